"""Every state and event word that crosses a process boundary, defined once,
with the named sets every user reads.

The scheduler's reconciler, the health monitor, the registry, the agent's
supervisor, the gateway's router, ``llmgw ctl`` and the console all decide on
these; none spells one as a bare string (``tests/test_state_words.py`` reads
the code for comparisons against a bare word and fails naming file:line).
``StrEnum`` members *are* strings, so they encode on the wire as the words they
always were and compare equal to what older records hold.

Replica states (the scheduler writes them)::

    pending ─> launching ─> waiting-for-workers ─> ready <──> degraded
                  │               │                  │  ^        │
                  │               │                  │  │ promoted
                  │               │                  │  standby (a warm spare)
                  └───────────────┴──────> failed <──┴──┴────────┘
                                             │
                                           reaping ─> gone

    ready / degraded / standby ─> restarting ─> launching (restart in place)

``standby``: a warm spare (``DeploymentSpec.spares``): launched, loaded and
watched like a serving replica, not routed. A replica that comes up when its
deployment already has its serving count becomes ``standby`` instead of
``ready``; one is promoted to ``ready`` in the cycle a serving one is found
failed. A standby whose leader makes no progress is failed at once (a spare
that cannot make a token is no spare).

``restarting``: an engine exited on nodes that are healthy (a software fault):
its group's old engines are being stopped, and it is launched again on the same
members, GPUs and ports under a new generation (restart in place), within the
scheduler's ``restart_in_place`` budget.

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

Lease states (the health monitor writes them, from heartbeats)::

    ready ─> suspect ─> lost ─> ready (heartbeats again, or a new boot id)

Admin states (the registry writes them, on an operator's word or the
scheduler's auto-cordon): ``active``, ``cordoned`` (nothing new is placed),
``draining`` (nothing new, and its replicas are moved off).

A node's one word (``NodeState``) folds the two, most urgent first: the lease's
when it is not ready, else the admin state when not active, else ready; and
``unknown`` for a node with no lease yet.

Event words (``Event.kind``, ``Event.what``): see ``EventKind`` and
``EventWhat``. Unlike the states, an event word this build does not know is
*kept*, not refused: an event stream outlives every build that writes to it,
and a newer peer's new word must not make the stream (or a replica record's
event outbox) unreadable to an older console.

"Starting" is not one set: an engine ``starting`` (``EngineState.STARTING``:
its process runs, it has not joined or served), a replica launched and not yet
serving (``LAUNCHED_REPLICA``: its startup timeout runs, and a failure counts
towards the crash-loop backoff) and a replica wanted and not yet serving
(``COMING_UP_REPLICA``, which adds ``pending``: the console's "starting" rows)
each have their own name.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self


class ReplicaState(StrEnum):
    PENDING = "pending"
    LAUNCHING = "launching"
    WAITING = "waiting-for-workers"
    READY = "ready"
    DEGRADED = "degraded"
    STANDBY = "standby"
    RESTARTING = "restarting"
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
# Up, or on its way up: holds GPUs, its members' facts can fail it, and it
# counts towards the deployment's replicas and spares. A standby spare is up.
ACTIVE_REPLICA = frozenset({ReplicaState.LAUNCHING, ReplicaState.WAITING, ReplicaState.READY, ReplicaState.DEGRADED, ReplicaState.STANDBY})
# What a deployment counts against its replicas and spares (a replica restarting
# in place comes back on what it holds).
WANTED_REPLICA = ACTIVE_REPLICA | {ReplicaState.PENDING, ReplicaState.RESTARTING}
# What the gateway may send a new request to (never a standby spare).
ROUTABLE_REPLICA = frozenset({ReplicaState.READY})
# Serving: counted against the deployment's ``replicas`` (a degraded one may
# recover); a standby spare is counted against its ``spares``.
SERVING_REPLICA = frozenset({ReplicaState.READY, ReplicaState.DEGRADED})
# Started and not yet settled either way (a rolling update waits for these).
IN_FLIGHT_REPLICA = frozenset({ReplicaState.LAUNCHING, ReplicaState.WAITING, ReplicaState.RESTARTING, ReplicaState.FAILED, ReplicaState.REAPING})
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
# A leader that came up (whether or not it makes progress now).
UP_ENGINE = frozenset({EngineState.READY, EngineState.STALLED})

# -- more replica sets ---------------------------------------------------------
# Every state but gone holds its members' GPUs (and ports): a failed or reaping
# replica's engines may run until an agent reports them exited, and a degraded
# one may recover. The scheduler's view and the operator's read model count this.
HOLDING_REPLICA = WANTED_REPLICA | ENDING_REPLICA
# Launched and not yet serving: its startup timeout runs, and a failure from here
# counts towards the deployment's crash-loop backoff.
LAUNCHED_REPLICA = frozenset({ReplicaState.LAUNCHING, ReplicaState.WAITING})
# Wanted and not yet serving, placed or not: what the console shows as starting.
COMING_UP_REPLICA = LAUNCHED_REPLICA | {ReplicaState.PENDING, ReplicaState.RESTARTING}


# -- nodes -----------------------------------------------------------------------
class LeaseState(StrEnum):
    """A node's lease, as the health monitor judges its heartbeats."""

    READY = "ready"
    SUSPECT = "suspect"
    LOST = "lost"


class AdminState(StrEnum):
    """What an operator (or the scheduler's auto-cordon) said about a node."""

    ACTIVE = "active"
    CORDONED = "cordoned"  # nothing new is placed on it
    DRAINING = "draining"  # nothing new, and its replicas are moved off


class AdminBy(StrEnum):
    """Who set a node's admin state."""

    UNSET = ""  # records from before this was kept
    OPERATOR = "operator"  # ``llmgw ctl``, the console
    AUTO = "auto"  # the scheduler's auto-cordon


class NodeState(StrEnum):
    """A node's one word for operators, most urgent first: health beats
    administration, because a lost node is lost whether or not someone cordoned it."""

    LOST = "lost"
    SUSPECT = "suspect"
    DRAINING = "draining"
    CORDONED = "cordoned"
    UNKNOWN = "unknown"  # registered, but the health monitor has not spoken
    READY = "ready"


# Every node word, most urgent first (for tables, counts and sorting).
NODE_ORDER = tuple(NodeState)

# A new agent incarnation (boot id) is settled once the health monitor has
# accepted this many of its heartbeats without another agent answering for the
# node: the monitor writes the lease at that count, and the scheduler trusts the
# incarnation's full reports for teardown from then on.
BOOT_SETTLED_HEARTBEATS = 4


# -- events --------------------------------------------------------------------
class _OpenVocabulary(StrEnum):
    """A word list that keeps a word it does not know (see the module docstring):
    decoding one gives a member outside the list that compares equal to its word,
    encodes as it, and equals no listed member."""

    @classmethod
    def _missing_(cls, value: object) -> Self | None:
        if not isinstance(value, str):
            return None
        word = str.__new__(cls, value)
        word._name_ = value
        word._value_ = value
        return word

    @property
    def known(self) -> bool:
        """Whether this build lists the word."""
        return self._value_ in type(self)._value2member_map_


class EventKind(_OpenVocabulary):
    """What an event is about (``Event.kind``); ``Event.subject`` names which one."""

    NODE = "node"  # subject: the node id
    REPLICA = "replica"  # subject: the replica id
    DEPLOYMENT = "deployment"  # subject: the deployment name
    REQUEST = "request"  # subject: the request's id as its client sees it (the gateway's)


class EventWhat(_OpenVocabulary):
    """What happened (``Event.what``), by kind and by who says it.

    A replica event's word is the state it entered (every ``ReplicaState``); a
    node's lease change is the lease state it entered (every ``LeaseState``);
    the two share ``ready``.
    """

    # node, the registry
    JOINED = "joined"  # first inventory
    INVENTORY = "inventory"  # its inventory changed
    ADDR_PROBLEM = "addr-problem"  # its management address cannot be used
    ADDR_OK = "addr-ok"  # usable again
    ADDR_REFUSED = "addr-refused"  # an inventory claimed another address than the recorded one
    ADDR_RECORDED = "addr-recorded"  # an operator recorded its address
    CORDONED = "cordoned"
    UNCORDONED = "uncordoned"
    DRAINING = "draining"
    # node, the registry, from the model cache its inventory reports (data: source, bytes, total / digest, size)
    STAGING = "staging"  # weights being copied into the node's model cache: progress
    STAGED = "staged"  # a copy is complete: the node holds the model
    EVICTED = "evicted"  # a model left the cache (least recently used, to make room)
    STAGE_FAILED = "stage-failed"  # a copy failed (source unreadable, disk)
    # node, the health monitor (LeaseState); READY is shared with the replica's
    SUSPECT = "suspect"
    LOST = "lost"
    QUARANTINED = "quarantined"  # two agents answer for the node
    RELEASED = "released"  # an operator lifted the quarantine
    # node, the scheduler
    AUTO_CORDON_WITHHELD = "auto-cordon-withheld"  # the circuit breaker kept a node active
    # replica, the scheduler (ReplicaState)
    PENDING = "pending"
    LAUNCHING = "launching"
    WAITING = "waiting-for-workers"
    READY = "ready"
    DEGRADED = "degraded"
    STANDBY = "standby"
    RESTARTING = "restarting"
    FAILED = "failed"
    REAPING = "reaping"
    GONE = "gone"
    # deployment, the scheduler
    APPLIED = "applied"
    DELETED = "deleted"
    RECOVERED = "recovered"  # a replica became ready: crash-loop backoff cleared
    BACKOFF = "backoff"  # crash-loop backoff: no launch until its retry time
    # request, the gateway: a stream whose replica failed, continued on another or not
    MIGRATED = "migrated"
    NOT_MIGRATED = "not-migrated"


# Every vocabulary above: the words no code outside this module compares against
# bare (tests/test_state_words.py).
VOCABULARIES: tuple[type[StrEnum], ...] = (ReplicaState, EngineState, LeaseState, AdminState, AdminBy, NodeState, EventKind, EventWhat)
