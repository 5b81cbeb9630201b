"""Every KV bucket and stream, once: its name, what it holds, and who writes it.

A service's buckets (what it provisions), its NATS rights (``permissions.py``),
the words ``llmgw ctl`` uses for a bucket not created yet, and every reader's
decoding (``KvMirror``, ``open_mirror``) come from these rows; nothing else
pairs a bucket with a schema.

Writers and owners: each bucket has one writer — except the leadership leases,
which every service that must act alone writes its own key of — and each stream
one *owner*, its first writer. Every writer may create the stream (a service
must not wait for another to start before it can write; JetStream refuses a
create whose configuration differs from the existing stream's, so creating
changes nothing that is there), but only the owner may update it: one
compromised identity that may not update the event stream cannot cut its
history to one message (``max_msgs=1``). Nobody may delete a stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from . import subjects as S
from .schemas import DeploymentSpec, Event, LeaderLease, Lease, NodeRecord, Replica, decode
from .states import EventKind

T = TypeVar("T")

# How an operator-facing line names a role (the health monitor's role is "health").
_SPOKEN = {"health": "health monitor"}


def spoken(role: str) -> str:
    """A role as a line for operators names it."""
    return _SPOKEN.get(role, role)


@dataclass(frozen=True)
class Stream(Generic[T]):
    """A JetStream stream: what each message in it is, and who writes it (first: the owner)."""

    name: str
    schema: type[T]
    writers: tuple[str, ...]

    @property
    def stream(self) -> str:
        return self.name

    @property
    def owner(self) -> str:
        """The only identity that may update the stream (the replica count when a cluster grows)."""
        return self.writers[0]

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        """One stored value as this stream's schema, or ``WireError``."""
        return decode(data, self.schema)


@dataclass(frozen=True)
class Bucket(Stream[T]):
    """A KV bucket; ``name`` is the bucket's, its stream is ``KV_<name>``."""

    @property
    def stream(self) -> str:
        return S.kv_stream(self.name)


NODES = Bucket(S.BUCKET_NODES, NodeRecord, ("registry",))
LEASES = Bucket(S.BUCKET_LEASES, Lease, ("health",))
DEPLOYMENTS = Bucket(S.BUCKET_DEPLOYMENTS, DeploymentSpec, ("scheduler",))
REPLICAS = Bucket(S.BUCKET_REPLICAS, Replica, ("scheduler",))
# The services that must act alone, each under its role's key (shared/leader.py).
LEADERS = Bucket(S.BUCKET_LEADERS, LeaderLease, ("health", "scheduler"))

BUCKETS: tuple[Bucket, ...] = (NODES, LEASES, DEPLOYMENTS, REPLICAS, LEADERS)

# The event stream: most events are the scheduler's (replicas and deployments).
EVENTS: Stream[Event] = Stream(S.EVENT_STREAM, Event, ("scheduler", "registry", "health"))

STREAMS: tuple[Stream, ...] = (*BUCKETS, EVENTS)
# Roles that publish one kind of event only, never creating or owning the stream:
# the gateway says which requests it moved between replicas (``request`` events).
PARTIAL_EVENT_WRITERS: dict[str, tuple[EventKind, ...]] = {"gateway": (EventKind.REQUEST,)}


def written_by(role: str) -> tuple[Bucket, ...]:
    """The buckets ``role`` writes (and provisions)."""
    return tuple(b for b in BUCKETS if role in b.writers)


def publishes_events(role: str) -> bool:
    """Whether ``role`` writes the event stream (any kind; it provisions the stream)."""
    return role in EVENTS.writers


def event_subjects(role: str) -> list[str]:
    """The event subjects ``role`` may publish on."""
    if publishes_events(role):
        return [S.ALL_EVENTS]
    return [S.event_kind_space(kind) for kind in PARTIAL_EVENT_WRITERS.get(role, ())]


def created_by(role: str) -> tuple[str, ...]:
    """The streams ``role`` may create: those it writes."""
    return tuple(s.stream for s in STREAMS if role in s.writers)


def owned_by(role: str) -> tuple[str, ...]:
    """The streams ``role`` may update: those it owns."""
    return tuple(s.stream for s in STREAMS if s.owner == role)
