#!/usr/bin/env python3
"""The audit statistics of an fp8-dense miner beside the fp32 and bf16 ones (scoring.envelope_fp8); prints the
envelope tables (statistics per variant, failure rates of the rules).

    python benchmarks/fp8_envelope.py --checkpoint inference/model/assets/tiny_trained [--audits 48]
"""
import argparse
import sys
import time
from pathlib import Path

from scoring.envelope import format_report
from scoring.envelope_fp8 import FP8_VARIANT, measure_with_fp8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--audits", type=int, default=48, help="audits per variant")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--variants", default=f"fp32-batched,bf16,{FP8_VARIANT}")
    args = ap.parse_args()
    started = time.perf_counter()
    report = measure_with_fp8(args.checkpoint, only=args.variants.split(","), audits_per_variant=args.audits,
                              max_tokens=args.max_tokens, sharded=False,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(report))
    print(f"\n{sum(len(r.answers) for r in report.results)} audits in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
