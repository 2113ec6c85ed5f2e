"""Checkpoint layout, writing, manifest and loading, with real safetensors files in tmp_path."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference.model import KimiK3Model, ModelConfig
from inference.model.checkpoint import (INDEX_FILE, MANIFEST_FILE, PREFIX, CheckpointError, TensorSelection, TensorSite,
                                        TensorSpec, expected_tensors, fingerprint, load_checkpoint, load_tensors,
                                        make_random_checkpoint, model_key, num_parameters, random_checkpoint_tensors,
                                        read_config, read_manifest, read_weight_map, state_dict_to_checkpoint_tensors,
                                        tensor_site, verify_manifest, write_checkpoint, write_manifest)

SMALL_SHARD = 256 * 1024  # forces the tiny checkpoint (1.46 MB) into several shards
ROOT = Path(__file__).resolve().parent.parent


def totals(specs: dict[str, TensorSpec]) -> tuple[int, int]:
    return sum(s.nbytes for s in specs.values()), sum(num_parameters(n, s) for n, s in specs.items())


# ------------------------------------------------------------------ layout
def test_kimi_k3_layout_matches_the_release_totals():
    config = ModelConfig.kimi_k3()
    specs = expected_tensors(config)
    assert len(specs) == 497_220 - 168  # the release's tensors minus vision tower and projector
    nbytes, params = totals(specs)
    assert nbytes == config.checkpoint_bytes() == 1_559_965_606_912
    assert params == config.num_parameters() == 2_779_484_478_208
    layer = PREFIX + "model.layers.{}."
    table = {  # spot checks against model.md section 7
        layer.format(1) + "block_sparse_moe.experts.0.w1.weight_packed": ((3072, 1792), torch.uint8),
        layer.format(1) + "block_sparse_moe.experts.895.w3.weight_scale": ((3072, 112), torch.uint8),
        layer.format(92) + "block_sparse_moe.experts.7.w2.weight_packed": ((3584, 1536), torch.uint8),
        layer.format(92) + "block_sparse_moe.experts.7.w2.weight_scale": ((3584, 96), torch.uint8),
        layer.format(0) + "self_attn.A_log": ((128,), torch.float32),
        layer.format(0) + "self_attn.q_conv1d.weight": ((12288, 1, 4), torch.float32),
        layer.format(0) + "self_attn.f_b_proj.weight": ((12288, 128), torch.bfloat16),
        layer.format(0) + "mlp.down_proj.weight": ((7168, 33792), torch.bfloat16),
        layer.format(3) + "self_attn.q_b_proj.weight": ((18432, 1536), torch.bfloat16),
        layer.format(3) + "self_attn.kv_b_proj.weight": ((24576, 512), torch.bfloat16),
        layer.format(3) + "self_attn.g_proj.weight": ((12288, 7168), torch.bfloat16),
        layer.format(5) + "block_sparse_moe.gate.e_score_correction_bias": ((896,), torch.float32),
        layer.format(5) + "self_attention_res_proj.weight": ((1, 7168), torch.bfloat16),
        PREFIX + "lm_head.weight": ((163840, 7168), torch.bfloat16),
    }
    for name, (shape, dtype) in table.items():
        assert specs[name] == TensorSpec(shape, dtype), name
    assert PREFIX + "model.layers.3.self_attn.q_proj.weight" not in specs  # K3 has q_lora
    assert PREFIX + "model.layers.3.self_attn.A_log" not in specs  # MLA layer
    assert PREFIX + "model.layers.1.mlp.gate_proj.weight" not in specs  # MoE layer


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig.tiny(),
        ModelConfig.tiny_grouped(),
        ModelConfig.tiny_kimi_linear(),
        ModelConfig.tiny(mla_output_gate=False, mxfp4_experts=False, first_k_dense=2),
    ],
    ids=["tiny", "grouped", "kimi_linear", "no_gate_bf16_experts"],
)
def test_layout_totals_for_every_variant(config):
    specs = expected_tensors(config)
    assert totals(specs) == (config.checkpoint_bytes(), config.num_parameters())


def test_layout_branches():
    linear = expected_tensors(ModelConfig.tiny_kimi_linear())
    kda, mla = PREFIX + "model.layers.0.self_attn.", PREFIX + "model.layers.3.self_attn."
    assert linear[kda + "g_a_proj.weight"].shape == (16, 64) and linear[kda + "g_b_proj.weight"].shape == (64, 16)
    assert kda + "g_proj.weight" not in linear
    assert linear[mla + "q_proj.weight"].shape == (4 * 24, 64) and mla + "q_a_proj.weight" not in linear
    assert linear[kda + "A_log"].shape == (4,)
    plain = expected_tensors(ModelConfig.tiny(mla_output_gate=False, mxfp4_experts=False, first_k_dense=2))
    assert mla + "g_proj.weight" not in plain
    w1 = PREFIX + "model.layers.2.block_sparse_moe.experts.3.w1.weight"
    assert plain[w1] == TensorSpec((32, 32), torch.bfloat16)
    assert PREFIX + "model.layers.1.mlp.up_proj.weight" in plain
    assert not any(n.endswith("weight_packed") for n in plain)


def test_the_model_state_dict_is_the_layout():
    for config in (ModelConfig.tiny(), ModelConfig.tiny_kimi_linear()):
        model = KimiK3Model(config)
        state = model.state_dict()
        specs = {model_key(n): s for n, s in expected_tensors(config).items()}
        assert set(state) == set(specs)
        for key, t in state.items():
            want = (config.kda_heads,) if key.endswith("A_log") else specs[key].shape
            assert tuple(t.shape) == want, key


# --------------------------------------------------------- write and load
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    manifest = make_random_checkpoint(ModelConfig.tiny(), out, seed=0, max_shard_bytes=SMALL_SHARD)
    assert manifest["num_shards"] >= 4
    return out


def test_written_files_and_manifest(tiny_dir):
    config = ModelConfig.tiny()
    index = json.loads((tiny_dir / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert set(index["weight_map"]) == set(expected_tensors(config))
    assert index["metadata"]["total_size"] == config.checkpoint_bytes()
    assert read_config(tiny_dir) == config
    manifest = read_manifest(tiny_dir)
    assert manifest["config_hash"] == config.config_hash()
    assert set(manifest["shards"]) == set(files)
    assert manifest["total_bytes"] == sum((tiny_dir / f).stat().st_size for f in files)
    assert manifest["fingerprint"] == fingerprint(tiny_dir) and len(fingerprint(tiny_dir)) == 16
    assert verify_manifest(tiny_dir)["fingerprint"] == fingerprint(tiny_dir)


def test_tensor_round_trip_is_exact(tmp_path):
    config = ModelConfig.tiny_kimi_linear()
    tensors = random_checkpoint_tensors(config, seed=3)
    write_checkpoint(tensors, config, tmp_path, max_shard_bytes=SMALL_SHARD)
    back = load_tensors(tmp_path, lambda name: True)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_model_round_trip_is_exact(tiny_dir, tmp_path):
    config = ModelConfig.tiny()
    a = KimiK3Model(config)
    report = load_checkpoint(a, tiny_dir, progress=False)
    assert report["tensors"] == len(expected_tensors(config)) and report["skipped"] == 0
    raw = load_tensors(tiny_dir, lambda n: True)
    for key, t in a.state_dict().items():
        src = raw[PREFIX + key]
        if key.endswith("A_log"):
            src = src[: config.kda_heads]
        assert t.dtype == (torch.uint8 if src.dtype == torch.uint8 else torch.float32)
        assert torch.equal(t, src.to(t.dtype)), key
    # model -> checkpoint -> another model gives the same state dict
    write_checkpoint(state_dict_to_checkpoint_tensors(a.state_dict(), config), config, tmp_path / "again",
                     max_shard_bytes=SMALL_SHARD)
    b = KimiK3Model(config, seed=1)
    assert not torch.equal(b.lm_head.weight, a.lm_head.weight)
    load_checkpoint(b, tmp_path / "again", progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # same bytes as the original (A_log padded back with zeros), so the same fingerprint
    again = load_tensors(tmp_path / "again", lambda n: True)
    assert all(torch.equal(again[n], raw[n]) for n in raw)
    assert fingerprint(tmp_path / "again") == fingerprint(tiny_dir)


def test_bf16_model_loads_bf16_and_keeps_fp32_extras(tiny_dir):
    config = ModelConfig.tiny()
    model = KimiK3Model(config, dtype=torch.bfloat16)
    load_checkpoint(model, tiny_dir, verify=False, progress=False)
    state = model.state_dict()
    raw = load_tensors(tiny_dir, ["lm_head.weight", "model.layers.0.self_attn.dt_bias"])
    assert state["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(state["lm_head.weight"], raw["lm_head.weight"])
    assert state["model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert torch.equal(state["model.layers.0.self_attn.dt_bias"], raw["model.layers.0.self_attn.dt_bias"])


def test_state_dict_conversion_pads_a_log():
    config = ModelConfig.tiny()
    model = KimiK3Model(config)
    tensors = state_dict_to_checkpoint_tensors(model.state_dict(), config)
    a_log = tensors[PREFIX + "model.layers.0.self_attn.A_log"]
    assert a_log.shape == (config.a_log_size,) and a_log.dtype == torch.float32
    assert torch.equal(a_log[: config.kda_heads], model.state_dict()["model.layers.0.self_attn.A_log"])
    assert (a_log[config.kda_heads:] == 0).all()
    assert tensors[PREFIX + "lm_head.weight"].dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        state_dict_to_checkpoint_tensors({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
                                         config)


# ------------------------------------------------------------- integrity
def test_corrupted_shard_is_detected_and_named(tiny_dir, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, copy)
    victim = sorted(read_manifest(copy)["shards"])[1]
    data = bytearray((copy / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / victim).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=victim):
        verify_manifest(copy)
    with pytest.raises(CheckpointError, match=victim):
        load_checkpoint(KimiK3Model(ModelConfig.tiny()), copy, progress=False)
    (copy / victim).unlink()
    with pytest.raises(CheckpointError, match=f"{victim} is missing"):
        verify_manifest(copy)


def test_missing_manifest_says_how_to_make_one(tmp_path):
    config = ModelConfig.tiny()
    write_checkpoint(random_checkpoint_tensors(config), config, tmp_path)
    (tmp_path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="write_manifest"):
        load_checkpoint(KimiK3Model(config), tmp_path, progress=False)
    assert write_manifest(tmp_path)["config_hash"] == config.config_hash()
    verify_manifest(tmp_path)


def test_fingerprint_is_deterministic(tiny_dir, tmp_path):
    config = ModelConfig.tiny()
    same = make_random_checkpoint(config, tmp_path / "same", seed=0, max_shard_bytes=SMALL_SHARD)
    other = make_random_checkpoint(config, tmp_path / "other", seed=1, max_shard_bytes=SMALL_SHARD)
    assert same["fingerprint"] == fingerprint(tiny_dir)
    assert other["fingerprint"] != same["fingerprint"]
    assert same["created"] and same["shards"] == read_manifest(tiny_dir)["shards"]


# -------------------------------------------------------- mismatched files
def broken_checkpoint(tmp_path, edit) -> Path:
    config = ModelConfig.tiny()
    tensors = random_checkpoint_tensors(config)
    edit(tensors)
    write_checkpoint(tensors, config, tmp_path, strict=False)
    return tmp_path


def test_missing_tensor_names_the_tensor_and_shape(tmp_path):
    name = PREFIX + "model.layers.5.self_attn.b_proj.weight"
    path = broken_checkpoint(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor .*layers\.5\.self_attn\.b_proj\.weight.*\[4, 64\]"):
        load_checkpoint(KimiK3Model(ModelConfig.tiny()), path, progress=False)


def test_misshapen_tensor_names_both_shapes(tmp_path):
    name = PREFIX + "model.layers.3.self_attn.kv_b_proj.weight"
    path = broken_checkpoint(tmp_path, lambda t: t.__setitem__(name, torch.zeros(128, 16, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight has shape \[128, 16\].*expects \[128, 32\]"):
        load_checkpoint(KimiK3Model(ModelConfig.tiny()), path, progress=False)


def test_unexpected_text_tensor_is_an_error(tmp_path):
    name = PREFIX + "model.layers.0.self_attn.rotary_inv_freq"
    path = broken_checkpoint(tmp_path, lambda t: t.__setitem__(name, torch.zeros(4)))
    with pytest.raises(CheckpointError, match="unexpected tensor .*rotary_inv_freq"):
        load_checkpoint(KimiK3Model(ModelConfig.tiny()), path, progress=False)


def test_unquantised_experts_for_an_mxfp4_model_get_a_hint(tmp_path):
    config = ModelConfig.tiny(mxfp4_experts=False)
    write_checkpoint(random_checkpoint_tensors(config), config, tmp_path)
    model = KimiK3Model(ModelConfig.tiny())
    with pytest.raises(CheckpointError, match="mxfp4_experts"):  # caught by the config comparison first
        load_checkpoint(model, tmp_path, progress=False)
    model.config = config  # bypass the config check to reach the per-tensor message
    with pytest.raises(CheckpointError, match="unquantised"):
        load_checkpoint(model, tmp_path, progress=False)


def test_config_mismatch_is_an_error(tiny_dir):
    with pytest.raises(CheckpointError, match="n_group"):
        load_checkpoint(KimiK3Model(ModelConfig.tiny_grouped()), tiny_dir, progress=False)


def test_strict_write_rejects_wrong_dtype(tmp_path):
    config = ModelConfig.tiny()
    tensors = random_checkpoint_tensors(config)
    name = PREFIX + "model.layers.0.self_attn.A_log"
    tensors[name] = tensors[name].bfloat16()
    with pytest.raises(CheckpointError, match="A_log"):
        write_checkpoint(tensors, config, tmp_path)


def test_vision_tensors_are_skipped(tmp_path):
    vision = {"vision_tower.blocks.0.attn.qkv.weight": torch.ones(8, 4, dtype=torch.bfloat16),
              "mm_projector.proj.weight": torch.ones(64, 8, dtype=torch.bfloat16)}
    path = broken_checkpoint(tmp_path, lambda t: t.update(vision))
    assert set(vision) <= set(read_weight_map(path))
    report = load_checkpoint(KimiK3Model(ModelConfig.tiny()), path, progress=False)
    assert report["skipped"] == 2


@pytest.mark.parametrize("shape", ["padded", "kimi_linear"])
def test_a_log_layouts_load(tmp_path, shape):
    config = ModelConfig.tiny()
    name = PREFIX + "model.layers.1.self_attn.A_log"
    wanted = torch.log(torch.arange(1, config.kda_heads + 1, dtype=torch.float32))

    def edit(t):
        if shape == "padded":
            t[name] = torch.cat([wanted, torch.full((config.a_log_size - config.kda_heads,), 99.0)])
        else:
            t[name] = wanted.reshape(1, 1, config.kda_heads, 1)

    path = broken_checkpoint(tmp_path, edit)
    model = KimiK3Model(config)
    load_checkpoint(model, path, progress=False)
    assert torch.equal(model.state_dict()["model.layers.1.self_attn.A_log"], wanted)


def test_a_log_too_short_is_an_error(tmp_path):
    name = PREFIX + "model.layers.1.self_attn.A_log"
    path = broken_checkpoint(tmp_path, lambda t: t.__setitem__(name, torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"A_log has shape \[2\].*expects \[4\]"):
        load_checkpoint(KimiK3Model(ModelConfig.tiny()), path, progress=False)


def test_load_tensors_opens_only_the_needed_shards(tiny_dir, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, copy)
    weight_map = read_weight_map(copy)
    wanted = ["model.layers.7.block_sparse_moe.experts.3.w2.weight_packed",
              PREFIX + "model.layers.7.block_sparse_moe.experts.3.w2.weight_scale"]
    needed = {weight_map[PREFIX + model_key(n)] for n in wanted}
    for shard in set(weight_map.values()) - needed:
        (copy / shard).unlink()  # any attempt to open these would now fail
    assert len(set(weight_map.values()) - needed) >= 3
    got = load_tensors(copy, wanted)
    assert set(got) == set(wanted)
    reference = load_tensors(tiny_dir, wanted)
    assert all(torch.equal(got[k], reference[k]) for k in wanted)
    assert got[wanted[0]].dtype == torch.uint8 and got[wanted[0]].shape == (32, 16)
    by_predicate = load_tensors(copy, lambda n: n.startswith(PREFIX + "model.layers.7.block_sparse_moe.experts.3.w2"))
    assert set(by_predicate) == {PREFIX + model_key(n) for n in wanted}
    with pytest.raises(CheckpointError, match="no_such_tensor"):
        load_tensors(copy, ["no_such_tensor"])


def test_checkpoint_without_index_is_read_from_headers(tmp_path):
    tensors = {"language_model.a": torch.ones(3), "language_model.b": torch.zeros(2, dtype=torch.uint8)}
    save_file(tensors, tmp_path / "model.safetensors")
    assert read_weight_map(tmp_path) == {n: "model.safetensors" for n in tensors}
    assert torch.equal(load_tensors(tmp_path, ["a"])["a"], torch.ones(3))


# ------------------------------------------ one loader, with a selection
def record_opened_files(monkeypatch) -> list[str]:
    """The shard files the checkpoint module opens from now on (its own safe_open, wrapped)."""
    from inference.model import checkpoint as module

    opened, real = [], module.safe_open

    def recording(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, "safe_open", recording)
    return opened


def test_a_shard_and_the_whole_model_load_the_same_tensors_through_one_loader(tiny_dir, monkeypatch):
    from inference.planning import Plan
    from inference.sharding import worker

    config = ModelConfig.tiny()
    assert worker.load_checkpoint is load_checkpoint  # the shard worker has no loader of its own
    full = KimiK3Model(config, random_init=False)
    load_checkpoint(full, tiny_dir, progress=False)
    whole = full.state_dict()
    plan = Plan.simple(config, 3, "both", memory_bytes=1 << 30)
    weight_map = read_weight_map(tiny_dir)
    holders: dict[str, list[int]] = {}
    for rank in range(3):
        opened = record_opened_files(monkeypatch)
        shard = worker.build_shard_model(config, plan, rank, str(tiny_dir))
        held = {k: v for k, v in shard.state_dict().items() if not v.is_meta}
        assert 0 < len(held) < len(whole)
        for key, t in held.items():
            assert t.dtype == whole[key].dtype and torch.equal(t, whole[key]), (rank, key)
            holders.setdefault(key, []).append(rank)
        # only the files holding this rank's tensors were opened (headers and data)
        assert set(opened) == {weight_map[PREFIX + k] for k in held}
    assert set(holders) == set(whole)  # the plan's shards together hold the whole model
    for key, ranks in holders.items():
        if tensor_site(key).kind != "expert":
            assert len(ranks) == 1, (key, ranks)  # a layer's own tensors live on its home rank only


@pytest.mark.parametrize("first, end, embedding, head", [(0, 3, True, False), (4, 9, False, True), (5, 5, False, False)])
def test_a_stage_selection_loads_only_its_layers(tiny_dir, monkeypatch, first, end, embedding, head):
    from inference.sharding.worker import model_skeleton

    config = ModelConfig.tiny()
    full = KimiK3Model(config, random_init=False)
    load_checkpoint(full, tiny_dir, progress=False)
    whole = full.state_dict()
    opened = record_opened_files(monkeypatch)
    stage = model_skeleton(config, torch.float32, on="meta")
    select = TensorSelection.stage(first, end, embedding=embedding, head=head)
    report = load_checkpoint(stage, tiny_dir, verify=False, progress=False, select=select)
    held = {k: v for k, v in stage.state_dict().items() if not v.is_meta}

    def wanted(key: str) -> bool:
        site = tensor_site(key)
        return {"embedding": embedding, "head": head}.get(site.kind, site.layer is not None and first <= site.layer < end)

    assert set(held) == {k for k in whole if wanted(k)} and report["tensors"] == len(held)
    assert all(torch.equal(held[k], whole[k]) for k in held)
    weight_map = read_weight_map(tiny_dir)
    assert set(opened) == {weight_map[PREFIX + k] for k in held}
    if first < end:  # a stage's layers include their MoE experts
        assert any(tensor_site(k).kind == "expert" for k in held) == any(config.is_moe(i) for i in range(first, end))


def test_tensor_sites_name_every_tensor_and_refuse_strangers():
    config = ModelConfig.tiny()
    kinds = {tensor_site(n).kind for n in expected_tensors(config)}
    assert kinds == {"embedding", "head", "layer", "expert"}
    site = tensor_site(PREFIX + "model.layers.7.block_sparse_moe.experts.3.w2.weight_packed")
    assert (site.kind, site.layer, site.expert) == ("expert", 7, 3)
    assert tensor_site("model.layers.7.block_sparse_moe.gate.weight") == TensorSite("layer", 7)
    for stranger in ("model.layers.x.input_layernorm.weight", "model.blocks.0.weight", "vision_tower.patch"):
        with pytest.raises(CheckpointError, match="outside the Kimi K3 layout"):
            tensor_site(stranger)
    with pytest.raises(ValueError, match="first <= end"):
        TensorSelection.stage(5, 2, embedding=False, head=False)


# ------------------------------------------------- one random initialisation
@pytest.mark.parametrize("preset, seed", [("tiny", 0), ("tiny", 5), ("tiny_kimi_linear", 2)])
def test_the_seeded_model_is_the_seeded_checkpoint(tmp_path, preset, seed):
    """`KimiK3Model(config, seed=s)` and `make_random_checkpoint(config, seed=s)` loaded back are one network."""
    config = ModelConfig.preset(preset)
    built = KimiK3Model(config, seed=seed)
    make_random_checkpoint(config, tmp_path, seed=seed, max_shard_bytes=SMALL_SHARD)
    loaded = KimiK3Model(config, random_init=False)
    load_checkpoint(loaded, tmp_path, progress=False)
    a, b = built.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    # the model's tensors written out are the checkpoint's bytes, so the same fingerprint
    write_checkpoint(state_dict_to_checkpoint_tensors(a, config), config, tmp_path / "from_model",
                     max_shard_bytes=SMALL_SHARD)
    assert fingerprint(tmp_path / "from_model") == fingerprint(tmp_path)
    ids = [torch.tensor(list(b"one network")), torch.tensor(list(b"two"))]
    with torch.no_grad():
        la = built(ids, [built.new_cache() for _ in ids], all_logits=True)
        lb = loaded(ids, [loaded.new_cache() for _ in ids], all_logits=True)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    other = KimiK3Model(config, seed=seed + 1)
    assert not torch.equal(other.lm_head.weight, built.lm_head.weight)  # the seed matters


# ------------------------------------------------- random weights are useful
def next_token_entropy(model, prompt: bytes) -> tuple[float, int]:
    with torch.no_grad():
        logits = model([torch.tensor(list(prompt))], [model.new_cache()])[0]
    logp = torch.log_softmax(logits.float(), -1)
    return float(-(logp.exp() * logp).sum()), int(logits.argmax())


@pytest.mark.parametrize("preset", ["tiny", "tiny_grouped", "tiny_kimi_linear"])
def test_random_tiny_checkpoint_gives_non_degenerate_distributions(tmp_path, preset):
    config = ModelConfig.preset(preset)
    make_random_checkpoint(config, tmp_path, seed=0)
    model = KimiK3Model(config)
    load_checkpoint(model, tmp_path, progress=False)
    prompts = [b"Hello, world", b"The quick brown fox", b"1234567", b"\x00\x01zz", b"Kimi K3"]
    results = [next_token_entropy(model, p) for p in prompts]
    upper = math.log(config.vocab_size) - 0.5
    for prompt, (entropy, _) in zip(prompts, results):
        assert 0.5 < entropy < upper, (prompt, entropy)
    assert len({top for _, top in results}) >= 3  # different prompts, different predictions


# ------------------------------------------------------------------ script
def load_script():
    module = importlib.import_module("inference.model.make_checkpoint")
    return module


def test_script_writes_the_same_checkpoint(tiny_dir, tmp_path, capsys):
    script = load_script()
    out = tmp_path / "script"
    assert script.main(["--preset", "tiny", "--out", str(out), "--seed", "0", "--quiet",
                        "--max-shard-mb", str(SMALL_SHARD / 2**20)]) == 0
    assert fingerprint(tiny_dir) in capsys.readouterr().out
    assert fingerprint(out) == fingerprint(tiny_dir)
    assert script.main(["--preset", "tiny", "--out", str(out), "--quiet"]) == 1  # refuses to overwrite
    (tmp_path / "cfg.json").write_text(json.dumps(ModelConfig.tiny_grouped().to_hf_config()))
    assert script.main(["--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "g"), "--quiet"]) == 0
    assert read_config(tmp_path / "g") == ModelConfig.tiny_grouped()


def test_script_refuses_the_full_model_without_the_flag(tmp_path, capsys):
    assert load_script().main(["--preset", "kimi_k3", "--out", str(tmp_path / "k3")]) == 2
    captured = capsys.readouterr()
    assert "1,559,965,606,912 bytes" in captured.out and "--i-have-1.6TB" in captured.err
    assert not (tmp_path / "k3").exists()
