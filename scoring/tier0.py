"""Tier 0: the checks a validator's CPU runs on every finished generation (docs/verification.md).

Usage counts against the validator's own, finish reason and max_tokens, nothing after an end-of-sequence
token, logprobs present and consistent (greedy tokens at the miner's own top-1), no buffered stream, the
response signature (over the request, the tokens and the reported seed), the seed the request asked for, and the
model fingerprint: `check_tier0`.
"""
from __future__ import annotations

import math
from typing import Optional

from protocol.client import GenerateResult
from protocol.schemas import Capabilities, GenerateRequest
from protocol.signature import verify_response

from .config import DEFAULT_CONFIG, ScoringConfig
from .failures import Failure
from .replay import replays
from .workloads import WorkItem


def validator_prompt_ids(request: GenerateRequest, tokenizer) -> list[int]:
    """The prompt as the validator's own tokenizer sees it (token prompts are taken as sent)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    return tokenizer.encode(request.prompt, add_bos=request.add_special_tokens)


def check_tier0(item: Optional[WorkItem], result: GenerateResult, tokenizer, capabilities: Capabilities,
                miner_hotkey: str, config: ScoringConfig = DEFAULT_CONFIG) -> list[Failure]:
    """Every check of tier 0 on one finished generation; [] when it passes.

    `item` may be None for traffic that is not a work item (the prompt is then tokenized here);
    with an item its `prompt_ids` are used, which the validator computed with the same tokenizer.
    """
    request = result.request
    if item is not None and item.request.request_id != request.request_id:
        raise ValueError(f"result of request {request.request_id} checked against item {item.request.request_id}")
    final = result.final
    if final is None:
        return [Failure("incomplete", "the stream ended without a final event")]
    failures: list[Failure] = []
    tokens = result.token_ids
    n = len(tokens)
    stop_ids = frozenset(getattr(tokenizer, "stop_ids", None) or {tokenizer.eos_id})

    # Usage equals the validator's own count, no slack. Over-counting is billing fraud (hard);
    # under-counting only hurts the miner, but still means it is not counting our way.
    prompt_count = item.prompt_tokens if item is not None else len(validator_prompt_ids(request, tokenizer))
    for name, reported, counted in (("usage_prompt", final.usage.prompt_tokens, prompt_count),
                                    ("usage_completion", final.usage.completion_tokens, n)):
        if reported != counted:
            failures.append(Failure(name, f"miner reports {reported} tokens, the validator counts {counted}",
                                    hard=reported > counted))

    # Finish reason and max_tokens.
    if n > request.max_tokens:
        failures.append(Failure("max_tokens", f"{n} tokens streamed for max_tokens = {request.max_tokens}", hard=True))
    if final.finish_reason == "length" and n != request.max_tokens:
        failures.append(Failure("finish_reason", f"finish 'length' after {n} of {request.max_tokens} tokens"))
    elif final.finish_reason == "eos" and (n == 0 or tokens[-1] not in stop_ids):
        failures.append(Failure("finish_reason", "finish 'eos' but the last token is not an end-of-sequence token"))
    elif final.finish_reason == "stop" and not any(s in result.text for s in request.stop):
        failures.append(Failure("finish_reason", "finish 'stop' but no stop string appears in the output"))
    early = next((i for i, t in enumerate(tokens[:-1]) if t in stop_ids), None)
    if early is not None:
        failures.append(Failure("continued_past_eos", f"end-of-sequence token at {early} and the stream went on"))

    failures += _check_logprobs(result, capabilities, config)

    # Buffering: the first few percent of the tokens arrived only near the end of the call.
    arrivals = result.token_arrivals_s
    total = result.total_s or 0.0
    if n > config.buffering_min_tokens and total > 0:
        head = max(1, math.ceil(config.buffering_head_fraction * n))
        if arrivals[head - 1] >= config.buffering_time_fraction * total:
            failures.append(Failure(
                "buffered_stream",
                f"the first {head} of {n} tokens arrived at {arrivals[head - 1]:.3f} s of {total:.3f} s",
                hard=True))

    committed = getattr(final, "state_commitment", None)
    if not verify_response(final.signature, result.body, tokens, miner_hotkey, final.seed,
                           state_root=committed.root if committed is not None else None):
        failures.append(Failure("signature", "the response signature does not cover this request, these tokens, "
                                             "this seed and the state commitment under the miner's hotkey",
                                hard=True))
    if request.seed is not None and final.seed is not None and final.seed != request.seed:
        failures.append(Failure("seed", f"the final event reports seed {final.seed}, the request asked for "
                                        f"{request.seed}", hard=True))
    elif final.seed is None and request.temperature > 0 and replays(capabilities.sampler):
        failures.append(Failure("seed_missing", "a sampled answer of a miner declaring k3-gumbel/1 names no seed, "
                                                "so it cannot be replayed"))
    if final.model_fingerprint != capabilities.model_fingerprint:
        failures.append(Failure("fingerprint", f"final event names model {final.model_fingerprint}, capabilities "
                                               f"say {capabilities.model_fingerprint}"))
    return failures


def _check_logprobs(result: GenerateResult, capabilities: Capabilities, config: ScoringConfig) -> list[Failure]:
    """Logprobs present for every token, self-consistent, and greedy tokens at the miner's own top-1."""
    request = result.request
    want = min(request.logprobs, capabilities.vocab_size)
    tol = config.logprob_tolerance
    missing, inconsistent, not_top1 = [], [], []
    position = 0
    for timed in result.token_events:
        event = timed.event
        for token, chosen, top in zip(event.token_ids, event.logprobs, event.top_logprobs):
            if len(top) < want:
                missing.append(position)
            elif top:
                values = [entry.logprob for entry in top]
                listed = {entry.token_id: entry.logprob for entry in top}
                if (any(a < b - tol for a, b in zip(values, values[1:])) or chosen > values[0] + tol
                        or (token in listed and abs(listed[token] - chosen) > tol)
                        or (token not in listed and len(top) >= want and chosen > values[-1] + tol)):
                    inconsistent.append(position)
                elif request.temperature == 0 and token != top[0].token_id and chosen < values[0] - tol:
                    not_top1.append(position)
            position += 1
    failures = []
    if missing:
        failures.append(Failure("logprobs_missing", f"{len(missing)} tokens have fewer than {want} alternatives "
                                                    f"(first at {missing[0]})"))
    if inconsistent:
        failures.append(Failure("logprobs_inconsistent", f"{len(inconsistent)} tokens have a chosen logprob that "
                                                         f"contradicts their own top list (first at {inconsistent[0]})"))
    if not_top1:
        failures.append(Failure("greedy_not_top1", f"temperature 0, yet {len(not_top1)} tokens are not the top-1 of "
                                                   f"the miner's own distribution (first at {not_top1[0]})"))
    return failures


__all__ = ["validator_prompt_ids", "check_tier0"]
