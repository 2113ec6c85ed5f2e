"""Engine metrics for Prometheus: TTFT, inter-token latency, queue, active sequences,
tokens/s and cache memory. Each engine has its own registry so several engines (tests,
a validator's reference engine beside a gateway) never collide."""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, window_s: float = 10.0):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft_seconds = Histogram("k3_engine_ttft_seconds", "Time from submission to first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram("k3_engine_inter_token_seconds", "Time between consecutive tokens",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("k3_engine_step_seconds", "Duration of one scheduler step",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("k3_engine_queue_length", "Requests waiting for admission", registry=r)
        self.active_sequences = Gauge("k3_engine_active_sequences", "Sequences being served", registry=r)
        self.cache_bytes_reserved = Gauge("k3_engine_cache_bytes_reserved",
                                          "Cache memory reserved for admitted sequences (full requested length)",
                                          registry=r)
        self.generated_tokens = Counter("k3_engine_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge("k3_engine_tokens_per_second",
                                       f"Generated tokens per second over the last {window_s:g} s", registry=r)
        self._window_s = window_s
        self._recent: collections.deque[float] = collections.deque()

    def record_token(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self._recent.append(now)
        while self._recent and self._recent[0] < now - self._window_s:
            self._recent.popleft()
        self.tokens_per_second.set(len(self._recent) / self._window_s)

    def exposition(self) -> bytes:
        """The Prometheus text format of this engine's metrics."""
        return generate_latest(self.registry)
