"""MLA: naive and absorbed forms against each other and against a direct transcription of model.md section 3."""
import pytest
import torch

from inference.model import ModelConfig
from inference.model.mla import MLAAttention, MLALayerCache

ATOL = 1e-5


def make_attn(config: ModelConfig, seed: int = 0) -> MLAAttention:
    torch.manual_seed(seed)
    attn = MLAAttention(config)
    with torch.no_grad():
        for p in attn.parameters():  # non-trivial norm weights too
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return attn


def spec_reference(attn: MLAAttention, x: torch.Tensor) -> torch.Tensor:
    """model.md section 3 written out for a fresh sequence (no cache), in float64."""
    cfg = attn.config
    x = x.double()
    H, nope, rope, vd, r = cfg.mla_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    T = x.shape[0]

    def rms(t, w, eps):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    if cfg.q_lora_rank:
        c_q = rms(x @ attn.q_a_proj.weight.double().T, attn.q_a_layernorm.weight, cfg.mla_norm_eps)
        q = c_q @ attn.q_b_proj.weight.double().T
    else:
        q = x @ attn.q_proj.weight.double().T
    q = q.view(T, H, nope + rope)
    ckv = x @ attn.kv_a_proj_with_mqa.weight.double().T
    c_kv = rms(ckv[:, :r], attn.kv_a_layernorm.weight, cfg.mla_norm_eps)
    k_pe = ckv[:, r:]
    kv = (c_kv @ attn.kv_b_proj.weight.double().T).view(T, H, nope + vd)
    K = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(T, H, rope)], -1)
    V = kv[..., nope:]
    scores = torch.einsum("thd,shd->hts", q, K) * (nope + rope) ** -0.5
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    A = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
    o = torch.einsum("hts,shv->thv", A, V).reshape(T, H * vd)
    if cfg.mla_output_gate:
        o = o * torch.sigmoid(x @ attn.g_proj.weight.double().T)
    return (o @ attn.o_proj.weight.double().T).float()


CONFIGS = [ModelConfig.tiny(), ModelConfig.tiny_kimi_linear()]


@pytest.mark.parametrize("config", CONFIGS, ids=["q_lora", "plain_q"])
@pytest.mark.parametrize("T", [1, 6, 23])
def test_naive_matches_the_spec_formula(config, T):
    attn = make_attn(config)
    x = torch.randn(T, config.hidden_size)
    with torch.no_grad():
        got = attn.forward_naive(x, attn.new_cache())
    torch.testing.assert_close(got, spec_reference(attn, x), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("config", CONFIGS, ids=["q_lora", "plain_q"])
@pytest.mark.parametrize("past,T", [(0, 1), (0, 9), (5, 1), (5, 7), (17, 3)])
def test_naive_and_absorbed_agree_with_cache(config, past, T):
    attn = make_attn(config, seed=1)
    x_past = torch.randn(past, config.hidden_size)
    x_new = torch.randn(T, config.hidden_size)
    with torch.no_grad():
        cache_a, cache_b = attn.new_cache(), attn.new_cache()
        if past:
            attn.forward_naive(x_past, cache_a)
            attn.forward_absorbed(x_past, cache_b)
        naive = attn.forward_naive(x_new, cache_a)
        absorbed = attn.forward_absorbed(x_new, cache_b)
    torch.testing.assert_close(naive, absorbed, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(cache_a.view(), cache_b.view(), atol=0, rtol=0)
    assert cache_a.length == past + T


@pytest.mark.parametrize("config", CONFIGS, ids=["q_lora", "plain_q"])
def test_cached_continuation_equals_one_shot(config):
    attn = make_attn(config, seed=2)
    x = torch.randn(20, config.hidden_size)
    with torch.no_grad():
        whole = attn.forward_naive(x, attn.new_cache())
        cache = attn.new_cache()
        parts = [attn.forward_naive(x[:7], cache), attn.forward_naive(x[7:8], cache), attn.forward_naive(x[8:], cache)]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=1e-4)


def test_batched_absorbed_decode_matches_per_sequence_naive():
    config = ModelConfig.tiny()
    attn = make_attn(config, seed=3)
    prompts = [torch.randn(n, config.hidden_size) for n in (1, 4, 11)]
    step = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        batched = [attn.new_cache() for _ in prompts]
        single = [attn.new_cache() for _ in prompts]
        for p, cb, cs in zip(prompts, batched, single):
            attn.forward_naive(p, cb)
            attn.forward_naive(p, cs)
        got = attn.forward_batch_decode(step, batched)
        want = torch.cat([attn.forward_naive(step[b: b + 1], single[b]) for b in range(3)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    assert [c.length for c in batched] == [2, 5, 12]


def test_no_positional_encoding_earlier_order_does_not_matter():
    # NoPE: the last token sees the earlier ones as a set, so permuting them leaves its output unchanged.
    config = ModelConfig.tiny()
    attn = make_attn(config, seed=4)
    x = torch.randn(9, config.hidden_size)
    perm = torch.cat([torch.randperm(8), torch.tensor([8])])
    with torch.no_grad():
        a = attn.forward_naive(x, attn.new_cache())[-1]
        b = attn.forward_naive(x[perm], attn.new_cache())[-1]
        c = attn.forward_naive(x.flip(0), attn.new_cache())[-1]
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    assert not torch.allclose(a, c, atol=1e-3)  # a different last token does change the output


@pytest.mark.parametrize("config", CONFIGS, ids=["q_lora", "plain_q"])
def test_cache_holds_normalised_ckv_then_k_pe(config):
    attn = make_attn(config, seed=5)
    x = torch.randn(6, config.hidden_size)
    cache = attn.new_cache()
    with torch.no_grad():
        attn.forward_naive(x, cache)
        ckv = x @ attn.kv_a_proj_with_mqa.weight.T
    r = config.kv_lora_rank
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert cache.view().shape == (6, width)
    assert cache.nbytes == 6 * width * 4
    c = ckv[:, :r]
    want_c = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + config.mla_norm_eps) * attn.kv_a_layernorm.weight
    torch.testing.assert_close(cache.view()[:, :r], want_c, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache.view()[:, r:], ckv[:, r:], atol=1e-6, rtol=1e-5)
    if config.q_lora_rank:
        assert hasattr(attn, "q_a_proj") and not hasattr(attn, "q_proj")
    else:
        assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj")


def test_k3_latent_cache_is_576_values_per_token_per_layer():
    cfg = ModelConfig.kimi_k3()
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == cfg.mla_cache_width == 576
    # One bf16 cache of the full-size width, filled token by token: 576 values = 1152 bytes per token.
    cache = MLALayerCache(cfg.mla_cache_width, torch.bfloat16)
    for n in range(1, 40):
        cache.append(torch.zeros(1, 576, dtype=torch.bfloat16))
        assert cache.nbytes == n * 576 * 2
    assert cache.allocated_nbytes >= cache.nbytes
    assert cfg.num_mla_layers * cfg.mla_cache_width * 2 == 27_648  # model.md section 1


def test_cache_clone_is_independent_and_wrong_width_is_refused():
    cache = MLALayerCache(40, torch.float32)
    cache.append(torch.ones(3, 40))
    twin = cache.clone()
    twin.append(torch.zeros(2, 40))
    assert cache.length == 3 and twin.length == 5
    torch.testing.assert_close(twin.view()[:3], cache.view())
    with pytest.raises(ValueError, match="latents"):
        cache.append(torch.ones(2, 39))


def test_bad_input_shape_is_refused():
    config = ModelConfig.tiny()
    attn = make_attn(config)
    with pytest.raises(ValueError, match="MLA expects"):
        attn.forward_naive(torch.randn(3, config.hidden_size + 1), attn.new_cache())


def test_query_tiling_of_long_prefills_changes_nothing(monkeypatch):
    import inference.model.mla as mla_module

    config = ModelConfig.tiny()
    attn = make_attn(config, seed=6)
    x = torch.randn(30, config.hidden_size)
    with torch.no_grad():
        cache = attn.new_cache()
        attn.forward_naive(x[:4], cache)
        whole = attn.forward_naive(x[4:], cache.clone())
        monkeypatch.setattr(mla_module, "QUERY_TILE_ELEMENTS", config.mla_heads * 30 * 7)  # tiles of 7 queries
        tiled = attn.forward_naive(x[4:], cache.clone())
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-5)
