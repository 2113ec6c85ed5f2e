"""The sharded Kimi K3 model: the weights split over several processes, driven like the single-process model.

`ShardedModel` has the surface `LocalEngine` drives (`config`, `dtype`, `new_cache()`,
`forward(token_ids, caches, all_logits)`, `recover()`, `close()`), so the serving engine runs unchanged on
top of it (`inference.serving.builders.build_sharded_engine`). Underneath (docs/engine.md section 2):

- One process per plan device (`inference.planning.plan.Plan`: pipeline stages over contiguous layers, a home rank
  per layer, expert placement with replicas), talking torch.distributed point to point (gloo on CPU, NCCL
  on CUDA). Each loads only its own tensors. The schedule, the messages and the worker process:
  `inference.sharding.worker`, `inference.sharding.messages`.
- Only rank 0 talks to this driver, over a multiprocessing Pipe: the engine's process never joins the
  torch.distributed world, so it can always kill it and start another. The driver hosts the TCP store the
  shards meet at and watch each other through (heartbeats, error reports).
- Local mode spawns every rank on this host. External mode (`store="HOST:PORT"`) spawns rank 0 only; the
  other ranks run on other hosts under torchrun (commands in inference.sharding.worker's docstring).
- A sequence's decode state lives in the shards (each rank keeps the caches of its home layers);
  `new_cache()` returns a small handle (`ShardCache`). Dropping the handle (or `free_cache`) frees the
  state at the next step.
- Faults: a shard that dies is noticed at once (its process sentinel locally, a closed connection
  remotely); one that hangs, by its heartbeat going silent (`ShardTimeouts.heartbeat`); every transfer has a
  timeout as well. The forward in flight raises `ShardFailure`, `health()` reports the set down, and
  `recover()` kills every local shard process (joined: no zombies) and starts a fresh set. Steps submitted
  to a set that is gone are dropped with it (collecting one raises `ShardFailure`). `abort()` fails the set
  from another thread when a step hangs past a caller's own deadline (the serving engine's watchdog).
- Speed (issue 17): `submit()` / `collect()` keep several steps (micro-batches of different sequences) in
  flight, so pipeline stages work on different micro-batches at once (`forward_pipelined` sends a list of
  them); `ShardCache.mark()` / `rewind()` give speculative decoding the single-process cache's rewind, the
  ops travelling with the sequence's next step; `link=LinkEmulation(latency_ms, gbps)` puts every
  inter-shard message through an emulated link (benchmarks on one host). A plan's `dense_split` groups divide
  each layer's attention heads, shared experts and the LM head over ranks of one host
  (`inference.sharding.dense_split`); its `dense_dtype: fp8` holds the dense weights in float8 e4m3.
- Routing statistics: each home rank counts expert selections and co-activation
  (`inference.planning.routing.RoutingRecorder`); `dump_routing_stats(path)` gathers them through rank 0 in the
  planner's `RoutingStats` format. `RoutingRecorder.attach(model)` does the same for the single-process model.
"""
from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from inference.model import check_forward_batch, fingerprint, read_config, verify_manifest
from inference.model.k3 import ResidualState, check_rewind
from inference.model.kda import REWIND_MODES
from inference.planning import Plan, PlanError, RoutingStats
from inference.sharding.messages import (MARK, REWIND, CacheOp, LinkEmulation, ShardTimeouts, StoreKeys, WorkerArgs,
                                         dtype_of)
from inference.sharding.worker import run_local

STORE_ENV = "K3_SHARD_STORE"  # HOST:PORT: host the store there and wait for ranks 1..N-1 from other hosts
_POLL_S = 0.25  # how often a waiting driver looks at process sentinels and heartbeats
_PEER_DEATH_GRACE_S = 0.5  # how long a reported error waits for a dying peer process to show as dead


class ShardFailure(RuntimeError):
    """The shard set failed (a process died, hung, or reported an error); its sequences are lost."""


@dataclass(frozen=True)
class ShardSetHealth:
    """The shard set's state as the serving engine reads a model's health (status "ok" | "degraded" | "down")."""

    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ShardCache:
    """The engine's handle on one sequence whose decode state lives in the shard processes.

    `mark()` and `rewind()` (speculative decoding) have the single-process `SequenceCache` meaning; they are
    recorded here and carried to the shards with this sequence's next step (`CacheOp`), where every rank
    applies them to its layers' caches before that step runs."""

    __slots__ = ("slot", "generation", "length", "freed", "marked_at", "ops", "_finalizer", "__weakref__")

    def __init__(self, slot: int, generation: int):
        self.slot = slot
        self.generation = generation
        self.length = 0
        self.freed = False
        self.marked_at: int | None = None
        self.ops: list[CacheOp] = []  # marks and rewinds not yet sent to the shards

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def marked(self) -> bool:
        return self.marked_at is not None

    def mark(self, mode: str = "snapshot") -> None:
        """Start logging what a rewind to the current length (or any later one) needs."""
        if mode not in REWIND_MODES:
            raise ValueError(f"KDA rewind mode must be one of {REWIND_MODES}; got {mode!r}")
        self.ops.append(CacheOp(self.slot, MARK, REWIND_MODES.index(mode)))
        self.marked_at = self.length

    def rewind(self, length: int) -> None:
        """Back to the state after the first `length` tokens (mark <= length <= self.length); ends the mark."""
        check_rewind(self.marked_at, length, self.length)
        self.ops.append(CacheOp(self.slot, REWIND, length))
        self.length = length
        self.marked_at = None

    def __repr__(self) -> str:
        return f"ShardCache(slot={self.slot}, generation={self.generation}, length={self.length})"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ShardedModel:
    """Kimi K3 over several shard processes, with the single-process model's forward surface."""

    def __init__(self, checkpoint: str | Path, plan: Plan | str | Path | None = None, *, shards: int | None = None,
                 mode: str = "both", replicas: int = 0, dtype: str = "float32", device: str = "cpu",
                 store: str | None = None, timeouts: ShardTimeouts = ShardTimeouts(),
                 threads_per_rank: int | None = None, verify: bool = False, start: bool = True,
                 link: LinkEmulation = LinkEmulation(), dense_split: int = 1, dense_dtype: str = "bf16",
                 layers: tuple[int, int] | None = None):
        """`plan`: a plan file (or Plan) to execute, or None for `Plan.simple(config, shards, mode, replicas,
        dense_split=..., dense_dtype=...)`: dense_split > 1 splits every layer's attention, shared experts and
        the LM head over that many ranks of its stage; dense_dtype "fp8" holds the dense weights in e4m3.
        `layers` [start, stop): serve only this block of layers (a swarm stage), driven by `forward_block`;
        the ranks load only the block's tensors of what the plan gives them. The plan must cover the block (a
        whole-model plan covers every block); with no plan the simple plan is made for the block alone
        (`Plan.simple(..., layer_range=layers)`), and a block plan given without `layers` serves its block."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (rank r on GPU r), got {device!r}")
        self.checkpoint = str(Path(checkpoint).resolve())
        self.config = read_config(self.checkpoint)
        if layers is not None and not 0 <= layers[0] < layers[1] <= self.config.num_layers:
            raise ValueError(f"layers {layers} is not a block [start, stop) of 0..{self.config.num_layers}")
        self.layer_range = None if layers is None or tuple(layers) == (0, self.config.num_layers) else \
            (int(layers[0]), int(layers[1]))
        if verify:
            verify_manifest(self.checkpoint)
        self.fingerprint = fingerprint(self.checkpoint)
        self.plan_source = "simple"
        if isinstance(plan, (str, Path)):
            self.plan_source = str(plan)
            plan = Plan.load(plan)
        elif plan is None:
            if not shards:
                raise ValueError("give a plan or a shard count")
            plan = Plan.simple(self.config, shards, mode, replicas, dense_split=dense_split, dense_dtype=dense_dtype,
                               layer_range=self.layer_range, device=device)
            self.plan_source = f"simple {mode} x{shards}" + (f", {replicas} replicas per layer" if replicas else "")
            if self.layer_range:
                self.plan_source += f", layers {self.layer_range[0]}-{self.layer_range[1] - 1}"
            if dense_split > 1:
                self.plan_source += f", dense split x{dense_split}"
            if dense_dtype != "bf16":
                self.plan_source += f", {dense_dtype} dense"
        if shards and plan.num_ranks != shards:
            raise PlanError(f"the plan places the model on {plan.num_ranks} ranks, but {shards} shards were asked for")
        plan.validate(self.config)
        if self.layer_range is None and plan.layer_range is not None:
            self.layer_range = plan.layer_range  # a block plan serves its block
        first, end = self.layer_range or (0, self.config.num_layers)
        if not plan.covers(first, end):
            raise PlanError(f"the plan places layers [{plan.block.start}, {plan.block.stop}), not the requested "
                            f"block [{first}, {end}): give a plan for that block, or a whole-model plan")
        self.plan = plan
        self.world_size = plan.num_ranks
        self.dtype = dtype_of(dtype)
        self._dtype_name = dtype
        self.device = device
        self.timeouts = timeouts
        if link.problems():
            raise ValueError("; ".join(link.problems()))
        self.link = link
        if threads_per_rank is None:
            env = os.environ.get("OMP_NUM_THREADS", "")
            threads_per_rank = int(env) if env.isdigit() else max(1, (os.cpu_count() or 1) // self.world_size)
        self.threads_per_rank = threads_per_rank
        self.external = store is not None
        if self.external:
            host, _, port = store.rpartition(":")
            if not port.isdigit():
                raise ValueError(f"store must be HOST:PORT, got {store!r}")
            self._store_port = int(port)
        else:
            self._store_port = 0  # any free port
        store_host = "127.0.0.1" if not self.external else (host or "0.0.0.0")
        # TCPStore listens on every interface whatever host it is given; a socket bound here keeps a local
        # store on loopback (and an external one on the address the plan names).
        self._store_socket = socket.create_server((store_host, self._store_port), backlog=512)
        self._store_port = self._store_socket.getsockname()[1]
        self._store = dist.TCPStore(store_host, self._store_port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=self._store_socket.fileno(),
                                    timeout=timedelta(seconds=timeouts.startup))
        self._store_port = self._store.port
        self._store_lock = threading.Lock()
        self._lock = threading.RLock()  # one driver conversation at a time
        self._ctx = multiprocessing.get_context("spawn")
        # swapped whole, never mutated in place once published: health probes read them from other threads
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._pids: dict[int, int] = {}
        self._conn = None
        self._slots = itertools.count(1)
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._messages = itertools.count(1)
        # steps of the current shard set: submitted, not yet collected; a set's end drops them
        self._in_flight: dict[int, tuple[list[int], bool]] = {}
        self._results: dict[int, np.ndarray] = {}  # logits that came back before their step was collected
        self._dropped_below = 0  # tickets below this were submitted to a shard set that is gone
        self.generation = 0
        self.ranks: list[dict] = []
        self._state = "stopped"  # stopped -> starting -> ready -> failed -> (recover) starting ... -> closed
        self._detail = "not started"
        self._hb_last: list[bytes] = []
        self._hb_seen: list[float] = []
        self.restarts = 0
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def store_address(self) -> str:
        return f"{'0.0.0.0' if self.external else '127.0.0.1'}:{self._store_port}"

    @property
    def pids(self) -> dict[int, int]:
        """Rank -> pid of the shard processes this driver started (rank 0 only in external mode)."""
        return dict(self._pids)

    def start(self) -> None:
        """Spawn a fresh shard set and wait until every rank has loaded its weights and joined."""
        with self._lock:
            if self._state == "closed":
                raise ShardFailure("this sharded model was closed")
            self.generation += 1
            keys = StoreKeys(self.generation)
            args = WorkerArgs(
                world_size=self.world_size, generation=self.generation, store_host="127.0.0.1",
                store_port=self._store_port, checkpoint=self.checkpoint, plan=self.plan.to_dict(),
                fingerprint=self.fingerprint, dtype=self._dtype_name, device=self.device,
                threads=self.threads_per_rank, timeouts=self.timeouts, parent_pid=os.getpid(),
                local=not self.external, link=self.link,
                layer_range=list(self.layer_range) if self.layer_range else None,
            )
            with self._store_lock:
                for r in range(self.world_size):
                    self._store.set(keys.heartbeat(r), "0")
                self._store.set(keys.args(), args.to_json())
                self._store.set(StoreKeys.GENERATION, str(self.generation))
            self._hb_last = [b"0"] * self.world_size
            self._hb_seen = [time.monotonic()] * self.world_size
            parent_conn, child_conn = self._ctx.Pipe()
            local_ranks = range(self.world_size) if not self.external else range(1)
            procs: dict[int, multiprocessing.process.BaseProcess] = {}
            try:
                for r in local_ranks:
                    proc = self._ctx.Process(target=run_local, args=(args, r, child_conn if r == 0 else None),
                                             name=f"k3-shard-{r}", daemon=True)
                    proc.start()
                    procs[r] = proc
            finally:
                self._procs, self._pids = procs, {r: p.pid for r, p in procs.items()}
            child_conn.close()
            self._conn = parent_conn
            self._state, self._detail = "starting", "starting the shard set"
            try:
                self._await(("ready",), self.timeouts.startup, what="starting the shard set", starting=True)
            except BaseException:
                self._stop_processes()
                raise
            with self._store_lock:
                infos = self._store.multi_get([keys.info(r) for r in range(self.world_size)])
            self.ranks = [json.loads(v) for v in infos]
            self._state, self._detail = "ready", ""

    def recover(self) -> None:
        """Kill every shard process this driver started, wait for them, and start a fresh set.

        Sequences in the old set are lost (their handles raise if used again)."""
        with self._lock:
            self._stop_processes()
            self.restarts += 1
            self.start()

    def abort(self, reason: str) -> None:
        """Fail the shard set from another thread, without waiting for the driver (a step that hangs holds it):
        every local shard process is killed, so a thread waiting for one of the set's steps raises ShardFailure
        at once. recover() then starts a fresh set; until then nothing is sent to this one."""
        self._state, self._detail = "failed", reason
        for proc in list(self._procs.values()):
            try:
                proc.kill()  # multiprocessing signals only a process it has not reaped
            except ValueError:  # closed by a stop running in another thread
                pass

    def close(self) -> None:
        """Stop the shard set: politely when it is healthy, by SIGKILL otherwise."""
        with self._lock:
            if self._state == "closed":
                return
            if self._state == "ready" and self._conn is not None:
                try:
                    self._receive_in_flight()
                    self._conn.send(("close",))
                    self._await(("closed",), self.timeouts.close, what="closing")
                except (ShardFailure, OSError):
                    pass
                deadline = time.monotonic() + self.timeouts.close
                for proc in self._procs.values():
                    proc.join(max(0.0, deadline - time.monotonic()))
            self._stop_processes()
            self._state, self._detail = "closed", "closed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stop_processes(self) -> None:
        """SIGKILL and join every local shard process (a stopped process dies from SIGKILL too)."""
        if self._state != "closed":
            self._state = "stopped"  # before the processes go: health() then reads no process object
        procs, self._procs, self._pids = self._procs, {}, {}
        if self.generation:
            with self._store_lock:
                self._store.set(StoreKeys(self.generation).closed(), "1")
        for proc in procs.values():
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs.values():
            proc.join(10)
            if proc.exitcode is not None:
                proc.close()
        # every step submitted so far ran on this set: nothing will answer them now
        self._in_flight.clear()
        self._results.clear()
        self._dropped_below = next(self._messages)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ health
    def health(self) -> ShardSetHealth:
        """ok while every shard process lives and beats; degraded while a set starts; down after a failure
        until recover()."""
        if self._state == "starting":
            return ShardSetHealth("degraded", self._detail)
        if self._state != "ready":
            return ShardSetHealth("down", self._detail)
        problem = self._find_fault(starting=False)
        if problem:
            return ShardSetHealth("down", problem)
        return ShardSetHealth("ok")

    def _find_fault(self, starting: bool) -> str | None:
        for r, proc in self._procs.items():
            try:
                exitcode, pid = proc.exitcode, proc.pid
            except ValueError:  # closed by a stop running in another thread
                return "the shard set is stopping"
            if exitcode is not None:
                return f"shard rank {r} (pid {pid}) {_describe_exit(exitcode)}"
        keys = StoreKeys(self.generation)
        with self._store_lock:
            beats = self._store.multi_get([keys.heartbeat(r) for r in range(self.world_size)])
            error_text = None
            if self._store.add(keys.error_count(), 0):
                reported = [r for r in range(self.world_size) if self._store.check([keys.error(r)])]
                if reported:
                    error_text = self._store.get(keys.error(reported[0])).decode()
        if error_text:
            return error_text
        now = time.monotonic()
        for r, beat in enumerate(beats):
            if beat != self._hb_last[r]:
                self._hb_last[r], self._hb_seen[r] = beat, now
            elif beat != b"0" or not starting:
                silent = now - self._hb_seen[r]
                if silent > self.timeouts.heartbeat:
                    return (f"shard rank {r} sent no heartbeat for {silent:.1f} s: the process is stopped or "
                            "wedged")
        return None

    def _fail(self, reason: str) -> ShardFailure:
        """Declare the set failed: no more work goes to it until recover()."""
        detail = reason
        try:
            extra = self._find_fault(starting=self._state == "starting")
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; the reason stands
            extra = None
        if extra and extra not in reason:
            detail = f"{extra} ({reason})"
        self._state, self._detail = "failed", detail
        try:
            with self._store_lock:
                self._store.set(StoreKeys(self.generation).closed(), "1")
        except Exception:  # noqa: BLE001
            pass
        return ShardFailure(detail)

    def _await(self, expect: tuple, timeout: float, what: str, starting: bool = False):
        """The next message from rank 0, watching process sentinels and heartbeats while waiting."""
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in self._procs.items()}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer from the shard set within {timeout:g} s while {what}")
            ready = multiprocessing.connection.wait([self._conn, *sentinels], timeout=min(_POLL_S, left))
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    raise self._fail(f"rank 0 closed its pipe while {what}") from None
                if msg[0] == "error":
                    # a rank's error is often a peer's death seen first (the peer's connection closed): give the
                    # dying process a moment to be reaped, so that the failure names the process that died
                    multiprocessing.connection.wait(list(sentinels), timeout=_PEER_DEATH_GRACE_S)
                    raise self._fail(msg[2])
                if msg[0] != expect[0] or (len(expect) > 1 and msg[1] != expect[1]):
                    raise self._fail(f"rank 0 answered {msg[0]!r} while {what}")
                return msg
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                proc = self._procs[dead[0]]
                proc.join(1)
                raise self._fail(f"shard rank {dead[0]} (pid {proc.pid}) {_describe_exit(proc.exitcode)} while {what}")
            problem = self._find_fault(starting)
            if problem:
                raise self._fail(f"{problem} while {what}")

    def _send(self, msg: tuple, what: str) -> None:
        if self._state != "ready":
            raise ShardFailure(f"the shard set is not serving ({self._detail}); recover() starts a new one")
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as exc:
            raise self._fail(f"rank 0 did not take the request ({exc}) while {what}") from None

    # ------------------------------------------------------------------ caches
    def new_cache(self) -> ShardCache:
        """A handle on a new sequence; its state is created in the shards by its first forward."""
        handle = ShardCache(next(self._slots), self.generation)
        handle._finalizer = weakref.finalize(handle, self._freed.append, (handle.generation, handle.slot))
        return handle

    def free_cache(self, handle: ShardCache) -> None:
        """Free a sequence's state now (dropping the handle does the same when it is collected)."""
        handle.freed = True
        handle._finalizer()

    # ------------------------------------------------------------------ forward
    @property
    def steps_in_flight(self) -> int:
        """Steps submitted to the current shard set and not yet collected."""
        return len(self._in_flight)

    def forward(self, token_ids: list[Tensor], caches: list[ShardCache], all_logits: bool = False) -> list[Tensor]:
        """Each sequence's new tokens after its cache; fp32 logits [T_i, V] (all_logits) or [V] per sequence."""
        with self._lock:
            return self.collect(self.submit(token_ids, caches, all_logits))

    __call__ = forward

    def forward_pipelined(self, micro_batches: list[tuple[list[Tensor], list[ShardCache], bool]]) -> list[list[Tensor]]:
        """Several independent micro-batches (token_ids, caches, all_logits) at once, each micro-batch's logits
        as `forward` returns them. They are all sent before any is waited for, so with pipeline stages the
        first stage works on micro-batch m + 1 while the next works on m (the results equal one `forward`
        per micro-batch)."""
        with self._lock:
            tickets = [self.submit(*mb) for mb in micro_batches]
            return [self.collect(t) for t in tickets]

    def submit(self, token_ids: list[Tensor], caches: list[ShardCache], all_logits: bool = False,
               state: np.ndarray | None = None) -> int:
        """Start a step without waiting for it; returns the ticket that `collect` takes. Steps run in the
        order they were submitted; the caches count the tokens at once (a later step of the same sequence
        may be submitted before this one is collected). `state`: a block not starting at layer 0 takes the
        residual state entering it ([sources, T, D] fp32; `token_ids` then only count the tokens)."""
        with self._lock:
            starts_later = self.layer_range is not None and self.layer_range[0] > 0
            if starts_later != (state is not None):
                raise ValueError("a block starting after layer 0 takes a residual state, the embedding takes token "
                                 "ids only")
            self._check_batch(token_ids, caches)
            freed = []
            while self._freed:
                generation, slot = self._freed.popleft()
                if generation == self.generation:
                    freed.append(slot)
            lengths = [int(t.shape[0]) for t in token_ids]
            ids = torch.cat([t.to(torch.long).cpu() for t in token_ids]).numpy()
            ops = [(op.slot, op.kind, op.value) for c in caches for op in c.ops]
            number = next(self._messages)
            msg = ("step", number, [c.slot for c in caches], lengths, ids, freed, bool(all_logits), ops)
            self._send(msg if state is None else msg + (state,), "a step")
            for cache, n in zip(caches, lengths):
                cache.ops.clear()
                cache.advance(n)
            self._in_flight[number] = (lengths, bool(all_logits))
            return number

    def collect(self, ticket: int) -> list[Tensor]:
        """The logits of a submitted step (waiting for it, and for the steps submitted before it)."""
        with self._lock:
            if ticket in self._in_flight:
                lengths, all_logits = self._in_flight[ticket]
            logits = self._collect_raw(ticket)
            return list(torch.split(logits, lengths)) if all_logits else list(logits)

    def forward_block(self, inputs: Tensor | ResidualState, cache: ShardCache,
                      all_logits: bool = False) -> ResidualState | Tensor:
        """One sequence's new tokens through this shard set's block of layers (`layers` [start, stop)):
        token ids [T] when the block starts at 0, else the ResidualState entering `start`. Returns the state
        leaving layer stop - 1, or, when the block ends with the head, fp32 logits [T, V] (all_logits) or [V]."""
        start, stop = self.layer_range or (0, self.config.num_layers)
        with self._lock:
            if isinstance(inputs, ResidualState):
                n = int(inputs.partial.shape[0])
                packed = torch.stack(list(inputs.blocks) + [inputs.partial]).float().contiguous().numpy()
                ticket = self.submit([torch.zeros(n, dtype=torch.long)], [cache], all_logits, state=packed)
            else:
                n = int(inputs.shape[0])
                ticket = self.submit([inputs], [cache], all_logits)
            out = self._collect_raw(ticket)
        if stop < self.config.num_layers:
            return ResidualState((n,), list(out[:-1].unbind(0)), out[-1])
        return out if all_logits else out[0]

    def _collect_raw(self, ticket: int) -> Tensor:
        """What rank 0 answered for a submitted step, as one tensor (logits rows, or a block's state)."""
        with self._lock:
            if ticket not in self._in_flight:
                if ticket < self._dropped_below:
                    raise ShardFailure(f"step {ticket} was lost: the shard set it ran on was restarted or closed")
                raise ValueError(f"step {ticket} was not submitted, or was collected already")
            while ticket not in self._results:
                if self._state != "ready":
                    raise ShardFailure(f"the shard set is not serving ({self._detail}); recover() starts a new one")
                _, number, logits = self._await(("logits",), float("inf"), what=f"step {ticket}")
                self._results[number] = logits
            del self._in_flight[ticket]
            return torch.from_numpy(np.ascontiguousarray(self._results.pop(ticket)))

    def _receive_in_flight(self) -> None:
        """Take every answer still owed by rank 0 (kept for `collect`), so the next message is a reply to
        whatever is asked next."""
        for ticket in sorted(self._in_flight):
            while ticket not in self._results:
                _, done, logits = self._await(("logits",), float("inf"), what=f"step {ticket}")
                self._results[done] = logits

    def _check_batch(self, token_ids: list[Tensor], caches: list[ShardCache]) -> None:
        for b, cache in enumerate(caches):  # the handle first: its length is only meaningful for our own caches
            if not isinstance(cache, ShardCache):
                raise ValueError(f"sequence {b}: the cache must come from this model's new_cache()")
            if cache.freed:
                raise ValueError(f"sequence {b}: its cache was freed")
            if cache.generation != self.generation:
                raise ValueError(f"sequence {b}: its cache belongs to a shard set that was restarted, so its state "
                                 "is gone; start the sequence again with new_cache()")
        check_forward_batch(self.config, token_ids, caches)

    # ------------------------------------------------------------------ statistics and layout
    def dump_routing_stats(self, path: str | Path | None = None, reset: bool = False) -> RoutingStats:
        """Expert load and co-activation per MoE layer since the start (or the last reset), from every home rank."""
        with self._lock:
            self._receive_in_flight()  # their answers come first
            number = next(self._messages)
            self._send(("stats", number, bool(reset)), "gathering routing statistics")
            _, _, data = self._await(("stats", number), self.timeouts.comm * 2, what="gathering routing statistics")
        stats = RoutingStats.from_dict(data, source="the shard set")
        if path is not None:
            stats.save(path)
        return stats

    def layout(self) -> dict:
        """What runs where, for EngineCapabilities.layout."""
        plan = self.plan
        experts: dict[int, int] = collections.Counter()
        for holders in plan.expert_placement.values():
            for h in holders:
                experts.update(h)
        return {
            "processes": self.world_size,
            "plan": self.plan_source,
            "backend": "nccl" if self.device == "cuda" else "gloo",
            "external_ranks": self.external,
            "stages": [{"layers": [s.first_layer, s.end_layer], "ranks": list(s.ranks)} for s in plan.stages],
            "layer_home": list(plan.layer_home),
            "embedding_rank": plan.embedding_rank,
            "lm_head_rank": plan.lm_head_rank,
            "dense_split": {str(layer): list(g) for layer, g in sorted(plan.dense_groups.items())},
            "lm_head_split": list(plan.head_group()),
            "dense_dtype": plan.dense_dtype,
            "experts_per_rank": {str(r): experts.get(r, 0) for r in range(self.world_size)},
            "replicas": sum(plan.replica_count(layer) for layer in plan.expert_placement),
        }

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


__all__ = ["ShardedModel", "ShardCache", "ShardFailure", "ShardSetHealth", "ShardTimeouts", "LinkEmulation",
           "STORE_ENV"]
