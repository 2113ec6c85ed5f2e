"""Benchmark of a miner under hostile clients (issue 12), on loopback: a real miner process (tiny checkpoint,
devnet), measured from outside. Prints a table:

- miner RSS growth while N slow unauthenticated connections are open (N = 16, 64, 256);
- time for the miner to close a slow-header connection;
- p50/p99 of a signed legitimate generation while 300 slow clients are connected;
- in-process engine: time from a scheduler failure to health "down", and to serving again.
"""
from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bittensor as bt
import psutil

from benchmarks.probe_miner import Probe
from chain.devnet import DevnetChain

ROOT = Path(__file__).resolve().parent.parent


def _wallet(root: Path, name: str) -> bt.Wallet:
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


async def _subnet(devnet: Path, wallets: dict) -> int:
    chain = DevnetChain(devnet, create=True, block_interval=1.0)
    try:
        netuid = await chain.create_subnet(wallets["owner"], tempo=10_000)
        for name in ("miner", "validator"):
            await chain.register(wallets[name], netuid)
        await chain.add_stake(wallets["validator"], wallets["validator"], netuid, 100.0)
        return netuid
    finally:
        await chain.close()


async def published_url(devnet: Path, netuid: int, hotkey: str, process: subprocess.Popen,
                        output: Callable[[], str], timeout_s: float = 150.0) -> str:
    """The URL a starting miner `process` publishes for `hotkey` on the devnet, once it has (also used by
    the tests that start miner processes); RuntimeError with the end of its `output()` when it exits
    first, or when `timeout_s` passes."""
    chain = DevnetChain(devnet)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the miner exited ({process.returncode}): {output()[-2000:]}")
            neuron = (await chain.metagraph(netuid)).by_hotkey(hotkey)
            if neuron.endpoint is not None:
                return neuron.endpoint.url
            await asyncio.sleep(0.25)
    finally:
        await chain.close()
    raise RuntimeError(f"the miner did not publish its endpoint within {timeout_s:g} s")


async def _slow_clients(host: str, port: int, n: int) -> list[socket.socket]:
    """n connections, each having sent part of a request line and nothing more, spread over source addresses
    127.0.0.2.. (at most 30 per address, under the per-address cap)."""
    loop = asyncio.get_running_loop()
    out = []
    for i in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((f"127.0.0.{2 + i // 30}", 0))
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), 2)
            await loop.sock_sendall(s, b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 66060288\r\n")
            out.append(s)
        except (OSError, TimeoutError):
            s.close()
    return out


async def _miner_numbers(rows: list[tuple[str, str]]) -> None:
    from inference.model import ModelConfig, make_random_checkpoint  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wallets = {n: _wallet(root / "wallets", n) for n in ("owner", "miner", "validator")}
        devnet = root / "devnet.sqlite"
        netuid = await _subnet(devnet, wallets)
        make_random_checkpoint(ModelConfig.tiny(), root / "ckpt", seed=0)
        command = [sys.executable, str(ROOT / "neurons/miner.py"), "--network", f"devnet:{devnet}", "--netuid",
                   str(netuid), "--wallet-name", "miner", "--wallet-path", str(root / "wallets"), "--engine",
                   "reference", "--checkpoint", str(root / "ckpt"), "--max-context", "512", "--max-concurrent", "4",
                   "--host", "127.0.0.1", "--port", "0", "--external-ip", "127.0.0.1", "--no-metrics",
                   "--nonce-store", str(root / "nonces.sqlite"), "--min-validator-stake", "5",
                   "--metagraph-refresh-s", "2", "--budget-requests", "100000", "--budget-min-requests", "10000",
                   "--header-timeout-s", "5", "--body-timeout-s", "10", "--max-connections", "512"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        log = open(root / "miner.log", "wb")
        process = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = await published_url(devnet, netuid, wallets["miner"].hotkey.ss58_address, process,
                                      lambda: (root / "miner.log").read_text(errors="replace"))
            await asyncio.sleep(2.5)
            host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
            probe = Probe(url, wallets["validator"].hotkey, wallets["miner"].hotkey.ss58_address)
            await probe.legitimate("warm-up")
            rss = psutil.Process(process.pid)
            for n in (16, 64, 256):
                before = rss.memory_info().rss
                held = await _slow_clients(host, port, n)
                await asyncio.sleep(1.0)
                grown = rss.memory_info().rss - before
                rows.append((f"RSS growth, {n} slow unauthenticated connections ({len(held)} connected)",
                             f"{grown / 2**20:.1f} MiB"))
                for s in held:
                    s.close()
                await asyncio.sleep(0.5)
            check = await probe.slow_client("headers")
            rows.append(("time to close a slow-header connection (header deadline 5 s)", check.detail))
            held = await _slow_clients(host, port, 300)
            latencies = []
            for i in range(30):
                started = time.monotonic()
                result = await probe.legitimate(f"attack-{i}")
                if result.passed:
                    latencies.append(time.monotonic() - started)
            for s in held:
                s.close()
            latencies.sort()
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
            rows.append((f"legitimate generate (2 tokens) during {len(held)} slow clients: p50 / p99",
                         f"{statistics.median(latencies) * 1000:.0f} / {p99 * 1000:.0f} ms "
                         f"({len(latencies)}/30 ok)"))
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


async def _engine_numbers(rows: list[tuple[str, str]]) -> None:
    import torch  # noqa: PLC0415

    from inference.model import ByteTokenizer, KimiK3Model, ModelConfig  # noqa: PLC0415
    from inference.serving import EngineSettings, GenerationRequest, LocalEngine, SamplingParams  # noqa: PLC0415

    config = ModelConfig.tiny()
    torch.manual_seed(0)
    model, tokenizer = KimiK3Model(config).eval(), ByteTokenizer.from_config(config)
    async with LocalEngine(model, tokenizer, EngineSettings(max_context=512), model_fingerprint="bench") as engine:
        async def serve_one():
            return [e async for e in engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=1)))]
        await serve_one()
        started = time.monotonic()
        engine._task.cancel()  # the scheduler dies
        while engine.health().ok:
            await asyncio.sleep(0.001)
        down = time.monotonic() - started
        while engine.scheduler_restarts == 0:
            await asyncio.sleep(0.001)
        await serve_one()
        back = time.monotonic() - started
    rows.append(("scheduler killed -> health down", f"{down * 1000:.0f} ms"))
    rows.append(("scheduler killed -> serving again (watchdog every 0.5 s)", f"{back * 1000:.0f} ms"))


def main() -> int:
    rows: list[tuple[str, str]] = []
    asyncio.run(_miner_numbers(rows))
    asyncio.run(_engine_numbers(rows))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  value")
    print("-" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
