"""`python neurons/miner.py` and `python localnet/cheats/miner.py` as real processes: start-up from
flags, endpoint publication on a devnet file, signed generations, and a clean SIGTERM shutdown that
lets an open stream finish. Both processes start at once so that their start-up times overlap."""
import asyncio
import os
import signal
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import aiohttp
import pytest

from benchmarks.hostile import published_url
from protocol.client import MinerClient
from protocol.schemas import FinalMessage, GenerateRequest, TokenMessage
from protocol.signature import verify_final

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0  # two cold Python processes importing torch on a busy 2-core machine
PROMPT = [(5 * j + 1) % 256 for j in range(16)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, free_port):
    root = tmp_path_factory.mktemp("miner_process")
    checkpoint = tiny_checkpoint
    wallets = make_wallets(root / "wallets", ("owner", "miner", "cheater", "validator"))
    devnet = root / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ("miner", "cheater", "validator"), {"validator": 100.0})

    def command(script: str, wallet: str, metrics_port: int, *extra: str) -> list[str]:
        return [sys.executable, str(ROOT / script), "--network", f"devnet:{devnet}", "--netuid", str(netuid),
                "--wallet-name", wallet, "--wallet-hotkey", "default", "--wallet-path", str(root / "wallets"),
                "--engine", "reference", "--checkpoint", str(checkpoint), "--max-context", "512",
                "--max-concurrent", "2", "--host", "127.0.0.1", "--port", "0", "--external-ip", "127.0.0.1",
                "--metrics-port", str(metrics_port), "--nonce-store", str(root / f"{wallet}-nonces.sqlite"),
                "--min-validator-stake", "5", "--metagraph-refresh-s", "2", "--shutdown-grace-s", "30", *extra]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           # An environment variable sets what no flag gives: the request-budget window.
           "K3_MINER_BUDGET_WINDOW_S": "30", "K3_LOG_LEVEL": "DEBUG"}
    ports = {"miner": free_port(), "cheater": free_port()}
    processes = {
        "miner": subprocess.Popen(command("neurons/miner.py", "miner", ports["miner"]), env=env, cwd=root,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
        "cheater": subprocess.Popen(command("localnet/cheats/miner.py", "cheater", ports["cheater"],
                                            "--cheat", "inflate"), env=env, cwd=root,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
    }
    yield dict(root=root, devnet=devnet, netuid=netuid, wallets=wallets, processes=processes, metrics=ports)
    for process in processes.values():
        if process.poll() is None:
            process.kill()
        process.wait(10)


async def miner_url(setup, name: str) -> str:
    """Wait until the process has published its endpoint on the devnet; its URL."""
    process = setup["processes"][name]
    return await published_url(setup["devnet"], setup["netuid"], setup["wallets"][name].hotkey.ss58_address, process,
                               lambda: process.stdout.read().decode(errors="replace"), START_TIMEOUT_S)


def stop_and_collect(process: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=timeout_s)
    return process.returncode, output.decode(errors="replace")


async def test_the_miner_process_publishes_serves_and_drains_on_sigterm(setup):
    url = await miner_url(setup, "miner")
    assert url.startswith("http://127.0.0.1:")
    miner_hotkey = setup["wallets"]["miner"].hotkey.ss58_address
    async with MinerClient(setup["wallets"]["validator"].hotkey) as client:
        assert (await client.health(url)).status == "ok"
        result = await client.generate(url, miner_hotkey, GenerateRequest(
            request_id="p-1", prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0))
        assert verify_final(result.final, result.body, result.token_ids, miner_hotkey)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{setup['metrics']['miner']}/metrics") as response:
                assert 'k3_miner_requests_total{endpoint="generate",status="200"} 1.0' in await response.text()

        # SIGTERM while a stream is open: the stream still ends with its final event, then the process exits 0.
        process = setup["processes"]["miner"]
        events = []
        request = GenerateRequest(request_id="p-2", prompt_token_ids=PROMPT, max_tokens=30, temperature=0.0)
        async with aclosing(client.stream_generate(url, miner_hotkey, request)) as stream:
            async for timed in stream:
                events.append(timed.event)
                if len(events) == 1:
                    process.send_signal(signal.SIGTERM)
    assert isinstance(events[0], TokenMessage) and isinstance(events[-1], FinalMessage)
    assert events[-1].usage.completion_tokens == 30
    output, _ = await asyncio.to_thread(process.communicate, timeout=60)
    log = output.decode(errors="replace")
    assert process.returncode == 0, log
    assert "SIGTERM: shutting down" in log and "miner stopped" in log
    assert "--budget-window-s=30.0" in log  # the environment variable reached the settings
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            await session.get(url + "/health")


async def test_the_cheating_miner_script_serves_its_cheat(setup):
    url = await miner_url(setup, "cheater")
    hotkey = setup["wallets"]["cheater"].hotkey.ss58_address
    async with MinerClient(setup["wallets"]["validator"].hotkey) as client:
        result = await client.generate(url, hotkey, GenerateRequest(
            request_id="c-1", prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0))
    assert len(result.token_ids) == 4 and result.final.usage.completion_tokens > 4  # inflated
    assert verify_final(result.final, result.body, result.token_ids, hotkey)
    code, log = await asyncio.to_thread(stop_and_collect, setup["processes"]["cheater"])
    assert code == 0, log
    assert "CHEATING MINER: cheat=inflate" in log
