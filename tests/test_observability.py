"""Metrics, dashboards and alerts.

* ``deploy/grafana/llmgw.json`` is what ``deploy/grafana/build.py`` makes with
  Grafana's schema library (skipped, visibly, without grafana-foundation-sdk);
* every query in it names only metrics llmgw exports (the services' real
  registries) or the engines do (a real ``sim`` engine's ``/metrics``, plus the
  SGLang names declared below);
* ``promtool test rules`` passes ``deploy/prometheus/alerts_test.yml``, and
  ``promtool check config`` the example configuration (skipped, visibly,
  without promtool: Debian's ``prometheus`` package);
* the rebuild, apply-to-ready, leader and lease-age metrics move on a real
  control plane with real agents and engines when an engine is killed, and
  ``promtool check metrics`` accepts every service's real exposition.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from llmgw.services.gateway.metrics import GatewayMetrics
from llmgw.services.gateway.router import Router
from llmgw.services.scheduler.metrics import REBUILD_REASONS, RebuildClock, rebuild_reason
from llmgw.shared.events import Event

from . import spawning
from .gateway_helpers import metric_sum, start_sims

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
PROMETHEUS = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")

# SGLang's metric names the dashboard uses (SGLang's own docs, "Production Metrics");
# no engine here serves them, so they are declared, not scraped.
SGLANG_METRICS = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:gen_throughput",
    "sglang:time_to_first_token_seconds_bucket",
    "sglang:e2e_request_latency_seconds_bucket",
}


# -- the dashboard -------------------------------------------------------------------


def test_the_committed_dashboard_is_what_build_py_makes():
    if importlib.util.find_spec("grafana_foundation_sdk") is None:
        pytest.skip("grafana-foundation-sdk not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, str(ROOT / "deploy" / "grafana" / "build.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "le", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, label names,
    strings, durations and Grafana variables left out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)  # grouping labels
    s = re.sub(r"\$\w+", "", s)  # $model, $__rate_interval
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        rest = s[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        if re.fullmatch(r"\d", word[0]):
            continue
        names.add(word)
    return names


def test_metric_names_reads_what_the_expression_reads():
    assert metric_names('histogram_quantile(0.95, sum by (model, le) (rate(llmgw_gateway_time_to_first_token_seconds_bucket{model=~"$model"}[5m])))') == {
        "llmgw_gateway_time_to_first_token_seconds_bucket"
    }
    assert metric_names("sum by (replica) (rate(vllm:prefix_cache_hits_total[$__rate_interval])) / sum(x_total) unless on (model) y > 0") == {
        "vllm:prefix_cache_hits_total",
        "x_total",
        "y",
    }


def llmgw_sample_names() -> set[str]:
    """Every sample name llmgw's services can expose: the process registry after
    importing each service, and a gateway's own registry."""
    for mod in ("llmgw.services.registry", "llmgw.services.health.service", "llmgw.services.scheduler.service", "llmgw.shared.leader"):
        __import__(mod)
    families = list(REGISTRY.collect()) + list(GatewayMetrics(Router(cooldown=1, failures_before_cooldown=1, retry_after=1)).registry.collect())
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("_count", "_sum", "_created"),
        "gauge": ("",),
    }
    names = set()
    for f in families:
        if f.name.startswith("llmgw_"):
            names |= {f.name + s for s in suffixes.get(f.type, ("",))}
    return names


async def test_every_dashboard_query_names_an_exported_metric(tmp_path):
    (sim,) = await start_sims(tmp_path, [("a", "org/alpha", 0.0)])
    try:
        engine = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", await sim.metrics(), re.MULTILINE)}
        text = await sim.metrics()
    finally:
        sim.kill()
    engine_samples = {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.MULTILINE)}
    # a labelled histogram or counter with no sample yet still has its # TYPE line
    for line in re.finditer(r"^# TYPE (\S+) (counter|histogram|gauge)$", text, re.MULTILINE):
        name, kind = line.groups()
        engine_samples |= {name + s for s in {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}[kind]}
    assert "vllm:num_requests_running" in engine
    known = llmgw_sample_names() | engine_samples | SGLANG_METRICS

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 30
    unknown = {(name, e) for e in exprs for name in metric_names(e) if name not in known}
    assert not unknown, unknown
    # and the dashboard covers what the issue asks for
    used = {n for e in exprs for n in metric_names(e)}
    for wanted in (
        "llmgw_scheduler_nodes",
        "llmgw_scheduler_gpus",
        "llmgw_scheduler_replicas",
        "llmgw_scheduler_replica_failures_total",
        "llmgw_scheduler_rebuild_seconds_bucket",
        "llmgw_gateway_requests_total",
        "llmgw_gateway_time_to_first_token_seconds_bucket",
        "llmgw_gateway_request_duration_seconds_bucket",
        "llmgw_gateway_retries_total",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert wanted in used, wanted


# -- alerts and the example configuration ----------------------------------------------


@needs_promtool
def test_alert_rules_pass_their_unit_tests():
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # one test group at least per alert
    alerts = set(re.findall(r"^\s+- alert: (\w+)$", (PROMETHEUS / "alerts.yml").read_text(), re.MULTILINE))
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    assert alerts and alerts <= tested, alerts - tested


@needs_promtool
def test_the_example_prometheus_configuration_is_valid():
    r = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# -- the rebuild metrics, pure ----------------------------------------------------------


@pytest.mark.parametrize(
    "reason, label",
    [
        ("node node02 lost", "node_lost"),
        ("node node02 lost; node node03 lost", "node_lost"),
        ("node node02 has no record", "node_lost"),
        ("GPU 3 on node02 unhealthy: XID 79", "hardware"),
        ("fabric ib-a unusable on node02: no ACTIVE HCA port", "hardware"),
        ("member rank 1 on node02 exited", "engine_exited"),
        ("member rank 1 on node02 absent", "engine_exited"),
        ("member rank 0 on node01 peer-lost: rank 1 lost (connection reset)", "peer_lost"),
        ("not ready within 30s of launch (node01: starting, node02: exited)", "startup_timeout"),
        ("leader on node01 made no progress for 30s: canary sent 12:00:01 got no token in 3s", "hang"),
        ("deployment spec changed; replaced by a replica of the new spec", "spec_changed"),
        ("node node02, node03 draining; replaced", "drained"),
        ("no members recorded", "no_members"),
        ("something nobody wrote yet", "other"),
    ],
)
def test_rebuild_reason_is_a_bounded_word(reason, label):
    assert rebuild_reason(reason) == label
    assert label in REBUILD_REASONS


def _ev(at, what, frm, detail, dep="clockdep"):
    return Event(time=at, kind="replica", subject="r", what=what, detail=detail, data={"deployment": dep, "generation": "1", "from": frm})


def _count(name, **labels) -> float:
    return metric_sum(generate_latest(REGISTRY).decode(), name, **labels)


def test_rebuild_clock_times_a_failure_to_the_next_replica_ready():
    clock = RebuildClock()
    before = (_count("llmgw_scheduler_rebuild_seconds_count", deployment="clockdep"), _count("llmgw_scheduler_rebuild_seconds_sum", deployment="clockdep"))
    failed = _count("llmgw_scheduler_replica_failures_total", deployment="clockdep", reason="node_lost")
    spec_changed = _count("llmgw_scheduler_replica_failures_total", deployment="clockdep", reason="spec_changed")
    clock.events([_ev(100.0, "failed", "ready", "node node02 lost"), _ev(100.0, "reaping", "failed", "node node02 lost; stopping node01")])
    clock.events([_ev(105.0, "ready", "degraded", "leader on node01 making progress again")])  # not a replacement
    clock.events([_ev(101.0, "reaping", "ready", "scaled down to 1; stopping node01")])  # nothing rebuilt: not counted
    clock.events([_ev(102.0, "reaping", "ready", "deployment spec changed; replaced by a replica of the new spec; stopping node01")])
    clock.events([_ev(112.5, "ready", "waiting-for-workers", "leader on node03 serving")])
    assert _count("llmgw_scheduler_replica_failures_total", deployment="clockdep", reason="node_lost") == failed + 1
    assert _count("llmgw_scheduler_replica_failures_total", deployment="clockdep", reason="spec_changed") == spec_changed + 1
    after = (_count("llmgw_scheduler_rebuild_seconds_count", deployment="clockdep"), _count("llmgw_scheduler_rebuild_seconds_sum", deployment="clockdep"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 12.5)


def test_rebuild_clock_counts_a_restart_in_place_and_closes_on_a_promotion_or_a_spare_standing_by():
    clock = RebuildClock()
    restarts = _count("llmgw_scheduler_restarts_in_place_total", deployment="clockdep2")
    timed = (_count("llmgw_scheduler_rebuild_seconds_count", deployment="clockdep2"), _count("llmgw_scheduler_rebuild_seconds_sum", deployment="clockdep2"))
    clock.events([_ev(200.0, "restarting", "ready", "restart in place: member rank 0 on node01 exited", dep="clockdep2")])
    clock.events([_ev(200.0, "ready", "standby", "promoted from standby: 1 of 2 serving", dep="clockdep2")])  # capacity back at once
    clock.events([_ev(210.0, "failed", "ready", "node node02 lost", dep="clockdep2")])
    clock.events([_ev(226.0, "standby", "waiting-for-workers", "leader on node05 loaded; a warm spare", dep="clockdep2")])
    assert _count("llmgw_scheduler_restarts_in_place_total", deployment="clockdep2") == restarts + 1
    after = (_count("llmgw_scheduler_rebuild_seconds_count", deployment="clockdep2"), _count("llmgw_scheduler_rebuild_seconds_sum", deployment="clockdep2"))
    assert (after[0] - timed[0], after[1] - timed[1]) == (2, 16.0)


# -- a real control plane -----------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_rebuild_leader_and_lease_metrics_on_a_real_cluster(nats_server, connector, tmp_path):
    from .cluster_helpers import MOVE, Cluster
    from .test_control_plane import bring_up, spec

    cluster = Cluster(nats_server, tmp_path / "cluster")
    try:
        await bring_up(cluster, connector, nodes=2, **MOVE)  # the worker's kill below moves the replica
        scheduler = next(s for s in cluster.services if s.role == "scheduler")
        health = next(s for s in cluster.services if s.role == "health")
        dep = f"obs{os.getpid()}"
        applied = _count("llmgw_scheduler_apply_to_ready_seconds_count", deployment=dep)
        await cluster.apply(spec(name=dep))
        (first,) = await cluster.wait(lambda: cluster.ready(dep), what="replica ready")
        await cluster.wait(lambda: _count("llmgw_scheduler_apply_to_ready_seconds_count", deployment=dep), applied + 1, what="apply to ready observed")

        text = generate_latest(REGISTRY).decode()
        assert metric_sum(text, "llmgw_leader", service="scheduler", instance=scheduler.instance) == 1
        assert metric_sum(text, "llmgw_leader", service="health", instance=health.instance) == 1
        ages = {n: metric_sum(text, "llmgw_health_lease_age_seconds", node=n) for n in ("node01", "node02")}
        assert all(0 <= a < 5 for a in ages.values()), ages
        assert 'llmgw_health_lease_age_seconds{node="node01"}' in text
        assert metric_sum(text, "llmgw_scheduler_gpus", fabric="ib-a", state="used") == 4  # 2 nodes × 2 GPUs
        assert metric_sum(text, "llmgw_scheduler_gpus", fabric="ib-a", state="free") == 4
        assert metric_sum(text, "llmgw_scheduler_nodes", fabric="ib-a", state="ready", admin="active") == 2

        os.kill(first.members[1].pid, signal.SIGKILL)  # the worker engine dies; its agent lives
        await cluster.wait(lambda: [r for r in cluster.ready(dep) if r.id != first.id], what="replacement ready")
        await cluster.wait(lambda: _count("llmgw_scheduler_rebuild_seconds_count", deployment=dep), 1, what="rebuild observed")
        # Whichever the scheduler hears first: the worker's agent says it exited, or the
        # leader's says its peer is gone. One failure, under one of those two words.
        assert _count("llmgw_scheduler_replica_failures_total", deployment=dep) == 1
        assert (
            _count("llmgw_scheduler_replica_failures_total", deployment=dep, reason="engine_exited")
            + _count("llmgw_scheduler_replica_failures_total", deployment=dep, reason="peer_lost")
            == 1
        )
        assert 0 < _count("llmgw_scheduler_rebuild_seconds_sum", deployment=dep) < 60

        if PROMTOOL:
            gw = GatewayMetrics(Router(cooldown=1, failures_before_cooldown=1, retry_after=1))
            gw.answered("sim-7b", 200, 0.1, first.id)
            for name, exposition in (("services", generate_latest(REGISTRY)), ("gateway", gw.render())):
                r = await spawning.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
                assert r.returncode == 0, (name, r.stdout.decode() + r.stderr.decode())
    finally:
        await cluster.close()
