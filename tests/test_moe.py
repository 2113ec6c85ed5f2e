"""Router, SiTU-GLU and Stable LatentMoE against plain per-token references (model.md section 4)."""
import dataclasses
import math

import pytest
import torch

from inference.model import ModelConfig, mxfp4
from inference.model.moe import DenseMLP, Expert, LatentMoE, Router, situ_glu


def controlled_router(config: ModelConfig) -> Router:
    """A router whose logits equal the first E input features (gate weight = identity)."""
    router = Router(config)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, : config.num_experts] = torch.eye(config.num_experts)
    return router


def features(logits: list[list[float]], config: ModelConfig) -> torch.Tensor:
    x = torch.zeros(len(logits), config.hidden_size)
    x[:, : config.num_experts] = torch.tensor(logits)
    return x


# ---------------------------------------------------------------------------- router
def test_bias_steers_selection_but_weights_come_from_unbiased_scores():
    config = ModelConfig.tiny()
    router = Router(config)
    x = torch.randn(12, config.hidden_size)
    ids0, w0 = router.route(x)
    s = torch.sigmoid(x @ router.weight.T)
    boosted = [0, 1]
    with torch.no_grad():
        router.e_score_correction_bias[boosted] = 10.0
    ids1, w1 = router.route(x)
    was_unpicked = ~((ids0 == 0) | (ids0 == 1)).all(-1)
    assert was_unpicked.any()  # for some tokens the bias must change the selection
    for t in range(12):
        assert set(boosted) <= set(ids1[t].tolist())
    want = s.gather(1, ids1)
    want = want / want.sum(-1, keepdim=True) * config.routed_scaling_factor
    torch.testing.assert_close(w1, want, atol=1e-6, rtol=1e-6)
    biased = (s + router.e_score_correction_bias).gather(1, ids1)
    assert not torch.allclose(w1, biased / biased.sum(-1, keepdim=True), atol=1e-3)
    assert w1.dtype == torch.float32 and ids1.dtype == torch.int64


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_weights_renormalise_to_the_routed_scaling_factor(scaling):
    config = ModelConfig.tiny(routed_scaling_factor=scaling)
    router = Router(config)
    x = torch.randn(20, config.hidden_size)
    ids, w = router.route(x)
    torch.testing.assert_close(w.sum(-1), torch.full((20,), scaling), atol=1e-5, rtol=0)
    s = torch.sigmoid(x @ router.weight.T).gather(1, ids)
    torch.testing.assert_close(w, s / (s.sum(-1, keepdim=True) + 1e-20) * scaling, atol=1e-6, rtol=1e-6)


def test_without_renormalisation_weights_are_scaled_scores():
    config = ModelConfig.tiny(renormalize=False, routed_scaling_factor=2.0)
    router = Router(config)
    x = torch.randn(5, config.hidden_size)
    ids, w = router.route(x)
    torch.testing.assert_close(w, 2.0 * torch.sigmoid(x @ router.weight.T).gather(1, ids), atol=1e-6, rtol=1e-6)


def test_topk_picks_the_highest_biased_scores():
    config = ModelConfig.tiny()
    router = controlled_router(config)
    logits = [[float(i) for i in range(16)], [float(-i) for i in range(16)]]
    ids, _ = router.route(features(logits, config))
    assert sorted(ids[0].tolist()) == [12, 13, 14, 15]
    assert sorted(ids[1].tolist()) == [0, 1, 2, 3]


def grouped_reference(choice: torch.Tensor, n_group: int, topk_group: int, k: int) -> list[set[int]]:
    """Per token, in plain Python: rate groups by the sum of their two best scores, keep the best groups."""
    out = []
    for row in choice.tolist():
        size = len(row) // n_group
        groups = [row[g * size: (g + 1) * size] for g in range(n_group)]
        rating = [sum(sorted(grp, reverse=True)[:2]) for grp in groups]
        kept = sorted(range(n_group), key=lambda g: rating[g], reverse=True)[:topk_group]
        candidates = [(row[e], e) for g in kept for e in range(g * size, (g + 1) * size)]
        out.append({e for _, e in sorted(candidates, reverse=True)[:k]})
    return out


def test_grouped_topk_only_selects_from_the_kept_groups():
    config = ModelConfig.tiny_grouped()
    assert (config.n_group, config.topk_group) == (4, 2)
    router = controlled_router(config)
    # Group 0 holds the single best expert but a poor second one; groups 1 and 2 win on their top-2 sums.
    crafted = [5, -5, -5, -5, 2, 2, -5, -5, 1.5, 1.5, 1.5, 1.5, -1, -1, -1, -1]
    ids, _ = router.route(features([crafted], config))
    picked = set(ids[0].tolist())
    assert 0 not in picked  # the globally best expert is in a dropped group
    assert {4, 5} <= picked and all(4 <= e < 12 for e in picked)
    # Random tokens against the reference, including a bias that reshuffles groups.
    router = Router(config)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.randn(config.num_experts) * 0.3)
    x = torch.randn(40, config.hidden_size)
    ids, w = router.route(x)
    s = torch.sigmoid(x @ router.weight.T)
    want = grouped_reference(s + router.e_score_correction_bias, 4, 2, config.experts_per_token)
    size = config.num_experts // config.n_group
    for t in range(40):
        assert set(ids[t].tolist()) == want[t]
        assert len({e // size for e in ids[t].tolist()}) <= config.topk_group
    torch.testing.assert_close(w.sum(-1), torch.ones(40), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- SiTU-GLU
def test_situ_glu_matches_the_formula():
    pairs = [(0.0, 1.0), (1.3, -0.7), (-3.0, 40.0), (9.0, 60.0), (20.0, -100.0), (-20.0, 2.0), (4.0, 25.0)]
    g = torch.tensor([p[0] for p in pairs])
    u = torch.tensor([p[1] for p in pairs])
    got = situ_glu(g, u, 4.0, 25.0)
    for i, (gv, uv) in enumerate(pairs):
        want = 4 * math.tanh(gv / 4) * (1 / (1 + math.exp(-gv))) * 25 * math.tanh(uv / 25)
        assert abs(got[i].item() - want) <= 1e-5 * max(1.0, abs(want))
    # fp32 even from bf16 inputs, and the gate's cap is at 4, the up's at 25
    assert situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.float32
    big = situ_glu(torch.tensor([1e4]), torch.tensor([1e4]))
    assert abs(big.item() - 100.0) < 1e-3


def test_dense_mlp_uses_situ_glu():
    config = ModelConfig.tiny()
    torch.manual_seed(0)
    mlp = DenseMLP(config.hidden_size, 48, config)
    x = torch.randn(7, config.hidden_size)
    act = situ_glu(x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T, config.situ_beta, config.situ_linear_beta)
    torch.testing.assert_close(mlp(x), act @ mlp.down_proj.weight.T, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------- LatentMoE
def make_moe(config: ModelConfig, seed: int = 0) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(config, layer_idx=5)
    with torch.no_grad():
        moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


@torch.no_grad()
def routed_tokens(seed: int, tokens: int):
    """A tiny MoE (`make_moe` with `seed`), `tokens` random hidden states x, their routing (ids, w) and latents z."""
    config = ModelConfig.tiny()
    moe = make_moe(config, seed=seed)
    x = torch.randn(tokens, config.hidden_size)
    ids, w = moe.route(x)
    return config, moe, x, ids, w, moe.down(x)


def per_token_reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Stable LatentMoE token by token, experts dequantised to dense weights (the plain reference)."""
    cfg = moe.config
    ids, w = moe.gate.route(x)
    out = []
    for t in range(x.shape[0]):
        z = x[t] @ moe.routed_expert_down_proj.weight.T
        y = torch.zeros(cfg.latent_size)
        for j in range(cfg.experts_per_token):
            ex = moe.experts[int(ids[t, j])]
            w1, w2, w3 = (m.dequantized_weight() for m in (ex.w1, ex.w2, ex.w3))
            y = y + w[t, j] * (situ_glu(z @ w1.T, z @ w3.T) @ w2.T)
        y = y / torch.sqrt(y.pow(2).mean() + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
        out.append(y @ moe.routed_expert_up_proj.weight.T + moe.shared_experts(x[t: t + 1])[0])
    return torch.stack(out)


def test_latent_moe_matches_per_token_reference():
    config = ModelConfig.tiny()
    moe = make_moe(config)
    x = torch.randn(30, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), per_token_reference(moe, x), atol=1e-5, rtol=1e-4)
    assert moe.shared_experts.gate_proj.out_features == config.num_shared_experts * config.expert_intermediate_size


def test_forward_equals_sum_of_partials_over_disjoint_expert_subsets():
    config, moe, x, ids, w, z = routed_tokens(seed=1, tokens=25)
    with torch.no_grad():
        assert z.shape == (25, config.latent_size)
        subsets = [[0, 3, 7, 12], [1, 2, 4, 5, 6, 15], [8, 9, 10, 11, 13, 14]]
        partials = [moe.expert_partial(z, ids, w, experts=s) for s in subsets]
        combined = moe.finish(sum(partials), x)
        torch.testing.assert_close(combined, moe(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sum(partials), moe.expert_partial(z, ids, w), atol=1e-6, rtol=1e-6)
        # A subset holding none of the selected experts contributes exactly nothing.
        unused = [e for e in range(config.num_experts) if not (ids == e).any()]
        if unused:
            assert torch.count_nonzero(moe.expert_partial(z, ids, w, experts=unused)) == 0
        with pytest.raises(ValueError, match="outside"):
            moe.expert_partial(z, ids, w, experts=[config.num_experts])


def test_mxfp4_expert_equals_dequantise_then_matmul():
    config = ModelConfig.tiny()
    torch.manual_seed(2)
    q_expert = Expert(config)
    dense_expert = Expert(dataclasses.replace(config, mxfp4_experts=False))
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            packed, scale = mxfp4.random_on_grid(getattr(q_expert, name).out_features,
                                                 getattr(q_expert, name).in_features, scale_exponents=(121, 124))
            getattr(q_expert, name).weight_packed.copy_(packed)
            getattr(q_expert, name).weight_scale.copy_(scale)
            getattr(dense_expert, name).weight.copy_(mxfp4.dequantize(packed, scale))
    z = torch.randn(9, config.latent_size)
    torch.testing.assert_close(q_expert(z), dense_expert(z), atol=0, rtol=0)


def test_dequantize_cache_gives_identical_results_and_follows_weight_updates():
    config = ModelConfig.tiny()
    moe = make_moe(config, seed=3)
    x = torch.randn(16, config.hidden_size)
    with torch.no_grad():
        on_the_fly = moe(x)
        moe.set_dequantize_cache(True)
        assert moe.dequantize_cache
        cached = moe(x)
        # 16 tokens of the tiny model take the all-experts path (batched matmuls over the cached dense
        # weights): the same sums in another order, so equal to rounding
        assert moe._stacked is not None
        torch.testing.assert_close(cached, on_the_fly, atol=1e-6, rtol=1e-6)
        # Loading new expert weights in place must not leave a stale dense copy behind.
        for ex in moe.experts:
            packed, scale = mxfp4.random_on_grid(ex.w2.out_features, ex.w2.in_features, scale_exponents=(120, 122))
            ex.w2.weight_packed.copy_(packed)
            ex.w2.weight_scale.copy_(scale)
        after_cached = moe(x)
        moe.set_dequantize_cache(False)
        assert not moe.dequantize_cache
        torch.testing.assert_close(after_cached, moe(x), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(after_cached, on_the_fly)


def test_routing_observer_sees_layer_and_ids():
    config = ModelConfig.tiny()
    moe = make_moe(config, seed=4)
    seen = []
    moe.routing_observer = lambda layer, ids: seen.append((layer, ids.clone()))
    x = torch.randn(6, config.hidden_size)
    with torch.no_grad():
        moe(x)
    ids, _ = moe.gate.route(x)
    assert len(seen) == 1 and seen[0][0] == 5
    assert torch.equal(seen[0][1], ids)


def test_mxfp4_state_names_and_plain_variant():
    config = ModelConfig.tiny()
    names = set(LatentMoE(config).state_dict())
    assert {"experts.0.w1.weight_packed", "experts.0.w1.weight_scale", "experts.15.w2.weight_packed"} <= names
    assert LatentMoE(config).state_dict()["experts.3.w3.weight_packed"].shape == (32, 16)
    plain = set(LatentMoE(dataclasses.replace(config, mxfp4_experts=False)).state_dict())
    assert "experts.0.w1.weight" in plain and "experts.0.w1.weight_packed" not in plain


def test_all_experts_path_equals_experts_on_their_tokens():
    """The small-model fast path (every expert on every token, batched) against per-expert grouping."""
    config, moe, x, ids, w, z = routed_tokens(seed=4, tokens=12)
    with torch.no_grad():
        grouped = moe.expert_partial(z, ids, w)  # no dense cache: per-expert matmuls, decoded on the fly
        moe.set_dequantize_cache(True)
        batched = moe.expert_partial(z, ids, w)
        assert moe._stacked is not None
        torch.testing.assert_close(batched, grouped, atol=1e-6, rtol=1e-6)
        # a subset of experts (expert parallelism) still takes the per-expert path, and agrees
        half = list(range(0, config.num_experts, 2))
        torch.testing.assert_close(moe.expert_partial(z, ids, w, experts=half)
                                   + moe.expert_partial(z, ids, w, experts=range(1, config.num_experts, 2)),
                                   batched, atol=1e-6, rtol=1e-6)

