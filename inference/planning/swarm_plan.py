"""Swarm plans: which independent machine holds which contiguous layer block of one model.

A swarm is a route of stage miners, each an independent operator's machine (its own devices, joined to the
next stage by a WAN or LAN link). Planning one means choosing the cuts: where layer blocks start and end.
"""
from __future__ import annotations


def stage_blocks(num_layers: int, block_size: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous layer ranges [start, stop) covering 0..num_layers-1 as evenly as possible, cutting
    only at Attention Residuals block boundaries (multiples of `block_size`) while there are enough of them
    (a cut there carries no partial sum), else at even layer counts."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    boundaries = [b for b in range(block_size, num_layers, block_size)] if block_size > 0 else []
    if stages - 1 <= len(boundaries):
        cuts: list[int] = []
        for i in range(1, stages):
            target = i * num_layers / stages
            # the nearest free boundary after the last cut that leaves enough boundaries for the cuts still to come
            left = [b for b in boundaries if (not cuts or b > cuts[-1])
                    and sum(1 for c in boundaries if c > b) >= stages - 1 - i]
            cuts.append(min(left, key=lambda b: (abs(b - target), b)))
    else:
        cuts = [round(i * num_layers / stages) for i in range(1, stages)]
    edges = [0, *cuts, num_layers]
    return list(zip(edges[:-1], edges[1:]))
