"""k3-checkpoint: the model's weights, from the release or made up.

    k3-checkpoint download moonshotai/Kimi-K3 --out /data/kimi-k3                 # the whole release (1.56 TB)
    k3-checkpoint download moonshotai/Kimi-K3 --out /data/k3-24-35 --layers 24-35  # only one block's shards
    k3-checkpoint convert /data/kimi-k3                                           # k3_manifest.json: what the engine loads
    k3-checkpoint convert /data/k3-24-35 --layers 24-35                           # a stage miner's checkpoint
    k3-checkpoint convert /data/kimi-k3 --meta-only --out ckpt/k3-meta            # config, tokenizer, manifest only
    k3-checkpoint verify /data/kimi-k3 [--layers 24-35]                           # every tensor against the manifest
    k3-checkpoint make --preset tiny --out ckpt/tiny --seed 0                     # a seeded random checkpoint
    k3-checkpoint --preset tiny --out ckpt/tiny --seed 0                          # the same (make is the default)

`make` writes a seeded random checkpoint in the release layout: experts drawn directly on the MXFP4 grid, the
other tensors normal with per-tensor scales that give the tiny model non-degenerate next-token distributions
(inference/model/checkpoint.py, random_tensor); the same config, seed and shard size always give the same
fingerprint. `download`, `convert` and `verify` are inference/model/release.py (docs/model.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inference.model.checkpoint import CheckpointError, make_random_checkpoint
from inference.model.config import ConfigError, ModelConfig
from inference.model.release import convert, download, hub_fetch, hub_sha256, verify

FULL_SIZE_FLAG = "--i-have-1.6TB"
COMMANDS = ("make", "download", "convert", "verify")


def make_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3-checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{make,download,convert,verify}")
    make_parser(commands.add_parser("make", help="write a seeded random checkpoint (the default command)"))
    down = commands.add_parser("download", help="download the release from the Hugging Face Hub (all, or one block)")
    down.add_argument("repo", help="the release's Hub repository, e.g. moonshotai/Kimi-K3")
    down.add_argument("--out", type=Path, required=True, help="directory to download into")
    down.add_argument("--revision", help="a branch, tag or commit of the repository (default: main)")
    down.add_argument("--layers", metavar="A-B", help="only the shards holding these layers (a stage miner's block, "
                      "as its --serve-layers; the first block also takes the embedding, the last the head)")
    down.add_argument("--token", help="a Hub token for gated repositories (default: HF_TOKEN or the saved login)")
    conv = commands.add_parser("convert", help="write k3_manifest.json and what the engine or a stage miner loads")
    conv.add_argument("release", type=Path, help="a downloaded release (Hugging Face layout)")
    conv.add_argument("--out", type=Path, help="write a checkpoint directory there (shards hard-linked, or copied); "
                      "default: the manifest goes into the release directory")
    conv.add_argument("--layers", metavar="A-B", help="with --out: only this block's shard files (a stage miner's "
                      "checkpoint); the fingerprint stays the release's")
    conv.add_argument("--meta-only", action="store_true", help="config, tokenizer and manifest only, no weights (a "
                      "miner in front of vLLM or SGLang)")
    conv.add_argument("--sha256", type=Path, metavar="FILE", help="the release's sha256 list (default: SHA256SUMS in "
                      "the release, written by download)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    ver = commands.add_parser("verify", help="check every tensor (or one block's) against the manifest's sha256")
    ver.add_argument("checkpoint", type=Path)
    ver.add_argument("--layers", metavar="A-B", help="only this block's tensors (reads only its shard files)")
    ver.add_argument("--manifest", type=Path, metavar="FILE", help="a manifest file (default: the checkpoint's "
                     "k3_manifest.json)")
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run_make(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
    manifest = make_random_checkpoint(config, args.out, seed=args.seed, max_shard_bytes=int(args.max_shard_mb * 2**20),
                                      overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {manifest['num_shards']} shards, {manifest['total_bytes']:,} bytes to {args.out}")
    print(f"fingerprint {manifest['fingerprint']}")
    return 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "make":
        return run_make(args, parser)
    if args.command == "download":
        files = download(hub_fetch(args.repo, args.out, args.revision, args.token), args.out, args.layers,
                         lambda: hub_sha256(args.repo, args.revision, args.token))
        print(f"downloaded {len(files)} shard files into {args.out}; next: k3-checkpoint convert {args.out}"
              + (f" --layers {args.layers}" if args.layers else ""))
        return 0
    if args.command == "convert":
        convert(args.release, args.out, args.layers, args.meta_only, args.sha256, progress=not args.quiet)
        return 0
    done = verify(args.checkpoint, args.layers, args.manifest, progress=not args.quiet)
    print(f"verified {done.tensors} tensors ({done.bytes:,} bytes) in {len(done.files)} shard files"
          + (f" of layers {done.block}" if done.block else "") + f": they match the manifest; fingerprint "
          f"{done.fingerprint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "make")  # `k3-checkpoint --preset tiny ...`, as before the subcommands
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return run(args, parser)
    except (CheckpointError, OSError, ValueError) as exc:  # the Hub's errors are OSError (HTTP) or ValueError (names)
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
