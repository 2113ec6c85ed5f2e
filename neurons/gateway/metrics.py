"""The organic gateway's Prometheus metrics (served on the validator's metrics port, 127.0.0.1 only):

    k3_gateway_requests_total{endpoint,status,model_name}        answered user requests
    k3_gateway_e2e_request_latency_seconds{endpoint,model_name}  whole request, failovers included
    k3_gateway_time_to_first_token_seconds{model_name}           the serving miner's first token, from its call
    k3_gateway_time_per_output_token_seconds{model_name}         the serving miner's decode time per token
    k3_gateway_generation_tokens_total{model_name}               tokens relayed (rate() gives tokens/s)
    k3_gateway_miner_attempts_total{result}                      ok, error, tier0_failed
    k3_gateway_failovers_total{model_name}                       a miner failed and the next one was tried
    k3_gateway_rate_limited_total{key_id}                        429s per API key id (never the key itself)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from inference.serving.metrics import REQUEST_BUCKETS, TOKEN_BUCKETS

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models",
             "/health": "health"}


class GatewayMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("k3_gateway_requests", "Answered user requests by endpoint and HTTP status",
                                ["endpoint", "status", "model_name"], registry=r)
        self.e2e_seconds = Histogram("k3_gateway_e2e_request_latency_seconds",
                                     "Whole user request, failovers included", ["endpoint", "model_name"],
                                     buckets=REQUEST_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("k3_gateway_time_to_first_token_seconds",
                                      "First token of the answering miner, from the start of its call",
                                      ["model_name"], buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        self.tpot_seconds = Histogram("k3_gateway_time_per_output_token_seconds",
                                      "Answering miner's decode time over the tokens after the first",
                                      ["model_name"], buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.generation_tokens = Counter("k3_gateway_generation_tokens", "Tokens of verified answers",
                                         ["model_name"], registry=r).labels(model_name)
        self.attempts = Counter("k3_gateway_miner_attempts", "Calls to miners by result", ["result"], registry=r)
        for result in ("ok", "error", "tier0_failed"):
            self.attempts.labels(result)
        self.failovers = Counter("k3_gateway_failovers", "Miner attempts that failed before anything reached the "
                                 "user (the next miner is tried, if any is left)", ["model_name"],
                                 registry=r).labels(model_name)
        self.rate_limited = Counter("k3_gateway_rate_limited", "Requests refused by the per-key rate limit",
                                    ["key_id"], registry=r)

    def observe_request(self, request, status: int, seconds: float) -> None:
        endpoint = ENDPOINTS.get(request.path, "model" if request.path.startswith("/v1/models/") else "other")
        self.requests.labels(endpoint, str(status), self.model_name).inc()
        if endpoint in ("chat", "completions"):
            self.e2e_seconds.labels(endpoint, self.model_name).observe(seconds)

    def observe_attempt(self, outcome, tier0_failures) -> None:
        """One call to a miner: a GenerateResult (verified by tier 0 or not) or a MinerError."""
        if not hasattr(outcome, "token_arrivals_s"):
            self.attempts.labels("error").inc()
            return
        if tier0_failures:
            self.attempts.labels("tier0_failed").inc()
            return
        self.attempts.labels("ok").inc()
        arrivals = outcome.token_arrivals_s
        self.generation_tokens.inc(len(arrivals))
        if arrivals:
            self.ttft_seconds.observe(arrivals[0])
        if len(arrivals) > 1:
            self.tpot_seconds.observe((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
