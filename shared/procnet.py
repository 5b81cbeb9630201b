"""What the kernel says is listening: proof of who opens a port (the agent, tests, the seed scenario).

Reading ``/proc/net/tcp{,6}`` sees every process's sockets - including ones a
test did not start and cannot ask - and never connects to anything, so looking
cannot change what is seen. Each line also carries the socket's inode, which
``/proc/<pid>/fd/*`` links name (``socket:[inode]``): that is how the agent
proves a listening port belongs to the engine it launched
(``shared/procfs.py``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from typing import NamedTuple

TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10
TCP_ESTABLISHED = "01"  # include/net/tcp_states.h: TCP_ESTABLISHED = 1


def _decode_addr(hex_addr: str) -> str:
    # The kernel prints each 32-bit word of the address as a number in host
    # byte order, so on little-endian machines every word reads reversed.
    raw = bytes.fromhex(hex_addr)
    words = struct.unpack(f">{len(raw) // 4}I", raw)  # the printed numbers
    packed = struct.pack(f"={len(words)}I", *words)  # back to the bytes in memory
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip)


class Listener(NamedTuple):
    """One TCP socket in LISTEN state: its local address and port, and its inode."""

    addr: str  # "0.0.0.0" / "::" for a wildcard; an IPv4-mapped address as IPv4
    port: int
    inode: int


WILDCARDS = frozenset({"0.0.0.0", "::"})


def listeners() -> list[Listener]:
    """Every TCP socket in LISTEN state in this network namespace, IPv4 and IPv6.

    Asked of the kernel through sock_diag netlink (what ``ss -lt`` does), which
    returns only the listeners; ``/proc/net/tcp{,6}`` is the fallback. The
    two differ in cost, not in what they say: the /proc tables list every
    connection too, and a leader with 8,000 connections made reading them
    cost 30-70 ms per look on the 2-core test machine, against well under
    1 ms for the netlink dump.
    """
    try:
        return _diag_listeners()
    except OSError:
        return _proc_listeners()


# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBxI48x")  # family, protocol, ext, pad, states, inet_diag_sockid (any)
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sIQIIIII")  # inet_diag_msg
_IPPROTO_TCP = 6


def _diag_listeners() -> list[Listener]:
    found: list[Listener] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            body = _DIAG_REQ.pack(family, _IPPROTO_TCP, 0, 1 << int(TCP_LISTEN, 16))
            nl.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0) + body)
            done = False
            while not done:
                data = nl.recv(1 << 16)
                off = 0
                while off + _NLMSG_HDR.size <= len(data):
                    length, kind, _flags, _seq, _pid = _NLMSG_HDR.unpack_from(data, off)
                    if length < _NLMSG_HDR.size:
                        raise OSError("sock_diag: malformed netlink message")
                    if kind == _NLMSG_DONE:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        err = -struct.unpack_from("=i", data, off + _NLMSG_HDR.size)[0]
                        raise OSError(err, f"sock_diag: {os.strerror(err)}")
                    if kind == _SOCK_DIAG_BY_FAMILY:
                        fam, state, *_r, sport, _dport, src, _dst, _if, _cookie, _exp, _rq, _wq, _uid, inode = _DIAG_MSG.unpack_from(
                            data, off + _NLMSG_HDR.size
                        )
                        if state == int(TCP_LISTEN, 16):
                            ip = ipaddress.ip_address(src[:4] if fam == socket.AF_INET else src)
                            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                                ip = ip.ipv4_mapped
                            found.append(Listener(str(ip), int.from_bytes(sport, "big"), inode))
                    off += (length + 3) & ~3
                if not data:
                    raise OSError("sock_diag: the kernel closed the dump")
    return found


def _tcp_rows(state: str):
    """The fields of each line of ``/proc/net/tcp{,6}`` in TCP ``state``:
    sl local rem st tx:rx tr:when retrnsmt uid timeout inode ..."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            # The state is the only field that can read " 0A " or " 01 " (the others
            # are addr:port pairs, fixed-width hex runs and decimals): skip the other
            # sockets before splitting them.
            if f" {state} " not in line:
                continue
            fields = line.split()
            if len(fields) >= 10 and fields[3] == state:
                yield fields


def _inode(fields: list[str]) -> int:
    try:
        return int(fields[9])
    except ValueError:
        return 0


def _proc_listeners() -> list[Listener]:
    found: list[Listener] = []
    for fields in _tcp_rows(TCP_LISTEN):
        addr, port = fields[1].split(":")
        found.append(Listener(_decode_addr(addr), int(port, 16), _inode(fields)))
    return found


def _addresses(addr: str | Iterable[str]) -> frozenset[str]:
    return frozenset((addr,) if isinstance(addr, str) else addr)


def answering(found: list[Listener], addr: str | Iterable[str], port: int) -> list[Listener]:
    """The listeners a connection to ``addr:port`` may reach: on that very address or on a wildcard.

    ``addr`` is an IP address, or several (every address a node's name
    resolves to: ``shared/addresses.py``); the kernel's table holds no names,
    so a name here would match nothing but a wildcard. The kernel prefers the
    exact address, but any of these holding the port means our engine does
    not hold it alone; an IPv4 address is reachable through an IPv6 wildcard
    (dual stack) too.
    """
    addrs = _addresses(addr)
    wild: set[str] = set()
    for a in addrs:
        try:
            v6 = ipaddress.ip_address(a).version == 6
        except ValueError:
            v6 = ":" in a
        wild |= {"::"} if v6 else WILDCARDS
    return [s for s in found if s.port == port and (s.addr in addrs or s.addr in wild)]


def listening_sockets() -> set[tuple[str, int]]:
    """Every TCP (ip, port) in LISTEN state on this machine, IPv4 and IPv6."""
    return {(s.addr, s.port) for s in listeners()}


def listening_on(addr: str) -> list[int]:
    """Ports in LISTEN state on one address (e.g. a simulated node's 127.0.1.N)."""
    return sorted(p for a, p in listening_sockets() if a == addr)


def connected_to(addr: str | Iterable[str], port: int) -> set[int]:
    """Inodes of the ESTABLISHED TCP sockets on this machine whose far end is
    ``addr:port`` (an IPv4-mapped address counts as IPv4); ``addr`` is an IP
    address or several (a leader's name, resolved: never the name itself).

    How the agent sees a worker join its leader: a worker rank of vLLM or
    SGLang holds a connection to the leader's rendezvous (torch's TCPStore on
    ``--master-port`` / ``--dist-init-addr``), and so does the sim's. Read from
    ``/proc/net/tcp{,6}``: a look happens only while a worker is starting.
    """
    addrs = _addresses(addr)
    found: set[int] = set()
    for fields in _tcp_rows(TCP_ESTABLISHED):
        raddr, rport = fields[2].split(":")
        if int(rport, 16) == port and _decode_addr(raddr) in addrs and (inode := _inode(fields)):
            found.add(inode)
    return found
