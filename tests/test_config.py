import pytest

from inference.model import ConfigError, ModelConfig


def test_kimi_k3_counts_are_exact():
    c = ModelConfig.kimi_k3()
    assert c.num_parameters() == 2_779_484_478_208
    assert c.num_active_parameters() == 104_189_614_848
    assert c.checkpoint_bytes() == 1_559_965_606_912
    assert c.num_routed_active_parameters() == 48_620_371_968
    assert c.expert_bytes() == 17_547_264
    assert c.kda_state_bytes_per_sequence() == 434_110_464
    assert c.mla_cache_bytes_per_token() == 27_648


def test_kimi_k3_layer_layout():
    c = ModelConfig.kimi_k3()
    assert c.num_mla_layers == 24 and c.num_kda_layers == 69
    assert c.mla_layers[:3] == (3, 7, 11) and c.mla_layers[-2:] == (91, 92)
    assert c.moe_layers[0] == 1 and len(c.moe_layers) == 92


@pytest.mark.parametrize("cfg", [ModelConfig.kimi_k3(), ModelConfig.tiny(), ModelConfig.tiny_grouped(),
                                 ModelConfig.tiny_kimi_linear()])
def test_hf_config_round_trip(cfg):
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_hf_config_accepts_deepseek_aliases_and_one_based_lists():
    hf = ModelConfig.tiny().to_hf_config()
    t = hf["text_config"]
    t["n_routed_experts"] = t.pop("num_experts")
    t["num_experts_per_tok"] = t.pop("num_experts_per_token")
    t["n_shared_experts"] = t.pop("num_shared_experts")
    t["n_group"] = t.pop("num_expert_group")
    t["norm_topk_prob"] = t.pop("moe_renormalize")
    c = ModelConfig.from_hf_config(hf)
    assert c == ModelConfig.tiny()
    assert c.mla_layers == (3, 7, 11, 12)


def test_tiny_is_about_a_million_parameters():
    assert 1_000_000 < ModelConfig.tiny().num_parameters() < 1_400_000


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(latent_size=48), "multiple of 32"),
        (dict(expert_intermediate_size=40), "multiple of 32"),
        (dict(experts_per_token=17), "exceeds the number of experts"),
        (dict(mla_layers=(3, 13)), "outside"),
        (dict(n_group=3), "do not split"),
        (dict(a_log_size=2), "smaller than"),
    ],
)
def test_invalid_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.tiny(**overrides)


def test_layer_lists_that_do_not_cover_the_layers():
    hf = ModelConfig.tiny().to_hf_config()
    hf["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    with pytest.raises(ConfigError, match="every layer"):
        ModelConfig.from_hf_config(hf)
    hf["text_config"]["linear_attn_config"]["full_attn_layers"] = [0, 4]
    with pytest.raises(ConfigError, match="1-based"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize("document", [
    {},
    {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
     "intermediate_size": 512, "vocab_size": 512},
    {"num_hidden_layers": "two"},
])
def test_a_config_that_is_not_kimi_k3_is_a_config_error(tmp_path, document):
    import json

    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path)
    assert "config.json" in str(info.value)
