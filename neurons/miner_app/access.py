"""Who may call the miner and how much: refusals with their status, the validator gate
(registered, validator permit, stake) and each caller's budget (requests per window, streams at once)."""
from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from chain.interface import MetagraphSnapshot
from inference.serving import EngineError
from neurons.base.rate_limit import TokenBuckets
from neurons.miner_app.settings import AccessSettings
from protocol.errors import ErrorCode, http_status
from protocol.schemas import JSON_CONTENT_TYPE, error_body

_ERROR_CODE = re.compile(r"^[a-z0-9_]{1,64}$")


# ---------------------------------------------------------------- refusals
class Refusal(Exception):
    """A request answered with an error status and a JSON body; never reaches the engine.

    The status and the default Retry-After come from the code (protocol.errors); `status`
    is given only for aiohttp's own answers whose status has no code of its own."""

    def __init__(self, code: ErrorCode | str, message: str, retry_after_s: float | None = None,
                 close: bool = False, status: int | None = None):
        super().__init__(message)
        known = ErrorCode.parse(code)
        self.code = str(code)
        self.status = status if status is not None else http_status(code)
        self.message = message
        self.retry_after_s = retry_after_s if retry_after_s is not None or known is None else known.retry_after_s
        self.close = close

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        response = web.Response(status=self.status, body=error_body(self.code, self.message),
                                content_type=JSON_CONTENT_TYPE, headers=headers)
        if self.close:  # the unread rest of an oversized body is not worth draining
            response.force_close()
        return response


def engine_refusal(error: EngineError) -> Refusal:
    """An engine refusal as the miner's answer; a code the table lacks counts as an engine failure."""
    code = ErrorCode.parse(error.code)
    if code is None:
        return Refusal(wire_code(error.code), public_message(error), 5.0, status=503)
    return Refusal(code, public_message(error))


def wire_code(code: str) -> str:
    return code if _ERROR_CODE.match(code or "") else "engine_failure"


def public_message(error: EngineError) -> str:
    # An engine failure's message can carry internals (exception text, paths); the caller gets a plain one.
    if error.code in ("invalid_request", "context_too_long", "queue_full", "over_capacity"):
        return error.message[:1024]
    if error.code == "engine_unavailable":
        return "the engine is not serving right now; retry later"
    return "the engine failed on this request; retry later"


# ---------------------------------------------------------------- validator gate
@dataclass(frozen=True)
class CallerBudget:
    uid: int | None  # None: an owner hotkey (not necessarily registered)
    stake: float
    requests_per_window: int
    max_streams: int
    owner: str = ""  # an owner hotkey's name as configured (--owner-hotkeys); "" for a validator


class ValidatorAccess:
    """Who may call this miner and with what budget, computed once per metagraph snapshot.

    A caller must be registered, hold a validator permit and have at least
    `min_validator_stake`. Its budget is its share of the stake of all such
    validators: `requests_per_window * share` requests per window and
    `capacity * min(1, share * overcommit)` streams at once, each at least its floor.

    The owner's hotkeys (`owners`: SS58 -> the name it was configured by) pass without permit or stake, with a
    budget of their own (`owner_requests`, `owner_streams`), so that an operator can benchmark and self-check its
    own miner before it has a validator on its side (an owner hotkey that is also a permitted validator gets the
    validator's budget).
    """

    def __init__(self, snapshot: MetagraphSnapshot | None, settings: AccessSettings, capacity: int,
                 owners: Mapping[str, str] | None = None):
        self.snapshot = snapshot
        self.settings = settings
        self.owners = dict(owners or {})
        self._neurons = {n.hotkey: n for n in snapshot.neurons} if snapshot is not None else {}
        self._budgets: dict[str, CallerBudget] = {}
        owner_streams = min(capacity, settings.owner_streams or capacity)
        for hotkey, name in self.owners.items():
            self._budgets[hotkey] = CallerBudget(None, 0.0, settings.owner_requests, max(1, owner_streams), name)
        eligible = [n for n in self._neurons.values()
                    if n.validator_permit and n.stake >= settings.min_validator_stake]
        total = sum(n.stake for n in eligible)
        for n in eligible:
            share = n.stake / total if total > 0 else 0.0
            requests = max(settings.min_requests, math.ceil(settings.requests_per_window * share))
            streams = math.ceil(capacity * min(1.0, share * settings.overcommit))
            streams = min(capacity, max(settings.min_streams, streams))
            self._budgets[n.hotkey] = CallerBudget(n.uid, n.stake, requests, streams)

    def check(self, hotkey: str) -> CallerBudget:
        budget = self._budgets.get(hotkey)
        if budget is not None:
            return budget
        if self.snapshot is None:
            raise Refusal(ErrorCode.METAGRAPH_UNAVAILABLE,
                          "this miner has not read the subnet's metagraph yet; retry shortly")
        neuron = self._neurons.get(hotkey)
        netuid = self.snapshot.netuid
        if neuron is None:
            raise Refusal(ErrorCode.NOT_REGISTERED, f"hotkey {hotkey} is not registered on subnet {netuid}")
        if not neuron.validator_permit:
            raise Refusal(ErrorCode.NO_VALIDATOR_PERMIT,
                          f"uid {neuron.uid} has no validator permit on subnet {netuid}")
        raise Refusal(ErrorCode.INSUFFICIENT_STAKE,
                      f"uid {neuron.uid} has stake {neuron.stake:g}, below this miner's minimum of "
                      f"{self.settings.min_validator_stake:g}")

    def budget_of(self, hotkey: str) -> CallerBudget | None:
        return self._budgets.get(hotkey)


class CallerBudgets:
    """Per-caller request rate (a token bucket holding one window's worth) and streams at once,
    under a global cap. Everything here runs on the event loop: no locks needed."""

    def __init__(self, window_s: float, capacity: int):
        self.window_s = window_s
        self.capacity = capacity
        self._buckets = TokenBuckets(window_s)
        self._streams: dict[str, int] = {}
        self.streams_in_flight = 0

    def take_request(self, hotkey: str, budget: CallerBudget, now: float | None = None) -> None:
        wait = self._buckets.take(hotkey, budget.requests_per_window, now)
        if wait is not None:
            raise Refusal(ErrorCode.RATE_LIMITED,
                          f"this hotkey may send {budget.requests_per_window} requests per {self.window_s:g} s "
                          f"(its stake share); retry in {wait:.1f} s", wait)

    def check_request(self, hotkey: str, budget: CallerBudget, now: float | None = None) -> None:
        """take_request's refusal, without taking: for a caller whose signature is not checked yet."""
        wait = self._buckets.peek(hotkey, budget.requests_per_window, now)
        if wait is not None:
            raise Refusal(ErrorCode.RATE_LIMITED,
                          f"this hotkey may send {budget.requests_per_window} requests per {self.window_s:g} s "
                          f"(its stake share); retry in {wait:.1f} s", wait)

    def check_stream(self, hotkey: str, budget: CallerBudget) -> None:
        """open_stream's refusal, without opening."""
        self.open_stream(hotkey, budget)
        self.close_stream(hotkey)

    def open_stream(self, hotkey: str, budget: CallerBudget) -> None:
        mine = self._streams.get(hotkey, 0)
        if mine >= budget.max_streams:
            raise Refusal(ErrorCode.CALLER_STREAMS,
                          f"this hotkey has {mine} streams open; its limit (stake share) is {budget.max_streams}")
        if self.streams_in_flight >= self.capacity:
            raise Refusal(ErrorCode.OVER_CAPACITY,
                          f"all {self.capacity} streams of this miner are busy; retry later")
        self._streams[hotkey] = mine + 1
        self.streams_in_flight += 1

    def close_stream(self, hotkey: str) -> None:
        left = self._streams.get(hotkey, 0) - 1
        if left > 0:
            self._streams[hotkey] = left
        else:
            self._streams.pop(hotkey, None)
        self.streams_in_flight -= 1

    @contextlib.contextmanager
    def stream_slot(self, hotkey: str, budget: CallerBudget):
        self.open_stream(hotkey, budget)
        try:
            yield
        finally:
            self.close_stream(hotkey)
