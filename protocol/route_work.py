"""Route work a route driver claims: the receipts of the steps it drove, submitted to a validator for credit.

A route driver (the route miner, or anyone driving routes over the subnet's stage miners) POSTs
`ROUTE_WORK_PATH` to a validator's work endpoint, btauth/1-signed for the validator's hotkey, with a JSON
`RouteWork`: per step the route, session and step, the request the session served (`request_id`: the id of a
request the validator itself sent to this driver), the token ids it sent the first stage (what the first
receipt's input hash must hash to, as the driver framed them) and every stage's signed receipt. The validator
audits the receipts (signed by registered stage miners for their layers, for sessions this driver opened,
chained from those ids, every layer once) and credits each stage the step's tokens, but only for requests it
sent this driver, and at most the tokens it measured for that request: work nobody asked for earns nothing.
Receipts the stages never signed blame the driver and credit no one.

Answers: 200 {"steps", "credited_tokens", "held_steps", "uncredited_steps", "credited_before_steps"} (held: the
request is not measured yet, credited once it is; credited before: steps this driver claimed and was credited for
already, sent again after an answer it never got); 400 a malformed claim; 401/403 the signature; 413 too large; 422
receipts that do not audit (the driver is blamed; {"error": {"code": "receipts_rejected", "message"}}); 503
the validator has not found the stage miners yet (try again later).
"""
from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field

from .stage import _ID, MAX_RECEIPTS, Receipt, _Msg

ROUTE_WORK_PATH = "/route/work"
MAX_WORK_STEPS = 256  # steps per claim
MAX_STEP_TOKENS = 4096  # token ids per step
MAX_WORK_TOKENS = 1 << 16  # token ids per claim
MAX_WORK_BYTES = 8 * 1024 * 1024  # request body


class RouteWorkStep(_Msg):
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    step: int = Field(ge=0, le=2**31 - 1)
    position: int = Field(ge=0, le=2**31 - 1)
    request_id: str = Field("", max_length=128, pattern=r"^[A-Za-z0-9._:\-]*$")
    rewind: Optional[int] = Field(None, ge=0, le=2**31 - 1)  # the rewind the forward carried, if any
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=MAX_STEP_TOKENS)
    receipts: list[Receipt] = Field(min_length=1, max_length=MAX_RECEIPTS)


class RouteWork(_Msg):
    steps: list[RouteWorkStep] = Field(min_length=1, max_length=MAX_WORK_STEPS)

    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.steps)


__all__ = ["MAX_STEP_TOKENS", "MAX_WORK_BYTES", "MAX_WORK_STEPS", "MAX_WORK_TOKENS", "ROUTE_WORK_PATH", "RouteWork",
           "RouteWorkStep"]
