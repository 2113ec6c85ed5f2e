"""Miner auditors: who audits an answer when the validator has no engine of its own, and whether an
auditor tells the truth (docs/verification.md).

    chosen = choose_auditors(audited_uid, audited_coldkey, candidates, need_tokens, rng)
    reference, name = consensus_reference(chosen, client, timeouts, config)
    failure = await check_auditor(reference.references[i], canary, config)   # each auditor checked on a canary

Miner auditors never confirm a hard failure (scoring.tier1.audit_tier1 makes it soft and asks for
escalation); a disagreement, or an escalation, is settled by a canary on the audited miner, and the
auditor that turned out wrong has it recorded against it (scoring.audit_sequence runs that order).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from protocol.client import ClientTimeouts, MinerClient

from .canaries import Canary
from .config import ScoringConfig
from .failures import Failure
from .tier1 import ConsensusReference, MinerScoreReference

AUDITORS = 2  # miners that score an answer when the validator has no engine of its own


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
    coldkeys, none on the audited miner's coldkey, drawn at random among the eligible miners (not
    the best-scored ones: a colluding pair that reached the top would otherwise audit everyone).
    Once at least two candidates have a score, unscored and zeroed ones are not eligible. Fewer
    than `count` eligible: []."""
    pool = []
    for c in candidates:
        if c.uid == audited_uid or c.coldkey == audited_coldkey:
            continue
        if c.max_context is not None and (c.max_context < need_tokens or (c.max_score_tokens or 0) < need_tokens):
            continue  # declared too small for this audit
        pool.append(c)
    if sum(1 for c in pool if c.score > 0) >= 2:
        pool = [c for c in pool if c.score > 0]
    pool.sort(key=lambda c: c.uid)  # a fixed order, so that the draw depends only on the rng
    rng.shuffle(pool)
    chosen, coldkeys = [], set()
    for candidate in pool:
        if candidate.coldkey not in coldkeys:
            chosen.append(candidate)
            coldkeys.add(candidate.coldkey)
        if len(chosen) == count:
            break
    return chosen if len(chosen) == count else []


async def check_auditor(reference, canary: Canary, config: ScoringConfig) -> Optional[Failure]:
    """Ask an auditor to score a canary's text (its prompt and known greedy continuation), which
    it cannot tell from an audit. The last clear position (reference margin over `greedy_gap_soft`)
    carries a decoy: the reference's runner-up instead of its greedy token, and the text ends there.
    A truthful auditor
    - reports logprobs of the canary's tokens within `logprob_gap_soft` nats of the reference's on
      average (the statistic and bound of a tier-1 audit, calibrated on the honest-numerics
      envelope; needs the canary's logprobs) - a framing auditor (false low scores) fails here
      whatever the margins;
    - ranks each canary token first up to the honest flip margin (without logprobs, the only test
      of framing);
    - puts the decoy well behind its top-1 - a shielding one (everything agrees) fails here.
    None when it passes; a Failure (against the auditor) otherwise."""
    tokens = list(canary.tokens)
    decoy = None
    if canary.runner_up_ids is not None:
        clear = [i for i, m in enumerate(canary.margins) if m > 2 * config.greedy_gap_soft
                 and canary.runner_up_ids[i] != tokens[i]]
        if clear:
            decoy = clear[-1]
            tokens = tokens[:decoy] + [canary.runner_up_ids[decoy]]
    token_ids = list(canary.prompt_ids) + tokens
    positions = list(range(len(canary.prompt_ids), len(token_ids)))
    try:
        scores = await reference.score(token_ids, positions, 2)
    except Exception as error:  # noqa: BLE001 - any failure to answer is the auditor's
        return Failure("auditor_canary", f"the auditor did not score a canary: {type(error).__name__}: {error}")
    if [int(s.position) for s in scores] != positions:
        return Failure("auditor_canary", "the auditor did not score exactly the asked positions")
    wrong, gaps = 0, []
    for i, (margin, scored) in enumerate(zip(canary.margins, scores)):
        if canary.logprobs is not None:  # the decoy is the runner-up: the reference's top-1 less the margin
            gaps.append(abs(float(scored.logprob) - (canary.logprobs[i] - (margin if i == decoy else 0.0))))
        top = sorted(((int(e[0]), float(e[1])) if isinstance(e, (tuple, list)) else (int(e.token_id), float(e.logprob))
                      for e in scored.top), key=lambda pair: -pair[1])
        if not top:
            continue
        behind = top[0][1] - float(scored.logprob)
        if i == decoy:
            if behind < config.greedy_gap_soft:
                return Failure("auditor_canary", f"scoring canary {canary.canary_id}, the auditor ranks a token the "
                                                 f"reference puts {margin:.2f} nats behind its greedy one as (nearly) "
                                                 f"its top-1 ({behind:.2f} behind)")
        elif margin > config.greedy_gap_soft and behind > config.greedy_gap_soft:
            wrong += 1
    if gaps and sum(gaps) / len(gaps) > config.logprob_gap_soft:
        return Failure("auditor_canary", f"scoring canary {canary.canary_id}, the auditor's logprobs of its "
                                         f"{len(gaps)} tokens are {sum(gaps) / len(gaps):.2f} nats off the reference's "
                                         f"on average (honest numerics stay under {config.logprob_gap_soft})")
    if wrong > config.max_greedy_mismatches:
        return Failure("auditor_canary", f"scoring canary {canary.canary_id}, the auditor ranks {wrong} of its "
                                         f"{len(canary.tokens)} known greedy tokens clearly below its own top-1")
    return None


def consensus_reference(chosen: Sequence[AuditorCandidate], client: MinerClient, timeouts: ClientTimeouts,
                        config: ScoringConfig) -> tuple[ConsensusReference, str]:
    """The chosen auditors as one reference (their scores must agree), and its name for the store."""
    references = [MinerScoreReference(client, c.url, c.hotkey, timeouts) for c in chosen]
    return (ConsensusReference(references, margin=config.auditor_disagreement_margin),
            "miners:" + ",".join(c.hotkey for c in chosen))


__all__ = ["AUDITORS", "AuditorCandidate", "choose_auditors", "check_auditor", "consensus_reference"]
