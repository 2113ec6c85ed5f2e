"""Engine metrics for Prometheus, named and meant as vLLM's where vLLM has one, with a `k3:` prefix in
place of `vllm:` (a dashboard written for vLLM works after s/vllm:/k3:/):

    k3:prompt_tokens_total, k3:generation_tokens_total           counters (rate() gives tokens/s)
    k3:time_to_first_token_seconds                               submission -> first token
    k3:inter_token_latency_seconds                               between two tokens of a stream
    k3:request_time_per_output_token_seconds                     per request: (end - first token) / (tokens - 1)
    k3:e2e_request_latency_seconds                               submission -> last token
    k3:request_queue_time_seconds                                submission -> admission (waiting for memory)
    k3:request_prefill_time_seconds                              admission -> prefill done
    k3:request_success_total{finished_reason}                    finished requests by reason (eos, stop, length,
                                                                 cancelled)
    k3:num_requests_running, k3:num_requests_waiting             gauges
    k3:kv_cache_usage_perc                                       cache memory reserved / budget, 0..1
    k3:kv_cache_reserved_bytes, k3:engine_step_seconds           ours: no vLLM equivalent

Every series carries `model_name`. Latency buckets reach 30 minutes: a long-context prefill on a sharded
cluster takes minutes. Each engine has its own registry so several engines (tests, a validator's reference
engine beside a gateway) never collide.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; from sub-millisecond steps to half-hour requests.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0)
FINISH_REASONS = ("eos", "stop", "length", "cancelled")


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "kimi-k3"):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def histogram(name, text, buckets):
            return Histogram(name, text, m, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, text):
            return Gauge(name, text, m, registry=r).labels(model_name)

        self.prompt_tokens = Counter("k3:prompt_tokens", "Prompt tokens of finished requests", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("k3:generation_tokens", "Tokens generated", m, registry=r).labels(model_name)
        self.ttft_seconds = histogram("k3:time_to_first_token_seconds", "Time from submission to the first token",
                                      REQUEST_BUCKETS)
        self.inter_token_seconds = histogram("k3:inter_token_latency_seconds", "Time between two tokens of a stream",
                                             TOKEN_BUCKETS)
        self.time_per_output_token = histogram("k3:request_time_per_output_token_seconds",
                                               "Per request: decode time over the tokens after the first",
                                               TOKEN_BUCKETS)
        self.e2e_seconds = histogram("k3:e2e_request_latency_seconds", "Time from submission to the end",
                                     REQUEST_BUCKETS)
        self.queue_seconds = histogram("k3:request_queue_time_seconds",
                                       "Time from submission to admission (waiting for cache memory or a slot)",
                                       REQUEST_BUCKETS)
        self.prefill_seconds = histogram("k3:request_prefill_time_seconds", "Time from admission to prefill done",
                                         REQUEST_BUCKETS)
        self._finished = Counter("k3:request_success", "Finished requests by finish reason",
                                 m + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # every reason is exported from the start (rate() needs a first sample)
            self._finished.labels(model_name, reason)
        self.active_sequences = gauge("k3:num_requests_running", "Sequences being served")
        self.queue_length = gauge("k3:num_requests_waiting", "Requests waiting for admission")
        self.cache_usage = gauge("k3:kv_cache_usage_perc", "Cache memory reserved over the budget (0..1)")
        self.cache_bytes_reserved = gauge("k3:kv_cache_reserved_bytes",
                                          "Cache memory reserved for admitted sequences (full requested length)")
        self.step_seconds = histogram("k3:engine_step_seconds", "Duration of one scheduler step", TOKEN_BUCKETS)

    def record_finished(self, reason: str, prompt_tokens: int, completion_tokens: int, submitted_at: float,
                        admitted_at: float | None, first_token_at: float | None, end: float,
                        prefill_done_at: float | None = None) -> None:
        """One request's end: counters and per-request histograms (times from one perf_counter clock)."""
        self._finished.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e_seconds.observe(end - submitted_at)
        if admitted_at is not None:
            self.queue_seconds.observe(admitted_at - submitted_at)
            if prefill_done_at is not None:
                self.prefill_seconds.observe(prefill_done_at - admitted_at)
        if first_token_at is not None and completion_tokens > 1:
            self.time_per_output_token.observe((end - first_token_at) / (completion_tokens - 1))

    def exposition(self) -> bytes:
        """The Prometheus text format of this engine's metrics."""
        return generate_latest(self.registry)
