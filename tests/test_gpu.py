"""Devices and dtypes everywhere, the GPU fast paths against their plain twins, and the prepared GPU check.

The device-generic code runs here on the CPU (a model loaded through the GPU loader's path with device "cpu", the
experts batched by expert forced on, a stage's snapshots where its model is, the planner's GPU branch over a
stand-in for torch.cuda). What only a GPU can run (fla's Triton kernels, bf16 on CUDA against the fp32 CPU reference)
is tested where CUDA is present and skipped, with the reason, where it is not.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from inference.model import (DeviceError, KimiK3Model, ModelConfig, device_problem, make_random_checkpoint,
                             moe as moe_module, resolve_device, resolve_dtype)
from inference.model.kda import KDAAttention, KDALayerCache, fla_kda, kda_chunked, kda_recurrent
from inference.model.moe import LatentMoE
from inference.planning.plan import Plan
from inference.serving import EngineSpec, load_reference_model
from inference.swarm.stage import LayerRange, Stage

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is false here)")


@pytest.fixture
def no_cuda(monkeypatch):
    """This process sees no GPU, whatever the machine has (the CPU-only path and its error messages)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------------------------------- devices
def test_device_spellings_and_the_one_line_error(no_cuda):
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    assert device_problem("cpu") is None
    for bad in ("gpu", "cuda:x", "CUDA1", ""):
        assert "is not one of cpu, cuda, cuda:N" in device_problem(bad)
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError) as caught:
            resolve_device(asked)
        message = str(caught.value)
        assert "\n" not in message and "torch.cuda.is_available() is false" in message and "--device cpu" in message


def test_auto_dtype_is_bf16_on_a_gpu_and_fp32_on_the_cpu():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32 and resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(DeviceError, match="not one of auto"):
        resolve_dtype("int8", "cpu")


def test_engine_spec_says_when_its_device_cannot_be(no_cuda, tiny_checkpoint):
    ok = EngineSpec(checkpoint=str(tiny_checkpoint))
    assert ok.problems() == [] and ok.device == "cpu" and ok.dtype == "auto"
    (problem,) = EngineSpec(checkpoint=str(tiny_checkpoint), device="cuda").problems()
    assert "torch.cuda.is_available() is false" in problem
    sharded = EngineSpec(kind="sharded", checkpoint=str(tiny_checkpoint), shards=2, device="cuda:1").problems()
    assert any("rank r on GPU r" in p for p in sharded)
    remote = EngineSpec(kind="remote", checkpoint=str(tiny_checkpoint), remote_url="http://127.0.0.1:9",
                        remote_model="m", device="cuda").problems()
    assert any("remote engine computes on its server" in p for p in remote)


# ----------------------------------------------------------- the three processes refuse a missing GPU
def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    return lines[0]


def test_stage_miner_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys):
    from neurons import stage_miner  # noqa: PLC0415

    code = stage_miner.main(["--checkpoint", str(tiny_checkpoint), "--serve-layers", "0-12", "--device", "cuda"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "error: device cuda asked for" in line and "torch.cuda.is_available() is false" in line


def test_whole_model_miner_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys, tmp_path):
    from neurons import miner  # noqa: PLC0415

    code = miner.main(["--engine", "reference", "--checkpoint", str(tiny_checkpoint), "--device", "cuda",
                       "--no-publish", "--network", f"devnet:{tmp_path}/chain.sqlite", "--netuid", "1"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "device cuda asked for" in line and "torch.cuda.is_available() is false" in line


def test_validator_reference_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys, tmp_path):
    from neurons import validator  # noqa: PLC0415

    code = validator.main(["run", "--checkpoint", str(tiny_checkpoint), "--reference-engine", "--device", "cuda:0",
                           "--network", f"devnet:{tmp_path}/chain.sqlite", "--netuid", "1", "--no-gateway",
                           "--db", str(tmp_path / "v.sqlite")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "device cuda:0 asked for" in line and "torch.cuda.is_available() is false" in line


def test_validator_block_reference_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys, tmp_path):
    """The block reference alone (no --reference-engine) computes on --device too: asked for a GPU it cannot have,
    the validator says so in one line before it starts."""
    from neurons import validator  # noqa: PLC0415

    code = validator.main(["run", "--checkpoint", str(tiny_checkpoint), "--reference-memory", "1", "--device", "cuda",
                           "--canary-pool", str(tmp_path / "pool.json"), "--network", f"devnet:{tmp_path}/c.sqlite",
                           "--netuid", "1", "--no-gateway", "--db", str(tmp_path / "v.sqlite")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "device cuda asked for" in line and "torch.cuda.is_available() is false" in line


def test_the_validator_scale_benchmark_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys):
    from benchmarks import validator_scale  # noqa: PLC0415

    code = validator_scale.main(["--checkpoint", str(tiny_checkpoint), "--device", "cuda"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "torch.cuda.is_available() is false" in line


def test_k3_generate_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint, capsys):
    from inference.__main__ import main  # noqa: PLC0415

    code = main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "hi", "--device", "cuda"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "torch.cuda.is_available() is false" in line


# ------------------------------------------------------------------- the loader's device path on the CPU
def test_the_device_loader_on_the_cpu_holds_the_checkpoint_bit_for_bit(tiny_checkpoint):
    """load_reference_model goes through a meta skeleton and materialises every tensor on its device, on every
    device; on the CPU it must hold exactly what the checkpoint's seeded model holds."""
    model, _, _ = load_reference_model(tiny_checkpoint, device="cpu", verify=False)
    seeded = KimiK3Model(ModelConfig.tiny(), seed=0)
    held = model.state_dict()
    assert set(held) == set(seeded.state_dict())
    for key, want in seeded.state_dict().items():
        assert not held[key].is_meta and held[key].device.type == "cpu"
        assert torch.equal(held[key], want), key
    assert model.device == torch.device("cpu")
    bf16, _, _ = load_reference_model(tiny_checkpoint, dtype="bfloat16", device="cpu", verify=False)
    assert bf16.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].self_attn.A_log.dtype == torch.float32  # the format's fp32 tensors stay fp32


def test_mxfp4_decodes_straight_to_bf16_exactly():
    """A GPU decodes experts per call in bf16 directly (half the bytes of an fp32 decode): for every byte and every
    scale the same values as the fp32 decode rounded to bf16 (a code times a power of two is exact in either)."""
    from inference.model import mxfp4  # noqa: PLC0415

    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every byte, under every scale byte below
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    direct = mxfp4.dequantize(packed, scale, torch.bfloat16)
    via_fp32 = mxfp4.dequantize(packed, scale, torch.float32).to(torch.bfloat16)
    assert direct.dtype == torch.bfloat16
    assert bool(((direct == via_fp32) | (direct.isnan() & via_fp32.isnan())).all())


# ----------------------------------------------------------------- routed experts batched by expert
@pytest.mark.parametrize("experts, top_k, tokens, chunk", [(16, 4, 1, None), (64, 4, 3, None), (64, 4, 3, 5),
                                                            (16, 4, 7, None), (64, 8, 16, None)])
def test_grouped_experts_equal_the_per_expert_loop(experts, top_k, tokens, chunk, monkeypatch):
    """The GPU decode path of the MoE (the pairs' experts dequantised together, batched matmuls; in chunks; or every
    expert on every token), forced on here, against the per-expert loop it replaces."""
    config = ModelConfig.tiny(num_experts=experts, experts_per_token=top_k)
    if chunk:  # chunks of `chunk` pairs
        monkeypatch.setattr(moe_module, "GROUPED_DEQUANT_BYTES", chunk * 3 * config.latent_size
                            * config.expert_intermediate_size * 4)
    torch.manual_seed(0)
    moe = LatentMoE(config).eval()
    z = torch.randn(tokens, config.latent_size)
    ids, weights = moe.route(torch.randn(tokens, config.hidden_size))
    moe.grouped_experts = False
    loop = moe.expert_partial(z, ids, weights)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    moe.grouped_experts = True
    grouped = moe.expert_partial(z, ids, weights)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    after = moe.state_dict()  # the experts' bytes now live in the stacks, unchanged
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert moe.experts[3].w1.weight_packed.data_ptr() == moe.packed_experts()["w1.packed"][3].data_ptr()
    moe.grouped_experts = None  # auto: only on a GPU, so the loop here
    torch.testing.assert_close(moe.expert_partial(z, ids, weights), loop, atol=0, rtol=0)


def test_a_load_after_stacking_lands_in_the_stacks():
    config = ModelConfig.tiny()
    moe = LatentMoE(config).eval()
    moe.grouped_experts = True
    stacks = moe.packed_experts()
    with torch.no_grad():
        moe.experts[5].w2.weight_packed.copy_(torch.full_like(moe.experts[5].w2.weight_packed, 0x22))
    assert bool((stacks["w2.packed"][5] == 0x22).all())


def test_experts_held_stacked_before_a_load_receive_the_checkpoint_in_place(tiny_checkpoint):
    """What a GPU load does (the stacks allocated on the device, the loader copying each expert into its view), here
    on the CPU: every expert's bytes land in the stacks, and the model equals the checkpoint's."""
    from inference.model import load_checkpoint  # noqa: PLC0415
    from inference.sharding.worker import model_skeleton  # noqa: PLC0415

    model = model_skeleton(ModelConfig.tiny(), torch.float32)
    model.hold_experts_stacked("cpu", layers=[1, 2])
    moe = model.layers[1].block_sparse_moe
    assert moe.experts[7].w3.weight_scale.data_ptr() == moe.packed_experts()["w3.scale"][7].data_ptr()
    load_checkpoint(model, tiny_checkpoint, verify=False, progress=False)
    seeded = KimiK3Model(ModelConfig.tiny(), seed=0).state_dict()
    assert all(torch.equal(t, seeded[k]) for k, t in model.state_dict().items())
    stacks = moe.packed_experts()
    assert torch.equal(stacks["w2.packed"][7], seeded["model.layers.1.block_sparse_moe.experts.7.w2.weight_packed"])
    assert model.layers[3].block_sparse_moe._packed is None  # only the layers asked for


def test_the_model_switch_puts_every_layer_on_its_plain_twin():
    model = KimiK3Model(ModelConfig.tiny(), seed=0)
    model.set_fast_paths(False)
    assert all(not layer.self_attn.fast_kernels for layer in model.layers if not layer.is_mla)
    assert all(layer.block_sparse_moe.grouped_experts is False for layer in model.layers if layer.is_moe)
    model.set_fast_paths(True)
    assert all(layer.block_sparse_moe.grouped_experts is None for layer in model.layers if layer.is_moe)


def test_a_model_with_grouped_experts_decodes_as_the_plain_one(tiny_checkpoint):
    plain, _, _ = load_reference_model(tiny_checkpoint, verify=False)
    fast, _, _ = load_reference_model(tiny_checkpoint, verify=False)
    for m in (plain, fast):
        m.set_dequantize_cache(False)  # the per-expert loop is the path the grouped one replaces
    for layer in fast.layers:
        if layer.is_moe:
            layer.block_sparse_moe.grouped_experts = True
    plain.set_fast_paths(False)
    prompt = [torch.tensor([256, 10, 20, 30, 40])]
    caches = [plain.new_cache()], [fast.new_cache()]
    a, b = plain.forward(prompt, caches[0]), fast.forward(prompt, caches[1])
    for step in range(4):
        torch.testing.assert_close(b[0], a[0], atol=1e-4, rtol=1e-4)
        nxt = [torch.tensor([int(a[0].argmax())])]
        a, b = plain.forward(nxt, caches[0]), fast.forward(nxt, caches[1])


def test_the_envelope_measures_a_device_variant_through_the_same_code(tiny_checkpoint):
    """benchmarks/verification.py --device: the honest miner on a device, fp32 and bf16, its logits back on the host;
    run here with device "cpu" through the code a GPU takes."""
    from scoring.envelope import device_variants  # noqa: PLC0415

    fp32, bf16 = device_variants(tiny_checkpoint, "cpu")
    assert (fp32.name, bf16.name, fp32.precision, bf16.precision) == ("fp32-cpu", "bf16-cpu", "fp32", "bf16")
    assert fp32.honest and bf16.honest
    (answer,) = bf16.run([[256, 1, 2, 3]], [0.8], [5], 3, frozenset())
    assert len(answer.tokens) == 3 and all(math.isfinite(lp) and lp <= 0 for lp in answer.logprobs)


# ----------------------------------------------------------------------------- a stage on its device
def test_a_stage_computes_on_its_models_device_and_answers_on_the_host(tiny_checkpoint):
    stage = Stage.from_checkpoint(tiny_checkpoint, "0-5", device="cpu")
    assert stage.device == torch.device("cpu")
    stage.open("s")
    out = stage.forward("s", 0, torch.tensor([256, 1, 2, 3]))
    assert out.partial.device.type == "cpu" and all(b.device.type == "cpu" for b in out.blocks)
    snapshot = stage.sessions["s"].snapshots[4]
    assert all(c.state.device == stage.device for c in snapshot.values())


def test_a_stage_refuses_cuda_without_a_gpu(no_cuda, tiny_checkpoint):
    with pytest.raises(DeviceError, match="torch.cuda.is_available"):
        Stage.from_checkpoint(tiny_checkpoint, "0-5", device="cuda")


# ------------------------------------------------------------------------------------ the planner
def test_the_local_planner_on_the_cpu_is_unchanged():
    config = ModelConfig.tiny()
    default, cpu = Plan.simple(config, 2, "expert"), Plan.simple(config, 2, "expert", device="cpu")
    assert default.to_dict() == cpu.to_dict()
    assert {d.kind for d in cpu.devices} == {"cpu-process"}


def test_the_local_planner_reads_each_gpus_free_memory(monkeypatch):
    """Rank r on GPU r % count; each GPU's free memory (mem_get_info) split among the ranks it hosts. torch.cuda is
    stood in for, so that this branch runs on every machine."""
    free = {0: 40 << 30, 1: 10 << 30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Test GPU")
    plan = Plan.simple(ModelConfig.tiny(), 3, "expert", device="cuda")
    assert [d.memory_bytes for d in plan.devices] == [20 << 30, 10 << 30, 20 << 30]
    assert [d.kind for d in plan.devices] == ["cuda:0 Test GPU", "cuda:1 Test GPU", "cuda:0 Test GPU"]


# ------------------------------------------------------------------ fla's Triton kernels (CUDA only)
def _kernel_inputs(B, T, H=4, K=128, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, K, generator=g)
    log_alpha = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))  # the K3 gate's range
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    state = 0.1 * torch.randn(B, H, K, K, generator=g)
    return [t.to(device) for t in (q, k, v, log_alpha, beta, state)]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@needs_cuda
@pytest.mark.parametrize("T", [1, 5, 100, 300])
def test_fla_kernels_equal_ours_on_the_gpu(T):
    q, k, v, g, beta, state = _kernel_inputs(2, T)
    o_ref, s_ref = (kda_chunked if T >= 32 else kda_recurrent)(q, k, v, g, beta, initial_state=state)
    o, s = fla_kda(q, k, v, g, beta, initial_state=state, chunked=T > 1)
    assert _rel(o, o_ref) < 1e-2 and _rel(s, s_ref) < 1e-2


@needs_cuda
def test_a_kda_layer_on_the_gpu_matches_its_plain_kernels():
    config = ModelConfig.tiny(hidden_size=256, kda_heads=2, kda_head_dim=128, a_log_size=2)
    layer = KDAAttention(config).cuda().eval()
    x = torch.randn(70, 256, device="cuda")
    out = {}
    for fast in (True, False):
        layer.fast_kernels = fast
        cache = layer.new_cache()
        with torch.inference_mode():
            y = torch.cat([layer(x[:64], cache), layer(x[64:65], cache), layer(x[65:], cache)])
        out[fast] = (y, cache.state.clone())
    assert _rel(out[True][0], out[False][0]) < 1e-2 and _rel(out[True][1], out[False][1]) < 1e-2


@needs_cuda
def test_rewind_snapshots_stay_on_the_gpu():
    config = ModelConfig.tiny(hidden_size=256, kda_heads=2, kda_head_dim=128, a_log_size=2)
    layer = KDAAttention(config).cuda().eval()
    cache = layer.new_cache()
    with torch.inference_mode():
        layer(torch.randn(8, 256, device="cuda"), cache)
        cache.mark("snapshot")
        layer(torch.randn(4, 256, device="cuda"), cache)
    assert all(s.is_cuda for s in cache.rewind_log.states) and cache.rewind_log.start_state.is_cuda
    cache.rewind(2)
    assert cache.state.is_cuda and isinstance(cache, KDALayerCache)


@needs_cuda
def test_bf16_on_the_gpu_decodes_the_cpu_references_greedy_tokens(trained_checkpoint):
    reference, tok, _ = load_reference_model(trained_checkpoint, verify=False)
    gpu, _, _ = load_reference_model(trained_checkpoint, device="cuda", verify=False)
    assert gpu.dtype == torch.bfloat16 and gpu.device.type == "cuda"
    ids = tok.encode("def add(a, b):\n    return", add_bos=True)
    tokens = {}
    for name, model in (("cpu", reference), ("gpu", gpu)):
        cache, out, seq = model.new_cache(), [], torch.tensor(ids)
        for _ in range(16):
            logits = model.forward([seq], [cache])[0]
            out.append(int(logits.argmax()))
            seq = torch.tensor([out[-1]])
        tokens[name] = out
    assert tokens["gpu"] == tokens["cpu"]


@needs_cuda
def test_the_validators_block_reference_on_the_gpu_checks_as_on_the_cpu(tiny_checkpoint):
    """The lazy block reference on CUDA (fp32, as the validator's default): the same blocks and head as on the CPU
    within fp32 kernel differences, its weights only ever on the GPU, and a stage check of honest CPU steps passes."""
    from inference.swarm.block_reference import BlockReference, ModelReferences  # noqa: PLC0415
    from scoring.stage_checks import OpenedStep, recheck_opened  # noqa: PLC0415

    whole = load_reference_model(tiny_checkpoint, verify=False)[0]
    held, gpu = ModelReferences(whole), BlockReference(tiny_checkpoint, 16 << 20, device="cuda")
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5))
    x = held.run_block(0, 3, ids)
    want, got = held.run_block(3, 6, x), gpu.run_block(3, 6, x)
    assert got.partial.device.type == "cpu" and torch.allclose(got.partial, want.partial, rtol=1e-3, atol=1e-4)
    assert torch.allclose(gpu.head(want, [0, 7]), held.head(want, [0, 7]), rtol=1e-3, atol=1e-3)
    assert all(t.is_meta or t.is_cuda for t in gpu.model.state_dict().values())
    held[(3, 6)].open("x")
    steps = [OpenedStep(k, lo, "none", None, 0, None, part, held[(3, 6)].forward("x", lo, part))
             for k, (lo, hi) in enumerate(((0, 20), (20, 21), (21, 22)))
             for part in [type(x)((hi - lo,), [t[lo:hi] for t in x.blocks], x.partial[lo:hi])]]
    assert gpu[(3, 6)].device.type == "cuda"
    assert recheck_opened(steps, gpu[(3, 6)], seed=7).ok
    gpu.close()


# ----------------------------------------------------------------------------- the prepared GPU check
def test_the_gpu_checks_dry_run_writes_every_step(tmp_path):
    """benchmarks/gpu_check.py's entry at a tiny size on the CPU (its dry run's path; the tiny trained model's step
    and the swarm of processes are left out here for time): every step's figures land in the JSON."""
    from benchmarks import gpu_check  # noqa: PLC0415

    config = gpu_check.scaled_k3_config(10**6, layers=4)
    assert config.hidden_size % 64 == 0 and config.kda_head_dim == 128 and config.num_layers == 4
    make_random_checkpoint(config, gpu_check.scaled_checkpoint_dir(config, tmp_path), seed=0)  # as k3-checkpoint
    out = tmp_path / "check.json"
    code = gpu_check.main(["--device", "cpu", "--scaled-gb", "0.001", "--scaled-layers", "4", "--skip", "tiny",
                           "--skip", "swarm", "--prompt-tokens", "6", "--new-tokens", "2", "--audits", "1",
                           "--decode-steps", "1", "--prefill-tokens", "16", "--kda-tokens", "16", "--out", str(out),
                           "--work", str(tmp_path)])
    data = json.loads(out.read_text())
    assert code == 0
    assert {"command", "dtype", "machine", "tiny", "kda", "scaled_checkpoint", "scaled", "swarm", "seconds"} <= set(data)
    assert data["tiny"] == {"skipped": "--skip tiny"} and data["swarm"] == {"skipped": "--skip swarm"}
    assert data["scaled_checkpoint"]["reused"] is True and data["machine"]["bandwidth_measured"] > 0
    scaled = data["scaled"]
    assert "error" not in scaled, scaled.get("traceback")
    assert {"greedy", "teacher_forced", "stage_judge", "speed", "roofline", "config"} <= set(scaled)
    assert len(scaled["greedy"]["device"]) == 2 and scaled["teacher_forced"]["audits"] == 1
    assert [b["exact_checks"] for b in scaled["stage_judge"]] == ["ok"] * 3
    assert [b["device_block_reference"]["exact_checks"] for b in scaled["stage_judge"]] == ["ok"] * 3
    assert {"decode_1", "decode_16", "prefill"} <= set(scaled["speed"])
    roof = scaled["roofline"]
    assert roof["weight_bytes_per_step"]["experts"] > 0 and 0 < roof["fraction_of_measured_bandwidth"]
    for kernel in ("prefill", "decode"):
        assert data["kda"][kernel]["ours_ms"] > 0
        if not CUDA:
            assert "need a CUDA device" in data["kda"][kernel]["fla"]
