"""The honest-numerics envelope measured for one model, as the logprob-gap bounds a validator judges by.

The wide bound of `ScoringConfig.logprob_gap_soft` (0.75 nats) was set on the random tiny model, whose flat
distributions move by up to 0.51 nats in honest bf16. A trained model moves far less (about 0.05 nats), so a
bf16 miner that also halves its experts or truncates the context sits inside the wide bound. The bounds here
are measured for the served model by `benchmarks/verification.py --write-envelope FILE` (honest variants
only) and set with `ScoringConfig(logprob_gap_envelope=FILE)` (or `--scoring-overrides
'{"logprob_gap_envelope": "FILE"}'`):

    {"format": "k3-model-envelope", "version": 1, "checkpoint": ..., "fingerprint": ..., "margin": 1.5,
     "precisions": {"bf16": {"variants": [...], "audits": 750, "worst": 0.0547,
                             "bins": [{"prompt_tokens": [5, 60], "audits": 640, "p99": 0.031, "worst": 0.0547,
                                       "soft": 0.082, "false_positive_rate_95": 0.0047}, ...]}}}

A file may also record how often the model answers the validator's answer probes (greedy, at the measured prompt
lengths, in each honest variant), written by `benchmarks/tiny_model.py --write-probes FILE`:

    "probes": {"planted_fact": {"prompt_tokens": [16, 256], "variants": {"fp32": [97, 100], "bf16": [96, 100]}}}

("prompt_tokens": the range of chat prompt sizes the probes were drawn from, ScoringConfig.chat_prompt_tokens.)
A validator scores a probe kind (`ScoringConfig.probes_scored`) when every measured variant answered at least
PROBE_MIN_PASS of its probes and its own prompt range lies within the measured one: a model that answers them is
held to answering them. Its misses are then judged against the 95% upper bound of the measured miss rate
(ScoringConfig.probe_miss_rate, scoring/rewards.py).

A file may also record the replay of sampled answers (scoring/replay.py: a miner declaring the sampler
k3-gumbel/1 is replayed token by token), written by `benchmarks/verification.py --write-replay FILE`, a section
with a version of its own:

    "replay": {"version": 1, "sampler": "k3-gumbel/1", "margin": 1.5, "min_delta": 0.001,
               "precisions": {"bf16": {"variants": [...], "answers": 400, "positions": 9000, "mismatches": 31,
                                       "worst_gap": 0.043, "delta": 0.0645, "beyond_delta": 0,
                                       "near_ties": 52, "rate_95": 0.00033}}}

Per declared precision (fp32 included): `delta`, the near-tie allowance in nats of logit, is `margin` times the
worst gap by which an honest sampled token trailed the replayed one (at least `min_delta`); `rate_95` is the 95%
upper bound of the share of honest sampled tokens beyond it (none of `positions` were: about 3 / positions).
`near_ties`: honest tokens whose replay had a best-vs-second margin under `delta`, where another token is
excused. A precision the section does not cover is replayed with the validator's conservative values.

A bin covers the prompt lengths (in tokens) its honest audits had; its soft bound is `margin` times the worst
mean |miner logprob - reference logprob| of those audits. With none of n honest audits over the worst, the
chance that an honest audit of those variants exceeds the bound is under 3/n at 95% confidence (the rule of
three; `false_positive_rate_95`). A prompt between two bins gets the larger of their bounds; a precision the
file does not cover, or a prompt longer than any measured, gets the wide bound (what was not measured is not
tightened).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

FORMAT = "k3-model-envelope"
SCORABLE_PROBES = ("copy", "planted_fact")  # answer probes with a right answer to check
HONEST_PROBE_MISS_RATE = 0.1  # a probe kind is scored only for a model measured to answer at least 1 - this
VERSION = 1
MARGIN = 1.5  # soft bound = this x the worst honest audit of the bin
REPLAY_VERSION = 1  # of the "replay" section
REPLAY_SAMPLER = "k3-gumbel/1"  # the sampler the section measured (inference.decoding.sampling.SAMPLER)
REPLAY_MIN_DELTA = 1e-3  # nats of logit: the smallest near-tie allowance, whatever the measured worst gap
MIN_BIN_AUDITS = 50  # a prompt class with fewer honest audits is not tightened (3/n would say little)
PROBE_MIN_PASS = 1.0 - HONEST_PROBE_MISS_RATE  # a probe kind the model answers this often, in every honest
# variant measured, is scored
PROBE_MIN_COUNT = 50  # ...over at least this many probes of each variant

_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8", "fp8_e4m3": "fp8",
            "float8_e4m3fn": "fp8", "e4m3": "fp8", "float32": "fp32"}


class ModelEnvelopeError(ValueError):
    """An envelope file that cannot be read or does not have the expected form."""


def precision_key(precision: Optional[str]) -> Optional[str]:
    """A declared precision (Capabilities.precision) as the file's key: "bfloat16" -> "bf16"."""
    if not precision:
        return None
    p = precision.strip().lower()
    return _ALIASES.get(p, p)


@dataclass(frozen=True)
class GapBin:
    low: int  # prompt tokens, inclusive
    high: int
    soft: float
    audits: int
    worst: float


@dataclass(frozen=True)
class ProbeRecord:
    kind: str  # "copy" or "planted_fact"
    low: int  # the range of prompt sizes (ScoringConfig.chat_prompt_tokens) the probes were drawn from
    high: int
    passed: dict  # honest variant -> (answered right, probes)

    def answered(self, prompt_tokens: tuple[int, int], min_pass: float = PROBE_MIN_PASS,
                 min_count: int = PROBE_MIN_COUNT) -> bool:
        """Every variant answered at least `min_pass` of at least `min_count` probes, drawn from sizes that
        cover the validator's `prompt_tokens` range (a model measured on short prompts says nothing of long)."""
        return (bool(self.passed) and self.low <= prompt_tokens[0] and prompt_tokens[1] <= self.high
                and all(n >= min_count and ok >= min_pass * n for ok, n in self.passed.values()))

    def miss_rate_bound(self, confidence: float = 0.95) -> float:
        """The most an honest miner of this model misses, at `confidence`: the largest one-sided Clopper-Pearson
        upper bound of the miss rate over the measured variants (91 of 100 answered: 0.152)."""
        return max(_binomial_upper_bound(n - ok, n, 1.0 - confidence) for ok, n in self.passed.values())


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (n of tens of thousands, tails down to 1e-300)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0

    def term(i: int) -> float:
        return math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                        + i * math.log(p) + (n - i) * math.log1p(-p))

    if k <= n * p:  # the tail holds most of the mass: one minus the (shorter) head
        return min(1.0, max(0.0, 1.0 - sum(term(i) for i in range(k))))
    total = 0.0
    for i in range(k, n + 1):  # past the mode the terms only shrink
        t = term(i)
        total += t
        if t <= total * 1e-17:
            break
    return min(1.0, total)


def _binomial_upper_bound(k: int, n: int, alpha: float) -> float:
    """The p at which P(X <= k | n, p) = alpha (by bisection): the one-sided upper confidence bound of a rate."""
    if k >= n:
        return 1.0
    low, high = k / n, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if 1.0 - binomial_tail(n, k + 1, mid) > alpha else (low, mid)
    return high


@dataclass(frozen=True)
class ReplayRecord:
    """The replay of one declared precision's honest sampled answers (the file's "replay" section)."""

    precision: str
    delta: float  # near-tie allowance, nats of logit
    rate_95: float  # 95% upper bound of the share of honest sampled tokens beyond delta
    positions: int
    worst_gap: float


@dataclass(frozen=True)
class ModelEnvelope:
    checkpoint: str
    fingerprint: Optional[str]
    bins: dict  # precision key -> tuple[GapBin, ...] sorted by prompt length
    probes: dict = field(default_factory=dict)  # probe kind -> ProbeRecord
    replay: dict = field(default_factory=dict)  # precision key -> ReplayRecord

    def answered_probes(self, prompt_tokens: tuple[int, int]) -> tuple[str, ...]:
        """The probe kinds this model was measured to answer at prompts of these sizes (ProbeRecord.answered)."""
        return tuple(sorted(kind for kind, record in self.probes.items() if record.answered(prompt_tokens)))

    def probe_miss_rate(self, prompt_tokens: tuple[int, int]) -> Optional[float]:
        """The miss rate an honest miner stays under (95%) on the kinds answered at these sizes; None: none is."""
        bounds = [self.probes[kind].miss_rate_bound() for kind in self.answered_probes(prompt_tokens)]
        return max(bounds) if bounds else None

    def soft_bound(self, precision: Optional[str], prompt_tokens: Optional[int]) -> Optional[float]:
        """The measured soft logprob-gap bound for this precision and prompt length; None where the file
        does not cover them (then the wide `logprob_gap_soft` applies)."""
        bins = self.bins.get(precision_key(precision) or "")
        if not bins or prompt_tokens is None:
            return None
        for i, b in enumerate(bins):
            if b.low <= prompt_tokens <= b.high:
                return b.soft
            if prompt_tokens < b.low:
                return max(b.soft, bins[i - 1].soft) if i else None
        return None  # longer than anything measured


def build_envelope(rows: Sequence[tuple[str, str, bool, int, float]], *, checkpoint: str,
                   fingerprint: Optional[str] = None, margin: float = MARGIN,
                   min_audits: int = MIN_BIN_AUDITS) -> dict:
    """The envelope file's content from honest audits: rows of (variant, precision, long, prompt tokens,
    logprob gap). Short and long prompts form separate bins (the bench's two prompt classes); a class with
    fewer than `min_audits` audits gets no bin (its prompt lengths keep the wide bound)."""
    out: dict = {"format": FORMAT, "version": VERSION, "checkpoint": checkpoint, "fingerprint": fingerprint,
                 "margin": margin, "precisions": {}}
    keys = sorted({precision_key(p) for _, p, _, _, _ in rows} - {None, "fp32"})
    for key in keys:
        mine = [r for r in rows if precision_key(r[1]) == key]
        gaps = sorted(r[4] for r in mine)
        bins = []
        for long in (False, True):
            part = [r for r in mine if r[2] == long]
            if len(part) < max(1, min_audits):
                continue
            g = sorted(r[4] for r in part)
            bins.append({"prompt_tokens": [min(r[3] for r in part), max(r[3] for r in part)], "audits": len(part),
                         "p50": round(g[len(g) // 2], 5), "p99": round(g[min(len(g) - 1, int(0.99 * len(g)))], 5),
                         "worst": round(g[-1], 5), "soft": round(margin * g[-1], 4),
                         "false_positive_rate_95": round(3 / len(part), 5)})
        if len(bins) == 2 and bins[0]["prompt_tokens"][1] >= bins[1]["prompt_tokens"][0]:
            bins = [{**bins[0], "prompt_tokens": [bins[0]["prompt_tokens"][0], bins[1]["prompt_tokens"][1]],
                     "audits": len(mine), "worst": round(gaps[-1], 5), "soft": round(margin * gaps[-1], 4),
                     "false_positive_rate_95": round(3 / len(mine), 5)}]  # overlapping classes: one bin
        if not bins:
            continue
        out["precisions"][key] = {"variants": sorted({r[0] for r in mine}), "audits": len(mine),
                                  "worst": round(gaps[-1], 5), "bins": bins}
    return out


def parse_envelope(data: dict, source: str = "envelope") -> ModelEnvelope:
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ModelEnvelopeError(f"{source}: not a {FORMAT} version {VERSION} file")
    bins = {}
    try:
        for key, entry in data["precisions"].items():
            parsed = sorted((GapBin(int(b["prompt_tokens"][0]), int(b["prompt_tokens"][1]), float(b["soft"]),
                                    int(b["audits"]), float(b["worst"])) for b in entry["bins"]),
                            key=lambda b: b.low)
            for b in parsed:
                if not (0 <= b.low <= b.high and b.soft > 0 and b.audits > 0):
                    raise ModelEnvelopeError(f"{source}: precision {key!r} has a bad bin {b}")
            bins[precision_key(key)] = tuple(parsed)
    except (KeyError, TypeError, IndexError, ValueError) as error:
        if isinstance(error, ModelEnvelopeError):
            raise
        raise ModelEnvelopeError(f"{source}: malformed ({type(error).__name__}: {error})") from None
    return ModelEnvelope(str(data.get("checkpoint", "")), data.get("fingerprint"), bins,
                         _parse_probes(data.get("probes", {}), source), _parse_replay(data.get("replay"), source))


def _parse_replay(data, source: str) -> dict:
    if data is None:
        return {}
    found = (data.get("version"), data.get("sampler")) if isinstance(data, dict) else (None, None)
    if found != (REPLAY_VERSION, REPLAY_SAMPLER):
        raise ModelEnvelopeError(f"{source}: the replay section is not version {REPLAY_VERSION} of {REPLAY_SAMPLER} "
                                 f"(got version {found[0]!r} of {found[1]!r})")
    out = {}
    try:
        for key, entry in data["precisions"].items():
            record = ReplayRecord(precision_key(key), float(entry["delta"]), float(entry["rate_95"]),
                                  int(entry["positions"]), float(entry["worst_gap"]))
            if not (record.delta > 0 and 0 < record.rate_95 <= 1 and record.positions > 0):
                raise ModelEnvelopeError(f"{source}: replay of {key!r} needs delta > 0, rate_95 in (0, 1] and "
                                         f"positions > 0: {record}")
            out[record.precision] = record
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        if isinstance(error, ModelEnvelopeError):
            raise
        raise ModelEnvelopeError(f"{source}: malformed replay ({type(error).__name__}: {error})") from None
    return out


def build_replay(rows: Sequence[tuple[str, str, int, int, Sequence[float], Sequence[float]]],
                 margin: float = MARGIN, min_delta: float = REPLAY_MIN_DELTA) -> dict:
    """The "replay" section from honest replays: rows of (variant, declared precision, answers, sampled
    positions, the gaps of the mismatched tokens, the replay margins of every position), any number of rows per
    variant. Per precision, delta = max(margin x worst gap, min_delta), and the 95% bound of the rate beyond it."""
    out: dict = {"version": REPLAY_VERSION, "sampler": REPLAY_SAMPLER, "margin": margin, "min_delta": min_delta,
                 "precisions": {}}
    for key in sorted({precision_key(r[1]) for r in rows} - {None}):
        mine = [r for r in rows if precision_key(r[1]) == key]
        positions = sum(r[3] for r in mine)
        if not positions:
            continue
        gaps = [g for r in mine for g in r[4] if g > 0.0]
        finite = [g for g in gaps if math.isfinite(g)]
        worst = max(finite, default=0.0)
        delta = max(margin * worst, min_delta)
        beyond = sum(1 for g in gaps if g >= delta)  # 0 unless a token was not allowed at all (an infinite gap)
        out["precisions"][key] = {
            "variants": sorted({r[0] for r in mine}), "answers": sum(r[2] for r in mine), "positions": positions,
            "mismatches": len(gaps), "worst_gap": round(worst, 6), "delta": round(delta, 6), "beyond_delta": beyond,
            "near_ties": sum(1 for r in mine for m in r[5] if m < delta),
            "rate_95": round(_binomial_upper_bound(beyond, positions, 0.05), 8)}
    return out


def with_replay(data: dict, replay: dict) -> dict:
    """`data` (an envelope file's content) with its "replay" section set to `replay` (build_replay)."""
    _parse_replay(replay, "the replay section")
    return {**data, "replay": replay}


def _parse_probes(data, source: str) -> dict:
    out = {}
    try:
        for kind, entry in data.items():
            if kind not in SCORABLE_PROBES:
                raise ModelEnvelopeError(f"{source}: unknown probe kind {kind!r} (known: {list(SCORABLE_PROBES)})")
            passed = {str(v): (int(ok), int(n)) for v, (ok, n) in entry["variants"].items()}
            if any(not 0 <= ok <= n for ok, n in passed.values()):
                raise ModelEnvelopeError(f"{source}: probe kind {kind!r} has counts outside 0..probes: {passed}")
            low, high = (int(x) for x in entry["prompt_tokens"])
            out[kind] = ProbeRecord(kind, low, high, passed)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        if isinstance(error, ModelEnvelopeError):
            raise
        raise ModelEnvelopeError(f"{source}: malformed probes ({type(error).__name__}: {error})") from None
    return out


def with_probes(data: dict, kind: str, prompt_tokens: tuple[int, int], passed: dict) -> dict:
    """`data` (an envelope file's content) with the probe record of `kind` set: passed = {variant: (ok, n)}."""
    if kind not in SCORABLE_PROBES:
        raise ModelEnvelopeError(f"unknown probe kind {kind!r} (known: {list(SCORABLE_PROBES)})")
    probes = dict(data.get("probes", {}))
    probes[kind] = {"prompt_tokens": [int(prompt_tokens[0]), int(prompt_tokens[1])],
                    "variants": {v: [int(ok), int(n)] for v, (ok, n) in passed.items()}}
    return {**data, "probes": probes}


@functools.lru_cache(maxsize=8)
def load_envelope(path: str) -> ModelEnvelope:
    """The envelope file at `path` (read once per path)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ModelEnvelopeError(f"cannot read the envelope file {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ModelEnvelopeError(f"the envelope file {path} is not JSON: {error}") from None
    return parse_envelope(data, path)


__all__ = ["ModelEnvelope", "ModelEnvelopeError", "GapBin", "ProbeRecord", "build_envelope", "parse_envelope",
           "load_envelope", "with_probes", "precision_key", "MARGIN", "MIN_BIN_AUDITS", "PROBE_MIN_PASS",
           "ReplayRecord", "build_replay", "with_replay", "REPLAY_VERSION", "REPLAY_MIN_DELTA",
           "PROBE_MIN_COUNT"]


SHIPPED = Path(__file__).resolve().parent / "envelopes"  # envelopes measured for models the project ships


def shipped_envelope(model_fingerprint: str, directory: Path = SHIPPED) -> Optional[Path]:
    """The shipped envelope file measured on the model with this fingerprint, if there is one."""
    for path in sorted(directory.glob("*.json")):
        try:
            if load_envelope(str(path)).fingerprint == model_fingerprint:
                return path
        except ModelEnvelopeError:
            continue
    return None
