"""One shard process of the sharded Kimi K3 runtime (docs/engine.md section 2).

A shard is one device of a placement plan (`inference.planning.plan.Plan`): it loads, through the one checkpoint
loader (`inference.model.checkpoint.load_checkpoint` with `shard_selection`), only the tensors that plan gives
its rank (its home layers' attention, norms, router, latent projections and shared experts, its routed
experts, the embedding or the LM head when they are its), keeps the decode caches of its home layers, and
runs every step on the same deterministic schedule as every other rank (`ShardRank.run_step`): the residual
state moves to each layer's home, the home runs attention and routing and sends each expert holder the
latent rows it must compute, the holders answer with weighted partial sums, the head rank returns logits to
rank 0, which answers the driver (`inference.sharding.driver.ShardedModel`). Message layouts:
`inference.sharding.messages`. A layer with a `dense_split` group (and a split LM head) runs its attention
heads, shared experts and vocabulary split over the group's ranks (`inference.sharding.dense_split`): the home
sends each block's input, every rank of the group computes its part and returns a partial sum. Each rank reads
only its parts of the split tensors from the checkpoint (`load_shard_model`; `shard_read_bytes` counts them).

Any failure (a peer gone, a timeout, an exception) ends the process at once with the reason written to the
driver's store: the driver restarts the whole set, so a half-broken world never lingers.

Launching:
- local: `inference.sharding.driver.ShardedModel` spawns every rank itself (`run_local`).
- other hosts: the driver hosts a TCP store (ShardedModel(..., store="0.0.0.0:PORT")) and spawns only
  rank 0; ranks 1..N-1 are started by hand on their hosts, usually under torchrun so a crashed or
  restarted shard set comes back by itself. With the engine on host A (10.0.0.1) and ranks 1..2 of a
  3-rank plan on host B:

      host A:  GLOO_SOCKET_IFNAME=eth0 K3_SHARD_STORE=0.0.0.0:29600 <start the engine with a sharded
               EngineSpec: checkpoint=/data/k3, plan=plan.yaml>   (or ShardedModel(..., store="0.0.0.0:29600"))
      host B:  GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=8 torchrun --standalone --nproc-per-node 2 \\
                   --max-restarts 1000 -m inference.sharding.worker \\
                   --dist-addr 10.0.0.1:29600 --checkpoint /data/k3 --rank-offset 1

  The worker's rank is rank-offset + torchrun's RANK (or --rank R without torchrun). It reads the plan and
  settings from the store and checks that its checkpoint has the driver's fingerprint. After a failure
  every shard exits; torchrun restarts the local group, which waits for the driver's next generation.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from inference.model import (CheckpointError, KimiK3Model, ModelConfig, ResidualState, SequenceCache, TensorSelection,
                             fingerprint, load_checkpoint, read_config)
from inference.model.checkpoint import (LAYER_PREFIX, TensorPart, expected_tensors, model_key, row_absmax,
                                        tensor_site)
from inference.model.fp8 import quantize_dense
from inference.model.k3 import DecoderLayer
from inference.planning import Plan, RoutingRecorder, RoutingStats, merge_routing_stats
from inference.sharding.dense_split import (DenseGroup, GroupHead, attach_group, head_part, keep_only_split_part,
                                            layer_parts, mlp_part, mlp_prefix, split_head, split_layer,
                                            split_part_keys, to_meta, vocab_slice)
from inference.sharding.messages import (LOGITS_TAG, META_LEN, PING, STATS, STEP, STOP, CacheOp, LinkEmulation,
                                         StepHeader, StoreKeys, WorkerArgs, dispatch_specs, dtype_of, pack,
                                         packed_nbytes, state_sources, unpack)

log = logging.getLogger(__name__)


class ShardCommError(RuntimeError):
    """A point-to-point transfer failed or timed out: the shard set is broken."""


# =================================================================== expert dispatch
@dataclass
class ExpertTable:
    """Where one MoE layer's experts live: holders per expert (primary first) and who holds anything."""

    holders: list[list[int]]
    ranks: list[int]  # every rank holding an expert of this layer, ascending
    primary: Tensor  # [E] int64
    replicated: Tensor  # [E] bool: more than one holder

    @classmethod
    def from_holders(cls, holders: list[list[int]]) -> "ExpertTable":
        return cls([list(h) for h in holders], sorted({r for h in holders for r in h}),
                   torch.tensor([h[0] for h in holders], dtype=torch.long),
                   torch.tensor([len(h) > 1 for h in holders], dtype=torch.bool))


def choose_expert_holders(ids: Tensor, table: ExpertTable, home: int) -> Tensor:
    """The rank that computes each (token, selected expert): [T, k] int64.

    An expert with one holder goes there. For a replicated expert, per token and greedily: a holder this
    token already sends to (no extra message), else the home rank (no message at all), else the holder
    with the fewest assignments so far in this step (lowest rank on a tie).
    """
    ids = ids.cpu()
    assign = table.primary[ids]
    rep = table.replicated[ids]
    if not bool(rep.any()):
        return assign
    load: dict[int, int] = {}
    for r in assign[~rep].tolist():
        load[r] = load.get(r, 0) + 1
    for t in rep.any(dim=1).nonzero().flatten().tolist():
        row_rep = rep[t]
        chosen = set(assign[t][~row_rep].tolist())
        for j in row_rep.nonzero().flatten().tolist():
            holders = table.holders[int(ids[t, j])]
            pick = next((h for h in holders if h in chosen), None)
            if pick is None:
                pick = home if home in holders else min(holders, key=lambda h: (load.get(h, 0), h))
            assign[t, j] = pick
            chosen.add(pick)
            load[pick] = load.get(pick, 0) + 1
    return assign


def shard_selection(plan: Plan, rank: int, layer_range: tuple[int, int] | None = None,
                    split: "SplitParts | None" = None) -> TensorSelection:
    """The tensors `rank` holds under `plan`: its home layers, the experts placed on it, embedding and head, and
    (`split`, from `split_shard_model`) only its parts of the split tensors it shares, including those of layers
    homed elsewhere. `layer_range` [start, stop) (default: the plan's block): only what those layers need (the
    embedding only when start is 0, the head only when stop is the last layer + 1)."""
    start, stop = layer_range or (plan.block.start, plan.block.stop)
    split = split or SplitParts()
    head = stop == len(plan.layer_home)

    def within(key: str) -> bool:
        site = tensor_site(key)
        return site.kind == "head" and head or site.layer is not None and start <= site.layer < stop

    return TensorSelection.shard([i for i in plan.layers_homed_on(rank) if start <= i < stop],
                                 {i: e for i, e in plan.experts_on(rank).items() if start <= i < stop},
                                 embedding=rank == plan.embedding_rank and start == 0,
                                 head=rank == plan.lm_head_rank and head,
                                 keys=[k for k in split.keys if within(k)],
                                 parts={k: p for k, p in split.parts.items() if within(k)})


@dataclass
class SplitParts:
    """What a rank holds of the dense splits it takes part in: model key -> part of a split tensor, and the
    keys it holds of layers (and an LM head) homed on another rank of its group."""

    parts: dict[str, TensorPart] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)


def shard_read_bytes(config: ModelConfig, plan: Plan, rank: int, whole_layers: bool = False) -> dict[str, int]:
    """What `rank` reads of a checkpoint of `config` under `plan` (and so holds, in the checkpoint's dtypes),
    from the config alone: {"dense": bytes of its layers', embedding's and head's tensors, "experts": bytes of
    its routed experts, "largest": the largest single tensor (or part) read}. The same selection and parts
    as `load_shard_model` (tests compare the two on the tiny model). whole_layers: what loading every layer it
    shares whole and cutting it to its part afterwards read and held at its peak (before parts existed)."""
    specs = expected_tensors(config)
    split = SplitParts()
    head = plan.head_group()
    if not whole_layers:
        helped = set(plan.layers_split_with(rank))
        for layer, group in plan.dense_groups.items():
            if rank in group:
                split.parts.update({f"model.layers.{layer}.{k}": p
                                    for k, p in layer_parts(config, layer, group.index(rank), len(group)).items()})
        if len(head) > 1 and rank in head:
            split.parts["lm_head.weight"] = head_part(config, head.index(rank), len(head))
            if rank != head[0]:
                split.keys.add("lm_head.weight")
        for name in specs:
            key = model_key(name)
            if key.startswith(LAYER_PREFIX):
                layer, _, within = key[len(LAYER_PREFIX):].partition(".")
                mlp = mlp_prefix(config, int(layer)) if int(layer) in helped else None
                if int(layer) in helped and (within.startswith("self_attn.") or mlp and within.startswith(mlp)):
                    split.keys.add(key)
        select = shard_selection(plan, rank, split=split)
    else:
        select = TensorSelection.shard(set(plan.layers_homed_on(rank)) | set(plan.layers_split_with(rank)),
                                       plan.experts_on(rank),
                                       embedding=rank == plan.embedding_rank and plan.has_embedding,
                                       head=rank in head and plan.has_head)
    out = {"dense": 0, "experts": 0, "largest": 0}
    for name, spec in specs.items():
        key = model_key(name)
        if not select.holds(key):
            continue
        part = select.parts.get(key)
        n = spec.nbytes if part is None or key.endswith(".A_log") else \
            spec.nbytes // spec.shape[part.dim] * (part.stop - part.start)
        out["experts" if tensor_site(key).kind == "expert" else "dense"] += n
        out["largest"] = max(out["largest"], n)
    return out


# Below this size the skeleton is built on the CPU and then emptied onto meta: the same result, but the
# first meta-device operations of a process import PyTorch's Python meta kernels (seconds per process).
CPU_SKELETON_MAX_BYTES = 1 << 30


def model_skeleton(config: ModelConfig, dtype: torch.dtype, on: str | None = None) -> KimiK3Model:
    """KimiK3Model with every tensor on the meta device (shapes and dtypes only, nothing allocated).

    on: "meta" builds it there directly (any size); "cpu" builds it in memory and drops the tensors (small
    models only); None picks by size."""
    if on is None:
        on = "cpu" if 4 * config.num_parameters() <= CPU_SKELETON_MAX_BYTES else "meta"
    if on == "meta":
        with torch.device("meta"):
            return KimiK3Model(config, dtype=dtype, random_init=False).eval()
    if on != "cpu":
        raise ValueError(f"skeleton device must be 'meta' or 'cpu', got {on!r}")
    model = KimiK3Model(config, dtype=dtype, random_init=False).eval()
    to_meta(model)
    return model


def build_shard_model(config: ModelConfig, plan: Plan, rank: int, checkpoint: str,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      skeleton: str | None = None, layer_range: tuple[int, int] | None = None) -> KimiK3Model:
    """The model with only `rank`'s tensors materialised (read from `checkpoint`); the rest stay on meta."""
    return load_shard_model(config, plan, rank, checkpoint, dtype, device, skeleton, layer_range)[0]


def load_shard_model(config: ModelConfig, plan: Plan, rank: int, checkpoint: str,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     skeleton: str | None = None,
                     layer_range: tuple[int, int] | None = None) -> tuple[KimiK3Model, dict]:
    """`build_shard_model` and the loader's report (bytes read, the largest tensor held while reading).

    The skeleton is cut to this rank's parts of its dense splits first, so the loader reads only those parts
    of the split tensors: no rank ever holds a whole tensor it shares."""
    model = model_skeleton(config, dtype, skeleton)
    split = split_shard_model(model, plan, rank)
    report = load_checkpoint(model, checkpoint, verify=False, progress=False,
                             select=shard_selection(plan, rank, layer_range, split), device=device)
    if plan.dense_dtype == "fp8":  # a column part takes its whole rows' scales, as the unsplit layer's
        columns = [k for k, p in split.parts.items() if p.dim == 1 and not model.get_parameter(k).is_meta]
        amax = row_absmax(checkpoint, columns)
        quantize_dense(model, {k.removesuffix(".weight"): a for k, a in amax.items()})
    return model, report


def split_shard_model(model: KimiK3Model, plan: Plan, rank: int) -> SplitParts:
    """Cut the dense weights of every split layer (and a split LM head) this rank takes part in to its part (on a
    skeleton: to its part's shapes), and drop what only the home uses; returns the parts and shared keys."""
    split = SplitParts()
    for layer, group in plan.dense_groups.items():
        if rank in group:
            prefix = f"model.layers.{layer}."
            cut = split_layer(model.layers[layer], group.index(rank), len(group))
            split.parts.update({prefix + k: p for k, p in cut.items()})
            if group[0] != rank:
                keep_only_split_part(model.layers[layer])
                split.keys.update(prefix + k for k in split_part_keys(model.layers[layer]))
    group = plan.head_group()
    if len(group) > 1 and rank in group:
        split.parts["lm_head.weight"] = split_head(model, group.index(rank), len(group))
        if group[0] != rank:  # the final norm and output AttnRes site run on the head rank
            split.keys.add("lm_head.weight")
            for module in (model.model.norm, model.model.output_attn_res_norm, model.model.output_attn_res_proj):
                to_meta(module)
    return split


def tensor_nbytes(model: nn.Module, resident: bool) -> int:
    """Bytes of the model's parameters and buffers held in memory (resident) or in the whole model."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not (resident and t.is_meta))


# =================================================================== point to point with timeouts
class PendingRecv:
    """A receive posted now and waited for later (rank 0's logits while it starts the next micro-batch)."""

    def __init__(self, wire: "Wire", work, buf: Tensor, what: str):
        self.wire, self.work, self.buf, self.what = wire, work, buf, what

    def result(self) -> Tensor:
        self.wire._wait(self.work, self.what)
        return self.buf


class ReadyValue:
    """A result that is already there, with PendingRecv's surface."""

    def __init__(self, value: Tensor):
        self.value = value

    def result(self) -> Tensor:
        return self.value


class Wire:
    """isend/irecv to peers; every wait is bounded.

    A gloo send completes only when the peer has received it, so sends are kept (with their tensors) per
    step and waited for later: `end_step()` closes the current step's list, `settle(keep)` waits for all
    but the last `keep` steps' sends, `flush()` for everything. A rank then never waits for a peer to reach
    a message of the step it has just finished, which is what lets pipeline stages overlap.

    With a `LinkEmulation`, every message leaves through a link of that latency and bandwidth per peer
    (`EmulatedLinks`), so a run on one host behaves like ranks on hosts joined by that network."""

    def __init__(self, rank: int, device: torch.device, timeout: float, link: LinkEmulation | None = None):
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.current: list[tuple[object, Tensor, str]] = []
        self.steps: collections.deque[list] = collections.deque()
        self.bytes_sent = 0
        self.links = EmulatedLinks(self, link) if link is not None and link.active else None

    def send(self, dst: int, tensor: Tensor, what: str, tag: int = 0) -> None:
        t = tensor.to(self.device).contiguous()
        self.bytes_sent += t.numel() * t.element_size()
        if self.links is not None:
            self.links.put(dst, t, what, tag)
        else:
            self.current.append((self.post_send(dst, t, what, tag), t, f"sending {what} to rank {dst}"))

    def post_send(self, dst: int, t: Tensor, what: str, tag: int):
        try:
            return dist.isend(t, dst, tag=tag)
        except Exception as exc:
            raise ShardCommError(f"rank {self.rank}: sending {what} to rank {dst} failed: {exc}") from None

    def irecv(self, src: int, shape, dtype: torch.dtype, what: str, tag: int = 0) -> PendingRecv:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, src, tag=tag)
        except Exception as exc:
            raise ShardCommError(f"rank {self.rank}: receiving {what} from rank {src} failed: {exc}") from None
        return PendingRecv(self, work, buf, f"receiving {what} from rank {src}")

    def recv(self, src: int, shape, dtype: torch.dtype, what: str, timeout: float | None = None,
             tag: int = 0) -> Tensor:
        pending = self.irecv(src, shape, dtype, what, tag)
        self._wait(pending.work, pending.what, timeout)
        return pending.buf

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = []
        if self.links is not None:
            self.links.check()

    def settle(self, keep: int) -> None:
        """Wait for the sends of every step but the last `keep` ones."""
        while len(self.steps) > keep:
            for work, _, what in self.steps.popleft():
                self._wait(work, what)

    def flush(self) -> None:
        """Wait until every message sent so far has been received."""
        self.end_step()
        self.settle(0)
        if self.links is not None:
            self.links.drain(self.timeout)

    def _wait(self, work, what: str, timeout: float | None = None) -> None:
        limit = self.timeout if timeout is None else timeout
        try:
            work.wait(timedelta(seconds=limit))
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "Timed out" in text or "timeout" in text.lower():
                text = f"no answer within {limit:g} s ({text})"
            raise ShardCommError(f"rank {self.rank}: {what} failed: {text}") from None


class EmulatedLinks:
    """The outgoing links of one rank, each with a latency and a bandwidth (docs/engine.md, emulated links).

    A message of n bytes to peer d starts when d's link is free (messages to one peer go one after another),
    occupies it n / bandwidth seconds, and is handed to the transport `latency` after it is through, by
    that link's sender thread. The rank's own compute goes on meanwhile, as with a real NIC; order per peer
    is kept, so the schedule's matching of messages is unchanged."""

    def __init__(self, wire: Wire, link: LinkEmulation):
        self.wire = wire
        self.latency = link.latency_ms / 1000.0
        self.bytes_per_s = link.gbps * 1e9 / 8 if link.gbps > 0 else math.inf
        self.free_at: dict[int, float] = {}
        self.queues: dict[int, collections.deque] = {}
        self.cond = threading.Condition()
        self.busy = 0  # messages queued or in transfer
        self.error: BaseException | None = None

    def put(self, dst: int, t: Tensor, what: str, tag: int) -> None:
        self.check()
        with self.cond:
            start = max(time.monotonic(), self.free_at.get(dst, 0.0))
            through = start + t.numel() * t.element_size() / self.bytes_per_s
            self.free_at[dst] = through
            if dst not in self.queues:
                self.queues[dst] = collections.deque()
                threading.Thread(target=self._run, args=(dst,), daemon=True, name=f"k3-link-{dst}").start()
            self.queues[dst].append((through + self.latency, t, what, tag))
            self.busy += 1
            self.cond.notify_all()

    def _run(self, dst: int) -> None:
        queue = self.queues[dst]
        while True:
            with self.cond:
                while not queue:
                    self.cond.wait()
                due, t, what, tag = queue[0]
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                self.wire._wait(self.wire.post_send(dst, t, what, tag), f"sending {what} to rank {dst}")
            except BaseException as exc:  # noqa: BLE001 - reported to the main thread by check()
                self.error = exc
            with self.cond:
                queue.popleft()
                self.busy -= 1
                self.cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self, timeout: float) -> None:
        """Wait until every queued message has been received."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.busy and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardCommError(f"rank {self.wire.rank}: the emulated links did not drain within {timeout:g} s")
                self.cond.wait(left)
        self.check()


# =================================================================== the schedule
class ShardRank:
    """One rank's part of every step. All ranks call `run_step` with the same header and meet in order."""

    def __init__(self, args: WorkerArgs, rank: int, device: torch.device):
        self.args = args
        self.rank = rank
        self.world_size = args.world_size
        self.config = read_config(args.checkpoint)
        self.plan = Plan.from_dict(args.plan, source="the driver's plan")
        if self.plan.config_hash != self.config.config_hash():
            raise CheckpointError(f"the plan was made for config {self.plan.config_hash[:12]}..., the checkpoint at "
                                  f"{args.checkpoint} is {self.config.config_hash()[:12]}...")
        if self.plan.num_ranks != args.world_size:
            raise ValueError(f"the plan has {self.plan.num_ranks} devices, the shard set {args.world_size} ranks")
        self.device = device
        self.dtype = dtype_of(args.dtype)
        self.start, self.stop = args.layer_range or (self.plan.block.start, self.plan.block.stop)
        t0 = time.perf_counter()
        self.model, self.load_report = load_shard_model(self.config, self.plan, rank, args.checkpoint, self.dtype,
                                                        device, layer_range=(self.start, self.stop))
        self.load_seconds = time.perf_counter() - t0
        self.recorder = RoutingRecorder(self.config.num_experts, self.config.experts_per_token)
        self.model.routing_observer = self.recorder.observe
        self.homed = [i for i in self.plan.layers_homed_on(rank) if self.start <= i < self.stop]
        self.tables = {layer: ExpertTable.from_holders(h) for layer, h in self.plan.expert_placement.items()}
        self.held = {}
        for layer, table in self.tables.items():
            mask = torch.zeros(self.config.num_experts, dtype=torch.bool)
            mask[[e for e, h in enumerate(table.holders) if rank in h]] = True
            self.held[layer] = mask
        self.caches: dict[int, SequenceCache] = {}
        self.wire = Wire(rank, device, args.timeouts.comm, args.link)
        # dense split: the home drives each split block through a DenseGroup; the others serve their part
        self.helped = self.plan.layers_split_with(rank)
        self.cache_layers = sorted(set(self.homed) | set(self.helped))
        for layer in self.homed:
            group = self.plan.dense_group(layer)
            if len(group) > 1:
                attach_group(self.model.layers[layer],
                             lambda what, g=group, i=layer: DenseGroup(g, self.wire.send, self.wire.recv,
                                                                       f"layer {i} {what}"))
        head_group = self.plan.head_group()
        self.head_widths = [len(vocab_slice(self.config.vocab_size, p, len(head_group)))
                            for p in range(len(head_group))]
        if len(head_group) > 1 and rank == self.plan.lm_head_rank:
            self.model.lm_head = GroupHead(self.model.lm_head, DenseGroup(head_group, self.wire.send, self.wire.recv,
                                                                          "LM head"), self.head_widths)

    def info(self) -> dict:
        return {
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(self.device),
            "homed_layers": self.homed,
            "experts": {str(layer): ids for layer, ids in self.plan.experts_on(self.rank).items()},
            # what this rank holds of the block it serves (the embedding only from layer 0, the head only to the end)
            "embedding": self.rank == self.plan.embedding_rank and self.start == 0,
            "lm_head": self.rank == self.plan.lm_head_rank and self.stop == self.config.num_layers,
            "dense_split_layers": self.helped, "dense_dtype": self.plan.dense_dtype,
            "resident_bytes": tensor_nbytes(self.model, resident=True),
            "model_bytes": tensor_nbytes(self.model, resident=False),
            "load_seconds": round(self.load_seconds, 3),
            # from the checkpoint: bytes of tensor data read, and the most of one tensor held at once while reading
            "checkpoint_bytes_read": self.load_report["bytes"],
            "largest_tensor_read": self.load_report["largest"],
            "largest_part_read": self.load_report["largest_part"],
        }

    # ------------------------------------------------------------ headers
    def send_header(self, header: StepHeader) -> None:
        meta, payload = header.encode()
        for r in range(1, self.world_size):
            self.wire.send(r, meta, "step header")
            if payload is not None:
                self.wire.send(r, payload, "step header payload")

    def recv_header(self) -> StepHeader:
        idle = self.args.timeouts.idle
        meta = self.wire.recv(0, (META_LEN,), torch.long, "the next step header", timeout=idle).tolist()
        n = StepHeader.payload_len(meta)
        payload = self.wire.recv(0, (n,), torch.long, "step header payload") if n else None
        return StepHeader.decode(meta, payload)

    # ------------------------------------------------------------ one step
    @torch.inference_mode()
    def run_step(self, h: StepHeader, state_in: Tensor | None = None) -> PendingRecv | ReadyValue | None:
        """Embed, every layer, head. On rank 0: the logits [R, V] fp32 to come (`.result()`), None elsewhere.

        With a layer range: the layers [start, stop) only. A range not starting at 0 begins from `state_in`
        (rank 0: the state entering `start`, [sources, T, D]); a range not ending at the last layer gives rank 0
        the state leaving it ([sources, T, D]) instead of logits.

        Rank 0 does not wait for them here: it may start the next micro-batch while the later stages still
        work on this one. Every other rank waits for its sends one step later (`Wire.settle`)."""
        cfg, plan, me = self.config, self.plan, self.rank
        for slot in h.freed:
            self.caches.pop(slot, None)
        if self.cache_layers:
            for slot in h.slots:
                if slot not in self.caches:
                    self.caches[slot] = self.model.new_cache(layers=self.cache_layers)
            for op in h.cache_ops:  # speculative decoding's marks and rewinds, before this step's tokens
                if op.slot not in self.caches:
                    raise RuntimeError(f"rank {me}: a cache op for sequence slot {op.slot}, which has no state here")
                op.apply(self.caches[op.slot])
        lengths = tuple(h.lengths)
        if self.start == 0:
            cur = plan.embedding_rank
            state = self.model.embed(h.ids.to(self.device), lengths) if me == cur else None
        else:
            cur = 0
            state = None
            if me == 0:
                t = state_in.to(self.device, torch.float32)
                state = ResidualState(lengths, list(t[:-1].unbind(0)), t[-1])
        for i in range(self.start, self.stop):
            layer = self.model.layers[i]
            home = plan.layer_home[i]
            state = self._hop(state, cur, home, i, lengths, f"the residual state into layer {i}")
            cur = home
            if me == home:
                state, x = layer.attend(state, [self.caches[s] for s in h.slots])
                if layer.is_moe:
                    moe = layer.block_sparse_moe
                    m = moe.finish(self._home_experts(i, moe, x), x)
                else:
                    m = layer.mlp(x)
                state = layer.add_mlp(state, m)
            elif i in self.helped:
                self._serve_split_layer(i, home, lengths, [self.caches[s] for s in h.slots])
            elif layer.is_moe and me in self.tables[i].ranks:
                self._serve_experts(i, home)
        if self.stop < cfg.num_layers:
            return self._block_end(state, cur, lengths, h)
        # the head needs one row per sequence (its last new token), or every row for scoring
        rows = None
        if not h.all_logits:
            rows, end = [], 0
            for n in lengths:
                end += n
                rows.append(end - 1)
        head = plan.lm_head_rank
        logits = None
        if cur == head:
            if me == head:
                logits = self.model.head(state, rows)
        else:
            if me == cur and rows is not None:
                state = state.select(rows)
            R = h.logit_rows
            state = self._hop(state, cur, head, cfg.num_layers, (1,) * R if rows is not None else lengths,
                              "the residual state into the head")
            if me == head:
                logits = self.model.head(state)
        if me != head and me in plan.head_group():
            self._serve_split_head(head, h.logit_rows if rows is not None else sum(lengths))
        result = None
        if head != 0:
            if me == head:
                self.wire.send(0, logits.float(), "logits", tag=LOGITS_TAG)
            elif me == 0:
                result = self.wire.irecv(head, (h.logit_rows, cfg.vocab_size), torch.float32, "logits",
                                         tag=LOGITS_TAG)
        elif me == 0:
            result = ReadyValue(logits)
        for slot, n in zip(h.slots, lengths):
            if slot in self.caches:
                self.caches[slot].advance(n)
        self.wire.end_step()
        if me != 0:
            self.wire.settle(1)
        return result

    def _block_end(self, state: ResidualState | None, cur: int, lengths: tuple[int, ...],
                   h: StepHeader) -> ReadyValue | None:
        """A layer range ending before the head: the state leaving it goes to rank 0 (the driver's answer)."""
        state = self._hop(state, cur, 0, self.stop, lengths, f"the residual state leaving layer {self.stop - 1}")
        for slot, n in zip(h.slots, lengths):
            if slot in self.caches:
                self.caches[slot].advance(n)
        self.wire.end_step()
        if self.rank != 0:
            self.wire.settle(1)
            return None
        return ReadyValue(torch.stack(state.blocks + [state.partial]).float())

    def _hop(self, state: ResidualState | None, src: int, dst: int, layer: int, lengths: tuple[int, ...],
             what: str) -> ResidualState | None:
        """Move the residual state from src to dst (entering `layer`; num_layers = the head)."""
        if src == dst:
            return state
        n = state_sources(self.config, layer)
        if self.rank == src:
            if len(state.blocks) + 1 != n:
                raise RuntimeError(f"{what}: the state has {len(state.blocks)} blocks, the schedule expects {n - 1}")
            self.wire.send(dst, torch.stack(state.blocks + [state.partial]), what)
            return None
        if self.rank == dst:
            t = self.wire.recv(src, (n, sum(lengths), self.config.hidden_size), torch.float32, what)
            return ResidualState(lengths, list(t[:-1].unbind(0)), t[-1])
        return None

    def _serve_split_layer(self, i: int, home: int, lengths: tuple[int, ...], caches: list[SequenceCache]) -> None:
        """This rank's part of layer i's split dense work, in the home's order: attention, the routed experts it
        holds (if any), then the dense MLP or shared experts."""
        layer = self.model.layers[i]
        shape = (sum(lengths), self.config.hidden_size)
        x = self.wire.recv(home, shape, self.dtype, f"layer {i} attention input")
        y = DecoderLayer.attention(layer, x, lengths, [layer._layer_cache(c) for c in caches])
        self.wire.send(home, y.float(), f"layer {i} attention partial sum")
        if layer.is_moe and self.rank in self.tables[i].ranks:
            self._serve_experts(i, home)
        mlp = mlp_part(layer)
        if mlp is not None:
            what = "shared experts" if layer.is_moe else "dense MLP"
            x = self.wire.recv(home, shape, self.dtype, f"layer {i} {what} input")
            self.wire.send(home, mlp(x).float(), f"layer {i} {what} partial sum")

    def _serve_split_head(self, head: int, rows: int) -> None:
        """This rank's vocabulary slice of the LM head for the head rank's `rows` normalised rows."""
        x = self.wire.recv(head, (rows, self.config.hidden_size), self.dtype, "LM head input")
        self.wire.send(head, self.model.lm_head(x).float(), "LM head columns")

    def _home_experts(self, layer: int, moe, x: Tensor) -> Tensor:
        """Route on the home rank, dispatch latent rows to the holders, add up their partial sums: [T, latent]."""
        ids, weights = moe.route(x)
        z = moe.down(x)
        table = self.tables[layer]
        assign = choose_expert_holders(ids, table, self.rank).to(ids.device)
        T, latent = x.shape[0], self.config.latent_size
        y = torch.zeros(T, latent, dtype=torch.float32, device=x.device)
        waiting = []
        for r in table.ranks:
            if r == self.rank:
                continue
            tok, slot = (assign == r).nonzero(as_tuple=True)
            rows, local = torch.unique(tok, return_inverse=True)
            self.wire.send(r, torch.tensor([rows.numel(), tok.numel()], dtype=torch.long),
                           f"layer {layer} dispatch header")
            if tok.numel():
                self.wire.send(r, pack([local, ids[tok, slot], weights[tok, slot].float(), z[rows]]),
                               f"layer {layer} latent rows")
            waiting.append((r, rows))
        tok, slot = (assign == self.rank).nonzero(as_tuple=True)
        if tok.numel():  # this rank's own experts run while the others compute
            rows, local = torch.unique(tok, return_inverse=True)
            y.index_add_(0, rows, self._expert_share(layer, moe, z[rows], local, ids[tok, slot], weights[tok, slot]))
        for r, rows in waiting:
            if rows.numel():
                part = self.wire.recv(r, (rows.numel(), latent), torch.float32, f"layer {layer} expert partial sums")
                y.index_add_(0, rows, part)
        return y

    def _serve_experts(self, layer: int, home: int) -> None:
        tokens, assignments = self.wire.recv(home, (2,), torch.long, f"layer {layer} dispatch header").tolist()
        if assignments == 0:
            return
        specs = dispatch_specs(tokens, assignments, self.config.latent_size, self.dtype)
        buf = self.wire.recv(home, (packed_nbytes(specs),), torch.uint8, f"layer {layer} latent rows")
        local, experts, weights, z = unpack(buf, specs)
        moe = self.model.layers[layer].block_sparse_moe
        self.wire.send(home, self._expert_share(layer, moe, z, local, experts, weights),
                       f"layer {layer} expert partial sums")

    def _expert_share(self, layer: int, moe, z: Tensor, local: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """sum over this rank's assignments of w * Expert_e(z_token), per distinct token: [T_r, latent] fp32."""
        held = self.held[layer][experts.cpu()]
        if not bool(held.all()):
            missing = sorted(set(experts.cpu()[~held].tolist()))
            raise RuntimeError(f"rank {self.rank} was sent experts {missing} of layer {layer}, which it does not hold")
        # one row per assignment, so the (token, expert) pairs chosen for this rank are exactly what runs
        part = moe.expert_partial(z[local], experts[:, None], weights[:, None].float())
        out = torch.zeros(z.shape[0], self.config.latent_size, dtype=torch.float32, device=z.device)
        return out.index_add_(0, local, part)

    # ------------------------------------------------------------ routing statistics
    def routing_payload(self, reset: bool) -> bytes:
        data = json.dumps(self.recorder.to_stats().to_dict()).encode()
        if reset:
            self.recorder.reset()
        return data

    def gather_stats(self, reset: bool) -> dict:
        parts = [RoutingStats.from_dict(json.loads(self.routing_payload(reset)))]
        for r in range(1, self.world_size):
            n = int(self.wire.recv(r, (1,), torch.long, "routing statistics size").item())
            buf = self.wire.recv(r, (n,), torch.uint8, "routing statistics")
            parts.append(RoutingStats.from_dict(json.loads(bytes(buf.cpu().numpy()))))
        self.wire.flush()
        return merge_routing_stats(parts).to_dict()

    def send_stats(self, reset: bool) -> None:
        data = self.routing_payload(reset)
        self.wire.send(0, torch.tensor([len(data)], dtype=torch.long), "routing statistics size")
        self.wire.send(0, torch.frombuffer(bytearray(data), dtype=torch.uint8), "routing statistics")
        self.wire.flush()

    # ------------------------------------------------------------ serving loops
    def serve_driver(self, conn, fail) -> None:
        """Rank 0: steps come from the driver's pipe; idle time is filled with keepalive pings.

        A step is started as soon as it arrives, without waiting for the logits of the steps before it: those
        are waited for, in order, by an answer thread that passes them to the driver. So when the driver
        has several micro-batches in flight, this stage works on the next while the later stages finish
        the earlier ones. `fail(exc)` ends the process (a failure in the answer thread)."""
        keepalive = self.args.timeouts.keepalive
        answers: queue.Queue = queue.Queue()
        send_lock = threading.Lock()

        def answer() -> None:
            try:
                while True:
                    item = answers.get()
                    if item is None:
                        return
                    number, pending = item
                    logits = pending.result().cpu().numpy()
                    with send_lock:
                        conn.send(("logits", number, logits))
                    answers.task_done()
            except BaseException as exc:  # noqa: BLE001 - the shard set is broken: report and exit
                fail(exc)

        threading.Thread(target=answer, daemon=True, name="k3-shard-answers").start()
        in_flight = 0
        while True:
            if not conn.poll(keepalive):
                if answers.unfinished_tasks == 0:
                    self.send_header(StepHeader(PING))
                    self.wire.flush()
                continue
            msg = conn.recv()
            kind = msg[0]
            if kind == "step":
                _, number, slots, lengths, ids, freed, all_logits, ops = msg[:8]
                state_in = torch.from_numpy(msg[8]) if len(msg) > 8 and msg[8] is not None else None
                header = StepHeader(STEP, number, list(slots), list(lengths), torch.from_numpy(ids), list(freed),
                                    bool(all_logits), cache_ops=[CacheOp(*op) for op in ops])
                self.send_header(header)
                answers.put((number, self.run_step(header, state_in)))
                in_flight = answers.unfinished_tasks
                self.wire.settle(in_flight + 1)  # the sends of steps whose logits are back have been received
                continue
            answers.join()  # anything else waits for the steps in flight
            self.wire.settle(0)
            if kind == "stats":
                _, number, reset = msg
                self.send_header(StepHeader(STATS, number, reset=bool(reset)))
                stats = self.gather_stats(bool(reset))
                with send_lock:
                    conn.send(("stats", number, stats))
            elif kind == "close":
                self.send_header(StepHeader(STOP))
                self.wire.flush()
                answers.put(None)
                with send_lock:
                    conn.send(("closed",))
                return
            else:
                raise ValueError(f"unknown driver message {kind!r}")

    def serve_peers(self) -> None:
        """Ranks 1..N-1: follow rank 0's headers until told to stop."""
        while True:
            header = self.recv_header()
            if header.kind == PING:
                continue
            if header.kind == STOP:
                return
            if header.kind == STEP:
                self.run_step(header)
            elif header.kind == STATS:
                self.send_stats(header.reset)


# =================================================================== process entry points
def _keep_alive(host: str, port: int, key: str, interval: float, parent_pid: int | None, timeout: float) -> None:
    """Heartbeat thread: proves to the driver that this process is scheduled; exits when orphaned."""
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        beat = 0
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                os._exit(3)  # the driver died: nobody will ever send us work
            beat += 1
            client.set(key, str(beat))
            time.sleep(interval)
    except Exception:
        os._exit(4)  # the driver's store is gone: so is the driver


def _device_for(args: WorkerArgs, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for but this process sees no GPU")
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % torch.cuda.device_count())
    raise ValueError(f"device must be 'cpu' or 'cuda', got {args.device!r}")


def serve(args: WorkerArgs, rank: int, conn=None, claim: bool = True) -> None:
    """Load, join the world, serve until told to stop; on any failure report and exit. Never returns.

    `claim`: take the rank in the store first (external workers have claimed it while joining)."""
    keys = StoreKeys(args.generation)
    t = args.timeouts
    torch.set_num_threads(max(1, args.threads))
    store = None

    def fail(exc: BaseException) -> None:
        """Record why this process fails (the store, rank 0's pipe) and exit at once."""
        text = f"rank {rank}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, (ShardCommError, EOFError)):
            traceback.print_exception(exc, file=sys.stderr)
        print(f"k3 shard {text}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            store.set(keys.error(rank), text)
            store.add(keys.error_count(), 1)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.send(("error", -1, text))
        os._exit(1)

    try:
        store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=timedelta(seconds=t.startup))
        threading.Thread(target=_keep_alive, daemon=True, name="k3-shard-heartbeat",
                         args=(args.store_host, args.store_port, keys.heartbeat(rank), t.heartbeat_interval,
                               args.parent_pid, t.startup)).start()
        if claim and store.add(keys.claim(rank), 1) != 1:
            raise RuntimeError(f"rank {rank} of shard set {args.generation} was already taken by another process")
        device = _device_for(args, rank)
        shard = ShardRank(args, rank, device)
        store.set(keys.info(rank), json.dumps(shard.info()))
        store.set(keys.loaded(rank), "1")
        store.wait([keys.loaded(r) for r in range(args.world_size)], timedelta(seconds=t.startup))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(keys.process_group(), store), rank=rank,
                                world_size=args.world_size, timeout=timedelta(seconds=t.comm))
        if conn is not None:
            conn.send(("ready",))
            shard.serve_driver(conn, fail)
        else:
            shard.serve_peers()
    except BaseException as exc:  # noqa: BLE001 - every failure ends this process, with its reason recorded
        fail(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: peers may be gone, and gloo's destructor would wait for them


def run_local(args: WorkerArgs, rank: int, conn=None) -> None:
    """Target of the processes ShardedModel spawns."""
    with contextlib.suppress(OSError):
        os.setsid()  # its own session: the terminal's Ctrl-C goes to the engine, which stops the shards itself
    if args.local:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this host: stay on loopback
    serve(args, rank, conn)


def _join_generation(store: dist.TCPStore, rank: int | None, rank_offset: int, timeout: float) -> WorkerArgs:
    """Wait for an open shard set of the driver whose `rank` is still free, and take it."""
    if rank is None:
        if "RANK" not in os.environ:
            raise SystemExit("give --rank, or launch under torchrun (which sets RANK)")
        rank = rank_offset + int(os.environ["RANK"])
    waited_for = None
    while True:
        store.wait([StoreKeys.GENERATION], timedelta(seconds=timeout))
        generation = int(store.get(StoreKeys.GENERATION))
        keys = StoreKeys(generation)
        if generation != waited_for and not store.check([keys.closed()]) and store.check([keys.args()]):
            if store.add(keys.claim(rank), 1) == 1:
                args = WorkerArgs.from_json(store.get(keys.args()).decode())
                if not 0 < rank < args.world_size:
                    raise SystemExit(f"rank {rank} is outside 1..{args.world_size - 1} of the driver's plan")
                args.rank = rank
                return args
            waited_for = generation  # that set already has this rank (our previous life): wait for the next
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m inference.sharding.worker",
                                     description="Run shard ranks of a sharded Kimi K3 engine hosted elsewhere.")
    parser.add_argument("--dist-addr", required=True, help="HOST:PORT of the driver's TCP store")
    parser.add_argument("--checkpoint", required=True, help="this host's copy of the checkpoint directory")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: RANK + offset)")
    parser.add_argument("--rank-offset", type=int, default=1, help="added to torchrun's RANK (rank 0 is the driver's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="override the driver's device kind")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the driver's setting)")
    parser.add_argument("--connect-timeout", type=float, default=3600.0,
                        help="seconds to wait for the driver's store and shard set")
    opts = parser.parse_args(argv)
    host, _, port = opts.dist_addr.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--dist-addr must be HOST:PORT, got {opts.dist_addr!r}")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=opts.connect_timeout))
    args = _join_generation(store, opts.rank, opts.rank_offset, opts.connect_timeout)
    mine = fingerprint(opts.checkpoint)
    if mine != args.fingerprint:
        raise SystemExit(f"checkpoint {opts.checkpoint} has fingerprint {mine}, the driver serves {args.fingerprint}")
    args.checkpoint = opts.checkpoint
    args.store_host, args.store_port = host, int(port)
    args.parent_pid = None  # torchrun (or the operator) owns this process
    if opts.device:
        args.device = opts.device
    if opts.threads:
        args.threads = opts.threads
    print(f"k3 shard rank {args.rank} joining shard set {args.generation} of {args.world_size} ranks at "
          f"{opts.dist_addr}", file=sys.stderr, flush=True)
    del store
    serve(args, args.rank, claim=False)


if __name__ == "__main__":
    main()
