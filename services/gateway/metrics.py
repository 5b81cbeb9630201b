"""The gateway's Prometheus metrics (``llmgw_gateway_*``).

Each gateway has its own registry, not the process-global one, so several
gateways in one process (tests, embedders) count apart. In-flight requests
per replica are read from the router when scraped, so the hot path pays
nothing for them. Unknown model names are folded into one label value: a
client must not be able to grow the label set by asking for made-up models.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .httpserver import HttpServer
from .router import Router

# Latency buckets start at a millisecond (the gateway's own overhead shows at
# the low end) and reach the default upstream timeout (600 s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# A migrated stream's gap: failure detection (a reset: at once; a stall: stall_after) plus one time to first token.
GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)

UNKNOWN_MODEL = "_unknown"  # label for names that match no deployment or replica


class _RouterCollector:
    def __init__(self, router: Router):
        self.router = router

    def describe(self):
        return []

    def collect(self):
        inflight = GaugeMetricFamily("llmgw_gateway_inflight_requests", "Requests in flight through this gateway, by replica", labels=["replica", "model"])
        ready = GaugeMetricFamily("llmgw_gateway_ready_replicas", "Routable replicas, by model (cooling ones included)", labels=["model"])
        cooling = GaugeMetricFamily(
            "llmgw_gateway_replica_cooling", "1 while a replica is out of rotation (repeated failures, or ejected)", labels=["replica", "model"]
        )
        silent = GaugeMetricFamily(
            "llmgw_gateway_replica_silent_seconds",
            "How long a replica has sent no byte to any stream in flight (0: none in flight)",
            labels=["replica", "model"],
        )
        counts: dict[str, int] = {}
        for b in list(self.router.backends()):
            inflight.add_metric([b.id, b.model], b.outstanding)
            cooling.add_metric([b.id, b.model], 1.0 if self.router.cooling(b) else 0.0)
            silent.add_metric([b.id, b.model], b.silent_for)
            if b.routable:
                counts[b.model] = counts.get(b.model, 0) + 1
        for model, n in counts.items():
            ready.add_metric([model], n)
        yield inflight
        yield ready
        yield cooling
        yield silent
        d = self.router.decisions
        decisions = CounterMetricFamily(
            "llmgw_gateway_routing_decisions",
            "Replicas chosen, by reason (prefix: the prompt prefix's owner; load-bound-overflow: the owner was full, the next in "
            "its ranking took it; least-outstanding: least-outstanding routing, or no prompt to go by; retry: after a failed attempt)",
            labels=["reason"],
        )
        for reason, n in d.items():
            decisions.add_metric([reason], n)
        yield decisions
        placed = d["prefix"] + d["load-bound-overflow"]
        ratio = GaugeMetricFamily(
            "llmgw_gateway_prefix_hit_ratio", "Share of prefix-routed requests sent to their prefix's owner (the gateway's estimate of cache hits)"
        )
        ratio.add_metric([], d["prefix"] / placed if placed else 0.0)
        yield ratio


class _ServerCollector:
    """What the HTTP server holds now, read when scraped (``GatewayMetrics.server``)."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        server = self.metrics.server
        if server is None:
            return
        conns = GaugeMetricFamily("llmgw_gateway_client_connections", "Client connections open (max: gateway.max_connections)")
        conns.add_metric([], len(server.connections))
        held = GaugeMetricFamily("llmgw_gateway_buffered_body_bytes", "Request body bytes held, all connections (max: gateway.max_buffered_body_bytes)")
        held.add_metric([], server.buffered)
        yield conns
        yield held


class GatewayMetrics:
    def __init__(self, router: Router):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "llmgw_gateway_requests",
            'Requests answered, by model, HTTP status (499: the client left) and the replica that answered last ("": refused before any replica)',
            ["model", "status", "replica"],
            registry=r,
        )
        self._latency = Histogram(
            "llmgw_gateway_request_duration_seconds", "Time from request to the end of its answer", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self._ttft = Histogram(
            "llmgw_gateway_time_to_first_token_seconds", "Time from request to the first streamed chunk", ["model"], buckets=TTFT_BUCKETS, registry=r
        )
        self._upstream_errors = Counter("llmgw_gateway_upstream_errors", "Failed upstream attempts, by replica and kind", ["replica", "kind"], registry=r)
        self._retries = Counter(
            "llmgw_gateway_retries",
            "Requests retried on another replica, by why the first attempt was given up "
            "(connect, endpoint, broken: it failed; left_ready: its record left the ready state; stalled: no byte for stall_after)",
            ["model", "reason"],
            registry=r,
        )
        self._cooldowns = Counter(
            "llmgw_gateway_cooldowns",
            "Times a replica was taken out of rotation, by reason (failures: repeated failures; connect, endpoint, stalled: ejected at once)",
            ["replica", "reason"],
            registry=r,
        )
        self._stream_errors = Counter(
            "llmgw_gateway_stream_errors",
            "Streams ended with an error event after their first chunk, by reason (timeout, stream_broken, left_ready, stalled)",
            ["model", "reason"],
            registry=r,
        )
        self._migrations = Counter(
            "llmgw_gateway_stream_migrations",
            "Streams whose replica failed after their first chunk, by what broke (cause: stream_broken, left_ready, stalled, timeout, ...) "
            "and what came of it (outcome: continued on another replica; failed: the other replica failed before sending; "
            "refused: the request cannot be continued exactly; no_replica: none other was ready)",
            ["model", "cause", "outcome"],
            registry=r,
        )
        self._gap = Histogram(
            "llmgw_gateway_stream_migration_gap_seconds",
            "What a client of a moved stream saw: from the last chunk before the failure to the first chunk from the next replica",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self._served = Counter("llmgw_gateway_replica_requests", "Upstream attempts, by replica", ["replica"], registry=r)
        self._refused = Counter(
            "llmgw_gateway_bounded",
            "Connections and requests cut off by a resource bound, by reason (connection_limit: 503; read_timeout: 408 or closed; "
            "body_buffer_full: 503; response_too_large: 502; out_of_fds: 503, or an accept that failed on asyncio's loop — uvloop's closes those unseen)",
            ["reason"],
            registry=r,
        )
        self.server: HttpServer | None = None  # the HttpServer, once it exists (what it holds is read when scraped)
        r.register(_RouterCollector(router))
        r.register(_ServerCollector(self))
        # labels() takes a lock and hashes its arguments; the hot path reuses children.
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels):
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def answered(self, model: str, status: int, seconds: float, replica: str = "") -> None:
        self._child(self._requests, model, str(status), replica).inc()
        self._child(self._latency, model).observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        self._child(self._ttft, model).observe(seconds)

    def upstream_error(self, replica: str, kind: str) -> None:
        self._child(self._upstream_errors, replica, kind).inc()

    def retried(self, model: str, reason: str) -> None:
        self._child(self._retries, model, reason).inc()

    def cooled(self, replica: str, reason: str) -> None:
        self._child(self._cooldowns, replica, reason).inc()

    def stream_error(self, model: str, reason: str) -> None:
        self._child(self._stream_errors, model, reason).inc()

    def migrated(self, model: str, cause: str, outcome: str) -> None:
        self._child(self._migrations, model, cause, outcome).inc()

    def migration_gap(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def refused(self, reason: str) -> None:
        self._child(self._refused, reason).inc()

    def attempt(self, replica: str) -> None:
        self._child(self._served, replica).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
