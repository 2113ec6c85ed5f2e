"""Stage checks over the real wire (neurons/validator_app/stage_rounds.py) against real stage processes: per
stage cheater the challenges and seconds until blame, honest fp32 and bf16 stages never blamed, and the
validator's CPU per stage challenge. Prints tables.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/bench_stage_rounds.py --repeats 5 --honest 4
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import statistics
import tempfile
import time
from pathlib import Path

import bittensor as bt

from inference.model import ModelConfig, make_random_checkpoint
from inference.serving.builders import load_reference_model
from neurons.swarm.cheats import CHEATS, start_hosts, stop_hosts
from neurons.swarm.route import StaticDirectory
from neurons.validator_app.stage_rounds import StageMiner, StageRounds
from neurons.validator_app.store import ValidatorStore

BLOCKS = {"0-2": (0, 3), "3-5": (3, 6), "6-8": (6, 9), "9-12": (9, 13)}
CHEAT_BLOCK = {"other-weights": "3-5", "skip-layer": "9-12", "echo": "0-2", "session-liar": "3-5",
               "long-position-liar": "6-8", "replay": "6-8", "forwarder": "6-8"}


def hotkey(root: Path, name: str):
    w = bt.Wallet(name, "default", path=str(root))
    w.create_new_hotkey(use_password=False, suppress=True)
    return w.hotkey


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def bench(args, root: Path, ckpt: Path, info: dict, decoy_port: int) -> None:
    model, tokenizer, _ = load_reference_model(ckpt, verify=False)
    validator, decoy = hotkey(root / "wallets", "validator"), hotkey(root / "wallets", "decoy")

    async def rounds(seed: int, db: Path):
        store = ValidatorStore(db)
        sr = StageRounds(store, validator, model, tokenizer, seed=seed, max_tokens=args.max_tokens,
                         decoy_keypair=decoy, decoys={(6, 9): decoy_port})
        await sr.start()
        await sr._start_decoys()
        found = {i.hotkey: i for i in await StaticDirectory([v["url"] for v in info.values()]).stages(sr._http)}
        miners = {n: StageMiner(i, v["hotkey"], n, found[v["hotkey"]]) for i, (n, v) in enumerate(info.items())}
        sr.miners = {m.hotkey: m for m in miners.values()}
        store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, layers=m.label) for m in miners.values()])
        return store, sr, miners

    print("| stage | dtype / wire | challenges | blamed | tokens / challenge | median rel L2 | validator CPU ms / "
          "challenge (all) | of which reference + compare | wall ms / challenge |")
    print("|---|---|---|---|---|---|---|---|---|")
    store, sr, miners = await rounds(1, root / "honest.sqlite")
    try:
        for name, m in miners.items():
            if not name.startswith(("fp32", "bf16")):
                continue
            results = [await sr.challenge(m) for _ in range(args.honest)]
            rows = store.stage_checks(hotkey=m.hotkey)
            print(f"| {m.label} | {name[:4]} | {len(results)} | {sum(not r.ok for r in results)} | "
                  f"{statistics.mean(r.tokens for r in results):.0f} | "
                  f"{statistics.median(r.median_rel_l2 for r in results):.4f} | "
                  f"{statistics.mean(r['cpu_s'] for r in rows) * 1000:.0f} | "
                  f"{statistics.mean(r.validator_cpu_s for r in results) * 1000:.0f} | "
                  f"{statistics.mean(r['wall_s'] for r in rows) * 1000:.0f} |")
    finally:
        await sr.close()
        store.close()
    print("\n| cheater | block | challenges until blamed (per run) | max | seconds until blamed (per run) | caught by |")
    print("|---|---|---|---|---|---|")
    for kind, block in CHEAT_BLOCK.items():
        counts, secs, how = [], [], set()
        for run in range(args.repeats):
            store, sr, miners = await rounds(100 + run, root / f"{kind}-{run}.sqlite")
            try:
                m = miners[f"cheat-{kind}"]
                t0 = time.monotonic()
                for k in range(1, args.limit + 1):
                    await sr.challenge(m)
                    blame = store.stage_blame(m.hotkey, 0)
                    if blame:
                        counts.append(k)
                        secs.append(time.monotonic() - t0)
                        how.add(blame[-1]["kind"])
                        break
                else:
                    counts.append(None)
            finally:
                await sr.close()
                store.close()
        shown = [c if c is not None else f">{args.limit}" for c in counts]
        worst = max(c for c in counts) if all(counts) else "not caught"
        print(f"| {kind} | {block} | {shown} | {worst} | {[round(s, 1) for s in secs]} | {', '.join(sorted(how))} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="runs per cheater (a fresh validator each)")
    ap.add_argument("--honest", type=int, default=4, help="challenges per honest stage")
    ap.add_argument("--limit", type=int, default=30, help="give up on a cheater after this many challenges")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = root / "ckpt"
        make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
        names = [f"fp32-{b}" for b in BLOCKS] + [f"bf16-{b}" for b in BLOCKS] + [f"cheat-{k}" for k in CHEATS]
        for n in names:
            hotkey(root / "wallets", n)
        decoy_port = free_port()
        hosts = {"fp32": [f"fp32-{b}:honest:{b}" for b in BLOCKS],
                 "bf16": [f"bf16-{b}:honest:{b}:bfloat16:bfloat16" for b in BLOCKS]}
        procs, info = start_hosts(ckpt, root / "wallets", hosts, root)
        try:
            more, cheats = start_hosts(ckpt, root / "wallets", {"cheats": [
                f"cheat-{k}:{k}:{b}" for k, b in CHEAT_BLOCK.items()]}, root, {"cheats": [
                    "--forward-to", f"http://127.0.0.1:{decoy_port}", "--forward-to", info["fp32-6-8"]["url"]]})
            procs.update(more)
            info.update(cheats)
            print(f"stage processes ready in {time.time() - started:.0f} s\n")
            asyncio.run(bench(args, root, ckpt, info, decoy_port))
        finally:
            stop_hosts(procs)
    print(f"\n{time.time() - started:.0f} s; the forwarder hands each session to one of 2 stages of its block, one "
          "of them the validator's decoy")


if __name__ == "__main__":
    logging.getLogger("k3").setLevel(logging.ERROR)  # blame is in the tables
    main()
