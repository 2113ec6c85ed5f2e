"""Placement plans, the cost model and the planner (docs/engine.md sections 2-4)."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from inference.model import ModelConfig
from inference.planning.cost_model import (BREAKDOWN_KEYS, CostModel, CostParams, RoutedLayer, expected_max,
                                           selection_count_pmf)
from inference.planning.plan import (Link, Links, Plan, PlanError, RoutingStats, attn_res_sources, embedding_bytes,
                                     layer_weights, lm_head_bytes)
from inference.planning.plan_cluster import main as plan_cli
from inference.planning.planner import (Cluster, ClusterError, PlanDoesNotFit, PlannerOptions, eplb_layer,
                                        parse_quantity, plan_cluster)

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "inference" / "planning" / "clusters"
TINY = ModelConfig.tiny()
K3 = ModelConfig.kimi_k3()


def tiny_cluster(hosts: int = 1, per_host: int = 4, memory: str | int = "64 MB", intra_latency: float = 15e-6,
                 intra_bw: float = 64e9, inter_latency: float = 100e-6, inter_bw: float = 3.125e9,
                 name: str = "test") -> Cluster:
    return Cluster.from_dict({
        "name": name,
        "device_kinds": {"gpu": {"memory": memory, "mem_bandwidth": "1 TB/s", "flops": "100 TFLOPS",
                                 "power": "300 W"}},
        "hosts": [{"name": "h", "repeat": hosts, "devices": {"gpu": per_host}}],
        "links": {"intra_host": {"bandwidth": intra_bw, "latency": intra_latency},
                  "inter_host": {"bandwidth": inter_bw, "latency": inter_latency}},
        "memory_policy": {"runtime_reserved_bytes": 1 << 20, "prefill_chunk_tokens": 64},
    })


def zipf_stats(config: ModelConfig, tokens: int = 4000, skew: float = 1.2, seed: int = 0,
               paired: bool = False) -> RoutingStats:
    """Routing sampled from a skewed expert popularity; `paired` makes experts 2i and 2i+1 co-fire."""
    rng = np.random.default_rng(seed)
    E, k = config.num_experts, config.experts_per_token
    stats = RoutingStats(E, k)
    weights = 1 / np.arange(1, E + 1) ** skew
    for layer in config.moe_layers:
        w = weights[rng.permutation(E)]
        if paired:  # choose k/2 pairs, both members of a pair fire together
            keys = np.log(w[0::2] + w[1::2]) + rng.gumbel(size=(tokens, E // 2))
            pairs = np.argsort(-keys, axis=1)[:, : k // 2]
            ids = np.concatenate([2 * pairs, 2 * pairs + 1], axis=1)
        else:  # Gumbel top-k: k distinct experts drawn in proportion to w
            ids = np.argsort(-(np.log(w) + rng.gumbel(size=(tokens, E))), axis=1)[:, :k]
        stats.add(layer, ids)
    return stats


# =================================================================== weight accounting
@pytest.mark.parametrize("config", [K3, TINY, ModelConfig.tiny_kimi_linear()])
def test_layer_weights_add_up_to_the_checkpoint(config):
    total = sum(layer_weights(config, layer).total_bytes for layer in range(config.num_layers))
    total += embedding_bytes(config) + lm_head_bytes(config)
    total += len(config.moe_layers) * config.num_experts * config.expert_bytes()
    assert total == config.checkpoint_bytes()


def test_k3_dense_reads_per_token_match_engine_md():
    # engine.md: ~55.6B non-expert active parameters, about 111 GB read per token in bf16
    dense = sum(layer_weights(K3, layer).total_bytes for layer in range(K3.num_layers)) + lm_head_bytes(K3)
    active_non_expert = K3.num_active_parameters() - K3.num_routed_active_parameters()
    assert 110e9 < dense < 112e9
    assert abs(dense / 2 - active_non_expert) / active_non_expert < 0.001


def test_attn_res_sources_follow_the_block_recurrence():
    # simulate model.md section 6: count blocks + partial arriving at each layer
    for config in (TINY, K3):
        blocks, has_partial = 0, True  # the embedding arrives as the partial sum
        for layer in range(config.num_layers):
            assert attn_res_sources(config, layer) == blocks + (1 if has_partial else 0)
            if layer % config.attn_res_block_size == 0:
                blocks += 1
            has_partial = True
        assert attn_res_sources(config, config.num_layers) == blocks + 1


# =================================================================== Plan.simple and file io
@pytest.mark.parametrize("mode, ranks, replicas", [("pipeline", 3, 0), ("expert", 3, 0), ("both", 4, 0),
                                                    ("expert", 3, 5), ("both", 5, 3)])
def test_simple_plans_are_valid_and_shaped_by_mode(mode, ranks, replicas):
    plan = Plan.simple(TINY, ranks, mode, replicas=replicas, memory_bytes=1 << 30)
    plan.validate(TINY)
    stage_sizes = [len(s.ranks) for s in plan.stages]
    if mode == "pipeline":
        assert stage_sizes == [1] * ranks
        for layer in TINY.moe_layers:  # experts live with their layer
            assert plan.ranks_for_layer(layer) == [plan.home_of(layer)]
    elif mode == "expert":
        assert stage_sizes == [ranks]
        assert [plan.home_of(layer) for layer in range(ranks)] == list(range(ranks))  # homes rotate
        for layer in TINY.moe_layers:
            assert plan.ranks_for_layer(layer) == list(range(ranks))
    else:
        assert len(plan.stages) == 2 and sum(stage_sizes) == ranks and min(stage_sizes) >= 1
        assert max(stage_sizes) >= 2
    for layer in TINY.moe_layers:
        assert plan.replica_count(layer) == replicas
        for e in range(TINY.num_experts):
            holders = plan.expert_holders(layer, e)
            assert holders and len(set(holders)) == len(holders)
            assert set(holders) <= set(plan.stage_of(layer).ranks)
    # every rank's expert list is exactly what the placement says
    for r in range(ranks):
        for layer, experts in plan.experts_on(r).items():
            assert all(r in plan.expert_holders(layer, e) for e in experts)


def test_simple_rejects_replicas_without_a_second_rank():
    with pytest.raises(PlanError, match="two ranks"):
        Plan.simple(TINY, 3, "pipeline", replicas=1, memory_bytes=1 << 30)
    with pytest.raises(PlanError, match="mode"):
        Plan.simple(TINY, 3, "tensor", memory_bytes=1 << 30)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_plan_save_load_round_trip(tmp_path, suffix):
    plan = Plan.simple(TINY, 4, "both", replicas=2, memory_bytes=1 << 30, concurrency=3, context=1000)
    plan.prediction = {"tokens_per_s_single_stream": 12.5}
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    loaded.validate(TINY)
    assert loaded.model_config() == TINY


def _write_plan_dict(tmp_path, mutate) -> Path:
    plan = Plan.simple(TINY, 3, "expert", memory_bytes=1 << 30)
    data = plan.to_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    import json

    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("stages"), "missing field stages"),
    (lambda d: d["devices"][0].update(rank="zero"), r"devices\[0\].rank must be int"),
    (lambda d: d.update(format="other/9"), "expected 'k3-placement-plan/1'"),
    (lambda d: d["layers"][2].update(experts="all"), r"layers\[2\].experts"),
    (lambda d: d["stages"][0].update(layers=[0]), r"stages\[0\].layers must be \[first, end\]"),
    (lambda d: d["links"]["intra_host"].update(bandwidth=0), "bandwidth > 0"),
])
def test_malformed_plan_files_get_clear_errors(tmp_path, mutate, message):
    with pytest.raises(PlanError, match=message):
        Plan.load(_write_plan_dict(tmp_path, mutate))


def test_load_reports_missing_and_unparsable_files(tmp_path):
    with pytest.raises(PlanError, match="no plan file"):
        Plan.load(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: [unclosed\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        Plan.load(bad)


def _expect_invalid(plan: Plan, message: str, config: ModelConfig = TINY):
    with pytest.raises(PlanError, match=message):
        plan.validate(config)


def test_validation_names_what_is_wrong():
    base = Plan.simple(TINY, 3, "expert", memory_bytes=1 << 30)
    p = dataclasses.replace(base, expert_placement={k: [list(h) for h in v] for k, v in base.expert_placement.items()})
    p.expert_placement[4][7] = []
    _expect_invalid(p, "layer 4: expert 7 is on no device")
    p = dataclasses.replace(base, expert_placement={k: v for k, v in base.expert_placement.items() if k != 5})
    _expect_invalid(p, "MoE layer 5 has no expert placement")
    p = dataclasses.replace(base, layer_home=[9] + base.layer_home[1:])
    _expect_invalid(p, "home rank 9 is not in stage 0")
    _expect_invalid(base, "config hash", ModelConfig.tiny_grouped())
    p = dataclasses.replace(base, memory=[dataclasses.replace(m) for m in base.memory])
    p.memory[1].weights_experts += 1
    _expect_invalid(p, "rank 1: memory.weights_experts")
    p = dataclasses.replace(base, stages=[dataclasses.replace(base.stages[0], end_layer=12)])
    _expect_invalid(p, "stages cover layers \\[0, 12\\)")


def test_simple_plan_that_does_not_fit_raises_with_the_overflow():
    with pytest.raises(PlanError, match=r"rank 0 \(localhost, cpu-process\) needs .* overflows by"):
        Plan.simple(TINY, 3, "expert", memory_bytes=1 << 20)


# =================================================================== routing statistics
def test_routing_stats_count_like_a_plain_loop(tmp_path):
    rng = np.random.default_rng(1)
    E, k = 16, 4
    batches = [np.array([rng.choice(E, k, replace=False) for _ in range(n)]) for n in (5, 9, 1)]
    stats = RoutingStats(E, k)
    for b in batches:
        stats.add(3, b)
    load = [0] * E
    pairs: dict[tuple[int, int], int] = {}
    for b in batches:
        for row in b.tolist():
            for e in row:
                load[e] += 1
            for i, j in itertools.combinations(sorted(row), 2):
                pairs[(i, j)] = pairs.get((i, j), 0) + 1
    rec = stats.layers[3]
    assert rec.tokens == 15 and rec.load.tolist() == load
    got = {(int(i), int(j)): int(c) for i, j, c in zip(rec.pair_i, rec.pair_j, rec.pair_count)}
    assert got == pairs
    path = tmp_path / "routing.json"
    stats.save(path)
    back = RoutingStats.load(path)
    assert back.layers[3].load.tolist() == load and back.layers[3].tokens == 15
    assert {(int(i), int(j)): int(c) for i, j, c in zip(back.layers[3].pair_i, back.layers[3].pair_j,
                                                       back.layers[3].pair_count)} == pairs
    back.validate(TINY)


def test_routing_stats_accept_a_dense_matrix_and_reject_bad_input():
    matrix = [[0, 2, 0, 1], [2, 0, 3, 0], [0, 3, 0, 0], [1, 0, 0, 0]]
    dense = RoutingStats.from_dict({"layers": {"1": {"tokens": 5, "load": [3, 5, 3, 1],
                                                     "coactivation_matrix": matrix}}})
    sparse = RoutingStats.from_dict({"layers": {"1": {"tokens": 5, "load": [3, 5, 3, 1],
                                                      "coactivation": [[1, 0, 2], [0, 3, 1], [1, 2, 3]]}}})
    a, b = dense.layers[1], sparse.layers[1]
    assert sorted(zip(a.pair_i.tolist(), a.pair_j.tolist(), a.pair_count.tolist())) == \
        sorted(zip(b.pair_i.tolist(), b.pair_j.tolist(), b.pair_count.tolist()))
    columns = RoutingStats.from_dict({"layers": {"1": {"tokens": 5, "load": [3, 5, 3, 1], "coactivation":
                                                       {"i": [1, 0, 1], "j": [0, 3, 2], "count": [2, 1, 3]}}}})
    c = columns.layers[1]
    assert sorted(zip(c.pair_i.tolist(), c.pair_j.tolist(), c.pair_count.tolist())) == \
        sorted(zip(b.pair_i.tolist(), b.pair_j.tolist(), b.pair_count.tolist()))
    bad = [
        ({"layers": {"1": {"tokens": 5, "load": [1, 2, 3], "coactivation_matrix": matrix}}}, "4 x 4|3 x 3"),
        ({"layers": {"1": {"tokens": 5, "load": [1, 1, 1, 1], "coactivation": {"i": [0], "j": [1, 2],
                                                                               "count": [1]}}}}, "one length"),
        ({"layers": {"1": {"tokens": 5, "load": [1, 1, 1, 1],
                           "coactivation_matrix": [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]}}},
         "not symmetric"),
        ({"layers": {"1": {"tokens": 5, "load": [1, 1, 1, 1], "coactivation": [[0, 1, 1], [1, 0, 1]]}}},
         "listed twice"),
        ({"layers": {"x": {"tokens": 5, "load": [1]}}}, "integers"),
        ({"layers": {"1": {"tokens": 5, "load": [1, -1]}}}, "non-negative"),
    ]
    for data, message in bad:
        with pytest.raises(PlanError, match=message):
            RoutingStats.from_dict(data)
    wrong = RoutingStats.from_dict({"layers": {"0": {"tokens": 1, "load": [1] * 16}}})
    with pytest.raises(PlanError, match="not a MoE layer"):
        wrong.validate(TINY)


# =================================================================== cost model pieces
def test_expected_max_matches_enumeration():
    rng = np.random.default_rng(2)
    for _ in range(20):
        G, k = 3, 4
        pmf = rng.random((G, k + 1))
        pmf /= pmf.sum(axis=1, keepdims=True)
        values = np.sort(rng.random((G, k + 1)), axis=1)
        brute = 0.0
        for xs in itertools.product(range(k + 1), repeat=G):
            prob = np.prod([pmf[d, x] for d, x in enumerate(xs)])
            brute += prob * max(values[d, x] for d, x in enumerate(xs))
        assert expected_max(pmf, values) == pytest.approx(brute, rel=1e-9)


def test_uniform_placement_gives_engine_md_destination_count():
    E, k = TINY.num_experts, TINY.experts_per_token
    for G in (2, 4, 8):
        holders = [[e % G] for e in range(E)]
        rl = RoutedLayer.build(holders, list(range(G)), 0, np.full(E, k / E), None)
        pmf = selection_count_pmf(rl.mu, rl.m2, k)
        n_dest = float((1 - pmf[:, 0]).sum())
        assert n_dest == pytest.approx(G * (1 - (1 - 1 / G) ** k))


def test_copy_pair_moments_match_a_plain_loop():
    rng = np.random.default_rng(9)
    E, G = 30, 5
    holders = [[int(x) for x in rng.choice(G, size=int(rng.integers(1, 4)), replace=False)] for _ in range(E)]
    codes = np.unique(rng.integers(0, E * E, 300))
    pi, pj = codes // E, codes % E
    keep = pi < pj
    pi, pj = pi[keep], pj[keep]
    pp = rng.random(len(pi))
    rl = RoutedLayer.build(holders, list(range(G)), 0, rng.random(E), (pi, pj, pp))
    reference = np.zeros(G)
    for i, j, q in zip(pi, pj, pp):
        for d in set(holders[i]) & set(holders[j]):
            reference[d] += 2 * q / (len(holders[i]) * len(holders[j]))
    assert np.allclose(rl.m2, reference)


def test_coactivation_moments_predict_distinct_devices():
    """Paired experts co-fire: putting both of a pair on one device makes fewer devices hit."""
    config = TINY
    rng = np.random.default_rng(4)
    ids = np.array([np.concatenate([2 * p, 2 * p + 1]) for p in
                    (rng.choice(8, 2, replace=False) for _ in range(3000))])
    stats = RoutingStats(config.num_experts, config.experts_per_token)
    stats.add(1, ids)
    rec = stats.layers[1]
    for together in (True, False):
        dev = [(e // 2) % 4 if together else e % 4 for e in range(16)]
        holders = [[d] for d in dev]
        rl = RoutedLayer.build(holders, [0, 1, 2, 3], 0, rec.selection_probability(),
                               (rec.pair_i, rec.pair_j, rec.pair_probability()))
        pmf = selection_count_pmf(rl.mu, rl.m2, config.experts_per_token)
        predicted = (1 - pmf[:, 0]).sum()
        empirical = np.mean([len({dev[e] for e in row}) for row in ids])
        assert predicted == pytest.approx(empirical, abs=0.12)
    # and the independent model cannot see the difference co-location makes
    indep = selection_count_pmf(np.full(4, 1.0), None, 4)
    assert (1 - indep[:, 0]).sum() == pytest.approx(4 * (1 - 0.75 ** 4))


# =================================================================== planner: memory
def _check_memory(plan: Plan, config: ModelConfig):
    plan.validate(config)
    for m in plan.memory:
        assert m.total <= m.capacity == plan.devices[m.rank].memory_bytes
        assert m.total == (m.weights_dense + m.weights_experts + m.kda_state + m.mla_cache + m.buffers + m.headroom)
    for layer in config.moe_layers:
        assert all(plan.expert_holders(layer, e) for e in range(config.num_experts))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hosts=st.integers(1, 3), per_host=st.integers(1, 4), memory_kb=st.integers(600, 6000),
       concurrency=st.integers(1, 8))
def test_planner_never_exceeds_device_memory(hosts, per_host, memory_kb, concurrency):
    cluster = tiny_cluster(hosts, per_host, memory=memory_kb * 1000)
    try:
        plan, _ = plan_cluster(TINY, cluster, concurrency, 2048, report_concurrency=(1,))
    except PlanDoesNotFit as exc:
        assert exc.overflows, "a refusal must name the overflowing devices"
        worst = exc.overflows[0]
        assert worst["overflow"] == worst["needed"] - worst["capacity"] > 0
        assert f"rank {worst['rank']}" in str(exc) and "overflows by" in str(exc)
        return
    _check_memory(plan, TINY)


def test_tight_cluster_fits_and_one_byte_less_does_not():
    def attempt(capacity: int):
        try:
            return plan_cluster(TINY, tiny_cluster(1, 3, memory=capacity), 2, 1024, report_concurrency=(1,))[0]
        except PlanDoesNotFit as exc:
            return exc

    lo, hi = 100_000, 50_000_000  # bisection on the per-device memory
    assert isinstance(attempt(lo), PlanDoesNotFit) and isinstance(attempt(hi), Plan)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if isinstance(attempt(mid), Plan):
            hi = mid
        else:
            lo = mid
    plan, refusal = attempt(hi), attempt(lo)
    _check_memory(plan, TINY)
    assert min(m.free for m in plan.memory) < TINY.expert_bytes()  # it really is tight
    assert isinstance(refusal, PlanDoesNotFit)
    assert refusal.overflows[0]["overflow"] > 0 and "overflows by" in str(refusal)


def test_k3_does_not_fit_on_this_machine_and_says_where():
    cluster = Cluster.load(CLUSTERS / "local_cpu.yaml")
    with pytest.raises(PlanDoesNotFit, match=r"rank \d \(localhost, cpu_process\) needs .* overflows by") as exc:
        plan_cluster(K3, cluster, 1, 4096)
    assert all(o["overflow"] > 0 for o in exc.value.overflows)


def test_the_hopper_clusters_hold_k3_from_two_h200_nodes_and_list_themselves(capsys):
    """8 x H100 and 8 x H200 are what operators rent: K3 does not fit in one node (the CLI says by how much), in
    two H200 nodes it does; `k3-plan --list` names every shipped cluster and model preset."""
    assert plan_cli(["--model", "kimi_k3", "--cluster", "h200_8", "--concurrency", "1"]) == 2
    assert "kimi-k3 does not fit on h200_8 (8 devices, 1128.0 GB)" in capsys.readouterr().err
    assert plan_cli(["--model", "kimi_k3", "--cluster", "h100_8", "--concurrency", "1"]) == 2
    assert "overflows by" in capsys.readouterr().err
    assert plan_cli(["--model", "kimi_k3", "--cluster", "h200_16", "--concurrency", "1"]) == 0
    assert "16 x h200 on 2 host(s)" in capsys.readouterr().out
    assert plan_cli(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "h100_8                 8 x h100 (80 GB), 1 host(s), 640 GB in all" in listing
    assert "h200_8 " in listing and "h200_16 " in listing and "b300_8 " in listing
    assert "kimi_k3                kimi-k3: 2,779,484,478,208 parameters, 1,560.0 GB of weights" in listing
    assert "kimi-k3 " not in listing.split("model presets")[1].replace("kimi-k3:", "")  # one line per model
    with pytest.raises(SystemExit):
        plan_cli(["--model", "tiny"])
    assert "k3-plan --list" in capsys.readouterr().err


# =================================================================== planner: replicas
def _eplb_reference(load, slots, replicas):
    """Plain EPLB: argmax load-per-copy replication, then heaviest copy to lightest eligible device."""
    E, G = len(load), len(slots)
    copies = [1] * E
    for _ in range(replicas):
        e = max((e for e in range(E) if copies[e] < G), key=lambda e: (load[e] / copies[e], -e))
        copies[e] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])), key=lambda t: (-t[0], t[1]))
    holders = [[] for _ in range(E)]
    dev_load, free = [0.0] * G, list(slots)
    for w, e in items:
        eligible = [d for d in range(G) if free[d] > 0 and d not in holders[e]]
        if not eligible:
            return None
        d = min(eligible, key=lambda d: (dev_load[d], d))
        holders[e].append(d)
        free[d] -= 1
        dev_load[d] += w
    return holders


def test_eplb_matches_the_plain_reference():
    rng = np.random.default_rng(5)
    compared = 0
    for _ in range(30):
        E, G = int(rng.integers(8, 40)), int(rng.integers(2, 6))
        replicas = int(rng.integers(0, E))
        total = E + replicas
        slots = [total // G + (1 if d < total % G else 0) for d in range(G)]
        load = rng.pareto(1.5, E) + 0.01
        ref = _eplb_reference(load.tolist(), slots, replicas)
        if ref is None:
            continue
        assert eplb_layer(load, slots, replicas) == ref
        compared += 1
    assert compared >= 20


def test_replicas_follow_load():
    stats = zipf_stats(TINY, tokens=2000, skew=1.5, seed=6)
    plan, _ = plan_cluster(TINY, tiny_cluster(1, 4, memory="64 MB"), 2, 1024, stats,
                           options=PlannerOptions(max_replicas_per_layer=8, improve=False, stages=1),
                           report_concurrency=(1,))
    _check_memory(plan, TINY)
    for layer in TINY.moe_layers:
        load = stats.layers[layer].load
        copies = np.array([len(plan.expert_holders(layer, e)) for e in range(TINY.num_experts)])
        assert copies.sum() == TINY.num_experts + 8
        order = np.argsort(-load, kind="stable")
        assert copies[order[0]] >= 2 and copies[order[-1]] == 1
        for a, b in zip(order, order[1:]):  # hotter never has fewer copies
            if load[a] > load[b]:
                assert copies[a] >= copies[b]
        per_copy = load / copies
        ranks = plan.stage_of(layer).ranks
        device_load = {r: sum(per_copy[e] for e in range(TINY.num_experts) if r in plan.expert_holders(layer, e))
                       for r in ranks}
        assert max(device_load.values()) <= 1.35 * np.mean(list(device_load.values()))


def test_uniform_load_spreads_replicas():
    stats = RoutingStats(TINY.num_experts, TINY.experts_per_token)
    for layer in TINY.moe_layers:
        stats.add(layer, np.array([[(t + j) % 16 for j in range(4)] for t in range(64)]))
    plan, _ = plan_cluster(TINY, tiny_cluster(1, 4, memory="64 MB"), 2, 1024, stats,
                           options=PlannerOptions(max_replicas_per_layer=6, improve=False, stages=1),
                           report_concurrency=(1,))
    for layer in TINY.moe_layers:
        copies = [len(plan.expert_holders(layer, e)) for e in range(TINY.num_experts)]
        assert sum(copies) == TINY.num_experts + 6 and max(copies) - min(copies) <= 1


def test_local_improvement_never_predicts_worse():
    stats = zipf_stats(TINY, tokens=1500, skew=0.3, paired=True, seed=7)
    cluster = tiny_cluster(1, 4, memory="64 MB", intra_latency=200e-6, intra_bw=1e9)
    base, _ = plan_cluster(TINY, cluster, 4, 1024, stats, options=PlannerOptions(improve=False, stages=1),
                           report_concurrency=(1,))
    better, report = plan_cluster(TINY, cluster, 4, 1024, stats, options=PlannerOptions(stages=1),
                                  report_concurrency=(1,))
    _check_memory(better, TINY)
    t_base = CostModel(TINY, base, routing=stats).token_time().total
    t_better = CostModel(TINY, better, routing=stats).token_time().total
    assert t_better <= t_base + 1e-15
    if report.params["local_improvement_swaps"]:
        assert better.expert_placement != base.expert_placement


# =================================================================== cost model: monotonic
def _with_links(plan: Plan, intra: Link, inter: Link) -> Plan:
    return dataclasses.replace(plan, links=Links(intra, inter))


def test_predicted_times_are_monotonic_in_link_latency_and_bandwidth():
    plan, _ = plan_cluster(TINY, tiny_cluster(2, 2, memory="64 MB"), 8, 1024, report_concurrency=(1,),
                           options=PlannerOptions(max_replicas_per_layer=3))
    stats = zipf_stats(TINY, tokens=500, skew=1.0, paired=True, seed=8)

    def times(intra: Link, inter: Link):
        intra, inter = dataclasses.replace(intra, per_peer=per_peer), dataclasses.replace(inter, per_peer=per_peer)
        model = CostModel(TINY, _with_links(plan, intra, inter), routing=stats)
        return (model.token_time().total, model.ttft(300)["seconds"], 1 / model.throughput(8)["tokens_per_s"])

    latencies = [0.0, 5e-6, 50e-6, 200e-6, 1e-3]
    bandwidths = [0.5e9, 3e9, 25e9, 200e9]
    for which, per_peer in itertools.product(("intra", "inter"), (False, True)):
        prev = None
        for lat in latencies:
            link = Link(bandwidth=10e9, latency=lat)
            other = Link(bandwidth=10e9, latency=20e-6)
            t = times(link, other) if which == "intra" else times(other, link)
            if prev is not None:
                assert all(a >= b for a, b in zip(t, prev)), (which, lat)
            prev = t
        prev = None
        for bw in bandwidths:
            link = Link(bandwidth=bw, latency=20e-6)
            other = Link(bandwidth=10e9, latency=20e-6)
            t = times(link, other) if which == "intra" else times(other, link)
            if prev is not None:
                assert all(a <= b for a, b in zip(t, prev)), (which, bw)
            prev = t
    per_peer = False
    slow = times(Link(1e9, 1e-3), Link(1e9, 1e-3))[0]
    fast = times(Link(100e9, 1e-6), Link(100e9, 1e-6))[0]
    assert slow > fast  # links matter at all


def test_per_peer_links_overlap_messages_that_a_shared_pipe_queues(tmp_path):
    plan, _ = plan_cluster(TINY, tiny_cluster(1, 4, intra_bw=1e9), 4, 1024, report_concurrency=(1,),
                           options=PlannerOptions(stages=1))
    shared = Link(bandwidth=1e9, latency=10e-6)
    mesh = Link(bandwidth=1e9, latency=10e-6, per_peer=True)
    a = CostModel(TINY, _with_links(plan, shared, shared))
    b = CostModel(TINY, _with_links(plan, mesh, mesh))
    assert b.token_time().total <= a.token_time().total
    assert b.ttft(512)["seconds"] < a.ttft(512)["seconds"]  # 512 latents to 3 peers: queued vs together
    meshed = _with_links(plan, mesh, shared)
    meshed.save(tmp_path / "mesh.yaml")
    assert Plan.load(tmp_path / "mesh.yaml").links.intra_host.per_peer is True


def test_replanning_is_monotonic_in_inter_host_latency():
    previous = None
    for latency in (10e-6, 100e-6, 1e-3, 5e-3):
        _, report = plan_cluster(TINY, tiny_cluster(2, 2, inter_latency=latency), 2, 512, report_concurrency=(1,))
        t = report.single_stream["seconds_per_token"]
        if previous is not None:
            assert t >= previous
        previous = t


# =================================================================== cluster files
def test_quantities_parse_with_units_and_reject_nonsense():
    assert parse_quantity("32 GB", "bytes", "x") == 32e9
    assert parse_quantity("32 GiB", "bytes", "x") == 32 * 2 ** 30
    assert parse_quantity("1792 GB/s", "bandwidth", "x") == 1.792e12
    assert parse_quantity("25 Gbit/s", "bandwidth", "x") == 3.125e9
    assert parse_quantity("15 us", "time", "x") == pytest.approx(15e-6)
    assert parse_quantity("2.5 PFLOPS", "flops", "x") == 2.5e15
    assert parse_quantity(575, "power", "x") == 575.0
    for value in ("32 parsecs", "fast", -1, True):
        with pytest.raises(ClusterError, match="x"):
            parse_quantity(value, "bytes", "x")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("links"), "missing 'links'"),
    (lambda d: d["hosts"][0]["devices"].update(tpu=2), "unknown device kind 'tpu'"),
    (lambda d: d["device_kinds"]["gpu"].pop("flops"), "missing \\['flops'\\]"),
    (lambda d: d["links"].pop("inter_host"), "no links.inter_host"),
    (lambda d: d.update(cost_params={"warp_factor": 9}), "unknown cost parameters"),
])
def test_bad_cluster_files_are_refused(mutate, message):
    data = {
        "name": "bad", "device_kinds": {"gpu": {"memory": "1 GB", "mem_bandwidth": "1 TB/s", "flops": "1 TFLOPS",
                                                "power": "1 W"}},
        "hosts": [{"name": "h", "repeat": 2, "devices": {"gpu": 2}}],
        "links": {"intra_host": {"bandwidth": "1 GB/s", "latency": "1 us"},
                  "inter_host": {"bandwidth": "1 GB/s", "latency": "1 us"}},
    }
    mutate(data)
    with pytest.raises(ClusterError, match=message):
        Cluster.from_dict(data)


def test_shipped_cluster_files_match_the_data_sheets():
    rtx = Cluster.load(CLUSTERS / "rtx5090_80.yaml")
    assert len(rtx.devices) == 80 and len(rtx.hosts) == 10
    assert {d.memory_bytes for d in rtx.devices} == {32_000_000_000}
    assert rtx.links.inter_host.bandwidth == 3.125e9 and rtx.devices[0].power_w == 575
    for name in ("mi355x_8", "b300_8"):
        c = Cluster.load(CLUSTERS / f"{name}.yaml")
        assert len(c.devices) == 8 and c.devices[0].memory_bytes == 288e9 and c.devices[0].mem_bandwidth == 8e12
    local = Cluster.load(CLUSTERS / "local_cpu.yaml")
    assert len(local.hosts) == 1 and 2 <= len(local.devices) <= 3
    assert local.links.intra_host.latency == pytest.approx(75e-6)


# =================================================================== the real clusters
@pytest.fixture(scope="module")
def k3_plans():
    out = {}
    for name in ("rtx5090_80", "mi355x_8", "b300_8"):
        out[name] = plan_cluster(K3, Cluster.load(CLUSTERS / f"{name}.yaml"), 64, 32768, prompt_tokens=8192)
    return out


@pytest.mark.parametrize("name", ["rtx5090_80", "mi355x_8", "b300_8"])
def test_full_k3_plans_on_the_reference_clusters(k3_plans, name):
    plan, report = k3_plans[name]
    _check_memory(plan, K3)
    assert report.planning_seconds < 30
    ss = report.single_stream
    assert set(ss["breakdown_s"]) == set(BREAKDOWN_KEYS)
    assert sum(ss["breakdown_s"].values()) == pytest.approx(ss["seconds_per_token"])
    assert [t["concurrency"] for t in report.throughput] == [1, 8, 64]
    tps = [t["tokens_per_s"] for t in report.throughput]
    assert tps[0] == pytest.approx(ss["tokens_per_s"]) and tps[0] < tps[1] < tps[2]
    assert all(t["tokens_per_joule"] == pytest.approx(t["tokens_per_s"] / report.total_power_w)
               for t in report.throughput)
    assert all(t["tokens_per_s"] <= t["concurrency"] * tps[0] * (1 + 1e-9) for t in report.throughput)
    assert report.ttft["prompt_tokens"] == 8192
    non_expert_params = K3.num_active_parameters() - K3.num_routed_active_parameters()
    assert report.ttft["seconds"] >= 2 * non_expert_params * 8192 / sum(d.flops for d in plan.devices)
    assert report.to_reach["target_tokens_per_s"] == 20 and report.to_reach["options"]
    text = report.to_markdown()
    for needle in ("tokens/s, one stream", "concurrency 64", "TTFT, 8192-token prompt", "tokens per joule",
                   "To reach 20 tokens/s", "dense_reads", "stage_hops"):
        assert needle in text
    assert plan.prediction["tokens_per_s_single_stream"] == ss["tokens_per_s"]
    # sanity bounds from the model itself
    model = CostModel(K3, plan)
    dense = model.dense_bytes_per_token()
    peak = max(d.mem_bandwidth for d in plan.devices)
    assert ss["seconds_per_token"] >= dense / peak  # one device reads each layer's dense weights
    p = CostParams()
    slowest = min(d.mem_bandwidth for d in plan.devices) * p.mem_efficiency
    worst_link = max(plan.links.intra_host.latency, plan.links.inter_host.latency)
    slow_bw = min(plan.links.intra_host.bandwidth, plan.links.inter_host.bandwidth) * p.link_efficiency
    routed = len(K3.moe_layers) * K3.experts_per_token * K3.expert_bytes()
    per_msg = K3.experts_per_token * (2 * K3.latent_size * 2 + 8) / slow_bw
    hop = worst_link + attn_res_sources(K3, K3.num_layers) * K3.hidden_size * 2 / slow_bw
    upper = ((dense + routed + K3.num_layers * model.kda_state_layer * 2) / slowest
             + K3.num_mla_layers * 32768 * 2 * K3.mla_heads * 1088 / (min(d.flops for d in plan.devices) * 0.5)
             + K3.num_layers * (2 * worst_link + per_msg + p.launch_overhead_s + p.expert_overhead_s + hop) + 1e-3)
    assert ss["seconds_per_token"] <= upper
    print(f"\n{name}: {ss['tokens_per_s']:.2f} tok/s one stream, "
          f"{', '.join(f'{t:.0f}' for t in tps)} tok/s at 1/8/64, TTFT(8k) {report.ttft['seconds']:.2f} s")


def test_rtx5090_expert_traffic_stays_on_pcie(k3_plans):
    plan, report = k3_plans["rtx5090_80"]
    for layer in K3.moe_layers:
        home_host = plan.devices[plan.home_of(layer)].host
        assert {plan.devices[r].host for r in plan.ranks_for_layer(layer)} == {home_host}
    # the dense reads dominate, as engine.md says, and 20 tokens/s needs one of the options
    bd = report.single_stream["breakdown_s"]
    assert bd["dense_reads"] == max(bd.values())
    assert report.single_stream["tokens_per_s"] < 20
    assert any(o["reaches"] for o in report.to_reach["options"])


# =================================================================== the script
def _script():
    module = importlib.import_module("inference.planning.plan_cluster")
    return module


def test_script_writes_a_loadable_plan_and_report(tmp_path, capsys):
    script = _script()
    out, report = tmp_path / "plan.yaml", tmp_path / "report.md"
    rc = script.main(["--model", "tiny", "--cluster", str(CLUSTERS / "local_cpu.yaml"), "--concurrency", "1,4",
                      "--context", "2048", "--prompt", "300", "--out", str(out), "--report", str(report)])
    assert rc == 0
    plan = Plan.load(out)
    plan.validate(TINY)
    assert plan.concurrency == 4 and plan.context == 2048
    assert "aggregate tokens/s at concurrency 4" in report.read_text()
    assert "tokens/s, one stream" in capsys.readouterr().out


def test_script_exits_2_with_a_clear_message(tmp_path, capsys):
    script = _script()
    rc = script.main(["--model", "kimi_k3", "--cluster", str(CLUSTERS / "local_cpu.yaml"), "--concurrency", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and "overflows by" in err and "rank" in err
    rc = script.main(["--model", "nonsense", "--cluster", str(CLUSTERS / "local_cpu.yaml")])
    assert rc == 2 and "unknown preset" in capsys.readouterr().err
    rc = script.main(["--model", "tiny", "--cluster", str(tmp_path / "none.yaml")])
    assert rc == 2 and "no cluster file" in capsys.readouterr().err
    rc = script.main(["--model", "tiny", "--cluster", str(CLUSTERS / "local_cpu.yaml"), "--concurrency", "0"])
    assert rc == 2 and "positive" in capsys.readouterr().err


# =================================================================== dense split and dense dtype (issue 17)
def test_dense_split_plans_are_valid_round_trip_and_move_memory(tmp_path):
    plan, _ = plan_cluster(TINY, tiny_cluster(hosts=2, per_host=2, memory="256 MB"), 1, 1024, prompt_tokens=64,
                           options=PlannerOptions(dense_split=2, dense_dtype="fp8"))
    assert plan.dense_dtype == "fp8" and plan.dense_split == 2
    for layer in range(TINY.num_layers):
        group = plan.dense_group(layer)
        assert group[0] == plan.layer_home[layer] and len(group) == 2
        assert len({plan.devices[r].host for r in group}) == 1
        assert set(group) <= set(plan.stage_of(layer).ranks)
    _check_memory(plan, TINY)
    path = tmp_path / "split.yaml"
    plan.save(path)
    back = Plan.load(path)
    back.validate(TINY)
    assert back.dense_groups == plan.dense_groups and back.lm_head_group == plan.lm_head_group
    unsplit = dataclasses.replace(plan, dense_groups={}, lm_head_group=(), dense_dtype="bf16").with_dense_groups(
        TINY, {})
    # the same total dense bytes (halved by fp8), spread over more devices
    assert sum(m.weights_dense for m in plan.memory) < sum(m.weights_dense for m in unsplit.memory)
    assert max(m.weights_dense for m in plan.memory) < max(m.weights_dense for m in unsplit.memory)


def test_dense_split_groups_are_checked():
    plan = Plan.simple(TINY, 4, "both", stages=2, memory_bytes=1 << 30)  # stages [0, 1] and [2, 3]
    home = plan.layer_home[0]
    other = next(r for r in plan.stages[0].ranks if r != home)
    outside = plan.stages[1].ranks[0]
    for groups, message in (({0: (other, home)}, "start with its home"),
                            ({0: (home, outside)}, "leaves stage"),
                            ({0: (home, home)}, "distinct"),
                            ({0: (home, other, 2, 3)}, "leaves stage")):
        with pytest.raises(PlanError, match=message):
            plan.with_dense_groups(TINY, groups)
    with pytest.raises(PlanError, match="divide"):
        Plan.simple(TINY, 3, "expert", memory_bytes=1 << 30, dense_split=3)  # 4 heads over 3
    with pytest.raises(PlanError, match="needs 2"):
        Plan.simple(TINY, 2, "pipeline", memory_bytes=1 << 30, dense_split=2)  # one rank per stage
    two_hosts = dataclasses.replace(plan, devices=[dataclasses.replace(d, host=f"h{d.rank}") for d in plan.devices])
    with pytest.raises(PlanError, match="spans hosts"):
        two_hosts.with_dense_groups(TINY, {0: (home, other)})
    with pytest.raises(PlanError, match="dense_dtype"):
        plan.with_dense_groups(TINY, {}, dense_dtype="int4")


def test_cost_model_prices_the_plan_layout_like_the_what_if():
    cluster = tiny_cluster(hosts=1, per_host=4, memory="256 MB")
    plan, _ = plan_cluster(TINY, cluster, 1, 1024, prompt_tokens=64, options=PlannerOptions(stages=1))
    base = CostModel(TINY, plan)
    split = CostModel(TINY, plan.with_dense_split(TINY, 2))
    fp8 = CostModel(TINY, plan.with_dense_split(TINY, 1, "fp8"))
    t0, t2, t8 = (m.token_time().breakdown for m in (base, split, fp8))
    assert t2["dense_reads"] < t0["dense_reads"] and t8["dense_reads"] < t0["dense_reads"]
    assert t2["home_hops"] > t0["home_hops"]  # the split's input broadcasts and partial sums
    assert t8["home_hops"] == t0["home_hops"]
    # a plan with split groups costs what the dense_split what-if on the unsplit plan says
    assert split.token_time().total == pytest.approx(base.variant(dense_split=2).token_time().total)
    assert fp8.token_time().total == pytest.approx(base.variant(dense_weight_scale=0.5).token_time().total)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "plans").glob("*.json")), ids=lambda p: p.stem)
def test_shipped_claim_plans_load_validate_and_price_as_recorded(path):
    plan = Plan.load(path)
    plan.validate(K3)
    split = int(path.stem.split("_split")[1].split("_")[0])
    assert plan.dense_split == split and plan.dense_dtype == path.stem.rsplit("_", 1)[1]
    tps = 1 / CostModel(K3, plan).token_time(components=False).total
    assert tps == pytest.approx(plan.prediction["single_stream_tokens_per_s"], rel=1e-9)
