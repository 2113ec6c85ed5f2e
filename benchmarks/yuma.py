"""Time one Yuma Consensus epoch (chain/yuma.py) on a full subnet; the devnet runs one per tempo.

Random dense weights from every validator to every uid, random stakes (validators hold the largest),
random stored bonds. Target: well under 1 s per epoch at 256 uids and 64 validators.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.yuma [--uids 256] [--validators 64] [--reps 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from chain.yuma import EpochInputs, YumaParams, run_epoch, weights_to_u16

TARGET_S = 1.0


def full_subnet(uids: int, validators: int, seed: int = 0) -> EpochInputs:
    rng = np.random.default_rng(seed)
    stake = np.zeros(uids)
    stake[:validators] = rng.uniform(1_000, 100_000, size=validators)
    weights = np.zeros((uids, uids), dtype=np.uint16)
    for i in range(validators):
        weights[i] = weights_to_u16(rng.random(uids))
    bonds = np.zeros((uids, uids), dtype=np.uint16)
    bonds[:validators] = rng.integers(0, 65536, size=(validators, uids))
    block = 100_000
    return EpochInputs(
        block=block,
        stake=stake,
        last_update=np.full(uids, block - 10, dtype=np.int64),
        block_at_registration=rng.integers(0, block - 100, size=uids),
        validator_permit=stake > 0,
        weights=weights,
        bonds=bonds,
        registered_since_last_epoch=np.zeros(uids, dtype=bool),
        emission_budget=1e9,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uids", type=int, default=256)
    parser.add_argument("--validators", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not 0 < args.validators <= args.uids or args.reps < 1:
        parser.error("need 0 < validators <= uids and reps >= 1")

    inputs = full_subnet(args.uids, args.validators)
    variants = {
        "yuma3": YumaParams(max_validators=args.validators),
        "yuma3 + liquid alpha": YumaParams(max_validators=args.validators, liquid_alpha=True),
        "legacy": YumaParams(max_validators=args.validators, version="legacy"),
    }
    print(f"Yuma epoch, {args.uids} uids, {args.validators} validators, {args.reps} repetitions")
    print(f"{'variant':<22} {'mean ms':>9} {'min ms':>9} {'max ms':>9}  target < {TARGET_S * 1000:.0f} ms")
    for name, params in variants.items():
        run_epoch(inputs, params)  # warm-up: first-call allocations are not the steady state
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            run_epoch(inputs, params)
            times.append(time.perf_counter() - start)
        ms = np.array(times) * 1000
        verdict = "ok" if ms.max() < TARGET_S * 1000 else "SLOW"
        print(f"{name:<22} {ms.mean():>9.2f} {ms.min():>9.2f} {ms.max():>9.2f}  {verdict}")


if __name__ == "__main__":
    main()
