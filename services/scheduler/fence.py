"""Fencing: stop every engine no replica record vouches for (invariant 6).

A node that comes back after being declared lost still runs the engines of
replicas that were reaped meanwhile; its status report is compared with the
records here. Pure: the shell calls it with what agents reported.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.shared.schemas import EngineFact, Replica
from llmgw.shared.states import ENDING_REPLICA, EngineState, ReplicaState

from .plan import Stop

# Records whose engines are meant to be stopping already; a stop for them is a
# retry of one the node may have missed while it was unreachable.
_STOPPING = ENDING_REPLICA | {ReplicaState.GONE}


def fence(reported_engines: Mapping[str, list[EngineFact]], replicas: Mapping[str, Replica]) -> list[Stop]:
    """Stop orders for reported engines that must not run; one per (node, replica)."""
    stops: list[Stop] = []
    for node_id in sorted(reported_engines):
        seen: set[str] = set()
        for fact in reported_engines[node_id]:
            if fact.state == EngineState.EXITED or fact.replica_id in seen:
                continue
            reason = _why_stop(node_id, fact, replicas.get(fact.replica_id))
            if reason:
                seen.add(fact.replica_id)
                stops.append(Stop(node_id, fact.replica_id, fact.generation, reason))
    return stops


def _why_stop(node_id: str, fact: EngineFact, replica: Replica | None) -> str:
    if replica is None:
        return f"fenced: replica {fact.replica_id} no longer exists"
    if fact.generation < replica.generation:
        return f"fenced: generation {fact.generation} is older than the record's {replica.generation}"
    if replica.state in _STOPPING:
        return f"fenced: replica {replica.id} is {replica.state}"
    if not any(m.node_id == node_id for m in replica.members):
        return f"fenced: {node_id} is not a member of {replica.id}"
    return ""
