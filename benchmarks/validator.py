#!/usr/bin/env python3
"""Validator CPU cost per response, and how many miners one validator can evaluate per tempo.

    python -m benchmarks.validator                       # small: tiny model, 16 responses
    python -m benchmarks.validator --checkpoint random   # the random tiny model (default: the trained one)
    python -m benchmarks.validator --responses 64 --scoring-overrides '{"chat_max_tokens": [64, 256]}'

A real miner (neurons.miner_app.server.MinerServer on loopback, on a devnet in a temp dir, with a tiny
checkpoint: the trained one unless --checkpoint says otherwise) answers a round of ordinary work from
scoring.workloads.plan_round; then, one response at a time, the validator's checks are timed with
time.process_time:
- planning a round for one miner (prompt building and tokenisation);
- receiving a response: decoding its NDJSON events (what the client does as they arrive);
- tier 0 on a response (scoring.tier0.check_tier0);
- tier-1 judging with the reference's answer already in hand: the validator's own CPU when the
  audit's scoring is done by other miners (no reference engine);
- a tier-1 audit against the validator's own reference engine on this CPU (the tiny model here;
  for Kimi K3 this part runs on the reference's GPUs).
Miners per tempo = tempo seconds x cores / validator CPU seconds per miner-round, where a
miner-round is `round_requests` responses, each planned, received, checked at tier 0 and audited
at `audit_rate`. This bounds the validator's CPU only: the wall time of the requests themselves
(the miners' speed, the round deadline) is the other limit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bittensor as bt

from chain.devnet import DevnetChain
from inference.serving import EngineSettings, LocalEngine, load_reference_model
from neurons.base.settings import ChainSettings
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore
from protocol.client import ClientTimeouts, MinerClient, MinerError
from protocol.schemas import decode_event, encode_event
from scoring.config import ScoringConfig
from scoring.tier0 import check_tier0
from scoring.tier1 import audit_tier1
from scoring.workloads import plan_round
from benchmarks.checkpoint_choice import add_checkpoint_argument, resolve_checkpoint

PRODUCTION_TEMPO_S = 360 * 12.0  # 360 blocks of 12 s


class AnswersInHand:
    """A reference whose answers were computed beforehand: timing audit_tier1 with it measures only
    the validator's own judging CPU (what remains when other miners do the scoring)."""

    trusted = True

    def __init__(self, answers):
        self.answers = answers

    async def score(self, token_ids, positions=None, top_k=0):
        return self.answers


def _wallet(root: Path, name: str):
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


def _stats(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return statistics.mean(values), statistics.median(values), p95


async def bench(args) -> None:
    overrides = json.loads(args.scoring_overrides) if args.scoring_overrides else {}
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    config = (ScoringConfig.local_testnet(**overrides) if args.profile == "local_testnet"
              else ScoringConfig(**overrides))
    root = Path(tempfile.mkdtemp(prefix="bench-validator-"))
    model, tokenizer, fingerprint = load_reference_model(resolve_checkpoint(args.checkpoint, root))
    model_config = model.config
    wallets = {name: _wallet(root / "wallets", name) for name in ("owner", "miner", "validator")}
    chain = DevnetChain(root / "devnet.sqlite", create=True, block_interval=1.0)
    netuid = await chain.create_subnet(wallets["owner"], tempo=10_000)
    for name in ("miner", "validator"):
        await chain.register(wallets[name], netuid)
    await chain.add_stake(wallets["validator"], wallets["validator"], netuid, 10_000.0)
    settings = MinerSettings(
        chain=ChainSettings(network=f"devnet:{root / 'devnet.sqlite'}", netuid=netuid),
        server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                              nonce_store=str(root / "nonces.sqlite"), shutdown_grace_s=0.0),
        access=AccessSettings(min_validator_stake=100.0, requests_per_window=100_000, min_requests=10_000),
    )
    engine_settings = EngineSettings(max_context=args.max_context, max_concurrent_sequences=args.capacity)
    miner_engine = LocalEngine(model, tokenizer, engine_settings, model_fingerprint=fingerprint)
    miner = MinerServer(settings, engine=miner_engine, tokenizer=tokenizer, chain=chain, wallet=wallets["miner"],
                        nonce_store=SQLiteNonceStore(root / "nonces.sqlite"))
    reference = LocalEngine(model, tokenizer, engine_settings, model_fingerprint=fingerprint)
    await miner.start()
    await reference.start()
    rng = random.Random(args.seed)
    rows: dict[str, list[tuple[float, int]]] = {"plan": [], "receive": [], "tier0": [], "judge": [], "audit": []}
    try:
        async with MinerClient(wallets["validator"].hotkey, ClientTimeouts(first_byte=600, between_events=120,
                                                                             total=1200)) as client:
            hotkey = wallets["miner"].hotkey.ss58_address
            caps = await client.capabilities(miner.url, hotkey)
            items = []
            while len(items) < args.responses:
                started = time.process_time()
                planned = plan_round(rng, caps, config, tokenizer=tokenizer)
                rows["plan"].append((time.process_time() - started, len(planned)))
                items += planned
            items = items[: args.responses]
            wall = time.monotonic()
            semaphore = asyncio.Semaphore(args.capacity)

            async def answer(item):
                async with semaphore:
                    try:
                        return item, await client.generate(miner.url, hotkey, item.request)
                    except MinerError as error:
                        return item, error

            answered = [(i, r) for i, r in await asyncio.gather(*(answer(i) for i in items))
                        if not isinstance(r, MinerError)]
            generation_s = time.monotonic() - wall
            for item, result in answered:  # one at a time, so process_time is this check's alone
                lines = [encode_event(timed.event) for timed in result.events]
                started = time.process_time()
                for line in lines:
                    decode_event(line)
                rows["receive"].append((time.process_time() - started, len(result.token_ids)))
                started = time.process_time()
                failures = check_tier0(item, result, tokenizer, caps, hotkey, config)
                rows["tier0"].append((time.process_time() - started, len(result.token_ids)))
                if failures:
                    print(f"warning: an honest answer failed tier 0: {failures}", file=sys.stderr)
                tokens = list(item.prompt_ids) + result.token_ids
                positions = list(range(len(item.prompt_ids), len(tokens)))
                started = time.process_time()
                answers = await reference.score(tokens, positions, config.audit_reference_top_k)
                audit = await audit_tier1(item.prompt_ids, result, AnswersInHand(answers), config,
                                          stop_ids=tokenizer.stop_ids, rng=rng)
                judged = time.process_time()
                await audit_tier1(item.prompt_ids, result, AnswersInHand(answers), config,
                                  stop_ids=tokenizer.stop_ids, rng=rng)
                rows["judge"].append((time.process_time() - judged, len(result.token_ids)))
                rows["audit"].append((judged - started, len(tokens)))
                if audit.passed is False:
                    print(f"warning: an honest answer failed its audit: {audit.failures}", file=sys.stderr)
    finally:
        await miner.close(grace_s=0.0)
        await reference.stop()
        await chain.close()

    per_response = {name: statistics.mean(s for s, _ in values) for name, values in rows.items() if values}
    plan_per_request = sum(s for s, _ in rows["plan"]) / max(1, sum(n for _, n in rows["plan"]))
    print(f"validator CPU per check, tiny model ({model_config.model_id}), profile {args.profile}, "
          f"{len(rows['tier0'])} responses (generated in {generation_s:.1f} s), time.process_time, one at a time")
    print(f"{'check':<44} {'n':>4} {'mean ms':>9} {'p50 ms':>9} {'p95 ms':>9} {'per unit us':>12}  unit")
    labels = {"plan": ("plan_round (per miner-round)", "request"),
              "receive": ("receive: decode the NDJSON events", "output token"),
              "tier0": ("tier 0 (per response)", "output token"),
              "judge": ("tier-1 judging, answers in hand (per audit)", "output token"),
              "audit": ("tier-1 audit on own reference (per audit)", "scored token")}
    for name, (label, unit) in labels.items():
        values = rows[name]
        if not values:
            continue
        mean, p50, p95 = _stats([s for s, _ in values])
        per_unit = sum(s for s, _ in values) / max(1, sum(n for _, n in values)) * 1e6
        print(f"{label:<44} {len(values):>4} {mean * 1e3:>9.2f} {p50 * 1e3:>9.2f} {p95 * 1e3:>9.2f} "
              f"{per_unit:>12.1f}  {unit}")
    tempo_s = args.tempo_s
    round_requests = config.round_requests
    for label, audit_cost in (("audits scored by other miners", per_response["judge"]),
                              ("audits on own CPU reference (tiny model)", per_response["audit"])):
        per_miner = round_requests * (plan_per_request + per_response["receive"] + per_response["tier0"]
                                      + config.audit_rate * audit_cost)
        print(f"miners per tempo ({tempo_s:.0f} s, {args.cores} core(s)), {label}: "
              f"{per_miner * 1e3:.1f} ms CPU per miner-round of {round_requests} requests at audit rate "
              f"{config.audit_rate:g} -> {int(tempo_s * args.cores / per_miner)} miners")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=16, help="responses to generate and check")
    parser.add_argument("--profile", choices=("local_testnet", "production"), default="local_testnet",
                        help="scoring profile the workloads come from (production needs a large --max-context)")
    parser.add_argument("--scoring-overrides", default='{"chat_max_tokens": [64, 96], "long_context_sizes": [2048]}',
                        help="JSON of ScoringConfig fields (the default keeps the run small)")
    parser.add_argument("--max-context", type=int, default=2560, help="the miner's and reference's context")
    parser.add_argument("--capacity", type=int, default=8, help="the miner's concurrent streams")
    parser.add_argument("--tempo-s", type=float, default=PRODUCTION_TEMPO_S, help="seconds per tempo")
    parser.add_argument("--cores", type=int, default=1, help="validator cores given to verification")
    parser.add_argument("--seed", type=int, default=0)
    add_checkpoint_argument(parser)
    args = parser.parse_args()
    if args.responses < 1:
        parser.error("--responses must be at least 1")
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
