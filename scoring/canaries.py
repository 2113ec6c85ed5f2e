"""Tier 2: canaries, prompts whose reference greedy continuation is known (docs/verification.md).

A `Canary` holds the prompt, the reference's greedy tokens, the top-1 vs top-2 margin at each of them and,
when known, the runner-up and the reference's logprob of each token. A `CanaryPool` hands each canary out
once (planned as a probe by scoring.workloads, sent as an escalation by scoring.audit_sequence, or scored
by a miner auditor as its own check); `check_tier2` judges a miner's greedy answer against one.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from protocol.client import GenerateResult

from .config import DEFAULT_CONFIG, ScoringConfig
from .failures import Failure


class CanaryPoolError(ValueError):
    """A canary pool file that cannot be used."""


@dataclass(frozen=True)
class Canary:
    canary_id: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]  # the reference's greedy continuation (shorter when it ended at EOS)
    margins: tuple[float, ...]  # reference top-1 minus top-2 logprob at each position
    runner_up_ids: Optional[tuple[int, ...]] = None  # reference top-2 at each position, when known
    logprobs: Optional[tuple[float, ...]] = None  # reference logprob of each greedy token, when known

    def __post_init__(self):
        if not self.prompt_ids or not self.tokens:
            raise CanaryPoolError(f"canary {self.canary_id}: prompt_ids and tokens must not be empty")
        if len(self.margins) != len(self.tokens):
            raise CanaryPoolError(f"canary {self.canary_id}: one margin per token is needed")
        if self.runner_up_ids is not None and len(self.runner_up_ids) != len(self.tokens):
            raise CanaryPoolError(f"canary {self.canary_id}: one runner-up id per token is needed")
        if self.logprobs is not None and (len(self.logprobs) != len(self.tokens)
                                          or any(not (lp <= 0.0) for lp in self.logprobs)):
            raise CanaryPoolError(f"canary {self.canary_id}: one logprob (<= 0) per token is needed")
        if any(not (m >= 0) for m in self.margins):
            raise CanaryPoolError(f"canary {self.canary_id}: margins must be non-negative numbers")


def canary_id_for(prompt_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


class CanaryPool:
    """Canaries, each used once. The pool file (JSON):

        {"format": "k3-canaries", "version": 1, "model_fingerprint": "...",
         "canaries": [{"id": "...", "prompt_ids": [...], "tokens": [...], "margins": [...],
                       "runner_up_ids": [...], "logprobs": [...]}]}   # runner_up_ids, logprobs optional

    Which canaries were used is the validator's state: persist `used` and pass it back in."""

    FORMAT = "k3-canaries"
    VERSION = 1

    def __init__(self, canaries: Iterable[Canary], used: Iterable[str] = (), model_fingerprint: str = ""):
        self.canaries: dict[str, Canary] = {}
        for canary in canaries:
            if canary.canary_id in self.canaries:
                raise CanaryPoolError(f"canary id {canary.canary_id} appears twice")
            self.canaries[canary.canary_id] = canary
        self.used: set[str] = set(used)
        self.model_fingerprint = model_fingerprint

    def __len__(self) -> int:
        return len(self.canaries)

    @property
    def remaining(self) -> int:
        return sum(1 for cid in self.canaries if cid not in self.used)

    def take(self, rng: random.Random, max_prompt_tokens: Optional[int] = None) -> Optional[Canary]:
        """A random unused canary whose prompt fits, now marked used; None when none is left."""
        choices = sorted(cid for cid, c in self.canaries.items() if cid not in self.used
                         and (max_prompt_tokens is None or len(c.prompt_ids) <= max_prompt_tokens))
        if not choices:
            return None
        chosen = rng.choice(choices)
        self.used.add(chosen)
        return self.canaries[chosen]

    def mark_used(self, canary_ids: Iterable[str]) -> None:
        self.used.update(canary_ids)

    # -------------------------------------------------------------- files
    def to_json(self) -> dict:
        return {
            "format": self.FORMAT, "version": self.VERSION, "model_fingerprint": self.model_fingerprint,
            "canaries": [
                {"id": c.canary_id, "prompt_ids": list(c.prompt_ids), "tokens": list(c.tokens),
                 "margins": list(c.margins),
                 **({"runner_up_ids": list(c.runner_up_ids)} if c.runner_up_ids is not None else {}),
                 **({"logprobs": list(c.logprobs)} if c.logprobs is not None else {})}
                for c in self.canaries.values()
            ],
        }

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def from_json(cls, data: Any, used: Iterable[str] = (), source: str = "pool") -> "CanaryPool":
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            raise CanaryPoolError(f"{source} is not a canary pool (expected format {cls.FORMAT!r})")
        if data.get("version") != cls.VERSION:
            raise CanaryPoolError(f"{source} has version {data.get('version')!r}; this validator reads {cls.VERSION}")
        entries = data.get("canaries")
        if not isinstance(entries, list):
            raise CanaryPoolError(f"{source} has no 'canaries' list")
        canaries = []
        for k, entry in enumerate(entries):
            try:
                runner_up, logprobs = entry.get("runner_up_ids"), entry.get("logprobs")
                canaries.append(Canary(
                    canary_id=str(entry["id"]),
                    prompt_ids=tuple(_ints(entry["prompt_ids"])),
                    tokens=tuple(_ints(entry["tokens"])),
                    margins=tuple(float(m) for m in entry["margins"]),
                    runner_up_ids=None if runner_up is None else tuple(_ints(runner_up)),
                    logprobs=None if logprobs is None else tuple(float(lp) for lp in logprobs),
                ))
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise CanaryPoolError(f"{source}: canary {k} is malformed: {error}") from None
        return cls(canaries, used, str(data.get("model_fingerprint", "")))

    @classmethod
    def from_file(cls, path: str | Path, used: Iterable[str] = ()) -> "CanaryPool":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CanaryPoolError(f"cannot read the canary pool {path}: {error}") from None
        return cls.from_json(data, used, source=str(path))

    @classmethod
    async def from_engine(cls, engine, prompts: Iterable[Sequence[int]], config: ScoringConfig = DEFAULT_CONFIG,
                          model_fingerprint: str = "") -> "CanaryPool":
        """Canaries computed by the validator's own reference engine (local testnet): the first
        `config.canary_tokens` greedy tokens of each prompt, with top-1/top-2 margins and the
        reference's logprob of each token (what an auditor checked on the canary must report)."""
        # the engine's types load torch; a pool read from a file (the validator's status, a CPU validator) needs none
        from inference.serving import GenerationRequest, SamplingParams, TokenEvent  # noqa: PLC0415

        async def one(prompt: Sequence[int]) -> Canary:
            params = SamplingParams(max_tokens=config.canary_tokens, temperature=0.0, logprobs=2)
            tokens, margins, runner_up, logprobs = [], [], [], []
            async for event in engine.generate(GenerationRequest(list(prompt), params)):
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                    logprobs.append(min(0.0, float(event.logprob)))
                    top = event.top_logprobs
                    margins.append(top[0][1] - top[1][1] if len(top) > 1 else math.inf)
                    runner_up.append(top[1][0] if len(top) > 1 else top[0][0])
            return Canary(canary_id_for(prompt), tuple(prompt), tuple(tokens), tuple(margins), tuple(runner_up),
                          tuple(logprobs))

        canaries = await asyncio.gather(*(one(p) for p in prompts))
        return cls(canaries, model_fingerprint=model_fingerprint)


def _ints(values) -> list[int]:
    out = [int(v) for v in values]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError("token ids must be non-negative integers")
    return out


@dataclass
class Tier2Result:
    passed: bool
    compared: int  # positions compared before a stop (end, near-tie divergence or mismatch)
    near_tie_at: Optional[int] = None  # the miner took another token at a near-tie here; rest not compared
    mismatch_at: Optional[int] = None
    failures: list[Failure] = field(default_factory=list)


def check_tier2(canary: Canary, result: GenerateResult, config: ScoringConfig = DEFAULT_CONFIG, *,
                exact: bool = False) -> Tier2Result:
    """The miner's greedy output must equal the canary's known continuation until the first place
    where honest numerics may take another token: where the reference's top-1 vs top-2 margin is
    under `greedy_gap_soft` (the flips of honest bf16, measured up to 5 nats on the random tiny
    model), or under `near_tie_margin` for a miner that declares fp32 (`exact`), and the miner took
    the runner-up (when the pool names it). After such a divergence the two continuations no longer
    share a prefix, so comparing stops there and the canary passes. Any other divergence fails;
    hard only where the reference's margin exceeds `greedy_gap_hard` (odds of e^6 against an honest
    flip), soft otherwise (it counts towards the audit failure rate)."""
    tokens = result.token_ids
    tolerance = config.near_tie_margin if exact else max(config.near_tie_margin, config.greedy_gap_soft)
    for i, want in enumerate(canary.tokens[: config.canary_tokens]):
        if i >= len(tokens):
            return Tier2Result(passed=True, compared=i)
        got = tokens[i]
        if got == want:
            continue
        margin = canary.margins[i]
        acceptable = canary.runner_up_ids is None or got == canary.runner_up_ids[i]
        if margin < tolerance and acceptable:
            return Tier2Result(passed=True, compared=i, near_tie_at=i)
        hard = margin > config.greedy_gap_hard
        reason = (f"canary {canary.canary_id}: token {i} is {got}, the reference's greedy token is {want} "
                  f"(margin {margin:.3f}; honest {'fp32' if exact else 'numerics'} may differ under {tolerance:g}"
                  f"{'' if acceptable else ', and only to the runner-up'}; hard over {config.greedy_gap_hard:g})")
        return Tier2Result(passed=False, compared=i, mismatch_at=i,
                           failures=[Failure("canary_mismatch", reason, hard=hard)])
    return Tier2Result(passed=True, compared=min(len(canary.tokens), config.canary_tokens, len(tokens)))


__all__ = ["Canary", "CanaryPool", "CanaryPoolError", "canary_id_for", "Tier2Result", "check_tier2"]
