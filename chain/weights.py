"""Weights as the chain stores them: the one place that turns a validator's {uid: weight} into a u16 row.

Both chain implementations use it: `SubtensorChain` to report the row the SDK submits, the devnet to
store the row a real chain would store. The steps, in the SDK 11 order (`bittensor.intents.SetWeights`):

1. `validated_pairs`: uids are integers in 0..65535, weights finite and non-negative.
2. `clip_to_max_weight`: unless the row is a lone self-weight, normalise to sum 1 with no weight above
   the subnet's `max_weight_limit` (the excess is spread over the others by lowering one cutoff), so a
   row the chain would refuse with MaxWeightExceeded is clipped instead.
3. `quantize`: max-upscale to u16 the way the SDK does (`round(w / max * 65535)`, Python's rounding).
   The SDK drops entries that become 0; the devnet keeps them (`keep_zeros=True`), because subtensor
   stores explicit zeros and they matter to Yuma's bonds (a stored zero decays a bond, an absent entry
   resets it).
4. `too_few_weights`: subtensor's WeightVecLengthIsLow rule, min(min_allowed_weights, n) entries unless
   the row is a lone self-weight.

`max_upscale_u16` is the chain side of step 3 (`vec_u16_max_upscale_to_u16` in subtensor's math.rs:
fixed-point rounding, ties away from zero); it leaves a row whose maximum is already 65535 unchanged.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

U16_MAX = 65535
# Clipping lands the largest weight a hair under the limit, as the SDK does, so that the u16 row still
# passes the chain's `max / sum <= limit` check after rounding.
CLIP_MARGIN = 1e-7


class WeightsError(ValueError):
    """Weights that cannot be submitted (negative, not finite, a uid out of range, all zero)."""


@dataclass(frozen=True)
class ConformedRow:
    uids: tuple[int, ...]
    values: tuple[int, ...]  # u16, max-upscaled
    self_weight_only: bool


def validated_pairs(weights: Mapping | Iterable) -> list[tuple[int, float]]:
    """(uid, weight) pairs from a {uid: weight} mapping (sorted by uid, as the SDK sends them) or from a
    sequence of pairs (order kept, duplicates kept for the chain to refuse)."""
    is_mapping = isinstance(weights, Mapping)
    items = weights.items() if is_mapping else list(weights)
    pairs = []
    for item in items:
        try:
            uid, value = item
        except (TypeError, ValueError):
            raise WeightsError(f"weights must be a dict uid -> weight or (uid, weight) pairs, got {item!r}") from None
        if isinstance(uid, bool) or not isinstance(uid, numbers.Integral) or not 0 <= uid <= U16_MAX:
            raise WeightsError(f"uid {uid!r} is not an integer in 0..{U16_MAX}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise WeightsError(f"weight for uid {uid} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise WeightsError(f"weight for uid {uid} is {value}; weights must be finite and non-negative")
        pairs.append((int(uid), value))
    return sorted(pairs) if is_mapping else pairs


def clip_to_max_weight(values: Sequence[float], limit: float) -> list[float]:
    """Normalise to sum 1 with no value above `limit` (a fraction in (0, 1]).

    Values above a cutoff are lowered to it; the cutoff is the one that puts the largest normalised value
    at the limit (less CLIP_MARGIN). When no distribution can satisfy the limit (len * limit <= 1) the
    result is uniform. All-zero input is a WeightsError.
    """
    n = len(values)
    total = float(sum(values))
    if n == 0 or total <= 0:
        raise WeightsError("weights are all zero; give at least one positive weight")
    if n * limit <= 1:
        return [1.0 / n] * n
    shares = sorted(v / total for v in values)
    if shares[-1] <= limit:
        return [v / total for v in values]
    positive = sum(1 for v in values if v > 0)
    if positive * limit <= 1:
        # Lowering the largest values cannot lift the zeros: no clipped row meets the limit (the chain
        # refuses it with MaxWeightExceeded), so the row goes as it is.
        return [v / total for v in values]
    running = np.cumsum(shares)
    # Keep the k smallest shares as they are and clip the n - k others to one cutoff c, so that
    # c / (sum of the k kept + (n - k) c) = limit. k is the count of shares that stay below their cutoff.
    kept = sum(
        1 for i, s in enumerate(shares) if s / ((n - i - 1) * s + running[i] + CLIP_MARGIN) < limit
    )
    cutoff = (limit * running[kept - 1] - CLIP_MARGIN) / (1 - limit * (n - kept)) * total
    clipped = [min(float(v), cutoff) for v in values]
    clipped_total = sum(clipped)
    return [v / clipped_total for v in clipped]


def quantize(values: Sequence[float]) -> list[int]:
    """Max-upscale to u16 as the SDK does: round(v / max * 65535) (Python rounds halves to even).
    An all-zero row gives all zeros."""
    top = max(values) if len(values) else 0.0
    if top <= 0:
        return [0] * len(values)
    return [int(round((v / top) * U16_MAX)) for v in values]


def max_upscale_u16(values: Sequence[float]) -> list[int]:
    """The chain's max-upscale of a submitted row: round(v * 65535 / max(v)), ties away from zero.

    A ValueError for an empty, non-finite, negative or all-zero row."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError("weights must be a non-empty list of numbers")
    if not np.all(np.isfinite(v)):
        raise ValueError("weights must be finite numbers (no NaN or infinity)")
    if np.any(v < 0):
        raise ValueError("weights must be non-negative")
    top = v.max()
    if top == 0:
        raise ValueError("weights are all zero; give at least one positive weight")
    scaled = v * U16_MAX / top
    whole = np.floor(scaled)
    rounded = whole + (scaled - whole >= 0.5)  # half rounds up: away from zero, all values being >= 0
    return [int(w) for w in np.clip(rounded, 0, U16_MAX)]


def conform(
    weights: Mapping | Iterable,
    own_uid: int | None,
    max_weight_limit: float = 1.0,
    keep_zeros: bool = False,
) -> ConformedRow:
    """Steps 1-3: the u16 row submitted for `weights` by the validator with uid `own_uid`.

    `max_weight_limit` is a fraction (1.0 = disabled). With keep_zeros=False (the SDK) entries that
    quantise to 0 are dropped and an all-zero row is a WeightsError; with keep_zeros=True (the devnet)
    every entry given stays, zeros included.
    """
    pairs = validated_pairs(weights)
    uids = [uid for uid, _ in pairs]
    values = [w for _, w in pairs]
    self_only = own_uid is not None and uids == [own_uid]
    if not any(v > 0 for v in values):
        if not keep_zeros or not values:
            raise WeightsError("weights are all zero; give at least one positive weight")
        return ConformedRow(tuple(uids), tuple(0 for _ in values), self_only)
    if not self_only and max_weight_limit < 1.0:
        values = clip_to_max_weight(values, max_weight_limit)
    row = quantize(values)
    if not keep_zeros:
        kept = [(uid, w) for uid, w in zip(uids, row) if w != 0]
        uids, row = [uid for uid, _ in kept], [w for _, w in kept]
    return ConformedRow(tuple(uids), tuple(row), self_only)


def too_few_weights(count: int, min_allowed_weights: int, subnet_n: int, self_weight_only: bool) -> bool:
    """Subtensor's WeightVecLengthIsLow: fewer than min(min_allowed_weights, n) entries, explicit zeros
    counting, unless the row is a lone self-weight."""
    return not self_weight_only and count < min(min_allowed_weights, subnet_n)


def exceeds_max_weight(row: Sequence[int], max_weight_limit_u16: int, self_weight_only: bool) -> bool:
    """Subtensor's MaxWeightExceeded: the row's largest share max/sum is above limit/65535
    (check_vec_max_limited; a lone self-weight and a disabled limit, 65535, are exempt)."""
    if self_weight_only or max_weight_limit_u16 >= U16_MAX or not row:
        return False
    total = sum(row)
    if total == 0:
        return False
    return max(row) * U16_MAX > max_weight_limit_u16 * total
