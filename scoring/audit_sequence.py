"""The order of checks for one measured request, decided in one place (docs/verification.md).

For an answer that reached its final event, `AuditSequence.check` runs:
1. tier 0 on the validator's CPU (scoring.tier0), tier 2 when the item is a canary (scoring.canaries) and
   the answer checks of a probe; a canary sent to settle an escalation also settles what the miner
   auditors of that escalation said;
2. whether the answer gets a tier-1 audit: drawn at the item's rate (higher for a new or suspect miner and
   for long-context items), never after a hard tier-0 failure;
3. who audits (scoring.tier1): the validator's own engine, else two miners on two other coldkeys
   (scoring.auditors), each of which scores a canary of its own; a wrong one voids the audit; the
   validator's own engine also replays a sampled answer of a miner declaring k3-gumbel/1 (scoring.replay);
4. escalation: when the auditors disagree, or miner auditors saw what would be hard evidence, the audited
   miner gets a greedy canary shaped like any other request;
5. an answer that carries a state commitment may be opened (scoring.openings, drawn at its own rate, with its own
   random stream): one block of it re-run on the validator's block reference.

The validator only sends and stores:

    sequence = AuditSequence(config, rng, tokenizer, reference=engine_or_none, canaries=pool, client=client,
                             timeouts=timeouts, audit_timeout_s=90.0)
    checked = await sequence.check(item, result, capabilities, uid=uid, hotkey=hotkey, coldkey=coldkey,
                                   new_or_suspect=..., candidates=lambda: [AuditorCandidate(...), ...])
    # store checked.audits and checked.against_auditors, mark checked.canaries_used, send checked.escalation

`verify_item` is the same checks for one item without the draw, the auditors or the escalation (the
validator's self-check and the tests use it).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from inference.serving import Engine
from protocol.client import ClientTimeouts, GenerateResult, MinerClient
from protocol.schemas import Capabilities

from .auditors import AuditorCandidate, check_auditor, choose_auditors, consensus_reference
from .canaries import Canary, CanaryPool, Tier2Result, check_tier2
from .config import DEFAULT_CONFIG, ScoringConfig
from .failures import Failure
from .openings import OpeningRecord, OpeningVerdict, StateOpenings
from .replay import replays
from .tier0 import check_tier0
from .tier1 import AuditResult, Reference, audit_tier1
from .workloads import WorkItem, WorkloadError, canary_item

log = logging.getLogger("k3.scoring")


# ------------------------------------------------------------------ answers
def check_answer(item: WorkItem, result: GenerateResult) -> list[Failure]:
    """Exact-copy and planted-fact answers (soft failures; how they count is the scorer's call)."""
    expect, text = item.expect, result.text
    failures = []
    if expect.copy_text is not None and expect.copy_text.strip() not in text:
        failures.append(Failure("copy", "the answer does not contain the text it was asked to repeat"))
    if expect.answer is not None and expect.answer not in text:
        failures.append(Failure("planted_fact", f"the answer does not contain the planted value for {expect.subject}"))
    return failures


# ------------------------------------------------------------------ what one answer gets
@dataclass
class Verification:
    tier0: list[Failure] = field(default_factory=list)
    audit: Optional[AuditResult] = None
    tier2: Optional[Tier2Result] = None
    answer: list[Failure] = field(default_factory=list)
    opening: Optional[OpeningVerdict] = None  # an opening of the answer's committed states

    @property
    def tier0_ok(self) -> bool:
        return not self.tier0

    @property
    def failures(self) -> list[Failure]:
        out = list(self.tier0)
        if self.audit is not None:
            out += self.audit.failures
        if self.tier2 is not None:
            out += self.tier2.failures
        if self.opening is not None:
            out += self.opening.failures
        return out + list(self.answer)

    @property
    def hard_failures(self) -> list[Failure]:
        return [f for f in self.failures if f.hard]


def cpu_checks(item: WorkItem, result: GenerateResult, *, tokenizer, capabilities: Capabilities, miner_hotkey: str,
               config: ScoringConfig = DEFAULT_CONFIG) -> Verification:
    """Tier 0, then (for a finished answer) tier 2 for canaries and the answer checks for items that expect
    an answer: everything the validator's CPU judges without a reference."""
    verification = Verification(tier0=check_tier0(item, result, tokenizer, capabilities, miner_hotkey, config))
    if result.final is None:
        return verification
    if item.expect.canary is not None:
        exact = (capabilities.precision or "").lower() in config.exact_precisions
        verification.tier2 = check_tier2(item.expect.canary, result, config, exact=exact)
    if item.expect.answer is not None or item.expect.copy_text is not None:
        verification.answer = check_answer(item, result)
    return verification


async def verify_item(item: WorkItem, result: GenerateResult, *, tokenizer, capabilities: Capabilities,
                      miner_hotkey: str, config: ScoringConfig = DEFAULT_CONFIG,
                      reference: Optional[Reference] = None, audit: bool = False,
                      rng: Optional[random.Random] = None) -> Verification:
    """Tier 0 always; tier 1 when `audit` (and a reference is given and tier 0 found no hard
    failure, which already settles the matter); tier 2 for canaries; answer checks for items
    that expect an answer."""
    verification = cpu_checks(item, result, tokenizer=tokenizer, capabilities=capabilities,
                              miner_hotkey=miner_hotkey, config=config)
    if result.final is None:
        return verification
    if audit and reference is not None and not any(f.hard for f in verification.tier0):
        verification.audit = await audit_tier1(item.prompt_ids, result, reference, config,
                                               stop_ids=tokenizer.stop_ids, rng=rng,
                                               declared_precision=capabilities.precision,
                                               replay=replayable(reference, capabilities))
    return verification


def replayable(reference, capabilities: Capabilities) -> bool:
    """Whether an audit on `reference` also replays the sampled tokens: the miner declares k3-gumbel/1 and the
    reference is an engine in the validator's own process (it replays while it scores; miner auditors do not)."""
    return replays(capabilities.sampler) and isinstance(reference, Engine)


# ------------------------------------------------------------------ whether to audit, and escalation
def audit_probability(item: WorkItem, config: ScoringConfig, *, new_or_suspect: bool) -> float:
    """Chance that this response gets a tier-1 audit (decide after the answer is in)."""
    rate = config.audit_rate_new_or_suspect if new_or_suspect else config.audit_rate
    if item.kind == "long_context":
        rate = max(rate, config.long_context_audit_rate)
    if item.resend_of is not None:  # a resend exists to be replayed (scoring.workloads.with_resends)
        rate = 1.0
    return rate


def draw_audit(rng: random.Random, item: WorkItem, tier0: Sequence[Failure], config: ScoringConfig, *,
               new_or_suspect: bool) -> bool:
    """Whether this answer gets a tier-1 audit: drawn at the item's audit rate (higher for a new or
    suspect miner, and for long-context items), never for an answer tier 0 already failed hard.
    The draw happens either way, so the validator's random stream does not depend on tier 0."""
    drawn = rng.random() < audit_probability(item, config, new_or_suspect=new_or_suspect)
    return drawn and not any(f.hard for f in tier0)


def canary_escalation(pool: Optional[CanaryPool], rng: random.Random, capabilities: Capabilities,
                      config: ScoringConfig, tokenizer) -> tuple[Optional[Canary], Optional[WorkItem]]:
    """(the canary taken from the pool, the work item that sends it). The canary is None when the
    pool has none that fits the miner's context; the item is None when none could be built from it
    (the canary is used up all the same, so the caller records it as used either way)."""
    if pool is None:
        return None, None
    canary = pool.take(rng, max_prompt_tokens=capabilities.max_context - config.chat_max_tokens[0])
    if canary is None:
        return None, None
    try:
        return canary, canary_item(rng, canary, capabilities, config, tokenizer)
    except WorkloadError as error:
        log.warning("cannot escalate with canary %s: %s", canary.canary_id, error)
        return canary, None


# ------------------------------------------------------------------ the sequence
@dataclass
class AuditRecord:
    """One audit of the answer, for the validator to store: tier 2 (a canary, reference "canary") or tier 1
    (against `reference`: "local", or "miners:" and the auditors' hotkeys)."""

    tier: int
    reference: str
    result: AuditResult | Tier2Result
    cpu_s: float
    wall_s: Optional[float] = None


@dataclass(frozen=True)
class AuditorFinding:
    """A failed audit against a miner auditor (counts towards its audit failure rate, not its requests)."""

    auditor: AuditorCandidate
    check: str  # "auditor_canary" (it scored a canary wrong) or "auditor_wrong" (the escalation canary said otherwise)
    reason: str


@dataclass
class CheckedAnswer:
    """What the sequence decided for one answer, and what the validator must send and store because of it."""

    verification: Verification
    cpu_s: float  # the validator's CPU for tier 0, tier 2 and the answer checks
    audits: list[AuditRecord] = field(default_factory=list)
    against_auditors: list[AuditorFinding] = field(default_factory=list)
    canaries_used: list[str] = field(default_factory=list)
    escalation: Optional[WorkItem] = None  # a canary to send the audited miner after its round's work
    openings: list[OpeningRecord] = field(default_factory=list)

    @property
    def tier1(self) -> Optional[AuditRecord]:
        return next((a for a in self.audits if a.tier == 1), None)


class AuditSequence:
    """The validator's audit policy over its rounds (the module doc's order). It shares the validator's
    random stream, so that a seeded validator draws the same audits, auditors and canaries; and it keeps
    which auditors an escalation canary will settle until that canary's answer is checked."""

    def __init__(self, config: ScoringConfig, rng: random.Random, tokenizer, *, reference: Optional[Reference] = None,
                 canaries: Optional[CanaryPool] = None, client: Optional[MinerClient] = None,
                 timeouts: Optional[ClientTimeouts] = None, audit_timeout_s: float = 90.0,
                 openings: Optional[StateOpenings] = None):
        self.config = config
        self.rng = rng
        self.tokenizer = tokenizer
        self.reference = reference  # the validator's own engine; None: miner auditors
        self.canaries = canaries
        self.client = client
        self.timeouts = timeouts
        self.audit_timeout_s = audit_timeout_s
        self.openings = openings  # openings of committed answers (scoring.openings); None: the validator opens none
        # escalation canary request id -> [(auditor, its verdict)]: settled when the canary is judged
        self.pending: dict[str, list[tuple[AuditorCandidate, bool]]] = {}

    async def check(self, item: WorkItem, result: GenerateResult, capabilities: Capabilities, *, uid: int,
                    hotkey: str, coldkey: str, new_or_suspect: bool,
                    candidates: Callable[[], Iterable[AuditorCandidate]] = tuple, url: str = "") -> CheckedAnswer:
        """Every check one finished answer gets, in order. `candidates` lists the serving miners that could
        audit (asked only when the answer is audited and the validator has no engine of its own); `url`: where
        the miner answers openings of its committed states."""
        started = time.thread_time()
        verification = cpu_checks(item, result, tokenizer=self.tokenizer, capabilities=capabilities,
                                  miner_hotkey=hotkey, config=self.config)
        checked = CheckedAnswer(verification, time.thread_time() - started)
        if verification.tier2 is not None:
            checked.audits.append(AuditRecord(2, "canary", verification.tier2, checked.cpu_s))
            checked.against_auditors += self._settle(item, uid, hotkey, verification.tier2.passed)
        if draw_audit(self.rng, item, verification.tier0, self.config, new_or_suspect=new_or_suspect):
            await self._audit(item, result, capabilities, uid, coldkey, candidates, checked)
        if self._opens(result, verification, url, new_or_suspect):
            record = await self.openings.open(item.prompt_ids, result, capabilities.precision, url=url, hotkey=hotkey)
            verification.opening = record.verdict
            checked.openings.append(record)
        return checked

    def _opens(self, result: GenerateResult, verification: Verification, url: str, new_or_suspect: bool) -> bool:
        """Whether to open this answer: it carries a commitment, tier 0 found nothing hard, and the draw says so."""
        final = result.final
        return (self.openings is not None and bool(url) and final is not None
                and getattr(final, "state_commitment", None) is not None and bool(result.token_ids)
                and not any(f.hard for f in verification.tier0) and self.openings.draw(new_or_suspect))

    async def _audit(self, item: WorkItem, result: GenerateResult, capabilities: Capabilities, uid: int,
                     coldkey: str, candidates: Callable[[], Iterable[AuditorCandidate]],
                     checked: CheckedAnswer) -> None:
        reference, name, auditors = self._reference_for(item, result, uid, coldkey, candidates)
        if reference is None:
            return
        audit, wall_s, cpu_s = await self._timed_audit(item, result, reference, capabilities.precision,
                                                       replayable(reference, capabilities))
        if auditors and (audit.passed is not None or audit.escalate):
            failed = await self._check_auditors(reference, auditors, checked)
            if failed:
                audit = AuditResult(passed=None, disagreement=True, auditor_verdicts=audit.auditor_verdicts,
                                    error="an auditor failed its canary check: "
                                          + ", ".join(c.hotkey for c in failed), positions=audit.positions)
        checked.verification.audit = audit
        checked.audits.append(AuditRecord(1, name, audit, cpu_s, wall_s))
        if audit.disagreement or audit.escalate:
            self._escalate(uid, capabilities, audit, auditors, checked)

    def _reference_for(self, item: WorkItem, result: GenerateResult, uid: int, coldkey: str,
                       candidates: Callable[[], Iterable[AuditorCandidate]]):
        """(reference, its name, the miner auditors behind it): the validator's own engine, else two other
        miners on two other coldkeys; (None, "none", []) when too few can audit."""
        if self.reference is not None:
            return self.reference, "local", []
        chosen = choose_auditors(uid, coldkey, candidates(), item.prompt_tokens + len(result.token_ids), self.rng)
        if not chosen:
            return None, "none", []
        reference, name = consensus_reference(chosen, self.client, self.timeouts, self.config)
        return reference, name, chosen

    async def _timed_audit(self, item: WorkItem, result: GenerateResult, reference,
                           precision: Optional[str], replay: bool = False) -> tuple[AuditResult, float, float]:
        wall, cpu = time.monotonic(), time.process_time()
        try:
            audit = await asyncio.wait_for(
                audit_tier1(item.prompt_ids, result, reference, self.config, stop_ids=self.tokenizer.stop_ids,
                            rng=self.rng, declared_precision=precision, replay=replay),
                self.audit_timeout_s)
        except TimeoutError:
            audit = AuditResult(passed=None, error=f"the reference took over {self.audit_timeout_s:g} s")
        return audit, time.monotonic() - wall, time.process_time() - cpu

    async def _check_auditors(self, reference, auditors: list[AuditorCandidate],
                              checked: CheckedAnswer) -> list[AuditorCandidate]:
        """Each miner auditor scores a canary's text (indistinguishable from an audit); those that rank
        its known greedy tokens wrong have it recorded against them and are returned (their verdict is void)."""
        if self.canaries is None:
            return []
        failed = []
        for ref, auditor in zip(reference.references, auditors):
            canary = self.canaries.take(self.rng)
            if canary is None:
                break
            checked.canaries_used.append(canary.canary_id)
            failure = await check_auditor(ref, canary, self.config)
            if failure is not None:
                failed.append(auditor)
                checked.against_auditors.append(AuditorFinding(auditor, failure.check, failure.reason))
        return failed

    def _escalate(self, uid: int, capabilities: Capabilities, audit: AuditResult,
                  auditors: list[AuditorCandidate], checked: CheckedAnswer) -> None:
        """A canary for the audited miner; the miner auditors' verdicts wait for its answer."""
        canary, escalation = canary_escalation(self.canaries, self.rng, capabilities, self.config, self.tokenizer)
        if canary is not None:
            checked.canaries_used.append(canary.canary_id)
        if escalation is not None:
            checked.escalation = escalation
            if auditors and len(audit.auditor_verdicts) == len(auditors):
                self.pending[escalation.request.request_id] = list(zip(auditors, audit.auditor_verdicts))
        elif auditors:
            log.warning("uid %d: miner auditors %s need a canary to settle, and none is left",
                        uid, ", ".join(c.hotkey for c in auditors))

    def _settle(self, item: WorkItem, uid: int, hotkey: str, canary_passed: bool) -> list[AuditorFinding]:
        """An escalation canary settled what miner auditors said: whoever was wrong has it recorded."""
        found = []
        for auditor, verdict in self.pending.pop(item.request.request_id, None) or ():
            if verdict != canary_passed:
                what = "failed" if canary_passed else "passed"
                found.append(AuditorFinding(
                    auditor, "auditor_wrong", f"audited uid {uid} ({hotkey}) and {what} it; the escalation canary "
                                              f"{'passed' if canary_passed else 'failed'}"))
        return found


__all__ = [
    "check_answer", "Verification", "cpu_checks", "verify_item", "audit_probability", "draw_audit",
    "canary_escalation", "AuditRecord", "AuditorFinding", "CheckedAnswer", "AuditSequence",
]
