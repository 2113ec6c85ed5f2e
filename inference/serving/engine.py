"""The serving engine: one interface for the miner, whatever runs underneath.

`Engine.generate(request)` validates and admits the request at once (raising
`EngineError` with a clear code when it cannot be served) and returns an
`EventStream`: an async iterator of `TokenEvent`s then one `FinalEvent`.
`Engine.score(...)` runs a teacher-forced prefill and returns per-position
logprobs (and, given a `ReplayKey`, replays the sampled tokens of an answer
under the protocol's sampler k3-gumbel/1: what a validator's audit needs). `LocalEngine` runs a model in-process (the reference model, or a
sharded model with the same `new_cache`/`forward` surface) under a scheduler
that does continuous batching with chunked prefill; `RemoteEngine`
(`inference.serving.remote`) adapts an OpenAI-compatible server.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from inference.decoding.sampling import (MAX_LOGPROBS, SAMPLER, ReplayedToken, ReplayKey, SampledToken, SamplingParams,
                                         TokenSampler, find_stop, replay_token)
from inference.decoding.speculation import SequenceSpeculation, SpeculationConfig
from inference.model import ModelConfig
from inference.serving.metrics import EngineMetrics

log = logging.getLogger(__name__)


def pipelined_model(model) -> bool:
    """Whether `model` keeps several steps in flight: `submit(ids, caches, all_logits) -> ticket` starts one,
    `collect(ticket)` returns its logits (inference.sharding.ShardedModel)."""
    return callable(getattr(model, "submit", None)) and callable(getattr(model, "collect", None))


# ------------------------------------------------------------------- types
class EngineError(Exception):
    """A request the engine will not or cannot serve. `code` is machine-readable: one of ERROR_CODES.

    A remote engine also says, as data, what went wrong on the wire: `http_status`, the status
    the server answered with; `timeout`, which deadline passed ("first_byte", "between_events"
    or "total"); `unreachable`, the server could not be reached. Nobody parses `message`."""

    def __init__(self, code: str, message: str, *, http_status: int | None = None, timeout: str | None = None,
                 unreachable: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status
        self.timeout = timeout
        self.unreachable = unreachable


# Every code an EngineError carries (protocol.errors.ErrorCode holds each; a test checks).
ERROR_CODES = ("invalid_request", "context_too_long", "over_capacity", "queue_full", "engine_unavailable",
               "engine_failure", "engine_stalled", "cancelled")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""

    def check(self) -> None:
        """Refuse (EngineError invalid_request) a request no engine can serve: bad sampling or an empty prompt."""
        problems = self.sampling.problems()
        if not self.prompt_token_ids:
            problems.append("the prompt is empty")
        if problems:
            raise EngineError("invalid_request", "; ".join(problems))


@dataclass
class TokenEvent:
    index: int  # position of this token in the completion, 0-based
    token_id: int
    text: str  # text piece this token completes (may be "" mid-character)
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class FinalEvent:
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float | None  # from submission to the first token
    total_ms: float
    prefill_ms: float | None = None
    draft_proposed: int = 0  # speculative decoding: drafted tokens verified, and how many were accepted
    draft_accepted: int = 0
    verify_steps: int = 0
    seed: int | None = None  # the seed the sampler ran with (the request's or one drawn): replays the answer


@dataclass
class ScoredPosition:
    position: int  # index into token_ids: logprob of token_ids[position] given token_ids[:position]
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    replayed: ReplayedToken | None = None  # score(..., replay=key): the sampler's token here from these logits


@dataclass(frozen=True)
class EngineCapabilities:
    model_id: str
    model_fingerprint: str
    vocab_size: int
    max_context: int
    max_concurrent_sequences: int
    engine_kind: str  # "reference" | "sharded" | "remote"
    layout: dict = field(default_factory=dict)
    precision: str = "fp32"
    sampler: str = SAMPLER  # inference.decoding.sampling.SAMPLERS: k3-gumbel/1 (replayable) or "engine" (its own)


@dataclass(frozen=True)
class EngineHealth:
    status: str  # "ok" | "degraded" | "down"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class EventStream:
    """Async iterator over one request's events. Closing it (or dropping the
    consumer) cancels the request; the engine frees its sequence at the next step."""

    def __init__(self, queue: asyncio.Queue, on_close):
        self._queue = queue
        self._on_close = on_close
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, EngineError):
            self._done = True
            raise item
        if isinstance(item, FinalEvent):
            self._done = True
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._on_close()

    def __del__(self):
        if not self._done:
            try:
                self._on_close()
            except Exception:  # interpreter shutdown
                pass


class Engine(abc.ABC):
    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> EventStream: ...

    @abc.abstractmethod
    async def score(self, token_ids: list[int], positions: list[int] | None = None, top_k: int = 0,
                    replay: ReplayKey | None = None) -> list[ScoredPosition]:
        """Teacher-forced logprobs of token_ids[p] given token_ids[:p] for each asked p (all by default), with the
        top_k alternatives; with `replay`, each position at or after replay.first_position also carries the
        token k3-gumbel/1 draws there (ScoredPosition.replayed). An engine that cannot replay refuses it
        (EngineError invalid_request)."""

    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()


class WrappedEngine(Engine):
    """An engine around another one (`inner`): everything passes through; a subclass overrides what it changes."""

    def __init__(self, inner: Engine):
        self.inner = inner

    def generate(self, request: GenerationRequest) -> EventStream:
        return self.inner.generate(request)

    async def score(self, token_ids: list[int], positions: list[int] | None = None,
                    top_k: int = 0, replay: ReplayKey | None = None) -> list[ScoredPosition]:
        return await self.inner.score(token_ids, positions, top_k, replay)

    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities()

    def health(self) -> EngineHealth:
        return self.inner.health()

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()


# ------------------------------------------------------------ local engine
@dataclass(frozen=True)
class EngineSettings:
    max_context: int = 32768
    max_concurrent_sequences: int = 64
    cache_memory_budget_bytes: int = 2 << 30
    max_waiting: int = 128
    step_token_budget: int = 512  # work per forward step, in short-context tokens (decode tokens first)
    min_prefill_chunk: int = 32  # prefill progresses at least this much per step even under heavy decode
    attention_cost_tokens: int = 4096  # context length at which a token's attention costs as much as the rest
    cache_dtype_bytes: int = 4  # fp32 caches on CPU
    # The scheduler's watchdog: the loop must come round within scheduler_stall_s (a model forward within
    # forward_stall_s), else health() says "down" and the scheduler is restarted; checked every watchdog_s.
    scheduler_stall_s: float = 5.0
    forward_stall_s: float = 120.0
    watchdog_s: float = 0.5
    # Pipelined decode (issue 17): split the running sequences into up to this many groups and keep one step
    # per group in flight, so pipeline stages work on different groups at once. 1 = one step at a time.
    # > 1 needs a model that keeps steps in flight (`submit` / `collect`: the sharded runtime).
    micro_batches: int = 1


class _Sequence:
    __slots__ = (
        "request_id", "kind", "token_ids", "prompt_len", "sampling", "sampler", "cache", "consumed",
        "generated", "text", "text_emitted", "queue", "reserved", "submitted_at", "admitted_at",
        "prefill_done_at", "first_token_at", "last_token_at", "cancelled", "finished",
        "positions", "top_k", "scores", "future", "decoder", "speculation", "draft", "group", "replay",
    )

    def __init__(self, kind, token_ids, sampling=None, request_id=""):
        self.request_id = request_id
        self.kind = kind  # "generate" | "score"
        self.token_ids = list(token_ids)  # prompt, then generated tokens appended
        self.prompt_len = len(token_ids)
        self.sampling = sampling
        self.sampler = TokenSampler(sampling) if sampling else None
        self.cache = None
        self.consumed = 0  # tokens fed through the model
        self.generated: list[int] = []
        self.text = ""
        self.text_emitted = 0
        self.queue: asyncio.Queue | None = None
        self.reserved = 0
        self.submitted_at = time.perf_counter()
        self.admitted_at = None
        self.prefill_done_at = None
        self.first_token_at = None
        self.last_token_at = None
        self.cancelled = False
        self.finished = False
        self.positions: set[int] | None = None
        self.top_k = 0
        self.scores: list[ScoredPosition] = []
        self.future: asyncio.Future | None = None
        self.decoder = None  # the tokenizer's incremental decoder, set for generate requests
        self.speculation: SequenceSpeculation | None = None  # drafter and statistics, when the engine speculates
        self.draft = None  # this step's drafted tokens (inference.decoding.drafters.Draft)
        self.group: int | None = None  # micro_batches > 1: the group whose steps carry this sequence
        self.replay: ReplayKey | None = None  # a score sequence that also replays an answer's sampled tokens

    @property
    def in_prefill(self) -> bool:
        return self.consumed < self.prompt_len


class LocalEngine(Engine):
    """Continuous batching over an in-process model.

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
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._reserved_bytes = 0
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
        if settings.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1 (got {settings.micro_batches})")
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
        c, b = self.config, self.settings.cache_dtype_bytes
        kda = c.num_kda_layers * c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4 + c.kda_conv_bytes_per_sequence(4)
        return kda + c.mla_cache_bytes_per_token(b) * length

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    @property
    def active_sequences(self) -> int:
        return len(self._running)

    @property
    def waiting_sequences(self) -> int:
        return len(self._waiting)

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
        for seq in list(self._waiting) + list(self._running):
            self._fail(seq, EngineError("engine_unavailable", "the engine is shutting down"))
        self._waiting.clear()
        self._running.clear()
        self._reserved_bytes = 0
        self._health = EngineHealth("down", "stopped")
        self._executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.model, "close", None)
        if close is not None:
            await asyncio.get_running_loop().run_in_executor(None, close)

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

    def _admissible(self, length: int) -> int:
        if length > self.max_context:
            raise EngineError(
                "context_too_long",
                f"prompt plus max_tokens is {length} tokens, more than this engine's context of {self.max_context}",
            )
        need = self.sequence_bytes(length)
        if need > self.settings.cache_memory_budget_bytes:
            raise EngineError(
                "context_too_long",
                f"a sequence of {length} tokens needs {need} bytes of cache, more than the whole budget "
                f"({self.settings.cache_memory_budget_bytes} bytes)",
            )
        return need

    def _enqueue(self, seq: _Sequence) -> None:
        if self._task is None or self._health.status == "down":
            raise EngineError("engine_unavailable", f"the engine is not serving ({self._health.detail or 'stopped'})")
        if len(self._waiting) >= self.settings.max_waiting:
            raise EngineError("queue_full", f"the wait queue is full ({self.settings.max_waiting} requests); retry later")
        seq.queue = asyncio.Queue()
        self._waiting.append(seq)
        self._admit()  # admitted at once when there is room: only what cannot run yet waits
        self._wake.set()

    def generate(self, request: GenerationRequest) -> EventStream:
        request.check()
        p = request.sampling
        self._check_tokens(request.prompt_token_ids)
        seq = _Sequence("generate", request.prompt_token_ids, p, request.request_id)
        seq.decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
        if self.speculation is not None:
            seq.speculation = SequenceSpeculation.for_request(self.speculation, p, request.prompt_token_ids)
        seq.reserved = self._admissible(len(request.prompt_token_ids) + p.max_tokens)
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
        seq.reserved = self._admissible(n)
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

    # ------------------------------------------------------------ scheduler
    def _admit(self) -> None:
        s = self.settings
        while self._waiting:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                seq.finished = True
                continue
            if len(self._running) >= s.max_concurrent_sequences:
                break
            if self._reserved_bytes + seq.reserved > s.cache_memory_budget_bytes:
                break
            self._waiting.popleft()
            seq.cache = self.model.new_cache()
            seq.admitted_at = time.perf_counter()
            self._reserved_bytes += seq.reserved
            self._running.append(seq)
        self.metrics.queue_length.set(len(self._waiting))

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self._reserved_bytes -= seq.reserved
        seq.cache = None
        seq.finished = True

    def _prefill_cost(self, start: int, n: int) -> float:
        """Work of prefilling n prompt tokens from position `start`, in units of one short-context token:
        attention makes a token at position p cost (1 + p / attention_cost_tokens)."""
        return n * (1.0 + (start + n) / self.settings.attention_cost_tokens)

    def _prefill_fit(self, seq: _Sequence, start: int, units: float) -> int:
        """The most prompt tokens of seq from `start` whose prefill costs at most `units`."""
        a = self.settings.attention_cost_tokens
        b = 1.0 + start / a
        n = int((-b + math.sqrt(b * b + 4.0 * max(units, 0.0) / a)) * a / 2.0)
        return max(0, min(n, seq.prompt_len - start))

    def _plan_step(self, running: list[_Sequence] | None = None) -> list[tuple[_Sequence, list[int]]]:
        """Decode tokens for every sequence past its prompt, then prefill chunks within the step's budget.

        The budget counts work, not tokens: a chunk deep into a long prompt attends to everything before
        it, so it gets fewer tokens, and every step stays short enough for the decoding sequences' next
        tokens. Prefill goes shortest-remaining-first, so a short prompt is not stuck behind a long one;
        the oldest prefilling sequence always advances (by `min_prefill_chunk` tokens of work, at least one
        token), so a long prompt is never starved by a stream of short ones. `running`: the sequences to plan
        for (one group's, with micro_batches > 1), else every running one."""
        s = self.settings
        running = self._running if running is None else running
        batch = [(seq, self._decode_positions(seq)) for seq in running if not seq.in_prefill]
        units = float(max(s.step_token_budget - sum(len(chunk) for _, chunk in batch), s.min_prefill_chunk))
        prefilling = [seq for seq in running if seq.in_prefill]
        grant: dict[int, int] = {}
        if prefilling:
            oldest = prefilling[0]
            n = max(1, self._prefill_fit(oldest, oldest.consumed, min(s.min_prefill_chunk, units)))
            grant[id(oldest)] = n
            units -= self._prefill_cost(oldest.consumed, n)
            for seq in sorted(prefilling, key=lambda q: q.prompt_len - q.consumed):
                if units <= 0:
                    break
                start = seq.consumed + grant.get(id(seq), 0)
                extra = self._prefill_fit(seq, start, units)
                units -= self._prefill_cost(start, extra)
                grant[id(seq)] = grant.get(id(seq), 0) + extra
        for seq in prefilling:
            n = grant.get(id(seq), 0)
            if n > 0:
                batch.append((seq, seq.token_ids[seq.consumed:seq.consumed + n]))
        return batch

    def _decode_positions(self, seq: _Sequence) -> list[int]:
        """The tokens a decoding sequence runs this step: its last token, then any drafted ones. A sequence
        with drafts has its cache marked, so that the positions the model rejects can be rewound."""
        tokens = [seq.token_ids[seq.consumed]]
        if seq.speculation is None:
            return tokens
        seq.draft = seq.speculation.drafts(seq.token_ids, seq.sampling.max_tokens - len(seq.generated) - 1)
        if seq.draft.tokens:
            seq.cache.mark(self.speculation.rewind_mode)
        return tokens + seq.draft.tokens

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
        for seq in list(self._running) + list(self._waiting):
            self._fail(seq, err)
            self._release(seq)
        self._waiting.clear()
        self._running.clear()
        self._reserved_bytes = 0
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
                for seq in list(self._running):
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
            for seq in [q for q in self._running if q.cancelled]:
                self._finish(seq, "cancelled")
            self._admit()
            self._update_gauges()
            if not self._running:
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
        m = self.settings.micro_batches
        groups: list[list[_Sequence]] = [[] for _ in range(m)]
        in_flight: deque = deque()  # (group, ticket, batch, all_logits, submitted at)
        busy: set[int] = set()
        round_end = time.perf_counter()
        try:
            while True:
                self._beat = time.monotonic()
                self._admit()
                for seq in self._running:
                    if seq.group is None:
                        seq.group = min(range(m), key=lambda i: len(groups[i]))
                        groups[seq.group].append(seq)
                for g in range(m):
                    if g not in busy:
                        for seq in [q for q in groups[g] if q.cancelled]:
                            self._finish(seq, "cancelled")
                    groups[g] = [q for q in groups[g] if not q.finished]
                    if g in busy or not groups[g]:
                        continue
                    batch = self._plan_step(groups[g])
                    all_logits, ids, caches = self._step_inputs(batch)
                    submitted = time.perf_counter()
                    try:
                        ticket = await self._in_step(self.model.submit, ids, caches, all_logits)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        await self._pipeline_failed(exc, groups, in_flight, busy)
                        break
                    in_flight.append((g, ticket, batch, all_logits, submitted))
                    busy.add(g)
                    self.most_steps_in_flight = max(self.most_steps_in_flight, len(in_flight))
                self._update_gauges()
                if not in_flight:
                    if not self._running:
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
                    await self._pipeline_failed(exc, groups, in_flight, busy)
                    continue
                busy.discard(g)
                # cycle: since the previous step came back; in the model: waiting for this one
                round_end = await self._step_done(batch, logits, all_logits, submitted, round_end)
        except Exception:  # a bug outside the model: take the answers still owed, then _run fails the sequences
            for _, ticket, *_ in in_flight:
                with contextlib.suppress(Exception):
                    await self._in_step(self.model.collect, ticket)
            raise

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

    async def _pipeline_failed(self, exc: Exception, groups: list[list[_Sequence]], in_flight: deque,
                               busy: set[int]) -> None:
        """A submit or collect failed: every running sequence fails (as in the one-step loop), the model
        recovers, and the steps still in flight are dropped (a restarted shard set has dropped them already;
        collecting them takes what a model that was not restarted still holds)."""
        await self._on_step_failure(exc)
        for _, ticket, *_ in in_flight:
            with contextlib.suppress(Exception):
                await self._in_step(self.model.collect, ticket)
        in_flight.clear()
        busy.clear()
        for group in groups:
            group.clear()

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
        for seq in list(self._running):
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
                for seq in list(self._waiting):
                    self._fail(seq, EngineError("engine_unavailable", self._health.detail))
                self._waiting.clear()
        else:
            self._health = EngineHealth("ok", f"last failure: {exc}")

    def _after_step(self, batch, logits, all_logits) -> None:
        now = time.perf_counter()
        sample_rows, sample_seqs = [], []
        for (seq, chunk), out in zip(batch, logits):
            start = seq.consumed
            seq.consumed += len(chunk)
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
            ))
        if seq.future is not None and not seq.future.done():
            seq.future.set_exception(EngineError("cancelled", "the request was cancelled"))
        self._release(seq)

    def _fail(self, seq: _Sequence, err: EngineError) -> None:
        if seq.finished:
            return
        if seq.queue is not None:
            seq.queue.put_nowait(err)
        if seq.future is not None and not seq.future.done():
            seq.future.set_exception(err)
        seq.finished = True

    def _update_gauges(self) -> None:
        self.metrics.active_sequences.set(len(self._running))
        self.metrics.cache_bytes_reserved.set(self._reserved_bytes)
        self.metrics.cache_usage.set(self._reserved_bytes / max(1, self.settings.cache_memory_budget_bytes))
        self.metrics.queue_length.set(len(self._waiting))
