"""Checkpoints in the Kimi K3 release layout: the one place that knows tensor names (model.md section 7).

A checkpoint directory holds
- safetensors shards `model-00001-of-0000N.safetensors` and `model.safetensors.index.json` (weight_map),
- `config.json` (HF style, `ModelConfig.to_hf_config()`),
- `k3_manifest.json`: sha256 and size of every shard file, total bytes, the config hash, and the model
  fingerprint derived from them (what miners report and validators check).

Text tensors are named `language_model.<model state_dict key>`; `vision_tower.*` and `mm_projector.*`
belong to the release's multimodal wrapper and are skipped. Routed experts are MXFP4
(`weight_packed` / `weight_scale`, uint8); conv weights, A_log, dt_bias, o_norm and the router's
correction bias are fp32; everything else is bf16.

Public API: `expected_tensors`, `TensorSpec`, `tensor_site`, `TensorSelection`, `TensorPart`, `write_checkpoint`,
`state_dict_to_checkpoint_tensors`,
`write_manifest`, `verify_manifest`, `fingerprint`, `read_manifest`, `read_config`, `read_weight_map`,
`load_tensors`, `load_checkpoint`, `row_absmax`, `random_tensor`, `make_random_checkpoint`, `CheckpointError`.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.model import mxfp4
from inference.model.config import MXFP4_BLOCK, ConfigError, ModelConfig
from inference.model.progress import byte_progress
from inference.model.tokenizer import TOKENIZER_CONFIG_FILE, tokenizer_config_for

PREFIX = "language_model."
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "k3_manifest.json"
CONFIG_FILE = "config.json"
MANIFEST_FORMAT = "k3-manifest-v1"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or does not fit the model."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def num_parameters(name: str, spec: TensorSpec) -> int:
    """Parameters a tensor holds: packed MXFP4 bytes count two weights each, their scales none."""
    if name.endswith(PACKED_SUFFIX):
        return 2 * spec.numel
    if name.endswith(SCALE_SUFFIX):
        return 0
    return spec.numel


def is_text_tensor(name: str) -> bool:
    return not name.startswith(NON_TEXT_PREFIXES)


def model_key(name: str) -> str:
    """Checkpoint tensor name -> model state_dict key."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


# ------------------------------------------------------------------- names
EMBEDDING_KEY = "model.embed_tokens.weight"
HEAD_KEYS = ("model.norm.weight", "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
             "lm_head.weight")
LAYER_PREFIX = "model.layers."
EXPERTS_PART = ".block_sparse_moe.experts."


@dataclass(frozen=True)
class TensorSite:
    """Where a tensor belongs: the embedding, the head (final norm, output AttnRes, LM head), a layer's own
    tensors (attention, norms, router, latent projections, shared experts), or one routed expert of a layer."""

    kind: str  # "embedding" | "head" | "layer" | "expert"
    layer: int | None = None
    expert: int | None = None


def tensor_site(key: str) -> TensorSite:
    """The site of a model state_dict key (or a checkpoint name); CheckpointError for a name outside the layout."""
    key = model_key(key)
    if key == EMBEDDING_KEY:
        return TensorSite("embedding")
    if key in HEAD_KEYS:
        return TensorSite("head")
    if key.startswith(LAYER_PREFIX):
        layer, _, rest = key[len(LAYER_PREFIX):].partition(".")
        if layer.isdigit():
            if ("." + rest).startswith(EXPERTS_PART):
                expert = rest[len(EXPERTS_PART) - 1:].split(".", 1)[0]
                if expert.isdigit():
                    return TensorSite("expert", int(layer), int(expert))
            else:
                return TensorSite("layer", int(layer))
    raise CheckpointError(f"tensor {key} is outside the Kimi K3 layout (no embedding, head, layer or expert name)")


@dataclass(frozen=True)
class TensorPart:
    """The indices [start, stop) of dimension `dim` of a tensor (0: rows / output channels, 1: columns):
    what a rank of a dense split reads of a tensor it shares. An A_log part counts heads of the flattened
    tensor (the release may pad or reshape it)."""

    dim: int
    start: int
    stop: int

    def __post_init__(self):
        if self.dim not in (0, 1) or not 0 <= self.start < self.stop:
            raise ValueError(f"a tensor part is [start, stop) of dimension 0 or 1, got {self}")

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part's shape within a tensor of `shape`."""
        if len(shape) <= self.dim or shape[self.dim] < self.stop:
            raise CheckpointError(f"part [{self.start}, {self.stop}) of dimension {self.dim} lies outside shape "
                                  f"{list(shape)}")
        return shape[:self.dim] + (self.stop - self.start,) + shape[self.dim + 1:]


@dataclass(frozen=True)
class TensorSelection:
    """Which tensors a process holds; `load_checkpoint(..., select=...)` loads only those.

    layers: the layers whose own tensors are held (None: every layer). experts: per MoE layer, the routed
    experts held (None: every expert of the held layers; a shard of an expert-parallel plan may hold experts of
    layers it is not home to). embedding / head: whether the input embedding and the output head are held.
    keys: further tensors held by name (model keys), whatever their site (a dense split's shared tensors of a
    layer homed elsewhere). parts: model key -> the part of that tensor held; only that part is read.
    """

    layers: frozenset[int] | None = None
    experts: Mapping[int, frozenset[int]] | None = None
    embedding: bool = True
    head: bool = True
    keys: frozenset[str] = frozenset()
    parts: Mapping[str, TensorPart] = field(default_factory=dict)

    @classmethod
    def shard(cls, layers: Iterable[int], experts: Mapping[int, Iterable[int]], embedding: bool,
              head: bool, keys: Iterable[str] = (), parts: Mapping[str, TensorPart] | None = None) -> "TensorSelection":
        """A shard of a placement plan: its home layers, the experts placed on it, embedding and head flags, the
        tensors it shares of layers homed elsewhere and the parts it holds of split tensors."""
        return cls(frozenset(layers), {int(k): frozenset(v) for k, v in experts.items()}, embedding, head,
                   frozenset(keys), dict(parts or {}))

    @classmethod
    def stage(cls, first_layer: int, end_layer: int, embedding: bool, head: bool) -> "TensorSelection":
        """A pipeline stage: the contiguous layers [first_layer, end_layer) with all their experts."""
        if not 0 <= first_layer <= end_layer:
            raise ValueError(f"a stage covers layers [first, end) with 0 <= first <= end; got [{first_layer}, {end_layer})")
        return cls(frozenset(range(first_layer, end_layer)), None, embedding, head)

    def holds(self, key: str) -> bool:
        if key in self.keys:
            return True
        site = tensor_site(key)
        if site.kind == "embedding":
            return self.embedding
        if site.kind == "head":
            return self.head
        if site.kind == "expert" and self.experts is not None:
            return site.expert in self.experts.get(site.layer, ())
        return self.layers is None or site.layer in self.layers


EVERY_TENSOR = TensorSelection()


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every text tensor of a checkpoint for `config`, in layer order: full name -> shape and dtype."""
    c = config
    D, V = c.hidden_size, c.vocab_size
    bf16, fp32, u8 = torch.bfloat16, torch.float32, torch.uint8
    specs: dict[str, TensorSpec] = {}

    def add(name: str, shape, dtype=bf16):
        specs[PREFIX + name] = TensorSpec(tuple(int(s) for s in shape), dtype)

    add("model.embed_tokens.weight", (V, D))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for site in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(p + site + ".weight", (D,))
        add(p + "self_attention_res_proj.weight", (1, D))
        add(p + "mlp_res_proj.weight", (1, D))
        a = p + "self_attn."
        if c.is_mla(i):
            Hm, v = c.mla_heads, c.v_head_dim
            if c.q_lora_rank:
                add(a + "q_a_proj.weight", (c.q_lora_rank, D))
                add(a + "q_a_layernorm.weight", (c.q_lora_rank,))
                add(a + "q_b_proj.weight", (Hm * c.qk_head_dim, c.q_lora_rank))
            else:
                add(a + "q_proj.weight", (Hm * c.qk_head_dim, D))
            add(a + "kv_a_proj_with_mqa.weight", (c.mla_cache_width, D))
            add(a + "kv_a_layernorm.weight", (c.kv_lora_rank,))
            add(a + "kv_b_proj.weight", (Hm * (c.qk_nope_head_dim + v), c.kv_lora_rank))
            if c.mla_output_gate:
                add(a + "g_proj.weight", (Hm * v, D))
            add(a + "o_proj.weight", (D, Hm * v))
        else:
            H, d, P, K = c.kda_heads, c.kda_head_dim, c.kda_proj_size, c.conv_kernel_size
            for proj in ("q_proj", "k_proj", "v_proj"):
                add(a + proj + ".weight", (P, D))
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                add(a + conv + ".weight", (P, 1, K), fp32)
            add(a + "A_log", (c.a_log_size,), fp32)
            add(a + "f_a_proj.weight", (d, D))
            add(a + "f_b_proj.weight", (P, d))
            add(a + "dt_bias", (P,), fp32)
            add(a + "b_proj.weight", (H, D))
            if c.full_rank_output_gate:
                add(a + "g_proj.weight", (P, D))
            else:
                add(a + "g_a_proj.weight", (d, D))
                add(a + "g_b_proj.weight", (P, d))
            add(a + "o_norm.weight", (d,), fp32)
            add(a + "o_proj.weight", (D, P))
        if not c.is_moe(i):
            I = c.dense_intermediate_size
            add(p + "mlp.gate_proj.weight", (I, D))
            add(p + "mlp.up_proj.weight", (I, D))
            add(p + "mlp.down_proj.weight", (D, I))
            continue
        m = p + "block_sparse_moe."
        E, Lt, Ie, S = c.num_experts, c.latent_size, c.expert_intermediate_size, c.shared_expert_intermediate_size
        add(m + "gate.weight", (E, D))
        add(m + "gate.e_score_correction_bias", (E,), fp32)
        add(m + "routed_expert_down_proj.weight", (Lt, D))
        add(m + "routed_expert_up_proj.weight", (D, Lt))
        if c.latent_moe_norm:
            add(m + "routed_expert_norm.weight", (Lt,))
        if S:
            add(m + "shared_experts.gate_proj.weight", (S, D))
            add(m + "shared_experts.up_proj.weight", (S, D))
            add(m + "shared_experts.down_proj.weight", (D, S))
        # One spec object per expert tensor kind, shared by all experts (K3 has 494,592 of these names).
        per_expert = {}
        for w, (out_f, in_f) in (("w1", (Ie, Lt)), ("w2", (Lt, Ie)), ("w3", (Ie, Lt))):
            if c.mxfp4_experts:
                per_expert[w + PACKED_SUFFIX] = TensorSpec((out_f, in_f // 2), u8)
                per_expert[w + SCALE_SUFFIX] = TensorSpec((out_f, in_f // MXFP4_BLOCK), u8)
            else:
                per_expert[w + ".weight"] = TensorSpec((out_f, in_f))
        for e in range(E):
            for suffix, spec in per_expert.items():
                specs[f"{PREFIX}{m}experts.{e}.{suffix}"] = spec
    add("model.norm.weight", (D,))
    add("model.output_attn_res_norm.weight", (D,))
    add("model.output_attn_res_proj.weight", (1, D))
    add("lm_head.weight", (V, D))
    return specs


def state_dict_to_checkpoint_tensors(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A model state_dict -> checkpoint tensors: prefixed names, A_log padded, dtypes as released."""
    out = {}
    remaining = set(state_dict)
    for name, spec in expected_tensors(config).items():
        key = model_key(name)
        if key not in state_dict:
            raise CheckpointError(f"state_dict has no {key!r} (checkpoint tensor {name}, shape {list(spec.shape)})")
        remaining.discard(key)
        t = state_dict[key].detach().cpu()
        if name.endswith(".A_log") and t.numel() < spec.numel:
            t = torch.cat([t.reshape(-1).float(), t.new_zeros(spec.numel - t.numel(), dtype=torch.float32)])
        if spec.dtype == torch.uint8 and t.dtype != torch.uint8:
            raise CheckpointError(f"{key} must be uint8 (MXFP4), the state_dict holds {t.dtype}")
        if t.numel() != spec.numel:
            raise CheckpointError(f"{key}: state_dict shape {list(t.shape)} does not fit checkpoint shape {list(spec.shape)}")
        out[name] = t.reshape(spec.shape).to(spec.dtype).contiguous()
    if remaining:
        raise CheckpointError(f"state_dict has tensors the checkpoint layout does not know: {sorted(remaining)[:5]}")
    return out


# ------------------------------------------------------------------ writing
def _sha256_file(path: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


def _fingerprint_of(shard_hashes: Iterable[str], config_hash: str) -> str:
    blob = "\n".join(sorted(shard_hashes)) + "\nconfig:" + config_hash
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _plan_shards(names: list[str], nbytes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Fill shards in order up to max_shard_bytes; a tensor larger than that gets a shard of its own."""
    shards: list[list[str]] = []
    size = 0
    for name in names:
        if not shards or (size + nbytes[name] > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _write_sharded(
    names: list[str],
    nbytes: Mapping[str, int],
    produce: Callable[[str], torch.Tensor],
    config: ModelConfig,
    out_dir: Path,
    max_shard_bytes: int,
    overwrite: bool,
    progress: bool,
) -> dict:
    if max_shard_bytes < 1:
        raise ValueError("max_shard_bytes must be positive")
    out_dir = Path(out_dir)
    if (out_dir / INDEX_FILE).exists() or (out_dir / MANIFEST_FILE).exists():
        if not overwrite:
            raise CheckpointError(f"{out_dir} already holds a checkpoint; choose another directory or overwrite it (overwrite=True, --overwrite)")
        for old in out_dir.glob("model-*-of-*.safetensors"):
            old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = _plan_shards(names, nbytes, max_shard_bytes)
    weight_map = {}
    with byte_progress("writing", sum(nbytes.values()), progress) as advance:
        for k, group in enumerate(plan, start=1):
            fname = shard_name(k, len(plan))
            tensors = {name: produce(name).contiguous() for name in group}
            tmp = out_dir / (fname + ".partial")
            save_file(tensors, tmp, metadata={"format": "pt"})
            tmp.replace(out_dir / fname)
            for name in group:
                weight_map[name] = fname
            advance(sum(nbytes[n] for n in group))
            del tensors
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config.to_hf_config(), indent=2))
    if not (out_dir / TOKENIZER_CONFIG_FILE).exists():  # the chat template (Kimi format) and special tokens
        (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config_for(config), indent=2))
    return write_manifest(out_dir, config, progress=progress)


def _check_against_spec(tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    specs = expected_tensors(config)
    for name, spec in specs.items():
        if name not in tensors:
            raise CheckpointError(f"missing tensor {name} (shape {list(spec.shape)}, {spec.dtype})")
        t = tensors[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise CheckpointError(
                f"tensor {name} is {list(t.shape)} {t.dtype}; the layout needs {list(spec.shape)} {spec.dtype}"
            )
    extra = [n for n in tensors if n not in specs and is_text_tensor(n)]
    if extra:
        raise CheckpointError(f"tensors outside the layout for this config: {extra[:5]}")


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    config: ModelConfig,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    strict: bool = True,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Write checkpoint tensors (full names, as `expected_tensors`) as shards plus index, config and manifest.

    With strict (the default) the tensors must be exactly the layout of `config` (plus optional
    vision/projector tensors); strict=False writes whatever is given (tests use it for broken
    checkpoints). Returns the manifest.
    """
    if strict:
        _check_against_spec(tensors, config)
    names = list(tensors)
    nbytes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    return _write_sharded(names, nbytes, lambda n: tensors[n].detach().cpu(), config, Path(out_dir),
                          max_shard_bytes, overwrite, progress)


# ----------------------------------------------------------------- manifest
def read_weight_map(ckpt_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the shard headers when there is no index)."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc}") from None
    shards = sorted(ckpt_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{ckpt_dir} holds no {INDEX_FILE} and no .safetensors files")
    weight_map = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                weight_map[name] = shard.name
    return weight_map


def _stored_bytes(t: torch.Tensor):
    """A tensor's bytes as stored (row-major, little-endian; MXFP4 blocks as their uint8 bytes)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (row-major, little-endian; MXFP4 blocks as their uint8 bytes)."""
    return hashlib.sha256(_stored_bytes(t).tobytes()).hexdigest()


def _tensor_hashes(ckpt_dir: Path, files: list[str], advance: Callable[[int], None]) -> dict[str, str]:
    out = {}
    for fname in files:
        with safe_open(ckpt_dir / fname, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = tensor_sha256(t)
                advance(t.numel() * t.element_size())
    return dict(sorted(out.items()))


def write_manifest(ckpt_dir: str | Path, config: ModelConfig | None = None, progress: bool = False) -> dict:
    """Hash every shard and every tensor and write `k3_manifest.json` (also for a downloaded release that lacks
    one). The per-tensor hashes (`tensors`: checkpoint name -> sha256 of its bytes) let a loader that reads only
    some tensors (a swarm stage) check exactly those."""
    ckpt_dir = Path(ckpt_dir)
    config = config or read_config(ckpt_dir)
    files = sorted(set(read_weight_map(ckpt_dir).values()))
    for fname in files:
        if not (ckpt_dir / fname).exists():
            raise CheckpointError(f"shard {fname} named by the index is missing from {ckpt_dir}")
    shards = {}
    with byte_progress("hashing", sum((ckpt_dir / f).stat().st_size for f in files), progress) as advance:
        for fname in files:
            path = ckpt_dir / fname
            shards[fname] = {"sha256": _sha256_file(path, advance), "bytes": path.stat().st_size}
    with byte_progress("hashing tensors", sum((ckpt_dir / f).stat().st_size for f in files), progress) as advance:
        tensors = _tensor_hashes(ckpt_dir, files, advance)
    config_hash = config.config_hash()
    manifest = {
        "format": MANIFEST_FORMAT,
        "model_id": config.model_id,
        "config_hash": config_hash,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_shards": len(shards),
        "total_bytes": sum(s["bytes"] for s in shards.values()),
        "tensor_bytes": _index_total_size(ckpt_dir),
        "shards": shards,
        "tensors": tensors,
        "fingerprint": _fingerprint_of((s["sha256"] for s in shards.values()), config_hash),
    }
    (ckpt_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def _index_total_size(ckpt_dir: Path) -> int | None:
    index = ckpt_dir / INDEX_FILE
    if not index.exists():
        return None
    return json.loads(index.read_text()).get("metadata", {}).get("total_size")


def read_manifest(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / MANIFEST_FILE
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing: create it with inference.model.checkpoint.write_manifest({str(ckpt_dir)!r})"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("shards"), dict):
        raise CheckpointError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    return manifest


def fingerprint(ckpt_dir: str | Path) -> str:
    """The short model fingerprint (16 hex digits): sha256 over the sorted shard hashes and the config hash."""
    manifest = read_manifest(ckpt_dir)
    return _fingerprint_of((s["sha256"] for s in manifest["shards"].values()), manifest["config_hash"])


def verify_manifest(ckpt_dir: str | Path, progress: bool = False) -> dict:
    """Recompute every shard hash; raise CheckpointError naming the first missing, resized or altered file."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    indexed = set(read_weight_map(ckpt_dir).values())
    unlisted = sorted(indexed - set(manifest["shards"]))
    if unlisted:
        raise CheckpointError(f"shard {unlisted[0]} is in the index but not in the manifest")
    config_hash = read_config(ckpt_dir).config_hash()
    if config_hash != manifest["config_hash"]:
        raise CheckpointError(f"{CONFIG_FILE} does not match the config hash in the manifest")
    for fname, entry in sorted(manifest["shards"].items()):
        path = ckpt_dir / fname
        if not path.exists():
            raise CheckpointError(f"shard {fname} is missing from {ckpt_dir}")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"shard {fname} has {path.stat().st_size} bytes; the manifest says {entry['bytes']}")
    total = sum(int(entry["bytes"]) for entry in manifest["shards"].values())
    with byte_progress("verifying", total, progress) as advance:
        for fname, entry in sorted(manifest["shards"].items()):
            if _sha256_file(ckpt_dir / fname, advance) != entry["sha256"]:
                raise CheckpointError(f"shard {fname} is corrupt: its sha256 differs from the manifest")
    if manifest.get("fingerprint") not in (None, fingerprint(ckpt_dir)):
        raise CheckpointError(f"{MANIFEST_FILE}: the recorded fingerprint does not follow from its shard hashes")
    return manifest


def read_config(ckpt_dir: str | Path) -> ModelConfig:
    try:
        return ModelConfig.from_file(Path(ckpt_dir) / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None


# ------------------------------------------------------------------ loading
def load_tensors(
    ckpt_dir: str | Path, names_or_predicate: Iterable[str] | Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """Load only the selected tensors, opening only the shards that hold them (memory-mapped reads).

    Names may be given with or without the `language_model.` prefix; the result is keyed as asked.
    A predicate is applied to the full checkpoint names, which then key the result.
    """
    ckpt_dir = Path(ckpt_dir)
    weight_map = read_weight_map(ckpt_dir)
    wanted: dict[str, str] = {}  # checkpoint name -> result key
    if callable(names_or_predicate):
        wanted = {n: n for n in weight_map if names_or_predicate(n)}
    else:
        for key in names_or_predicate:
            if key in weight_map:
                wanted[key] = key
            elif PREFIX + key in weight_map:
                wanted[PREFIX + key] = key
            else:
                raise CheckpointError(f"tensor {key} is not in the checkpoint at {ckpt_dir}")
    by_shard: dict[str, list[str]] = {}
    for name in wanted:
        by_shard.setdefault(weight_map[name], []).append(name)
    out = {}
    for fname, names in sorted(by_shard.items()):
        with safe_open(ckpt_dir / fname, framework="pt") as f:
            for name in names:
                out[wanted[name]] = f.get_tensor(name)
    return out


def _header_specs(ckpt_dir: Path, weight_map: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every tensor, read from the shard headers without loading data."""
    specs = {}
    by_shard: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_shard.setdefault(fname, []).append(name)
    for fname, names in sorted(by_shard.items()):
        path = ckpt_dir / fname
        if not path.exists():
            raise CheckpointError(f"shard {fname} named by the index is missing from {ckpt_dir}")
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"the index places {name} in {fname}, which does not hold it")
                sl = f.get_slice(name)
                if sl.get_dtype() not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(f"tensor {name} in {fname} has unsupported dtype {sl.get_dtype()}")
                specs[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
    return specs


# A tensor read in blocks of whole rows (verifying a part's whole tensor, a row's largest magnitude) holds at
# most this many bytes of it at once.
ROW_BLOCK_BYTES = 64 * 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_blocks(stored, shape: tuple[int, ...], dtype: torch.dtype):
    """(first row, block) for consecutive blocks of whole rows (ROW_BLOCK_BYTES, at least one row) of a stored
    tensor (a safetensors slice), in order: their bytes, one after another, are the tensor's bytes; the whole
    tensor is never in memory at once."""
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    step = max(1, ROW_BLOCK_BYTES // max(1, row_bytes))
    for first in range(0, shape[0], step):
        yield first, stored[first:min(shape[0], first + step)]


def _read_part(stored, name: str, part: TensorPart, sha256: str | None) -> tuple[torch.Tensor, int]:
    """(part `part` of a stored tensor, the most bytes of it held at once while reading).

    Without a hash only the part's bytes are read. With one, the whole tensor streams through in row blocks
    (every byte read, hashed in order, at most a block and the part held) and must match it."""
    shape, dtype = tuple(stored.get_shape()), _SAFETENSORS_DTYPES[stored.get_dtype()]
    index = slice(part.start, part.stop)
    if sha256 is None:
        t = stored[index] if part.dim == 0 else stored[:, index]
        return t, _nbytes(t)
    digest, pieces, largest = hashlib.sha256(), [], 0
    for first, block in _row_blocks(stored, shape, dtype):
        digest.update(_stored_bytes(block))
        largest = max(largest, _nbytes(block))
        if part.dim == 1:
            pieces.append(block[:, index].clone())
        elif part.start < first + block.shape[0] and first < part.stop:
            pieces.append(block[max(part.start - first, 0):part.stop - first].clone())
        del block
    if digest.hexdigest() != sha256:
        raise CheckpointError(f"tensor {name} does not match its sha256 in the manifest: the file was altered or "
                              "corrupted")
    t = torch.cat(pieces, dim=part.dim)
    return t, max(largest, _nbytes(t))


def row_absmax(ckpt_dir: str | Path, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The largest magnitude of each row of each matrix `keys` (model keys): {key: fp32 [rows]}, read in row
    blocks (the whole matrix is never in memory). A rank holding some columns of a matrix quantises them with
    the whole rows' fp8 scales (the single-process model's) this way."""
    ckpt_dir = Path(ckpt_dir)
    weight_map = read_weight_map(ckpt_dir)
    out = {}
    for key in keys:
        name = key if key in weight_map else PREFIX + key
        if name not in weight_map:
            raise CheckpointError(f"tensor {key} is not in the checkpoint at {ckpt_dir}")
        with safe_open(ckpt_dir / weight_map[name], framework="pt") as f:
            stored = f.get_slice(name)
            shape, dtype = tuple(stored.get_shape()), _SAFETENSORS_DTYPES[stored.get_dtype()]
            if len(shape) != 2:
                raise CheckpointError(f"row_absmax takes matrices; {name} has shape {list(shape)}")
            out[key] = torch.cat([block.float().abs().amax(dim=1) for _, block in _row_blocks(stored, shape, dtype)])
    return out


def _fits(key: str, shape: tuple[int, ...], target: torch.Tensor, part: TensorPart | None) -> bool:
    """Whether a stored tensor of `shape` (or its `part`) fits the model tensor `target`."""
    if key.endswith(".A_log"):  # any shape with at least the heads needed; the first H (or the part's) used
        return math.prod(shape) >= (part.stop if part else target.numel()) and (
            part is None or part.stop - part.start == target.numel())
    if part is None:
        return shape == tuple(target.shape)
    try:
        return part.shape_of(shape) == tuple(target.shape)
    except CheckpointError:
        return False


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path, verify: bool = True, progress: bool = True,
                    select: TensorSelection = EVERY_TENSOR, device: torch.device | str | None = None,
                    verify_tensors: bool = False) -> dict:
    """Copy a checkpoint's text tensors into `model` (state_dict keys = names minus `language_model.`).

    The one loader: the single-process model loads everything; a shard or a stage passes `select` and reads
    only the shard files holding its tensors. Checks every selected tensor against the shard headers before
    copying anything: present, with the model's shape (A_log: any shape with at least H elements, the first H
    used); no text tensor may be unknown to the model. Float tensors are cast to the model tensor's dtype;
    MXFP4 bytes stay uint8. A model tensor on the meta device (a skeleton) is replaced by the loaded one on
    `device` (default: the CPU; a GPU: each tensor goes there as read, so the host never holds more than the
    tensor being read); others are copied into in place. Unselected tensors are left as they are.
    A tensor in `select.parts` is read as that part only (safetensors slices read only its bytes; the model
    tensor has the part's shape): a rank of a dense split never holds the whole tensor.
    `verify_tensors` checks every selected tensor, as read, against the manifest's per-tensor sha256 (a
    CheckpointError naming the first that differs, or saying the manifest has no per-tensor hashes); unlike
    `verify` it reads only the selected tensors. A part is checked against its whole tensor's hash: the tensor
    streams through in row blocks of ROW_BLOCK_BYTES (all its bytes read, never all held), so a rank checks
    every tensor it holds a part of, bytes of the other ranks' parts included.
    Returns {"tensors": loaded count, "bytes": bytes of tensor data read (parts: the part's), "parts": tensors
    read as parts, "largest": the most bytes of one tensor held at once while reading, "largest_part": the
    same over the tensors read as parts, "skipped": non-text tensors skipped, "verified": tensors checked
    against their sha256}.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"no checkpoint directory at {ckpt_dir}")
    if verify:
        verify_manifest(ckpt_dir, progress=progress)
    model_config = getattr(model, "config", None)
    if isinstance(model_config, ModelConfig):
        ckpt_config = read_config(ckpt_dir)
        differ = [f for f in ModelConfig.__dataclass_fields__
                  if f != "model_id" and getattr(ckpt_config, f) != getattr(model_config, f)]
        if differ:
            raise CheckpointError(f"checkpoint config differs from the model's in {differ}")
    expected_sha: dict[str, str] = {}
    if verify_tensors:
        expected_sha = read_manifest(ckpt_dir).get("tensors") or {}
        if not expected_sha:
            raise CheckpointError(f"the manifest of {ckpt_dir} has no per-tensor sha256: rewrite it with "
                                  f"inference.model.checkpoint.write_manifest({str(ckpt_dir)!r})")
    weight_map = read_weight_map(ckpt_dir)
    skipped = [n for n in weight_map if not is_text_tensor(n)]
    text = {model_key(n): n for n in weight_map if is_text_tensor(n)}
    every_target = model.state_dict(keep_vars=True)
    targets = {k: t for k, t in every_target.items() if select.holds(k)}

    for key, target in targets.items():
        if key not in text:
            hint = ""
            if key.endswith(PACKED_SUFFIX) and key[: -len(PACKED_SUFFIX)] + ".weight" in text:
                hint = " (the checkpoint stores this expert unquantised as .weight; the model expects MXFP4)"
            elif key.endswith(".weight") and key[: -len(".weight")] + PACKED_SUFFIX in text:
                hint = " (the checkpoint stores this expert as MXFP4; the model expects a plain weight)"
            raise CheckpointError(
                f"missing tensor {PREFIX + key}: the model expects shape {list(target.shape)}, "
                f"the checkpoint has none{hint}"
            )
    extra = sorted(k for k in text if k not in every_target)
    if extra:
        raise CheckpointError(
            f"unexpected tensor {text[extra[0]]} in the checkpoint ({len(extra)} the model does not have)"
        )
    # only the headers of the files this selection reads: a host may hold only its shard's files
    header = _header_specs(ckpt_dir, {text[k]: weight_map[text[k]] for k in targets})
    parts = {k: p for k, p in select.parts.items() if k in targets}
    for key, target in targets.items():
        shape, dtype = header[text[key]]
        if not _fits(key, shape, target, parts.get(key)):
            of = f" (its part {parts[key]})" if key in parts else ""
            raise CheckpointError(
                f"tensor {text[key]} has shape {list(shape)} in the checkpoint but the model expects "
                f"{list(target.shape)}{of}"
            )
        if (dtype == torch.uint8) != (target.dtype == torch.uint8):
            raise CheckpointError(
                f"tensor {text[key]} is {dtype} in the checkpoint but the model holds {target.dtype} "
                "(MXFP4 bytes must meet uint8 buffers)"
            )

    by_shard: dict[str, list[str]] = {}
    for key in targets:
        by_shard.setdefault(weight_map[text[key]], []).append(key)
    def stored_bytes(key: str) -> int:
        shape, dtype = header[text[key]]
        part = parts.get(key)
        if part is not None and not key.endswith(".A_log"):
            shape = part.shape_of(shape)
        return math.prod(shape) * dtype.itemsize

    total = sum(stored_bytes(k) for k in targets)
    largest = largest_part = 0
    with torch.no_grad(), byte_progress("loading", total, progress) as advance:
        for fname, keys in sorted(by_shard.items()):
            with safe_open(ckpt_dir / fname, framework="pt") as f:
                for key in keys:
                    name, part, target = text[key], parts.get(key), targets[key]
                    want = None
                    if verify_tensors:
                        want = expected_sha.get(name)
                        if want is None:
                            raise CheckpointError(f"tensor {name} has no sha256 in the manifest of {ckpt_dir}")
                    if part is not None and not key.endswith(".A_log"):
                        t, held = _read_part(f.get_slice(name), name, part, want)
                        largest_part = max(largest_part, held)
                    else:  # whole (an A_log part is a few heads' values: read whole, then cut)
                        t = f.get_tensor(name)
                        held = _nbytes(t)
                        if want is not None and tensor_sha256(t) != want:
                            raise CheckpointError(f"tensor {name} in {fname} does not match its sha256 in "
                                                  f"the manifest: the file was altered or corrupted")
                        if key.endswith(".A_log"):
                            start = part.start if part is not None else 0
                            t = t.reshape(-1)[start:start + target.numel()].reshape(target.shape)
                    largest = max(largest, held)
                    if target.is_meta:  # onto the device as stored, cast there: one tensor at a time crosses
                        _materialise(model, key, t.to(device or "cpu").to(target.dtype).contiguous())
                    else:
                        target.copy_(t)
                    advance(stored_bytes(key))
                    del t
    return {"tensors": len(targets), "bytes": total, "parts": len(parts), "largest": largest,
            "largest_part": largest_part, "skipped": len(skipped), "verified": len(targets) if verify_tensors else 0}


def _materialise(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    """Put a loaded tensor in the place of a skeleton's meta parameter or buffer."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


# ----------------------------------------------------------- random weights
# The one random initialisation: `make_random_checkpoint(config, seed=s)` writes these tensors and
# `KimiK3Model(config, seed=s)` holds them (`fill_random_weights`), so the two are one network.
# Scales: chosen so that the tiny model's next-token distributions are neither uniform nor one-hot (top
# probability around 0.35, depending on context; see tests/test_checkpoint.py); projections get unit-variance
# outputs. Measured on the tiny model: with unit gain on the residual branch outputs and AttnRes query std
# 1/sqrt(D) the network amplifies fp32 rounding ~1000x, so a prefill and a token-by-token decode differ by up to
# 1e-3; with the values below the amplification is ~30-70x and they agree within ~2e-5.
LM_HEAD_GAIN = 3.0  # logits of std ~3 after the final norm (unit RMS)
NORM_JITTER = 0.1  # norm weights 1 + 0.1 * N(0, 1)
CONV_STD = 0.5
DT_BIAS_STD = 0.1
CORRECTION_BIAS_STD = 0.01
E2M1_RMS = 2.93  # root mean square of the 16 E2M1 values, uniform codes


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def expert_scale_exponents(in_features: int) -> tuple[int, int]:
    """Biased E8M0 exponents giving random on-grid experts about 1/sqrt(in_features) standard deviation."""
    k = round(math.log2(1.0 / (math.sqrt(in_features) * E2M1_RMS)))
    return 127 + k - 1, 127 + k


RESIDUAL_BRANCH_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                           "routed_expert_up_proj.weight")


def _random_expert(base: str, packed_spec: TensorSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP4 expert weight on the grid: (weight_packed, weight_scale), drawn together from its base name."""
    out_f, in_f = packed_spec.shape[0], packed_spec.shape[1] * 2
    g = torch.Generator().manual_seed(_seed_for(seed, base))
    return mxfp4.random_on_grid(out_f, in_f, g, expert_scale_exponents(in_f))


def random_tensor(name: str, spec: TensorSpec, config: ModelConfig, seed: int) -> torch.Tensor:
    """The deterministic random value of one checkpoint tensor (depends only on seed, name and shape)."""
    key = model_key(name)
    if key.endswith(PACKED_SUFFIX):
        return _random_expert(key[: -len(PACKED_SUFFIX)], spec, seed)[0]
    if key.endswith(SCALE_SUFFIX):
        out_f, blocks = spec.shape
        return _random_expert(key[: -len(SCALE_SUFFIX)], TensorSpec((out_f, blocks * MXFP4_BLOCK // 2), spec.dtype),
                              seed)[1]
    g = torch.Generator().manual_seed(_seed_for(seed, key))
    normal = torch.randn(spec.shape, generator=g, dtype=torch.float32)
    if key.endswith(".A_log"):
        H = config.kda_heads
        a = torch.zeros(spec.numel)
        a[:H] = torch.log(1 + 15 * torch.rand(H, generator=g))  # log(uniform(1, 16))
        t = a.reshape(spec.shape)
    elif key.endswith(".dt_bias"):
        t = DT_BIAS_STD * normal
    elif key.endswith("e_score_correction_bias"):
        t = CORRECTION_BIAS_STD * normal
    elif "conv1d" in key:
        t = CONV_STD * normal
    elif key.endswith("norm.weight"):  # every RMSNorm: layer, AttnRes, MLA low-rank, o_norm, latent
        t = 1 + NORM_JITTER * normal
    elif key == "model.embed_tokens.weight":
        t = normal
    elif key == "lm_head.weight":
        t = LM_HEAD_GAIN * normal / math.sqrt(spec.shape[1])
    elif key.endswith("attn_res_proj.weight") or key.endswith("_res_proj.weight"):
        # AttnRes query vectors: source logits of std ~0.5
        t = 0.5 * normal / math.sqrt(spec.shape[-1])
    elif key.endswith(RESIDUAL_BRANCH_OUTPUTS):
        # outputs feeding the residual stream get 1/sqrt(2 * layers) (the GPT-2 factor): with gain 1
        # the 13-layer tiny model amplifies fp32 rounding ~1000x and prefill and decode drift apart
        t = normal / math.sqrt(spec.shape[-1]) / math.sqrt(2 * config.num_layers)
    else:  # projections [out, in]
        t = normal / math.sqrt(spec.shape[-1])
    return t.to(spec.dtype)


def fill_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Give `model` (a KimiK3Model) the tensors of `make_random_checkpoint(model.config, seed=seed)`, as loading
    that checkpoint would: same values, cast to the model's dtypes, A_log trimmed to one value per head."""
    config = model.config
    targets = model.state_dict(keep_vars=True)
    specs = expected_tensors(config)
    with torch.no_grad():
        for name, spec in specs.items():
            key = model_key(name)
            if key.endswith(SCALE_SUFFIX):
                continue  # drawn with its packed twin
            if key.endswith(PACKED_SUFFIX):
                base = key[: -len(PACKED_SUFFIX)]
                packed, scale = _random_expert(base, spec, seed)
                targets[key].copy_(packed)
                targets[base + SCALE_SUFFIX].copy_(scale)
                continue
            t = random_tensor(name, spec, config, seed)
            target = targets[key]
            if key.endswith(".A_log"):
                t = t.reshape(-1)[: target.numel()].reshape(target.shape)
            target.copy_(t)


def random_checkpoint_tensors(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """All random checkpoint tensors in memory (small configs only)."""
    return {name: random_tensor(name, spec, config, seed) for name, spec in expected_tensors(config).items()}


def make_random_checkpoint(
    config: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Write a seeded random checkpoint of `config`, one shard in memory at a time; returns the manifest.

    Same config, seed and shard size give the same bytes and so the same fingerprint.
    """
    specs = expected_tensors(config)
    return _write_sharded(
        list(specs),
        {n: s.nbytes for n, s in specs.items()},
        lambda n: random_tensor(n, specs[n], config, seed),
        config,
        Path(out_dir),
        max_shard_bytes,
        overwrite,
        progress,
    )


__all__ = [
    "CheckpointError",
    "TensorSpec",
    "TensorSite",
    "TensorSelection",
    "TensorPart",
    "EVERY_TENSOR",
    "tensor_site",
    "PREFIX",
    "expected_tensors",
    "num_parameters",
    "model_key",
    "is_text_tensor",
    "state_dict_to_checkpoint_tensors",
    "write_checkpoint",
    "write_manifest",
    "tensor_sha256",
    "read_manifest",
    "verify_manifest",
    "fingerprint",
    "read_config",
    "read_weight_map",
    "load_tensors",
    "load_checkpoint",
    "row_absmax",
    "random_tensor",
    "fill_random_weights",
    "random_checkpoint_tensors",
    "make_random_checkpoint",
]
