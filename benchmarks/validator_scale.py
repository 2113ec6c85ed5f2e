#!/usr/bin/env python3
"""A validator that verifies a model ~4x larger than its memory: what each check costs it, next to what the
checked miner spent on the same tokens.

    k3-checkpoint --preset kimi_k3_scaled --out ckpt/k3-scaled --max-shard-mb 2048   # 12.8 GB, once
    python -m benchmarks.validator_scale --checkpoint ckpt/k3-scaled --reference-memory 3 --phase both

This process is the validator: it never holds the model, only its block reference (inference/swarm/
block_reference.py, `--reference-memory` GiB of weights read from the checkpoint on disk), and drives the
validator's own code paths against real miner processes, one kind at a time (the two do not fit in memory at
once on a 24 GB machine):

1. **A whole-model miner** (`python -m neurons.miner`, the project's engine in bf16, committing its states every
   `--commit-layers` layers) on a devnet made in a temporary directory answers `--answers` greedy requests;
   each answer is opened (scoring/openings.py `StateOpenings.open`, one committed block per opening, spread over
   the model by `--openings`) and judged.
2. **A local swarm** (`localnet.cheats.stage` hosts, honest, bf16 with a bf16 wire, `--stages` blocks) carries
   `--sessions` sessions of the validator's route driver (neurons/validator_app/stage_rounds.py); every stage of
   every session is checked after the fact from the ledgers on the same block reference.

Per check the table gives the validator's CPU and wall seconds, the weight bytes it read from disk, the most
weight bytes its reference held and its process's peak resident memory (VmHWM, reset before each check), and the
checked miner's CPU seconds for the same tokens (its process's CPU time over the answer or the session) with
both sides' compute in FLOPs (2 x active parameters x tokens). At the end: the validator process's peak resident
memory over the whole run, which must stay under --reference-memory + 1 GiB.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import bittensor as bt
import torch

from chain.devnet import DevnetChain
from inference.model import DeviceError, load_tokenizer, read_config, resolve_device
from inference.swarm.block_reference import BlockReference, reset_rss_peak, rss_peak
from localnet.cheats.stage import start_hosts, stop_hosts
from neurons.swarm.route import StaticDirectory
from neurons.validator_app.stage_rounds import StageMiner, StageRounds
from neurons.validator_app.store import ValidatorStore
from protocol.client import ClientTimeouts, MinerClient
from protocol.schemas import GenerateRequest
from scoring.openings import StateOpenings

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def _wallet(root: Path, name: str):
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and the threads it runs), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


# ------------------------------------------------------------------ 1. the whole-model miner
async def start_miner(args, root: Path):
    """(the miner process, its URL, its hotkey, the validator's wallet, the devnet) once it serves."""
    wallets = {name: _wallet(root / "wallets", name) for name in ("owner", "miner", "validator")}
    chain = DevnetChain(root / "devnet.sqlite", create=True, block_interval=1.0)
    netuid = await chain.create_subnet(wallets["owner"], tempo=10_000)
    for name in ("miner", "validator"):
        await chain.register(wallets[name], netuid)
    await chain.add_stake(wallets["validator"], wallets["validator"], netuid, 10_000.0)
    cmd = [sys.executable, "-m", "neurons.miner", "--network", f"devnet:{root / 'devnet.sqlite'}", "--netuid",
           str(netuid), "--wallet-name", "miner", "--wallet-path", str(root / "wallets"), "--engine", "reference",
           "--checkpoint", str(args.checkpoint), "--dtype", "bfloat16", "--commit-layers", str(args.commit_layers),
           "--host", "127.0.0.1", "--port", str(args.miner_port), "--no-publish", "--no-metrics", "--nonce-store",
           str(root / "nonces.sqlite"), "--min-validator-stake", "1", "--max-concurrent", "1",
           "--first-event-timeout-s", "3600", "--stall-timeout-s", "3600", "--forward-stall-s", "3600"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    log = open(root / "miner.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.miner_port}"
    deadline = time.monotonic() + args.load_timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the miner exited: {(root / 'miner.log').read_text()[-3000:]}")
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                proc.terminate()
                raise RuntimeError(f"the miner did not serve within {args.load_timeout_s} s")
            await asyncio.sleep(2.0)
    return proc, url, wallets["miner"].hotkey.ss58_address, wallets["validator"], chain


async def whole_model_phase(args, reference: BlockReference, rows: list[dict]) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-validator-scale-"))
    config = reference.config
    proc, url, miner_hotkey, validator, chain = await start_miner(args, root)
    rng = random.Random(args.seed)
    try:
        timeouts = ClientTimeouts(connect=10, first_byte=3600, between_events=3600, total=7200)
        async with MinerClient(validator.hotkey, timeouts) as client:
            openings = StateOpenings(reference, client, rate=1.0, timeouts=timeouts, rng=random.Random(args.seed))
            blocks = len(range(args.commit_layers, config.num_layers, args.commit_layers)) + 1
            picks = [round(i * (blocks - 1) / max(1, args.openings - 1)) for i in range(args.openings)]
            for k, block in enumerate(picks):
                ids = prompt(rng, args.prompt_tokens)
                request = GenerateRequest(request_id=f"scale-{k}", prompt_token_ids=ids, max_tokens=args.max_tokens,
                                          temperature=0.0, logprobs=1)
                cpu0 = process_cpu_s(proc.pid)
                result = await client.generate(url, miner_hotkey, request)
                miner_cpu = process_cpu_s(proc.pid) - cpu0
                record = await openings.open(ids, result, "bfloat16", url=url, hotkey=miner_hotkey, block=block)
                c, v = record.cost, record.verdict
                a, b = record.block
                stats = v.state
                rows.append(dict(check=f"opening layers {a}-{b - 1}", tokens=record.positions, passed=v.passed,
                                 reason=v.reason or (f"median rel L2 {stats.median:.3g}, {stats.bad} far off; head "
                                                     f"median {v.head.median:.3g} nats" if stats and v.head else ""), cpu_s=c.cpu_s if c else None, wall_s=record.wall_s,
                                 bytes_read=c.bytes_read if c else None,
                                 peak_resident=c.peak_resident_bytes if c else None,
                                 peak_rss=c.peak_rss_bytes if c else None, received=record.bytes_received,
                                 miner_cpu_s=miner_cpu, miner_wall_s=result.final.timings.total_ms / 1000.0,
                                 check_flops=record.check_flops, checked_flops=record.checked_flops))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        await chain.close()


# ------------------------------------------------------------------ 2. the local swarm
async def swarm_phase(args, reference: BlockReference, rows: list[dict]) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-validator-swarm-"))
    config = reference.config
    L = config.num_layers
    cuts = [round(i * L / args.stages) for i in range(args.stages + 1)]
    names = [f"s{i}" for i in range(args.stages)]
    for name in [*names, "validator"]:
        _wallet(root / "wallets", name)
    hosts = {n: [f"{n}:honest:{a}-{b - 1}:bfloat16:bfloat16"] for n, a, b in zip(names, cuts, cuts[1:])}
    procs, info = start_hosts(args.checkpoint, root / "wallets", hosts, root, timeout_s=args.load_timeout_s,
                              threads=args.threads, extra={n: ["--hop-timeout-s", str(args.hop_timeout_s)]
                                                           for n in names})
    store = ValidatorStore(root / "validator.sqlite")
    keypair = bt.Wallet("validator", "default", path=str(root / "wallets")).hotkey
    tokenizer = load_tokenizer(args.checkpoint, config)
    directory = StaticDirectory([info[n]["url"] for n in names], timeout_s=60.0)
    sr = StageRounds(store, keypair, reference, tokenizer, directory, config, seed=args.seed,
                     max_tokens=args.max_tokens, max_prompt_tokens=args.prompt_tokens, timeout_s=args.hop_timeout_s)
    try:
        await sr.start()
        await sr._ensure_model()
        infos = {i.hotkey: i for i in await directory.stages(sr._http)}
        sr.miners = {v["hotkey"]: StageMiner(k, v["hotkey"], "cold-" + n, infos[v["hotkey"]])
                     for k, (n, v) in enumerate(info.items())}
        store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, layers=m.label, url=m.info.url)
                                 for m in sr.miners.values()])
        pids = {info[n]["hotkey"]: procs[n].pid for n in names}
        for s in range(args.sessions):
            cpu0 = {h: process_cpu_s(p) for h, p in pids.items()}
            started = time.monotonic()
            if await sr.drive_session() != 1:
                raise RuntimeError("the validator's session found no route through the swarm")
            stage_cpu = {h: process_cpu_s(p) - cpu0[h] for h, p in pids.items()}
            session_wall = time.monotonic() - started
            before = len(store.stage_checks())
            await sr.settle()
            for r in store.stage_checks()[before:]:
                if r["kind"] not in ("session_check", "session_lie", "unchecked"):
                    continue
                rows.append(dict(check=f"stage {r['layers']} (session {s})", tokens=r["tokens"],
                                 passed=bool(r["passed"]), reason=r["reason"], cpu_s=r["cpu_s"], wall_s=r["wall_s"],
                                 bytes_read=r["weights_read"], peak_resident=r["peak_resident"],
                                 peak_rss=r["peak_rss"], received=r["bytes_read"],
                                 miner_cpu_s=stage_cpu.get(r["hotkey"]), miner_wall_s=session_wall,
                                 check_flops=r["check_flops"], checked_flops=r["checked_flops"]))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await sr.close()
        stop_hosts(procs)
        store.close()


# ------------------------------------------------------------------ the table
def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _comparison(reason: str) -> str:
    """The check's statistics, from its reason (a stage check's: after "matched the reference")."""
    text = reason or ""
    return text.split("matched the reference ", 1)[1] if "matched the reference " in text else text[:120]


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict], budget_gib: float, peak_rss: int | None) -> str:
    head = ("| check | tokens | passed | validator CPU s | wall s | weights read GB | peak held GB | peak RSS GB | "
            "miner CPU s (same tokens) | CPU share | FLOP share | comparison |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        share = (r["cpu_s"] / r["miner_cpu_s"]) if r["cpu_s"] and r["miner_cpu_s"] else None
        flops = (r["check_flops"] / r["checked_flops"]) if r["check_flops"] and r["checked_flops"] else None
        out.append(f"| {r['check']} | {r['tokens']} | {'yes' if r['passed'] else 'NO'} | "
                   f"{r['cpu_s'] or 0:.1f} | {r['wall_s'] or 0:.1f} | {_gb(r['bytes_read'])} | "
                   f"{_gb(r['peak_resident'])} | {_gb(r['peak_rss'])} | {_num(r['miner_cpu_s'], '.1f')} | "
                   f"{_num(share, '.1%')} | {_num(flops, '.1%')} | {_comparison(r['reason'])} |")
    limit = (budget_gib + 1) * GIB
    out.append("")
    out.append(f"validator process peak RSS over the run: {_gb(peak_rss)} GB (budget {budget_gib:g} GiB + 1 GiB = "
               f"{limit / 1e9:.2f} GB: {'within' if peak_rss is not None and peak_rss <= limit else 'OVER'})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.validator_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint made by k3-checkpoint")
    p.add_argument("--reference-memory", type=float, default=3.0, help="GiB of weights the block reference holds")
    p.add_argument("--device", default="cpu", help="where the block reference computes: cpu, cuda or cuda:N (its "
                   "budget is then GPU memory); the miners stay on the CPU")
    p.add_argument("--phase", choices=("miner", "swarm", "both"), default="both")
    p.add_argument("--commit-layers", type=int, default=1, help="the miner commits every N layers")
    p.add_argument("--openings", type=int, default=4, help="answers, each opened at one block (spread over the model)")
    p.add_argument("--stages", type=int, default=2, help="blocks of the local swarm")
    p.add_argument("--sessions", type=int, default=1, help="validator sessions through the swarm, each checked")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument("--miner-port", type=int, default=18391)
    p.add_argument("--load-timeout-s", type=float, default=3600.0)
    p.add_argument("--hop-timeout-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reset_rss_peak()
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        print(f"validator_scale: {error}", file=sys.stderr)
        return 2
    reference = BlockReference(args.checkpoint, int(args.reference_memory * GIB), device=device)
    model = reference.model
    print(f"{read_config(args.checkpoint).model_id}: checkpoint "
          f"{sum(f.stat().st_size for f in args.checkpoint.glob('*.safetensors')) / 1e9:.2f} GB, block reference "
          f"{args.reference_memory:g} GiB (one layer's working set {model.working_set_bytes() / 1e9:.2f} GB)",
          flush=True)
    rows: list[dict] = []

    async def run():
        if args.phase in ("miner", "both"):
            await whole_model_phase(args, reference, rows)
        if args.phase in ("swarm", "both"):
            await swarm_phase(args, reference, rows)

    asyncio.run(run())
    # each check resets the kernel's peak; the reference keeps what each reset forgot
    peak = max([reference.rss_high_water, rss_peak() or 0] + [r["peak_rss"] or 0 for r in rows])
    print(table(rows, args.reference_memory, peak))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "peak_rss": peak, "args": vars(args)}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
