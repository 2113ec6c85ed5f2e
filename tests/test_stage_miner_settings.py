"""The swarm stage miner speaks the operator's vocabulary: btcli's flags and BT_* variables, the template's dotted
aliases, K3_STAGE_* for its own settings, clear CLI errors, usage lines naming the program as started; and a real
stage miner process (started as `python neurons/miner.py --serve-layers ...`) answers with X-Request-Id, writes
JSON access-log lines, and serves Prometheus metrics of the forwards it computed."""
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.decoding.sampling import SamplingParams
from inference.model.checkpoint import fingerprint
from inference.model.config import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving.engine import FinalEvent, GenerationRequest
from localnet.cheats.stage import stop_hosts
from neurons.stage_miner import main
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
from neurons.swarm.settings import StageMinerSettings, read_stage_miner_settings
from protocol.stage import FORWARD_PATH, HEALTH_PATH

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["--checkpoint", "/ckpt", "--serve-layers", "0-5"]


def read(argv, environ=None) -> StageMinerSettings:
    return read_stage_miner_settings(argv, environ or {}, prog="stage-test")


def test_btcli_spellings_and_template_aliases_set_the_settings():
    s = read(REQUIRED + ["-w", "alice", "-H", "hot", "--wallet-path", "/wallets", "-n", "ws://10.0.0.1:9944",
                         "--netuid", "3", "--axon.port", "9000", "--log-format", "json", "--max-body-bytes", "1MiB",
                         "--metrics", "--metrics-port", "0"])
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == ("alice", "hot", "/wallets")
    assert (s.chain.network, s.chain.netuid, s.server.port) == ("ws://10.0.0.1:9944", 3, 9000)
    assert (s.log_format, s.server.max_body_bytes, s.server.metrics, s.server.metrics_port) == ("json", 2**20, True, 0)
    assert (s.block.checkpoint, s.block.serve_layers) == ("/ckpt", "0-5")
    s = read(REQUIRED + ["--wallet.name", "bob", "--wallet.hotkey", "hk", "--wallet.path", "/w",
                         "--subtensor.network", "local"])
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path, s.chain.network) == ("bob", "hk", "/w", "local")


def test_environment_fills_what_no_flag_gives():
    environ = {"BT_WALLET": "env-wallet", "BT_WALLET_HOTKEY": "env-hot", "BT_WALLET_PATH": "/env/wallets",
               "BT_NETWORK": "test", "K3_NETUID": "7", "K3_STAGE_CHECKPOINT": "/env/ckpt",
               "K3_STAGE_SERVE_LAYERS": "4-5", "K3_STAGE_METRICS": "yes", "K3_STAGE_HOP_TIMEOUT_S": "2.5",
               "K3_LOG_LEVEL": "debug"}
    s = read([], environ)
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == ("env-wallet", "env-hot", "/env/wallets")
    assert (s.chain.network, s.chain.netuid) == ("test", 7)
    assert (s.block.checkpoint, s.block.serve_layers, s.server.metrics) == ("/env/ckpt", "4-5", True)
    assert (s.server.hop_timeout_s, s.log_level) == (2.5, "DEBUG")
    assert read(["-w", "flag-wallet"], environ).wallet.name == "flag-wallet"  # a flag wins over the environment


def test_defaults_are_the_stage_miners_former_ones():
    s = read(REQUIRED)
    assert (s.server.host, s.server.port, s.server.public_url, s.server.external_ip, s.server.external_port) == (
        "127.0.0.1", 0, "", "", 0)
    assert (s.chain.network, s.chain.netuid) == ("", None)  # announce nothing
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == (
        "default", "default", "~/.bittensor/wallets")  # open_wallet expands it
    b = s.block
    assert (b.dtype, b.wire_dtype, b.threads, b.max_sessions, b.max_context, b.max_tokens_per_forward) == (
        "auto", "float32", 0, 16, 4096, 512)  # auto: float32 on the CPU, as before
    assert b.device == "cpu"
    assert (b.idle_expiry_s, b.max_snapshots, b.rewind_window) == (300.0, 16, 1024)
    assert (b.shard_ranks, b.shard_mode) == (1, "expert")
    assert (s.server.hop_timeout_s, s.server.max_body_bytes, s.server.metrics, s.log_level) == (
        5.0, 64 * 2**20, False, "WARNING")


@pytest.mark.parametrize("argv, environ, says", [
    (["--serve-layers", "0-5"], {}, "--checkpoint is required"),
    (REQUIRED + ["-n", "mars"], {}, "'mars' is not a network"),
    (REQUIRED, {"K3_STAGE_PORT": "eighty"}, "environment variable K3_STAGE_PORT='eighty' (for --port)"),
    (REQUIRED + ["--max-sessions", "0"], {}, "must be an integer >= 1"),
    (REQUIRED + ["--wire-dtype", "int8"], {}, "invalid choice: 'int8'"),
    (REQUIRED + ["--shard-mode", "tensor"], {}, "invalid choice: 'tensor'"),
])
def test_bad_values_are_cli_errors(capsys, argv, environ, says):
    with pytest.raises(SystemExit) as exit_info:
        read(argv, environ)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_the_shard_layout_comes_from_flags_or_environment():
    s = read(REQUIRED + ["--shard-ranks", "4", "--shard-mode", "pipeline"])
    assert (s.block.shard_ranks, s.block.shard_mode) == (4, "pipeline")
    s = read(REQUIRED, {"K3_STAGE_SHARD_RANKS": "2", "K3_STAGE_SHARD_MODE": "pipeline"})
    assert (s.block.shard_ranks, s.block.shard_mode) == (2, "pipeline")


def test_a_pipeline_with_more_ranks_than_layers_is_a_one_line_error(capsys, tiny_checkpoint):
    argv = ["--checkpoint", str(tiny_checkpoint), "--serve-layers", "0-1", "--shard-ranks", "3", "--shard-mode",
            "pipeline"]
    assert main(argv, prog="sm") == 2
    err = capsys.readouterr().err
    assert err.startswith("sm: error: ") and "needs at least 3 layers" in err and "Traceback" not in err


def test_network_without_netuid_is_refused_before_anything_loads(capsys, tmp_path):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--serve-layers", "0-1", "-n", "local"], prog="sm") == 2
    assert "sm: error: --network needs --netuid" in capsys.readouterr().err


def test_a_missing_checkpoint_is_a_one_line_error(capsys, tmp_path):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--serve-layers", "0-1"], prog="sm") == 2
    err = capsys.readouterr().err
    assert err.startswith("sm: error: ") and "Traceback" not in err


def run_help(*args) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, *args, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_names_the_program_as_started_and_lists_btcli_flags():
    out = run_help("-m", "neurons.stage_miner")
    assert out.startswith("usage: python -m neurons.stage_miner ")
    out = run_help("neurons/miner.py", "--serve-layers", "0-5")
    assert out.startswith("usage: python neurons/miner.py ")
    for text in ("-w NAME", "-H NAME", "-n NETWORK", "--wallet.name", "--axon.port", "env BT_WALLET;",
                 "env K3_STAGE_SERVE_LAYERS;", "--log-format {text,json}", "--metrics-port PORT"):
        assert text in out, text


# ---------------------------------------------------------------- a real stage miner process
@pytest.fixture(scope="module")
def stage_process(tiny_checkpoint, tmp_path_factory, make_wallet):
    root = tmp_path_factory.mktemp("stage_ops")
    make_wallet(root / "wallets", "stage")
    driver = make_wallet(root / "wallets", "driver")
    ready, log = root / "stage.ready", root / "stage.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "BT_WALLET_HOTKEY": "default",
           "BT_WALLET_PATH": str(root / "wallets"), "K3_STAGE_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "neurons/miner.py", "--serve-layers", "0-12", "--checkpoint", str(tiny_checkpoint),
             "-w", "stage", "--metrics", "--metrics-port", "0", "--log-format", "json", "--log-level", "INFO",
             "--ready-file", str(ready)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the stage miner exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stage miner was not ready in 120 s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield {"info": json.loads(ready.read_text()), "proc": proc, "log": log, "driver": driver,
               "checkpoint": tiny_checkpoint}
    finally:
        stop_hosts({"stage": proc})


def samples(text: str) -> dict:
    """{(metric sample name, frozenset of labels): value} of a Prometheus exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_stage_miner_process_is_observable(stage_process):
    info = stage_process["info"]
    config = ModelConfig.tiny()
    prompt = [(5 * j + 2) % 256 for j in range(11)]

    async def drive():
        driver = RouteDriver(StaticDirectory([info["url"]]), stage_process["driver"].hotkey, config,
                             hop_timeout_s=3.0)
        engine = RouteEngine(driver, load_tokenizer(stage_process["checkpoint"], config), prefill_chunk=16,
                             model_fingerprint=fingerprint(stage_process["checkpoint"]))
        async with engine:
            tokens, final = [], None
            async for event in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=3,
                                                                                         ignore_eos=True))):
                if isinstance(event, FinalEvent):
                    final = event
                else:
                    tokens.append(event.token_id)
            scored = await engine.score(prompt + tokens)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.post(info["url"] + FORWARD_PATH, data=b"unsigned") as unsigned:
                refused = (unsigned.status, unsigned.headers.get("X-Request-Id"))
            async with http.get(info["url"] + HEALTH_PATH, headers={"X-Request-Id": "ops-test-1"}) as health:
                echoed = health.headers.get("X-Request-Id")
            async with http.get(info["metrics_url"]) as answer:
                metrics = (answer.status, answer.headers.get("X-Request-Id"), await answer.text())
        return tokens, final, scored, refused, echoed, metrics

    tokens, final, scored, refused, echoed, (status, metrics_id, text) = asyncio.run(drive())
    assert len(tokens) == 3 and final is not None and scored
    assert refused[0] == 401 and refused[1]  # a refusal carries a request id too
    assert echoed == "ops-test-1"
    assert status == 200 and metrics_id
    assert info["metrics_url"].startswith("http://127.0.0.1:")

    got = samples(text)

    def value(name, **labels):
        return got.get((name, frozenset({"layers": "0-12", **labels}.items())), 0.0)

    assert value("k3_stage_forwards_total", kind="prefill") >= 1
    assert value("k3_stage_forwards_total", kind="decode") >= 2  # tokens 2 and 3
    assert value("k3_stage_forwards_total", kind="score") >= 1
    assert value("k3_stage_tokens_total", kind="prefill") >= len(prompt)
    assert value("k3_stage_tokens_total", kind="decode") == value("k3_stage_forwards_total", kind="decode")
    for kind in ("prefill", "decode", "score"):
        assert value("k3_stage_step_duration_seconds_count", kind=kind) == value("k3_stage_forwards_total", kind=kind)
        assert value("k3_stage_step_duration_seconds_sum", kind=kind) > 0
    assert ("k3_stage_sessions_open", frozenset({"layers": "0-12"}.items())) in got
    refusals = {dict(labels)["reason"]: v for (name, labels), v in got.items() if name == "k3_stage_refusals_total"}
    assert sum(refusals.values()) >= 1 and all(reason for reason in refusals)
    assert value("k3_stage_requests_total", endpoint="forward", status="202") >= 4

    deadline = time.monotonic() + 5  # the access-log line is written as the answer ends
    while True:
        lines = [json.loads(line) for line in stage_process["log"].read_text().splitlines() if line.startswith("{")]
        access = [e for e in lines if e["logger"] == "k3.access"]
        if any(e.get("request_id") == "ops-test-1" for e in access) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    health_line = next(e for e in access if e.get("request_id") == "ops-test-1")
    assert (health_line["component"], health_line["path"], health_line["status"]) == ("stage", HEALTH_PATH, 200)
    signed = [e for e in access if e["path"] == FORWARD_PATH and e["status"] == 202]
    assert signed and signed[0]["caller"] == stage_process["driver"].hotkey.ss58_address
    assert any(e["component"] == "stage-metrics" for e in access)


def test_each_kind_of_process_has_its_own_default_metrics_port():
    """Miner, validator, route miner and stage miner can share a host with their default metrics ports."""
    from neurons.miner_app import miner_options
    from neurons.swarm.settings import route_miner_options, stage_miner_options
    from neurons.validator_app.settings import validator_options

    def default_port(options):
        return next(o.default for o in options if o.flag == "--metrics-port")

    ports = [default_port(options()) for options in (miner_options, validator_options, route_miner_options,
                                                     stage_miner_options)]
    assert len(set(ports)) == len(ports), ports
