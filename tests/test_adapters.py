"""Engine adapters: the exact argv and env of each engine for a 2-node replica, pinned.

A golden here changing means an engine will be started differently on real
hardware; update it only together with docs/engines.md and the reason.
"""

from __future__ import annotations

import pytest

from llmgw.services.agent.adapters import AdapterError, EngineCommand, build
from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import LaunchCommand

PY = "/opt/llmgw/bin/python"

# One 2-node replica: node01 (10.0.0.141) leads, node02 (10.0.0.142) works;
# 4 GPUs each (the upper half), fabric ib-a through two HCAs.
NODES = {0: "10.0.0.141", 1: "10.0.0.142"}


def member(engine: str, rank: int, **kw) -> LaunchCommand:
    fields = dict(
        replica_id="chat-7f3a",
        generation=3,
        deployment="chat",
        model="meta-llama/Llama-3.1-70B-Instruct",
        engine=engine,
        nnodes=2,
        rank=rank,
        leader_addr="10.0.0.141",
        rendezvous_port=29500,
        http_port=8100 if rank == 0 else 0,
        gpus=[4, 5, 6, 7],
        fabric="ib-a",
        hcas=["mlx5_0", "mlx5_1"],
        engine_args=["--max-model-len", "8192"],
        env={"HF_HOME": "/models/hf"},
    )
    fields.update(kw)
    return LaunchCommand(**fields)


def run(cmd: LaunchCommand, rank: int | None = None) -> EngineCommand:
    return build(cmd, mgmt_addr=NODES[cmd.rank if rank is None else rank], mgmt_interface="eth0", python=PY)


def env_for(addr: str) -> dict[str, str]:
    return {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NCCL_SOCKET_IFNAME": "=eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "VLLM_HOST_IP": addr,
        "SGLANG_HOST_IP": addr,
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
        "HF_HOME": "/models/hf",
    }


MODEL = "meta-llama/Llama-3.1-70B-Instruct"

GOLDEN = [
    (
        "vllm-rank0",
        member("vllm", 0),
        EngineCommand(
            argv=[
                "vllm", "serve", MODEL,
                "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
                "--nnodes", "2", "--node-rank", "0",
                "--master-addr", "10.0.0.141", "--master-port", "29500",
                "--distributed-executor-backend", "mp",
                "--host", "10.0.0.141", "--port", "8100",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.141"),
            serves_http=True,
        ),
    ),
    (
        "vllm-rank1",
        member("vllm", 1),
        EngineCommand(
            argv=[
                "vllm", "serve", MODEL,
                "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
                "--nnodes", "2", "--node-rank", "1",
                "--master-addr", "10.0.0.141", "--master-port", "29500",
                "--distributed-executor-backend", "mp",
                "--headless",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.142"),
            serves_http=False,
        ),
    ),
    (
        "sglang-rank0",
        member("sglang", 0),
        EngineCommand(
            argv=[
                PY, "-m", "sglang.launch_server", "--model-path", MODEL,
                "--tensor-parallel-size", "8",
                "--nnodes", "2", "--node-rank", "0",
                "--dist-init-addr", "10.0.0.141:29500",
                "--host", "10.0.0.141", "--port", "8100",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.141"),
            serves_http=True,
        ),
    ),
    (
        "sglang-rank1",
        member("sglang", 1),
        EngineCommand(
            argv=[
                PY, "-m", "sglang.launch_server", "--model-path", MODEL,
                "--tensor-parallel-size", "8",
                "--nnodes", "2", "--node-rank", "1",
                "--dist-init-addr", "10.0.0.141:29500",
                "--host", "10.0.0.142", "--port", "0",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.142"),
            serves_http=False,
        ),
    ),
    (
        "sim-rank0",
        member("sim", 0),
        EngineCommand(
            argv=[
                PY, "-m", "llmgw.services", "engine", "sim",
                "--model", MODEL, "--nnodes", "2", "--rank", "0",
                "--leader-addr", "10.0.0.141", "--rendezvous-port", "29500",
                "--host", "10.0.0.141", "--port", "8100",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.141"),
            serves_http=True,
        ),
    ),
    (
        "sim-rank1",
        member("sim", 1),
        EngineCommand(
            argv=[
                PY, "-m", "llmgw.services", "engine", "sim",
                "--model", MODEL, "--nnodes", "2", "--rank", "1",
                "--leader-addr", "10.0.0.141", "--rendezvous-port", "29500",
                "--host", "10.0.0.142", "--port", "0",
                "--max-model-len", "8192",
            ],
            env=env_for("10.0.0.142"),
            serves_http=False,
        ),
    ),
]  # fmt: skip


@pytest.mark.parametrize("cmd, expected", [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden(cmd, expected):
    got = run(cmd)
    assert got.argv == expected.argv
    assert got.env == expected.env
    assert got.serves_http is expected.serves_http


def test_env_order_is_stable_with_deployment_env_last():
    # Not semantic for exec, but it is what a log line or `ctl explain` shows.
    assert list(run(member("vllm", 0)).env) == list(env_for("x"))


def test_python_defaults_to_the_agent_interpreter():
    import sys

    got = build(member("sim", 0), mgmt_addr="10.0.0.141", mgmt_interface="eth0")
    assert got.argv[0] == sys.executable


# --------------------------------------------------------------------------
# Deployment engine_args: TP/PP may be overridden, placement may not
# --------------------------------------------------------------------------

OVERRIDES = [
    ("vllm-tp-long", "vllm", ["--tensor-parallel-size", "8"], "--tensor-parallel-size", ["--tensor-parallel-size", "8"]),
    ("vllm-tp-short", "vllm", ["-tp", "8"], "--tensor-parallel-size", ["-tp", "8"]),
    ("vllm-tp-equals-underscore", "vllm", ["--tensor_parallel_size=8"], "--tensor-parallel-size", ["--tensor_parallel_size=8"]),
    ("vllm-pp", "vllm", ["--pipeline-parallel-size", "1"], "--pipeline-parallel-size", ["--pipeline-parallel-size", "1"]),
    ("vllm-pp-short", "vllm", ["-pp=1"], "--pipeline-parallel-size", ["-pp=1"]),
    ("sglang-tp-long", "sglang", ["--tensor-parallel-size", "4"], "--tensor-parallel-size", ["--tensor-parallel-size", "4"]),
    ("sglang-tp", "sglang", ["--tp", "4"], "--tensor-parallel-size", ["--tp", "4"]),
    ("sglang-tp-size", "sglang", ["--tp-size=4"], "--tensor-parallel-size", ["--tp-size=4"]),
]


@pytest.mark.parametrize("engine, args, ours, tail", [o[1:] for o in OVERRIDES], ids=[o[0] for o in OVERRIDES])
def test_user_parallelism_replaces_ours(engine, args, ours, tail):
    got = run(member(engine, 0, engine_args=args)).argv
    assert ours not in got[: len(got) - len(tail)], got
    assert got[-len(tail) :] == tail


def test_overriding_tp_keeps_pp():
    got = run(member("vllm", 1, engine_args=["-tp", "8"])).argv
    assert got[3:5] == ["--pipeline-parallel-size", "2"] and "--tensor-parallel-size" not in got


REFUSED_ARGS = [
    ("vllm-port", "vllm", ["--port", "9000"], "--port"),
    ("vllm-host-equals", "vllm", ["--host=0.0.0.0"], "--host"),
    ("vllm-headless", "vllm", ["--headless"], "--headless"),
    ("vllm-node-rank", "vllm", ["--node_rank", "0"], "--node-rank"),
    ("vllm-master-port", "vllm", ["--master-port", "1"], "--master-port"),
    ("vllm-backend", "vllm", ["--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
    ("sglang-dist-init-addr", "sglang", ["--dist-init-addr", "x:1"], "--dist-init-addr"),
    ("sglang-nnodes", "sglang", ["--nnodes=4"], "--nnodes"),
    ("sim-rank", "sim", ["--rank", "1"], "--rank"),
    ("sim-model", "sim", ["--model", "other"], "--model"),
]


@pytest.mark.parametrize("engine, args, flag", [r[1:] for r in REFUSED_ARGS], ids=[r[0] for r in REFUSED_ARGS])
def test_placement_flags_in_engine_args_are_refused(engine, args, flag):
    with pytest.raises(AdapterError) as e:
        run(member(engine, 0, engine_args=args))
    assert f"{engine}: engine_args may not set {flag}" in str(e.value)


# Every spelling vLLM's argparse reads as a flag llmgw owns (aliases from
# vllm/engine/arg_utils.py and vllm/entrypoints/openai/cli_args.py), what the
# error names, and a word of why.
PLACED = "from the replica's placement"
DP = "data parallelism in llmgw is a deployment's replicas"
VLLM_REFUSED = [
    ("nnodes-short", ["-n", "2"], "-n (--nnodes)", PLACED),
    ("nnodes-short-attached", ["-n2"], "-n2 (--nnodes)", PLACED),
    ("nnodes-short-equals", ["-n=2"], "-n (--nnodes)", PLACED),
    ("nnodes-prefix", ["--nnode", "2"], "--nnode (--nnodes)", PLACED),
    ("node-rank-short", ["-r", "1"], "-r (--node-rank)", PLACED),
    ("node-rank-short-attached", ["-r1"], "-r1 (--node-rank)", PLACED),
    ("node-rank-prefix", ["--node-r=1"], "--node-r (--node-rank)", PLACED),
    ("uds", ["--uds", "/tmp/v.sock"], "--uds", PLACED),
    ("dp-size", ["--data-parallel-size", "2"], "--data-parallel-size", DP),
    ("dp-size-short", ["-dp", "2"], "-dp (--data-parallel-*)", DP),
    ("dp-rank-short", ["-dpn=1"], "-dpn (--data-parallel-*)", DP),
    ("dp-address-underscore", ["--data_parallel_address", "10.0.0.9"], "--data-parallel-address", DP),
    ("dp-rpc-port-short", ["-dpp", "13345"], "-dpp (--data-parallel-*)", DP),
    ("dp-hybrid-lb-short", ["-dph"], "-dph (--data-parallel-*)", DP),
    ("dp-unknown-future", ["--data-parallel-something-new", "1"], "--data-parallel-something-new", DP),
    ("dp-prefix", ["--data-parallel", "2"], "--data-parallel (--data-parallel-*)", DP),
    ("api-server-count", ["--api-server-count", "0"], "--api-server-count", "0 would serve no HTTP at all"),
    ("api-server-count-short", ["-asc", "4"], "-asc (--api-server-count)", "exactly one API server"),
    ("api-server-count-prefix", ["-as", "4"], "-as (--api-server-count)", "exactly one API server"),
    ("headless", ["--headless"], "--headless", PLACED),
    ("config", ["--config", "serve.yaml"], "--config", "a vLLM config file can set any flag"),
    ("config-equals", ["--config=serve.yaml"], "--config", "put its options in engine_args"),
]


@pytest.mark.parametrize("args, shown, why", [r[1:] for r in VLLM_REFUSED], ids=[r[0] for r in VLLM_REFUSED])
@pytest.mark.parametrize("rank", [0, 1])
def test_vllm_refuses_every_spelling_of_what_llmgw_owns(args, shown, why, rank):
    with pytest.raises(AdapterError) as e:
        run(member("vllm", rank, engine_args=["--max-model-len", "8192", *args]))
    message = str(e.value)
    assert message.startswith(f"vllm: engine_args may not set {shown}: "), message
    assert why in message


# Look-alikes that are other vLLM flags (or values) and must pass through.
VLLM_ALLOWED = [
    ("config-format", ["--config-format", "auto"]),
    ("compilation-level", ["-O3"]),
    ("expert-parallel", ["--enable-expert-parallel"]),
    ("expert-parallel-short", ["-ep"]),
    ("context-parallel-short", ["-dcp", "2"]),
    ("served-name", ["--served-model-name", "chat"]),
    ("negative-value", ["--max-num-seqs", "-1"]),
]


@pytest.mark.parametrize("args", [a[1] for a in VLLM_ALLOWED], ids=[a[0] for a in VLLM_ALLOWED])
def test_vllm_passes_look_alikes_through(args):
    assert run(member("vllm", 0, engine_args=args)).argv[-len(args) :] == args


def test_vllm_names_every_refused_flag_once_grouped_by_reason():
    args = ["-n", "2", "--port", "9", "-dp", "2", "--config", "x.yaml", "-n", "2"]
    with pytest.raises(AdapterError) as e:
        run(member("vllm", 0, engine_args=args))
    assert str(e.value).split("; ") == [
        "vllm: engine_args may not set -n (--nnodes), --port: llmgw sets them from the replica's placement (ranks, addresses, ports)",
        (
            "engine_args may not set -dp (--data-parallel-*): data parallelism in llmgw is a deployment's replicas "
            "(scale with `replicas`), and vLLM's own would start engines and open ports the scheduler never placed"
        ),
        (
            "engine_args may not set --config: a vLLM config file can set any flag, including those llmgw sets, "
            "out of this check's sight, so put its options in engine_args instead"
        ),
    ]


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{"fabric": None, "hcas": []}, {"fabric": None, "hcas": ["mlx5_0"]}, {"fabric": "ib-a", "hcas": []}],
    ids=["no-fabric", "hcas-without-fabric", "fabric-without-hcas"],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_no_fabric_no_nccl_ib_hca(engine, kw):
    env = run(member(engine, 0, **kw)).env
    assert "NCCL_IB_HCA" not in env
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"


def test_deployment_env_goes_on_top():
    env = run(member("vllm", 1, env={"NCCL_IB_HCA": "=mlx5_2", "NCCL_DEBUG": "INFO", "VLLM_HOST_IP": "192.168.0.2"})).env
    assert env["NCCL_IB_HCA"] == "=mlx5_2"
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["VLLM_HOST_IP"] == "192.168.0.2"
    assert env["SGLANG_HOST_IP"] == "10.0.0.142"


@pytest.mark.parametrize("var", ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"])
def test_deployment_env_may_not_move_the_gpus(var):
    with pytest.raises(AdapterError) as e:
        run(member("sglang", 0, env={var: "0"}))
    assert f"may not set {var}" in str(e.value) and "4,5,6,7" in str(e.value)


def test_mgmt_interface_and_address_come_from_the_node():
    got = build(member("vllm", 0), mgmt_addr="192.168.7.1", mgmt_interface="ens1f0np0", python=PY)
    assert got.env["NCCL_SOCKET_IFNAME"] == "=ens1f0np0" and got.env["GLOO_SOCKET_IFNAME"] == "ens1f0np0"
    assert got.env["VLLM_HOST_IP"] == got.env["SGLANG_HOST_IP"] == "192.168.7.1"
    assert got.argv[got.argv.index("--host") + 1] == "192.168.7.1"


# --------------------------------------------------------------------------
# Shapes other than the 2-node golden
# --------------------------------------------------------------------------

SINGLE = [
    (
        "vllm",
        ["vllm", "serve", MODEL, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
         "--distributed-executor-backend", "mp", "--host", "10.0.0.141", "--port", "8100"],
    ),
    (
        "sglang",
        [PY, "-m", "sglang.launch_server", "--model-path", MODEL, "--tensor-parallel-size", "2",
         "--host", "10.0.0.141", "--port", "8100"],
    ),
    (
        "sim",
        [PY, "-m", "llmgw.services", "engine", "sim", "--model", MODEL, "--nnodes", "1", "--rank", "0",
         "--leader-addr", "", "--rendezvous-port", "0", "--host", "10.0.0.141", "--port", "8100"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("engine, argv", SINGLE, ids=[s[0] for s in SINGLE])
def test_single_node_replica_has_no_multinode_flags(engine, argv):
    cmd = member(engine, 0, nnodes=1, leader_addr="", rendezvous_port=0, gpus=[0, 1], engine_args=[], fabric=None, hcas=[])
    got = run(cmd)
    assert got.argv == argv
    assert got.serves_http is True
    assert got.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_sim_runs_without_gpus():
    got = run(member("sim", 0, gpus=[]))
    assert got.env["CUDA_VISIBLE_DEVICES"] == ""


def test_sglang_brackets_an_ipv6_leader():
    got = run(member("sglang", 1, leader_addr="fd00::141"))
    assert got.argv[got.argv.index("--dist-init-addr") + 1] == "[fd00::141]:29500"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_only_rank_zero_serves_http(engine, nnodes):
    for rank in range(nnodes):
        got = run(member(engine, rank, nnodes=nnodes), rank=min(rank, 1))
        assert got.serves_http is (rank == 0)
        if engine == "vllm":
            assert ("--headless" in got.argv) is (rank > 0) and ("--port" in got.argv) is (rank == 0)


INVALID = [
    ("unknown-engine", dict(engine="trtllm"), "unknown engine 'trtllm': this agent knows sglang, sim, vllm"),
    ("rank-out-of-range", dict(rank=2), "rank 2 is outside 0..1"),
    ("negative-rank", dict(rank=-1), "rank -1 is outside 0..1"),
    ("zero-nodes", dict(nnodes=0), "nnodes must be at least 1"),
    ("no-leader-addr", dict(leader_addr=""), "needs leader_addr"),
    ("no-rendezvous-port", dict(rendezvous_port=0), "rendezvous_port 0 is not a port"),
    ("leader-without-http-port", dict(http_port=0), "the leader's http_port 0 is not a port"),
    ("no-gpus-for-a-real-engine", dict(gpus=[]), "engine vllm needs at least one GPU"),
    ("repeated-gpu", dict(gpus=[1, 1]), "GPU indices [1, 1] repeat"),
    ("no-model", dict(model=""), "no model given"),
]


@pytest.mark.parametrize("kw, expected", [i[1:] for i in INVALID], ids=[i[0] for i in INVALID])
def test_commands_that_cannot_run_are_refused(kw, expected):
    with pytest.raises(AdapterError) as e:
        build(member(**{"engine": "vllm", "rank": 0, **kw}), mgmt_addr="10.0.0.141", mgmt_interface="eth0", python=PY)
    assert expected in str(e.value)


@pytest.mark.parametrize("addr, ifname", [("", "eth0"), ("10.0.0.141", "")], ids=["no-mgmt-addr", "no-mgmt-interface"])
def test_node_facts_are_required(addr, ifname):
    with pytest.raises(AdapterError, match="mgmt_addr and mgmt_interface"):
        build(member("sim", 0), mgmt_addr=addr, mgmt_interface=ifname, python=PY)


def test_adapter_error_is_a_config_error():
    assert issubclass(AdapterError, ConfigError)
