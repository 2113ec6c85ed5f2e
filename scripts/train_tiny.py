"""Train the tiny Kimi K3 on the Python standard library's sources and write it in the release layout.

    python scripts/train_tiny.py --out inference/model/assets/tiny_trained --overwrite
    python scripts/train_tiny.py --out /tmp/t --steps 3 --batch-size 2    # a quick run

Deterministic for a seed and a thread count (inference/model/training.py). Prints the loss as it goes and,
at the end, held-out bits per byte of the trained model against a byte-unigram baseline; the same numbers
land in <out>/training_info.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from inference.model.training import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if field.name == "kda_decay_init":
            parser.add_argument(flag, type=lambda s: tuple(float(x) for x in s.split(",")), default=default,
                                help="SLOWEST,FASTEST per-token KDA decay (nats) to start from "
                                     f"(default {default})")
        elif isinstance(default, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=default,
                                help=f"true/false (default {default})")
        else:
            parser.add_argument(flag, type=type(default) if default is not None else str, default=default,
                                help=f"default {default}")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        print(f"error: {args.out} is not empty; pass --overwrite to replace it", file=sys.stderr)
        return 1
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    info = train(tc, args.out)
    print(json.dumps(info["heldout_bits_per_byte"], indent=1))
    print(f"wall {info['wall_seconds']} s, fingerprint {info['fingerprint']}, written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
