"""The released weights: download them (all, or only one block of layers), turn them into what the engine and the
stage miners load, and verify them tensor by tensor (`k3-checkpoint download|convert|verify`; docs/model.md).

A release on the Hugging Face Hub is a directory in the Hugging Face layout: `config.json`,
`model.safetensors.index.json` (tensor name -> shard file), the safetensors shards, and the tokenizer files
(`tiktoken.model`, `tokenizer_config.json`). The project adds `k3_manifest.json`: the sha256 of every shard and of
every tensor's bytes and the fingerprint miners report (inference/model/checkpoint.py).

- `download`: the metadata first, then the shards; with a block of layers (`layers`), only the shards that hold its
  tensors (the index says which). The Hub's own sha256 of every shard (its LFS metadata) is written to
  `SHA256SUMS`, for all shards, downloaded or not, so that a block-only download still knows the whole release's
  fingerprint.
- `convert`: checks that the release is the Kimi K3 layout (names, shapes and dtypes against the config), hashes
  the shards present in one pass per file (file and tensor sha256 together), checks them against `SHA256SUMS`, and
  writes `k3_manifest.json`; with `out`, a directory the engine loads (hard links to the shards, or copies), a
  block-only one for a stage miner (`layers`), or the metadata alone for a miner in front of vLLM/SGLang.
- `verify`: every tensor (or every tensor of a block) against the manifest's sha256, naming the tensor and the shard
  that differ, with a progress bar; only the files holding the selected tensors are read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from inference.model.checkpoint import (CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, MANIFEST_FORMAT, CheckpointError,
                                        TensorSelection, _fingerprint_of, _header_specs, expected_tensors,
                                        is_text_tensor, model_key, read_config, read_manifest, read_weight_map)
from inference.model.config import ModelConfig
from inference.model.manifest import TOKENIZER_FILES, make_manifest, read_sha256_list
from inference.model.progress import byte_progress

SHA256_FILE = "SHA256SUMS"
GENERATION_CONFIG_FILE = "generation_config.json"
# What every download takes, whatever the block: the files that describe the model (and its manifest when the
# release publishes one).
METADATA_PATTERNS = (CONFIG_FILE, INDEX_FILE, GENERATION_CONFIG_FILE, MANIFEST_FILE, SHA256_FILE, *TOKENIZER_FILES)
READ_CHUNK = 16 * 2**20


# ---------------------------------------------------------------- blocks of layers
@dataclass(frozen=True)
class Block:
    """Layers [start, stop) of a model with `num_layers` layers; the first block also holds the embedding and the
    last the head (what a stage miner of that block loads: `TensorSelection.stage`)."""

    start: int
    stop: int
    num_layers: int

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "Block":
        """'A-B' (inclusive, as the stage miner's --serve-layers) or 'A'."""
        parts = text.strip().split("-")
        try:
            first, last = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (None, None)
        except ValueError:
            first = last = None
        if first is None or not 0 <= first <= last < num_layers:
            raise CheckpointError(f"layers {text!r} is not A-B with 0 <= A <= B < {num_layers} (inclusive layer "
                                  "numbers, as --serve-layers takes them)")
        return cls(first, last + 1, num_layers)

    @property
    def selection(self) -> TensorSelection:
        return TensorSelection.stage(self.start, self.stop, embedding=self.start == 0, head=self.stop == self.num_layers)

    def __str__(self) -> str:
        return f"{self.start}-{self.stop - 1}"


def selected_tensors(weight_map: Mapping[str, str], block: Block | None) -> dict[str, str]:
    """Tensor name -> shard file of the text tensors a block holds (every text tensor without a block)."""
    selection = block.selection if block is not None else None
    return {name: fname for name, fname in weight_map.items()
            if is_text_tensor(name) and (selection is None or selection.holds(model_key(name)))}


def block_files(weight_map: Mapping[str, str], block: Block | None) -> list[str]:
    """The shard files a block's tensors are in (every shard file without a block)."""
    if block is None:
        return sorted(set(weight_map.values()))
    return sorted(set(selected_tensors(weight_map, block).values()))


def download_patterns(weight_map: Mapping[str, str] | None, block: Block | None) -> list[str]:
    """`allow_patterns` for huggingface_hub: the metadata alone (weight_map None: the index is not read yet), or the
    metadata and the shard files of the block (of every layer without a block). Shard names are matched exactly:
    `model-00003-of-00064.safetensors`, never a wildcard that would take a neighbour's shard."""
    patterns = list(METADATA_PATTERNS)
    if weight_map is not None:
        patterns += block_files(weight_map, block)
    return patterns


# ---------------------------------------------------------------- download
Fetch = Callable[[list[str]], Path]  # allow_patterns -> the directory the matching files are in


def hub_fetch(repo_id: str, out: str | Path, revision: str | None = None, token: str | None = None) -> Fetch:
    """A Fetch through huggingface_hub (its own progress bars; files already there and unchanged are kept)."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (only a download needs the Hub client)

    def fetch(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, local_dir=str(out), allow_patterns=patterns,
                                      token=token))

    return fetch


def hub_sha256(repo_id: str, revision: str | None = None, token: str | None = None) -> dict[str, str]:
    """{shard file: sha256} from the Hub's metadata of the release (its LFS objects' sha256), for every shard."""
    from huggingface_hub import HfApi  # noqa: PLC0415

    info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, token=token, timeout=60)
    return {s.rfilename: s.lfs.sha256 for s in info.siblings or ()
            if s.rfilename.endswith(".safetensors") and s.lfs is not None and s.lfs.sha256}


def download(fetch: Fetch, out: str | Path, layers: str | None = None,
             published_sha256: Callable[[], Mapping[str, str]] | None = None,
             say: Callable[[str], None] = print) -> list[str]:
    """Download a release into `out`: the metadata, then the shards (of the block `layers` only, when given).
    `published_sha256` gives the release's shard hashes (the Hub's metadata), written to SHA256SUMS. Returns the
    shard files downloaded."""
    out = Path(out)
    say(f"[1/3] metadata (config, index, tokenizer) into {out}")
    fetch(download_patterns(None, None))
    if not (out / CONFIG_FILE).exists() or not (out / INDEX_FILE).exists():
        raise CheckpointError(f"the release has no {CONFIG_FILE} and {INDEX_FILE}: is it a Kimi K3 release in the "
                              "Hugging Face layout?")
    config = read_config(out)
    weight_map = read_weight_map(out)
    block = Block.parse(layers, config.num_layers) if layers else None
    files = block_files(weight_map, block)
    total = len(set(weight_map.values()))
    say(f"[2/3] {len(files)} of {total} shard files" + (f" (the tensors of layers {block})" if block else ""))
    fetch(download_patterns(weight_map, block))
    missing = [f for f in files if not (out / f).exists()]
    if missing:
        raise CheckpointError(f"shard {missing[0]} (and {len(missing) - 1} more) did not arrive in {out}")
    if published_sha256 is not None:
        sums = dict(published_sha256())
        if sums:
            (out / SHA256_FILE).write_text("".join(f"{sums[f]}  {f}\n" for f in sorted(sums)))
            say(f"[3/3] {SHA256_FILE}: the release's sha256 of its {len(sums)} shard files")
        else:
            say(f"[3/3] the release publishes no sha256 of its shards: {SHA256_FILE} not written")
    return files


# ---------------------------------------------------------------- hashing in one pass
def safetensors_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(where the tensor data starts, {tensor name: (begin, end) byte offsets inside the data}) from a shard's
    header (the safetensors format: an 8-byte little-endian header size, then the JSON header)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than its header size)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    spans = {name: tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"}
    return 8 + size, spans


def hash_shard(path: Path, names: Iterable[str] | None = None, whole_file: bool = True,
               advance: Callable[[int], None] = lambda n: None) -> tuple[str | None, dict[str, str]]:
    """(sha256 of the file, {tensor name: sha256 of its bytes}) in one read of the file; `names` limits the tensors
    (default: every one). The bytes of a tensor as stored are the bytes `checkpoint.tensor_sha256` hashes. Without
    `whole_file` only the tensors' bytes are read (no file hash)."""
    start, spans = safetensors_layout(path)
    wanted = sorted((spans[n] + (n,) for n in (spans if names is None else names)), key=lambda s: s[0])
    hashers = {name: hashlib.sha256() for _, _, name in wanted}
    file_hash = hashlib.sha256() if whole_file else None
    with open(path, "rb") as f:
        if file_hash is not None:
            file_hash.update(f.read(start))
            advance(start)
            pieces = [(0, os.path.getsize(path) - start)]
        else:
            pieces = [(b, e) for b, e, _ in wanted]
        first = 0  # wanted[first:] are the tensors not yet wholly read (they are sorted by where they begin)
        for begin, end in _merged(pieces):
            f.seek(start + begin)
            at = begin
            while at < end:
                chunk = f.read(min(READ_CHUNK, end - at))
                if not chunk:
                    raise CheckpointError(f"{path} ends at byte {start + at}: its header promises {start + end}")
                if file_hash is not None:
                    file_hash.update(chunk)
                while first < len(wanted) and wanted[first][1] <= at:
                    first += 1
                k = first
                while k < len(wanted) and wanted[k][0] < at + len(chunk):  # the tensors this chunk overlaps
                    b, e, name = wanted[k]
                    lo, hi = max(b, at), min(e, at + len(chunk))
                    if lo < hi:
                        hashers[name].update(chunk[lo - at:hi - at])
                    k += 1
                at += len(chunk)
                advance(len(chunk))
    return (file_hash.hexdigest() if file_hash else None), {name: h.hexdigest() for name, h in hashers.items()}


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in sorted(spans):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


# ---------------------------------------------------------------- verify
@dataclass
class Verified:
    files: list[str]
    tensors: int
    bytes: int
    fingerprint: str
    block: str = ""
    notes: list[str] = field(default_factory=list)


def verify(ckpt_dir: str | Path, layers: str | None = None, manifest_file: str | Path | None = None,
           progress: bool = True) -> Verified:
    """Check every tensor (of the block `layers`, when given) against the manifest's per-tensor sha256, reading only
    the shard files that hold them; CheckpointError naming the first tensor and shard that differ, or the file
    missing. Without a block, each whole file is also checked against its sha256 (header included)."""
    ckpt_dir = Path(ckpt_dir)
    manifest = json.loads(Path(manifest_file).read_text()) if manifest_file else read_manifest(ckpt_dir)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{manifest_file or ckpt_dir / MANIFEST_FILE} is not a {MANIFEST_FORMAT} manifest")
    tensor_sha = manifest.get("tensors") or {}
    if not tensor_sha:
        raise CheckpointError("the manifest has no per-tensor sha256: make it with `k3-checkpoint convert "
                              f"{ckpt_dir}`")
    config = read_config(ckpt_dir)
    if config.config_hash() != manifest["config_hash"]:
        raise CheckpointError(f"{CONFIG_FILE} is not the config the manifest was made for (its hash differs)")
    block = Block.parse(layers, config.num_layers) if layers else None
    wanted = selected_tensors(read_weight_map(ckpt_dir), block)
    by_file: dict[str, list[str]] = {}
    for name, fname in wanted.items():
        by_file.setdefault(fname, []).append(name)
    for fname in sorted(by_file):
        if not (ckpt_dir / fname).exists():
            raise CheckpointError(f"shard {fname} is missing from {ckpt_dir}" + (
                f" (it holds tensors of layers {block}: k3-checkpoint download --layers {block})" if block else ""))
    total = sum((ckpt_dir / f).stat().st_size for f in by_file) if block is None else \
        sum(_span_bytes(ckpt_dir / f, names) for f, names in by_file.items())
    count = 0
    with byte_progress(f"verifying {'layers ' + str(block) if block else 'every tensor'}", total, progress) as advance:
        for fname in sorted(by_file):
            file_sha, hashes = hash_shard(ckpt_dir / fname, by_file[fname], whole_file=block is None, advance=advance)
            for name in sorted(by_file[fname]):
                want = tensor_sha.get(name)
                if want is None:
                    raise CheckpointError(f"tensor {name} (in shard {fname}) has no sha256 in the manifest")
                if hashes[name] != want:
                    raise CheckpointError(f"tensor {name} in shard {fname} does not match its sha256 in the manifest: "
                                          "the file was altered or corrupted; download that shard again")
                count += 1
            listed = manifest["shards"].get(fname, {}).get("sha256")
            if file_sha is not None and listed and file_sha != listed:
                raise CheckpointError(f"shard {fname}: every tensor matches but the file's sha256 differs from the "
                                      "manifest (its header was altered); download that shard again")
    fp = _fingerprint_of((s["sha256"] for s in manifest["shards"].values()), manifest["config_hash"])
    if manifest.get("fingerprint") not in (None, fp):
        raise CheckpointError(f"{MANIFEST_FILE}: the recorded fingerprint does not follow from its shard hashes")
    return Verified(sorted(by_file), count, total, fp, str(block) if block else "")


def _span_bytes(path: Path, names: list[str]) -> int:
    _, spans = safetensors_layout(path)
    return sum(spans[n][1] - spans[n][0] for n in names)


# ---------------------------------------------------------------- convert
def check_layout(release: Path, config: ModelConfig, files: Iterable[str]) -> None:
    """The release holds exactly the Kimi K3 text tensors of its config (names from the index; shapes and dtypes
    from the headers of the shard `files` present)."""
    weight_map = read_weight_map(release)
    specs = expected_tensors(config)
    text = {n for n in weight_map if is_text_tensor(n)}
    missing = [n for n in specs if n not in text]
    if missing:
        raise CheckpointError(f"the index has no tensor {missing[0]} ({len(missing)} of the {len(specs)} tensors of "
                              f"this config are missing): not a Kimi K3 release of this config")
    extra = sorted(text - set(specs))
    if extra:
        raise CheckpointError(f"the index names {extra[0]} ({len(extra)} tensors) that Kimi K3 of this config lacks")
    present = set(files)
    header = _header_specs(release, {n: f for n, f in weight_map.items() if f in present and n in specs})
    for name, (shape, dtype) in header.items():
        spec = specs[name]
        if name.endswith(".A_log"):
            continue  # the release may pad or reshape A_log; the loader takes its first values
        if shape != spec.shape or dtype != spec.dtype:
            raise CheckpointError(f"tensor {name} in shard {weight_map[name]} is {list(shape)} {dtype}; Kimi K3 "
                                  f"needs {list(spec.shape)} {spec.dtype}")


def convert(release: str | Path, out: str | Path | None = None, layers: str | None = None, meta_only: bool = False,
            sha256_list: str | Path | None = None, progress: bool = True,
            say: Callable[[str], None] = print) -> dict:
    """Write `k3_manifest.json` for a downloaded release (in place, or with what to load into `out`); returns it.

    The shards present are hashed (file and tensors in one pass) and checked against the release's sha256 list
    (`sha256_list`, else SHA256SUMS in the release when present); a shard absent (a block-only download) takes
    its hash from that list, so the fingerprint is the whole release's. `layers` with `out`: only the block's
    shard files go to `out` (a stage miner's checkpoint). `meta_only`: config, tokenizer and manifest only (a
    miner in front of vLLM or SGLang)."""
    release = Path(release)
    sha256_list = sha256_list or (release / SHA256_FILE if (release / SHA256_FILE).exists() else None)
    if meta_only:
        if out is None:
            raise CheckpointError("--meta-only writes the metadata checkpoint into --out DIR")
        manifest = make_manifest(release, sha256_list, out, progress=progress)
        say(f"wrote the metadata checkpoint (config, tokenizer, manifest; no weights) to {out}")
        return manifest
    config = read_config(release)
    weight_map = read_weight_map(release)
    all_files = sorted(set(weight_map.values()))
    present = [f for f in all_files if (release / f).exists()]
    block = Block.parse(layers, config.num_layers) if layers else None
    needed = block_files(weight_map, block) if block else present
    missing = [f for f in needed if f not in present] if block else []
    if missing:
        raise CheckpointError(f"shard {missing[0]} holds tensors of layers {block} but is not in {release}: "
                              f"k3-checkpoint download --layers {block}")
    if not present:
        raise CheckpointError(f"{release} holds none of its shard files: download them first (k3-checkpoint "
                              "download), or write the metadata checkpoint with --meta-only")
    check_layout(release, config, present)
    published = read_sha256_list(sha256_list) if sha256_list else {}
    absent = [f for f in all_files if f not in present and f not in published]
    if absent:
        raise CheckpointError(f"shard {absent[0]} (and {len(absent) - 1} more) is neither here nor in a sha256 list: "
                              f"the fingerprint needs every shard's hash; give the release's list ({SHA256_FILE}, "
                              "written by k3-checkpoint download) with --sha256")
    shards, tensors = {}, {}
    with byte_progress("hashing shards and tensors", sum((release / f).stat().st_size for f in present),
                       progress) as advance:
        for fname in present:
            file_sha, hashes = hash_shard(release / fname, advance=advance)
            if fname in published and published[fname] != file_sha:
                raise CheckpointError(f"shard {fname}: its sha256 differs from the release's list: download it again")
            shards[fname] = {"sha256": file_sha, "bytes": (release / fname).stat().st_size}
            tensors.update(hashes)
    for fname in all_files:
        if fname not in shards:
            shards[fname] = {"sha256": published[fname], "bytes": None}
    config_hash = config.config_hash()
    index = json.loads((release / INDEX_FILE).read_text())
    manifest = {
        "format": MANIFEST_FORMAT, "model_id": config.model_id, "config_hash": config_hash,
        "num_shards": len(shards), "total_bytes": None if len(present) < len(all_files) else
        sum(s["bytes"] for s in shards.values()),
        "tensor_bytes": index.get("metadata", {}).get("total_size"),
        "weights_present": len(present) == len(all_files),
        "shards": dict(sorted(shards.items())), "tensors": dict(sorted(tensors.items())),
        "fingerprint": _fingerprint_of((s["sha256"] for s in shards.values()), config_hash),
    }
    target = Path(out) if out else release
    target.mkdir(parents=True, exist_ok=True)
    if target.resolve() != release.resolve():
        for name in METADATA_PATTERNS:
            if name != MANIFEST_FILE and (release / name).exists():
                shutil.copyfile(release / name, target / name)
        for fname in needed:
            _link_or_copy(release / fname, target / fname)
        say(f"{'linked' if _same_device(release, target) else 'copied'} {len(needed)} shard files to {target}"
            + (f" (layers {block})" if block else ""))
    (target / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    say(f"wrote {target / MANIFEST_FILE}: {len(shards)} shards ({len(present)} here), {len(tensors)} tensor hashes, "
        f"fingerprint {manifest['fingerprint']}")
    return manifest


def _same_device(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)  # no second copy of hundreds of GB on the same disk
    except OSError:
        shutil.copyfile(src, dst)


__all__ = ["Block", "SHA256_FILE", "METADATA_PATTERNS", "selected_tensors", "block_files", "download_patterns",
           "hub_fetch", "hub_sha256", "download", "safetensors_layout", "hash_shard", "verify", "Verified",
           "check_layout", "convert"]
