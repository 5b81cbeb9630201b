"""The simulated engine's rendezvous: how ranks find the leader and notice a lost peer.

It stands in for torch.distributed's TCPStore plus the NCCL links: the leader
listens on ``leader-addr:rendezvous-port``, each worker connects, says hello
with its rank, and the connection stays open for the life of the group. Both
ends ping every ``PING_INTERVAL`` and call the peer lost on EOF, on a reset,
or after ``PEER_TIMEOUT`` of silence (a frozen or partitioned machine sends
no FIN).

Wire format: one JSON object per line.
    worker -> leader  {"op": "hello", "proto": 1, "rank": R, "nnodes": N, "model": M}
    leader -> worker  {"op": "welcome"} | {"op": "reject", "reason": "..."}
    leader -> worker  {"op": "formed"}          once every rank has joined
    both ways         {"op": "ping"}
    leader -> worker  {"op": "step", "n": N}  a decode step of the whole batch
    worker -> leader  {"op": "ack", "n": N}   this rank has done step N
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
from collections.abc import Callable

from llmgw.shared.errors import LlmgwError

from .binding import explain_bind_error, reserve

PROTO = 1
PING_INTERVAL = 0.4
PEER_TIMEOUT = 1.6
# The longest pause between a worker's tries to reach its leader's rendezvous.
RETRY_MAX = 0.25
# A step held this long by a worker that has not acked is worth a log line.
STEP_NOTICE = 1.0
HELLO_TIMEOUT = 5.0
MAX_LINE = 4096


class RendezvousError(LlmgwError):
    """A worker could not join its leader's group."""

    code = "rendezvous"


class ProtocolError(Exception):
    """A peer sent something that is not this protocol."""


def _encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


async def _read_msg(reader: asyncio.StreamReader) -> dict | None:
    """The next message, or None at EOF."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's "separator not found, limit exceeded"
        raise ProtocolError(f"line longer than {MAX_LINE} bytes") from None
    if not line:
        return None
    if not line.endswith(b"\n"):
        return None  # EOF in the middle of a line: the peer is gone
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError(f"not a JSON line: {line[:60]!r}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"not a message: {line[:60]!r}")
    return msg


class Link:
    """One open rank-to-rank connection, kept alive by pings."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, peer_timeout: float = PEER_TIMEOUT):
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.peer_timeout = peer_timeout
        self.ping_interval = min(PING_INTERVAL, peer_timeout / 4)

    def send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(_encode(msg))

    async def watch(self, on_message: Callable[[dict], None] = lambda m: None) -> str:
        """Run until the peer is lost; returns why, in words."""
        pinger = asyncio.create_task(self._ping())
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(_read_msg(self.reader), self.peer_timeout)
                except TimeoutError:
                    return f"no word from {self.peer} for {self.peer_timeout:g}s"
                except ProtocolError as e:
                    return f"{self.peer} broke protocol: {e}"
                except OSError as e:
                    return f"connection to {self.peer} failed: {e.strerror or e}"
                if msg is None:
                    return f"{self.peer} closed the connection"
                if msg["op"] != "ping":
                    on_message(msg)
        finally:
            pinger.cancel()
            self.close()

    async def _ping(self) -> None:
        with contextlib.suppress(OSError):
            while not self.writer.is_closing():
                self.send({"op": "ping"})
                await self.writer.drain()
                await asyncio.sleep(self.ping_interval)

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.close()


class Leader:
    """Rank 0's side: admits ranks 1..nnodes-1 once each, then watches them.

    ``formed`` is set when every worker has joined. A worker that leaves
    before then simply frees its rank (the rendezvous keeps waiting); one lost
    after the group formed calls ``on_peer_lost`` - the group is broken for
    good, like a NCCL communicator.
    """

    def __init__(
        self,
        addr: str,
        port: int,
        nnodes: int,
        model: str,
        on_peer_lost: Callable[[int, str], None],
        log: logging.Logger,
        peer_timeout: float = PEER_TIMEOUT,
    ):
        self.addr, self.port, self.nnodes, self.model = addr, port, nnodes, model
        self.on_peer_lost = on_peer_lost
        self.log = log
        self.peer_timeout = peer_timeout
        # The step in progress: its number and, per worker rank, its ack.
        self._step = 0
        self._acks: dict[int, asyncio.Future] = {}
        self.members: dict[int, Link] = {}
        self.formed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    @property
    def workers(self) -> int:
        return self.nnodes - 1

    async def start(self) -> None:
        sock = reserve("rendezvous", self.addr, self.port)
        try:
            self._server = await asyncio.start_server(self._accept, sock=sock, limit=MAX_LINE)
        except OSError as e:
            sock.close()
            raise explain_bind_error("rendezvous", self.addr, self.port, e) from None
        self.log.info("rendezvous listening on %s:%d; waiting for workers 0/%d", self.addr, self.port, self.workers)
        if self.workers == 0:
            self.formed.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # asyncio.start_server runs each connection's handler as a task
        self._tasks.add(task)
        try:
            await self._serve_member(reader, writer)
        except asyncio.CancelledError:
            # Cancelled by close(). Swallowed: on 3.11 asyncio's streams log a
            # cancelled connection task as an error.
            writer.close()
        finally:
            self._tasks.discard(task)

    async def _serve_member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername") or ("?", 0)
        _nodelay(writer)  # a step message must not sit in Nagle's buffer
        link = Link(reader, writer, f"{peername[0]}:{peername[1]}", self.peer_timeout)
        try:
            hello = await asyncio.wait_for(_read_msg(reader), HELLO_TIMEOUT)
            rank = self._admit(hello)
        except (TimeoutError, ProtocolError, OSError) as e:
            self.log.warning("rendezvous: dropped a connection from %s: %s", link.peer, e or "no hello in time")
            link.close()
            return
        except _Rejected as e:
            self.log.warning("rendezvous: refused %s: %s", link.peer, e)
            link.send({"op": "reject", "reason": str(e)})
            with contextlib.suppress(OSError):
                await writer.drain()
            link.close()
            return

        link.peer = str(peername[0])
        self.members[rank] = link
        link.send({"op": "welcome"})
        self.log.info("rank %d joined from %s; workers joined %d/%d", rank, peername[0], len(self.members), self.workers)
        if len(self.members) == self.workers:
            self.log.info("all %d ranks joined", self.nnodes)
            self.formed.set()
            for member in self.members.values():
                member.send({"op": "formed"})

        def on_message(msg: dict) -> None:
            if msg["op"] == "ack" and msg.get("n") == self._step:
                ack = self._acks.get(rank)
                if ack is not None and not ack.done():
                    ack.set_result(None)

        why = await link.watch(on_message)
        if self.members.get(rank) is link:
            del self.members[rank]
        if self._closing:
            return
        if self.formed.is_set():
            self.on_peer_lost(rank, why)
        else:
            self.log.warning("rank %d left the rendezvous (%s); workers joined %d/%d", rank, why, len(self.members), self.workers)

    def _admit(self, hello: dict | None) -> int:
        if hello is None:
            raise ProtocolError("closed before saying hello")
        if hello.get("op") != "hello" or hello.get("proto") != PROTO:
            raise _Rejected(f"expected a hello of protocol {PROTO}, got {hello!r:.120}")
        rank, nnodes, model = hello.get("rank"), hello.get("nnodes"), hello.get("model")
        if nnodes != self.nnodes:
            raise _Rejected(f"group size mismatch: leader has --nnodes {self.nnodes}, worker says {nnodes}")
        if type(rank) is not int or not 1 <= rank < self.nnodes:
            raise _Rejected(f"rank {rank!r} is not a worker rank of a {self.nnodes}-node group (1..{self.nnodes - 1})")
        if model != self.model:
            raise _Rejected(f"model mismatch: leader serves {self.model!r}, worker has {model!r}")
        if self.formed.is_set():
            raise _Rejected("the group has already formed; a rank cannot rejoin a running group")
        if rank in self.members:
            raise _Rejected(f"rank {rank} has already joined")
        return rank

    async def collective(self) -> None:
        """One decode step across the group: done when every worker has acked it.

        Never times out and never declares anyone lost: a rank that does not
        answer holds the step (and every request) until it answers, or until
        its link is lost - which ``watch`` notices on its own.
        """
        if self.workers == 0:
            return
        self._step += 1
        n = self._step
        loop = asyncio.get_running_loop()
        self._acks = {}
        for rank, link in list(self.members.items()):
            self._acks[rank] = loop.create_future()
            link.send({"op": "step", "n": n})
        # A rank already gone has no ack to give: the step waits for ever, as
        # a collective with a dead rank does (the core gates on a broken group
        # before it gets here, so this is only the step the loss interrupted).
        waits = set(self._acks.values()) or {loop.create_future()}
        if len(self._acks) < self.workers:
            waits.add(loop.create_future())
        _, pending = await asyncio.wait(waits, timeout=STEP_NOTICE)
        if pending:
            slow = sorted(r for r, f in self._acks.items() if not f.done())
            self.log.info(
                "step %d has waited %gs for rank(s) %s to ack; a collective does not time out, still waiting",
                n, STEP_NOTICE, ",".join(map(str, slow)) or "(gone)",
            )  # fmt: skip
            await asyncio.wait(pending)
            self.log.info("step %d completed; generation goes on", n)

    async def close(self) -> None:
        self._closing = True  # links dropped from here on are ours to drop, not lost peers
        if self._server is not None:
            self._server.close()
        for link in list(self.members.values()):
            link.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


class _Rejected(Exception):
    pass


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def join(
    leader_addr: str,
    port: int,
    *,
    rank: int,
    nnodes: int,
    model: str,
    source_addr: str | None,
    give_up_after: float,
    log: logging.Logger,
    peer_timeout: float = PEER_TIMEOUT,
) -> Link:
    """Connect to the leader (retrying while it is not up yet) and join as ``rank``.

    ``source_addr`` pins the local end of the link to this node's address, as
    NCCL_SOCKET_IFNAME does for the real engines.
    """
    deadline = time.monotonic() + give_up_after
    delay = 0.1
    told = False
    local = (source_addr, 0) if source_addr else None
    while True:
        try:
            reader, writer = await asyncio.open_connection(leader_addr, port, local_addr=local, limit=MAX_LINE)
            break
        except OSError as e:
            if local and e.errno == errno.EADDRNOTAVAIL:
                raise RendezvousError(f"cannot connect from {source_addr}: not an address of this machine") from None
            if time.monotonic() >= deadline:
                raise RendezvousError(f"leader rendezvous {leader_addr}:{port} not reachable after {give_up_after:g}s: {e.strerror or e}") from None
            if not told:
                log.info("waiting for the leader's rendezvous at %s:%d (%s)", leader_addr, port, e.strerror or e)
                told = True
            await asyncio.sleep(delay)
            # A refused connect to a local leader costs next to nothing; waiting a second
            # after it listens delays the group's start (a restart in place's whole margin).
            delay = min(delay * 2, RETRY_MAX)

    _nodelay(writer)
    link = Link(reader, writer, f"leader {leader_addr}:{port}", peer_timeout)
    link.send({"op": "hello", "proto": PROTO, "rank": rank, "nnodes": nnodes, "model": model})
    try:
        reply = await asyncio.wait_for(_read_msg(reader), HELLO_TIMEOUT)
    except (TimeoutError, ProtocolError, OSError) as e:
        link.close()
        raise RendezvousError(f"leader at {leader_addr}:{port} did not answer the hello: {e or 'timed out'}") from None
    if reply is None:
        link.close()
        raise RendezvousError(f"leader at {leader_addr}:{port} closed the connection during the hello")
    if reply.get("op") == "reject":
        link.close()
        raise RendezvousError(f"leader refused rank {rank}: {reply.get('reason')}")
    if reply.get("op") != "welcome":
        link.close()
        raise RendezvousError(f"leader at {leader_addr}:{port} answered {reply!r:.120} instead of welcome")
    return link
