"""The authority, its ledger and the `llmgw ctl cert` commands (no server needed)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from cryptography import x509

from llmgw.shared import pki
from llmgw.shared.errors import PkiError


def llmgw(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"llmgw {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def ca(tmp_path):
    pki.init_ca(tmp_path / "pki")
    return tmp_path / "pki"


def test_init_ca_refuses_to_overwrite(ca):
    before = (ca / pki.CA_KEY).read_bytes()
    with pytest.raises(PkiError, match="refusing to overwrite"):
        pki.init_ca(ca)
    assert (ca / pki.CA_KEY).read_bytes() == before


def test_keys_are_private(ca, tmp_path):
    issued = pki.issue(ca, "node01", "node", tmp_path / "out")
    assert mode(ca / pki.CA_KEY) == 0o600
    assert mode(issued.key_path) == 0o600
    assert mode(ca / pki.LEDGER) == 0o600
    assert mode(ca) == 0o700
    assert mode(issued.cert_path) == 0o644


def test_subject_carries_role_and_matches_server_mapping(ca, tmp_path):
    issued = pki.issue(ca, "node01", "node", tmp_path / "out")
    cert = x509.load_pem_x509_certificate(issued.cert_path.read_bytes())
    # The exact string nats-server's verify_and_map compares with the user name.
    assert cert.subject.rfc4514_string() == "CN=node01,OU=node" == pki.subject_dn("node", "node01")
    assert issued.entry.subject == "CN=node01,OU=node"
    assert pki.identity_of(issued.cert_path) == ("node", "node01")
    # One SAN, the identity as a URI: verify_and_map looks it up as the user's name
    # (a map look-up) before it would walk every user comparing DNs.
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.UniformResourceIdentifier("urn:llmgw:node:node01")]
    assert issued.entry.sans == ["urn:llmgw:node:node01"] == [pki.identity_uri("node", "node01")]


def test_ledger_records_issue_and_revoke(ca, tmp_path):
    pki.issue(ca, "node01", "node", tmp_path / "o")
    pki.issue(ca, "scheduler", "scheduler", tmp_path / "o2")
    assert [(e.role, e.name, e.revoked) for e in pki.ledger(ca)] == [("node", "node01", False), ("scheduler", "scheduler", False)]
    pki.revoke(ca, "node01")
    entries = {e.key: e for e in pki.ledger(ca)}
    assert entries["node/node01"].revoked
    assert [e.key for e in pki.active_identities(ca)] == ["scheduler/scheduler"]


def test_revoke_needs_role_when_name_is_ambiguous(ca, tmp_path):
    pki.issue(ca, "scheduler", "node", tmp_path / "a")
    pki.issue(ca, "scheduler", "scheduler", tmp_path / "b")
    with pytest.raises(PkiError, match="--role"):
        pki.revoke(ca, "scheduler")
    pki.revoke(ca, "scheduler", role="node")
    assert [e.key for e in pki.active_identities(ca)] == ["scheduler/scheduler"]


def test_revoke_unknown_name_is_an_error(ca):
    with pytest.raises(PkiError, match="no certificate named"):
        pki.revoke(ca, "node99")


def test_issue_without_authority_says_what_to_do(tmp_path):
    with pytest.raises(PkiError, match="init-ca"):
        pki.issue(tmp_path / "empty", "node01", "node", tmp_path / "out")


def test_damaged_ledger_is_reported_not_overwritten(ca, tmp_path):
    (ca / pki.LEDGER).write_text("{not json")
    with pytest.raises(PkiError, match="damaged"):
        pki.issue(ca, "node01", "node", tmp_path / "out")
    assert (ca / pki.LEDGER).read_text() == "{not json"


def test_server_certificate_has_sans(ca):
    issued = pki.issue_server(ca, ["127.0.0.1", "nats.example", "::1"])
    cert = x509.load_pem_x509_certificate(issued.cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert san.get_values_for_type(x509.DNSName) == ["nats.example"]


@pytest.mark.parametrize("host", ["urn:llmgw:node:node01", "a:b"])
def test_server_dns_name_with_a_colon_is_refused(ca, host):
    # No DNS name has one; refusing it keeps server SANs apart from client user names.
    with pytest.raises(PkiError, match="invalid host name"):
        pki.issue_server(ca, [host])


def test_cli_seed_onboarding_command(tmp_path):
    """The exact command the seed's onboarding script runs."""
    d, out = tmp_path / "pki", tmp_path / "tmp"
    llmgw("ctl", "cert", "init-ca", "--dir", str(d))
    llmgw("ctl", "cert", "issue-client", "node01", "--dir", str(d), "--out", str(out))
    assert (out / "node01.pem").exists() and mode(out / "node01-key.pem") == 0o600
    listing = json.loads(llmgw("ctl", "cert", "list", "--dir", str(d), "--output", "json").stdout)
    assert [(e["role"], e["name"]) for e in listing] == [("node", "node01")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["ctl", "cert", "issue-client", "Node.01"], "invalid node id"),
        (["ctl", "cert", "issue-service", "sched", "--role", "scheduler"], None),
        (["ctl", "cert", "init-ca"], "refusing to overwrite"),
        (["ctl", "cert", "revoke", "ghost"], "no certificate named"),
    ],
    ids=["bad-node-id", "service-ok", "init-twice", "revoke-unknown"],
)
def test_cli_errors_are_one_clear_line(ca, args, message):
    r = llmgw(*args, "--dir", str(ca), check=False)
    if message is None:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 2
        assert message in r.stderr
        assert "Traceback" not in r.stderr
