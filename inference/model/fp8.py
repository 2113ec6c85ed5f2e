"""Dense (non-expert) weights in float8 e4m3 with one fp32 scale per output channel (issue 17, precision lever).

`quantize_fp8(w [out, in]) -> (q float8_e4m3fn [out, in], scale fp32 [out])` with scale = max|row| / 448, so every
row uses the format's whole range; `dequantize_fp8(q, scale)` is q * scale. `FP8Linear` holds (q, scale) and
computes y = (x @ q^T) * scale: the scale factors out of the row's dot product, so the matmul runs on the
codes cast to the activation dtype and one multiply per output channel follows (no full dequantised copy).
Its `weight` property gives the dequantised matrix for code that reads weights directly (MLA's absorbed form
folds `kv_b_proj.weight` into the query).

`quantize_dense(model)` swaps every dense linear layer of a `KimiK3Model` (attention projections, dense MLP,
shared experts, latent down/up projections, LM head) for an `FP8Linear`; the router, the Attention Residuals
projections (one output each, read as weights), norms, convolutions, the embedding and the MXFP4 routed
experts stay as they are. Weights on the meta device (another shard's) are left alone.

e4m3 has 3 mantissa bits: a weight's relative rounding error is at most 2^-4 (half a unit in the last place),
and values below 2^-6 x scale lose relative precision (subnormals, down to 2^-9 x scale).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_RELATIVE_ERROR = 2.0 ** -4  # worst relative rounding error of a normal e4m3 value
FP8_SUBNORMAL_STEP = 2.0 ** -9  # spacing of e4m3 subnormals (times the row's scale): the absolute error floor

# Linear layers left in the checkpoint's dtype: read as weights, or too small and too sensitive to matter.
KEEP_SUFFIXES = ("res_proj",)


def quantize_fp8(w: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """w [out, in] -> (codes float8_e4m3fn [out, in], scale fp32 [out]); an all-zero row gets scale 1.

    amax: the rows' largest magnitudes when w holds only some columns of the matrix (a dense split's part):
    the codes are then exactly those columns of the whole matrix's."""
    if w.dim() != 2:
        raise ValueError(f"fp8 quantisation takes a matrix [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    amax = w.abs().amax(dim=1) if amax is None else amax.float().to(w.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.to(torch.float32) * scale.float()[:, None]).to(dtype)


class FP8Linear(nn.Module):
    """A bias-free linear layer with fp8 e4m3 weight codes and per-output-channel fp32 scales."""

    def __init__(self, q: Tensor, scale: Tensor, dtype: torch.dtype):
        super().__init__()
        if q.dtype != FP8_DTYPE or scale.shape != (q.shape[0],):
            raise ValueError("FP8Linear needs float8_e4m3fn codes [out, in] and fp32 scales [out]")
        self.out_features, self.in_features = q.shape
        self.dtype = dtype  # the activations' dtype: codes are cast to it for the matmul
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scale.float())

    @classmethod
    def from_linear(cls, linear: nn.Linear, amax: Tensor | None = None) -> "FP8Linear":
        if linear.bias is not None:
            raise ValueError("FP8Linear has no bias")
        q, scale = quantize_fp8(linear.weight.detach(), amax)
        return cls(q, scale, linear.weight.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantised weight [out, in] in the activation dtype."""
        return dequantize_fp8(self.weight_fp8, self.weight_scale, self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.nn.functional.linear(x, self.weight_fp8.to(x.dtype))
        return y * self.weight_scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel scales"


def dense_linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the linear layers `quantize_dense` turns into fp8 (materialised ones only)."""
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.endswith(KEEP_SUFFIXES) or ".experts." in name:
            continue
        if module.weight.is_meta:
            continue
        names.append(name)
    return names


@torch.no_grad()
def quantize_dense(model: nn.Module, row_absmax: dict[str, Tensor] | None = None) -> list[str]:
    """Replace the model's dense linear layers by FP8Linear in place; returns the names replaced.

    row_absmax: layer name -> its whole rows' largest magnitudes, for layers holding only some columns."""
    names = dense_linear_names(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_linear(getattr(parent, child), (row_absmax or {}).get(name)))
    return names


__all__ = ["FP8Linear", "quantize_fp8", "dequantize_fp8", "quantize_dense", "dense_linear_names", "FP8_DTYPE",
           "FP8_MAX", "FP8_RELATIVE_ERROR", "FP8_SUBNORMAL_STEP"]
