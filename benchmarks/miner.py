#!/usr/bin/env python3
"""Benchmark the miner's own overheads on a tiny model (everything real, on loopback).

    python -m benchmarks.miner                      # defaults
    python -m benchmarks.miner --auth-requests 5000 --streams 8 --tokens 128 --flood 200
    python -m benchmarks.miner --checkpoint random     # the random tiny model (default: the trained one)

Prints one table:
- authentication: btauth/1 verification per request (signature + replay store), and its parts;
- streaming: the same greedy generations run directly on the engine and through the miner (signed
  request, NDJSON over loopback, response signature), next to each other; then the same through an
  engine that replays recorded events instantly, which isolates the miner's own cost per token from
  the model's (noisy) step time; plus the wire conversion of one token event alone;
- 429 under a flood: with every stream slot held by a long generation, N concurrent new connections
  each send a signed generate request from another process (so the client does not share the
  miner's event loop); time from sending to the 429, p50 and p99.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import queue
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import bittensor as bt

from chain import connect
from chain.devnet import DevnetChain
from inference.serving import (Engine, EngineSettings, EventStream, GenerationRequest, LocalEngine, SamplingParams,
                               TokenEvent as EngineTokenEvent, WrappedEngine, load_reference_model)
from neurons.base.engine_wire import token_message
from neurons.base.settings import ChainSettings
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore, sign_request, verify_request
from protocol.client import MinerClient
from protocol.schemas import GENERATE_PATH, GenerateRequest, encode_event, encode_model
from benchmarks.checkpoint_choice import add_checkpoint_argument, resolve_checkpoint


def make_wallet(root: Path, name: str):
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def bench_auth(validator, miner_hotkey: str, store_path: Path, n: int) -> list[tuple[str, str]]:
    from bittensor.sp_core import CRYPTO_SR25519, verify as sr25519_verify

    body = encode_model(GenerateRequest(request_id="bench", prompt_token_ids=list(range(64)), max_tokens=64))
    base = time.time_ns()
    signed = [sign_request(validator, "POST", GENERATE_PATH, body, miner_hotkey, nonce_ns=base + i) for i in range(n)]
    store = SQLiteNonceStore(store_path)
    started = time.perf_counter()
    for headers in signed:
        verify_request(headers, body, "POST", GENERATE_PATH, miner_hotkey, store)
    verify_us = (time.perf_counter() - started) / n * 1e6
    started = time.perf_counter()
    for i in range(n):
        store.check_and_store("bench-other", base + i)
    store_us = (time.perf_counter() - started) / n * 1e6
    payload, signature = b"x" * 200, bytes(validator.sign(b"x" * 200))
    started = time.perf_counter()
    for _ in range(n):
        sr25519_verify(payload, signature, validator.ss58_address, CRYPTO_SR25519)
    sig_us = (time.perf_counter() - started) / n * 1e6
    store.close()
    return [
        ("auth: verify_request per request (all checks)", f"{verify_us:.0f} us"),
        ("auth:   of which sr25519 verify", f"{sig_us:.0f} us"),
        ("auth:   of which SQLite replay store insert", f"{store_us:.0f} us"),
    ]


class ReplayEngine(WrappedEngine):
    """Replays events recorded from the real engine, instantly: what is left of a stream's time
    through the miner is the miner's (and loopback's) own cost."""

    def __init__(self, inner: LocalEngine):
        super().__init__(inner)
        self.recorded: dict[tuple[int, ...], list] = {}

    async def record(self, prompt: list[int], tokens: int) -> None:
        request = GenerationRequest(prompt, SamplingParams(max_tokens=tokens))
        self.recorded[tuple(prompt)] = [event async for event in self.inner.generate(request)]

    def generate(self, request: GenerationRequest) -> EventStream:
        queue: asyncio.Queue = asyncio.Queue()
        for event in self.recorded[tuple(request.prompt_token_ids)]:
            queue.put_nowait(event)
        return EventStream(queue, lambda: None)



async def timed_runs(miner: MinerServer, engine: Engine, validator, prompts, tokens: int) -> tuple[float, float]:
    """Seconds for all prompts directly on `engine`, and through `miner` (alternating, so that
    machine noise hits both alike)."""
    direct_s = miner_s = 0.0
    async with MinerClient(validator) as client:
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            async for _ in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=tokens))):
                pass
            direct_s += time.perf_counter() - started
            started = time.perf_counter()
            result = await client.generate(miner.url, miner.hotkey, GenerateRequest(
                request_id=f"b{i}", prompt_token_ids=prompt, max_tokens=tokens, temperature=0.0))
            miner_s += time.perf_counter() - started
            assert len(result.token_ids) == tokens
    return direct_s, miner_s


async def bench_streaming(miner: MinerServer, replay_miner: MinerServer, engine: LocalEngine,
                          replay: ReplayEngine, validator, streams: int, tokens: int):
    prompts = [[(7 * s + 3 * j) % 256 for j in range(32)] for s in range(streams)]
    direct_s, miner_s = await timed_runs(miner, engine, validator, prompts, tokens)
    for prompt in prompts:
        await replay.record(prompt, tokens)
    replay_direct_s, replay_miner_s = await timed_runs(replay_miner, replay, validator, prompts, tokens)
    total = streams * tokens
    event = EngineTokenEvent(3, 65, "A", -0.5, [(65, -0.5), (66, -1.5), (67, -2.0)])
    n = 20000
    started = time.perf_counter()
    for _ in range(n):
        encode_event(token_message(event))
    convert_us = (time.perf_counter() - started) / n * 1e6
    return [
        ("stream: engine alone, per token", f"{direct_s / total * 1e3:.2f} ms ({total / direct_s:.0f} tok/s)"),
        ("stream: through the miner, per token", f"{miner_s / total * 1e3:.2f} ms ({total / miner_s:.0f} tok/s)"),
        ("stream: difference per token (noisy: model steps)", f"{(miner_s - direct_s) / total * 1e6:.0f} us"),
        ("stream: miner cost per token (instant engine)",
         f"{(replay_miner_s - replay_direct_s) / total * 1e6:.0f} us"),
        ("stream: wire conversion of one token event", f"{convert_us:.1f} us"),
    ]


def flood_client(url: str, miner_hotkey: str, wallet_path: str, flood: int, go, answers) -> None:
    """In a child process: wait for `go`, then send `flood` signed requests at once, each on its own
    connection; put [(status, seconds)] on `answers`."""
    validator = bt.Wallet("validator", "default", path=wallet_path).hotkey

    async def run():
        bodies = [encode_model(GenerateRequest(request_id=f"f{i}", prompt_token_ids=[1, 2, 3], max_tokens=4,
                                               temperature=0.0)) for i in range(flood)]
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            await session.get(url + "/health")  # warm the client (DNS cache, imports)
            while not go.is_set():
                await asyncio.sleep(0.01)
            headers = [sign_request(validator, "POST", GENERATE_PATH, b, miner_hotkey, nonce_ns=time.time_ns() + i)
                       for i, b in enumerate(bodies)]

            async def one(i):
                started = time.perf_counter()
                try:
                    async with session.post(url + GENERATE_PATH, data=bodies[i],
                                            headers={**headers[i], "Content-Type": "application/json"}) as response:
                        await response.read()
                        return response.status, time.perf_counter() - started
                except aiohttp.ClientError:  # the listener's per-address cap closes the connection unanswered
                    return "closed", time.perf_counter() - started

            return await asyncio.gather(*(one(i) for i in range(flood)))

    answers.put(asyncio.run(run()))


def flood_answers(child, answers, timeout_s: float) -> list:
    """The flood child's results, or a clear error as soon as it dies without any."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return answers.get(True, 0.5)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the flood client exited with code {child.exitcode} before answering")
    raise TimeoutError(f"the flood client gave no answers in {timeout_s:.0f} s")


async def bench_flood(miner: MinerServer, validator, wallet_path: Path, flood: int) -> list[tuple[str, str]]:
    context = multiprocessing.get_context("spawn")
    go, answers = context.Event(), context.Queue()
    child = context.Process(target=flood_client, args=(miner.url, miner.hotkey, str(wallet_path), flood, go, answers))
    child.start()
    holder = MinerClient(validator)
    hold = GenerateRequest(request_id="hold", prompt_token_ids=[1, 2, 3], max_tokens=1000, temperature=0.0)
    holding = [asyncio.create_task(holder.generate(miner.url, miner.hotkey,
                                                   hold.model_copy(update={"request_id": f"hold{i}"})))
               for i in range(miner.capacity)]
    try:
        while miner.budgets.streams_in_flight < miner.capacity:
            await asyncio.sleep(0.01)
        go.set()
        results = await asyncio.to_thread(flood_answers, child, answers, 300.0)
    finally:
        for task in holding:
            task.cancel()
        await asyncio.gather(*holding, return_exceptions=True)
        await holder.close()
        child.join(30)
    latencies = [t * 1e3 for status, t in results if status == 429]
    counts = collections.Counter(str(status) for status, _ in results)
    closed = [t * 1e3 for status, t in results if status == "closed"]
    cap = miner.settings.server.max_connections_per_address
    return [
        (f"429 flood: {flood} concurrent connections from one address (cap {cap} per address), answers",
         ", ".join(f"{status} x {n}" for status, n in sorted(counts.items()))),
        ("429 flood: time to close past the per-address cap, p50",
         f"{percentile(closed, 50):.1f} ms" if closed else "none closed"),
        ("429 flood: time to 429, p50", f"{percentile(latencies, 50):.1f} ms"),
        ("429 flood: time to 429, p99", f"{percentile(latencies, 99):.1f} ms"),
    ]


async def main_async(args) -> list[tuple[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="bench_miner_"))
    model, tokenizer, fingerprint = load_reference_model(resolve_checkpoint(args.checkpoint, root))
    wallets = {name: make_wallet(root / "wallets", name) for name in ("owner", "miner", "validator")}
    chain = DevnetChain(root / "devnet.sqlite", create=True)
    netuid = await chain.create_subnet(wallets["owner"], tempo=10_000)
    for name in ("miner", "validator"):
        await chain.register(wallets[name], netuid)
    await chain.add_stake(wallets["validator"], wallets["validator"], netuid, 1000.0)
    await chain.close()
    validator = wallets["validator"].hotkey

    rows = bench_auth(validator, wallets["miner"].hotkey.ss58_address, root / "auth-nonces.sqlite",
                      args.auth_requests)
    miners, chains = [], []

    async def start_miner(engine: Engine, name: str) -> MinerServer:
        settings = MinerSettings(
            chain=ChainSettings(network=f"devnet:{root / 'devnet.sqlite'}", netuid=netuid),
            server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                                  nonce_store=str(root / f"{name}-nonces.sqlite"), shutdown_grace_s=0.0),
            access=AccessSettings(min_validator_stake=1.0, requests_per_window=10**6),
        )
        chain = connect(settings.chain.network)
        miner = MinerServer(settings, engine=engine, tokenizer=tokenizer, chain=chain, wallet=wallets["miner"],
                            nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        miners.append(miner)
        chains.append(chain)
        await miner.start()
        return miner

    engine = LocalEngine(model, tokenizer, EngineSettings(max_context=2048, max_concurrent_sequences=args.capacity),
                         model_fingerprint=fingerprint)
    replay = ReplayEngine(LocalEngine(model, tokenizer, EngineSettings(max_context=2048),
                                      model_fingerprint=fingerprint))
    try:
        miner = await start_miner(engine, "real")
        replay_miner = await start_miner(replay, "replay")
        rows += await bench_streaming(miner, replay_miner, engine, replay, validator, args.streams, args.tokens)
        rows += await bench_flood(miner, validator, root / "wallets", args.flood)
    finally:
        for miner in miners:
            await miner.close(grace_s=0.0)
        for chain in chains:
            await chain.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--auth-requests", type=int, default=2000, help="signed requests to verify")
    parser.add_argument("--streams", type=int, default=4, help="generations, each run directly and via the miner")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    parser.add_argument("--flood", type=int, default=200, help="concurrent connections in the 429 flood")
    parser.add_argument("--capacity", type=int, default=2, help="engine capacity (streams at once)")
    add_checkpoint_argument(parser)
    args = parser.parse_args(argv)
    rows = asyncio.run(main_async(args))
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 24}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
