"""The lines the agent reads in an engine's output, held to what real engines printed.

``tests/data/vllm-0.32-cpu-*.log`` are real vLLM 0.32 (CPU build) leader logs
captured under ``llmgw up --engine vllm`` (health-check lines left out):
one where its pipeline peer's node was killed and the next request failed in
Gloo, one that served, lost its worker to a SIGKILL while idle and was
stopped. The agent must call the first peer-lost on the very line Gloo
printed, and never the second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.services.agent.supervisor import says_peer_lost

DATA = Path(__file__).parent / "data"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text(encoding="utf-8").splitlines()


def test_real_vllm_says_its_pipeline_peer_is_gone_in_gloos_words():
    hits = [line for line in lines("vllm-0.32-cpu-leader-pp1-lost.log") if says_peer_lost(line)]
    assert hits, "the line Gloo printed when the PP1 rank's node died is not matched"
    assert "pair.cc:537] Read error [127.0.0.1]:40115: Connection reset by peer" in hits[0]
    assert hits[0].startswith("(Worker_PP0 pid=27546) ERROR")


def test_a_real_vllm_leader_serving_and_stopping_says_nothing_of_a_lost_peer():
    assert [line for line in lines("vllm-0.32-cpu-leader-healthy.log") if says_peer_lost(line)] == []


@pytest.mark.parametrize(
    ("line", "lost"),
    [
        # Gloo's pair.cc, as libtorch_cpu.so spells them (strings of torch 2.13's build)
        ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Connection closed by peer [10.0.0.142]:21581", True),
        ("RuntimeError: [pair.cc:537] Read error [10.0.0.142]:21581: Connection reset by peer. This is typically caused by a remote worker", True),
        ("RuntimeError: [pair.cc:318] writev [10.0.0.142]:21581: Broken pipe", True),
        # NCCL and torch's NCCL watchdog
        ("NCCL error: remote process exited or there was a network error, NCCL version 2.21.5", True),
        ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) ran for 600081 milliseconds", True),
        # not a group's peer: an HTTP client going away, a read of a file
        ('INFO:     127.0.0.1:54892 - "POST /v1/completions HTTP/1.1" 200 OK', False),
        ("ConnectionResetError: [Errno 104] Connection reset by peer", False),
        ("pardiso_read_ooc_file: Read error", False),
        ("Read timeout [10.0.0.142]:21581", False),  # a slow peer is the canary's to judge, not a lost one
    ],
)
def test_which_lines_say_a_peer_is_lost(line, lost):
    assert says_peer_lost(line) is lost
