"""fp8 e4m3 dense weights with per-output-channel scales (inference.model.fp8), in one process and as a plan's
dense_dtype executed by the sharded runtime (with a dense split, against the single-process fp8 model)."""
import pytest
import torch
from torch import nn

from inference.model import ModelConfig
from inference.model.fp8 import (FP8_DTYPE, FP8_MAX, FP8_RELATIVE_ERROR, FP8_SUBNORMAL_STEP, FP8Linear, dequantize_fp8,
                                 quantize_dense, quantize_fp8)
from inference.planning import Plan, PlanError
from inference.serving import load_reference_model
from inference.sharding import ShardedModel, ShardTimeouts

CONFIG = ModelConfig.tiny()
TIMEOUTS = ShardTimeouts(comm=30.0, heartbeat=10.0, startup=180.0, keepalive=0.5)


def test_round_trip_error_is_within_the_e4m3_bound():
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, one all-zero row, a few outliers
    w = torch.randn(64, 96, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    w[5] = 0
    w[7, 3] = 50.0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_fp8(q, scale)
    err = (back - w).abs()
    # normal values: half a unit in the last of 3 mantissa bits; subnormals: half the subnormal spacing
    bound = FP8_RELATIVE_ERROR * w.abs() + 0.5 * FP8_SUBNORMAL_STEP * scale[:, None]
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err - bound).max())
    assert torch.equal(back[5], torch.zeros(96))
    # each row's largest magnitude uses the top of the range and comes back exactly
    top = w.abs().argmax(dim=1)
    rows = torch.arange(64)
    assert torch.allclose(back[rows, top].abs(), w[rows, top].abs(), rtol=1e-6)
    assert float(q.float().abs().amax()) == FP8_MAX
    # and it is a real 8-bit rounding, not a copy
    rel = (err / w.abs().clamp_min(1e-30))[w.abs() > scale[:, None] * 2 ** -6]
    assert float(rel.max()) > 2 ** -6


def test_fp8_linear_equals_the_dequantised_matmul():
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(48, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 48, generator=g))
    f = FP8Linear.from_linear(lin)
    x = torch.randn(5, 48, generator=g)
    want = x @ f.weight.T
    assert torch.allclose(f(x), want, atol=1e-5)
    with torch.no_grad():
        assert float((f(x) - lin(x)).norm() / lin(x).norm()) < 0.04  # e4m3: about 2.5% per product
    with pytest.raises(ValueError, match="matrix"):
        quantize_fp8(torch.zeros(3))


def test_quantize_dense_swaps_the_dense_linears_and_the_model_still_runs(tiny_checkpoint, tiny_reference):
    plain = tiny_reference[0]
    model, _, _ = load_reference_model(tiny_checkpoint)
    names = quantize_dense(model)
    assert "lm_head" in names and "model.layers.0.self_attn.q_proj" in names
    assert "model.layers.3.self_attn.kv_b_proj" in names  # MLA, read as a weight by the absorbed decode
    assert "model.layers.1.block_sparse_moe.shared_experts.down_proj" in names
    assert not any(n.endswith("res_proj") or ".experts." in n for n in names)
    assert isinstance(model.layers[1].block_sparse_moe.shared_experts.gate_proj, FP8Linear)
    ids = [torch.arange(40) % 256, torch.tensor([7, 8, 9])]
    c8, c32 = [model.new_cache() for _ in ids], [plain.new_cache() for _ in ids]
    a, b = model(ids, c8), plain(ids, c32)
    for _ in range(4):  # batched decode through the absorbed MLA form and the KDA recurrence
        nxt = [row.argmax().reshape(1) for row in a]
        a, b = model(nxt, c8), plain(nxt, c32)
    # the random tiny model amplifies weight error (3% random noise on these weights moves its logits by
    # about 35%); e4m3's ~2.5% per matrix moves them about as much, and no more
    for x, y in zip(a, b):
        assert torch.isfinite(x).all()
        gap = float((x - y).norm() / y.norm())
        assert 0 < gap < 0.6, gap


def test_plan_dense_dtype_is_checked_and_written(tmp_path):
    plan = Plan.simple(CONFIG, 2, "expert", memory_bytes=1 << 30, dense_split=2, dense_dtype="fp8")
    path = tmp_path / "plan.yaml"
    plan.save(path)
    back = Plan.load(path)
    assert back.dense_dtype == "fp8" and back.dense_groups == plan.dense_groups
    assert back.lm_head_group == (plan.lm_head_rank, 1 - plan.lm_head_rank)
    bf16 = Plan.simple(CONFIG, 2, "expert", memory_bytes=1 << 30, dense_split=2)
    assert sum(m.weights_dense for m in back.memory) < sum(m.weights_dense for m in bf16.memory)
    text = path.read_text().replace("dense_dtype: fp8", "dense_dtype: fp4")
    path.write_text(text)
    with pytest.raises(PlanError, match="dense_dtype"):
        Plan.load(path)


def test_sharded_fp8_dense_split_equals_the_single_process_fp8_model(tiny_checkpoint):
    reference, _, _ = load_reference_model(tiny_checkpoint)
    quantize_dense(reference)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (12, 35, 1)]
    with ShardedModel(tiny_checkpoint, shards=2, mode="expert", dense_split=2, dense_dtype="fp8",
                      timeouts=TIMEOUTS, threads_per_rank=1) as sharded:
        assert sharded.layout()["dense_dtype"] == "fp8"
        caches, ref_caches = [sharded.new_cache() for _ in prompts], [reference.new_cache() for _ in prompts]
        got, want = sharded(prompts, caches, all_logits=True), reference(prompts, ref_caches, all_logits=True)
        for step in range(4):
            for x, y in zip(got, want):
                assert float((x - y).abs().max()) <= 1e-4, step
                assert x.argmax(-1).tolist() == y.argmax(-1).tolist()
            nxt = [(y[-1] if y.dim() == 2 else y).argmax().reshape(1) for y in want]
            got, want = sharded(nxt, caches), reference(nxt, ref_caches)


def test_the_fp8_dense_miner_is_measured_beside_the_baselines(tiny_checkpoint):
    from scoring.envelope import build_variants
    from scoring.envelope_fp8 import FP8_VARIANT, measure_with_fp8

    report = measure_with_fp8(tiny_checkpoint, only=["fp32-batched", FP8_VARIANT], audits_per_variant=4,
                              max_tokens=6, sharded=False)
    names = [r.variant.name for r in report.results]
    assert names == ["fp32-batched", FP8_VARIANT]
    fp32, fp8 = report.results
    assert fp8.variant.honest and fp8.variant.precision == "fp8" and len(fp8.statistics) == 4
    gap = [s.logprob_gap_mean for s in fp8.statistics if s.logprob_gap_mean is not None]
    exact = [s.logprob_gap_mean for s in fp32.statistics if s.logprob_gap_mean is not None]
    assert gap and max(gap) > max(exact)  # rounder numerics: further from the fp32 reference
    assert build_variants.__name__ == "build_variants"  # the measurement's hook is undone
