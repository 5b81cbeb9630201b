"""``llmgw sim hang-engine / resume-engine / stall-replica / unstall-replica`` on real engines.

A cluster directory shaped as ``llmgw up`` writes it (cluster.json, each
node's agent.yaml naming its work dir), whose engines are launched by real
supervisors - the agent's own code, without the bus - as real ``sim``
processes: a 2-node replica, leader on node01 and worker on node02. The verbs
are run through the CLI's entry point and judged by the kernel (process state
``T``) and by the engine (a one-token canary answers or does not).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import yaml

from llmgw.services import cli
from llmgw.services.agent.config import SupervisorConfig
from llmgw.services.agent.supervisor import Supervisor
from llmgw.shared import procfs
from llmgw.shared.natsserver import free_port

from .agent_helpers import eventually, kill_engines, make_launch

pytestmark = pytest.mark.timeout(60)

NODES = ("node01", "node02")


def canary(port: int, timeout: float) -> str | None:
    """The text of a one-token completion, or None when none comes within ``timeout``."""
    body = json.dumps({"model": "sim-7b", "prompt": "ping", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["choices"][0]["text"]
    except TimeoutError:
        return None


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def state(pid: int) -> str:
    st = procfs.stat(pid)
    return st.state if st else "gone"


@pytest.fixture
async def cluster(tmp_path):
    d = tmp_path / "llmgw"
    nodes, sups = [], {}
    for node in NODES:
        nd = d / "nodes" / node
        nd.mkdir(parents=True)
        (nd / "agent.yaml").write_text(yaml.safe_dump({"node_id": node, "supervisor": {"work_dir": str(nd / "work")}}))
        nodes.append({"node_id": node, "agent_config": str(nd / "agent.yaml")})
        cfg = SupervisorConfig(work_dir=str(nd / "work"), log_lines=20, stop_timeout=1.0, health_interval=0.2)
        sups[node] = Supervisor(cfg, mgmt_addr="127.0.0.1", mgmt_interface="lo")
        await sups[node].adopt()
        sups[node].start()
    (d / "cluster.json").write_text(json.dumps({"dir": str(d), "nodes": nodes}))
    try:
        yield d, sups
    finally:
        for node, sup in sups.items():
            await sup.close()
            kill_engines(d / "nodes" / node / "work")


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["sim", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


async def test_hang_resume_and_stall_verbs_signal_exactly_the_engines_they_name(cluster, capsys):
    d, sups = cluster
    rdv, port = free_port(), free_port()
    # A long peer timeout: a worker stopped for the length of the test is slow, not lost.
    extra = ("--peer-timeout", "60s", "--token-rate", "100")
    lead = make_launch("r1", rank=0, nnodes=2, gpus=(0,), rendezvous_port=rdv, http_port=port, extra=extra)
    work = make_launch("r1", rank=1, nnodes=2, gpus=(0,), rendezvous_port=rdv, http_port=port, extra=extra)
    assert (await sups["node01"].launch(lead, {0})).ok
    assert (await sups["node02"].launch(work, {0})).ok
    leader_pid = sups["node01"].facts()[0].pid
    worker_pid = sups["node02"].facts()[0].pid
    await eventually(lambda: sups["node01"].facts()[0].state == "ready", "the leader serving", timeout=30)
    assert await asyncio.to_thread(canary, port, 10)

    rc, out = run(capsys, "hang-engine", "node02", "--replica", "r1", "--dir", str(d))
    assert rc == 0, out
    assert f"SIGSTOP sent to engine pid {worker_pid} (r1 rank 1, worker, generation 1) on node02" in out
    # A signal takes effect when the process is next scheduled: wait for the kernel to say so.
    await eventually(lambda: state(worker_pid) == "T", "the worker stopped")
    assert state(leader_pid) not in ("T", "gone")
    # Every step is a collective: the stopped worker holds the leader's generation.
    assert await asyncio.to_thread(canary, port, 1.0) is None
    assert health(port) == 200

    rc, out = run(capsys, "resume-engine", "node02", "--dir", str(d))
    assert rc == 0, out
    assert f"SIGCONT sent to engine pid {worker_pid} (r1 rank 1, worker, generation 1) on node02 (it was stopped)" in out
    await eventually(lambda: state(worker_pid) not in ("T", "gone"), "the worker running again")
    assert await asyncio.to_thread(canary, port, 10)

    rc, out = run(capsys, "stall-replica", "r1", "--dir", str(d))
    assert rc == 0, out
    assert f"SIGUSR1 sent to the leader engine pid {leader_pid} (r1 rank 0, leader, generation 1) on node01" in out
    assert await asyncio.to_thread(canary, port, 1.0) is None
    assert health(port) == 200 and state(leader_pid) not in ("T", "gone")

    rc, out = run(capsys, "unstall-replica", "r1", "--dir", str(d))
    assert rc == 0, out
    assert f"SIGUSR2 sent to the leader engine pid {leader_pid}" in out
    assert await asyncio.to_thread(canary, port, 10)

    # Whatever cannot be done is said, with what there is instead; nothing is signalled.
    for argv, words in (
        (("hang-engine", "node09"), "no simulated node 'node09'"),
        (("hang-engine", "node01", "--replica", "r2"), "no engine of replica 'r2' runs on node01 (it runs: r1)"),
        (("stall-replica", "r2"), "no running leader engine of replica 'r2'"),
    ):
        rc, out = run(capsys, *argv, "--dir", str(d))
        assert rc == 2 and words in out, (argv, out)
    rc, out = run(capsys, "hang-engine", "node01", "--dir", str(tmp := d.parent / "elsewhere"))
    assert rc == 2 and f"no cluster in {tmp}" in out
    assert state(leader_pid) not in ("T", "gone") and state(worker_pid) not in ("T", "gone")
