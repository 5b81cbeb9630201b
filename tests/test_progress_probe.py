"""The agent's progress probes and peer-loss detection, as real processes.

A real agent (``llmgw agent``) under its node certificate on a real
nats-server supervises real ``sim`` engines; faults are injected the real way
(SIGSTOP/SIGCONT to an engine, SIGUSR1/SIGUSR2 for the sim's silent stall,
SIGKILL of a worker), and the verdicts are read where the control plane reads
them: the status reports on the bus. A gateway identity publishes
``TrafficReport``s as a gateway would. Probe timings are compressed (canary
every 1 s, 500 ms to answer, stall after 1 s of silence).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request

import pytest

from llmgw.shared import procfs
from llmgw.shared import subjects as S
from llmgw.shared.schemas import ReplicaTraffic, TrafficReport, encode
from llmgw.shared.states import EngineState

from .agent_helpers import Tap, eventually, kill_engines, make_launch
from .test_agent import NODE, Node, command, first_boot

pytestmark = pytest.mark.timeout(60)

PROBE_INTERVAL = 1.0
STALL_AFTER = 1.0
GATEWAY = "gw1"


@pytest.fixture
def node(tmp_path, nats_server):
    n = Node(root=tmp_path, tls=nats_server.issue(NODE, "node"), nats_url=nats_server.url)
    n.configure(nats_server.url)
    # The supervisor section is the file's last: the probe settings go with it.
    with open(n.config, "a") as f:
        f.write(f"  probe_interval: {PROBE_INTERVAL:g}s\n  probe_timeout: 1s\n  stall_after: {STALL_AFTER:g}s\n")
    yield n
    for a in n.agents:
        a.kill()
    kill_engines(n.work_dir)


@pytest.fixture
async def control(connector, nats_server):
    """(operator tap on node01, scheduler connection, gateway connection), onboarded with one reload."""
    ops = connector.identity("ops", "operator", reload=False)
    sched = connector.identity("scheduler", "scheduler", reload=False)
    gw = connector.identity(GATEWAY, "gateway", reload=False)
    nats_server.reload()
    tap = Tap(NODE)
    await tap.start(await connector.connect(ops, label="operator/ops"))
    return tap, await connector.connect(sched, label="scheduler/scheduler"), await connector.connect(gw, label=f"gateway/{GATEWAY}")


def fact_in(tap: Tap, replica_id: str, rank: int, state: str, after: int = 0):
    """The first fact about the engine in ``state`` reported after status report number ``after``; None if none yet."""
    for r in tap.statuses[after:]:
        for f in r.engines:
            if f.replica_id == replica_id and f.rank == rank and f.state == state:
                return f
    return None


async def launch(sched, cmd) -> int:
    ack = await command(sched, S.cmd_launch(NODE), encode(cmd))
    assert ack.ok and ack.pid > 0, ack
    return ack.pid


def leader_url(cmd) -> str:
    return f"http://127.0.0.1:{cmd.http_port}"


def http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def finished_requests(cmd) -> float:
    """Requests the engine finished, all reasons: canaries included (the engine's own count)."""
    with urllib.request.urlopen(leader_url(cmd) + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


async def test_a_frozen_leader_and_a_silently_stalled_one_are_stalled_until_tokens_flow(node, control):
    tap, sched, _ = control
    node.start_agent()
    await first_boot(tap)
    cmd = make_launch("r1")
    pid = await launch(sched, cmd)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY), "the leader to be ready")

    # (a) SIGSTOP: nothing answers, neither /health nor the canary.
    mark = len(tap.statuses)
    os.kill(pid, signal.SIGSTOP)
    try:
        stalled = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.STALLED, mark), "the frozen leader reported stalled")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stalled.detail.startswith(("/health failed 2 times in a row", "canary sent")), stalled.detail
    assert not next(r for r in tap.statuses[mark:] if stalled in r.engines).full, "the change went out as a delta"
    mark = len(tap.statuses)
    ready = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY, mark), "the thawed leader ready again")
    assert ready.detail == "" and ready.pid == pid

    # (b) SIGUSR1: the sim stops producing tokens and says nothing; /health still answers 200.
    mark = len(tap.statuses)
    os.kill(pid, signal.SIGUSR1)
    stalled = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.STALLED, mark), "the silently stalled leader reported stalled")
    assert re.fullmatch(r"canary sent \d\d:\d\d:\d\d got no token in 1s", stalled.detail), stalled.detail
    assert await asyncio.to_thread(http_status, leader_url(cmd) + "/health") == 200
    mark = len(tap.statuses)
    os.kill(pid, signal.SIGUSR2)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY, mark), "the resumed leader ready again")


async def test_a_stopped_worker_stalls_its_leader_and_a_killed_one_is_a_lost_peer(node, control):
    tap, sched, _ = control
    node.start_agent()
    await first_boot(tap)
    # A peer timeout longer than the test: the stopped worker is slow, not lost.
    extra = ("--peer-timeout", "60s")
    leader = make_launch("r1", nnodes=2, rank=0, gpus=(0,), extra=extra)
    worker = make_launch("r1", nnodes=2, rank=1, gpus=(1,), rendezvous_port=leader.rendezvous_port, extra=extra)
    worker_pid = await launch(sched, worker)
    await launch(sched, leader)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY), "the leader to be ready")

    # (c) The leader's /health answers, but its generation waits for the stopped worker.
    mark = len(tap.statuses)
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        stalled = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.STALLED, mark), "the leader of a stopped worker reported stalled")
        assert stalled.detail.startswith("canary sent") and "got no token" in stalled.detail, stalled.detail
        assert await asyncio.to_thread(http_status, leader_url(leader) + "/health") == 200
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    mark = len(tap.statuses)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY, mark), "the leader ready once its worker runs again")
    assert fact_in(tap, "r1", 0, EngineState.PEER_LOST) is None, "a slow worker was taken for a lost one"

    # (d) A killed worker: the leader says so in its log, and the agent reports it.
    mark = len(tap.statuses)
    os.kill(worker_pid, signal.SIGKILL)
    lost = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.PEER_LOST, mark), "the leader reported peer-lost")
    assert re.search(r"rank 1 lost \(", lost.detail), lost.detail
    assert lost.pid and procfs.stat(lost.pid) is not None, "peer-lost is about a running engine"
    await eventually(lambda: fact_in(tap, "r1", 1, EngineState.EXITED, mark), "the worker reported exited")


async def test_canaries_only_for_idle_leaders_and_gateway_traffic_is_evidence(node, control):
    tap, sched, gw = control
    agent = node.start_agent()
    await first_boot(tap)
    cmd = make_launch("r1")
    await launch(sched, cmd)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY), "the leader to be ready")

    # (e) Idle: canaries come, at most one per probe interval.
    first = await eventually(lambda: asyncio.get_event_loop().time() if finished_requests(cmd) >= 1 else None, "a first canary")
    start_count = finished_requests(cmd)
    await eventually(lambda: finished_requests(cmd) >= start_count + 2, "two more canaries")
    elapsed = asyncio.get_event_loop().time() - first
    sent = finished_requests(cmd) - start_count
    assert sent <= elapsed / PROBE_INTERVAL + 1, f"{sent} canaries in {elapsed:.1f}s with a {PROBE_INTERVAL:g}s interval"

    completed = 0

    async def report(in_flight: int = 0, silent_for: float = 0.0, grow: int = 1) -> None:
        nonlocal completed
        completed += grow
        r = TrafficReport(
            gateway=GATEWAY, node_id=NODE, replicas=[ReplicaTraffic(replica_id="r1", completed=completed, in_flight=in_flight, silent_for=silent_for)]
        )
        await gw.publish(S.traffic(NODE), encode(r))
        await gw.flush()

    # Busy: a gateway sees requests complete, so no canary is needed.
    loop = asyncio.get_event_loop()
    warm_until = loop.time() + 1.5 * PROBE_INTERVAL
    while loop.time() < warm_until:  # past one whole interval of growth, no canary is due
        await report()
        await asyncio.sleep(0.2)
    before = finished_requests(cmd)
    busy_until = loop.time() + 2 * PROBE_INTERVAL
    while loop.time() < busy_until:
        await report()
        await asyncio.sleep(0.2)
    assert finished_requests(cmd) == before, "a canary went to a leader the gateway saw completing requests"
    assert tap.engine("r1", 0).state == EngineState.READY

    # (f) Requests in flight with no byte for stall_after: stalled at once, with the gateway's words.
    mark = len(tap.statuses)
    await report(in_flight=3, silent_for=STALL_AFTER + 1, grow=0)
    stalled = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.STALLED, mark), "the leader stalled by the gateway's evidence")
    assert stalled.detail == f"3 requests in flight, no byte for {STALL_AFTER + 1:.0f}s (gateway {GATEWAY})", stalled.detail
    mark = len(tap.statuses)
    await report(grow=2)
    ready = await eventually(lambda: fact_in(tap, "r1", 0, EngineState.READY, mark), "the leader ready when completions grow")
    assert ready.detail == ""

    # Malformed reports are dropped, logged and counted; the agent keeps listening.
    await gw.publish(S.traffic(NODE), b"\x00not a traffic report")
    await gw.publish(S.traffic(NODE), json.dumps({"gateway": GATEWAY, "node_id": NODE, "replicas": [{"replica_id": "r1", "silent_for": -4}]}).encode())
    await gw.publish(S.traffic(NODE), encode(TrafficReport(gateway=GATEWAY, node_id="node02", replicas=[])))
    await gw.flush()
    await eventually(lambda: "dropped a traffic report (3 so far)" in agent.log(), "the three bad reports logged")
    assert "silent_for must be a number of seconds >= 0, got -4" in agent.log()
    assert "it is about node 'node02', not this node 'node01'" in agent.log()
    mark = len(tap.statuses)
    await report(in_flight=1, silent_for=STALL_AFTER + 5, grow=0)
    await eventually(lambda: fact_in(tap, "r1", 0, EngineState.STALLED, mark), "a good report acted on after the bad ones")
    assert agent.proc.poll() is None


@pytest.mark.parametrize(
    ("engine_args", "served"),
    [
        ((), "sim-7b"),
        (("--served-model-name", "chat"), "chat"),
        (("--served_model_name=chat-2",), "chat-2"),
        (("--served-model-name", "first", "second"), "first"),  # vLLM's list: the first name
        (("--served-model-name",), "sim-7b"),  # no value: the model
    ],
)
def test_the_canary_asks_for_the_name_the_leader_serves(engine_args, served):
    from llmgw.services.agent.adapters import served_model

    cmd = make_launch("r1")
    cmd.engine_args = list(engine_args)
    assert served_model(cmd) == served


@pytest.mark.parametrize(
    ("engine", "engine_args", "path", "expects"),
    [
        ("vllm", (), "/v1/completions", "token"),
        ("vllm", ("--runner", "pooling"), "/v1/embeddings", "embedding"),
        ("vllm", ("--runner=pooling", "--convert", "embed"), "/v1/embeddings", "embedding"),
        ("vllm", ("--convert", "embed"), "/v1/embeddings", "embedding"),
        ("vllm", ("--task", "embed"), "/v1/embeddings", "embedding"),  # older vLLM's spelling
        ("vllm", ("--runner", "generate"), "/v1/completions", "token"),
        ("sim", (), "/v1/completions", "token"),
    ],
)
def test_the_canary_of_a_pooling_model_asks_for_an_embedding(engine, engine_args, path, expects):
    # A vLLM embedding model has no /v1/completions: a token canary would call it stalled for ever.
    from llmgw.services.agent.adapters import progress_probe

    cmd = make_launch("r1")
    cmd.engine, cmd.engine_args = engine, list(engine_args)
    probe = progress_probe(cmd, "ping")
    assert (probe.path, probe.expects) == (path, expects)
    assert probe.body["model"] == "sim-7b"
    assert probe.body.get("input" if expects == "embedding" else "prompt") == "ping"


@pytest.mark.parametrize(
    ("raw", "verdict"),
    [
        (b'{"data": [{"embedding": [0.1, -0.2]}]}', None),
        (b'{"data": [{"embedding": []}]}', "carries no embedding"),
        (b'{"data": []}', "carries no embedding"),
        (b"not json", "not an OpenAI embeddings answer"),
    ],
)
def test_an_embedding_canary_counts_only_a_vector(raw, verdict):
    from llmgw.services.agent.supervisor import _judge_embedding

    got = _judge_embedding(raw)
    assert got is None if verdict is None else verdict in got
