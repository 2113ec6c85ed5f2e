"""One market (scoring/stage_rewards.py): N stages covering the model earn what one whole-model miner earns for
the same verified work at the same speed; slower, less available or challenged miners earn less or nothing."""
import pytest

from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from scoring.stage_rewards import MinerWork, active_params_per_layer, block_share, market_scores

CUTS = [(0, 3), (3, 6), (6, 9), (9, 13)]


@pytest.fixture(scope="module")
def costs():
    return active_params_per_layer(KimiK3Model(ModelConfig.tiny()))


def test_block_shares_sum_to_one_and_follow_compute(costs):
    shares = [block_share(costs, a, b) for a, b in CUTS]
    assert sum(shares) == pytest.approx(1.0)
    assert shares[-1] == max(shares)  # the last block carries the head (V x D) and four layers
    assert costs[3] != costs[1]  # an MLA layer and a KDA layer cost differently
    assert costs[12] - costs[11] >= 64 * 272  # the head is folded into the last layer
    with pytest.raises(ValueError):
        block_share(costs, 5, 20)


def test_n_stages_earn_what_one_whole_model_miner_earns(costs):
    t_ms, tokens = 40.0, 1000
    stages = [MinerWork(f"stage{i}", tokens, block_share(costs, a, b) * t_ms, layers=(a, b))
              for i, (a, b) in enumerate(CUTS)]
    rows = {r.hotkey: r for r in market_scores(stages + [MinerWork("whole", tokens, t_ms)], costs)}
    assert sum(rows[f"stage{i}"].weight for i in range(4)) == pytest.approx(rows["whole"].weight)
    assert rows["whole"].weight == pytest.approx(0.5)


def test_slow_unavailable_and_challenged_miners_earn_less(costs):
    share = block_share(costs, 3, 6)
    rows = market_scores([MinerWork("fast", 100, share * 40, layers=(3, 6)),
                          MinerWork("slow", 100, share * 80, layers=(3, 6)),
                          MinerWork("flaky", 100, share * 40, availability=0.5, layers=(3, 6)),
                          MinerWork("liar", 100, share * 10, layers=(3, 6),
                                    failed_checks=["stage challenge: 16 of 16 tokens diverge"])], costs)
    by = {r.hotkey: r for r in rows}
    assert by["slow"].score == pytest.approx(by["fast"].score / 2)
    assert by["flaky"].score == pytest.approx(by["fast"].score / 2)
    assert by["liar"].weight == 0 and "diverge" in by["liar"].reason
    assert sum(r.weight for r in rows) == pytest.approx(1.0)
