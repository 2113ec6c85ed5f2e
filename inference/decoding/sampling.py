"""Per-request sampling: greedy, temperature, top-k, top-p, seeded, with top-k logprobs.

Reported logprobs are those of the model's raw distribution (log-softmax of the
logits, before temperature or filtering), which is what a teacher-forced audit
recomputes. Sampling uses the request's own `torch.Generator`, so a request's
tokens depend only on its seed and its logits, never on what it was batched with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
# Bounds of the sampling parameters (protocol/schemas.py states the same numbers on the wire; a test
# checks they agree). A temperature is 0 (greedy) or at least MIN_TEMPERATURE: below that, sampling is
# greedy in all but name, and tinier values only invite overflow. top_p below MIN_TOP_P keeps one token.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 2.0
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0  # how many top alternatives to report per token (0..20)
    ignore_eos: bool = False

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            out.append(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        t = self.temperature
        if not isinstance(t, (int, float)) or not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            out.append(f"temperature must be 0 (greedy) or lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                       f"(got {t!r})")
        if not isinstance(self.top_p, (int, float)) or not (MIN_TOP_P <= self.top_p <= 1.0):
            out.append(f"top_p must lie in [{MIN_TOP_P:g}, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            out.append(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (got {self.logprobs!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            out.append(f"seed must be an integer in [0, 2^64) (got {self.seed!r})")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            out.append("stop strings must be non-empty strings")
        return out


class SamplingFailure(ValueError):
    """The logits of one sequence cannot be sampled from (NaN or +inf): that sequence fails, not the batch."""


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # raw model logprob of the chosen token
    top: list[tuple[int, float]] = field(default_factory=list)  # raw top-k (id, logprob), best first


class TokenSampler:
    """Chooses tokens for one request; owns that request's random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator = torch.Generator().manual_seed(seed % (2**63))

    def choose(self, logits: torch.Tensor, logprobs: torch.Tensor | None = None) -> SampledToken:
        """`logits` [V] fp32; `logprobs` optionally precomputed log_softmax(logits)."""
        if logprobs is None:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        p = self.params
        if torch.isnan(logits).any() or torch.isposinf(logits).any():
            raise SamplingFailure("the model produced NaN or infinite logits")
        if p.temperature == 0.0:
            token = int(torch.argmax(logits))
        else:
            token = int(torch.multinomial(filtered_probs(logits, p), 1, generator=self.generator))
        top: list[tuple[int, float]] = []
        if p.logprobs:
            values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.numel()))
            top = [(int(i), float(v)) for i, v in zip(ids, values)]
        return SampledToken(token, float(logprobs[token]), top)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering.

    Safe for any temperature > 0 and top_p > 0 (subnormals included): the logits are shifted so the best
    is 0 and divided in float64, so every scaled value is 0 or negative (never an overflow to +inf, never
    NaN); the best token always keeps its mass, so the result is a distribution with at least one token."""
    logits = logits.double()
    best = logits.max()
    scaled = (logits - best) / float(p.temperature)  # <= 0 everywhere, exactly 0 at the best token
    if p.top_k and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop_sorted = (cumulative - sorted_probs) >= float(p.top_p)
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> int:
    """Index in `text` where the earliest stop string starts (searching from `search_from`), or -1."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
