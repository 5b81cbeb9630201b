"""A management address that may be a DNS name: what it resolves to, and which of those are this machine's.

The kernel's tables (``procnet``) hold IP addresses, never names, so every
comparison of a node's ``mgmt_addr`` or a leader's address with a listener or
a connection goes through the addresses the name resolves to. A name is
resolved with the system resolver (``getaddrinfo``: ``/etc/hosts``, then DNS,
as ``nsswitch.conf`` says), A and AAAA both, in the order it returns them
(RFC 6724's preference). An IP literal resolves to itself, without a lookup.

Which of a node's addresses its engines bind is decided once, here: the first
of its name's addresses that is an address of this machine (``local``). A
socket bound to an address of this machine succeeds; to any other it fails
with EADDRNOTAVAIL, so a bind test on port 0 answers that exactly, without
reading interface tables (and agrees with what the engine's own bind will do).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Resolution", "is_ip", "is_local", "normal", "resolve", "resolve_mgmt"]


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return False


def normal(ip: str) -> str:
    """The form ``procnet`` prints: compressed IPv6, an IPv4-mapped IPv6 address as IPv4."""
    a = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped:
        a = a.ipv4_mapped
    return str(a)


class Unresolved(OSError):
    """A name the resolver has no address for (or could not ask about)."""


def resolve(host: str) -> tuple[str, ...]:
    """Every address ``host`` resolves to, in the resolver's order, each once.

    Raises ``Unresolved`` with the resolver's own words ("Name or service not
    known", "Temporary failure in name resolution") when it has none.
    """
    if is_ip(host):
        return (normal(host),)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise Unresolved(f"{host} does not resolve: {getattr(e, 'strerror', None) or e}") from None
    found: list[str] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            ip = normal(str(sockaddr[0]))
            if ip not in found:
                found.append(ip)
    if not found:
        raise Unresolved(f"{host} resolves to no IPv4 or IPv6 address")
    return tuple(found)


def is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
            return False
        raise


class Resolution(NamedTuple):
    """What a node's ``mgmt_addr`` means on the node, at one look.

    ``addrs``: everything it resolves to; ``local``: those that are this
    machine's, in the same order (the first is where engines bind);
    ``problem``: why engines cannot bind it ("" when ``local`` is not empty).
    """

    name: str
    addrs: tuple[str, ...]
    local: tuple[str, ...]
    problem: str

    @property
    def bind(self) -> str:
        """The address engines bind: the first local one ("" when there is none)."""
        return self.local[0] if self.local else ""

    def describe(self) -> str:
        if self.problem:
            return self.problem
        if self.addrs == (self.name,):
            return self.name
        return f"{self.name} ({', '.join(self.addrs)})"


def resolve_mgmt(host: str) -> Resolution:
    """Resolve a node's own ``mgmt_addr`` and keep the addresses that are this machine's.

    Blocking (a resolver call and a bind test per address): call it off the event loop.
    """
    try:
        addrs = resolve(host)
    except Unresolved as e:
        return Resolution(host, (), (), f"mgmt_addr {e}")
    local = tuple(a for a in addrs if is_local(a))
    if local:
        return Resolution(host, addrs, local, "")
    if addrs == (host,):
        return Resolution(host, addrs, (), f"mgmt_addr {host} is not an address of this machine")
    return Resolution(host, addrs, (), f"mgmt_addr {host} resolves to {', '.join(addrs)}, none of which is an address of this machine")


def overlap(a: Iterable[str], b: Iterable[str]) -> list[str]:
    """The addresses in both, in ``a``'s order."""
    bs = set(b)
    return [x for x in a if x in bs]


def claim_problem(claim: str, recorded: str, node_ips: Iterable[str], here: tuple[str, ...] | str, node_problem: str = "") -> str:
    """Why a node's address claim does not agree with the address recorded for it, or "".

    The registry's rule, pure. ``claim``: the inventory's ``mgmt_addr``;
    ``recorded``: the address an operator recorded ("" for none);
    ``node_ips``: what the claim resolves to on the node, its own addresses,
    bind address first (empty from an agent that could not resolve it, or
    that predates resolving); ``here``: what ``recorded`` resolves to at the
    registry, or the resolver's error in words; ``node_problem``: the node's
    own word on why it has no usable address.

    Clients reach a node at its recorded address, resolved where they are;
    its engines listen on its bind address. So a claim is good when the bind
    address is among the recorded address's, whatever name the node calls
    itself by: an IP recorded at onboarding and a DNS name in agent.yaml that
    resolves to it agree. A node that says it has no usable address is taken
    at its word (its record keeps the recorded address, and the node's own
    problem keeps replicas off it), so an operator reads the real cause.
    Otherwise, without resolved addresses, only the same spelling agrees, as
    before names were resolved.
    """
    if not recorded:
        return ""
    ips = list(node_ips)
    if not ips:
        return "" if claim == recorded or node_problem else f"claims mgmt_addr {claim} but its recorded address is {recorded}"
    if isinstance(here, str):
        return f"its recorded address {recorded} does not resolve at the registry ({here}), so clients could not reach it"
    if ips[0] in here:
        return ""
    claimed = (
        f"{claim} (where its engines listen)"
        if claim == ips[0]
        else f"{claim}, which resolves on the node to {', '.join(ips)} (its engines listen on {ips[0]}),"
    )
    recorded_words = recorded if tuple(here) == (recorded,) else f"{recorded}, which resolves here to {', '.join(here)}"
    return f"claims mgmt_addr {claimed} but its recorded address is {recorded_words}"
