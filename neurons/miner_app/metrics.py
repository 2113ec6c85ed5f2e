"""The miner's Prometheus counters, in their own registry (the engine has its own)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inference.serving.metrics import REQUEST_BUCKETS
from protocol.schemas import CAPABILITIES_PATH, GENERATE_PATH, HEALTH_PATH, SCORE_PATH, STATES_PATH


class MinerMetrics:
    """Miner counters, in their own registry (the engine has its own)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3_miner_requests", "Answered requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.auth_failures = Counter("k3_miner_auth_failures",
                                     "Requests refused by authentication or the validator gate, by reason",
                                     ["reason"], registry=r)
        self.rejections = Counter("k3_miner_rejections", "429 answers by reason", ["reason"], registry=r)
        self.stream_errors = Counter("k3_miner_stream_errors", "Generations ended by an error event, by code",
                                     ["code"], registry=r)
        self.disconnects = Counter("k3_miner_client_disconnects",
                                   "Requests whose client left before the answer was complete", registry=r)
        self.streams_active = Gauge("k3_miner_streams_active", "Generate and score requests in flight", registry=r)
        self.metagraph_block = Gauge("k3_miner_metagraph_block", "Block of the metagraph snapshot in use",
                                     registry=r)
        self.metagraph_age = Gauge("k3_miner_metagraph_age_seconds", "Age of the metagraph snapshot in use",
                                   registry=r)
        self.metagraph_failures = Counter("k3_miner_metagraph_read_failures", "Failed metagraph reads",
                                          registry=r)
        self.request_seconds = Histogram("k3_miner_request_duration_seconds",
                                         "Time to answer a request (a stream: until its last event), by endpoint",
                                         ["endpoint"], buckets=REQUEST_BUCKETS, registry=r)

    def observe_request(self, request, status: int, seconds: float) -> None:
        self.request_seconds.labels(ENDPOINTS.get(request.path, "other")).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


ENDPOINTS = {GENERATE_PATH: "generate", SCORE_PATH: "score", CAPABILITIES_PATH: "capabilities",
              HEALTH_PATH: "health", STATES_PATH: "states"}
