"""Single-stream tokens/s and TTFT of an N-stage swarm vs the single-process model, on loopback and with
emulated link delays (`benchmarks/swarm.py`).

Every link of the route (driver -> stage 1, stage i -> stage i+1, stage N -> driver) goes through a
`DelayLink` with one-way delay RTT/2, so a token's traversal costs (N + 1) one-way delays plus compute C.
The table compares the measured time per decoded token with the two models:
  chain:  C + (N + 1) x RTT / 2   (this route's one-way chain)
  law:    C + N x RTT              (g / (N x RTT + C) with g = 1, the request-response form)
where C (compute and software per token) is fitted as the smallest measured time minus the chain's link
time over the rows; the RTTs are measured in interleaved rounds. Per token the table gives the
minimum gap between consecutive tokens over all repeats (the estimate least disturbed by other load on a
shared machine) and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_cuts(num_layers: int, block_size: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous ranges [a, b) cut at Attention Residuals block boundaries where possible."""
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    for i in range(1, stages):
        snapped = round(bounds[i] / block_size) * block_size
        if bounds[i - 1] < snapped < num_layers:
            bounds[i] = snapped
    return list(zip(bounds, bounds[1:]))


def launch_stages(checkpoint: Path, ranges: list[str], wallet_path: Path, names: list[str], workdir: Path,
                  ports: list[int] | None = None, public_urls: list[str] | None = None, threads: int = 1,
                  extra: list[str] | None = None, timeout_s: float = 300.0) -> tuple[list[subprocess.Popen], list[dict]]:
    """Start one stage miner process per range (in parallel) and wait until each listens."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs, ready = [], []
    for i, (layers, name) in enumerate(zip(ranges, names)):
        path = workdir / f"{name}.ready"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "neurons.stage_miner", "--checkpoint", str(checkpoint),
               "--serve-layers", layers, "--wallet-name", name, "--wallet-path", str(wallet_path),
               "--threads", str(threads), "--ready-file", str(path), *(extra or [])]
        if ports:
            cmd += ["--port", str(ports[i])]
        if public_urls:
            cmd += ["--public-url", public_urls[i]]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(workdir / f"{name}.log", "w")))
        ready.append(path)
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in ready):
        for p, name in zip(procs, names):
            if p.poll() is not None:
                stop_processes(procs)
                raise RuntimeError(f"stage {name} exited: {(workdir / f'{name}.log').read_text()[-1500:]}")
        if time.monotonic() > deadline:
            stop_processes(procs)
            raise RuntimeError(f"stage miners not ready within {timeout_s} s")
        time.sleep(0.2)
    return procs, [json.loads(p.read_text()) for p in ready]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _one_generation(engine, prompt: list[int], n: int) -> tuple[float, list[float]]:
    """TTFT (ms) and the gaps between consecutive tokens (s) of one greedy generation."""
    from inference.decoding.sampling import SamplingParams  # noqa: PLC0415
    from inference.serving.engine import FinalEvent, GenerationRequest  # noqa: PLC0415

    t0 = time.perf_counter()
    stamps = []
    async for ev in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True))):
        if isinstance(ev, FinalEvent):
            break
        stamps.append(time.perf_counter())
    return (stamps[0] - t0) * 1000.0, [b - a for a, b in zip(stamps, stamps[1:])]


async def _measure(engine, prompt, n, repeats) -> dict:
    """Best TTFT; per decoded token the minimum gap (the least disturbed by other load on the machine) and the
    median gap, over every token of every repeat."""
    await _one_generation(engine, prompt, n)  # warm
    ttfts, gaps = [], []
    for _ in range(repeats):
        ttft, g = await _one_generation(engine, prompt, n)
        ttfts.append(ttft)
        gaps += g
    gaps.sort()
    return {"ttft_ms": min(ttfts), "min_ms": gaps[0] * 1000.0, "median_ms": gaps[len(gaps) // 2] * 1000.0}


async def start_delayed_route(ckpt: Path, config, tokenizer, work: Path, args):
    """`args.stages` stage miners cut at block boundaries, each behind a `DelayLink` (and one in front of the
    route driver), and a RouteEngine over them (not started). Returns (ranges, links with the driver's last,
    processes, engine)."""
    import bittensor as bt  # noqa: PLC0415

    from localnet.linkproxy import DelayLink  # noqa: PLC0415
    from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory  # noqa: PLC0415

    ranges = [f"{a}-{b - 1}" for a, b in block_cuts(config.num_layers, config.attn_res_block_size, args.stages)]
    names = [f"stage{i}" for i in range(len(ranges))] + ["driver"]
    wallets = {}
    for name in names:
        w = bt.Wallet(name, "default", path=str(work / "wallets"))
        w.create_new_hotkey(use_password=False, suppress=True)
        wallets[name] = w
    links = [DelayLink(free_port()) for _ in names]
    for link in links:
        await link.start()
    try:
        procs, infos = launch_stages(ckpt, ranges, work / "wallets", names[:-1], work,
                                     ports=[link.target[1] for link in links[:-1]],
                                     public_urls=[link.url for link in links[:-1]], threads=args.threads,
                                     extra=["--hop-timeout-s", "30", "--device", getattr(args, "device", "cpu"),
                                            "--dtype", getattr(args, "dtype", "auto")])
    except BaseException:
        for link in links:
            await link.close()
        raise
    driver = RouteDriver(StaticDirectory([i["url"] for i in infos], timeout_s=30.0), wallets["driver"].hotkey,
                         config, port=links[-1].target[1], public_url=links[-1].url, hop_timeout_s=30.0)
    return ranges, links, procs, RouteEngine(driver, tokenizer, prefill_chunk=args.prefill_chunk)


async def run_bench(args) -> list[dict]:
    from inference.model.checkpoint import make_random_checkpoint, read_config  # noqa: PLC0415
    from inference.model.config import ModelConfig  # noqa: PLC0415
    from inference.model.tokenizer import load_tokenizer  # noqa: PLC0415
    from inference.serving.builders import load_reference_model  # noqa: PLC0415
    from inference.serving.engine import EngineSettings  # noqa: PLC0415
    from inference.serving.local_engine import LocalEngine  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="bench_swarm_"))
    ckpt = Path(args.checkpoint) if args.checkpoint else work / "ckpt"
    if not args.checkpoint:
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    config = read_config(ckpt)
    tokenizer = load_tokenizer(ckpt, config)
    prompt = [(13 * j + 7) % 256 for j in range(args.prompt_tokens)]
    rows = []

    model, tok, _ = load_reference_model(ckpt, verify=False, device=args.device)
    local = LocalEngine(model, tok, EngineSettings(max_context=1024, max_concurrent_sequences=1))
    async with local:
        rows.append({"setup": "single process", "rtt_ms": 0.0,
                     **await _measure(local, prompt, args.new_tokens, args.repeats)})

    ranges, links, procs, engine = await start_delayed_route(ckpt, config, tokenizer, work, args)
    driver_link, links = links[-1], links[:-1]
    try:
        async with engine:
            await _one_generation(engine, prompt, args.new_tokens)  # warm
            # rounds over every RTT, so that changes in the machine's load spread over all of them
            ttfts = {rtt: [] for rtt in args.rtts_ms}
            gaps = {rtt: [] for rtt in args.rtts_ms}
            for _ in range(args.repeats):
                for rtt in args.rtts_ms:
                    for link in links + [driver_link]:
                        link.delay_s = rtt / 2000.0
                    ttft, g = await _one_generation(engine, prompt, args.new_tokens)
                    ttfts[rtt].append(ttft)
                    gaps[rtt] += g
            for rtt in args.rtts_ms:
                g = sorted(gaps[rtt])
                rows.append({"setup": f"{len(ranges)}-stage swarm", "rtt_ms": rtt, "ttft_ms": min(ttfts[rtt]),
                             "min_ms": g[0] * 1000.0, "median_ms": g[len(g) // 2] * 1000.0})
    finally:
        stop_processes(procs)
        for link in links + [driver_link]:
            await link.close()
    swarm_rows = [r for r in rows if r["setup"] != "single process"]
    # C: compute and software per token, from the least disturbed row
    C = min(r["min_ms"] - (len(ranges) + 1) * r["rtt_ms"] / 2 for r in swarm_rows)
    for r in swarm_rows:
        r["chain_model_ms"] = C + (len(ranges) + 1) * r["rtt_ms"] / 2
        r["law_model_ms"] = C + len(ranges) * r["rtt_ms"]
    return rows


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) used so far by these processes and this one (Linux /proc; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = time.process_time()
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


async def _speculative_generation(engine, prompt: list[int], n: int, pids: list[int] = ()) -> dict:
    """One greedy generation: TTFT, decode tokens/s (tokens after the first over the time after the first),
    the CPU seconds of the driver and the stage processes `pids` over the decode, the rewind round trips, and
    the final event's draft counts."""
    from inference.decoding.sampling import SamplingParams  # noqa: PLC0415
    from inference.serving.engine import FinalEvent, GenerationRequest  # noqa: PLC0415

    t0 = time.perf_counter()
    stamps, final, cpu0 = [], None, None
    messages = engine.driver.rewind_messages
    async for ev in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True))):
        if isinstance(ev, FinalEvent):
            final = ev
            break
        stamps.append(time.perf_counter())
        if cpu0 is None:
            cpu0 = cpu_seconds(list(pids))
    return {"ttft_ms": (stamps[0] - t0) * 1000.0, "tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "cpu_s": cpu_seconds(list(pids)) - cpu0, "tokens": len(stamps) - 1,
            "rewind_messages": engine.driver.rewind_messages - messages,
            "proposed": final.draft_proposed, "accepted": final.draft_accepted, "steps": final.verify_steps}


PROMPTS = {"repeating": [65, 66] * 10, "novel": [(13 * j + 7) % 256 for j in range(20)]}
CODE_LIKE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef "  # tokenized per model


def speculation_kinds(args) -> list[str]:
    """What each round runs: plain, speculation (the rewind rides on the next forward), with --rewind-message
    also speculation with the separate rewind round trip (how it was before), and with --always-wrong a
    drafter whose every guess is wrong (the worst case adaptive k must keep near plain speed)."""
    return ["none", args.speculate] + ([args.speculate + "+rewind-msg"] if args.rewind_message else []) \
        + (["always-wrong"] if args.always_wrong else [])


def always_wrong(vocab_size: int):
    """A drafter factory whose drafts are never the greedy token: it guesses the last token + 1, which a
    greedy route almost never emits right after (checked: the drafts accepted are reported)."""
    from inference.decoding.drafters import Draft, Drafter  # noqa: PLC0415

    class Wrong(Drafter):
        def propose(self, history, k):
            return Draft([(int(history[-1]) + 1) % vocab_size] * k)
    return lambda prompt: Wrong()


async def run_speculation_bench(args) -> list[dict]:
    """Speculation on vs off over one N-stage route, side by side: for every RTT and prompt, generations with
    `--speculate` drafts and without alternate (interleaved rounds), the best decode tokens/s of each."""
    from inference.decoding.distilled import speculation_with_table  # noqa: PLC0415
    from inference.decoding.speculation import SpeculationConfig  # noqa: PLC0415
    from inference.model.checkpoint import fingerprint, make_random_checkpoint, read_config  # noqa: PLC0415
    from inference.model.config import ModelConfig  # noqa: PLC0415
    from inference.model.tokenizer import load_tokenizer  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="bench_swarm_spec_"))
    ckpt = Path(args.checkpoint) if args.checkpoint else work / "ckpt"
    if not args.checkpoint:
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    config = read_config(ckpt)
    tokenizer = load_tokenizer(ckpt, config)
    # a distilled table is checked against the checkpoint before any stage starts
    spec = speculation_with_table(SpeculationConfig(drafter=args.speculate, max_draft_tokens=args.draft_tokens),
                                  args.draft_model, fingerprint(ckpt))
    ranges, links, procs, engine = await start_delayed_route(ckpt, config, tokenizer, work, args)
    wrong = SpeculationConfig(max_draft_tokens=args.draft_tokens, drafter_factory=always_wrong(config.vocab_size))
    prompts = {**PROMPTS, "code-like": tokenizer.encode(CODE_LIKE, add_bos=True)}
    prompts = {name: prompts[name] for name in args.prompts}
    rows = []
    try:
        async with engine:
            await _speculative_generation(engine, PROMPTS["novel"], args.new_tokens)  # warm
            runs: dict[tuple, list[dict]] = {}
            for _ in range(args.repeats):
                for rtt in args.rtts_ms:
                    for link in links:
                        link.delay_s = rtt / 2000.0
                    for prompt in prompts:
                        for kind in speculation_kinds(args):
                            engine.speculation = None if kind == "none" else wrong if kind == "always-wrong" \
                                else spec
                            engine.driver.rewind_in_forward = not kind.endswith("+rewind-msg")
                            runs.setdefault((rtt, prompt, kind), []).append(
                                await _speculative_generation(engine, prompts[prompt], args.new_tokens,
                                                              [p.pid for p in procs]))
            for (rtt, prompt, kind), rs in runs.items():
                best = max(rs, key=lambda r: r["tps"])
                rows.append({"stages": len(ranges), "rtt_ms": rtt, "prompt": prompt, "speculate": kind,
                             "ttft_ms": min(r["ttft_ms"] for r in rs), "tps": best["tps"],
                             "tps_median": sorted(r["tps"] for r in rs)[len(rs) // 2],
                             "cpu_ms_per_token": 1000.0 * sum(r["cpu_s"] for r in rs) / sum(r["tokens"] for r in rs),
                             "rewind_messages": best["rewind_messages"],
                             "proposed": best["proposed"], "accepted": best["accepted"], "steps": best["steps"]})
    finally:
        stop_processes(procs)
        for link in links:
            await link.close()
    return rows


def print_speculation_table(rows: list[dict], args) -> None:
    print(f"# bench_swarm --speculate {args.speculate}: tiny model, {rows[0]['stages'] if rows else '?'} stages, "
          f"{args.new_tokens} generated (greedy), best of {args.repeats}; "
          f"{os.cpu_count()}-core CPU, torch threads {args.threads} per stage; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| RTT per link (ms) | prompt | speculate | decode tokens/s (best) | median | speed-up (best) | "
          "CPU ms per token (all processes) | CPU-time speed-up | drafts accepted / proposed | verify steps | "
          "rewind round trips | TTFT (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    plain = {(r["rtt_ms"], r["prompt"]): r for r in rows if r["speculate"] == "none"}
    for r in rows:
        base = plain[(r["rtt_ms"], r["prompt"])]
        drafts = f"{r['accepted']} / {r['proposed']}" if r["speculate"] != "none" else "-"
        print(f"| {r['rtt_ms']:g} | {r['prompt']} | {r['speculate']} | {r['tps']:.1f} | {r['tps_median']:.1f} | "
              f"{r['tps'] / base['tps']:.2f}x | {r['cpu_ms_per_token']:.1f} | "
              f"{base['cpu_ms_per_token'] / r['cpu_ms_per_token']:.2f}x | {drafts} | {r['steps']} | "
              f"{r['rewind_messages']} | {r['ttft_ms']:.0f} |")


def print_table(rows: list[dict], args) -> None:
    print(f"# bench_swarm: tiny model, prompt {args.prompt_tokens} tokens, {args.new_tokens} generated, "
          f"{args.repeats} repeats; {os.cpu_count()}-core CPU, torch threads {args.threads} per stage; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| setup | RTT per link (ms) | TTFT (ms) | ms/token min | tokens/s at min | ms/token median | "
          "chain model C+(N+1)RTT/2 | law C+N*RTT |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        chain = f"{r['chain_model_ms']:.1f}" if "chain_model_ms" in r else "-"
        law = f"{r['law_model_ms']:.1f}" if "law_model_ms" in r else "-"
        print(f"| {r['setup']} | {r['rtt_ms']:g} | {r['ttft_ms']:.1f} | {r['min_ms']:.1f} | "
              f"{1000.0 / r['min_ms']:.1f} | {r['median_ms']:.1f} | {chain} | {law} |")


def run_shard_bench(args) -> list[dict]:
    """One block (all layers of the checkpoint) in process, expert parallel and as a pipeline over
    --shard-ranks local processes: start time, median single-token sampled forward after a prefill, how soon
    a forward notices a SIGKILLed shard, and how long `restart_shards` takes."""
    from inference.model.checkpoint import make_random_checkpoint, read_config  # noqa: PLC0415
    from inference.model.config import ModelConfig  # noqa: PLC0415
    from inference.swarm.stage import Stage, StageError  # noqa: PLC0415

    ckpt = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="shard-bench-")) / "ckpt"
    if not args.checkpoint:
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    last = read_config(ckpt).num_layers - 1
    prompt = torch.tensor([(11 * j + 5) % 256 for j in range(args.prompt_tokens)])
    rows = []
    layouts = [("in process", {})] + [(f"{mode} x{args.shard_ranks}", dict(shard_ranks=args.shard_ranks,
                                       shard_mode=mode, threads_per_rank=args.threads))
                                      for mode in ("expert", "pipeline")]
    for name, options in layouts:
        t0 = time.perf_counter()
        stage = Stage.from_checkpoint(ckpt, f"0-{last}", **options)
        row = {"layout": name, "start_s": time.perf_counter() - t0}
        try:
            stage.open("bench")
            stage.forward("bench", 0, prompt, mode="sample")
            gaps = []
            for position in range(len(prompt), len(prompt) + args.new_tokens):
                t0 = time.perf_counter()
                stage.forward("bench", position, torch.tensor([7]), mode="sample")
                gaps.append(time.perf_counter() - t0)
            row["forward_ms"] = sorted(gaps)[len(gaps) // 2] * 1000.0
            if stage.sharded:
                os.kill(stage.model.pids[1], signal.SIGKILL)
                t0 = time.perf_counter()
                try:
                    stage.forward("bench", len(prompt) + args.new_tokens, torch.tensor([7]), mode="sample")
                except StageError:
                    row["noticed_ms"] = (time.perf_counter() - t0) * 1000.0
                t0 = time.perf_counter()
                stage.restart_shards()
                row["restart_s"] = time.perf_counter() - t0
        finally:
            stage.shutdown()
        rows.append(row)
    return rows


def print_shard_table(rows: list[dict], args) -> None:
    print(f"# bench_swarm --shard-restart: tiny model, one block of every layer, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} single-token forwards; {os.cpu_count()}-core CPU, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| block layout | start (s) | single-token forward, median (ms) | killed shard noticed (ms) | restart (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        noticed = f"{r['noticed_ms']:.0f}" if "noticed_ms" in r else "-"
        restart = f"{r['restart_s']:.1f}" if "restart_s" in r else "-"
        print(f"| {r['layout']} | {r['start_s']:.1f} | {r['forward_ms']:.1f} | {noticed} | {restart} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="", help="checkpoint dir (default: a fresh tiny one)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--rtts-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0, 10.0, 30.0])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the single process and every stage miner "
                                                   "compute there (several stages share one GPU)")
    p.add_argument("--speculate", default="none", choices=("none", "ngram", "suffix", "distilled"),
                   help="compare speculative decoding with these drafts against plain decoding on the route "
                        "(distilled: the draft table of --draft-model, made for --checkpoint)")
    p.add_argument("--draft-model", default="", help="with --speculate distilled: the draft table "
                                                     "scripts/distill_drafter.py made for --checkpoint")
    p.add_argument("--draft-tokens", type=int, default=8, help="with --speculate: most tokens drafted per step")
    p.add_argument("--prompts", type=lambda s: s.split(","), default=["repeating", "novel"],
                   help="with --speculate: which of repeating,novel,code-like")
    p.add_argument("--always-wrong", action="store_true",
                   help="with --speculate: also run a drafter whose every guess is wrong")
    p.add_argument("--rewind-message", action="store_true",
                   help="with --speculate: also run speculation with the separate rewind round trip")
    p.add_argument("--shard-restart", action="store_true",
                   help="instead: one block in process, expert parallel and as a pipeline over --shard-ranks local "
                        "processes (forward time, a killed shard noticed, the restart)")
    p.add_argument("--shard-ranks", type=int, default=2, help="with --shard-restart: local processes per block")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args(argv)
    from inference.decoding.distilled import DraftModelMismatch, draft_model_problems  # noqa: PLC0415

    for problem in draft_model_problems(args.speculate, args.draft_model):
        p.error(problem)
    torch.set_num_threads(args.threads)
    if args.shard_restart:
        rows = run_shard_bench(args)
        print_shard_table(rows, args)
    elif args.speculate != "none":
        try:
            rows = asyncio.run(run_speculation_bench(args))
        except DraftModelMismatch as error:
            p.error(str(error))
        print_speculation_table(rows, args)
    else:
        rows = asyncio.run(run_bench(args))
        print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
