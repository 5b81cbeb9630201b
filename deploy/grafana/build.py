"""Build ``deploy/grafana/llmgw.json`` with Grafana's own schema library.

    pip install 'grafana-foundation-sdk==1769699379!11.6.0'   # (the test extra pins it)
    python deploy/grafana/build.py            # rewrites llmgw.json next to this file
    python deploy/grafana/build.py --check    # exit 1 if llmgw.json is not what this builds

Three rows: the cluster (nodes by state per fabric, GPUs, replicas by state,
rebuilds and how long they take, leaders, lease ages), the gateways (requests,
errors, TTFT and latency by model, retries) and the engines, through the
targets Prometheus found at the gateway's ``/sd/engines`` (vLLM's ``vllm:*``
series, which the ``sim`` engine also serves, and SGLang's ``sglang:*``).
Every expression names only metrics llmgw or the engines export
(tests/test_observability.py checks it). The datasource is a variable, so the
file imports into any Grafana with a Prometheus datasource.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUT = Path(__file__).with_name("llmgw.json")
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")


def q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    d = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    return d.legend_format(legend) if legend else d


def ts(title: str, unit: str, *queries: prometheus.Dataquery, description: str = "", width: int = 8) -> timeseries.Panel:
    p = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(width)
    if description:
        p = p.description(description)
    for i, query in enumerate(queries):
        p = p.with_target(query.ref_id(chr(ord("A") + i)))
    return p


def st(title: str, unit: str, query: prometheus.Dataquery, description: str = "", width: int = 4) -> stat.Panel:
    p = stat.Panel().title(title).unit(unit).datasource(DS).height(4).span(width).with_target(query)
    return p.description(description) if description else p


def quantile(metric: str, by: str, legend: str, p: str = "0.95", selector: str = "") -> prometheus.Dataquery:
    return q(f"histogram_quantile({p}, sum by ({by}, le) (rate({metric}_bucket{selector}[5m])))", legend)


def build() -> dashboard.Dashboard:
    d = (
        dashboard.Dashboard("llmgw")
        .uid("llmgw")
        .tags(["llmgw", "llm", "vllm", "sglang"])
        .description("llmgw: cluster, gateway and engines (deploy/grafana/build.py)")
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model")
            .label("model")
            .datasource(DS)
            .query("label_values(llmgw_gateway_requests_total, model)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
        )
    )
    m = '{model=~"$model"}'

    d = d.with_row(dashboard.Row("Cluster"))
    d = d.with_panel(st("Nodes ready", "none", q('sum(max without (instance, job) (llmgw_scheduler_nodes{state="ready"}))')))
    d = d.with_panel(st("Nodes lost", "none", q('max(llmgw_health_leases{state="lost"})'), "Lease state from the acting health monitor"))
    d = d.with_panel(st("GPUs free", "none", q('sum(max without (instance, job) (llmgw_scheduler_gpus{state="free"}))')))
    d = d.with_panel(st("Replicas ready", "none", q('max(llmgw_scheduler_replicas{state="ready"})')))
    d = d.with_panel(st("Scheduler leader", "none", q('max(llmgw_leader{service="scheduler"})'), "1: an instance leads; 0: none does"))
    d = d.with_panel(st("Health leader", "none", q('max(llmgw_leader{service="health"})'), "1: an instance leads; 0: none does"))
    d = d.with_panel(
        ts("Nodes by state, per fabric", "none", q("sum by (fabric, state) (max without (instance, job) (llmgw_scheduler_nodes))", "{{fabric}} {{state}}"))
    )
    d = d.with_panel(
        ts("GPUs by state, per fabric", "none", q("sum by (fabric, state) (max without (instance, job) (llmgw_scheduler_gpus))", "{{fabric}} {{state}}"))
    )
    d = d.with_panel(ts("Replicas by state", "none", q("max by (state) (llmgw_scheduler_replicas)", "{{state}}")))
    d = d.with_panel(
        ts(
            "Replica failures by reason",
            "ops",
            q("sum by (deployment, reason) (increase(llmgw_scheduler_replica_failures_total[$__rate_interval]))", "{{deployment}} {{reason}}"),
            description="Replicas failed or replaced, by the scheduler's bounded reason",
        )
    )
    d = d.with_panel(
        ts(
            "Rebuild time (failure to replacement ready)",
            "s",
            quantile("llmgw_scheduler_rebuild_seconds", "deployment", "p50 {{deployment}}", "0.5"),
            quantile("llmgw_scheduler_rebuild_seconds", "deployment", "p95 {{deployment}}"),
        )
    )
    d = d.with_panel(ts("Apply to ready", "s", quantile("llmgw_scheduler_apply_to_ready_seconds", "deployment", "p95 {{deployment}}")))
    d = d.with_panel(ts("Oldest lease (top 10 nodes)", "s", q("topk(10, max by (node) (llmgw_health_lease_age_seconds))", "{{node}}")))
    d = d.with_panel(ts("Deployments backing off", "none", q("max(llmgw_scheduler_deployments_backing_off)", "backing off")))
    d = d.with_panel(
        ts(
            "Lease writes",
            "ops",
            q("sum(rate(llmgw_health_lease_write_errors_total[$__rate_interval]))", "errors"),
            q("sum(rate(llmgw_health_lease_write_seconds_count[$__rate_interval]))", "batches"),
        )
    )

    d = d.with_row(dashboard.Row("Gateway"))
    d = d.with_panel(
        ts(
            "Requests by model and status",
            "reqps",
            q(f"sum by (model, status) (rate(llmgw_gateway_requests_total{m}[$__rate_interval]))", "{{model}} {{status}}"),
            width=12,
        )
    )
    d = d.with_panel(
        ts(
            "Error ratio (5xx) by model",
            "percentunit",
            q(
                f'sum by (model) (rate(llmgw_gateway_requests_total{{status=~"5..", model=~"$model"}}[$__rate_interval])) / sum by (model) (rate(llmgw_gateway_requests_total{m}[$__rate_interval]))',
                "{{model}}",
            ),
            width=12,
        )
    )
    d = d.with_panel(
        ts(
            "Time to first token (p50, p95)",
            "s",
            quantile("llmgw_gateway_time_to_first_token_seconds", "model", "p50 {{model}}", "0.5", m),
            quantile("llmgw_gateway_time_to_first_token_seconds", "model", "p95 {{model}}", "0.95", m),
        )
    )
    d = d.with_panel(
        ts(
            "Request latency (p50, p95)",
            "s",
            quantile("llmgw_gateway_request_duration_seconds", "model", "p50 {{model}}", "0.5", m),
            quantile("llmgw_gateway_request_duration_seconds", "model", "p95 {{model}}", "0.95", m),
        )
    )
    d = d.with_panel(
        ts("Retries by reason", "ops", q(f"sum by (model, reason) (rate(llmgw_gateway_retries_total{m}[$__rate_interval]))", "{{model}} {{reason}}"))
    )
    d = d.with_panel(ts("Requests by replica", "reqps", q(f"sum by (replica) (rate(llmgw_gateway_requests_total{m}[$__rate_interval]))", "{{replica}}")))
    d = d.with_panel(ts("In flight by replica", "none", q(f"sum by (replica) (llmgw_gateway_inflight_requests{m})", "{{replica}}")))
    d = d.with_panel(
        ts(
            "Stream errors and cool-downs",
            "ops",
            q(f"sum by (reason) (rate(llmgw_gateway_stream_errors_total{m}[$__rate_interval]))", "stream {{reason}}"),
            q("sum by (reason) (rate(llmgw_gateway_cooldowns_total[$__rate_interval]))", "cool-down {{reason}}"),
        )
    )

    d = d.with_row(dashboard.Row("Engines (found through /sd/engines)"))
    d = d.with_panel(
        ts(
            "Requests running / waiting",
            "none",
            q("sum by (replica) (vllm:num_requests_running)", "running {{replica}}"),
            q("sum by (replica) (vllm:num_requests_waiting)", "waiting {{replica}}"),
            q("sum by (replica) (sglang:num_running_reqs)", "running {{replica}} (sglang)"),
            q("sum by (replica) (sglang:num_queue_reqs)", "waiting {{replica}} (sglang)"),
        )
    )
    d = d.with_panel(
        ts(
            "Engine time to first token (p95)",
            "s",
            quantile("vllm:time_to_first_token_seconds", "model", "vllm {{model}}"),
            quantile("sglang:time_to_first_token_seconds", "model", "sglang {{model}}"),
        )
    )
    d = d.with_panel(
        ts(
            "KV cache usage",
            "percentunit",
            q("max by (replica) (vllm:kv_cache_usage_perc)", "{{replica}}"),
            q("max by (replica) (sglang:token_usage)", "{{replica}} (sglang)"),
        )
    )
    d = d.with_panel(
        ts(
            "Prefix cache hit rate",
            "percentunit",
            q(
                "sum by (replica) (rate(vllm:prefix_cache_hits_total[$__rate_interval])) / sum by (replica) (rate(vllm:prefix_cache_queries_total[$__rate_interval]))",
                "{{replica}}",
            ),
            q("max by (replica) (sglang:cache_hit_rate)", "{{replica}} (sglang)"),
        )
    )
    d = d.with_panel(
        ts(
            "Generation throughput",
            "none",
            q("sum by (model) (rate(vllm:generation_tokens_total[$__rate_interval]))", "vllm {{model}} tokens/s"),
            q("sum by (model) (sglang:gen_throughput)", "sglang {{model}} tokens/s"),
        )
    )
    d = d.with_panel(
        ts(
            "Engine end-to-end latency (p95)",
            "s",
            quantile("vllm:e2e_request_latency_seconds", "model", "vllm {{model}}"),
            quantile("sglang:e2e_request_latency_seconds", "model", "sglang {{model}}"),
        )
    )
    return d


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what build.py makes: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
