"""From measurements to scores and their EMA (docs/verification.md). Pure functions, no I/O.

    scores = score_miners(window, config, now, hotkeys, coldkeys)   # per uid, with reasons
    ema = update_ema(previous_ema, scores, config.ema_alpha)         # once per round

The weights come from the EMA in one place, scoring.weights (proportional to EMA^2).

Per miner, over the window, from its verified requests:
- D: decode tokens/s per stream (TTFT excluded), `percentile`-th percentile;
- F: TTFT per 1k prompt tokens, lower is better, taken at the same percentile of performance
  (the (100 - percentile)-th percentile of the seconds);
- C: burst aggregate verified tokens/s, pooled over the window's bursts (sum of verified burst
  tokens over the sum of burst wall times);
- L: share of long-context requests correct within budget, weighted by prompt length.
Each is scaled by the best miner's value (F: best / F) among miners not zeroed by a gate and
clipped to [floor, ceiling]; a component a miner has no data for is left out of its perf
(the weighted mean of the components it was measured on). perf = 0.30 D + 0.20 F + 0.30 C + 0.20 L.

S = gate * reliability * quality * perf, where reliability is the share of requests answered
(final event, clean at tier 0; 429s past the declared capacity left out), quality the mean
tier-1 quality (a failed audit counts 0), and the gate 0 for a hard failure within
`hard_failure_s` or an audit failure rate >= 15% over >= 10 audits (long-context audits also
on their own, over >= `long_audit_min_count`); of several uids on one coldkey only the best keeps its S.

Evidence instead of a cap: with n requests measured in the window (answered or not) and
N = `min_completed_requests`, the round moves the EMA by alpha * min(1, n / N) towards S
(`MinerScore.evidence`). A new miner's weight grows with the evidence behind it, not with one
lucky short round, and S itself is never capped, so no 4x jump happens the round a miner crosses
N: two identical miners with the same evidence get the same EMA, round by round. Counting every
measured request (not only the answered ones) keeps a miner that stops answering from freezing
its EMA: its timeouts are evidence too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional

import numpy as np

from .config import ScoringConfig
from .metrics import BURST_AGGREGATE, Measurement, MeasurementWindow
from .model_envelope import binomial_tail


@dataclass
class MinerScore:
    uid: int
    hotkey: str
    coldkey: str
    requests: int = 0  # requests in the window, excused 429s left out
    answered: int = 0  # completed and clean at tier 0
    verified: int = 0  # answered and no failed audit
    decode_tps: Optional[float] = None  # raw D
    ttft_per_1k_s: Optional[float] = None  # raw F
    burst_tps: Optional[float] = None  # raw C
    long_context_share: Optional[float] = None  # raw L
    D: float = 0.0
    F: float = 0.0
    C: float = 0.0
    L: float = 0.0
    perf: float = 0.0
    quality: float = 0.0
    reliability: float = 0.0
    gate: float = 1.0
    score: float = 0.0  # S
    audits: int = 0
    audit_failures: int = 0
    hard_failures: int = 0
    zeroed: bool = False  # zeroed by a hard failure or the audit failure rate: its EMA restarts at 0
    evidence: float = 1.0  # min(1, requests / min_completed_requests): the share of a full EMA step
    reasons: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def _raw_components(rows: list[Measurement], config: ScoringConfig) -> tuple:
    requests = [m for m in rows if m.kind != BURST_AGGREGATE and m.outcome != "excused"]
    verified_singles = [m for m in requests if m.verified and m.kind != "burst"]
    decode = _percentile([m.decode_tps for m in verified_singles if m.decode_tps is not None], config.percentile)
    ttft = _percentile([m.ttft_per_1k_s for m in verified_singles if m.ttft_per_1k_s is not None],
                       100.0 - config.percentile)
    bursts = [m for m in rows if m.kind == BURST_AGGREGATE and m.burst_wall_s]
    burst = sum(m.burst_tokens or 0 for m in bursts) / sum(m.burst_wall_s for m in bursts) if bursts else None
    longs = [m for m in requests if m.kind == "long_context" and m.long_context_success is not None]
    weight = sum(m.prompt_tokens for m in longs)
    long_share = sum(m.prompt_tokens for m in longs if m.long_context_success) / weight if weight > 0 else None
    return requests, decode, ttft, burst, long_share


def _scaled(value: Optional[float], best: Optional[float], config: ScoringConfig, lower_is_better: bool = False) -> float:
    if best is None:
        return 1.0  # nobody has data: the component does not tell miners apart
    if value is None or value <= 0:
        return config.component_floor
    ratio = best / value if lower_is_better else value / best
    return min(max(ratio, config.component_floor), config.component_ceiling)


def score_miners(window: MeasurementWindow, config: ScoringConfig, now: float, hotkeys: Mapping[int, str],
                 coldkeys: Mapping[int, str]) -> dict[int, MinerScore]:
    """Scores of every uid in `hotkeys` (uid -> current hotkey) from the window's measurements
    taken under that hotkey. `coldkeys` maps uid -> coldkey (a uid without one is on its own)."""
    since = now - config.window_s
    scores: dict[int, MinerScore] = {}
    raw: dict[int, tuple] = {}
    for uid, hotkey in hotkeys.items():
        score = MinerScore(uid=uid, hotkey=hotkey, coldkey=coldkeys.get(uid, ""))
        all_rows = window.rows(uid, hotkey)
        rows = [m for m in all_rows if m.at >= since]
        requests, decode, ttft, burst, long_share = _raw_components(rows, config)
        score.requests = len(requests)
        score.answered = sum(1 for m in requests if m.answered)
        score.verified = sum(1 for m in requests if m.verified)
        score.decode_tps, score.ttft_per_1k_s, score.burst_tps, score.long_context_share = decode, ttft, burst, long_share
        score.reliability = score.answered / score.requests if score.requests else 0.0
        if not score.requests:
            score.reasons.append("no requests in the window")
        qualities = [m.quality for m in rows if m.quality is not None]
        score.quality = sum(qualities) / len(qualities) if qualities else config.quality_without_audits
        score.audits = sum(m.audits for m in rows)
        score.audit_failures = sum(m.audit_failures for m in rows)
        hard = [m for m in all_rows if m.hard_failure and m.at >= now - config.hard_failure_s]
        score.hard_failures = len(hard)
        if hard:
            score.gate, score.zeroed = 0.0, True
            score.reasons.append(f"hard failure at {hard[-1].at:.0f}: {hard[-1].failures}")
        if score.audits >= config.audit_min_count and score.audit_failures >= config.audit_failure_rate * score.audits:
            score.gate, score.zeroed = 0.0, True
            score.reasons.append(f"failed {score.audit_failures} of {score.audits} audits")
        # Long-context audits judged on their own: a swap on long prompts only must not hide among
        # many passed short audits.
        long_audits = sum(m.audits for m in rows if m.kind == "long_context")
        long_failed = sum(m.audit_failures for m in rows if m.kind == "long_context")
        if long_audits >= config.long_audit_min_count and long_failed >= config.audit_failure_rate * long_audits:
            score.gate, score.zeroed = 0.0, True
            score.reasons.append(f"failed {long_failed} of {long_audits} long-context audits")
        probes = [m.probe_answer for m in rows if m.probe_answer is not None]
        missed = probes.count(False)
        if missed:
            chance = binomial_tail(len(probes), missed, config.probe_miss_rate)
            if chance < config.probe_gate_p:
                score.gate, score.zeroed = 0.0, True
                score.reasons.append(f"missed {missed} of {len(probes)} answer probes (a miner of the served model "
                                     f"misses at most {config.probe_miss_rate:.0%}: chance {chance:.1e})")
        score.evidence = evidence_share(score.requests, config)
        if score.evidence < 1.0:
            score.reasons.append(f"only {score.requests} requests in the window (< {config.min_completed_requests}): "
                                 f"the EMA moves {score.evidence:.2f} of a full step")
        scores[uid] = score
        raw[uid] = (decode, ttft, burst, long_share)

    # Relative scaling against the best miner that a gate has not zeroed (a cheater's numbers
    # must not set the bar).
    eligible = [uid for uid, s in scores.items() if not s.zeroed]

    def best(index: int, pick) -> Optional[float]:
        values = [raw[uid][index] for uid in eligible if raw[uid][index] is not None and raw[uid][index] > 0]
        return pick(values) if values else None

    best_d, best_f, best_c, best_l = best(0, max), best(1, min), best(2, max), best(3, max)
    for uid, s in scores.items():
        decode, ttft, burst, long_share = raw[uid]
        s.D = _scaled(decode, best_d, config)
        s.F = _scaled(ttft, best_f, config, lower_is_better=True)
        s.C = _scaled(burst, best_c, config)
        s.L = _scaled(long_share, best_l, config)
        # A component the miner has no data for (no burst this window, say) is left out, not floored:
        # perf is the weighted mean of the components it was measured on.
        parts = [(w, c) for w, c, value in ((config.weight_decode, s.D, decode), (config.weight_ttft, s.F, ttft),
                                            (config.weight_burst, s.C, burst),
                                            (config.weight_long_context, s.L, long_share))
                 if value is not None and w > 0]
        total_weight = sum(w for w, _ in parts)
        s.perf = sum(w * c for w, c in parts) / total_weight if total_weight > 0 else 0.0
        s.score = s.gate * s.reliability * s.quality * s.perf

    if config.one_hotkey_per_coldkey:
        by_coldkey: dict[str, list[int]] = {}
        for uid, s in scores.items():
            if s.coldkey:
                by_coldkey.setdefault(s.coldkey, []).append(uid)
        for coldkey, uids in by_coldkey.items():
            if len(uids) < 2:
                continue
            keep = min(uids, key=lambda u: (-scores[u].score, u))
            for uid in uids:
                if uid != keep:
                    scores[uid].gate, scores[uid].score = 0.0, 0.0
                    scores[uid].reasons.append(f"coldkey {coldkey} keeps only its best uid ({keep})")
    return scores


def evidence_share(requests: int, config: ScoringConfig) -> float:
    """The share of a full EMA step that `requests` measured requests in the window earn."""
    if config.min_completed_requests <= 0:
        return 1.0
    return min(1.0, max(0, requests) / config.min_completed_requests)


class EmaEntry(NamedTuple):
    hotkey: str
    value: float


def update_ema(previous: Mapping[int, tuple[str, float]], scores: Mapping[int, MinerScore],
               alpha: float) -> dict[int, EmaEntry]:
    """One round of EMA(S) per uid: EMA += alpha * evidence * (S - EMA). A new uid, or a uid whose
    hotkey changed, starts from 0; a miner zeroed by a gate (hard failure, audit failure rate) drops
    to 0 at once. Uids absent from `scores` (deregistered) are dropped."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    out = {}
    for uid, s in scores.items():
        old = previous.get(uid)
        step = alpha * min(1.0, max(0.0, s.evidence))
        if s.zeroed:
            value = 0.0
        elif old is None or old[0] != s.hotkey:
            value = step * s.score
        else:
            value = step * s.score + (1.0 - step) * float(old[1])
        out[uid] = EmaEntry(s.hotkey, value)
    return out


__all__ = ["MinerScore", "EmaEntry", "evidence_share", "score_miners", "update_ema"]
