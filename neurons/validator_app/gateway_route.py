"""Organic traffic through a route of swarm stage miners, credited to the stages as stage work.

`GatewayRoute` serves the signed miner API on loopback (`MinerServer`, signing as the validator's hotkey) over
the validator's own route engine: the same `RouteEngine` and route driver (neurons/validator_app/stage_rounds.py)
that drive the validator's own stage sessions, so a stage sees one driver and one kind of session. The gateway
talks to it as to any miner (`RouteAndMiners` adds it to the validator's ranking, first or last), so tier 0 and
failover apply unchanged. After each organic attempt through the route, before the gateway ends the user's answer,
`credit()` audits every step's receipts of that request and credits the stages the layer-tokens they served
(`gateway_work` rows, StageRounds.credit_finished: nothing awaited, so a validator killed once the user was
answered has lost no record); then `settle()` (StageRounds.settle) credits what was left, and a share of the
sessions (--gateway-route-audit-rate) is checked after the fact from the stages' ledgers, every stage re-run on
the validator's reference (neurons/validator_app/session_audits.py).

The driver re-reads the stages and the validator's blames every `--gateway-route-refresh-s` (and at once after a
blame of its own), and with `--gateway-route-log FILE` appends one JSON line {"at", "route": [stage hotkeys]} per
route it plans (the local testnet tells from it which stages served each organic request).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from pathlib import Path
from typing import Optional

from neurons.gateway.server import MinerTarget
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from neurons.validator_app.settings import ValidatorSetupError
from protocol.auth import SQLiteNonceStore

log = logging.getLogger("k3.gateway.route")

ROUTE_UID = -1  # the route's MinerTarget uid (no neuron has it); the gateway's x-k3-miner-uid header says -1
SETTLE_ON_CLOSE_S = 8.0  # at shutdown, how long the route may take to credit what it served (inside a 10 s grace)
ROUTE_PLACES = ("off", "first", "last")


class GatewayRoute:
    """The validator's own route for organic traffic (module doc): `await start()`, `target()`, `await settle()`,
    `await close()`."""

    def __init__(self, stage_rounds, wallet, tokenizer, chain, chain_settings, *, nonce_store_path: str,
                 refresh_s: float = 30.0, route_log: str = ""):
        self.stage_rounds = stage_rounds
        self.hotkey = wallet.hotkey.ss58_address
        self.refresh_s = refresh_s
        self.route_log = route_log  # "": no log; else one JSON line {at, route: [stage hotkeys]} per route
        Path(nonce_store_path).parent.mkdir(parents=True, exist_ok=True)
        self.nonce_store = SQLiteNonceStore(nonce_store_path)
        self.settings = MinerSettings(chain=chain_settings,
                                      server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                                                            nonce_store=nonce_store_path, shutdown_grace_s=1.0),
                                      access=AccessSettings(min_validator_stake=0.0))
        self.tokenizer, self.chain, self.wallet = tokenizer, chain, wallet
        self.server: Optional[MinerServer] = None
        self.settled: list[dict] = []  # every settle()'s summary, newest last (bounded)

    @property
    def driver(self):
        return self.stage_rounds.driver

    async def start(self) -> None:
        await self.stage_rounds.start()  # its driver and engine: the one route the validator drives
        self.driver.refresh_s = self.refresh_s
        self.driver.route_log = self.route_log
        self.server = MinerServer(self.settings, engine=self.stage_rounds.engine, tokenizer=self.tokenizer,
                                  chain=self.chain, wallet=self.wallet, nonce_store=self.nonce_store)
        await self.server.start()
        log.info("the gateway's route serves the signed miner API on %s (driver result endpoint %s)", self.server.url,
                 self.driver.url)

    async def close(self) -> None:
        """Stop serving; what the route served and has not settled yet is credited first (users were answered: the
        stages' work is on record), for at most SETTLE_ON_CLOSE_S."""
        if self.server is not None:
            await self.server.close(grace_s=0.0)
        try:
            await asyncio.wait_for(self.settle(), SETTLE_ON_CLOSE_S)
        except Exception as error:  # noqa: BLE001 (shutting down: what could not be settled is logged, not raised)
            log.warning("route sessions not settled at shutdown: %s", error or type(error).__name__)
        self.nonce_store.close()

    def target(self, score: float = 1.0) -> MinerTarget:
        return MinerTarget(ROUTE_UID, self.hotkey, self.server.url, score)

    def credit(self, request_id: Optional[str]) -> None:
        """Credit the stages at once for the request the route just served (StageRounds.credit_finished), before
        the gateway ends the user's answer: the record outlives a validator killed right after."""
        try:
            self.stage_rounds.credit_finished(request_id)
        except Exception:  # noqa: BLE001 (settle() credits what this could not; the user is answered either way)
            log.exception("crediting the route's request %s failed", request_id)

    async def settle(self) -> Optional[dict]:
        """Credit and check what the route drove since the last settle (StageRounds.settle); after a blame the
        driver re-reads its directory at once, so the blamed stage leaves the route."""
        summary = await self.stage_rounds.settle()
        if not summary["sessions"]:
            return None
        if summary["blamed"]:
            await self.driver.stages(refresh=True)
        log.info("route sessions settled: %d, %d stage checks (%d outside the envelope), %d layer-tokens credited%s",
                 summary["sessions"], summary["checked"], summary["outside"], summary["credited_tokens"],
                 f"; blamed {summary['blamed']}" if summary["blamed"] else "")
        self.settled = (self.settled + [summary])[-100:]
        return summary


class RouteAndMiners:
    """The gateway's MinerDirectory: the validator's ranked miners and the route (first or last). Attempts through
    the route are settled by the route (`GatewayRoute.settle`); the others go to the validator's hook."""

    def __init__(self, miners, route: GatewayRoute, place: str = "last"):
        if place not in ("first", "last"):
            raise ValueError(f"route place {place!r} is not first or last")
        self.miners = miners
        self.route = route
        self.place = place

    async def ranked_miners(self):
        ranked = self.miners.ranked_miners()
        if inspect.isawaitable(ranked):
            ranked = await ranked
        route = self.route.target()
        return [route, *ranked] if self.place == "first" else [*ranked, route]

    def record_organic(self, *, uid, hotkey, outcome, **kw):
        if uid == ROUTE_UID and hotkey == self.route.hotkey:
            self.route.credit(getattr(getattr(outcome, "request", None), "request_id", None))
            return self.route.settle()
        hook = getattr(self.miners, "record_organic", None)
        return hook(uid=uid, hotkey=hotkey, outcome=outcome, **kw) if hook is not None else None


async def start_gateway_route(loop, settings) -> GatewayRoute:
    """The validator's gateway route (--gateway-route first|last) over the subnet's announced stage miners; needs
    the validator's stage checks (--reference-engine, --stage-sessions > 0), whose driver it serves through and
    which check the route's work before crediting it."""
    stage_rounds = getattr(loop, "stage", None)
    if stage_rounds is None:
        raise ValidatorSetupError("--gateway-route needs the validator's stage checks (--reference-engine and "
                                  "--stage-sessions > 0): the route's work is checked before it is credited")
    g = settings.gateway
    route = GatewayRoute(stage_rounds, loop.wallet, loop.tokenizer, loop.chain, settings.chain,
                         nonce_store_path=str(Path(settings.db).with_suffix(".route-nonces.sqlite")),
                         refresh_s=g.route_refresh_s, route_log=g.route_log or "")
    await route.start()
    return route


__all__ = ["GatewayRoute", "ROUTE_PLACES", "ROUTE_UID", "RouteAndMiners", "start_gateway_route"]
