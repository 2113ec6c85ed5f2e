"""Cache rewind for speculative decoding: after mark(), some tokens, rewind(p), every per-sequence state
(KDA conv windows and recurrent state, MLA latent cache, length) is as if only the first p were seen."""
import pytest
import torch

from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model, SequenceCache
from inference.model.kda import REWIND_MODES, KDALayerCache
from inference.model.mla import MLALayerCache

# A forward over T rows rounds its matmuls differently from one over fewer rows, so a cache that saw the
# kept tokens in a different call shape agrees to fp32 rounding (about 1e-6 here, amplified a little from
# layer to layer), not bitwise. Same call shapes must agree exactly.
SHAPE_TOL = 1e-5
_models: dict = {}


def model_for(name: str = "tiny") -> KimiK3Model:
    if name not in _models:
        config = ModelConfig.tiny() if name == "tiny" else ModelConfig.tiny_kimi_linear()
        _models[name] = KimiK3Model(config, seed=3)
    return _models[name]


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def assert_same_state(got: SequenceCache, want: SequenceCache, tol: float) -> None:
    assert got.length == want.length
    assert not got.marked
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        if isinstance(b, KDALayerCache):
            torch.testing.assert_close(a.conv, b.conv, atol=tol, rtol=0, msg=f"layer {i} conv")
            torch.testing.assert_close(a.state, b.state, atol=tol, rtol=0, msg=f"layer {i} state")
            assert a.rewind_log is None
        else:
            assert isinstance(b, MLALayerCache)
            assert a.length == b.length == want.length
            torch.testing.assert_close(a.view(), b.view(), atol=tol, rtol=0, msg=f"layer {i} latents")


@pytest.mark.parametrize("mode", REWIND_MODES)
def test_rewind_is_exact_when_the_kept_tokens_ran_in_the_same_shapes(mode):
    """Marked, then tokens fed one per forward; the reference feeds only the kept ones the same way."""
    model = model_for()
    prefilled = model.new_cache()
    model([tokens(9, seed=1)], [prefilled])
    extra = tokens(5, seed=2)
    for keep in (0, 2, 4):
        cache, reference = prefilled.clone(), prefilled.clone()
        cache.mark(mode)
        for t in extra:
            model([t[None]], [cache])
        for t in extra[:keep]:
            model([t[None]], [reference])
        cache.rewind(9 + keep)
        assert_same_state(cache, reference, tol=0.0)


@pytest.mark.parametrize("mode", REWIND_MODES)
@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_rewind_equals_a_cache_that_never_saw_the_rejected_tokens(mode, name):
    model = model_for(name)
    prompt, extra = tokens(37, seed=1), tokens(6, seed=2)  # 37: the prompt takes the chunked KDA path
    prefilled = model.new_cache()
    model([prompt], [prefilled])
    for keep in (0, 1, 3, 6):
        cache = prefilled.clone()
        cache.mark(mode)
        model([extra], [cache])  # one verify-style forward over 6 positions
        cache.rewind(37 + keep)
        reference = prefilled.clone()  # the same prompt, then only the kept tokens
        if keep:
            model([extra[:keep]], [reference])
        assert_same_state(cache, reference, tol=0.0 if keep == len(extra) else SHAPE_TOL)
        # and the model continues as the reference does (logits are O(10): the state's 1e-5 becomes ~1e-5..5e-5)
        nxt = tokens(3, seed=100 + keep)
        torch.testing.assert_close(model([nxt], [cache], all_logits=True)[0],
                                   model([nxt], [reference], all_logits=True)[0],
                                   atol=0.0 if keep == len(extra) else 5 * SHAPE_TOL, rtol=0)


@pytest.mark.parametrize("mode", REWIND_MODES)
def test_rewind_across_several_forwards_and_batched_decode_steps(mode):
    """Marked caches in a batch: batched one-token decode steps (the batched KDA path) and a multi-token
    step, then each sequence rewinds to its own position."""
    model = model_for()
    prompts = [tokens(n, seed=n) for n in (5, 11, 3)]
    caches = [model.new_cache() for _ in prompts]
    model(prompts, caches)
    for c in caches:
        c.mark(mode)
    fed = [[] for _ in prompts]
    for step in range(3):  # pure decode steps: forward_batch_decode
        ids = [tokens(1, seed=50 + 10 * step + b) for b in range(3)]
        model(ids, caches)
        for f, t in zip(fed, ids):
            f.append(t)
    ids = [tokens(n, seed=70 + n) for n in (4, 1, 2)]  # a mixed step: per-sequence path
    model(ids, caches)
    for f, t in zip(fed, ids):
        f.append(t)
    for b, keep in enumerate((5, 0, 2)):
        caches[b].rewind(len(prompts[b]) + keep)
        reference = model.new_cache()  # the prompt, then the kept tokens one at a time
        model([prompts[b]], [reference])
        for t in torch.cat(fed[b])[:keep]:
            model([t[None]], [reference])
        assert_same_state(caches[b], reference, tol=SHAPE_TOL)


def test_unmark_keeps_everything_and_long_marked_runs_use_the_recurrence():
    model = model_for()
    ids = tokens(33, seed=9)
    cache = model.new_cache()
    cache.mark()
    model([ids], [cache])  # 33 >= the chunked threshold, but a marked cache takes the recurrent kernel
    assert cache.rewind_nbytes > 0
    cache.unmark()
    assert cache.rewind_nbytes == 0 and not cache.marked and cache.length == 33
    reference = model.new_cache()
    for t in ids:  # token by token: the recurrent kernel too
        model([t[None]], [reference])
    assert_same_state(cache, reference, tol=SHAPE_TOL)


def test_replay_keeps_much_less_than_snapshots():
    model = model_for()
    sizes = {}
    for mode in REWIND_MODES:
        cache = model.new_cache()
        model([tokens(4, seed=1)], [cache])
        cache.mark(mode)
        model([tokens(8, seed=2)], [cache])
        sizes[mode] = cache.rewind_nbytes
    # snapshot: 8 states of H x d x d per KDA layer; replay: q, k, v, g (H x d) and beta per position
    assert sizes["replay"] < sizes["snapshot"]


def test_rewind_errors_are_clear():
    model = model_for()
    cache = model.new_cache()
    model([tokens(5, seed=1)], [cache])
    with pytest.raises(ValueError, match="mark"):
        cache.rewind(3)
    cache.mark()
    model([tokens(2, seed=2)], [cache])
    with pytest.raises(ValueError, match="5..7"):
        cache.rewind(4)
    with pytest.raises(ValueError, match="5..7"):
        cache.rewind(8)
    with pytest.raises(ValueError, match="mode"):
        model.new_cache().mark("teleport")
    cache.rewind(6)
    assert cache.length == 6 and not cache.marked
    with pytest.raises(ValueError, match="0..6"):
        next(c for c in cache.layers if isinstance(c, MLALayerCache)).truncate(7)
