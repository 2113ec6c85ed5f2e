import math

import numpy as np
import pytest
import torch

from inference.decoding.sampling import (SAMPLER, SAMPLERS, SamplingParams, TokenSampler, filtered_probs, find_stop,
                                         gumbel_choice, gumbel_noise, index_key, mix32, perturbed_values,
                                         uniform_numerator)
from protocol.schemas import Capabilities


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
    s = TokenSampler(SamplingParams(temperature=0.0, logprobs=2)).choose(logits, 0)
    lp = torch.log_softmax(logits, -1)
    assert s.token_id == 1 and s.logprob == pytest.approx(float(lp[1]))
    assert [i for i, _ in s.top] == [1, 3]


# ------------------------------------------------------------------ k3-gumbel/1
def lowbias32(x: int) -> int:
    """The spec's mix32 written with plain mod-2^32 arithmetic (Python ints never overflow)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def spec_numerator(seed: int, index: int, token: int) -> int:
    """2n + 1 of the spec (docs: k3-gumbel/1), from its text alone."""
    key = lowbias32(lowbias32(lowbias32((seed >> 32) ^ 0x6B336775) ^ (seed & 0xFFFFFFFF)) ^ index)
    a = lowbias32(lowbias32(key ^ token))
    b = lowbias32((a + 0x9E3779B9) & 0xFFFFFFFF)
    return 2 * (a * 2**20 + (b >> 12)) + 1


# Test vectors for other implementations: (seed, index, token) -> 2n + 1, u = (2n + 1) / 2^53.
VECTORS = [
    ((0, 0, 0), 8740292276267937), ((0, 0, 1), 7118113843306645), ((7, 3, 271), 3024018836934063),
    ((2**64 - 1, 2**32 - 1, 0), 8229007601731259), ((123456789012345678, 17, 2**31), 685353783953539),
]


def test_the_split_multiplication_equals_plain_modular_arithmetic():
    rng = np.random.default_rng(0)
    xs = [0, 1, 0xFFFFFFFF, 0x80000000] + [int(x) for x in rng.integers(0, 2**32, 2000)]
    assert [mix32(x) for x in xs] == [lowbias32(x) for x in xs]
    as_tensor = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    as_array = mix32(np.array(xs, dtype=np.int64)).tolist()
    assert as_tensor == as_array == [lowbias32(x) for x in xs]


def test_the_generator_is_the_spec_on_python_ints_tensors_and_arrays():
    for (seed, index, token), want in VECTORS:
        assert spec_numerator(seed, index, token) == want
        key = index_key(seed, index)
        assert uniform_numerator(key, token) == want
        assert int(uniform_numerator(key, torch.tensor([token], dtype=torch.int64))[0]) == want
        assert int(uniform_numerator(key, np.array([token], dtype=np.int64))[0]) == want
    ids = np.arange(512, dtype=np.int64)
    key = index_key(99, 5)
    assert uniform_numerator(key, torch.from_numpy(ids)).tolist() == uniform_numerator(key, ids).tolist() \
        == [spec_numerator(99, 5, v) for v in range(512)]
    g = gumbel_noise(99, 5, 512)
    assert g.dtype == torch.float64
    want = [-math.log(-math.log(spec_numerator(99, 5, v) / 2**53)) for v in range(512)]
    assert g.tolist() == pytest.approx(want, rel=1e-14, abs=1e-14)
    with pytest.raises(ValueError, match="seed in"):
        index_key(2**64, 0)


def test_the_noise_is_gumbel_and_independent_across_indices_and_seeds():
    g = torch.cat([gumbel_noise(seed, i, 1000) for seed in (1, 2) for i in range(20)])
    assert float(g.mean()) == pytest.approx(0.5772, abs=0.02)  # Euler-Mascheroni
    assert float(g.std()) == pytest.approx(math.pi / math.sqrt(6), abs=0.02)
    a, b, c = gumbel_noise(1, 0, 1000), gumbel_noise(1, 1, 1000), gumbel_noise(2, 0, 1000)
    for x, y in ((a, b), (a, c)):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 0.1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3),
                                    SamplingParams(temperature=1.5, top_p=0.7)])
def test_the_draws_follow_the_filtered_distribution(params):
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    want = filtered_probs(logits, params)
    n = 5000
    counts = torch.zeros(5)
    for i in range(n):
        counts[gumbel_choice(logits, params, 1234, i)] += 1
    assert (counts / n).tolist() == pytest.approx(want.tolist(), abs=0.025)  # 3.5 sigma of the largest cell
    assert all(counts[j] == 0 for j in range(5) if want[j] == 0)  # nothing outside top-k / top-p


def test_a_draw_depends_only_on_seed_index_and_logits():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.8, seed=42)
    first = [TokenSampler(p).choose(logits, i).token_id for i in range(40)]
    again = TokenSampler(p)
    assert [again.choose(logits, i).token_id for i in reversed(range(40))] == first[::-1]  # any order
    assert first == [int(torch.argmax(perturbed_values(logits, p, 42, i))) for i in range(40)]
    other = [TokenSampler(SamplingParams(temperature=0.8, seed=43)).choose(logits, i).token_id for i in range(40)]
    assert other != first
    drawn = TokenSampler(SamplingParams(temperature=0.8))  # no seed: one is drawn, and replays the answer
    tokens = [drawn.choose(logits, i).token_id for i in range(40)]
    assert tokens == [gumbel_choice(logits, p, drawn.seed, i) for i in range(40)]


def test_the_sampler_names_agree_with_the_wire():
    assert SAMPLER == "k3-gumbel/1" and set(SAMPLERS) == set(Capabilities.model_fields["sampler"].annotation.__args__)


def test_invalid_parameters_are_named():
    p = SamplingParams(max_tokens=0, temperature=-1, top_p=1.5, top_k=-1, logprobs=30, seed=-3, stop=("",))
    text = " ".join(p.problems())
    for name in ("max_tokens", "temperature", "top_p", "top_k", "logprobs", "seed", "stop"):
        assert name in text


def test_find_stop_finds_the_earliest_across_pieces():
    assert find_stop("hello world", ("wor", "lo"), 0) == 3
    assert find_stop("abcXYZ", ("XY",), 4) == 3  # the stop straddles the previous piece
    assert find_stop("abc", ("zz",), 0) == -1
