"""Prometheus HTTP service discovery for the engines (``GET /sd/engines``).

Prometheus's ``http_sd_configs`` reads a JSON list of target groups::

    [{"targets": ["host:port"], "labels": {"name": "value", ...}}, ...]

llmgw knows where every ready replica's leader listens (``Replica.endpoint``,
``http://host:port``), and vLLM, SGLang and the ``sim`` engine serve
``/metrics`` on that same port, so the gateway answers this list from the
replica records it already mirrors. One group per ready replica, with plain
labels ``deployment``, ``replica``, ``model``, ``node`` (the leader's),
``fabric`` and ``engine``; an ``https://`` endpoint adds ``__scheme__``.

Only ``ready`` replicas (``ROUTABLE_REPLICA``) are listed: one that is torn
down, failed or degraded drops out at the next refresh, as it drops out of
routing. Pure: records in, the list out (tests/test_promsd.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from llmgw.shared.schemas import Replica
from llmgw.shared.states import ROUTABLE_REPLICA

CONTENT_TYPE = "application/json"
LABELS = ("deployment", "replica", "model", "node", "fabric", "engine")


def target_of(endpoint: str) -> tuple[str, str] | None:
    """``("host:port", scheme)`` of an ``http(s)://host:port`` endpoint; None for one
    that names no host (a record that is not serving yet, or one not to trust)."""
    try:
        u = urlsplit(endpoint)
        port = u.port  # raises on a port that is not a number or out of range
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname  # an IPv6 literal keeps its brackets
    return (f"{host}:{port}" if port else host), u.scheme


def leader_node(rep: Replica) -> str:
    for m in rep.members:
        if m.role == "leader":
            return m.node_id
    return ""


def engine_targets(replicas: Iterable[Replica]) -> list[dict]:
    """The http_sd target groups: one per ready replica with a usable endpoint,
    sorted by deployment and replica so the answer is stable between refreshes."""
    groups: list[dict[str, Any]] = []
    for rep in replicas:
        if rep.state not in ROUTABLE_REPLICA:
            continue
        found = target_of(rep.endpoint)
        if found is None:
            continue
        target, scheme = found
        labels = {
            "deployment": rep.deployment,
            "replica": rep.id,
            "model": rep.model,
            "node": leader_node(rep),
            "fabric": rep.fabric or "",
            "engine": str(rep.engine),
        }
        if scheme == "https":
            labels["__scheme__"] = "https"
        groups.append({"targets": [target], "labels": labels})
    groups.sort(key=lambda g: (g["labels"]["deployment"], g["labels"]["replica"]))
    return groups
