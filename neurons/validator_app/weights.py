"""The validator's weights policy: the weights it submits, from its scores.

Clipping to the subnet's max_weight_limit and u16 quantisation happen in one place only,
`chain.weights.conform`, inside every chain's set_weights (devnet and subtensor); the validator
hands over its normalised weights as they are.
"""
from __future__ import annotations

import math
from collections.abc import Mapping


def submitted_weights(weights: Mapping[int, float]) -> dict[int, float]:
    """Positive, finite weights normalised to sum 1 (empty when no miner carries weight)."""
    kept = {uid: float(w) for uid, w in weights.items() if w > 0 and math.isfinite(w)}
    total = sum(kept.values())
    return {uid: w / total for uid, w in kept.items()} if total > 0 else {}
