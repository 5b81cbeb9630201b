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
