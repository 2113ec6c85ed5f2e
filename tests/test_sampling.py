import math

import pytest
import torch

from inference.decoding.sampling import SamplingParams, TokenSampler, filtered_probs, find_stop


def plain_filtered(logits, temperature, top_k, top_p):
    """Reference: sort, cut by top-k, then by cumulative mass, renormalise (plain Python)."""
    vals = [float(x) / temperature for x in logits]
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    keep = order[:top_k] if top_k else order
    m = max(vals[i] for i in keep)
    exps = {i: math.exp(vals[i] - m) for i in keep}
    z = sum(exps.values())
    probs = {i: exps[i] / z for i in keep}
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    z2 = sum(probs[i] for i in kept)
    return [probs[i] / z2 if i in kept else 0.0 for i in range(len(vals))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.3)])
def test_filtered_probs_match_a_plain_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, generator=g) * 3
    got = filtered_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    want = plain_filtered(logits.tolist(), temperature, top_k, top_p)
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_greedy_and_reported_logprobs_are_raw():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5])
    s = TokenSampler(SamplingParams(temperature=0.0, logprobs=2)).choose(logits)
    lp = torch.log_softmax(logits, -1)
    assert s.token_id == 1 and s.logprob == pytest.approx(float(lp[1]))
    assert [i for i, _ in s.top] == [1, 3]


def test_seeded_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    sampler = TokenSampler(SamplingParams(temperature=1.0, seed=7))
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler.choose(logits).token_id] += 1
    probs = torch.softmax(logits, -1).tolist()
    for c, p in zip(counts, probs):
        assert abs(c / 3000 - p) < 0.04
    again = TokenSampler(SamplingParams(temperature=1.0, seed=7))
    first = TokenSampler(SamplingParams(temperature=1.0, seed=7))
    assert [again.choose(logits).token_id for _ in range(50)] == [first.choose(logits).token_id for _ in range(50)]


def test_invalid_parameters_are_named():
    p = SamplingParams(max_tokens=0, temperature=-1, top_p=1.5, top_k=-1, logprobs=30, seed=-3, stop=("",))
    text = " ".join(p.problems())
    for name in ("max_tokens", "temperature", "top_p", "top_k", "logprobs", "seed", "stop"):
        assert name in text


def test_find_stop_finds_the_earliest_across_pieces():
    assert find_stop("hello world", ("wor", "lo"), 0) == 3
    assert find_stop("abcXYZ", ("XY",), 4) == 3  # the stop straddles the previous piece
    assert find_stop("abc", ("zz",), 0) == -1
