#!/usr/bin/env python
"""Decode latency of the sharded runtime on loopback against the cost model's prediction; prints tables.

  1. gloo point-to-point on this machine: alpha (one-way latency = round trip of a small message / 2) and
     bandwidth (from the round trip of a large message), plus this CPU's copy bandwidth and matmul FLOP/s
  2. measured time per decoded token (batch 1) of the tiny model: single process, then each shard layout
  3. the cost model (inference.planning.cost_model.CostModel.token_time) for each layout with the measured alpha,
     bandwidth, memory bandwidth and FLOP/s put into the plan, and measured / predicted. Two predictions:
     the model's default constants, and with `launch_overhead_s` fitted so that the single-process
     prediction equals the single-process measurement (PyTorch eager on a CPU spends ~ms per layer in
     Python, which the default, sized for fused GPU kernels, does not know about): the second isolates
     what sharding adds.

    .venv/bin/python -m benchmarks.sharded [--steps 32] [--prompt 16] [--checkpoint DIR|random] [--threads 1]

The runtime sends the residual state and partial sums in fp32, so the plans get activation_dtype_bytes=4.
Not in the cost model: the driver <-> rank 0 pipe and rank 0's step header to every rank (one small
message per rank per step).
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from inference.model import ModelConfig, make_random_checkpoint
from inference.planning import CostModel, CostParams
from inference.planning.plan import Link, Links, Plan
from inference.serving import load_reference_model
from inference.sharding import ShardedModel, ShardTimeouts

TRAINED_TINY = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"

LAYOUTS = [("pipeline", 2, 0), ("expert", 2, 0), ("both", 3, 0), ("expert", 3, 16)]


# ------------------------------------------------------------------ gloo point to point
P2P_SIZES = ((8, 400), (1 << 20, 12), (8 << 20, 12))  # (bytes, round trips)


def _p2p_rank(rank: int, port: int, conn) -> None:
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    wait = timedelta(seconds=30)
    peer = 1 - rank
    results = {}
    for nbytes, iters in P2P_SIZES:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        times = []
        for i in range(iters + 3):
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(buf, peer).wait(wait)
                dist.irecv(buf, peer).wait(wait)
            else:
                dist.irecv(buf, peer).wait(wait)
                dist.isend(buf, peer).wait(wait)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        results[nbytes] = (statistics.median(times), min(times))
    if rank == 0:
        conn.send(results)
    os._exit(0)


def measure_gloo() -> dict:
    """gloo send/recv between two processes: alpha (one way: small round trip / 2, median and best) and the
    bandwidth one direction (from the difference of two large round trips, so alpha cancels)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_p2p_rank, args=(r, store.port, child), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    if not parent.poll(120):
        for p in procs:
            p.kill()
        raise RuntimeError("the gloo ping-pong did not finish within 120 s")
    rtt = parent.recv()
    for p in procs:
        p.join(10)
    (small, _), (mid, _), (big, _) = (P2P_SIZES[0], P2P_SIZES[1], P2P_SIZES[2])
    one_way = (rtt[big][0] - rtt[mid][0]) / 2
    return {"alpha": rtt[small][0] / 2, "alpha_best": rtt[small][1] / 2,
            "bandwidth": (big - mid) / one_way if one_way > 0 else float("nan")}


def measure_cpu() -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, fp32 matmul FLOP/s) on one thread."""
    x = torch.empty(64 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bw = 5 * 2 * x.numel() / (time.perf_counter() - t0)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 10 * 2 * 512 ** 3 / (time.perf_counter() - t0)
    return bw, flops


# ------------------------------------------------------------------ decode timing
def decode_seconds(model, prompt: int, steps: int) -> float:
    """Mean seconds per decoded token at batch 1, after a prompt of `prompt` tokens and 3 warm-up steps."""
    cache = model.new_cache()
    g = torch.Generator().manual_seed(0)
    model.forward([torch.randint(0, 256, (prompt,), generator=g)], [cache])
    token = torch.tensor([1])
    for _ in range(3):
        model.forward([token], [cache])
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward([token], [cache])[0]
        token = logits.argmax().reshape(1)
    return (time.perf_counter() - t0) / steps


# ------------------------------------------------------------------ prediction
def local_plan(config: ModelConfig, mode: str, ranks: int, replicas: int, alpha: float, bandwidth: float,
               mem_bw: float, flops: float) -> Plan:
    plan = Plan.simple(config, ranks, mode if ranks > 1 else "pipeline", replicas, memory_bytes=8 << 30)
    link = Link(bandwidth=bandwidth, latency=alpha, kind="loopback gloo (measured)")
    devices = [dataclasses.replace(d, mem_bandwidth=mem_bw, flops=flops) for d in plan.devices]
    policy = dataclasses.replace(plan.memory_policy, activation_dtype_bytes=4)
    return dataclasses.replace(plan, links=Links(link, link), devices=devices, memory_policy=policy)


def predict(config: ModelConfig, plan: Plan, context: int, params: CostParams) -> float:
    return CostModel(config, plan, params).token_time(context=context).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--checkpoint", default=str(TRAINED_TINY),
                        help="the checkpoint (default: the tiny K3 trained on real text, inference/model/assets/"
                             "tiny_trained); random: the tiny model with random weights, seed 0, made in a temp dir")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = opts.checkpoint
        if ckpt == "random":
            ckpt = tmp
            make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
        gloo = measure_gloo()
        alpha, bandwidth = gloo["alpha"], gloo["bandwidth"]
        mem_bw, flops = measure_cpu()
        print(f"gloo point to point on loopback: alpha = {alpha * 1e6:.1f} us one way (median; best "
              f"{gloo['alpha_best'] * 1e6:.1f} us), bandwidth = {bandwidth / 1e9:.2f} GB/s; CPU copy "
              f"{mem_bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.1f} GFLOP/s (1 thread)")

        reference, _, _ = load_reference_model(ckpt)
        config = reference.config
        context = opts.prompt + 3 + opts.steps // 2
        rows = [("single process", 1, decode_seconds(reference, opts.prompt, opts.steps),
                 local_plan(config, "pipeline", 1, 0, alpha, bandwidth, mem_bw, flops))]
        del reference
        for mode, n, replicas in LAYOUTS:
            with ShardedModel(ckpt, shards=n, mode=mode, replicas=replicas, threads_per_rank=opts.threads,
                              timeouts=ShardTimeouts(comm=120, heartbeat=30)) as model:
                seconds = decode_seconds(model, opts.prompt, opts.steps)
            label = f"{mode}" + (f" +{replicas} replicas" if replicas else "")
            rows.append((label, n, seconds, local_plan(config, mode, n, replicas, alpha, bandwidth, mem_bw, flops)))

        default = CostParams()
        single_plan = rows[0][3]
        # the prediction is linear in the per-layer launch overhead: fit it on the single-process row
        t0 = predict(config, single_plan, context, dataclasses.replace(default, launch_overhead_s=0.0))
        t1 = predict(config, single_plan, context, dataclasses.replace(default, launch_overhead_s=1e-3))
        launch = max(0.0, (rows[0][2] - t0) / ((t1 - t0) / 1e-3))
        fitted = dataclasses.replace(default, launch_overhead_s=launch)

        print(f"\ntiny model, batch-1 decode, {opts.steps} steps after a {opts.prompt}-token prompt, "
              f"{opts.threads} thread(s) per process; fitted launch overhead {launch * 1e3:.2f} ms per layer")
        header = (f"{'layout':<24}{'ranks':>6}{'measured ms':>13}{'predicted ms':>14}{'ratio':>8}"
                  f"{'fitted ms':>11}{'ratio':>8}{'vs single':>11}")
        print(header)
        print("-" * len(header))
        for label, n, seconds, plan in rows:
            p_default = predict(config, plan, context, default)
            p_fitted = predict(config, plan, context, fitted)
            print(f"{label:<24}{n:>6}{seconds * 1e3:>13.2f}{p_default * 1e3:>14.3f}{seconds / p_default:>8.1f}"
                  f"{p_fitted * 1e3:>11.2f}{seconds / p_fitted:>8.2f}{seconds / rows[0][2]:>11.2f}")


if __name__ == "__main__":
    main()
