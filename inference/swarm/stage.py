"""A swarm stage: a contiguous block of Kimi K3 layers and the per-session state those layers need.

A `Stage` holds layers [start, stop) of the model, plus the embedding when start == 0 and the head (output
Attention Residuals site, final norm, lm_head) when stop == num_layers. It loads only those tensors (the one
checkpoint loader with `TensorSelection.stage`). What
crosses into and out of a stage is the `ResidualState` of the new tokens (the embedding and every completed
Attention Residuals block sum so far, then the running partial sum), or token ids for the first stage; the
last stage answers with a sampled token or teacher-forced logprobs instead of a state.

Per session a stage keeps the decode state of its own layers (KDA recurrent and short-convolution state, MLA
latent cache; Attention Residuals need nothing across tokens), under limits (sessions, tokens per forward,
context), with idle expiry and least-recently-used eviction of idle sessions when full. A session can be
**rewound** to an earlier position and **forked**.

Rewind is implemented here, without touching the model's cache classes (another branch adds rewind there; the
lead will unify): MLA caches are truncated (their rows are per position), and KDA state is restored from a
snapshot taken after a forward that ended at or before the target, then the stage's own recorded inputs
replay the positions between the snapshot and the target. Snapshots are taken after every forward (a decode
step ends at every position) and kept for the last `max_snapshots` forwards; recorded inputs are kept for the
last `rewind_window` positions. A rewind outside the window is refused.

A forward in mode "verify" (speculative decoding across the route) carries the last token and k drafts; the
cache is marked before it (`SequenceCache.mark`), so a rewind into it is the cache's own rewind (no replay),
and the head judges the drafts (inference.decoding.acceptance) and answers the emitted tokens. The rewind after a
rejection can come with the next forward (`rewind_and_forward`), so it costs the route no round trip of its own.

The block may run sharded over local processes (`Stage.from_checkpoint(..., shard_ranks=N, shard_mode=...)`:
the sharded runtime restricted to the block, `ShardedModel(layers=...)`, expert parallel or as a pipeline of
contiguous sub-blocks); its session state then lives in the shards, so there are no snapshots here: a rewind is
the marked cache's rewind, or a replay from position 0 of the recorded inputs; fork is refused. When the shard
set fails (a process died or hung) every session is lost with it: the forward that noticed raises 503
"shard_set_failed", `status()` says "failed", and `restart_shards()` starts a fresh set (opens get 503
"stage_restarting" until it serves).

Sampling at the head is the protocol's sampler (k3-gumbel/1, inference.decoding.sampling) with the request's seed:
the token at position p is generated-token index p - prompt_tokens (the prompt length the driver states at open),
so the head draws exactly the token a whole-model engine would, whatever the route's chunking, speculation or
rewinds; a rewound or re-prefilled session (after a stage was replaced) draws the same tokens again, and a
validator can replay a route's sampled answer like any other. Greedy is argmax, as everywhere.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from inference.decoding.acceptance import accept_drafts
from inference.decoding.sampling import MAX_LOGPROBS, SamplingParams, TokenSampler
from inference.model import CheckpointError, TensorSelection, load_checkpoint, model_device, read_config, resolve_device
from inference.model.checkpoint import read_manifest, tensor_sha256
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model, ResidualState, SequenceCache
from inference.model.kda import KDALayerCache
from inference.model.mla import MLALayerCache

HEAD_MODES = ("none", "sample", "score", "verify")


# ------------------------------------------------------------------ layer ranges
@dataclass(frozen=True)
class LayerRange:
    """Layers [start, stop) of a model with `num_layers` layers."""

    start: int
    stop: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.start < self.stop <= self.num_layers:
            raise ValueError(f"layer range {self.start}-{self.stop - 1} is not inside 0-{self.num_layers - 1}")

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "LayerRange":
        """'A-B' (inclusive, as on the command line: `--serve-layers 24-47`) or a single layer 'A'."""
        parts = str(text).strip().split("-")
        try:
            if len(parts) == 1:
                a = b = int(parts[0])
            elif len(parts) == 2:
                a, b = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"layer range {text!r} is not of the form A-B (inclusive layer numbers)") from None
        if b < a:
            raise ValueError(f"layer range {text!r} ends before it starts")
        return cls(a, b + 1, num_layers)

    @property
    def has_embedding(self) -> bool:
        return self.start == 0

    @property
    def has_head(self) -> bool:
        return self.stop == self.num_layers

    def __str__(self) -> str:
        return f"{self.start}-{self.stop - 1}"


def blocks_before(layer: int, block_size: int) -> int:
    """Completed Attention Residuals sources (embedding included) in the state entering `layer`
    (layer == num_layers: the state entering the head)."""
    return 0 if layer == 0 else (layer - 1) // block_size + 1


def wire_bytes_per_token(config: ModelConfig, cut: int, dtype_bytes: int = 2) -> int:
    """Bytes per token of the residual state crossing a cut before layer `cut`: (completed block sums,
    embedding included, + the partial sum) x D values. Cuts at block boundaries are the cheapest in their block."""
    return (blocks_before(cut, config.attn_res_block_size) + 1) * config.hidden_size * dtype_bytes


def stage_fingerprint(config_hash: str, layers: LayerRange, tensor_hashes: dict[str, str]) -> str:
    """16 hex digits naming exactly the tensors a stage holds: sha256 over the config hash, the range and
    every (name, sha256 of the tensor bytes) in name order."""
    h = hashlib.sha256(f"k3-stage/v1\n{config_hash}\n{layers.start}-{layers.stop}\n".encode())
    for name in sorted(tensor_hashes):
        h.update(f"{name} {tensor_hashes[name]}\n".encode())
    return h.hexdigest()[:16]


def load_stage_model(checkpoint: str | Path, layers: LayerRange, dtype: torch.dtype = torch.float32,
                     verify: bool = False, verify_tensors: bool | None = None,
                     device: torch.device | str = "cpu") -> tuple[KimiK3Model, str, int]:
    """The model with only the stage's tensors materialised (the rest stay on the meta device), through the one
    checkpoint loader filtered to the stage (`TensorSelection.stage`: only the shard files holding the block are
    opened). Returns (model, stage fingerprint, bytes held).

    The stage fingerprint is computed from the tensors as held (after the cast to `dtype`). Every tensor the stage
    reads is checked against the manifest's per-tensor sha256 (`verify_tensors`; None: when the manifest has
    them, so a checkpoint made before they existed still loads); `verify` re-hashes the whole checkpoint
    against the manifest's per-file sha256 (every file, so a stage host rarely wants it). On a GPU `device` the
    tensors go there one at a time as read (the host never holds the block) and are hashed one at a time from there:
    the fingerprint names the bytes held, whatever device holds them."""
    from inference.sharding.worker import model_skeleton  # noqa: PLC0415 (meta/CPU skeleton builder)

    config = read_config(checkpoint)
    if config.num_layers != layers.num_layers:
        raise CheckpointError(f"the checkpoint has {config.num_layers} layers, the range assumes {layers.num_layers}")
    model = model_skeleton(config, dtype)
    select = TensorSelection.stage(layers.start, layers.stop, layers.has_embedding, layers.has_head)
    if verify_tensors is None:
        try:
            verify_tensors = bool(read_manifest(checkpoint).get("tensors"))
        except CheckpointError:  # no manifest at all: nothing to check against
            verify_tensors = False
    if torch.device(device).type == "cuda":  # the batched expert path reads the experts stacked: load them in place
        model.hold_experts_stacked(device, range(layers.start, layers.stop))
    load_checkpoint(model, checkpoint, verify=verify, progress=False, select=select, verify_tensors=verify_tensors,
                    device=device)
    hashes, nbytes = {}, 0
    for key, t in model.state_dict().items():
        if not t.is_meta:
            hashes[f"{key} {str(t.dtype).replace('torch.', '')}"] = tensor_sha256(t.cpu())
            nbytes += t.numel() * t.element_size()
    for i in range(layers.start, layers.stop):
        layer = model.layers[i]
        if layer.is_moe and config.num_parameters() < (1 << 28):
            layer.block_sparse_moe.set_dequantize_cache(True)  # small models: keep decoded experts
    return model, stage_fingerprint(config.config_hash(), layers, hashes), nbytes


SHARD_MODES = ("expert", "pipeline")


def block_plan(config: ModelConfig, layers: LayerRange, ranks: int, mode: str = "expert", **simple):
    """A block plan (`Plan.layer_range`) for `ranks` local processes serving the block `layers`: it places only
    the block's layers (the embedding when it starts at 0, the head when it ends with the last layer), and its
    memory counts only what the ranks load. mode "expert": one stage over every rank, layer homes rotating, each
    MoE layer's experts spread over all ranks; "pipeline": rank r is the home of the r-th contiguous sub-block
    of the block's layers (sizes differ by at most one, the larger ones first) and holds every expert of its
    layers. `simple`: further `Plan.simple` keywords (memory_bytes, policy, concurrency, context, ...)."""
    from inference.planning.plan import Plan  # noqa: PLC0415

    if mode not in SHARD_MODES:
        raise ValueError(f"shard mode must be one of {SHARD_MODES}, got {mode!r}")
    size = layers.stop - layers.start
    if mode == "pipeline" and not 1 <= ranks <= size:
        raise ValueError(f"a pipeline over {ranks} ranks needs 1..{size} ranks for the block {layers}")
    plan = Plan.simple(config, ranks, mode, layer_range=(layers.start, layers.stop), **simple)
    plan.cluster_name = f"block-{layers}-{mode}-{ranks}"
    return plan


# ------------------------------------------------------------------ errors and limits
class StageError(Exception):
    """A request the stage refuses; `status` is the HTTP status the wire answers with."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class StageLimits:
    max_sessions: int = 16
    max_tokens_per_forward: int = 512
    max_context: int = 4096
    idle_expiry_s: float = 300.0  # a session untouched this long is dropped
    evict_idle_s: float = 10.0  # when full, the least recently used session idle this long may be evicted
    max_snapshots: int = 16  # KDA snapshots kept per session (one per forward)
    rewind_window: int = 1024  # positions of recorded inputs kept per session for replay


# ------------------------------------------------------------------ sessions
@dataclass
class HeadOutput:
    """What the last stage returns instead of a state."""

    mode: str
    token_id: int | None = None  # sample
    logprob: float | None = None  # sample
    top: list[tuple[int, float]] = field(default_factory=list)  # sample: top alternatives
    logprobs: list[float | None] = field(default_factory=list)  # score: per row (None where no target)
    row_tops: list[list[tuple[int, float]]] = field(default_factory=list)  # score: per row top_k
    # verify: the emitted tokens (accepted drafts, then the correction or bonus) as (id, logprob, top)
    verified: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    accepted: int = 0  # verify: how many drafted tokens were accepted


@dataclass
class StageSession:
    session_id: str
    route_id: str
    cache: SequenceCache
    sampling: SamplingParams
    seed: int
    prompt_tokens: int = 0  # the request's prompt length: position p samples generated-token index p - this
    owner: str = ""  # who opened it (the wire checks later control messages against it)
    upstream: str = ""  # who may send forwards
    downstream: dict = field(default_factory=dict)  # where the output goes (the wire's business)
    reply_to: dict = field(default_factory=dict)  # the route driver (errors and the head's result)
    position: int = 0
    step: int = 0
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    snapshots: "OrderedDict[int, dict[int, KDALayerCache]]" = field(default_factory=OrderedDict)
    inputs: list[tuple[int, object]] = field(default_factory=list)  # (start position, ids or ResidualState)

    @property
    def inputs_start(self) -> int:
        return self.inputs[0][0] if self.inputs else self.position


def _slice_input(payload, lo: int, hi: int):
    if isinstance(payload, Tensor):
        return payload[lo:hi]
    return ResidualState((hi - lo,), [b[lo:hi] for b in payload.blocks], payload.partial[lo:hi])


def end_mark(cache) -> None:
    """Drop a cache's speculative rewind log, keeping everything (a rewind to its own length ends the mark;
    works for `SequenceCache` and the sharded runtime's `ShardCache`)."""
    if cache.marked:
        cache.rewind(cache.length)


class Stage:
    """Layers [start, stop) of one model and the sessions that run through them. Thread-safe: calls are
    serialised by one lock (the stage server runs compute in a worker thread)."""

    def __init__(self, model, layers: LayerRange, fingerprint: str = "",
                 limits: StageLimits = StageLimits()):
        """`model`: a KimiK3Model holding (at least) the block's tensors, or a block-restricted
        `inference.sharding.ShardedModel` (layers == the block) serving it over local ranks."""
        self.model = model
        self.config: ModelConfig = model.config
        self.sharded = hasattr(model, "forward_block")
        if self.sharded and tuple(model.layer_range or (0, model.config.num_layers)) != (layers.start, layers.stop):
            raise ValueError(f"the sharded model serves layers {model.layer_range}, the stage {layers}")
        self.layers = layers
        self.fingerprint = fingerprint
        self.limits = limits
        self.sessions: dict[str, StageSession] = {}
        self._lock = threading.RLock()
        self.decode_ms: float | None = None  # measured, EWMA of single-token forwards
        self.forwards = 0
        self.tokens = 0
        self.evicted = 0
        self.expired = 0
        self.shard_mode = ""  # a sharded block's layout ("expert" | "pipeline"; set by from_checkpoint)
        # a sharded block's shard set: "ok" | "failed" (a shard died or hung; its sessions are gone) |
        # "restarting" (restart_shards is starting a fresh set); an in-process block is always "ok"
        self.shard_state = "ok"
        self.shard_detail = ""
        self.shard_restarts = 0
        self.lost_sessions = 0  # sessions dropped because the shard set holding their state failed
        # where the block computes: its inputs go there, its outputs (a state, the head's logits) come back to the
        # host, which the wire and the checks read; session state (KDA snapshots included) stays on the device
        self.device = torch.device("cpu") if self.sharded else model_device(model)

    @property
    def numerics(self) -> str:
        """The dtype the block computes in ("float32", "bfloat16", "float16"): its floating weights' dtype."""
        if self.sharded:
            return str(getattr(self.model, "dtype", "float32")).replace("torch.", "")
        for p in self.model.parameters():
            if p.is_floating_point():
                return str(p.dtype).replace("torch.", "")
        return "float32"

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, layers: str | LayerRange, dtype: torch.dtype = torch.float32,
                        limits: StageLimits = StageLimits(), shard_ranks: int = 1,
                        threads_per_rank: int | None = None, shard_mode: str = "expert",
                        shard_timeouts=None, device: torch.device | str = "cpu") -> "Stage":
        """The block from a checkpoint; `shard_ranks` > 1 serves it over that many local processes (the sharded
        runtime). `shard_mode` "expert": layer homes rotate over the ranks and every MoE layer's experts are
        spread over all of them; "pipeline": each rank holds a contiguous sub-block of the stage's layers (both
        `block_plan`: a plan of the block alone). The fingerprint is the same either way (computed from the
        block's tensors as loaded here once, then dropped). `shard_timeouts`: the shard set's `ShardTimeouts`
        (None: its defaults). `device` "cpu", "cuda" or "cuda:N" (a sharded block: "cuda", rank r on GPU r)."""
        if shard_mode not in SHARD_MODES:
            raise ValueError(f"shard mode must be one of {SHARD_MODES}, got {shard_mode!r}")
        config = read_config(checkpoint)
        if not isinstance(layers, LayerRange):
            layers = LayerRange.parse(layers, config.num_layers)
        if shard_ranks > 1 and shard_mode == "pipeline" and shard_ranks > layers.stop - layers.start:
            raise ValueError(f"a pipeline over {shard_ranks} ranks needs at least {shard_ranks} layers; the block "
                             f"{layers} has {layers.stop - layers.start}")
        where = resolve_device(device)
        if shard_ranks > 1 and where.type == "cuda" and str(device) != "cuda":
            raise ValueError(f"a block sharded over {shard_ranks} ranks puts rank r on GPU r: give device cuda, "
                             f"not {device}")
        # a sharded block's ranks load their own parts: the fingerprint's copy is read on the host
        model, fp, _ = load_stage_model(checkpoint, layers, dtype, device=where if shard_ranks == 1 else "cpu")
        if shard_ranks > 1:
            from inference.sharding.driver import ShardedModel, ShardTimeouts  # noqa: PLC0415 (spawns processes)

            del model
            plan = block_plan(config, layers, shard_ranks, shard_mode, device=where.type)
            model = ShardedModel(checkpoint, plan, shards=shard_ranks, dtype=str(dtype).split(".")[-1],
                                 layers=(layers.start, layers.stop), threads_per_rank=threads_per_rank,
                                 timeouts=shard_timeouts or ShardTimeouts(), device=where.type)
            model.plan_source = f"block {shard_mode} x{shard_ranks}"
        stage = cls(model, layers, fp, limits)
        stage.shard_mode = shard_mode if shard_ranks > 1 else ""
        return stage

    def shard_layout(self) -> dict:
        """How the block runs over its local ranks ({} in this process): ranks, mode and each layer's home rank."""
        if not self.sharded:
            return {}
        return {"ranks": self.model.world_size, "mode": self.shard_mode or "plan",
                "layer_home": list(self.model.plan.layer_home[self.layers.start:self.layers.stop])}

    def shutdown(self) -> None:
        """Stop a sharded block's processes (nothing to do for an in-process block)."""
        if self.sharded:
            self.model.close()

    # ------------------------------------------------------------ the shard set's health and restart
    def status(self) -> tuple[str, str]:
        """("ok" | "failed" | "restarting", detail). A sharded block is "failed" as soon as its shard set is
        (a process died, or stopped beating), even before a forward noticed; the check takes no lock, so it
        answers while a forward or a restart runs."""
        if not self.sharded or self.shard_state == "restarting":
            return self.shard_state, self.shard_detail
        if self.shard_state == "ok":
            health = self.model.health()
            if health.status == "down":
                return "failed", health.detail
        return self.shard_state, self.shard_detail

    @property
    def serving(self) -> bool:
        """What /health says: a shard set seen down counts before a forward noticed (capabilities agree)."""
        return self.status()[0] == "ok"

    def check_serving(self) -> None:
        """Refuses work while the set is failed or restarting (a set seen down but not yet failed under a forward
        lets the forward through: its failure is what starts the restart)."""
        if self.shard_state != "ok":
            raise StageError(503, "stage_restarting", f"this stage's shard set is {self.shard_state} "
                                                      f"({self.shard_detail}); try again once /health says ok")

    def _shard_set_failed(self, reason: str) -> StageError:
        """The shard set failed under a forward: every session's state lived there, so every session is gone."""
        self.shard_state, self.shard_detail = "failed", reason
        self.lost_sessions += len(self.sessions)
        self.sessions.clear()
        return StageError(503, "shard_set_failed", f"this stage's shard set failed ({reason}); its sessions are "
                                                   "lost and it restarts; re-open and re-prefill")

    def restart_shards(self) -> None:
        """Kill the block's shard processes and start a fresh set (sharded blocks only). Every session is
        dropped (its state lived in the old set). Refuses opens (503) while it runs; on failure the state
        stays "failed" (call again)."""
        if not self.sharded:
            raise ValueError("an in-process block has no shard set to restart")
        self.shard_state, self.shard_detail = "restarting", "starting a fresh shard set"
        with self._lock:
            self.lost_sessions += len(self.sessions)
            self.sessions.clear()
            try:
                self.model.recover()
            except Exception as e:  # noqa: BLE001 (ShardFailure, a spawn or load error: report and retry later)
                self.shard_state, self.shard_detail = "failed", f"restart failed: {type(e).__name__}: {e}"
                raise
            self.shard_restarts += 1
            self.shard_state, self.shard_detail = "ok", ""

    # ------------------------------------------------------------ shapes
    @property
    def input_blocks(self) -> int:
        return blocks_before(self.layers.start, self.config.attn_res_block_size)

    @property
    def output_blocks(self) -> int:
        return blocks_before(self.layers.stop, self.config.attn_res_block_size)

    def capacity(self) -> dict:
        lim = self.limits
        return {"sessions": lim.max_sessions, "tokens_per_forward": lim.max_tokens_per_forward,
                "context": min(lim.max_context, self.config.max_position_embeddings),
                "forward_rewind": 1,  # a forward may carry a rewind (`rewind_and_forward`)
                "shard_ranks": self.model.world_size if self.sharded else 1,
                "serving": int(self.serving),  # 0 while a sharded block's shard set is failed or restarting
                "restarts": self.shard_restarts}

    # ------------------------------------------------------------ sessions
    def open(self, session_id: str, route_id: str = "", sampling: SamplingParams = SamplingParams(),
             seed: int = 0, owner: str = "", upstream: str = "", downstream: dict | None = None,
             reply_to: dict | None = None, prompt_tokens: int = 0) -> StageSession:
        """A new session at position 0 (admission: refused with 429 when full and nothing can be evicted)."""
        problems = sampling.problems()
        if problems:
            raise StageError(400, "invalid_sampling", "; ".join(problems))
        self.check_serving()
        with self._lock:
            self.check_serving()
            if session_id in self.sessions:
                raise StageError(409, "session_exists", f"session {session_id!r} is already open here")
            self.expire_idle()
            if len(self.sessions) >= self.limits.max_sessions:
                self._evict_one()
            session = StageSession(session_id, route_id, self._new_cache(), sampling, int(seed), int(prompt_tokens),
                                   owner=owner,
                                   upstream=upstream, downstream=dict(downstream or {}),
                                   reply_to=dict(reply_to or {}))
            self.sessions[session_id] = session
            return session

    def _new_cache(self):
        if self.sharded:
            return self.model.new_cache()  # a handle; the state lives in the shard processes
        return self.model.new_cache(range(self.layers.start, self.layers.stop))

    def _evict_one(self) -> None:
        now = time.monotonic()
        idle = [s for s in self.sessions.values() if not s.busy and now - s.last_used >= self.limits.evict_idle_s]
        if not idle:
            raise StageError(429, "over_capacity",
                             f"this stage holds its maximum of {self.limits.max_sessions} sessions, none idle")
        victim = min(idle, key=lambda s: s.last_used)
        del self.sessions[victim.session_id]
        self.evicted += 1

    def expire_idle(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [sid for sid, s in self.sessions.items()
                    if not s.busy and now - s.last_used > self.limits.idle_expiry_s]
            for sid in gone:
                del self.sessions[sid]
            self.expired += len(gone)
            return gone

    def get(self, session_id: str) -> StageSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise StageError(404, "unknown_session", f"no session {session_id!r} on this stage (never opened, "
                                                     "closed, expired or evicted)")
        return session

    def close(self, session_id: str) -> None:
        with self._lock:
            self.get(session_id)
            del self.sessions[session_id]

    def fork(self, session_id: str, new_id: str) -> StageSession:
        """A copy of a session under a new id (same position, state, snapshots and recorded inputs)."""
        with self._lock:
            src = self.get(session_id)
            if self.sharded:
                raise StageError(501, "fork_unsupported", "this stage's block is sharded over local processes; "
                                                          "its sessions cannot be copied (open and prefill one)")
            if new_id in self.sessions:
                raise StageError(409, "session_exists", f"session {new_id!r} is already open here")
            if len(self.sessions) >= self.limits.max_sessions:
                self._evict_one()
            with torch.inference_mode():
                copy = replace(src, session_id=new_id, cache=src.cache.clone(), snapshots=OrderedDict(src.snapshots),
                               inputs=list(src.inputs), downstream=dict(src.downstream), reply_to=dict(src.reply_to),
                               busy=False, created=time.monotonic(), last_used=time.monotonic())
            self.sessions[new_id] = copy
            return copy

    # ------------------------------------------------------------ forward
    def check_forward(self, session: StageSession, position: int, inputs, mode: str = "none",
                      targets: Sequence[int] | None = None, top_k: int = 0, expected_position: int | None = None) -> int:
        """Validate a forward without touching the session; returns the number of new tokens.
        `expected_position`: where the session will be once already accepted forwards ran (a server that queues
        forwards checks against that); by default the session's position."""
        expected = session.position if expected_position is None else expected_position
        if position != expected:
            raise StageError(409, "position_mismatch",
                             f"session {session.session_id!r} is at position {expected}, the forward "
                             f"starts at {position}")
        cfg = self.config
        if self.layers.has_embedding:
            if not isinstance(inputs, Tensor) or inputs.dim() != 1 or inputs.is_floating_point():
                raise StageError(400, "bad_input", "the first stage takes a 1-D integer tensor of token ids")
            n = int(inputs.shape[0])
            if n and (int(inputs.min()) < 0 or int(inputs.max()) >= cfg.vocab_size):
                raise StageError(400, "bad_input", f"token ids must lie in 0..{cfg.vocab_size - 1}")
        else:
            if not isinstance(inputs, ResidualState):
                raise StageError(400, "bad_input", "this stage takes a residual state, not token ids")
            n = int(inputs.partial.shape[0]) if inputs.partial.dim() == 2 else -1
            if len(inputs.blocks) != self.input_blocks:
                raise StageError(400, "bad_shape", f"the state entering layer {self.layers.start} has "
                                                   f"{self.input_blocks} block sums, got {len(inputs.blocks)}")
            for t in list(inputs.blocks) + [inputs.partial]:
                if t.dim() != 2 or tuple(t.shape) != (n, cfg.hidden_size):
                    raise StageError(400, "bad_shape", f"every state tensor must be [{max(n, 0)}, {cfg.hidden_size}],"
                                                       f" got {list(t.shape)}")
                if not bool(torch.isfinite(t).all()):
                    raise StageError(400, "non_finite", "the residual state holds NaN or infinite values")
        if n < 1:
            raise StageError(400, "bad_input", "a forward needs at least one token")
        if n > self.limits.max_tokens_per_forward:
            raise StageError(413, "too_many_tokens", f"{n} tokens in one forward; this stage takes at most "
                                                     f"{self.limits.max_tokens_per_forward}")
        context = self.capacity()["context"]
        if position + n > context:
            raise StageError(413, "context_too_long", f"{position} + {n} tokens exceed this stage's context of {context}")
        if mode not in HEAD_MODES:
            raise StageError(400, "bad_mode", f"mode must be one of {HEAD_MODES}")
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise StageError(400, "bad_top_k", f"top_k must lie in 0..{MAX_LOGPROBS}")
        if mode in ("sample", "verify") and position + (n if mode == "sample" else 1) < session.prompt_tokens:
            raise StageError(400, "bad_position", f"mode {mode} samples inside the prompt (position {position} + "
                                                  f"{n} tokens, a {session.prompt_tokens}-token prompt)")
        if mode == "verify":
            if n < 2 or targets is None or len(targets) != n - 1:
                raise StageError(400, "bad_targets", "verifying takes the last token then k >= 1 drafted ones, "
                                                     f"and the k drafts as targets ({n} tokens, "
                                                     f"{'no' if targets is None else len(targets)} targets)")
            if any(not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in targets):
                raise StageError(400, "bad_targets", f"drafted tokens must lie in 0..{cfg.vocab_size - 1}")
        if mode == "score":
            if targets is None or len(targets) != n:
                raise StageError(400, "bad_targets", f"scoring needs one target per token ({n}), -1 for none")
            if any(not isinstance(t, int) or not -1 <= t < cfg.vocab_size for t in targets):
                raise StageError(400, "bad_targets", f"targets must lie in -1..{cfg.vocab_size - 1}")
        return n

    def rewind_and_forward(self, session_id: str, rewind: int, position: int, inputs, mode: str = "none",
                           targets: Sequence[int] | None = None, top_k: int = 0) -> ResidualState | HeadOutput:
        """A forward that first returns the session to `rewind` (where the forward must start): the rewind and
        the forward are checked before either touches the session, so a refused one leaves it as it was."""
        with self._lock:
            session = self.get(session_id)
            self.check_rewind(session, rewind)
            self.check_forward(session, position, inputs, mode, targets, top_k, expected_position=rewind)
            self.rewind(session_id, rewind)
            return self.forward(session_id, position, inputs, mode, targets, top_k)

    def forward(self, session_id: str, position: int, inputs, mode: str = "none",
                targets: Sequence[int] | None = None, top_k: int = 0) -> ResidualState | HeadOutput:
        """Run the stage's layers on the new tokens of one session.

        inputs: token ids [N] for the first stage, else the ResidualState entering layer `start`. Returns the
        state leaving the last layer, or the head's output on the last stage. A refused forward (StageError)
        leaves the session as it was."""
        with self._lock:
            session = self.get(session_id)
            self.check_forward(session, position, inputs, mode, targets, top_k)
            session.busy = True
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    end_mark(session.cache)
                    if mode == "verify":  # drafts the driver will likely take back: rewinding into them is cheap
                        session.cache.mark("snapshot")
                    n = self._input_len(inputs)
                    rows = self._head_rows(mode, n, targets) if self.layers.has_head else None
                    state, logits = self._compute(session, inputs, rows)
                    out = self._head(session, position, n, logits, mode, targets, top_k) \
                        if self.layers.has_head else state
                self._record(session, position, inputs, n)
                elapsed = (time.perf_counter() - t0) * 1000.0
                if n == 1:
                    self.decode_ms = elapsed if self.decode_ms is None else 0.8 * self.decode_ms + 0.2 * elapsed
                self.forwards += 1
                self.tokens += n
                session.step += 1
                return out
            finally:
                session.busy = False
                session.last_used = time.monotonic()

    @staticmethod
    def _head_rows(mode: str, n: int, targets: Sequence[int] | None) -> list[int] | None:
        """The rows whose next-token logits the head's answer needs (None: no head work)."""
        if mode == "sample":
            return [n - 1]
        if mode == "verify":
            return list(range(n))
        if mode == "score":
            return [r for r, t in enumerate(targets) if t >= 0]
        return None

    def _compute(self, session: StageSession, inputs, rows: list[int] | None
                 ) -> tuple[ResidualState | None, Tensor | None]:
        """The block's layers on the new tokens: (the state leaving them, the head's logits of `rows`). A
        sharded block runs in its shard set and returns only what leaves it (the state, or the logits)."""
        if not self.sharded:
            state = self._run(session, inputs)
            logits = self.model.head(state, rows).cpu() if rows else None
            return ResidualState(state.lengths, [b.cpu() for b in state.blocks], state.partial.cpu()), logits
        if not self.layers.has_embedding:
            inputs = ResidualState((int(inputs.partial.shape[0]),), [b.float() for b in inputs.blocks],
                                   inputs.partial.float())
        want_rows = rows is not None and rows != [self._input_len(inputs) - 1]
        from inference.sharding.driver import ShardFailure  # noqa: PLC0415 (only sharded blocks get here)

        self.check_serving()
        try:
            out = self.model.forward_block(inputs.to(torch.long) if self.layers.has_embedding else inputs,
                                           session.cache, all_logits=want_rows)
        except ShardFailure as e:
            raise self._shard_set_failed(str(e)) from None
        except ValueError as e:  # its cache belongs to a shard set that was restarted meanwhile
            if "restarted" not in str(e):
                raise
            self.sessions.pop(session.session_id, None)
            raise StageError(404, "unknown_session", f"session {session.session_id!r} was lost in a restart of "
                                                     "this stage's shard set; re-open and re-prefill") from None
        if not self.layers.has_head:
            return out, None
        if rows is None:
            return None, None
        return None, (out[rows] if want_rows else out[None])

    def _run(self, session: StageSession, inputs) -> ResidualState | None:
        """The block's layers on the new tokens; the state leaving them (None from a sharded head block)."""
        if self.sharded:
            return self._compute(session, inputs, None)[0]
        if self.layers.has_embedding:
            state = self.model.embed(inputs.to(self.device, torch.long))
        else:
            state = ResidualState((int(inputs.partial.shape[0]),), [b.to(self.device, torch.float32)
                                                                    for b in inputs.blocks],
                                  inputs.partial.to(self.device, torch.float32))
        state = self.model.run_layers(self.layers.start, self.layers.stop, state, [session.cache])
        session.cache.advance(int(state.partial.shape[0]))
        return state

    def _head(self, session: StageSession, position: int, n: int, logits: Tensor | None, mode: str,
              targets: Sequence[int] | None, top_k: int) -> HeadOutput:
        """The last stage's answer from the logits of `_head_rows(mode, n, targets)`."""
        if mode == "none":
            return HeadOutput("none")
        sampler = TokenSampler(replace(session.sampling, seed=session.seed))
        if mode == "verify":  # row 0 predicts position + 1
            verdict = accept_drafts(list(targets), logits.float(), sampler, position + 1 - session.prompt_tokens)
            return HeadOutput("verify", accepted=verdict.accepted,
                              verified=[(t.token_id, t.logprob, list(t.top)) for t in verdict.tokens])
        if mode == "sample":  # the last row predicts position + n
            chosen = sampler.choose(logits[0], position + n - session.prompt_tokens)
            return HeadOutput("sample", token_id=chosen.token_id, logprob=chosen.logprob, top=chosen.top)
        rows = [r for r, t in enumerate(targets) if t >= 0]
        out = HeadOutput("score", logprobs=[None] * n, row_tops=[[] for _ in range(n)])
        if rows:
            lp = torch.log_softmax(logits.float(), dim=-1)
            for j, r in enumerate(rows):
                out.logprobs[r] = float(lp[j, targets[r]])
                if top_k:
                    v, i = torch.topk(lp[j], top_k)
                    out.row_tops[r] = [(int(a), float(b)) for a, b in zip(i, v)]
        return out

    def _record(self, session: StageSession, position: int, inputs, n: int) -> None:
        """After a forward: remember its input (for replay) and the KDA state at the new position."""
        session.position = position + n
        session.inputs.append((position, inputs))
        if not self.sharded:  # a sharded block's state lives in its shards: it replays from 0 instead
            session.snapshots[session.position] = self._kda_snapshot(session.cache)
        while len(session.snapshots) > self.limits.max_snapshots:
            session.snapshots.popitem(last=False)
        floor = session.position - self.limits.rewind_window
        while session.inputs and session.inputs[0][0] + self._input_len(session.inputs[0][1]) <= floor:
            session.inputs.pop(0)

    @staticmethod
    def _input_len(payload) -> int:
        return int(payload.shape[0]) if isinstance(payload, Tensor) else int(payload.partial.shape[0])

    @staticmethod
    def _kda_snapshot(cache: SequenceCache) -> dict[int, KDALayerCache]:
        return {i: c.clone() for i, c in enumerate(cache.layers) if isinstance(c, KDALayerCache)}

    # ------------------------------------------------------------ rewind
    def check_rewind(self, session: StageSession, position: int, current: int | None = None) -> None:
        """Refuse (StageError) a rewind of `session` to `position` that `rewind` could not do, touching nothing:
        400 outside 0..its position (`current`: where it will be once accepted forwards ran; by default its
        position now), 409 when older than its rewind window."""
        now = session.position if current is None else current
        if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= now:
            raise StageError(400, "bad_position", f"can rewind only to 0..{now}, not {position!r}")
        if position in (0, session.position) or position > session.position:
            return  # a fresh cache, nothing to do, or (queued forwards) judged again when it runs
        if session.cache.marked and session.cache.marked_at <= position:
            return
        if self._replay_start(session, position) is None:
            raise StageError(409, "rewind_out_of_window",
                             f"position {position} is older than this session's rewind window "
                             f"(recorded inputs from {session.inputs_start}, snapshots at "
                             f"{list(session.snapshots)[:1]}...); re-open and re-prefill")

    def rewind(self, session_id: str, position: int) -> int:
        """Return a session to `position` (< its current position): as if it had never seen the later tokens."""
        with self._lock:
            session = self.get(session_id)
            self.check_rewind(session, position)
            if position == session.position:
                return position
            if session.cache.marked and session.cache.marked_at <= position:
                with torch.inference_mode():  # into the last (verify) forward: its rewind log has the state
                    session.cache.rewind(position)
                self._trim(session, position)
                return position
            end_mark(session.cache)
            if position == 0:
                session.cache = self._new_cache()
                session.snapshots.clear()
                session.inputs.clear()
                session.position = 0
                session.last_used = time.monotonic()
                return 0
            start = self._replay_start(session, position)  # not None: check_rewind said so
            with torch.inference_mode():
                self._restore(session, start)
                for pos, payload in [(p, x) for p, x in session.inputs]:
                    end = pos + self._input_len(payload)
                    lo, hi = max(pos, start), min(end, position)
                    if lo < hi:
                        self._run(session, _slice_input(payload, lo - pos, hi - pos))
            self._trim(session, position)
            return position

    def _trim(self, session: StageSession, position: int) -> None:
        """After the state went back to `position`: drop the snapshots and recorded inputs beyond it."""
        for p in [p for p in session.snapshots if p > position]:
            del session.snapshots[p]
        kept = []
        for pos, payload in session.inputs:
            end = pos + self._input_len(payload)
            if end <= position:
                kept.append((pos, payload))
            elif pos < position:
                kept.append((pos, _slice_input(payload, 0, position - pos)))
        session.inputs = kept
        session.position = position
        if position not in session.snapshots and not self.sharded:
            session.snapshots[position] = self._kda_snapshot(session.cache)
        session.last_used = time.monotonic()

    def _replay_start(self, session: StageSession, position: int) -> int | None:
        """The latest snapshot position <= target from which recorded inputs reach the target (0 counts when
        the inputs reach back to 0)."""
        candidates = [p for p in session.snapshots if p <= position]
        if session.inputs_start == 0:
            candidates.append(0)
        usable = [p for p in candidates if p == position or p >= session.inputs_start]
        return max(usable) if usable else None

    def _restore(self, session: StageSession, start: int) -> None:
        if start == 0:
            session.cache = self._new_cache()
            return
        snapshot = session.snapshots[start]
        for i, c in enumerate(session.cache.layers):
            if isinstance(c, KDALayerCache):
                session.cache.layers[i] = snapshot[i].clone()
            elif isinstance(c, MLALayerCache):
                c.length = start  # rows are per position: truncation is the rewind
        session.cache.length = start


def session_cache_bytes(config: ModelConfig, layers: LayerRange, length: int) -> int:
    """Decode state of one session on a stage (fp32): KDA constant part plus MLA per token."""
    kda = sum(1 for i in range(layers.start, layers.stop) if not config.is_mla(i))
    mla = layers.stop - layers.start - kda
    per_kda = config.kda_heads * config.kda_head_dim * config.kda_head_dim * 4 \
        + 3 * config.kda_proj_size * (config.conv_kernel_size - 1) * 4
    return kda * per_kda + mla * length * (config.kv_lora_rank + config.qk_rope_head_dim) * 4


__all__ = ["LayerRange", "Stage", "StageError", "StageLimits", "StageSession", "HeadOutput", "blocks_before",
           "wire_bytes_per_token",
           "stage_fingerprint", "load_stage_model", "session_cache_bytes"]
