"""Write a seeded random checkpoint in the Kimi K3 release layout.

    k3-checkpoint --preset tiny --out ckpt/tiny --seed 0
    k3-checkpoint --config path/to/config.json --out ckpt/x --max-shard-mb 512

Experts are drawn directly on the MXFP4 grid; the other tensors are normal with per-tensor scales that
give the tiny model non-degenerate next-token distributions (inference/model/checkpoint.py, random_tensor).
Prints the manifest fingerprint; the same config, seed and shard size always give the same one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inference.model.checkpoint import CheckpointError, make_random_checkpoint
from inference.model.config import ConfigError, ModelConfig

FULL_SIZE_FLAG = "--i-have-1.6TB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "tiny_grouped", "tiny_kimi_linear", "kimi_k3", "kimi_k3_scaled"])
    source.add_argument("--config", type=Path, help="an HF-style config.json (or a directory holding one)")
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-mb", type=float, default=5 * 1024, help="largest shard size in MiB")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(FULL_SIZE_FLAG, dest="full_size_ok", action="store_true",
                        help="allow configs whose checkpoint exceeds 100 GB (the full K3 is 1.56 TB)")
    args = parser.parse_args(argv)

    try:
        config = ModelConfig.preset(args.preset) if args.preset else ModelConfig.from_file(args.config)
    except ConfigError as exc:
        parser.error(str(exc))
    size = config.checkpoint_bytes()
    print(f"{config.model_id}: {config.num_parameters():,} parameters, {size:,} bytes ({size / 1e12:.3f} TB)")
    if size > 100e9 and not args.full_size_ok:
        print(f"refusing to write {size / 1e12:.2f} TB of random weights; pass {FULL_SIZE_FLAG} if you mean it",
              file=sys.stderr)
        return 2
    try:
        manifest = make_random_checkpoint(
            config,
            args.out,
            seed=args.seed,
            max_shard_bytes=int(args.max_shard_mb * 2**20),
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {manifest['num_shards']} shards, {manifest['total_bytes']:,} bytes to {args.out}")
    print(f"fingerprint {manifest['fingerprint']}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
