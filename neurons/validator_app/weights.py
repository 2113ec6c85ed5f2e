"""The validator's weights policy: the weights it submits, from its scores.

MERGE NOTE (issue 11): `conform_weights` clips to the subnet's max_weight_limit here because the
devnet on this branch refuses an over-limit row instead of clipping it. chain/weights.py (another
branch) becomes the one conformance place, used by the devnet and subtensor adapters' set_weights;
at merge, remove this function and the call in ValidatorLoop.set_weights (hand the normalised
weights to chain.set_weights as they are).
"""
from __future__ import annotations

import math
from collections.abc import Mapping


def conform_weights(weights: Mapping[int, float], max_weight_limit: float) -> dict[int, float]:
    """Positive weights only, normalised, with no weight above `max_weight_limit` of the total when
    enough uids carry weight to allow it (the excess goes to the others in proportion)."""
    kept = {uid: float(w) for uid, w in weights.items() if w > 0 and math.isfinite(w)}
    total = sum(kept.values())
    if total <= 0:
        return {}
    out = {uid: w / total for uid, w in kept.items()}
    if max_weight_limit >= 1.0 or len(out) * max_weight_limit < 1.0:
        return out
    for _ in range(len(out)):
        over = {uid for uid, w in out.items() if w > max_weight_limit + 1e-12}
        if not over:
            break
        excess = sum(out[uid] - max_weight_limit for uid in over)
        for uid in over:
            out[uid] = max_weight_limit
        rest = {uid: w for uid, w in out.items() if uid not in over and w < max_weight_limit}
        rest_total = sum(rest.values())
        if rest_total <= 0:
            break
        for uid, w in rest.items():
            out[uid] = w + excess * w / rest_total
    return out
