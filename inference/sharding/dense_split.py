"""Split dense work inside a host (issue 17): a layer's attention heads, its shared experts' (or dense MLP's)
hidden units and the LM head's vocabulary divided over the ranks of a plan's `dense_split` group.

Each rank of a group keeps part p of P of the layer's weights (`split_layer`, `split_head`):
- KDA: heads [p H/P, (p+1) H/P): their rows of q/k/v/f_b/b/g projections, convolution channels, A_log and
  dt_bias, their columns of o_proj (column split, then row split). Its KDA state and conv windows are those
  heads' only.
- MLA: the same heads' rows of q_b_proj, kv_b_proj, g_proj and columns of o_proj; the low-rank q_a / kv_a
  projections and their norms are whole on every rank, so each keeps the full latent cache (576 per token).
- Dense MLP and shared experts: hidden units [p F/P, (p+1) F/P) of gate/up (rows) and down (columns).
- LM head: a contiguous slice of the vocabulary (rows).

The home (part 0) runs everything else (Attention Residuals, norms, router, latent projections, the routed
experts' dispatch) and drives each block through a `DenseGroup`: it sends the block's input to the other ranks,
computes its own part, and adds the fp32 partial sums they send back (one broadcast and one reduce per
block, over the same timed point-to-point wire as every other message, so link emulation and timeouts
apply). Row-split partial sums add up to the whole product, so the result equals the unsplit layer up to
the order of fp32 additions.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from inference.model.fp8 import FP8Linear


# =================================================================== slicing weights
def _rows(linear: nn.Module, index: Tensor) -> nn.Module:
    """The output channels `index` of a bias-free linear layer (bf16/fp32 or fp8)."""
    if isinstance(linear, FP8Linear):
        return linear.rows(index)
    out = nn.Linear(linear.in_features, len(index), bias=False, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[index].clone(), requires_grad=False)
    return out


def _columns(linear: nn.Module, index: Tensor) -> nn.Module:
    """The input features `index` of a bias-free linear layer: its part of a row-split product."""
    if isinstance(linear, FP8Linear):
        return linear.columns(index)
    out = nn.Linear(len(index), linear.out_features, bias=False, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[:, index].clone(), requires_grad=False)
    return out


def _part(total: int, part: int, parts: int) -> range:
    if total % parts:
        raise ValueError(f"{total} does not divide into {parts} parts")
    n = total // parts
    return range(part * n, (part + 1) * n)


def _channels(heads: range, width: int) -> Tensor:
    """The channel indices of `heads` when each head has `width` consecutive channels."""
    return torch.arange(heads.start * width, heads.stop * width)


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=False)


def split_kda(attn: nn.Module, part: int, parts: int) -> None:
    """Keep heads of part `part` of a KDAAttention, in place."""
    heads = _part(attn.num_heads, part, parts)
    d = attn.head_dim
    ch, hs = _channels(heads, d), torch.arange(heads.start, heads.stop)
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj"):
        setattr(attn, name, _rows(getattr(attn, name), ch))
    attn.b_proj = _rows(attn.b_proj, hs)
    if attn.config.full_rank_output_gate:
        attn.g_proj = _rows(attn.g_proj, ch)
    else:
        attn.g_b_proj = _rows(attn.g_b_proj, ch)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(attn, name)
        conv.weight = _param(conv.weight[ch])
        conv.in_channels = conv.out_channels = conv.groups = len(ch)
    attn.A_log = _param(attn.A_log[hs])
    attn.dt_bias = _param(attn.dt_bias[ch])
    attn.o_proj = _columns(attn.o_proj, ch)
    attn.num_heads, attn.proj_size = len(heads), len(ch)


def split_mla(attn: nn.Module, part: int, parts: int) -> None:
    """Keep heads of part `part` of an MLAAttention, in place (q_a / kv_a stay whole: the latent is shared)."""
    cfg = attn.config
    heads = _part(attn.num_heads, part, parts)
    if cfg.q_lora_rank:
        attn.q_b_proj = _rows(attn.q_b_proj, _channels(heads, cfg.qk_head_dim))
    else:
        attn.q_proj = _rows(attn.q_proj, _channels(heads, cfg.qk_head_dim))
    attn.kv_b_proj = _rows(attn.kv_b_proj, _channels(heads, attn.nope + attn.v_dim))
    values = _channels(heads, attn.v_dim)
    if cfg.mla_output_gate:
        attn.g_proj = _rows(attn.g_proj, values)
    attn.o_proj = _columns(attn.o_proj, values)
    attn.num_heads = len(heads)


def split_mlp(mlp: nn.Module, part: int, parts: int) -> None:
    """Keep hidden units of part `part` of a DenseMLP (dense layer or shared experts), in place."""
    units = torch.tensor(list(_part(mlp.gate_proj.out_features, part, parts)))
    mlp.gate_proj = _rows(mlp.gate_proj, units)
    mlp.up_proj = _rows(mlp.up_proj, units)
    mlp.down_proj = _columns(mlp.down_proj, units)


def split_layer(layer: nn.Module, part: int, parts: int) -> None:
    """Part `part` of `parts` of a DecoderLayer's attention and shared experts (or dense MLP), in place."""
    (split_mla if layer.is_mla else split_kda)(layer.self_attn, part, parts)
    mlp = mlp_part(layer)
    if mlp is not None:
        split_mlp(mlp, part, parts)


def to_meta(module: nn.Module) -> None:
    """Drop every tensor of `module` to the meta device (shapes kept, memory freed), in place."""
    for sub in module.modules():
        for name, t in sub._parameters.items():
            if t is not None:
                sub._parameters[name] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False)
        for name, t in sub._buffers.items():
            if t is not None:
                sub._buffers[name] = torch.empty_like(t, device="meta")


def keep_only_split_part(layer: nn.Module) -> None:
    """On a rank that shares a layer's dense work without being its home: free what only the home uses
    (norms, Attention Residuals projections, router, latent projections), keeping the split attention and MLP."""
    keep = {id(layer.self_attn)}
    mlp = mlp_part(layer)
    if mlp is not None:
        keep.add(id(mlp))
    for module in layer.children():
        if id(module) in keep:
            continue
        if layer.is_moe and module is layer.block_sparse_moe:
            for child in module.children():
                if id(child) not in keep and child is not module.experts:
                    to_meta(child)
            continue
        to_meta(module)


def mlp_part(layer: nn.Module) -> nn.Module | None:
    """The layer's dense MLP, or its shared experts (None for a MoE layer without them)."""
    if not layer.is_moe:
        return layer.mlp
    return getattr(layer.block_sparse_moe, "shared_experts", None)


def vocab_slice(vocab: int, part: int, parts: int) -> range:
    """Part `part` of the vocabulary (contiguous, sizes differ by at most one)."""
    bounds = torch.linspace(0, vocab, parts + 1).round().long().tolist()
    return range(bounds[part], bounds[part + 1])


def split_head(lm_head: nn.Module, part: int, parts: int) -> nn.Module:
    rows = vocab_slice(lm_head.out_features, part, parts)
    return _rows(lm_head, torch.arange(rows.start, rows.stop))


# =================================================================== the group's messages
class DenseGroup:
    """One split block's messages on the home: input out to the group, fp32 partial sums back.

    `send(dst, tensor, what)` and `recv(src, shape, dtype, what)` are the rank's timed wire."""

    def __init__(self, ranks: tuple[int, ...], send: Callable, recv: Callable, what: str):
        self.peers = ranks[1:]
        self.send, self.recv, self.what = send, recv, what

    def run(self, x: Tensor, local: Callable[[Tensor], Tensor]) -> Tensor:
        """local(x) plus every peer's part of the same block on x: [N, out] in local's dtype."""
        for r in self.peers:
            self.send(r, x, f"{self.what} input")
        y = local(x)
        total = y.float()
        for r in self.peers:
            total = total + self.recv(r, tuple(y.shape), torch.float32, f"{self.what} partial sum")
        return total.to(y.dtype)

    def gather(self, x: Tensor, local: Callable[[Tensor], Tensor], widths: list[int]) -> Tensor:
        """local(x) with every peer's output columns after it (the vocabulary-split LM head)."""
        for r in self.peers:
            self.send(r, x, f"{self.what} input")
        parts = [local(x)]
        for r, width in zip(self.peers, widths[1:]):
            parts.append(self.recv(r, (x.shape[0], width), torch.float32, f"{self.what} columns").to(parts[0].dtype))
        return torch.cat(parts, dim=-1)


def attach_group(layer: nn.Module, group_for: Callable[[str], DenseGroup]) -> None:
    """Make the home's (already split) layer run its attention and MLP part through groups (in place)."""
    base = type(layer).attention  # DecoderLayer.attention on the local heads

    attention_group = group_for("attention")

    def attention(x: Tensor, lengths, caches) -> Tensor:
        return attention_group.run(x, lambda v: base(layer, v, lengths, caches))

    layer.attention = attention  # this instance only: the class's attend() calls it
    if not layer.is_moe:
        layer.mlp = GroupMLP(layer.mlp, group_for("dense MLP"))
    elif mlp_part(layer) is not None:
        layer.block_sparse_moe.shared_experts = GroupMLP(layer.block_sparse_moe.shared_experts,
                                                         group_for("shared experts"))


class GroupMLP(nn.Module):
    """The home's view of a split dense MLP / shared experts: its own part plus the peers' partial sums."""

    def __init__(self, local: nn.Module, group: DenseGroup):
        super().__init__()
        self.local = local
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return self.group.run(x, self.local)


class GroupHead(nn.Module):
    """The head rank's view of a vocabulary-split LM head: its logits slice, then the peers' in order."""

    def __init__(self, local: nn.Module, group: DenseGroup, widths: list[int]):
        super().__init__()
        self.local = local
        self.group = group
        self.widths = widths
        self.out_features = sum(widths)

    @property
    def weight(self) -> Tensor:  # the driver's and the model's device/dtype queries
        return self.local.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.group.gather(x, self.local, self.widths)


__all__ = ["split_layer", "split_kda", "split_mla", "split_mlp", "split_head", "vocab_slice", "mlp_part",
           "attach_group", "to_meta", "keep_only_split_part", "DenseGroup", "GroupMLP", "GroupHead"]
