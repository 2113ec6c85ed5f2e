"""Block plans (`Plan.layer_range`): a placement of one contiguous block of layers, what a swarm stage miner
serves over its own devices (issue 18). Its memory counts only what its ranks load: the block's layers, their
experts and per-session state, the embedding only when the block starts at 0, the head only when it ends with
the last layer.

- tiny model: every rank's planned weight bytes equal what the loader reads for it (the checkpoint reads
  counted by `load_shard_model`, and `shard_read_bytes` from the config), and together they are exactly the
  block's tensors; the whole-model plan the stage used before prices more;
- Kimi K3: layers 24-35 over 8 x RTX 5090 (32 GB each, the swarm cluster file's device) validate as a block plan
  (expert parallel) while the whole-model accounting of the same 8 ranks overflows every rank; as a pipeline
  (2 layers per rank) the block does not fit either, and the error says by how much;
- a block plan refuses a `layers=` block it does not cover, by name;
- the committed whole-model plan files (deploy/plans, written before `layer_range` existed) load, validate and
  write back unchanged; block plans round-trip through YAML and JSON, and malformed block plans are refused;
- real processes: a shard set started from a block plan file reads per rank what the plan says.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from inference.model import ModelConfig
from inference.model.checkpoint import expected_tensors, make_random_checkpoint, model_key, tensor_site
from inference.planning import Plan, PlanError
from inference.planning.plan import (MemoryPolicy, compute_memory, kda_reserve_per_layer, layer_weights,
                                     mla_reserve_per_layer)
from inference.planning.planner import Cluster
from inference.sharding import worker
from inference.sharding.driver import ShardedModel
from inference.sharding.messages import ShardTimeouts
from inference.swarm.stage import LayerRange, block_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig.tiny()
GiB = 1 << 30
# with the embedding / a middle block across an Attention Residuals boundary / ending with the head
BLOCKS = [(0, 4), (3, 9), (5, TINY.num_layers)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("block_plan") / "ckpt"
    make_random_checkpoint(TINY, path, seed=3)
    return path


def block_tensor_bytes(config: ModelConfig, start: int, stop: int) -> int:
    """Bytes of every checkpoint tensor a block [start, stop) needs, counted from the tensor layout."""
    total = 0
    for name, spec in expected_tensors(config).items():
        site = tensor_site(model_key(name))
        if (site.kind == "embedding" and start == 0 or site.kind == "head" and stop == config.num_layers
                or site.layer is not None and start <= site.layer < stop):
            total += spec.nbytes
    return total


def tiny_block_plan(start: int, stop: int, mode: str, ranks: int = 2) -> Plan:
    return block_plan(TINY, LayerRange(start, stop, TINY.num_layers), ranks, mode, memory_bytes=GiB)


@pytest.mark.parametrize("mode", ["expert", "pipeline"])
@pytest.mark.parametrize("start, stop", BLOCKS)
def test_block_plan_memory_is_what_the_loader_reads(ckpt, start, stop, mode):
    plan = tiny_block_plan(start, stop, mode)
    assert plan.layer_range == (start, stop) and list(plan.block) == list(range(start, stop))
    assert all(plan.layer_home[i] is None for i in range(TINY.num_layers) if not start <= i < stop)
    assert set(plan.expert_placement) == {i for i in TINY.moe_layers if start <= i < stop}
    for rank, mem in enumerate(plan.memory):
        _, report = worker.load_shard_model(TINY, plan, rank, str(ckpt), layer_range=(start, stop))
        counted = worker.shard_read_bytes(TINY, plan, rank)  # from the plan alone: it knows its block
        assert report["bytes"] == counted["dense"] + counted["experts"] == mem.weights_dense + mem.weights_experts
        assert (counted["dense"], counted["experts"]) == (mem.weights_dense, mem.weights_experts)
    # one copy of each of the block's tensors, nothing else (no replicas, no split)
    assert sum(m.weights_dense + m.weights_experts for m in plan.memory) == block_tensor_bytes(TINY, start, stop)
    # per-session state only for the block's layers
    block = range(start, stop)
    kda_layers = sum(1 for i in block if not TINY.is_mla(i))
    mla_layers = sum(1 for i in block if TINY.is_mla(i))
    assert sum(m.kda_state for m in plan.memory) == kda_layers * kda_reserve_per_layer(TINY, plan.concurrency)
    assert sum(m.mla_cache for m in plan.memory) == mla_layers * mla_reserve_per_layer(
        TINY, plan.concurrency, plan.context, plan.memory_policy.cache_dtype_bytes)
    # the whole-model plan a block stage used before (layers outside it on the edge ranks) prices far more
    whole = Plan.simple(TINY, 2, mode, memory_bytes=GiB)
    assert whole.layer_range is None
    whole_weights = sum(m.weights_dense + m.weights_experts for m in whole.memory)
    assert whole_weights == block_tensor_bytes(TINY, 0, TINY.num_layers)
    assert sum(m.total for m in whole.memory) > sum(m.total for m in plan.memory)


def test_embedding_and_head_count_only_when_the_block_has_them():
    emb = 2 * TINY.vocab_size * TINY.hidden_size
    head = 2 * (TINY.vocab_size * TINY.hidden_size + 3 * TINY.hidden_size)
    for start, stop in [(0, 9), (3, 9), (3, TINY.num_layers), (0, 1)]:
        plan = tiny_block_plan(start, stop, "expert")
        assert (plan.has_embedding, plan.has_head) == (start == 0, stop == TINY.num_layers)
        for r, mem in enumerate(plan.memory):
            layers = sum(layer_weights(TINY, i).total_bytes for i in range(start, stop) if plan.layer_home[i] == r)
            extra = (emb if start == 0 and r == plan.embedding_rank else 0) + \
                (head if stop == TINY.num_layers and r == plan.lm_head_rank else 0)
            assert mem.weights_dense == layers + extra, (start, stop, r)


def k3_operator() -> tuple[int, MemoryPolicy]:
    """One swarm operator's device memory and the cluster file's memory policy (8 x RTX 5090 per machine)."""
    cluster = Cluster.load(ROOT / "inference/planning/clusters/swarm_rtx5090x8_wan.yaml")
    host = cluster.hosts[0]
    devices = [d for d in cluster.devices if d.host == host]
    assert len(devices) == 8 and len({d.memory_bytes for d in devices}) == 1
    return devices[0].memory_bytes, MemoryPolicy(**cluster.memory_policy)


def test_kimi_k3_block_over_8_rtx5090_fits_only_as_a_block_plan():
    k3 = ModelConfig.preset("kimi_k3")
    memory, policy = k3_operator()
    assert memory == 32 * 10**9
    layers = LayerRange.parse("24-35", k3.num_layers)
    plan = block_plan(k3, layers, 8, "expert", memory_bytes=memory, policy=policy)
    plan.validate(k3)  # fits
    assert plan.layer_range == (24, 36) and not plan.has_embedding and not plan.has_head
    block = range(24, 36)
    moe = [i for i in block if k3.is_moe(i)]
    want = sum(layer_weights(k3, i).total_bytes for i in block) + len(moe) * k3.num_experts * k3.expert_bytes()
    assert sum(m.weights_dense + m.weights_experts for m in plan.memory) == want  # no embedding, no head
    assert all(0 < m.free for m in plan.memory)
    # the whole-model accounting of the same 8 ranks (what a block stage planned before) overflows every rank
    with pytest.raises(PlanError, match="overflows") as whole:
        Plan.simple(k3, 8, "expert", memory_bytes=memory, policy=policy)
    assert all(f"rank {r} " in str(whole.value) for r in range(8))
    old = compute_memory(k3, plan.devices, [r % 8 for r in range(k3.num_layers)],
                         {i: [[(e + i) % 8] for e in range(k3.num_experts)] for i in k3.moe_layers},
                         0, (k3.num_layers - 1) % 8, plan.concurrency, plan.context, policy)
    assert all(m.total > m.capacity for m in old)
    assert min(m.total for m in old) > 5 * max(m.total for m in plan.memory)
    # as a pipeline the block puts 2 whole MoE layers (two layers' 896 experts) on 4 of the ranks: too much
    with pytest.raises(PlanError, match=r"rank 0 .* overflows by"):
        block_plan(k3, layers, 8, "pipeline", memory_bytes=memory, policy=policy)


def test_a_block_plan_refuses_layers_outside_it(ckpt, tmp_path):
    plan = tiny_block_plan(5, TINY.num_layers, "expert")
    for layers in [(0, 5), (3, 9), (4, TINY.num_layers)]:
        with pytest.raises(PlanError, match=r"the plan places layers \[5, 13\), not the requested block"):
            ShardedModel(ckpt, plan, layers=layers, start=False)
    path = tmp_path / "block.yaml"
    plan.save(path)
    with pytest.raises(PlanError, match=r"not the requested block \[0, 5\)"):
        ShardedModel(ckpt, path, layers=(0, 5), start=False)
    # inside it, the plan's own block, or no layers at all (it serves its block); a whole-model plan covers any
    for given, layers, want in [(plan, (5, TINY.num_layers), (5, TINY.num_layers)), (plan, (6, 9), (6, 9)),
                                (path, None, (5, TINY.num_layers)),
                                (Plan.simple(TINY, 2, "expert", memory_bytes=GiB), (6, 9), (6, 9))]:
        model = ShardedModel(ckpt, given, layers=layers, start=False)
        try:
            assert model.layer_range == want
        finally:
            model.close()


def test_committed_whole_model_plan_files_load_validate_and_write_back_unchanged():
    k3 = ModelConfig.preset("kimi_k3")
    files = sorted((ROOT / "deploy/plans").glob("*.json"))
    assert len(files) >= 2
    for path in files[:2]:
        data = json.loads(path.read_text())
        assert "layer_range" not in data
        plan = Plan.load(path)
        assert plan.layer_range is None and plan.block == range(k3.num_layers)
        assert plan.has_embedding and plan.has_head
        plan.validate(k3)  # the recorded memory is still what compute_memory says
        again = plan.to_dict()
        assert "layer_range" not in again
        for key in set(data) | set(again):
            if key != "conventions":  # the conventions gained the layer_range line
                assert again[key] == data[key], (path.name, key)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_block_plan_files_round_trip(tmp_path, suffix):
    plan = tiny_block_plan(3, 9, "pipeline", ranks=3)
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    data = yaml.safe_load(path.read_text()) if suffix == ".yaml" else json.loads(path.read_text())
    assert data["layer_range"] == [3, 9] and [rec["layer"] for rec in data["layers"]] == list(range(3, 9))
    back = Plan.load(path)
    back.validate(TINY)
    assert back.layer_range == (3, 9) and back.layer_home == plan.layer_home and back.memory == plan.memory
    assert back.to_dict() == plan.to_dict()


def test_malformed_block_plans_are_refused(tmp_path):
    plan = tiny_block_plan(3, 9, "expert")
    data = plan.to_dict()

    def refused(change, match):
        d = json.loads(json.dumps(data))
        change(d)
        with pytest.raises(PlanError, match=match):
            Plan.from_dict(d, source="block.json").validate(TINY)

    refused(lambda d: d.update(layer_range=[9, 3]), r"layer_range must be \[start, stop\)")
    refused(lambda d: d.update(layer_range=[3, "9"]), r"layer_range must be \[start, stop\)")
    refused(lambda d: d.update(layer_range=[3, 99]), r"layer_range \[3, 99\] does not fit")
    refused(lambda d: d.update(layer_range=[3, 8]), r"layers lists 6 records, the block \[3, 8\) has 5")

    def stage_short(d):
        d["stages"][-1]["layers"][1] = 8
    refused(stage_short, r"stages cover layers \[3, 8\), the block is \[3, 9\)")
    # the in-memory plan: a home, an expert placement or a dense split outside the block
    homes = list(plan.layer_home)
    homes[0] = 0
    with pytest.raises(PlanError, match=r"layers \[0\] lie outside the block \[3, 9\) but have a home"):
        dataclasses.replace(plan, layer_home=homes).validate(TINY)
    placement = dict(plan.expert_placement)
    placement[10] = [[0]] * TINY.num_experts
    with pytest.raises(PlanError, match="layer 10 lies outside the block"):
        dataclasses.replace(plan, expert_placement=placement).validate(TINY)
    with pytest.raises(PlanError, match="dense_split for layer 1, which lies outside"):
        dataclasses.replace(plan, dense_groups={1: (0, 1)}).validate(TINY)
    with pytest.raises(PlanError, match="has no LM head"):
        dataclasses.replace(plan, lm_head_group=(plan.lm_head_rank, 1 - plan.lm_head_rank)).validate(TINY)
    with pytest.raises(PlanError, match="outside this plan's block"):
        plan.home_of(10)


def test_a_shard_set_from_a_block_plan_file_reads_what_the_plan_says(ckpt, tmp_path):
    plan = tiny_block_plan(5, TINY.num_layers, "pipeline")
    path = tmp_path / "block.json"
    plan.save(path)
    model = ShardedModel(ckpt, path, threads_per_rank=1, timeouts=ShardTimeouts(startup=120.0))
    try:
        assert model.layer_range == (5, TINY.num_layers)
        assert len(model.ranks) == 2
        for info in model.ranks:
            mem = plan.memory[info["rank"]]
            assert info["checkpoint_bytes_read"] == mem.weights_dense + mem.weights_experts > 0
            assert set(info["homed_layers"]) <= set(range(5, TINY.num_layers)) and not info["embedding"]
            assert info["lm_head"] == (info["rank"] == plan.lm_head_rank)
        assert sorted(i for info in model.ranks for i in info["homed_layers"]) == list(range(5, TINY.num_layers))
    finally:
        model.close()


def test_the_cost_model_refuses_a_block_plan_and_prices_the_whole_model():
    from inference.planning.cost_model import CostModel
    with pytest.raises(ValueError, match=r"block plan of layers \[3, 9\)"):
        CostModel(TINY, tiny_block_plan(3, 9, "expert"))
    whole = tiny_block_plan(0, TINY.num_layers, "expert")
    whole = dataclasses.replace(whole, layer_range=None)
    assert CostModel(TINY, whole).token_time(context=64).tokens_per_s > 0
