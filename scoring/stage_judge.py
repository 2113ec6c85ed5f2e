"""The stage judge: when the evidence a stage has given over time makes it certain that it does not compute its
block in the numerics it declares.

A *check* is one session of one stage re-run on the validator's reference of its block (scoring.stage_checks
`recheck_opened`): per token the relative L2 distance of its output state from the reference's (per emitted
token the logprob difference, for a head). Honest numerics other than the reference's (bf16, fp16, sharded,
other thread counts) move every token a little and a few tokens a lot (a router near-tie flips an expert), so
no single token, and no single check, condemns a stage. What a check contributes is whether it lies *outside
the honest envelope of its numerics*: its median distance above the largest median honest checks showed, or more
of its tokens far off than honest checks ever had (`NumericsEnvelope.outside`). The envelope is measured on
honest stages (benchmarks/stage_envelope.py) and kept with the model's envelope file (`stages` section);
half of the honest checks set the bounds, the other half count how often an honest check still falls outside
them, and the 95% upper bound of that rate is `p_outside`.

The verdict over a stage's window of checks is a binomial test: with k of its n checks outside, the chance that
an honest stage (each check outside with probability p_outside at most) shows k or more is
binomial_tail(n, k, p_outside); the stage is blamed when that chance is below `alpha`. A cheat that lies on
every check is blamed after a handful (3 when p_outside is 0.15%), one that lies on a fraction of its sessions,
or a little on every token, after more, and an honest stage essentially never: with `alpha` = 1e-7 and at most
1,000 checks of one stage a day, under one honest stage in 10^4 is blamed per day (a union bound over the day's
evaluations).

Exact failures (a malformed output, a changed pass-through, bytes that do not hash to what the stage signed, an
output replayed for another input) need no statistics and are judged where they are found. A model without a
measured stage envelope gets no statistical verdict at all: its stages are held to the exact checks only.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from .model_envelope import _binomial_upper_bound, binomial_tail
from .stage_checks import Comparison

STAGE_SECTION_VERSION = 1
MARGIN = 2.0  # a bound is this times the worst honest check that set it
# the least a median bound may be, per numerics: reductions in another order (other thread counts, GPU kernels,
# another batch) move honest outputs by a few ulps of the dtype even where the measured ones matched bit for bit
MEDIAN_FLOOR = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 5e-3}
MIN_BAD = 2  # a check with fewer far-off tokens than this is never outside on their count
ALPHA = 1e-7  # blame when an honest stage would show the window's outside checks with less chance than this
MIN_TOKENS = 4  # checks shorter than this say too little to count either way


@dataclass(frozen=True)
class CheckStats:
    """The summary of one check that the judge and the store keep."""

    tokens: int
    bad: int
    median: float
    q90: float
    worst: float

    @classmethod
    def of(cls, c: Comparison) -> "CheckStats":
        d = np.asarray(c.rel_l2, dtype=np.float64)
        if d.size == 0:
            return cls(0, 0, 0.0, 0.0, 0.0)
        return cls(int(d.size), int(sum(bool(b) for b in c.bad)), float(np.median(d)), float(np.quantile(d, 0.9)),
                   float(d.max()))

    @property
    def bad_fraction(self) -> float:
        return self.bad / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class NumericsEnvelope:
    """The honest bounds of one numerics ("float32", "bfloat16", "float16") and kind of stage ("state": a block
    that sends a state on; "head": the last block, judged by its answers' logprobs)."""

    numerics: str
    kind: str
    max_median: float
    max_bad_fraction: float
    checks: int  # honest checks that set the bounds
    heldout: int  # honest checks held out
    heldout_outside: int  # of which outside the bounds
    p_outside: float  # 95% upper bound of an honest check's chance to fall outside

    def outside(self, stats: CheckStats) -> Optional[str]:
        """Why this check lies outside the honest envelope, or None."""
        if stats.tokens < MIN_TOKENS:
            return None
        if stats.median > self.max_median:
            return (f"median distance {stats.median:.3g} over {stats.tokens} tokens, honest {self.numerics} "
                    f"checks stay under {self.max_median:.3g}")
        if stats.bad >= MIN_BAD and stats.bad_fraction > self.max_bad_fraction:
            return (f"{stats.bad} of {stats.tokens} tokens far off ({stats.bad_fraction:.1%}), honest "
                    f"{self.numerics} checks stay under {self.max_bad_fraction:.1%}")
        return None

    def to_json(self) -> dict:
        return asdict(self)


def derive_envelope(numerics: str, kind: str, stats: Sequence[CheckStats], margin: float = MARGIN) -> NumericsEnvelope:
    """Bounds from every other honest check (margin x the worst of them, the median bound at least the
    numerics' floor), counted on the rest."""
    usable = [s for s in stats if s.tokens >= MIN_TOKENS]
    setting, heldout = usable[0::2], usable[1::2]
    if not setting:
        raise ValueError(f"no honest {numerics} {kind} checks of {MIN_TOKENS}+ tokens to set bounds from")
    max_median = max(margin * max(s.median for s in setting), MEDIAN_FLOOR.get(numerics, 0.0))
    max_bad = min(1.0, margin * max(s.bad_fraction for s in setting if s.bad >= MIN_BAD)) \
        if any(s.bad >= MIN_BAD for s in setting) else 0.0
    draft = NumericsEnvelope(numerics, kind, max_median, max_bad, len(setting), len(heldout), 0, 1.0)
    outside = sum(1 for s in heldout if draft.outside(s))
    p = _binomial_upper_bound(outside, len(heldout), 0.05) if heldout else 1.0
    return NumericsEnvelope(numerics, kind, max_median, max_bad, len(setting), len(heldout), outside, p)


@dataclass(frozen=True)
class StageVerdict:
    blame: bool
    outside: int
    checks: int
    chance: float  # binomial_tail(checks, outside, p_outside): how likely an honest stage shows this
    reason: str = ""


def verdict(outcomes: Sequence[Optional[str]], envelope: NumericsEnvelope, alpha: float = ALPHA) -> StageVerdict:
    """The sequential test over a stage's window of checks (`outcomes`: each check's reason for lying outside,
    None when inside)."""
    n = len(outcomes)
    reasons = [r for r in outcomes if r]
    k = len(reasons)
    chance = binomial_tail(n, k, envelope.p_outside) if k else 1.0
    if k and chance < alpha:
        return StageVerdict(True, k, n, chance, f"{k} of its last {n} checks lie outside the honest {envelope.numerics} "
                                           f"envelope (an honest stage: chance {chance:.1e}); latest: {reasons[-1]}")
    return StageVerdict(False, k, n, chance)


# ------------------------------------------------------------------ the envelope file's `stages` section
def stage_envelope_section(envelopes: Iterable[NumericsEnvelope], command: str = "") -> dict:
    out: dict = {"version": STAGE_SECTION_VERSION, "margin": MARGIN, "min_tokens": MIN_TOKENS, "min_bad": MIN_BAD,
                 "measured": time.strftime("%Y-%m-%d"), "command": command, "numerics": {}}
    for e in envelopes:
        out["numerics"].setdefault(e.numerics, {})[e.kind] = e.to_json()
    return out


def write_stage_section(path: Path, section: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data["stages"] = section
    path.write_text(json.dumps(data, indent=1) + "\n")


class StageEnvelopeError(ValueError):
    pass


def parse_stage_section(section: dict, source: str = "envelope") -> dict[tuple[str, str], NumericsEnvelope]:
    """(numerics, kind) -> bounds, from a model envelope file's `stages` section."""
    if not isinstance(section, dict) or section.get("version") != STAGE_SECTION_VERSION:
        raise StageEnvelopeError(f"{source}: stages section of another version than {STAGE_SECTION_VERSION}")
    out = {}
    try:
        for numerics, kinds in section["numerics"].items():
            for kind, e in kinds.items():
                env = NumericsEnvelope(**e)
                if (env.numerics, env.kind) != (numerics, kind) or not 0 < env.p_outside <= 1 \
                        or not math.isfinite(env.max_median) or env.max_median <= 0:
                    raise StageEnvelopeError(f"{source}: stages.numerics.{numerics}.{kind} is inconsistent")
                out[(numerics, kind)] = env
    except (KeyError, TypeError) as e:
        raise StageEnvelopeError(f"{source}: malformed stages section ({e})") from None
    return out


def load_stage_envelopes(path: str) -> Optional[dict[tuple[str, str], NumericsEnvelope]]:
    """The `stages` section of a model envelope file (None when the file has none: the model's stage outputs
    were never measured, and only exact checks apply). StageEnvelopeError for a file that cannot be used."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise StageEnvelopeError(f"{path}: {e}") from None
    section = data.get("stages") if isinstance(data, dict) else None
    return parse_stage_section(section, path) if section is not None else None


__all__ = ["ALPHA", "CheckStats", "MARGIN", "NumericsEnvelope", "StageEnvelopeError", "StageVerdict", "derive_envelope",
           "load_stage_envelopes", "parse_stage_section", "stage_envelope_section", "verdict", "write_stage_section"]
