"""`python -m neurons.route_miner --network devnet:PATH --netuid N --checkpoint DIR ...`: one Kimi K3 served
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
(`neurons.swarm.route.TrustedDirectory`), so its traffic moves to a spare once a stage is blamed.
`--route-log FILE` appends one JSON line {"at", "route": [stage hotkeys]} per route it plans (what the local
testnet shows and its tests check). `--report-work HOTKEY@URL` submits the receipts of every step it drives to
that validator's work endpoint (protocol.route_work, every --report-work-s; `WorkReport`), which credits the
stages the work.

`--speculate ngram|suffix|distilled --draft-tokens K` drafts on the route driver and has the last stage verify
the drafts (greedy output is plain greedy output). `distilled` takes `--draft-model FILE`, a draft table made by
scripts/distill_drafter.py from the route's checkpoint: the table's fingerprint must be the one in --checkpoint's
k3_manifest.json (the model the stages announce), else the route miner refuses to start and says both.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import sqlite3
import sys
from pathlib import Path

import aiohttp
import numpy as np

from chain import connect
from chain.interface import ChainError
from inference.decoding.distilled import speculation_with_table
from inference.decoding.speculation import SpeculationConfig
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.model.tokenizer import load_tokenizer
from neurons.base.observability import run_neuron
from neurons.base.settings import describe_values, open_wallet, program_name
from neurons.miner_app import MinerServer
from neurons.miner_app.server import owner_hotkeys
from neurons.stage_miner import serve_until_signalled
from neurons.swarm.route import LoggedRouteDriver, MetagraphDirectory, RouteDriver, RouteEngine, TrustedDirectory
from neurons.swarm.settings import (RouteMinerSettings, RouteSettings, read_route_miner_settings, route_miner_options,
                                    work_hop)
from neurons.swarm.signed_http import post_signed
from neurons.validator_app.store import ValidatorStore, ValidatorStoreError
from protocol.auth import SQLiteNonceStore
from protocol.route_work import MAX_WORK_STEPS, MAX_WORK_TOKENS, ROUTE_WORK_PATH, RouteWork, RouteWorkStep

MODULE = "neurons.route_miner"
log = logging.getLogger("k3.route_miner")


class StoreFile:
    """A validator's store read afresh at every call (the validator writes it; it may not exist yet)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()
        self._last: dict = {}  # (since, hotkey) -> the last rows read, for a moment the store cannot be read

    def stage_checks(self, since=None, hotkey=None) -> list:
        if not self.path.exists():
            return []
        try:
            with ValidatorStore(self.path, readonly=True) as store:
                rows = [dict(r) for r in store.stage_checks(since, hotkey)]
        except (ValidatorStoreError, sqlite3.Error) as error:  # being written or migrated right now: trust as before
            log.warning("trust store %s unreadable: %s", self.path, error)
            return [r for r in self._last.get(hotkey, []) if since is None or r["at"] >= since]
        self._last[hotkey] = rows
        return rows




class WorkReport:
    """Submits the receipts of the steps `driver` drove (its StepRecords) to a validator's work endpoint
    (protocol.route_work, signed for its hotkey) every `every_s`; steps a validator could not take yet (not
    ready, unreachable) are kept for the next submission (at most `keep` of them), rejected ones are dropped."""

    def __init__(self, driver: RouteDriver, keypair, validator, every_s: float = 5.0, timeout_s: float = 10.0,
                 keep: int = 4096):
        self.driver, self.keypair, self.validator = driver, keypair, validator
        self.every_s, self.timeout_s = every_s, timeout_s
        self.pending: collections.deque = collections.deque(maxlen=keep)
        self.answers: collections.Counter = collections.Counter()  # HTTP status -> submissions

    def claims(self, records: list) -> list[RouteWorkStep]:
        """The steps to claim for `records` (a cheating driver claims more: localnet/cheats/route.py)."""
        return [RouteWorkStep(route_id=r.route_id, session=r.session, step=r.step, position=r.position,
                              request_id=r.request_id, rewind=r.rewind,
                              token_ids=np.frombuffer(r.input_body, dtype="<i4").tolist(),
                              receipts=list(r.receipts))
                for r in records]

    async def submit(self, http) -> int | None:
        """One submission of what is pending (at most MAX_WORK_STEPS steps, MAX_WORK_TOKENS token ids); its HTTP
        status, or None when there was nothing to submit or the validator could not be reached."""

        while self.driver.records:
            self.pending.append(self.driver.records.popleft())
        batch, tokens = [], 0
        while self.pending and len(batch) < MAX_WORK_STEPS // 2:  # half: room for what claims() adds
            n = len(self.pending[0].input_body) // 4
            if batch and tokens + n > MAX_WORK_TOKENS // 2:
                break
            batch.append(self.pending.popleft())
            tokens += n
        if not batch:
            return None
        steps = self.claims(batch)
        body = RouteWork(steps=steps[:MAX_WORK_STEPS]).model_dump_json().encode()
        try:
            status, answer = await post_signed(http, self.keypair, self.validator, ROUTE_WORK_PATH, body,
                                               self.timeout_s, "application/json")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as error:
            log.warning("work endpoint %s unreachable: %s", self.validator.url, type(error).__name__)
            self.pending.extendleft(reversed(batch))
            return None
        self.answers[status] += 1
        if status in (429, 503):  # not ready yet: the same steps next time
            self.pending.extendleft(reversed(batch))
        elif status != 200:
            log.warning("work endpoint %s rejected %d steps: %s %s", self.validator.url, len(batch), status,
                        answer[:300].decode(errors="replace"))
        return status

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.sleep(self.every_s)
                await self.submit(http)


def route_speculation(route: RouteSettings, model_fingerprint: str):
    """What the route drafts with (--speculate, --draft-tokens): model-free drafts, or the distilled draft table of
    --draft-model, which must have been made from the route's checkpoint (`model_fingerprint`: the model its
    stages announce); a table made from another one is a ValueError naming both fingerprints."""
    config = SpeculationConfig(drafter=route.speculate, max_draft_tokens=route.draft_tokens)
    return speculation_with_table(config, route.draft_model, model_fingerprint)


async def run(settings: RouteMinerSettings, report=WorkReport) -> int:
    r, c = settings.route, settings.chain
    config = read_config(r.checkpoint)
    try:
        model_fp = fingerprint(r.checkpoint)
    except CheckpointError:
        model_fp = ""
    speculation = route_speculation(r, model_fp)  # a draft table for another checkpoint stops it here
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
                                   hop_timeout_s=r.hop_timeout_s, refresh_s=c.metagraph_refresh_s,
                                   record_steps=4096 if r.report_work else 0)
        driver.route_log = r.route_log
        engine = RouteEngine(driver, load_tokenizer(r.checkpoint, config), model_fingerprint=model_fp,
                             max_context=r.max_context, max_concurrent=r.max_concurrent,
                             prefill_chunk=r.prefill_chunk, speculation=speculation)
        server = MinerServer(miner_settings, engine=engine, tokenizer=engine.tokenizer, chain=chain, wallet=wallet,
                             nonce_store=nonce_store, owners=owner_hotkeys(miner_settings))
        await server.start()
        reporting = asyncio.create_task(report(driver, wallet.hotkey, work_hop(r.report_work), r.report_work_s).run()) \
            if r.report_work else None
        try:
            info = {"url": server.url, "hotkey": wallet.hotkey.ss58_address, "pid": os.getpid(),
                    "route": [s.describe() for s in driver.current], "health": engine.health().status}
            if server.metrics_port:
                info["metrics_url"] = f"http://127.0.0.1:{server.metrics_port}/metrics"
            await serve_until_signalled(info, r.ready_file)
        finally:
            if reporting is not None:
                reporting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporting
            await server.close(grace_s=0.0)
    finally:
        await chain.close()
        nonce_store.close()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None, report=WorkReport) -> int:
    prog = prog or program_name(f"python -m {MODULE}", MODULE)
    settings = read_route_miner_settings(argv, prog=prog, description=__doc__)
    problems = settings.problems()
    for problem in problems:
        print(f"{prog}: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    return run_neuron(settings, lambda: run(settings, report), (CheckpointError, ChainError, ValueError, OSError),
                      "k3.route_miner", describe_values(route_miner_options(), dataclasses.asdict(settings)), prog)


if __name__ == "__main__":
    sys.exit(main())
