"""Benchmark the embedded devnet: set-weights round trip, metagraph read, and an epoch via the devnet.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.chain [--uids 256] [--validators 64] [--calls 200]

Every figure goes through `DevnetChain` (asyncio -> worker thread -> SQLite in WAL mode on a temp file);
"epoch via devnet" is a whole epoch transaction (load state, Yuma, store results, bonds and history),
"yuma alone" is `chain.yuma.run_epoch` on the same inputs.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bittensor.sp_core import ss58_encode

from chain.devnet import DevnetChain, epoch_blocks
from chain.yuma import EpochInputs, YumaParams, run_epoch


def stats(samples_s: list[float]) -> tuple[float, float]:
    ms = np.array(samples_s) * 1e3
    return float(ms.mean()), float(np.percentile(ms, 99))


async def bench(args) -> list[tuple[str, str]]:
    rng = np.random.default_rng(0)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # A frozen clock (very long blocks): the benchmark moves it with advance_blocks.
        chain = DevnetChain(Path(tmp) / "bench.sqlite", block_interval=1e6, create=True)
        owner = ss58_encode(os.urandom(32))
        netuid = await chain.create_subnet(owner, tempo=1000, max_uids=args.uids, weights_rate_limit=0,
                                           max_validators=args.validators)
        hotkeys = [ss58_encode(os.urandom(32)) for _ in range(args.uids)]
        start = time.perf_counter()
        for hotkey in hotkeys:
            await chain.register_hotkey(netuid, hotkey, owner)
        rows.append((f"register {args.uids} uids", f"{(time.perf_counter() - start) / args.uids * 1e3:.2f} ms each"))
        for hotkey in hotkeys[: args.validators]:
            await chain.add_stake(owner, hotkey, netuid, float(rng.uniform(1, 100)))
        await chain.advance_blocks(1)  # weights must postdate the miners' registration

        miners = list(range(args.validators, args.uids))
        row = {uid: float(w) for uid, w in zip(miners, rng.random(len(miners)))}
        samples = []
        for _ in range(args.calls):
            t = time.perf_counter()
            await chain.set_weights(hotkeys[0], netuid, row, 0)
            samples.append(time.perf_counter() - t)
        mean, p99 = stats(samples)
        rows.append((f"set_weights round trip ({len(row)} weights, {args.calls} calls)",
                     f"mean {mean:.2f} ms  p99 {p99:.2f} ms"))

        samples = []
        for _ in range(max(20, args.calls // 4)):
            t = time.perf_counter()
            snapshot = await chain.metagraph(netuid)
            samples.append(time.perf_counter() - t)
        assert len(snapshot) == args.uids
        mean, p99 = stats(samples)
        rows.append((f"metagraph read ({args.uids} uids)", f"mean {mean:.2f} ms  p99 {p99:.2f} ms"))

        for hotkey in hotkeys[: args.validators]:
            weights = {uid: float(w) for uid, w in zip(miners, rng.random(len(miners)))}
            await chain.set_weights(hotkey, netuid, weights, 0)
        await chain.set_hyperparameter(netuid, "tempo", 10)
        epoch_times, yuma_times = [], []
        for _ in range(args.epochs):
            block = await chain.block()
            target = epoch_blocks(netuid, 10, block, block + 20)[0]
            # Yuma alone on the state the epoch will see.
            snapshot = await chain.metagraph(netuid)
            n = len(snapshot)
            w = np.zeros((n, n), dtype=np.int64)
            for uid, targets in (await chain.weights(netuid)).items():
                w[uid, list(targets)] = list(targets.values())
            b = np.zeros((n, n), dtype=np.int64)
            for uid, targets in (await chain.bonds(netuid)).items():
                b[uid, list(targets)] = list(targets.values())
            inputs = EpochInputs(
                block=target, stake=np.array([x.stake for x in snapshot.neurons]),
                last_update=np.array([x.last_update for x in snapshot.neurons]),
                block_at_registration=np.array([x.block_at_registration for x in snapshot.neurons]),
                validator_permit=np.array([x.validator_permit for x in snapshot.neurons]), weights=w, bonds=b,
                registered_since_last_epoch=np.zeros(n, bool), emission_budget=10.0,
            )
            t = time.perf_counter()
            run_epoch(inputs, YumaParams(max_validators=args.validators))
            yuma_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            await chain.advance_blocks(target - block)  # runs the epoch inside this transaction
            epoch_times.append(time.perf_counter() - t)
            assert (await chain.last_epoch(netuid)).block == target
        mean, p99 = stats(epoch_times)
        rows.append((f"epoch via devnet ({args.uids} uids, {args.validators} validators, {args.epochs} epochs)",
                     f"mean {mean:.1f} ms  max {max(epoch_times) * 1e3:.1f} ms"))
        mean, _ = stats(yuma_times)
        rows.append(("  of which yuma alone", f"mean {mean:.1f} ms"))
        await chain.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--uids", type=int, default=256)
    p.add_argument("--validators", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args()
    if not 1 <= args.validators <= args.uids:
        p.error("--validators must be between 1 and --uids")
    rows = asyncio.run(bench(args))
    width = max(len(name) for name, _ in rows)
    print(f"{'measurement':<{width}}  result")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
