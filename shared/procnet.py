"""What the kernel says is listening: proof of who opens a port (tests, the seed scenario).

Reading ``/proc/net/tcp{,6}`` sees every process's sockets - including ones a
test did not start and cannot ask - and never connects to anything, so looking
cannot change what is seen.
"""

from __future__ import annotations

import ipaddress
import struct

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


def listening_sockets() -> set[tuple[str, int]]:
    """Every TCP (ip, port) in LISTEN state on this machine, IPv4 and IPv6."""
    found: set[tuple[str, int]] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != TCP_LISTEN:
                continue
            addr, port = fields[1].split(":")
            found.add((_decode_addr(addr), int(port, 16)))
    return found


def listening_on(addr: str) -> list[int]:
    """Ports in LISTEN state on one address (e.g. a simulated node's 127.0.1.N)."""
    return sorted(p for a, p in listening_sockets() if a == addr)
