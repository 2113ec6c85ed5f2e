#!/usr/bin/env python3
"""Thin wrapper over neurons.localnet (the `k3-localnet` console script): see its docstring for the flags."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.localnet import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="scripts/localnet.sh"))
