"""GPU health parsing (docs/hardware.md): real H200 output, NVIDIA's documented error shapes, fakes run for real.

The healthy rows are the real H200 capture (tests/data, copied from
/work/shared/samples/h200). A machine with a failing GPU was not available, so
the failure shapes are NVIDIA's, as docs/hardware.md cites them: nvidia-smi's
"Unable to determine the device handle for GPU…: Unknown Error" / "GPU is
lost" line in place of a GPU that fell off the bus (exit code 15), numeric
``ecc.errors.uncorrected.volatile.total``, ``retired_pages.pending`` Yes/No,
and ``[N/A]`` where a field does not apply. NVML paths run on a fake of the
pynvml API (no NVML here): the names and call shapes are nvidia-ml-py's.
"""

from __future__ import annotations

import stat
import textwrap
import types
from pathlib import Path

import pytest

from llmgw.services.agent import discovery as D
from llmgw.services.agent.config import AgentConfig, DiscoveryConfig, load_agent_config
from llmgw.services.agent.discovery import (
    DiscoveryError,
    NvmlHealth,
    discover,
    parse_compute_apps_csv,
    parse_gpu_health_csv,
    parse_nvidia_smi_csv,
    split_device_errors,
)
from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import Gpu
from llmgw.shared.tls import TlsFiles

DATA = Path(__file__).parent / "data"
UUID = "GPU-73b88528-63cc-b45e-8ae5-d8c543a45569"
BUS = "00000000:00:06.0"


def real_rows() -> str:
    """The agent's inventory query from the real H200 capture (with header and units)."""
    return (DATA / "h200-nvidia-smi-query-header.csv").read_text()


def h200(index=0, uuid=UUID, bus=BUS) -> Gpu:
    return Gpu(index=index, uuid=uuid, name="NVIDIA H200", memory_mib=143771, pci_bus_id=bus)


# --------------------------------------------------------------------------
# lost GPUs: nvidia-smi's device-handle errors
# --------------------------------------------------------------------------


def test_real_output_has_no_device_errors_and_passes_through_unchanged():
    text, errors = split_device_errors(real_rows())
    assert errors == {}
    assert parse_nvidia_smi_csv(text) == [h200()]


@pytest.mark.parametrize(
    "line, bus, said",
    [
        ("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error", "00000000:3B:00.0", "Unknown Error"),
        (
            "Unable to determine the device handle for GPU 0000:3b:00.0: GPU is lost.  Reboot the system to recover this GPU",
            "00000000:3B:00.0",
            "GPU is lost.  Reboot the system to recover this GPU",
        ),
        ("Unable to determine the device handle for GPU00000000:48:00.0: Unknown Error", "00000000:48:00.0", "Unknown Error"),
    ],
)
def test_a_lost_gpus_line_is_taken_out_and_keyed_by_its_bus_id(line, bus, said):
    text, errors = split_device_errors(real_rows() + line + "\n")
    assert errors == {bus: said}
    assert parse_nvidia_smi_csv(text) == [h200()]


def fake_smi(directory: Path, body: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / "nvidia-smi"
    p.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def cfg(tmp_path, smi: str, **disc) -> AgentConfig:
    return AgentConfig(
        node_id="node01",
        servers=("tls://10.0.0.140:4222",),
        tls=TlsFiles("ca.pem", "agent.pem", "agent-key.pem"),
        mgmt_addr="10.0.0.141",
        discovery=DiscoveryConfig(nvidia_smi=smi, ib_root=str(tmp_path / "ib"), **disc),
    )


def two_gpu_smi(tmp_path, *, lost_second=False, ecc="0", pending="No", apps="") -> str:
    """A fake answering the agent's three queries like an 8-GPU box cut to two:
    GPU 0 the real H200 row, GPU 1 the same card at bus 00000000:48:00.0."""
    row0 = f"0, {UUID}, NVIDIA H200, 143771, {BUS}"
    row1 = "1, GPU-11111111-2222-3333-4444-555555555555, NVIDIA H200, 143771, 00000000:48:00.0"
    lost = "echo 'Unable to determine the device handle for GPU0000:48:00.0: Unknown Error'; exit 15"
    return fake_smi(
        tmp_path / "smi",
        f"""\
        case "$1" in
        --query-gpu=index,uuid,*) echo '{row0}'; {lost if lost_second else f"echo '{row1}'"} ;;
        --query-gpu=index,pci.bus_id,*) echo '0, {BUS}, {ecc}, {pending}'; {lost if lost_second else "echo '1, 00000000:48:00.0, [N/A], [N/A]'"} ;;
        --query-compute-apps=*) printf '%s' '{apps}' ;;
        esac
        """,
    )


def test_a_gpu_fallen_off_the_bus_keeps_its_index_from_the_previous_inventory(tmp_path):
    healthy = discover(cfg(tmp_path, two_gpu_smi(tmp_path)))
    assert [(g.index, g.healthy) for g in healthy.gpus] == [(0, True), (1, True)]
    lost = discover(cfg(tmp_path, two_gpu_smi(tmp_path / "x", lost_second=True)), previous=healthy.gpus)
    assert [(g.index, g.healthy) for g in lost.gpus] == [(0, True), (1, False)]
    assert lost.gpus[1].problem == (
        "GPU is lost (XID 79, fallen off the bus?): nvidia-smi: Unable to determine the device handle for GPU 00000000:48:00.0: Unknown Error"
    )
    assert lost.gpus[1].uuid == healthy.gpus[1].uuid


def test_at_start_a_lost_gpu_cannot_be_named_and_is_left_out_with_a_warning(tmp_path):
    found = discover(cfg(tmp_path, two_gpu_smi(tmp_path, lost_second=True)))
    assert [g.index for g in found.gpus] == [0]
    assert any("00000000:48:00.0" in w and "no earlier inventory" in w for w in found.warnings)


def test_only_lost_gpus_at_start_is_still_an_error_naming_them(tmp_path):
    smi = fake_smi(tmp_path / "s", "echo 'Unable to determine the device handle for GPU0000:48:00.0: Unknown Error'\nexit 15\n")
    with pytest.raises(DiscoveryError, match=r"exited with code 15.*Unable to determine the device handle"):
        discover(cfg(tmp_path, smi))


# --------------------------------------------------------------------------
# ECC and retired pages
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (f"0, {BUS}, 0, No", {0: ""}),
        (f"0, {BUS}, [N/A], [N/A]", {0: ""}),  # no ECC / row remapping instead of page retirement
        (f"0, {BUS}, 1, No", {0: "1 uncorrectable ECC error (volatile)"}),
        (f"0, {BUS}, 12, Yes", {0: "12 uncorrectable ECC errors (volatile); retired pages pending (a GPU reset retires them)"}),
        (
            f"index, pci.bus_id, ecc.errors.uncorrected.volatile.total, retired_pages.pending\n0, {BUS}, 0, No\n\n1, 00000000:48:00.0, 3, No\r\n",
            {0: "", 1: "3 uncorrectable ECC errors (volatile)"},
        ),
    ],
)
def test_parse_gpu_health(text, expected):
    assert parse_gpu_health_csv(text) == expected


@pytest.mark.parametrize(
    "text, words",
    [
        (f"0, {BUS}, 0", "expected 4 fields"),
        (f"x, {BUS}, 0, No", "index 'x' is not a number"),
        (f"0, {BUS}, many, No", "ECC count 'many' is not a number"),
        (real_rows().splitlines()[1], "expected 4 fields"),  # the inventory's shape is not the health's
    ],
)
def test_parse_gpu_health_refuses_other_shapes(text, words):
    with pytest.raises(DiscoveryError, match=words):
        parse_gpu_health_csv(text)


def test_ecc_errors_make_the_gpu_unhealthy_in_the_inventory(tmp_path):
    found = discover(cfg(tmp_path, two_gpu_smi(tmp_path, ecc="2", pending="Yes")))
    assert [(g.index, g.healthy, g.problem) for g in found.gpus] == [
        (0, False, "2 uncorrectable ECC errors (volatile); retired pages pending (a GPU reset retires them)"),
        (1, True, ""),
    ]


def test_health_that_cannot_be_read_leaves_the_gpus_listed_and_healthy(tmp_path, caplog):
    smi = fake_smi(
        tmp_path / "s",
        f"""\
        case "$1" in
        --query-gpu=index,uuid,*) echo '0, {UUID}, NVIDIA H200, 143771, {BUS}' ;;
        *) echo 'Field "retired_pages.pending" is not a valid field to query.'; exit 2 ;;
        esac
        """,
    )
    found = discover(cfg(tmp_path, smi), known_pids=set())
    assert [(g.index, g.healthy) for g in found.gpus] == [(0, True)]
    assert "GPU health not read" in caplog.text and "is not a valid field to query" in caplog.text


# --------------------------------------------------------------------------
# foreign processes
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", []),
        ("No running processes found\n", []),
        (f"4242, 20480, {UUID}\n", [(4242, 20480, UUID)]),
        (f"pid, used_gpu_memory [MiB], gpu_uuid\n4242, 20480 MiB, {UUID}\n", [(4242, 20480, UUID)]),
        (f"4242, [N/A], {UUID}\n", [(4242, 0, UUID)]),  # memory not visible to this user
    ],
)
def test_parse_compute_apps(text, expected):
    assert parse_compute_apps_csv(text) == expected


def test_parse_compute_apps_refuses_other_shapes():
    with pytest.raises(DiscoveryError, match="pid 'abc' is not a number"):
        parse_compute_apps_csv(f"abc, 1, {UUID}")
    with pytest.raises(DiscoveryError, match="expected pid, used_memory, gpu_uuid"):
        parse_compute_apps_csv("4242, 1")


def test_memory_of_processes_llmgw_did_not_start_is_counted_per_gpu(tmp_path):
    apps = f"100, 1024, {UUID}\n200, 2048, {UUID}\n300, 512, {UUID}\n"
    smi = two_gpu_smi(tmp_path, apps=apps)
    asked = []

    def ours():
        asked.append(True)
        return {100}

    found = discover(cfg(tmp_path, smi), known_pids=ours)
    assert asked  # asked after the process list was read
    assert [(g.index, g.foreign_mib, g.foreign_pids, g.healthy) for g in found.gpus] == [(0, 2560, [200, 300], True), (1, 0, [], True)]
    # Without knowing our engines (before adoption) nothing is called foreign.
    assert all(g.foreign_mib == 0 and not g.foreign_pids for g in discover(cfg(tmp_path, smi)).gpus)


# --------------------------------------------------------------------------
# NVML, on a fake of the pynvml API (no NVML on this machine)
# --------------------------------------------------------------------------


def fake_nvml(*, ecc=(0, 0), pending=(0, 0), events=(), lost=(), procs=None):
    class NVMLError(Exception):
        pass

    class NVMLError_GPUIsLost(NVMLError):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    uuids = [UUID, "GPU-11111111-2222-3333-4444-555555555555"]
    queue = list(events)
    m = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_GPUIsLost=NVMLError_GPUIsLost,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=8,
        registered=[],
    )

    def handle(i):
        if i in lost:
            raise NVMLError_GPUIsLost("GPU is lost")
        return ("h", i)

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # never blocks the discovery thread
        if not queue:
            raise NVMLError_Timeout("Timeout")
        index, xid = queue.pop(0)
        return types.SimpleNamespace(device=("h", index), eventType=8, eventData=xid)

    def total_ecc(h, kind, counter):
        assert (kind, counter) == (1, 0)
        return ecc[h[1]]

    m.nvmlInit = lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlDeviceRegisterEvents = lambda h, kinds, s: m.registered.append((h[1], kinds, s))
    m.nvmlEventSetWait = wait
    m.nvmlDeviceGetUUID = lambda h: uuids[h[1]].encode()
    m.nvmlDeviceGetTotalEccErrors = total_ecc
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: pending[h[1]]
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in (procs or {}).get(h[1], [])]
    return m


GPUS = [h200(0), h200(1, uuid="GPU-11111111-2222-3333-4444-555555555555", bus="00000000:48:00.0")]


def test_nvml_healthy_gpus():
    n = fake_nvml()
    health = NvmlHealth(n)
    assert health.read(GPUS) == ({0: "", 1: ""}, {0: [], 1: []})
    assert n.registered == [(0, 8, "set"), (1, 8, "set")]  # critical XIDs, one set for all GPUs


def test_nvml_critical_xid_is_remembered_and_others_ignored():
    health = NvmlHealth(fake_nvml(events=[(1, 79), (0, 13)]))
    problems, _ = health.read(GPUS)
    assert problems == {0: "", 1: "XID 79: GPU has fallen off the bus"}
    assert health.read(GPUS)[0][1] == "XID 79: GPU has fallen off the bus"  # no new event: still unhealthy


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"ecc": (0, 3)}, {0: "", 1: "3 uncorrectable ECC errors (volatile)"}),
        ({"pending": (1, 0)}, {0: "retired pages pending (a GPU reset retires them)", 1: ""}),
        ({"lost": (0,)}, {0: "GPU is lost (NVML: GPU is lost)", 1: ""}),
        ({"events": [(0, 48), (0, 94)]}, {0: "XID 94: contained ECC error", 1: ""}),
    ],
)
def test_nvml_health_signals(kw, expected):
    assert NvmlHealth(fake_nvml(**kw)).read(GPUS)[0] == expected


def test_nvml_compute_processes_in_mib():
    _, apps = NvmlHealth(fake_nvml(procs={0: [(4242, 3 * 1024 * 1024 * 1024)]})).read(GPUS)
    assert apps == {0: [(4242, 3072)], 1: []}


def test_without_pynvml_nvml_health_is_unavailable(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert NvmlHealth().available is False


def test_discover_with_nvml_health_and_foreign_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "query_nvml", lambda: list(GPUS))
    n = fake_nvml(ecc=(0, 1), procs={0: [(100, 1024 * 1024 * 1024), (555, 2 * 1024 * 1024 * 1024)]})
    found = discover(cfg(tmp_path, "", prefer_nvml=True), known_pids={100}, nvml=NvmlHealth(n))
    assert [(g.index, g.healthy, g.problem, g.foreign_mib, g.foreign_pids) for g in found.gpus] == [
        (0, True, "", 2048, [555]),
        (1, False, "1 uncorrectable ECC error (volatile)", 0, []),
    ]


# --------------------------------------------------------------------------
# discovery.interval
# --------------------------------------------------------------------------


def agent_yaml(tmp_path, discovery: str) -> Path:
    for name in ("ca.pem", "agent.pem", "agent-key.pem"):
        (tmp_path / name).write_text("x")
    p = tmp_path / "agent.yaml"
    p.write_text("node_id: node01\nserver: tls://10.0.0.140:4222\ntls: {ca: ca.pem, cert: agent.pem, key: agent-key.pem}\nmgmt_addr: 10.0.0.141\n" + discovery)
    return p


def test_discovery_interval_defaults_to_10s_and_reads_durations(tmp_path):
    assert load_agent_config(agent_yaml(tmp_path, "")).discovery.interval == 10.0
    assert load_agent_config(agent_yaml(tmp_path, "discovery: {interval: 500ms}\n")).discovery.interval == 0.5


@pytest.mark.parametrize(
    "value, words",
    [("100ms", "must be between 200ms and 60m"), ("2h", "must be between 200ms and 60m"), ("0s", "greater than 0"), ("soon", "soon"), ("[1]", "")],
)
def test_discovery_interval_is_validated(tmp_path, value, words):
    with pytest.raises(ConfigError, match=r"discovery\.interval") as e:
        load_agent_config(agent_yaml(tmp_path, f"discovery: {{interval: {value}}}\n"))
    assert words in str(e.value)
