#!/usr/bin/env python
"""Benchmark of the reference model pieces; prints one table.

  1. KDA kernels: kda_chunked vs kda_recurrent (B=1, H=4, K=V=64, T=4096): time, speedup, max |diff|
  2. tiny model prefill throughput at 1k and 8k tokens
  3. tiny model decode latency per step at batch 1 and 16
  4. memory per sequence (SequenceCache.nbytes) at 1k and 8k tokens, KDA part shown separately
  5. routed expert matmul: MXFP4 decoded on the fly vs a cached dequantised copy

    .venv/bin/python -m benchmarks.model [--quick] [--checkpoint DIR] [--threads N]

--quick shrinks every size (a smoke run); --checkpoint loads weights (and config) with inference.model.checkpoint,
otherwise the tiny model is randomly initialised.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from inference.model import KimiK3Model, ModelConfig, mxfp4
from inference.model.kda import kda_chunked, kda_recurrent


def timed(fn, repeat: int = 3, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def bench_kda(T: int, rows: list) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, K = 1, 4, 64
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, K, generator=g)
    log_decay = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))  # the K3 gate range (-5, 0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    t_rec = timed(lambda: kda_recurrent(q, k, v, log_decay, beta), repeat=1)
    t_chk = timed(lambda: kda_chunked(q, k, v, log_decay, beta), repeat=3)
    o_rec, s_rec = kda_recurrent(q, k, v, log_decay, beta)
    o_chk, s_chk = kda_chunked(q, k, v, log_decay, beta)
    diff = max((o_rec - o_chk).abs().max().item(), (s_rec - s_chk).abs().max().item())
    shape = f"B=1 H=4 K=V=64 T={T}"
    rows.append(("kda", f"recurrent {shape}", f"{t_rec * 1e3:.1f} ms"))
    rows.append(("kda", f"chunked {shape}", f"{t_chk * 1e3:.1f} ms"))
    rows.append(("kda", "chunked speedup / max |diff| (out, state)", f"{t_rec / t_chk:.1f}x / {diff:.2e}"))


def bench_prefill(model: KimiK3Model, lengths: list[int], rows: list) -> dict[int, object]:
    caches = {}
    V = min(model.config.vocab_size, 256)
    for n in lengths:
        ids = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n))
        state = {}

        def run():
            state["cache"] = model.new_cache()
            model([ids], [state["cache"]])

        t = timed(run, repeat=1, warmup=0 if n > 2048 else 1)
        caches[n] = state["cache"]
        rows.append(("prefill", f"{n} tokens, one sequence", f"{n / t:,.0f} tok/s ({t:.2f} s)"))
    return caches


def bench_decode(model: KimiK3Model, batches: list[int], prompt: int, steps: int, rows: list) -> None:
    V = min(model.config.vocab_size, 256)
    for b in batches:
        g = torch.Generator().manual_seed(b)
        caches = [model.new_cache() for _ in range(b)]
        model([torch.randint(0, V, (prompt,), generator=g) for _ in range(b)], caches)
        nxt = [torch.randint(0, V, (1,), generator=g) for _ in range(b)]
        model(nxt, caches)  # warm-up step
        t0 = time.perf_counter()
        for _ in range(steps):
            model(nxt, caches)
        per_step = (time.perf_counter() - t0) / steps
        rows.append(("decode", f"batch {b} (after {prompt}-token prompts)",
                     f"{per_step * 1e3:.1f} ms/step, {b / per_step:,.0f} tok/s"))


def bench_memory(model: KimiK3Model, caches: dict, rows: list) -> None:
    cfg = model.config
    for n, cache in sorted(caches.items()):
        rows.append(("memory", f"sequence of {n} tokens: total", fmt_bytes(cache.nbytes)))
        rows.append(("memory", f"  KDA part (constant) / MLA part ({cfg.num_mla_layers} layers x "
                     f"{cfg.mla_cache_width} values/token)", f"{fmt_bytes(cache.kda_nbytes)} / {fmt_bytes(cache.mla_nbytes)}"))


def bench_experts(model: KimiK3Model, k3_shape: bool, rows: list) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [("tiny", model.config.expert_intermediate_size, model.config.latent_size, 8)]
    if k3_shape:
        full = ModelConfig.kimi_k3()
        shapes.append(("K3 w1", full.expert_intermediate_size, full.latent_size, 1))
    for label, out_f, in_f, tokens in shapes:
        packed, scale = mxfp4.random_on_grid(out_f, in_f, generator=g)
        x = torch.randn(tokens, in_f, generator=g)
        cache = mxfp4.DequantizedCache()
        t_fly = timed(lambda: mxfp4.mxfp4_matmul(x, packed, scale), repeat=5)
        t_cached = timed(lambda: mxfp4.mxfp4_matmul(x, packed, scale, cache=cache), repeat=5)
        same = torch.equal(mxfp4.mxfp4_matmul(x, packed, scale), mxfp4.mxfp4_matmul(x, packed, scale, cache=cache))
        rows.append(("experts", f"{label} [{out_f}x{in_f}] x {tokens} tokens: on the fly / cached",
                     f"{t_fly * 1e6:,.0f} us / {t_cached * 1e6:,.0f} us ({t_fly / t_cached:.1f}x, equal={same})"))
    # whole tiny model decode step, experts on the fly vs cached dense copies
    V = min(model.config.vocab_size, 256)
    results = {}
    for enabled in (False, True):
        model.set_dequantize_cache(enabled)
        cache = model.new_cache()
        model([torch.randint(0, V, (16,), generator=g)], [cache])
        step = [torch.randint(0, V, (1,), generator=g)]
        results[enabled] = timed(lambda: model(step, [cache.clone()]), repeat=5)
    model.set_dequantize_cache(False)
    rows.append(("experts", "model decode step, batch 1: on the fly / cached",
                 f"{results[False] * 1e3:.1f} ms / {results[True] * 1e3:.1f} ms"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in well under a minute")
    ap.add_argument("--checkpoint", type=Path, help="load this checkpoint directory instead of random weights")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    if args.checkpoint:
        from inference.model import checkpoint

        config = checkpoint.read_config(args.checkpoint)
        model = KimiK3Model(config)
        checkpoint.load_checkpoint(model, args.checkpoint, progress=False)
        source = f"checkpoint {args.checkpoint}"
    else:
        config = ModelConfig.tiny()
        model = KimiK3Model(config)
        source = "tiny, random init"
    model.eval()

    rows: list[tuple[str, str, str]] = []
    bench_kda(512 if args.quick else 4096, rows)
    caches = bench_prefill(model, [256, 1024] if args.quick else [1024, 8192], rows)
    bench_decode(model, [1, 16], prompt=32 if args.quick else 128, steps=5 if args.quick else 20, rows=rows)
    bench_memory(model, caches, rows)
    bench_experts(model, k3_shape=not args.quick, rows=rows)

    print(f"model: {config.model_id} ({source}), torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (", --quick" if args.quick else ""))
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    print(f"{'part':<{w1}}  {'case':<{w2}}  result")
    print(f"{'-' * w1}  {'-' * w2}  {'-' * 30}")
    for part, case, result in rows:
        print(f"{part:<{w1}}  {case:<{w2}}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
