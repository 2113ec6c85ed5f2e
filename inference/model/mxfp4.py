"""MXFP4 weights: OCP Microscaling Formats v1.0, FP4 E2M1 elements with E8M0 block scales (model.md section 5).

Layout (compressed-tensors ``mxfp4-pack-quantized``, as K3 ships its routed experts):
- ``packed`` uint8 [..., n/2]: two E2M1 codes per byte, element 2j in the low nibble, 2j+1 in the high nibble.
- ``scale`` uint8 [..., n/32]: one E8M0 exponent per 32 consecutive elements of the input dimension;
  the block scale is 2^(e - 127) for e in 0..254 (e = 0 is 2^-127, not zero) and e = 255 is NaN.

Decoding is a table lookup times an exact power of two. In fp32 it is exact for every code and scale
except where the true value exceeds the fp32 range (e = 254 with |code| >= 2 gives +-inf): the format
reaches 6 * 2^127, fp32 stops just below 2^128.
"""
from __future__ import annotations

import functools
import math

import torch

BLOCK = 32
SCALE_BIAS = 127
SCALE_NAN = 255

# E2M1 value of each 4-bit code: bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0


@functools.lru_cache(maxsize=None)
def _code_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values of every byte, element 2j (low nibble) first."""
    codes = torch.arange(256)
    return _code_table(dtype, device)[torch.stack((codes & 0x0F, codes >> 4), dim=-1).to(device)]


@functools.lru_cache(maxsize=None)
def _scale_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built from exact Python floats: 2^-127 is an fp32 subnormal, which torch.tensor stores exactly.
    values = [math.ldexp(1.0, e - SCALE_BIAS) for e in range(255)] + [math.nan]
    return torch.tensor(values, dtype=torch.float64, device=device).to(dtype)


def _check_pair(packed: torch.Tensor, scale: torch.Tensor) -> int:
    """Validate a (packed, scale) pair and return the number of input elements n."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed and scale tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree on leading dims")
    n = packed.shape[-1] * 2
    if scale.shape[-1] * BLOCK != n:
        raise ValueError(
            f"MXFP4 packed {tuple(packed.shape)} holds {n} elements per row but scale {tuple(scale.shape)} "
            f"covers {scale.shape[-1] * BLOCK} (one scale per {BLOCK} elements)"
        )
    return n


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> int64 codes [..., n], low nibble first."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2).long()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] (values 0..15) -> uint8 [..., n/2], element 2j in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP4 to a dense tensor [..., n]: table[code] * 2^(e - 127), NaN where e = 255."""
    n = _check_pair(packed, scale)
    # fp64 output is decoded in fp64 so that it holds even the values past the fp32 range; bf16 output in bf16 (its
    # exponent range is fp32's, and a code times a power of two has at most two significant bits: exact, and half
    # the bytes an fp32 decode writes, which is what a GPU decoding experts per call pays for).
    work = dtype if dtype in (torch.float64, torch.bfloat16) else torch.float32
    # One lookup per byte yields both of its elements (low nibble first): half the gathers of a per-code table.
    pairs = _byte_table(work, packed.device)[packed.int()]  # [..., n/2, 2]
    factors = _scale_table(work, packed.device)[scale.int()]
    blocks = pairs.reshape(*packed.shape[:-1], n // BLOCK, BLOCK) * factors.unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def _round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round magnitudes y >= 0 (already divided by the block scale) to the E2M1 grid, ties to even, saturating.

    The grid has step 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6]; torch.round rounds half to even on each
    integer lattice, and on this grid "even lattice point" coincides with "even code" (even mantissa bit).
    """
    fine = torch.round(y * 2) / 2
    mid = torch.round(y)
    coarse = torch.round(y / 2) * 2
    q = torch.where(y < 2, fine, torch.where(y < 4, mid, coarse))
    return q.clamp(max=E2M1_MAX)


@functools.lru_cache(maxsize=None)
def _magnitude_to_code(device: torch.device) -> torch.Tensor:
    """Index by 2 * magnitude (0..12) -> magnitude code 0..7; -1 marks values off the grid."""
    return torch.tensor([0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7], device=device)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., n] (n a multiple of 32) to MXFP4: (packed uint8 [..., n/2], scale uint8 [..., n/32]).

    Each block takes the smallest shared exponent e for which the block's largest magnitude fits in
    E2M1's range (|w| <= 6 * 2^(e-127)); elements round to nearest on the grid, ties to even. Blocks of
    weights already on the grid with a largest code of magnitude 4 or 6 round-trip bit for bit, and any
    on-grid block round-trips in value.
    """
    if w.dim() < 1 or w.shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP4 quantisation needs the last (input) dimension to be a multiple of {BLOCK}; got shape {tuple(w.shape)}"
        )
    if not w.is_floating_point():
        raise ValueError(f"MXFP4 quantisation needs a floating point tensor, got {w.dtype}")
    x = w.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError("MXFP4 quantisation got non-finite weights (inf or NaN)")
    n = x.shape[-1]
    blocks = x.unflatten(-1, (n // BLOCK, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    # frexp is exact: amax = m * 2^k with m in [0.5, 1), so amax / 2^(k-3) lies in [4, 8).
    _, k = torch.frexp(amax)
    exponent = k.long() - 3
    exponent = exponent + (amax > E2M1_MAX * torch.ldexp(torch.ones_like(amax), exponent)).long()
    exponent = torch.where(amax == 0, torch.zeros_like(exponent), exponent)
    biased = (exponent + SCALE_BIAS).clamp(0, 254)
    block_scale = torch.ldexp(torch.ones_like(amax), biased - SCALE_BIAS)
    y = blocks / block_scale.unsqueeze(-1)  # exact: division by a power of two in fp64
    magnitude = _round_to_e2m1(y.abs())
    codes = _magnitude_to_code(x.device)[(magnitude * 2).long()]
    codes = codes + 8 * torch.signbit(blocks).long()
    return pack_codes(codes.flatten(-2)), biased.to(torch.uint8)


def random_on_grid(
    out_features: int,
    in_features: int,
    generator: torch.Generator | None = None,
    scale_exponents: tuple[int, int] = (120, 127),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights (packed, scale) whose dense form quantises back to the same bytes.

    Codes are uniform over all 16; biased scale exponents are uniform over [lo, hi] (inclusive). One
    random element of every block is set to +-4 or +-6 so the block's scale is the canonical one that
    `quantize` would choose: then quantize(dequantize(packed, scale)) == (packed, scale) exactly.
    """
    lo, hi = scale_exponents
    if not 0 <= lo <= hi <= 254:
        raise ValueError(f"scale exponents must satisfy 0 <= lo <= hi <= 254, got {scale_exponents}")
    if in_features % BLOCK:
        raise ValueError(f"in_features={in_features} is not a multiple of the MXFP4 block ({BLOCK})")
    n_blocks = in_features // BLOCK
    codes = torch.randint(0, 16, (out_features, n_blocks, BLOCK), generator=generator)
    anchor_pos = torch.randint(0, BLOCK, (out_features, n_blocks, 1), generator=generator)
    anchor_code = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (out_features, n_blocks, 1), generator=generator)]
    codes.scatter_(-1, anchor_pos, anchor_code)
    scale = torch.randint(lo, hi + 1, (out_features, n_blocks), generator=generator).to(torch.uint8)
    return pack_codes(codes.flatten(-2)), scale


class DequantizedCache:
    """Dense copies of MXFP4 weights, made once and reused (trades memory for decode time).

    Keyed by the packed tensor's identity; an entry is dropped when the packed or scale tensor is
    modified in place (e.g. a checkpoint load copies into the buffer), detected by the tensor version.
    """

    def __init__(self):
        self._entries: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]] = {}

    def get(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(packed), dtype)
        entry = self._entries.get(key)
        if entry is not None:
            p, s, pv, sv, dense = entry
            # Holding references to p and s keeps id(packed) from being reused by another tensor.
            if p is packed and s is scale and pv == packed._version and sv == scale._version:
                return dense
        dense = dequantize(packed, scale, dtype)
        self._entries[key] = (packed, scale, packed._version, scale._version, dense)
        return dense

    def clear(self) -> None:
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e[4].numel() * e[4].element_size() for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def mxfp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, cache: DequantizedCache | None = None
) -> torch.Tensor:
    """x [..., n] @ W^T for MXFP4 W [m, n]; returns [..., m] in x.dtype.

    Without a cache the weight is decoded on every call (memory stays at 4.25 bits per weight between
    calls); with one, the dense copy is decoded once. Decoding to x.dtype is exact for bf16 and fp32.
    """
    n = _check_pair(packed, scale)
    if packed.dim() != 2:
        raise ValueError(f"mxfp4_matmul needs a 2-D weight, got packed shape {tuple(packed.shape)}")
    if x.shape[-1] != n:
        raise ValueError(f"input has {x.shape[-1]} features but the MXFP4 weight takes {n}")
    dtype = x.dtype if x.is_floating_point() else torch.float32
    w = cache.get(packed, scale, dtype) if cache is not None else dequantize(packed, scale, dtype)
    return x.to(dtype) @ w.T


__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "DequantizedCache",
    "dequantize",
    "quantize",
    "random_on_grid",
    "mxfp4_matmul",
    "pack_codes",
    "unpack_codes",
]
