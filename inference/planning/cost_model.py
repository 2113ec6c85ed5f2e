"""Cost model of a placement plan: time per token, throughput, TTFT, energy (docs/engine.md section 4).

Per decoded token of one stream:

    T_tok = sum over layers [ hop into the layer + T_home(l) + T_par(l) ] + T_head + return hop
    T_home(l) = dense bytes of l / B_mem(home) + KDA state or MLA cache read + launch overhead
    T_par(l)  = E[ max( T_shared + own experts on home,
                        max over remote devices d hit: 2 alpha(home, d) + messages + experts on d ) ]
    messages  = sum over remote d of P(d hit) * (dispatch + combine bytes) / B_link(home, d)

`T_par` is engine.md's `max(T_shared, T_routed)` with the max taken over the random expert
selection rather than over averages: per device the number of selected experts is fitted
from its first two moments (independent picks without routing statistics, which gives
E[n_dest] = G (1 - (1 - 1/G)^k) for uniform placement; the measured co-activation with
them), and the expectation of the max is computed exactly from those distributions. A
hop carries every AttnRes block sum plus the partial sum (`plan.attn_res_sources`).

Batches (concurrency c, prefill chunks): weights are read once per step for the whole batch,
experts once per distinct expert hit (E[distinct] = sum_e 1 - (1 - p_e)^b), state, cache and
activations once per token; every matrix product is the max of its memory time and its
compute time. Energy counts every device at full board power for the whole time (an upper
bound: idle devices draw less).

Pipelined decode (`decode_round`): the c streams go in m micro-batches of ceil(c / m), up to
f of them in flight; each micro-batch's next step starts when its logits are back, so a round
(every stream one token) takes m x max(loop latency / f, slowest stage[, the stages' sum / N when
`shared_cores` N: ranks that are processes on one CPU]), the loop and the stage
times those of one micro-batch (a stage's time without the links' propagation latency, which
delays a micro-batch but does not keep the stage from the next one). f = 1 is one step at a time; f = m >= S keeps every stage busy
when the loop is short enough.

Speculative decoding (`speculative_token_time`): a verify step runs 1 + k positions of one
stream (a decode step of b = k + 1 rows: weights read once, k + 1 rows of compute, state and
messages); with drafts accepted independently with probability g it emits
E(k) = (1 - g^(k+1)) / (1 - g) tokens, so a token costs T_step(k + 1) / E(k).

Links: every hop and message pays the link's one-way latency plus bytes / bandwidth
(`hop_time`); `return_logits` makes the head's answer the full fp32 logits rows (this
repository's runtime) instead of sampled token ids, and `step_overhead_s` adds a fixed cost per
step outside the layers (a driver's pipe, a step header).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from inference.model import ModelConfig
from inference.planning.plan import (DENSE_DTYPE_SCALE, Plan, RoutingStats, attn_res_sources, layer_weights,
                                     lm_head_bytes)


@dataclass(frozen=True)
class CostParams:
    """Every constant of the model, with the reason for its default."""

    # Achievable fraction of peak memory bandwidth when streaming weights (decode GEMV).
    mem_efficiency: float = 0.85
    # Achievable fraction of peak bf16 FLOP/s for large matrix products (prefill, big batches).
    compute_efficiency: float = 0.5
    # Achievable fraction of nominal link bandwidth after protocol overhead (TCP/NCCL).
    link_efficiency: float = 0.8
    # Kernel launches and synchronisation per layer on its home device, per step.
    launch_overhead_s: float = 20e-6
    # Fixed cost for a device that runs experts of one layer in a step (launches, gather).
    expert_overhead_s: float = 10e-6
    # Bytes per selected expert sent with a dispatch besides the latent (expert id + weight).
    routing_metadata_bytes: int = 8
    # Tokens per prefill chunk (long prompts are prefilled chunk by chunk, pipelined over stages).
    prefill_chunk_tokens: int = 4096
    # KDA chunk length of the chunkwise prefill form (only its FLOP count uses it).
    kda_chunk: int = 64
    # What-if knobs used by the "what would it take" analysis; 1 means the plan as it is.
    dense_weight_scale: float = 1.0  # dense bytes relative to bf16: 0.5 = fp8, 0.265625 = MXFP4
    dense_split: int = 1  # each layer's home work tensor-split over this many devices of its host
    mem_bandwidth_scale: float = 1.0  # multiplies every device's memory bandwidth
    # The head answers with full fp32 logits rows (inference.sharding does, so rank 0 can sample) rather
    # than the 8-byte sampled token ids a production engine sends back.
    return_logits: bool = False
    # Fixed cost of a step outside the layers: the driver's pipe to rank 0, the step header (0: none).
    step_overhead_s: float = 0.0
    # 0: every device computes on its own. N: the plan's devices are processes sharing N CPU cores (an
    # emulation on one machine), so the stages' work in a pipelined round cannot run faster than N at once.
    shared_cores: int = 0

    def __post_init__(self):
        for name in ("mem_efficiency", "compute_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1]")
        if self.dense_split < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("dense_split and prefill_chunk_tokens must be >= 1")
        if self.shared_cores < 0:
            raise ValueError("shared_cores must be >= 0 (0: devices do not share cores)")

    def with_overrides(self, overrides: dict | None) -> "CostParams":
        if not overrides:
            return self
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown cost parameters {sorted(unknown)}")
        return dataclasses.replace(self, **overrides)


BREAKDOWN_KEYS = ("dense_reads", "state_cache", "expert_reads", "messages", "home_hops", "stage_hops",
                  "head", "launch")


@dataclass
class TokenTime:
    total: float
    breakdown: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.total


# ======================================================= selection count distributions
def _binomial_pmf(n: int, p: float, k: int) -> np.ndarray:
    x = np.arange(k + 1)
    out = np.zeros(k + 1)
    top = min(n, k)
    if p <= 0:
        out[0] = 1.0
        return out
    if p >= 1:
        out[min(n, k)] = 1.0
        return out
    xs = x[: top + 1]
    logc = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in xs])
    out[: top + 1] = np.exp(logc + xs * math.log(p) + (n - xs) * math.log1p(-p))
    return out


def _set_p0(row: np.ndarray, p0: float) -> None:
    """Use the un-rounded trial count for P(X = 0), which sets how often a device is hit;
    the rounded distribution keeps the shape of X given X > 0."""
    rest = row[1:].sum()
    if rest > 0:
        row[1:] *= (1 - p0) / rest
        row[0] = p0


def selection_count_pmf(mu: np.ndarray, m2: np.ndarray | None, k: int) -> np.ndarray:
    """[G, k+1]: distribution of how many of a token's k experts land on each device.

    Without co-activation (m2 None) the k picks are independent: Binomial(k, mu / k), which
    gives engine.md's E[n_dest] = G (1 - (1 - 1/G)^k) for a uniform spread. With it, a
    distribution matching the mean mu and the factorial moment m2 = E[X(X-1)]:
    - picks that repel (m2 below the independent (k-1)/k mu^2): Binomial(n, mu/n), n from m2;
    - picks that come in clumps (co-activated experts on the same device): the k picks travel
      in n = k / c clumps of c experts, each clump on the device with probability mu / k;
      c follows from m2. A device is then hit less often than independent picks suggest.
    """
    mu = np.clip(np.asarray(mu, dtype=float), 0.0, float(k))
    G = len(mu)
    x = np.arange(k + 1)
    if m2 is None:
        q = mu / k
        comb = np.array([math.comb(k, i) for i in x], dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            pmf = comb * q[:, None] ** x * (1 - q[:, None]) ** (k - x)
        return np.nan_to_num(pmf)
    pmf = np.zeros((G, k + 1))
    for d in range(G):
        m, f2 = float(mu[d]), float(m2[d])
        q = m / k
        if m <= 1e-12:
            pmf[d, 0] = 1.0
        elif q >= 1 - 1e-12:
            pmf[d, k] = 1.0
        elif f2 > (k - 1) / k * m * m * (1 + 1e-9):
            c = (f2 - m * m + m) / (m * (1 - q))  # experts per clump
            n_real = max(1.0, k / c)
            n = max(1, int(round(n_real)))
            for y, prob in enumerate(_binomial_pmf(n, q, n)):
                pmf[d, min(k, int(round(y * k / n)))] += prob
            _set_p0(pmf[d], (1 - q) ** n_real)
        else:
            r = f2 / (m * m)
            n_real = max(1 / (1 - r), m, 1.0)
            n = max(int(round(n_real)), math.ceil(m - 1e-9), 1)
            row = _binomial_pmf(n, m / n, max(n, k))
            pmf[d, :k] = row[:k]
            pmf[d, k] = row[k:].sum()
            _set_p0(pmf[d], (1 - m / n_real) ** n_real)
    return pmf


def expected_max(pmf: np.ndarray, values: np.ndarray) -> float:
    """E[max_d values[d, X_d]] for independent X_d ~ pmf[d]; each values row nondecreasing in x.

    Counts whose probability is below 1e-13 on every device are dropped (their mass is
    negligible), and identical devices are evaluated once (F^count).
    """
    significant = np.nonzero((pmf > 1e-13).any(axis=0))[0]
    width = int(significant[-1]) + 1 if len(significant) else 1
    pmf, values = pmf[:, :width], values[:, :width]
    counts = np.ones(len(pmf))
    if len(pmf) > 16:  # big stages: most devices look alike, evaluate each kind once
        rows, counts = np.unique(np.concatenate([values, pmf], axis=1), axis=0, return_counts=True)
        values, pmf = rows[:, :width], rows[:, width:]
    grid = np.unique(values)
    below = values[:, :, None] <= grid[None, None, :]  # [rows, x, grid]
    F_rows = np.einsum("rx,rxg->rg", pmf, below)
    F = np.prod(np.minimum(F_rows, 1.0) ** counts[:, None], axis=0)
    return float(np.sum(grid * np.diff(np.concatenate(([0.0], F)))))


# ======================================================= one MoE layer's expert section
@dataclass
class RoutedLayer:
    """Expected expert traffic of one MoE layer under a placement (stage-local device indices)."""

    ranks: np.ndarray  # [G] global ranks of the stage
    home: int  # index into ranks
    slot_dev: np.ndarray  # [slots] device index of each expert copy
    slot_p: np.ndarray  # [slots] probability a token sends to this copy (p_e / copies)
    slot_expert: np.ndarray  # [slots] expert id
    mu: np.ndarray  # [G] expected experts per token on each device
    m2: np.ndarray | None  # [G] E[X(X-1)] from co-activation, or None

    @classmethod
    def build(cls, holders: list[list[int]], ranks: list[int], home_rank: int, p: np.ndarray,
              pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> "RoutedLayer":
        index = {r: i for i, r in enumerate(ranks)}
        counts = np.fromiter((len(h) for h in holders), dtype=np.int64, count=len(holders))
        slot_expert = np.repeat(np.arange(len(holders)), counts)
        slot_dev = np.fromiter((index[r] for h in holders for r in h), dtype=np.int64, count=int(counts.sum()))
        slot_p = p[slot_expert] / counts[slot_expert]
        G = len(ranks)
        mu = np.bincount(slot_dev, weights=slot_p, minlength=G)
        m2 = None
        if pairs is not None and len(pairs[0]):
            # E[X_d (X_d - 1)] = 2 sum over co-activated pairs of copies on the same device of
            # P(pair) / (copies_i copies_j): expand each expert pair into its copy pairs
            pi, pj, pp = pairs
            first = np.concatenate(([0], np.cumsum(counts)[:-1]))
            ci, cj = counts[pi], counts[pj]
            per_pair = ci * cj
            owner = np.repeat(np.arange(len(pi)), per_pair)
            local = np.arange(int(per_pair.sum())) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
            sa = first[pi][owner] + local // cj[owner]
            sb = first[pj][owner] + local % cj[owner]
            same = slot_dev[sa] == slot_dev[sb]
            weight = (pp / (ci * cj))[owner]
            m2 = 2 * np.bincount(slot_dev[sa][same], weights=weight[same], minlength=G)
        return cls(np.asarray(ranks), index[home_rank], slot_dev, slot_p, slot_expert, mu, m2)

    def distinct(self, b: int) -> np.ndarray:
        """[G] expected distinct expert copies hit by b tokens."""
        return np.bincount(self.slot_dev, weights=1 - (1 - self.slot_p) ** b, minlength=len(self.ranks))


# ======================================================= the model
class CostModel:
    def __init__(self, config: ModelConfig, plan: Plan, params: CostParams | None = None,
                 routing: RoutingStats | None = None, coactivation: bool = True):
        """`routing` gives per-expert load (and co-activation, used unless coactivation=False);
        without it every expert is equally likely. A block plan (`plan.layer_range`, a swarm stage's own
        devices) has no whole token to price and is refused."""
        if plan.layer_range is not None:
            start, stop = plan.layer_range
            raise ValueError(f"the cost model prices whole-model plans; this is a block plan of layers "
                             f"[{start}, {stop}) (price the swarm's route instead: inference.planning.swarm_plan)")
        self.config, self.plan = config, plan
        self.params = params = params or CostParams()
        self.k = config.experts_per_token
        self.expert_bytes = config.expert_bytes()
        self.expert_params = 3 * config.latent_size * config.expert_intermediate_size
        self.act_bytes = plan.memory_policy.activation_dtype_bytes
        self.cache_bytes = plan.memory_policy.cache_dtype_bytes
        self.bw = np.array([d.mem_bandwidth for d in plan.devices]) * params.mem_efficiency * params.mem_bandwidth_scale
        self.fl = np.array([d.flops for d in plan.devices]) * params.compute_efficiency
        self.weights = [layer_weights(config, layer) for layer in range(config.num_layers)]
        self.stage_of_layer = [plan.stage_of(layer).index for layer in range(config.num_layers)]
        self.routed: dict[int, RoutedLayer] = {}
        self._pmf: dict[int, np.ndarray] = {}
        uniform = np.full(config.num_experts, self.k / config.num_experts)
        for layer, holders in plan.expert_placement.items():
            p, pairs = uniform, None
            rec = routing.layers.get(layer) if routing is not None else None
            if rec is not None and rec.tokens > 0:
                p = rec.selection_probability()
                if rec.has_coactivation and coactivation:
                    pairs = (rec.pair_i, rec.pair_j, rec.pair_probability())
            stage = plan.stages[self.stage_of_layer[layer]]
            self.routed[layer] = RoutedLayer.build(holders, list(stage.ranks), plan.layer_home[layer], p, pairs)
        self.kda_state_layer = (config.kda_state_bytes_per_sequence() + config.kda_conv_bytes_per_sequence()) \
            // max(config.num_kda_layers, 1)
        self.mla_width_bytes = config.mla_cache_width * self.cache_bytes
        self.dispatch_bytes = config.latent_size * self.act_bytes + self.k * params.routing_metadata_bytes
        self.combine_bytes = config.latent_size * self.act_bytes
        self.split_ok = self._dense_split_feasible()
        self._links_cache: dict = {}

    # --------------------------------------------------------------- links
    def link_between(self, a: int, b: int):
        return self.plan.links.between(self.plan.devices[a], self.plan.devices[b])

    def hop_time(self, src: int, dst: int, nbytes: float, propagation: bool = True) -> float:
        """One message: the link's one-way latency (left out with propagation=False: the time the message
        occupies its sender, which can send the next one meanwhile) plus bytes / bandwidth."""
        link = self.link_between(src, dst)
        if link is None:
            return 0.0
        return link.latency * propagation + nbytes / (link.bandwidth * self.params.link_efficiency)

    def _dense_split_feasible(self) -> bool:
        n = self.params.dense_split
        if n == 1:
            return True
        for layer, home in enumerate(self.plan.layer_home):
            stage = self.plan.stages[self.stage_of_layer[layer]]
            host = self.plan.devices[home].host
            if sum(1 for r in stage.ranks if self.plan.devices[r].host == host) < n:
                return False
        return True

    def split_of(self, layer: int | None) -> int:
        """Ranks sharing a layer's dense work (None: the LM head's): the plan's dense_split group, or the
        `dense_split` what-if when that is larger."""
        group = self.plan.head_group() if layer is None else self.plan.dense_group(layer)
        return max(self.params.dense_split, len(group))

    @property
    def dense_scale(self) -> float:
        """Dense weight bytes relative to bf16: the plan's dense_dtype times the `dense_weight_scale` what-if."""
        return self.params.dense_weight_scale * DENSE_DTYPE_SCALE[self.plan.dense_dtype]

    def _block_sync(self, n: int, rows: int, out_width: int) -> float:
        """One split block as the runtime runs it (inference.sharding.dense_split): the home sends the block's
        input to the n - 1 other ranks and each sends back its fp32 part (`out_width` values per row), over the
        host's link; messages to different peers share it unless it is per peer."""
        if n == 1:
            return 0.0
        link = self.plan.links.intra_host
        bw = link.bandwidth * self.params.link_efficiency
        fan = 1 if link.per_peer else n - 1
        nbytes = rows * (self.config.hidden_size * self.act_bytes + out_width * 4)
        return 2 * link.latency + fan * nbytes / bw

    def _split_sync(self, layer: int, b: int) -> float:
        """A split layer's exchanges: its attention block, and its dense MLP or shared-expert block."""
        n, D = self.split_of(layer), self.config.hidden_size
        blocks = 1 + (not self.config.is_moe(layer) or bool(self.config.num_shared_experts))
        return blocks * self._block_sync(n, b, D)

    # ------------------------------------------------------------ one layer
    def _home_times(self, layer: int, b: int, positions: float, prefill: bool) -> tuple[float, float, float]:
        """(dense time, state/cache/attention time, shared-expert time) on the home device.

        Decode: each of the b tokens attends over `positions` cached tokens. Prefill: b new
        tokens after `positions` earlier ones.
        """
        c, lw, p = self.config, self.weights[layer], self.params
        home = self.plan.layer_home[layer]
        bw, fl, n = self.bw[home], self.fl[home], self.split_of(layer)
        scale = self.dense_scale
        dense = max(lw.dense_bytes * scale / bw, 2 * (lw.attention_params + lw.mlp_params) * b / fl) / n
        shared = max(lw.shared_bytes * scale / bw, 2 * lw.shared_params * b / fl) / n
        if c.is_mla(layer):
            per_pair = 2 * c.mla_heads * (c.qk_head_dim + c.v_head_dim)
            if prefill:
                flops = per_pair * b * (positions + (b + 1) / 2)
                mem = b * self.mla_width_bytes + positions * self.mla_width_bytes  # write new, read earlier
            else:
                # absorbed form: scores over the 576-wide cache, values over the 512-wide latent
                flops = b * positions * 2 * c.mla_heads * (c.mla_cache_width + c.kv_lora_rank)
                mem = b * positions * self.mla_width_bytes
            state = max(mem / bw, flops / fl)
        else:
            H, d = c.kda_heads, c.kda_head_dim
            flops = b * 2 * H * (6 * d * d + 2 * p.kda_chunk * d) if prefill else b * 2 * H * 4 * d * d
            reads = 2 * self.kda_state_layer * (1 if prefill else b)  # read and write the state
            state = max(reads / bw, flops / fl)
        return dense, state / n, shared

    def layer_pmf(self, layer: int) -> np.ndarray:
        pmf = self._pmf.get(layer)
        if pmf is None:
            rl = self.routed[layer]
            pmf = self._pmf[layer] = selection_count_pmf(rl.mu, rl.m2, self.k)
        return pmf

    def _link_arrays(self, ranks: np.ndarray, home: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(one-way latency, 1 / effective bandwidth, own-link flag) from the home device to each device."""
        key = (ranks.tobytes(), home)
        cached = self._links_cache.get(key)
        if cached is None:
            G = len(ranks)
            lat, inv_bw, per_peer = np.zeros(G), np.zeros(G), np.zeros(G, dtype=bool)
            for d, r in enumerate(ranks):
                link = self.link_between(int(ranks[home]), int(r))
                if link is not None:
                    lat[d] = link.latency
                    inv_bw[d] = 1 / (link.bandwidth * self.params.link_efficiency)
                    per_peer[d] = link.per_peer
            cached = self._links_cache[key] = (lat, inv_bw, per_peer)
        return cached

    def _remote_links(self, ranks: np.ndarray, home: int, p_hit: np.ndarray, b: int) -> tuple[np.ndarray, float]:
        """(one-way latency to each hit remote device, message transfer time for b tokens).

        Messages over a shared pipe queue behind each other (their times add); over per-peer
        links they travel together (the longest counts); both kinds proceed at once."""
        lat_all, inv_bw, per_peer = self._link_arrays(ranks, home)
        hit = p_hit > 0
        hit[home] = False
        lat = np.where(hit, lat_all, 0.0)
        per_dest = b * (self.dispatch_bytes + self.combine_bytes) * np.where(hit, p_hit * inv_bw, 0.0)
        queued = float(per_dest[~per_peer].sum())
        parallel = float(per_dest[per_peer].max()) if per_peer.any() else 0.0
        return lat, max(queued, parallel)

    def parallel_single(self, ranks: np.ndarray, home: int, pmf: np.ndarray, shared: float,
                        components: bool = True) -> tuple[float, float, float]:
        """One token: (E[parallel section], message component, expert-read component)."""
        p = self.params
        G = len(ranks)
        p_hit = 1 - pmf[:, 0]
        lat, msg = self._remote_links(ranks, home, p_hit, 1)
        unit = np.maximum(self.expert_bytes / self.bw[ranks], 2 * self.expert_params / self.fl[ranks])
        x = np.arange(self.k + 1)
        values = unit[:, None] * x[None, :]
        values[:, 1:] += (2 * lat + msg + p.expert_overhead_s)[:, None]
        # the home device runs the shared experts, then its own routed experts, on one memory
        values[home] = shared + unit[home] * x + np.where(x > 0, p.expert_overhead_s, 0.0)
        active = (p_hit > 0) | (np.arange(G) == home)
        total = expected_max(pmf[active], values[active])
        if not components or total <= shared + 1e-15:
            return total, 0.0, 0.0
        remote = active.copy()
        remote[home] = False
        lat_vals = np.zeros((G, self.k + 1))
        lat_vals[:, 1:] = 2 * lat[:, None]
        msg_part = (expected_max(pmf[remote], lat_vals[remote]) if remote.any() else 0.0) + msg
        exp_vals = unit[:, None] * x[None, :]
        exp_part = expected_max(pmf[active], exp_vals[active]) + p.expert_overhead_s
        return total, msg_part, exp_part

    def parallel_batch(self, ranks: np.ndarray, home: int, pmf0: np.ndarray, mu: np.ndarray,
                       distinct: np.ndarray, b: int, shared: float) -> tuple[float, float, float]:
        """b tokens in one step: expert reads per distinct expert hit, messages per token."""
        p = self.params
        tokens = b * mu
        exp_time = np.maximum(distinct * self.expert_bytes / self.bw[ranks],
                              2 * self.expert_params * tokens / self.fl[ranks])
        exp_time = exp_time + np.where(tokens > 0, p.expert_overhead_s, 0.0)
        lat, msg = self._remote_links(ranks, home, 1 - pmf0, b)
        hit_batch = 1 - pmf0 ** b
        remote = np.where(hit_batch > 1e-12, 2 * lat + msg + exp_time, 0.0)
        remote[home] = 0.0
        total = max(shared + exp_time[home], float(remote.max()))
        if total <= shared + 1e-15:
            return total, 0.0, 0.0
        msg_part = 2 * float(lat.max()) + msg if remote.max() > 0 else 0.0
        return total, msg_part, float(exp_time.max())

    def layer_time(self, layer: int, b: int, positions: float, prefill: bool = False,
                   components: bool = True) -> dict[str, float]:
        """Time of one layer for a step of b tokens, by breakdown category (hops excluded)."""
        dense, state, shared = self._home_times(layer, b, positions, prefill)
        out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        out["dense_reads"] = dense
        out["state_cache"] = state
        out["launch"] = self.params.launch_overhead_s
        out["home_hops"] = self._split_sync(layer, b)
        if layer not in self.routed:
            out["dense_reads"] += shared
            return out
        rl, pmf = self.routed[layer], self.layer_pmf(layer)
        if b == 1 and not prefill:
            total, msg_part, exp_part = self.parallel_single(rl.ranks, rl.home, pmf, shared, components)
        else:
            total, msg_part, exp_part = self.parallel_batch(rl.ranks, rl.home, pmf[:, 0], rl.mu,
                                                            rl.distinct(b), b, shared)
        on_shared = min(shared, total)
        rest = total - on_shared
        out["dense_reads"] += on_shared
        if rest > 0:
            weight = msg_part + exp_part
            frac_msg = msg_part / weight if weight > 0 else 0.0
            out["messages"] += rest * frac_msg
            out["expert_reads"] += rest * (1 - frac_msg)
        return out

    # ------------------------------------------------------------ stages
    def _hop_bytes(self, layer: int, b: int) -> float:
        return b * attn_res_sources(self.config, layer) * self.config.hidden_size * self.act_bytes

    def stage_times(self, b: int, positions: float, prefill: bool = False,
                    components: bool = True, propagation: bool = True) -> list[dict[str, float]]:
        """Per stage, its time for one step of b tokens by category (the loop closes in the last). With
        propagation=False the hops between stages count only their serialisation: how long the stage is
        occupied, which bounds pipelined throughput (a link carries several micro-batches at once)."""
        c, plan = self.config, self.plan
        out = []
        for stage in plan.stages:
            acc = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
            for layer in stage.layers:
                prev = plan.embedding_rank if layer == 0 else plan.layer_home[layer - 1]
                same_stage = layer > 0 and self.stage_of_layer[layer - 1] == stage.index
                hop = self.hop_time(prev, plan.layer_home[layer], self._hop_bytes(layer, b),
                                    propagation or same_stage)
                acc["home_hops" if same_stage else "stage_hops"] += hop
                for key, value in self.layer_time(layer, b, positions, prefill, components).items():
                    acc[key] += value
            if stage.index == 0:
                emb = plan.embedding_rank
                acc["head"] += b * c.hidden_size * 2 / self.bw[emb]
            if stage.index == len(plan.stages) - 1:
                last, head = plan.layer_home[c.num_layers - 1], plan.lm_head_rank
                acc["stage_hops"] += self.hop_time(last, head, self._hop_bytes(c.num_layers, b), propagation)
                rows = 1 if prefill else b  # prefill needs logits of the last prompt token only
                bw, fl, n = self.bw[head], self.fl[head], self.split_of(None)
                acc["head"] += max(lm_head_bytes(c) * self.dense_scale / bw,
                                   2 * c.vocab_size * c.hidden_size * rows / fl) / n + self.params.launch_overhead_s
                acc["home_hops"] += self._block_sync(n, rows, c.vocab_size // n)
                if not prefill:  # the sampled token (or the logits) goes back to the embedding's device
                    back = b * c.vocab_size * 4 if self.params.return_logits else 8 * b
                    acc["stage_hops"] += self.hop_time(head, plan.embedding_rank, back, propagation)
                acc["launch"] += self.params.step_overhead_s
            out.append(acc)
        return out

    # ------------------------------------------------------------ predictions
    def token_time(self, context: int | None = None, components: bool = True) -> TokenTime:
        """One stream decoding at `context` tokens of history (default: the plan's target).

        With components=False the total is exact but the split of each layer's parallel
        section between messages and expert reads is not computed (faster)."""
        positions = self.plan.context if context is None else context
        total = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        for st in self.stage_times(1, positions, components=components):
            for key, value in st.items():
                total[key] += value
        return TokenTime(sum(total.values()), total)

    def throughput(self, concurrency: int, context: int | None = None) -> dict:
        """Aggregate decode tokens/s with `concurrency` streams, each at `context` tokens."""
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        S = len(self.plan.stages)
        best = None
        top = min(S, concurrency)
        # micro-batch counts tried: powers of two up to the most that can be in flight, and that most
        for m in sorted({2 ** i for i in range(top.bit_length()) if 2 ** i <= top} | {top}):
            r = self.decode_round(concurrency, m, context)
            if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                best = {"concurrency": concurrency, **r}
        best["tokens_per_joule"] = best["tokens_per_s"] / self.total_power_w() if self.total_power_w() else None
        best["within_reservation"] = concurrency <= self.plan.concurrency
        return best

    def decode_round(self, concurrency: int, micro_batches: int, context: int | None = None,
                     in_flight: int | None = None) -> dict:
        """Pipelined decode of `concurrency` streams in `micro_batches` micro-batches of which at most
        `in_flight` (default: all) are in the pipeline at once (see the module docstring): the round time
        (every stream one token), aggregate tokens/s and what bounds it. Micro-batches complete at the rate
        min(in_flight / loop latency, 1 / slowest stage), so a round takes
        micro_batches x max(loop / in_flight, slowest stage). The loop counts the links' propagation
        latency; a stage's occupancy does not (its link carries the next micro-batch meanwhile)."""
        in_flight = micro_batches if in_flight is None else in_flight
        if concurrency < 1 or not 1 <= micro_batches <= concurrency or not 1 <= in_flight <= micro_batches:
            raise ValueError("need concurrency >= 1, 1 <= micro_batches <= concurrency and "
                             "1 <= in_flight <= micro_batches")
        positions = self.plan.context if context is None else context
        b = math.ceil(concurrency / micro_batches)
        loop = sum(sum(st.values()) for st in self.stage_times(b, positions))
        times = [sum(st.values()) for st in self.stage_times(b, positions, propagation=False)]
        bounds = {"loop latency": loop / in_flight, "slowest stage": max(times)}
        if self.params.shared_cores:
            bounds["shared cores"] = sum(times) / self.params.shared_cores
        bound = max(bounds, key=bounds.get)
        round_s = micro_batches * bounds[bound]
        return {"tokens_per_s": concurrency / round_s, "round_s": round_s, "micro_batches": micro_batches,
                "in_flight": in_flight, "micro_batch": b, "loop_s": loop, "slowest_stage": int(np.argmax(times)),
                "slowest_stage_s": max(times), "bound": bound}

    @staticmethod
    def tokens_per_verify(acceptance: float, draft_tokens: int) -> float:
        """E(k): tokens a verify step of k drafts emits when each is accepted with probability g."""
        g, k = acceptance, draft_tokens
        if not 0.0 <= g <= 1.0 or k < 0:
            raise ValueError("acceptance must lie in [0, 1] and draft_tokens be >= 0")
        return float(k + 1) if g >= 1.0 else (1.0 - g ** (k + 1)) / (1.0 - g)

    def speculative_token_time(self, acceptance: float, draft_tokens: int | None = None,
                               context: int | None = None, max_draft_tokens: int = 16) -> dict:
        """One stream with speculative decoding at acceptance g: seconds per token, the speed-up over plain
        decoding, and k (given, or the best in 0..max_draft_tokens under this model)."""
        positions = self.plan.context if context is None else context

        def step(k: int) -> float:
            return sum(sum(st.values()) for st in self.stage_times(k + 1, positions, components=False))

        plain = step(0)
        ks = [draft_tokens] if draft_tokens is not None else range(max_draft_tokens + 1)
        best = min(ks, key=lambda k: step(k) / self.tokens_per_verify(acceptance, k))
        emitted = self.tokens_per_verify(acceptance, best)
        per_token = step(best) / emitted
        return {"acceptance": acceptance, "draft_tokens": best, "tokens_per_step": emitted,
                "step_s": step(best), "token_s": per_token, "tokens_per_s": 1.0 / per_token,
                "plain_token_s": plain, "speedup": plain / per_token}

    def ttft(self, prompt_tokens: int) -> dict:
        """Seconds to the first token of a `prompt_tokens` prompt on an otherwise idle cluster."""
        if prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        C = self.params.prefill_chunk_tokens
        S = len(self.plan.stages)
        finish = [0.0] * S
        chunks = 0
        for start in range(0, prompt_tokens, C):
            b = min(C, prompt_tokens - start)
            times = [sum(st.values()) for st in self.stage_times(b, start, prefill=True)]
            prev = 0.0
            for s in range(S):  # a chunk enters stage s when it left s-1 and s finished the previous chunk
                finish[s] = max(finish[s], prev) + times[s]
                prev = finish[s]
            chunks += 1
        # is the first chunk limited by FLOPs rather than by weight reads on layer 0's home?
        b0 = min(C, prompt_tokens)
        home0, lw0 = self.plan.layer_home[0], self.weights[0]
        compute_bound = 2 * (lw0.attention_params + lw0.mlp_params) * b0 / self.fl[home0] > \
            lw0.dense_bytes * self.dense_scale / self.bw[home0]
        return {"prompt_tokens": prompt_tokens, "seconds": finish[-1], "chunks": chunks, "chunk_tokens": b0,
                "compute_bound": bool(compute_bound)}

    def total_power_w(self) -> float:
        return float(sum(d.power_w for d in self.plan.devices))

    def dense_bytes_per_token(self) -> int:
        """Non-expert bytes one decoded token reads (all layers' home weights, LM head, one embedding row)."""
        c = self.config
        return sum(w.total_bytes for w in self.weights) + lm_head_bytes(c) + 2 * c.hidden_size

    # ------------------------------------------------------------ what-ifs
    def variant(self, **changes) -> "CostModel":
        """The same plan under changed parameters (fp8 dense, split homes, faster memory...)."""
        clone = object.__new__(CostModel)
        clone.__dict__.update(self.__dict__)
        clone.params = dataclasses.replace(self.params, **changes)
        p = clone.params
        clone.bw = np.array([d.mem_bandwidth for d in self.plan.devices]) * p.mem_efficiency * p.mem_bandwidth_scale
        clone.fl = np.array([d.flops for d in self.plan.devices]) * p.compute_efficiency
        clone._pmf = dict(self._pmf)
        clone._links_cache = {}
        clone.split_ok = clone._dense_split_feasible()
        return clone

    def to_reach(self, target_tokens_per_s: float) -> dict:
        """What the model says a single stream needs to reach `target_tokens_per_s`."""
        base = self.token_time()
        budget = 1.0 / target_tokens_per_s
        options = []

        def seconds(model: "CostModel") -> float:
            return model.token_time(components=False).total

        def add(name: str, model: "CostModel", detail: str):
            t = seconds(model)
            options.append({"option": name, "tokens_per_s": 1 / t, "reaches": t <= budget, "detail": detail})

        add("dense weights in fp8", self.variant(dense_weight_scale=0.5),
            "attention, shared experts, latent projections and LM head stored in 8 bits")
        add("dense weights in MXFP4", self.variant(dense_weight_scale=4.25 / 16),
            "the same in 4.25 bits per weight, like the routed experts")
        max_split = max(
            sum(1 for r in self.plan.stages[self.stage_of_layer[layer]].ranks
                if self.plan.devices[r].host == self.plan.devices[home].host)
            for layer, home in enumerate(self.plan.layer_home)
        )
        for scale, label in ((1.0, "bf16"), (0.5, "fp8")):
            found = None
            for n in range(2, max_split + 1):
                m = self.variant(dense_split=n, dense_weight_scale=scale)
                if m.split_ok and seconds(m) <= budget:
                    found = (n, m)
                    break
            if found:
                add(f"split each layer's dense work over {found[0]} devices ({label})", found[1],
                    f"tensor-split attention/shared experts over {found[0]} devices of the host "
                    f"({self.plan.links.intra_host.kind or 'intra-host link'}), 2 exchanges per layer")
            elif max_split >= 2:
                m = self.variant(dense_split=max_split, dense_weight_scale=scale)
                if m.split_ok:
                    add(f"split each layer's dense work over {max_split} devices ({label})", m,
                        "the most devices a stage has on one host; not enough on its own")
        # memory bandwidth needed, everything else unchanged (bisection on a common factor)
        lo, hi = 1.0, 1.0
        if base.total > budget:
            while hi < 1e4 and seconds(self.variant(mem_bandwidth_scale=hi)) > budget:
                lo, hi = hi, hi * 2
            if hi < 1e4:
                for _ in range(16):  # 1e-5 relative: plenty for a what-if
                    mid = (lo + hi) / 2
                    if seconds(self.variant(mem_bandwidth_scale=mid)) > budget:
                        lo = mid
                    else:
                        hi = mid
        floor = seconds(self.variant(mem_bandwidth_scale=1e6))
        kinds = sorted({d.kind for d in self.plan.devices})
        peak = max(d.mem_bandwidth for d in self.plan.devices)
        needed = {
            "memory_bandwidth_factor": hi if hi < 1e4 else None,
            "memory_bandwidth_needed": peak * hi if hi < 1e4 else None,
            "floor_without_memory_time_s": floor,
            "note": ("already reached with the present memory bandwidth" if base.total <= budget else
                     f"every device's memory bandwidth x{hi:.2f} ({peak * hi / 1e12:.2f} TB/s peak per "
                     f"{'/'.join(kinds)})" if hi < 1e4 else
                     f"unreachable by memory bandwidth alone: links, hops and overheads take {floor * 1e3:.1f} ms"),
        }
        return {"target_tokens_per_s": target_tokens_per_s, "predicted_tokens_per_s": base.tokens_per_s,
                "reaches": base.total <= budget, "budget_s": budget, "bandwidth": needed, "options": options}


__all__ = ["CostModel", "CostParams", "TokenTime", "RoutedLayer", "selection_count_pmf", "expected_max",
           "BREAKDOWN_KEYS"]
