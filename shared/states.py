"""Replica and engine states, defined once, and the named sets every user reads.

The scheduler's reconciler, the agent's supervisor, the gateway's router,
``llmgw ctl`` and the console all decide on these; none spells a state as a
bare string. ``StrEnum`` members *are* strings, so they encode on the wire and
compare with what older records hold without conversion.

Replica states (the scheduler writes them)::

    pending ─> launching ─> waiting-for-workers ─> ready <──> degraded
                  │               │                  │           │
                  └───────────────┴──────> failed <──┴───────────┘
                                             │
                                           reaping ─> gone

``degraded``: the replica's leader stopped making progress — a canary got no
token, or real requests in flight got no byte for ``stall_after``, or its
``/health`` stopped answering. It takes no new requests; it returns to
``ready`` when tokens flow again, and is failed after ``hang_timeout``.

Engine states (an agent reports them for each engine it supervises, and the
scheduler copies the latest into ``ReplicaMember.engine_state``)::

    starting ─> joined (a worker in its group) / ready (a leader that serves)
    ready <──> stalled (a leader that answers nothing or produces no token)
    any ─> peer-lost (the engine says a peer of its group is gone: the group
           is broken for good, as a NCCL communicator is)
    any ─> exited

plus two that only the scheduler writes: ``absent`` (a full report from the
member's node lacks the engine, or the agent refused the launch) and ``""``
(nothing reported yet).
"""

from __future__ import annotations

from enum import StrEnum


class ReplicaState(StrEnum):
    PENDING = "pending"
    LAUNCHING = "launching"
    WAITING = "waiting-for-workers"
    READY = "ready"
    DEGRADED = "degraded"
    FAILED = "failed"
    REAPING = "reaping"
    GONE = "gone"


class EngineState(StrEnum):
    STARTING = "starting"
    JOINED = "joined"
    READY = "ready"
    STALLED = "stalled"
    PEER_LOST = "peer-lost"
    EXITED = "exited"
    # Written by the scheduler only, never reported by an agent.
    ABSENT = "absent"
    UNREPORTED = ""


# -- replica sets --------------------------------------------------------------
# Up, or on its way up: holds GPUs and counts towards the deployment's replicas.
ACTIVE_REPLICA = frozenset({ReplicaState.LAUNCHING, ReplicaState.WAITING, ReplicaState.READY, ReplicaState.DEGRADED})
# What a deployment counts against its replica count.
WANTED_REPLICA = ACTIVE_REPLICA | {ReplicaState.PENDING}
# What the gateway may send a new request to.
ROUTABLE_REPLICA = frozenset({ReplicaState.READY})
# Started and not yet settled either way (a rolling update waits for these).
IN_FLIGHT_REPLICA = frozenset({ReplicaState.LAUNCHING, ReplicaState.WAITING, ReplicaState.FAILED, ReplicaState.REAPING})
# On its way out: holds GPUs until its engines are stopped.
ENDING_REPLICA = frozenset({ReplicaState.FAILED, ReplicaState.REAPING})
# Every state, in the order a replica passes through them (for tables and gauges).
REPLICA_ORDER = tuple(ReplicaState)

# -- engine sets ---------------------------------------------------------------
# The process runs (whether or not it makes progress).
RUNNING_ENGINE = frozenset({EngineState.STARTING, EngineState.JOINED, EngineState.READY, EngineState.STALLED, EngineState.PEER_LOST})
# The process is gone, or never was.
ENDED_ENGINE = frozenset({EngineState.EXITED, EngineState.ABSENT})
# Running, but its group is broken for good: the replica fails at once.
BROKEN_ENGINE = frozenset({EngineState.PEER_LOST})
# States an agent may report (the wire schema's Literal mirrors this).
REPORTED_ENGINE = frozenset({EngineState.STARTING, EngineState.JOINED, EngineState.READY, EngineState.STALLED, EngineState.PEER_LOST, EngineState.EXITED})
