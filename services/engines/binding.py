"""Binding listening addresses with errors an operator can act on."""

from __future__ import annotations

import errno
import socket

from llmgw.shared.errors import LlmgwError


class BindError(LlmgwError):
    """An address this engine must listen on cannot be had."""

    code = "bind"


def explain_bind_error(what: str, host: str, port: int, e: OSError) -> BindError:
    where = f"{what} {host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return BindError(f"cannot bind {where}: address already in use (another engine on this port?)")
    if e.errno == errno.EADDRNOTAVAIL:
        return BindError(f"cannot bind {where}: {host} is not an address of this machine")
    if e.errno == errno.EACCES:
        return BindError(f"cannot bind {where}: permission denied (ports below 1024 need privileges)")
    if isinstance(e, socket.gaierror):
        return BindError(f"cannot bind {where}: cannot resolve {host!r} ({e.strerror})")
    return BindError(f"cannot bind {where}: {e.strerror or e}")


def reserve(what: str, host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` but not listening.

    The leader must not listen for HTTP before its group has formed and loaded,
    yet a port taken by someone else should fail at start, not minutes later
    after the rendezvous. A bound socket holds the port without appearing as
    LISTEN in the kernel's socket table; connections to it are refused.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise explain_bind_error(what, host, port, e) from None
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        # Lets a restarted engine rebind while old connections sit in TIME_WAIT;
        # on Linux it does not allow two listeners on one port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise explain_bind_error(what, host, port, e) from None
    return sock
