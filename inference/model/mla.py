"""Multi-head latent attention without positional encoding (model.md section 3).

Two forms of the same math:
- naive (prefill): expand every cached latent to per-head keys and values with kv_b_proj, causal softmax;
- absorbed (decode): fold W_UK into the query and W_UV after the weighted sum, so attention runs directly
  against the cached latents and nothing is expanded per token.
The cache holds, per token, the normalised c_kv followed by the shared k_pe channel:
kv_lora_rank + qk_rope_head_dim values (576 for K3). The attention core runs in fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from inference.model.config import ModelConfig
from inference.model.layers import RMSNorm

QUERY_TILE_ELEMENTS = 1 << 24  # naive prefill: at most this many fp32 scores (64 MiB) at a time


class MLALayerCache:
    """Latent cache of one MLA layer for one sequence: [length, kv_lora_rank + rope] (c_kv normalised, then k_pe).

    Storage grows by doubling so that token-by-token decode does not copy the whole cache every step;
    `nbytes` counts the values held (length x width), `allocated_nbytes` the storage reserved.
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 0):
        self.width = width
        self.length = 0
        self._store = torch.empty(capacity, width, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype

    def view(self) -> Tensor:
        """The cached latents, oldest first: [length, width] (a view, not a copy)."""
        return self._store[: self.length]

    def append(self, latents: Tensor) -> None:
        if latents.dim() != 2 or latents.shape[1] != self.width:
            raise ValueError(f"MLA cache expects latents [T, {self.width}], got {tuple(latents.shape)}")
        need = self.length + latents.shape[0]
        if need > self._store.shape[0]:
            grown = torch.empty(max(need, 2 * self._store.shape[0], 16), self.width,
                                dtype=self._store.dtype, device=self._store.device)
            grown[: self.length] = self._store[: self.length]
            self._store = grown
        self._store[self.length: need] = latents.to(self._store.dtype)
        self.length = need

    @property
    def nbytes(self) -> int:
        return self.length * self.width * self._store.element_size()

    @property
    def allocated_nbytes(self) -> int:
        return self._store.numel() * self._store.element_size()

    def truncate(self, length: int) -> None:
        """Forget every latent after the first `length` (speculative rewind); the storage is kept for reuse."""
        if not 0 <= length <= self.length:
            raise ValueError(f"can truncate this MLA cache to 0..{self.length} tokens, not {length}")
        self.length = length

    def clone(self) -> "MLALayerCache":
        copy = MLALayerCache(self.width, self._store.dtype, self._store.device, capacity=self.length)
        copy.append(self.view())
        return copy


class MLAAttention(nn.Module):
    """One MLA layer: `forward(x [T, D], cache)` (naive) and `forward_batch_decode(x [B, D], caches)` (absorbed)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        D, H = config.hidden_size, config.mla_heads
        self.num_heads = H
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim ** -0.5
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.mla_cache_width, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.mla_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        if config.mla_output_gate:
            self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)

    # ---------------------------------------------------------------- pieces
    def new_cache(self, dtype: torch.dtype | None = None, device=None) -> MLALayerCache:
        w = self.kv_b_proj.weight
        return MLALayerCache(self.config.mla_cache_width, dtype or w.dtype, device or w.device)

    def _queries(self, x: Tensor) -> Tensor:
        """[T, D] -> [T, H, nope + rope] fp32."""
        if self.config.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.float().view(x.shape[0], self.num_heads, self.nope + self.rope)

    def latents(self, x: Tensor) -> Tensor:
        """[T, D] -> the cache entries [T, kv_lora_rank + rope]: RMSNorm(c_kv) then the raw shared k_pe."""
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(ckv[:, : self.kv_rank])
        return torch.cat([c_kv, ckv[:, self.kv_rank:]], dim=-1)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """o [T, H * v] fp32 -> gated output projection [T, D] in x.dtype."""
        if self.config.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(o.to(x.dtype))

    def _check(self, x: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise ValueError(f"MLA expects x [T, {self.config.hidden_size}], got {tuple(x.shape)}")

    # ------------------------------------------------------------ naive form
    def forward_naive(self, x: Tensor, cache: MLALayerCache) -> Tensor:
        """T new tokens after `cache.length` cached ones; expands all latents to per-head K and V."""
        self._check(x)
        T, H = x.shape[0], self.num_heads
        past = cache.length
        q = self._queries(x)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        cache.append(self.latents(x))
        lat = cache.view()  # [n, W]
        n = lat.shape[0]
        kv = self.kv_b_proj(lat[:, : self.kv_rank].to(x.dtype)).float().view(n, H, self.nope + self.v_dim)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
        k_pe = lat[:, self.kv_rank:].float()  # [n, rope], one key channel shared by all heads
        # Queries in tiles so the [H, tile, n] score matrix stays bounded on long prefills; a tile only
        # reads the keys up to its last query (causal), which also halves the work of a long prefill.
        tile = max(1, QUERY_TILE_ELEMENTS // (H * n))
        outs = []
        for t0 in range(0, T, tile):
            qn, qp = q_nope[t0: t0 + tile], q_pe[t0: t0 + tile]
            rows = past + t0 + torch.arange(qn.shape[0], device=x.device)
            seen = past + t0 + qn.shape[0]
            scores = (torch.einsum("thd,nhd->htn", qn, k_nope[:seen])
                      + torch.einsum("thd,nd->htn", qp, k_pe[:seen]))
            future = torch.arange(seen, device=x.device)[None, :] > rows[:, None]
            p = torch.softmax((scores * self.scale).masked_fill(future, float("-inf")), dim=-1)
            outs.append(torch.einsum("htn,nhv->thv", p, v[:seen]))
        o = torch.cat(outs)
        return self._output(o.reshape(T, H * self.v_dim), x)

    forward = forward_naive

    # --------------------------------------------------------- absorbed form
    def _absorbed_core(self, q: Tensor, lat: Tensor, visible: Tensor) -> Tensor:
        """q [B, Tq, H, nope+rope] fp32, lat [B, N, W], visible [B, Tq, N] bool -> o [B, Tq, H * v] fp32."""
        H = self.num_heads
        w = self.kv_b_proj.weight.float().view(H, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, nope, r], [H, v, r]
        lat = lat.float()
        c_kv, k_pe = lat[..., : self.kv_rank], lat[..., self.kv_rank:]
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        q_tilde = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # W_UK^T q_nope: r values per head
        scores = torch.einsum("bthr,bnr->bhtn", q_tilde, c_kv) + torch.einsum("bthd,bnd->bhtn", q_pe, k_pe)
        scores = (scores * self.scale).masked_fill(~visible[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o_tilde = torch.einsum("bhtn,bnr->bthr", p, c_kv)  # weighted sum of cached latents
        o = torch.einsum("bthr,hvr->bthv", o_tilde, w_uv)
        return o.reshape(q.shape[0], q.shape[1], H * self.v_dim)

    def forward_absorbed(self, x: Tensor, cache: MLALayerCache) -> Tensor:
        """Same contract and result as `forward_naive`, computed in the absorbed form."""
        self._check(x)
        T = x.shape[0]
        past = cache.length
        q = self._queries(x)
        cache.append(self.latents(x))
        lat = cache.view()
        n = lat.shape[0]
        visible = torch.arange(n, device=x.device)[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
        o = self._absorbed_core(q[None], lat[None], visible[None])[0]
        return self._output(o, x)

    def forward_batch_decode(self, x: Tensor, caches: list[MLALayerCache]) -> Tensor:
        """One new token for each of B sequences (x [B, D]); absorbed form, batched over padded caches."""
        self._check(x)
        B = x.shape[0]
        if len(caches) != B:
            raise ValueError(f"{B} tokens but {len(caches)} caches")
        q = self._queries(x)
        new = self.latents(x)
        for b, cache in enumerate(caches):
            cache.append(new[b: b + 1])
        lengths = [c.length for c in caches]
        if B == 1:
            lat = caches[0].view()[None]
        else:
            lat = torch.zeros(B, max(lengths), self.config.mla_cache_width, dtype=new.dtype, device=x.device)
            for b, cache in enumerate(caches):
                lat[b, : cache.length] = cache.view()
        n_max = lat.shape[1]
        visible = torch.arange(n_max, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        o = self._absorbed_core(q[:, None], lat, visible[:, None])[:, 0]
        return self._output(o, x)


__all__ = ["MLAAttention", "MLALayerCache"]
