"""The one place that decides weights (scoring/weights.py): EMA^2 among whole-model miners, one vector with the
stage miners by their market scores, blamed route drivers at 0, and what is submitted positive, finite and
normalised (the chain clips and quantises)."""
import pytest

from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from scoring.config import ScoringConfig
from scoring.rewards import EmaEntry
from scoring.stage_rewards import MinerWork, active_params_per_layer, block_share
from scoring.weights import (StageEvidence, WeightEvidence, miner_weights, one_vector, submitted_weights,
                             weights_from_ema, weights_to_submit)

CUTS = [(0, 3), (3, 6), (6, 9), (9, 13)]
CONFIG = ScoringConfig()


@pytest.fixture(scope="module")
def costs():
    return active_params_per_layer(KimiK3Model(ModelConfig.tiny()))


def test_weights_are_proportional_to_ema_squared():
    weights = weights_from_ema({1: ("a", 0.2), 2: ("b", 0.1), 3: ("c", 0.0)})
    assert weights == {1: pytest.approx(0.8), 2: pytest.approx(0.2), 3: 0.0}
    assert weights_from_ema({1: 0.5, 2: 0.5}) == {1: 0.5, 2: 0.5}
    assert weights_from_ema({1: ("a", 0.0), 2: ("b", 0.0)}) == {1: 0.0, 2: 0.0}
    assert weights_from_ema({}) == {}
    assert weights_from_ema({1: 0.2, 2: 0.1}, exponent=1.0) == {1: pytest.approx(2 / 3), 2: pytest.approx(1 / 3)}
    with pytest.raises(ValueError):
        weights_from_ema({1: -0.1})


def test_one_vector_keeps_whole_model_weights_and_shares_by_market(costs):
    t_ms, tokens = 40.0, 1000
    whole_work = {1: MinerWork("w1", tokens, t_ms), 2: MinerWork("w2", tokens, t_ms)}
    today = {1: 0.8, 2: 0.2, 3: 0.0}  # EMA^2 shares today; uid 3 is gated to 0
    # no stage miners: exactly today's weights
    assert one_vector(today, whole_work, {}, costs)[0] == pytest.approx({1: 0.8, 2: 0.2})
    # a route of 4 stages doing one whole-model miner's work at its speed earns what that miner brings its kind
    stages = {10 + i: MinerWork(f"s{i}", tokens, block_share(costs, a, b) * t_ms, layers=(a, b))
              for i, (a, b) in enumerate(CUTS)}
    weights, _ = one_vector({1: 1.0}, {1: whole_work[1]}, stages, costs)
    assert sum(weights[10 + i] for i in range(4)) == pytest.approx(weights[1]) == pytest.approx(0.5)
    # two whole-model miners keep today's ratio among themselves; a blamed stage gets 0, its route-mates share
    stages[12] = MinerWork("liar", tokens, 1.0, layers=CUTS[2], failed_checks=["challenge: 16 of 16 diverge"])
    weights, rows = one_vector(today, whole_work, stages, costs)
    assert weights[1] / weights[2] == pytest.approx(4.0) and 3 not in weights
    assert weights[12] == 0.0 and sum(weights.values()) == pytest.approx(1.0)
    rest = 1 - block_share(costs, *CUTS[2])  # the honest stages did that share of one miner's work
    assert weights[1] + weights[2] == pytest.approx(2 / (2 + rest))


def test_submitted_weights_are_normalised_and_left_for_the_chain_to_clip():
    assert submitted_weights({1: 0.0, 2: 3.0, 3: 1.0}) == {2: 0.75, 3: 0.25}
    assert submitted_weights({1: 8.0, 2: 1.0, 3: 1.0}) == {1: 0.8, 2: 0.1, 3: 0.1}  # chain.weights clips
    assert submitted_weights({1: float("nan"), 2: 1.0}) == {2: 1.0}
    assert submitted_weights({1: 0.0}) == {}


def test_the_submitted_vector_comes_from_the_evidence(costs):
    """Whole-model EMA alone: EMA^2 shares; with stage rounds: a blamed route driver at 0 and the stage miners in
    the same vector; before the model's layer costs are known, the whole-model weights as they are."""
    ema = {1: EmaEntry("w1", 0.4), 2: EmaEntry("w2", 0.2), 3: EmaEntry("w3", 0.0)}
    alone = WeightEvidence(ema)
    assert miner_weights(alone, CONFIG) == weights_from_ema(ema, CONFIG.weight_exponent)
    assert weights_to_submit(alone, CONFIG) == {1: pytest.approx(0.8), 2: pytest.approx(0.2)}
    whole_work = {1: MinerWork("w1", 1000, 40.0), 2: MinerWork("w2", 1000, 40.0)}
    stages = {10 + i: MinerWork(f"s{i}", 1000, block_share(costs, a, b) * 40.0, layers=(a, b))
              for i, (a, b) in enumerate(CUTS)}
    blamed = WeightEvidence(ema, whole_work, StageEvidence(stages, {"w2": "receipts not signed"}, costs))
    weights = miner_weights(blamed, CONFIG)
    assert weights.get(2, 0.0) == 0.0 and weights[1] > 0 and all(weights[uid] > 0 for uid in stages)
    assert weights == pytest.approx(one_vector({1: 0.8, 2: 0.0, 3: 0.0}, whole_work, stages, costs)[0])
    submitted = weights_to_submit(blamed, CONFIG)
    assert set(submitted) == {1, *stages} and sum(submitted.values()) == pytest.approx(1.0)
    unloaded = WeightEvidence(ema, whole_work, StageEvidence(stages, {"w2": "receipts not signed"}, None))
    assert miner_weights(unloaded, CONFIG) == {1: pytest.approx(0.8), 2: 0.0, 3: 0.0}


def test_miners_whose_answers_carry_no_state_commitment_are_paid_at_the_stated_discount():
    """An engine that cannot commit to its layer states (vLLM, SGLang behind inference/serving/remote.py) is verified
    by less: its miner's weight is multiplied by c + (1 - c) x uncommitted_weight_factor (c: its committed share),
    the others share what it loses, and a miner with nothing measured is not discounted."""
    ema = {1: ("committing", 0.5), 2: ("vllm", 0.5), 3: ("half", 0.5), 4: ("unmeasured", 0.5)}
    committed = {1: 1.0, 2: 0.0, 3: 0.5}
    weights = miner_weights(WeightEvidence(ema, committed=committed), CONFIG)
    assert CONFIG.uncommitted_weight_factor == 0.5
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights[2] / weights[1] == pytest.approx(0.5) and weights[3] / weights[1] == pytest.approx(0.75)
    assert weights[4] == pytest.approx(weights[1])
    # no discount asked: exactly the EMA^2 shares; everyone committing: the same
    assert miner_weights(WeightEvidence(ema, committed=committed), CONFIG.replace(uncommitted_weight_factor=1.0)) \
        == pytest.approx(weights_from_ema(ema))
    assert miner_weights(WeightEvidence(ema, committed={u: 1.0 for u in ema}), CONFIG) == \
        pytest.approx(weights_from_ema(ema))
    # a gated miner stays at 0; an uncommitted one alone keeps the whole weight (the discount is relative)
    assert miner_weights(WeightEvidence({1: ("a", 0.0), 2: ("b", 0.4)}, committed={2: 0.0}), CONFIG) == \
        {1: 0.0, 2: pytest.approx(1.0)}
    with pytest.raises(Exception, match="uncommitted_weight_factor"):
        CONFIG.replace(uncommitted_weight_factor=1.5)


def test_layer_costs_come_from_the_config_alone_and_count_every_parameter(costs):
    """scoring.stage_rewards.active_params_per_layer from a config equals counting a model's own tensors (the routed
    experts, MXFP4 buffers included, times k / E; the embedding a lookup, the head on the last layer)."""
    import torch

    for config in (ModelConfig.tiny(), ModelConfig.tiny_kimi_linear(), ModelConfig.tiny(mxfp4_experts=False)):
        with torch.device("meta"):
            model = KimiK3Model(config, random_init=False)
        counted = []
        for layer in model.layers:
            dense = routed = 0
            tensors = list(layer.named_parameters()) + [(n, b) for n, b in layer.named_buffers() if ".experts." in n]
            for name, t in tensors:
                if name.endswith("weight_scale"):
                    continue
                n = t.numel() * (2 if t.dtype == torch.uint8 else 1)
                if ".experts." in f".{name}":
                    routed += n
                else:
                    dense += n
            counted.append(dense + routed * config.experts_per_token / config.num_experts)
        counted[0] += config.hidden_size
        counted[-1] += config.hidden_size * config.vocab_size
        assert active_params_per_layer(config) == pytest.approx(counted)
    assert active_params_per_layer(KimiK3Model(ModelConfig.tiny())) == costs
