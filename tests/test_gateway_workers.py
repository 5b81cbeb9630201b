"""``llmgw gateway --workers 2`` as a real process in front of a real ``sim``
engine, fed a replica record on a real nats-server: two worker processes hold
listening sockets on the same port (the kernel's socket table says so), both
serve, a SIGKILLed worker is replaced while the other keeps serving, and a
SIGTERM to the parent ends them all."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
import yaml

from llmgw.shared import procfs, procnet
from llmgw.shared.natsserver import free_port

from . import spawning
from .gateway_helpers import HOST, Board, metric_sum, replica, start_sims, wait_for

pytestmark = pytest.mark.timeout(90)

CHAT = {"model": "org/alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def workers_listening(parent: int, port: int) -> dict[int, int]:
    """pid -> listening socket inode, for the children of ``parent`` that listen on ``port``."""
    inodes = {lst.inode for lst in procnet.listeners() if lst.port == port}
    out = {}
    for pid in procfs.tree(parent) - {parent}:
        st = procfs.stat(pid)
        held = procfs.socket_inodes(pid) & inodes
        if st is not None and st.ppid == parent and held:
            out[pid] = held.pop()
    return out


async def chats(base: str, n: int) -> list[tuple[int, str]]:
    """``n`` requests, each on a new connection (the kernel places connections, not requests)."""
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for _ in range(n):
            async with http.post(f"{base}/v1/chat/completions", json=CHAT) as r:
                await r.read()
                out.append((r.status, r.headers.get("x-llmgw-replica", "")))
    return out


async def served(mport: int) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"http://{HOST}:{mport}/metrics") as r:
        return metric_sum(await r.text(), "llmgw_gateway_requests_total", status="200")


async def test_two_workers_one_port_restart_and_stop(nats_server, tmp_path):
    (sim,) = await start_sims(tmp_path, [("a", "org/alpha", 0.0)])
    board = await Board.open(nats_server)
    proc = None
    try:
        await board.put(replica("alpha-1", "org/alpha", sim.endpoint))
        tls = nats_server.issue("gw-workers", "gateway")
        nats_server.reload()
        port, mport = free_port(HOST), free_port(HOST)
        while mport + 1 == port or not _free(mport + 1):
            mport = free_port(HOST)
        conf = {
            "server": nats_server.url, "tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key},
            "metrics_listen": f"{HOST}:{mport}", "gateway": {"listen": f"{HOST}:{port}"},
        }  # fmt: skip
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(conf))
        argv = [sys.executable, "-m", "llmgw.services", "--log-level", "warning", "gateway", "-c", str(tmp_path / "gateway.yaml"), "--workers", "2"]
        proc = await spawning.start_logged(argv, tmp_path / "gateway.log", stdin=subprocess.DEVNULL)

        def listening():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "gateway.log").read_text())
            return workers_listening(proc.pid, port)

        # A worker listens only once its mirrors hold the records: listening means it routes.
        first = await wait_for(lambda: len(listening()) == 2 and listening(), "two worker processes listening on the port", timeout=30)
        assert proc.pid not in first and len(set(first.values())) == 2  # two sockets, one per worker, one port
        base = f"http://{HOST}:{port}"
        assert await chats(base, 24) == [(200, "alpha-1")] * 24
        # Each worker served some (its own metrics port: metrics_listen + index).
        counts = [await served(mport), await served(mport + 1)]
        assert sum(counts) == 24 and all(counts), counts

        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        # Connections the kernel queued on the dying worker's socket are reset (SO_REUSEPORT
        # moves none to another socket); once its socket is gone, the other worker takes all.
        await wait_for(lambda: first[victim] not in {lst.inode for lst in procnet.listeners()}, "the killed worker's socket gone", timeout=10)
        assert await chats(base, 8) == [(200, "alpha-1")] * 8
        again = await wait_for(lambda: len(listening()) == 2 and victim not in listening() and listening(), "the killed worker replaced", timeout=30)
        assert set(first) - {victim} <= set(again)
        assert await chats(base, 8) == [(200, "alpha-1")] * 8

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        for pid in again:
            assert procfs.stat(pid) is None, f"worker {pid} outlived its parent"
        assert not [lst for lst in procnet.listeners() if lst.port == port]
    finally:
        if proc is not None and proc.poll() is None:
            for pid in procfs.tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
        sim.kill()
        await board.close()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(
    "gateway, says",
    [
        ({"listen": f"{HOST}:99999"}, "gateway.listen: '127.0.0.1:99999' is not HOST:PORT"),
        ({"listen": f"{HOST}:0", "tls_cert": "junk.pem", "tls_key": "junk.pem"}, "are not a PEM certificate and its key"),
        ({"listen": f"{HOST}:0", "api_keys_file": "junk.pem"}, "gateway.api_keys_file: "),
    ],
    ids=["listen", "https-pair", "key-file"],
)
def test_a_bad_file_is_one_error_before_any_worker_starts(tmp_path, gateway, says):
    """The parent starts no worker with a file each would refuse: the configuration
    is checked whole when it is read, and the command ends with that one error."""
    for f in ("ca.pem", "gw.pem", "gw-key.pem"):
        (tmp_path / f).write_text("x")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    conf = {"server": "tls://127.0.0.1:4222", "tls": {"ca": "ca.pem", "cert": "gw.pem", "key": "gw-key.pem"}, "gateway": gateway}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(conf))
    argv = [sys.executable, "-m", "llmgw.services", "gateway", "-c", str(tmp_path / "gateway.yaml"), "--workers", "2"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert r.stderr.count(says) == 1 and f"{tmp_path / 'gateway.yaml'}: " in r.stderr, r.stderr
    assert "worker" not in r.stderr, r.stderr
