"""The step scheduler: which requests the in-process engine serves, and what each model step runs.

`StepScheduler` holds the waiting and running sequences and the cache-memory budget, and decides:

- admission: a request waits, first come first served, until a sequence slot is free and its whole cache
  (prompt plus max_tokens) fits the budget; one that could never fit an empty engine is refused at once;
- the plan of each step: one decode position per sequence past its prompt (with its drafted tokens when it
  speculates), then prefill chunks within the step's work budget;
- micro-batch groups (`EngineSettings.micro_batches` > 1): which running sequences share a step;
- the accounting after a step: how many of each sequence's tokens the model has read.

It is policy only: no threads, no asyncio, no model. It takes plain numbers (the settings, the cache bytes of
a sequence) and sequence objects, and returns plans, which `LocalEngine` (inference.serving.local_engine) runs.
"""
from __future__ import annotations

import math
from collections import deque

from inference.serving.engine import EngineError, EngineSettings

# A planned step: each sequence with the token ids it runs (a prefill chunk, or its last token and any drafts).
StepPlan = list[tuple["ScheduledSequence", list[int]]]


class ScheduledSequence:
    """What the scheduler knows of one request. The engine appends each emitted token to `token_ids` and
    `generated`; the scheduler moves `consumed` (the tokens the model has read) and the sequence's place.

    `speculation` (an inference.decoding.SequenceSpeculation, set by an engine that speculates) proposes the
    drafts a decode step runs; the plan leaves them in `draft` for the step's verification."""

    __slots__ = ("token_ids", "prompt_len", "max_tokens", "generated", "consumed", "reserved", "cancelled",
                 "finished", "speculation", "draft", "group")

    def __init__(self, token_ids: list[int], max_tokens: int = 0):
        self.token_ids = list(token_ids)  # prompt, then generated tokens appended
        self.prompt_len = len(token_ids)
        self.max_tokens = max_tokens  # completion tokens asked for (0: a scoring request, which never decodes)
        self.generated: list[int] = []
        self.consumed = 0  # tokens fed through the model
        self.reserved = 0  # cache bytes held while running (StepScheduler.admissible)
        self.cancelled = False
        self.finished = False
        self.speculation = None
        self.draft = None  # this step's drafted tokens (inference.decoding.drafters.Draft)
        self.group: int | None = None  # micro_batches > 1: the group whose steps carry this sequence

    @property
    def in_prefill(self) -> bool:
        return self.consumed < self.prompt_len


class StepScheduler:
    """Continuous batching with chunked prefill, under a cache-memory budget and a per-step work budget.

    A sequence's cache costs `fixed_bytes` (the KDA state, whatever its length) plus `bytes_per_token` per
    token; the whole of it (prompt plus max_tokens) is reserved at admission, so a running sequence never
    runs out of cache. `max_context` is the longest sequence served."""

    def __init__(self, settings: EngineSettings, *, max_context: int, fixed_bytes: int, bytes_per_token: int):
        if settings.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1 (got {settings.micro_batches})")
        self.settings = settings
        self.max_context = max_context
        self.fixed_bytes = fixed_bytes
        self.bytes_per_token = bytes_per_token
        self._waiting: deque[ScheduledSequence] = deque()
        self._running: list[ScheduledSequence] = []
        self._reserved_bytes = 0
        self._groups: list[list[ScheduledSequence]] = [[] for _ in range(settings.micro_batches)]

    # ------------------------------------------------------------ state
    @property
    def waiting(self) -> tuple[ScheduledSequence, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[ScheduledSequence, ...]:
        """The admitted sequences, oldest first."""
        return tuple(self._running)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    # ------------------------------------------------------------ admission
    def sequence_bytes(self, length: int) -> int:
        """Cache memory of one sequence of `length` tokens."""
        return self.fixed_bytes + self.bytes_per_token * length

    def admissible(self, length: int) -> int:
        """The cache bytes a sequence of `length` tokens (prompt plus max_tokens) reserves; EngineError
        context_too_long when it is longer than the context or could not fit even an empty engine."""
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

    def enqueue(self, seq: ScheduledSequence) -> None:
        """Queue `seq` (its `reserved` set by admissible()) behind the others; EngineError queue_full when
        max_waiting requests wait already. admit() then runs it as soon as it fits."""
        if len(self._waiting) >= self.settings.max_waiting:
            raise EngineError("queue_full", f"the wait queue is full ({self.settings.max_waiting} requests); retry later")
        self._waiting.append(seq)

    def admit(self) -> list[ScheduledSequence]:
        """Move waiting sequences, in order, into the running set while a slot is free and their cache fits;
        returns those admitted (the engine gives each a cache). A sequence cancelled while waiting is dropped.
        The queue is first come first served: a large request at its head holds back smaller ones behind it,
        so it is not starved by them."""
        s = self.settings
        admitted = []
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
            self._reserved_bytes += seq.reserved
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def release(self, seq: ScheduledSequence) -> None:
        """`seq` is done (finished, failed or cancelled): its slot and its cache reservation are free."""
        if seq in self._running:
            self._running.remove(seq)
            self._reserved_bytes -= seq.reserved
        seq.finished = True

    def cancelled(self, group: int | None = None) -> list[ScheduledSequence]:
        """The running sequences (of one micro-batch group) whose request was cancelled: the engine ends them."""
        return [q for q in self._members(group) if q.cancelled]

    def drain(self) -> list[ScheduledSequence]:
        """Forget every sequence, running then waiting, and return them (the engine stops or restarts)."""
        drained = list(self._running) + list(self._waiting)
        self._waiting.clear()
        self._running.clear()
        self._reserved_bytes = 0
        self.reset_groups()
        return drained

    def drain_waiting(self) -> list[ScheduledSequence]:
        """Forget the waiting sequences and return them (the model is broken: they cannot be served)."""
        drained = list(self._waiting)
        self._waiting.clear()
        return drained

    # ------------------------------------------------------------ planning
    def prefill_cost(self, start: int, n: int) -> float:
        """Work of prefilling n prompt tokens from position `start`, in units of one short-context token:
        attention makes a token at position p cost (1 + p / attention_cost_tokens)."""
        return n * (1.0 + (start + n) / self.settings.attention_cost_tokens)

    def prefill_fit(self, seq: ScheduledSequence, start: int, units: float) -> int:
        """The most prompt tokens of seq from `start` whose prefill costs at most `units`."""
        a = self.settings.attention_cost_tokens
        b = 1.0 + start / a
        n = int((-b + math.sqrt(b * b + 4.0 * max(units, 0.0) / a)) * a / 2.0)
        return max(0, min(n, seq.prompt_len - start))

    def plan_step(self, group: int | None = None) -> StepPlan:
        """Decode tokens for every sequence past its prompt, then prefill chunks within the step's budget.

        The budget counts work, not tokens: a chunk deep into a long prompt attends to everything before
        it, so it gets fewer tokens, and every step stays short enough for the decoding sequences' next
        tokens. Prefill goes shortest-remaining-first, so a short prompt is not stuck behind a long one;
        the oldest prefilling sequence always advances (by `min_prefill_chunk` tokens of work, at least one
        token), so a long prompt is never starved by a stream of short ones. `group`: plan for that
        micro-batch group's sequences (micro_batches > 1), else for every running one."""
        s = self.settings
        running = self._members(group)
        batch = [(seq, self.decode_positions(seq)) for seq in running if not seq.in_prefill]
        units = float(max(s.step_token_budget - sum(len(chunk) for _, chunk in batch), s.min_prefill_chunk))
        prefilling = [seq for seq in running if seq.in_prefill]
        grant = self._prefill_grants(prefilling, units)
        for seq in prefilling:
            n = grant.get(id(seq), 0)
            if n > 0:
                batch.append((seq, seq.token_ids[seq.consumed:seq.consumed + n]))
        return batch

    def _prefill_grants(self, prefilling: list[ScheduledSequence], units: float) -> dict[int, int]:
        """Prompt tokens each prefilling sequence (by id) runs this step, within `units` of work: the oldest
        first (its minimum chunk), then shortest-remaining-first."""
        grant: dict[int, int] = {}
        if not prefilling:
            return grant
        oldest = prefilling[0]
        n = max(1, self.prefill_fit(oldest, oldest.consumed, min(self.settings.min_prefill_chunk, units)))
        grant[id(oldest)] = n
        units -= self.prefill_cost(oldest.consumed, n)
        for seq in sorted(prefilling, key=lambda q: q.prompt_len - q.consumed):
            if units <= 0:
                break
            start = seq.consumed + grant.get(id(seq), 0)
            extra = self.prefill_fit(seq, start, units)
            units -= self.prefill_cost(start, extra)
            grant[id(seq)] = grant.get(id(seq), 0) + extra
        return grant

    @staticmethod
    def decode_positions(seq: ScheduledSequence) -> list[int]:
        """The tokens a decoding sequence runs this step: its last token, then any drafted ones (left in
        `seq.draft`; at most the completion tokens still owed after this step's own)."""
        tokens = [seq.token_ids[seq.consumed]]
        if seq.speculation is None:
            return tokens
        seq.draft = seq.speculation.drafts(seq.token_ids, seq.max_tokens - len(seq.generated) - 1)
        return tokens + seq.draft.tokens

    @staticmethod
    def account_step(plan: StepPlan) -> list[int]:
        """A planned step ran: each sequence has read its chunk. Returns the position each chunk started at.
        (A speculative step's rejected drafts are taken back by the engine, which rewinds the cache too.)"""
        starts = []
        for seq, chunk in plan:
            starts.append(seq.consumed)
            seq.consumed += len(chunk)
        return starts

    # ------------------------------------------------------------ micro-batch groups
    def reset_groups(self) -> None:
        """Empty every micro-batch group (a loop starts afresh, or every running sequence failed)."""
        self._groups = [[] for _ in range(self.settings.micro_batches)]

    def assign_groups(self) -> None:
        """Each running sequence without a group joins the smallest one; a sequence keeps its group, so its
        steps never overlap (speculation's cache marks and rewinds stay in order)."""
        groups = self._groups
        for seq in self._running:
            if seq.group is None:
                seq.group = min(range(len(groups)), key=lambda i: len(groups[i]))
                groups[seq.group].append(seq)

    def prune_group(self, group: int) -> list[ScheduledSequence]:
        """Drop the finished sequences from `group`; returns those left."""
        self._groups[group] = [q for q in self._groups[group] if not q.finished]
        return list(self._groups[group])

    def _members(self, group: int | None) -> list[ScheduledSequence]:
        return self._running if group is None else self._groups[group]
