"""A miner's owner benchmarks its own miner without a validator permit: the miner's --owner-hotkeys (SS58 addresses
or hotkey names of its own wallet) pass the gate with a budget of their own, and every owner request is logged.
Real HTTP on loopback, a devnet subnet on which nobody holds a validator permit, real wallets."""
import logging

import aiohttp
import bittensor as bt
import pytest

from benchmarks import endpoint as bench
from chain import connect
from inference.serving import EngineSettings, LocalEngine
from neurons.base.settings import ChainSettings, WalletSettings
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, MinerSetupError, ServerSettings
from neurons.miner_app.server import owner_hotkeys
from protocol.auth import SQLiteNonceStore
from protocol.client import MinerClient, MinerHTTPError
from protocol.schemas import GenerateRequest

OWNER_REQUESTS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, tiny_reference):
    root = tmp_path_factory.mktemp("owner")
    wallets = make_wallets(root / "wallets", ("owner", "miner", "stranger"))
    bench_key = bt.Wallet("miner", "bench", path=str(root / "wallets"))
    bench_key.create_new_hotkey(use_password=False, suppress=True)  # a second hotkey of the miner's coldkey
    netuid, _ = make_subnet(root / "devnet.sqlite", wallets, ("miner",))  # no validator at all
    return dict(root=root, ckpt=tiny_checkpoint, reference=tiny_reference, wallets=wallets, bench=bench_key,
                netuid=netuid)


def settings_of(world, tmp_path, owners=("bench",)) -> MinerSettings:
    return MinerSettings(
        wallet=WalletSettings(name="miner", hotkey="default", path=str(world["root"] / "wallets")),
        chain=ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"],
                            timeout_s=2.0),
        server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                              nonce_store=str(tmp_path / "nonces.sqlite"), shutdown_grace_s=0.0),
        access=AccessSettings(owner_hotkeys=tuple(owners), owner_requests=OWNER_REQUESTS, window_s=600.0))


@pytest.fixture
async def miner(world, tmp_path):
    settings = settings_of(world, tmp_path)
    model, tokenizer, fingerprint = world["reference"]
    engine = LocalEngine(model, tokenizer, EngineSettings(max_context=512, max_concurrent_sequences=2),
                         model_fingerprint=fingerprint, engine_kind="reference")
    chain = connect(settings.chain.network)
    server = MinerServer(settings, engine=engine, tokenizer=tokenizer, chain=chain, wallet=world["wallets"]["miner"],
                         nonce_store=SQLiteNonceStore(settings.server.nonce_store), owners=owner_hotkeys(settings))
    await server.start()
    yield server
    await server.close(grace_s=0.0)
    server.nonce_store.close()
    await chain.close()


def test_owner_hotkeys_are_addresses_or_names_in_the_miners_own_wallet(world, tmp_path):
    address = world["wallets"]["stranger"].hotkey.ss58_address
    owners = owner_hotkeys(settings_of(world, tmp_path, ("bench", address)))
    assert owners == {world["bench"].hotkey.ss58_address: "bench", address: address}
    with pytest.raises(MinerSetupError, match="--owner-hotkeys nosuch: not an SS58 address, and no hotkey file"):
        owner_hotkeys(settings_of(world, tmp_path, ("nosuch",)))


async def test_the_owner_benchmarks_its_miner_without_a_permit_and_strangers_are_refused(world, miner, tmp_path,
                                                                                         caplog):
    argv = ["--miner", miner.url, "--miner-hotkey", miner.hotkey, "--wallet-name", "miner", "--wallet-hotkey",
            "bench", "--wallet-path", str(world["root"] / "wallets"), "--tokenizer-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "32", "--output-lengths", "4", "--concurrency", "1,2", "--repeats", "1",
            "--warmup", "0", "--probes", "0", "--between-tokens-timeout-s", "60"]
    with caplog.at_level(logging.INFO, logger="k3.miner"):
        report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
    assert report["totals"] == {"requests": 3, "completed": 3, "errors": {}}
    assert report["quality"]["tier0"]["passed"] == 3  # signatures and counts checked as a validator checks them
    owner_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("owner hotkey")]
    assert len(owner_lines) >= 4 and all("(bench) calls" in line for line in owner_lines)  # capabilities + 3
    assert "POST /v1/generate" in owner_lines[-1]

    stranger = [*argv[:4], "--wallet-name", "stranger", "--wallet-hotkey", "default", *argv[8:]]
    with pytest.raises(bench.BenchmarkSetupError, match="not registered on subnet"):
        await bench.run_benchmark(bench.read_benchmark_settings(stranger, environ={}), stranger)


async def test_an_owner_hotkey_has_a_budget_of_its_own(world, miner):
    async with MinerClient(world["bench"].hotkey) as client:
        used = 0
        with pytest.raises(MinerHTTPError) as limited:
            while used <= OWNER_REQUESTS:
                await client.capabilities(miner.url, miner.hotkey)
                used += 1
        assert used == OWNER_REQUESTS and (limited.value.status, limited.value.code) == (429, "rate_limited")
        async with aiohttp.ClientSession() as http:  # the health check needs no key at all
            async with http.get(miner.url + "/health") as response:
                assert response.status == 200
    async with MinerClient(world["wallets"]["stranger"].hotkey) as client:
        with pytest.raises(MinerHTTPError) as refused:
            await client.generate(miner.url, miner.hotkey, GenerateRequest(request_id="s", prompt_token_ids=[1, 2],
                                                                            max_tokens=2))
    assert (refused.value.status, refused.value.code) == (403, "not_registered")
