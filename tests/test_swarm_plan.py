"""Swarm plans (inference/planning/swarm_plan.py): one layer block per operator, cut at AttnRes block boundaries,
the wire cost of each cut, the route's hops; and `plan_cluster.py swarm`."""
from __future__ import annotations

import pytest
from test_planner import CLUSTERS, K3, TINY, tiny_cluster

from inference.planning.cost_model import CostParams
from inference.planning.plan_cluster import link_rate, main as plan_cli
from inference.planning.planner import Cluster, ClusterError
from inference.planning.swarm_plan import over_link, plan_swarm, snap_to_blocks, stage_blocks
from inference.swarm.stage import wire_bytes_per_token


def covers(blocks, num_layers):
    return blocks[0][0] == 0 and blocks[-1][1] == num_layers and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("stages", range(1, 14))
def test_stage_blocks_cover_the_model_and_cut_at_block_boundaries_while_they_can(stages):
    blocks = stage_blocks(13, 3, stages)
    assert len(blocks) == stages and covers(blocks, 13) and all(a < b for a, b in blocks)
    if stages <= 5:  # 4 boundaries (3, 6, 9, 12): every cut on one
        assert all(a % 3 == 0 for a, _ in blocks)
    sizes = [b - a for a, b in blocks]
    assert max(sizes) - min(sizes) <= 3 if stages <= 5 else max(sizes) - min(sizes) <= 1


def test_stage_blocks_k3_is_a_dozen_layers_per_operator_and_bad_counts_are_refused():
    assert stage_blocks(93, 12, 8) == [(i * 12, min(93, i * 12 + 12)) for i in range(8)]
    for bad in (0, 94):
        with pytest.raises(ValueError):
            stage_blocks(93, 12, bad)


def test_snap_moves_each_cut_to_the_nearest_free_boundary():
    assert snap_to_blocks([(0, 5), (5, 10), (10, 13)], 13, 3) == [(0, 6), (6, 9), (9, 13)]
    assert snap_to_blocks([(0, 1), (1, 2), (2, 13)], 13, 3) == [(0, 3), (3, 6), (6, 13)]  # distinct, in order
    assert snap_to_blocks([(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 13)], 13, 3) is None  # 5 cuts, 4 boundaries


def test_tiny_swarm_plan_cuts_at_blocks_and_its_hops_follow_the_swarm_law():
    cluster = tiny_cluster(hosts=3, per_host=2, inter_latency=5e-3, inter_bw=12.5e6)
    sp = plan_swarm(TINY, cluster, context=256, prompt_tokens=64)
    assert sp.split == "block boundaries" and len(sp.plan.stages) == 3
    assert all(c.at_block_boundary for c in sp.cuts)
    hosts = [{sp.plan.devices[r].host for r in st.ranks} for st in sp.plan.stages]
    assert all(len(h) == 1 for h in hosts) and len({h.pop() for h in hosts}) == 3  # one operator per block
    # wire cost per cut against the stage runtime's own count of what crosses a cut
    for c in sp.cuts:
        assert c.bytes_per_token == wire_bytes_per_token(TINY, c.layer, 2)
        assert c.prefill_bytes == c.bytes_per_token * sp.prefill_tokens
    # tokens/s = 1 / (N x hop + C): N = stages + 1 hops (driver -> 1 -> 2 -> 3 -> driver), C fixed by the layout
    slower = over_link(sp, TINY, latency_s=25e-3, bandwidth=12.5e6, params=CostParams())
    assert sp.hops_per_token == 4
    assert slower.seconds_per_token - sp.seconds_per_token == pytest.approx(4 * 20e-3, rel=1e-9)
    assert slower.ttft_s > sp.ttft_s and 0 < sp.latency_share < slower.latency_share < 1
    # a slower link only costs bytes / rate more per token
    thin = over_link(sp, TINY, latency_s=5e-3, bandwidth=1.25e6, params=CostParams())
    assert thin.seconds_per_token > sp.seconds_per_token and thin.wire_bytes_per_token == sp.wire_bytes_per_token


def test_one_operator_is_not_a_swarm():
    with pytest.raises(ClusterError):
        plan_swarm(TINY, tiny_cluster(hosts=1))


def test_k3_on_eight_operators_of_eight_rtx5090():
    cluster = Cluster.load(CLUSTERS / "swarm_rtx5090x8_wan.yaml")
    sp = plan_swarm(K3, cluster)
    assert sp.split == "block boundaries"
    assert [(s.first_layer, s.end_layer) for s in sp.plan.stages] == stage_blocks(93, 12, 8)
    # docs/swarm.md's table: 2 vectors (28.7 KB) after layer 12, 5 (71.7 KB) after 48, 8 (114.7 KB) after 84
    by_cut = {c.layer: c for c in sp.cuts}
    assert [by_cut[n].vectors_per_token for n in (12, 48, 84)] == [2, 5, 8]
    assert by_cut[48].bytes_per_token == 5 * 7168 * 2
    assert 1 < sp.tokens_per_s < 20 and sp.latency_share > 0.5  # 30 ms RTT: latency-bound
    faster = over_link(sp, K3, latency_s=5e-3, bandwidth=125e6, params=CostParams())
    assert faster.tokens_per_s > sp.tokens_per_s


def test_cli_swarm_table_and_errors(capsys):
    rc = plan_cli(["swarm", "--model", "kimi_k3", "--cluster", "swarm_rtx5090x8_wan", "--rtt-ms", "10,50",
                   "--bandwidth", "1 Gbit/s"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| swarm_rtx5090x8_wan")]
    assert rc == 0 and len(rows) == 2
    fast, slow = (float(r.split("|")[5]) for r in rows)
    assert fast > slow
    assert plan_cli(["swarm", "--model", "kimi_k3", "--cluster", "swarm_rtx5090x8_wan", "--rtt-ms", "-1"]) == 2
    assert "non-negative" in capsys.readouterr().err
    assert plan_cli(["swarm", "--model", "kimi_k3", "--cluster", "nowhere.yaml"]) == 2
    assert "no cluster file" in capsys.readouterr().err
    assert link_rate("100 Mbit/s") == 12.5e6 and link_rate("1 Gbit/s") == 125e6
    with pytest.raises(ValueError):
        link_rate("fast Mbit/s")
