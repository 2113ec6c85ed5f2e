"""Feed-forward parts of Kimi K3 (model.md section 4): SiTU-GLU MLPs, the noaux_tc router and Stable LatentMoE.

A MoE layer computes, per token:
    ids, w = route(x)                    # sigmoid scores, bias steers selection only, renormalised weights
    z      = down(x)                     # D -> latent, once per token
    y      = expert_partial(z, ids, w)   # sum_j w_j * Expert_j(z) inside the latent (MXFP4 experts)
    out    = finish(y, x)                # latent RMSNorm, latent -> D, plus the shared experts on x
Each step is callable on its own so that expert parallelism can send z to the devices holding the selected
experts and add up the partial sums they return (the sum over disjoint expert subsets equals the whole sum).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from inference.model import mxfp4
from inference.model.config import ModelConfig
from inference.model.layers import RMSNorm

RoutingObserver = Callable[[int, Tensor], None]  # (layer index, expert ids [T, k])
ExpertLoader = Callable[[int, Iterable[int]], None]  # (layer index, the experts about to run)


# Below this many multiply-adds per step, running every expert on every token in batched matmuls beats one
# small matmul per expert hit (the tiny model's decode steps); above it, experts run only on their tokens.
ALL_EXPERTS_MACS = 1 << 24
# Steps with at most this many (token, expert) pairs (decode, speculative verify) run their experts batched on a
# GPU (`LatentMoE._grouped_partial`): one dequantisation and three batched matmuls per chunk instead of a small
# matmul per expert and a host round trip. Longer steps (prefill) run each expert on its own tokens.
GROUPED_MAX_PAIRS = 512
# The dense copies one chunk of the batched path holds at once (K3: about 30 experts' w1, w2, w3 in bf16).
GROUPED_DEQUANT_BYTES = 2 << 30


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """SiTU-GLU in fp32: beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta). sigmoid sees the uncapped g."""
    g, u = gate.float(), up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


class DenseMLP(nn.Module):
    """gate_proj / up_proj / down_proj with SiTU-GLU: the dense layer-0 MLP and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: ModelConfig):
        super().__init__()
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        act = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(act.to(x.dtype))


class Router(nn.Module):
    """noaux_tc routing in fp32: `route(x [T, D]) -> (expert_ids [T, k] int64, weights [T, k] fp32)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.randn(config.num_experts, config.hidden_size) / math.sqrt(config.hidden_size))
        # Only steers which experts are picked; the weights come from the unbiased scores. Always fp32.
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def scores(self, x: Tensor) -> Tensor:
        """Unbiased sigmoid affinities [T, E] fp32."""
        return torch.sigmoid(x.float() @ self.weight.float().T)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        s = self.scores(x)
        choice = s + self.e_score_correction_bias.float()
        if cfg.n_group > 1:
            T = choice.shape[0]
            grouped = choice.view(T, cfg.n_group, -1)
            # A group is rated by the sum of its two best (biased) scores; the other groups are masked out.
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
            keep = group_score.topk(cfg.topk_group, dim=-1).indices
            kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(T, -1)
        ids = choice.topk(cfg.experts_per_token, dim=-1).indices
        weights = s.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor

    forward = route


class MXFP4Linear(nn.Module):
    """A bias-free linear layer whose weight [out, in] is stored as MXFP4 (weight_packed, weight_scale buffers).

    `dense_cache` (set through LatentMoE.set_dequantize_cache) switches between decoding the weight on every
    call and reusing a dequantised copy.
    """

    def __init__(self, in_features: int, out_features: int, random_init: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if not random_init:  # shapes only: the weights come from a checkpoint
            self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.empty(out_features, in_features // mxfp4.BLOCK,
                                                             dtype=torch.uint8))
            self.dense_cache = None
            return
        # Random weights on the MXFP4 grid (from the global RNG). Uniform E2M1 codes have RMS ~2.9, so
        # block scales around 0.35/sqrt(in) give std ~1/sqrt(in), like a default linear layer.
        top = 127 + round(math.log2(0.35 / math.sqrt(in_features)))
        packed, scale = mxfp4.random_on_grid(out_features, in_features, scale_exponents=(top - 1, top))
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)
        self.dense_cache: mxfp4.DequantizedCache | None = None

    def forward(self, x: Tensor) -> Tensor:
        return mxfp4.mxfp4_matmul(x, self.weight_packed, self.weight_scale, cache=self.dense_cache)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return mxfp4.dequantize(self.weight_packed, self.weight_scale, dtype)


class Expert(nn.Module):
    """One routed expert living in the latent: w1 gate and w3 up (latent -> width), w2 down (width -> latent)."""

    def __init__(self, config: ModelConfig, random_init: bool = True):
        super().__init__()
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta
        L, F = config.latent_size, config.expert_intermediate_size
        if config.mxfp4_experts:
            def make(i, o):
                return MXFP4Linear(i, o, random_init=random_init)
        else:
            def make(i, o):
                return nn.Linear(i, o, bias=False)
        self.w1 = make(L, F)
        self.w2 = make(F, L)
        self.w3 = make(L, F)

    def forward(self, z: Tensor) -> Tensor:
        act = situ_glu(self.w1(z), self.w3(z), self.beta, self.linear_beta)
        return self.w2(act.to(z.dtype))


class LatentMoE(nn.Module):
    """Stable LatentMoE plus shared experts (module names follow the checkpoint's `block_sparse_moe.*`)."""

    def __init__(self, config: ModelConfig, layer_idx: int = -1, random_init: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, L = config.hidden_size, config.latent_size
        self.gate = Router(config)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        if config.latent_moe_norm:
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps)
        if config.num_shared_experts:
            self.shared_experts = DenseMLP(D, config.shared_expert_intermediate_size, config)
        self.experts = nn.ModuleList(Expert(config, random_init) for _ in range(config.num_experts))
        self.routing_observer: RoutingObserver | None = None
        # (layer index, experts about to run) -> None: a model that keeps experts on disk until used
        # (inference.model.lazy) loads them here; None: every expert is held
        self.expert_loader: ExpertLoader | None = None
        self._dense_cache: mxfp4.DequantizedCache | None = None
        self._stacked = None  # (key, w1 [E, F, L], w3 [E, F, L], w2 [E, L, F]) for the all-experts path
        # Experts batched by expert for short steps: None on a GPU only, True everywhere (the tests run it on the
        # CPU against the per-expert loop), False never (the loop is the oracle).
        self.grouped_experts: bool | None = None
        self._packed: dict[str, Tensor] | None = None  # w1/w2/w3 packed and scale bytes stacked [E, ...]

    # ------------------------------------------------------------- switches
    def set_dequantize_cache(self, enabled: bool) -> None:
        """True: keep a dequantised copy of each MXFP4 expert weight after first use; False: decode every call."""
        self._dense_cache = mxfp4.DequantizedCache() if enabled else None
        self._stacked = None
        for module in self.experts.modules():
            if isinstance(module, MXFP4Linear):
                module.dense_cache = self._dense_cache

    @property
    def dequantize_cache(self) -> bool:
        return self._dense_cache is not None

    # --------------------------------------------------------------- pieces
    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (expert_ids [T, k], weights [T, k] fp32); reports the ids to the routing observer."""
        ids, weights = self.gate.route(x)
        if self.routing_observer is not None:
            self.routing_observer(self.layer_idx, ids)
        return ids, weights

    def down(self, x: Tensor) -> Tensor:
        """x [T, D] -> z [T, latent] in x.dtype: what crosses the network under expert parallelism."""
        return self.routed_expert_down_proj(x)

    def expert_partial(self, z: Tensor, ids: Tensor, weights: Tensor, experts: Iterable[int] | None = None) -> Tensor:
        """sum over the selected experts (optionally only those in `experts`) of w * Expert(z): [T, latent] fp32.

        Tokens are grouped by expert, so each expert that was hit runs once on all its tokens.
        """
        T, k = ids.shape
        E = self.config.num_experts
        allowed = None
        if experts is not None:
            allowed = {int(e) for e in experts}
            bad = [e for e in allowed if not 0 <= e < E]
            if bad:
                raise ValueError(f"expert ids {sorted(bad)} are outside 0..{E - 1}")
        if allowed is None and self._dense_cache is not None and self.config.mxfp4_experts \
                and E * T * 3 * self.config.latent_size * self.config.expert_intermediate_size <= ALL_EXPERTS_MACS:
            self._load_experts(range(E))
            return self._all_experts_partial(z, ids, weights)
        if allowed is None and self._groups_experts(z, T):
            return self._grouped_partial(z, ids, weights)
        y = torch.zeros(T, self.config.latent_size, dtype=torch.float32, device=z.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        w_sorted = weights.reshape(-1)[order].float()
        counts = torch.bincount(flat, minlength=E).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            if allowed is None or e in allowed:
                self._load_experts((e,))
                rows = token_of[start:end]
                out = self.experts[e](z[rows])
                y.index_add_(0, rows, out.float() * w_sorted[start:end, None])
            start = end
        return y

    def _load_experts(self, experts: Iterable[int]) -> None:
        if self.expert_loader is not None:
            self.expert_loader(self.layer_idx, experts)

    def _stacked_experts(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """All experts' dense w1, w3 [E, F, L] and w2 [E, L, F], from the dequantised cache (rebuilt when any
        expert weight changes in place, e.g. a checkpoint load)."""
        versions = tuple((lin.weight_packed._version, lin.weight_scale._version, id(lin.weight_packed))
                         for ex in self.experts for lin in (ex.w1, ex.w2, ex.w3))
        if self._stacked is None or self._stacked[0] != (versions, dtype):
            stack = [torch.stack([getattr(ex, name).dequantized_weight(dtype) for ex in self.experts])
                     for name in ("w1", "w3", "w2")]
            self._stacked = ((versions, dtype), *stack)
        return self._stacked[1], self._stacked[2], self._stacked[3]

    def _all_experts_partial(self, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """expert_partial for few tokens and small experts: every expert on every token in three batched
        matmuls (cheaper than one small matmul per expert hit), then the routed (token, expert) pairs gathered."""
        T, k = ids.shape
        w1, w3, w2 = self._stacked_experts(z.dtype)
        zt = z.unsqueeze(0).expand(w1.shape[0], -1, -1)  # [E, T, L]
        act = situ_glu(torch.bmm(zt, w1.transpose(1, 2)), torch.bmm(zt, w3.transpose(1, 2)),
                       self.config.situ_beta, self.config.situ_linear_beta)
        out = torch.bmm(act.to(z.dtype), w2.transpose(1, 2))  # [E, T, L]
        tokens = torch.arange(T, device=z.device).repeat_interleave(k)
        picked = out[ids.reshape(-1), tokens].float() * weights.reshape(-1, 1).float()  # [T*k, L]
        return torch.zeros(T, self.config.latent_size, dtype=torch.float32, device=z.device).index_add_(
            0, tokens, picked)

    def _groups_experts(self, z: Tensor, T: int) -> bool:
        if self.grouped_experts is False or not self.config.mxfp4_experts \
                or T * self.config.experts_per_token > GROUPED_MAX_PAIRS:
            return False
        if self.grouped_experts is None and not z.is_cuda:
            return False
        return not any(lin.weight_packed.is_meta for ex in self.experts for lin in (ex.w1, ex.w2, ex.w3))

    _PACKED_BUFFERS = (("packed", "weight_packed"), ("scale", "weight_scale"))

    def packed_experts(self) -> dict[str, Tensor]:
        """Every expert's MXFP4 bytes stacked by expert ({"w1.packed": [E, F, L/2], "w1.scale": [E, F, L/32], ...}),
        made once (here from the experts' own buffers; before a load, `hold_experts_stacked`); each expert's buffers
        are views of the stacks, so the bytes are held once and a later in-place load into an expert lands there."""
        if self._packed is None:
            self._bind_stacks({f"{name}.{part}": torch.stack([getattr(getattr(ex, name), buffer) for ex in self.experts])
                               for name in ("w1", "w2", "w3") for part, buffer in self._PACKED_BUFFERS})
        return self._packed

    def hold_experts_stacked(self, device: torch.device | str) -> None:
        """Before a load into a skeleton: the experts' MXFP4 bytes allocated as stacks on `device`, each expert's
        buffers views of them, so the loader copies every expert into its place (no stacking copy later, which
        would hold a layer's experts twice on the GPU for a moment)."""
        if self._packed is not None or not self.config.mxfp4_experts:
            return
        first = self.experts[0]
        self._bind_stacks({f"{name}.{part}": torch.empty((len(self.experts), *getattr(getattr(first, name), buffer).shape),
                                                         dtype=torch.uint8, device=device)
                           for name in ("w1", "w2", "w3") for part, buffer in self._PACKED_BUFFERS})

    def _bind_stacks(self, stacks: dict[str, Tensor]) -> None:
        for e, ex in enumerate(self.experts):
            for name in ("w1", "w2", "w3"):
                for part, buffer in self._PACKED_BUFFERS:
                    getattr(ex, name)._buffers[buffer] = stacks[f"{name}.{part}"][e]
        if self._dense_cache is not None:
            self._dense_cache.clear()  # its entries hold the old buffers
        self._packed = stacks

    def _grouped_partial(self, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """expert_partial for a short step on a device, without a host round trip: the MXFP4 bytes of the experts
        it needs are gathered and dequantised together (on the device, per call: what is held between calls is
        MXFP4), then three batched matmuls. Each (token, expert) pair is one matrix-vector product, in chunks of at
        most GROUPED_DEQUANT_BYTES of dense weights (a single stream reads exactly its k experts); when the step has
        at least as many pairs as there are experts and all of them fit in one chunk, every expert runs on every
        token instead and the routed pairs are picked. Equal to the per-expert loop up to rounding."""
        T, k = ids.shape
        E, L, F = self.config.num_experts, self.config.latent_size, self.config.expert_intermediate_size
        flat = ids.reshape(-1)  # [T*k] the experts of the pairs, token-major
        tokens = torch.arange(T, device=z.device).repeat_interleave(k)
        per_chunk = max(1, GROUPED_DEQUANT_BYTES // (3 * L * F * z.element_size()))
        if T * k >= E and E <= per_chunk:
            picked = self._experts_on(z.unsqueeze(0).expand(E, -1, -1), None)[flat, tokens]  # [T*k, L]
        else:
            picked = torch.cat([self._experts_on(z[tokens[i:i + per_chunk]].unsqueeze(1), flat[i:i + per_chunk])[:, 0]
                                for i in range(0, T * k, per_chunk)])
        picked = picked.float() * weights.reshape(-1, 1).float()
        return torch.zeros(T, L, dtype=torch.float32, device=z.device).index_add_(0, tokens, picked)

    def _experts_on(self, x: Tensor, which: Tensor | None) -> Tensor:
        """x [n, t, L] through the experts `which` [n] (None: all E, in order): [n, t, L] in x.dtype."""
        packed = self.packed_experts()

        def dense(name):  # [n, out, in] in x's dtype, decoded exactly
            data, scale = packed[f"{name}.packed"], packed[f"{name}.scale"]
            if which is not None:
                data, scale = data.index_select(0, which), scale.index_select(0, which)
            return mxfp4.dequantize(data, scale, x.dtype)

        act = situ_glu(torch.bmm(x, dense("w1").transpose(1, 2)), torch.bmm(x, dense("w3").transpose(1, 2)),
                       self.config.situ_beta, self.config.situ_linear_beta)
        return torch.bmm(act.to(x.dtype), dense("w2").transpose(1, 2))

    def finish(self, y_latent: Tensor, x: Tensor) -> Tensor:
        """Latent RMSNorm on the weighted sum, latent -> D, plus the shared experts on the full-width x."""
        y = y_latent.float()
        if self.config.latent_moe_norm:
            y = self.routed_expert_norm(y)
        out = self.routed_expert_up_proj(y.to(x.dtype))
        if self.config.num_shared_experts:
            out = out + self.shared_experts(x)
        return out

    def forward(self, x: Tensor) -> Tensor:
        ids, weights = self.route(x)
        return self.finish(self.expert_partial(self.down(x), ids, weights), x)


__all__ = ["situ_glu", "DenseMLP", "Router", "MXFP4Linear", "Expert", "LatentMoE", "RoutingObserver", "ExpertLoader"]
