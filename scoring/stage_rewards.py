"""One market for whole-model miners and stage miners: one weight vector over both kinds.

The unit of work is a **model-token**: one token through every layer of the model, embedding to head. A
whole-model miner that serves T verified tokens did T model-tokens of work. A stage miner whose block holds a
share `s` of the model's per-token compute (its layers' active parameters over all layers' active
parameters; the embedding counts with layer 0's stage and the head with the last layer's) and that served T
verified tokens through its block (in routes and in probes) did s x T model-tokens. Speed is measured in
model-tokens per second: 1 / step time for a whole-model miner, s / step time for a stage; a route of N stages
each taking s_i x t per token runs the model at 1 / t, exactly like one miner taking t. Each miner's score is

    work x (speed / best speed of any miner) x availability

(availability: the fraction of probes it answered in the window), and 0 when it failed a stage challenge or
a verification audit (with the reason kept). Scores are normalised to weights summing to 1. So serving the
whole model as one miner and as N stages earns the same in total, for the same verified work at the same
speed: the stage shares sum to 1 and the speed of each stage is the speed of the route. scoring.weights
(`one_vector`) puts both kinds in the vector the validator submits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class MinerWork:
    """One miner's window. Whole-model miners: layers = None. Stage miners: layers = (start, stop)."""

    hotkey: str
    verified_tokens: int  # tokens through its block (stage) or its model (whole) on verified work
    step_ms: float  # measured per-token time of its block (stage) or the whole model
    availability: float = 1.0  # fraction of probes answered
    layers: tuple[int, int] | None = None
    failed_checks: list[str] = field(default_factory=list)  # failed challenges or audits: zeroed


@dataclass
class MarketScore:
    hotkey: str
    work: float  # model-tokens
    speed: float  # model-tokens per second
    score: float
    weight: float = 0.0
    reason: str = ""


def block_share(layer_costs: Sequence[float], start: int, stop: int) -> float:
    """The share of the per-token compute of layers [start, stop) (layer_costs: per layer, head and
    embedding folded into the last and first layer)."""
    total = float(sum(layer_costs))
    if not 0 <= start < stop <= len(layer_costs) or total <= 0:
        raise ValueError(f"layers [{start}, {stop}) outside the model's {len(layer_costs)} layers")
    return float(sum(layer_costs[start:stop])) / total


def active_params_per_layer(config) -> list[float]:
    """Per-token active parameters of each layer of a model of `config` (a ModelConfig, or a model: its config),
    computed from the config alone: all its parameters but the routed experts, plus the routed experts times
    experts_per_token / num_experts (MXFP4 experts count their weights, two per packed byte); the embedding is
    added to layer 0 as a lookup (D values) and the head (final norm, lm_head) to the last layer. The router's
    selection bias steers the choice and is not counted."""
    cfg = getattr(config, "config", config)
    D = cfg.hidden_size
    kda_bf16, kda_fp32 = cfg._kda_params()
    kda = kda_bf16 + kda_fp32 - cfg.a_log_size + cfg.kda_heads  # the model holds one A_log value per head
    moe_bf16, _ = cfg._moe_dense_params()
    routed = cfg.experts_per_token * cfg._expert_params()
    costs = []
    for i in range(cfg.num_layers):
        attention = cfg._mla_params() if cfg.is_mla(i) else kda
        mlp = moe_bf16 + routed if cfg.is_moe(i) else 3 * D * cfg.dense_intermediate_size
        costs.append(float(cfg._layer_common_params() + attention + mlp))
    costs[0] += D
    costs[-1] += D * cfg.vocab_size
    return costs


def market_scores(miners: Sequence[MinerWork], layer_costs: Sequence[float]) -> list[MarketScore]:
    """Scores and weights of whole-model and stage miners together (the module doc's rule)."""
    rows = []
    for m in miners:
        share = 1.0 if m.layers is None else block_share(layer_costs, *m.layers)
        work = share * max(0, m.verified_tokens)
        speed = share / (m.step_ms / 1000.0) if m.step_ms and m.step_ms > 0 else 0.0
        rows.append(MarketScore(m.hotkey, work, speed, 0.0))
    best = max((r.speed for r in rows), default=0.0)
    for r, m in zip(rows, miners):
        if m.failed_checks:
            r.reason = "; ".join(m.failed_checks)
            continue
        a = min(1.0, max(0.0, m.availability))
        r.score = r.work * (r.speed / best if best > 0 else 0.0) * a
    total = sum(r.score for r in rows)
    for r in rows:
        r.weight = r.score / total if total > 0 else 0.0
    return rows


__all__ = ["MinerWork", "MarketScore", "block_share", "active_params_per_layer", "market_scores"]
