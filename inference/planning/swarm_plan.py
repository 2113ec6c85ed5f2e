"""Swarm plans: which independent machine holds which contiguous layer block of one model.

A swarm is a route of stage miners, each an independent operator's machine (its own devices, joined to the
next stage by a WAN or LAN link). Planning one means choosing the cuts: where layer blocks start and end.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from inference.model import ModelConfig
from inference.planning.cost_model import CostModel, CostParams
from inference.planning.plan import MemoryPolicy, Plan, attn_res_sources
from inference.planning.planner import Cluster, ClusterError, PlannerOptions, _build_candidate, _does_not_fit


def stage_blocks(num_layers: int, block_size: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous layer ranges [start, stop) covering 0..num_layers-1 as evenly as possible, cutting
    only at Attention Residuals block boundaries (multiples of `block_size`) while there are enough of them
    (a cut there carries no partial sum), else at even layer counts."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    boundaries = [b for b in range(block_size, num_layers, block_size)] if block_size > 0 else []
    if stages - 1 <= len(boundaries):
        cuts: list[int] = []
        for i in range(1, stages):
            target = i * num_layers / stages
            # the nearest free boundary after the last cut that leaves enough boundaries for the cuts still to come
            left = [b for b in boundaries if (not cuts or b > cuts[-1])
                    and sum(1 for c in boundaries if c > b) >= stages - 1 - i]
            cuts.append(min(left, key=lambda b: (abs(b - target), b)))
    else:
        cuts = [round(i * num_layers / stages) for i in range(1, stages)]
    edges = [0, *cuts, num_layers]
    return list(zip(edges[:-1], edges[1:]))


# ============================================================== swarm plans on a cluster file
# A swarm cluster file is an ordinary cluster file (inference/planning/clusters) whose hosts are independent
# operators' machines and whose `inter_host` link is what joins them (a WAN: 10-50 ms RTT, 0.1-1 Gbit/s; or a
# LAN). The route driver is one more party on that network (`driver_latency_s`, default the inter_host
# latency). Each host serves one contiguous layer block over its own devices
# (experts spread over them by the ordinary planner); every token crosses every host in turn.
@dataclass
class SwarmCut:
    layer: int  # the first layer of the next stage
    at_block_boundary: bool
    vectors_per_token: int  # completed block sums + the partial (AttnRes), each hidden_size wide
    bytes_per_token: int  # bf16
    prefill_bytes: int  # for `prefill_tokens`
    prefill_seconds: float  # those bytes over the link


@dataclass
class SwarmPlan:
    model_id: str
    cluster: str
    plan: Plan
    breakdown_s: dict  # the cost model's time per token by category (its S hops; the driver's extra is apart)
    cuts: list[SwarmCut]
    hops_per_token: int  # driver -> stage 1 -> ... -> stage N -> driver
    hop_latency_s: float  # one way between operators
    driver_latency_s: float
    seconds_per_token: float
    ttft_s: float
    prompt_tokens: int
    prefill_tokens: int
    split: str  # "block boundaries" or "memory" (when block-boundary cuts do not fit)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token

    @property
    def wire_bytes_per_token(self) -> int:
        """Bytes every decoded token puts on the operators' links (bf16 residual state at each cut)."""
        return sum(c.bytes_per_token for c in self.cuts)

    @property
    def latency_share(self) -> float:
        """Of the time per token, the share that is hop latency (the N x RTT of the swarm law)."""
        return self.hops_per_token * self.hop_latency_s / self.seconds_per_token

    def summary(self) -> dict:
        return {
            "model": self.model_id, "cluster": self.cluster, "operators": len(self.plan.stages), "split": self.split,
            "layers_per_operator": [s.end_layer - s.first_layer for s in self.plan.stages],
            "hop_latency_ms": self.hop_latency_s * 1e3, "hops_per_token": self.hops_per_token,
            "tokens_per_s": self.tokens_per_s, "seconds_per_token": self.seconds_per_token,
            "compute_s_per_token": self.seconds_per_token - self.hops_per_token * self.hop_latency_s,
            "ttft_s": self.ttft_s, "prompt_tokens": self.prompt_tokens,
            "wire_bytes_per_token": self.wire_bytes_per_token,
            "cuts": [dataclasses.asdict(c) for c in self.cuts],
        }

    def to_markdown(self) -> str:
        s = self.summary()
        lines = [f"## {self.model_id} as a swarm on {self.cluster}", "",
                 f"{s['operators']} operators, layer blocks cut at {self.split}; one-way hop {s['hop_latency_ms']:g} ms "
                 f"({s['hops_per_token']} hops per token, driver -> stage 1 -> ... -> stage N -> driver).", "",
                 "| prediction | value |", "|---|---|",
                 f"| tokens/s, one stream | {s['tokens_per_s']:.2f} |",
                 f"| time per token | {s['seconds_per_token'] * 1e3:.1f} ms ({s['compute_s_per_token'] * 1e3:.1f} ms "
                 f"compute and transfer, {self.latency_share:.0%} hop latency) |",
                 f"| TTFT, {self.prompt_tokens}-token prompt | {s['ttft_s']:.2f} s |",
                 f"| wire bytes per token (all cuts, bf16) | {s['wire_bytes_per_token'] / 1e3:.1f} KB |", "",
                 "| stage | layers | devices | host |", "|---|---|---|---|"]
        for st in self.plan.stages:
            lines.append(f"| {st.index} | {st.first_layer}-{st.end_layer - 1} | {len(st.ranks)} | "
                         f"{self.plan.devices[st.ranks[0]].host} |")
        lines += ["", f"| cut before layer | block boundary | vectors/token | bytes/token | "
                      f"{self.prefill_tokens}-token prefill | at link rate |", "|---|---|---|---|---|---|"]
        for c in self.cuts:
            lines.append(f"| {c.layer} | {'yes' if c.at_block_boundary else 'no'} | {c.vectors_per_token} | "
                         f"{c.bytes_per_token / 1e3:.1f} KB | {c.prefill_bytes / 1e9:.2f} GB | {c.prefill_seconds:.2f} s |")
        return "\n".join(lines) + "\n"


def snap_to_blocks(runs: list[tuple[int, int]], num_layers: int, block_size: int) -> list[tuple[int, int]] | None:
    """The same number of stages with every cut moved to its nearest Attention Residuals block boundary
    (None when there are too few boundaries for distinct cuts)."""
    boundaries = list(range(block_size, num_layers, block_size))
    cuts = [b for _, b in runs[:-1]]
    if len(cuts) > len(boundaries):
        return None
    snapped: list[int] = []
    for i, c in enumerate(cuts):
        room = len(cuts) - i - 1  # boundaries that must stay free after this one
        options = [b for b in boundaries if (not snapped or b > snapped[-1])
                   and sum(1 for x in boundaries if x > b) >= room]
        snapped.append(min(options, key=lambda b: (abs(b - c), b)))
    edges = [0, *snapped, num_layers]
    return list(zip(edges[:-1], edges[1:]))


def plan_swarm(config: ModelConfig, cluster: Cluster, *, concurrency: int = 1, context: int = 32768,
               prompt_tokens: int = 8192, prefill_tokens: int = 16384, hop_latency_s: float | None = None,
               bandwidth: float | None = None, driver_latency_s: float | None = None,
               params: CostParams | None = None, preset: str | None = None) -> SwarmPlan:
    """Plan `config` over the cluster's hosts as a swarm: one layer block per host, cut at block boundaries when
    that fits (else where memory says), each block laid out over its host's devices by the ordinary planner.
    `hop_latency_s` / `bandwidth` override the inter-host link (what-if over WAN conditions). Raises
    PlanDoesNotFit when no split fits."""
    if hop_latency_s is not None or bandwidth is not None:
        inter = cluster.links.inter_host
        inter = dataclasses.replace(inter, latency=inter.latency if hop_latency_s is None else hop_latency_s,
                                    bandwidth=inter.bandwidth if bandwidth is None else bandwidth)
        cluster = dataclasses.replace(cluster, links=dataclasses.replace(cluster.links, inter_host=inter))
    hosts = cluster.hosts
    if len(hosts) < 2:
        raise ClusterError(f"{cluster.name}: a swarm needs at least 2 hosts (operators), it has {len(hosts)}")
    if len(hosts) > config.num_layers:
        raise ClusterError(f"{cluster.name}: {len(hosts)} operators for {config.num_layers} layers")
    params = (params or CostParams()).with_overrides(cluster.cost_params)
    policy = MemoryPolicy(**cluster.memory_policy)
    options = PlannerOptions()
    groups = [[d.rank for d in cluster.devices if d.host == h] for h in hosts]
    label = "one operator per stage"
    by_memory = _build_candidate(config, cluster, label, groups, concurrency, context, policy, options, {}, preset)
    chosen, split = by_memory, "memory"
    if by_memory.plan is not None:
        runs = [(s.first_layer, s.end_layer) for s in by_memory.plan.stages]
        blocks = snap_to_blocks(runs, config.num_layers, config.attn_res_block_size)
        if blocks is not None:
            by_blocks = _build_candidate(config, cluster, label + ", block-boundary cuts", groups, concurrency,
                                         context, policy, options, {}, preset, runs=blocks)
            if by_blocks.plan is not None and not by_blocks.overflows:
                chosen, split = by_blocks, "block boundaries"
    if chosen.plan is None or chosen.overflows:
        raise _does_not_fit(config, cluster, [by_memory], concurrency, context)
    return predict(config, cluster.name, chosen.plan, split, params=params, prompt_tokens=prompt_tokens, prefill_tokens=prefill_tokens, driver_latency_s=driver_latency_s)


def predict(config: ModelConfig, cluster_name: str, plan: Plan, split: str, *, params: CostParams,
            prompt_tokens: int = 8192, prefill_tokens: int = 16384, driver_latency_s: float | None = None) -> SwarmPlan:
    """The cost model's predictions for a swarm plan (its links as they are in `plan.links`)."""
    model = CostModel(config, plan, params)
    token = model.token_time()
    ttft = model.ttft(prompt_tokens)["seconds"]
    link = plan.links.inter_host
    driver = link.latency if driver_latency_s is None else driver_latency_s
    S = len(plan.stages)
    # the cost model closes the loop last stage -> first (S hops); a route goes through the driver (S + 1)
    extra = 2 * driver - link.latency
    cuts = []
    for st in plan.stages[1:]:
        vectors = attn_res_sources(config, st.first_layer)
        per_token = vectors * config.hidden_size * 2
        cuts.append(SwarmCut(layer=st.first_layer, at_block_boundary=st.first_layer % config.attn_res_block_size == 0,
                             vectors_per_token=vectors, bytes_per_token=per_token,
                             prefill_bytes=per_token * prefill_tokens,
                             prefill_seconds=per_token * prefill_tokens / (link.bandwidth * params.link_efficiency)))
    return SwarmPlan(model_id=config.model_id, cluster=cluster_name, plan=plan, breakdown_s=dict(token.breakdown),
                     cuts=cuts, hops_per_token=S + 1, hop_latency_s=link.latency, driver_latency_s=driver,
                     seconds_per_token=token.total + extra, ttft_s=ttft + extra, prompt_tokens=prompt_tokens, prefill_tokens=prefill_tokens,
                     split=split)


def over_link(sp: SwarmPlan, config: ModelConfig, *, latency_s: float, bandwidth: float,
              params: CostParams) -> SwarmPlan:
    """The same layout with the operators joined by another link (another RTT or rate): the cost model again."""
    inter = dataclasses.replace(sp.plan.links.inter_host, latency=latency_s, bandwidth=bandwidth)
    plan = dataclasses.replace(sp.plan, links=dataclasses.replace(sp.plan.links, inter_host=inter))
    return predict(config, sp.cluster, plan, sp.split, params=params, prompt_tokens=sp.prompt_tokens, prefill_tokens=sp.prefill_tokens,
                   driver_latency_s=None if sp.driver_latency_s == sp.hop_latency_s else sp.driver_latency_s)
