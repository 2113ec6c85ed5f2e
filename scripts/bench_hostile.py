#!/usr/bin/env python3
"""A miner under hostile clients: memory, deadlines, legitimate latency, scheduler recovery (neurons/hostile_bench.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.hostile_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
