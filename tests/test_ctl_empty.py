"""``llmgw ctl`` against a real nats-server with nothing provisioned.

Every verb says in one line what is missing and exits non-zero; none prints a
traceback. The server is real, the operator certificate is real, and ctl runs
as its own process, as an operator runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from llmgw.shared.config import write_config

from .conftest import make_server, start_on_free_ports


@pytest.fixture(scope="module")
def empty_server(tmp_path_factory):
    """One server for the whole module (a server, its authority and the operator's
    identity cost more than most of these tests): every verb here fails on an
    empty cluster without writing anything, so the tests only read it — and
    ``nothing_provisioned`` checks after each test that it is still empty."""
    srv = make_server(tmp_path_factory.mktemp("ctl-empty") / "nats")
    srv.prepare()
    start_on_free_ports(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def operator_cfg(empty_server, tmp_path_factory):
    tls = empty_server.issue("admin", "operator")
    empty_server.reload()
    cfg = tmp_path_factory.mktemp("operator") / "operator.yaml"
    write_config(cfg, {"server": empty_server.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}})
    return cfg


def jetstream_assets(server) -> dict:
    with urllib.request.urlopen(f"{server.monitor_url}/jsz", timeout=5) as r:
        jsz = json.load(r)
    return {"streams": jsz.get("streams", 0), "consumers": jsz.get("consumers", 0), "messages": jsz.get("messages", 0)}


@pytest.fixture(autouse=True)
def nothing_provisioned(request):
    """The shared server stays empty: a verb that created a stream, a bucket or a
    consumer would change what the next test sees, so it fails the test that did it."""
    yield
    if "operator_cfg" in request.fixturenames:
        server = request.getfixturevalue("empty_server")
        assert jetstream_assets(server) == {"streams": 0, "consumers": 0, "messages": 0}, f"{request.node.name} left JetStream assets behind"


def ctl(cfg, *args):
    return subprocess.run([sys.executable, "-m", "llmgw.services", "ctl", *args, "--config", str(cfg)], capture_output=True, text=True, timeout=60)


def one_line_error(r) -> str:
    """The single error line of a failed ctl run (asserting there is no traceback)."""
    assert r.returncode != 0, f"exit 0; stdout={r.stdout!r}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (("events",), "no events yet: the event stream LLMGW_EVENTS does not exist (has the scheduler started?)"),
        (("events", "-o", "json"), "no events yet: the event stream LLMGW_EVENTS does not exist (has the scheduler started?)"),
        (("nodes",), "no nodes yet: the bucket llmgw_nodes does not exist (has the registry started?)"),
        (("nodes", "-o", "json"), "no nodes yet: the bucket llmgw_nodes does not exist (has the registry started?)"),
        (("replicas",), "no replicas yet: the bucket llmgw_replicas does not exist (has the scheduler started?)"),
        (("deployments",), "no deployments yet: the bucket llmgw_deployments does not exist (has the scheduler started?)"),
        (("explain", "demo"), "the scheduler did not answer explain"),
        (("deploy", "delete", "demo"), "the scheduler did not answer delete"),
        (("cordon", "node01"), "the registry did not answer cordon"),
        (("drain", "node01"), "the registry did not answer drain"),
        (("uncordon", "node01"), "the registry did not answer uncordon"),
        (("node", "set-addr", "node01", "10.0.0.1"), "the registry did not answer set-addr"),
        (("node", "release", "node01"), "the health did not answer release"),
    ],
)
def test_each_verb_on_an_empty_cluster_says_what_is_missing(operator_cfg, args, says):
    line = one_line_error(ctl(operator_cfg, *args))
    assert says in line, line


def test_deploy_apply_on_an_empty_cluster_says_the_scheduler_is_missing(operator_cfg, tmp_path):
    f = tmp_path / "demo.yaml"
    f.write_text("name: demo\nmodel: sim-7b\nengine: sim\nreplicas: 1\nnodes_per_replica: 1\ngpus_per_node: 1\n")
    line = one_line_error(ctl(operator_cfg, "deploy", "apply", "-f", str(f)))
    assert "the scheduler did not answer apply" in line, line


@pytest.mark.parametrize(
    "before, after",
    [
        (("nodes",), ()),
        (("deploy",), ("delete", "demo")),
        (("node",), ("release", "node01")),
    ],
    ids=["nodes", "deploy-delete", "node-release"],
)
def test_config_is_read_before_the_verb_as_after_it(operator_cfg, tmp_path, before, after):
    """``ctl --config F VERB`` as kubectl takes it, and ``ctl VERB --config F``.

    Run from an empty directory with LLMGW_CONFIG unset: a --config that was not
    read would fall back to ./.llmgw/operator.yaml and say there is none.
    """
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_CONFIG"}

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "llmgw.services", "ctl", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        return one_line_error(r)

    first = run("--config", str(operator_cfg), *before, *after)
    last = run(*before, *after, "--config", str(operator_cfg))
    assert "no operator configuration" not in first, first
    assert first == last


def test_config_before_a_verb_that_reads_no_operator_yaml_is_refused(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "llmgw.services", "ctl", "--config", str(tmp_path / "operator.yaml"), "nats-config"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2
    assert "'llmgw ctl nats-config' takes no --config (it reads the PKI directory, not operator.yaml)" in r.stderr
