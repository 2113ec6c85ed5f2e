#!/usr/bin/env python3
"""Speculative decoding benchmark: accepted tokens per verify step, single-stream speed-up on code-like,
repetitive and novel prompts, and the cost of the KDA rollback modes (inference/speculative/benchmark.py).

    python scripts/make_checkpoint.py --preset tiny --out ckpt/tiny
    python scripts/bench_speculative.py --checkpoint ckpt/tiny [--tokens 64] [--repeats 3] [--json OUT]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.speculative.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
