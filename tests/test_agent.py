"""The agent as a real process: real nats-server, real certificates, real sim engines.

The agent runs as ``python -m llmgw.services agent --config agent.yaml`` under
its own node certificate, with a configuration in the onboarding script's
shape, a fake ``nvidia-smi`` printing eight H200s and a sysfs-shaped
``ib_root``. An operator identity watches what it publishes; a scheduler
identity commands it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from llmgw.shared import procfs
from llmgw.shared import subjects as S
from llmgw.shared.schemas import CommandAck, FabricMembership, Gpu, StatusReport, StopCommand, decode, encode
from llmgw.shared.tls import TlsFiles

from .agent_helpers import (
    GPU_MIB,
    GPU_NAME,
    HCAS,
    AgentProcess,
    CuttableLink,
    Tap,
    bus_id,
    eventually,
    fake_ib_root,
    fake_nvidia_smi,
    gpu_uuid,
    kill_engines,
    make_launch,
    recorded_engines,
    write_agent_yaml,
)

pytestmark = pytest.mark.timeout(60)

NODE = "node01"


@dataclass
class Node:
    """One simulated node: its identity, fake hardware, configuration, and the agents started on it."""

    root: Path
    tls: TlsFiles
    nats_url: str
    agents: list[AgentProcess] = field(default_factory=list)

    def __post_init__(self):
        self.work_dir = self.root / "var-lib-llmgw-agent"
        self.config = self.root / "agent.yaml"
        self.nvidia_smi = fake_nvidia_smi(self.root / "nvidia-smi", NODE)
        self.ib_root = fake_ib_root(self.root / "sys-class-infiniband")

    def configure(self, server: str, **options) -> None:
        write_agent_yaml(
            self.config,
            node_id=NODE,
            server=server,
            tls=self.tls,
            work_dir=self.work_dir,
            nvidia_smi=self.nvidia_smi,
            ib_root=self.ib_root,
            **options,
        )

    def start_agent(self) -> AgentProcess:
        agent = AgentProcess(self.config, self.root / f"agent-{len(self.agents)}.log").start()
        self.agents.append(agent)
        return agent

    def agent_logs(self) -> str:
        return "\n".join(a.log() for a in self.agents)


@pytest.fixture
def node(tmp_path, nats_server):
    n = Node(root=tmp_path, tls=nats_server.issue(NODE, "node"), nats_url=nats_server.url)
    n.configure(nats_server.url)
    yield n
    for a in n.agents:
        a.kill()
    kill_engines(n.work_dir)


@pytest.fixture
async def control(connector, nats_server):
    """(operator tap on node01, scheduler connection), identities onboarded with one reload."""
    ops = connector.identity("ops", "operator", reload=False)
    sched = connector.identity("scheduler", "scheduler", reload=False)
    nats_server.reload()  # also accepts node01, issued by the node fixture
    tap = Tap(NODE)
    await tap.start(await connector.connect(ops, label="operator/ops"))
    return tap, await connector.connect(sched, label="scheduler/scheduler")


async def command(nc, subject: str, payload: bytes, schema=CommandAck):
    msg = await nc.request(subject, payload, timeout=10)
    return decode(msg.data, schema)


def full_reports(tap: Tap, boot_id: str) -> list[StatusReport]:
    return [r for r in tap.statuses if r.full and r.boot_id == boot_id]


async def first_boot(tap: Tap, not_in: set[str] = frozenset()) -> str:
    """The boot id of an agent that has announced itself with a full status report."""
    report = await eventually(lambda: next((r for r in tap.statuses if r.full and r.boot_id not in not_in), None), "a full status report")
    return report.boot_id


async def launch_pair(sched, replica_id: str = "r1") -> dict[int, CommandAck]:
    """A 2-member sim replica with both ranks on this node (worker first: it waits for its leader)."""
    rdzv = make_launch(replica_id).rendezvous_port
    acks = {}
    for rank, gpus in ((1, (4, 5, 6, 7)), (0, (0, 1, 2, 3))):
        cmd = make_launch(replica_id, nnodes=2, rank=rank, gpus=gpus, rendezvous_port=rdzv)
        acks[rank] = await command(sched, S.cmd_launch(NODE), encode(cmd))
        assert acks[rank].ok and acks[rank].pid > 0, acks[rank]
    return acks


async def test_agent_publishes_its_node_and_runs_a_two_member_replica(node, control):
    tap, sched = control
    node.configure(node.nats_url, inventory_interval="1s")
    node.start_agent()
    boot = await first_boot(tap)

    inv = await eventually(lambda: tap.inventories and tap.inventories[0], "an inventory")
    assert (inv.node_id, inv.boot_id, inv.mgmt_addr, inv.mgmt_interface) == (NODE, boot, "127.0.0.1", "lo")
    assert inv.gpus == [Gpu(index=i, uuid=gpu_uuid(NODE, i), name=GPU_NAME, memory_mib=GPU_MIB, pci_bus_id=bus_id(i)) for i in range(8)]
    assert inv.fabrics == [FabricMembership(name="ib-a", hcas=list(HCAS), usable=True)]
    assert [h.name for h in inv.hcas] == list(HCAS)
    for h in inv.hcas:
        assert h.usable and h.problem == "", h
        assert [(p.port, p.state, p.phys_state, p.rate, p.link_layer) for p in h.ports] == [(1, "ACTIVE", "LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand")]
    assert full_reports(tap, boot)[0].engines == []
    # Its first connect waited a draw in [0, reconnect_base) (nodes starting together spread out).
    first = re.search(r"first connect to NATS in ([\d.]+)s \(spread over reconnect_base ([\d.]+)s", node.agent_logs())
    assert first is not None, node.agent_logs()[-2000:]
    assert float(first[2]) == 0.1 and 0.0 <= float(first[1]) <= 0.1, first[0]

    await eventually(lambda: len(tap.heartbeats) >= 3, "three heartbeats")
    seqs = [hb.seq for hb in tap.heartbeats]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1, seqs
    assert {(hb.node_id, hb.boot_id) for hb in tap.heartbeats} == {(NODE, boot)}

    acks = await launch_pair(sched)
    # the leader's "ready" and the worker's "joined" (it holds a connection to the
    # leader's rendezvous) are separate messages: wait for both
    leader, worker = await eventually(
        lambda: (f := tap.engine("r1", 0)) and f.state == "ready" and (w := tap.engine("r1", 1)) and w.state == "joined" and (f, w),
        "the leader ready and the worker joined",
    )
    assert (leader.pid, leader.serves_http, leader.gpus) == (acks[0].pid, True, [0, 1, 2, 3])
    assert (worker.pid, worker.serves_http) == (acks[1].pid, False)

    listed = await command(sched, S.cmd_list(NODE), b"", StatusReport)
    assert listed.full and {(f.rank, f.state) for f in listed.engines} == {(0, "ready"), (1, "joined")}

    stop = await command(sched, S.cmd_stop(NODE), encode(StopCommand(replica_id="r1", generation=1, reason="test")))
    assert stop.ok, stop
    await eventually(lambda: tap.engine("r1", 0).state == tap.engine("r1", 1).state == "exited", "both members to be reported exited")
    assert (tap.engine("r1", 0).exit_code, tap.engine("r1", 1).exit_code) == (0, 0)
    await eventually(lambda: not recorded_engines(node.work_dir), "the engine directories to be removed")
    assert "launched r1.g1.r0" in node.agent_logs() and "stop replica r1" in node.agent_logs()

    # A port going down is found by re-discovery and published.
    (node.ib_root / "mlx5_1" / "ports" / "1" / "state").write_text("1: DOWN\n")
    changed = await eventually(lambda: (i := tap.inventories[-1]) and not i.fabrics[0].usable and i, "an inventory with mlx5_1 down")
    assert "mlx5_1" in changed.fabrics[0].problem and "DOWN" in changed.fabrics[0].problem, changed.fabrics
    assert [h.usable for h in changed.hcas] == [True, False]


async def test_an_agent_restart_kills_nothing(node, control):
    tap, sched = control
    first = node.start_agent()
    boot1 = await first_boot(tap)
    acks = await launch_pair(sched)
    await eventually(lambda: (f := tap.engine("r1", 0)) and f.state == "ready", "the leader to be ready")
    running = recorded_engines(node.work_dir)
    assert {pid for pid, _ in running.values()} == {acks[0].pid, acks[1].pid}

    first.proc.send_signal(signal.SIGKILL)  # as an OOM kill or a crash would
    first.proc.wait(10)
    second = node.start_agent()
    boot2 = await first_boot(tap, not_in={boot1})

    # The new agent's first word on status is the full list: the same processes, as they were.
    from_boot2 = [(kind, m) for kind, m in tap.order if m.boot_id == boot2]
    first_status = next(m for kind, m in from_boot2 if kind == "status")
    assert first_status.full
    assert {(f.rank, f.pid, f.state) for f in first_status.engines} == {(0, acks[0].pid, "ready"), (1, acks[1].pid, "joined")}
    # …sent on connect, before its second heartbeat (one heartbeat interval later).
    statuses_before_beat2 = next(i for i, (kind, m) in enumerate(from_boot2) if kind == "status")
    beat2 = next((i for i, (kind, m) in enumerate(from_boot2) if kind == "heartbeat" and m.seq >= 2), len(from_boot2))
    assert statuses_before_beat2 < beat2
    assert recorded_engines(node.work_dir) == running, "an engine was restarted"
    assert all(procfs.is_alive(pid, started) for pid, started in running.values())

    # A clean stop of the agent leaves the engines running too.
    assert second.terminate() == 0
    assert "engines keep running" in second.log()
    assert all(procfs.is_alive(pid, started) for pid, started in running.values())

    # …and a third agent still has them.
    node.start_agent()
    boot3 = await first_boot(tap, not_in={boot1, boot2})
    assert {f.pid for f in full_reports(tap, boot3)[0].engines} == {acks[0].pid, acks[1].pid}


async def test_commands_get_one_reply_each_with_a_reason(node, control):
    tap, sched = control
    agent = node.start_agent()
    await first_boot(tap)

    cmd = make_launch("r1", generation=2, gpus=(0, 1))
    launched = await command(sched, S.cmd_launch(NODE), encode(cmd))
    assert launched.ok and launched.pid > 0, launched
    again = await command(sched, S.cmd_launch(NODE), encode(cmd))
    assert again.ok and again.pid == launched.pid, again

    refused = {
        "stale_generation": make_launch("r1", generation=1, gpus=(4,)),
        "gpu_busy": make_launch("r2", gpus=(1, 2)),
        "unknown_gpu": make_launch("r2", gpus=(9,)),
    }
    for code, bad in refused.items():
        ack = await command(sched, S.cmd_launch(NODE), encode(bad))
        assert (ack.ok, ack.code) == (False, code) and ack.reason, ack

    malformed = [
        (S.cmd_launch(NODE), b"not json"),
        (S.cmd_launch(NODE), b"{}"),
        (S.cmd_launch(NODE), encode({**msgspec.to_builtins(cmd), "gpus": "0,1"})),
        (S.cmd_launch(NODE), b'{"replica_id": "r3", "generation": "one"}'),
        (S.cmd_stop(NODE), b"[1, 2]"),
        (S.cmd_stop(NODE), b"\xff\xfe"),
    ]
    for subject, payload in malformed:
        ack = await command(sched, subject, payload)
        assert (ack.ok, ack.code) == (False, "bad_message") and ack.reason, (payload, ack)

    # Still running, still answering, and nothing else was started.
    listed = await command(sched, S.cmd_list(NODE), b"", StatusReport)
    assert [(f.replica_id, f.pid) for f in listed.engines] == [("r1", launched.pid)]
    assert agent.proc.poll() is None
    assert list(recorded_engines(node.work_dir)) == ["r1.g2.r0"]


async def test_a_reconnect_brings_a_full_report_and_no_stale_heartbeats(node, control, nats_server):
    tap, sched = control
    link = await CuttableLink(nats_server.host, nats_server.port).start()
    try:
        node.configure(link.url)
        agent = node.start_agent()
        boot = await first_boot(tap)
        ack = await command(sched, S.cmd_launch(NODE), encode(make_launch("r1", gpus=(0,))))
        assert ack.ok, ack
        ((pid, started),) = recorded_engines(node.work_dir).values()
        await eventually(lambda: len(tap.heartbeats) >= 2, "heartbeats before the cut")

        link.cut()
        await eventually(lambda: "disconnected from NATS" in agent.log(), "the agent to notice the cut")
        cut_off_since = time.time()
        # While it is cut off, its engine dies (as if OOM-killed) and heartbeats fall due.
        os.killpg(pid, signal.SIGKILL)
        await eventually(lambda: not procfs.is_alive(pid, started), "the engine to die")
        # Not a wait for anything: heartbeats fall due while it is cut off (several intervals).
        await asyncio.sleep(1.5)
        back_at = time.time()
        link.restore()

        report = await eventually(lambda: len(full_reports(tap, boot)) >= 2 and full_reports(tap, boot)[-1], "a full report after the reconnect")
        (fact,) = report.engines
        assert (fact.pid, fact.state, fact.exit_code) == (pid, "exited", -signal.SIGKILL), "the exit during the outage was lost"
        await eventually(lambda: tap.heartbeats[-1].sent_at > back_at, "heartbeats after the reconnect")
        stale = [hb for hb in tap.heartbeats if cut_off_since < hb.sent_at < back_at]
        assert stale == [], "heartbeats composed while disconnected were replayed"
        seqs = [hb.seq for hb in tap.heartbeats]
        assert seqs == sorted(set(seqs)) and {hb.boot_id for hb in tap.heartbeats} == {boot}
    finally:
        await link.close()


async def test_agent_refuses_to_start_under_another_nodes_certificate(tmp_path, nats_server):
    other = nats_server.issue("node02", "node")
    config = write_agent_yaml(
        tmp_path / "agent.yaml",
        node_id=NODE,
        server=nats_server.url,
        tls=other,
        work_dir=tmp_path / "work",
        nvidia_smi=fake_nvidia_smi(tmp_path / "nvidia-smi", NODE),
        ib_root=fake_ib_root(tmp_path / "ib"),
    )
    agent = AgentProcess(config, tmp_path / "agent.log").start()
    try:
        assert agent.proc.wait(30) == 2
    finally:
        agent.kill()
    said = agent.log()
    assert "common name is 'node02' but node_id is 'node01'" in said, said
    assert "Traceback" not in said
    assert not (tmp_path / "work").exists(), "it must refuse before touching anything"
