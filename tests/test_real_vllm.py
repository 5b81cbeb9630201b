"""Real vLLM (its CPU build), launched by llmgw on this machine.

One ``llmgw up --engine vllm`` cluster serves the whole module, because a real
engine costs a minute or more to start on a 2-core machine: four simulated
nodes, the demo's 2-node (TP 1 x PP 2) replica and single-node replica of a
tiny model, launched by the unchanged agent through the vLLM adapter's GPU
command line. The tests, in order, hold it to what the docs claim:

* the leader listened only once its worker had joined (read off the kernel's
  socket tables while ``up`` ran), and the worker opens no port of its own
  choosing: everything either rank binds besides the leader's allocated HTTP
  and rendezvous ports is a kernel-chosen (ephemeral) port;
* every endpoint the gateway passes through answers the official ``openai``
  client, embeddings included (a pooling replica, whose canary is an
  embedding);
* a stopped replica leaves no process and no listening socket;
* ``llmgw sim kill-node`` of the worker's node — after which the leader still
  answers ``/health`` 200 while its pipeline is broken — is caught, the
  replica rebuilt and requests served meanwhile.

``llmgw down`` must leave no process of the cluster behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import yaml

from llmgw.services.agent.enginedir import EngineDir
from llmgw.services.devcluster import realvllm, simcluster
from llmgw.shared import procfs, procnet

from .vllm_helpers import install_vllm
from .waiting import eventually_sync

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = realvllm.MODEL
# Compressed timings: lost after 5 missed seconds, failed after 10 s without progress. The
# canary keeps its default (every 5 s, 3 s to answer): a first request after a start on a
# loaded 2-core machine took longer than 1.2 s, and a tighter canary made the replica flap.
UP_ARGS = ["--heartbeat-interval", "1s", "--node-lost-after", "5s", "--hang-timeout", "10s"]
# A replica in service: ready, or degraded for a moment while a canary is slow.
IN_SERVICE = ("ready", "degraded")
# A replacement's start, on a loaded 2-core machine (about 1.5 minutes when quiet).
START = 420.0
WILDCARD = ("0.0.0.0", "::")


def ephemeral_range() -> range:
    """The ports the kernel hands out to a bind to port 0 (and to outgoing connections)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def llmgw(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=timeout)


@dataclass
class Bringup:
    """First moments seen, from the kernel's tables, while ``llmgw up`` ran (time.time())."""

    worker_joined: dict[str, float] = field(default_factory=dict)  # replica -> worker connected to the leader's rendezvous
    leader_listening: dict[str, float] = field(default_factory=dict)  # replica -> leader's HTTP port listening


@dataclass
class Cluster:
    dir: Path
    info: dict
    up_output: str
    bringup: Bringup

    @property
    def operator(self) -> str:
        return str(self.dir / "operator.yaml")

    @property
    def gateway(self) -> str:
        return self.info["gateway_url"]

    def addr(self, node: str) -> str:
        return next(n["mgmt_addr"] for n in self.info["nodes"] if n["node_id"] == node)

    def replicas(self) -> dict[str, dict]:
        r = llmgw("ctl", "replicas", "--config", self.operator, "-o", "json")
        assert r.returncode == 0, r.stderr
        return {x["id"]: x for x in json.loads(r.stdout)}

    def ready(self, deployment: str) -> list[dict]:
        return [x for x in self.replicas().values() if x["deployment"] == deployment and x["state"] == "ready"]

    def serving(self, deployment: str) -> list[dict]:
        return [x for x in self.replicas().values() if x["deployment"] == deployment and x["state"] in IN_SERVICE]

    def engines(self) -> list[tuple[str, EngineDir]]:
        out = []
        for node in sorted(os.listdir(self.dir / "nodes")):
            root = self.dir / "nodes" / node / "work" / "engines"
            if root.is_dir():
                out += [(node, EngineDir(p)) for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]
        return out

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key="unused", timeout=120, max_retries=0)


def engine_tree(d: EngineDir) -> set[int]:
    pids = d.read_pid()
    return procfs.tree(pids.pid) if pids is not None and procfs.is_alive(pids.pid, pids.start_time) else set()


def listeners_of(pids: set[int]) -> list[procnet.Listener]:
    inodes: set[int] = set()
    for pid in pids:
        inodes |= procfs.socket_inodes(pid)
    return [x for x in procnet.listeners() if x.inode in inodes]


def watch_bringup(d: Path, seen: Bringup, done: threading.Event) -> None:
    """While ``up`` runs: when each worker's connection to its leader's rendezvous and
    each leader's HTTP listener first appear in the kernel's tables, held by the engine's
    own processes."""
    while not done.is_set():
        try:
            info = json.loads((d / "cluster.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
            continue
        addrs = {n["node_id"]: n["mgmt_addr"] for n in info["nodes"]}
        for node, e in Cluster(d, info, "", seen).engines():
            try:
                cmd = e.read_spec().command
            except Exception:  # being written, or gone: look again next round
                continue
            key = cmd.replica_id
            if cmd.rank > 0 and key not in seen.worker_joined:
                links = procnet.connected_to(cmd.leader_addr, cmd.rendezvous_port)
                mine = set().union(*(procfs.socket_inodes(p) for p in engine_tree(e))) if links else set()
                if links & mine:
                    seen.worker_joined[key] = time.time()
            if cmd.rank == 0 and key not in seen.leader_listening:
                there = procnet.answering(procnet.listeners(), addrs[node], cmd.http_port)
                if there and {x.inode for x in there} <= set().union(*(procfs.socket_inodes(p) for p in engine_tree(e))):
                    seen.leader_listening[key] = time.time()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    vllm = install_vllm()
    d = (tmp_path_factory.mktemp("real-vllm") / "llmgw").resolve()
    seen, done = Bringup(), threading.Event()
    watcher = threading.Thread(target=watch_bringup, args=(d, seen, done), daemon=True)
    watcher.start()
    argv = [sys.executable, "-m", "llmgw.services", "up", "--dir", str(d), "--engine", "vllm", "--vllm", vllm, "--detach", "--gateway-port", "0", *UP_ARGS]
    info: dict = {}
    # One try around all of it: a test timeout while 'up' still waits must stop what it
    # started too, or its engines keep their ports through every later test.
    try:
        try:
            up = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
        finally:
            done.set()
            watcher.join(5)
        info = json.loads((d / "cluster.json").read_text()) if (d / "cluster.json").exists() else {}
        assert up.returncode == 0, f"llmgw up --engine vllm failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
        yield Cluster(d, info, up.stdout, seen)
    finally:
        down = llmgw("down", "--dir", str(d), timeout=180)
        assert down.returncode == 0, down.stderr
        nodes = [n["node_id"] for n in info.get("nodes", [])]
        eventually_sync(
            lambda: {n: p for n in nodes if (p := simcluster.processes_of(n, str(d)))},
            {},
            what="no process of any node left after 'llmgw down'",
            timeout=30,
            interval=0.2,
        )


def test_up_serves_a_real_two_node_vllm_replica_through_the_gateway(cluster):
    assert "replicas: demo-g1 ready on ib-a" in cluster.up_output, cluster.up_output[-3000:]
    # Both ready at once (a slow first canary may make one degraded for a moment).
    (demo,), (single,) = eventually_sync(
        lambda: (cluster.ready("demo"), cluster.ready("demo-single")), what="both demo replicas ready", timeout=60, interval=1.0,
    )  # fmt: skip
    leader, worker = demo["members"]
    assert (leader["rank"], leader["engine_state"], worker["rank"], worker["engine_state"]) == (0, "ready", 1, "joined")
    nodes = {n["node_id"]: n["fabric"] for n in cluster.info["nodes"]}
    assert leader["node"] != worker["node"] and nodes[leader["node"]] == nodes[worker["node"]] == demo["fabric"]

    raw = cluster.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )  # fmt: skip
    answer = raw.parse()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-llmgw-replica"] in (demo["id"], single["id"])
    assert answer.model == MODEL and answer.choices[0].message.content and answer.usage.completion_tokens >= 1
    # a CPU engine prefilling is silent for seconds: the stall watch waits longer for it (realvllm.STALL_AFTER)
    gateway = yaml.safe_load((cluster.dir / "config" / "gateway.yaml").read_text())["gateway"]
    agents = [yaml.safe_load(p.read_text())["supervisor"] for p in (cluster.dir / "nodes").glob("*/agent.yaml")]
    assert gateway["stall_after"] == "30s" and agents and all(a["stall_after"] == "30s" for a in agents), (gateway, agents)


def test_the_leader_listened_only_once_its_worker_had_joined(cluster):
    (demo,) = cluster.serving("demo")
    rid = demo["id"]
    seen = cluster.bringup
    assert rid in seen.worker_joined and rid in seen.leader_listening, f"not seen while 'up' ran: {seen}"
    # vLLM's API server comes up only after its engine core built the pipeline, which
    # waits for every rank: the worker's link to the rendezvous comes first.
    assert seen.worker_joined[rid] < seen.leader_listening[rid]


def test_only_the_allocated_ports_are_fixed_everything_else_vllm_binds_is_the_kernels_choice(cluster):
    (demo,) = cluster.serving("demo")
    (single,) = cluster.serving("demo-single")
    ephemeral = ephemeral_range()
    fixed: dict[str, set[tuple[str, int]]] = {}
    for node, e in cluster.engines():
        cmd = e.read_spec().command
        if cmd.replica_id not in (demo["id"], single["id"]):
            continue
        mine = listeners_of(engine_tree(e))
        assert mine, f"{e.name}: no listener found for a running engine"
        fixed[e.name] = {(x.addr, x.port) for x in mine if x.port not in ephemeral}
        # Whatever else it binds (ZMQ queues, Gloo pairs) the kernel chose: nothing llmgw allocates can collide with it.
        if cmd.rank > 0:
            assert fixed[e.name] == set(), f"a headless worker listens on a port it chose: {fixed[e.name]}"
        elif cmd.nnodes > 1:
            # The rendezvous (torch's TCPStore) binds every address of the host; the API server its node's.
            assert {(a, p) for a, p in fixed[e.name] if a not in WILDCARD} == {(cluster.addr(node), cmd.http_port)}
            assert {p for a, p in fixed[e.name] if a in WILDCARD} == {cmd.rendezvous_port}
        else:
            assert fixed[e.name] == {(cluster.addr(node), cmd.http_port)}  # a single-node vLLM has no rendezvous
    leaders = [m for r in (demo, single) for m in r["members"] if m["rank"] == 0]
    if leaders[0]["node"] == leaders[1]["node"]:  # two replicas on one node (bin-packing puts them there)
        a, b = (f for name, f in fixed.items() if name.endswith(".r0"))
        assert not {p for _, p in a} & {p for _, p in b}


def embeddings_answered(cluster: Cluster, replica: str) -> int:
    """POSTs to /v1/embeddings the embedding leader logged with a 200 (tests' and canaries')."""
    for _, e in cluster.engines():
        if e.name.startswith(f"{replica}.") and e.name.endswith(".r0"):
            return e.log_path.read_text(errors="replace").count('"POST /v1/embeddings HTTP/1.1" 200')
    return 0


def test_every_endpoint_the_gateway_passes_answers_the_openai_client(cluster, tmp_path):
    client = cluster.client()
    assert MODEL in {m.id for m in client.models.list().data}

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say hi"}], max_tokens=6)
    assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say hi"}], max_tokens=6, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) and chunks[-1].choices[-1].finish_reason in ("length", "stop")

    done = client.completions.create(model=MODEL, prompt="the fabric", max_tokens=6)
    assert done.choices[0].text and done.usage.completion_tokens >= 1
    streamed = list(client.completions.create(model=MODEL, prompt="the fabric", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)

    response = client.responses.create(model=MODEL, input="hello", max_output_tokens=6)
    # Six tokens of a model that never says it is done: cut at the limit, as the API says so.
    assert (response.status, response.incomplete_details.reason if response.incomplete_details else "") in (
        ("completed", ""),
        ("incomplete", "max_output_tokens"),
    )
    assert response.output_text

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{cluster.gateway}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    # Not in the openai client: vLLM's own routes, through the gateway the same way.
    tokens = post("/tokenize", {"model": MODEL, "prompt": "hello fabric"})["tokens"]
    assert len(tokens) == 2 and post("/detokenize", {"model": MODEL, "tokens": tokens})["prompt"] == "hello fabric"

    # Embeddings: a pooling replica of the same tiny model under a name of its own.
    spec = realvllm.embed_deployment()
    f = tmp_path / "embed.yaml"
    fields = ("name", "model", "engine", "replicas", "nodes_per_replica", "gpus_per_node", "engine_args", "env", "startup_timeout")
    f.write_text(yaml.safe_dump({k: getattr(spec, k) for k in fields}))
    applied = llmgw("ctl", "deploy", "apply", "-f", str(f), "--config", cluster.operator)
    assert applied.returncode == 0, applied.stderr
    (embed,) = eventually_sync(lambda: cluster.ready("embed"), what="the embedding replica ready", timeout=START, interval=1.0)
    vectors = client.embeddings.create(model=realvllm.EMBED_MODEL, input=["hello", "fabric node"])
    assert [len(v.embedding) for v in vectors.data] == [128, 128]  # the model's hidden size
    # The agent's canary for a pooling model is an embedding: two more answered, and it is still ready.
    eventually_sync(lambda: embeddings_answered(cluster, embed["id"]) >= 3, what="two embedding canaries answered", timeout=60, interval=0.5)
    assert cluster.replicas()[embed["id"]]["state"] == "ready"


def test_a_stopped_replica_leaves_no_process_and_no_listening_socket(cluster):
    (embed,) = cluster.serving("embed")
    engines = [e for _, e in cluster.engines() if e.name.startswith(f"{embed['id']}.")]
    pids = set().union(*(engine_tree(e) for e in engines))
    sockets = {x.inode for x in listeners_of(pids)}
    port = int(embed["endpoint"].rsplit(":", 1)[1])
    # vLLM's API server, engine core, worker and multiprocessing resource tracker.
    assert len(pids) >= 4 and sockets, (pids, sockets)

    deleted = llmgw("ctl", "deploy", "delete", "embed", "--config", cluster.operator)
    assert deleted.returncode == 0, deleted.stderr
    eventually_sync(lambda: embed["id"] not in cluster.replicas(), what="the embedding replica gone", timeout=60, interval=1.0)
    alive = [p for p in pids if (st := procfs.stat(p)) is not None and st.state not in ("Z", "X")]
    assert alive == [], [procfs.describe(p) for p in alive]
    left = [x for x in procnet.listeners() if x.inode in sockets or x.port == port]
    assert left == []


def test_kill_node_of_the_worker_node_is_caught_while_the_leader_says_healthy(cluster):
    (demo,) = eventually_sync(lambda: cluster.ready("demo"), what="demo ready", timeout=60, interval=1.0)
    victim = demo["members"][1]["node"]  # the worker's
    health = f"{demo['endpoint']}/health"
    codes: list[tuple[float, int]] = []

    def health_code() -> int:
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    stop = threading.Event()

    def watch_health() -> None:
        while not stop.is_set():
            codes.append((time.time(), health_code()))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    try:
        killed = llmgw("sim", "kill-node", victim, "--dir", str(cluster.dir))
        assert killed.returncode == 0, killed.stderr
        killed_at = time.time()
        assert simcluster.processes_of(victim, str(cluster.dir)) == []
        _caught_and_rebuilt(cluster, demo, victim, killed_at, codes)
    finally:
        stop.set()
        watcher.join(5)


def _caught_and_rebuilt(cluster: Cluster, demo: dict, victim: str, killed_at: float, codes: list) -> None:
    # A request right after the loss: the gateway's business to answer it from a live replica.
    answer = cluster.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=4)
    assert answer.choices[0].message.content

    def failed() -> str | None:
        r = cluster.replicas().get(demo["id"])
        return None if r is not None and r.get("state") in IN_SERVICE else (r or {}).get("reason", "gone")

    why = eventually_sync(failed, what=f"{demo['id']} failed after {victim} was killed", timeout=60, interval=1.0)
    # The gray failure was real: the leader went on answering /health 200 after its worker died.
    assert any(code == 200 for t, code in codes if t > killed_at), codes
    assert why, why

    def rebuilt() -> list[dict]:
        return [r for r in cluster.serving("demo") if r["id"] != demo["id"]]

    (new,) = eventually_sync(rebuilt, what="a replacement of demo ready", timeout=START, interval=1.0)
    assert victim not in {m["node"] for m in new["members"]}
    again = cluster.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and now?"}], max_tokens=4)
    assert again.choices[0].message.content
