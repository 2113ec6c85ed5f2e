"""Replaying sampled answers: the exact check of a miner that declares the protocol's sampler (k3-gumbel/1).

A miner that declares `sampler: "k3-gumbel/1"` draws each sampled token as argmax((l - max l)/T + g) with g a
pure function of (seed, generated-token index, token id) (inference.decoding.sampling), and reports the seed in
its signed final event. So the validator, teacher-forcing the answer on its reference, recomputes at every
generated index the token the sampler picks from the reference's logits (`ReplayedToken`). An honest engine
agrees except where its own numerics (bf16, other kernels, batching) move a near-tie: the miner's token then
trails the replayed one by a gap under `delta` nats of logit. Greedy answers to sampled requests, answers that
ignore the seed (a cache, a fixed seed), a wrong temperature and cheaper models disagree at a large share of
the tokens, by gaps far beyond it.

The judgement (`judge_replay`): the tokens whose gap is `delta` or more ("beyond a near-tie") are counted; an
honest miner of the declared numerics has them at a rate under `rate` (the 95% upper bound of what the
model's envelope measured; scoring/model_envelope.py, its "replay" section). The audit fails when that many
such tokens among the answer's sampled tokens would happen to an honest miner with chance under
`config.replay_p_soft` (binomial tail), and hard under `config.replay_p_hard` on a trusted reference. A model
without a measured envelope is replayed with the conservative `config.replay_delta_unmeasured` and
`replay_rate_unmeasured` (the validator says so at start).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from inference.decoding.sampling import SAMPLER, ReplayedToken, SamplingParams, replay_token

from .config import ScoringConfig
from .failures import Failure
from .model_envelope import binomial_tail, load_envelope, precision_key


@dataclass
class ReplayStatistics:
    """One sampled answer replayed on one reference."""

    positions: int  # sampled tokens replayed
    temperature: float
    gaps: list[float] = field(default_factory=list)  # per token: 0 where it is the replayed one, else its gap
    margins: list[float] = field(default_factory=list)  # per token: the replay's best-vs-second margin

    @classmethod
    def of(cls, replayed: Sequence[ReplayedToken], temperature: float) -> "ReplayStatistics":
        return cls(len(replayed), temperature, [r.gap for r in replayed], [r.margin for r in replayed])

    @property
    def mismatches(self) -> int:
        return sum(1 for g in self.gaps if g > 0.0)

    def beyond(self, delta: float) -> int:
        """Tokens that are not the replayed one by a gap of `delta` or more (no near-tie excuses them)."""
        return sum(1 for g in self.gaps if g >= delta and g > 0.0)

    def first_beyond(self, delta: float) -> Optional[int]:
        return next((i for i, g in enumerate(self.gaps) if g >= delta and g > 0.0), None)

    def near_ties(self, delta: float) -> int:
        """Tokens whose replay was a near-tie (best and second best perturbed values within `delta`)."""
        return sum(1 for m in self.margins if m < delta)

    @property
    def worst_gap(self) -> float:
        return max((g for g in self.gaps if math.isfinite(g)), default=0.0)


def replay_rows(rows: torch.Tensor, tokens: Sequence[int], params: SamplingParams, seed: int,
                first_index: int = 0) -> ReplayStatistics:
    """Replay a sampled answer from the reference's logits rows [n, V] (row j: generated-token index
    first_index + j)."""
    if params.temperature <= 0:
        raise ValueError("only sampled answers (temperature > 0) are replayed; greedy ones are the greedy check's")
    replayed = [replay_token(rows[j], params, seed, first_index + j, int(t)) for j, t in enumerate(tokens)]
    return ReplayStatistics.of(replayed, float(params.temperature))


@dataclass(frozen=True)
class ReplayRule:
    """How one miner's sampled answers are judged: near-ties under `delta` nats of logit are excused; an honest
    miner has tokens beyond that at a rate under `rate` (95%)."""

    delta: float
    rate: float
    source: str  # where the numbers come from, for the failure's reason and the validator's log


def replay_rule(config: ScoringConfig, precision: Optional[str]) -> ReplayRule:
    """The rule for a miner declaring `precision`: the served model's measured envelope when it covers that
    precision (config.logprob_gap_envelope's "replay" section), else the conservative unmeasured values."""
    if config.logprob_gap_envelope is not None:
        record = load_envelope(str(config.logprob_gap_envelope)).replay.get(precision_key(precision) or "")
        if record is not None:
            return ReplayRule(record.delta, record.rate_95,
                              f"the envelope measured for this model in {precision_key(precision)} "
                              f"({record.positions} honest sampled tokens)")
    return ReplayRule(config.replay_delta_unmeasured, config.replay_rate_unmeasured,
                      "no envelope measured for this model and precision: conservative values")


def replays(sampler: Optional[str]) -> bool:
    """Whether a miner declaring this sampler (Capabilities.sampler) has its sampled answers replayed."""
    return sampler == SAMPLER


def judge_replay(stats: ReplayStatistics, rule: ReplayRule, config: ScoringConfig, trusted: bool) -> list[Failure]:
    """The replay's verdict on one answer (module doc): [] when it passes."""
    k, n = stats.beyond(rule.delta), stats.positions
    if k == 0:
        return []
    chance = binomial_tail(n, k, min(1.0, rule.rate))
    if chance >= config.replay_p_soft:
        return []
    return [Failure("replay_mismatch",
                    f"{k} of {n} sampled tokens are not what k3-gumbel/1 draws with the reported seed from the "
                    f"reference's logits, beyond a near-tie of {rule.delta:g} nats (first at token "
                    f"{stats.first_beyond(rule.delta)}, worst gap {stats.worst_gap:.2f}); an honest miner has at "
                    f"most {rule.rate:.2g} such tokens ({rule.source}): chance {chance:.1e}, failing under "
                    f"{config.replay_p_soft:g}, hard under {config.replay_p_hard:g}",
                    hard=trusted and chance < config.replay_p_hard)]


__all__ = ["ReplayStatistics", "ReplayRule", "replay_rows", "replay_rule", "replays", "judge_replay"]
