"""scripts/benchmark_endpoint.py at tiny sizes against (a) a real miner on loopback (signed protocol,
devnet permit and stake, capacity 2 so that a wave of 5 gets 429s) and (b) the OpenAI-compatible
server over the reference engine, with the same checkpoint as the reference for audits and canaries."""
import asyncio
import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import bittensor as bt
import pytest
from aiohttp import web

from chain.devnet import DevnetChain
from chain.interface import connect
from inference.model import KimiK3Model, ModelConfig, make_random_checkpoint
from inference.serving import EngineSettings, LocalEngine, OpenAICompatibleServer, load_reference_model
from neurons.miner_app.server import AccessSettings, ChainSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore
from protocol.schemas import Capabilities, Limits

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig.tiny()
MODEL_NAME = "kimi-k3-tiny"
CAPACITY = 2


def load_script():
    module = importlib.import_module("neurons.benchmark")
    return module


bench = load_script()


def make_wallet(root: Path, name: str):
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


async def _make_devnet(path: Path, wallets: dict) -> int:
    chain = DevnetChain(path, create=True, block_interval=1.0)
    try:
        netuid = await chain.create_subnet(wallets["owner"], tempo=10_000)
        for name in ("validator", "miner"):
            await chain.register(wallets[name], netuid)
        await chain.add_stake(wallets["validator"], wallets["validator"], netuid, 1000.0)
        return netuid
    finally:
        await chain.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    make_random_checkpoint(CONFIG, root / "ckpt", seed=0)
    model, tokenizer, fingerprint = load_reference_model(root / "ckpt")
    wallets = {n: make_wallet(root / "wallets", n) for n in ("owner", "validator", "miner")}
    netuid = asyncio.run(_make_devnet(root / "devnet.sqlite", wallets))
    return dict(root=root, ckpt=root / "ckpt", model=model, tokenizer=tokenizer, fingerprint=fingerprint,
                wallets=wallets, netuid=netuid)


def engine_of(world) -> LocalEngine:
    return LocalEngine(world["model"], world["tokenizer"],
                       EngineSettings(max_context=512, max_concurrent_sequences=CAPACITY, step_token_budget=256),
                       model_fingerprint=world["fingerprint"], engine_kind="reference")


@pytest.fixture
async def miner(world, tmp_path):
    settings = MinerSettings(
        chain=ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"], timeout_s=2.0),
        server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                              nonce_store=str(tmp_path / "nonces.sqlite"), shutdown_grace_s=0.0),
        access=AccessSettings(min_validator_stake=5.0, requests_per_window=100_000),
    )
    chain = connect(settings.chain.network)
    server = MinerServer(settings, engine=engine_of(world), tokenizer=world["tokenizer"], chain=chain,
                         wallet=world["wallets"]["miner"], nonce_store=SQLiteNonceStore(settings.server.nonce_store))
    await server.start()
    yield server
    await server.close(grace_s=0.0)
    await chain.close()


@pytest.fixture
async def serve_openai(world):
    """Start OpenAI-compatible servers over the checkpoint's model (or another one); yields their URLs."""
    running = []

    async def start(model=None) -> str:
        engine = engine_of(world) if model is None else LocalEngine(
            model, world["tokenizer"], EngineSettings(max_context=512, max_concurrent_sequences=CAPACITY))
        await engine.start()
        runner = web.AppRunner(OpenAICompatibleServer(engine, world["tokenizer"], MODEL_NAME).app, access_log=None)
        running.append((runner, engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner, engine in running:
        await runner.cleanup()
        await engine.stop()


@pytest.fixture
async def openai_server(serve_openai):
    return await serve_openai()


def ordered(stats: dict) -> bool:
    return stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] and stats["min"] > 0


async def test_a_miner_benchmark_reports_speeds_tier0_and_429s_beyond_capacity(world, miner, tmp_path):
    argv = ["--miner", miner.url, "--miner-hotkey", miner.hotkey, "--wallet-name", "validator",
            "--wallet-hotkey", "default", "--wallet-path", str(world["root"] / "wallets"),
            "--tokenizer-checkpoint", str(world["ckpt"]), "--prompt-lengths", "32,48", "--output-lengths", "6",
            "--concurrency", "1,5", "--repeats", "1", "--seed", "3", "--probes", "0", "--out-dir", str(tmp_path)]
    settings = bench.read_benchmark_settings(argv, environ={})
    report = await bench.run_benchmark(settings, argv)
    bench.write_report(report, str(tmp_path))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert "| prompt | output | conc |" in (tmp_path / "report.md").read_text()

    assert saved["target"] == {"kind": "miner", "url": miner.url, "hotkey": miner.hotkey}
    assert saved["model_fingerprint"] == world["fingerprint"] and saved["precision"] == "float32"
    assert saved["endpoint"]["capabilities"]["max_concurrent_streams"] == CAPACITY
    assert saved["declared_concurrency"] == CAPACITY
    assert [(w["prompt_tokens"], w["concurrency"]) for w in saved["workloads"]] == [(32, 1), (32, 5), (48, 1), (48, 5)]
    for w in saved["workloads"]:
        if w["concurrency"] == 1:
            assert w["completed"] == 1 and w["errors"] == {} and not w["beyond_declared_capacity"]
            for key in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "latency_s"):
                assert ordered(w[key]), key
            assert w["aggregate_tokens_per_s"] > 0
            assert w["ttft_s"]["p50"] <= w["latency_s"]["p50"]
            assert w["prefill_tokens_per_s"]["p50"] == pytest.approx(w["prompt_tokens"] / w["ttft_s"]["p50"])
        else:
            # Five streams at a miner that serves two: the rest are refused with 429, reported as such.
            assert w["beyond_declared_capacity"] and w["requests"] == 5
            assert set(w["errors"]) == {"http_429"} and w["errors"]["http_429"] >= 1
            assert 1 <= w["completed"] and w["completed"] + w["errors"]["http_429"] == 5
            assert w["aggregate_tokens_per_s"] > 0
        assert 1 <= w["completion_tokens"]["max"] <= 6 and w["tier0_failed"] == 0
    totals = saved["totals"]
    assert totals["requests"] == 12 and totals["completed"] + totals["errors"]["http_429"] == 12
    tier0 = saved["quality"]["tier0"]
    assert tier0["checked"] == totals["completed"] == tier0["passed"] and tier0["not_applicable"] == []
    assert saved["quality"]["audits"] == {"skipped": "no --reference-checkpoint"}

    # The request set is a function of the settings and the tokenizer alone.
    caps = miner.engine.capabilities()
    declared = Capabilities(model_id="m", model_fingerprint="f", vocab_size=CONFIG.vocab_size,
                            max_context=caps.max_context, max_concurrent_streams=CAPACITY, engine="reference",
                            precision="float32", software_version="x", limits=Limits(max_tokens=511))
    again = bench.plan_cells(settings.workload, world["tokenizer"], declared)
    assert bench.request_set_digest(again) == saved["request_set_sha256"]
    other = bench.plan_cells(dataclasses.replace(settings.workload, seed=4), world["tokenizer"], declared)
    assert bench.request_set_digest(other) != saved["request_set_sha256"]
    assert all(len(r.prompt_token_ids) == c.prompt_tokens for c in again for wave in c.waves for r in wave)


async def test_an_openai_server_benchmark_with_reference_audits_and_canaries(world, openai_server, tmp_path):
    argv = ["--openai", openai_server, "--model", MODEL_NAME, "--reference-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "32", "--output-lengths", "6", "--concurrency", "1,2", "--repeats", "1",
            "--audits", "2", "--canaries", "1", "--probes", "0"]
    report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
    assert report["target"]["kind"] == "openai" and report["endpoint"]["model"]["max_model_len"] == 512
    assert report["totals"] == {"requests": 3, "completed": 3, "errors": {}}
    for w in report["workloads"]:
        assert w["completed"] == w["requests"] == w["concurrency"]
        assert ordered(w["ttft_s"]) and ordered(w["decode_tokens_per_s"]) and w["aggregate_tokens_per_s"] > 0
    tier0 = report["quality"]["tier0"]
    assert tier0 == {"checked": 3, "passed": 3, "failures": {}, "not_applicable": ["signature", "fingerprint"]}
    audits = report["quality"]["audits"]
    assert audits["audited"] == 2 and audits["passed"] == 2 and audits["failed"] == 0
    canaries = report["quality"]["canaries"]
    assert canaries["checked"] == canaries["passed"] == 1 and canaries["tokens_per_canary"] == 6
    assert report["reference_fingerprint"] == world["fingerprint"]
    table = bench.markdown_report(report)
    assert "tier-1 audits: 2 passed" in table and "| 32 | 6 | 2 | 2/2 |" in table


async def test_audits_and_canaries_catch_a_server_that_serves_other_weights(world, serve_openai):
    impostor = await serve_openai(KimiK3Model(CONFIG, seed=1).eval())  # same shape, other weights
    argv = ["--openai", impostor, "--model", MODEL_NAME, "--reference-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "32", "--output-lengths", "8", "--concurrency", "1", "--repeats", "1",
            "--warmup", "0", "--audits", "1", "--canaries", "1", "--probes", "1"]
    report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
    assert report["quality"]["tier0"]["passed"] == 1  # self-consistent: only the reference can tell
    probes = report["quality"]["probes"]  # one answer probe ran (a random model fails it; it is reported)
    assert probes["copy"]["checked"] + probes["planted_fact"]["checked"] == 1 and probes["errors"] == 0
    assert probes["tier0_failed"] == 0
    audits, canaries = report["quality"]["audits"], report["quality"]["canaries"]
    assert audits["audited"] == 1 and audits["failed"] == 1 and audits["failures"]
    assert canaries["checked"] == 1 and canaries["failed"] == 1


async def test_requests_that_cannot_fit_are_refused_before_anything_is_sent(world, openai_server):
    base = ["--openai", openai_server, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(world["ckpt"]),
            "--output-lengths", "6", "--concurrency", "1", "--repeats", "1", "--probes", "0"]
    with pytest.raises(bench.BenchmarkSetupError, match="does not fit the endpoint"):
        await bench.run_benchmark(bench.read_benchmark_settings(base + ["--prompt-lengths", "600"], environ={}))
    with pytest.raises(bench.BenchmarkSetupError, match="no room for content"):
        await bench.run_benchmark(bench.read_benchmark_settings(base + ["--prompt-lengths", "10"], environ={}))
    wrong = ["--openai", openai_server, "--model", "another", "--tokenizer-checkpoint", str(world["ckpt"])]
    with pytest.raises(bench.BenchmarkSetupError, match="does not serve 'another'"):
        await bench.run_benchmark(bench.read_benchmark_settings(wrong, environ={}))


def test_bad_command_lines_exit_2_with_a_message(world, capsys):
    with pytest.raises(SystemExit) as caught:
        bench.main(["--tokenizer-checkpoint", str(world["ckpt"])])
    assert caught.value.code == 2 and "exactly one target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--openai", "http://127.0.0.1:1", "--model", "m", "--concurrency", "1,0"])
    assert "--concurrency: invalid list of integers value" in capsys.readouterr().err
    assert bench.main(["--miner", "http://127.0.0.1:1", "--miner-hotkey", "5abc", "--wallet-name", "nobody",
                       "--wallet-path", str(world["root"] / "wallets"),
                       "--tokenizer-checkpoint", str(world["ckpt"])]) == 2
    assert "no hotkey file" in capsys.readouterr().err
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and math.isclose(bench.percentile([5.0], 99), 5.0)
