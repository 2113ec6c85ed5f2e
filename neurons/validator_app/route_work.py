"""The validator's route-work endpoint: outside route drivers (the route miner, anyone driving routes over the
subnet's stage miners) submit the receipts of the steps they drove, and the stages are credited that work.

`RouteWorkServer` listens on --stage-work-port (bound to --stage-sink-host) for POST /route/work
(protocol.route_work: btauth/1-signed for the validator's hotkey, a JSON `RouteWork` of at most 256 steps and
65536 token ids). Only a serving neuron of the subnet may submit. The claim goes to
`StageRounds.claim_route_work`, which audits every step's receipts (`credit_route`: signed by the registered stage
miners for their layers, this route, session and step, chained from the token ids the driver sent, every layer
once, never credited before) and credits each stage the step's tokens; receipts the stages never signed (forged
in a stage's name, unsigned, signed by a stranger) blame the driver (`route_receipts`), which is then zeroed and
credits no one.
"""
from __future__ import annotations

import logging

from aiohttp import web
from bittensor.http_auth import InMemoryNonceStore

from neurons.swarm.signed_http import start_result_site
from protocol.auth import AuthFailure, verify_request
from protocol.route_work import MAX_WORK_BYTES, MAX_WORK_TOKENS, ROUTE_WORK_PATH, RouteWork
from protocol.schemas import error_body
from protocol.stage import StageWireError, parse_model

log = logging.getLogger("k3.validator.route_work")


class RouteWorkServer:
    """POST /route/work on host:port (port 0: a free one); `claim(work, caller) -> (status, body)`."""

    def __init__(self, keypair, claim, host: str = "127.0.0.1", port: int = 0):
        self.hotkey = keypair.ss58_address
        self.claim = claim
        self.host, self.port = host, port
        self.nonce_store = InMemoryNonceStore()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_WORK_BYTES)
        app.router.add_post(ROUTE_WORK_PATH, self.handle)
        self._runner, self.port = await start_result_site(app, self.host, self.port, shutdown_timeout=1.0)
        log.info("route work endpoint on %s%s", self.url, ROUTE_WORK_PATH)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def handle(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"a route work claim is at most {MAX_WORK_BYTES} bytes")
        try:
            caller = verify_request(request.headers, body, "POST", request.raw_path, self.hotkey, self.nonce_store)
            work = parse_model(RouteWork, body, "route work")
        except AuthFailure as e:
            return web.Response(status=e.status, body=e.to_json(), content_type="application/json")
        except StageWireError as e:
            return _error(e.status, e.code, e.message)
        if work.tokens() > MAX_WORK_TOKENS:
            return _error(413, "too_large", f"a route work claim holds at most {MAX_WORK_TOKENS} token ids "
                                            f"(got {work.tokens()})")
        status, answer = self.claim(work, caller)
        if status != 200:
            return _error(status, answer["code"], answer["message"])
        return web.json_response(answer)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(code, message), content_type="application/json")


__all__ = ["RouteWorkServer"]
