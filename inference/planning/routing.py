"""Routing statistics: how often each expert is selected and which experts are selected together.

A planning input (`inference.planning.planner` reads them as `RoutingStats`). `RoutingRecorder` observes any
model that routes (`routing_observer`): the single-process `KimiK3Model` or a shard of the sharded runtime,
whose driver gathers every home rank's recorder and merges them (`merge_routing_stats`).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from inference.planning.plan import LayerRouting, RoutingStats


class RoutingRecorder:
    """Counts, per MoE layer, how often each expert is selected and how often pairs are selected together.

    Plug it into any model with `routing_observer` (the single-process KimiK3Model or a shard):
        recorder = RoutingRecorder.attach(model); ...; recorder.save("routing.json")
    Co-activation is a dense E x E matrix for small E and a sparse counter above DENSE_MAX_EXPERTS (K3's
    896 experts over 92 layers would need 590 MB dense).
    """

    DENSE_MAX_EXPERTS = 256

    def __init__(self, num_experts: int, experts_per_token: int):
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.reset()

    @classmethod
    def attach(cls, model) -> "RoutingRecorder":
        recorder = cls(model.config.num_experts, model.config.experts_per_token)
        model.routing_observer = recorder.observe
        return recorder

    def reset(self) -> None:
        self._tokens: dict[int, int] = {}
        self._load: dict[int, np.ndarray] = {}
        self._dense: dict[int, np.ndarray] = {}  # flat [E * E], index i * E + j with i < j
        self._sparse: dict[int, dict[int, int]] = {}

    def observe(self, layer: int, expert_ids: Tensor) -> None:
        ids = expert_ids.detach().to("cpu", torch.long).numpy()
        T, k = ids.shape
        E = self.num_experts
        self._tokens[layer] = self._tokens.get(layer, 0) + T
        load = self._load.setdefault(layer, np.zeros(E, dtype=np.int64))
        np.add.at(load, ids.ravel(), 1)
        if k < 2 or T == 0:
            return
        s = np.sort(ids, axis=1)
        a, b = np.triu_indices(k, 1)
        codes = (s[:, a] * E + s[:, b]).ravel()
        if E <= self.DENSE_MAX_EXPERTS:
            np.add.at(self._dense.setdefault(layer, np.zeros(E * E, dtype=np.int64)), codes, 1)
        else:
            counter = self._sparse.setdefault(layer, {})
            uniq, counts = np.unique(codes, return_counts=True)
            for c, n in zip(uniq.tolist(), counts.tolist()):
                counter[c] = counter.get(c, 0) + n

    def to_stats(self) -> RoutingStats:
        E = self.num_experts
        layers = {}
        for layer, tokens in self._tokens.items():
            if layer in self._dense:
                codes = np.flatnonzero(self._dense[layer])
                counts = self._dense[layer][codes]
            else:
                counter = self._sparse.get(layer, {})
                codes = np.fromiter(sorted(counter), dtype=np.int64, count=len(counter))
                counts = np.fromiter((counter[c] for c in codes.tolist()), dtype=np.int64, count=len(counter))
            layers[layer] = LayerRouting(tokens, self._load[layer].copy(), codes // E, codes % E, counts)
        return RoutingStats(E, self.experts_per_token, layers)

    def save(self, path) -> RoutingStats:
        stats = self.to_stats()
        stats.save(path)
        return stats


def merge_routing_stats(parts: list[RoutingStats]) -> RoutingStats:
    """Statistics of several ranks as one (ranks record disjoint layers; overlapping layers are summed)."""
    E, k = parts[0].num_experts, parts[0].experts_per_token
    merged: dict[int, LayerRouting] = {}
    for part in parts:
        for layer, rec in part.layers.items():
            old = merged.get(layer)
            if old is None:
                merged[layer] = rec
                continue
            pairs: dict[int, int] = {}
            for r in (old, rec):
                for i, j, c in zip(r.pair_i.tolist(), r.pair_j.tolist(), r.pair_count.tolist()):
                    pairs[i * E + j] = pairs.get(i * E + j, 0) + c
            codes = np.fromiter(sorted(pairs), dtype=np.int64, count=len(pairs))
            counts = np.fromiter((pairs[c] for c in codes.tolist()), dtype=np.int64, count=len(pairs))
            merged[layer] = LayerRouting(old.tokens + rec.tokens, old.load + rec.load, codes // E, codes % E, counts)
    return RoutingStats(E, k, dict(sorted(merged.items())))


__all__ = ["RoutingRecorder", "merge_routing_stats"]
