"""Placement planner: a model and a cluster in, a plan and a predicted-performance report out.

docs/engine.md section 3. Steps:
1. Candidate device groupings (one stage per host, several hosts per stage, hosts split in
   parts, one stage over everything); each stage gets a contiguous run of layers sized to
   its memory.
2. Home devices: each stage's layers go in contiguous runs onto as few devices as hold
   them within `home_memory_fraction` of usable memory (fewer home changes, fewer hops).
3. Expert slots: what is left on every device after homes, reservations, buffers and
   headroom, water-filled so devices hold equal slot counts where they can; every expert
   once, spare slots (up to `max_replicas_per_layer`) for replicas.
4. EPLB per layer: replicate the expert with the highest load per copy into the spare
   slots, then pack copies heaviest first onto the lightest device with a free slot.
5. Pick the grouping the cost model predicts fastest for one stream (ties: throughput).
6. Local improvement with measured co-activation: swap expert copies between devices of a
   stage when the cost model predicts a gain (co-activated experts together cut messages,
   apart spread reads; the model decides).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inference.model import ModelConfig
from inference.model.files import read_document
from inference.planning.cost_model import BREAKDOWN_KEYS, CostModel, CostParams, selection_count_pmf
from inference.planning.plan import (Device, Link, Links, MemoryPolicy, Plan, PlanError, PlannedStage, RoutingStats,
                                     buffer_bytes, compute_memory, embedding_bytes, kda_reserve_per_layer,
                                     layer_weights, lm_head_bytes, mla_reserve_per_layer)


class ClusterError(ValueError):
    """A cluster description that cannot be used."""


class PlanDoesNotFit(Exception):
    """No grouping of the cluster holds the model at the target load."""

    def __init__(self, message: str, overflows: list[dict]):
        super().__init__(message)
        self.overflows = overflows  # [{rank, host, kind, needed, capacity, overflow}], worst first


# ============================================================== cluster files
_UNITS = {
    "bytes": {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
              "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40},
    "bandwidth": {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
                  "gib/s": 2 ** 30, "gbit/s": 1e9 / 8, "gbps": 1e9 / 8},
    "time": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9},
    "power": {"w": 1, "kw": 1e3},
    "flops": {"flops": 1, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15},
}


def parse_quantity(value, kind: str, where: str) -> float:
    """A number in SI base units, or a string like '32 GB', '1792 GB/s', '15 us', '575 W'."""
    if isinstance(value, bool):
        raise ClusterError(f"{where}: expected a {kind} quantity, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*", value)
        if not m:
            raise ClusterError(f"{where}: cannot read {value!r} as a {kind} quantity")
        unit = m.group(2).lower()
        factors = _UNITS[kind]
        if unit and unit not in factors:
            raise ClusterError(f"{where}: unknown unit {m.group(2)!r} for {kind}; use one of {sorted(factors)}")
        out = float(m.group(1)) * (factors[unit] if unit else 1.0)
    else:
        raise ClusterError(f"{where}: expected a {kind} quantity, got {value!r}")
    if out < 0 or not math.isfinite(out):
        raise ClusterError(f"{where}: {value!r} must be a finite non-negative {kind}")
    return out


@dataclass
class Cluster:
    name: str
    devices: list[Device]
    links: Links
    description: str = ""
    cost_params: dict = field(default_factory=dict)  # overrides of CostParams for this cluster
    memory_policy: dict = field(default_factory=dict)  # overrides of MemoryPolicy

    @property
    def hosts(self) -> list[str]:
        out: list[str] = []
        for d in self.devices:
            if d.host not in out:
                out.append(d.host)
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        return cls.from_dict(read_document(path, ClusterError, "cluster", yaml_format=True), source=str(path))

    @classmethod
    def from_dict(cls, data, source: str = "cluster") -> "Cluster":
        if not isinstance(data, dict):
            raise ClusterError(f"{source}: expected a mapping at the top level")
        for key in ("name", "device_kinds", "hosts", "links"):
            if key not in data:
                raise ClusterError(f"{source}: missing '{key}'")
        kinds = {}
        if not isinstance(data["device_kinds"], dict) or not data["device_kinds"]:
            raise ClusterError(f"{source}: device_kinds must map a kind name to its figures")
        for kind, spec in data["device_kinds"].items():
            w = f"{source}: device_kinds.{kind}"
            if not isinstance(spec, dict):
                raise ClusterError(f"{w} must be a mapping")
            missing = {"memory", "mem_bandwidth", "flops", "power"} - set(spec)
            if missing:
                raise ClusterError(f"{w} is missing {sorted(missing)}")
            kinds[kind] = dict(
                memory_bytes=int(parse_quantity(spec["memory"], "bytes", f"{w}.memory")),
                mem_bandwidth=parse_quantity(spec["mem_bandwidth"], "bandwidth", f"{w}.mem_bandwidth"),
                flops=parse_quantity(spec["flops"], "flops", f"{w}.flops"),
                power_w=parse_quantity(spec["power"], "power", f"{w}.power"),
            )
            if kinds[kind]["memory_bytes"] <= 0 or kinds[kind]["mem_bandwidth"] <= 0 or kinds[kind]["flops"] <= 0:
                raise ClusterError(f"{w}: memory, mem_bandwidth and flops must be > 0")
        devices: list[Device] = []
        if not isinstance(data["hosts"], list) or not data["hosts"]:
            raise ClusterError(f"{source}: hosts must be a non-empty list")
        host_names = set()
        for i, host in enumerate(data["hosts"]):
            w = f"{source}: hosts[{i}]"
            if not isinstance(host, dict) or "name" not in host or not isinstance(host.get("devices"), dict):
                raise ClusterError(f"{w} needs a name and devices: {{kind: count}}")
            repeat = host.get("repeat", 1)
            if not isinstance(repeat, int) or repeat < 1:
                raise ClusterError(f"{w}.repeat must be a positive integer")
            for j in range(repeat):
                name = f"{host['name']}{j}" if "repeat" in host else str(host["name"])
                if name in host_names:
                    raise ClusterError(f"{w}: host name {name!r} appears twice")
                host_names.add(name)
                for kind, count in host["devices"].items():
                    if kind not in kinds:
                        raise ClusterError(f"{w}: unknown device kind {kind!r}; declared: {sorted(kinds)}")
                    if not isinstance(count, int) or count < 1:
                        raise ClusterError(f"{w}: device count for {kind!r} must be a positive integer")
                    for _ in range(count):
                        devices.append(Device(rank=len(devices), host=name, kind=kind, **kinds[kind]))
        links_d = data["links"]
        if not isinstance(links_d, dict) or "intra_host" not in links_d:
            raise ClusterError(f"{source}: links needs intra_host (and inter_host for several hosts)")

        def link(name: str) -> Link:
            d = links_d[name]
            w = f"{source}: links.{name}"
            if not isinstance(d, dict) or "bandwidth" not in d or "latency" not in d:
                raise ClusterError(f"{w} needs bandwidth and latency")
            bw = parse_quantity(d["bandwidth"], "bandwidth", f"{w}.bandwidth")
            if bw <= 0:
                raise ClusterError(f"{w}.bandwidth must be > 0")
            per_peer = d.get("per_peer", False)
            if not isinstance(per_peer, bool):
                raise ClusterError(f"{w}.per_peer must be true or false")
            return Link(bandwidth=bw, latency=parse_quantity(d["latency"], "time", f"{w}.latency"),
                        kind=str(d.get("kind", name)), per_peer=per_peer)

        intra = link("intra_host")
        if "inter_host" in links_d:
            inter = link("inter_host")
        elif len(host_names) > 1:
            raise ClusterError(f"{source}: several hosts but no links.inter_host")
        else:
            inter = intra
        cost = data.get("cost_params") or {}
        policy = data.get("memory_policy") or {}
        try:
            CostParams().with_overrides(cost)
            MemoryPolicy(**policy)
        except (TypeError, ValueError) as exc:
            raise ClusterError(f"{source}: cost_params / memory_policy: {exc}") from None
        return cls(name=str(data["name"]), devices=devices, links=Links(intra, inter),
                   description=str(data.get("description", "")).strip(), cost_params=cost, memory_policy=policy)


# ============================================================== options and report
@dataclass(frozen=True)
class PlannerOptions:
    max_replicas_per_layer: int | None = None  # None: num_experts // 8 (EPLB's 32 per 256)
    home_memory_fraction: float = 0.5  # of a device's usable memory that layer homes may take
    improve: bool = True  # local improvement (only with co-activation statistics)
    improve_pairs_per_layer: int = 32  # most co-activated pairs examined per layer
    improve_time_budget_s: float = 10.0
    objective: str = "latency"  # "latency": fastest single stream; "throughput": at target concurrency
    stages: int | None = None  # only consider groupings with this many stages
    # Split each layer's dense work (and the LM head) over this many devices of its home's host (Plan.dense_groups)
    # and hold the dense weights in this dtype ("bf16" | "fp8"); applied to the chosen layout.
    dense_split: int = 1
    dense_dtype: str = "bf16"


@dataclass
class Report:
    model_id: str
    cluster: str
    devices: int
    hosts: int
    device_kinds: list[str]
    total_power_w: float
    target_concurrency: int
    context: int
    stages: list[dict]
    memory: list[dict]
    single_stream: dict
    throughput: list[dict]
    ttft: dict
    to_reach: dict
    candidates: list[dict]
    params: dict
    planning_seconds: float = 0.0

    def summary(self) -> dict:
        """The key numbers, stored in the plan file's `prediction`."""
        return {
            "seconds_per_token": self.single_stream["seconds_per_token"],
            "tokens_per_s_single_stream": self.single_stream["tokens_per_s"],
            "breakdown_s": self.single_stream["breakdown_s"],
            "throughput_tokens_per_s": {str(t["concurrency"]): t["tokens_per_s"] for t in self.throughput},
            "tokens_per_joule": {str(t["concurrency"]): t["tokens_per_joule"] for t in self.throughput},
            "ttft_s": {str(self.ttft["prompt_tokens"]): self.ttft["seconds"]},
            "context": self.context,
            "power_w": self.total_power_w,
            "power_note": "tokens per joule count every device at full board power",
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_markdown(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
        ss = self.single_stream
        lines = [
            f"## {self.model_id} on {self.cluster}",
            "",
            f"{self.devices} x {'/'.join(self.device_kinds)} on {self.hosts} host(s), "
            f"{self.total_power_w / 1e3:.1f} kW at full board power; reservations for "
            f"{self.target_concurrency} sequences of {self.context} tokens; planned in {self.planning_seconds:.1f} s.",
            "",
            "| prediction | value |",
            "|---|---|",
            f"| time per output token, one stream | {ms(ss['seconds_per_token'])} ms |",
            f"| tokens/s, one stream | {ss['tokens_per_s']:.2f} |",
        ]
        for t in self.throughput:
            flag = "" if t["within_reservation"] else " (beyond the reserved load)"
            lines.append(f"| aggregate tokens/s at concurrency {t['concurrency']} | {t['tokens_per_s']:.1f}{flag} |")
        for t in self.throughput:
            tpj = "-" if t["tokens_per_joule"] is None else f"{t['tokens_per_joule']:.3g}"
            lines.append(f"| tokens per joule at concurrency {t['concurrency']} (full board power) | {tpj} |")
        lines.append(f"| TTFT, {self.ttft['prompt_tokens']}-token prompt | {self.ttft['seconds']:.3g} s "
                     f"({self.ttft['chunks']} chunks of {self.ttft['chunk_tokens']}"
                     f"{', compute-bound' if self.ttft['compute_bound'] else ', memory-bound'}) |")
        lines += ["", "Time per token, one stream (ms):", "", "| " + " | ".join(BREAKDOWN_KEYS) + " | total |",
                  "|" + "---|" * (len(BREAKDOWN_KEYS) + 1),
                  "| " + " | ".join(ms(ss["breakdown_s"][k]) for k in BREAKDOWN_KEYS)
                  + f" | {ms(ss['seconds_per_token'])} |", ""]
        lines += ["Stages:", "", "| stage | layers [first, end) | ranks | hosts | home devices | replicas |",
                  "|---|---|---|---|---|---|"]
        for s in self.stages:
            lines.append(f"| {s['index']} | [{s['layers'][0]}, {s['layers'][1]}) | {_ranges(s['ranks'])} | "
                         f"{', '.join(s['hosts'])} | {s['home_devices']} | {s['replicas']} |")
        lines += ["", "Memory per device (GB; tightest first, at most 8 shown):", "",
                  "| rank | host | dense | experts | KDA state | MLA cache | buffers | headroom | total | capacity | free |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in sorted(self.memory, key=lambda m: m["free"])[:8]:
            lines.append("| " + " | ".join([str(m["rank"]), m["host"]] + [
                f"{m[k] / 1e9:.2f}" for k in ("weights_dense", "weights_experts", "kda_state", "mla_cache",
                                             "buffers", "headroom", "total", "capacity", "free")]) + " |")
        tr = self.to_reach
        lines += ["", f"To reach {tr['target_tokens_per_s']:g} tokens/s for one stream "
                      f"(budget {ms(tr['budget_s'])} ms per token; predicted now {tr['predicted_tokens_per_s']:.2f}):", ""]
        lines.append(f"- memory bandwidth: {tr['bandwidth']['note']}")
        for o in tr["options"]:
            lines.append(f"- {o['option']}: {o['tokens_per_s']:.2f} tokens/s "
                         f"({'reaches' if o['reaches'] else 'does not reach'} it; {o['detail']})")
        lines += ["", "Groupings considered (co-activation not used for this comparison):", "",
                  f"| grouping | stages | fits | tokens/s one stream | tokens/s at concurrency "
                  f"{self.target_concurrency} | note |", "|---|---|---|---|---|---|"]
        for c in self.candidates:
            tps = f"{c['tokens_per_s']:.2f}" if c.get("tokens_per_s") else "-"
            thr = f"{c['tokens_per_s_at_target']:.1f}" if c.get("tokens_per_s_at_target") else "-"
            lines.append(f"| {c['grouping']} | {c['stages']} | {'yes' if c['fits'] else 'no'} | {tps} | {thr} | "
                         f"{c.get('note', '')} |")
        return "\n".join(lines) + "\n"


def _plain(value):
    """Numbers as Python floats/ints all the way down, so YAML and JSON can write them."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# ============================================================== groupings and layers
def device_groupings(cluster: Cluster, num_layers: int) -> list[tuple[str, list[list[int]]]]:
    """Candidate stage device groups: contiguous ranks, never a stage's devices split oddly."""
    by_host: dict[str, list[int]] = {}
    for d in cluster.devices:
        by_host.setdefault(d.host, []).append(d.rank)
    hosts = list(by_host.values())
    H = len(hosts)
    out: list[tuple[str, list[list[int]]]] = []
    for m in _divisors(H):
        groups = [sum(hosts[i:i + m], []) for i in range(0, H, m)]
        label = "one stage over all devices" if m == H else f"{m} host{'s' if m > 1 else ''} per stage"
        out.append((label, groups))
    sizes = {len(h) for h in hosts}
    if len(sizes) == 1:
        g = sizes.pop()
        for n in _divisors(g):
            if n > 1:
                groups = [h[i:i + g // n] for h in hosts for i in range(0, g, g // n)]
                out.append((f"{g // n} device{'s' if g // n > 1 else ''} per stage", groups))
    seen, unique = set(), []
    for label, groups in out:
        key = tuple(map(tuple, groups))
        if key not in seen and len(groups) <= num_layers:
            seen.add(key)
            unique.append((label, groups))
    return unique


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _split_layers(demand: list[float], usable: list[float]) -> list[tuple[int, int]] | None:
    """Contiguous layer runs, one per stage, minimising the largest demand/usable ratio."""
    L, S = len(demand), len(usable)
    if S > L:
        return None
    usable = [max(u, 1.0) for u in usable]  # a group with no usable memory still gets layers (and overflows)

    def runs(limit: float):
        out, start = [], 0
        for s in range(S):
            left_stages = S - s - 1
            end, acc = start, 0.0
            while end < L - left_stages and (end == start or acc + demand[end] <= limit * usable[s]):
                acc += demand[end]
                end += 1
            if s == S - 1:
                if end < L:
                    return None
            out.append((start, end))
            start = end
        return out

    lo, hi = 0.0, max(sum(demand) / min(usable), 1.0) * 2
    best = runs(hi)  # at this limit any stage could take every layer, so it always succeeds
    for _ in range(50):
        mid = (lo + hi) / 2
        r = runs(mid)
        if r is None:
            lo = mid
        else:
            hi, best = mid, r
    return best


def _home_runs(layers: list[int], demand: list[float], caps: list[float]) -> list[int]:
    """Device index (within the stage) of each layer's home: contiguous runs filling devices in
    order up to their cap, so as few devices as possible take homes (fewer home changes).
    If that does not work, runs balanced over every device (the fit check names any overflow)."""
    owner, dev, acc = [], 0, 0.0
    for need in demand:
        if acc > 0 and acc + need > caps[dev]:
            dev, acc = dev + 1, 0.0
        if dev >= len(caps) or need > caps[dev]:
            break
        owner.append(dev)
        acc += need
    if len(owner) == len(layers):
        return owner
    n = min(len(caps), len(layers))
    runs = _split_layers(demand, [1.0] * n) or [(i, i + 1) for i in range(n)]
    owner = []
    for dev, (a, b) in enumerate(runs):
        owner += [dev] * (b - a)
    return owner


# ============================================================== expert placement
def _water_fill(room: list[int], total: int) -> list[int]:
    """Integer slots per device summing to `total`, as equal as `room` caps allow."""
    G = len(room)
    if total > sum(room):
        raise ValueError("not enough room")
    lo, hi = 0, max(room) if room else 0
    while lo < hi:  # smallest level whose capped sum reaches total
        mid = (lo + hi) // 2
        if sum(min(r, mid) for r in room) >= total:
            hi = mid
        else:
            lo = mid + 1
    t = [min(r, lo - 1) if lo > 0 else 0 for r in room]
    extra = total - sum(t)
    for d in range(G):
        if extra == 0:
            break
        if t[d] < room[d]:
            t[d] += 1
            extra -= 1
    return t


def _slot_matrix(row_totals: list[int], col_totals: list[int], cell_cap: int) -> np.ndarray:
    """Integer matrix with the given row and column sums, proportional, cells <= cell_cap."""
    R, C = len(row_totals), len(col_totals)
    T = sum(col_totals)
    if sum(row_totals) != T:
        raise ValueError("row and column totals differ")
    rows = np.array(row_totals, dtype=float)
    cols = np.array(col_totals, dtype=float)
    n = np.minimum(np.floor(rows[:, None] * cols[None, :] / max(T, 1)), cell_cap).astype(np.int64)
    row_def = np.array(row_totals) - n.sum(axis=1)
    col_slack = np.array(col_totals) - n.sum(axis=0)
    for r in range(R):
        while row_def[r] > 0:
            order = np.argsort(-col_slack, kind="stable")
            placed = False
            for c in order:
                if col_slack[c] <= 0:
                    break
                if n[r, c] < cell_cap:
                    n[r, c] += 1
                    col_slack[c] -= 1
                    row_def[r] -= 1
                    placed = True
                    break
            if not placed:
                raise ValueError("cannot distribute expert slots")
    return n


def eplb_layer(load: np.ndarray, slots_per_device: list[int], replicas: int) -> list[list[int]]:
    """EPLB for one layer: replicate by load per copy, then pack heaviest copy onto lightest device.

    Returns, per expert, the device indices holding a copy (first placed = primary).
    """
    E, G = len(load), len(slots_per_device)
    copies = np.ones(E, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(replicas):
        while True:
            neg, e = heapq.heappop(heap)
            if copies[e] < G:
                break
        copies[e] += 1
        heapq.heappush(heap, (-float(load[e]) / copies[e], e))
    per_copy = load / copies
    order = sorted(range(E), key=lambda e: (-per_copy[e], e))
    holders: list[list[int]] = [[] for _ in range(E)]
    free = list(slots_per_device)
    dev_load = [0.0] * G
    dev_heap = [(0.0, d) for d in range(G) if free[d] > 0]
    heapq.heapify(dev_heap)
    for e in order:
        for _ in range(int(copies[e])):
            skipped, chosen = [], None
            while dev_heap:
                ld, d = heapq.heappop(dev_heap)
                if ld != dev_load[d] or free[d] <= 0:
                    continue  # stale entry
                if d in holders[e]:
                    skipped.append((ld, d))
                    continue
                chosen = d
                break
            for item in skipped:
                heapq.heappush(dev_heap, item)
            if chosen is None:
                chosen = _make_room(e, holders, free, G)
            holders[e].append(chosen)
            free[chosen] -= 1
            dev_load[chosen] += float(per_copy[e])
            if free[chosen] > 0:
                heapq.heappush(dev_heap, (dev_load[chosen], chosen))
    return holders


def _make_room(e: int, holders: list[list[int]], free: list[int], G: int) -> int:
    """Every device with a free slot already holds e: move another expert f into that slot."""
    d_free = next(d for d in range(G) if free[d] > 0)
    for f, hs in enumerate(holders):
        for d2 in hs:
            if d2 != d_free and d2 not in holders[e] and d_free not in hs:
                hs[hs.index(d2)] = d_free
                free[d_free] -= 1
                free[d2] += 1
                return d2
    raise PlanError(f"cannot place every copy of expert {e}: too few devices in the stage")


# ============================================================== one candidate
@dataclass
class _Candidate:
    label: str
    plan: Plan | None
    overflows: list[dict]
    token_time: float | None = None  # single stream, seconds per token
    throughput: float | None = None  # tokens/s at the target concurrency
    note: str = ""


def _build_candidate(config: ModelConfig, cluster: Cluster, label: str, groups: list[list[int]],
                     concurrency: int, context: int, policy: MemoryPolicy, options: PlannerOptions,
                     loads: dict[int, np.ndarray], preset: str | None,
                     runs: list[tuple[int, int]] | None = None) -> _Candidate:
    """One grouping's plan; `runs` fixes each stage's layers [start, end) (default: split by memory)."""
    devices = cluster.devices
    L, E, eb = config.num_layers, config.num_experts, config.expert_bytes()
    kda_l = kda_reserve_per_layer(config, concurrency)
    mla_l = mla_reserve_per_layer(config, concurrency, context, policy.cache_dtype_bytes)

    def home_demand(layer: int) -> float:
        d = layer_weights(config, layer).total_bytes + (mla_l if config.is_mla(layer) else kda_l)
        if layer == 0:
            d += embedding_bytes(config)
        if layer == L - 1:
            d += lm_head_bytes(config)
        return float(d)

    homes_demand = [home_demand(layer) for layer in range(L)]
    demand = [homes_demand[layer] + (E * eb if config.is_moe(layer) else 0) for layer in range(L)]
    usable_dev = [d.memory_bytes * (1 - policy.headroom_fraction) - buffer_bytes(config, [0, 1], True, policy)
                  for d in devices]
    usable = [sum(usable_dev[r] for r in g) for g in groups]
    runs = runs or _split_layers(demand, usable)
    if runs is None:
        return _Candidate(label, None, [], note="more stages than layers")
    stages = [PlannedStage(i, a, b, tuple(g)) for i, ((a, b), g) in enumerate(zip(runs, groups))]
    layer_home = [0] * L
    for st in stages:
        layers = list(st.layers)
        caps = [options.home_memory_fraction * usable_dev[r] for r in st.ranks]
        owner = _home_runs(layers, [homes_demand[layer] for layer in layers], caps)
        for layer, o in zip(layers, owner):
            layer_home[layer] = st.ranks[o]
    embedding_rank, lm_head_rank = layer_home[0], layer_home[L - 1]
    # memory without experts tells each device's room for expert slots
    bare = compute_memory(config, devices, layer_home, {}, embedding_rank, lm_head_rank, concurrency, context,
                          policy)
    placement: dict[int, list[list[int]]] = {}
    max_rep = options.max_replicas_per_layer if options.max_replicas_per_layer is not None else E // 8
    short: list[tuple[PlannedStage, int]] = []
    uniform_layouts: dict[tuple, list[list[int]]] = {}  # without statistics, equal rows give equal layouts
    for st in stages:
        moe = [layer for layer in st.layers if config.is_moe(layer)]
        if not moe:
            continue
        G = len(st.ranks)
        room = []
        for r in st.ranks:
            homed = [layer for layer in range(L) if layer_home[layer] == r]
            extra_buf = buffer_bytes(config, homed, True, policy) - bare[r].buffers
            room.append(max(0, int((bare[r].free - extra_buf) // eb)))
        room = [min(x, len(moe) * E) for x in room]
        need = len(moe) * E
        if sum(room) < need:
            short.append((st, need - sum(room)))
            # still lay experts out evenly, without replicas, so the overflow can be named per device
            room = [len(moe) * E] * G
            replicas_total = 0
        else:
            replicas_total = min(sum(room) - need, len(moe) * min(max_rep, E * (G - 1)))
        total = need + replicas_total
        per_device = _water_fill(room, total)
        rows = [E + replicas_total // len(moe) + (1 if i < replicas_total % len(moe) else 0)
                for i in range(len(moe))]
        matrix = _slot_matrix(rows, per_device, E)
        for i, layer in enumerate(moe):
            slots = [int(x) for x in matrix[i]]
            load = loads.get(layer)
            if load is None:
                key = (tuple(slots), rows[i])
                if key not in uniform_layouts:
                    uniform_layouts[key] = eplb_layer(np.ones(E), slots, rows[i] - E)
                held = uniform_layouts[key]
            else:
                held = eplb_layer(load, slots, rows[i] - E)
            placement[layer] = [[st.ranks[d] for d in h] for h in held]
    memory = compute_memory(config, devices, layer_home, placement, embedding_rank, lm_head_rank, concurrency,
                            context, policy)
    overflows = [
        {"rank": m.rank, "host": devices[m.rank].host, "kind": devices[m.rank].kind, "needed": m.total,
         "capacity": m.capacity, "overflow": m.total - m.capacity}
        for m in memory if m.total > m.capacity
    ]
    overflows.sort(key=lambda o: -o["overflow"])
    plan = Plan(
        config_hash=config.config_hash(), hf_config=config.to_hf_config(), preset=preset, devices=list(devices),
        links=cluster.links, stages=stages, layer_home=layer_home, expert_placement=placement,
        embedding_rank=embedding_rank, lm_head_rank=lm_head_rank, concurrency=concurrency, context=context,
        memory=memory, memory_policy=policy, cluster_name=cluster.name,
    )
    note = ""
    if short:
        st, missing = short[0]
        note = (f"stage {st.index} (layers [{st.first_layer}, {st.end_layer})) lacks room for "
                f"{missing} expert copies ({missing * eb / 1e9:.1f} GB)")
    return _Candidate(label, plan, overflows, note=note)


# ============================================================== local improvement
def improve_placement(model: CostModel, plan: Plan, routing: RoutingStats, options: PlannerOptions,
                      deadline: float) -> int:
    """Swap expert copies inside stages while the cost model predicts a gain. Returns swaps made."""
    b_batch = max(1, min(plan.concurrency, 64))
    swaps = 0
    for layer, holders in plan.expert_placement.items():
        rec = routing.layers.get(layer)
        if rec is None or not rec.has_coactivation or time.monotonic() > deadline:
            continue
        rl = model.routed[layer]
        G = len(rl.ranks)
        if G < 2:
            continue
        swaps += _improve_layer(model, layer, holders, rec, b_batch, options, deadline)
    return swaps


def _improve_layer(model: CostModel, layer: int, holders: list[list[int]], rec, b_batch: int,
                   options: PlannerOptions, deadline: float) -> int:
    rl = model.routed[layer]
    ranks, home, k = rl.ranks, rl.home, model.k
    G, E = len(ranks), len(holders)
    index = {int(r): i for i, r in enumerate(ranks)}
    p = rec.selection_probability()
    pi, pj, pp = rec.pair_i, rec.pair_j, rec.pair_probability()
    # co-activation neighbours of every expert (CSR) and A[e, d] = sum_f P(e, f) share(f, d)
    both_i, both_j, both_p = np.concatenate([pi, pj]), np.concatenate([pj, pi]), np.concatenate([pp, pp])
    order = np.lexsort((both_j, both_i))
    nb_i, nb_j, nb_p = both_i[order], both_j[order], both_p[order]
    starts = np.searchsorted(nb_i, np.arange(E + 1))
    copies = np.array([len(h) for h in holders])
    share = np.zeros((E, G))
    for e, h in enumerate(holders):
        for r in h:
            share[e, index[r]] = 1.0 / copies[e]
    A = np.zeros((E, G))
    for d in range(G):
        A[:, d] = np.bincount(nb_i, weights=nb_p * share[nb_j, d], minlength=E)
    mu = (p[:, None] * share).sum(axis=0)
    m2 = (share * A).sum(axis=0)
    _, _, shared1 = model._home_times(layer, 1, model.plan.context, False)
    _, _, shared_b = model._home_times(layer, b_batch, model.plan.context, False)

    def term(e: int, s: float) -> float:  # expected distinct hits of one copy in a batch
        return 1 - (1 - p[e] * s) ** b_batch

    distinct = np.zeros(G)
    for e, h in enumerate(holders):
        for r in h:
            distinct[index[r]] += term(e, 1.0 / copies[e])

    def objective(mu_, m2_, distinct_, pmf_) -> float:
        t1, _, _ = model.parallel_single(ranks, home, pmf_, shared1, components=False)
        if b_batch == 1:
            return t1
        tb, _, _ = model.parallel_batch(ranks, home, pmf_[:, 0], mu_, distinct_, b_batch, shared_b)
        return t1 + tb / b_batch

    pmf = selection_count_pmf(mu, m2, k)
    current = objective(mu, m2, distinct, pmf)

    def pair_p(a: int, b: int) -> float:
        lo, hi = starts[a], starts[a + 1]
        pos = lo + np.searchsorted(nb_j[lo:hi], b)
        return float(nb_p[pos]) if pos < hi and nb_j[pos] == b else 0.0

    def try_swap(ea: int, da: int, eb: int, db: int, apply: bool):
        """Move ea's copy da -> db and eb's copy db -> da; returns the new objective."""
        nonlocal current, pmf
        sa, sb = 1.0 / copies[ea], 1.0 / copies[eb]
        pab = pair_p(ea, eb)
        mu_ = mu.copy()
        m2_ = m2.copy()
        dist_ = distinct.copy()
        mu_[da] += p[eb] * sb - p[ea] * sa
        mu_[db] += p[ea] * sa - p[eb] * sb
        m2_[da] += -2 * sa * A[ea, da] + 2 * sb * (A[eb, da] - pab * sa)
        m2_[db] += -2 * sb * A[eb, db] + 2 * sa * (A[ea, db] - pab * sb)
        dist_[da] += term(eb, sb) - term(ea, sa)
        dist_[db] += term(ea, sa) - term(eb, sb)
        pmf_ = pmf.copy()
        pmf_[[da, db]] = selection_count_pmf(mu_[[da, db]], np.maximum(m2_[[da, db]], 0.0), k)
        value = objective(mu_, np.maximum(m2_, 0.0), dist_, pmf_)
        if apply:
            mu[:], m2[:], distinct[:] = mu_, np.maximum(m2_, 0.0), dist_
            pmf = pmf_
            for e, s, src, dst in ((ea, sa, da, db), (eb, sb, db, da)):
                lo, hi = starts[e], starts[e + 1]
                A[nb_j[lo:hi], src] -= nb_p[lo:hi] * s
                A[nb_j[lo:hi], dst] += nb_p[lo:hi] * s
                share[e, src], share[e, dst] = 0.0, s
                h = holders[e]
                h[h.index(int(ranks[src]))] = int(ranks[dst])
            current = value
        return value

    def on(e: int) -> list[int]:
        return [index[r] for r in holders[e]]

    top = np.argsort(-pp, kind="stable")[: options.improve_pairs_per_layer]
    swaps = 0
    for idx in top:
        if time.monotonic() > deadline:
            break
        a, b = int(pi[idx]), int(pj[idx])
        best = None
        da_all, db_all = on(a), on(b)
        together = set(da_all) & set(db_all)
        moves = []
        if not together:  # try bringing b next to a, and a next to b
            moves = [(b, db_all[0], da_all[0]), (a, da_all[0], db_all[0])]
        else:  # try moving b away, to one of the two least-loaded devices
            d = next(iter(together))
            lightest = [int(t) for t in np.argsort(mu) if t != d][:2]
            for dt in lightest:
                moves.append((b, d, dt))
        for x, dx, dt in moves:
            if dt in on(x):
                continue
            ok = (share[:, dt] > 0) & (share[:, dx] == 0)
            ok[[a, b]] = False
            cands = np.nonzero(ok)[0]
            if not len(cands):
                continue
            # partners least tied to where they are, relative to where they would go
            cands = cands[np.argsort(A[cands, dt] - A[cands, dx], kind="stable")].tolist()
            for c in cands[:2]:
                value = try_swap(x, dx, c, dt, apply=False)
                if value < current * (1 - 1e-9) and (best is None or value < best[0]):
                    best = (value, x, dx, c, dt)
        if best is not None:
            _, x, dx, c, dt = best
            try_swap(x, dx, c, dt, apply=True)
            swaps += 1
    return swaps


# ============================================================== the planner
def plan_cluster(
    config: ModelConfig,
    cluster: Cluster,
    concurrency: int,
    context: int,
    routing_stats: RoutingStats | None = None,
    *,
    params: CostParams | None = None,
    policy: MemoryPolicy | None = None,
    options: PlannerOptions | None = None,
    prompt_tokens: int = 8192,
    report_concurrency: tuple[int, ...] = (1, 8, 64),
    target_tokens_per_s: float = 20.0,
    preset: str | None = None,
) -> tuple[Plan, Report]:
    """Plan `config` on `cluster` for `concurrency` sequences of `context` tokens.

    Raises PlanDoesNotFit naming the overflowing devices when no grouping holds the model.
    """
    started = time.monotonic()
    if concurrency < 1 or context < 1:
        raise ValueError("concurrency and context must be >= 1")
    options = options or PlannerOptions()
    if options.objective not in ("latency", "throughput"):
        raise ValueError("objective must be 'latency' or 'throughput'")
    params = (params or CostParams()).with_overrides(cluster.cost_params)
    policy = policy or MemoryPolicy(**cluster.memory_policy)
    if routing_stats is not None:
        routing_stats.validate(config)
    loads = {}
    if routing_stats is not None:
        for layer, rec in routing_stats.layers.items():
            if rec.tokens > 0:
                loads[layer] = rec.load.astype(float) + 1e-9  # keep never-seen experts orderable
    candidates: list[_Candidate] = []
    groupings = device_groupings(cluster, config.num_layers)
    if options.stages is not None:
        groupings = [(label, groups) for label, groups in groupings if len(groups) == options.stages]
        if not groupings:
            raise ValueError(f"no grouping of {cluster.name} has {options.stages} stages")
    for label, groups in groupings:
        cand = _build_candidate(config, cluster, label, groups, concurrency, context, policy, options, loads,
                                preset)
        if cand.plan is not None and not cand.overflows and (options.dense_split > 1 or options.dense_dtype != "bf16"):
            try:
                cand.plan = cand.plan.with_dense_split(config, options.dense_split, options.dense_dtype)
            except PlanError as exc:
                cand.note = f"dense split x{options.dense_split}: {exc}"
                candidates.append(cand)
                continue
        if cand.plan is not None and not cand.overflows:
            # groupings are compared on load alone; co-activation refines the chosen one below
            model = CostModel(config, cand.plan, params, routing_stats, coactivation=False)
            cand.token_time = model.token_time(components=False).total
            cand.throughput = model.throughput(concurrency)["tokens_per_s"]
        candidates.append(cand)
    fitting = [c for c in candidates if c.token_time is not None]
    if not fitting:
        raise _does_not_fit(config, cluster, candidates, concurrency, context)
    if options.objective == "latency":  # fastest single stream; near-ties go to throughput
        best_time = min(c.token_time for c in fitting)
        chosen = max((c for c in fitting if c.token_time <= best_time * 1.01), key=lambda c: c.throughput)
    else:
        chosen = max(fitting, key=lambda c: c.throughput)
    plan = chosen.plan
    model = CostModel(config, plan, params, routing_stats)
    swaps = 0
    if options.improve and routing_stats is not None:
        swaps = improve_placement(model, plan, routing_stats, options,
                                  deadline=time.monotonic() + options.improve_time_budget_s)
        if swaps:
            plan.memory = compute_memory(config, plan.devices, plan.layer_home, plan.expert_placement,
                                         plan.embedding_rank, plan.lm_head_rank, concurrency, context, policy,
                                         plan.dense_groups, plan.lm_head_group, plan.dense_dtype)
            model = CostModel(config, plan, params, routing_stats)
    report = build_report(config, cluster, plan, model, candidates, chosen, prompt_tokens, report_concurrency,
                          target_tokens_per_s)
    report.params = dataclasses.asdict(params) | {"local_improvement_swaps": swaps}
    report.planning_seconds = time.monotonic() - started
    plan.prediction = report.summary()
    plan.validate(config)
    return plan, report


def build_report(config: ModelConfig, cluster: Cluster, plan: Plan, model: CostModel, candidates: list[_Candidate],
                 chosen: _Candidate | None, prompt_tokens: int, report_concurrency, target_tokens_per_s: float) -> Report:
    tt = model.token_time()
    power = model.total_power_w()
    stages = []
    for st in plan.stages:
        stages.append({
            "index": st.index, "layers": [st.first_layer, st.end_layer], "ranks": list(st.ranks),
            "hosts": sorted({plan.devices[r].host for r in st.ranks}, key=lambda h: (len(h), h)),
            "home_devices": len({plan.layer_home[layer] for layer in st.layers}),
            "replicas": sum(plan.replica_count(layer) for layer in st.layers if layer in plan.expert_placement),
        })
    memory = [m.to_dict() | {"host": plan.devices[m.rank].host} for m in plan.memory]
    cands = []
    for c in candidates:
        note = c.note
        if c.overflows:
            o = c.overflows[0]
            note = note or f"rank {o['rank']} overflows by {o['overflow'] / 1e9:.2f} GB"
        if c is chosen:
            note = ("chosen; " + note).strip("; ")
        cands.append({"grouping": c.label, "stages": len(c.plan.stages) if c.plan else None,
                      "fits": c.token_time is not None,
                      "tokens_per_s": (1 / c.token_time) if c.token_time else None,
                      "tokens_per_s_at_target": c.throughput, "note": note})
    return Report(**_plain(dict(
        model_id=config.model_id, cluster=cluster.name, devices=len(plan.devices), hosts=len(cluster.hosts),
        device_kinds=sorted({d.kind for d in plan.devices}), total_power_w=power,
        target_concurrency=plan.concurrency, context=plan.context, stages=stages, memory=memory,
        single_stream={"seconds_per_token": tt.total, "tokens_per_s": tt.tokens_per_s,
                       "tokens_per_joule": tt.tokens_per_s / power if power else None,
                       "breakdown_s": tt.breakdown,
                       "dense_bytes_per_token": model.dense_bytes_per_token()},
        throughput=[model.throughput(c) for c in report_concurrency],
        ttft=model.ttft(prompt_tokens),
        to_reach=model.to_reach(target_tokens_per_s),
        candidates=cands, params={},
    )))


def _does_not_fit(config: ModelConfig, cluster: Cluster, candidates: list[_Candidate], concurrency: int,
                  context: int) -> PlanDoesNotFit:
    with_layout = [c for c in candidates if c.plan is not None and c.overflows]
    capacity = sum(d.memory_bytes for d in cluster.devices)
    head = (f"{config.model_id} does not fit on {cluster.name} ({len(cluster.devices)} devices, "
            f"{capacity / 1e9:.1f} GB) for {concurrency} sequences of {context} tokens")
    if not with_layout:
        return PlanDoesNotFit(head + ": no grouping can hold it", [])
    best = min(with_layout, key=lambda c: (c.overflows[0]["overflow"], len(c.overflows)))
    parts = [f"rank {o['rank']} ({o['host']}, {o['kind']}) needs {o['needed'] / 1e9:.2f} GB of "
             f"{o['capacity'] / 1e9:.2f} GB: overflows by {o['overflow'] / 1e9:.2f} GB" for o in best.overflows[:5]]
    more = f" and {len(best.overflows) - 5} more devices" if len(best.overflows) > 5 else ""
    return PlanDoesNotFit(
        f"{head}. Closest grouping ({best.label}): " + "; ".join(parts) + more
        + (f". {best.note}" if best.note else ""),
        best.overflows,
    )


__all__ = ["plan_cluster", "Cluster", "ClusterError", "PlanDoesNotFit", "PlannerOptions", "Report",
           "parse_quantity", "device_groupings", "eplb_layer", "improve_placement", "build_report"]
