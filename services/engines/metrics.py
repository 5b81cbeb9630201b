"""Prometheus metrics under vLLM's names, so dashboards and routers built for
vLLM read the simulated engine unchanged. Each engine has its own registry
(never the process-global one), which keeps tests and embedders independent.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's own bucket boundaries.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]

        def child(metric):
            return metric.labels(model_name=model_name)

        self.running = child(Gauge("vllm:num_requests_running", "Requests in the running batch.", label, registry=r))
        self.waiting = child(Gauge("vllm:num_requests_waiting", "Requests waiting for a batch slot.", label, registry=r))
        self.ttft = child(Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label, buckets=TTFT_BUCKETS, registry=r))
        self.e2e = child(Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", label, buckets=E2E_BUCKETS, registry=r))
        self.prompt_tokens = child(Counter("vllm:prompt_tokens", "Prefill tokens processed.", label, registry=r))
        self.generation_tokens = child(Counter("vllm:generation_tokens", "Generation tokens processed.", label, registry=r))
        # Prefix caching, as vLLM (v1) counts it: tokens of prompts looked up, and of those found cached.
        self.prefix_queries = child(Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", label, registry=r))
        self.prefix_hits = child(Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", label, registry=r))
        self.kv_usage = child(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label, registry=r))
        self._success = Counter("vllm:request_success", "Finished requests.", [*label, "finished_reason"], registry=r)
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
