#!/usr/bin/env python3
"""Single-stream tokens/s the cost model predicts for a cluster plan with issue 17's levers; prints a table.

Plans `--model` on `--cluster` for one stream (the planner, latency objective), then re-prices the plan with
fp8 dense weights, each layer's dense work split over 2 or 4 devices of its host, and speculative decoding at
the given draft acceptances (k chosen by the model, `CostModel.speculative_token_time`).

    python scripts/claim_levers.py [--model kimi_k3] [--cluster rtx5090_80] [--acceptance 0.35,0.6,0.8]

Only the plain row's layout is one the sharded runtime executes today (dense splits are a what-if).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.model import ModelConfig  # noqa: E402
from inference.planning import CostModel, CostParams  # noqa: E402
from inference.planning.plan_cluster import cluster_file  # noqa: E402
from inference.planning.planner import Cluster, PlannerOptions, plan_cluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi_k3")
    ap.add_argument("--cluster", default="rtx5090_80")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--acceptance", default="0.35,0.6,0.8", help="draft acceptance rates g to price")
    ap.add_argument("--out", help="write the plain plan here")
    args = ap.parse_args()
    config = ModelConfig.preset(args.model)
    plan, _ = plan_cluster(config, Cluster.load(cluster_file(args.cluster)), 1, args.context, None,
                           params=CostParams(), options=PlannerOptions(objective="latency"), prompt_tokens=8192,
                           report_concurrency=(1,), target_tokens_per_s=20.0, preset=args.model)
    if args.out:
        plan.save(args.out)
    model = CostModel(config, plan)
    levers = [("bf16 dense (the plan)", model), ("fp8 dense", model.variant(dense_weight_scale=0.5)),
              ("dense split x2, bf16", model.variant(dense_split=2)),
              ("dense split x2, fp8", model.variant(dense_split=2, dense_weight_scale=0.5)),
              ("dense split x4, fp8", model.variant(dense_split=4, dense_weight_scale=0.5))]
    rates = [float(g) for g in args.acceptance.split(",")]
    head = f"{'layout':<24}{'feasible':>9}{'plain tok/s':>13}" + "".join(f"{f'g={g} (k)':>18}" for g in rates)
    print(f"{args.model} on {args.cluster}, one stream, {args.context} tokens of context")
    print(head)
    print("-" * len(head))
    for name, m in levers:
        plain = 1 / m.token_time(components=False).total
        cells = ""
        for g in rates:
            r = m.speculative_token_time(g, max_draft_tokens=8)
            cells += f"{r['tokens_per_s']:>12.1f} ({r['draft_tokens']})".rjust(18)
        print(f"{name:<24}{'yes' if m.split_ok else 'no':>9}{plain:>13.1f}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
