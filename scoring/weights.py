"""The one place that decides the validator's weights (docs/verification.md).

The validator gathers its evidence and submits what comes out; nothing else turns scores into weights:

    evidence = WeightEvidence(ema, whole_work=..., stages=StageEvidence(work, blamed_drivers, layer_costs))
    weights = miner_weights(evidence, config)          # every scored uid, zeros kept (status, tests)
    submitted = weights_to_submit(evidence, config)     # positive, finite, summing to 1 ({}: nothing to submit)

1. Whole-model miners share in proportion to EMA^exponent (`weights_from_ema`; the EMA of S comes from
   scoring.rewards, gates and verification included), each times its commitment factor
   (`commitment_discount`): c + (1 - c) x `uncommitted_weight_factor`, c the share of its answers in the window
   that carried a state commitment. An engine that cannot commit (vLLM, SGLang) is verified by less (no opening
   can re-run a block of its answers) and is paid at that discount until it commits; the discount is stated in
   the validator's status, never applied silently.
2. A validator that checks stage miners pays both kinds from one vector: a whole-model miner blamed as a
   route driver (receipts the stages never signed) gets 0, and `one_vector` shares the total between the
   kinds by their market scores (scoring.stage_rewards: verified model-tokens x relative speed x
   availability).
3. What is submitted keeps the positive, finite weights, normalised to sum 1. Clipping to the subnet's
   max_weight_limit and u16 quantisation happen in one place only, `chain.weights.conform`, inside every
   chain's set_weights (devnet and subtensor).
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from .config import ScoringConfig
from .stage_rewards import MarketScore, MinerWork, market_scores


@dataclass(frozen=True)
class StageEvidence:
    """What the validator's stage rounds gathered over their window."""

    work: Mapping[int, MinerWork]  # stage uid -> verified layer-tokens, step time, availability, blame reasons
    blamed_drivers: Collection[str] = ()  # hotkeys of route drivers blamed for receipts that do not audit
    layer_costs: Optional[Sequence[float]] = None  # per-layer compute; None until the model's copy is loaded


@dataclass(frozen=True)
class WeightEvidence:
    """Everything a validator's weights depend on."""

    ema: Mapping[int, Union[tuple[str, float], float]]  # whole-model uid -> EMA of S (an EmaEntry or a value)
    whole_work: Mapping[int, MinerWork] = field(default_factory=dict)  # whole-model uid -> its verified work
    stages: Optional[StageEvidence] = None  # None: the validator checks no stage miners
    # whole-model uid -> share of its completed answers in the window that carried a state commitment (a uid not
    # here: nothing measured, no discount)
    committed: Mapping[int, float] = field(default_factory=dict)


def weights_from_ema(ema: Mapping[int, Union[tuple[str, float], float]], exponent: float = 2.0) -> dict[int, float]:
    """Weights proportional to EMA^exponent, summing to 1; all zero when every EMA is zero (the
    neuron decides what to submit then)."""
    values = {uid: float(e[1]) if isinstance(e, tuple) else float(e) for uid, e in ema.items()}
    if any(v < 0 for v in values.values()):
        raise ValueError("EMA values must be non-negative")
    powered = {uid: v ** exponent for uid, v in values.items()}
    total = sum(powered.values())
    if total <= 0:
        return {uid: 0.0 for uid in values}
    return {uid: p / total for uid, p in powered.items()}


def commitment_discount(weights: Mapping[int, float], committed: Mapping[int, float],
                        factor: float) -> dict[int, float]:
    """Whole-model weights times c + (1 - c) x factor (c: the uid's committed share), normalised again to their
    total: an uncommitted miner's share goes to the others, the total stays."""
    total = sum(weights.values())
    scaled = {uid: w * _commitment_factor(committed.get(uid), factor) for uid, w in weights.items()}
    new_total = sum(scaled.values())
    if total <= 0 or new_total <= 0:
        return dict(scaled) if total > 0 else dict(weights)
    return {uid: w * total / new_total for uid, w in scaled.items()}


def _commitment_factor(share: Optional[float], factor: float) -> float:
    if share is None:
        return 1.0
    share = min(1.0, max(0.0, float(share)))
    return share + (1.0 - share) * factor


def one_vector(whole_weights: Mapping[int, float], whole_work: Mapping[int, MinerWork],
               stage_work: Mapping[int, MinerWork], layer_costs: Sequence[float]
               ) -> tuple[dict[int, float], list[MarketScore]]:
    """One weight vector (uid -> weight, summing to 1) over whole-model miners and stage miners.

    Whole-model miners keep today's weights among themselves (`whole_weights`: EMA^2 of S, gates and
    verification included); the two kinds share the total in proportion to their market scores
    (`market_scores`: verified model-tokens x speed relative to the fastest miner of either kind x
    availability), and stage miners split their part by their own market scores. A whole-model miner with
    weight 0 today earns no market share. So the rule of scoring.stage_rewards holds between the kinds: a route
    of N stages doing a miner's verified work at its speed brings the stage miners together what that miner
    brings the whole-model miners; and with no stage miners (or none with verified work) the weights are
    exactly today's."""
    live = {uid: w for uid, w in whole_weights.items() if w > 0}
    total_whole = sum(live.values())
    whole = [whole_work.get(uid) or MinerWork(str(uid), 0, 0.0) for uid in live]
    stages = list(stage_work.values())
    rows = market_scores(whole + stages, layer_costs)
    m_whole = sum(r.score for r in rows[:len(whole)])
    m_stage = sum(r.score for r in rows[len(whole):])
    if m_stage <= 0:
        return ({uid: w / total_whole for uid, w in live.items()} if total_whole > 0 else {}), rows
    share_whole = m_whole / (m_whole + m_stage) if total_whole > 0 else 0.0
    out = {uid: share_whole * w / total_whole for uid, w in live.items()}
    for uid, r in zip(stage_work, rows[len(whole):]):
        out[uid] = (1.0 - share_whole) * r.score / m_stage
    return out, rows


def with_stage_miners(whole_weights: Mapping[int, float], whole_work: Mapping[int, MinerWork],
                      stages: StageEvidence) -> dict[int, float]:
    """The whole-model weights with blamed route drivers at 0, then one vector with the stage miners
    (`one_vector`) once there is stage work and the layers' costs are known."""
    whole_weights = {uid: 0.0 if whole_work.get(uid) is not None and whole_work[uid].hotkey in stages.blamed_drivers
                     else w for uid, w in whole_weights.items()}
    if not stages.work or stages.layer_costs is None:
        return dict(whole_weights)
    weights, _ = one_vector(whole_weights, whole_work, stages.work, stages.layer_costs)
    return weights


def miner_weights(evidence: WeightEvidence, config: ScoringConfig) -> dict[int, float]:
    """uid -> weight from the validator's evidence (the module doc's rules 1 and 2); zeros kept."""
    weights = commitment_discount(weights_from_ema(evidence.ema, config.weight_exponent), evidence.committed,
                                  config.uncommitted_weight_factor)
    if evidence.stages is None:
        return weights
    return with_stage_miners(weights, evidence.whole_work, evidence.stages)


def submitted_weights(weights: Mapping[int, float]) -> dict[int, float]:
    """Positive, finite weights normalised to sum 1 (empty when no miner carries weight)."""
    kept = {uid: float(w) for uid, w in weights.items() if w > 0 and math.isfinite(w)}
    total = sum(kept.values())
    return {uid: w / total for uid, w in kept.items()} if total > 0 else {}


def weights_to_submit(evidence: WeightEvidence, config: ScoringConfig) -> dict[int, float]:
    """The vector the validator submits: `miner_weights`, positive and finite, normalised ({}: none to submit)."""
    return submitted_weights(miner_weights(evidence, config))


__all__ = [
    "StageEvidence", "WeightEvidence", "weights_from_ema", "commitment_discount", "one_vector", "with_stage_miners", "miner_weights",
    "submitted_weights", "weights_to_submit",
]
