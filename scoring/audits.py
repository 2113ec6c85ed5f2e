"""The tier-1 audit policy: whether an answer is audited, and who audits it.

The validator measures and stores; what is audited and by whom is decided here:

    if draw_audit(rng, item, tier0, config, new_or_suspect=...):
        chosen = choose_auditors(audited, candidates, need_tokens, rng)   # when it has no engine of its own
        reference, name = consensus_reference(chosen, client, timeouts, config)
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from protocol.client import ClientTimeouts, MinerClient

from .config import ScoringConfig
from .verify import ConsensusReference, Failure, MinerScoreReference, audit_probability
from .workloads import WorkItem

AUDITORS = 2  # miners that score an answer when the validator has no engine of its own


def draw_audit(rng: random.Random, item: WorkItem, tier0: Sequence[Failure], config: ScoringConfig, *,
               new_or_suspect: bool) -> bool:
    """Whether this answer gets a tier-1 audit: drawn at the item's audit rate (higher for a new or
    suspect miner, and for long-context items), never for an answer tier 0 already failed hard.
    The draw happens either way, so the validator's random stream does not depend on tier 0."""
    drawn = rng.random() < audit_probability(item, config, new_or_suspect=new_or_suspect)
    return drawn and not any(f.hard for f in tier0)


@dataclass(frozen=True)
class AuditorCandidate:
    """A serving miner that could audit: its identity, its score (EMA, 0 when unscored) and, when
    known, the context and score lengths it declared."""

    uid: int
    hotkey: str
    coldkey: str
    url: str
    score: float
    max_context: Optional[int] = None
    max_score_tokens: Optional[int] = None


def choose_auditors(audited_uid: int, audited_coldkey: str, candidates: Iterable[AuditorCandidate],
                    need_tokens: int, rng: random.Random, count: int = AUDITORS) -> list[AuditorCandidate]:
    """`count` auditors for an answer of `need_tokens` (prompt plus completion) tokens, on as many
    coldkeys, none on the audited miner's coldkey; best score first (ties broken at random). Once
    at least two candidates have a score, unscored ones are not used. Fewer than `count`: []."""
    pool = []
    for c in candidates:
        if c.uid == audited_uid or c.coldkey == audited_coldkey:
            continue
        if c.max_context is not None and (c.max_context < need_tokens or (c.max_score_tokens or 0) < need_tokens):
            continue  # declared too small for this audit
        pool.append((c.score, rng.random(), c.uid, c.hotkey, c.url, c.coldkey, c))
    pool.sort(key=lambda row: row[:6], reverse=True)
    if sum(1 for row in pool if row[0] > 0) >= 2:
        pool = [row for row in pool if row[0] > 0]  # once there is a ranking, only trusted auditors
    chosen, coldkeys = [], set()
    for row in pool:
        candidate = row[-1]
        if candidate.coldkey not in coldkeys:
            chosen.append(candidate)
            coldkeys.add(candidate.coldkey)
        if len(chosen) == count:
            break
    return chosen if len(chosen) == count else []


def consensus_reference(chosen: Sequence[AuditorCandidate], client: MinerClient, timeouts: ClientTimeouts,
                        config: ScoringConfig) -> tuple[ConsensusReference, str]:
    """The chosen auditors as one reference (their scores must agree), and its name for the store."""
    references = [MinerScoreReference(client, c.url, c.hotkey, timeouts) for c in chosen]
    return (ConsensusReference(references, margin=config.auditor_disagreement_margin),
            "miners:" + ",".join(c.hotkey for c in chosen))
