#!/usr/bin/env python3
"""Serving-engine benchmark on the tiny model (issue: serving engine).

1. Aggregate decode tokens/s at 1, 4, 16 and 64 concurrent streams (target: 16 streams >= 6x one stream).
2. TTFT p50/p99 of short requests on an idle engine, and while 32k-token prompts arrive in the background.
3. Per-step overhead outside the model's forward (scheduling, sampling, event emission) as a share of the
   step cycle, per batch size (target: under 20% at batch 16).

    python -m benchmarks.engine [--checkpoint DIR|random] [--quick] [--threads N] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from inference.model import ModelConfig, make_random_checkpoint
from inference.serving import (EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent,
                               load_reference_model)

TRAINED_TINY = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def stream_tokens(engine, prompt, max_tokens):
    t0 = time.perf_counter()
    first, n = None, 0
    async for ev in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))):
        if isinstance(ev, TokenEvent):
            n += 1
            if first is None:
                first = time.perf_counter()
    return first - t0, n, time.perf_counter()


async def decode_throughput(model, tok, streams, max_tokens):
    settings = EngineSettings(max_context=8192, max_concurrent_sequences=max(64, streams), step_token_budget=4096)
    async with LocalEngine(model, tok, settings) as engine:
        prompts = [[(11 * i + j) % 256 for j in range(16)] for i in range(streams)]
        await stream_tokens(engine, prompts[0], 4)  # warm up
        engine.step_stats.clear()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_tokens(engine, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        total = sum(n for _, n, _ in results)
        steps, cycle, fwd = engine.step_stats.get(streams, [0, 0.0, 0.0])
        overhead = (cycle - fwd) / cycle if cycle else float("nan")
        return total / wall, overhead, (cycle / steps * 1000 if steps else float("nan"))


async def ttft_under_load(model, tok, long_len, n_short, background):
    settings = EngineSettings(max_context=max(long_len + 64, 8192), max_concurrent_sequences=64,
                              step_token_budget=512, cache_memory_budget_bytes=8 << 30)
    async with LocalEngine(model, tok, settings) as engine:
        await stream_tokens(engine, [1, 2, 3], 2)
        bg_tasks = []
        if background:
            for i in range(background):
                long_prompt = [(7 * j + i) % 256 for j in range(long_len)]
                bg_tasks.append(asyncio.create_task(stream_tokens(engine, long_prompt, 4)))
            await asyncio.sleep(0.2)
        ttfts = []
        for i in range(n_short):
            ttft, _, _ = await stream_tokens(engine, [(5 * i + j) % 256 for j in range(32)], 4)
            ttfts.append(ttft * 1000)
            await asyncio.sleep(0.02)
        busy = any(not t.done() for t in bg_tasks)
        for t in bg_tasks:
            t.cancel()
        await asyncio.gather(*bg_tasks, return_exceptions=True)
        return ttfts, busy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(TRAINED_TINY),
                    help="the checkpoint (default: the tiny K3 trained on real text, inference/model/assets/"
                         "tiny_trained); random: the tiny model with random weights, seed 0, made in a temp dir")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script works")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (where the model computes)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="weights dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoint
    if ckpt == "random":
        ckpt = tempfile.mkdtemp(prefix="k3-bench-")
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    model, tok, fp = load_reference_model(ckpt, args.dtype, device=args.device)
    out = {"threads": args.threads, "checkpoint_fingerprint": fp, "decode": [], "ttft": {}}

    levels = (1, 4, 16) if args.quick else (1, 4, 16, 64)
    max_tokens = 16 if args.quick else 64
    print(f"# engine benchmark, tiny model, {args.threads} thread(s)\n")
    print("| streams | aggregate tok/s | x single | step ms | overhead outside forward |")
    print("|---:|---:|---:|---:|---:|")
    single = None
    for n in levels:
        tps, overhead, step_ms = asyncio.run(decode_throughput(model, tok, n, max_tokens))
        single = single or tps
        out["decode"].append({"streams": n, "tokens_per_s": tps, "speedup": tps / single,
                              "step_ms": step_ms, "overhead_share": overhead})
        print(f"| {n} | {tps:.1f} | {tps / single:.2f} | {step_ms:.1f} | {overhead * 100:.1f}% |")

    long_len = 4096 if args.quick else 32768
    n_short = 5 if args.quick else 20
    idle, _ = asyncio.run(ttft_under_load(model, tok, long_len, n_short, background=0))
    loaded, busy = asyncio.run(ttft_under_load(model, tok, long_len, n_short, background=2))
    out["ttft"] = {"long_prompt_tokens": long_len, "idle_ms": idle, "loaded_ms": loaded,
                   "background_still_prefilling": busy}
    print("\n| short-request TTFT | p50 ms | p99 ms |\n|---|---:|---:|")
    print(f"| idle engine | {statistics.median(idle):.1f} | {percentile(idle, 99):.1f} |")
    print(f"| while two {long_len}-token prompts prefill | {statistics.median(loaded):.1f} | "
          f"{percentile(loaded, 99):.1f} |")
    if not busy:
        print("(note: the background prompts finished before the short requests did)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
