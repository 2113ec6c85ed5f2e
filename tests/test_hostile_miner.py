"""A real miner process on loopback under the hostile clients of issue 12 (benchmarks/probe_miner.py): edge values,
malformed requests, 16 unauthenticated 63 MiB bodies, slow headers and bodies, and an idle-connection flood
with RLIMIT_NOFILE at 256. After every phase a signed legitimate request succeeds with a verified response
signature; the miner's memory and its log stay small."""
import asyncio
import os
import resource
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.hostile import published_url
from benchmarks.probe_miner import Probe, table
from protocol.auth import hotkey_signer

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


def low_file_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


@pytest.fixture(scope="module")
def miner(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, free_port):
    root = tmp_path_factory.mktemp("hostile_miner")
    wallets = make_wallets(root / "wallets", ("owner", "miner", "validator"))
    devnet = root / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ("miner", "validator"), {"validator": 100.0})
    log_path = root / "miner.log"
    command = [sys.executable, str(ROOT / "neurons/miner.py"), "--network", f"devnet:{devnet}", "--netuid", str(netuid),
               "--wallet-name", "miner", "--wallet-hotkey", "default", "--wallet-path", str(root / "wallets"),
               "--engine", "reference", "--checkpoint", str(tiny_checkpoint), "--max-context", "512",
               "--max-concurrent", "4", "--host", "127.0.0.1", "--port", "0", "--external-ip", "127.0.0.1",
               "--metrics-port", str(free_port()), "--nonce-store", str(root / "nonces.sqlite"),
               "--min-validator-stake", "5", "--metagraph-refresh-s", "2", "--budget-requests", "100000",
               "--budget-min-requests", "10000", "--header-timeout-s", "2", "--body-timeout-s", "4",
               "--max-connections-per-address", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=low_file_limit)
    try:
        yield dict(process=process, wallets=wallets, devnet=devnet, netuid=netuid, log=log_path)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.mark.exclusive  # the floods race the miner's accept loop: a test on the other worker slows it down
async def test_no_hostile_client_takes_the_miner_down(miner):
    url = await published_url(miner["devnet"], miner["netuid"], miner["wallets"]["miner"].hotkey.ss58_address,
                              miner["process"], lambda: miner["log"].read_text(errors="replace"), START_TIMEOUT_S)
    await asyncio.sleep(2.5)  # a metagraph refresh after publication: the validator's permit is in
    probe = Probe(url, hotkey_signer(miner["wallets"]["validator"]), miner["wallets"]["miner"].hotkey.ss58_address,
                  header_timeout_s=2.0, body_timeout_s=4.0, flood=300, flood_address="127.0.0.2")
    rss = psutil.Process(miner["process"].pid)
    assert (await probe.legitimate("start")).passed
    await probe.edge_values()
    await probe.legitimate("edge values")
    await probe.malformed()
    await probe.legitimate("malformed requests")
    before = rss.memory_info().rss
    await probe.big_bodies()
    grown = rss.memory_info().rss - before
    await probe.legitimate("big bodies")
    await probe.slow_client("headers")
    await probe.slow_client("body")
    await probe.legitimate("slow clients")
    log_before = miner["log"].read_text(errors="replace").count("\n")
    await probe.idle_flood()
    await probe.legitimate("idle flood")
    print(table(probe.checks))
    failed = [c for c in probe.checks if not c.passed]
    assert not failed, table(probe.checks)
    assert all("200 in" in c.detail for c in probe.checks if c.name.startswith("legitimate"))  # not a gate 403
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
    await asyncio.sleep(0.5)
    log = miner["log"].read_text(errors="replace")
    assert log.count("\n") - log_before <= 5, log[-3000:]
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]
    assert miner["process"].poll() is None
