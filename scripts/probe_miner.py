#!/usr/bin/env python3
"""Run a bounded set of hostile-client attacks against your own miner and print what passed (neurons/probe.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.probe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
