"""The validator's lazy block reference (inference/swarm/block_reference.py, inference/model/lazy.py): the same
outputs as the model held whole, bit for bit in fp32, under a memory budget it keeps by evicting, with what each
check read and held accounted."""
from __future__ import annotations

import pytest
import torch

from inference.model import CheckpointError, load_checkpoint
from inference.model.checkpoint import read_manifest
from inference.model.lazy import LazyK3Model
from inference.serving.builders import load_reference_model
from inference.swarm.block_reference import BlockReference, ModelReferences
from scoring.stage_checks import OpenedStep, recheck_opened

BLOCKS = [(0, 3), (3, 6), (6, 9), (9, 13)]


@pytest.fixture(scope="module")
def whole(tiny_checkpoint):
    return load_reference_model(tiny_checkpoint, verify=False)[0]


def session_inputs(whole, n=24, seed=5):
    """A prompt's token ids and the state entering each block, from the whole model."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n,), generator=g)
    refs = ModelReferences(whole)
    inputs = {0: ids}
    state = refs.run_block(0, 3, ids)
    for a, b in BLOCKS[1:]:
        inputs[a] = state
        state = refs.run_block(a, b, state)
    return inputs


def same_state(x, y) -> bool:
    return len(x.blocks) == len(y.blocks) and all(torch.equal(a, b) for a, b in zip(x.blocks, y.blocks)) \
        and torch.equal(x.partial, y.partial)


def test_every_block_equals_the_whole_model_bit_for_bit(whole, tiny_checkpoint):
    inputs = session_inputs(whole)
    lazy, held = BlockReference(tiny_checkpoint, 64 << 20), ModelReferences(whole)
    for a, b in BLOCKS:
        assert same_state(lazy.run_block(a, b, inputs[a]), held.run_block(a, b, inputs[a])), (a, b)
    out = held.run_block(9, 13, inputs[9])
    assert torch.equal(lazy.head(out, [0, 5, 23]), held.head(out, [0, 5, 23]))
    # and through a Stage, as a stage check re-runs a session: prefill, then decode steps
    for a, b in BLOCKS[1:3]:
        for refs in (lazy, held):
            refs[(a, b)].open("s")
        x = inputs[a]
        for lo, hi in ((0, 16), (16, 17), (17, 18)):
            part = type(x)((hi - lo,), [t[lo:hi] for t in x.blocks], x.partial[lo:hi])
            assert same_state(lazy[(a, b)].forward("s", lo, part), held[(a, b)].forward("s", lo, part))
    lazy.close()


def test_a_small_budget_evicts_and_still_computes_the_same(whole, tiny_checkpoint):
    inputs = session_inputs(whole)
    probe = LazyK3Model(tiny_checkpoint, 1 << 40)
    need, block = probe.working_set_bytes(), probe.block_bytes(3, 6)
    probe.close()
    assert need < block
    with pytest.raises(ValueError, match="below what one layer of this model needs"):
        BlockReference(tiny_checkpoint, need - 1)
    tight = BlockReference(tiny_checkpoint, need)
    held = ModelReferences(whole)
    for a, b in BLOCKS:
        with tight.track() as cost:
            got = tight.run_block(a, b, inputs[a])
        assert same_state(got, held.run_block(a, b, inputs[a]))
        assert cost.peak_resident_bytes <= need and cost.bytes_read > 0 and cost.tensors_read > 0
        assert cost.wall_s > 0 and cost.cpu_s >= 0
    assert tight.model.traffic.sites_evicted > 0 and tight.model.traffic.resident_bytes <= need
    with tight.track() as again:  # evicted sites are read again when needed
        tight.run_block(3, 6, inputs[3])
    assert again.bytes_read > 0
    roomy = BlockReference(tiny_checkpoint, 1 << 30)
    with roomy.track() as first:
        roomy.run_block(3, 6, inputs[3])
    with roomy.track() as second:  # everything it needs stayed resident
        roomy.run_block(3, 6, inputs[3])
    assert first.bytes_read > 0 and second.bytes_read == 0 and second.sites_evicted == 0


def test_a_stage_check_on_the_lazy_reference_equals_the_in_memory_one(whole, tiny_checkpoint):
    inputs = session_inputs(whole)
    held = ModelReferences(whole)
    held[(3, 6)].open("x")
    x = inputs[3]
    steps = []
    for k, (lo, hi) in enumerate(((0, 20), (20, 21), (21, 22))):
        part = type(x)((hi - lo,), [t[lo:hi] for t in x.blocks], x.partial[lo:hi])
        steps.append(OpenedStep(k, lo, "none", None, 0, None, part, held[(3, 6)].forward("x", lo, part)))
    lazy = BlockReference(tiny_checkpoint, 16 << 20)
    with lazy.track() as cost:
        c = recheck_opened(steps, lazy[(3, 6)], seed=7)
    assert c.ok and not any(c.bad) and max(c.rel_l2) == 0.0
    assert cost.bytes_read > 0 and 0 < cost.peak_resident_bytes <= 16 << 20


def test_a_tensor_altered_on_disk_is_refused_when_read(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    manifest = read_manifest(bad)
    name = "language_model.model.layers.7.self_attn.o_proj.weight"
    shard = next(f for f in sorted(bad.glob("*.safetensors")) if name in load_file(f))
    tensors = load_file(shard)
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, shard, metadata={"format": "pt"})
    assert manifest["tensors"][name]
    lazy = BlockReference(bad, 1 << 30)
    lazy.run_block(0, 3, torch.arange(8))  # other layers read fine
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        lazy.run_block(6, 9, session_state(lazy, 6))


def session_state(refs, start: int, n: int = 8):
    return refs.run_block(0, start, torch.arange(n))


def test_load_checkpoint_and_the_lazy_model_hold_the_same_tensors(tiny_checkpoint):
    lazy = LazyK3Model(tiny_checkpoint, 1 << 30)
    lazy.run_layers(0, 13, lazy.embed(torch.arange(6)), [lazy.new_cache()])
    whole = type(lazy).__mro__[1](lazy.config, random_init=False)
    load_checkpoint(whole, tiny_checkpoint, verify=False, progress=False)
    mine = {k: v for k, v in lazy.state_dict().items() if not v.is_meta}
    theirs = whole.state_dict()
    assert mine and all(torch.equal(v, theirs[k]) for k, v in mine.items())


def test_what_a_site_holds_follows_from_the_checkpoint_layout_alone(tiny_checkpoint):
    """inference.model.lazy.site_bytes (what the planner's validator costs use for Kimi K3) is what the lazy model
    holds and reads, site by site."""
    from inference.model.lazy import site_bytes

    lazy = LazyK3Model(tiny_checkpoint, 1 << 30)
    stored, held = site_bytes(lazy.config)
    assert held == lazy._site_bytes
    before = lazy.traffic.bytes_read
    lazy.run_layers(0, 3, lazy.embed(torch.arange(300) % 256), [lazy.new_cache()])
    read = sum(b for s, b in stored.items() if s[0] == "embedding" or (s[0] in ("layer", "expert") and s[1] < 3))
    assert lazy.traffic.bytes_read - before == read


def test_the_validator_runs_block_checks_only_when_told_and_within_its_budget(tiny_checkpoint, tmp_path):
    """--reference-memory GB (or --reference-engine, with 8 GB) turns the block reference on; nothing else does, and
    the whole model is loaded only by --reference-engine."""
    from neurons.validator_app.references import SharedReference, shared_reference
    from neurons.validator_app.settings import read_validator_settings

    base = ["--netuid", "1", "--checkpoint", str(tiny_checkpoint), "--canary-pool", str(tmp_path / "pool.json")]
    off = read_validator_settings(base, environ={})
    assert not off.block_checks and off.reference_memory == 0.0
    on = read_validator_settings(base + ["--reference-memory", "3"], environ={})
    assert on.block_checks and not on.reference_engine and on.reference_memory_bytes == 3 * 2**30
    engine = read_validator_settings(base + ["--reference-engine"], environ={})
    assert engine.block_checks and engine.reference_memory_bytes == 8 * 2**30
    assert read_validator_settings(base + ["--opening-rate", "1.5"], environ={}).problems()

    class Loop:
        pass

    loop = Loop()
    shared = shared_reference(loop, on)
    assert isinstance(shared, SharedReference) and shared_reference(loop, on) is shared and not shared.made
    ref = shared.get()
    assert shared.made and ref.memory_bytes == 3 * 2**30 and ref.model.traffic.bytes_read == 0  # nothing read yet
    assert ref.model.home_device == torch.device("cpu") and ref.model.dtype == torch.float32  # the defaults
    shared.close()
    # the block reference follows --device and --dtype, and says so when they cannot be
    bf16 = read_validator_settings(base + ["--reference-memory", "3", "--dtype", "bfloat16"], environ={})
    ref = shared_reference(Loop(), bf16).get()
    assert ref.model.dtype == torch.bfloat16
    ref.close()


def test_the_block_reference_takes_host_states_and_gives_host_states_from_its_device(whole, tiny_checkpoint):
    """Whatever its device, the reference reads states off the host (the wire's) and answers on the host, where the
    checks compare; its decode state and a Stage over it are on its device (here the CPU: tests/test_gpu.py runs
    the same on CUDA)."""
    inputs = session_inputs(whole)
    lazy = BlockReference(tiny_checkpoint, 16 << 20, device="cpu")
    assert lazy.model.input_device() == torch.device("cpu") and lazy[(3, 6)].device == torch.device("cpu")
    out = lazy.run_block(3, 6, inputs[3])
    assert out.partial.device.type == "cpu" and lazy.head(out, [1]).device.type == "cpu"
    cache = lazy.model.new_cache(range(3, 6))
    assert all(c.state.device.type == "cpu" for c in cache.layers if hasattr(c, "state"))
    lazy.close()
