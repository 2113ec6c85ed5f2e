"""Plan a model on a cluster: write the plan file and print the predicted-performance report.

    k3-plan --model kimi_k3 --cluster inference/planning/clusters/rtx5090_80.yaml \
        --concurrency 1,8,64 --context 32768 --prompt 8192 --out plan.yaml [--report report.md] [--json] \
        [--dense-split 2] [--dense-dtype fp8]

--model is a preset (kimi_k3, tiny, ...) or a config.json / checkpoint directory. --cluster is a YAML
file or the name of one shipped with the package (`k3-plan --list` shows them and the model presets). Reservations
(KDA state, MLA cache) are sized for the largest --concurrency; the report predicts each one.
Exit status 2 on bad input or when the model does not fit (the message names the device and
by how much it overflows).

    k3-plan swarm --model kimi_k3 --cluster swarm_rtx5090x8_wan --rtt-ms 10,30,50

plans a swarm instead: one layer block per host (an independent operator), cut at Attention Residuals block
boundaries when that fits (inference/planning/swarm_plan.py; `swarm --help` lists its options).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inference.model import ConfigError, ModelConfig
from inference.planning.cost_model import CostParams
from inference.planning.plan import DENSE_DTYPES, PlanError, RoutingStats
from inference.planning.planner import (Cluster, ClusterError, PlanDoesNotFit, PlannerOptions, parse_quantity,
                                        plan_cluster)
from inference.planning.swarm_plan import SwarmPlan, over_link, plan_swarm


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the shipped clusters and the model presets, then exit")
    ap.add_argument("--model", help="preset name or path to config.json / checkpoint directory (required)")
    ap.add_argument("--cluster", help="cluster description (YAML file), or the name of a shipped one (required): "
                    + ", ".join(shipped_clusters()))
    ap.add_argument("--concurrency", default="1,8,64", help="comma-separated stream counts to predict")
    ap.add_argument("--context", type=int, default=32768, help="tokens of context per sequence to reserve for")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt length for the TTFT prediction")
    ap.add_argument("--routing-stats", help="routing statistics JSON written by the runtime (RoutingStats)")
    ap.add_argument("--out", help="plan file to write (.yaml or .json)")
    ap.add_argument("--report", help="also write the Markdown report here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of Markdown")
    ap.add_argument("--target-tps", type=float, default=20.0, help="single-stream tokens/s to analyse")
    ap.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    ap.add_argument("--dense-split", type=int, default=1,
                    help="split each layer's attention, shared experts and the LM head over N devices of its host")
    ap.add_argument("--dense-dtype", choices=DENSE_DTYPES, default="bf16",
                    help="dense (non-expert) weights: bf16 as released, or fp8 e4m3 with per-channel scales")
    args = ap.parse_args(argv)
    if not args.list and not (args.model and args.cluster):
        ap.error("--model and --cluster are required (k3-plan --list shows the shipped clusters and model presets)")
    return args


CLUSTERS = Path(__file__).resolve().parent / "clusters"


def shipped_clusters() -> list[str]:
    """Names of the cluster files installed with the package (inference/planning/clusters/*.yaml)."""
    return sorted(p.stem for p in CLUSTERS.glob("*.yaml"))


def cluster_file(spec: str) -> Path:
    """A cluster file as given, or a shipped cluster's file by its name."""
    path = Path(spec)
    if path.exists():
        return path
    if spec in shipped_clusters():
        return CLUSTERS / f"{spec}.yaml"
    raise ClusterError(f"no cluster file at {spec} and no shipped cluster of that name "
                       f"(shipped: {', '.join(shipped_clusters())})")


def catalogue() -> str:
    """`k3-plan --list`: every shipped cluster (devices, memory, hosts) and every model preset (size)."""
    lines = ["clusters (--cluster NAME; files in inference/planning/clusters/):"]
    for name in shipped_clusters():
        cluster = Cluster.load(CLUSTERS / f"{name}.yaml")
        kinds = sorted({(d.kind, d.memory_bytes) for d in cluster.devices})
        devices = " + ".join(f"{sum(1 for d in cluster.devices if d.kind == k)} x {k} ({m / 1e9:g} GB)"
                             for k, m in kinds)
        total = sum(d.memory_bytes for d in cluster.devices)
        lines.append(f"  {name:<22} {devices}, {len(cluster.hosts)} host(s), {total / 1e9:,.0f} GB in all")
    lines.append("model presets (--model NAME; or a config.json / checkpoint directory):")
    seen = set()
    for name, make in ModelConfig.presets().items():
        config = make()
        if config.model_id in seen and "-" in name:  # kimi-k3 is kimi_k3 spelled with a dash
            continue
        seen.add(config.model_id)
        lines.append(f"  {name:<22} {config.model_id}: {config.num_parameters():,} parameters, "
                     f"{_size(config.checkpoint_bytes())} of weights, {config.num_layers} layers")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


def load_model(spec: str) -> tuple[ModelConfig, str | None]:
    path = Path(spec)
    if path.exists():
        return ModelConfig.from_file(path), None
    if path.suffix == ".json" or "/" in spec or "\\" in spec:  # a path, not a preset name
        raise ConfigError(f"no config file at {spec}: give a config.json, a checkpoint directory or a preset")
    return ModelConfig.preset(spec), spec


PLANNING_ERRORS = (PlanDoesNotFit, ConfigError, ClusterError, PlanError, ValueError)


def planning_error(exc: Exception) -> int:
    """Say on stderr why planning failed; the CLI's exit status (2)."""
    print(f"error: plan does not fit: {exc}" if isinstance(exc, PlanDoesNotFit) else f"error: {exc}", file=sys.stderr)
    return 2


# ============================================================== `k3-plan swarm ...`
SWARM_USAGE = """Plan a model as a swarm: one layer block per host of the cluster file, hosts joined by its inter_host link.

    k3-plan swarm --model kimi_k3 --cluster swarm_rtx5090x8_wan \\
        [--rtt-ms 10,30,50] [--bandwidth "100 Mbit/s,1 Gbit/s"] [--prompt 8192] [--json]

One RTT and one bandwidth (default: the file's link) print the plan's report; several print one table row per
(RTT, bandwidth): predicted tokens/s, TTFT and wire bytes per token, the layout planned once."""


def link_rate(text: str) -> float:
    """Bytes/s from '100 Mbit/s' (network units: the planner's own parser takes Gbit/s, MB/s, GB/s, ...)."""
    text = text.strip()
    if text.lower().endswith(("mbit/s", "mbps")):
        number = text.lower().removesuffix("mbit/s").removesuffix("mbps").strip()
        try:
            return float(number) * 1e6 / 8
        except ValueError:
            raise ValueError(f"--bandwidth: {text!r} is not a rate such as '100 Mbit/s'") from None
    return parse_quantity(text, "bandwidth", "--bandwidth")


def swarm_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3-plan swarm", description=SWARM_USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name or path to config.json / checkpoint directory")
    ap.add_argument("--cluster", required=True, help="cluster file (YAML) or a shipped cluster's name")
    ap.add_argument("--rtt-ms", default="", help="comma-separated round-trip times between operators (ms)")
    ap.add_argument("--bandwidth", default="", help="comma-separated link rates, e.g. '100 Mbit/s,1 Gbit/s'")
    ap.add_argument("--context", type=int, default=32768, help="tokens of context per sequence to reserve for")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt length for the TTFT prediction")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    try:
        if args.context < 1 or args.prompt < 1:
            raise ValueError("--context and --prompt must be >= 1")
        rtts = [float(x) for x in args.rtt_ms.split(",") if x.strip()]
        if any(r < 0 for r in rtts):
            raise ValueError("--rtt-ms takes non-negative milliseconds")
        rates = [link_rate(x) for x in args.bandwidth.split(",") if x.strip()]
        if any(r <= 0 for r in rates):
            raise ValueError("--bandwidth must be > 0")
        config, preset = load_model(args.model)
        cluster = Cluster.load(cluster_file(args.cluster))
        params = CostParams().with_overrides(cluster.cost_params)
        base = plan_swarm(config, cluster, context=args.context, prompt_tokens=args.prompt, preset=preset)
    except PLANNING_ERRORS as exc:
        return planning_error(exc)
    link = base.plan.links.inter_host
    variants = [(rtt, rate) for rtt in (rtts or [2e3 * link.latency]) for rate in (rates or [link.bandwidth])]
    plans = [base if (rtt / 2e3, rate) == (link.latency, link.bandwidth) else
             over_link(base, config, latency_s=rtt / 2e3, bandwidth=rate, params=params) for rtt, rate in variants]
    if args.json:
        print(json.dumps([p.summary() for p in plans], indent=1, default=float))
    elif len(plans) == 1:
        print(plans[0].to_markdown(), end="")
    else:
        print(swarm_table(plans), end="")
    return 0


def swarm_table(plans: list[SwarmPlan]) -> str:
    """One Markdown row per plan: the README's swarm table."""
    lines = ["| cluster | operators x layers | RTT | link | tokens/s, one stream | hop latency share | "
             f"TTFT ({plans[0].prompt_tokens} tokens) | wire KB/token |", "|---|---|---|---|---|---|---|---|"]
    for p in plans:
        layers = sorted({s.end_layer - s.first_layer for s in p.plan.stages})
        rate = p.plan.links.inter_host.bandwidth * 8
        rate_text = f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"
        lines.append(f"| {p.cluster} | {len(p.plan.stages)} x {'-'.join(map(str, (layers[0], layers[-1])))} | "
                     f"{2e3 * p.hop_latency_s:g} ms | {rate_text} | {p.tokens_per_s:.2f} | {p.latency_share:.0%} | "
                     f"{p.ttft_s:.1f} s | {p.wire_bytes_per_token / 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["swarm"]:
        return swarm_main(argv[1:])
    args = parse_args(argv)
    if args.list:
        print(catalogue())
        return 0
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not concurrency or min(concurrency) < 1:
            raise ValueError("--concurrency needs positive integers, e.g. 1,8,64")
        if args.context < 1 or args.prompt < 1:
            raise ValueError("--context and --prompt must be >= 1")
        if args.dense_split < 1:
            raise ValueError("--dense-split must be >= 1")
        config, preset = load_model(args.model)
        cluster = Cluster.load(cluster_file(args.cluster))
        stats = RoutingStats.load(args.routing_stats) if args.routing_stats else None
        plan, report = plan_cluster(
            config, cluster, max(concurrency), args.context, stats, params=CostParams(),
            options=PlannerOptions(objective=args.objective, dense_split=args.dense_split,
                                   dense_dtype=args.dense_dtype), prompt_tokens=args.prompt,
            report_concurrency=tuple(concurrency), target_tokens_per_s=args.target_tps, preset=preset,
        )
    except PLANNING_ERRORS as exc:
        return planning_error(exc)
    if args.out:
        plan.save(args.out)
    markdown = report.to_markdown()
    if args.report:
        Path(args.report).write_text(markdown)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=float))
    else:
        print(markdown, end="")
        if args.out:
            print(f"\nplan written to {args.out}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
