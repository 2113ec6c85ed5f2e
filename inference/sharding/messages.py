"""What the shard processes say to each other and to their driver (inference.sharding.driver, inference.sharding.worker).

Three channels:

1. Driver <-> rank 0: a `multiprocessing` Pipe carrying pickled tuples (the engine never joins the
   torch.distributed world, so it can always kill and restart it):

       ("step", n, slots, lengths, ids, freed, all_logits, cache_ops) -> ("logits", n, float32 [R, V] numpy)
       ("stats", n, reset)                                 -> ("stats", n, RoutingStats dict)
       ("close",)                                          -> ("closed",)
       rank 0, once started:  ("ready",)   on any failure: ("error", n, text), then it exits

   `ids` is every sequence's new tokens concatenated (int64 numpy); R is the number of logit rows
   (all tokens with all_logits, else one per sequence). `cache_ops` are the marks and rewinds of
   speculative decoding (`CacheOp`) that the engine made on the batch's handles since their last step;
   every rank applies them, in order, to its caches before the step runs.

2. Rank 0 -> every other rank, once per step: a `StepHeader` (point to point, so each rank runs the same
   deterministic schedule): META_LEN int64 values, then, if the step has sequences, one int64 payload
   `slots[B] | lengths[B] | ids[N] | freed[F] | cache ops [O, 3]` (slot, MARK or REWIND, mode index or length). Idle rank 0 sends PING headers every keepalive period so
   that every receive in the world has a bounded wait.

3. Within a step (all sizes follow from the header, the layer index and the plan, except expert dispatch):
   - state hop into layer i (or into the head, i = num_layers): one float32 tensor
     [state_sources(i), N, D] = completed AttnRes block sums then the partial sum;
   - expert dispatch, home -> each rank holding experts of the layer, every MoE layer: int64 [2] =
     (tokens T_r, assignments A_r), then if A_r > 0 one uint8 buffer packing
     token index [A_r] int64 | expert id [A_r] int64 | weight [A_r] float32 | latent rows [T_r, latent];
     the holder answers with its weighted partial sum, float32 [T_r, latent];
   - logits, head rank -> rank 0: float32 [R, V].

Rendezvous and liveness go through the driver's TCP store, under one namespace per generation (a fresh
namespace each time the driver (re)starts the shard set): see `StoreKeys`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from inference.model import ModelConfig
from inference.model.kda import REWIND_MODES

# ------------------------------------------------------------------ step header
META_LEN = 8
PING, STEP, STATS, STOP = 0, 1, 2, 3
KIND_NAMES = {PING: "ping", STEP: "step", STATS: "stats", STOP: "stop"}
MARK, REWIND = 1, 2  # cache ops: start a rewind log (value: index in kda.REWIND_MODES); back to `value` tokens


@dataclass(frozen=True)
class CacheOp:
    """A mark or rewind of one sequence's caches (speculative decoding), made by the engine on its handle
    and carried to the shards with that sequence's next step."""

    slot: int
    kind: int  # MARK | REWIND
    value: int  # MARK: index of the rewind mode in kda.REWIND_MODES; REWIND: the length to return to

    def apply(self, cache) -> None:
        if self.kind == MARK:
            cache.mark(REWIND_MODES[self.value])
        elif self.kind == REWIND:
            cache.rewind(self.value)
        else:
            raise ValueError(f"unknown cache op {self.kind}")


@dataclass
class StepHeader:
    kind: int
    number: int = 0
    slots: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    ids: torch.Tensor | None = None  # [N] int64, the new tokens of every sequence concatenated
    freed: list[int] = field(default_factory=list)
    all_logits: bool = False
    reset: bool = False  # STATS: clear the counters after reading them
    cache_ops: list[CacheOp] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def logit_rows(self) -> int:
        return self.num_tokens if self.all_logits else len(self.slots)

    def encode(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = self.ids if self.ids is not None else torch.zeros(0, dtype=torch.long)
        meta = torch.tensor([self.kind, self.number, len(self.slots), int(ids.numel()), len(self.freed),
                             int(self.all_logits), int(self.reset), len(self.cache_ops)], dtype=torch.long)
        if not (self.slots or self.freed or self.cache_ops):
            return meta, None
        ops = [v for op in self.cache_ops for v in (op.slot, op.kind, op.value)]
        payload = torch.cat([torch.tensor(self.slots, dtype=torch.long), torch.tensor(self.lengths, dtype=torch.long),
                             ids.to(torch.long).cpu(), torch.tensor(self.freed, dtype=torch.long),
                             torch.tensor(ops, dtype=torch.long)])
        return meta, payload

    @staticmethod
    def payload_len(meta: Sequence[int]) -> int:
        _, _, b, n, f, _, _, o = meta[:8]
        return 2 * b + n + f + 3 * o

    @classmethod
    def decode(cls, meta: Sequence[int], payload: torch.Tensor | None) -> "StepHeader":
        kind, number, b, n, f, all_logits, reset, o = (int(v) for v in meta[:8])
        if kind not in KIND_NAMES:
            raise ValueError(f"unknown step header kind {kind}")
        if payload is None:
            return cls(kind, number, all_logits=bool(all_logits), reset=bool(reset))
        p = payload.cpu()
        end = 2 * b + n + f
        ops = [CacheOp(*row) for row in p[end:end + 3 * o].reshape(o, 3).tolist()]
        return cls(kind, number, p[:b].tolist(), p[b:2 * b].tolist(), p[2 * b:2 * b + n].clone(),
                   p[2 * b + n:end].tolist(), bool(all_logits), bool(reset), ops)


LOGITS_TAG = 1  # the head's logits travel on their own tag: rank 0 waits for them while later steps run


# ------------------------------------------------------------------ tensor layouts
def state_sources(config: ModelConfig, layer: int) -> int:
    """Tensors in the residual state entering `layer` (num_layers: the head): completed blocks + partial."""
    return math.ceil(layer / config.attn_res_block_size) + 1


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors' bytes into one uint8 buffer (one message instead of several)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def packed_nbytes(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


def unpack(buf: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of `pack`. Order the specs widest item first so every view stays aligned."""
    if packed_nbytes(specs) != buf.numel():
        raise ValueError(f"message holds {buf.numel()} bytes, its layout {packed_nbytes(specs)}")
    out, offset = [], 0
    for shape, dtype in specs:
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[offset:offset + n].view(dtype).reshape(shape))
        offset += n
    return out


def dispatch_specs(tokens: int, assignments: int, latent: int, dtype: torch.dtype):
    return [((assignments,), torch.long), ((assignments,), torch.long), ((assignments,), torch.float32),
            ((tokens, latent), dtype)]


# ------------------------------------------------------------------ settings shared by driver and workers
@dataclass(frozen=True)
class ShardTimeouts:
    """Bounds on every wait (seconds). Why each default:

    comm: one point-to-point transfer, including waiting for the peer to reach it in the schedule, so it
      must cover the longest compute of a step between two messages (a prefill chunk on a slow stage);
      a backstop: hangs are normally caught sooner by the heartbeat.
    heartbeat: every shard process bumps a counter in the store several times a second from a thread
      that runs even while the main thread computes; silence this long means the process is stopped or
      wedged.
    startup: spawning, loading weights and connecting a fresh shard set.
    keepalive: rank 0 pings idle ranks this often, so their wait for the next step is bounded too.
    """

    comm: float = 60.0
    heartbeat: float = 5.0
    startup: float = 600.0
    keepalive: float = 1.0
    close: float = 10.0

    @property
    def heartbeat_interval(self) -> float:
        return max(0.05, min(self.keepalive, self.heartbeat / 8))

    @property
    def idle(self) -> float:
        """Longest wait of a non-zero rank for the next step header (rank 0 may be finishing a step)."""
        return self.comm + 2 * self.keepalive


@dataclass(frozen=True)
class LinkEmulation:
    """Make every inter-shard message behave as if it crossed a network link: `latency_ms` one way, and
    `gbps` of bandwidth per sender and peer (0: unlimited). 25 GbE: gbps=25, latency_ms ~0.02-0.05; a WAN
    hop: tens of ms. All zero: the plain transport."""

    latency_ms: float = 0.0
    gbps: float = 0.0

    @property
    def active(self) -> bool:
        return self.latency_ms > 0 or self.gbps > 0

    def problems(self) -> list[str]:
        out = []
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            out.append(f"link_latency_ms must be a finite number >= 0 (got {self.latency_ms})")
        if not (self.gbps >= 0 and math.isfinite(self.gbps)):
            out.append(f"link_gbps must be a finite number >= 0, 0 meaning unlimited (got {self.gbps})")
        return out

    def seconds(self, nbytes: int) -> float:
        """One message's time on the link: latency plus serialisation."""
        return self.latency_ms / 1000.0 + (nbytes * 8 / (self.gbps * 1e9) if self.gbps > 0 else 0.0)


@dataclass
class WorkerArgs:
    """Everything a shard process needs; published in the store for ranks launched on other hosts."""

    world_size: int
    generation: int
    store_host: str
    store_port: int
    checkpoint: str
    plan: dict  # Plan.to_dict()
    fingerprint: str
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per process)
    threads: int = 1
    timeouts: ShardTimeouts = ShardTimeouts()
    rank: int = -1  # -1: taken from torchrun's RANK plus the rank offset
    parent_pid: int | None = None  # local shards exit when this process disappears
    local: bool = True
    link: LinkEmulation = LinkEmulation()
    # [start, stop): the shard set serves only these layers (a swarm stage's block); None: the whole model.
    # A block not starting at 0 takes the residual state entering `start` from the driver; one not ending at
    # the last layer answers the state leaving `stop - 1` instead of logits.
    layer_range: list[int] | None = None

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "WorkerArgs":
        d = json.loads(text)
        d["timeouts"] = ShardTimeouts(**d["timeouts"])
        d["link"] = LinkEmulation(**d.get("link", {}))
        return cls(**d)


class StoreKeys:
    """Key names in the driver's TCP store. `generation` names the live shard set; each set has its own
    namespace so a restarted set never meets the leftovers of the one before it."""

    GENERATION = "generation"

    def __init__(self, generation: int):
        self.prefix = f"gen{generation}/"

    def args(self) -> str:
        return self.prefix + "args"

    def closed(self) -> str:
        return self.prefix + "closed"

    def heartbeat(self, rank: int) -> str:
        return f"{self.prefix}hb/{rank}"

    def claim(self, rank: int) -> str:
        return f"{self.prefix}claim/{rank}"

    def loaded(self, rank: int) -> str:
        return f"{self.prefix}loaded/{rank}"

    def info(self, rank: int) -> str:
        return f"{self.prefix}info/{rank}"

    def error(self, rank: int) -> str:
        return f"{self.prefix}error/{rank}"

    def error_count(self) -> str:
        """Bumped with every error report, so the driver looks for reports with one store call."""
        return self.prefix + "errors"

    def process_group(self) -> str:
        return self.prefix + "pg/"


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


__all__ = [
    "StepHeader", "CacheOp", "MARK", "REWIND", "META_LEN", "PING", "STEP", "STATS", "STOP", "state_sources", "pack", "unpack",
    "packed_nbytes", "dispatch_specs", "ShardTimeouts", "LinkEmulation", "LOGITS_TAG", "WorkerArgs", "StoreKeys", "dtype_of",
]
