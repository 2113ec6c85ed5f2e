#!/usr/bin/env python
"""Speed of the sharded runtime (issue 17): pipelined decode, emulated links, speculation; prints tables.

  1. Pipelined decode: 16 streams on 2 and 3 pipeline stages: one batch of 16, then S micro-batches one at a
     time (1 in flight, the runtime before pipelining), then the same S micro-batches all in flight (each micro-batch's next step is submitted as soon as its logits are
     back: `ShardedModel.submit` / `collect`), on loopback and on emulated links (`LinkEmulation`: 25 GbE,
     and a 30 ms, 1 Gbit/s WAN hop, where waiting on the link rather than compute sets the pace). Aggregate tokens/s, the ratio, and whether the tokens were the same.
  2. The cost model against those runs: predicted round time (every stream one token;
     `CostModel.decode_round`) against measured, and measured / predicted. The plan gets the measured
     gloo alpha and bandwidth plus the emulated link, this CPU's copy bandwidth and FLOP/s, fp32 activations,
     `return_logits`; the per-layer overhead (PyTorch eager on a CPU) is fitted per micro-batch size on a
     1-rank shard set, so the prediction's sharding terms (hops, link latency, pipelining) are what is checked.
     The shard processes share this machine's cores, so the prediction has `shared_cores` set to them: in
     flight, S stages' work cannot go faster than the cores (3 stages on 2 cores).
  3. Speculative decoding through the serving engine on the 2-stage shard set (one stream, greedy, ngram and
     suffix drafts), with the cost model's speed-up at the measured acceptance (`speculative_token_time`).
  4. Dense split: 1 process, 2 ranks as a 2-stage pipeline, and 2 ranks splitting every layer's attention,
     shared experts and the LM head (`Plan.simple(..., "expert", dense_split=2)`, routed experts expert-parallel),
     decoding 1 and `--streams` streams, on loopback and emulated 25 GbE, with the cost model's prediction
     for each (per-layer overhead fitted on the 1-rank set, as in 2).
  5. Engine (`--sections engine`): `--streams` concurrent greedy requests through the serving engine
     (`LocalEngine`) on 2 and 3 pipeline stages, one step at a time (micro_batches 1) against the engine's
     pipelined decode (micro_batches = stages: that many groups of sequences, one step each in flight), on
     the same links as 1. Aggregate tokens/s over the whole run (prefill included) and whether the tokens
     were the same.

    .venv/bin/python -m benchmarks.sharded_speed [--checkpoint DIR|random] [--streams 16] [--steps 8]
        [--sections pipelined,speculation,split,engine] [--split-links "loopback,25 GbE"] [--engine-tokens 24]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.sharded import local_plan, measure_cpu, measure_gloo
from benchmarks.speculative import speedup_table
from inference.model import ModelConfig, make_random_checkpoint, read_config
from inference.model.tokenizer import load_tokenizer
from inference.planning import CostModel, CostParams
from inference.serving import EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent
from inference.sharding import LinkEmulation, ShardedModel, ShardTimeouts

TRAINED_TINY = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"

LINKS = {"loopback": LinkEmulation(), "25 GbE": LinkEmulation(latency_ms=0.02, gbps=25.0),
         "WAN 30 ms": LinkEmulation(latency_ms=30.0, gbps=1.0)}
TIMEOUTS = ShardTimeouts(comm=120, heartbeat=30, startup=300)
CORES = len(os.sched_getaffinity(0))  # the shard processes share this machine's cores (CostParams.shared_cores)


def decode_streams(model, streams: int, micro_batches: int, steps: int, prompt: int,
                   in_flight: int | None = None) -> tuple[float, list]:
    """Greedy decode of `streams` sequences in `micro_batches` groups, at most `in_flight` of them (default
    all) submitted at once; (seconds per round, every stream's tokens). One round = every stream one token."""
    in_flight = micro_batches if in_flight is None else in_flight
    g = torch.Generator().manual_seed(0)
    sizes = [streams // micro_batches + (i < streams % micro_batches) for i in range(micro_batches)]
    groups = [[torch.randint(0, 256, (prompt,), generator=g) for _ in range(n)] for n in sizes]
    caches = [[model.new_cache() for _ in grp] for grp in groups]
    tokens: list[list[int]] = [[] for _ in range(streams)]
    first = [sum(sizes[:i]) for i in range(micro_batches)]

    def after(i, logits):
        feed = [row.argmax().reshape(1) for row in logits]
        for j, t in enumerate(feed):
            tokens[first[i] + j].append(int(t))
        return feed

    feeds = [after(i, out) for i, out in enumerate(model.forward_pipelined(
        [(grp, c, False) for grp, c in zip(groups, caches)]))]
    feeds = [after(i, out) for i, out in enumerate(model.forward_pipelined(  # warm-up step
        [(f, c, False) for f, c in zip(feeds, caches)]))]
    done = [0] * micro_batches
    t0 = time.perf_counter()
    waiting = collections.deque(range(micro_batches))  # micro-batches ready for their next step
    tickets: collections.deque = collections.deque()
    while waiting or tickets:
        while waiting and len(tickets) < in_flight:
            i = waiting.popleft()
            tickets.append((i, model.submit(feeds[i], caches[i])))
        i, ticket = tickets.popleft()
        feeds[i] = after(i, model.collect(ticket))
        done[i] += 1
        if done[i] < steps:
            waiting.append(i)
    return (time.perf_counter() - t0) / steps, tokens


def fit_launch(config, plan, context: int, b: int, measured_round: float, return_logits: bool) -> CostParams:
    """CostParams whose per-layer launch overhead makes the 1-rank prediction equal the measured 1-rank step
    of batch b (the prediction is linear in it)."""
    base = CostParams(return_logits=return_logits)
    model0 = CostModel(config, plan, dataclasses.replace(base, launch_overhead_s=0.0))
    model1 = CostModel(config, plan, dataclasses.replace(base, launch_overhead_s=1e-3))
    t0 = model0.decode_round(b, 1, context)["round_s"]
    t1 = model1.decode_round(b, 1, context)["round_s"]
    return dataclasses.replace(base, launch_overhead_s=max(0.0, (measured_round - t0) / ((t1 - t0) / 1e-3)))


def link_plan(config, stages: int, link: LinkEmulation, gloo: dict, cpu: tuple[float, float]):
    bandwidth = gloo["bandwidth"] if link.gbps <= 0 else min(gloo["bandwidth"], link.gbps * 1e9 / 8)
    return local_plan(config, "pipeline", stages, 0, gloo["alpha"] + link.latency_ms / 1e3, bandwidth, *cpu)


class Borrowed:
    """A shard set lent to an engine that would close it when it stops."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def close(self) -> None:
        pass


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    head = " | ".join(name for _, name, _ in columns)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(" | ".join(format(r[key], fmt).rjust(len(name)) for key, name, fmt in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(TRAINED_TINY),
                        help="the checkpoint (default: the tiny K3 trained on real text, inference/model/assets/"
                             "tiny_trained); random: the tiny model with random weights, seed 0, made in a temp dir")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="decode rounds timed per run")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of: {', '.join(LINKS)}")
    parser.add_argument("--spec-tokens", type=int, default=48, help="tokens per speculative run (0: skip)")
    parser.add_argument("--sections", default="pipelined,speculation,split",
                        help="comma-separated, of: pipelined, speculation, split, engine")
    parser.add_argument("--engine-tokens", type=int, default=24, help="engine section: tokens per request")
    parser.add_argument("--split-links", default="loopback,25 GbE", help="links for the dense-split rows")
    opts = parser.parse_args()
    sections = set(opts.sections.split(","))
    known = {"pipelined", "speculation", "split", "engine"}
    if sections - known:
        parser.error(f"unknown sections {sorted(sections - known)}")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = opts.checkpoint
        if ckpt == "random":
            ckpt = tmp
            make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
        config = read_config(ckpt)
        gloo = measure_gloo()
        cpu = measure_cpu()
        print(f"gloo loopback: alpha {gloo['alpha'] * 1e6:.0f} us one way, {gloo['bandwidth'] / 1e9:.2f} GB/s; "
              f"CPU copy {cpu[0] / 1e9:.1f} GB/s, matmul {cpu[1] / 1e9:.1f} GFLOP/s; load {os.getloadavg()}")
        stage_counts = [int(s) for s in opts.stages.split(",")]
        micro_sizes = sorted(({opts.streams} | {-(-opts.streams // s) for s in stage_counts}
                              if "pipelined" in sections else set())
                             | ({1, opts.streams} if "split" in sections else set())
                             | ({1} if "speculation" in sections else set()))
        context = opts.prompt + 1 + opts.steps // 2
        # calibration: a 1-rank shard set (the same driver, pipe and worker, no hops) per micro-batch size
        fitted = {}
        with (ShardedModel(ckpt, shards=1, mode="pipeline", threads_per_rank=1, timeouts=TIMEOUTS) if micro_sizes
              else contextlib.nullcontext()) as one:
            plan1 = local_plan(config, "pipeline", 1, 0, gloo["alpha"], gloo["bandwidth"], *cpu)
            for b in micro_sizes:
                measured, _ = decode_streams(one, b, 1, opts.steps, opts.prompt)
                fitted[b] = fit_launch(config, plan1, context, b, measured, return_logits=True)
        print("fitted per-layer overhead (ms) by micro-batch size: "
              + ", ".join(f"{b}: {p.launch_overhead_s * 1e3:.2f}" for b, p in fitted.items()))

        rows = []
        for stages in (stage_counts if "pipelined" in sections else []):
            for link_name in opts.links.split(","):
                link = LINKS[link_name]
                plan = link_plan(config, stages, link, gloo, cpu)
                runs = [(1, 1), (stages, 1), (stages, stages)]  # (micro-batches, in flight)
                with ShardedModel(ckpt, shards=stages, mode="pipeline", threads_per_rank=1, timeouts=TIMEOUTS,
                                  link=link) as model:
                    results = {run: decode_streams(model, opts.streams, run[0], opts.steps, opts.prompt, run[1])
                               for run in runs}
                sequential = results[(stages, 1)][0]
                for (m, f), (round_s, tokens) in results.items():
                    b = -(-opts.streams // m)
                    params = dataclasses.replace(fitted[b], shared_cores=CORES)  # the ranks share this CPU
                    predicted = CostModel(config, plan, params).decode_round(opts.streams, m, context, f)
                    rows.append(dict(stages=stages, link=link_name, micro=f"{m} x {b}", in_flight=f,
                                     tps=opts.streams / round_s, ratio=sequential / round_s,
                                     same="yes" if tokens == results[(1, 1)][1] else "no",
                                     measured_ms=round_s * 1e3, predicted_ms=predicted["round_s"] * 1e3,
                                     error=round_s / predicted["round_s"], bound=predicted["bound"]))
        if rows:
            print_table(f"pipelined decode, {opts.streams} streams, {opts.steps} rounds, pipeline stages over gloo "
                        "(real processes, 1 thread each); micro = micro-batches x streams; ratio = tokens/s over the "
                        "same micro-batches one at a time; same tokens = as the one-batch run; error = measured / "
                        "predicted round", rows,
                        [("stages", "stages", "d"), ("link", "link          ", "s"), ("micro", "micro ", "s"),
                         ("in_flight", "in flight", "d"),
                         ("tps", "tokens/s", ".1f"), ("ratio", "ratio", ".2f"), ("same", "same tokens", "s"),
                         ("measured_ms", "measured ms", ".1f"), ("predicted_ms", "predicted ms", ".1f"),
                         ("error", "error", ".2f"), ("bound", "bound          ", "s")])

        if opts.spec_tokens and "speculation" in sections:
            tokenizer = load_tokenizer(ckpt, config)
            with ShardedModel(ckpt, shards=2, mode="pipeline", threads_per_rank=1, timeouts=TIMEOUTS) as model:
                spec_rows = speedup_table(Borrowed(model), tokenizer, opts.spec_tokens, repeats=1)
            plan = link_plan(config, 2, LINKS["loopback"], gloo, cpu)
            for r in spec_rows:
                g = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
                k = round(r["proposed"] / r["verify_steps"]) if r["verify_steps"] else 0
                predicted = CostModel(config, plan, fitted[min(fitted)]).speculative_token_time(
                    min(g, 0.999), draft_tokens=k, context=context) if k else None
                r["predicted"] = predicted["speedup"] if predicted else 1.0
                r["g"] = g
                r["k"] = k
            print_table("speculative decoding on the 2-stage shard set (serving engine, one stream, greedy); "
                        "predicted = the cost model's speed-up at the measured acceptance g and mean k per verify "
                        "step (per-layer overhead fitted on 1-rank decode at batch 1)",
                        spec_rows,
                        [("prompt", "prompt    ", "s"), ("drafter", "drafter              ", "s"),
                         ("tokens", "tokens", "d"), ("proposed", "proposed", "d"), ("accepted", "accepted", "d"),
                         ("accepted_per_verify", "acc/verify", ".2f"), ("tokens_per_s", "tokens/s", ".1f"),
                         ("speedup", "speed-up", ".2f"), ("predicted", "predicted", ".2f"), ("g", "g", ".2f"),
                         ("k", "k", "d"), ("same_output", "same", "")])
        if "split" in sections:
            split_rows = dense_split_rows(ckpt, config, opts, gloo, cpu, fitted, context)
            print_table("dense split inside a host: one process, 2 ranks as 2 pipeline stages, 2 ranks splitting "
                        "each layer's attention, shared experts and LM head (routed experts expert-parallel); "
                        "ms per decode round (every stream one token); error = measured / predicted", split_rows,
                        [("layout", "layout                 ", "s"), ("link", "link          ", "s"),
                         ("streams", "streams", "d"), ("tps", "tokens/s", ".1f"), ("measured_ms", "measured ms", ".1f"),
                         ("predicted_ms", "predicted ms", ".1f"), ("error", "error", ".2f"),
                         ("same", "same tokens", "s")])
        if "engine" in sections:
            engine_rows = []
            for stages in stage_counts:
                for link_name in opts.links.split(","):
                    engine_rows += engine_runs(ckpt, config, stages, link_name, opts)
            print_table(f"the serving engine (LocalEngine) over pipeline stages, {opts.streams} concurrent greedy "
                        f"requests of {opts.engine_tokens} tokens (prompts {opts.prompt}.."
                        f"{opts.prompt + opts.streams - 1} tokens); micro-batches = EngineSettings.micro_batches (1: one step at a time); ratio = "
                        "tokens/s over micro-batches 1; same tokens = as micro-batches 1; load = 1-minute load "
                        "average after the run", engine_rows,
                        [("stages", "stages", "d"), ("link", "link          ", "s"), ("micro", "micro-batches", "d"),
                         ("tps", "tokens/s", ".1f"), ("ratio", "ratio", ".2f"), ("same", "same tokens", "s"),
                         ("in_flight", "most in flight", "d"), ("load", "load", ".2f")])
        print(f"\nload average at the end: {os.getloadavg()}")


def engine_runs(ckpt, config, stages: int, link_name: str, opts) -> list[dict]:
    """--streams greedy requests at once through LocalEngine on one shard set, micro_batches 1 and `stages`."""
    tokenizer = load_tokenizer(ckpt, config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, config.vocab_size, (opts.prompt + i,), generator=g).tolist()
               for i in range(opts.streams)]
    sampling = SamplingParams(max_tokens=opts.engine_tokens, ignore_eos=True)

    async def one(engine, prompt):
        return [ev.token_id async for ev in engine.generate(GenerationRequest(prompt, sampling))
                if isinstance(ev, TokenEvent)]

    async def run(model, micro_batches: int):
        settings = EngineSettings(max_context=config.max_position_embeddings, max_concurrent_sequences=opts.streams,
                                  micro_batches=micro_batches)
        async with LocalEngine(Borrowed(model), tokenizer, settings, engine_kind="sharded") as engine:
            await one(engine, prompts[0][:4])  # warm-up
            t0 = time.perf_counter()
            tokens = await asyncio.gather(*(one(engine, p) for p in prompts))
            return time.perf_counter() - t0, tokens, engine.most_steps_in_flight

    rows = []
    with ShardedModel(ckpt, shards=stages, mode="pipeline", threads_per_rank=1, timeouts=TIMEOUTS,
                      link=LINKS[link_name]) as model:
        results = {}
        for m in (1, stages):
            results[m] = asyncio.run(run(model, m))
            seconds, tokens, in_flight = results[m]
            rows.append(dict(stages=stages, link=link_name, micro=m, tps=sum(map(len, tokens)) / seconds,
                             ratio=results[1][0] / seconds, same="yes" if tokens == results[1][1] else "no",
                             in_flight=max(in_flight, 1), load=os.getloadavg()[0]))
    return rows


SPLIT_LAYOUTS = {"1 process": dict(shards=1, mode="pipeline"), "2 ranks, pipeline": dict(shards=2, mode="pipeline"),
                 "2 ranks, dense split": dict(shards=2, mode="expert", dense_split=2)}


def split_plan(config, layout: dict, link: LinkEmulation, gloo: dict, cpu: tuple[float, float]):
    """The layout's plan with the measured loopback (plus the emulated link) and this CPU, for the cost model."""
    bandwidth = gloo["bandwidth"] if link.gbps <= 0 else min(gloo["bandwidth"], link.gbps * 1e9 / 8)
    plan = local_plan(config, layout["mode"], layout["shards"], 0, gloo["alpha"] + link.latency_ms / 1e3, bandwidth,
                      *cpu)
    return plan.with_dense_split(config, layout.get("dense_split", 1))


def dense_split_rows(ckpt, config, opts, gloo, cpu, fitted, context) -> list[dict]:
    rows = []
    sizes = [1, opts.streams]
    for link_name in opts.split_links.split(","):
        link = LINKS[link_name]
        reference = {}
        for name, layout in SPLIT_LAYOUTS.items():
            if name == "1 process" and link_name != opts.split_links.split(",")[0]:
                continue  # no links to emulate
            with ShardedModel(ckpt, threads_per_rank=1, timeouts=TIMEOUTS, link=link, **layout) as model:
                results = {b: decode_streams(model, b, 1, opts.steps, opts.prompt) for b in sizes}
            plan = split_plan(config, layout, link, gloo, cpu)
            for b, (round_s, tokens) in results.items():
                reference.setdefault(b, tokens)
                predicted = CostModel(config, plan, fitted[b]).decode_round(b, 1, context)["round_s"]
                rows.append(dict(layout=name, link=link_name if layout["shards"] > 1 else "-", streams=b,
                                 tps=b / round_s, measured_ms=round_s * 1e3, predicted_ms=predicted * 1e3,
                                 error=round_s / predicted, same="yes" if tokens == reference[b] else "no"))
    return rows


if __name__ == "__main__":
    main()
