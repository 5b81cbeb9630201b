"""``llmgw up`` / ``llmgw down`` / ``llmgw sim …``: the whole system on one machine.

``up`` creates (or reuses) a PKI in ``DIR/pki``, onboards each simulated node
with its own certificate (``simcluster.py``), renders the NATS configuration
and starts the embedded nats-server, the four services and one agent per node
— every one a real process in its own session, logging to ``DIR/logs`` — then
applies the seed's deployment and waits until its replicas are ready, showing
progress. In the foreground, Ctrl-C stops everything; with ``--detach`` it
returns once ready and ``llmgw down`` stops everything later. What it started
is recorded in ``DIR/pids.json`` (pid + process start time, so a reused pid is
never killed) and ``DIR/cluster.json``.

A service process that exits is started again, as systemd's
``Restart=on-failure`` would (``supervise``): by the foreground ``up`` itself,
or, with ``--detach``, by a small supervisor process (``llmgw up --supervise
DIR``, recorded in pids.json as ``supervisor``) that ``llmgw down`` stops
first. ``--ha`` adds a standby scheduler, a standby health monitor and a
second gateway (``cluster.json``: ``gateway_urls``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from llmgw.shared import api, bus, pki, procfs
from llmgw.shared import buckets as B
from llmgw.shared.api import ApiFailed
from llmgw.shared.config import write_config
from llmgw.shared.durations import format_duration, parse_duration
from llmgw.shared.errors import BusError, ConfigError, LlmgwError
from llmgw.shared.kvmirror import open_mirror
from llmgw.shared.natsconf import check_cluster_size
from llmgw.shared.natsserver import NatsCluster, NatsServer, free_port
from llmgw.shared.schemas import DeploymentSpec, NodeAddrRequest, Replica
from llmgw.shared.states import LAUNCHED_REPLICA, LeaseState, ReplicaState

from . import realvllm, simcluster
from .demo import DEMO_MODEL
from .simcluster import SimNode, Timings

SERVICES = ("registry", "health", "scheduler", "gateway")
# With --ha: a second instance of each (the same identity, its own process and ports).
HA_SERVICES = ("health-b", "scheduler-b", "gateway-b")
# Restart=on-failure with systemd's default start limit: at most this many
# restarts of one service within RESTART_WINDOW, each after RESTART_DELAY.
RESTART_DELAY = 1.0
RESTART_BURST = 5
RESTART_WINDOW = 60.0


class UpError(LlmgwError):
    code = "up"


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks (shared/procfs.py), recorded against pid reuse.

    None for a process that is gone — or a zombie: it has exited and only
    waits for its parent to reap it, so waiting for it to die would be waiting
    for nothing.
    """
    st = procfs.stat(pid)
    return None if st is None or st.state in ("Z", "X") else st.start_time


def _alive(pid: int, start: int | None) -> bool:
    """``pid`` still the process recorded as started at ``start``; with no start
    recorded (it had already exited when recorded), any live process of that pid."""
    if start is None:
        return _start_time(pid) is not None
    return procfs.is_alive(pid, start)


def _free_node_net(nodes: int) -> str:
    """The first 127.0.M.0/24 (M from 1) where none of this cluster's node addresses
    has a listening socket: two clusters on one machine (or one and a leftover
    engine) on the same 127.0.1.N and the same engine ports would health-check
    and route to each other's engines — or, now that an agent proves a port is
    its engine's, refuse every launch as port_busy."""
    from llmgw.shared.procnet import listening_sockets

    taken = {addr for addr, _port in listening_sockets()}
    for m in range(1, 255):
        net = f"127.0.{m}"
        if not any(f"{net}.{i + 1}" in taken for i in range(nodes)):
            return net
    raise UpError("every 127.0.M.0/24 (M 1-254) has a listener on a node address: too many clusters on this machine")


def _preferred_port(host: str, preferred: int) -> int:
    if not preferred:
        return free_port(host)
    with socket.socket() as s:
        try:
            s.bind((host, preferred))
            return preferred
        except OSError:
            return free_port(host)


@dataclass
class Cluster:
    """Everything ``up`` starts and where it put it."""

    dir: Path
    progress: Callable[[str], object] = print
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    nodes: list[SimNode] = field(default_factory=list)
    nats: NatsServer | None = None  # the (first) server
    nats_cluster: NatsCluster | None = None  # with --nats-servers 3: all of them
    gateway_url: str = ""
    gateway_urls: list[str] = field(default_factory=list)
    ha: bool = False
    # The engine the demo runs ("sim" or "vllm") and, for vllm, the environment
    # every agent runs with (realvllm.prepare: the vllm command, the model cache).
    engine: str = "sim"
    agent_env: dict[str, str] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    @property
    def first_server(self) -> NatsServer:
        """The (first) NATS server, once ``prepare`` made it."""
        if self.nats is None:
            raise UpError("no NATS server prepared yet")
        return self.nats

    def say(self, msg: str) -> None:
        self.progress(f"[{time.monotonic() - self.t0:6.1f}s] {msg}")

    @property
    def nats_urls(self) -> list[str]:
        return self.nats_cluster.urls if self.nats_cluster else [self.first_server.url]

    @property
    def server_setting(self) -> str | list[str]:
        """``server:`` in every config: one URL, or the list of the cluster's."""
        return self.nats_urls if self.nats_cluster else self.first_server.url

    # -- files ---------------------------------------------------------------
    def _service_config(self, role: str, extra: dict, file: str = "") -> Path:
        tls = self.first_server.tls_for(role, role)
        if not Path(tls.cert).exists():
            tls = self.first_server.issue(role, role)
        path = self.dir / "config" / f"{file or role}.yaml"
        if self.nats_cluster and role != "operator":
            extra = {"kv_replicas": 3, **extra}
        write_config(path, {"server": self.server_setting, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}, **extra})
        return path

    def _record(self) -> None:
        pids = {name: {"pid": p.pid, "start": _start_time(p.pid), "cmd": p.args[2:4] if isinstance(p.args, list) else []} for name, p in self.procs.items()}
        (self.dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}, cwd=self.dir)
        self.procs[name] = p
        self._record()
        return p

    def llmgw(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "llmgw.services", *args]

    # -- bring-up ---------------------------------------------------------------
    def prepare(self, args) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        old = self.dir / "pids.json"
        if old.exists() and any(_alive(v["pid"], v.get("start")) for v in json.loads(old.read_text()).values()):
            raise UpError(f"a cluster from {self.dir} is still running; stop it first with 'llmgw down --dir {self.dir}'")
        fresh = not pki.has_ca(self.dir / "pki")
        n_nats = getattr(args, "nats_servers", 1) or 1
        if n_nats > 1:
            # Each server on its own loopback address, as on its own machine.
            self.nats_cluster = NatsCluster(root=self.dir, size=n_nats, hosts=[f"127.0.0.{i + 1}" for i in range(n_nats)])
            self.nats_cluster.prepare()
            self.nats = self.nats_cluster.members[0]
            if (self.dir / "jetstream").is_dir():
                self.say(
                    f"note: the single server's JetStream store in {self.dir / 'jetstream'} is not carried over — nats-server "
                    "does not adopt a standalone store into a cluster; this cluster's state starts empty (docs/operations.md)"
                )
        else:
            self.nats = NatsServer(root=self.dir)
            self.nats.port = _preferred_port("127.0.0.1", 4222)
            self.nats.prepare()
        self.say(("created an authority in " if fresh else "reusing the authority in ") + str(self.dir / "pki"))
        hb = args.heartbeat_interval
        probe = getattr(args, "probe_interval", None)
        stall_after = getattr(args, "stall_after", None)
        hang_timeout = getattr(args, "hang_timeout", None)
        self.engine = getattr(args, "engine", None) or "sim"
        stop_timeout = min(10.0, max(1.0, hb * 2))
        if self.engine == "vllm":
            # A real engine gets the time its SIGTERM takes measured, and more (realvllm.STOP_TIMEOUT).
            stop_timeout = max(stop_timeout, realvllm.STOP_TIMEOUT)
            if stall_after is None:  # a CPU engine's prefill is silence (realvllm.STALL_AFTER)
                stall_after = realvllm.STALL_AFTER
        self.timings = Timings(
            heartbeat_interval=hb,
            stop_timeout=stop_timeout,
            health_interval=min(1.0, max(0.1, hb / 2)),
            reconnect_base=min(0.5, hb),
            reconnect_max=max(1.0, min(5.0, hb * 2)),
            probe_interval=probe,
            # A canary is judged before the next is due (the agent insists).
            probe_timeout=min(3.0, probe * 0.6) if probe else None,
            stall_after=stall_after,
            discovery_interval=getattr(args, "discovery_interval", None),
        )
        gw_port = _preferred_port("127.0.0.1", args.gateway_port)
        self.gateway_url = f"http://127.0.0.1:{gw_port}"
        self.gateway_urls = [self.gateway_url]
        self.ha = bool(getattr(args, "ha", False))
        common = {"reconnect_base": format_duration(self.timings.reconnect_base), "reconnect_max": format_duration(self.timings.reconnect_max)}
        self.configs = {
            "registry": self._service_config("registry", {**common, "metrics_listen": f"127.0.0.1:{free_port()}"}),
            "health": self._service_config(
                "health",
                {
                    **common,
                    "metrics_listen": f"127.0.0.1:{free_port()}",
                    "health": {
                        "heartbeat_interval": format_duration(hb),
                        "suspect_after_missed": 3,
                        "node_lost_after": format_duration(args.node_lost_after),
                        "leader_ttl": format_duration(max(1.0, hb * 2)),
                    },
                },
            ),
            "scheduler": self._service_config(
                "scheduler",
                {
                    **common,
                    "metrics_listen": f"127.0.0.1:{free_port()}",
                    "scheduler": {
                        "reconcile_interval": format_duration(min(1.0, hb)),
                        # The simulated nodes are one machine: a port goes to one of them at a time.
                        "nodes_share_ports": True,
                        "leader_ttl": format_duration(max(1.0, hb * 2)),
                        **({"hang_timeout": format_duration(hang_timeout)} if hang_timeout else {}),
                    },
                },
            ),
            "gateway": self._service_config(
                "gateway",
                {
                    **common,
                    "metrics_listen": f"127.0.0.1:{free_port()}",
                    "gateway": {
                        "listen": f"127.0.0.1:{gw_port}",
                        "workers": 1 if getattr(args, "gateway_workers", None) is None else args.gateway_workers,
                        **({"stall_after": format_duration(stall_after)} if stall_after else {}),
                        **({"routing": args.routing} if getattr(args, "routing", None) else {}),
                    },
                },
            ),
        }
        if self.ha:
            # Standbys read the same files but for their metrics (and the gateway's port).
            for name in HA_SERVICES:
                role = name.removesuffix("-b")
                extra = write_safe_copy(self.configs[role])
                extra["metrics_listen"] = f"127.0.0.1:{free_port()}"
                if role == "gateway":
                    port = free_port()
                    extra["gateway"] = {**extra["gateway"], "listen": f"127.0.0.1:{port}"}
                    self.gateway_urls.append(f"http://127.0.0.1:{port}")
                extra.pop("server", None), extra.pop("tls", None), extra.pop("kv_replicas", None)
                self.configs[name] = self._service_config(role, extra, file=name)
        self.operator_config = self._service_config("operator", {})
        os.replace(self.operator_config, self.dir / "operator.yaml")
        self.operator_config = self.dir / "operator.yaml"
        specs = simcluster.layout(args.nodes, args.fabrics, args.gpus_per_node)
        net = _free_node_net(len(specs))
        if net != "127.0.1":
            self.say(f"127.0.1.0/24 is in use on this machine (another cluster's engines?): this cluster's nodes use {net}.0/24")
        specs = [dataclasses.replace(s, mgmt_addr=f"{net}.{s.mgmt_addr.rsplit('.', 1)[1]}") for s in specs]
        if self.engine == "vllm":
            vllm = realvllm.find_vllm(getattr(args, "vllm", None))
            self.agent_env = realvllm.prepare(self.dir, vllm)
            self.say(f"real vLLM: {vllm}; the model {realvllm.MODEL} written to {self.agent_env['HF_HUB_CACHE']} (no weights: --load-format dummy)")
        self.nodes = [simcluster.write_node(self.dir, self.dir / "pki", self.server_setting, s, self.timings) for s in specs]
        self.say(
            f"onboarded {len(self.nodes)} simulated nodes: "
            + ", ".join(f"{n.spec.node_id} ({n.spec.fabric or 'no fabric'}, {n.spec.mgmt_addr})" for n in self.nodes)
        )
        self._write_cluster_json()

    def _write_cluster_json(self) -> None:
        data = {
            "gateway_url": self.gateway_url,
            "gateway_urls": self.gateway_urls,
            "nats_url": self.first_server.url,
            "nats_monitor_url": self.first_server.monitor_url,
            "operator_config": str(self.operator_config.resolve()),
            "dir": str(self.dir.resolve()),
            "engine": self.engine,
            # What every agent runs with on top of its own environment ('llmgw sim start-node' too).
            "agent_env": self.agent_env,
            "nodes": [
                {
                    "node_id": n.spec.node_id,
                    "fabric": n.spec.fabric,
                    "mgmt_addr": n.spec.mgmt_addr,
                    "gpus": n.spec.gpus,
                    "agent_config": str(n.config.resolve()),
                }
                for n in self.nodes
            ],
            "nats_servers": [
                {
                    "name": m.name,
                    "url": m.url,
                    "monitor_url": m.monitor_url,
                    "process": _nats_proc_name(m.name) if self.nats_cluster else "nats-server",
                    "config": str(m.conf_path.resolve()),
                    "store_dir": str((m.root / "jetstream").resolve()),
                }
                for m in (self.nats_cluster.members if self.nats_cluster else [self.first_server])
            ],
        }
        (self.dir / "cluster.json").write_text(json.dumps(data, indent=2) + "\n")

    def start_nats(self) -> None:
        if self.nats_cluster:
            self.nats_cluster.render()
            for m in self.nats_cluster.members:
                m.log_file = self.dir / "logs" / f"{_nats_proc_name(m.name)}.log"
                m.proc = self._spawn(_nats_proc_name(m.name), self.llmgw("nats", "--config", str(m.conf_path)))
            self.nats_cluster.wait_ready(30)
            self.say(
                f"{len(self.nats_cluster.members)} nats-servers ready (a cluster, routes over mutual TLS): "
                + ", ".join(f"{m.name} {m.url}" for m in self.nats_cluster.members)
            )
            return
        nats = self.first_server
        nats.render()
        nats.log_file = self.dir / "logs" / "nats-server.log"
        self._spawn("nats-server", self.llmgw("nats", "--config", str(nats.conf_path)))
        nats.proc = self.procs["nats-server"]
        nats.wait_ready(20)
        self.say(f"nats-server ready on {nats.url} (monitoring {nats.monitor_url})")

    def start_services(self) -> None:
        names = SERVICES + (HA_SERVICES if self.ha else ())
        argv = {name: self.llmgw(name.removesuffix("-b"), "--config", str(self.configs[name])) for name in names}
        # What the supervisor restarts (``supervise``), by name.
        (self.dir / "services.json").write_text(json.dumps(argv, indent=2) + "\n")
        for name in names:
            self._spawn(name, argv[name])
        self.say("started " + ", ".join(names) + (" (health-b and scheduler-b stand by; gateway-b is a second gateway)" if self.ha else ""))

    def start_agent(self, node: SimNode) -> None:
        env = {**self.agent_env, **simcluster.cluster_env(self.dir, node.spec.node_id)}
        self._spawn(f"agent-{node.spec.node_id}", self.llmgw("agent", "--config", str(node.config)), env=env)

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise UpError(f"{name} exited with code {p.returncode}; see {self.dir / 'logs' / (name + '.log')}")

    # -- waiting, with progress --------------------------------------------------
    async def connect(self):
        tls = self.first_server.tls_for("operator", "operator")
        # Progress lines are the output here; connection chatter only if something is wrong.
        quiet = logging.getLogger("llmgw.up.bus")
        quiet.setLevel(max(logging.WARNING, logging.getLogger().level))
        logging.getLogger("llmgw.kv").setLevel(max(logging.WARNING, logging.getLogger().level))
        nc = await bus.connect(self.nats_urls, tls, name="up", initial_attempts=20, reconnect_base=0.2, reconnect_max=1.0, logger=quiet)
        js = nc.jetstream(timeout=5)
        return nc, js

    async def wait_nodes(self, js, timeout: float) -> None:
        nodes = await open_mirror(js, B.NODES, wait=timeout)
        leases = await open_mirror(js, B.LEASES, wait=timeout)
        want = {n.spec.node_id for n in self.nodes}
        deadline = time.monotonic() + timeout
        last = None
        try:
            while True:
                self.check_alive()
                ready = {k for k, lease in leases.items.items() if lease.state == LeaseState.READY} & want
                registered = {k for k, r in nodes.items.items() if r.boot_id} & want  # joined, not only onboarded (set-addr)
                now_state = (len(registered), len(ready))
                if now_state != last:
                    self.say(f"nodes registered {len(registered)}/{len(want)}, heartbeating {len(ready)}/{len(want)}")
                    last = now_state
                if registered == want and ready == want:
                    return
                if time.monotonic() > deadline:
                    missing = sorted(want - ready)
                    raise UpError(f"nodes not ready after {timeout:.0f}s: {', '.join(missing)}; see {self.dir / 'logs'}")
                await asyncio.sleep(0.2)
        finally:
            await nodes.stop()
            await leases.stop()

    async def wait_replicas(self, js, deployment: str, count: int, timeout: float, spares: int = 0) -> dict[str, Replica]:
        """Wait until ``count`` replicas of ``deployment`` are ready and ``spares`` stand by; the ready ones."""
        replicas = await open_mirror(js, B.REPLICAS, wait=timeout)
        started = time.monotonic()
        deadline = started + timeout
        last, said = None, started
        try:
            while True:
                self.check_alive()
                mine = {k: r for k, r in replicas.items.items() if r.deployment == deployment}
                summary = ", ".join(
                    f"{r.id} {r.state}" + (f" on {r.fabric}" if r.fabric else "") + _engines(r) for r in sorted(mine.values(), key=lambda r: r.id)
                )
                now = time.monotonic()
                if summary != last:
                    self.say(f"replicas: {summary or 'none yet'}")
                    last, said = summary, now
                elif now - said >= 30:  # a real engine's start is minutes of nothing to report
                    self.say(f"replicas: {summary or 'none yet'} (still waiting, {now - started:.0f}s)")
                    said = now
                ready = {k: r for k, r in mine.items() if r.state == ReplicaState.READY}
                if len(ready) >= count and sum(1 for r in mine.values() if r.state == ReplicaState.STANDBY) >= spares:
                    return ready
                if time.monotonic() > deadline:
                    raise UpError(
                        f"replicas of {deployment} not ready after {timeout:.0f}s ({summary}); try 'llmgw ctl explain {deployment} --config {self.operator_config}'"
                    )
                await asyncio.sleep(0.2)
        finally:
            await replicas.stop()

    async def record_addresses(self, nc, timeout: float = 60.0) -> None:
        """Record each simulated node's 127.0.1.N with the registry (``set-addr``),
        as ``llmgw ctl node set-addr`` would, retrying until the registry answers."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            req = NodeAddrRequest(node_id=n.spec.node_id, addr=n.spec.mgmt_addr)
            while True:
                try:
                    await api.call(nc, api.SET_ADDR, req, timeout=2)
                    break
                except ApiFailed as e:
                    raise UpError(f"the registry refused the address of {n.spec.node_id}: {e}") from None
                except BusError:
                    pass  # not answering yet
                self.check_alive()
                if time.monotonic() > deadline:
                    raise UpError(f"the registry did not answer set-addr within {timeout:.0f}s; see {self.dir / 'logs' / 'registry.log'}")
                await asyncio.sleep(0.2)
        self.say(f"recorded the addresses of {len(self.nodes)} nodes with the registry")

    def demo_specs(self, load_time: float, peer_timeout: float | None = None, spares: int = 0) -> list[DeploymentSpec]:
        """The demo's deployments: two 2 × 4-GPU replicas of the sim, or on real vLLM
        what this machine holds (``realvllm.demo_deployments``); ``spares`` warm spares each."""
        return [msgspec.structs.replace(s, spares=spares) for s in self._demo_specs(load_time, peer_timeout)]

    def _demo_specs(self, load_time: float, peer_timeout: float | None) -> list[DeploymentSpec]:
        if self.engine == "vllm":
            return realvllm.demo_deployments()
        return [
            DeploymentSpec(
                name="demo",
                model=DEMO_MODEL,
                engine="sim",
                replicas=2,
                nodes_per_replica=2,
                gpus_per_node=4,
                engine_args=["--load-time", format_duration(load_time), *(["--peer-timeout", format_duration(peer_timeout)] if peer_timeout else [])],
                startup_timeout=max(60.0, load_time * 4),
            )
        ]

    @property
    def demo_model(self) -> str:
        return realvllm.MODEL if self.engine == "vllm" else DEMO_MODEL

    async def apply_demo(self, nc, load_time: float, peer_timeout: float | None = None, spares: int = 0) -> list[DeploymentSpec]:
        specs = self.demo_specs(load_time, peer_timeout, spares)
        for spec in specs:
            for _ in range(100):
                try:
                    await api.call(nc, api.APPLY, spec, timeout=2)
                    break
                except ApiFailed as e:
                    raise UpError(f"the scheduler refused the demo deployment {spec.name}: {e}") from None
                except BusError:  # not answering yet
                    self.check_alive()
                    await asyncio.sleep(0.2)
            else:
                raise UpError(f"the scheduler did not accept the demo deployment {spec.name}; see its log")
            shape = f"{spec.replicas} replica{'s' if spec.replicas != 1 else ''} × {spec.nodes_per_replica} node{'s' if spec.nodes_per_replica != 1 else ''} × {spec.gpus_per_node} GPU{'s' if spec.gpus_per_node != 1 else ''}"
            how = f"load time {format_duration(load_time)}" if spec.engine == "sim" else " ".join(spec.engine_args)
            spared = f", and {spec.spares} warm spare{'s' if spec.spares != 1 else ''}" if spec.spares else ""
            self.say(f"applied deployment {spec.name}: {shape} of {spec.model} on {spec.engine} ({how}){spared}")
        return specs

    # -- teardown -------------------------------------------------------------------
    def stop_all(self) -> None:
        stop_recorded(self.dir, [n.spec.node_id for n in self.nodes], say=self.say)


def _engines(r: Replica) -> str:
    """A starting replica's members as their agents last reported them: "[node01 starting, node02 joined]"."""
    if r.state not in LAUNCHED_REPLICA:
        return ""
    return " [" + ", ".join(f"{m.node_id} {m.engine_state or 'launched'}" for m in r.members) + "]"


def stop_recorded(d: Path, node_ids: list[str] | None = None, say=print) -> int:
    """Stop what ``up`` recorded: the supervisor (so nothing is restarted), agents and
    their engines, services, then NATS."""
    pids_file = d / "pids.json"
    if not pids_file.exists():
        return 0
    procs = json.loads(pids_file.read_text())
    sup = procs.pop("supervisor", None)
    if sup and _alive(sup["pid"], sup.get("start")):
        _signal(sup["pid"], signal.SIGTERM)
        _wait_gone([sup], 5.0)
        procs = json.loads(pids_file.read_text())  # what it restarted last
        procs.pop("supervisor", None)
    if node_ids is None:
        try:
            node_ids = [n["node_id"] for n in json.loads((d / "cluster.json").read_text())["nodes"]]
        except (OSError, ValueError, KeyError):
            # An 'up' ended before it wrote cluster.json: its agents are recorded by name,
            # and their engines must not outlive them (they hold ports a next run needs).
            node_ids = [n.removeprefix("agent-") for n in procs if n.startswith("agent-")]
    order = sorted(procs, key=lambda n: (0 if n.startswith("agent-") else 2 if n.startswith("nats-server") else 1, n))
    stopped = 0
    for group in ([n for n in order if n.startswith("agent-")], [n for n in order if not n.startswith("agent-") and not n.startswith("nats-server")]):
        live = [(n, procs[n]) for n in group if _alive(procs[n]["pid"], procs[n].get("start"))]
        for _, p in live:
            _signal(p["pid"], signal.SIGTERM)
        _wait_gone([p for _, p in live], 5.0)
        stopped += len(live)
        if group and group[0].startswith("agent-"):
            # Engines outlive agents by design; a simulated machine going away takes them too.
            killed = [pid for node in node_ids for pid in simcluster.kill_node(node, str(d.resolve()))]
            stopped += len(killed)
            # SIGKILL is sent, not done: a vLLM worker freeing gigabytes takes a moment to go.
            left = simcluster.wait_gone(killed, 10.0)
            if left:
                say(f"still running 10s after SIGKILL: pids {', '.join(map(str, left))} (stuck in the kernel?)")
    servers = [procs[n] for n in order if n.startswith("nats-server") and _alive(procs[n]["pid"], procs[n].get("start"))]
    for nats in servers:
        _signal(nats["pid"], signal.SIGTERM)
    _wait_gone(servers, 5.0)
    stopped += len(servers)
    pids_file.unlink(missing_ok=True)
    say(f"stopped {stopped} processes")
    return stopped


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each was started in its own session: take its children too
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(procs: list[dict], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p["pid"], p.get("start")) for p in procs):
        time.sleep(0.05)
    for p in procs:
        if _alive(p["pid"], p.get("start")):
            _signal(p["pid"], signal.SIGKILL)
    # Reap our own children if these were ours.
    for p in procs:
        try:
            os.waitpid(p["pid"], os.WNOHANG)
        except ChildProcessError:
            pass


# --------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------


def _durations(args) -> None:
    for name in ("heartbeat_interval", "node_lost_after", "engine_load_time"):
        setattr(args, name, parse_duration(getattr(args, name), "--" + name.replace("_", "-")))
    for name in ("probe_interval", "stall_after", "hang_timeout", "engine_peer_timeout", "discovery_interval"):
        value = getattr(args, name, None)
        if value is not None:
            seconds = parse_duration(value, "--" + name.replace("_", "-"))
            if seconds <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be greater than 0, got {value!r}")
            setattr(args, name, seconds)
    if getattr(args, "engine_peer_timeout", None) is not None and args.engine_peer_timeout < 0.2:
        raise ConfigError(f"--engine-peer-timeout must be at least 200ms (the sim's floor), got {format_duration(args.engine_peer_timeout)}")
    if args.node_lost_after <= 3 * args.heartbeat_interval:
        raise ConfigError(
            f"--node-lost-after ({format_duration(args.node_lost_after)}) must exceed 3 heartbeat intervals ({format_duration(3 * args.heartbeat_interval)})"
        )


def spare_nodes(args) -> None:
    """``--spares N``: the demo deployment keeps N warm spares, and the cluster
    gains N fabrics of as many nodes as each of its fabrics has. The seed's four
    nodes have the GPUs for a spare, but only beside a serving replica, on the
    same two nodes: the node kill that fails that replica would take the spare
    with it. A fabric of its own gives each spare a failure domain of its own."""
    spares = getattr(args, "spares", 0) or 0
    if spares < 0:
        raise ConfigError(f"--spares {spares}: must be 0 or more")
    if not spares or args.fabrics <= 0 or args.no_demo:
        return
    per = -(-args.nodes // args.fabrics)
    args.nodes += spares * per
    args.fabrics += spares


async def _bring_up(cluster: Cluster, args) -> None:
    cluster.prepare(args)
    cluster.start_nats()
    cluster.start_services()
    nc, js = await cluster.connect()
    try:
        # Onboarding records each node's address before its agent speaks
        # (a node does not choose it): an inventory claiming another one is refused.
        await cluster.record_addresses(nc)
        for node in cluster.nodes:
            cluster.start_agent(node)
        cluster.say(f"started {len(cluster.nodes)} agents")
        await cluster.wait_nodes(js, timeout=max(60.0, args.heartbeat_interval * 6))
        if not args.no_demo:
            specs = await cluster.apply_demo(nc, args.engine_load_time, getattr(args, "engine_peer_timeout", None), getattr(args, "spares", 0))
            if cluster.engine == "vllm":
                cluster.say(f"real vLLM engines take a minute or two to start here (up to {format_duration(realvllm.STARTUP_TIMEOUT)})")
            for spec in specs:
                timeout = spec.startup_timeout + 30 if spec.engine != "sim" else max(120.0, args.engine_load_time * 4 + 30)
                await cluster.wait_replicas(js, spec.name, spec.replicas, timeout=timeout, spares=spec.spares)
    finally:
        await nc.close()


def _ready_banner(cluster: Cluster, args) -> None:
    cfg = cluster.operator_config
    print()
    print(f"llmgw is up: {len(cluster.nodes)} simulated nodes, NATS at {cluster.first_server.url}")
    print(f"  gateway (OpenAI API): {cluster.gateway_url}/v1")
    for url in cluster.gateway_urls[1:]:
        print(f"  second gateway:       {url}/v1 (--ha: standby scheduler and health monitor too)")
    print(f"  operator config:      {cfg}")
    print(f"  logs:                 {cluster.dir / 'logs'}")
    print()
    print("Try:")
    if not args.no_demo:
        print(f"  curl -s {cluster.gateway_url}/v1/chat/completions -H 'content-type: application/json' \\")
        print(f'       -d \'{{"model": "{cluster.demo_model}", "messages": [{{"role": "user", "content": "hello"}}]}}\'')
    print(f"  llmgw ctl nodes --config {cfg}")
    print(f"  llmgw ctl replicas --config {cfg}")
    print(f"  llmgw tui --config {cfg}")
    print(f"  llmgw sim kill-node node02 --dir {cluster.dir}     # then watch the rebuild")
    print(f"  llmgw ctl events --follow --config {cfg}")
    print()


def up(args) -> int:
    if getattr(args, "supervise", None):
        return supervise_detached(Path(args.supervise).resolve())
    _durations(args)
    if getattr(args, "vllm", None) and getattr(args, "engine", "sim") != "vllm":
        raise ConfigError(f"--vllm {args.vllm} names the vllm command for --engine vllm; this cluster's engine is {args.engine}")
    if getattr(args, "engine", "sim") == "vllm":
        realvllm.find_vllm(getattr(args, "vllm", None))  # no vLLM to run: say so before touching DIR
    spare_nodes(args)
    simcluster.layout(args.nodes, args.fabrics, args.gpus_per_node)  # refuse bad sizes before touching DIR
    check_cluster_size(getattr(args, "nats_servers", 1))
    d = Path(args.dir).resolve()  # children run elsewhere (cwd=DIR): every path they get is absolute
    cluster = Cluster(dir=d)
    try:
        asyncio.run(_bring_up(cluster, args))
    except (KeyboardInterrupt, Exception) as e:
        cluster.say("start failed; stopping what was started")
        cluster.stop_all()
        if isinstance(e, KeyboardInterrupt):
            return 130
        raise
    _ready_banner(cluster, args)
    if args.scenario in ("seed", "fabric"):
        from .scenario import run_fabric_scenario, run_seed_scenario

        try:
            asyncio.run((run_seed_scenario if args.scenario == "seed" else run_fabric_scenario)(cluster, args))
        finally:
            if not args.detach:
                cluster.stop_all()
        return 0
    if args.detach:
        supervising = cluster._spawn("supervisor", cluster.llmgw("up", "--supervise", str(d)))
        print(f"running in the background (a crashed service is restarted by the supervisor, pid {supervising.pid}); stop with: llmgw down --dir {d}")
        return 0
    print("running; press Ctrl-C to stop everything")
    stop = {"flag": False}
    # Explicit handlers: a shell without job control starts background jobs
    # with SIGINT ignored, and "stop everything" must still work there.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.update(flag=True))
    sup = Supervisor(d, cluster.say, {n: p for n, p in cluster.procs.items()})
    try:
        while not stop["flag"]:
            time.sleep(0.5)
            # A service that exits is restarted (agents and NATS servers are simulated
            # machines: llmgw sim kill-node/kill-nats and start-node/start-nats).
            sup.check()
    except KeyboardInterrupt:
        pass
    cluster.say("stopping")
    cluster.stop_all()
    return 0


def write_safe_copy(path: Path) -> dict:
    """A service config's keys, to derive a standby's from."""
    from llmgw.shared.config import read_yaml

    return dict(read_yaml(path))


class Supervisor:
    """Restart=on-failure for the service processes ``up`` started.

    ``procs`` holds what this process started (their exit codes are known); a
    service recorded in pids.json by another process (``up --detach`` before it
    exited) is watched by pid and start time. Each restart is said and logged:
    "scheduler (pid 1234) exited with -9; restarted as pid 1240". More than
    RESTART_BURST restarts of one service within RESTART_WINDOW: it stays down,
    and that is said too (systemd's start limit).
    """

    def __init__(self, d: Path, say, procs: dict[str, subprocess.Popen]):
        self.dir = d
        self.say = say
        self.procs = procs
        try:
            self.argv: dict[str, list[str]] = json.loads((d / "services.json").read_text())
        except (OSError, ValueError):
            self.argv = {}
        self.restarts: dict[str, list[float]] = {}
        self.given_up: set[str] = set()
        self.down_since: dict[str, float] = {}

    def _recorded(self) -> dict:
        try:
            return json.loads((self.dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}

    def _status(self, name: str, rec: dict) -> tuple[bool, int | None, str]:
        """(running, pid, how it ended)."""
        p = self.procs.get(name)
        if p is not None and rec.get(name, {}).get("pid") in (None, p.pid):
            code = p.poll()
            return code is None, p.pid, f"exited with {code}"
        r = rec.get(name)
        if r is None:
            return False, None, "is not running"
        return _alive(r["pid"], r.get("start")), r["pid"], "exited"

    def check(self) -> list[str]:
        said = []
        rec = self._recorded()
        stamp = time.monotonic()
        for name, argv in self.argv.items():
            running, pid, how = self._status(name, rec)
            if running or name in self.given_up:
                self.down_since.pop(name, None)
                continue
            if stamp - self.down_since.setdefault(name, stamp) < RESTART_DELAY:
                continue  # RestartSec
            recent = [t for t in self.restarts.get(name, []) if stamp - t < RESTART_WINDOW]
            if len(recent) >= RESTART_BURST:
                self.given_up.add(name)
                msg = f"{name} (pid {pid}) {how}; restarted {len(recent)} times within {RESTART_WINDOW:.0f}s, left stopped; see {self.dir / 'logs' / (name + '.log')}"
                self.say(msg)
                said.append(msg)
                continue
            logs = self.dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / f"{name}.log", "ab") as log:
                p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)
            self.procs[name] = p
            self.restarts[name] = [*recent, stamp]
            self.down_since.pop(name, None)
            rec = self._recorded()
            rec[name] = {"pid": p.pid, "start": _start_time(p.pid), "cmd": argv[3:5]}
            tmp = self.dir / "pids.json.tmp"
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, self.dir / "pids.json")
            msg = f"{name} (pid {pid}) {how}; restarted as pid {p.pid}"
            self.say(msg)
            said.append(msg)
        return said


def supervise_detached(d: Path) -> int:
    """``llmgw up --supervise DIR``: what ``up --detach`` leaves behind to restart
    crashed services; ``llmgw down`` stops it first. Says what it does on stdout
    (DIR/logs/supervisor.log)."""
    stop = {"flag": False}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.update(flag=True))
    t0 = time.monotonic()
    sup = Supervisor(d, lambda m: print(f"[{time.monotonic() - t0:8.1f}s] {m}", flush=True), {})
    print(f"supervising {', '.join(sup.argv) or 'nothing (no services.json)'} in {d}", flush=True)
    while not stop["flag"]:
        time.sleep(0.5)
        if stop["flag"]:
            break
        sup.check()
        for p in list(sup.procs.values()):
            p.poll()  # reap what exited (it is restarted next round)
    return 0


def down(args) -> int:
    d = Path(args.dir).resolve()  # children run elsewhere (cwd=DIR): every path they get is absolute
    if not (d / "pids.json").exists():
        print(f"nothing running from {d}")
        return 0
    stop_recorded(d)
    return 0


def _cluster_nodes(d: Path) -> dict[str, dict]:
    try:
        data = json.loads((d / "cluster.json").read_text())
    except FileNotFoundError:
        raise UpError(f"no cluster in {d}; start one with 'llmgw up --dir {d}'") from None
    return {n["node_id"]: n for n in data["nodes"]}


def _agent_env(d: Path) -> dict[str, str]:
    """What ``up`` gave every agent on top of its environment (cluster.json ``agent_env``):
    for ``--engine vllm``, the vllm command and the model cache."""
    try:
        env = json.loads((d / "cluster.json").read_text()).get("agent_env") or {}
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def _nats_proc_name(server: str) -> str:
    return f"nats-server-{server}"


def _nats_server(d: Path, n: int) -> dict:
    """The Nth (1-based) server of the cluster ``up`` recorded in cluster.json."""
    try:
        servers = json.loads((d / "cluster.json").read_text()).get("nats_servers") or []
    except FileNotFoundError:
        raise UpError(f"no cluster in {d}; start one with 'llmgw up --dir {d} --nats-servers 3'") from None
    except ValueError as e:
        raise UpError(f"{d / 'cluster.json'} is not valid JSON ({e}); was it edited by hand?") from None
    if not servers:
        raise UpError(f"{d / 'cluster.json'} lists no NATS servers; it was written by an older 'llmgw up'")
    if not 1 <= n <= len(servers):
        raise UpError(f"no NATS server {n}: this cluster has {len(servers)} (1..{len(servers)})")
    return servers[n - 1]


def _nats_fault(d: Path, n: int, *, kill: bool) -> int:
    """kill-nats: SIGKILL one server, as its machine dies. start-nats: start it again
    on the same config and JetStream store, and wait until it is back in the cluster."""
    srv = _nats_server(d, n)
    pids_file = d / "pids.json"
    procs = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    rec = procs.get(srv["process"])
    running = rec is not None and _alive(rec["pid"], rec.get("start"))
    if kill:
        if rec is None or not running:
            print(f"NATS server {n} ({srv['name']}) is not running")
            return 0
        _signal(rec["pid"], signal.SIGKILL)
        _wait_gone([rec], 5.0)
        print(f"killed NATS server {n} ({srv['name']}, {srv['url']}) with SIGKILL; clients reconnect to the others")
        return 0
    if running:
        raise UpError(f"NATS server {n} ({srv['name']}) is already running; kill it first with 'llmgw sim kill-nats {n}'")
    logs = d / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{srv['process']}.log", "ab") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "llmgw.services", "nats", "--config", srv["config"]], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=d
        )
    procs[srv["process"]] = {"pid": p.pid, "start": _start_time(p.pid), "cmd": ["nats", srv["config"]]}
    pids_file.write_text(json.dumps(procs, indent=2) + "\n")
    probe = NatsServer(root=d, proc=p, log_file=logs / f"{srv['process']}.log")
    probe.host, _, port = srv["monitor_url"].removeprefix("http://").rpartition(":")
    probe.monitor_port = int(port)
    probe.wait_ready(60, js_current=True)
    print(f"started NATS server {n} ({srv['name']}, {srv['url']}) on its config and store; it caught up with the cluster")
    return 0


def sim(args) -> int:
    if args.sim_cmd == "node-devices":
        return _node_devices(args)
    if getattr(args, "agent_config", None):
        return _hardware_fault(None, {"agent_config": args.agent_config}, args)
    d = Path(args.dir).resolve()  # children run elsewhere (cwd=DIR): every path they get is absolute
    if args.sim_cmd in ("kill-nats", "start-nats"):
        return _nats_fault(d, args.server, kill=args.sim_cmd == "kill-nats")
    nodes = _cluster_nodes(d)
    if args.sim_cmd in ("stall-replica", "unstall-replica"):
        return _stall_replica(d, nodes, args.replica, stall=args.sim_cmd == "stall-replica")
    if args.node not in nodes:
        raise UpError(f"no simulated node {args.node!r} in {d} (nodes: {', '.join(sorted(nodes))})")
    if args.sim_cmd in ("hang-engine", "resume-engine"):
        return _hang_engine(d, nodes[args.node], args.node, args.replica, hang=args.sim_cmd == "hang-engine")
    if args.sim_cmd in ("hca-down", "hca-up", "gpu-fault", "gpu-ok"):
        return _hardware_fault(d, nodes[args.node], args)
    if args.sim_cmd == "kill-node":
        pids = simcluster.kill_node(args.node, str(d.resolve()))
        print(f"killed {args.node}: {len(pids)} processes (agent and engines) with SIGKILL" if pids else f"{args.node} had no running processes")
        return 0
    # start-node
    if simcluster.processes_of(args.node, str(d.resolve())):
        raise UpError(f"{args.node} is already running; kill it first with 'llmgw sim kill-node {args.node}'")
    cfg = nodes[args.node]["agent_config"]
    logs = d / "logs"
    with open(logs / f"agent-{args.node}.log", "ab") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "llmgw.services", "agent", "--config", cfg],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **_agent_env(d), **simcluster.cluster_env(d, args.node)},
            cwd=d,
        )
    pids_file = d / "pids.json"
    if pids_file.exists():
        procs = json.loads(pids_file.read_text())
        procs[f"agent-{args.node}"] = {"pid": p.pid, "start": _start_time(p.pid), "cmd": ["agent", cfg]}
        pids_file.write_text(json.dumps(procs, indent=2) + "\n")
    print(f"started the agent of {args.node} (pid {p.pid}); it adopts nothing, its engines died with it")
    return 0


def _node_devices(args) -> int:
    """``sim node-devices``: a simulated machine's nvidia-smi and sysfs, for nodes outside ``llmgw up`` (the compose kit's)."""
    from llmgw.shared.names import check_name, hca_problem

    check_name(args.node)
    if not 1 <= args.gpus <= 64:
        raise UpError(f"--gpus must be 1..{64}, got {args.gpus}")
    hcas = tuple(h for h in args.hcas.split(",") if h)
    for h in hcas:
        if problem := hca_problem(h):
            raise UpError(f"--hcas: {h!r} is not an HCA name: {problem}")
    d = Path(args.node_dir)
    spec = simcluster.SimNodeSpec(node_id=args.node, fabric=None, gpus=args.gpus, mgmt_addr="")
    try:
        simcluster.write_node_devices(
            d, spec, hcas, state_dir=Path(args.state_dir) if args.state_dir else None, home=Path("/") if args.own_machine else None, python=args.python
        )
    except OSError as e:
        raise UpError(f"cannot write the devices of {args.node} under {d}: {e.strerror or e}") from None
    print(f"{args.node}: {d / 'bin' / 'nvidia-smi'} ({args.gpus} GPUs), {d / 'ib'} ({', '.join(hcas) or 'no HCAs'})")
    return 0


def _hardware_fault(d: Path | None, node: dict, args) -> int:
    """hca-down/up and gpu-fault/ok: change the files the node's agent reads (docs/hardware.md).

    ``d``: the 'llmgw up' cluster, or None for a node given by its agent.yaml."""
    cfg = Path(node["agent_config"])
    if d is None and not cfg.is_file():
        raise UpError(f"--agent-config {cfg}: no such file")
    undo = f"--dir {d}" if d is not None else f"--agent-config {cfg}"
    try:
        if args.sim_cmd in ("hca-down", "hca-up"):
            up = args.sim_cmd == "hca-up"
            port, before, now = simcluster.set_hca_port(cfg, args.hca, up=up)
            print(f"{args.node} {args.hca} port {port.name}: state {before or '?'} -> {now} ({port / 'state'})")
            if not up:
                print(f"undo with: llmgw sim hca-up {args.node} {args.hca} {undo}")
            return 0
        if args.sim_cmd == "gpu-ok":
            simcluster.set_gpu_fault(cfg, args.index)
            print(f"{args.node} GPU {args.index}: no fault; its nvidia-smi reports it healthy")
            return 0
        xid = args.xid if args.xid is not None or args.ecc is not None else 79
        path = simcluster.set_gpu_fault(cfg, args.index, xid=xid, ecc=args.ecc)
        what = ", ".join(w for w in (f"XID {xid}" if xid is not None else "", f"{args.ecc} uncorrectable ECC errors" if args.ecc is not None else "") if w)
        print(f"{args.node} GPU {args.index}: {what} ({path}); its agent sees it within one discovery interval")
        print(f"undo with: llmgw sim gpu-ok {args.node} {args.index} {undo}")
        return 0
    except ConfigError as e:
        raise UpError(str(e)) from None


def _node_engines(node: dict, node_id: str) -> list[simcluster.SimEngine]:
    return simcluster.running_engines(node_id, simcluster.node_work_dir(Path(node["agent_config"])))


def _hang_engine(d: Path, node: dict, node_id: str, replica: str | None, *, hang: bool) -> int:
    """SIGSTOP (hang) or SIGCONT (resume) the engine processes of one node, or of one replica's member there."""
    engines = _node_engines(node, node_id)
    targets = [e for e in engines if replica is None or e.replica_id == replica]
    if not targets:
        if replica is None:
            raise UpError(f"no engine runs on {node_id} (in {d}); nothing to {'hang' if hang else 'resume'}")
        here = sorted({e.replica_id for e in engines})
        raise UpError(f"no engine of replica {replica!r} runs on {node_id}" + (f" (it runs: {', '.join(here)})" if here else " (it runs no engine)"))
    sig = signal.SIGSTOP if hang else signal.SIGCONT
    sent = 0
    for e in targets:
        was = e.state()
        if not simcluster.signal_engine(e, sig):
            print(f"engine pid {e.pid} ({e.label}) on {node_id} is gone; nothing sent")
            continue
        sent += 1
        note = ""
        if not hang:
            note = " (it was stopped)" if was == "T" else " (it was not stopped)"
        elif was == "T":
            note = " (it was already stopped)"
        print(f"{sig.name} sent to engine pid {e.pid} ({e.label}) on {node_id}{note}")
    if hang and sent:
        print(f"undo with: llmgw sim resume-engine {node_id}" + (f" --replica {replica}" if replica else "") + f" --dir {d}")
    return 0 if sent else 1


def _stall_replica(d: Path, nodes: dict[str, dict], replica: str, *, stall: bool) -> int:
    """SIGUSR1 (stall) or SIGUSR2 (unstall) to the leader engine of ``replica``: a silent stall of the sim engine."""
    leaders, seen = [], set()
    for node_id in sorted(nodes):
        for e in _node_engines(nodes[node_id], node_id):
            seen.add(e.replica_id)
            if e.replica_id == replica and e.rank == 0:
                leaders.append(e)
    if not leaders:
        raise UpError(
            f"no running leader engine of replica {replica!r} in {d}" + (f" (running replicas: {', '.join(sorted(seen))})" if seen else " (no engine runs)")
        )
    e = max(leaders, key=lambda x: x.generation)
    if e.engine == "vllm":
        return _stall_vllm(e, replica, d, stall=stall)
    if e.engine != "sim":
        raise UpError(f"replica {replica} runs engine {e.engine!r}: only the sim and vLLM can be stalled (SIGUSR1 would end another)")
    sig = signal.SIGUSR1 if stall else signal.SIGUSR2
    if not simcluster.signal_engine(e, sig, group=False):
        raise UpError(f"the leader engine pid {e.pid} ({e.label}) on {e.node_id} is gone; nothing sent")
    if stall:
        print(f"SIGUSR1 sent to the leader engine pid {e.pid} ({e.label}) on {e.node_id}: it stops producing tokens, silently; /health still answers 200")
        print(f"undo with: llmgw sim unstall-replica {replica} --dir {d}")
    else:
        print(f"SIGUSR2 sent to the leader engine pid {e.pid} ({e.label}) on {e.node_id}: it produces tokens again")
    return 0


def _stall_vllm(e: simcluster.SimEngine, replica: str, d: Path, *, stall: bool) -> int:
    """A silent stall of real vLLM: SIGSTOP (SIGCONT to undo) its leader's engine core
    alone. The API server in front of it keeps answering /health 200 — vLLM's health
    check asks only whether the core has died — while no request makes progress."""
    cores = simcluster.vllm_engine_cores(e)
    if not cores:
        raise UpError(f"the leader of {replica} (pid {e.pid}, {e.label}) on {e.node_id} has no VLLM::EngineCore process (still starting, or gone)")
    sig = signal.SIGSTOP if stall else signal.SIGCONT
    for pid in cores:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise UpError(f"the engine core pid {pid} of {replica} is gone; nothing sent") from None
    what = ", ".join(map(str, cores))
    if stall:
        print(
            f"SIGSTOP sent to the engine core of {replica}'s leader (pid {what}, {e.label}) on {e.node_id}: no token is produced, silently; /health still answers 200"
        )
        print(f"undo with: llmgw sim unstall-replica {replica} --dir {d}")
    else:
        print(f"SIGCONT sent to the engine core of {replica}'s leader (pid {what}) on {e.node_id}: it produces tokens again")
    return 0
