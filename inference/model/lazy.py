"""A Kimi K3 model whose weights stay on disk until a forward needs them, held under a memory budget.

A validator checks one block of layers at a time, and of a MoE layer only the routed experts its tokens pick
(docs/swarm.md section 8). `LazyK3Model` is a `KimiK3Model` built on the meta device: nothing is allocated until
`embed`, `run_layers` or `head` reaches a *site* (the embedding, the head, one layer's own tensors, or one routed
expert: `checkpoint.tensor_site`). A site is read from the checkpoint's safetensors files just before it is used
and kept in a least-recently-used set bounded by `budget_bytes`; to make room, the least recently used sites are
put back on the meta device. Experts are loaded one at a time as the MoE layer runs them
(`LatentMoE.expert_loader`), so a layer's working set is its own tensors plus one expert, whatever the number of
experts its tokens touch.

Reads are positional (`os.preadv` at the offsets of the safetensors header) into fresh buffers, not memory maps:
pages of a mapped file count as the process's resident memory for as long as the map lives, and a validator's
budget is a statement about its resident memory. Every read is counted (`WeightTraffic`: bytes and tensors read,
sites evicted, the most bytes held at once), and every tensor is checked against the manifest's per-tensor sha256
the first time it is read (when the manifest has them).

On a GPU (`device`), each tensor is read into a host buffer of its own size and moved to the device at once; the
budget is then the device's memory, and the host holds one tensor at a time. Decode state is made on the device.

The computation is the in-memory model's, tensor for tensor: the same casts on load, the same kernels (small
models keep decoded experts, as `load_reference_model` and `load_stage_model` do), so an fp32 `LazyK3Model`
gives the in-memory fp32 model's outputs bit for bit.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor

from inference.model.checkpoint import (_SAFETENSORS_DTYPES, PREFIX, CheckpointError, _materialise, expected_tensors,
                                        model_key, read_config, read_manifest, read_weight_map, tensor_sha256,
                                        tensor_site)
from inference.model.k3 import FP32_TENSOR_SUFFIXES, KimiK3Model, ResidualState, SequenceCache

Site = tuple  # ("embedding",) | ("head",) | ("layer", i) | ("expert", i, e)

# Small models keep a decoded (fp32) copy of their experts, as the in-memory loaders do; its bytes count too.
DECODED_EXPERTS_MAX_PARAMETERS = 1 << 28
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


class CheckpointFile:
    """One safetensors file read by offsets: its header parsed once, tensors read with `os.preadv`."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            header = json.loads(os.pread(self.fd, size, 8))
        except (ValueError, RuntimeError) as e:
            os.close(self.fd)
            raise CheckpointError(f"{path} is not a safetensors file: {e}") from None
        self.data_start = 8 + size
        self.tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}

    def read(self, name: str) -> Tensor:
        """The tensor as stored (its dtype and shape), in a buffer of its own."""
        spec = self.tensors.get(name)
        if spec is None:
            raise CheckpointError(f"{self.path.name} does not hold {name}")
        dtype = _SAFETENSORS_DTYPES.get(spec["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name} in {self.path.name} has unsupported dtype {spec['dtype']}")
        begin, end = spec["data_offsets"]
        shape = tuple(spec["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {name} in {self.path.name}: its offsets do not hold shape {list(shape)}")
        raw = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(raw.numpy()), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], self.data_start + begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path.name} ends inside tensor {name}")
            done += got
        return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class WeightTraffic:
    """What the lazy model read and held (running totals; a check takes the difference, `since`)."""

    bytes_read: int = 0
    tensors_read: int = 0
    sites_loaded: int = 0
    sites_evicted: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0

    def copy(self) -> "WeightTraffic":
        return WeightTraffic(**vars(self))


class LazyK3Model(KimiK3Model):
    """A KimiK3Model holding at most `budget_bytes` of weights, read from `checkpoint` as the computation reaches
    them (module doc). Thread-safe: one forward runs at a time."""

    def __init__(self, checkpoint: str | Path, budget_bytes: int, dtype: torch.dtype = torch.float32,
                 verify_tensors: bool | None = None, device: torch.device | str = "cpu"):
        config = read_config(checkpoint)
        with torch.device("meta"):
            super().__init__(config, dtype=dtype, random_init=False)
        # where the weights go as they are read, and the computation runs (the budget is that device's memory);
        # model_device() reads it, since between reads every tensor is on the meta device
        self.home_device = torch.device(device)
        self.eval()
        self.checkpoint = Path(checkpoint)
        self.budget_bytes = int(budget_bytes)
        weight_map = read_weight_map(checkpoint)
        self._files = {f: CheckpointFile(self.checkpoint / f) for f in sorted(set(weight_map.values()))}
        self._where = weight_map
        self._hashes: dict[str, str] = {}
        if verify_tensors is None or verify_tensors:
            try:
                self._hashes = read_manifest(checkpoint).get("tensors") or {}
            except CheckpointError:
                if verify_tensors:
                    raise
            if verify_tensors and not self._hashes:
                raise CheckpointError(f"the manifest of {checkpoint} has no per-tensor sha256 to verify against")
        self._verified: set[str] = set()
        return_freed_memory()
        self._sites: dict[Site, list[str]] = {}
        for key in self.state_dict(keep_vars=True):
            self._sites.setdefault(_site_of(key), []).append(key)
        missing = [k for keys in self._sites.values() for k in keys if PREFIX + k not in weight_map]
        if missing:
            raise CheckpointError(f"the checkpoint at {checkpoint} has no tensor {PREFIX + missing[0]} "
                                  f"({len(missing)} missing)")
        self._site_bytes = {site: sum(_nbytes(self._held(k)) for k in keys) for site, keys in self._sites.items()}
        self._resident: OrderedDict[Site, int] = OrderedDict()  # least recently used first
        self._pinned: set[Site] = set()
        self._lock = threading.RLock()
        self.traffic = WeightTraffic()
        self._decode_experts = config.mxfp4_experts and config.num_parameters() < DECODED_EXPERTS_MAX_PARAMETERS
        for layer in self.layers:
            if layer.is_moe:
                layer.block_sparse_moe.expert_loader = self._load_experts
                if self._decode_experts:
                    layer.block_sparse_moe.set_dequantize_cache(True)
        need = self.working_set_bytes()
        if need > self.budget_bytes:
            raise ValueError(f"a reference memory of {self.budget_bytes / 2**30:.2f} GiB is below what one layer of "
                             f"this model needs at once ({need / 2**30:.2f} GiB: its own tensors and one expert, "
                             f"or the embedding or the head); give more")

    # ------------------------------------------------------------ sizes
    def working_set_bytes(self) -> int:
        """The most bytes one step of a forward holds at once: the largest of the embedding, the head, and one
        layer's own tensors with its largest expert (all of its experts, decoded, for a small model)."""
        largest = max(self._site_bytes.get(("embedding",), 0), self._site_bytes.get(("head",), 0))
        for i, layer in enumerate(self.layers):
            experts = [b for s, b in self._site_bytes.items() if s[0] == "expert" and s[1] == i]
            expert = (sum(experts) + self._decoded_bytes(len(experts))) if self._decode_experts else max(experts,
                                                                                                         default=0)
            largest = max(largest, self._site_bytes[("layer", i)] + expert)
        return largest

    def block_bytes(self, start: int, stop: int) -> int:
        """Bytes of layers [start, stop) with every expert (what a block would hold if read whole)."""
        return sum(b for s, b in self._site_bytes.items() if s[0] in ("layer", "expert") and start <= s[1] < stop)

    def _decoded_bytes(self, experts: int) -> int:
        c = self.config
        return experts * 3 * c.latent_size * c.expert_intermediate_size * 4 if self._decode_experts else 0

    # ------------------------------------------------------------ the forward's entry points
    def new_cache(self, layers: Iterable[int] | None = None) -> SequenceCache:
        """Empty decode state on the model's device (the skeleton's tensors are on the meta device)."""
        wanted = set(range(self.config.num_layers) if layers is None else layers)
        return SequenceCache([layer.self_attn.new_cache(device=self.home_device) if i in wanted else None
                              for i, layer in enumerate(self.layers)])

    def embed(self, ids: Tensor, lengths: Sequence[int] | None = None) -> ResidualState:
        with self._holding(("embedding",)):
            return super().embed(ids, lengths)

    def run_layers(self, start: int, stop: int, state: ResidualState, caches: list[SequenceCache]) -> ResidualState:
        if not 0 <= start <= stop <= self.config.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.config.num_layers}")
        if len(caches) != len(state.lengths):
            raise ValueError(f"{len(state.lengths)} sequences in the state but {len(caches)} caches")
        for i in range(start, stop):
            with self._holding(("layer", i)):
                state = self.layers[i](state, caches)
        return state

    def head(self, state: ResidualState, rows=None) -> Tensor:
        with self._holding(("head",)):
            return super().head(state, rows)

    def input_device(self) -> torch.device:
        return self.home_device  # the skeleton's tensors are on the meta device until read

    # ------------------------------------------------------------ residency
    def _holding(self, site: Site):
        model = self

        class _Hold:
            def __enter__(self):
                model._lock.acquire()
                try:
                    model._ensure(site)
                    model._pinned.add(site)
                except BaseException:
                    model._lock.release()
                    raise

            def __exit__(self, *exc):
                model._pinned.discard(site)
                model._lock.release()

        return _Hold()

    def _load_experts(self, layer: int, experts: Iterable[int]) -> None:
        with self._lock:
            for e in experts:
                self._ensure(("expert", layer, int(e)))

    def _ensure(self, site: Site) -> None:
        """Make `site` resident (most recently used), evicting the least recently used unpinned sites first."""
        if site in self._resident:
            self._resident.move_to_end(site)
            return
        need = self._site_bytes[site] + (self._decoded_bytes(1) if site[0] == "expert" else 0)
        for old in list(self._resident):
            if self.traffic.resident_bytes + need <= self.budget_bytes:
                break
            if old not in self._pinned:
                self._evict(old)
        with torch.inference_mode(False):  # ordinary tensors, whatever mode the caller computes in
            for key in self._sites[site]:
                _materialise(self, key, self._read(key))
        self._resident[site] = need
        self.traffic.sites_loaded += 1
        self.traffic.resident_bytes += need
        self.traffic.peak_resident_bytes = max(self.traffic.peak_resident_bytes, self.traffic.resident_bytes)

    def _evict(self, site: Site) -> None:
        for key in self._sites[site]:
            held = self._held(key)
            _materialise(self, key, torch.empty(held.shape, dtype=held.dtype, device="meta"))
        if site[0] in ("expert", "layer") and self.layers[site[1]].is_moe:
            moe = self.layers[site[1]].block_sparse_moe
            if moe.dequantize_cache:
                moe.set_dequantize_cache(True)  # decoded copies of the evicted tensors go with them
        self.traffic.resident_bytes -= self._resident.pop(site)
        self.traffic.sites_evicted += 1

    def _read(self, key: str) -> Tensor:
        """A model tensor as the in-memory loader holds it: read, checked once against its sha256, cast."""
        name = PREFIX + key
        t = self._files[self._where[name]].read(name)
        self.traffic.bytes_read += _nbytes(t)
        self.traffic.tensors_read += 1
        want = self._hashes.get(name)
        if want is not None and name not in self._verified:
            if tensor_sha256(t) != want:
                raise CheckpointError(f"tensor {name} in {self._where[name]} does not match its sha256 in the "
                                      "manifest: the file was altered or corrupted")
            self._verified.add(name)
        target = self._held(key)
        if key.endswith(".A_log"):  # stored padded; the model holds one value per head
            t = t.reshape(-1)[:target.numel()].reshape(target.shape)
        elif tuple(t.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name} has shape {list(t.shape)} in the checkpoint but the model expects "
                                  f"{list(target.shape)}")
        return t.to(device=self.home_device, dtype=target.dtype).contiguous()

    def _held(self, key: str) -> Tensor:
        module_name, _, name = key.rpartition(".")
        module = self.get_submodule(module_name)
        return module._parameters[name] if name in module._parameters else module._buffers[name]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


def site_bytes(config, dtype: torch.dtype = torch.float32) -> tuple[dict[Site, int], dict[Site, int]]:
    """(bytes each site takes on disk, bytes it takes held by a model of `dtype`), from the checkpoint layout
    alone (`expected_tensors`): what a check of any block reads and holds, for a model too large to build (the
    planner's validator costs, inference.planning.validator_cost). Held: floating tensors in `dtype` but those
    the format keeps in fp32, MXFP4 bytes as stored, A_log one value per head."""
    stored: dict[Site, int] = {}
    held: dict[Site, int] = {}
    for name, spec in expected_tensors(config).items():
        key = model_key(name)
        site = _site_of(key)
        stored[site] = stored.get(site, 0) + spec.nbytes
        if not spec.dtype.is_floating_point:
            size = spec.nbytes
        elif key.endswith(".A_log"):
            size = config.kda_heads * 4
        else:
            size = spec.numel * (4 if key.endswith(FP32_TENSOR_SUFFIXES) else dtype.itemsize)
        held[site] = held.get(site, 0) + size
    return stored, held


def return_freed_memory() -> bool:
    """Make freed tensor buffers go back to the system at once (glibc; False elsewhere). glibc's malloc raises its
    mmap threshold to the largest block freed so far, so once an expert is evicted, later experts come from its
    heap and what is evicted stays in the process: measured, a reference holding 1 GB of weights grew to 2.4 GB of
    resident memory over six layers, and stays at 1.7 GB with a fixed threshold of 64 KiB."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 16))


def _site_of(key: str) -> Site:
    site = tensor_site(key)
    if site.kind in ("embedding", "head"):
        return (site.kind,)
    if site.kind == "layer":
        return ("layer", site.layer)
    return ("expert", site.layer, site.expert)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


__all__ = ["CheckpointFile", "LazyK3Model", "WeightTraffic", "DECODED_EXPERTS_MAX_PARAMETERS", "return_freed_memory",
           "site_bytes"]
