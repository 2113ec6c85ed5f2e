#!/usr/bin/env python3
"""Single-stream tokens/s the cost model predicts for a cluster plan with issue 17's levers; prints a table.

Plans `--model` on `--cluster` for one stream (the planner, latency objective), then derives one plan per lever
(`Plan.with_dense_split`: each layer's attention, shared experts and the LM head split over 2 or 4 devices of its
host; `dense_dtype: fp8`), prices each with the cost model, and prices speculative decoding on top at the given
draft acceptances (k chosen by the model, `CostModel.speculative_token_time`). Every row's plan is written to
`--plans DIR` (default deploy/plans, compact JSON): the sharded runtime executes those files
(`ShardedModel(checkpoint, plan=...)`, given the checkpoint and one process per planned device).

    python -m benchmarks.claim_levers [--model kimi_k3] [--cluster rtx5090_80] [--acceptance 0.35,0.6,0.8] [--plans DIR]
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from inference.model import ModelConfig
from inference.planning import CostModel, CostParams
from inference.planning.plan_cluster import cluster_file
from inference.planning.planner import Cluster, PlannerOptions, plan_cluster

LEVERS = [("bf16 dense (the plan)", 1, "bf16"), ("fp8 dense", 1, "fp8"), ("dense split x2, bf16", 2, "bf16"),
          ("dense split x2, fp8", 2, "fp8"), ("dense split x4, fp8", 4, "fp8")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi_k3")
    ap.add_argument("--cluster", default="rtx5090_80")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--acceptance", default="0.35,0.6,0.8", help="draft acceptance rates g to price")
    ap.add_argument("--plans", default=str(ROOT / "deploy" / "plans"), help="directory for the plan files ('' = none)")
    args = ap.parse_args()
    config = ModelConfig.preset(args.model)
    plain, _ = plan_cluster(config, Cluster.load(cluster_file(args.cluster)), 1, args.context, None,
                            params=CostParams(), options=PlannerOptions(objective="latency"), prompt_tokens=8192,
                            report_concurrency=(1,), target_tokens_per_s=20.0, preset=args.model)
    rates = [float(g) for g in args.acceptance.split(",")]
    head = f"{'layout':<24}{'plain tok/s':>13}" + "".join(f"{f'g={g} (k)':>18}" for g in rates) + "  plan file"
    print(f"{args.model} on {args.cluster}, one stream, {args.context} tokens of context")
    print(head)
    print("-" * len(head))
    for name, split, dtype in LEVERS:
        plan = plain if (split, dtype) == (1, "bf16") else plain.with_dense_split(config, split, dtype)
        model = CostModel(config, plan)
        plain_tps = 1 / model.token_time(components=False).total
        cells = ""
        for g in rates:
            r = model.speculative_token_time(g, max_draft_tokens=8)
            cells += f"{r['tokens_per_s']:>12.1f} ({r['draft_tokens']})".rjust(18)
        where = "-"
        if args.plans:
            out = Path(args.plans) / f"{args.model}_{args.cluster}_split{split}_{dtype}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            plan.prediction = dict(plan.prediction or {}, lever=name, single_stream_tokens_per_s=float(plain_tps))
            out.write_text(json.dumps(plan.to_dict(), separators=(",", ":")) + "\n")  # compact: 0.4 MB, loads fast
            where = str(out.relative_to(ROOT)) if out.resolve().is_relative_to(ROOT) else str(out)
        print(f"{name:<24}{plain_tps:>13.1f}{cells}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
