"""Acceptance of drafted tokens against the target model's logits (one verify forward over k+1 positions).

The verify forward feeds [last, d_1, ..., d_k]; row i of its logits is the target's next-token
distribution after d_i (row 0: after `last`), the token at generated-token index first_index + i. Under the
protocol's sampler (k3-gumbel/1, inference.decoding.sampling) the token plain decoding would emit at an index
is a deterministic function of that row, the request's seed and the index: greedy, the argmax; sampled, the
Gumbel-max draw. So, greedy or sampled, d_i is accepted exactly when it equals that token, and the first
mismatch is replaced by it; if every draft is accepted, one more token comes from row k (the bonus). The
emitted tokens are then token for token those of plain decoding with the same seed, not only distributed
alike, and no draft distribution is needed (a draft model that proposes its own argmax under the same noise,
argmax(draft logits / T + g), agrees with the target most often). A verify step emits between 1 and k+1
tokens, and the cache keeps 1 + accepted of the k+1 positions it ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.decoding.sampling import SampledToken, TokenSampler


@dataclass
class Verdict:
    tokens: list[SampledToken]  # accepted drafts then the correction or bonus token (1 .. k+1 of them)
    accepted: int  # how many drafted tokens were accepted (0 .. k)


def accept_drafts(drafts: list[int], logits: torch.Tensor, sampler: TokenSampler, first_index: int) -> Verdict:
    """Judge `drafts` (k tokens) with the verify logits [k+1, V] (fp32), row i being generated-token index
    `first_index` + i. Reported logprobs are the raw model's, as in plain sampling."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of verify logits, got {logits.shape[0]}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out: list[SampledToken] = []
    for i, draft in enumerate(drafts):
        out.append(sampler.choose(logits[i], first_index + i, logprobs[i]))
        if out[-1].token_id != draft:  # the correction: plain decoding's token at this index
            return Verdict(out, i)
    out.append(sampler.choose(logits[k], first_index + k, logprobs[k]))  # every draft accepted: the bonus
    return Verdict(out, k)


__all__ = ["Verdict", "accept_drafts"]
