"""The sim engine's decode step is a collective across all ranks (real processes).

As with NCCL, a worker that stops answering (SIGSTOP, or SIGUSR1's silent
stall) holds the leader's generation for as long as it does not answer, without
anyone being called lost; SIGCONT lets it finish. SIGUSR1 to the leader stalls
generation silently while ``/health`` answers 200; SIGUSR2 resumes it.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time

import pytest

from llmgw.shared.natsserver import free_port

from .test_sim_engine import LEADER, SERVED, WORKER, engines, fetch, metric, sim_args, wait_until  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)

# Long enough that a worker stopped for the length of the test is slow, not lost.
LONG_PEER_TIMEOUT = ("--peer-timeout", "60s")


class Stream(threading.Thread):
    """A streamed completion read in the background; ``tokens`` counts the token chunks seen."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection(LEADER, port, timeout=60)
        body = {"model": SERVED, "prompt": "collective", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.tokens = 0
        self.start()

    def run(self):
        try:
            while line := self.resp.readline():
                if line.startswith(b"data: {"):
                    self.tokens += 1
        except (OSError, ValueError, AttributeError):  # closed under our feet at the end
            pass

    def close(self):
        self.conn.close()


def steps_done(port: int) -> float:
    return metric(fetch("GET", f"http://{LEADER}:{port}/metrics")[1].decode(), "vllm:generation_tokens_total")


def test_a_stopped_worker_stalls_the_leaders_generation_and_sigcont_resumes_it(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    leader = engines("leader", *sim_args(0, 2, rdv, LEADER, "--load-time", "0", "--token-rate", "100", *LONG_PEER_TIMEOUT, http_port=port))
    worker = engines("worker", *sim_args(1, 2, rdv, WORKER, *LONG_PEER_TIMEOUT))
    leader.wait_log("serving")

    s = Stream(port, max_tokens=5000)
    try:
        wait_until(lambda: s.tokens >= 5, "tokens flowing across the group")
        worker.signal(signal.SIGSTOP)
        # The step in progress waits for the stopped rank's ack: the leader says
        # so after holding it a whole second, and nothing more.
        leader.wait_log("to ack; a collective does not time out")
        before, seen = steps_done(port), s.tokens
        time.sleep(0.5)  # a window to see nothing happen in (the held step is already proven by the log)
        assert (steps_done(port), s.tokens) == (before, seen), "the leader generated tokens while a rank of its group was stopped"
        assert fetch("GET", f"http://{LEADER}:{port}/health")[0] == 200
        assert "lost" not in leader.log(), "a slow collective was taken for a lost peer"
        assert leader.proc.poll() is None

        worker.signal(signal.SIGCONT)
        got = s.tokens
        wait_until(lambda: s.tokens >= got + 5, "tokens flowing again after SIGCONT")
        leader.wait_log("completed; generation goes on")
        assert "lost" not in leader.log()
    finally:
        s.close()


def test_sigusr1_stalls_the_leader_silently_and_sigusr2_resumes_it(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    leader = engines("leader", *sim_args(0, 2, rdv, LEADER, "--load-time", "0", "--token-rate", "200", http_port=port))
    engines("worker", *sim_args(1, 2, rdv, WORKER))
    leader.wait_log("serving")
    canary = json.dumps({"model": SERVED, "prompt": "ping", "max_tokens": 1}).encode()
    status, raw = fetch("POST", f"http://{LEADER}:{port}/v1/completions", canary)
    assert status == 200 and json.loads(raw)["choices"][0]["text"]

    leader.signal(signal.SIGUSR1)
    leader.wait_log("SIGUSR1: generation stalls")
    with pytest.raises(TimeoutError):
        fetch("POST", f"http://{LEADER}:{port}/v1/completions", canary, timeout=1.0)
    assert fetch("GET", f"http://{LEADER}:{port}/health")[0] == 200
    assert not re.search(r"rank \d+ lost|lost the leader", leader.log()), "the silent stall talked about lost peers"

    leader.signal(signal.SIGUSR2)
    status, raw = fetch("POST", f"http://{LEADER}:{port}/v1/completions", canary)
    assert status == 200 and json.loads(raw)["choices"][0]["text"]
