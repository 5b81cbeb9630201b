"""GPU and HCA discovery against real H200 output, a fake nvidia-smi run for real, and a fake sysfs."""

from __future__ import annotations

import shutil
import stat
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from llmgw.services.agent import discovery as D
from llmgw.services.agent.config import AgentConfig, DiscoveryConfig, FabricConfig
from llmgw.services.agent.discovery import DiscoveryError, discover, parse_nvidia_smi_csv, query_nvidia_smi, query_nvml, read_hca
from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import FabricMembership, Gpu, Hca, HcaPort
from llmgw.shared.tls import TlsFiles

DATA = Path(__file__).parent / "data"

H200 = Gpu(index=0, uuid="GPU-73b88528-63cc-b45e-8ae5-d8c543a45569", name="NVIDIA H200", memory_mib=143771, pci_bus_id="00000000:00:06.0")


def h200_query_line() -> str:
    """The agent's 5-field query, taken column by column from the real 9-field capture.

    Columns there: index, uuid, name, memory.total, memory.used, memory.free,
    pci.bus_id, driver_version, compute_cap -> ours are 0, 1, 2, 3, 6.
    """
    fields = (DATA / "h200-nvidia-smi-query-9fields.csv").read_text().strip().split(", ")
    assert len(fields) == 9
    return ", ".join(fields[i] for i in (0, 1, 2, 3, 6))


# --------------------------------------------------------------------------
# parse_nvidia_smi_csv
# --------------------------------------------------------------------------

A100_MIG = "1, GPU-2b1e3c7a-0000-1111-2222-333344445555, NVIDIA A100-SXM4-80GB, [N/A], 00000000:0A:00.0"

PARSES = [
    ("h200-real", lambda: h200_query_line() + "\n", [H200]),
    ("h200-real-with-header-and-units", lambda: (DATA / "h200-nvidia-smi-query-header.csv").read_text(), [H200]),
    (
        "memory-n/a",
        lambda: A100_MIG + "\n",
        [Gpu(index=1, uuid="GPU-2b1e3c7a-0000-1111-2222-333344445555", name="NVIDIA A100-SXM4-80GB", memory_mib=None, pci_bus_id="00000000:0A:00.0")],
    ),
    (
        "stray-spaces-blank-lines-crlf",
        lambda: "\r\n  " + h200_query_line().replace(", ", " ,   ") + "  \r\n\r\n" + A100_MIG + "\r\n\n",
        [H200, Gpu(index=1, uuid="GPU-2b1e3c7a-0000-1111-2222-333344445555", name="NVIDIA A100-SXM4-80GB", memory_mib=None, pci_bus_id="00000000:0A:00.0")],
    ),
    ("bus-id-n/a", lambda: "0, GPU-x, NVIDIA H200, 143771, [N/A]\n", [Gpu(index=0, uuid="GPU-x", name="NVIDIA H200", memory_mib=143771, pci_bus_id="")]),
    ("empty-output", lambda: "", []),
    ("only-blank-lines", lambda: "\n   \n\n", []),
]


@pytest.mark.parametrize("text, expected", [p[1:] for p in PARSES], ids=[p[0] for p in PARSES])
def test_parse_nvidia_smi(text, expected):
    assert parse_nvidia_smi_csv(text()) == expected


MALFORMED = [
    (
        "real-9-field-query-is-not-ours",
        lambda: (DATA / "h200-nvidia-smi-query-9fields.csv").read_text(),
        ["line 1", "expected 5 comma-separated fields", "got 9"],
    ),
    (
        "garbage-after-a-good-line",
        lambda: h200_query_line() + "\nNVIDIA-SMI has failed because it couldn't communicate\n",
        ["line 2", "got 1", "NVIDIA-SMI has failed"],
    ),
    ("too-few-fields", lambda: "0, GPU-x, NVIDIA H200\n", ["line 1", "got 3"]),
    ("index-not-a-number", lambda: "zero, GPU-x, NVIDIA H200, 143771, 00000000:00:06.0\n", ["line 1", "index 'zero' is not a number"]),
    ("negative-index", lambda: "-1, GPU-x, NVIDIA H200, 143771, 00000000:00:06.0\n", ["negative index"]),
    ("memory-not-a-number", lambda: "0, GPU-x, NVIDIA H200, lots, 00000000:00:06.0\n", ["memory.total 'lots' is not a number of MiB"]),
    ("duplicate-index", lambda: h200_query_line() + "\n" + h200_query_line() + "\n", ["line 2", "GPU index 0 already seen on line 1"]),
    ("no-uuid", lambda: "0, , NVIDIA H200, 143771, 00000000:00:06.0\n", ["GPU 0 has no uuid or name"]),
]


@pytest.mark.parametrize("text, expected", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_parse_nvidia_smi_refuses_malformed_lines(text, expected):
    with pytest.raises(DiscoveryError) as e:
        parse_nvidia_smi_csv(text())
    for part in expected:
        assert part in str(e.value), str(e.value)


def test_discovery_error_is_an_llmgw_error():
    assert issubclass(DiscoveryError, LlmgwError)


# --------------------------------------------------------------------------
# query_nvidia_smi, through a real subprocess
# --------------------------------------------------------------------------


def fake_smi(directory: Path, body: str, name: str = "nvidia-smi") -> Path:
    """An executable shell script standing in for nvidia-smi."""
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / name
    p.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return p


def test_query_runs_the_configured_binary_with_the_documented_query(tmp_path):
    args_file = tmp_path / "args"
    smi = fake_smi(
        tmp_path / "bin",
        f"""\
        printf '%s\\n' "$@" > {args_file}
        printf '%s\\n' '{h200_query_line()}'
        """,
    )
    assert query_nvidia_smi(str(smi)) == [H200]
    assert args_file.read_text().splitlines() == [
        "--query-gpu=index,uuid,name,memory.total,pci.bus_id",
        "--format=csv,noheader,nounits",
    ]


def test_query_finds_nvidia_smi_on_path_when_not_configured(tmp_path, monkeypatch):
    fake_smi(tmp_path / "bin", f"echo '{A100_MIG}'\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert [g.index for g in query_nvidia_smi("")] == [1]


FAILURES = [
    (
        "non-zero-exit-with-stderr",
        "echo 'Unable to determine the device handle for GPU0000:00:06.0: Unknown Error' >&2\nexit 3\n",
        ["exited with code 3", "Unable to determine the device handle"],
    ),
    (
        "driver-failure-on-stdout",
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n',
        ["exited with code 9", "NVIDIA-SMI has failed"],
    ),
    ("killed-by-signal", "kill -9 $$\n", ["was killed by signal 9"]),
    ("silent-failure", "exit 2\n", ["exited with code 2: (no output)"]),
    ("garbage-on-success", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-73b8)'\n", ["line 1", "got 1"]),
]


@pytest.mark.parametrize("body, expected", [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_query_failures_name_the_binary_and_what_it_said(tmp_path, body, expected):
    smi = fake_smi(tmp_path / "bin", body)
    with pytest.raises(DiscoveryError) as e:
        query_nvidia_smi(str(smi))
    msg = str(e.value)
    assert str(smi) in msg, msg
    for part in expected:
        assert part in msg, msg


def test_no_devices_is_an_empty_list_not_an_error(tmp_path):
    smi = fake_smi(tmp_path / "bin", "echo 'No devices were found'\nexit 6\n")
    assert query_nvidia_smi(str(smi)) == []


def test_a_hung_nvidia_smi_is_killed_with_its_children(tmp_path):
    # The shell waits on a child that holds stdout open: killing only the shell
    # would leave communicate() waiting for the child's 30 s.
    smi = fake_smi(tmp_path / "bin", "sleep 30\necho never\n")
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError) as e:
        query_nvidia_smi(str(smi), timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert str(e.value) == f"{smi} did not answer within 0.5s and was killed"


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux) to hold the pipes from another session")
def test_an_unkillable_nvidia_smi_is_abandoned_not_waited_for(tmp_path):
    # A grandchild in another session keeps the pipes open after the kill, as a
    # process stuck in the driver would: the query gives up instead of hanging.
    smi = fake_smi(tmp_path / "bin", "setsid sleep 6 &\nsleep 30\n")
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError) as e:
        query_nvidia_smi(str(smi), timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert "did not die on SIGKILL either" in str(e.value) and "abandoned" in str(e.value)


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("missing-configured", ["does not exist", "discovery.nvidia_smi"]),
        ("not-executable", ["is not an executable file"]),
        ("directory", ["is not an executable file"]),
        ("not-on-path", ["nvidia-smi not found on PATH", "discovery.nvidia_smi", "skip_gpus"]),
    ],
    ids=["missing-configured", "not-executable", "directory", "not-on-path"],
)
def test_query_when_there_is_no_binary(tmp_path, monkeypatch, setup, expected):
    target = tmp_path / "opt" / "nvidia-smi"
    if setup == "not-executable":
        target.parent.mkdir()
        target.write_text("#!/bin/sh\n")
    elif setup == "directory":
        target.mkdir(parents=True)
    path = "" if setup == "not-on-path" else str(target)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(DiscoveryError) as e:
        query_nvidia_smi(path)
    for part in expected:
        assert part in str(e.value), str(e.value)


# --------------------------------------------------------------------------
# NVML, with a pynvml stand-in built from the real capture
# --------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, as_bytes=False, fail_init=False, memory_unsupported=False, fail_name=False):
    """A pynvml module answering what nvml.txt recorded on the H200 machine."""
    lines = (DATA / "h200-nvml.txt").read_text().splitlines()
    count = int(lines[1].split()[1])
    devs = []
    for line in lines[2 : 2 + count]:
        _index, uuid, *rest = line.split()
        name, total, _used, _free, bus = " ".join(rest[:-4]), int(rest[-4]), rest[-3], rest[-2], rest[-1]
        devs.append((uuid, name, total, bus))
    enc = (lambda s: s.encode()) if as_bytes else (lambda s: s)
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.calls = []

    def init():
        m.calls.append("init")
        if fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def memory(h):
        if memory_unsupported:
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(total=devs[h][2], used=0, free=0)

    def name(h):
        if fail_name:
            raise FakeNVMLError("GPU is lost")
        return enc(devs[h][1])

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(devs)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: enc(devs[h][0])
    m.nvmlDeviceGetName = name
    m.nvmlDeviceGetMemoryInfo = memory
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=enc(devs[h][3]))
    return m


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str-api", "bytes-api"])
def test_nvml_agrees_with_nvidia_smi_on_the_real_h200(monkeypatch, as_bytes):
    fake = fake_pynvml(as_bytes=as_bytes)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # 150754820096 bytes is exactly 143771 MiB, the figure nvidia-smi printed.
    assert query_nvml() == parse_nvidia_smi_csv(h200_query_line()) == [H200]
    assert fake.calls == ["init", "shutdown"]


def test_nvml_memory_not_supported_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(memory_unsupported=True))
    assert query_nvml()[0].memory_mib is None


@pytest.mark.parametrize(
    "kw, expected, shut_down",
    [({"fail_init": True}, "NVML could not be initialised: Driver Not Loaded", False), ({"fail_name": True}, "NVML query failed: GPU is lost", True)],
    ids=["init-fails", "query-fails"],
)
def test_nvml_errors_become_discovery_errors(monkeypatch, kw, expected, shut_down):
    fake = fake_pynvml(**kw)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(DiscoveryError, match=expected):
        query_nvml()
    assert ("shutdown" in fake.calls) is shut_down


def test_nvml_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(DiscoveryError) as e:
        query_nvml()
    assert "pip install 'llmgw[nvml]'" in str(e.value)


# --------------------------------------------------------------------------
# HCAs from a sysfs-shaped directory
# --------------------------------------------------------------------------

ACTIVE_IB = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "rate": "200 Gb/sec (4X HDR)", "link_layer": "InfiniBand"}
DOWN_IB = {"state": "1: DOWN", "phys_state": "3: Disabled", "rate": "10 Gb/sec (4X SDR)", "link_layer": "InfiniBand"}
INIT_IB = {"state": "2: INIT", "phys_state": "5: LinkUp", "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}
ACTIVE_ROCE = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "rate": "100 Gb/sec (4X EDR)", "link_layer": "Ethernet"}


def make_hca(root: Path, name: str, *ports: dict | None) -> None:
    """ports[i] describes port i+1; None makes a port directory without files."""
    (root / name / "ports").mkdir(parents=True)
    for n, files in enumerate(ports, 1):
        d = root / name / "ports" / str(n)
        d.mkdir()
        for f, v in (files or {}).items():
            (d / f).write_text(v + "\n")


HCAS = [
    (
        "active-ib",
        [ACTIVE_IB],
        Hca(name="mlx5_0", ports=[HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)", link_layer="InfiniBand")], usable=True),
    ),
    (
        "port-down",
        [DOWN_IB],
        Hca(
            name="mlx5_0",
            ports=[HcaPort(port=1, state="DOWN", phys_state="Disabled", rate="10 Gb/sec (4X SDR)", link_layer="InfiniBand")],
            usable=False,
            problem="no ACTIVE port: port 1 is 1: DOWN (3: Disabled)",
        ),
    ),
    (
        "port-init-not-yet-active",
        [INIT_IB],
        Hca(
            name="mlx5_0",
            ports=[HcaPort(port=1, state="INIT", phys_state="LinkUp", rate="400 Gb/sec (4X NDR)", link_layer="InfiniBand")],
            usable=False,
            problem="no ACTIVE port: port 1 is 2: INIT (5: LinkUp)",
        ),
    ),
    (
        "one-of-two-ports-active",
        [DOWN_IB, ACTIVE_IB],
        Hca(
            name="mlx5_0",
            ports=[
                HcaPort(port=1, state="DOWN", phys_state="Disabled", rate="10 Gb/sec (4X SDR)", link_layer="InfiniBand"),
                HcaPort(port=2, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)", link_layer="InfiniBand"),
            ],
            usable=True,
        ),
    ),
    (
        "roce-active",
        [ACTIVE_ROCE],
        Hca(name="mlx5_0", ports=[HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="100 Gb/sec (4X EDR)", link_layer="Ethernet")], usable=True),
    ),
    (
        "port-without-files",
        [None],
        Hca(name="mlx5_0", ports=[HcaPort(port=1, state="UNKNOWN")], usable=False, problem="no ACTIVE port: port 1 is without a state file"),
    ),
]


@pytest.mark.parametrize("ports, expected", [h[1:] for h in HCAS], ids=[h[0] for h in HCAS])
def test_read_hca(tmp_path, ports, expected):
    make_hca(tmp_path, "mlx5_0", *ports)
    assert read_hca(tmp_path, "mlx5_0") == expected


def test_ports_are_read_in_numeric_order(tmp_path):
    make_hca(tmp_path, "mlx5_0", *([DOWN_IB] * 9), ACTIVE_IB)  # ports 1..10; "10" sorts before "2" as text
    assert [p.port for p in read_hca(tmp_path, "mlx5_0").ports] == list(range(1, 11))


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("missing-hca", "not found under {root} (present: mlx5_1, mlx5_2)"),
        ("empty-ib-root", "not found under {root} ({root} is empty)"),
        ("no-ib-root", "not found: {root} does not exist"),
        ("no-ports", "has no ports under {root}/mlx5_0/ports"),
    ],
    ids=["missing-hca", "empty-ib-root-as-on-the-h200", "no-ib-root", "no-ports"],
)
def test_read_hca_that_cannot_be_used(tmp_path, setup, expected):
    root = tmp_path / "infiniband"
    if setup == "missing-hca":
        make_hca(root, "mlx5_1", ACTIVE_IB)
        make_hca(root, "mlx5_2", ACTIVE_IB)
    elif setup == "empty-ib-root":
        root.mkdir()
    elif setup == "no-ports":
        (root / "mlx5_0").mkdir(parents=True)
    hca = read_hca(root, "mlx5_0")
    assert hca.usable is False and hca.ports == []
    assert hca.problem.startswith(expected.format(root=root)), hca.problem


@pytest.mark.parametrize("name", ["../etc", "", "a/b"], ids=["dotdot", "empty", "slash"])
def test_read_hca_refuses_path_like_names(tmp_path, name):
    make_hca(tmp_path / "ib", "mlx5_0", ACTIVE_IB)
    hca = read_hca(tmp_path / "ib", name)
    assert not hca.usable and "is not an HCA name" in hca.problem


# --------------------------------------------------------------------------
# discover()
# --------------------------------------------------------------------------


def config(tmp_path, *, fabrics=(), smi="", **disc) -> AgentConfig:
    return AgentConfig(
        node_id="node01",
        servers=("tls://10.0.0.140:4222",),
        tls=TlsFiles("ca.pem", "agent.pem", "agent-key.pem"),
        mgmt_addr="10.0.0.141",
        fabrics=tuple(FabricConfig(n, tuple(h)) for n, h in fabrics),
        discovery=DiscoveryConfig(nvidia_smi=smi, ib_root=str(tmp_path / "ib"), **disc),
    )


@pytest.fixture
def good_smi(tmp_path):
    return str(fake_smi(tmp_path / "good", f"echo '{h200_query_line()}'\n"))


@pytest.fixture
def failing_smi(tmp_path):
    return str(fake_smi(tmp_path / "bad", "echo 'must not be called' >&2\nexit 1\n"))


def test_discover_fabrics_usable_only_when_all_their_hcas_are(tmp_path, good_smi):
    ib = tmp_path / "ib"
    make_hca(ib, "mlx5_0", ACTIVE_IB)
    make_hca(ib, "mlx5_1", ACTIVE_IB)
    make_hca(ib, "mlx5_2", ACTIVE_IB)
    make_hca(ib, "mlx5_3", DOWN_IB)
    cfg = config(tmp_path, smi=good_smi, fabrics=[("ib-a", ["mlx5_0", "mlx5_1"]), ("ib-b", ["mlx5_2", "mlx5_3"]), ("ib-c", ["mlx5_9"])])
    d = discover(cfg)
    assert d.gpus == [H200]
    assert d.fabrics == [
        FabricMembership(name="ib-a", hcas=["mlx5_0", "mlx5_1"], usable=True, problem=""),
        FabricMembership(name="ib-b", hcas=["mlx5_2", "mlx5_3"], usable=False, problem="mlx5_3: no ACTIVE port: port 1 is 1: DOWN (3: Disabled)"),
        FabricMembership(name="ib-c", hcas=["mlx5_9"], usable=False, problem=f"mlx5_9: not found under {ib} (present: mlx5_0, mlx5_1, mlx5_2, mlx5_3)"),
    ]
    assert [(h.name, h.usable) for h in d.hcas] == [("mlx5_0", True), ("mlx5_1", True), ("mlx5_2", True), ("mlx5_3", False), ("mlx5_9", False)]
    assert d.warnings == [
        "HCA mlx5_3 (fabric ib-b) is not usable: no ACTIVE port: port 1 is 1: DOWN (3: Disabled)",
        f"HCA mlx5_9 (fabric ib-c) is not usable: not found under {ib} (present: mlx5_0, mlx5_1, mlx5_2, mlx5_3)",
    ]


def test_discover_without_fabrics_reads_no_hca(tmp_path, good_smi):
    d = discover(config(tmp_path, smi=good_smi))  # ib_root does not even exist
    assert (d.gpus, d.hcas, d.fabrics, d.warnings) == ([H200], [], [], [])


def test_discover_skip_gpus_does_not_run_nvidia_smi(tmp_path, failing_smi):
    d = discover(config(tmp_path, smi=failing_smi, skip_gpus=True))
    assert d.gpus == [] and d.warnings == []


def test_discover_raises_when_gpus_cannot_be_listed(tmp_path, failing_smi):
    with pytest.raises(DiscoveryError, match="exited with code 1: must not be called"):
        discover(config(tmp_path, smi=failing_smi))


def test_discover_prefers_nvml_when_asked(tmp_path, failing_smi, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    d = discover(config(tmp_path, smi=failing_smi, prefer_nvml=True))
    assert d.gpus == [H200] and d.warnings == []


def test_discover_falls_back_to_nvidia_smi_when_nvml_fails(tmp_path, good_smi, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    d = discover(config(tmp_path, smi=good_smi, prefer_nvml=True))
    assert d.gpus == [H200]
    assert len(d.warnings) == 1
    assert d.warnings[0].startswith("NVML discovery failed, falling back to nvidia-smi:")
    assert "pip install 'llmgw[nvml]'" in d.warnings[0]
    assert any("falling back to nvidia-smi" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_discover_reads_a_shared_hca_once(tmp_path, good_smi, monkeypatch):
    # Configuration forbids an HCA in two fabrics, but discover() must not
    # depend on that to stay correct.
    make_hca(tmp_path / "ib", "mlx5_0", DOWN_IB)
    reads = []
    real = D.read_hca
    monkeypatch.setattr(D, "read_hca", lambda root, name: reads.append(name) or real(root, name))
    d = discover(config(tmp_path, smi=good_smi, fabrics=[("ib-a", ["mlx5_0"]), ("ib-b", ["mlx5_0"])]))
    assert reads == ["mlx5_0"]
    assert [f.usable for f in d.fabrics] == [False, False]
    assert len(d.warnings) == 1
