"""Engines pointed at the weights the agent staged: the model directory in the
engine's own flag, the served name kept, and the sim told whether they were cached."""

from __future__ import annotations

import pytest

from llmgw.services.agent.adapters import AdapterError, Weights, build
from llmgw.shared.schemas import LaunchCommand

PY = "/opt/llmgw/bin/python"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CACHED = "/var/lib/llmgw-agent/model-cache/entries/3f2a"


def member(engine: str, engine_args: list[str] | None = None) -> LaunchCommand:
    return LaunchCommand(
        replica_id="chat-7f3a", generation=1, deployment="chat", model=MODEL, engine=engine, nnodes=1, rank=0,
        leader_addr="", rendezvous_port=0, http_port=8100, gpus=[0], engine_args=engine_args or [],
        weights_path="/srv/models/llama-8b",
    )  # fmt: skip


def argv(cmd: LaunchCommand, weights: Weights | None) -> list[str]:
    return build(cmd, mgmt_addr="10.0.0.141", mgmt_interface="eth0", python=PY, weights=weights).argv


CASES = [
    ("vllm serves the directory under the model's name", "vllm", [], True, ["vllm", "serve", CACHED, "--served-model-name", MODEL]),
    ("vllm keeps a served name the deployment gives", "vllm", ["--served-model-name", "chat"], True, ["vllm", "serve", CACHED, "--tensor-parallel-size"]),
    ("sglang reads the directory", "sglang", [], False, [PY, "-m", "sglang.launch_server", "--model-path", CACHED, "--served-model-name", MODEL]),
]


@pytest.mark.parametrize(("engine", "args", "cached", "head"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_real_engines_read_the_staged_directory(engine, args, cached, head):
    got = argv(member(engine, args), Weights(CACHED, cached=cached))
    assert got[: len(head)] == head
    assert got.count("--served-model-name") == 1


def test_the_sim_is_told_where_and_whether_cached_before_the_deployments_args():
    tail = ["--load-time", "30s", "--cached-load-time", "1s"]
    hit = argv(member("sim", tail), Weights(CACHED, cached=True))
    assert hit[-7:] == ["--weights", CACHED, "--weights-cached", *tail]
    miss = argv(member("sim", tail), Weights(CACHED, cached=False))
    assert miss[-6:] == ["--weights", CACHED, *tail] and "--weights-cached" not in miss
    assert "--weights" not in argv(member("sim", tail), None)


@pytest.mark.parametrize("flag", ["--weights", "--weights-cached"])
def test_a_deployment_may_not_claim_the_agents_weights_flags(flag):
    with pytest.raises(AdapterError, match=flag):
        argv(member("sim", [flag, "/elsewhere"] if flag == "--weights" else [flag]), None)
