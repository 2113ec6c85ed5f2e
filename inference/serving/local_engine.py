"""The in-process engine: `LocalEngine` serves a model under the step scheduler.

The scheduler (inference.serving.scheduler.StepScheduler) decides what each step runs; this module runs it:
the request surface (validation, admission errors, event streams), the loop that plans a step, runs the
model's forward in one worker thread (so the event loop stays responsive) and emits the step's tokens
(sampling, speculative verification, stop strings, scores), the pipelined loop that keeps one step per
micro-batch group in flight, and the watchdog that restarts a loop that stalls or dies.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import deque

import torch

from inference.decoding.sampling import (MAX_LOGPROBS, ReplayKey, SampledToken, SamplingParams, TokenSampler, find_stop,
                                         replay_token)
from inference.decoding.speculation import SequenceSpeculation, SpeculationConfig
from inference.model import KimiK3Model, ModelConfig
from inference.serving.engine import (Engine, EngineCapabilities, EngineError, EngineHealth, EngineSettings,
                                      EventStream, FinalEvent, GenerationRequest, ScoredPosition, TokenEvent)
from inference.serving.metrics import EngineMetrics
from inference.serving.scheduler import ScheduledSequence, StepPlan, StepScheduler
from inference.serving.state_commitment import (CommittedAnswer, CommittedStates, Opening, StateAsk, StateLog, commit,
                                                commit_boundaries)

log = logging.getLogger(__name__)


def pipelined_model(model) -> bool:
    """Whether `model` keeps several steps in flight: `submit(ids, caches, all_logits) -> ticket` starts one,
    `collect(ticket)` returns its logits (inference.sharding.ShardedModel)."""
    return callable(getattr(model, "submit", None)) and callable(getattr(model, "collect", None))


def cache_cost(config: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(bytes of one sequence's cache whatever its length: the KDA state and conv buffers, bytes per token:
    the MLA latents) for caches of `dtype_bytes` (the KDA state is kept in fp32)."""
    c = config
    kda = c.num_kda_layers * c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4 + c.kda_conv_bytes_per_sequence(4)
    return kda, c.mla_cache_bytes_per_token(dtype_bytes)


class _Sequence(ScheduledSequence):
    """A request as the engine serves it: the scheduler's part, plus its sampler, cache, stream and clocks."""

    __slots__ = (
        "request_id", "kind", "sampling", "sampler", "cache", "text", "queue", "submitted_at", "admitted_at",
        "prefill_done_at", "first_token_at", "last_token_at", "positions", "top_k", "scores", "future", "decoder",
        "replay",
        "owner",
    )

    def __init__(self, kind, token_ids, sampling: SamplingParams | None = None, request_id=""):
        super().__init__(token_ids, sampling.max_tokens if sampling else 0)
        self.request_id = request_id
        self.kind = kind  # "generate" | "score"
        self.sampling = sampling
        self.sampler = TokenSampler(sampling) if sampling else None
        self.cache = None
        self.text = ""
        self.queue: asyncio.Queue | None = None
        self.submitted_at = time.perf_counter()
        self.admitted_at = None
        self.prefill_done_at = None
        self.first_token_at = None
        self.last_token_at = None
        self.positions: set[int] | None = None
        self.top_k = 0
        self.scores: list[ScoredPosition] = []
        self.future: asyncio.Future | None = None
        self.decoder = None  # the tokenizer's incremental decoder, set for generate requests
        self.replay: ReplayKey | None = None  # a score sequence that also replays an answer's sampled tokens
        self.owner = ""  # who asked (only it may open the committed states)


class LocalEngine(Engine):
    """Continuous batching over an in-process model: `scheduler` (a StepScheduler) decides what each step
    runs; this class runs the steps and turns their logits into events.

    `model` needs `config`, `new_cache()` and `forward(token_ids, caches, all_logits)`;
    `tokenizer` needs `incremental_decoder()`, `eos_id` and optionally `stop_ids`. Model steps run in one worker thread so
    the event loop (HTTP, streaming) stays responsive while the model computes.

    `speculation` (inference.decoding): each decoding sequence may run drafted tokens after its last one
    and keep those the model accepts; its cache must support mark()/rewind() (the reference model's does).
    """

    def __init__(self, model, tokenizer, settings: EngineSettings = EngineSettings(), *,
                 model_fingerprint: str = "", engine_kind: str = "reference", layout: dict | None = None,
                 metrics: EngineMetrics | None = None, speculation: SpeculationConfig | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_fingerprint = model_fingerprint
        self.engine_kind = engine_kind
        self.layout = layout or {}
        self.metrics = metrics or EngineMetrics(model_name=getattr(model.config, "model_id", "") or "k3")
        self.max_context = min(settings.max_context, self.config.max_position_embeddings)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # torch's intra-op thread count is per OS thread (OpenMP): give the step thread the creator's setting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="k3-step", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),))
        self._health = EngineHealth("down", "not started")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_ids = frozenset(getattr(tokenizer, "stop_ids", None) or {tokenizer.eos_id})
        self.steps = 0
        self.step_stats: dict[int, list] = {}  # batch size -> [steps, cycle seconds, forward seconds]
        self._last_forward_s = 0.0
        self.speculation = speculation if speculation is not None and speculation.enabled else None
        if self.speculation is not None:
            problems = self.speculation.problems()
            probe = model.new_cache()
            if not (callable(getattr(probe, "mark", None)) and callable(getattr(probe, "rewind", None))):
                problems.append(f"speculative decoding needs caches that rewind; {type(probe).__name__} cannot")
            if problems:
                raise ValueError("; ".join(problems))
        # state commitments: the boundaries every answer's states are committed at (None: no commitments)
        self.commit_boundaries: tuple[int, ...] | None = None
        self.committed: CommittedStates | None = None
        if settings.commit_layers:
            if not isinstance(model, KimiK3Model):
                raise ValueError(f"state commitments need the in-process model (it stops at layer boundaries); "
                                 f"{type(model).__name__} cannot: set commit_layers 0")
            self.commit_boundaries = commit_boundaries(self.config, settings.commit_layers)
            self.committed = CommittedStates(settings.commit_retain_s, settings.commit_max_bytes)
        fixed_bytes, bytes_per_token = cache_cost(self.config, settings.cache_dtype_bytes)
        self.scheduler = StepScheduler(settings, max_context=self.max_context, fixed_bytes=fixed_bytes,
                                       bytes_per_token=bytes_per_token)
        if settings.micro_batches > 1 and not pipelined_model(model):
            raise ValueError(f"micro_batches={settings.micro_batches} needs a model that keeps several steps in "
                             f"flight (submit/collect, as the sharded runtime's ShardedModel); {type(model).__name__} "
                             "runs one step at a time: use micro_batches 1")
        self._watchdog: asyncio.Task | None = None
        self._beat = time.monotonic()  # the scheduler loop's last round
        self._in_forward_since: float | None = None
        self.scheduler_restarts = 0
        self.most_steps_in_flight = 0  # micro_batches > 1: the most steps that were in flight at once

    # ------------------------------------------------------------ memory
    def sequence_bytes(self, length: int) -> int:
        """Cache memory of one sequence of `length` tokens (KDA constant part + MLA per token)."""
        return self.scheduler.sequence_bytes(length)

    @property
    def reserved_bytes(self) -> int:
        return self.scheduler.reserved_bytes

    @property
    def active_sequences(self) -> int:
        return self.scheduler.running_count

    @property
    def waiting_sequences(self) -> int:
        return self.scheduler.waiting_count

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._beat = time.monotonic()
            self._task = asyncio.create_task(self._run(), name="k3-scheduler")
            self._watchdog = asyncio.create_task(self._watch(), name="k3-scheduler-watchdog")
            self._health = EngineHealth("ok")

    async def stop(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watchdog
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for seq in self.scheduler.drain():
            self._fail(seq, EngineError("engine_unavailable", "the engine is shutting down"))
        self._health = EngineHealth("down", "stopped")
        self._executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.model, "close", None)
        if close is not None:
            await asyncio.get_running_loop().run_in_executor(None, close)

    @property
    def committed_bytes(self) -> int | None:
        """Memory the answers' committed states hold (bounded by commit_max_bytes and commit_retain_s); None when
        this engine does not commit."""
        return self.committed.nbytes if self.committed is not None else None

    def health(self) -> EngineHealth:
        problem = self._scheduler_problem()
        if problem is not None:
            return EngineHealth("down", problem)
        # a sharded model knows when a shard died while the engine was idle
        model_health = getattr(self.model, "health", None)
        if self._health.ok and callable(model_health):
            h = model_health()
            if not h.ok:
                return h
        return self._health

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            model_id=self.config.model_id,
            model_fingerprint=self.model_fingerprint,
            vocab_size=self.config.vocab_size,
            max_context=self.max_context,
            max_concurrent_sequences=self.settings.max_concurrent_sequences,
            engine_kind=self.engine_kind,
            layout=self.layout,
            precision=str(getattr(self.model, "dtype", "fp32")).replace("torch.", ""),
        )

    # ------------------------------------------------------------ requests
    def _check_tokens(self, token_ids: list[int]) -> None:
        V = self.config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise EngineError("invalid_request", f"token id {bad!r} is outside the vocabulary 0..{V - 1}")

    def _enqueue(self, seq: _Sequence) -> None:
        if self._task is None or self._health.status == "down":
            raise EngineError("engine_unavailable", f"the engine is not serving ({self._health.detail or 'stopped'})")
        self.scheduler.enqueue(seq)
        seq.queue = asyncio.Queue()
        self._admit()  # admitted at once when there is room: only what cannot run yet waits
        self._wake.set()

    def generate(self, request: GenerationRequest) -> EventStream:
        request.check()
        p = request.sampling
        self._check_tokens(request.prompt_token_ids)
        seq = _Sequence("generate", request.prompt_token_ids, p, request.request_id)
        seq.owner = request.owner
        seq.decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
        if self.speculation is not None:
            seq.speculation = SequenceSpeculation.for_request(self.speculation, p, request.prompt_token_ids)
        seq.reserved = self.scheduler.admissible(len(request.prompt_token_ids) + p.max_tokens)
        self._enqueue(seq)
        return EventStream(seq.queue, lambda: self._cancel(seq))

    async def score(self, token_ids: list[int], positions: list[int] | None = None, top_k: int = 0,
                    replay: ReplayKey | None = None) -> list[ScoredPosition]:
        if len(token_ids) < 2:
            raise EngineError("invalid_request", "scoring needs at least 2 tokens")
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise EngineError("invalid_request", f"top_k must lie in 0..{MAX_LOGPROBS}")
        self._check_tokens(token_ids)
        n = len(token_ids)
        wanted = set(range(1, n)) if positions is None else set(positions)
        bad = sorted(p for p in wanted if not 1 <= p < n)
        if bad:
            raise EngineError("invalid_request", f"positions {bad[:5]} are outside 1..{n - 1}")
        if replay is not None and not (replay.sampling.temperature > 0 and 1 <= replay.first_position < n):
            raise EngineError("invalid_request", "a replay needs a temperature above 0 and an answer that starts "
                                                 f"inside the token ids (at {replay.first_position} of {n})")
        seq = _Sequence("score", token_ids)
        seq.positions, seq.top_k, seq.replay = wanted, top_k, replay
        seq.reserved = self.scheduler.admissible(n)
        seq.future = asyncio.get_running_loop().create_future()
        self._enqueue(seq)
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._cancel(seq)
            raise

    def _cancel(self, seq: _Sequence) -> None:
        if not seq.finished:
            seq.cancelled = True
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------ the scheduler's plans
    def _admit(self) -> None:
        """Admit what fits now; each admitted sequence gets its cache."""
        for seq in self.scheduler.admit():
            seq.cache = self.model.new_cache()
            if self.commit_boundaries is not None and seq.kind == "generate":
                seq.cache.state_log = StateLog(self.commit_boundaries)
            seq.admitted_at = time.perf_counter()
        self.metrics.queue_length.set(self.scheduler.waiting_count)

    def _release(self, seq: _Sequence) -> None:
        self.scheduler.release(seq)
        seq.cache = None

    def _plan_step(self, group: int | None = None) -> StepPlan:
        """The scheduler's next step (for one micro-batch group, with micro_batches > 1). A sequence with drafts
        has its cache marked, so that the positions the model rejects can be rewound."""
        batch = self.scheduler.plan_step(group)
        for seq, chunk in batch:
            if seq.draft is not None and seq.draft.tokens and not seq.in_prefill:
                seq.cache.mark(self.speculation.rewind_mode)
        return batch

    def _prefill_cost(self, start: int, n: int) -> float:
        return self.scheduler.prefill_cost(start, n)

    def _prefill_fit(self, seq: ScheduledSequence, start: int, units: float) -> int:
        return self.scheduler.prefill_fit(seq, start, units)

    # ------------------------------------------------------------ watchdog
    def _scheduler_problem(self) -> str | None:
        """Why the scheduler is not serving (it ended, or it has not come round in time), or None."""
        task = self._task
        if task is None:
            return None
        if task.done():
            if task.cancelled():
                return "the scheduler was cancelled"
            exc = task.exception()
            return f"the scheduler ended: {exc!r}" if exc is not None else "the scheduler ended"
        now = time.monotonic()
        if self._in_forward_since is not None:
            if now - self._in_forward_since > self.settings.forward_stall_s:
                return f"a model step has run for {now - self._in_forward_since:.1f} s"
        elif now - self._beat > self.settings.scheduler_stall_s:
            return f"the scheduler has not come round for {now - self._beat:.1f} s"
        return None

    async def _watch(self) -> None:
        """Restarts a scheduler that ended or stalled: its sequences fail with a clear error, new ones are served."""
        while True:
            await asyncio.sleep(self.settings.watchdog_s)
            problem = self._scheduler_problem()
            if problem is not None:
                await self._restart_scheduler(problem)

    async def _restart_scheduler(self, problem: str) -> None:
        log.error("restarting the engine's scheduler: %s", problem)
        self._health = EngineHealth("down", problem)
        old, self._task = self._task, None
        if old is not None and not old.done():
            old.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(old, 1.0)
        hung = self._in_forward_since is not None
        if hung:  # a model step that hangs keeps its thread; take a fresh one
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="k3-step", initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),))
            self._in_forward_since = None
        abort = getattr(self.model, "abort", None)
        if callable(abort) and (hung or getattr(self.model, "steps_in_flight", 0)):
            # a shard set: the step that hangs (or the old scheduler's steps in flight, which nobody will collect
            # now) dies with the set, which frees the old step thread; the new scheduler recovers it first
            abort(f"the engine's watchdog gave up on it: {problem}")
        err = EngineError("engine_failure", f"the engine's scheduler failed ({problem}); retry")
        for seq in self.scheduler.drain():
            self._fail(seq, err)
            seq.cache = None
        self.scheduler_restarts += 1
        self._beat = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="k3-scheduler")
        self._health = EngineHealth("ok", f"scheduler restarted after: {problem}")

    async def _run(self) -> None:
        """The scheduler. A bug anywhere in a step fails that step's sequences and the loop goes on. It first
        recovers a model that reports itself broken (one the watchdog aborted), so requests wait for that."""
        await self._recover_if_broken()
        while True:
            try:
                await self._schedule()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("engine step failed outside the model")
                err = EngineError("engine_failure", f"the engine failed during this request: {exc}")
                for seq in self.scheduler.running:
                    self._fail(seq, err)
                    self._release(seq)
                await asyncio.sleep(0)

    async def _schedule(self) -> None:
        if self.settings.micro_batches > 1:
            await self._schedule_pipelined()
            return
        loop = asyncio.get_running_loop()
        while True:
            self._beat = time.monotonic()
            for seq in self.scheduler.cancelled():
                self._finish(seq, "cancelled")
            self._admit()
            self._update_gauges()
            if not self.scheduler.running_count:
                # nothing admitted means nothing is waiting (every waiting request fits an empty engine)
                await self._idle()
                continue
            cycle_start = time.perf_counter()
            batch = self._plan_step()
            all_logits, ids, caches = self._step_inputs(batch)
            t0 = time.perf_counter()
            self._in_forward_since = time.monotonic()
            try:
                logits = await loop.run_in_executor(
                    self._executor, self._forward, ids, caches, all_logits
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a model or shard failure: fail this step's sequences, recover
                self._in_forward_since = None
                await self._on_step_failure(exc)
                continue
            self._in_forward_since = None
            await self._step_done(batch, logits, all_logits, t0, cycle_start)

    async def _idle(self) -> None:
        """Nothing to run: wait for a request (at most 1 s; then a broken model is recovered)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            await self._recover_if_broken()

    async def _step_done(self, batch, logits, all_logits, started: float, cycle_start: float) -> float:
        """A step came back: emit its tokens, let the loop breathe, count it. Returns when it was counted.
        step_stats, per batch size: [steps, cycle seconds (since `cycle_start`), seconds in the model]."""
        self._beat = time.monotonic()
        self._after_step(batch, logits, all_logits)
        self.steps += 1
        await asyncio.sleep(0)  # let consumers read and new requests arrive
        t2 = time.perf_counter()
        self.metrics.step_seconds.observe(t2 - started)
        stat = self.step_stats.setdefault(len(batch), [0, 0.0, 0.0])
        stat[0] += 1
        stat[1] += t2 - cycle_start
        stat[2] += self._last_forward_s
        return t2

    @staticmethod
    def _step_inputs(batch):
        """all_logits, token id tensors and caches of a planned step."""
        all_logits = any(seq.kind == "score" or len(chunk) > 1 and not seq.in_prefill for seq, chunk in batch)
        ids = [torch.tensor(chunk, dtype=torch.long) for _, chunk in batch]
        return all_logits, ids, [seq.cache for seq, _ in batch]

    def _forward(self, ids, caches, all_logits):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.forward(ids, caches, all_logits=all_logits)
            # sampling, acceptance and logprobs run on the host with each request's own CPU generator, so a seed
            # gives the same draws whatever device computed the logits (a no-op for CPU tensors)
            out = [o.cpu() for o in out]
        self._last_forward_s = time.perf_counter() - t0
        return out

    async def _schedule_pipelined(self) -> None:
        """micro_batches > 1. The running sequences are split into groups (a sequence keeps its group; a new one
        joins the smallest) and each group has at most one step in flight. The oldest step is collected while
        the others run; when it comes back, its group's tokens are emitted and the group's next step is
        submitted behind the others, so pipeline stage s works on one group while stage s + 1 works on the one
        before. A sequence is in one group, so no step of it is submitted while its previous one is in flight
        (speculation's cache marks and rewinds stay in order). Cancellations, admission and the prefill
        budget (per group) are as in the one-step loop; the watchdog sees every submit and collect."""
        self.scheduler.reset_groups()
        in_flight: deque = deque()  # (group, ticket, batch, all_logits, submitted at)
        busy: set[int] = set()
        round_end = time.perf_counter()
        try:
            while True:
                self._beat = time.monotonic()
                self._admit()
                self.scheduler.assign_groups()
                await self._submit_groups(in_flight, busy)
                self._update_gauges()
                if not in_flight:
                    if not self.scheduler.running_count:
                        await self._idle()
                    else:
                        await asyncio.sleep(0)
                    continue
                g, ticket, batch, all_logits, submitted = in_flight.popleft()
                try:
                    logits = await self._in_step(self._collect, ticket)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a model or shard failure: fail every sequence in flight, recover
                    await self._pipeline_failed(exc, in_flight, busy)
                    continue
                busy.discard(g)
                # cycle: since the previous step came back; in the model: waiting for this one
                round_end = await self._step_done(batch, logits, all_logits, submitted, round_end)
        except Exception:  # a bug outside the model: take the answers still owed, then _run fails the sequences
            for _, ticket, *_ in in_flight:
                with contextlib.suppress(Exception):
                    await self._in_step(self.model.collect, ticket)
            raise

    async def _submit_groups(self, in_flight: deque, busy: set[int]) -> None:
        """Submit the next step of each micro-batch group with none in flight (its cancelled sequences end
        first); a failed submit fails the running sequences and ends this round."""
        for g in range(self.settings.micro_batches):
            if g not in busy:
                for seq in self.scheduler.cancelled(g):
                    self._finish(seq, "cancelled")
            members = self.scheduler.prune_group(g)
            if g in busy or not members:
                continue
            batch = self._plan_step(g)
            all_logits, ids, caches = self._step_inputs(batch)
            submitted = time.perf_counter()
            try:
                ticket = await self._in_step(self.model.submit, ids, caches, all_logits)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._pipeline_failed(exc, in_flight, busy)
                return
            in_flight.append((g, ticket, batch, all_logits, submitted))
            busy.add(g)
            self.most_steps_in_flight = max(self.most_steps_in_flight, len(in_flight))

    async def _in_step(self, fn, *args):
        """fn(*args) in the step thread, watched by the watchdog like a model forward."""
        self._in_forward_since = time.monotonic()
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except asyncio.CancelledError:
            raise  # still in the step thread: _restart_scheduler sees _in_forward_since and takes a fresh one
        except BaseException:
            self._in_forward_since = None
            raise
        self._in_forward_since = None
        return out

    def _collect(self, ticket):
        t0 = time.perf_counter()
        out = self.model.collect(ticket)
        self._last_forward_s = time.perf_counter() - t0
        return out

    async def _pipeline_failed(self, exc: Exception, in_flight: deque, busy: set[int]) -> None:
        """A submit or collect failed: every running sequence fails (as in the one-step loop), the model
        recovers, and the steps still in flight are dropped (a restarted shard set has dropped them already;
        collecting them takes what a model that was not restarted still holds)."""
        await self._on_step_failure(exc)
        for _, ticket, *_ in in_flight:
            with contextlib.suppress(Exception):
                await self._in_step(self.model.collect, ticket)
        in_flight.clear()
        busy.clear()
        self.scheduler.reset_groups()

    async def _recover_if_broken(self) -> None:
        """While idle, and when a scheduler starts: a model that reports itself broken (a shard died, or the
        watchdog aborted it) is recovered before the next request."""
        model_health = getattr(self.model, "health", None)
        recover = getattr(self.model, "recover", None)
        if not (callable(model_health) and callable(recover)) or model_health().ok:
            return
        detail = model_health().detail
        log.warning("model unhealthy (%s): recovering", detail)
        self._health = EngineHealth("degraded", f"recovering: {detail}")
        try:
            self._in_forward_since = time.monotonic()  # a recovery is watched like a model step
            await asyncio.get_running_loop().run_in_executor(self._executor, recover)
            self._health = EngineHealth("ok", f"recovered after: {detail}")
        except Exception as exc:
            self._health = EngineHealth("down", f"recovery failed: {exc}")
        finally:
            self._in_forward_since = None

    async def _on_step_failure(self, exc: Exception) -> None:
        log.error("model step failed: %s", exc)
        self._health = EngineHealth("degraded", f"model step failed: {exc}")
        err = EngineError("engine_failure", f"the model failed during this request: {exc}")
        for seq in self.scheduler.running:
            self._fail(seq, err)
            self._release(seq)
        recover = getattr(self.model, "recover", None)
        if recover is not None:
            try:
                self._in_forward_since = time.monotonic()
                try:
                    await asyncio.get_running_loop().run_in_executor(self._executor, recover)
                finally:
                    self._in_forward_since = None
                self._health = EngineHealth("ok", f"recovered after: {exc}")
            except Exception as rexc:  # still broken: refuse new work until recovered
                self._health = EngineHealth("down", f"recovery failed: {rexc}")
                for seq in self.scheduler.drain_waiting():
                    self._fail(seq, EngineError("engine_unavailable", self._health.detail))
        else:
            self._health = EngineHealth("ok", f"last failure: {exc}")

    def _after_step(self, batch, logits, all_logits) -> None:
        """A step came back: the scheduler counts what each sequence read; scores, verified drafts and sampled
        tokens go out as events."""
        now = time.perf_counter()
        sample_rows, sample_seqs = [], []
        ran = batch[:len(logits)]  # one row per sequence; a model that answers fewer leaves the rest unread
        starts = self.scheduler.account_step(ran)
        for (seq, _), start, out in zip(ran, starts, logits):
            if seq.cancelled:
                continue
            if seq.kind == "score":
                with self._failing_alone(seq, "scoring"):
                    self._collect_scores(seq, start, out)
                    if not seq.in_prefill:
                        if not seq.future.done():
                            seq.future.set_result(sorted(seq.scores, key=lambda s: s.position))
                        self._release(seq)
                continue
            if seq.in_prefill:
                continue
            if seq.prefill_done_at is None:
                seq.prefill_done_at = now
            if seq.draft is not None and seq.draft.tokens:
                with self._failing_alone(seq, "speculative verification"):
                    self._emit_verified(seq, start, out, now)
                continue
            sample_rows.append(out[-1] if all_logits else out)
            sample_seqs.append(seq)
        if sample_seqs:
            rows = torch.stack(sample_rows).float()
            logprobs = torch.log_softmax(rows, dim=-1)
            for seq, row, lp in zip(sample_seqs, rows, logprobs):
                with self._failing_alone(seq, "sampling"):
                    self._emit_token(seq, seq.sampler.choose(row, len(seq.generated), lp), now)
        for seq in sample_seqs:  # speculation: judge the drafter's unused guess against the chosen token
            if seq.speculation is not None and seq.generated:
                seq.speculation.observe_plain(seq.generated[-1])

    def _emit_verified(self, seq: _Sequence, start: int, rows: torch.Tensor, now: float) -> None:
        """A speculative step ran [last token, drafts] from position `start`: accept drafts by the rules in
        inference.decoding.acceptance, rewind the cache to the kept positions, emit the 1..k+1 tokens."""
        draft, seq.draft = seq.draft, None
        verdict = seq.speculation.judge(draft, rows.float(), seq.sampler, len(seq.generated))
        seq.consumed = start + 1 + verdict.accepted
        seq.cache.rewind(seq.consumed)
        for sampled in verdict.tokens:
            self._emit_token(seq, sampled, now)
            if seq.finished:
                break

    @contextlib.contextmanager
    def _failing_alone(self, seq: _Sequence, stage: str):
        """A failure while finishing one sequence's step (sampling, detokenising, stop matching, logprobs,
        scoring) ends that sequence with an engine_failure event; the batch and the scheduler go on."""
        try:
            yield
        except Exception as exc:
            log.error("request %s failed in %s: %r", seq.request_id or "-", stage, exc)
            self._fail(seq, EngineError("engine_failure", f"the engine failed in {stage} for this request: {exc}"))
            self._release(seq)

    def _collect_scores(self, seq: _Sequence, start: int, out: torch.Tensor) -> None:
        # row r of `out` holds logits after token start + r, i.e. it predicts token start + r + 1
        lp = torch.log_softmax(out.float(), dim=-1)
        for r in range(out.shape[0]):
            pos = start + r + 1
            if pos in seq.positions:
                tok = seq.token_ids[pos]
                top = []
                if seq.top_k:
                    v, i = torch.topk(lp[r], seq.top_k)
                    top = [(int(a), float(b)) for a, b in zip(i, v)]
                key, replayed = seq.replay, None
                if key is not None and pos >= key.first_position:
                    replayed = replay_token(out[r].float(), key.sampling, key.seed, pos - key.first_position, tok)
                seq.scores.append(ScoredPosition(pos, tok, float(lp[r, tok]), top, replayed))

    def _emit_token(self, seq: _Sequence, sampled: SampledToken, now: float) -> None:
        p = seq.sampling
        index = len(seq.generated)
        seq.generated.append(sampled.token_id)
        seq.token_ids.append(sampled.token_id)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft_seconds.observe(now - seq.submitted_at)
        else:
            self.metrics.inter_token_seconds.observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.generation_tokens.inc()

        is_eos = sampled.token_id in self._stop_ids and not p.ignore_eos
        piece, stop_hit = "", False
        if not is_eos:
            before = len(seq.text)
            seq.text += seq.decoder.push(sampled.token_id)
            if len(seq.generated) >= p.max_tokens:
                seq.text += seq.decoder.flush()
            # text pieces are the plain detokenisation: the token that completes a stop string
            # ends the generation, and its text is streamed as is (not trimmed)
            stop_hit = bool(p.stop) and find_stop(seq.text, p.stop, before) != -1
            piece = seq.text[before:]
        seq.queue.put_nowait(TokenEvent(index, sampled.token_id, piece, sampled.logprob, sampled.top))
        if is_eos:
            self._finish(seq, "eos")
        elif stop_hit:
            self._finish(seq, "stop")
        elif len(seq.generated) >= p.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: _Sequence, reason: str) -> None:
        end = time.perf_counter()
        if not seq.finished:
            self.metrics.record_finished(reason, seq.prompt_len, len(seq.generated), seq.submitted_at,
                                         seq.admitted_at, seq.first_token_at, end, seq.prefill_done_at)
        if seq.queue is not None and not seq.finished:
            commitment = self._commit(seq) if reason != "cancelled" else None
            ms = lambda a, b: None if a is None or b is None else (b - a) * 1000.0  # noqa: E731
            seq.queue.put_nowait(FinalEvent(
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=len(seq.generated),
                queue_ms=ms(seq.submitted_at, seq.admitted_at) or 0.0,
                ttft_ms=ms(seq.submitted_at, seq.first_token_at),
                total_ms=ms(seq.submitted_at, end),
                prefill_ms=ms(seq.admitted_at, seq.prefill_done_at),
                seed=seq.sampler.seed,
                **(seq.speculation.final_counts() if seq.speculation is not None else {}),
                state_commitment=commitment,
            ))
        if seq.future is not None and not seq.future.done():
            seq.future.set_exception(EngineError("cancelled", "the request was cancelled"))
        self._release(seq)

    def _commit(self, seq: _Sequence):
        """The commitment to a finished answer's states (every position the model ran), kept for openings."""
        log = getattr(seq.cache, "state_log", None)  # caches of other engines (sharded) keep none
        if log is None or self.committed is None or seq.cache.length < 1:
            return None
        commitment, rows, levels = commit(log, seq.cache.length)
        self.committed.keep(self._answer_key(seq.owner, seq.request_id),
                            CommittedAnswer(commitment, rows, levels, owner=seq.owner))
        return commitment

    @staticmethod
    def _answer_key(owner: str, request_id: str) -> str:
        return f"{owner}/{request_id}"

    def open_states(self, request_id: str, root: str, asks: list[StateAsk], caller: str = "") -> Opening:
        if self.committed is None:
            return super().open_states(request_id, root, asks, caller)
        return self.committed.open(self._answer_key(caller, request_id), root, asks, caller)

    def _fail(self, seq: _Sequence, err: EngineError) -> None:
        if seq.finished:
            return
        if seq.queue is not None:
            seq.queue.put_nowait(err)
        if seq.future is not None and not seq.future.done():
            seq.future.set_exception(err)
        seq.finished = True

    def _update_gauges(self) -> None:
        s = self.scheduler
        self.metrics.active_sequences.set(s.running_count)
        self.metrics.cache_bytes_reserved.set(s.reserved_bytes)
        self.metrics.cache_usage.set(s.reserved_bytes / max(1, self.settings.cache_memory_budget_bytes))
        self.metrics.queue_length.set(s.waiting_count)
