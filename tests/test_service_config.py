"""Service and operator configuration files: refused with the file, the key and what was expected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from llmgw.shared.config import load_service_config
from llmgw.shared.errors import ConfigError


@pytest.fixture
def tls(tmp_path):
    for f in ("ca.pem", "svc.pem", "svc-key.pem"):
        (tmp_path / f).write_text("x")
    return "tls: {ca: ca.pem, cert: svc.pem, key: svc-key.pem}\n"


@pytest.mark.parametrize(
    "body, message",
    [
        ("server: tls://127.0.0.1:4222\n{tls}health: {{heartbeat_intervl: 5s}}\n", "health.heartbeat_intervl: unknown key; did you mean 'heartbeat_interval'?"),
        ("server: https://10.0.0.140:7443\n{tls}", "HTTP(S) endpoint from the earlier design"),
        ("server: tls://127.0.0.1:4222\nserver: tls://127.0.0.2:4222\n{tls}", "appears twice"),
        ("server: tls://127.0.0.1:4222\n{tls}health: {{node_lost_after: soon}}\n", "health.node_lost_after: 'soon' is not a duration"),
        ("server: tls://127.0.0.1:4222\n{tls}kv_replicas: three\n", "kv_replicas: expected a whole number, got a string 'three'"),
        ("server: tls://127.0.0.1:4222\n{tls}health: {{heartbeat_interval: 30s, node_lost_after: 60s}}\n", "must be longer than"),
        ("server: tls://127.0.0.1:4222\ntls: {{ca: ca.pem, cert: missing.pem, key: svc-key.pem}}\n", "tls.cert: file"),
        ("{tls}", "server: required key is missing"),
        ("server: [tls://127.0.0.1:4222\n", "YAML syntax error"),
        ("server: tls://127.0.0.1:4222\n{tls}scheduler: {{restart_in_place: -1}}\n", "restart_in_place and peer_lost_grace must not be negative"),
    ],
    ids=["typo", "https", "duplicate", "duration", "type", "lost-before-suspect", "missing-file", "missing-key", "yaml", "restart-budget"],
)
def test_bad_service_configs_are_refused_clearly(tmp_path, tls, body, message):
    path = tmp_path / "svc.yaml"
    path.write_text(body.format(tls=tls))
    with pytest.raises(ConfigError) as e:
        load_service_config(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


S = "server: tls://127.0.0.1:4222\n"
TOP_KEYS = "server, tls, metrics_listen, kv_replicas, reconnect_base, reconnect_max, health, scheduler, gateway"

# Each refusal, word for word after "<file>: ": the key path, then what is wrong.
REFUSALS = [
    ("bad-type", S + "{tls}kv_replicas: three\n", "kv_replicas: expected a whole number, got a string 'three'"),
    ("bad-type-float-for-int", S + "{tls}health: {{suspect_after_missed: 2.5}}\n", "health.suspect_after_missed: expected a whole number, got a number 2.5"),
    ("bad-type-bool", S + "{tls}gateway: {{access_log: sometimes}}\n", "gateway.access_log: expected true or false, got a string 'sometimes'"),
    ("bad-type-described", "server: 4222\n{tls}", "server: expected a NATS URL or a list of them, got an integer 4222"),
    ("section-not-a-mapping", S + "{tls}health: [5s]\n", "health: expected a mapping of keys, got a list"),
    ("unknown-key-suggests", S + "{tls}scheduler: {{hang_timout: 5s}}\n", "scheduler.hang_timout: unknown key; did you mean 'hang_timeout'?"),
    ("unknown-key-lists-known", S + "{tls}colour: blue\n", f"colour: unknown key (known keys here: {TOP_KEYS})"),
    ("unknown-key-not-a-string", S + "{tls}1: x\n", f"1: unknown key (known keys here: {TOP_KEYS})"),
    ("internal-field-is-unknown", S + "{tls}source: other.yaml\n", f"source: unknown key (known keys here: {TOP_KEYS})"),
    (
        "full-pass-below-step",
        S + "{tls}scheduler: {{full_pass_interval: 500ms}}\n",
        "scheduler.full_pass_interval: 0.5s is below reconcile_interval (1s): a full pass is at most one a step",
    ),
    ("coalesce-too-long", S + "{tls}health: {{io_coalesce: 500ms}}\n", "health.io_coalesce: must be between 0 and 100ms, not 0.5s"),
    ("bad-duration", S + "{tls}health: {{node_lost_after: soon}}\n", "health.node_lost_after: 'soon' is not a duration; write e.g. 500ms, 5s, 1m or 1h30m"),
    ("bad-duration-type", S + "{tls}gateway: {{cooldown: [1s]}}\n", "gateway.cooldown: expected a duration such as 5s or 1m, got list"),
    ("negative-duration", S + "{tls}reconnect_base: -1\n", "reconnect_base: a duration cannot be negative (-1)"),
    ("missing-required", "{tls}", "server: required key is missing"),
    ("missing-required-nested", S + "tls: {{ca: ca.pem, cert: svc.pem}}\n", "tls.key: required key is missing"),
    ("not-one-of-the-choices", S + "{tls}gateway: {{routing: random}}\n", "gateway.routing: 'random' is not one of prefix, least-outstanding"),
    (
        "max-migrations-range",
        S + "{tls}gateway: {{max_migrations: 17}}\n",
        "gateway.max_migrations: must be a whole number from 0 (never move a request) to 16, got 17",
    ),
    ("migration-text-positive", S + "{tls}gateway: {{stream_migration_max_text: 0}}\n", "gateway.stream_migration_max_text: must be at least 1 character"),
    ("stream-migration-bool", S + "{tls}gateway: {{stream_migration: maybe}}\n", "gateway.stream_migration: expected true or false, got a string 'maybe'"),
    ("value-of-a-key", S + "{tls}scheduler: {{auto_cordon_max_share: 2}}\n", "scheduler.auto_cordon_max_share: a share between 0 and 1, got 2.0"),
    ("values-of-a-section", S + "{tls}gateway: {{tls_cert: gw.pem}}\n", "gateway: tls_cert and tls_key go together (HTTPS needs both)"),
    ("values-across-sections", S + "{tls}reconnect_base: 1m\n", "reconnect_base: 60s is longer than reconnect_max (30s)"),
    ("unknown-top-key-suggests", S + "{tls}severs: [tls://b:4222]\n", "severs: unknown key; did you mean 'server'?"),
    (
        "server-list-element",
        "server: [tls://a:4222, https://b:7443]\n{tls}",
        "server[1]: 'https://b:7443' is an HTTP(S) endpoint from the earlier design; the control plane is now reached "
        "through NATS: write the NATS server's URL, e.g. tls://b:4222",
    ),
    ("listen-not-host-port", S + "{tls}gateway: {{listen: localhost}}\n", "gateway.listen: 'localhost' is not HOST:PORT (e.g. 127.0.0.1:8080)"),
    ("listen-port-too-high", S + "{tls}gateway: {{listen: '127.0.0.1:70000'}}\n", "gateway.listen: '127.0.0.1:70000' is not HOST:PORT (e.g. 127.0.0.1:8080)"),
    (
        "listen-host-with-scheme",
        S + "{tls}gateway: {{listen: 'http://gw:8080'}}\n",
        "gateway.listen: 'http://gw:8080': the host has a scheme (give the bare host, e.g. 10.0.0.7)",
    ),
    ("listen-wrong-type", S + "{tls}gateway: {{listen: 8080}}\n", "gateway.listen: expected HOST:PORT, such as 127.0.0.1:8080, got an integer 8080"),
    ("metrics-listen-not-host-port", S + "{tls}metrics_listen: nowhere\n", "metrics_listen: 'nowhere' is not HOST:PORT (e.g. 127.0.0.1:8080)"),
    ("metrics-listen-wrong-type", S + "{tls}metrics_listen: 9102\n", "metrics_listen: expected HOST:PORT, such as 127.0.0.1:8080, got an integer 9102"),
    ("server-list-empty", "server: []\n{tls}", "server: the list is empty; give at least one NATS URL, e.g. tls://HOST:4222"),
    ("server-listed-twice", "server: [tls://a:4222, tls://a:4222]\n{tls}", "server: the same URL is listed twice"),
]


@pytest.mark.parametrize("body, expected", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_word_for_word(tmp_path, tls, body, expected):
    path = tmp_path / "svc.yaml"
    path.write_text(body.format(tls=tls))
    with pytest.raises(ConfigError) as e:
        load_service_config(path)
    assert str(e.value) == f"{path}: {expected}"


def test_an_empty_value_takes_the_default(tmp_path, tls):
    path = tmp_path / "svc.yaml"
    path.write_text("server: tls://127.0.0.1:4222\n" + tls + "metrics_listen:\nhealth:\ngateway: {listen: ~, workers: 2}\n")
    cfg = load_service_config(path)
    assert (cfg.metrics_listen, cfg.health.heartbeat_interval, cfg.gateway.listen, cfg.gateway.workers) == ("", 5.0, "127.0.0.1:8080", 2)


def test_good_config_resolves_relative_paths(tmp_path, tls):
    path = tmp_path / "svc.yaml"
    path.write_text("server: tls://127.0.0.1:4222\n" + tls + "health: {heartbeat_interval: 500ms, node_lost_after: 3s}\n")
    cfg = load_service_config(path)
    assert cfg.server == ["tls://127.0.0.1:4222"]
    assert cfg.tls.cert == str(tmp_path / "svc.pem")
    assert (cfg.health.heartbeat_interval, cfg.health.node_lost_after) == (0.5, 3.0)


def test_event_loop_choice_per_service_and_overridden_by_environment(monkeypatch):
    import asyncio

    import uvloop

    from llmgw.services.gateway.service import Gateway
    from llmgw.services.registry import Registry
    from llmgw.services.runtime import LOOP_ENV, event_loop_runner

    monkeypatch.delenv(LOOP_ENV, raising=False)
    assert Gateway.event_loop == "uvloop" and Registry.event_loop == "asyncio"
    assert event_loop_runner(Gateway.event_loop) is uvloop.run
    assert event_loop_runner(Registry.event_loop) is asyncio.run
    monkeypatch.setenv(LOOP_ENV, "asyncio")
    assert event_loop_runner("uvloop") is asyncio.run
    monkeypatch.setenv(LOOP_ENV, "uvloop")
    assert event_loop_runner("asyncio") is uvloop.run
    monkeypatch.setenv(LOOP_ENV, "trio")
    with pytest.raises(ConfigError, match="LLMGW_EVENT_LOOP='trio': use asyncio or uvloop"):
        event_loop_runner("asyncio")


# What reading a configuration must not load: the NATS client and the bus module
# built on it, and the CA tooling with the cryptography package under it. A tool
# that only reads a file (ctl's config check, the console's start, a unit test)
# should not pay for them, and a broken install of either should not stop it.
NOT_FOR_READING = ("nats", "cryptography", "llmgw.shared.bus", "llmgw.shared.pki")


def test_reading_a_configuration_loads_neither_the_bus_nor_the_ca_tooling(tmp_path, tls):
    path = tmp_path / "svc.yaml"
    path.write_text(S + tls + "gateway: {listen: 127.0.0.1:8080}\n")
    probe = textwrap.dedent(
        f"""
        import sys
        from llmgw.shared.config import load_service_config
        cfg = load_service_config({str(path)!r})
        assert cfg.tls_files().cert.endswith("svc.pem")
        print(" ".join(sorted(m for m in sys.modules if m.partition(".")[0] in ("nats", "cryptography") or m.startswith("llmgw."))))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert "llmgw.shared.config" in out  # the probe saw the modules it loaded
    loaded = [m for m in out if any(m == bad or m.startswith(bad + ".") for bad in NOT_FOR_READING)]
    assert loaded == [], f"reading a configuration loaded {loaded}"


@pytest.mark.parametrize(
    "listen, expected",
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("[::1]:8080", ("::1", 8080)),
        (":8080", ("0.0.0.0", 8080)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("gw-1.example.net:443", ("gw-1.example.net", 443)),
    ],
)
def test_listen_addresses_that_are_host_port(tmp_path, tls, listen, expected):
    from llmgw.shared.config import parse_listen

    path = tmp_path / "svc.yaml"
    path.write_text(S + tls + f"metrics_listen: '{listen}'\ngateway: {{listen: '{listen}'}}\n")
    cfg = load_service_config(path)
    assert parse_listen(cfg.gateway.listen) == parse_listen(cfg.metrics_listen) == expected


@pytest.fixture
def https_pair(tmp_path):
    """A real certificate and key from the project's CA tooling."""
    from llmgw.shared import pki

    pki.init_ca(tmp_path / "pki")
    issued = pki.issue(tmp_path / "pki", "gw", "gateway", tmp_path / "out")
    return issued.cert_path, issued.key_path


def test_gateway_files_are_read_when_the_configuration_is(tmp_path, tls, https_pair):
    """The HTTPS pair and the API key file are read at load, as the gateway reads them
    at start: a bad one is refused naming the file, the key and what is wrong."""
    cert, key = https_pair
    path = tmp_path / "svc.yaml"

    def refusal(gateway: str) -> str:
        path.write_text(S + tls + f"gateway: {{{gateway}}}\n")
        with pytest.raises(ConfigError) as e:
            load_service_config(path)
        return str(e.value)

    assert refusal("tls_cert: gw.pem, tls_key: gw-key.pem") == f"{path}: gateway.tls_cert: {tmp_path / 'gw.pem'} does not exist"
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    assert f"{path}: gateway.tls_cert/tls_key: {tmp_path / 'junk.pem'} and {key} are not a PEM certificate and its key" in refusal(
        f"tls_cert: junk.pem, tls_key: {key}"
    )
    assert refusal("api_keys_file: keys") == f"{path}: gateway.api_keys_file: {tmp_path / 'keys'} does not exist"
    (tmp_path / "keys").write_text("s3cret\n")
    assert refusal("api_keys_file: keys").startswith(f"{path}: gateway.api_keys_file: {tmp_path / 'keys'} line 1: expected a SHA-256 hex digest")
    (tmp_path / "keys").write_text("# nobody yet\n")
    assert refusal("api_keys_file: keys").startswith(f"{path}: gateway.api_keys_file: {tmp_path / 'keys'} holds no keys")

    (tmp_path / "keys").write_text("0" * 64 + "\n")
    path.write_text(S + tls + f"gateway: {{tls_cert: {cert}, tls_key: {key}, api_keys_file: keys}}\n")
    g = load_service_config(path).gateway
    assert (g.tls_cert, g.tls_key, g.api_keys_file) == (str(cert), str(key), str(tmp_path / "keys"))
