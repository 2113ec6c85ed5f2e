"""Single-stream tokens/s and TTFT of a 4-stage swarm vs the single-process model, on loopback and with
emulated link delays (see neurons/swarm/bench.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.swarm.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
