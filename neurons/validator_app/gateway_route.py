"""Organic traffic through a route of swarm stage miners, credited to the stages as stage work.

`GatewayRoute` runs, inside the validator, a route driver over the subnet's stage miners (`TrustedDirectory`:
stages the validator blamed are left out at every refresh) that records every step it drives (what it fed the
first stage, the stages' signed receipts, the head's signed result), a `RouteEngine` over it, and the signed
miner API over that engine on loopback (`MinerServer`, signing as the validator's hotkey). The gateway talks to
it as to any miner (`RouteAndMiners` adds it to the validator's ranking, first or last), so tier 0 and failover
apply unchanged. After each organic attempt through the route, `settle()` hands the recorded steps to
`StageRounds.settle_gateway_route`: a sample of sessions is teacher-forced on the validator's reference (a
failing one starts a relayed route audit of the same stages, whose bisection blames), every step's receipts are
audited, and the stages are credited the layer-tokens they served (`gateway_work` rows in the store, counted in
the stage weights and `validator.py status`).

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

from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from neurons.gateway.server import MinerTarget
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from neurons.swarm.route import LoggedRouteDriver, MetagraphDirectory, RouteEngine, TrustedDirectory
from neurons.validator_app.settings import ValidatorSetupError
from protocol.auth import SQLiteNonceStore

log = logging.getLogger("k3.gateway.route")

ROUTE_UID = -1  # the route's MinerTarget uid (no neuron has it); the gateway's x-k3-miner-uid header says -1
ROUTE_PLACES = ("off", "first", "last")


class GatewayRoute:
    """The validator's own route for organic traffic (module doc): `await start()`, `target()`, `await settle()`,
    `await close()`."""

    def __init__(self, stage_rounds, directory, wallet, config, tokenizer, chain, chain_settings, *,
                 nonce_store_path: str, audit_rate: float = 0.1, host: str = "127.0.0.1", port: int = 0,
                 public_url: str = "", hop_timeout_s: float = 5.0,
                 refresh_s: float = 30.0, max_context: int = 4096, model_fingerprint: str = "",
                 record_steps: int = 65536, prefill_chunk: int = 128, route_log: str = ""):
        self.stage_rounds = stage_rounds
        self.audit_rate = audit_rate
        self.hotkey = wallet.hotkey.ss58_address
        self.driver = LoggedRouteDriver(TrustedDirectory(directory, stage_rounds.store, stage_rounds.blame_s),
                                        wallet.hotkey, config, host=host, port=port, public_url=public_url,
                                        hop_timeout_s=hop_timeout_s, refresh_s=refresh_s, record_steps=record_steps)
        self.driver.route_log = route_log  # "": no log; else one JSON line {at, route: [stage hotkeys]} per route
        self.engine = RouteEngine(self.driver, tokenizer, model_fingerprint=model_fingerprint,
                                  max_context=max_context, prefill_chunk=prefill_chunk)
        Path(nonce_store_path).parent.mkdir(parents=True, exist_ok=True)
        self.nonce_store = SQLiteNonceStore(nonce_store_path)
        settings = MinerSettings(chain=chain_settings,
                                 server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                                                       nonce_store=nonce_store_path, shutdown_grace_s=1.0),
                                 access=AccessSettings(min_validator_stake=0.0))
        self.server = MinerServer(settings, engine=self.engine, tokenizer=tokenizer, chain=chain, wallet=wallet,
                                  nonce_store=self.nonce_store)
        self._lock = asyncio.Lock()
        self.settled: list[dict] = []  # every settle()'s summary, newest last (bounded)
        self.last_records: list = []  # the steps the last settle() checked

    async def start(self) -> None:
        await self.server.start()
        log.info("the gateway's route serves the signed miner API on %s (driver result sink %s)", self.server.url,
                 self.driver.url)

    async def close(self) -> None:
        await self.server.close(grace_s=0.0)
        self.nonce_store.close()

    def target(self, score: float = 1.0) -> MinerTarget:
        return MinerTarget(ROUTE_UID, self.hotkey, self.server.url, score)

    async def settle(self) -> Optional[dict]:
        """Check and credit the steps the route drove since the last settle (StageRounds.settle_gateway_route);
        after a blame the driver re-reads its directory at once, so the blamed stage leaves the route."""
        async with self._lock:
            records = []
            while self.driver.records:
                records.append(self.driver.records.popleft())
            if not records:
                return None
            stages = await self.driver.stages()
            summary = await self.stage_rounds.settle_gateway_route(records, stages, self.hotkey, self.audit_rate)
            if summary["blamed"]:
                await self.driver.stages(refresh=True)
            log.info("gateway route: %d sessions, %d audited (%d failed), %d layer-tokens credited%s",
                     summary["sessions"], summary["audited"], len(summary["failed"]), summary["credited_tokens"],
                     f"; blamed {summary['blamed']}" if summary["blamed"] else "")
            self.settled = (self.settled + [summary])[-100:]
            self.last_records = records
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
            return self.route.settle()
        hook = getattr(self.miners, "record_organic", None)
        return hook(uid=uid, hotkey=hotkey, outcome=outcome, **kw) if hook is not None else None


async def start_gateway_route(loop, settings) -> GatewayRoute:
    """The validator's gateway route (--gateway-route first|last) over the subnet's announced stage miners; needs
    the validator's stage checks (--reference-engine, --stage-challenges > 0), which check the route's work
    before crediting it."""
    stage_rounds = getattr(loop, "stage", None)
    if stage_rounds is None:
        raise ValidatorSetupError("--gateway-route needs the validator's stage checks (--reference-engine and "
                                  "--stage-challenges > 0): the route's work is checked before it is credited")
    checkpoint = settings.engine.checkpoint
    config = read_config(checkpoint)
    try:
        model_fp = fingerprint(checkpoint)
    except CheckpointError:
        model_fp = ""
    directory = MetagraphDirectory(loop.chain, settings.chain.netuid, config_hash=config.config_hash(),
                                   model_fingerprint=model_fp or None)
    g = settings.gateway
    route = GatewayRoute(stage_rounds, directory, loop.wallet, config, loop.tokenizer, loop.chain, settings.chain,
                         nonce_store_path=str(Path(settings.db).with_suffix(".route-nonces.sqlite")),
                         audit_rate=g.route_audit_rate, host=settings.stages.sink_host, port=g.route_port,
                         public_url=g.route_url or "",
                         hop_timeout_s=settings.stages.timeout_s, refresh_s=g.route_refresh_s,
                         model_fingerprint=model_fp, route_log=g.route_log or "")
    await route.start()
    return route


__all__ = ["GatewayRoute", "ROUTE_PLACES", "ROUTE_UID", "RouteAndMiners", "start_gateway_route"]
