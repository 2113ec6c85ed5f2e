"""`python -m neurons.swarm.route_miner --network devnet:PATH --netuid N --checkpoint DIR ...`: one Kimi K3 served
over a route of stage miners, behind the signed miner protocol.

A `RouteDriver` finds the subnet's stage miners from the chain (`MetagraphDirectory`: their commitments announce
model and layer block, their axons say where) and a `RouteEngine` serves generate / score across them, so
validators and the gateway talk to it as to any whole-model miner. The checkpoint directory is read for the
config and the tokenizer only (no weights are loaded). It publishes its own endpoint like a miner, and takes the
miner's wallet, chain, server and validator flags (btcli's -w/-H/--wallet-path, -n/--network, --netuid, BT_*;
its own settings from K3_ROUTE_*; --help lists each with its variable). With --metrics, the miner's Prometheus
metrics on 127.0.0.1:--metrics-port. With --ready-file it writes {"url", "hotkey", "pid", "route", "health"}
there once it serves. SIGTERM/SIGINT stop it.

`--trust-db FILE` makes it follow a validator's trust (the local testnet's): stages blamed in that validator's
SQLite store (read-only, at every refresh of the stage list) are left out of its routes
(`neurons.validator_app.stage_rounds.TrustedDirectory`), so its traffic moves to a spare once a stage is blamed.
`--route-log FILE` appends one JSON line {"at", "route": [stage hotkeys]} per route it plans (what the local
testnet shows and its tests check).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import sys
import time
from pathlib import Path

from chain import connect
from chain.interface import ChainError
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.model.tokenizer import load_tokenizer
from neurons.miner_app import MinerServer
from neurons.observability import run_neuron
from neurons.settings import describe_values, open_wallet, program_name
from neurons.swarm.route import MetagraphDirectory, RouteDriver, RouteEngine
from neurons.swarm.settings import RouteMinerSettings, read_route_miner_settings, route_miner_options
from neurons.swarm.stage_miner import serve_until_signalled
from neurons.validator_app.stage_rounds import TrustedDirectory
from neurons.validator_app.store import ValidatorStore, ValidatorStoreError
from protocol.auth import SQLiteNonceStore

MODULE = "neurons.swarm.route_miner"
log = logging.getLogger("k3.route_miner")


class StoreFile:
    """A validator's store read afresh at every call (the validator writes it; it may not exist yet)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()

    def stage_checks(self, since=None, hotkey=None) -> list:
        if not self.path.exists():
            return []
        try:
            with ValidatorStore(self.path, readonly=True) as store:
                return [dict(r) for r in store.stage_checks(since, hotkey)]
        except (ValidatorStoreError, sqlite3.Error) as error:  # being created or migrated right now: trust as before
            log.warning("trust store %s unreadable: %s", self.path, error)
            return []


class LoggedRouteDriver(RouteDriver):
    """A route driver that appends every route it plans to a JSON-lines file."""

    route_log = ""

    async def plan(self, refresh: bool = False):
        route = await super().plan(refresh)
        if self.route_log:
            with open(self.route_log, "a") as f:
                f.write(json.dumps({"at": time.time(), "route": [s.hotkey for s in route]}) + "\n")
        return route


def speculation_config(drafter: str, draft_tokens: int):
    # imported here: inference.speculative and inference.serving import each other, serving must come first
    from inference.speculative.speculation import SpeculationConfig  # noqa: PLC0415

    return SpeculationConfig(drafter=drafter, max_draft_tokens=draft_tokens)


async def run(settings: RouteMinerSettings) -> int:
    r, c = settings.route, settings.chain
    config = read_config(r.checkpoint)
    try:
        model_fp = fingerprint(r.checkpoint)
    except CheckpointError:
        model_fp = ""
    miner_settings = settings.miner_settings()
    wallet = open_wallet(settings.wallet)
    chain = connect(c.network)
    nonce_store = SQLiteNonceStore(os.path.expanduser(settings.server.nonce_store))
    try:
        directory = MetagraphDirectory(chain, c.netuid, config_hash=config.config_hash(),
                                       model_fingerprint=model_fp or None)
        if r.trust_db:
            directory = TrustedDirectory(directory, StoreFile(r.trust_db))
        driver = LoggedRouteDriver(directory, wallet.hotkey, config, host=settings.server.host,
                                   hop_timeout_s=r.hop_timeout_s, refresh_s=c.metagraph_refresh_s)
        driver.route_log = r.route_log
        engine = RouteEngine(driver, load_tokenizer(r.checkpoint, config), model_fingerprint=model_fp,
                             max_context=r.max_context, max_concurrent=r.max_concurrent,
                             prefill_chunk=r.prefill_chunk,
                             speculation=speculation_config(r.speculate, r.draft_tokens))
        server = MinerServer(miner_settings, engine=engine, tokenizer=engine.tokenizer, chain=chain, wallet=wallet,
                             nonce_store=nonce_store)
        await server.start()
        try:
            info = {"url": server.url, "hotkey": wallet.hotkey.ss58_address, "pid": os.getpid(),
                    "route": [s.describe() for s in driver.current], "health": engine.health().status}
            if server.metrics_port:
                info["metrics_url"] = f"http://127.0.0.1:{server.metrics_port}/metrics"
            await serve_until_signalled(info, r.ready_file)
        finally:
            await server.close(grace_s=0.0)
    finally:
        await chain.close()
        nonce_store.close()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or program_name(f"python -m {MODULE}", MODULE)
    settings = read_route_miner_settings(argv, prog=prog, description=__doc__)
    problems = settings.problems()
    for problem in problems:
        print(f"{prog}: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    return run_neuron(settings, lambda: run(settings), (CheckpointError, ChainError, ValueError, OSError),
                      "k3.route_miner", describe_values(route_miner_options(), dataclasses.asdict(settings)), prog)


if __name__ == "__main__":
    sys.exit(main())
