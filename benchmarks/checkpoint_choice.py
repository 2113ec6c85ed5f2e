"""The tiny checkpoint a benchmark runs on (not a benchmark itself): `--checkpoint trained` (the default: the tiny K3 trained on real
text, inference/model/assets/tiny_trained), `random` (the tiny model with random weights, seed 0, made in a
temporary directory) or a checkpoint directory.

    add_checkpoint_argument(parser)
    ckpt = resolve_checkpoint(args.checkpoint, workdir)   # a directory holding config.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

from inference.model.checkpoint import make_random_checkpoint
from inference.model.config import ModelConfig

TRAINED_TINY = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"
CHOICES = ("trained", "random")


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default="trained", metavar="trained|random|DIR",
                        help="trained (default): the tiny K3 trained on real text (inference/model/assets/"
                             "tiny_trained); random: the tiny model with random weights, seed 0; or a checkpoint "
                             "directory")


def resolve_checkpoint(choice: str, workdir: Path) -> Path:
    """The checkpoint directory for a --checkpoint value; `random` is written under workdir."""
    if choice == "random":
        ckpt = Path(workdir) / "tiny-random"
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
        return ckpt
    ckpt = TRAINED_TINY if choice == "trained" else Path(choice)
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"error: --checkpoint {choice}: no checkpoint at {ckpt} (no config.json); "
                         "use --checkpoint random or make one with scripts/train_tiny.py")
    return ckpt
