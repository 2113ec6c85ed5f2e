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
The parts are named per tensor (`layer_parts`, `head_part`: dimension and [start, stop)); the worker cuts the
meta skeleton to them before loading, and the one loader reads only those bytes of each split tensor
(`TensorSelection.parts`), so no rank ever holds a whole tensor it shares. fp8 codes of a column part use the
whole rows' scales (read in row blocks, `checkpoint.row_absmax`): the same codes as the unsplit layer's.

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

from inference.model.checkpoint import TensorPart
from inference.model.config import ModelConfig


# =================================================================== slicing weights
def _part(total: int, part: int, parts: int) -> range:
    if total % parts:
        raise ValueError(f"{total} does not divide into {parts} parts")
    n = total // parts
    return range(part * n, (part + 1) * n)


def _of(dim: int, heads: range, width: int = 1) -> TensorPart:
    """The channels of `heads` along `dim` when each head has `width` consecutive channels."""
    return TensorPart(dim, heads.start * width, heads.stop * width)


def kda_parts(config: ModelConfig, part: int, parts: int) -> dict[str, TensorPart]:
    """KDA heads of part `part`: rows of q/k/v/f_b/b/g(_b) projections, conv channels, A_log and dt_bias, the
    columns of o_proj. f_a_proj, g_a_proj and o_norm (per head dimension, shared by heads) stay whole."""
    heads, d = _part(config.kda_heads, part, parts), config.kda_head_dim
    out = {f"{name}.weight": _of(0, heads, d) for name in ("q_proj", "k_proj", "v_proj", "f_b_proj",
                                                            "q_conv1d", "k_conv1d", "v_conv1d")}
    out["b_proj.weight"] = _of(0, heads)
    out["g_proj.weight" if config.full_rank_output_gate else "g_b_proj.weight"] = _of(0, heads, d)
    out["A_log"] = _of(0, heads)
    out["dt_bias"] = _of(0, heads, d)
    out["o_proj.weight"] = _of(1, heads, d)
    return out


def mla_parts(config: ModelConfig, part: int, parts: int) -> dict[str, TensorPart]:
    """MLA heads of part `part`: rows of q_b (or q), kv_b and g projections, columns of o_proj. The low-rank
    q_a / kv_a projections and their norms stay whole: every rank keeps the full latent cache."""
    c = config
    heads = _part(c.mla_heads, part, parts)
    out = {("q_b_proj.weight" if c.q_lora_rank else "q_proj.weight"): _of(0, heads, c.qk_head_dim),
           "kv_b_proj.weight": _of(0, heads, c.qk_nope_head_dim + c.v_head_dim)}
    if c.mla_output_gate:
        out["g_proj.weight"] = _of(0, heads, c.v_head_dim)
    out["o_proj.weight"] = _of(1, heads, c.v_head_dim)
    return out


def mlp_parts(hidden_units: int, part: int, parts: int) -> dict[str, TensorPart]:
    """Hidden units of part `part` of a dense MLP or the shared experts: rows of gate/up, columns of down."""
    units = _part(hidden_units, part, parts)
    return {"gate_proj.weight": _of(0, units), "up_proj.weight": _of(0, units), "down_proj.weight": _of(1, units)}


def mlp_prefix(config: ModelConfig, layer: int) -> str | None:
    """Where layer `layer` keeps its dense MLP or shared experts (None: a MoE layer without them)."""
    if not config.is_moe(layer):
        return "mlp."
    return "block_sparse_moe.shared_experts." if config.num_shared_experts else None


def layer_parts(config: ModelConfig, layer: int, part: int, parts: int) -> dict[str, TensorPart]:
    """Part `part` of `parts` of layer `layer`'s split tensors: key within the layer -> the part held."""
    attn = (mla_parts if config.is_mla(layer) else kda_parts)(config, part, parts)
    out = {f"self_attn.{k}": p for k, p in attn.items()}
    prefix = mlp_prefix(config, layer)
    if prefix is not None:
        units = config.shared_expert_intermediate_size if config.is_moe(layer) else config.dense_intermediate_size
        out.update({prefix + k: p for k, p in mlp_parts(units, part, parts).items()})
    return out


def vocab_slice(vocab: int, part: int, parts: int) -> range:
    """Part `part` of the vocabulary (contiguous, sizes differ by at most one)."""
    bounds = torch.linspace(0, vocab, parts + 1).round().long().tolist()
    return range(bounds[part], bounds[part + 1])


def head_part(config: ModelConfig, part: int, parts: int) -> TensorPart:
    """The rows of the LM head's vocabulary slice `part`."""
    rows = vocab_slice(config.vocab_size, part, parts)
    return TensorPart(0, rows.start, rows.stop)


def narrow(root: nn.Module, key: str, part: TensorPart) -> None:
    """Keep part `part` of the parameter `key` of `root`, in place (on the meta device: the part's shape only)."""
    owner_name, _, name = key.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    t = owner._parameters[name].detach()
    owner._parameters[name] = nn.Parameter(t.narrow(part.dim, part.start, part.stop - part.start).clone(),
                                           requires_grad=False)


def _fix_sizes(module: nn.Module) -> None:
    """Linear and convolution sizes after their weights were cut."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape
        elif isinstance(m, nn.Conv1d):
            m.in_channels = m.out_channels = m.groups = m.weight.shape[0]


def split_layer(layer: nn.Module, part: int, parts: int) -> dict[str, TensorPart]:
    """Part `part` of `parts` of a DecoderLayer's attention and shared experts (or dense MLP), in place; returns
    `layer_parts`. Split before quantising (the worker cuts the meta skeleton, then loads only the parts;
    fp8 codes of a column part use the whole rows' scales, `quantize_dense(row_absmax=...)`)."""
    cut = layer_parts(layer.config, layer.layer_idx, part, parts)
    for key, p in cut.items():
        narrow(layer, key, p)
    attn = layer.self_attn
    attn.num_heads //= parts
    if not layer.is_mla:
        attn.proj_size //= parts
    _fix_sizes(attn)
    mlp = mlp_part(layer)
    if mlp is not None:
        _fix_sizes(mlp)
    return cut


def split_part_keys(layer: nn.Module) -> list[str]:
    """Keys within the layer of what a rank sharing its dense work (not its home) holds: attention, MLP part."""
    keys = [f"self_attn.{k}" for k in layer.self_attn.state_dict()]
    prefix = mlp_prefix(layer.config, layer.layer_idx)
    if prefix is not None:
        keys += [prefix + k for k in mlp_part(layer).state_dict()]
    return keys


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


def split_head(model: nn.Module, part: int, parts: int) -> TensorPart:
    """Keep the LM head's vocabulary slice `part` of `parts`, in place; returns its part of `lm_head.weight`."""
    cut = head_part(model.config, part, parts)
    narrow(model, "lm_head.weight", cut)
    _fix_sizes(model.lm_head)
    return cut


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


__all__ = ["split_layer", "layer_parts", "kda_parts", "mla_parts", "mlp_parts", "head_part", "narrow", "split_head",
           "split_part_keys", "mlp_prefix", "vocab_slice", "mlp_part",
           "attach_group", "to_meta", "keep_only_split_part", "DenseGroup", "GroupMLP", "GroupHead"]
