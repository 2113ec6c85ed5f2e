"""Honest drift per block (fp32 and bf16 stages against the validator's fp32 reference), challenges until each
stage cheater is blamed, and the validator's CPU time per stage challenge, on the tiny model. Prints tables.

    PYTHONPATH=$PWD python -m benchmarks.stage_checks --prompts 12 --repeats 5
    PYTHONPATH=$PWD python -m benchmarks.stage_checks --checkpoint random   # default: the trained tiny K3
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from inference.serving.builders import load_reference_model
from inference.swarm.stage import LayerRange, Stage
from localnet.cheats.stage import CHEATS, WireRounding
from scoring.stage_checks import Thresholds, challenge_steps, plan_steps, reference_stage, run_challenge
from benchmarks.checkpoint_choice import add_checkpoint_argument, resolve_checkpoint

BLOCKS = [(0, 3), (3, 6), (6, 9), (9, 13)]
NETWORK_CHEATS = {"forwarder"}  # relays to another stage miner: nothing to measure without a network


def text_corpus() -> bytes:
    docs = Path(__file__).resolve().parent.parent / "inference"
    return b"".join(p.read_bytes() for p in sorted(docs.rglob("*.py")))[:200_000]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12, help="honest challenges per block and precision")
    ap.add_argument("--repeats", type=int, default=5, help="runs per cheater (challenges until blame)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=30, help="give up on a cheater after this many challenges")
    add_checkpoint_argument(ap)
    args = ap.parse_args()
    text = text_corpus()
    t = Thresholds()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = resolve_checkpoint(args.checkpoint, Path(tmp))
        model, _, _ = load_reference_model(ckpt, verify=False)
        rng = np.random.default_rng(0)

        def one(stage, layers, seen, long=False):
            plan = plan_steps(rng, args.max_tokens, min_tokens=args.max_tokens if long else 16)
            off = int(rng.integers(0, len(text) - args.max_tokens - 2))
            steps = challenge_steps(model, layers, list(text[off:off + args.max_tokens + 1]), plan)
            return run_challenge(stage, reference_stage(model, layers.start, layers.stop), steps,
                                 session_id=f"b{int(rng.integers(1 << 40)):x}", outputs_seen=seen)

        print("| block | stage | tokens | median | q99 | max | bad tokens | worst window | blamed | validator CPU ms/challenge |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for a, b in BLOCKS:
            layers = LayerRange(a, b, 13)
            for name, stage in (("fp32", Stage.from_checkpoint(ckpt, layers)),
                                ("bf16", WireRounding(Stage.from_checkpoint(ckpt, layers, dtype=torch.bfloat16)))):
                rels, bad, worst, blamed, cpu = [], [], 0, 0, []
                for _ in range(args.prompts):
                    r = one(stage, layers, {}, long=True)
                    rels += r.stats.rel_l2
                    bad += r.stats.bad
                    w = np.convolve(np.asarray(r.stats.bad, int), np.ones(t.window, int), "valid")
                    worst = max(worst, int(w.max()) if len(w) else 0)
                    blamed += not r.ok
                    cpu.append(r.validator_cpu_s * 1000)
                q = np.quantile(rels, [0.5, 0.99, 1.0])
                print(f"| {a}-{b - 1} | {name} | {len(rels)} | {q[0]:.4f} | {q[1]:.4f} | {q[2]:.4f} | "
                      f"{np.mean(bad):.2%} | {worst}/{t.window} | {blamed} | {np.mean(cpu):.0f} |")
        print("\n(state blocks: relative L2 of the projected new state per token; head block 9-12: |logprob diff|)\n")
        print("| cheater | block | challenges to blame (per run) | max |")
        print("|---|---|---|---|")
        for name, cls in CHEATS.items():
            if name in NETWORK_CHEATS:
                print(f"| {name} | - | not measured here: it relays to other stage miners on a network | - |")
                continue
            for a, b in ((3, 6), (9, 13)):
                layers = LayerRange(a, b, 13)
                counts = []
                for _ in range(args.repeats):
                    stage = cls.from_checkpoint(ckpt, layers)
                    seen: dict = {}
                    for k in range(1, args.limit + 1):
                        if not one(stage, layers, seen).ok:
                            break
                    else:
                        k = None
                    counts.append(k)
                shown = [c if c is not None else f">{args.limit}" for c in counts]
                print(f"| {name} | {a}-{b - 1} | {shown} | {max((c or 10**9) for c in counts) if all(counts) else 'not caught'} |")


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"\n{time.time() - start:.0f} s")
