"""The sharded runtime: real shard processes over gloo on loopback, against the single-process model.

One tiny random checkpoint per module; each shard configuration is started once and reused by the tests
that need it (starting a set costs a few seconds: every process imports torch and loads its weights).
"""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from inference.model import ModelConfig, make_random_checkpoint
from inference.model.checkpoint import PREFIX, expected_tensors
from inference.planning import Plan, RoutingRecorder, RoutingStats
from inference.serving import (EngineError, EngineSettings, EngineSpec, GenerationRequest, LocalEngine, SamplingParams,
                               TokenEvent, build_engine, load_reference_model)
from inference.sharding import ShardedModel, ShardFailure, ShardTimeouts
from inference.sharding.dense_split import head_part, layer_parts
from inference.sharding.messages import STEP, StepHeader, dispatch_specs, pack, packed_nbytes, unpack
from inference.sharding.worker import ExpertTable, build_shard_model, choose_expert_holders

CONFIG = ModelConfig.tiny()
ROOT = Path(__file__).resolve().parents[1]
TIMEOUTS = ShardTimeouts(comm=30.0, heartbeat=5.0, startup=120.0, keepalive=0.5)
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3tiny")
    make_random_checkpoint(CONFIG, path, seed=3)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, tokenizer, _ = load_reference_model(checkpoint)
    return model, tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One local set per placement kind, plus the 2-rank pipeline with rank 1 launched the documented way for
# another host (torchrun, `python -m inference.sharding.worker`), rank 0 spawned by the driver.
def split_last_stage_plan() -> Plan:
    """Two pipeline stages ([0] and [1, 2]); in the second every layer's attention, shared experts and the LM
    head are split over both ranks (dense split), its routed experts spread over them (expert parallel)."""
    plan = Plan.simple(CONFIG, 3, "both", memory_bytes=1 << 30)
    last = plan.stages[-1]
    groups = {layer: plan._host_group(last, plan.layer_home[layer], 2, f"layer {layer}") for layer in last.layers}
    return plan.with_dense_groups(CONFIG, groups, plan._host_group(last, plan.lm_head_rank, 2, "the LM head"))


CONFIGS = {
    "pipeline-2-torchrun": dict(shards=2, mode="pipeline"),
    "expert-3-replicas": dict(shards=3, mode="expert", replicas=16),
    "both-3": dict(shards=3, mode="both"),
    "expert-2-dense-split": dict(shards=2, mode="expert", dense_split=2),
    "pipeline-and-dense-split-3": dict(plan=split_last_stage_plan()),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def sharded(request, checkpoint):
    kwargs = CONFIGS[request.param]
    launcher = None
    if request.param.endswith("torchrun"):
        port = _free_port()
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        launcher = subprocess.Popen(
            [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "1",
             "--max-restarts", "0", "-m", "inference.sharding.worker", "--dist-addr", f"127.0.0.1:{port}",
             "--checkpoint", str(checkpoint), "--rank-offset", "1"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL)
        kwargs = dict(kwargs, store=f"127.0.0.1:{port}")
    try:
        model = ShardedModel(checkpoint, timeouts=TIMEOUTS, threads_per_rank=1, **kwargs)
    except BaseException:
        if launcher is not None:
            launcher.kill()
            launcher.wait()
        raise
    model.test_name = request.param
    yield model
    model.close()
    if launcher is not None:
        # a clean close stops every rank, so torchrun's worker ends with success and torchrun with it
        assert launcher.wait(timeout=60) == 0


def workload(model) -> list[list[torch.Tensor]]:
    """Prefill of sequences of different lengths in one batch, batched decode, then a mixed step in which a
    sequence decodes, one takes a prefill chunk and a new one joins, and a freed sequence's slot is gone."""
    g = torch.Generator().manual_seed(11)

    def tokens(n):
        return torch.randint(0, CONFIG.vocab_size, (n,), generator=g)

    caches = [model.new_cache() for _ in range(4)]
    outs = [model.forward([tokens(n) for n in (9, 4, 1, 13)], caches, all_logits=True)]
    for _ in range(3):
        outs.append(model.forward([tokens(1) for _ in caches], caches))
    new = model.new_cache()
    outs.append(model.forward([tokens(1), tokens(5), tokens(6)], [caches[0], caches[1], new]))
    del caches[2]  # dropped: its slot is freed in the shards with the next step
    outs.append(model.forward([tokens(1), tokens(1), tokens(2)], [caches[2], new, caches[0]], all_logits=True))
    return outs


@pytest.fixture(scope="module")
def reference_outputs(reference):
    model, _ = reference
    recorder = RoutingRecorder.attach(model)
    outs = workload(model)
    model.routing_observer = None
    return outs, recorder.to_stats()


def test_logits_match_the_single_process_model(sharded, reference_outputs, tmp_path):
    expected, expected_routing = reference_outputs
    sharded.dump_routing_stats(reset=True)  # count only this workload
    got = workload(sharded)
    assert len(got) == len(expected)
    worst = 0.0
    for step, (a, b) in enumerate(zip(expected, got)):
        assert [t.shape for t in a] == [t.shape for t in b], f"step {step}"
        worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(a, b)))
        assert [x.argmax(-1).tolist() for x in a] == [y.argmax(-1).tolist() for y in b], f"greedy tokens, step {step}"
    assert worst <= ATOL, f"{sharded.test_name}: sharded logits differ by {worst:.2e}"

    # routing statistics gathered from every home rank: the planner's format, the same counts as the
    # single-process model's recorder, and tokens x top-k selections per layer
    path = tmp_path / "routing.json"
    sharded.dump_routing_stats(path)
    stats = RoutingStats.load(path)
    stats.validate(CONFIG)
    tokens = sum(t.shape[0] for t in expected[0]) + 3 * 4 + (1 + 5 + 6) + (1 + 1 + 2)
    k = CONFIG.experts_per_token
    assert sorted(stats.layers) == list(CONFIG.moe_layers)
    for layer, rec in stats.layers.items():
        ref = expected_routing.layers[layer]
        assert rec.tokens == tokens
        assert int(rec.load.sum()) == tokens * k
        assert int(rec.pair_count.sum()) == tokens * k * (k - 1) // 2
        assert rec.load.tolist() == ref.load.tolist()
        assert sorted(zip(rec.pair_i.tolist(), rec.pair_j.tolist(), rec.pair_count.tolist())) == \
            sorted(zip(ref.pair_i.tolist(), ref.pair_j.tolist(), ref.pair_count.tolist()))


def test_each_rank_holds_only_its_part(sharded, reference):
    model, _ = reference
    whole = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    expert = sum(t.numel() * t.element_size() for t in model.layers[1].block_sparse_moe.experts[0].buffers())
    replicas = sum(sharded.plan.replica_count(layer) for layer in sharded.plan.expert_placement)
    assert len(sharded.ranks) == sharded.world_size
    for info in sharded.ranks:
        if not sharded.plan.dense_groups:  # a split layer's skeleton has its part's shapes only
            assert info["model_bytes"] == whole
        assert 0 < info["resident_bytes"] < 0.75 * whole, info
        assert info["homed_layers"] == sharded.plan.layers_homed_on(info["rank"])
    # together the ranks hold the model exactly once, plus the replicas, plus (dense split) the parts every
    # rank of a group keeps whole: KDA's f_a_proj and o_norm; MLA's low-rank q_a and kv_a projections and norms
    copies = 0
    for layer, group in sharded.plan.dense_groups.items():
        attn = model.layers[layer].self_attn
        whole_parts = ((attn.q_a_proj, attn.q_a_layernorm, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm)
                       if model.layers[layer].is_mla else (attn.f_a_proj, attn.o_norm))
        copies += (len(group) - 1) * sum(p.numel() * p.element_size() for m in whole_parts for p in m.parameters())
    assert sum(info["resident_bytes"] for info in sharded.ranks) == whole + replicas * expert + copies
    for info in sharded.ranks:
        assert info["dense_split_layers"] == sharded.plan.layers_split_with(info["rank"])
    assert len({info["pid"] for info in sharded.ranks}) == sharded.world_size
    # a rank of a dense split read only its parts of the tensors it shares: the most it held of one of them
    # while loading is its largest part (tests/test_dense_split_loading.py checks every read)
    specs = expected_tensors(CONFIG)
    for info in sharded.ranks:
        r, plan = info["rank"], sharded.plan
        parts = {f"model.layers.{layer}.{k}": p for layer, g in plan.dense_groups.items() if r in g
                 for k, p in layer_parts(CONFIG, layer, g.index(r), len(g)).items() if not k.endswith("A_log")}
        if len(plan.head_group()) > 1 and r in plan.head_group():
            parts["lm_head.weight"] = head_part(CONFIG, plan.head_group().index(r), len(plan.head_group()))
        sizes = {k: (specs[PREFIX + k].nbytes // specs[PREFIX + k].shape[p.dim] * (p.stop - p.start),
                     specs[PREFIX + k].nbytes) for k, p in parts.items()}
        assert info["largest_part_read"] == max((part for part, _ in sizes.values()), default=0), info
        if parts:
            assert info["largest_part_read"] < max(whole for _, whole in sizes.values())
        assert info["checkpoint_bytes_read"] > 0


def test_bad_input_is_refused_without_breaking_the_set(sharded):
    cache = sharded.new_cache()
    with pytest.raises(ValueError, match="out of range"):
        sharded.forward([torch.tensor([1, CONFIG.vocab_size])], [cache])
    with pytest.raises(ValueError, match="twice"):
        sharded.forward([torch.tensor([1]), torch.tensor([2])], [cache, cache])
    with pytest.raises(ValueError, match="new_cache"):
        sharded.forward([torch.tensor([1])], [object()])
    assert sharded.health().ok
    assert sharded.forward([torch.tensor([1, 2, 3])], [cache])[0].shape == (CONFIG.vocab_size,)


# ------------------------------------------------------------------ through the serving engine
SETTINGS = EngineSettings(max_context=4096, step_token_budget=64, min_prefill_chunk=16, max_concurrent_sequences=8)
PROMPTS = [[(5 * i + 7 * j) % 256 for j in range(n)] for i, n in enumerate((12, 30, 3))]


async def _generate(engine, prompt, max_tokens, on_token=None):
    tokens = []
    async for ev in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))):
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
            if on_token is not None:
                on_token(len(tokens))
    return tokens


async def _wait_ok(engine, limit: float) -> float:
    start = time.monotonic()
    while not engine.health().ok:
        assert time.monotonic() - start < limit, f"engine still unhealthy: {engine.health()}"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _fault_fails_request_then_recovers(engine, sig: int, expected: list[int]) -> None:
    """Send `sig` to shard rank 1 while a request streams: the request fails with a clear EngineError within
    10 s, the engine is unhealthy until recovery, every old shard process is gone, and the next request works."""
    model = engine.model
    old = model.pids
    victim = old[1]
    hit: dict[str, float] = {}

    def on_token(n):
        if n == 3 and "at" not in hit:
            os.kill(victim, sig)
            hit["at"] = time.monotonic()

    with pytest.raises(EngineError) as failure:
        await _generate(engine, PROMPTS[0], 400, on_token)
    took = time.monotonic() - hit["at"]
    assert failure.value.code == "engine_failure"
    assert "rank 1" in failure.value.message
    assert took < 10.0, f"the request failed {took:.1f} s after the fault"
    assert not engine.health().ok
    assert model.health().status in ("down", "degraded")  # failed, or the fresh set is still starting
    await _wait_ok(engine, 120)
    assert model.health().ok
    assert set(model.pids.values()).isdisjoint(old.values())
    for pid in old.values():
        assert not psutil.pid_exists(pid), f"old shard process {pid} is still there"
    zombies = [c.pid for c in psutil.Process().children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []
    assert await _generate(engine, PROMPTS[1], len(expected)) == expected


@pytest.mark.timeout(400)
async def test_engine_generates_like_the_reference_and_survives_lost_shards(checkpoint, reference):
    ref_model, tokenizer = reference
    async with LocalEngine(ref_model, tokenizer, SETTINGS) as ref_engine:
        expected = await asyncio.gather(*(_generate(ref_engine, p, 10) for p in PROMPTS))

    engine = build_engine(EngineSpec(kind="sharded", checkpoint=str(checkpoint), shards=2, shard_mode="expert",
                                     settings=SETTINGS))
    async with engine:
        caps = engine.capabilities()
        assert caps.engine_kind == "sharded" and caps.layout["processes"] == 2
        got = await asyncio.gather(*(_generate(engine, p, 10) for p in PROMPTS))
        assert got == expected

        stale = engine.model.new_cache()
        await _fault_fails_request_then_recovers(engine, signal.SIGKILL, expected[1])
        with pytest.raises(ValueError, match="restarted"):
            engine.model.forward([torch.tensor([1])], [stale])
        await _fault_fails_request_then_recovers(engine, signal.SIGSTOP, expected[1])
        assert engine.model.restarts == 2
        pids = list(engine.model.pids.values())
    for pid in pids:  # stopping the engine stops its shards
        assert not psutil.pid_exists(pid)


def test_transfer_timeout_catches_a_hang_the_heartbeat_would_not(checkpoint):
    """With the heartbeat turned far down, a stopped shard is still caught by the per-transfer timeout."""
    timeouts = ShardTimeouts(comm=3.0, heartbeat=300.0, startup=120.0, keepalive=0.3)
    with ShardedModel(checkpoint, shards=2, mode="pipeline", timeouts=timeouts, threads_per_rank=1) as model:
        cache = model.new_cache()
        model.forward([torch.arange(5)], [cache])
        os.kill(model.pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ShardFailure, match="no answer within 3 s"):
            model.forward([torch.tensor([7])], [cache])
        assert time.monotonic() - start < 10
        assert model.health().status == "down"
        with pytest.raises(ShardFailure, match="recover"):
            model.forward([torch.tensor([7])], [model.new_cache()])
        pids = list(model.pids.values())
    for pid in pids:
        assert not psutil.pid_exists(pid)


# ------------------------------------------------------------------ pieces, without processes
def test_meta_and_cpu_skeletons_load_the_same_shard(checkpoint, reference):
    """Large models are built on the meta device, small ones on the CPU and then emptied: same shard."""
    model, _ = reference
    plan = Plan.simple(CONFIG, 3, "both", memory_bytes=1 << 30)
    full = model.state_dict()
    for rank in (0, 2):  # the embedding's rank and the LM head's
        shards = [build_shard_model(CONFIG, plan, rank, str(checkpoint), skeleton=on) for on in ("meta", "cpu")]
        held = [{k: v for k, v in m.state_dict().items() if not v.is_meta} for m in shards]
        assert held[0].keys() == held[1].keys() and 0 < len(held[0]) < len(full)
        assert all(held[0][k].dtype == full[k].dtype and torch.equal(held[0][k], full[k]) for k in held[0])
        assert all(torch.equal(held[0][k], held[1][k]) for k in held[0])
        assert set(held[0]) >= {f"model.layers.{i}.input_layernorm.weight" for i in plan.layers_homed_on(rank)}


def test_replica_choice_touches_few_devices():
    # experts 0, 1 only on rank 1; 2 on ranks 0 (home) and 2; 3 on ranks 1 and 2; 4 on ranks 2 and 3; 5 on 3 and 2
    table = ExpertTable.from_holders([[1], [1], [2, 0], [2, 1], [2, 3], [3, 2]])
    ids = torch.tensor([
        [0, 3],  # 3 goes where 0 already goes: rank 1
        [2, 5],  # 2 prefers the home rank 0; 5 then goes to the less loaded of 3 and 2
        [4, 5],  # 4 to the least loaded of 2, 3; 5 joins it
    ])
    assign = choose_expert_holders(ids, table, home=0)
    assert assign[0].tolist() == [1, 1]
    assert assign[1, 0] == 0
    assert assign[2, 0] == assign[2, 1]
    # every assignment is to a holder of its expert
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            assert int(assign[t, j]) in table.holders[int(ids[t, j])]
    # without replicas the choice is the primary holder, as a lookup
    plain = ExpertTable.from_holders([[e % 3] for e in range(6)])
    assert choose_expert_holders(ids, plain, home=0).tolist() == (ids % 3).tolist()


def test_routing_recorder_dense_and_sparse_agree(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(50)])
    dense, sparse = RoutingRecorder(16, 4), RoutingRecorder(16, 4)
    sparse.DENSE_MAX_EXPERTS = 0
    for rec in (dense, sparse):
        rec.observe(3, ids[:20])
        rec.observe(3, ids[20:])
        rec.observe(5, ids[:7])
    def table(stats):
        return {layer: (rec.tokens, rec.load.tolist(),
                        sorted(zip(rec.pair_i.tolist(), rec.pair_j.tolist(), rec.pair_count.tolist())))
                for layer, rec in stats.layers.items()}

    a, b = table(dense.to_stats()), table(sparse.to_stats())
    assert a == b
    assert a[3][0] == 50 and sum(a[3][1]) == 200
    pairs = {}
    for row in ids[:7].tolist():
        for x in row:
            for y in row:
                if x < y:
                    pairs[(x, y)] = pairs.get((x, y), 0) + 1
    assert {(i, j): c for i, j, c in a[5][2]} == pairs
    dense.save(tmp_path / "r.json")
    assert RoutingStats.load(tmp_path / "r.json").layers[3].tokens == 50


def test_message_layouts_round_trip():
    header = StepHeader(STEP, 7, [4, 9], [3, 1], torch.tensor([5, 6, 7, 8]), [2], all_logits=True)
    meta, payload = header.encode()
    assert StepHeader.payload_len(meta.tolist()) == payload.numel()
    back = StepHeader.decode(meta.tolist(), payload)
    assert (back.slots, back.lengths, back.ids.tolist(), back.freed, back.all_logits) == \
        ([4, 9], [3, 1], [5, 6, 7, 8], [2], True)
    assert back.logit_rows == 4
    z = torch.randn(3, 32, dtype=torch.bfloat16)
    parts = [torch.tensor([0, 2, 1, 2]), torch.tensor([5, 9, 1, 3]), torch.rand(4), z]
    specs = dispatch_specs(3, 4, 32, torch.bfloat16)
    buf = pack(parts)
    assert buf.numel() == packed_nbytes(specs)
    for a, b in zip(parts, unpack(buf, specs)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        unpack(buf[:-2], specs)
