"""The swarm route miner speaks the operator's vocabulary, as the stage miner does: btcli's flags and BT_* variables,
the template's dotted aliases, K3_ROUTE_* for its own settings (the miner's server and validator groups among them),
the flags it had before (--refresh-s, --min-validator-stake, ...), clear CLI errors, a usage line naming the
program; and a real route miner process, started on a devnet subnet with no stage miners yet, publishes its endpoint,
says its route is not there yet (degraded health), answers with X-Request-Id, logs JSON and serves the miner's
Prometheus metrics. `--speculate distilled --draft-model FILE` takes the table the miner takes, and a route miner
process refuses, at startup and with both fingerprints, a table made for another checkpoint (the distilled drafts
over real stage miners: tests/test_route_miner_distilled.py)."""
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import start_route_miner
from prometheus_client.parser import text_string_to_metric_families

from chain import connect
from localnet.cheats.stage import stop_hosts
from neurons.base.settings import options_table
from neurons.route_miner import main
from neurons.swarm.settings import RouteMinerSettings, read_route_miner_settings, route_miner_options
from protocol.schemas import HEALTH_PATH

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["--checkpoint", "/ckpt", "--netuid", "2"]
SHIPPED_TABLE = ROOT / "inference" / "model" / "assets" / "tiny_trained_drafter.k3d"  # for assets/tiny_trained


def read(argv, environ=None) -> RouteMinerSettings:
    return read_route_miner_settings(argv, environ or {}, prog="route-test")


def test_btcli_spellings_and_template_aliases_set_the_settings():
    s = read(REQUIRED + ["-w", "alice", "-H", "hot", "--wallet-path", "/wallets", "-n", "ws://10.0.0.1:9944",
                         "--axon.port", "9000", "--log-format", "json", "--max-body", "1MiB", "--metrics",
                         "--metrics-port", "0", "--max-concurrent", "3"])
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == ("alice", "hot", "/wallets")
    assert (s.chain.network, s.chain.netuid, s.server.port) == ("ws://10.0.0.1:9944", 2, 9000)
    assert (s.log_format, s.server.max_body_bytes, s.server.metrics, s.server.metrics_port) == ("json", 2**20, True, 0)
    assert (s.route.checkpoint, s.route.max_concurrent) == ("/ckpt", 3)
    s = read(REQUIRED + ["--wallet.name", "bob", "--wallet.hotkey", "hk", "--wallet.path", "/w",
                         "--subtensor.network", "local"])
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path, s.chain.network) == ("bob", "hk", "/w", "local")


def test_the_flags_it_had_before_still_work():
    """localnet/testnet.py's route_command spells these; they keep their meaning."""
    s = read(["--network", "devnet:/tmp/d.sqlite", "--netuid", "4", "--checkpoint", "/ckpt",
              "--wallet-name", "route", "--wallet-hotkey", "default", "--wallet-path", "/w", "--host", "127.0.0.1",
              "--port", "8123", "--external-ip", "10.1.2.3", "--nonce-store", "/run/nonces.sqlite",
              "--min-validator-stake", "12.5", "--hop-timeout-s", "2", "--refresh-s", "5", "--prefill-chunk", "64",
              "--max-context", "1024", "--max-concurrent", "2", "--ready-file", "/run/route.ready",
              "--log-level", "info"])
    assert (s.chain.network, s.chain.netuid, s.chain.metagraph_refresh_s) == ("devnet:/tmp/d.sqlite", 4, 5.0)
    assert (s.server.host, s.server.port, s.server.external_ip, s.server.nonce_store) == (
        "127.0.0.1", 8123, "10.1.2.3", "/run/nonces.sqlite")
    assert s.access.min_validator_stake == 12.5
    r = s.route
    assert (r.hop_timeout_s, r.prefill_chunk, r.max_context, r.max_concurrent, r.ready_file) == (
        2.0, 64, 1024, 2, "/run/route.ready")
    assert s.log_level == "INFO"
    # the miner server it runs gets the same values
    m = s.miner_settings()
    assert (m.server, m.access, m.chain, m.wallet) == (s.server, s.access, s.chain, s.wallet)


def test_environment_fills_what_no_flag_gives():
    environ = {"BT_WALLET": "env-wallet", "BT_WALLET_HOTKEY": "env-hot", "BT_WALLET_PATH": "/env/wallets",
               "BT_NETWORK": "test", "K3_NETUID": "7", "K3_ROUTE_CHECKPOINT": "/env/ckpt",
               "K3_ROUTE_PREFILL_CHUNK": "32", "K3_ROUTE_METRICS": "yes", "K3_ROUTE_PORT": "8200",
               "K3_ROUTE_MIN_VALIDATOR_STAKE": "5", "K3_METAGRAPH_REFRESH_S": "9", "K3_LOG_LEVEL": "debug"}
    s = read([], environ)
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == ("env-wallet", "env-hot", "/env/wallets")
    assert (s.chain.network, s.chain.netuid, s.chain.metagraph_refresh_s) == ("test", 7, 9.0)
    assert (s.route.checkpoint, s.route.prefill_chunk, s.server.metrics, s.server.port) == ("/env/ckpt", 32, True, 8200)
    assert (s.access.min_validator_stake, s.log_level) == (5.0, "DEBUG")
    assert read(["-w", "flag-wallet", "--port", "8300"], environ).wallet.name == "flag-wallet"  # a flag wins
    assert read(["--port", "8300"], environ).server.port == 8300


def test_defaults_are_the_route_miners_former_ones():
    s = read(REQUIRED)
    assert (s.server.host, s.server.port, s.server.external_ip, s.server.metrics, s.server.publish) == (
        "127.0.0.1", 0, None, False, True)
    assert (s.server.nonce_store, s.server.shutdown_grace_s) == ("~/.k3-subnet/route-miner-nonces.sqlite", 2.0)
    assert (s.chain.network, s.chain.metagraph_refresh_s, s.access.min_validator_stake) == ("finney", 30.0, 1000.0)
    assert (s.wallet.name, s.wallet.hotkey, s.wallet.path) == ("default", "default", "~/.bittensor/wallets")
    r = s.route
    assert (r.hop_timeout_s, r.prefill_chunk, r.max_context, r.max_concurrent, r.ready_file) == (5.0, 128, 4096, 8, "")
    assert (s.log_level, s.log_format) == ("WARNING", "text")
    # the miner's own defaults are not changed by the route miner's
    from neurons.miner_app import MinerSettings
    assert (MinerSettings().server.host, MinerSettings().server.port, MinerSettings().chain.metagraph_refresh_s) == (
        "0.0.0.0", 8091, 60.0)


def test_every_flag_has_its_own_environment_variable_and_the_table_renders():
    options = route_miner_options()
    envs = [o.env for o in options]
    assert len(envs) == len(set(envs)) and all(envs)
    table = options_table(options)
    for row in ("| `--checkpoint` | `K3_ROUTE_CHECKPOINT` | required |",
                "| `--metagraph-refresh-s`, `--refresh-s` | `K3_METAGRAPH_REFRESH_S` | 30.0 |",
                "| `--port`, `--axon.port` | `K3_ROUTE_PORT` | 0 |"):
        assert row in table, row


@pytest.mark.parametrize("argv, environ, says", [
    (["--netuid", "2"], {}, "--checkpoint is required"),
    (["--checkpoint", "/ckpt"], {}, "--netuid is required"),
    (REQUIRED + ["-n", "mars"], {}, "'mars' is not a network"),
    (REQUIRED, {"K3_ROUTE_PORT": "eighty"}, "environment variable K3_ROUTE_PORT='eighty' (for --port)"),
    (REQUIRED + ["--prefill-chunk", "0"], {}, "must be an integer >= 1"),
    (REQUIRED + ["--refresh-s", "-1"], {}, "--refresh-s: invalid positive number value: '-1'"),
])
def test_bad_values_are_cli_errors(capsys, argv, environ, says):
    with pytest.raises(SystemExit) as exit_info:
        read(argv, environ)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_settings_that_cannot_work_are_refused_before_anything_starts(capsys, tmp_path):
    assert main(["--checkpoint", str(tmp_path), "--netuid", "1", "-n", "local"], prog="rm") == 2
    assert f"rm: error: {tmp_path} is not a checkpoint directory (no config.json)" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--netuid", "70000", "--host", "0.0.0.0"], prog="rm") == 2
    err = capsys.readouterr().err
    assert "--netuid 70000 is not a netuid" in err and "--host 0.0.0.0 is not an address validators can reach" in err


def test_speculate_distilled_takes_its_draft_table():
    s = read(REQUIRED + ["--speculate", "distilled", "--draft-model", str(SHIPPED_TABLE), "--draft-tokens", "6"])
    assert (s.route.speculate, s.route.draft_model, s.route.draft_tokens) == ("distilled", str(SHIPPED_TABLE), 6)
    s = read(REQUIRED, {"K3_ROUTE_SPECULATE": "distilled", "K3_ROUTE_DRAFT_MODEL": str(SHIPPED_TABLE)})
    assert (s.route.speculate, s.route.draft_model) == ("distilled", str(SHIPPED_TABLE))
    assert not any("draft" in p for p in s.problems())
    for argv, says in ((["--speculate", "distilled"], "speculate distilled needs its draft table (--draft-model FILE"),
                       (["--speculate", "ngram", "--draft-model", str(SHIPPED_TABLE)],
                        "--draft-model is for --speculate distilled"),
                       (["--speculate", "distilled", "--draft-model", "/no/such.k3d"],
                        "draft model /no/such.k3d is not a file")):
        assert says in "\n".join(read(REQUIRED + argv).problems()), argv


def test_a_route_miner_refuses_a_draft_table_made_for_another_checkpoint(tiny_checkpoint, tmp_path):
    """A real process: the shipped table belongs to the trained checkpoint, not to the random tiny one. It stops
    before it opens a wallet or the chain (none exists here), with one line naming both fingerprints."""
    from inference.model.checkpoint import fingerprint  # noqa: PLC0415

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "neurons.route_miner", "--netuid", "1", "-n", f"devnet:{tmp_path / 'd.sqlite'}",
         "--checkpoint", str(tiny_checkpoint), "--wallet-path", str(tmp_path / "no-wallets"),
         "--speculate", "distilled", "--draft-model", str(SHIPPED_TABLE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    trained = fingerprint(ROOT / "inference" / "model" / "assets" / "tiny_trained")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(
        f"python -m neurons.route_miner: error: the draft table {SHIPPED_TABLE} was distilled from checkpoint "
        f"{trained}, not from this one ({fingerprint(tiny_checkpoint)}); rebuild it with scripts/distill_drafter.py"), \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "d.sqlite").exists()


def test_distilled_drafts_need_the_checkpoints_fingerprint(capsys, tiny_checkpoint, tmp_path):
    """A checkpoint directory without k3_manifest.json gives no fingerprint to check the table against."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((tiny_checkpoint / "config.json").read_bytes())
    assert main(["--checkpoint", str(bare), "--netuid", "1", "-n", f"devnet:{tmp_path / 'd.sqlite'}",
                 "--speculate", "distilled", "--draft-model", str(SHIPPED_TABLE)], prog="rm") == 2
    err = capsys.readouterr().err
    assert err.startswith("rm: error: speculate distilled checks its draft table against the checkpoint's "
                          "fingerprint, and the checkpoint has none (no k3_manifest.json)"), err


def test_a_missing_wallet_is_a_one_line_error(capsys, tiny_checkpoint, tmp_path):
    assert main(["--checkpoint", str(tiny_checkpoint), "--netuid", "1", "-n", f"devnet:{tmp_path / 'd.sqlite'}",
                 "--wallet-path", str(tmp_path / "none")], prog="rm") == 2
    err = capsys.readouterr().err
    assert err.startswith("rm: error: no hotkey file at ") and "Traceback" not in err


def test_help_names_the_program_and_lists_btcli_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m neurons.route_miner ")  # in-process: named as `python -m` runs it
    for text in ("-w NAME", "-H NAME", "-n NETWORK", "--wallet.name", "--axon.port", "--refresh-s", "env BT_WALLET;",
                 "env K3_ROUTE_CHECKPOINT;", "--log-format {text,json}", "\nroute:\n", "\nvalidators and budgets:\n"):
        assert text in out, text


# ---------------------------------------------------------------- a real route miner process
def test_a_route_miner_process_publishes_itself_and_is_observable(tmp_path, tiny_checkpoint, make_wallets,
                                                                   make_subnet):
    wallets = make_wallets(tmp_path / "wallets", ("owner", "route"))
    devnet = tmp_path / "devnet.sqlite"
    netuid, uids = make_subnet(devnet, wallets, ("route",), block_interval=0.1)
    log = tmp_path / "route.log"
    env = {"BT_WALLET_PATH": str(tmp_path / "wallets"), "BT_NETWORK": f"devnet:{devnet}",
           "K3_ROUTE_NONCE_STORE": str(tmp_path / "nonces.sqlite"), "K3_ROUTE_METRICS": "on"}
    proc, info = start_route_miner(["--netuid", str(netuid), "--checkpoint", str(tiny_checkpoint), "-w", "route",
                                    "-H", "default", "--metrics-port", "0", "--log-format", "json",
                                    "--log-level", "INFO"], tmp_path, env)
    try:
        assert info["hotkey"] == wallets["route"].hotkey.ss58_address
        assert info["route"] == [] and info["health"] == "degraded"  # no stage miner announced yet

        async def look():
            async with connect(f"devnet:{devnet}") as chain:
                me = (await chain.metagraph(netuid)).by_hotkey(info["hotkey"])
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                async with http.get(info["url"] + HEALTH_PATH, headers={"X-Request-Id": "route-test-1"}) as r:
                    health = (r.status, r.headers.get("X-Request-Id"), await r.json())
                async with http.get(info["metrics_url"]) as r:
                    metrics = (r.status, await r.text())
            return me, health, metrics

        me, (status, request_id, health), (metrics_status, text) = asyncio.run(look())
        assert me is not None and me.uid == uids["route"]
        assert me.endpoint is not None and me.endpoint.port == int(info["url"].rsplit(":", 1)[1])
        assert (status, request_id, health["status"]) == (200, "route-test-1", "degraded")
        assert metrics_status == 200 and info["metrics_url"].startswith("http://127.0.0.1:")
        families = {f.name for f in text_string_to_metric_families(text)}
        assert {"k3_miner_requests", "k3_miner_metagraph_block"} <= families
        deadline = time.monotonic() + 5  # the access-log line is written as the answer ends
        while True:
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
            if any(e.get("request_id") == "route-test-1" for e in lines) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        line = next(e for e in lines if e.get("request_id") == "route-test-1")
        assert (line["logger"], line["component"], line["path"], line["status"]) == ("k3.access", "miner",
                                                                                    HEALTH_PATH, 200)
    finally:
        stop_hosts({"route": proc})
    # SIGTERM stops it cleanly (the interpreter's own teardown after that may outlast stop_hosts' 10 s on a busy box)
    assert any(json.loads(line)["message"] == "miner stopped" for line in log.read_text().splitlines()
               if line.startswith("{")), log.read_text()[-2000:]
