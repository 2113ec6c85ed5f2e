#!/usr/bin/env python3
"""The miner with an engine that cheats (neurons/miner_app/cheats.py), for tests and the local testnet."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.miner_app.cheats import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
