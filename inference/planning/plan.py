"""Placement plan: where every weight of the model lives, and what each device reserves.

A plan is what the sharded runtime loads (docs/engine.md sections 2 and 3). It is written
by `inference.planning.planner` for a real cluster, or by `Plan.simple` for N local processes.

File format (YAML or JSON, chosen by the file suffix; `format: k3-placement-plan/1`):

    format: k3-placement-plan/1
    conventions: {...}             # the rules below, repeated in the file for a human reader
    cluster: rtx5090_80            # name of the cluster description it was planned for
    model: {model_id, preset, config_hash, hf_config}
    target: {concurrency, context} # the load the reservations are sized for
    memory_policy: {...}           # MemoryPolicy: headroom fraction, dtypes, prefill chunk
    devices:                       # one per process; rank = torch.distributed rank
      - {rank, host, kind, memory_bytes, mem_bandwidth, flops, power_w}
    links:                         # one message of B bytes takes latency + B / bandwidth
      intra_host: {kind, bandwidth, latency}
      inter_host: {kind, bandwidth, latency}
    layer_range: [24, 36]          # optional (a block plan): the plan places only layers [start, stop) (a swarm
                                   # stage's block); absent = the whole model
    stages:                        # contiguous layer groups; layers = [first, end) half-open
      - {index, layers: [first, end], ranks: [...]}
    embedding_rank: 0              # holds the input embedding table (a rank of stage 0)
    lm_head_rank: 7                # holds the final norm and LM head (a rank of the last stage)
    lm_head_split: [7, 6]          # optional: ranks of one host splitting the LM head by vocabulary
    dense_dtype: bf16              # optional: bf16 (the checkpoint's dense weights) | fp8 (e4m3, per-row scales)
    layers:                        # one record per decoder layer (of the block), zero-based
      - {layer, attention: kda|mla, mlp: dense|moe, stage, home,
         dense_split: [home, r],   # optional: ranks of the home's host splitting the dense work (home first)
         experts: [[ranks], ...]}  # MoE only: position = expert id; the ranks holding a copy,
                                   # primary copy first, replicas after it; null for dense layers
    memory:                        # per rank, bytes
      - {rank, weights_dense, weights_experts, kda_state, mla_cache, buffers, headroom,
         total, capacity, free}
    prediction: {...}              # cost model summary (seconds, tokens/s, tokens/J)

Units are SI base units throughout: bytes, bytes/s, FLOP/s, seconds, watts.

A block plan (`layer_range: [start, stop)`) places one contiguous block of layers, what a swarm stage miner
serves over its own devices: its stages cover exactly [start, stop), its `layers` records list exactly those
layers, and nothing outside the block has a home, an expert placement or a dense split (in memory
`layer_home` keeps one entry per model layer, None outside the block). Its memory counts only the block's
layers, their experts and per-session state, the embedding only when start == 0, and the final norm and LM
head only when stop == num_layers; `embedding_rank` / `lm_head_rank` are still written (the first stage's and
the last stage's ranks) but hold nothing when the block lacks them. Files without `layer_range` are
whole-model plans, read and validated as before. The cost model and the planner work on whole-model plans.
`home` runs the layer's attention, router, latent projections and shared experts (or the
dense MLP of layer 0); it also holds that layer's KDA state / MLA cache reservation.
With `dense_split` the attention heads, the shared experts' (or dense MLP's) hidden units and
their weights are divided over those ranks (column split, then row split): the home sends each
the block's input, each returns its partial sum; the router, the latent projections and the
Attention Residuals stay on the home, the routed experts stay expert-parallel.

Routing statistics (written by the runtime, read by the planner): see `RoutingStats`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from inference.model import ConfigError, ModelConfig
from inference.model.files import read_document

PLAN_FORMAT = "k3-placement-plan/1"
ROUTING_FORMAT = "k3-routing-stats/1"

CONVENTIONS = {
    "layers": "zero-based decoder layer indices",
    "stage_layers": "[first, end) half-open: a stage runs layers first..end-1",
    "rank": "torch.distributed rank of the process that owns the device",
    "home": "rank running the layer's attention, router, latent projections, shared experts "
            "(or dense MLP) and holding its KDA state / MLA cache",
    "experts": "list indexed by expert id; each entry lists the ranks holding a copy, primary first",
    "units": "bytes, bytes/s, FLOP/s (bf16 dense peak), seconds, watts",
    "link_time": "one message of B bytes takes latency + B / bandwidth (bandwidth one direction); "
                 "per_peer links carry messages to different peers at the same time, others share one pipe",
    "kda_state": "recurrent state plus short-convolution windows, fp32, for `target.concurrency` sequences",
    "mla_cache": "latent cache for `target.concurrency` sequences of `target.context` tokens",
    "headroom": "memory deliberately left unused (fragmentation, growth); counted in total",
    "dense_split": "ranks (home first, one host) dividing a layer's attention heads and shared-expert / dense-MLP "
                   "units; one input broadcast and one partial-sum reduce per block; absent = the home alone",
    "dense_dtype": "bf16: dense weights as the checkpoint has them; fp8: float8_e4m3fn with one fp32 scale per "
                   "output channel (routed experts stay MXFP4)",
    "layer_range": "optional [start, stop): a block plan places only those layers (embedding if start is 0, "
                   "head if stop is the layer count); absent = the whole model",
}

DENSE_DTYPES = ("bf16", "fp8")
DENSE_DTYPE_SCALE = {"bf16": 1.0, "fp8": 0.5}  # dense weight bytes relative to bf16


class PlanError(ValueError):
    """A plan file that is malformed or does not describe a working placement."""


# ============================================================== weight accounting
@dataclass(frozen=True)
class LayerWeights:
    """Bytes and parameters of one decoder layer's non-routed parts (what its home device holds)."""

    attention_bytes: int  # attention projections, norms, AttnRes sites, fp32 extras
    mlp_bytes: int  # dense MLP (layer 0) or router + latent down/up projections + latent norm
    shared_bytes: int  # shared experts (0 for a dense layer)
    attention_params: int
    mlp_params: int
    shared_params: int

    @property
    def dense_bytes(self) -> int:
        """Everything the home device reads for this layer except the shared experts."""
        return self.attention_bytes + self.mlp_bytes

    @property
    def total_bytes(self) -> int:
        return self.attention_bytes + self.mlp_bytes + self.shared_bytes


def layer_weights(config: ModelConfig, layer: int) -> LayerWeights:
    """Weights of layer `layer` held by its home device, from ModelConfig's exact accounting."""
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"layer {layer} outside 0..{config.num_layers - 1}")
    common = config._layer_common_params()
    if config.is_mla(layer):
        attn_bf16, attn_fp32 = config._mla_params(), 0
    else:
        attn_bf16, attn_fp32 = config._kda_params()
    attn_bf16 += common
    if config.is_moe(layer):
        moe_bf16, moe_fp32 = config._moe_dense_params()
        shared = 3 * config.hidden_size * config.shared_expert_intermediate_size
        mlp_bf16, mlp_fp32 = moe_bf16 - shared, moe_fp32
    else:
        mlp_bf16, mlp_fp32, shared = 3 * config.hidden_size * config.dense_intermediate_size, 0, 0
    return LayerWeights(
        attention_bytes=2 * attn_bf16 + 4 * attn_fp32,
        mlp_bytes=2 * mlp_bf16 + 4 * mlp_fp32,
        shared_bytes=2 * shared,
        attention_params=attn_bf16 + attn_fp32,
        mlp_params=mlp_bf16 + mlp_fp32,
        shared_params=shared,
    )


def embedding_bytes(config: ModelConfig) -> int:
    return 2 * config.vocab_size * config.hidden_size


def lm_head_bytes(config: ModelConfig) -> int:
    """LM head plus the final norm and the output AttnRes site (held together)."""
    return 2 * (config.vocab_size * config.hidden_size + 3 * config.hidden_size)


def split_layer_bytes(config: ModelConfig, layer: int, parts: int) -> tuple[int, int]:
    """(the home's, each other rank's) dense bytes of layer `layer` split over `parts` ranks, as the runtime reads
    them (inference.sharding.dense_split): the heads' and hidden units' tensors divided evenly; the low-rank
    tensors every head uses (KDA f_a / g_a and o_norm, A_log, read whole; MLA q_a / kv_a and their norms) on
    every rank; norms, Attention Residuals sites, router and latent projections on the home only."""
    lw = layer_weights(config, layer)
    if parts == 1:
        return lw.total_bytes, 0
    c, D = config, config.hidden_size
    if c.is_mla(layer):
        shared = 2 * (c.mla_cache_width * D + c.kv_lora_rank + (c.q_lora_rank * (D + 1) if c.q_lora_rank else 0))
    else:
        d = c.kda_head_dim
        shared = 2 * d * D * (1 if c.full_rank_output_gate else 2) + 4 * (d + c.a_log_size)
    home_only = 2 * c._layer_common_params() + (lw.mlp_bytes if c.is_moe(layer) else 0)
    each = (lw.total_bytes - shared - home_only) // parts
    return home_only + shared + each, shared + each


def split_head_bytes(config: ModelConfig, parts: int) -> list[int]:
    """Bytes of the LM head on each rank splitting it (vocabulary slices as the runtime cuts them, sizes
    differing by at most one row); the first, the head rank, also holds the final norm and output AttnRes site."""
    V, D = config.vocab_size, config.hidden_size
    bounds = [round(V * p / parts) for p in range(parts + 1)]
    rows = [b - a for a, b in zip(bounds, bounds[1:])]
    return [2 * (n * D + (3 * D if p == 0 else 0)) for p, n in enumerate(rows)]


def attn_res_sources(config: ModelConfig, layer: int) -> int:
    """Vectors (each hidden_size wide) that must reach layer `layer` from the previous one.

    With block Attention Residuals a hop carries every completed block sum plus the running
    partial sum, not one hidden state (model.md section 6). `layer == num_layers` is the hop
    into the final norm / LM head.
    """
    return math.ceil(layer / config.attn_res_block_size) + 1


def kda_reserve_per_layer(config: ModelConfig, concurrency: int) -> int:
    """KDA recurrent state plus conv windows of one KDA layer for `concurrency` sequences."""
    if not config.num_kda_layers:
        return 0
    per_seq = config.kda_state_bytes_per_sequence() + config.kda_conv_bytes_per_sequence()
    return concurrency * per_seq // config.num_kda_layers


def mla_reserve_per_layer(config: ModelConfig, concurrency: int, context: int, cache_dtype_bytes: int) -> int:
    if not config.num_mla_layers:
        return 0
    per_token = config.mla_cache_bytes_per_token(cache_dtype_bytes) // config.num_mla_layers
    return concurrency * context * per_token


# ============================================================== devices and links
@dataclass(frozen=True)
class Device:
    rank: int
    host: str
    kind: str
    memory_bytes: int
    mem_bandwidth: float  # bytes/s, data-sheet peak
    flops: float  # bf16 dense FLOP/s, data-sheet peak
    power_w: float  # board power


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds per message, one way
    kind: str = ""
    # True when every pair of devices has its own link (xGMI full mesh): messages to different
    # peers travel at the same time. False when they share one pipe (PCIe via the host, a NIC,
    # a switch port): their transfer times add up.
    per_peer: bool = False

    def message_time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Links:
    intra_host: Link
    inter_host: Link

    def between(self, a: Device, b: Device) -> Link | None:
        """The link a message from device a to device b crosses (None: same device)."""
        if a.rank == b.rank:
            return None
        return self.intra_host if a.host == b.host else self.inter_host


@dataclass(frozen=True)
class PlannedStage:
    index: int
    first_layer: int
    end_layer: int  # exclusive
    ranks: tuple[int, ...]

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


@dataclass(frozen=True)
class MemoryPolicy:
    """How the per-device reservations beyond the weights are sized."""

    headroom_fraction: float = 0.05  # of each device's capacity, left unused
    runtime_reserved_bytes: int = 1 << 30  # driver/CUDA context, allocator slack, per device
    prefill_chunk_tokens: int = 2048  # sizes the activation workspace
    cache_dtype_bytes: int = 2  # MLA latent cache (bf16)
    activation_dtype_bytes: int = 2  # activations on the wire (bf16)

    def __post_init__(self):
        if not 0 <= self.headroom_fraction < 1:
            raise ValueError("headroom_fraction must lie in [0, 1)")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")


@dataclass
class DeviceMemory:
    rank: int
    weights_dense: int
    weights_experts: int
    kda_state: int
    mla_cache: int
    buffers: int
    headroom: int
    capacity: int

    @property
    def total(self) -> int:
        return self.weights_dense + self.weights_experts + self.kda_state + self.mla_cache + self.buffers + self.headroom

    @property
    def free(self) -> int:
        return self.capacity - self.total

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        d["free"] = self.free
        return d


def buffer_bytes(config: ModelConfig, homed_layers: list[int], holds_experts: bool, policy: MemoryPolicy,
                 last_hop: int | None = None) -> int:
    """Runtime reserve plus activation workspace for one prefill chunk and its messages. `last_hop`: the widest
    residual state the ranks move is the one entering that layer (the block's stop; default num_layers, the
    head)."""
    chunk, D = policy.prefill_chunk_tokens, config.hidden_size
    sources = attn_res_sources(config, config.num_layers if last_hop is None else last_hop)
    total = policy.runtime_reserved_bytes
    if homed_layers:
        widest = 0
        for layer in homed_layers:
            if config.is_mla(layer):
                w = config.mla_heads * (config.qk_head_dim + config.qk_nope_head_dim + 2 * config.v_head_dim)
            else:
                w = 5 * config.kda_proj_size
            if config.is_moe(layer):
                w = max(w, 2 * config.shared_expert_intermediate_size + config.latent_size)
            else:
                w = max(w, 2 * config.dense_intermediate_size)
            widest = max(widest, w)
        total += chunk * 4 * (D * (sources + 2) + widest)  # fp32 working set
    if holds_experts:
        total += chunk * 4 * (config.latent_size + 2 * config.expert_intermediate_size)
    total += 2 * chunk * D * sources * policy.activation_dtype_bytes  # send + receive buffers
    return total


def compute_memory(
    config: ModelConfig,
    devices: list[Device],
    layer_home: list[int],
    expert_placement: dict[int, list[list[int]]],
    embedding_rank: int,
    lm_head_rank: int,
    concurrency: int,
    context: int,
    policy: MemoryPolicy,
    dense_groups: dict[int, tuple[int, ...]] | None = None,
    lm_head_group: tuple[int, ...] = (),
    dense_dtype: str = "bf16",
    layer_range: tuple[int, int] | None = None,
) -> list[DeviceMemory]:
    """Per-device memory of a layout: the one accounting both the planner and validation use.

    A split layer's dense weights are divided over its group as the runtime reads them (`split_layer_bytes`:
    the split tensors evenly, the low-rank ones on every rank, the rest on the home; each also holds a KDA
    state or MLA cache share: its heads' KDA state, a full MLA latent cache); fp8 halves the dense weight
    bytes. `layer_range` [start, stop) (a block plan): only those layers' weights, experts and per-session
    state count, the embedding only when start == 0, the final norm and LM head only when stop == num_layers;
    homes and placements outside it are ignored."""
    start, stop = layer_range or (0, config.num_layers)
    n = len(devices)
    dense = [0] * n
    experts = [0] * n
    kda = [0] * n
    mla = [0] * n
    homed: list[list[int]] = [[] for _ in range(n)]
    kda_per_layer = kda_reserve_per_layer(config, concurrency)
    mla_per_layer = mla_reserve_per_layer(config, concurrency, context, policy.cache_dtype_bytes)
    scale = DENSE_DTYPE_SCALE.get(dense_dtype, 1.0)
    groups = dense_groups or {}
    for layer in range(start, stop):
        home = layer_home[layer]
        group = groups.get(layer) or (home,)
        home_bytes, other_bytes = split_layer_bytes(config, layer, len(group))
        for r in group:
            dense[r] += int((home_bytes if r == home else other_bytes) * scale)
            if config.is_mla(layer):
                mla[r] += mla_per_layer
            else:
                kda[r] += kda_per_layer // len(group)
        homed[home].append(layer)
    eb = config.expert_bytes()
    for layer, holders in expert_placement.items():
        if not start <= layer < stop:
            continue
        counts = np.bincount(np.fromiter((r for h in holders for r in h), dtype=np.int64), minlength=n)
        for r in range(n):
            experts[r] += int(counts[r]) * eb
    if start == 0:
        dense[embedding_rank] += embedding_bytes(config)
    if stop == config.num_layers:
        head_group = lm_head_group or (lm_head_rank,)
        for r, nbytes in zip(head_group, split_head_bytes(config, len(head_group))):
            dense[r] += int(nbytes * scale)
    out = []
    for d in devices:
        r = d.rank
        out.append(DeviceMemory(
            rank=r,
            weights_dense=dense[r],
            weights_experts=experts[r],
            kda_state=kda[r],
            mla_cache=mla[r],
            buffers=buffer_bytes(config, homed[r], experts[r] > 0, policy, stop),
            headroom=int(policy.headroom_fraction * d.memory_bytes),
            capacity=d.memory_bytes,
        ))
    return out


# ============================================================== the plan
@dataclass
class Plan:
    config_hash: str
    hf_config: dict
    preset: str | None
    devices: list[Device]
    links: Links
    stages: list[PlannedStage]
    layer_home: list[int | None]  # index = layer; None: outside a block plan's layer_range
    expert_placement: dict[int, list[list[int]]]  # MoE layer -> [expert id] -> ranks, primary first
    embedding_rank: int
    lm_head_rank: int
    concurrency: int
    context: int
    memory: list[DeviceMemory]  # index = rank
    memory_policy: MemoryPolicy = field(default_factory=MemoryPolicy)
    prediction: dict = field(default_factory=dict)
    cluster_name: str = ""
    dense_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)  # split layer -> ranks, home first
    lm_head_group: tuple[int, ...] = ()  # ranks splitting the LM head, lm_head_rank first (empty: it alone)
    dense_dtype: str = "bf16"
    layer_range: tuple[int, int] | None = None  # a block plan's [start, stop); None: the whole model

    # ---------------------------------------------------------------- queries
    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def block(self) -> range:
        """The layers this plan places: its layer_range, or every layer."""
        start, stop = self.layer_range or (0, len(self.layer_home))
        return range(start, stop)

    @property
    def has_embedding(self) -> bool:
        return self.block.start == 0

    @property
    def has_head(self) -> bool:
        return self.block.stop == len(self.layer_home)

    def covers(self, start: int, stop: int) -> bool:
        """Whether the layers [start, stop) all lie in this plan's block."""
        return self.block.start <= start < stop <= self.block.stop

    def _placed(self, layer: int) -> None:
        if layer not in self.block:
            raise PlanError(f"layer {layer} is outside this plan's block [{self.block.start}, {self.block.stop})")

    def model_config(self) -> ModelConfig:
        config = ModelConfig.from_hf_config(self.hf_config)
        if config.config_hash() != self.config_hash:
            raise PlanError("the plan's hf_config does not match its config_hash")
        return config

    def stage_of(self, layer: int) -> PlannedStage:
        for stage in self.stages:
            if stage.first_layer <= layer < stage.end_layer:
                return stage
        raise PlanError(f"layer {layer} is in no stage")

    def home_of(self, layer: int) -> int:
        self._placed(layer)
        return self.layer_home[layer]

    def expert_holders(self, layer: int, expert: int) -> list[int]:
        if layer not in self.expert_placement:
            raise PlanError(f"layer {layer} has no routed experts")
        return list(self.expert_placement[layer][expert])

    def ranks_for_layer(self, layer: int) -> list[int]:
        """Every rank holding part of `layer`: its home and every expert holder."""
        self._placed(layer)
        ranks = {self.layer_home[layer]}
        for holders in self.expert_placement.get(layer, ()):
            ranks.update(holders)
        return sorted(ranks)

    def layers_homed_on(self, rank: int) -> list[int]:
        return [layer for layer, home in enumerate(self.layer_home) if home == rank]

    def dense_group(self, layer: int) -> tuple[int, ...]:
        """The ranks doing layer `layer`'s dense work, its home first (the home alone when not split)."""
        self._placed(layer)
        return self.dense_groups.get(layer) or (self.layer_home[layer],)

    def head_group(self) -> tuple[int, ...]:
        """The ranks computing the LM head, lm_head_rank first."""
        return self.lm_head_group or (self.lm_head_rank,)

    def layers_split_with(self, rank: int) -> list[int]:
        """Layers whose dense work `rank` shares without being their home."""
        return [layer for layer, group in sorted(self.dense_groups.items())
                if rank in group and self.layer_home[layer] != rank]

    @property
    def dense_split(self) -> int:
        """The largest dense-split group (1: no layer is split)."""
        return max([len(g) for g in self.dense_groups.values()] + [len(self.head_group())])

    def with_dense_split(self, config: ModelConfig, parts: int, dense_dtype: str | None = None) -> "Plan":
        """This plan with every layer's dense work (and the LM head) split over `parts` ranks of its home's host
        and stage: the home, then the ranks of that host in the stage with the most memory left (greedy, layer
        by layer, so the moved weights land where they fit); a block plan splits its block's layers, and the head
        when it has it. PlanError if a stage has fewer than `parts` ranks on a host, the heads / hidden units do
        not divide by `parts`, or a device overflows."""
        if parts < 1:
            raise PlanError("a dense split needs at least 1 part")
        dtype = self.dense_dtype if dense_dtype is None else dense_dtype
        groups: dict[int, tuple[int, ...]] = {}
        head_group: tuple[int, ...] = ()
        if parts > 1:
            base = compute_memory(config, self.devices, self.layer_home, self.expert_placement, self.embedding_rank,
                                  self.lm_head_rank, self.concurrency, self.context, self.memory_policy,
                                  dense_dtype=dtype, layer_range=self.layer_range)
            free = {m.rank: m.free for m in base}
            scale = DENSE_DTYPE_SCALE[dtype]
            jobs = [(layer, self.stage_of(layer), self.layer_home[layer], layer_weights(config, layer).total_bytes)
                    for layer in self.block]
            if self.has_head:
                jobs.append((None, self.stages[-1], self.lm_head_rank, lm_head_bytes(config)))
            for layer, stage, home, nbytes in sorted(jobs, key=lambda j: -j[3]):  # biggest first
                what = "the LM head" if layer is None else f"layer {layer}"
                self._host_group(stage, home, parts, what)  # enough ranks on the host, or PlanError
                host = [r for r in stage.ranks if self.devices[r].host == self.devices[home].host and r != home]
                peers = sorted(sorted(host, key=lambda r: (-free[r], r))[: parts - 1])
                share = int(nbytes * scale) // parts
                free[home] += int(nbytes * scale) - share
                for r in peers:
                    free[r] -= share
                group = (home, *peers)
                if layer is None:
                    head_group = group
                else:
                    groups[layer] = group
        return self.with_dense_groups(config, groups, head_group, dtype)

    def with_dense_groups(self, config: ModelConfig, groups: dict[int, tuple[int, ...]],
                          head_group: tuple[int, ...] = (), dense_dtype: str | None = None) -> "Plan":
        """This plan with the given dense-split groups (layer -> ranks, home first; the LM head's) and dense
        dtype, its memory recomputed and the whole validated."""
        dtype = self.dense_dtype if dense_dtype is None else dense_dtype
        groups = {int(layer): tuple(g) for layer, g in groups.items() if len(g) > 1}
        head_group = tuple(head_group) if len(head_group) > 1 else ()
        plan = dataclasses.replace(self, dense_groups=groups, lm_head_group=head_group, dense_dtype=dtype,
                                   prediction={})
        plan.memory = compute_memory(config, plan.devices, plan.layer_home, plan.expert_placement,
                                     plan.embedding_rank, plan.lm_head_rank, plan.concurrency, plan.context,
                                     plan.memory_policy, groups, head_group, dtype, plan.layer_range)
        plan.validate(config)
        return plan

    def _host_group(self, stage: PlannedStage, home: int, parts: int, what: str) -> tuple[int, ...]:
        host = self.devices[home].host
        local = [r for r in stage.ranks if self.devices[r].host == host]
        if len(local) < parts:
            raise PlanError(f"{what}: stage {stage.index} has {len(local)} ranks on host {host}, a dense split "
                            f"over {parts} needs {parts}")
        i = local.index(home)
        return tuple(local[(i + j) % len(local)] for j in range(parts))

    def experts_on(self, rank: int) -> dict[int, list[int]]:
        """Layer -> expert ids a rank must load (primary copies and replicas)."""
        out: dict[int, list[int]] = {}
        for layer, holders in self.expert_placement.items():
            mine = [e for e, h in enumerate(holders) if rank in h]
            if mine:
                out[layer] = mine
        return out

    def replica_count(self, layer: int) -> int:
        return sum(len(h) - 1 for h in self.expert_placement[layer])

    # ------------------------------------------------------------- validation
    def validate(self, config: ModelConfig) -> None:
        """Raise PlanError listing every way this plan fails to place `config` on its devices."""
        problems: list[str] = []
        if config.config_hash() != self.config_hash:
            problems.append(
                f"plan was made for config hash {self.config_hash[:12]}..., this model is "
                f"{config.config_hash()[:12]}... ({config.model_id})"
            )
        n = len(self.devices)
        if [d.rank for d in self.devices] != list(range(n)):
            problems.append("device ranks must be 0..N-1 in order")
        ranks = set(range(n))
        start, stop = 0, config.num_layers
        if self.layer_range is not None:
            a, b = self.layer_range
            if not 0 <= a < b <= config.num_layers:
                problems.append(f"layer_range [{a}, {b}) is not a block of the model's {config.num_layers} layers")
            else:
                start, stop = a, b
        block = range(start, stop)
        # stages: contiguous, covering every layer of the block, disjoint device groups
        expected_first, seen_ranks = start, set()
        for i, st in enumerate(self.stages):
            if st.index != i:
                problems.append(f"stage {i} has index {st.index}")
            if st.first_layer != expected_first:
                problems.append(f"stage {i} starts at layer {st.first_layer}, expected {expected_first}")
            if st.end_layer <= st.first_layer:
                problems.append(f"stage {i} has no layers ([{st.first_layer}, {st.end_layer}))")
            expected_first = st.end_layer
            bad = [r for r in st.ranks if r not in ranks]
            if bad:
                problems.append(f"stage {i} lists unknown ranks {bad}")
            if not st.ranks:
                problems.append(f"stage {i} has no devices")
            if seen_ranks & set(st.ranks):
                problems.append(f"stage {i} shares ranks {sorted(seen_ranks & set(st.ranks))} with another stage")
            seen_ranks |= set(st.ranks)
        if expected_first != stop:
            whole = f"the block is [{start}, {stop})" if self.layer_range else f"the model has {config.num_layers}"
            problems.append(f"stages cover layers [{start}, {expected_first}), {whole}")
        if len(self.layer_home) != config.num_layers:
            problems.append(f"{len(self.layer_home)} layer homes for {config.num_layers} layers")
        outside = [layer for layer, home in enumerate(self.layer_home) if layer not in block and home is not None]
        if outside:
            problems.append(f"layers {outside} lie outside the block [{start}, {stop}) but have a home")
        stage_ranks = {}
        for layer in block if len(self.layer_home) == config.num_layers else ():
            try:
                st = self.stage_of(layer)
            except PlanError as exc:
                problems.append(str(exc))
                continue
            stage_ranks[layer] = set(st.ranks)
            if self.layer_home[layer] not in st.ranks:
                problems.append(f"layer {layer}: home rank {self.layer_home[layer]} is not in stage {st.index}")
        # experts
        moe = set(config.moe_layers) & set(block)
        for layer in sorted(set(self.expert_placement) - moe):
            problems.append(f"layer {layer} is not a MoE layer but has an expert placement" if layer in block else
                            f"layer {layer} lies outside the block [{start}, {stop}) but has an expert placement")
        for layer in sorted(moe):
            holders = self.expert_placement.get(layer)
            if holders is None:
                problems.append(f"MoE layer {layer} has no expert placement")
                continue
            if len(holders) != config.num_experts:
                problems.append(f"layer {layer}: {len(holders)} expert entries, the model has {config.num_experts}")
            allowed = stage_ranks.get(layer, ranks)
            for e, h in enumerate(holders):
                if not h:
                    problems.append(f"layer {layer}: expert {e} is on no device")
                elif len(set(h)) != len(h):
                    problems.append(f"layer {layer}: expert {e} lists a rank twice: {list(h)}")
                elif not set(h) <= allowed:
                    problems.append(
                        f"layer {layer}: expert {e} is on ranks {sorted(set(h) - allowed)} outside its stage"
                    )
                if len(problems) > 50:
                    break
        if self.stages:
            if self.embedding_rank not in self.stages[0].ranks:
                problems.append(f"embedding_rank {self.embedding_rank} is not in stage 0")
            if self.lm_head_rank not in self.stages[-1].ranks:
                problems.append(f"lm_head_rank {self.lm_head_rank} is not in the last stage")
        if self.concurrency < 1 or self.context < 1:
            problems.append("target concurrency and context must be >= 1")
        problems += self._dense_split_problems(config)
        # memory: the recorded breakdown must be the layout's, and must fit
        if not problems:
            fresh = compute_memory(config, self.devices, self.layer_home, self.expert_placement,
                                   self.embedding_rank, self.lm_head_rank, self.concurrency, self.context,
                                   self.memory_policy, self.dense_groups, self.lm_head_group, self.dense_dtype,
                                   self.layer_range)
            if len(self.memory) != n:
                problems.append(f"memory lists {len(self.memory)} devices, the plan has {n}")
            else:
                for rec, want in zip(self.memory, fresh):
                    for name in ("weights_dense", "weights_experts", "kda_state", "mla_cache", "capacity"):
                        if getattr(rec, name) != getattr(want, name):
                            problems.append(
                                f"rank {rec.rank}: memory.{name} is {getattr(rec, name)} but the layout "
                                f"needs {getattr(want, name)}"
                            )
                    if rec.capacity != self.devices[rec.rank].memory_bytes:
                        problems.append(f"rank {rec.rank}: memory capacity differs from the device's memory")
                    if rec.total > rec.capacity:
                        d = self.devices[rec.rank]
                        problems.append(
                            f"rank {rec.rank} ({d.host}, {d.kind}) needs {_gb(rec.total)} but has "
                            f"{_gb(rec.capacity)}: overflows by {_gb(rec.total - rec.capacity)}"
                        )
        if problems:
            shown = problems[:20]
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            raise PlanError("invalid plan: " + "; ".join(shown) + more)

    def _dense_split_problems(self, config: ModelConfig) -> list[str]:
        """Dense-split groups: one host, inside the layer's stage, home first, and sizes the weights divide by."""
        problems = []
        if self.dense_dtype not in DENSE_DTYPES:
            problems.append(f"dense_dtype must be one of {DENSE_DTYPES}, got {self.dense_dtype!r}")
        n = len(self.devices)
        checks = [(f"layer {layer}", layer, group) for layer, group in sorted(self.dense_groups.items())]
        if self.lm_head_group:
            if self.layer_range is not None and self.layer_range[1] != config.num_layers:
                problems.append(f"lm_head_split {list(self.lm_head_group)}, but the block "
                                f"[{self.layer_range[0]}, {self.layer_range[1]}) has no LM head")
            else:
                checks.append(("the LM head", None, self.lm_head_group))
        for what, layer, group in checks:
            if layer is not None and not 0 <= layer < min(config.num_layers, len(self.layer_home)):
                problems.append(f"dense_split for {what}, which does not exist")
                continue
            if layer is not None and self.layer_home[layer] is None:
                problems.append(f"dense_split for {what}, which lies outside the plan's block")
                continue
            home = self.layer_home[layer] if layer is not None else self.lm_head_rank
            if not group or group[0] != home:
                problems.append(f"{what}: dense_split must start with its home rank {home}, got {list(group)}")
                continue
            if len(set(group)) != len(group) or not all(0 <= r < n for r in group):
                problems.append(f"{what}: dense_split {list(group)} must list distinct ranks of the plan")
                continue
            hosts = {self.devices[r].host for r in group}
            if len(hosts) > 1:
                problems.append(f"{what}: dense_split {list(group)} spans hosts {sorted(hosts)}; a split stays "
                                "inside one host")
            try:
                stage = self.stage_of(layer) if layer is not None else self.stages[-1]
            except (PlanError, IndexError):
                continue
            if not set(group) <= set(stage.ranks):
                problems.append(f"{what}: dense_split {list(group)} leaves stage {stage.index}")
            parts = len(group)
            if layer is not None and parts > 1:
                heads = config.mla_heads if config.is_mla(layer) else config.kda_heads
                units = (config.shared_expert_intermediate_size if config.is_moe(layer)
                         else config.dense_intermediate_size)
                if heads % parts or (units and units % parts):
                    problems.append(f"{what}: {heads} heads and {units} MLP units do not divide by {parts}")
        return problems

    # ---------------------------------------------------------------- file io
    def to_dict(self) -> dict:
        config_layers = []
        moe_cfg = None
        try:
            moe_cfg = self.model_config()
        except (PlanError, ConfigError):
            pass
        for layer in self.block:
            home = self.layer_home[layer]
            stage = self.stage_of(layer).index
            holders = self.expert_placement.get(layer)
            rec = {
                "layer": layer,
                "attention": ("mla" if moe_cfg.is_mla(layer) else "kda") if moe_cfg else None,
                "mlp": "moe" if holders is not None else "dense",
                "stage": stage,
                "home": home,
                "experts": [list(h) for h in holders] if holders is not None else None,
            }
            if layer in self.dense_groups:
                rec["dense_split"] = list(self.dense_groups[layer])
            config_layers.append(rec)
        return {
            "format": PLAN_FORMAT,
            "conventions": CONVENTIONS,
            "cluster": self.cluster_name,
            "model": {
                "model_id": self.hf_config.get("model_id", ""),
                "preset": self.preset,
                "config_hash": self.config_hash,
                "hf_config": self.hf_config,
            },
            "target": {"concurrency": self.concurrency, "context": self.context},
            "memory_policy": dataclasses.asdict(self.memory_policy),
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "links": {"intra_host": dataclasses.asdict(self.links.intra_host),
                      "inter_host": dataclasses.asdict(self.links.inter_host)},
            **({"layer_range": list(self.layer_range)} if self.layer_range is not None else {}),
            "stages": [{"index": s.index, "layers": [s.first_layer, s.end_layer], "ranks": list(s.ranks)}
                       for s in self.stages],
            "embedding_rank": self.embedding_rank,
            "lm_head_rank": self.lm_head_rank,
            **({"lm_head_split": list(self.lm_head_group)} if self.lm_head_group else {}),
            "dense_dtype": self.dense_dtype,
            "layers": config_layers,
            "memory": [m.to_dict() for m in self.memory],
            "prediction": self.prediction,
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        data = self.to_dict()
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=1) + "\n")
        elif path.suffix in (".yaml", ".yml"):
            header = (f"# Placement plan ({PLAN_FORMAT}) for {data['model']['model_id']} on "
                      f"{self.cluster_name or 'local ranks'}. Format: inference/planning/plan.py.\n")
            body = yaml.dump(data, Dumper=_PlanDumper, sort_keys=False, default_flow_style=False, width=120)
            path.write_text(header + body)
        else:
            raise PlanError(f"{path}: plan files end in .yaml, .yml or .json")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}") from None
        try:
            if path.suffix == ".json":
                data = json.loads(text)
            else:
                data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise PlanError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        r = _Reader(source)
        r.mapping(data, "")
        fmt = data.get("format")
        if fmt != PLAN_FORMAT:
            raise PlanError(f"{source}: format is {fmt!r}, expected {PLAN_FORMAT!r}")
        model = r.get(data, "model", dict)
        devices = []
        for i, d in enumerate(r.get(data, "devices", list)):
            w = f"devices[{i}]"
            r.mapping(d, w)
            devices.append(Device(
                rank=r.get(d, "rank", int, w), host=str(r.get(d, "host", (str, int), w)),
                kind=r.get(d, "kind", str, w), memory_bytes=r.get(d, "memory_bytes", int, w),
                mem_bandwidth=float(r.get(d, "mem_bandwidth", (int, float), w)),
                flops=float(r.get(d, "flops", (int, float), w)),
                power_w=float(r.get(d, "power_w", (int, float), w)),
            ))
        links_d = r.get(data, "links", dict)
        links = Links(*(r.link(links_d, name) for name in ("intra_host", "inter_host")))
        stages = []
        for i, s in enumerate(r.get(data, "stages", list)):
            w = f"stages[{i}]"
            r.mapping(s, w)
            lay = r.get(s, "layers", list, w)
            if len(lay) != 2 or not all(isinstance(x, int) for x in lay):
                raise PlanError(f"{source}: {w}.layers must be [first, end] (half-open), got {lay!r}")
            stages.append(PlannedStage(index=r.get(s, "index", int, w), first_layer=lay[0], end_layer=lay[1],
                                ranks=tuple(r.int_list(r.get(s, "ranks", list, w), f"{w}.ranks"))))
        layer_range = None
        if data.get("layer_range") is not None:
            value = data["layer_range"]
            ok = isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            layer_range = tuple(value) if ok else ()
            if len(layer_range) != 2 or not 0 <= layer_range[0] < layer_range[1]:
                raise PlanError(f"{source}: layer_range must be [start, stop) with 0 <= start < stop, "
                                f"got {data['layer_range']!r}")
            try:
                num_layers = ModelConfig.from_hf_config(r.get(model, "hf_config", dict, "model")).num_layers
            except (ConfigError, TypeError, ValueError, KeyError) as exc:
                raise PlanError(f"{source}: model.hf_config is not a model config ({exc})") from None
            if num_layers < layer_range[1]:
                raise PlanError(f"{source}: layer_range {list(layer_range)} does not fit the model's {num_layers} "
                                "layers")
        first = layer_range[0] if layer_range else 0
        layer_home, placement, dense_groups = [None] * first, {}, {}
        records = r.get(data, "layers", list)
        if layer_range and len(records) != layer_range[1] - first:
            raise PlanError(f"{source}: layers lists {len(records)} records, the block [{first}, {layer_range[1]}) "
                            f"has {layer_range[1] - first} layers")
        for i, rec in enumerate(records, start=first):
            w = f"layers[{i - first}]"
            r.mapping(rec, w)
            if r.get(rec, "layer", int, w) != i:
                raise PlanError(f"{source}: {w}.layer is {rec['layer']}, layers must be listed in order from "
                                f"{first}")
            layer_home.append(r.get(rec, "home", int, w))
            if rec.get("dense_split") is not None:
                group = tuple(r.int_list(rec["dense_split"], f"{w}.dense_split"))
                if len(group) > 1:
                    dense_groups[i] = group
            experts = rec.get("experts")
            if experts is not None:
                if not isinstance(experts, list):
                    raise PlanError(f"{source}: {w}.experts must be a list of rank lists or null")
                placement[i] = [r.int_list(h, f"{w}.experts[{e}]") for e, h in enumerate(experts)]
        if layer_range:  # the layers after the block have no home either
            layer_home += [None] * (num_layers - layer_range[1])
        head_group = tuple(r.int_list(data.get("lm_head_split") or [], "lm_head_split"))
        dense_dtype = data.get("dense_dtype", "bf16")
        if dense_dtype not in DENSE_DTYPES:
            raise PlanError(f"{source}: dense_dtype must be one of {', '.join(DENSE_DTYPES)}, got {dense_dtype!r}")
        target = r.get(data, "target", dict)
        policy_d = r.get(data, "memory_policy", dict)
        try:
            policy = MemoryPolicy(**policy_d)
        except TypeError as exc:
            raise PlanError(f"{source}: memory_policy: {exc}") from None
        memory = []
        for i, m in enumerate(r.get(data, "memory", list)):
            w = f"memory[{i}]"
            r.mapping(m, w)
            memory.append(DeviceMemory(**{k: r.get(m, k, int, w) for k in (
                "rank", "weights_dense", "weights_experts", "kda_state", "mla_cache", "buffers", "headroom",
                "capacity")}))
        return cls(
            config_hash=r.get(model, "config_hash", str, "model"),
            hf_config=r.get(model, "hf_config", dict, "model"),
            preset=model.get("preset"),
            devices=devices,
            links=links,
            stages=stages,
            layer_home=layer_home,
            expert_placement=placement,
            embedding_rank=r.get(data, "embedding_rank", int),
            lm_head_rank=r.get(data, "lm_head_rank", int),
            concurrency=r.get(target, "concurrency", int, "target"),
            context=r.get(target, "context", int, "target"),
            memory=memory,
            memory_policy=policy,
            prediction=data.get("prediction") or {},
            cluster_name=str(data.get("cluster") or ""),
            dense_groups=dense_groups,
            lm_head_group=head_group if len(head_group) > 1 else (),
            dense_dtype=dense_dtype,
            layer_range=layer_range,
        )

    # ------------------------------------------------------- local plans
    @classmethod
    def simple(
        cls,
        config: ModelConfig,
        num_ranks: int,
        mode: str = "pipeline",
        replicas: int = 0,
        *,
        stages: int = 2,
        concurrency: int = 1,
        context: int = 4096,
        memory_bytes: int | None = None,
        policy: MemoryPolicy | None = None,
        preset: str | None = None,
        dense_split: int = 1,
        dense_dtype: str = "bf16",
        layer_range: tuple[int, int] | None = None,
        device: str = "cpu",
    ) -> "Plan":
        """A plan for `num_ranks` local processes on one host, without a cluster file.

        `layer_range` [start, stop): a block plan placing only those layers (a swarm stage's block; what the
        modes below split is then the block's layers, not the model's).
        `dense_split` > 1 splits every layer's dense work (and the LM head) over that many ranks of its stage
        (`with_dense_split`); `dense_dtype` "fp8" stores the dense weights in float8 e4m3.
        mode "pipeline": one stage per rank, layers split evenly, each layer's experts with it.
        mode "expert":   one stage over all ranks; home ranks rotate layer by layer; experts
                         spread round-robin (shifted per layer so every rank gets work).
        mode "both":     `stages` stages over contiguous rank groups, experts spread in each.
        `replicas` extra copies per MoE layer (experts 0, 1, ... get a second copy on another
        rank of their stage; needs stages of at least two ranks).
        `memory_bytes` per process defaults to what this machine has (`local_devices`): its memory split evenly
        (`device` "cpu"), or each GPU's free memory now (`device` "cuda": rank r on GPU r).
        """
        if num_ranks < 1:
            raise PlanError("num_ranks must be >= 1")
        if mode not in ("pipeline", "expert", "both"):
            raise PlanError(f"mode must be 'pipeline', 'expert' or 'both', got {mode!r}")
        L, E = config.num_layers, config.num_experts
        if layer_range is not None:
            layer_range = (int(layer_range[0]), int(layer_range[1]))
            if not 0 <= layer_range[0] < layer_range[1] <= L:
                raise PlanError(f"layer_range {list(layer_range)} is not a block [start, stop) of 0..{L}")
            if layer_range == (0, L):
                layer_range = None  # the whole model
        block = list(range(*(layer_range or (0, L))))
        if mode == "pipeline":
            groups = [[r] for r in range(num_ranks)]
        elif mode == "expert":
            groups = [list(range(num_ranks))]
        else:
            if num_ranks < 3 or stages < 2 or stages >= num_ranks:
                raise PlanError(f"mode 'both' needs at least 3 ranks and 2 <= stages < ranks "
                                f"(got {num_ranks} ranks, {stages} stages)")
            groups = [list(g) for g in _split_even(list(range(num_ranks)), stages, extra_last=True)]
        if len(groups) > len(block):
            raise PlanError(f"{len(groups)} stages for {len(block)} layers: every stage needs a layer")
        if replicas < 0:
            raise PlanError("replicas must be >= 0")
        if replicas and any(len(g) < 2 for g in groups):
            raise PlanError(f"replicas need at least two ranks in every stage (mode {mode!r}, {num_ranks} ranks)")
        if replicas > E * (min(len(g) for g in groups) - 1):
            raise PlanError(f"at most {E * (min(len(g) for g in groups) - 1)} replicas fit per layer")
        layer_groups = _split_even(block, len(groups), extra_last=False)
        stage_list, layer_home, placement = [], [0 if layer_range is None else None] * L, {}
        for s, (ranks, layers) in enumerate(zip(groups, layer_groups)):
            stage_list.append(PlannedStage(s, layers[0], layers[-1] + 1, tuple(ranks)))
            G = len(ranks)
            for i, layer in enumerate(layers):
                layer_home[layer] = ranks[i % G] if mode != "both" else ranks[(layer + s) % G]
                if not config.is_moe(layer):
                    continue
                holders = [[ranks[(e + layer) % G]] for e in range(E)]
                for j in range(replicas):
                    e = j % E
                    taken = holders[e]
                    spare = [r for r in ranks if r not in taken]
                    holders[e] = taken + [spare[(j // E) % len(spare)]]
                placement[layer] = holders
        local = local_devices(num_ranks, device)
        if memory_bytes is not None:
            local = [(kind, memory_bytes) for kind, _ in local]
        policy = policy or MemoryPolicy(runtime_reserved_bytes=64 << 20, prefill_chunk_tokens=512)
        devices = [Device(rank=r, host="localhost", kind=kind, memory_bytes=memory, mem_bandwidth=10e9, flops=100e9,
                          power_w=0.0) for r, (kind, memory) in enumerate(local)]
        loopback = Link(bandwidth=2e9, latency=75e-6, kind="loopback gloo")
        embedding_rank, lm_head_rank = layer_home[block[0]], layer_home[block[-1]]
        memory = compute_memory(config, devices, layer_home, placement, embedding_rank, lm_head_rank,
                                concurrency, context, policy, layer_range=layer_range)
        where = f"-layers{layer_range[0]}-{layer_range[1]}" if layer_range else ""
        plan = cls(
            config_hash=config.config_hash(), hf_config=config.to_hf_config(), preset=preset,
            devices=devices, links=Links(loopback, loopback), stages=stage_list, layer_home=layer_home,
            expert_placement=placement, embedding_rank=embedding_rank, lm_head_rank=lm_head_rank,
            concurrency=concurrency, context=context, memory=memory, memory_policy=policy,
            cluster_name=f"local-{mode}-{num_ranks}{where}", layer_range=layer_range,
        )
        plan.validate(config)
        if dense_split > 1 or dense_dtype != "bf16":
            plan = plan.with_dense_split(config, dense_split, dense_dtype)
            plan.cluster_name = f"local-{mode}-{num_ranks}{where}-split{dense_split}-{dense_dtype}"
        return plan


def local_devices(num_ranks: int, device: str = "cpu") -> list[tuple[str, int]]:
    """(kind, memory bytes) of each of `num_ranks` local processes. "cpu": this machine's memory split evenly.
    "cuda": rank r on GPU r % count (the sharded runtime's placement), each GPU's free memory as the driver reports
    it now (torch.cuda.mem_get_info: what other processes hold is not counted), split among the ranks it hosts."""
    if device == "cpu":
        import psutil  # only local plans look at this machine

        return [("cpu-process", int(psutil.virtual_memory().total // num_ranks))] * num_ranks
    if device != "cuda":
        raise PlanError(f"a local plan places ranks on the CPU or on this host's GPUs (cpu, cuda), not {device!r}")
    if not torch.cuda.is_available():
        raise PlanError("a local plan on GPUs needs CUDA, and torch.cuda.is_available() is false here")
    count = torch.cuda.device_count()
    out = []
    for rank in range(num_ranks):
        gpu = rank % count
        free, _ = torch.cuda.mem_get_info(gpu)
        out.append((f"cuda:{gpu} {torch.cuda.get_device_name(gpu)}", int(free // len(range(gpu, num_ranks, count)))))
    return out


class _PlanDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Block style for mappings, one line for a list of scalars (rank lists, layer ranges)."""


def _represent_list(dumper, data):
    flat = all(not isinstance(x, (list, tuple, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_PlanDumper.add_representer(list, _represent_list)


def _split_even(items: list, parts: int, extra_last: bool) -> list[list]:
    """Contiguous split into `parts` groups whose sizes differ by at most one."""
    q, rem = divmod(len(items), parts)
    sizes = [q + (1 if (i >= parts - rem if extra_last else i < rem) else 0) for i in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append(items[start:start + size])
        start += size
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


class _Reader:
    """Field access with errors that name the file and the field."""

    def __init__(self, source: str):
        self.source = source

    def mapping(self, value, where: str):
        if not isinstance(value, dict):
            raise PlanError(f"{self.source}: {where or 'top level'} must be a mapping, got {type(value).__name__}")

    def get(self, d: dict, key: str, kind, where: str = ""):
        name = f"{where}.{key}" if where else key
        if key not in d:
            raise PlanError(f"{self.source}: missing field {name}")
        value = d[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise PlanError(f"{self.source}: {name} must be {want}, got {value!r}")
        return value

    def int_list(self, value, where: str) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise PlanError(f"{self.source}: {where} must be a list of integer ranks, got {value!r}")
        return list(value)

    def link(self, links: dict, name: str) -> Link:
        d = self.get(links, name, dict, "links")
        w = f"links.{name}"
        bw = float(self.get(d, "bandwidth", (int, float), w))
        lat = float(self.get(d, "latency", (int, float), w))
        if bw <= 0 or lat < 0:
            raise PlanError(f"{self.source}: {w} needs bandwidth > 0 and latency >= 0")
        per_peer = d.get("per_peer", False)
        if not isinstance(per_peer, bool):
            raise PlanError(f"{self.source}: {w}.per_peer must be true or false")
        return Link(bandwidth=bw, latency=lat, kind=str(d.get("kind", "")), per_peer=per_peer)


# ============================================================== routing statistics
@dataclass
class LayerRouting:
    """Routing counts of one MoE layer over `tokens` routed tokens."""

    tokens: int
    load: np.ndarray  # [E] int64: tokens that selected each expert
    pair_i: np.ndarray  # [P] int64, i < j
    pair_j: np.ndarray
    pair_count: np.ndarray  # [P] int64: tokens that selected both i and j

    def selection_probability(self) -> np.ndarray:
        """Per expert, the probability that a token selects it (sums to top-k)."""
        return np.clip(self.load / max(self.tokens, 1), 0.0, 1.0)

    def pair_probability(self) -> np.ndarray:
        return self.pair_count / max(self.tokens, 1)

    @property
    def has_coactivation(self) -> bool:
        return len(self.pair_count) > 0


class RoutingStats:
    """Expert load and co-activation per MoE layer, gathered by the runtime.

    JSON file (`format: k3-routing-stats/1`):

        {"format": "k3-routing-stats/1",
         "num_experts": 896, "experts_per_token": 16,
         "layers": {"<layer>": {"tokens": n,                # tokens routed through this layer
                                "load": [c_0, ..., c_E-1],  # tokens that selected each expert
                                "coactivation": {"i": [...], "j": [...], "count": [...]}}}}

    `coactivation` counts, per unordered pair i != j, the tokens that selected both; each pair
    appears at most once. It is written column-wise as above (parallel lists: fast to parse
    at 896 experts), and also read as triplets `[[i, j, count], ...]`. A layer may instead
    give `coactivation_matrix` (dense E x E, symmetric, diagonal ignored), or neither (the
    cost model then treats the k selections as independent). Layer keys are zero-based
    decoder layer indices written as strings.
    """

    def __init__(self, num_experts: int, experts_per_token: int, layers: dict[int, LayerRouting] | None = None):
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.layers: dict[int, LayerRouting] = layers or {}

    # -------------------------------------------------------------- gathering
    def add(self, layer: int, expert_ids) -> None:
        """Count one batch of routing decisions: `expert_ids` is [tokens, top_k] expert indices."""
        ids = np.asarray(expert_ids, dtype=np.int64)
        if ids.ndim != 2:
            raise ValueError("expert_ids must be [tokens, top_k]")
        E = self.num_experts
        if ids.size and (ids.min() < 0 or ids.max() >= E):
            raise ValueError(f"expert ids must lie in 0..{E - 1}")
        rec = self.layers.get(layer)
        load = np.bincount(ids.ravel(), minlength=E).astype(np.int64)
        codes = np.zeros(0, dtype=np.int64)
        if ids.shape[1] > 1:
            s = np.sort(ids, axis=1)
            a, b = np.triu_indices(ids.shape[1], 1)
            codes = (s[:, a] * E + s[:, b]).ravel()
        counts = np.ones(len(codes), dtype=np.int64)
        if rec is not None:
            codes = np.concatenate([rec.pair_i * E + rec.pair_j, codes])
            counts = np.concatenate([rec.pair_count, counts])
            load = load + rec.load
        unique, inverse = np.unique(codes, return_inverse=True)
        merged = np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)
        tokens = ids.shape[0] + (rec.tokens if rec else 0)
        self.layers[layer] = LayerRouting(tokens, load, unique // E, unique % E, merged)

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict:
        return {
            "format": ROUTING_FORMAT,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "layers": {
                str(layer): {
                    "tokens": int(rec.tokens),
                    "load": rec.load.tolist(),
                    "coactivation": {"i": rec.pair_i.tolist(), "j": rec.pair_j.tolist(),
                                     "count": rec.pair_count.tolist()},
                }
                for layer, rec in sorted(self.layers.items())
            },
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RoutingStats":
        return cls.from_dict(read_document(path, PlanError, "routing statistics"), source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "routing stats") -> "RoutingStats":
        if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
            raise PlanError(f"{source}: expected an object with a 'layers' mapping")
        if data.get("format", ROUTING_FORMAT) != ROUTING_FORMAT:
            raise PlanError(f"{source}: format is {data.get('format')!r}, expected {ROUTING_FORMAT!r}")
        layers: dict[int, LayerRouting] = {}
        num_experts = data.get("num_experts")
        for key, rec in data["layers"].items():
            where = f"{source}: layers[{key!r}]"
            try:
                layer = int(key)
            except ValueError:
                raise PlanError(f"{where}: layer keys must be integers") from None
            if not isinstance(rec, dict) or "load" not in rec or "tokens" not in rec:
                raise PlanError(f"{where}: needs 'tokens' and 'load'")
            load = np.asarray(rec["load"])
            if load.ndim != 1 or not np.issubdtype(load.dtype, np.integer) or (load < 0).any():
                raise PlanError(f"{where}: load must be a list of non-negative integer counts")
            num_experts = num_experts or len(load)
            if len(load) != num_experts:
                raise PlanError(f"{where}: load has {len(load)} entries, expected {num_experts}")
            tokens = rec["tokens"]
            if not isinstance(tokens, int) or tokens < 0:
                raise PlanError(f"{where}: tokens must be a non-negative integer")
            if rec.get("coactivation") is not None and rec.get("coactivation_matrix") is not None:
                raise PlanError(f"{where}: give coactivation or coactivation_matrix, not both")
            if rec.get("coactivation_matrix") is not None:
                pi, pj, pc = _parse_coactivation_matrix(rec["coactivation_matrix"], num_experts, where)
            else:
                pi, pj, pc = _parse_coactivation(rec.get("coactivation"), num_experts, where)
            layers[layer] = LayerRouting(tokens, load.astype(np.int64), pi, pj, pc)
        if num_experts is None:
            raise PlanError(f"{source}: no layers and no num_experts")
        k = data.get("experts_per_token")
        if k is None:
            k = max((int(round(r.load.sum() / r.tokens)) for r in layers.values() if r.tokens), default=1)
        return cls(int(num_experts), int(k), layers)

    def validate(self, config: ModelConfig) -> None:
        problems = []
        if self.num_experts != config.num_experts:
            problems.append(f"statistics are for {self.num_experts} experts, the model has {config.num_experts}")
        if self.experts_per_token != config.experts_per_token:
            problems.append(f"statistics are for top-{self.experts_per_token}, the model routes top-{config.experts_per_token}")
        moe = set(config.moe_layers)
        for layer, rec in self.layers.items():
            if layer not in moe:
                problems.append(f"layer {layer} is not a MoE layer")
            if rec.load.sum() > rec.tokens * config.experts_per_token:
                problems.append(f"layer {layer}: load sums to {rec.load.sum()}, more than tokens x top-k")
            if len(rec.pair_count) and rec.pair_count.max() > rec.tokens:
                problems.append(f"layer {layer}: a pair count exceeds the token count")
        if problems:
            raise PlanError("routing statistics do not fit the model: " + "; ".join(problems))


def _parse_coactivation_matrix(value, E: int, where: str):
    arr = np.asarray(value)
    if arr.shape != (E, E) or not np.issubdtype(arr.dtype, np.integer) or (arr < 0).any():
        raise PlanError(f"{where}: coactivation_matrix must be a {E} x {E} matrix of non-negative integers")
    if not (arr == arr.T).all():
        raise PlanError(f"{where}: coactivation_matrix is not symmetric")
    i, j = np.triu_indices(E, 1)
    keep = arr[i, j] > 0
    return i[keep].astype(np.int64), j[keep].astype(np.int64), arr[i, j][keep].astype(np.int64)


def _parse_coactivation(value, E: int, where: str):
    empty = (np.zeros(0, np.int64),) * 3
    if value is None or (isinstance(value, list) and not value):
        return empty
    if isinstance(value, dict):
        if set(value) != {"i", "j", "count"}:
            raise PlanError(f"{where}: coactivation columns must be exactly i, j and count")
        try:
            i, j, c = (np.array(value[key], dtype=np.int64) for key in ("i", "j", "count"))
        except (TypeError, ValueError, OverflowError):
            raise PlanError(f"{where}: coactivation columns must hold integers") from None
        if not (i.ndim == j.ndim == c.ndim == 1 and len(i) == len(j) == len(c)):
            raise PlanError(f"{where}: coactivation columns i, j, count must be lists of one length")
    else:
        arr = np.asarray(value)
        if arr.ndim != 2 or arr.shape[1] != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise PlanError(f"{where}: coactivation triplets must be [i, j, count]")
        i, j, c = arr[:, 0], arr[:, 1], arr[:, 2]
    if (i < 0).any() or (j < 0).any() or (i >= E).any() or (j >= E).any() or (i == j).any() or (c < 0).any():
        raise PlanError(f"{where}: coactivation pairs need 0 <= i != j < {E} and count >= 0")
    lo, hi = np.minimum(i, j), np.maximum(i, j)
    codes = lo * E + hi
    if len(np.unique(codes)) != len(codes):
        raise PlanError(f"{where}: a coactivation pair is listed twice")
    return lo.astype(np.int64), hi.astype(np.int64), c.astype(np.int64)


__all__ = [
    "Plan", "PlanError", "Device", "Link", "Links", "PlannedStage", "DeviceMemory", "MemoryPolicy",
    "LayerWeights", "LayerRouting", "RoutingStats", "layer_weights", "embedding_bytes", "lm_head_bytes",
    "split_layer_bytes", "split_head_bytes",
    "attn_res_sources", "compute_memory", "buffer_bytes", "kda_reserve_per_layer", "mla_reserve_per_layer",
    "PLAN_FORMAT", "ROUTING_FORMAT", "DENSE_DTYPES", "DENSE_DTYPE_SCALE", "local_devices",
]
