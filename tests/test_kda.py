"""Kimi Delta Attention: the chunked kernel against the recurrence and fla-core's oracle, and the
layer's prefill, decode, split-prefill and batched-decode paths against each other and the spec."""
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference.model import ModelConfig, kda
from inference.model.kda import KDAAttention, KDALayerCache, kda_chunked, kda_recurrent


# ------------------------------------------------------------------------------------------ inputs
def kernel_inputs(B=2, T=70, H=2, K=16, V=8, gate="lower_bound", dtype=torch.float32, seed=0):
    """Inputs shaped as the layer makes them: unit q and k, log-decays from one of the gate forms."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    raw = randn(B, T, H, K)
    if gate == "lower_bound":  # K3: -5 sigmoid(a (x + b)) with a in [1, 16]
        g = -5.0 * torch.sigmoid(torch.linspace(1, 16, H, dtype=torch.float64)[:, None] * raw)
    elif gate == "softplus":  # Kimi Linear: -a softplus(x + b), unbounded below
        g = -torch.linspace(0.05, 3.0, H, dtype=torch.float64)[:, None] * F.softplus(raw)
    elif gate == "strong":  # close to the -5 floor everywhere: a chunk's cumulative decay passes -300
        g = -5.0 * torch.sigmoid(8.0 + raw)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(randn(B, T, H))
    state = randn(B, H, K, V)
    return [t.to(dtype) for t in (q, k, v, g, beta, state)]


# ------------------------------------------------------------------------------ chunked vs recurrent
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "strong"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_chunked_equals_recurrent_fp32(T, with_state, gate):
    q, k, v, g, beta, state = kernel_inputs(T=T, gate=gate)
    initial = state if with_state else None
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=initial)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=initial)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == (2, T, 2, 8) and s.shape == (2, 2, 16, 8)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "strong"])
def test_chunked_equals_recurrent_fp64_tightly(gate):
    q, k, v, g, beta, state = kernel_inputs(T=130, gate=gate, dtype=torch.float64)
    if gate == "strong":
        assert g[:, :64].sum(1).min() < -300  # a whole chunk decays past e^-300
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=state)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=state)
    assert o.dtype == torch.float64
    # Terms below e^-30 are floored there (inference/model/kda.py, _decay): far below this tolerance.
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 32, 128])
def test_chunked_any_power_of_two_chunk(chunk_size):
    q, k, v, g, beta, state = kernel_inputs(T=100, gate="softplus", dtype=torch.float64)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=state)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)


def test_chunked_spans_carry_the_state(monkeypatch):
    # Long inputs run in spans of chunks; force many small spans and check nothing changes.
    q, k, v, g, beta, state = kernel_inputs(T=300, gate="lower_bound", dtype=torch.float64)
    o_ref, s_ref = kda_chunked(q, k, v, g, beta, initial_state=state, chunk_size=16)
    monkeypatch.setattr(kda, "_SPAN_ELEMENTS", 1)  # one chunk per span
    o, s = kda_chunked(q, k, v, g, beta, initial_state=state, chunk_size=16)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)


def test_recurrent_follows_the_spec_step_by_step():
    # One head, written exactly as model.md section 2 step 6, with an explicit scale.
    q, k, v, g, beta, state = kernel_inputs(B=1, T=5, H=1, K=4, V=3, dtype=torch.float64)
    o, s = kda_recurrent(q, k, v, g, beta, scale=0.7, initial_state=state)
    S = state[0, 0].clone()
    for t in range(5):
        S = S * torch.exp(g[0, t, 0])[:, None]
        pred = k[0, t, 0] @ S
        S = S + beta[0, t, 0] * torch.outer(k[0, t, 0], v[0, t, 0] - pred)
        torch.testing.assert_close(o[0, t, 0], (0.7 * q[0, t, 0]) @ S, atol=1e-12, rtol=0)
    torch.testing.assert_close(s[0, 0], S, atol=1e-12, rtol=0)


def test_kernels_leave_inputs_alone_and_compute_in_fp32():
    q, k, v, g, beta, state = kernel_inputs(T=70, dtype=torch.bfloat16)
    saved = [t.clone() for t in (q, k, v, g, beta, state)]
    for kernel in (kda_recurrent, kda_chunked):
        o, s = kernel(q, k, v, g, beta, initial_state=state)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        for before, after in zip(saved, (q, k, v, g, beta, state)):
            assert torch.equal(before, after)
    o32, s32 = kda_recurrent(*[t.float() for t in (q, k, v, g, beta)], initial_state=state.float())
    torch.testing.assert_close(kda_chunked(q, k, v, g, beta, initial_state=state)[0], o32, atol=1e-4, rtol=0)


def test_kernels_reject_mismatched_shapes():
    q, k, v, g, beta, state = kernel_inputs(T=10)
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="g must have shape"):
        kda_chunked(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunked(q, k, v, g, beta, initial_state=state[:, :, :3])
    with pytest.raises(ValueError, match="power of two"):
        kda_chunked(q, k, v, g, beta, chunk_size=48)


# ---------------------------------------------------------------------------------- fla-core oracle
def _fla_naive():
    """fla-core's pure-PyTorch KDA reference, loaded from its one file: importing the whole fla
    package takes about ten seconds (it probes for Triton) and is not needed for this."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise AssertionError("fla-core is not installed; it is part of the test extra: pip install -e '.[test]'")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "strong"])
def test_both_kernels_equal_fla_naive_recurrent(gate):
    fla = _fla_naive()
    q, k, v, g, beta, state = kernel_inputs(T=130, gate=gate)
    o_fla, s_fla = fla.naive_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    for kernel in (kda_recurrent, kda_chunked):
        o, s = kernel(q, k, v, g, beta, initial_state=state)
        torch.testing.assert_close(o, o_fla, atol=1e-4, rtol=0)
        torch.testing.assert_close(s, s_fla, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_fla_naive_chunk(chunk_size):
    fla = _fla_naive()
    # fla's chunk form exponentiates every pair before masking, so keep its decays moderate here.
    q, k, v, g, beta, state = kernel_inputs(T=128, gate="softplus", seed=3)
    o_fla, s_fla = fla.naive_chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=state,
                                       output_final_state=True, chunk_size=chunk_size)
    o, s = kda_chunked(q, k, v, g, beta, scale=0.3, initial_state=state, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_fla, atol=1e-4, rtol=0)
    torch.testing.assert_close(s, s_fla, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------- layer
CONFIGS = {"k3": ModelConfig.tiny(), "kimi_linear": ModelConfig.tiny_kimi_linear()}


def make_layer(name, seed=0):
    torch.manual_seed(seed)
    layer = KDAAttention(CONFIGS[name])
    with torch.no_grad():  # larger gate and beta inputs than the default init, so decay and writes vary
        layer.f_b_proj.weight.mul_(4.0)
        layer.b_proj.weight.mul_(4.0)
    return layer


def hidden(T, D=64, seed=1):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def assert_same_cache(a: KDALayerCache, b: KDALayerCache, atol=1e-5):
    torch.testing.assert_close(a.conv, b.conv, atol=atol, rtol=0)
    torch.testing.assert_close(a.state, b.state, atol=atol, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_parameters_match_checkpoint_names(name):
    cfg = CONFIGS[name]
    D, H, d, P = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj_size
    shapes = {
        "q_proj.weight": (P, D), "k_proj.weight": (P, D), "v_proj.weight": (P, D),
        "q_conv1d.weight": (P, 1, 4), "k_conv1d.weight": (P, 1, 4), "v_conv1d.weight": (P, 1, 4),
        "f_a_proj.weight": (d, D), "f_b_proj.weight": (P, d), "b_proj.weight": (H, D),
        "A_log": (H,), "dt_bias": (P,), "o_norm.weight": (d,), "o_proj.weight": (D, P),
    }
    if cfg.full_rank_output_gate:
        shapes["g_proj.weight"] = (P, D)
    else:
        shapes["g_a_proj.weight"] = (d, D)
        shapes["g_b_proj.weight"] = (P, d)
    got = {key: tuple(t.shape) for key, t in KDAAttention(cfg).state_dict().items()}
    assert got == shapes


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_equals_decode_and_split_prefill(name):
    layer = make_layer(name)
    x = hidden(77)
    with torch.no_grad():
        whole_cache = layer.new_cache()
        whole = layer(x, whole_cache)  # one call: the chunked kernel
        results = {}
        for split in ([1] * 77, [37, 40], [5, 3, 69]):  # token by token (recurrent) and mixed prefills
            cache = layer.new_cache()
            pieces, start = [], 0
            for size in split:
                pieces.append(layer(x[start:start + size], cache))
                start += size
            results[tuple(split)] = (torch.cat(pieces), cache)
    assert kda.CHUNKED_MIN_TOKENS <= 37 and kda.CHUNKED_MIN_TOKENS > 5  # both kernels are exercised
    assert whole.shape == (77, 64) and torch.isfinite(whole).all()
    for split, (out, cache) in results.items():
        torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-4)
        assert_same_cache(cache, whole_cache)


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_decode_equals_single_decodes(name):
    layer = make_layer(name)
    prompts = [hidden(n, seed=10 + n) for n in (3, 20, 70)]
    with torch.no_grad():
        caches = []
        for p in prompts:
            cache = layer.new_cache()
            layer(p, cache)
            caches.append(cache)
        singles = [c.clone() for c in caches]
        for step in range(3):
            x = hidden(3, seed=100 + step)
            batched = layer.forward_batch_decode(x, caches)
            for b, cache in enumerate(singles):
                torch.testing.assert_close(batched[b], layer(x[b:b + 1], cache)[0], atol=1e-5, rtol=0)
    for a, b in zip(caches, singles):
        assert_same_cache(a, b)


@pytest.mark.parametrize("name", CONFIGS)
def test_cache_size_does_not_grow(name):
    cfg = CONFIGS[name]
    layer = make_layer(name)
    cache = layer.new_cache()
    expected = 4 * (3 * cfg.kda_proj_size * (cfg.conv_kernel_size - 1) + cfg.kda_heads * cfg.kda_head_dim ** 2)
    assert cache.nbytes == expected
    with torch.no_grad():
        layer(hidden(1), cache)
        assert cache.nbytes == expected
        layer(hidden(200), cache)
    assert cache.nbytes == expected
    assert cache.conv.dtype == torch.float32 and cache.state.dtype == torch.float32


def spec_layer(layer: KDAAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer transcribed from model.md section 2, one token at a time, from a zero cache."""
    cfg = layer.config
    H, d, P, kern = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj_size, cfg.conv_kernel_size
    p = {key: t.double() for key, t in layer.state_dict().items()}
    x = x.double()
    history = {name: torch.zeros(kern - 1, P, dtype=torch.float64) for name in "qkv"}
    S = torch.zeros(H, d, d, dtype=torch.float64)
    outputs = []
    for t in range(x.shape[0]):
        xt = x[t]
        conv = {}
        for name in "qkv":
            window = torch.cat([history[name], (p[f"{name}_proj.weight"] @ xt)[None]])  # [kern, P], oldest first
            history[name] = window[1:]
            conv[name] = F.silu((window.T * p[f"{name}_conv1d.weight"][:, 0, :]).sum(-1)).view(H, d)
        q = conv["q"] / torch.sqrt((conv["q"] ** 2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = conv["k"] / torch.sqrt((conv["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
        v = conv["v"]
        z = (p["f_b_proj.weight"] @ (p["f_a_proj.weight"] @ xt) + p["dt_bias"]).view(H, d)
        a = torch.exp(p["A_log"])[:, None]
        if cfg.gate_lower_bound is None:
            log_alpha = -a * F.softplus(z)
        else:
            log_alpha = cfg.gate_lower_bound * torch.sigmoid(a * z)
        beta = torch.sigmoid(p["b_proj.weight"] @ xt)
        o = torch.empty(H, d, dtype=torch.float64)
        for h in range(H):
            S[h] = S[h] * torch.exp(log_alpha[h])[:, None]
            pred = k[h] @ S[h]
            S[h] = S[h] + beta[h] * torch.outer(k[h], v[h] - pred)
            o[h] = q[h] @ S[h]
        o = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * p["o_norm.weight"]
        if cfg.full_rank_output_gate:
            gate = p["g_proj.weight"] @ xt
        else:
            gate = p["g_b_proj.weight"] @ (p["g_a_proj.weight"] @ xt)
        outputs.append(p["o_proj.weight"] @ (o * torch.sigmoid(gate.view(H, d))).reshape(P))
    return torch.stack(outputs)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_equals_spec_transcription(name):
    layer = make_layer(name, seed=4)
    with torch.no_grad():
        torch.nn.init.normal_(layer.o_norm.weight, 1.0, 0.2)  # a non-trivial norm weight
        x = hidden(40, seed=5)
        expected = spec_layer(layer, x)
        for split in ([40], [1] * 40):
            cache = layer.new_cache()
            got = torch.cat([layer(part, cache) for part in x.split(split)])
            torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_log_decay_ranges(name):
    layer = make_layer(name)
    g_raw = 10 * torch.randn(50, layer.num_heads, layer.head_dim)
    log_alpha = layer.log_decay(g_raw)
    assert log_alpha.dtype == torch.float32 and (log_alpha <= 0).all()
    if CONFIGS[name].gate_lower_bound is not None:
        assert (log_alpha >= -5).all() and log_alpha.min() < -4.9
    else:
        assert log_alpha.min() < -5  # the softplus gate has no floor


def test_bf16_layer_keeps_fp32_cache_and_matches_fp32():
    layer = make_layer("k3")
    x = hidden(70)
    with torch.no_grad():
        ref = layer(x, layer.new_cache())
        low = make_layer("k3").to(torch.bfloat16)  # fp32 extras cast too: the layer computes them in fp32
        cache = low.new_cache()
        out = low(x.bfloat16(), cache)
    assert out.dtype == torch.bfloat16 and cache.state.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max() + 1e-2


def test_layer_rejects_bad_inputs():
    layer = make_layer("k3")
    cache = layer.new_cache()
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(5, 63), cache)
    with pytest.raises(ValueError, match="new_cache"):
        layer(torch.randn(5, 64), KDALayerCache(conv=torch.zeros(3, 64, 2), state=torch.zeros(4, 16, 16)))
    with pytest.raises(ValueError, match="2 tokens but 1 caches"):
        layer.forward_batch_decode(torch.randn(2, 64), [cache])
