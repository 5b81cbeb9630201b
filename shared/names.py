"""Validation of the names that become NATS subject tokens.

A node id is used verbatim as a subject token (``llmgw.node.<node>.…``), as the
certificate CN and as the hostname, so it must be one token: no dots, no
wildcards, no whitespace. Lowercase letters, digits and inner hyphens — the
hostname rules (RFC 1123 label) — satisfy all three uses at once.
"""

import re

from .errors import InvalidName

_TOKEN = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")

ROLES = ("node", "registry", "health", "scheduler", "gateway", "operator")
SERVICE_ROLES = ROLES[1:]


def check_name(name: str, what: str = "node id") -> str:
    """Return ``name`` if it is a valid single-token name, else raise InvalidName."""
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise InvalidName(
            f"invalid {what} {name!r}: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (it becomes a NATS subject "
            "token, a hostname and a certificate CN)"
        )
    return name


def is_valid_name(name: str) -> bool:
    return isinstance(name, str) and _TOKEN.fullmatch(name) is not None


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidName(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    return role


# An HCA (InfiniBand device) name, as under /sys/class/infiniband (mlx5_0, ibp12s0):
# it becomes a sysfs path component and part of NCCL_IB_HCA, where ',' separates
# devices and ':' a port, so letters, digits, '_', '.' and '-', starting with a
# letter or digit (never '.' or '..'). One pattern for every place a name enters: the
# agent's configuration, the wire (``schemas.HcaName``, a msgspec pattern: searched,
# hence anchored), the simulated nodes' devices.
HCA_NAME_MAX = 64
HCA_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{HCA_NAME_MAX - 1}}}\Z"
_HCA_NAME = re.compile(HCA_NAME_PATTERN)


def hca_problem(name: object) -> str:
    """Why ``name`` is not an HCA name, or "" if it is."""
    if not isinstance(name, str) or not name:
        return "empty"
    if len(name) > HCA_NAME_MAX:
        return f"longer than {HCA_NAME_MAX} characters"
    if not _HCA_NAME.match(name):
        return "not letters, digits, '_', '.' and '-' starting with a letter or digit"
    return ""


_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
MAX_HOST = 253


def host_problem(addr: object) -> str:
    """Why ``addr`` is not a bare host (an IP address or a DNS name), or "" if it is.

    A management address becomes ``http://<addr>:<port>`` and ``<addr>:<port>``
    (NCCL's rendezvous), so it must carry no port, scheme, path, user or
    brackets: one validator, used wherever an address enters (configuration,
    the command line, an inventory, the registry's API).
    """
    import ipaddress

    if not isinstance(addr, str) or not addr:
        return "empty"
    if len(addr) > MAX_HOST:
        return f"longer than {MAX_HOST} characters"
    if "://" in addr:
        return "has a scheme (give the bare host, e.g. 10.0.0.7)"
    for ch, what in (("/", "a path"), ("@", "a user part"), ("[", "brackets"), ("]", "brackets"), ("%", "a zone")):
        if ch in addr:
            return f"has {what}"
    try:
        ipaddress.ip_address(addr)
        return ""
    except ValueError:
        pass
    if ":" in addr:
        return "has a port (give the bare host; ports are the scheduler's)"
    if addr.replace(".", "").isdigit():
        return "is not a valid IPv4 address"
    if not _HOSTNAME.fullmatch(addr):
        return "is neither an IP address nor a DNS name (letters, digits, '-' and '.')"
    return ""


def check_host(addr: str, what: str = "address") -> str:
    """Return ``addr`` if it is a bare host (IP or DNS name), else raise InvalidName."""
    problem = host_problem(addr)
    if problem:
        raise InvalidName(f"invalid {what} {addr!r}: {problem}")
    return addr


def is_valid_host(addr: object) -> bool:
    return host_problem(addr) == ""
