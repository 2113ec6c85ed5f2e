"""Plan a model on a cluster: write the plan file and print the predicted-performance report.

    .venv/bin/python scripts/plan_cluster.py --model kimi_k3 --cluster inference/planning/clusters/rtx5090_80.yaml \
        --concurrency 1,8,64 --context 32768 --prompt 8192 --out plan.yaml [--report report.md] [--json] \
        [--dense-split 2] [--dense-dtype fp8]

--model is a preset (kimi_k3, tiny, ...) or a config.json / checkpoint directory. --cluster is a YAML
file or the name of one shipped with the package (b300_8, mi355x_8, rtx5090_80, local_cpu). Reservations
(KDA state, MLA cache) are sized for the largest --concurrency; the report predicts each one.
Exit status 2 on bad input or when the model does not fit (the message names the device and
by how much it overflows).

    .venv/bin/python scripts/plan_cluster.py swarm --model kimi_k3 --cluster swarm_rtx5090x8_wan --rtt-ms 10,30,50

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
from inference.planning.planner import Cluster, ClusterError, PlanDoesNotFit, PlannerOptions, plan_cluster


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="preset name or path to config.json / checkpoint directory")
    ap.add_argument("--cluster", required=True,
                    help="cluster description (YAML file), or the name of a shipped one: " + ", ".join(shipped_clusters()))
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
    return ap.parse_args(argv)


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["swarm"]:
        from inference.planning.swarm_plan import swarm_main  # noqa: PLC0415

        return swarm_main(argv[1:])
    args = parse_args(argv)
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

