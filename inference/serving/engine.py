"""The serving engine's interface: one surface for the miner, whatever runs underneath.

`Engine.generate(request)` validates and admits the request at once (raising `EngineError` with a clear code
when it cannot be served) and returns an `EventStream`: an async iterator of `TokenEvent`s then one
`FinalEvent`. `Engine.score(...)` runs a teacher-forced prefill and returns per-position logprobs
(`ScoredPosition`; given a `ReplayKey`, also the token the protocol's sampler k3-gumbel/1 draws at each
generated position: what a validator's replay of a sampled answer needs). This module holds that interface, its requests, events and errors, and `EngineSettings`;
the engines live beside it:

- `inference.serving.local_engine.LocalEngine` runs a model in-process (the reference model, or a sharded
  model with the same `new_cache`/`forward` surface): a loop that asks the step scheduler
  (`inference.serving.scheduler.StepScheduler`, continuous batching with chunked prefill) what to run;
- `inference.serving.remote.RemoteEngine` adapts an OpenAI-compatible server (vLLM, SGLang).
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field

from inference.decoding.sampling import SAMPLER, ReplayedToken, ReplayKey, SamplingParams
from inference.serving.state_commitment import Opening, StateAsk, StateCommitment


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
    owner: str = ""  # who asked (a validator's hotkey): only it may open the answer's committed states

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
    state_commitment: StateCommitment | None = None  # the answer's committed states (engines that commit)


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

    def open_states(self, request_id: str, root: str, asks: list[StateAsk], caller: str = "") -> Opening:
        """The committed states of an answer this engine gave (inference.serving.state_commitment): EngineError
        from an engine that commits to none; OpeningError for an answer it does not (or no longer) keep."""
        raise EngineError("invalid_request", "this engine keeps no state commitments (it cannot read the model's "
                                             "layer states: docs/verification.md)")

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

    def open_states(self, request_id: str, root: str, asks: list[StateAsk], caller: str = "") -> Opening:
        return self.inner.open_states(request_id, root, asks, caller)


# ------------------------------------------------------------ settings
@dataclass(frozen=True)
class EngineSettings:
    """The in-process engine's limits: the step scheduler's budgets (inference.serving.scheduler) and the
    loop's watchdog (inference.serving.local_engine)."""

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
    # Pipelined decode: split the running sequences into up to this many groups and keep one step
    # per group in flight, so pipeline stages work on different groups at once. 1 = one step at a time.
    # > 1 needs a model that keeps steps in flight (`submit` / `collect`: the sharded runtime).
    micro_batches: int = 1
    # State commitments (inference.serving.state_commitment): commit every answer's residual states every this many
    # layers (a divisor of the AttnRes block size; 0: commit nothing, the forward runs without stops), kept for
    # openings this long and within this many bytes.
    commit_layers: int = 0
    commit_retain_s: float = 900.0
    commit_max_bytes: int = 1 << 30
