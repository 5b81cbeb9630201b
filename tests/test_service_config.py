"""Service and operator configuration files: refused with the file, the key and what was expected."""

from __future__ import annotations

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
        ("server: tls://127.0.0.1:4222\n{tls}health: {{heartbeat_intervl: 5s}}\n", "unknown key 'health.heartbeat_intervl' (did you mean 'heartbeat_interval'?)"),
        ("server: https://10.0.0.140:7443\n{tls}", "HTTP(S) endpoint from the earlier design"),
        ("server: tls://127.0.0.1:4222\nserver: tls://127.0.0.2:4222\n{tls}", "appears twice"),
        ("server: tls://127.0.0.1:4222\n{tls}health: {{node_lost_after: soon}}\n", "health.node_lost_after: 'soon' is not a duration"),
        ("server: tls://127.0.0.1:4222\n{tls}kv_replicas: three\n", "kv_replicas: expected an integer"),
        ("server: tls://127.0.0.1:4222\n{tls}health: {{heartbeat_interval: 30s, node_lost_after: 60s}}\n", "must be longer than"),
        ("server: tls://127.0.0.1:4222\ntls: {{ca: ca.pem, cert: missing.pem, key: svc-key.pem}}\n", "tls.cert: file"),
        ("{tls}", "missing required key 'server'"),
        ("server: [tls://127.0.0.1:4222\n", "YAML syntax error"),
    ],
    ids=["typo", "https", "duplicate", "duration", "type", "lost-before-suspect", "missing-file", "missing-key", "yaml"],
)
def test_bad_service_configs_are_refused_clearly(tmp_path, tls, body, message):
    path = tmp_path / "svc.yaml"
    path.write_text(body.format(tls=tls))
    with pytest.raises(ConfigError) as e:
        load_service_config(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


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
