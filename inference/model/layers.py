"""Small pieces shared by the Kimi K3 modules: RMSNorm and the Attention Residuals mix (model.md section 6)."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32 (no weight)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the result is cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


def attn_res(partial: Tensor, blocks: list[Tensor], proj_w: Tensor, norm_w: Tensor, eps: float) -> Tensor:
    """Attention Residuals: mix the completed block sums and the running partial sum, per token, in fp32.

    partial and each block are [N, D]; proj_w is [1, D] (or [D]); norm_w is [D]. Returns [N, D] fp32.
    The keys are the sources RMS-normalised without weight; the one learned query vector is norm_w * proj_w,
    so a source's logit is exactly `proj(norm(source))`.
    """
    v = torch.stack([b.float() for b in blocks] + [partial.float()])  # [n_src, N, D] raw values
    k = rms_normalize(v, eps)
    query = norm_w.float() * proj_w.float().reshape(-1)  # [D]
    logits = (k * query).sum(-1)  # [n_src, N]
    p = torch.softmax(logits, dim=0)
    return (p.unsqueeze(-1) * v).sum(0)


__all__ = ["RMSNorm", "rms_normalize", "attn_res"]
