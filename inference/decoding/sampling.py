"""Per-request sampling: greedy, temperature, top-k, top-p, with top-k logprobs, under the protocol's
replayable sampler `k3-gumbel/1`.

Reported logprobs are those of the model's raw distribution (log-softmax of the logits, before temperature
or filtering), which is what a teacher-forced audit recomputes.

The sampler k3-gumbel/1 (the protocol's definition; a validator replays it)
--------------------------------------------------------------------------
A sampled token is the Gumbel-max draw

    token(i) = argmax over allowed v of  (l_v - max_w l_w) / T + g(seed, i, v)

where l is the model's fp32 logits row for the token at generated-token index i (0 for the first token of
the completion), T the request's temperature, and g Gumbel noise from a counter-based generator keyed by
(request seed, i, token id) -- never by what came before, what else was batched, or how many tokens a
speculative step emitted. Because argmax(l/T + g) with g i.i.d. Gumbel(0, 1) is a draw from softmax(l/T),
this is ordinary temperature sampling; because g is a pure function of its key, anyone with the logits and
the seed can replay the draw.

- allowed: every token when top_k = 0 and top_p = 1; otherwise the support of the top-k then top-p filter
  (`filtered_probs`). The scaled logits (l_v - max l) / T are computed in float64.
- g(seed, i, v), seed in [0, 2^64), i in [0, 2^32), v in [0, 2^32): with mix32 the 32-bit avalanche hash
  ("lowbias32": x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, all mod 2^32),
      key = mix32(mix32(mix32(seed_hi ^ 0x6b336775) ^ seed_lo) ^ i)     (seed_hi, seed_lo: its 32-bit halves)
      a   = mix32(mix32(key ^ v))
      b   = mix32((a + 0x9e3779b9) mod 2^32)
      n   = a * 2^20 + (b >> 12)                                        (52 bits)
      u   = (2n + 1) / 2^53                                             (in (0, 1), exact in float64)
      g   = -ln(-ln u)                                                  (float64)
  The integers are exact everywhere (Python ints, int64 tensors on CPU or CUDA, int64 numpy arrays: every
  product is split so that nothing exceeds 2^49); g agrees across libraries to float64 rounding (~1e-15).
- ties: the lowest token id wins (torch.argmax). Greedy (T = 0) is argmax of the logits, no noise.

Every request has a seed: its own, or one the engine draws and reports in its final event (and the miner in
its signed final message), so every answer can be replayed. Speculative decoding under this sampler accepts a
draft exactly when it equals the token the sampler picks at its index (inference.decoding.acceptance), so its
output is token for token that of plain decoding with the same seed.
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

SAMPLER = "k3-gumbel/1"  # the replayable sampler this package's engines run (Capabilities.sampler)
ENGINE_SAMPLER = "engine"  # a remote engine's own sampler (vLLM, SGLang): seeded, but not replayable
SAMPLERS = (SAMPLER, ENGINE_SAMPLER)


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


# ------------------------------------------------------------------ k3-gumbel/1 (the module docstring is the spec)
_M32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B
_SEED_KEY = 0x6B336775  # "k3gu"
_GOLDEN = 0x9E3779B9


def _mul32(x, c: int):
    """x * c mod 2^32 for x < 2^32, with no intermediate above 2^49 (int64 tensors and arrays do not overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """The 32-bit avalanche hash (lowbias32) on a Python int, an int64 tensor or an int64 numpy array."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def index_key(seed: int, index: int) -> int:
    """The generator's 32-bit key for one generated-token index of a request."""
    if not 0 <= seed < 2**64 or not 0 <= index < 2**32:
        raise ValueError(f"k3-gumbel/1 needs a seed in [0, 2^64) and an index in [0, 2^32) (got {seed}, {index})")
    return mix32(mix32(mix32((seed >> 32) ^ _SEED_KEY) ^ (seed & _M32)) ^ index)


def uniform_numerator(key, token_ids):
    """2n + 1 for each token id (int64 tensor or array) under a key, n the 52-bit hash: u = (2n + 1) / 2^53."""
    a = mix32(mix32(token_ids ^ key))
    b = mix32((a + _GOLDEN) & _M32)
    return 2 * ((a << 20) + (b >> 12)) + 1  # < 2^53: exact once converted to float64


def gumbel_noise(seed: int, index: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """g(seed, index, v) for v in 0..vocab_size-1, float64 [vocab_size]."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    u = uniform_numerator(index_key(seed, index), ids).to(torch.float64) * 2.0 ** -53
    return -torch.log(-torch.log(u))


def allowed_tokens(logits: torch.Tensor, p: "SamplingParams") -> torch.Tensor | None:
    """The tokens a sampled draw may pick (bool [V]); None when every token may (top_k 0, top_p 1)."""
    if not p.top_k and p.top_p >= 1.0:
        return None
    return filtered_probs(logits, p) > 0.0


def perturbed_values(logits: torch.Tensor, p: "SamplingParams", seed: int, index: int) -> torch.Tensor:
    """(l - max l) / T + g(seed, index, .) in float64 [V], -inf outside the allowed tokens. Its argmax is the
    k3-gumbel/1 draw; a validator replaying an answer compares the miner's token with it."""
    scaled = (logits.double() - logits.max().double()) / float(p.temperature)
    values = scaled + gumbel_noise(seed, index, logits.numel(), logits.device)
    allowed = allowed_tokens(logits, p)
    return values if allowed is None else values.masked_fill(~allowed, float("-inf"))


def gumbel_choice(logits: torch.Tensor, p: "SamplingParams", seed: int, index: int) -> int:
    """The k3-gumbel/1 draw for one logits row [V] at generated-token `index` (temperature > 0)."""
    return int(torch.argmax(perturbed_values(logits, p, seed, index)))


@dataclass(frozen=True)
class ReplayedToken:
    """A sampled token replayed from a reference's logits: what k3-gumbel/1 picks there, and how far the token
    the miner sent is from it, in nats of logit (T times the perturbed values' difference, so that honest
    numerics, which move logits and not the noise, move it the same at every temperature)."""

    index: int  # generated-token index
    token: int  # the token the miner sent
    replayed: int  # the token the sampler picks from the reference's logits with the reported seed
    gap: float  # T * (z[replayed] - z[token]): 0 when they agree, inf when the token is not allowed at all
    margin: float  # T * (best - second best perturbed value): how near a tie the replay is (inf: one allowed)


@dataclass(frozen=True)
class ReplayKey:
    """What an engine's teacher-forced scoring needs to replay a sampled answer as well: the request's sampling
    parameters, the seed the answer was drawn with, and where in the scored token ids the answer starts (the
    position of generated-token index 0: the prompt's length)."""

    sampling: "SamplingParams"
    seed: int
    first_position: int


def replay_token(logits: torch.Tensor, p: "SamplingParams", seed: int, index: int, token: int) -> ReplayedToken:
    """Replay generated-token `index` (temperature > 0) of an answer that sent `token` from the reference's logits
    row [V]: the validator's side of k3-gumbel/1."""
    values = perturbed_values(logits, p, seed, index)
    top = torch.topk(values, min(2, values.numel()))
    best, t = int(top.indices[0]), float(p.temperature)
    margin = t * float(top.values[0] - top.values[1]) if values.numel() > 1 else float("inf")
    gap = 0.0 if token == best else t * float(values[best] - values[token])
    return ReplayedToken(index, int(token), best, gap, margin)


def draw_seed() -> int:
    """A fresh request seed in [0, 2^64), for a request that did not give one (the engine reports it)."""
    return int.from_bytes(os.urandom(8), "little")


class TokenSampler:
    """Chooses tokens for one request under k3-gumbel/1: greedy is argmax; sampled is the Gumbel-max draw keyed
    by (seed, generated-token index, token id). `seed` is the request's, or one drawn here (report it)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else draw_seed()

    def pick(self, logits: torch.Tensor, index: int) -> int:
        """The token id at generated-token `index` for this logits row [V] (fp32)."""
        if torch.isnan(logits).any() or torch.isposinf(logits).any():
            raise SamplingFailure("the model produced NaN or infinite logits")
        if self.params.temperature == 0.0:
            return int(torch.argmax(logits))
        return gumbel_choice(logits, self.params, self.seed, index)

    def choose(self, logits: torch.Tensor, index: int, logprobs: torch.Tensor | None = None) -> SampledToken:
        """`logits` [V] fp32 of generated-token `index`; `logprobs` optionally precomputed log_softmax(logits)."""
        token = self.pick(logits, index)
        return reported(token, logprobs if logprobs is not None else torch.log_softmax(logits.float(), dim=-1),
                        self.params.logprobs)


def reported(token: int, logprobs: torch.Tensor, n_top: int) -> SampledToken:
    """The chosen token with its raw logprob and the raw top-`n_top` alternatives."""
    top: list[tuple[int, float]] = []
    if n_top:
        values, ids = torch.topk(logprobs, min(n_top, logprobs.numel()))
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
