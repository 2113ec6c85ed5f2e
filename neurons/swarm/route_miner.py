"""`python -m neurons.swarm.route_miner --network devnet:PATH --netuid N --checkpoint DIR ...`: one Kimi K3 served
over a route of stage miners, behind the signed miner protocol.

A `RouteDriver` finds the subnet's stage miners from the chain (`MetagraphDirectory`: their commitments announce
model and layer block, their axons say where) and a `RouteEngine` serves generate / score across them, so
validators and the gateway talk to it as to any whole-model miner. The checkpoint directory is read for the
config and the tokenizer only (no weights are loaded). It publishes its own endpoint like a miner. With
--ready-file it writes {"url", "hotkey", "pid", "route"} there once it serves. SIGTERM/SIGINT stop it.

`--trust-db FILE` makes it follow a validator's trust (the local testnet's): stages blamed in that validator's
SQLite store (read-only, at every refresh of the stage list) are left out of its routes
(`neurons.validator_app.stage_rounds.TrustedDirectory`), so its traffic moves to a spare once a stage is blamed. `--route-log FILE` appends one JSON line
{"at", "route": [stage hotkeys]} per route it plans (what the local testnet shows and its tests check).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sqlite3
import sys
import time
from pathlib import Path

from chain import connect
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.model.tokenizer import load_tokenizer
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from neurons.settings import ChainSettings, WalletSettings, open_wallet
from neurons.swarm.route import MetagraphDirectory, RouteDriver, RouteEngine
from neurons.swarm.stage_miner import serve_until_signalled
from neurons.validator_app.stage_rounds import TrustedDirectory
from neurons.validator_app.store import ValidatorStore, ValidatorStoreError
from protocol.auth import SQLiteNonceStore

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="route_miner", description=__doc__.splitlines()[0])
    p.add_argument("--network", required=True, help="devnet:PATH, local, finney, ws://...")
    p.add_argument("--netuid", type=int, required=True)
    p.add_argument("--checkpoint", required=True, help="the model's directory (config and tokenizer are read)")
    p.add_argument("--wallet-name", default="default")
    p.add_argument("--wallet-hotkey", default="default")
    p.add_argument("--wallet-path", default="~/.bittensor/wallets")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--external-ip", default=None)
    p.add_argument("--nonce-store", default="~/.k3-subnet/route-miner-nonces.sqlite")
    p.add_argument("--min-validator-stake", type=float, default=1000.0)
    p.add_argument("--hop-timeout-s", type=float, default=5.0)
    p.add_argument("--refresh-s", type=float, default=30.0, help="how often the stage list is re-read from chain")
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-concurrent", type=int, default=8)
    p.add_argument("--trust-db", default="", metavar="FILE",
                   help="a validator's store: leave the stages it blamed out of routes (read at each refresh)")
    p.add_argument("--route-log", default="", metavar="FILE", help="append each route planned there (JSON lines)")
    p.add_argument("--ready-file", default="")
    p.add_argument("--log-level", default="WARNING")
    return p


async def run(args) -> None:
    config = read_config(args.checkpoint)
    try:
        model_fp = fingerprint(args.checkpoint)
    except CheckpointError:
        model_fp = ""
    settings = MinerSettings(
        chain=ChainSettings(network=args.network, netuid=args.netuid, metagraph_refresh_s=args.refresh_s),
        wallet=WalletSettings(args.wallet_name, args.wallet_hotkey, args.wallet_path),
        server=ServerSettings(host=args.host, port=args.port, external_ip=args.external_ip, metrics=False,
                              nonce_store=str(Path(args.nonce_store).expanduser()), shutdown_grace_s=2.0),
        access=AccessSettings(min_validator_stake=args.min_validator_stake))
    wallet = open_wallet(settings.wallet)
    chain = connect(args.network)
    nonce_store = SQLiteNonceStore(settings.server.nonce_store)
    try:
        directory = MetagraphDirectory(chain, args.netuid, config_hash=config.config_hash(),
                                       model_fingerprint=model_fp or None)
        if args.trust_db:
            directory = TrustedDirectory(directory, StoreFile(args.trust_db))
        driver = LoggedRouteDriver(directory, wallet.hotkey, config, host=args.host, hop_timeout_s=args.hop_timeout_s,
                             refresh_s=args.refresh_s)
        driver.route_log = args.route_log
        engine = RouteEngine(driver, load_tokenizer(args.checkpoint, config), model_fingerprint=model_fp,
                             max_context=args.max_context, max_concurrent=args.max_concurrent,
                             prefill_chunk=args.prefill_chunk)
        server = MinerServer(settings, engine=engine, tokenizer=engine.tokenizer, chain=chain, wallet=wallet,
                             nonce_store=nonce_store)
        await server.start()
        try:
            info = {"url": server.url, "hotkey": wallet.hotkey.ss58_address, "pid": os.getpid(),
                    "route": [s.describe() for s in driver.current], "health": engine.health().status}
            await serve_until_signalled(info, args.ready_file)
        finally:
            await server.close(grace_s=0.0)
    finally:
        await chain.close()
        nonce_store.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        asyncio.run(run(args))
    except (CheckpointError, ValueError) as e:
        print(f"route_miner: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
