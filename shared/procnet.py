"""What the kernel says is listening: proof of who opens a port (the agent, tests, the seed scenario).

Reading ``/proc/net/tcp{,6}`` sees every process's sockets - including ones a
test did not start and cannot ask - and never connects to anything, so looking
cannot change what is seen. Each line also carries the socket's inode, which
``/proc/<pid>/fd/*`` links name (``socket:[inode]``): that is how the agent
proves a listening port belongs to the engine it launched
(``services/agent/procfs.py``).
"""

from __future__ import annotations

import ipaddress
import struct
from typing import NamedTuple

TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10


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

    Only LISTEN lines are decoded: a busy node has thousands of established
    connections in the same table, and those are skipped on the state field.
    """
    found: list[Listener] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            # sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            addr, port = fields[1].split(":")
            try:
                inode = int(fields[9])
            except ValueError:
                inode = 0
            found.append(Listener(_decode_addr(addr), int(port, 16), inode))
    return found


def answering(found: list[Listener], addr: str, port: int) -> list[Listener]:
    """The listeners a connection to ``addr:port`` may reach: on that very address or on a wildcard.

    The kernel prefers the exact address, but any of these holding the port
    means our engine does not hold it alone; an IPv4 address is reachable
    through an IPv6 wildcard (dual stack) too.
    """
    try:
        v6 = ipaddress.ip_address(addr).version == 6
    except ValueError:
        v6 = ":" in addr
    wild = {"::"} if v6 else WILDCARDS
    return [s for s in found if s.port == port and (s.addr == addr or s.addr in wild)]


def listening_sockets() -> set[tuple[str, int]]:
    """Every TCP (ip, port) in LISTEN state on this machine, IPv4 and IPv6."""
    return {(s.addr, s.port) for s in listeners()}


def listening_on(addr: str) -> list[int]:
    """Ports in LISTEN state on one address (e.g. a simulated node's 127.0.1.N)."""
    return sorted(p for a, p in listening_sockets() if a == addr)
