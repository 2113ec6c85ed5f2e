"""Acceptance of drafted tokens against the target model's logits (one verify forward over k+1 positions).

The verify forward feeds [last, d_1, ..., d_k]; row i of its logits is the target's next-token
distribution after d_i (row 0: after `last`). Going through the drafts in order:
- greedy: d_i is accepted while it equals argmax(row i-1); the first mismatch is replaced by that argmax;
- sampled: standard speculative sampling. With p the target's distribution (temperature, top-k, top-p
  applied) and q the draft's, d_i is accepted with probability min(1, p(d_i) / q(d_i)); on rejection the
  token comes from the residual max(0, p - q) normalised, and the rest is discarded. A model-free drafter's q
  is a point mass on d_i: acceptance with probability p(d_i), residual p with d_i removed. Every emitted
  token is then distributed exactly as plain sampling from p would give it.
If every draft is accepted, one more token comes from row k (the bonus). So a verify step emits between
1 and k+1 tokens, and the cache keeps 1 + accepted of the k+1 positions it ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.decoding.sampling import SampledToken, SamplingParams, filtered_probs


@dataclass
class Verdict:
    tokens: list[SampledToken]  # accepted drafts then the correction or bonus token (1 .. k+1 of them)
    accepted: int  # how many drafted tokens were accepted (0 .. k)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from for these logits [V] (a one-hot for greedy)."""
    if params.temperature == 0.0:
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.numel()).float()
    return filtered_probs(logits, params)


def _sampled(token: int, logprobs: torch.Tensor, n_top: int) -> SampledToken:
    top: list[tuple[int, float]] = []
    if n_top:
        values, ids = torch.topk(logprobs, min(n_top, logprobs.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return SampledToken(token, float(logprobs[token]), top)


def accept_drafts(drafts: list[int], logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> Verdict:
    """Judge `drafts` (k tokens) with the verify logits [k+1, V] (fp32). `draft_probs` [k, V] is the draft
    distribution q (None: point masses). Reported logprobs are the raw model's, as in plain sampling."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of verify logits, got {logits.shape[0]}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = params.temperature == 0.0
    out: list[SampledToken] = []
    for i, d in enumerate(drafts):
        if greedy:
            best = int(torch.argmax(logits[i]))
            if d == best:
                out.append(_sampled(d, logprobs[i], params.logprobs))
                continue
            out.append(_sampled(best, logprobs[i], params.logprobs))
            return Verdict(out, i)
        p = filtered_probs(logits[i], params)
        q = None if draft_probs is None else draft_probs[i].float()
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0.0 and u * q_d < float(p[d]):  # u < min(1, p/q)
            out.append(_sampled(d, logprobs[i], params.logprobs))
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # only when p == q, where rejection cannot happen: be safe
            residual = p
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        out.append(_sampled(token, logprobs[i], params.logprobs))
        return Verdict(out, i)
    if greedy:
        bonus = int(torch.argmax(logits[k]))
    else:
        bonus = int(torch.multinomial(filtered_probs(logits[k], params), 1, generator=generator))
    out.append(_sampled(bonus, logprobs[k], params.logprobs))
    return Verdict(out, k)


__all__ = ["Verdict", "accept_drafts", "target_probs"]
