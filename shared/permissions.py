"""Per-identity NATS permissions, derived from the role in a certificate's subject.

NATS permission *templates* work only for JWT users, so the rendered server
config lists every identity with its own expanded allow lists; this module is
the single place that says what each role may do. ``docs/architecture.md``
carries the same table for people.

Principles:

* A node publishes only in its own space and subscribes only to its own
  commands and its own inbox. It answers commands through ``allow_responses``
  (a reply to a request it received), never through a broad publish right. It
  has no JetStream rights at all.
* Each service may write exactly the buckets ``shared/buckets.py`` names it
  a writer of (``$KV.<bucket>.>``), may read the buckets it needs through the
  JetStream read APIs, may create the streams it writes and update only the
  streams it owns; no identity may delete a stream.
* A service may ask exactly the endpoints ``shared/api.py`` lists it as a
  caller of, and answers exactly its own.
* Inboxes are per identity (``_INBOX_<role>_<name>``), so no one reads replies
  meant for someone else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import api
from . import buckets as B
from . import subjects as S


@dataclass(frozen=True)
class Permissions:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    publish_deny: list[str] = field(default_factory=list)
    subscribe_deny: list[str] = field(default_factory=list)
    allow_responses: bool = False


def _js_read(streams: list[str]) -> list[str]:
    """JetStream APIs to look up streams, read KV entries and watch them (ordered consumers).

    Nothing here creates, updates, restores or deletes a stream. Creating a
    consumer is allowed (ordered consumers are how KV watches, ``kv.keys()`` and
    event feeds read), and nats-server does not check a push consumer's
    ``deliver_subject`` against its creator's publish rights (tested in
    tests/test_js_permissions.py): such a consumer can only replay messages the
    single writers put in these streams, and the agent acts only on requests
    published on its own command subject with a reply (services/agent/agent.py),
    which a JetStream delivery (it keeps the stream's subject) never is.
    """
    out = ["$JS.API.INFO", "$JS.FC.>", "$JS.ACK.>"]
    for st in streams:
        out += [
            f"$JS.API.STREAM.INFO.{st}",
            f"$JS.API.CONSUMER.CREATE.{st}",
            f"$JS.API.CONSUMER.CREATE.{st}.>",
            f"$JS.API.CONSUMER.DELETE.{st}.>",
            f"$JS.API.CONSUMER.INFO.{st}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{st}.>",
            f"$JS.API.DIRECT.GET.{st}",
            f"$JS.API.DIRECT.GET.{st}.>",
            f"$JS.API.STREAM.MSG.GET.{st}",
        ]
    return out


def _js_own(role: str) -> list[str]:
    """Create the streams ``role`` writes (idempotent provisioning: a create that
    differs from an existing stream is refused by the server); update only those it
    owns (the replica count of a grown cluster)."""
    return [f"$JS.API.STREAM.CREATE.{st}" for st in B.created_by(role)] + [f"$JS.API.STREAM.UPDATE.{st}" for st in B.owned_by(role)]


def api_calls(role: str) -> list[str]:
    """The endpoints ``role`` may ask."""
    return [e.subject for e in api.callable_by(role)]


def commands(role: str) -> list[str]:
    """The commands ``role`` may send any node's agent."""
    return [c.every_node for c in api.sent_by(role)]


def api_answers(role: str) -> list[str]:
    """The endpoints ``role`` answers (and subscribes to)."""
    return [e.subject for e in api.served_by(role)]


# Listing streams and consumers (`nats stream ls`, `nats kv ls`, `nats consumer ls`).
OPERATOR_JS_LIST = [
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.API.CONSUMER.LIST.*",
]

# Denied to the operator on top of its allow-list (belt and braces: a later
# broad allow must not bring them back).
JS_WRITE_APIS = [
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.PEER.>",
    "$JS.API.STREAM.LEADER.>",
    "$JS.API.CONSUMER.DURABLE.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.SERVER.>",
    "$JS.API.META.>",
]

_ALL_STREAMS = [s.stream for s in B.STREAMS]


def _service(role: str, name: str, *, reads: list[str], subscribe: list[str]) -> Permissions:
    """A service's rights: what it writes from ``shared/buckets.py``, whom it asks,
    what it commands agents and what it answers from ``shared/api.py``, plus what
    it reads and hears."""
    writes = B.written_by(role)
    pub = [
        *(S.kv_put_space(b.name) for b in writes),
        *_js_read(sorted(set(reads) | set(B.created_by(role)))),
        *_js_own(role),
        *api_calls(role),
        *commands(role),
    ]
    pub += B.event_subjects(role)
    sub = [f"{S.inbox_prefix(role, name)}.>", S.MICRO_SPACE, *api_answers(role), *subscribe]
    return Permissions(publish=pub, subscribe=sub, allow_responses=True)


def for_identity(role: str, name: str) -> Permissions:
    """The permissions of the identity ``CN=<name>,OU=<role>``."""
    if role == "node":
        return Permissions(
            publish=[S.node_space(name)],
            subscribe=[S.cmd_space(name), f"{S.inbox_prefix(role, name)}.>"],
            allow_responses=True,
        )
    if role == "registry":
        return _service(
            role,
            name,
            # Leases tell it which nodes are alive, so it can ask one whose
            # inventory it never got (an agent that started before it) to send it.
            reads=[B.LEASES.stream],
            subscribe=[S.ALL_INVENTORIES],
        )
    if role == "health":
        return _service(
            role,
            name,
            reads=[B.NODES.stream],
            subscribe=[S.ALL_HEARTBEATS],
        )
    if role == "scheduler":
        return _service(
            role,
            name,
            reads=[B.NODES.stream, B.LEASES.stream],
            subscribe=[S.ALL_STATUS],
        )
    if role == "gateway":
        return _service(
            role,
            name,
            reads=[B.REPLICAS.stream, B.DEPLOYMENTS.stream],
            subscribe=[],
        )
    if role == "operator":
        # Reads everything and calls the services' APIs; writes state only
        # through those APIs (single-writer buckets stay single-writer) and
        # never speaks as a node or commands one directly. Its JetStream rights
        # are an explicit read allow-list: what `nats kv ls/get/watch/history`,
        # `nats stream ls/info/view`, ctl and the console use — never
        # STREAM.CREATE/UPDATE/DELETE/PURGE/RESTORE/SNAPSHOT, MSG.DELETE, the
        # legacy durable-consumer API or the server/meta APIs (a durable asked
        # for through the named CONSUMER.CREATE form cannot be told apart by subject).
        return Permissions(
            publish=[
                *api_calls(role),
                "$SRV.>",
                *_js_read(_ALL_STREAMS),
                *OPERATOR_JS_LIST,
            ],
            publish_deny=[
                "$KV.>",
                f"{S.NODE_SPACE}.>",
                f"{S.CMD_SPACE}.>",
                f"{S.EVENT_SPACE}.>",
                *JS_WRITE_APIS,
            ],
            subscribe=[">"],
            allow_responses=True,
        )
    raise ValueError(f"no permissions defined for role {role!r}")
