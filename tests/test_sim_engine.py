"""``llmgw engine sim`` as real processes on two loopback "nodes".

The leader runs on 127.0.1.1 and workers on 127.0.1.2/.3 (Linux routes all of
127/8 to lo), so "the worker listens on nothing" is checked against the
kernel's socket table for the worker's own address, not inferred from code.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from llmgw.shared.natsserver import free_port
from llmgw.shared.procnet import listening_sockets

from .waiting import eventually_sync

pytestmark = pytest.mark.timeout(60)

LEADER = "127.0.1.1"
WORKER = "127.0.1.2"
WORKER2 = "127.0.1.3"
MODEL = "org/sim-7b"
SERVED = "sim-7b"
EXIT_PEER_LOST = 3  # services/engines/sim.py


def wait_until(predicate, what: str, timeout: float = 15.0, interval: float = 0.02):
    """Until ``predicate()`` is truthy; fail naming ``what`` and the last value seen."""
    return eventually_sync(predicate, what=what, timeout=timeout, interval=interval)


class Engine:
    """One ``llmgw engine sim`` process, its output captured to a file."""

    def __init__(self, log_path, argv: list[str]):
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw.services", "engine", "sim", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 15.0) -> None:
        def seen():
            if text in self.log():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode} before logging {text!r}:\n{self.log()}")
            return False

        wait_until(seen, f"{text!r} in the engine log", timeout)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def exit_code(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine still running {timeout:g}s later:\n{self.log()}") from None


@pytest.fixture
def engines(tmp_path):
    """Start engines; every one is SIGKILLed and reaped at the end, pass or fail."""
    started: list[Engine] = []

    def start(name: str, *argv: str) -> Engine:
        engine = Engine(tmp_path / f"{name}.log", list(argv))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.signal(signal.SIGKILL)
        engine.proc.wait(10)


def sim_args(rank: int, nnodes: int, rdv_port: int, host: str, *extra: str, http_port: int | None = None) -> list[str]:
    argv = [
        "--model", MODEL, "--served-model-name", SERVED, "--nnodes", str(nnodes), "--rank", str(rank),
        "--leader-addr", LEADER, "--rendezvous-port", str(rdv_port), "--host", host,
    ]  # fmt: skip
    if http_port is not None:
        argv += ["--port", str(http_port)]
    return argv + list(extra)


class ListenWatch(threading.Thread):
    """Samples the kernel's LISTEN sockets over the whole test."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: set[tuple[str, int]] = set()
        self.samples = 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.seen |= listening_sockets()
            self.samples += 1
            time.sleep(0.01)

    def stop(self):
        self._halt.set()
        self.join(5)


def fetch(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_group_forms_serves_openai_and_stalls_when_a_worker_dies(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    base = f"http://{LEADER}:{port}"
    watch = ListenWatch()
    watch.start()
    try:
        leader = engines("leader", *sim_args(0, 2, rdv, LEADER, "--load-time", "300ms", "--token-rate", "50", http_port=port))
        wait_until(lambda: (LEADER, rdv) in listening_sockets(), "the leader's rendezvous listener")
        leader.wait_log("waiting for workers 0/1")
        assert (LEADER, port) not in listening_sockets(), "the leader listens for HTTP before its worker joined"

        worker = engines("worker", *sim_args(1, 2, rdv, WORKER))
        wait_until(lambda: (LEADER, port) in listening_sockets(), "the leader's HTTP listener")
        leader.wait_log("serving")
        assert "rank 1 joined from 127.0.1.2" in leader.log()  # the link comes from the worker's address

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=10)
        assert [m.id for m in client.models.list()] == [SERVED]

        messages = [{"role": "user", "content": "Which fabric holds the replica?"}]
        chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12)
        text = chat.choices[0].message.content
        assert chat.object == "chat.completion" and chat.model == SERVED
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens == len(text.split()) <= 12
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

        stream = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text  # tokens depend only on the prompt
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [chat.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

        done = client.completions.create(model=SERVED, prompt="GPUs on one fabric", max_tokens=5)
        assert done.object == "text_completion" and 0 < done.usage.completion_tokens <= 5
        assert len(done.choices[0].text.split()) == done.usage.completion_tokens
        pieces = list(client.completions.create(model=SERVED, prompt="GPUs on one fabric", max_tokens=5, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text

        status, raw = fetch("GET", f"{base}/metrics")
        assert status == 200
        metrics = raw.decode()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_total"):
            assert name in metrics, name
        assert metric(metrics, "vllm:generation_tokens_total") >= 2 * chat.usage.completion_tokens + 2 * done.usage.completion_tokens

        # Bad bodies are OpenAI errors, never a crash.
        for path, body, status_, code in (
            ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
            ("/v1/chat/completions", b"\xff\xfe", 400, "invalid_json"),
            ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
            ("/v1/chat/completions", json.dumps({"model": SERVED}).encode(), 400, "missing_field"),
            ("/v1/chat/completions", json.dumps({"messages": [{"content": "no role"}]}).encode(), 400, "invalid_value"),
            ("/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": "lots"}).encode(), 400, "invalid_value"),
            ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}).encode(), 404, "model_not_found"),
            ("/v1/completions", json.dumps({"model": SERVED}).encode(), 400, "missing_field"),
            ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), 400, "invalid_value"),
        ):
            got, raw = fetch("POST", base + path, body)
            assert got == status_, (path, body, raw)
            error = json.loads(raw)["error"]
            assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"], error
        assert fetch("GET", f"{base}/health")[0] == 200

        # A stream in flight when the worker dies stops mid-answer.
        conn = http.client.HTTPConnection(LEADER, port, timeout=1.0)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: {")
        worker.signal(signal.SIGKILL)
        leader.wait_log("rank 1 lost")
        with pytest.raises(TimeoutError):
            while line := resp.readline():
                assert line.strip() != b"data: [DONE]", "the stream finished although its group lost a rank"
        conn.close()

        # A new request hangs too, while /health keeps answering (as vLLM's does).
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).chat.completions.create(model=SERVED, messages=messages)
        assert fetch("GET", f"{base}/health")[0] == 200
        assert metric(fetch("GET", f"{base}/metrics")[1].decode(), "vllm:num_requests_running") >= 1
        assert leader.proc.poll() is None

        leader.signal(signal.SIGTERM)
        assert leader.exit_code() == 0
    finally:
        watch.stop()
    assert watch.samples >= 10
    assert (LEADER, port) in watch.seen  # the watch does see listeners
    assert not {s for s in watch.seen if s[0] == WORKER}, "something listened on the worker's address"


def test_exit_mode_leader_exits_when_a_worker_dies_and_refuses_late_joiners(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    leader = engines("leader", *sim_args(0, 2, rdv, LEADER, "--load-time", "0", "--on-peer-loss", "exit", http_port=port))
    worker = engines("worker", *sim_args(1, 2, rdv, WORKER))
    leader.wait_log("serving")

    late = engines("late", *sim_args(1, 2, rdv, WORKER2))
    assert late.exit_code() == 2
    assert "already formed" in late.log()

    worker.signal(signal.SIGKILL)
    assert leader.exit_code() == EXIT_PEER_LOST
    assert "rank 1 lost" in leader.log()


def test_a_frozen_worker_is_noticed_by_keepalive(engines):
    # A stopped process keeps its sockets open: no FIN, no reset, only silence -
    # what a hung or partitioned machine looks like to its peers.
    rdv, port = free_port(LEADER), free_port(LEADER)
    leader = engines("leader", *sim_args(0, 2, rdv, LEADER, "--load-time", "0", "--on-peer-loss", "exit", http_port=port))
    worker = engines("worker", *sim_args(1, 2, rdv, WORKER))
    leader.wait_log("serving")
    worker.signal(signal.SIGSTOP)
    assert leader.exit_code() == EXIT_PEER_LOST
    assert "rank 1 lost (no word from 127.0.1.2" in leader.log()


def test_workers_that_lose_their_leader_exit_or_idle_as_told(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    leader = engines("leader", *sim_args(0, 3, rdv, LEADER, "--load-time", "0", http_port=port))
    quitter = engines("quitter", *sim_args(1, 3, rdv, WORKER, "--on-peer-loss", "exit"))
    stayer = engines("stayer", *sim_args(2, 3, rdv, WORKER2))
    leader.wait_log("all 3 ranks joined")

    leader.signal(signal.SIGKILL)
    assert quitter.exit_code() == EXIT_PEER_LOST
    stayer.wait_log("lost the leader")
    assert stayer.proc.poll() is None
    stayer.signal(signal.SIGTERM)
    assert stayer.exit_code() == 0


def test_ignore_sigterm_survives_sigterm(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    engine = engines("leader", *sim_args(0, 1, rdv, LEADER, "--load-time", "0", "--ignore-sigterm", http_port=port))
    engine.wait_log("serving")
    engine.signal(signal.SIGTERM)
    # An ignored signal is dropped when sent; a pending one would be acted on
    # before the process answers another request. So an answer proves survival.
    assert fetch("GET", f"http://{LEADER}:{port}/health")[0] == 200
    assert engine.proc.poll() is None
    engine.signal(signal.SIGKILL)
    assert engine.exit_code() == -signal.SIGKILL


def test_address_in_use_and_bad_arguments_fail_with_one_line(engines):
    rdv, port = free_port(LEADER), free_port(LEADER)
    with socket.socket() as taken:
        taken.bind((LEADER, port))
        taken.listen()
        engine = engines("busy-http", *sim_args(0, 1, rdv, LEADER, http_port=port))
        assert engine.exit_code() == 2
        engine_rdv = engines("busy-rdv", *sim_args(0, 2, port, LEADER, http_port=rdv))
        assert engine_rdv.exit_code() == 2
    assert engine.log().strip().splitlines() == [f"llmgw: error: cannot bind HTTP {LEADER}:{port}: address already in use (another engine on this port?)"]
    assert engine_rdv.log().strip().splitlines() == [
        f"llmgw: error: cannot bind rendezvous {LEADER}:{port}: address already in use (another engine on this port?)"
    ]

    for i, (bad, words) in enumerate(
        (
            (sim_args(2, 2, rdv, LEADER, http_port=port), "--rank must be between 0 and 1"),
            (sim_args(0, 2, rdv, LEADER), "needs --port"),
            (sim_args(0, 2, rdv, LEADER, "--load-time", "soon", http_port=port), "--load-time: 'soon' is not a duration"),
        )
    ):
        engine = engines(f"bad{i}", *bad)
        assert engine.exit_code() == 2
        lines = engine.log().strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines
