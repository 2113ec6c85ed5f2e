"""Tier 1: the teacher-forced audit of a sample of answers (docs/verification.md).

The prompt and the miner's output are scored token by token on a reference that can teacher-force token
ids: the validator's own `inference.serving.LocalEngine`, one other miner (`MinerScoreReference`) or two
other miners that must agree (`ConsensusReference`). `audit_statistics` measures every number the rules
look at, `judge_statistics` applies the rules, and `audit_tier1` runs both on one answer.
"""
from __future__ import annotations

import asyncio
import math
import random
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol, Sequence

from inference.decoding.sampling import ReplayKey, SamplingParams
from inference.serving import EngineError
from protocol.client import ClientTimeouts, GenerateResult, MinerClient, MinerError
from protocol.schemas import ScoreRequest

from .config import DEFAULT_CONFIG, ScoringConfig
from .failures import Failure
from .model_envelope import load_envelope, precision_key
from .replay import ReplayStatistics, judge_replay, replay_rule


# ------------------------------------------------------------------ references
class Reference(Protocol):
    """Anything that teacher-forces token ids: `LocalEngine`, `MinerScoreReference`, ...

    `score` returns, per asked position p, an object with `position`, `token_id`, `logprob` (of
    token_ids[p] given token_ids[:p]) and `top` (best first; (id, logprob) pairs or objects with
    `token_id` and `logprob`). A reference with `trusted = False` cannot confirm a hard failure
    on its own; one without the attribute (the validator's own engine) is trusted."""

    async def score(self, token_ids: list[int], positions: Optional[list[int]] = None, top_k: int = 0) -> Sequence[Any]: ...


class MinerScoreReference:
    """Another miner's /v1/score as an audit reference (for validators without their own engine)."""

    trusted = False  # another miner could frame a competitor (or shield a partner): never confirms a hard failure

    def __init__(self, client: MinerClient, url: str, hotkey: str, timeouts: Optional[ClientTimeouts] = None):
        self.client = client
        self.url = url
        self.hotkey = hotkey
        self.timeouts = timeouts

    async def score(self, token_ids: list[int], positions: Optional[list[int]] = None, top_k: int = 0):
        request = ScoreRequest(request_id=secrets.token_hex(16), token_ids=list(token_ids),
                               positions=None if positions is None else list(positions), top_k=top_k)
        answer = await self.client.score(self.url, self.hotkey, request, self.timeouts)
        return list(answer.scores)

    def __repr__(self) -> str:
        return f"MinerScoreReference({self.url}, {self.hotkey})"


class ReferenceDisagreement(Exception):
    """The auditors of a ConsensusReference gave different answers: escalate to tier 2."""


class ConsensusReference:
    """Two (or more) references that must agree, e.g. two miners on different coldkeys.

    `audit_tier1` audits against each and marks the audit `disagreement=True` (no verdict) when
    they reach different verdicts or their probabilities differ by more than
    `config.auditor_disagreement_margin` on average. Used directly, `score` returns the first
    reference's answer when all agree and raises ReferenceDisagreement otherwise."""

    trusted = False  # agreeing auditors give a verdict, but only a canary or the validator's engine confirms a hard one

    def __init__(self, references: Sequence[Reference], margin: float = DEFAULT_CONFIG.auditor_disagreement_margin):
        if len(references) < 2:
            raise ValueError("a consensus needs at least two references")
        self.references = list(references)
        self.margin = margin

    async def score_each(self, token_ids: list[int], positions: Optional[list[int]] = None, top_k: int = 0) -> list[list]:
        answers = await asyncio.gather(*(r.score(token_ids, positions, top_k) for r in self.references),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [list(answer) for answer in answers]

    async def score(self, token_ids: list[int], positions: Optional[list[int]] = None, top_k: int = 0):
        answers = await self.score_each(token_ids, positions, top_k)
        for other in answers[1:]:
            diff = _mean_prob_diff(answers[0], other)
            if diff > self.margin:
                raise ReferenceDisagreement(f"references differ by {diff:.3f} in mean probability")
        return answers[0]


def _pairs(top) -> list[tuple[int, float]]:
    out = [(int(e[0]), float(e[1])) if isinstance(e, (tuple, list)) else (int(e.token_id), float(e.logprob))
           for e in top]
    out.sort(key=lambda pair: -pair[1])
    return out


def _mean_prob_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    if not a:
        return 0.0
    return sum(abs(math.exp(x.logprob) - math.exp(y.logprob)) for x, y in zip(a, b)) / len(a)


# ------------------------------------------------------------------ the audit
@dataclass
class AuditResult:
    passed: Optional[bool]  # None: no verdict (auditors disagree, reference failed, nothing to audit)
    failures: list[Failure] = field(default_factory=list)
    quality: Optional[float] = None  # 1..0 from the mean probability gap; None under quality_min_positions
    mean_prob_diff: Optional[float] = None
    positions: int = 0  # output tokens scored
    quality_positions: int = 0
    min_reference_logprob: Optional[float] = None
    outside_top_k: int = 0
    outside_allowance: float = 0.0  # failing needs more than this many outside the top-k
    greedy_mismatches: int = 0
    eos_avoided: int = 0
    disagreement: bool = False
    escalate: bool = False  # miner auditors saw what would be hard evidence: confirm on a canary
    auditor_verdicts: list[bool] = field(default_factory=list)  # per reference: passed (consensus audits)
    error: Optional[str] = None
    statistics: Optional["AuditStatistics"] = None
    replay: Optional[ReplayStatistics] = None  # a sampled answer of a k3-gumbel/1 miner, replayed on the reference

    @property
    def hard(self) -> bool:
        return any(f.hard for f in self.failures)


def outside_top_k_bound(top_logprobs: Sequence[float], k: int, temperature: float) -> float:
    """Upper bound on the chance that sampling at `temperature` picks a token outside the top-k,
    from the reference's top list (logprobs at temperature 1, best first). Exact at temperature 1;
    0 when greedy. Above temperature 1 nothing useful bounds it: 1."""
    if temperature <= 0:
        return 0.0
    if temperature > 1:
        return 1.0
    beta = 1.0 / temperature
    first, last = top_logprobs[0], top_logprobs[-1]
    rest = max(0.0, 1.0 - sum(math.exp(lp) for lp in top_logprobs))  # mass beyond the list
    weights = [math.exp(beta * (lp - first)) for lp in top_logprobs]
    # Each unseen token has p <= p_last, so sum(p^beta) over them <= p_last^(beta-1) * rest.
    tail = rest * math.exp((beta - 1.0) * last - beta * first)
    inside = sum(weights[:k])
    outside = sum(weights[k:]) + tail
    return outside / (inside + outside)


@dataclass
class AuditStatistics:
    """Every number the tier-1 rules look at, for one answer teacher-forced on one reference.

    Measured by `audit_statistics`; judged by `judge_statistics` (the rules) and, for comparison,
    `scoring.envelope.legacy_failures` (the rules before the honest-numerics envelope)."""

    positions: int
    temperature: float
    reference_probs: list[float]  # reference p of each output token
    min_reference_logprob: float
    min_at: int
    outside_top_k: int  # output tokens outside the reference top-k
    first_outside: Optional[int]
    outside_expected: float  # upper bound on the expected count for an honest sampler at this temperature
    greedy_gaps: list[float]  # temperature 0: reference top-1 logprob minus the chosen token's (>= 0)
    eos_ratio_count: int  # tokens chosen over an EOS more than eos_ratio times as likely (the old test)
    log_p_no_stop: float  # log of a lower bound on the chance an honest sampler never stops here (0 at T=0)
    surprisal_z: Optional[float]  # T > 0: standardised surprisal of the in-top-k choices (None: too few)
    surprisal_positions: int
    logprob_gap_mean: Optional[float]  # mean |miner logprob - reference logprob| of the chosen tokens
    logprob_gap_max: Optional[float]
    quality_diff: Optional[float]  # mean |p_miner - p_ref| over the quality sample
    quality_positions: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def gaps_over(self, margin: float) -> int:
        return sum(1 for g in self.greedy_gaps if g > margin)

    @property
    def max_greedy_gap(self) -> float:
        return max(self.greedy_gaps, default=0.0)


def _tempered_tail_bound(top: list[tuple[int, float]], beta: float) -> float:
    """Upper bound on sum(p^beta) over the tokens beyond the reference's top list (beta >= 1)."""
    rest = max(0.0, 1.0 - sum(math.exp(v) for _, v in top))
    return rest * math.exp((beta - 1.0) * top[-1][1])


def audit_statistics(tokens: Sequence[int], miner_logprobs: Sequence[float], temperature: float,
                     scores: Sequence[Any], stop_ids: frozenset, config: ScoringConfig,
                     sample: Sequence[int] = ()) -> AuditStatistics:
    """The statistics of one answer (tokens, the miner's raw logprobs of them, the request
    temperature) against one reference's teacher-forced scores of exactly those positions."""
    greedy = temperature == 0
    k = config.outside_top_k
    beta = 1.0 / temperature if temperature > 0 else math.inf
    min_lp, min_at = math.inf, -1
    outside, expected, eos_count = 0, 0.0, 0
    first_outside = None
    gaps: list[float] = []
    ref_probs: list[float] = []
    log_no_stop = 0.0
    z_sum = z_var = 0.0
    z_n = 0
    lp_gaps: list[float] = []
    for j, (token, scored) in enumerate(zip(tokens, scores)):
        lp = float(scored.logprob)
        top = _pairs(scored.top)
        ref_probs.append(math.exp(lp))
        if j < len(miner_logprobs) and miner_logprobs[j] is not None:
            lp_gaps.append(abs(float(miner_logprobs[j]) - lp))
        if lp < min_lp:
            min_lp, min_at = lp, j
        if not top:
            continue
        in_top = token in {t for t, _ in top[:k]}
        if not in_top:
            outside += 1
            first_outside = j if first_outside is None else first_outside
        expected += outside_top_k_bound([v for _, v in top], k, temperature)
        if greedy:
            gaps.append(max(0.0, top[0][1] - lp))
        if token not in stop_ids:
            eos_lp = max((v for t, v in top if t in stop_ids), default=None)
            if eos_lp is not None and eos_lp - lp > math.log(config.eos_ratio):
                eos_count += 1
            if eos_lp is not None and 0 < temperature <= 1:
                # chance an honest sampler at this temperature stops here, from below
                mass = sum(math.exp(beta * (v - top[0][1])) for _, v in top)
                tail = _tempered_tail_bound(top, beta) * math.exp(-beta * top[0][1])
                q_stop = math.exp(beta * (eos_lp - top[0][1])) / (mass + tail)
                log_no_stop += math.log1p(-min(q_stop, 1.0 - 1e-12))
        if temperature > 0 and token in {t for t, _ in top}:
            # surprisal of the choice among the listed tokens (exact for an honest sampler, given
            # that it picked one of them): -log c(token), with its mean and variance under c
            ws = [beta * (v - top[0][1]) for _, v in top]
            norm = math.log(sum(math.exp(w) for w in ws))
            logc = [w - norm for w in ws]
            c = [math.exp(x) for x in logc]
            mean = -sum(ci * li for ci, li in zip(c, logc))
            var = sum(ci * li * li for ci, li in zip(c, logc)) - mean * mean
            chosen = next(i for i, (t, _) in enumerate(top) if t == token)
            z_sum += -logc[chosen] - mean
            z_var += max(var, 0.0)
            z_n += 1
    z = z_sum / math.sqrt(z_var) if z_n >= config.surprisal_min_positions and z_var > 1e-9 else None
    diff = None
    if sample:
        diff = sum(abs(math.exp(miner_logprobs[j]) - ref_probs[j]) for j in sample) / len(sample)
    return AuditStatistics(
        positions=len(tokens), temperature=temperature, reference_probs=ref_probs, min_reference_logprob=min_lp,
        min_at=min_at, outside_top_k=outside, first_outside=first_outside, outside_expected=expected,
        greedy_gaps=gaps, eos_ratio_count=eos_count, log_p_no_stop=log_no_stop, surprisal_z=z,
        surprisal_positions=z_n, logprob_gap_mean=sum(lp_gaps) / len(lp_gaps) if lp_gaps else None,
        logprob_gap_max=max(lp_gaps, default=None), quality_diff=diff, quality_positions=len(sample))


def logprob_gap_bound(config: ScoringConfig, precision: Optional[str],
                      prompt_tokens: Optional[int]) -> tuple[float, str]:
    """The soft logprob-gap bound for a miner declaring `precision` on a prompt of `prompt_tokens`: the served
    model's measured envelope where it covers them (config.logprob_gap_envelope), else the wide bound; and
    where it comes from, for the failure's reason."""
    if config.logprob_gap_envelope is not None:
        bound = load_envelope(str(config.logprob_gap_envelope)).soft_bound(precision, prompt_tokens)
        if bound is not None and bound < config.logprob_gap_soft:
            return bound, (f"the envelope measured for this model in {precision_key(precision)} at "
                           f"{prompt_tokens}-token prompts: honest audits")
    return config.logprob_gap_soft, "honest numerics"


def judge_statistics(stats: AuditStatistics, config: ScoringConfig, trusted: bool,
                     exact: bool = False, precision: Optional[str] = None,
                     prompt_tokens: Optional[int] = None) -> list[Failure]:
    """The tier-1 rules (docs/verification.md). Every soft threshold sits outside what honest
    numerics produce (bf16/fp16, other kernels, batching, chunking, sharding: the envelope measured
    by benchmarks/verification.py); a failure is hard only when the reference is trusted (the
    validator's own engine) and the evidence is far outside that envelope, at any temperature.
    `exact`: the miner declared fp32 numerics (config.exact_precisions), whose envelope is far
    tighter; missing it is a soft failure only. `precision` (what the miner declared) and `prompt_tokens`
    pick the served model's measured logprob-gap bound when the config names an envelope file.
    With `config.statistical_checks` off (a model without a measured envelope) only the greedy check judges:
    the statistics are kept, their thresholds assume numerics nobody measured on this model."""
    failures: list[Failure] = []
    n = stats.positions

    def fail(check: str, reason: str, hard_evidence: bool) -> None:
        if check == "greedy_mismatch" or config.statistical_checks:
            failures.append(Failure(check, reason, hard=trusted and hard_evidence))

    # 1. the miner's own logprobs of its tokens against the reference's: same model, other
    #    numerics stays within a few hundredths of a nat; another model is off by tenths or more
    gap_soft, gap_source = (config.logprob_gap_soft, "honest numerics") if exact else logprob_gap_bound(
        config, precision, prompt_tokens)
    if stats.logprob_gap_mean is not None and stats.logprob_gap_mean > gap_soft:
        fail("logprob_gap", f"the miner's logprobs of its {n} tokens differ from the reference's by "
                            f"{stats.logprob_gap_mean:.3f} nats on average ({gap_source} stay under "
                            f"{gap_soft:g}; hard at {config.logprob_gap_hard:g})",
             stats.logprob_gap_mean > config.logprob_gap_hard)
    elif exact and stats.logprob_gap_mean is not None and stats.logprob_gap_mean > config.logprob_gap_soft_exact:
        fail("logprob_gap", f"the miner declares fp32, yet its logprobs of its {n} tokens differ from the "
                            f"reference's by {stats.logprob_gap_mean:.4f} nats on average (fp32 numerics stay under "
                            f"{config.logprob_gap_soft_exact:g}; a deployment that rounds more must declare its "
                            "precision)", False)
    # 2. greedy: each token must be the reference top-1 up to the honest flip margin
    if stats.greedy:
        over = stats.gaps_over(config.greedy_gap_soft)
        far = stats.gaps_over(config.greedy_gap_hard)
        if over > config.max_greedy_mismatches or far >= config.greedy_hard_count:
            fail("greedy_mismatch", f"temperature 0, yet {over} tokens trail the reference top-1 by more than "
                                    f"{config.greedy_gap_soft:g} nats ({far} by more than {config.greedy_gap_hard:g}; "
                                    f"largest {stats.max_greedy_gap:.2f})",
                 far >= config.greedy_hard_count)
    # 3. sampled: the choices must look like draws from the reference at this temperature
    z = stats.surprisal_z
    if z is not None and abs(z) > config.surprisal_z_soft:
        fail("surprisal", f"the sampled tokens' surprisal under the reference is {z:+.1f} standard deviations "
                          f"from an honest sampler's over {stats.surprisal_positions} tokens (allowed "
                          f"{config.surprisal_z_soft:g}; hard at {config.surprisal_z_hard:g})",
             abs(z) > config.surprisal_z_hard)
    allowance = config.max_outside_top_k
    if stats.temperature > 0 and config.outside_top_k_sampling_sigmas is not None:
        allowance += stats.outside_expected + config.outside_top_k_sampling_sigmas * math.sqrt(stats.outside_expected)
    if stats.outside_top_k > allowance:
        fail("outside_top_k", f"{stats.outside_top_k} of {n} tokens fall outside the reference top-"
                              f"{config.outside_top_k} (allowed {allowance:.1f}; first at {stats.first_outside})",
             stats.greedy and stats.outside_top_k > 2 * allowance)
    if stats.min_reference_logprob <= config.reference_logprob_floor and (stats.greedy or stats.temperature <= 1):
        fail("reference_logprob_floor", f"output token {stats.min_at} has reference logprob "
                                        f"{stats.min_reference_logprob:.2f} (floor {config.reference_logprob_floor})",
             stats.greedy)
    # 4. EOS avoidance: the chance an honest sampler at this temperature never stopped (greedy
    #    answers that skip a clear EOS already fail the greedy test)
    if stats.log_p_no_stop < math.log(config.eos_no_stop_p_soft):
        fail("eos_avoided", f"an honest sampler would have stopped with probability "
                            f"{-math.expm1(stats.log_p_no_stop):.6f} before the answer ended "
                            f"(allowed: not stopping has chance >= {config.eos_no_stop_p_soft:g})",
             stats.log_p_no_stop < math.log(config.eos_no_stop_p_hard))
    return failures


def _judge(result: GenerateResult, scores: Sequence[Any], config: ScoringConfig, stop_ids: frozenset,
           sample: list[int], trusted: bool, exact: bool = False, precision: Optional[str] = None,
           prompt_tokens: Optional[int] = None) -> tuple[AuditStatistics, list[Failure]]:
    stats = audit_statistics(result.token_ids, result.logprobs, result.request.temperature, scores, stop_ids,
                             config, sample)
    return stats, judge_statistics(stats, config, trusted, exact, precision, prompt_tokens)


def replay_key(result: GenerateResult, prompt_tokens: int) -> Optional[ReplayKey]:
    """What replays a sampled answer: the request's sampling and seed (the seed the miner reported when the
    request gave none); None for a greedy answer or one without a seed."""
    request, final = result.request, result.final
    seed = request.seed if request.seed is not None else (final.seed if final is not None else None)
    if request.temperature <= 0 or seed is None:
        return None
    return ReplayKey(SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k),
                     int(seed), prompt_tokens)


async def audit_tier1(prompt_ids: Sequence[int], result: GenerateResult, reference: Reference,
                      config: ScoringConfig = DEFAULT_CONFIG, *, stop_ids: Iterable[int],
                      rng: Optional[random.Random] = None, declared_precision: Optional[str] = None,
                      replay: bool = False) -> AuditResult:
    """Teacher-force prompt + the miner's output on `reference` and judge the output tokens.

    `prompt_ids` is what the miner had to condition on (`WorkItem.prompt_ids`): the whole
    prompt, so a miner that dropped part of the context is judged against all of it.
    `stop_ids` are the end-of-sequence ids (`tokenizer.stop_ids`) for the EOS-avoidance test.
    `declared_precision` (Capabilities.precision) picks the envelope the miner is judged by.
    `replay`: the miner declares the sampler k3-gumbel/1 and `reference` is an engine that replays sampled
    tokens while it scores them (`Engine.score(..., replay=ReplayKey)`, the validator's own): a sampled answer
    is also replayed token by token (scoring/replay.py).
    Reference failures (timeouts, errors) give `passed=None` with `error` set."""
    tokens = result.token_ids
    if not tokens:
        return AuditResult(passed=None, error="no output tokens to audit")
    if len(result.logprobs) != len(tokens):
        return AuditResult(passed=None, error="the output has no logprob per token")
    rng = rng or random.Random(secrets.randbits(64))
    stop_ids = frozenset(stop_ids)
    token_ids = list(prompt_ids) + tokens
    positions = list(range(len(prompt_ids), len(token_ids)))
    sample = []
    if len(tokens) >= config.quality_min_positions:
        sample = sorted(rng.sample(range(len(tokens)), min(config.quality_sample_positions, len(tokens))))
    references = reference.references if isinstance(reference, ConsensusReference) else [reference]
    key = replay_key(result, len(prompt_ids)) if replay and not isinstance(reference, ConsensusReference) else None
    try:
        if isinstance(reference, ConsensusReference):
            answers = await reference.score_each(token_ids, positions, config.audit_reference_top_k)
        elif key is not None:
            answers = [await reference.score(token_ids, positions, config.audit_reference_top_k, replay=key)]
        else:
            answers = [await reference.score(token_ids, positions, config.audit_reference_top_k)]
    except (MinerError, EngineError, ReferenceDisagreement, TimeoutError, ValueError) as error:
        # ValueError: the audit does not fit the reference's request limits (a ScoreRequest bound).
        return AuditResult(passed=None, error=f"reference failed: {error}")
    for answer in answers:
        if [int(s.position) for s in answer] != positions or [int(s.token_id) for s in answer] != tokens:
            return AuditResult(passed=None, error="the reference did not score exactly the output positions")
    # Miner auditors, one or two that agree, never confirm a hard failure: what would be hard on a
    # trusted reference is soft here and the audit asks for escalation (a canary, or the validator's own
    # engine) instead.
    trusted = all(getattr(ref, "trusted", True) for ref in references) and not isinstance(reference,
                                                                                         ConsensusReference)
    exact = declared_precision is not None and declared_precision.lower() in config.exact_precisions
    judged = [_judge(result, answer, config, stop_ids, sample, True, exact, declared_precision, len(prompt_ids))
              for answer in answers]
    first_stats, first_failures = judged[0]
    common = dict(positions=len(tokens), quality_positions=len(sample),
                  min_reference_logprob=first_stats.min_reference_logprob, outside_top_k=first_stats.outside_top_k,
                  outside_allowance=config.max_outside_top_k + (
                      first_stats.outside_expected + (config.outside_top_k_sampling_sigmas or 0.0)
                      * math.sqrt(first_stats.outside_expected) if first_stats.temperature > 0 else 0.0),
                  greedy_mismatches=first_stats.gaps_over(config.greedy_gap_soft),
                  eos_avoided=first_stats.eos_ratio_count, statistics=first_stats)
    common["auditor_verdicts"] = [not f for _, f in judged]
    if len(judged) > 1:
        verdicts = {bool(f) for _, f in judged}
        spread = max(sum(abs(a - b) for a, b in zip(first_stats.reference_probs, st.reference_probs)) / len(tokens)
                     for st, _ in judged[1:])
        if len(verdicts) > 1 or spread > config.auditor_disagreement_margin:
            return AuditResult(passed=None, disagreement=True, error=(
                f"auditors disagree (verdicts {sorted(verdicts)}, mean probability spread {spread:.3f})"), **common)
    escalate = False
    failures = first_failures
    if key is not None:
        replayed = ReplayStatistics.of([s.replayed for s in answers[0]], key.sampling.temperature)
        failures = failures + judge_replay(replayed, replay_rule(config, declared_precision), config, trusted=True)
        common["replay"] = replayed
    if not trusted and any(f.hard for f in failures):
        escalate = True
        failures = [Failure(f.check, f.reason + " (miner auditors: soft until a canary or a trusted reference "
                                                "confirms)", hard=False) for f in failures]
    diffs = [st.quality_diff for st, _ in judged if st.quality_diff is not None]
    diff = sum(diffs) / len(diffs) if diffs else None
    return AuditResult(
        passed=not failures, failures=failures, escalate=escalate,
        quality=None if diff is None else config.quality_from_margin(diff), mean_prob_diff=diff, **common)


__all__ = [
    "Reference", "MinerScoreReference", "ConsensusReference", "ReferenceDisagreement", "AuditResult",
    "AuditStatistics", "audit_statistics", "judge_statistics", "logprob_gap_bound", "outside_top_k_bound",
    "audit_tier1", "replay_key",
]
