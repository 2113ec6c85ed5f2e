#!/usr/bin/env python3
"""The standardized endpoint benchmark (neurons/benchmark.py): see its docstring for the flags."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
