"""Per-request measurements and the rolling window they live in (docs/subnet.md section 5).

`measure_request` turns one work item's outcome (a `GenerateResult`, or the `MinerError` it
raised) and its `Verification` into a flat `Measurement`; `measure_burst` adds one
"burst_aggregate" measurement per burst (verified tokens over the wall time from the first send
to the last final event). All times are the validator's clock: TTFT is the arrival of the first
token after the call started, decode speed excludes it.

`MeasurementWindow` is a plain in-memory store, per uid, pruned to the window. It has no
storage of its own: the neuron persists `to_rows()` (tuples in `COLUMNS` order, SQLite-ready
scalars) and rebuilds with `from_rows(...)` after a restart.
"""
from __future__ import annotations

import math
import secrets
import time
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from protocol.client import GenerateResult, MinerError, MinerHTTPError, MinerTimeout

from .config import ScoringConfig
from .workloads import KINDS, WorkItem

if TYPE_CHECKING:  # a type only: the audit code loads the reference engine (torch), the metrics need none
    from .audit_sequence import Verification

BURST_AGGREGATE = "burst_aggregate"
MEASUREMENT_KINDS = KINDS + (BURST_AGGREGATE,)
# completed: a final event arrived; error: any other failure; timeout: a client deadline passed;
# excused: 429 while the miner already had its declared capacity of our requests in flight.
OUTCOMES = ("completed", "error", "timeout", "excused")
Outcome = Union[GenerateResult, MinerError]


@dataclass(frozen=True)
class Measurement:
    uid: int
    hotkey: str
    at: float  # unix time the request ended
    kind: str  # a WorkItem kind, or "burst_aggregate"
    request_id: str  # the request's id (a burst's id for an aggregate)
    outcome: str  # one of OUTCOMES
    tier0_ok: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Optional[float] = None
    total_s: Optional[float] = None
    decode_tps: Optional[float] = None  # tokens/s after the first token
    ttft_per_1k_s: Optional[float] = None  # TTFT per 1000 prompt tokens
    long_context_success: Optional[bool] = None  # long-context items: correct within budget (None: unknown)
    audits: int = 0  # verdicts reached on this request: tier 1, tier 2
    audit_failures: int = 0
    quality: Optional[float] = None  # tier-1 quality (0 for a failed audit)
    hard_failure: bool = False
    failures: str = ""  # "check: reason; ..." for logs
    burst_id: Optional[str] = None
    burst_tokens: Optional[int] = None  # aggregate rows: verified tokens of all streams
    burst_wall_s: Optional[float] = None  # aggregate rows: first send to last final
    probe_answer: Optional[bool] = None  # a scored answer probe (ScoringConfig.probes_scored): answered right
    committed: Optional[bool] = None  # a completed answer: whether it carried a state commitment (scoring.openings)

    def __post_init__(self):
        if self.kind not in MEASUREMENT_KINDS:
            raise ValueError(f"measurement kind {self.kind!r} is not one of {MEASUREMENT_KINDS}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"measurement outcome {self.outcome!r} is not one of {OUTCOMES}")

    @property
    def answered(self) -> bool:
        """Completed and clean at tier 0: counts for reliability and the completed-requests gate."""
        return self.outcome == "completed" and self.tier0_ok

    @property
    def verified(self) -> bool:
        """Answered, no failed audit and no missed answer probe: the only requests performance is measured on."""
        return self.answered and self.audit_failures == 0 and self.probe_answer is not False


COLUMNS = tuple(f.name for f in fields(Measurement))
_BOOL_COLUMNS = ("tier0_ok", "long_context_success", "hard_failure", "probe_answer", "committed")


# ------------------------------------------------------------------ per request
def decode_tokens_per_s(result: GenerateResult, min_tokens: int = 2) -> Optional[float]:
    """Tokens after the first event over the time from the first to the last token (TTFT
    excluded). None for streams shorter than `min_tokens` or without a measurable interval."""
    events = result.token_events
    n = len(result.token_ids)
    if n < max(min_tokens, 2) or not events:
        return None
    span = events[-1].arrived_s - events[0].arrived_s
    if span <= 0:
        return None
    return (n - len(events[0].event.token_ids)) / span


def ttft_per_1k(ttft_s: Optional[float], prompt_tokens: int) -> Optional[float]:
    if ttft_s is None or prompt_tokens <= 0:
        return None
    return ttft_s * 1000.0 / prompt_tokens


def classify_error(error: MinerError, in_flight: int = 1, capacity: Optional[int] = None) -> str:
    """"timeout", "excused" (429 with at least `capacity` of our requests already in flight,
    this one included beyond it) or "error"."""
    if isinstance(error, MinerTimeout):
        return "timeout"
    if isinstance(error, MinerHTTPError) and error.status == 429 and capacity is not None and in_flight > capacity:
        return "excused"
    return "error"


def _audit_counts(item: WorkItem, verification: Verification, config: ScoringConfig) -> tuple[int, int, Optional[float]]:
    audits = failures = 0
    quality = None
    audit = verification.audit
    if audit is not None and audit.passed is not None:
        audits += 1
        if audit.passed:
            quality = audit.quality
        else:
            failures += 1
            quality = 0.0  # a failed audit says the output did not come from the model
    if verification.tier2 is not None:
        audits += 1
        failures += not verification.tier2.passed
    if verification.opening is not None:
        audits += 1
        failures += not verification.opening.passed
    return audits, failures, quality


def probe_answer(item: WorkItem, verification: Verification, config: ScoringConfig) -> Optional[bool]:
    """Whether a scored answer probe was answered right (None for anything else). A miss is not an audit failure:
    an honest miner of a model that answers 95% of probes misses some, so misses are judged by their rate
    (scoring.rewards, ScoringConfig.probe_miss_rate)."""
    if item.expect.probe not in config.probes_scored:
        return None
    return not verification.answer


def _failure_text(failures) -> str:
    return "; ".join(str(f) for f in failures)[:1000]


def measure_request(uid: int, hotkey: str, item: WorkItem, outcome: Outcome, verification: Optional[Verification],
                    config: ScoringConfig, *, in_flight: int = 1, capacity: Optional[int] = None,
                    at: Optional[float] = None) -> Measurement:
    """One request's measurement. `outcome` is the GenerateResult, or the MinerError raised;
    `verification` is None only for errors. For a 429, `in_flight` is how many of this
    validator's requests to the miner were in flight counting this one and `capacity` the
    miner's declared max_concurrent_streams."""
    base = dict(uid=uid, hotkey=hotkey, kind=item.kind, request_id=item.request.request_id,
                prompt_tokens=item.prompt_tokens, burst_id=item.burst_id)
    if isinstance(outcome, MinerError):
        kind = classify_error(outcome, in_flight, capacity)
        partial = outcome.partial
        ended = at if at is not None else (partial.started_at + (partial.total_s or 0.0) if partial else time.time())
        return Measurement(at=ended, outcome=kind, failures=str(outcome)[:1000],
                           long_context_success=(False if item.kind == "long_context" and kind != "excused" else None),
                           **base)
    result = outcome
    ended = at if at is not None else result.started_at + (result.total_s or 0.0)
    if result.final is None:
        return Measurement(at=ended, outcome="error", failures="no final event",
                           long_context_success=False if item.kind == "long_context" else None, **base)
    if verification is None:
        raise ValueError("a completed request needs its Verification (run verify_item first)")
    audits, audit_failures, quality = _audit_counts(item, verification, config)
    failures = verification.failures
    long_success = None
    if item.kind == "long_context":
        audit = verification.audit
        if audit is not None and audit.passed is None:
            long_success = None  # the audit reached no verdict: unknown, left out of L
        else:
            answer_ok = not (config.planted_fact_scored and any(f.check == "planted_fact" for f in verification.answer))
            long_success = (verification.tier0_ok and (audit is None or bool(audit.passed)) and answer_ok
                            and (result.total_s or math.inf) <= config.long_context_budget_s(item.prompt_tokens))
    ttft = result.ttft_s
    return Measurement(
        at=ended, outcome="completed", tier0_ok=verification.tier0_ok,
        completion_tokens=len(result.token_ids), ttft_s=ttft, total_s=result.total_s,
        decode_tps=decode_tokens_per_s(result, config.decode_min_tokens),
        ttft_per_1k_s=ttft_per_1k(ttft, item.prompt_tokens), long_context_success=long_success,
        audits=audits, audit_failures=audit_failures, quality=quality,
        hard_failure=any(f.hard for f in failures), failures=_failure_text(failures),
        probe_answer=probe_answer(item, verification, config),
        committed=getattr(result.final, "state_commitment", None) is not None, **base)


def measure_burst(uid: int, hotkey: str, streams: Sequence[tuple[WorkItem, Outcome, Optional[Verification]]],
                  config: ScoringConfig, *, at: Optional[float] = None) -> Measurement:
    """The aggregate of one burst: verified tokens of every stream over the wall time from the
    first send to the last final event. Streams that failed, or failed verification, add no
    tokens but their time still counts."""
    if not streams:
        raise ValueError("a burst needs at least one stream")
    burst_ids = {item.burst_id for item, _, _ in streams}
    if len(burst_ids) != 1 or None in burst_ids:
        raise ValueError(f"streams of one burst must share one burst_id, got {burst_ids}")
    starts, ends, tokens = [], [], 0
    for item, outcome, verification in streams:
        result = outcome.partial if isinstance(outcome, MinerError) else outcome
        if result is not None:
            starts.append(result.started_at)
        if isinstance(outcome, GenerateResult) and outcome.final is not None:
            ends.append(outcome.started_at + (outcome.total_s or 0.0))
            audit = verification.audit if verification is not None else None
            if verification is not None and verification.tier0_ok and not (audit is not None and audit.passed is False):
                tokens += len(outcome.token_ids)
    wall = max(ends) - min(starts) if ends and starts else None
    if wall is not None and wall <= 0:
        wall = None
    return Measurement(
        uid=uid, hotkey=hotkey, at=at if at is not None else (max(ends) if ends else time.time()),
        kind=BURST_AGGREGATE, request_id=burst_ids.pop() or "", outcome="completed" if ends else "error",
        tier0_ok=bool(ends), completion_tokens=tokens, burst_id=streams[0][0].burst_id,
        burst_tokens=tokens, burst_wall_s=wall)


def measure_auditor_failure(uid: int, hotkey: str, check: str, reason: str, *, at: Optional[float] = None
                            ) -> Measurement:
    """A failed audit against a miner auditor (scoring.audit_sequence.AuditorFinding): it counts towards
    the auditor's audit failure rate, not towards its requests (outcome "excused")."""
    return Measurement(uid=uid, hotkey=hotkey, at=time.time() if at is None else at, kind="chat",
                       request_id=f"auditor-{secrets.token_hex(8)}", outcome="excused", audits=1, audit_failures=1,
                       failures=f"{check}: {reason}"[:1000])


# ------------------------------------------------------------------ the window
class MeasurementWindow:
    """Measurements per uid, kept for `keep_s` seconds (the scoring window, or longer when hard
    failures must be remembered longer than the window)."""

    COLUMNS = COLUMNS

    def __init__(self, window_s: float = 24 * 3600.0, keep_s: Optional[float] = None):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.keep_s = max(window_s, keep_s or 0.0)
        self._by_uid: dict[int, list[Measurement]] = {}

    @classmethod
    def for_config(cls, config: ScoringConfig) -> "MeasurementWindow":
        return cls(config.window_s, config.hard_failure_s)

    def add(self, measurement: Measurement) -> None:
        self._by_uid.setdefault(measurement.uid, []).append(measurement)

    def extend(self, measurements: Iterable[Measurement]) -> None:
        for m in measurements:
            self.add(m)

    def replace(self, old: Measurement, new: Measurement) -> None:
        """Put `new` where `old` was (an answer whose failure turned out not to be its miner's)."""
        rows = self._by_uid.get(old.uid, [])
        rows[rows.index(old)] = new

    def rows(self, uid: Optional[int] = None, hotkey: Optional[str] = None,
             since: Optional[float] = None) -> list[Measurement]:
        pool = self._by_uid.get(uid, []) if uid is not None else [m for ms in self._by_uid.values() for m in ms]
        return [m for m in pool if (hotkey is None or m.hotkey == hotkey) and (since is None or m.at >= since)]

    def uids(self) -> list[int]:
        return sorted(self._by_uid)

    def forget(self, uid: int) -> None:
        """Drop a uid's measurements (e.g. when it changes hands)."""
        self._by_uid.pop(uid, None)

    def prune(self, now: float) -> int:
        """Drop measurements older than keep_s; returns how many were dropped."""
        cutoff = now - self.keep_s
        dropped = 0
        for uid in list(self._by_uid):
            kept = [m for m in self._by_uid[uid] if m.at >= cutoff]
            dropped += len(self._by_uid[uid]) - len(kept)
            if kept:
                self._by_uid[uid] = kept
            else:
                del self._by_uid[uid]
        return dropped

    def __len__(self) -> int:
        return sum(len(ms) for ms in self._by_uid.values())

    def is_new_or_suspect(self, uid: int, hotkey: str, now: float, config: ScoringConfig) -> bool:
        """New: fewer than `new_miner_requests` verified requests in the window. Suspect: any
        failed audit, audit disagreement or hard failure in the window."""
        rows = self.rows(uid, hotkey, since=now - config.window_s)
        if sum(1 for m in rows if m.verified) < config.new_miner_requests:
            return True
        return any(m.audit_failures or m.hard_failure for m in rows)

    # -------------------------------------------------------------- persistence
    def to_rows(self) -> list[tuple]:
        """Every measurement as a tuple of SQLite-ready scalars, in COLUMNS order."""
        return [astuple(m) for ms in self._by_uid.values() for m in ms]

    @classmethod
    def from_rows(cls, rows: Iterable[Union[Sequence[Any], Mapping[str, Any]]], window_s: float = 24 * 3600.0,
                  keep_s: Optional[float] = None) -> "MeasurementWindow":
        """Rebuild from `to_rows()` output, or from database rows (tuples in COLUMNS order, or
        mappings such as sqlite3.Row keyed by column name)."""
        window = cls(window_s, keep_s)
        for row in rows:
            values = dict(row) if hasattr(row, "keys") else dict(zip(COLUMNS, row))
            missing = [c for c in COLUMNS if c not in values]
            if missing:
                raise ValueError(f"measurement row lacks columns {missing}")
            for name in _BOOL_COLUMNS:
                if values[name] is not None:
                    values[name] = bool(values[name])
            window.add(Measurement(**{c: values[c] for c in COLUMNS}))
        return window


__all__ = [
    "BURST_AGGREGATE", "COLUMNS", "OUTCOMES", "Measurement", "MeasurementWindow", "classify_error",
    "decode_tokens_per_s", "measure_auditor_failure", "measure_burst", "measure_request", "ttft_per_1k",
]
