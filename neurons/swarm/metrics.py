"""The stage miner's Prometheus metrics, in their own registry, every series labelled with the served layers.

Forwards and tokens by kind (prefill: several new tokens, decode: one, score: teacher-forced scoring on the
head), the compute time of one forward, open sessions, refused requests by reason (the error code answered)
and forwards that failed after being accepted, by reason (the code reported to the route driver)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inference.serving.metrics import REQUEST_BUCKETS, TOKEN_BUCKETS
from protocol.stage import CAPABILITIES_PATH, CLOSE_PATH, FORK_PATH, FORWARD_PATH, HEALTH_PATH, OPEN_PATH, REWIND_PATH

FORWARD_KINDS = ("prefill", "decode", "score")
ENDPOINTS = {OPEN_PATH: "open", FORWARD_PATH: "forward", REWIND_PATH: "rewind", FORK_PATH: "fork",
             CLOSE_PATH: "close", CAPABILITIES_PATH: "capabilities", HEALTH_PATH: "health"}


def forward_kind(mode: str, tokens: int) -> str:
    """prefill, decode or score: what one forward of `tokens` new tokens in head mode `mode` is."""
    if mode == "score":
        return "score"
    return "decode" if tokens == 1 else "prefill"


class StageMetrics:
    """Stage miner counters; `layers` (such as "0-5") labels every series."""

    def __init__(self, layers: str):
        r = self.registry = CollectorRegistry()
        self.layers = layers
        self._forwards = Counter("k3_stage_forwards", "Forwards computed, by kind (prefill, decode, score)",
                                 ["layers", "kind"], registry=r)
        self._tokens = Counter("k3_stage_tokens", "Tokens computed, by kind of forward", ["layers", "kind"],
                               registry=r)
        self._step_seconds = Histogram("k3_stage_step_duration_seconds",
                                       "Compute time of one forward through the block, by kind",
                                       ["layers", "kind"], buckets=TOKEN_BUCKETS, registry=r)
        self.sessions_open = Gauge("k3_stage_sessions_open", "Sessions open on this stage", ["layers"], registry=r)
        self._refusals = Counter("k3_stage_refusals", "Requests refused (4xx), by reason", ["layers", "reason"],
                                 registry=r)
        self._failures = Counter("k3_stage_forward_failures",
                                 "Accepted forwards that ended in an error result sent to the route driver, by reason",
                                 ["layers", "reason"], registry=r)
        self._requests = Counter("k3_stage_requests", "Answered requests by endpoint and HTTP status",
                                 ["layers", "endpoint", "status"], registry=r)
        self._request_seconds = Histogram("k3_stage_request_duration_seconds",
                                          "Time to answer a request (a forward: until its 202), by endpoint",
                                          ["layers", "endpoint"], buckets=REQUEST_BUCKETS, registry=r)
        for kind in FORWARD_KINDS:  # every kind is shown from the start, at 0
            self._forwards.labels(layers, kind)
            self._tokens.labels(layers, kind)

    def forward(self, mode: str, tokens: int, seconds: float) -> None:
        kind = forward_kind(mode, tokens)
        self._forwards.labels(self.layers, kind).inc()
        self._tokens.labels(self.layers, kind).inc(tokens)
        self._step_seconds.labels(self.layers, kind).observe(seconds)

    def refused(self, reason: str) -> None:
        self._refusals.labels(self.layers, reason).inc()

    def failed(self, reason: str) -> None:
        self._failures.labels(self.layers, reason).inc()

    def observe_request(self, request, status: int, seconds: float) -> None:
        """observed_app's hook: every answered request."""
        endpoint = ENDPOINTS.get(request.path, "other")
        self._requests.labels(self.layers, endpoint, str(status)).inc()
        self._request_seconds.labels(self.layers, endpoint).observe(seconds)
