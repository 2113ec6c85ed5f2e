#!/usr/bin/env python3
"""Thin wrapper over inference.planning.plan_cluster (see its docstring for the flags)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.planning.plan_cluster import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
