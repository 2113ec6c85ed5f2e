"""Each stage cheater in turn on the local swarm: challenges and seconds until blame, the validator's CPU per stage
challenge (neurons/swarm/cheater_bench.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neurons.swarm.cheater_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
