"""A miner in front of a remote engine that does not answer, as a real process on a devnet: /health answers 503
(down, and why), nothing is published on chain, a warning comes every few seconds; once the server answers, the
miner publishes its endpoint and /health answers 200. A server whose model metadata contradicts the miner's
settings (a shorter context than --max-context) is refused at start with one line."""
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from chain.devnet import DevnetChain

MODEL = "kimi-k3"
START_TIMEOUT_S = 90.0  # a cold Python process importing torch on a busy 2-core machine


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet):
    root = tmp_path_factory.mktemp("engine_wait")
    wallets = make_wallets(root / "wallets", ("owner", "miner"))
    devnet = root / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ("miner",))
    return dict(root=root, wallets=wallets, devnet=devnet, netuid=netuid)


def start_miner(world, checkpoint: Path, remote_port: int, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "neurons.miner", "--network", f"devnet:{world['devnet']}",
               "--netuid", str(world["netuid"]), "--wallet-name", "miner", "--wallet-path", str(world["root"] / "wallets"),
               "--engine", "remote", "--remote-url", f"http://127.0.0.1:{remote_port}", "--remote-model", MODEL,
               "--checkpoint", str(checkpoint), "--max-context", "512", "--host", "127.0.0.1", "--port", str(port),
               "--external-ip", "127.0.0.1", "--no-metrics", "--metagraph-refresh-s", "1",
               "--nonce-store", str(log.with_suffix(".nonces.sqlite"))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=world["root"])


async def health(port: int) -> tuple[int, dict] | None:
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status, await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def published(world) -> bool:
    chain = DevnetChain(world["devnet"])
    try:
        me = (await chain.metagraph(world["netuid"])).by_hotkey(world["wallets"]["miner"].hotkey.ss58_address)
        return me is not None and me.endpoint is not None
    finally:
        await chain.close()


async def models_server(port: int, max_model_len: int) -> web.AppRunner:
    """What vLLM answers on /v1/models once it serves the model."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                              "max_model_len": max_model_len}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def until(condition, timeout_s: float, what: str, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what} within {timeout_s:.0f} s; the miner's log:\n{log.read_text()[-3000:]}")


async def test_a_miner_before_a_dead_engine_is_down_and_unpublished_until_the_engine_answers(world, tiny_checkpoint,
                                                                                             free_port):
    remote, port, log = free_port(), free_port(), world["root"] / "dead.log"
    process = start_miner(world, tiny_checkpoint, remote, port, log)
    server = None
    try:
        status, body = await until(lambda: health(port), START_TIMEOUT_S, "no /health answer", log)
        assert status == 503 and body["status"] == "down", body
        assert "the engine is not serving" in body["detail"] and "cannot reach" in body["detail"]
        # a warning every few seconds, and still nothing on chain
        await until(lambda: log.read_text().count("endpoint is not published") >= 2, 20, "no second warning", log)
        assert not await published(world)
        assert (await health(port))[0] == 503

        server = await models_server(remote, 512)  # the engine comes up: the miner publishes on its own
        await until(lambda: published(world), 30, "the endpoint was not published once the engine answered", log)
        assert (await health(port))[0] == 200
        assert "the engine serves after" in log.read_text()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
        if server is not None:
            await server.cleanup()
    assert code == 0, log.read_text()[-3000:]


async def test_a_server_with_a_shorter_context_is_refused_at_start(world, tiny_checkpoint, free_port):
    remote, port, log = free_port(), free_port(), world["root"] / "short.log"
    server = await models_server(remote, 256)
    try:
        process = start_miner(world, tiny_checkpoint, remote, port, log)
        code = await asyncio.to_thread(process.wait, START_TIMEOUT_S)
    finally:
        await server.cleanup()
    lines = log.read_text().strip().splitlines()
    assert code == 2, lines
    assert "error:" in lines[-1] and "context of 256 tokens" in lines[-1] and "--max-context 512" in lines[-1]
