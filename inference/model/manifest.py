"""The metadata checkpoint: what a miner in front of vLLM or SGLang needs of a release, weights optional.

    python -m inference manifest RELEASE_DIR [--sha256 SHA256SUMS] [--out DIR]

A remote-engine miner reads the served model's `config.json` (vocabulary, eos), its tokenizer
files and `k3_manifest.json` (the fingerprint validators check). The fingerprint is the same one
a full checkpoint has (sha256 over the shard hashes and the config hash), so every miner of one
release reports the same value whether its weights sit on this machine or on GPU hosts elsewhere.

Shard hashes come from the shard files when they are present (hashed with a progress bar), else
from the release's published sha256 list (`sha256sum` format: `HEX  FILENAME` per line); a shard
named by `model.safetensors.index.json` with neither is an error, because a guessed fingerprint
would not match other miners'. With `--out`, the metadata files are copied into DIR and the
manifest written there (the weights are not copied).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from inference.model.checkpoint import (CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, MANIFEST_FORMAT, CheckpointError,
                                        _fingerprint_of)
from inference.model.config import ConfigError, ModelConfig

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")
METADATA_FILES = (CONFIG_FILE, INDEX_FILE, "generation_config.json", *TOKENIZER_FILES)
_SHA256_LINE = re.compile(r"^([0-9a-fA-F]{64})\s+\*?(.+?)\s*$")


def config_hash_of(config_path: Path) -> str:
    """The config hash: Kimi K3's own (`ModelConfig.config_hash`, as full checkpoints have it) when the
    file is a K3 config, else sha256 of the file's JSON in canonical form (sorted keys, no spaces)."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path} cannot be read as JSON: {exc}") from None
    try:
        return ModelConfig.from_file(config_path).config_hash()
    except (ConfigError, KeyError, TypeError, ValueError):
        canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def read_sha256_list(path: str | Path) -> dict[str, str]:
    """`sha256sum` output -> {file name: hex digest}; names are taken without directories."""
    out = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SHA256_LINE.match(line.strip())
        if not m:
            raise CheckpointError(f"{path}:{lineno} is not 'SHA256  FILENAME': {line[:80]!r}")
        out[Path(m.group(2)).name] = m.group(1).lower()
    return out


def _sha256_with_progress(path: Path, bar: tqdm) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _weight_files(release: Path) -> list[str]:
    index = release / INDEX_FILE
    if index.exists():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc}") from None
    shards = sorted(p.name for p in release.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{release} has no {INDEX_FILE} and no .safetensors files: the manifest needs the "
                              "index (or the weights) to know the shards")
    return shards


def make_manifest(release: str | Path, sha256_list: str | Path | None = None, out: str | Path | None = None,
                  progress: bool = False) -> dict:
    """Write `k3_manifest.json` for a release directory (into `out` with the metadata files, if given)."""
    release = Path(release)
    if not (release / CONFIG_FILE).exists():
        raise CheckpointError(f"{release} has no {CONFIG_FILE}")
    published = read_sha256_list(sha256_list) if sha256_list else {}
    files = _weight_files(release)
    present = [f for f in files if (release / f).exists()]
    missing = [f for f in files if f not in present and f not in published]
    if missing:
        raise CheckpointError(f"shard {missing[0]} (and {len(missing) - 1} more) is neither in {release} nor in "
                              "the sha256 list: give the release's sha256 list with --sha256, or the weights")
    shards = {}
    total = sum((release / f).stat().st_size for f in present)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing weights", file=sys.stderr,
              disable=not progress or not present) as bar:
        for fname in files:
            if fname in present:
                digest = _sha256_with_progress(release / fname, bar)
                if fname in published and published[fname] != digest:
                    raise CheckpointError(f"shard {fname}: its sha256 differs from the published list")
                shards[fname] = {"sha256": digest, "bytes": (release / fname).stat().st_size}
            else:
                shards[fname] = {"sha256": published[fname], "bytes": None}
    config_hash = config_hash_of(release / CONFIG_FILE)
    tokenizer_files = {name: hashlib.sha256((release / name).read_bytes()).hexdigest()
                       for name in TOKENIZER_FILES if (release / name).exists()}
    if not tokenizer_files:
        raise CheckpointError(f"{release} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])})")
    model_id = json.loads((release / CONFIG_FILE).read_text()).get("model_type", "unknown")
    sizes = [s["bytes"] for s in shards.values()]
    manifest = {
        "format": MANIFEST_FORMAT,
        "model_id": model_id,
        "config_hash": config_hash,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_shards": len(shards),
        "total_bytes": None if None in sizes else sum(sizes),
        "tensor_bytes": _index_total_size(release),
        "weights_present": len(present) == len(files),
        "shards": shards,
        "tokenizer_files": tokenizer_files,
        "fingerprint": _fingerprint_of((s["sha256"] for s in shards.values()), config_hash),
    }
    target = Path(out) if out else release
    target.mkdir(parents=True, exist_ok=True)
    if target.resolve() != release.resolve():
        for name in METADATA_FILES:
            if (release / name).exists():
                shutil.copyfile(release / name, target / name)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def _index_total_size(release: Path) -> int | None:
    index = release / INDEX_FILE
    if not index.exists():
        return None
    return json.loads(index.read_text()).get("metadata", {}).get("total_size")
