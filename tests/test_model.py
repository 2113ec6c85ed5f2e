"""The whole tiny model: prefill, decode, batching, caches, tensor names and the layer-level split."""
import math

import pytest
import torch

from inference.model import KimiK3Model, ModelConfig, ResidualState, SequenceCache, checkpoint
from inference.model.kda import KDALayerCache
from inference.model.mla import MLALayerCache

ATOL = 1e-4
CONFIGS = {
    "tiny": ModelConfig.tiny(),
    "tiny_kimi_linear": ModelConfig.tiny_kimi_linear(),
    "tiny_grouped": ModelConfig.tiny_grouped(),
}
_models: dict = {}


def model_for(name: str = "tiny") -> KimiK3Model:
    if name not in _models:
        _models[name] = KimiK3Model(CONFIGS[name], seed=7)
    return _models[name]


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


# ---------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_equals_token_by_token_decode(name):
    model = model_for(name)
    ids = tokens(36, seed=1)  # long enough for the chunked KDA prefill path
    prefill = model([ids], [model.new_cache()], all_logits=True)[0]
    assert prefill.shape == (36, model.config.vocab_size) and prefill.dtype == torch.float32
    cache = model.new_cache()
    stepped = torch.stack([model([ids[t: t + 1]], [cache])[0] for t in range(36)])
    torch.testing.assert_close(stepped, prefill, atol=ATOL, rtol=0)
    assert cache.length == 36


def test_batch_of_different_lengths_equals_each_alone():
    model = model_for()
    prompts = [tokens(n, seed=10 + n) for n in (5, 33, 12, 1)]
    batch_caches = [model.new_cache() for _ in prompts]
    batched = model(prompts, batch_caches, all_logits=True)
    alone_caches = [model.new_cache() for _ in prompts]
    for p, c, got in zip(prompts, alone_caches, batched):
        torch.testing.assert_close(got, model([p], [c], all_logits=True)[0], atol=ATOL, rtol=0)
    # then two batched decode steps (the batched KDA / absorbed MLA paths) against single-sequence steps
    for step in range(2):
        nxt = [tokens(1, seed=100 + 10 * step + b) for b in range(len(prompts))]
        batched = model(nxt, batch_caches)
        for b in range(len(prompts)):
            alone = model([nxt[b]], [alone_caches[b]])[0]
            assert batched[b].shape == (model.config.vocab_size,)
            torch.testing.assert_close(batched[b], alone, atol=ATOL, rtol=0)
    assert [c.length for c in batch_caches] == [7, 35, 14, 3]


def test_chunked_prefill_equals_one_shot():
    model = model_for()
    ids = tokens(40, seed=2)
    whole = model([ids], [model.new_cache()], all_logits=True)[0]
    cache = model.new_cache()
    parts = [model([chunk], [cache], all_logits=True)[0] for chunk in (ids[:13], ids[13:14], ids[14:])]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)
    # last-token logits are the last row of all_logits
    torch.testing.assert_close(model([ids], [model.new_cache()])[0], whole[-1], atol=1e-5, rtol=0)


def test_greedy_generation_equals_teacher_forced_argmax():
    model = model_for()
    prompts = [tokens(8, seed=3), tokens(3, seed=4)]
    caches = [model.new_cache() for _ in prompts]
    logits = model(prompts, caches)
    generated = [[], []]
    for _ in range(12):
        nxt = [int(torch.argmax(lg)) for lg in logits]
        for g, t in zip(generated, nxt):
            g.append(t)
        logits = model([torch.tensor([t]) for t in nxt], caches)
    for prompt, gen in zip(prompts, generated):
        full = torch.cat([prompt, torch.tensor(gen)])
        scored = model([full], [model.new_cache()], all_logits=True)[0]
        teacher = scored[len(prompt) - 1: -1].argmax(-1)
        assert teacher.tolist() == gen
    assert len(set(generated[0])) > 1  # the model does not collapse onto one token


def test_layer_range_split_equals_full_forward():
    model = model_for()
    cfg = model.config
    prompts = [tokens(9, seed=5), tokens(4, seed=6)]
    want = model(prompts, [model.new_cache() for _ in prompts], all_logits=True)
    # two pipeline stages, each holding only its layers' caches
    stage0 = [model.new_cache(layers=range(0, 6)) for _ in prompts]
    stage1 = [model.new_cache(layers=range(6, cfg.num_layers)) for _ in prompts]
    assert stage0[0].layers[6] is None and stage1[0].layers[0] is None
    ids = torch.cat(prompts)
    state = model.embed(ids, [9, 4])
    state = model.run_layers(0, 6, state, stage0)
    carried = ResidualState(state.lengths, [b.clone() for b in state.blocks], state.partial.clone())
    assert len(carried.blocks) == 2  # embedding + block of layers 0..2 (block size 3)
    state = model.run_layers(6, cfg.num_layers, carried, stage1)
    got = model.head(state)
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=0)
    rows = state.last_rows
    torch.testing.assert_close(model.head(state, rows), got[rows], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no state for layer 0"):
        model.run_layers(0, 1, model.embed(ids, [9, 4]), stage1)


def test_expert_parallel_split_inside_a_layer_equals_the_layer():
    model = model_for()
    prompts = [tokens(7, seed=8), tokens(5, seed=9)]
    caches_a = [model.new_cache() for _ in prompts]
    caches_b = [model.new_cache() for _ in prompts]
    state = model.run_layers(0, 4, model.embed(torch.cat(prompts), [7, 5]), caches_a)
    state_b = model.run_layers(0, 4, model.embed(torch.cat(prompts), [7, 5]), caches_b)
    layer = model.layers[4]
    want = layer(state, caches_a)
    mid, x = layer.attend(state_b, caches_b)
    moe = layer.block_sparse_moe
    ids, w = moe.route(x)
    z = moe.down(x)
    devices = [range(0, 5), range(5, 11), range(11, 16)]
    y = sum(moe.expert_partial(z, ids, w, experts=d) for d in devices)
    got = layer.add_mlp(mid, moe.finish(y, x))
    torch.testing.assert_close(got.partial, want.partial, atol=1e-5, rtol=0)
    assert len(got.blocks) == len(want.blocks)


# ---------------------------------------------------------------------------- caches
def test_cache_sizes_kda_constant_mla_linear():
    model = model_for()
    cfg = model.config
    kda_bytes = cfg.num_kda_layers * 4 * (
        3 * cfg.kda_proj_size * (cfg.conv_kernel_size - 1) + cfg.kda_heads * cfg.kda_head_dim ** 2
    )
    cache = model.new_cache()
    assert cache.kda_nbytes == kda_bytes and cache.mla_nbytes == 0
    total = 0
    for n in (5, 1, 17, 1):
        model([tokens(n, seed=n)], [cache])
        total += n
        assert cache.length == total
        assert cache.kda_nbytes == kda_bytes
        assert cache.mla_nbytes == total * cfg.num_mla_layers * cfg.mla_cache_width * 4
        assert cache.nbytes == cache.kda_nbytes + cache.mla_nbytes
    kinds = [type(c) for c in cache.layers]
    assert kinds == [MLALayerCache if cfg.is_mla(i) else KDALayerCache for i in range(cfg.num_layers)]


def test_cloned_cache_continues_independently():
    model = model_for()
    prefix, a, b = tokens(10, seed=20), tokens(3, seed=21), tokens(3, seed=22)
    cache = model.new_cache()
    model([prefix], [cache])
    twin = cache.clone()
    assert isinstance(twin, SequenceCache) and twin.length == 10 and twin.nbytes == cache.nbytes
    out_b = model([b], [twin], all_logits=True)[0]
    out_a = model([a], [cache], all_logits=True)[0]
    fresh_a = model([torch.cat([prefix, a])], [model.new_cache()], all_logits=True)[0][10:]
    fresh_b = model([torch.cat([prefix, b])], [model.new_cache()], all_logits=True)[0][10:]
    torch.testing.assert_close(out_a, fresh_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, fresh_b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- names and dtypes
def expected_keys_by_hand(cfg: ModelConfig, layers) -> dict[str, tuple]:
    D = cfg.hidden_size
    keys = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
        "model.output_attn_res_norm.weight": (D,),
        "model.output_attn_res_proj.weight": (1, D),
        "lm_head.weight": (cfg.vocab_size, D),
    }
    for i in layers:
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            keys[p + n + ".weight"] = (D,)
        keys[p + "self_attention_res_proj.weight"] = (1, D)
        keys[p + "mlp_res_proj.weight"] = (1, D)
        a = p + "self_attn."
        if cfg.is_mla(i):
            keys[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
            keys[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            keys[a + "q_b_proj.weight"] = (cfg.mla_heads * 24, cfg.q_lora_rank)
            keys[a + "kv_a_proj_with_mqa.weight"] = (40, D)
            keys[a + "kv_a_layernorm.weight"] = (32,)
            keys[a + "kv_b_proj.weight"] = (cfg.mla_heads * 32, 32)
            keys[a + "g_proj.weight"] = (64, D)
            keys[a + "o_proj.weight"] = (D, 64)
        else:
            P = cfg.kda_proj_size
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                keys[a + n + ".weight"] = (P, D)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                keys[a + n + ".weight"] = (P, 1, 4)
            keys[a + "A_log"] = (cfg.kda_heads,)
            keys[a + "dt_bias"] = (P,)
            keys[a + "f_a_proj.weight"] = (16, D)
            keys[a + "f_b_proj.weight"] = (P, 16)
            keys[a + "b_proj.weight"] = (cfg.kda_heads, D)
            keys[a + "o_norm.weight"] = (16,)
            keys[a + "o_proj.weight"] = (D, P)
        if i == 0:
            keys[p + "mlp.gate_proj.weight"] = (128, D)
            keys[p + "mlp.up_proj.weight"] = (128, D)
            keys[p + "mlp.down_proj.weight"] = (D, 128)
            continue
        m = p + "block_sparse_moe."
        keys[m + "gate.weight"] = (16, D)
        keys[m + "gate.e_score_correction_bias"] = (16,)
        keys[m + "routed_expert_down_proj.weight"] = (32, D)
        keys[m + "routed_expert_up_proj.weight"] = (D, 32)
        keys[m + "routed_expert_norm.weight"] = (32,)
        keys[m + "shared_experts.gate_proj.weight"] = (64, D)
        keys[m + "shared_experts.up_proj.weight"] = (64, D)
        keys[m + "shared_experts.down_proj.weight"] = (D, 64)
        for e in range(16):
            for w in ("w1", "w2", "w3"):
                keys[f"{m}experts.{e}.{w}.weight_packed"] = (32, 16)
                keys[f"{m}experts.{e}.{w}.weight_scale"] = (32, 1)
    return keys


def test_state_dict_names_are_the_release_names():
    model = model_for()
    cfg = model.config
    sd = model.state_dict()
    by_hand = expected_keys_by_hand(cfg, layers=(0, 1, 3))
    for key, shape in by_hand.items():
        assert tuple(sd[key].shape) == shape, key
    layer_keys = {k for k in sd if k.startswith(("model.layers.0.", "model.layers.1.", "model.layers.3."))}
    assert layer_keys == {k for k in by_hand if k.startswith("model.layers.")}
    # every key of the whole model against the checkpoint helper's list (names minus `language_model.`)
    specs = {checkpoint.model_key(n): s for n, s in checkpoint.expected_tensors(cfg).items()}
    assert set(sd) == set(specs)
    for key, spec in specs.items():
        if not key.endswith("A_log"):  # stored padded, sliced to the H used heads by the loader
            assert tuple(sd[key].shape) == spec.shape, key


@pytest.mark.parametrize("name", ["tiny_kimi_linear", "tiny_grouped"])
def test_state_dict_names_of_the_variants(name):
    cfg = CONFIGS[name]
    sd = model_for(name).state_dict()
    assert set(sd) == {checkpoint.model_key(n) for n in checkpoint.expected_tensors(cfg)}
    if name == "tiny_kimi_linear":
        assert "model.layers.3.self_attn.q_proj.weight" in sd and "model.layers.0.self_attn.g_a_proj.weight" in sd


def test_bf16_model_keeps_fp32_tensors_and_returns_fp32_logits():
    cfg = CONFIGS["tiny"]
    model = KimiK3Model(cfg, dtype=torch.bfloat16, seed=7)
    sd = model.state_dict()
    for name, spec in checkpoint.expected_tensors(cfg).items():
        assert sd[checkpoint.model_key(name)].dtype == spec.dtype, name
    cache = model.new_cache()
    logits = model([tokens(6, seed=30)], [cache])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    mla = next(c for c in cache.layers if isinstance(c, MLALayerCache))
    assert mla.dtype == torch.bfloat16 and mla.nbytes == 6 * cfg.mla_cache_width * 2
    ref = model_for()([tokens(6, seed=30)], [model_for().new_cache()])[0]
    assert torch.corrcoef(torch.stack([logits, ref]))[0, 1] > 0.95  # same weights up to bf16 rounding


# ---------------------------------------------------------------------------- behaviour
def test_output_distributions_are_neither_uniform_nor_one_hot():
    model = model_for()
    V = model.config.vocab_size
    logits = model([tokens(30, seed=40)], [model.new_cache()], all_logits=True)[0]
    p = logits.softmax(-1)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    assert 0.5 < entropy.mean() < math.log(V) - 0.5
    assert 0.05 < p.max(-1).values.mean() < 0.95
    other = model([torch.cat([tokens(29, seed=41), tokens(30, seed=40)[-1:]])], [model.new_cache()])[0]
    assert (other - logits[-1]).abs().max() > 0.1  # the prediction depends on the context, not only the last token


def test_routing_observer_and_dequantize_cache():
    model = model_for()
    cfg = model.config
    ids = tokens(11, seed=50)
    seen = []
    model.routing_observer = lambda layer, expert_ids: seen.append((layer, tuple(expert_ids.shape)))
    try:
        plain = model([ids], [model.new_cache()])[0]
        model.set_dequantize_cache(True)
        cached = model([ids], [model.new_cache()])[0]
    finally:
        model.routing_observer = None
        model.set_dequantize_cache(False)
    assert seen[: len(cfg.moe_layers)] == [(i, (11, cfg.experts_per_token)) for i in cfg.moe_layers]
    # the cached dense experts take the batched all-experts path for few tokens: equal up to summation order
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=1e-5)
    model([ids], [model.new_cache()])
    assert len(seen) == 2 * len(cfg.moe_layers)  # the observer was removed


def test_same_seed_same_model_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = KimiK3Model(CONFIGS["tiny"], seed=3)
    assert torch.equal(torch.rand(1), before)
    b = KimiK3Model(CONFIGS["tiny"], seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_bad_inputs_are_refused_clearly():
    model = model_for()
    cache = model.new_cache()
    with pytest.raises(ValueError, match="out of range"):
        model([torch.tensor([1, 2, model.config.vocab_size])], [cache])
    with pytest.raises(ValueError, match="caches"):
        model([tokens(3, 1), tokens(2, 2)], [cache])
    with pytest.raises(ValueError, match="twice"):
        model([tokens(3, 1), tokens(2, 2)], [cache, cache])
    with pytest.raises(ValueError, match="non-empty"):
        model([torch.tensor([], dtype=torch.long)], [cache])
    with pytest.raises(ValueError, match="context"):
        big = model.new_cache()
        big.length = model.config.max_position_embeddings
        model([tokens(1, 1)], [big])
    with pytest.raises(ValueError, match="all 13 layers"):
        model([tokens(2, 1)], [model.new_cache(layers=range(0, 6))])
    assert cache.length == 0 and cache.mla_nbytes == 0  # nothing was half-applied


# ---------------------------------------------------------------------------- Attention Residuals
def test_attn_res_small_example_by_hand():
    from inference.model.layers import attn_res

    blocks = [torch.tensor([[1.0, 0.0]])]
    partial = torch.tensor([[0.0, 2.0]])
    a = 0.7
    got = attn_res(partial, blocks, torch.tensor([[a, 0.0]]), torch.tensor([2.0, 1.0]), eps=0.0)
    # keys: [1, 0] / sqrt(1/2) = [sqrt2, 0] and [0, 2] / sqrt(2) = [0, sqrt2]; query = norm_w * proj_w = [2a, 0]
    l1, l2 = 2 * a * math.sqrt(2), 0.0
    p1 = math.exp(l1) / (math.exp(l1) + math.exp(l2))
    torch.testing.assert_close(got, torch.tensor([[p1 * 1.0, (1 - p1) * 2.0]]), atol=1e-6, rtol=1e-6)
    assert got.dtype == torch.float32


def spec_attn_res(partial, blocks, proj_w, norm_w, eps):
    """model.md section 6 as proj(RMSNorm_without_weight(v) * norm_w) per source, softmax over sources."""
    v = torch.stack(blocks + [partial]).double()
    k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    logits = (k * norm_w.double()) @ proj_w.double().reshape(-1)
    return (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0).float()


def test_forward_follows_the_attention_residuals_pseudocode():
    model = model_for()
    cfg = model.config
    ids = tokens(10, seed=60)
    eps = cfg.rms_norm_eps
    partial = model.model.embed_tokens(ids).float()
    blocks = []
    for i, layer in enumerate(model.layers):
        h = (spec_attn_res(partial, blocks, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps)
             if blocks else partial)
        if i % cfg.attn_res_block_size == 0:
            blocks.append(partial)
            partial = None
        a = layer.self_attn(layer.input_layernorm(h), layer.new_cache())
        partial = a if partial is None else partial + a
        h = spec_attn_res(partial, blocks, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
        partial = partial + layer.mlp_forward(layer.post_attention_layernorm(h))
    assert len(blocks) == math.ceil(cfg.num_layers / cfg.attn_res_block_size)  # 5 with 13 layers, block 3
    h = spec_attn_res(partial, blocks, model.model.output_attn_res_proj.weight, model.model.output_attn_res_norm.weight, eps)
    want = model.model.norm(h) @ model.lm_head.weight.T
    got = model([ids], [model.new_cache()], all_logits=True)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_caches_cross_inference_mode_boundaries():
    # The engine runs steps under torch.inference_mode; caches made outside it and clones must keep working.
    model = model_for()
    ids = tokens(12, seed=70)
    want = model([ids], [model.new_cache()], all_logits=True)[0]
    cache = model.new_cache()
    with torch.inference_mode():
        first = model([ids[:8]], [cache], all_logits=True)[0]
    twin = cache.clone()
    rest_plain = model([ids[8:]], [cache], all_logits=True)[0]
    with torch.inference_mode():
        rest_twin = model([ids[8:]], [twin], all_logits=True)[0]
    torch.testing.assert_close(torch.cat([first, rest_plain]), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(rest_twin, rest_plain, atol=1e-6, rtol=0)
