"""agent.yaml: what loads, and that every refusal names the file, the key and what was expected."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from llmgw.services.agent.config import (
    AgentConfig,
    DiscoveryConfig,
    FabricConfig,
    SupervisorConfig,
    check_identity,
    load_agent_config,
)
from llmgw.shared import pki
from llmgw.shared.errors import ConfigError
from llmgw.shared.tls import TlsFiles

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a node certificate for node01 and a service certificate also named node01."""
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root)
    node = pki.issue(root, "node01", "node", root / "out")
    svc = pki.issue(root, "node01", "scheduler", root / "svc")
    return {"ca": str(node.ca_path), "cert": str(node.cert_path), "key": str(node.key_path), "svc_cert": str(svc.cert_path), "svc_key": str(svc.key_path)}


def base(certs) -> dict:
    """The seed's agent.yaml, as data, with a NATS URL and real certificate paths."""
    data = yaml.safe_load((DATA / "agent-seed.yaml").read_text())
    data["server"] = "tls://10.0.0.140:4222"
    data["tls"] = {"ca": certs["ca"], "cert": certs["cert"], "key": certs["key"]}
    return data


def write(tmp_path: Path, data, name: str = "agent.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return p


# --------------------------------------------------------------------------
# What loads
# --------------------------------------------------------------------------


def test_seed_shaped_file_loads_with_every_value(tmp_path, certs):
    cfg = load_agent_config(write(tmp_path, base(certs)))
    assert cfg == AgentConfig(
        node_id="node01",
        servers=("tls://10.0.0.140:4222",),
        tls=TlsFiles(ca=certs["ca"], cert=certs["cert"], key=certs["key"]),
        mgmt_addr="10.0.0.141",
        mgmt_interface="eth0",
        heartbeat_interval=5.0,
        reconnect_base=1.0,
        reconnect_max=30.0,
        fabrics=(FabricConfig(name="ib-a", hcas=("mlx5_0", "mlx5_1")),),
        discovery=DiscoveryConfig(nvidia_smi="", ib_root="/sys/class/infiniband", prefer_nvml=False, skip_gpus=False),
        supervisor=SupervisorConfig(work_dir="/var/lib/llmgw-agent", log_lines=512, stop_timeout=60.0, health_interval=2.0),
        inventory_interval=300.0,
        source=str(tmp_path / "agent.yaml"),
    )


def test_seed_file_as_written_is_refused_for_its_https_server():
    with pytest.raises(ConfigError) as e:
        load_agent_config(DATA / "agent-seed.yaml")
    msg = str(e.value)
    assert str(DATA / "agent-seed.yaml") in msg
    assert "server:" in msg and "NATS" in msg and "tls://10.0.0.140:4222" in msg


def test_minimal_config_takes_the_documented_defaults(tmp_path, certs):
    data = {k: v for k, v in base(certs).items() if k in ("node_id", "server", "tls", "mgmt_addr")}
    cfg = load_agent_config(write(tmp_path, data))
    assert (cfg.mgmt_interface, cfg.heartbeat_interval, cfg.reconnect_base, cfg.reconnect_max) == ("eth0", 5.0, 1.0, 30.0)
    assert cfg.inventory_interval == 300.0
    assert cfg.fabrics == ()
    assert cfg.discovery == DiscoveryConfig()
    assert cfg.supervisor == SupervisorConfig()


@pytest.mark.parametrize(
    "key, value, attr, expected",
    [
        ("server", ["tls://a:4222", "nats://b:4222", "tls://c"], "servers", ("tls://a:4222", "nats://b:4222", "tls://c")),
        ("server", "nats://[fd00::1]:4222", "servers", ("nats://[fd00::1]:4222",)),
        ("fabrics", [], "fabrics", ()),
        ("fabrics", None, "fabrics", ()),
        (
            "fabrics",
            [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_2", "mlx5_3"]}],
            "fabrics",
            (FabricConfig("ib-a", ("mlx5_0",)), FabricConfig("ib-b", ("mlx5_2", "mlx5_3"))),
        ),
        ("heartbeat_interval", "500ms", "heartbeat_interval", 0.5),
        ("heartbeat_interval", 2, "heartbeat_interval", 2.0),
        ("reconnect_max", "1m", "reconnect_max", 60.0),
        ("inventory_interval", "1h30m", "inventory_interval", 5400.0),
        ("mgmt_addr", "node01.cluster.local", "mgmt_addr", "node01.cluster.local"),
        ("mgmt_addr", "fd00::141", "mgmt_addr", "fd00::141"),
        ("mgmt_interface", "ens1f0np0", "mgmt_interface", "ens1f0np0"),
    ],
    ids=[
        "server-list",
        "server-ipv6",
        "fabrics-empty",
        "fabrics-null",
        "fabrics-two",
        "duration-ms",
        "duration-bare-number",
        "duration-minutes",
        "duration-compound",
        "mgmt-addr-hostname",
        "mgmt-addr-ipv6",
        "mgmt-interface",
    ],
)
def test_values_that_load(tmp_path, certs, key, value, attr, expected):
    data = base(certs)
    data[key] = value
    assert getattr(load_agent_config(write(tmp_path, data)), attr) == expected


def test_relative_paths_resolve_against_the_config_directory(tmp_path, certs, monkeypatch):
    conf_dir = tmp_path / "etc"
    (conf_dir / "pki").mkdir(parents=True)
    for k in ("ca", "cert", "key"):
        (conf_dir / "pki" / Path(certs[k]).name).write_bytes(Path(certs[k]).read_bytes())
    data = base(certs)
    data["tls"] = {k: f"pki/{Path(certs[k]).name}" for k in ("ca", "cert", "key")}
    data["discovery"] = {"nvidia_smi": "bin/nvidia-smi", "ib_root": "./sys-ib"}
    data["supervisor"] = {"work_dir": "state"}
    path = write(conf_dir, data)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_agent_config(path)
    assert cfg.tls.cert == str(conf_dir / "pki" / Path(certs["cert"]).name)
    assert cfg.discovery.nvidia_smi == str(conf_dir / "bin/nvidia-smi")
    assert Path(cfg.discovery.ib_root) == conf_dir / "sys-ib"
    assert cfg.supervisor.work_dir == str(conf_dir / "state")


@pytest.mark.parametrize(
    "value, expected",
    [("nvidia-smi", "nvidia-smi"), ("", ""), ("/opt/nvidia/bin/nvidia-smi", "/opt/nvidia/bin/nvidia-smi")],
    ids=["bare-name-stays-a-PATH-lookup", "empty", "absolute"],
)
def test_nvidia_smi_path(tmp_path, certs, value, expected):
    data = base(certs)
    data["discovery"] = {"nvidia_smi": value}
    assert load_agent_config(write(tmp_path, data)).discovery.nvidia_smi == expected


# --------------------------------------------------------------------------
# What is refused, and how it is said
# --------------------------------------------------------------------------


def _set(path: str, value):
    """A mutation: set a dotted key (``supervisor.stop_timeout``) to value; value DELETE removes it."""

    def apply(data):
        *parents, last = path.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


DELETE = object()

REFUSALS = [
    ("unknown-top-key-suggests", _set("heartbeat_intervall", "5s"), ["heartbeat_intervall: unknown key", "did you mean 'heartbeat_interval'"]),
    ("unknown-nested-key-suggests", _set("supervisor.stop_timout", "5s"), ["supervisor.stop_timout: unknown key", "did you mean 'stop_timeout'"]),
    ("unknown-key-lists-known", _set("discovery.colour", "blue"), ["discovery.colour: unknown key", "known keys here: nvidia_smi, ib_root"]),
    ("unknown-tls-key", _set("tls.password", "x"), ["tls.password: unknown key"]),
    ("missing-node-id", _set("node_id", DELETE), ["node_id: required key is missing"]),
    ("missing-server", _set("server", DELETE), ["server: required key is missing"]),
    ("missing-mgmt-addr", _set("mgmt_addr", DELETE), ["mgmt_addr: required key is missing"]),
    ("missing-tls-key-file-key", _set("tls.key", DELETE), ["tls.key: required key is missing"]),
    ("tls-file-does-not-exist", _set("tls.cert", "/nonexistent/agent.pem"), ["tls.cert: file /nonexistent/agent.pem does not exist"]),
    ("tls-not-a-mapping", _set("tls", "/etc/llmgw"), ["tls: expected a mapping", "a string"]),
    ("node-id-invalid", _set("node_id", "Node_01"), ["node_id: invalid node id 'Node_01'"]),
    ("node-id-wrong-type", _set("node_id", 7), ["node_id: expected a string, got an integer"]),
    ("server-https-from-old-design", _set("server", "https://10.0.0.140:7443"), ["server: ", "through NATS", "tls://10.0.0.140:4222"]),
    ("server-http", _set("server", "http://cp:7443"), ["through NATS", "tls://cp:4222"]),
    ("server-other-scheme", _set("server", "ws://cp:8080"), ["server: 'ws://cp:8080'", "tls:// or nats://"]),
    ("server-no-scheme", _set("server", "10.0.0.140:4222"), ["server:", "tls:// or nats://"]),
    ("server-list-bad-element", _set("server", ["tls://a:4222", "https://b:7443"]), ["server[1]:", "through NATS"]),
    ("server-list-empty", _set("server", []), ["server: the list is empty"]),
    ("server-wrong-type", _set("server", 4222), ["server: expected a NATS URL or a list"]),
    ("server-bad-port", _set("server", "tls://cp:99999"), ["server: 'tls://cp:99999' is not a valid URL"]),
    ("server-credentials", _set("server", "tls://u:p@cp:4222"), ["server:", "credentials"]),
    ("duration-garbage", _set("supervisor.stop_timeout", "fast"), ["supervisor.stop_timeout: 'fast' is not a duration"]),
    ("duration-wrong-type", _set("heartbeat_interval", [5]), ["heartbeat_interval: expected a duration"]),
    ("duration-zero", _set("heartbeat_interval", "0s"), ["heartbeat_interval: must be greater than 0"]),
    ("duration-negative", _set("reconnect_base", -1), ["reconnect_base: a duration cannot be negative"]),
    ("health-interval-zero", _set("supervisor.health_interval", 0), ["supervisor.health_interval: must be greater than 0"]),
    ("inventory-interval-zero", _set("inventory_interval", "0ms"), ["inventory_interval: must be greater than 0"]),
    ("reconnect-base-above-max", _set("reconnect_base", "1m"), ["reconnect_base: 60s is greater than reconnect_max (30s)"]),
    ("log-lines-string", _set("supervisor.log_lines", "many"), ["supervisor.log_lines: expected a whole number, got a string"]),
    ("log-lines-bool", _set("supervisor.log_lines", True), ["supervisor.log_lines: expected a whole number, got a boolean"]),
    ("log-lines-zero", _set("supervisor.log_lines", 0), ["supervisor.log_lines: must be greater than 0"]),
    ("bool-as-string", _set("discovery.prefer_nvml", "yes please"), ["discovery.prefer_nvml: expected true or false"]),
    ("skip-gpus-int", _set("discovery.skip_gpus", 1), ["discovery.skip_gpus: expected true or false, got an integer"]),
    ("section-not-mapping", _set("supervisor", ["work_dir"]), ["supervisor: expected a mapping of keys, got a list"]),
    ("mgmt-addr-wildcard", _set("mgmt_addr", "0.0.0.0"), ["mgmt_addr: 0.0.0.0 is the wildcard address"]),
    ("mgmt-addr-url", _set("mgmt_addr", "http://10.0.0.141:8000"), ["mgmt_addr: 'http://10.0.0.141:8000' is neither an IP address nor a hostname"]),
    ("mgmt-addr-empty", _set("mgmt_addr", ""), ["mgmt_addr: must not be empty"]),
    ("mgmt-interface-too-long", _set("mgmt_interface", "averyveryverylongif"), ["mgmt_interface: 'averyveryverylongif' is not a network interface name"]),
    ("fabrics-not-a-list", _set("fabrics", {"name": "ib-a"}), ["fabrics: expected a list"]),
    (
        "fabric-duplicate-name",
        _set("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-a", "hcas": ["mlx5_1"]}]),
        ["fabrics[1].name: fabric 'ib-a' is listed twice"],
    ),
    ("fabric-missing-hcas", _set("fabrics", [{"name": "ib-a"}]), ["fabrics[0].hcas: required key is missing"]),
    ("fabric-unknown-key-suggests", _set("fabrics", [{"name": "ib-a", "hca": ["mlx5_0"]}]), ["fabrics[0].hca: unknown key; did you mean 'hcas'?"]),
    ("fabric-hcas-as-string", _set("fabrics", [{"name": "ib-a", "hcas": "mlx5_0,mlx5_1"}]), ["fabrics[0].hcas: expected a list of HCA names"]),
    ("fabric-no-hcas", _set("fabrics", [{"name": "ib-a", "hcas": []}]), ["fabrics[0].hcas: fabric 'ib-a' lists no HCA"]),
    (
        "fabric-hca-in-two-fabrics",
        _set("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_0"]}]),
        ["fabrics[1].hcas[0]: HCA 'mlx5_0' is already in fabric 'ib-a'"],
    ),
    ("fabric-hca-twice", _set("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_0"]}]), ["fabrics[0].hcas[1]: HCA 'mlx5_0' is listed twice"]),
    ("fabric-hca-path", _set("fabrics", [{"name": "ib-a", "hcas": ["../mlx5_0"]}]), ["fabrics[0].hcas[0]: '../mlx5_0' is not an HCA name"]),
    ("fabric-bad-name", _set("fabrics", [{"name": "IB A", "hcas": ["mlx5_0"]}]), ["fabrics[0].name: invalid fabric name 'IB A'"]),
]


@pytest.mark.parametrize("mutate, expected", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_name_file_key_and_expectation(tmp_path, certs, mutate, expected):
    data = copy.deepcopy(base(certs))
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:"), msg
    for part in expected:
        assert part in msg, msg


# Word for word after "<file>: ": the key path, then what is wrong (the shared
# wording of shared/structconf.py, the same as for the services' files).
EXACT = [
    ("bad-type", _set("supervisor.log_lines", "many"), "supervisor.log_lines: expected a whole number, got a string 'many'"),
    ("bad-type-in-a-list", _set("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0", 5]}]), "fabrics[0].hcas[1]: expected a string, got an integer 5"),
    ("bad-type-described", _set("fabrics", {"name": "ib-a"}), "fabrics: expected a list of {name, hcas} (or [] for no fabric), got a mapping"),
    ("unknown-key-suggests", _set("fabrics", [{"name": "ib-a", "hca": ["mlx5_0"]}]), "fabrics[0].hca: unknown key; did you mean 'hcas'?"),
    ("unknown-key-lists-known", _set("tls.password", "x"), "tls.password: unknown key (known keys here: ca, cert, key)"),
    ("bad-duration", _set("supervisor.stop_timeout", "fast"), "supervisor.stop_timeout: 'fast' is not a duration; write e.g. 500ms, 5s, 1m or 1h30m"),
    ("zero-duration", _set("heartbeat_interval", "0s"), "heartbeat_interval: must be greater than 0, got 0s"),
    ("missing-required", _set("node_id", DELETE), "node_id: required key is missing"),
    ("missing-required-in-a-list", _set("fabrics", [{"name": "ib-a"}]), "fabrics[0].hcas: required key is missing"),
    ("required-but-empty", _set("mgmt_addr", None), "mgmt_addr: required key has no value"),
    ("value-in-a-list", _set("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_0"]}]), "fabrics[0].hcas[1]: HCA 'mlx5_0' is listed twice in fabric 'ib-a'"),
    (
        "values-of-a-section-blame-the-one-set",
        _set("supervisor.probe_interval", "1s"),
        "supervisor.probe_interval: probe_timeout (3s) must not exceed probe_interval (1s): a canary is judged before the next one is due",
    ),
    (
        "internal-field-is-unknown",
        _set("source", "other.yaml"),
        "source: unknown key (known keys here: node_id, server, tls, mgmt_addr, mgmt_interface, heartbeat_interval, "
        "full_report_interval, reconnect_base, reconnect_max, fabrics, discovery, supervisor, cache, inventory_interval)",
    ),
]


@pytest.mark.parametrize("mutate, expected", [r[1:] for r in EXACT], ids=[r[0] for r in EXACT])
def test_refusals_word_for_word(tmp_path, certs, mutate, expected):
    data = copy.deepcopy(base(certs))
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    assert str(e.value) == f"{path}: {expected}"


def test_empty_values_take_the_defaults(tmp_path, certs):
    data = base(certs)
    data.update(mgmt_interface=None, discovery=None, supervisor={"log_lines": None, "stop_timeout": "5s"})
    cfg = load_agent_config(write(tmp_path, data))
    assert (cfg.mgmt_interface, cfg.discovery, cfg.supervisor) == ("eth0", DiscoveryConfig(), SupervisorConfig(stop_timeout=5.0))


def test_unknown_key_without_a_close_match_suggests_nothing(tmp_path, certs):
    data = base(certs)
    data["colour"] = "blue"
    with pytest.raises(ConfigError) as e:
        load_agent_config(write(tmp_path, data))
    assert "colour: unknown key" in str(e.value) and "did you mean" not in str(e.value)


RAW_REFUSALS = [
    ("yaml-syntax-error-names-line", "node_id: node01\nserver: tls://a:4222\ntls: {ca: x\nmgmt_addr: 10.0.0.1\n", [":4: YAML syntax error"]),
    ("yaml-tab-indent", "node_id: node01\ntls:\n\tca: x\n", [":3: YAML syntax error"]),
    (
        "duplicate-key-names-both-lines",
        "node_id: node01\nserver: tls://a:4222\nserver: tls://b:4222\n",
        [":3: YAML syntax error", "'server' appears twice (first on line 2)"],
    ),
    ("empty-file", "", ["the configuration is empty"]),
    ("only-comments", "# node01\n", ["the configuration is empty"]),
    ("top-level-list", "- node_id: node01\n", ["top level: expected a mapping of keys, got a list"]),
    ("top-level-scalar", "node01\n", ["top level: expected a mapping of keys, got a string"]),
    ("python-tag-refused", "node_id: !!python/object/apply:os.system ['true']\n", ["YAML syntax error"]),
]


@pytest.mark.parametrize("text, expected", [r[1:] for r in RAW_REFUSALS], ids=[r[0] for r in RAW_REFUSALS])
def test_raw_file_refusals(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    for part in expected:
        assert part in msg, msg


@pytest.mark.parametrize("make", ["missing", "directory"], ids=["missing-file", "directory"])
def test_config_file_itself_must_exist(tmp_path, make):
    path = tmp_path / "agent.yaml"
    if make == "directory":
        path.mkdir()
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    assert str(path) in str(e.value)
    assert ("does not exist" if make == "missing" else "is a directory") in str(e.value)


def test_tls_file_missing_names_the_resolved_path(tmp_path, certs):
    data = base(certs)
    data["tls"]["key"] = "keys/agent-key.pem"
    with pytest.raises(ConfigError) as e:
        load_agent_config(write(tmp_path, data))
    assert f"tls.key: file {tmp_path / 'keys/agent-key.pem'} does not exist" in str(e.value)


# --------------------------------------------------------------------------
# The certificate speaks for this node
# --------------------------------------------------------------------------


def test_check_identity_accepts_the_node_certificate(tmp_path, certs):
    check_identity(load_agent_config(write(tmp_path, base(certs))))


@pytest.mark.parametrize(
    "node_id, cert_key, expected",
    [
        ("node02", ("cert", "key"), ["CN=node01", "common name is 'node01' but node_id is 'node02'"]),
        ("node01", ("svc_cert", "svc_key"), ["OU=scheduler", "role (OU) is 'scheduler', expected 'node'"]),
        ("node02", ("svc_cert", "svc_key"), ["node_id is 'node02'", "role (OU) is 'scheduler'"]),
    ],
    ids=["wrong-cn", "wrong-role", "both-wrong"],
)
def test_check_identity_refuses_another_identity(tmp_path, certs, node_id, cert_key, expected):
    data = base(certs)
    data["node_id"] = node_id
    data["tls"]["cert"], data["tls"]["key"] = certs[cert_key[0]], certs[cert_key[1]]
    path = write(tmp_path, data)
    cfg = load_agent_config(path)
    with pytest.raises(ConfigError) as e:
        check_identity(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{path}: tls.cert:"), msg
    for part in expected:
        assert part in msg, msg


def test_check_identity_on_a_file_that_is_not_a_certificate(tmp_path, certs):
    data = base(certs)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    data["tls"]["cert"] = str(junk)
    cfg = load_agent_config(write(tmp_path, data))
    with pytest.raises(ConfigError) as e:
        check_identity(cfg)
    assert "tls.cert:" in str(e.value) and "not a PEM certificate" in str(e.value)


def test_config_is_frozen(tmp_path, certs):
    cfg = load_agent_config(write(tmp_path, base(certs)))
    with pytest.raises(AttributeError):
        cfg.node_id = "node02"  # type: ignore[misc] - assigning to the frozen config is what this checks
    assert os.path.isabs(cfg.source)
