"""The Kimi K3 decoder stack with explicit per-sequence caches (model.md sections 1-6).

`KimiK3Model(config).forward(token_ids, caches)` runs a batch of sequences, each continuing from its own
`SequenceCache` (a fresh one from `new_cache()` for a new prompt). Per-token work (embedding, projections,
norms, MoE, Attention Residuals) runs on the concatenation of all new tokens; only the attention kernels loop
over sequences. A step where every sequence brings exactly one token takes the batched decode paths
(KDA `forward_batch_decode`, MLA absorbed form over padded latent caches).

The residual stream is carried as a `ResidualState`: the per-sequence token counts, the completed block
sums of Attention Residuals (the embedding first) and the running partial sum of the current block, all
[N, D] fp32 over the N concatenated tokens. That state is everything a layer needs from earlier layers, which
gives the split the sharded runtime uses:

    state = model.embed(ids, lengths)                     # stage 0
    state = model.run_layers(a, b, state, caches)         # any contiguous range [a, b); ship `state` between stages
    logits = model.head(state, rows)                      # last stage
    for c in caches: c.advance(n_new)                     # once all layers ran

Inside a layer, expert parallelism splits the MLP half:

    layer = model.layers[i]
    state, x = layer.attend(state, caches)                # AttnRes, attention, AttnRes, post-attention norm
    moe = layer.block_sparse_moe
    ids, w = moe.route(x); z = moe.down(x)                # on the layer's home device
    y = sum(moe.expert_partial(z, ids, w, experts=held_by_d) for each device d)   # latent z crosses, y returns
    state = layer.add_mlp(state, moe.finish(y, x))

These entry points run under torch.inference_mode (this is an inference engine): caches they touched hold
inference tensors, so keep extending them through these entry points (clone() gives ordinary tensors).
A `SequenceCache` may hold only a stage's layers (`new_cache(layers=range(a, b))`); the others stay None.
`model.routing_observer = fn` makes every MoE layer call fn(layer_index, expert_ids [T, k]) when it routes.

Initialisation: `KimiK3Model(config, seed=s)` holds exactly the weights of the checkpoint
`make_random_checkpoint(config, seed=s)` loaded back (one recipe, `inference.model.checkpoint.random_tensor`: a
seeded draw per tensor name, bf16 like the release, MXFP4 experts on the grid); that module's docstring and
comments give the scales and why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from inference.model.checkpoint import fill_random_weights
from inference.model.config import ModelConfig
from inference.model.device import model_device
from inference.model.kda import KDAAttention, KDALayerCache
from inference.model.layers import RMSNorm, attn_res
from inference.model.mla import MLAAttention, MLALayerCache
from inference.model.moe import DenseMLP, LatentMoE, RoutingObserver

# Tensors that stay fp32 whatever the model dtype (model.md sections 2 and 4), by name suffix.
FP32_TENSOR_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")



# --------------------------------------------------------------------------- state and caches
@dataclass
class ResidualState:
    """The residual stream of N concatenated new tokens between layers (Attention Residuals form).

    lengths: new tokens per sequence (sum = N); blocks: completed block sums [N, D] fp32, the embedding
    first; partial: running sum of the current block [N, D] fp32.
    """

    lengths: tuple[int, ...]
    blocks: list[Tensor]
    partial: Tensor

    @property
    def last_rows(self) -> list[int]:
        """Row of each sequence's last new token in the concatenation."""
        rows, end = [], 0
        for n in self.lengths:
            end += n
            rows.append(end - 1)
        return rows

    def select(self, rows: Sequence[int] | Tensor) -> "ResidualState":
        """The state restricted to some rows (for the head); lengths become one per selected row."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.partial.device)
        return ResidualState((1,) * len(idx), [b[idx] for b in self.blocks], self.partial[idx])


LayerCache = KDALayerCache | MLALayerCache


def check_rewind(marked_at: int | None, length: int, current: int) -> int:
    """The mark a rewind to `length` returns past (a cache of `current` tokens marked at `marked_at`);
    ValueError when there is no mark or `length` lies outside mark..current."""
    if marked_at is None:
        raise ValueError("rewind needs a mark() at or before the position to return to")
    if not marked_at <= length <= current:
        raise ValueError(f"can rewind to {marked_at}..{current} tokens (marked at {marked_at}), not {length}")
    return marked_at


class SequenceCache:
    """All decode state of one sequence: per-layer caches in layer order (None for layers not held here).

    KDA layers hold constant-size conv windows and recurrent state; MLA layers a latent cache that grows by
    mla_cache_width values per token. `length` counts the tokens the sequence has consumed.
    """

    def __init__(self, layers: list[LayerCache | None], length: int = 0):
        self.layers = layers
        self.length = length
        self.marked_at: int | None = None  # see mark() / rewind()
        # what records the residual state at layer boundaries for a state commitment (None: nothing is kept;
        # inference.serving.state_commitment.StateLog): `boundaries`, and record(boundary, first position, rows)
        self.state_log = None

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def kda_nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if isinstance(c, KDALayerCache))

    @property
    def mla_nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if isinstance(c, MLALayerCache))

    @property
    def nbytes(self) -> int:
        return self.kda_nbytes + self.mla_nbytes

    def clone(self) -> "SequenceCache":
        """A copy of the decode state (without a rewind mark)."""
        return SequenceCache([None if c is None else c.clone() for c in self.layers], self.length)

    # ---------------------------------------------------------- speculative rewind
    # mark() at length m, run some tokens, then rewind(p) for any m <= p <= length: every state is as if
    # only the first p tokens had been seen. MLA layers truncate their latent cache; KDA layers restore
    # their conv windows and recurrent state from the log kept since the mark (kda.KDARewindLog, mode
    # "snapshot" or "replay"). The Attention Residuals state lives only inside one forward (ResidualState):
    # nothing of it persists across steps, so the rows of rejected tokens are simply dropped with the logits.
    def mark(self, mode: str = "snapshot") -> None:
        """Start logging what a rewind to the current length (or any later one) needs."""
        for c in self.layers:
            if isinstance(c, KDALayerCache):
                c.mark(mode)
        self.marked_at = self.length

    @property
    def marked(self) -> bool:
        return self.marked_at is not None

    def unmark(self) -> None:
        """Keep everything since the mark and drop the log."""
        for c in self.layers:
            if isinstance(c, KDALayerCache):
                c.unmark()
        self.marked_at = None

    def rewind(self, length: int) -> None:
        """Back to the state after the first `length` tokens (mark <= length <= self.length); ends the mark."""
        start = check_rewind(self.marked_at, length, self.length)
        for c in self.layers:
            if isinstance(c, KDALayerCache):
                c.rewind(length - start)
            elif isinstance(c, MLALayerCache):
                c.truncate(length)
        self.length = length
        self.marked_at = None

    @property
    def rewind_nbytes(self) -> int:
        """Bytes held by the KDA rewind logs now (the MLA part of a rewind needs none)."""
        return sum(c.rewind_nbytes for c in self.layers if isinstance(c, KDALayerCache))


# --------------------------------------------------------------------------- one decoder layer
class DecoderLayer(nn.Module):
    """Attention (KDA or MLA) and MLP (dense or LatentMoE) joined by two Attention Residuals sites."""

    def __init__(self, config: ModelConfig, layer_idx: int, random_init: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.is_mla = config.is_mla(layer_idx)
        self.self_attn = MLAAttention(config) if self.is_mla else KDAAttention(config)
        self.is_moe = config.is_moe(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, layer_idx, random_init)
        else:
            self.mlp = DenseMLP(D, config.dense_intermediate_size, config)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.input_layernorm.weight.dtype

    def new_cache(self) -> LayerCache:
        return self.self_attn.new_cache()

    def _site(self, partial: Tensor, blocks: list[Tensor], proj: nn.Linear, norm: RMSNorm) -> Tensor:
        return attn_res(partial, blocks, proj.weight, norm.weight, self.config.rms_norm_eps)

    def attention(self, x: Tensor, lengths: Sequence[int], caches: list[LayerCache]) -> Tensor:
        """x [N, D] (concatenated new tokens) -> [N, D]; loops over sequences except in a pure decode step."""
        if all(n == 1 for n in lengths):
            return self.self_attn.forward_batch_decode(x, caches)
        outs, start = [], 0
        for n, cache in zip(lengths, caches):
            outs.append(self.self_attn(x[start: start + n], cache))
            start += n
        return torch.cat(outs)

    @torch.inference_mode()
    def attend(self, state: ResidualState, caches: list[SequenceCache]) -> tuple[ResidualState, Tensor]:
        """First half of the layer: returns the updated state and the MLP input x [N, D] (model dtype)."""
        blocks, partial = list(state.blocks), state.partial
        h = self._site(partial, blocks, self.self_attention_res_proj, self.self_attention_res_norm) if blocks else partial
        if self.layer_idx % self.config.attn_res_block_size == 0:
            blocks.append(partial)
            partial = None
        layer_caches = [self._layer_cache(c) for c in caches]
        a = self.attention(self.input_layernorm(h).to(self.compute_dtype), state.lengths, layer_caches).float()
        partial = a if partial is None else partial + a
        h = self._site(partial, blocks, self.mlp_res_proj, self.mlp_res_norm)
        x = self.post_attention_layernorm(h).to(self.compute_dtype)
        return ResidualState(state.lengths, blocks, partial), x

    def mlp_forward(self, x: Tensor) -> Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    @staticmethod
    def add_mlp(state: ResidualState, m: Tensor) -> ResidualState:
        """Second half: add the MLP output to the running partial sum."""
        return ResidualState(state.lengths, state.blocks, state.partial + m.float())

    @torch.inference_mode()
    def forward(self, state: ResidualState, caches: list[SequenceCache]) -> ResidualState:
        state, x = self.attend(state, caches)
        return self.add_mlp(state, self.mlp_forward(x))

    def _layer_cache(self, cache: SequenceCache) -> LayerCache:
        if len(cache.layers) <= self.layer_idx or cache.layers[self.layer_idx] is None:
            raise ValueError(f"this sequence cache holds no state for layer {self.layer_idx}")
        return cache.layers[self.layer_idx]


class KimiK3Decoder(nn.Module):
    """The `model.` part of the checkpoint: embedding, layers, final norm and the output AttnRes site."""

    def __init__(self, config: ModelConfig, random_init: bool = True):
        super().__init__()
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(config, i, random_init) for i in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)


# --------------------------------------------------------------------------- the whole model
class KimiK3Model(nn.Module):
    """Kimi K3 text model. state_dict keys are the release's tensor names without `language_model.`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                 random_init: bool = True):
        """The random model of `seed`: the weights `make_random_checkpoint(config, seed=seed)` writes.
        `random_init=False` builds shapes only (no random draws): for a skeleton whose weights come from a
        checkpoint, e.g. on the meta device in a shard process."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self._routing_observer: RoutingObserver | None = None
        # nn.Linear draws a default init from the global RNG while it is built; fork it so callers' random
        # streams are untouched (the weights themselves come from the checkpoint recipe below)
        with torch.random.fork_rng(devices=[]):
            self.model = KimiK3Decoder(config, random_init=False)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if random_init:
            fill_random_weights(self, seed)
        self._cast(dtype)

    # ------------------------------------------------------------ weights
    def _cast(self, dtype: torch.dtype) -> None:
        """Cast floating tensors to dtype except those the format keeps in fp32."""
        for mod_name, module in self.named_modules():
            for kind in ("_parameters", "_buffers"):
                store = getattr(module, kind)
                for name, t in store.items():
                    if t is None or not t.is_floating_point():
                        continue
                    full = f"{mod_name}.{name}" if mod_name else name
                    target = torch.float32 if full.endswith(FP32_TENSOR_SUFFIXES) else dtype
                    if t.dtype != target:
                        if kind == "_parameters":
                            t.data = t.data.to(target)
                        else:
                            store[name] = t.to(target)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def set_dequantize_cache(self, enabled: bool) -> None:
        """Routed MXFP4 experts: keep dequantised copies (True) or decode on every call (False, default)."""
        for layer in self.layers:
            if layer.is_moe:
                layer.block_sparse_moe.set_dequantize_cache(enabled)

    def set_fast_paths(self, enabled: bool) -> None:
        """The GPU fast paths (fla's Triton KDA kernels, routed experts batched by expert) where they apply (True,
        the default), or every layer on the plain kernels that are their oracles, wherever it runs (False)."""
        for layer in self.layers:
            if not layer.is_mla:
                layer.self_attn.fast_kernels = enabled
            if layer.is_moe:
                layer.block_sparse_moe.grouped_experts = None if enabled else False

    def hold_experts_stacked(self, device: torch.device | str, layers: Iterable[int] | None = None) -> None:
        """Before loading into a skeleton: each MoE layer's (of `layers`, default all) routed experts allocated as
        stacks on `device`, for the batched expert path (LatentMoE.hold_experts_stacked)."""
        for i in range(self.config.num_layers) if layers is None else layers:
            if self.layers[i].is_moe:
                self.layers[i].block_sparse_moe.hold_experts_stacked(device)

    @property
    def device(self) -> torch.device:
        """Where the materialised weights live (a stage's skeleton keeps the rest on meta)."""
        return model_device(self)

    @property
    def routing_observer(self) -> RoutingObserver | None:
        return self._routing_observer

    @routing_observer.setter
    def routing_observer(self, fn: RoutingObserver | None) -> None:
        self._routing_observer = fn
        for layer in self.layers:
            if layer.is_moe:
                layer.block_sparse_moe.routing_observer = fn

    # ------------------------------------------------------------- caches
    def new_cache(self, layers: Iterable[int] | None = None) -> SequenceCache:
        """Empty decode state for a new sequence (only for `layers` if given: a pipeline stage's share)."""
        wanted = set(range(self.config.num_layers) if layers is None else layers)
        return SequenceCache([layer.new_cache() if i in wanted else None for i, layer in enumerate(self.layers)])

    # ------------------------------------------------------ layer-level API
    attn_res = staticmethod(attn_res)  # the per-token Attention Residuals mix (inference.model.layers.attn_res)

    @torch.inference_mode()
    def embed(self, ids: Tensor, lengths: Sequence[int] | None = None) -> ResidualState:
        """Concatenated token ids [N] -> the initial residual state (the embedding is the first partial sum)."""
        lengths = tuple(lengths) if lengths is not None else (int(ids.shape[0]),)
        if sum(lengths) != ids.shape[0]:
            raise ValueError(f"lengths {lengths} do not add up to the {ids.shape[0]} token ids")
        return ResidualState(lengths, [], self.model.embed_tokens(ids).float())

    @torch.inference_mode()
    def run_layer(self, i: int, state: ResidualState, caches: list[SequenceCache]) -> ResidualState:
        return self.layers[i](state, caches)

    @torch.inference_mode()
    def run_layers(self, start: int, stop: int, state: ResidualState, caches: list[SequenceCache]) -> ResidualState:
        """Layers [start, stop) on the state; caches must hold those layers."""
        if not 0 <= start <= stop <= self.config.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.config.num_layers}")
        if len(caches) != len(state.lengths):
            raise ValueError(f"{len(state.lengths)} sequences in the state but {len(caches)} caches")
        for i in range(start, stop):
            state = self.layers[i](state, caches)
        return state

    @torch.inference_mode()
    def head(self, state: ResidualState, rows: Sequence[int] | Tensor | None = None) -> Tensor:
        """Output AttnRes site, final norm and lm_head on the given rows (all if None): fp32 logits [n, V]."""
        if rows is not None:
            state = state.select(rows)
        h = attn_res(state.partial, state.blocks, self.model.output_attn_res_proj.weight,
                     self.model.output_attn_res_norm.weight, self.config.rms_norm_eps)
        return self.lm_head(self.model.norm(h).to(self.dtype)).float()

    # -------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, token_ids: list[Tensor], caches: list[SequenceCache], all_logits: bool = False) -> list[Tensor]:
        """Run each sequence's new tokens after its cache; returns per sequence fp32 logits
        [T_i, V] (all_logits) or [V] (last new token). Updates the caches in place."""
        self._check_batch(token_ids, caches)
        lengths = [int(t.shape[0]) for t in token_ids]
        device = self.input_device()
        ids = torch.cat([t.to(device=device, dtype=torch.long) for t in token_ids])
        state = self.embed(ids, lengths)
        if any(c.state_log is not None for c in caches):
            state = self._run_recording(state, caches)
        else:
            state = self.run_layers(0, self.config.num_layers, state, caches)
        if all_logits:
            logits = self.head(state)
            out = list(torch.split(logits, lengths))
        else:
            out = list(self.head(state, state.last_rows))
        for cache, n in zip(caches, lengths):
            cache.advance(n)
        return out

    def input_device(self) -> torch.device:
        """Where token ids go in (the embedding's device)."""
        return self.lm_head.weight.device

    def _run_recording(self, state: ResidualState, caches: list[SequenceCache]) -> ResidualState:
        """Every layer, stopping at the layer boundaries the sequences' state logs ask for: there each log records
        the running partial sum of its own rows (the part of the residual state that is new since the previous
        boundary; the completed block sums were partial sums at earlier boundaries) at its positions."""
        boundaries = sorted({b for c in caches if c.state_log is not None for b in c.state_log.boundaries})
        start = 0
        for boundary in boundaries:
            state = self.run_layers(start, boundary, state, caches)
            row = 0
            for cache, n in zip(caches, state.lengths):
                if cache.state_log is not None and boundary in cache.state_log.boundaries:
                    cache.state_log.record(boundary, cache.length, state.partial[row:row + n])
                row += n
            start = boundary
        return self.run_layers(start, self.config.num_layers, state, caches)

    def _check_batch(self, token_ids: list[Tensor], caches: list[SequenceCache]) -> None:
        for b, cache in check_forward_batch(self.config, token_ids, caches):
            if len(cache.layers) != self.config.num_layers or any(c is None for c in cache.layers):
                raise ValueError(f"sequence {b}: forward needs a cache holding all {self.config.num_layers} layers "
                                 "(model.new_cache()); stage caches go through run_layers")


__all__ = ["KimiK3Model", "SequenceCache", "ResidualState", "DecoderLayer", "FP32_TENSOR_SUFFIXES"]


def check_forward_batch(config: ModelConfig, token_ids: list[Tensor], caches: list) -> list[tuple[int, object]]:
    """The checks every model's forward makes on a batch (token ids in range, one cache per sequence, within
    the context); returns (index, cache) pairs for the model's own cache checks."""
    if not token_ids:
        raise ValueError("forward needs at least one sequence")
    if len(token_ids) != len(caches):
        raise ValueError(f"{len(token_ids)} token sequences but {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("the same cache appears twice in one batch; clone it for a second sequence")
    for b, (t, cache) in enumerate(zip(token_ids, caches)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"sequence {b}: token ids must be a non-empty 1-D tensor")
        if t.is_floating_point():
            raise ValueError(f"sequence {b}: token ids must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"sequence {b}: token id out of range 0..{config.vocab_size - 1} (saw {lo}..{hi})")
        if cache.length + t.numel() > config.max_position_embeddings:
            raise ValueError(f"sequence {b}: {cache.length} cached + {t.numel()} new tokens exceed the context of "
                             f"{config.max_position_embeddings}")
    return list(enumerate(caches))
