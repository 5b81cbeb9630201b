"""Every service endpoint, once: which service answers it, its verb, what it is
asked and what it answers, and who may ask; and every command a service sends
a node's agent, with who sends it.

``ServiceRuntime.add_api`` registers a service's handlers from these rows and
decodes and encodes for them; a caller asks with :func:`call`; the NATS rights
to ask (and to answer) are derived from them (``permissions.py``). The subject
of each is ``llmgw.api.<service>.<verb>`` (a ``nats.micro`` endpoint, so
``nats micro info llmgw-<service>`` lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from . import subjects as S
from .errors import BusError, LlmgwError, WireError
from .schemas import (
    ApiError,
    CommandAck,
    DeploymentSpec,
    ExplainReply,
    Inventory,
    LaunchCommand,
    Lease,
    NameRequest,
    NodeAddrRequest,
    NodeRecord,
    NodeRequest,
    StageCommand,
    StatusReport,
    StopCommand,
    TrafficReport,
    decode,
    encode,
)

Req = TypeVar("Req")
Rep = TypeVar("Rep")

OPERATOR = "operator"


@dataclass(frozen=True)
class Endpoint(Generic[Req, Rep]):
    service: str
    verb: str
    request: type[Req]
    reply: type[Rep]
    # The roles that may ask (the operator always: ``llmgw ctl``, the console).
    callers: tuple[str, ...] = (OPERATOR,)

    @property
    def subject(self) -> str:
        return S.api(self.service, self.verb)


# -- the registry: node records' admin state and recorded address ----------------
# cordon: also the scheduler's auto-cordon (``auto``; the registry writes node records).
CORDON = Endpoint("registry", "cordon", NodeRequest, NodeRecord, callers=(OPERATOR, "scheduler"))
UNCORDON = Endpoint("registry", "uncordon", NodeRequest, NodeRecord)
DRAIN = Endpoint("registry", "drain", NodeRequest, NodeRecord)
SET_ADDR = Endpoint("registry", "set-addr", NodeAddrRequest, NodeRecord)

# -- the health monitor ----------------------------------------------------------
# lease: a node's exact last renewal (the bucket holds checkpoints); the scheduler
# asks whether a node a peer reported lost was heard since. A read: it changes nothing.
LEASE = Endpoint("health", "lease", NodeRequest, Lease, callers=(OPERATOR, "scheduler"))
RELEASE = Endpoint("health", "release", NodeRequest, Lease)

# -- the scheduler -----------------------------------------------------------------
APPLY = Endpoint("scheduler", "apply", DeploymentSpec, DeploymentSpec)
DELETE = Endpoint("scheduler", "delete", NameRequest, DeploymentSpec)
EXPLAIN = Endpoint("scheduler", "explain", NameRequest, ExplainReply)

ENDPOINTS: tuple[Endpoint, ...] = (CORDON, UNCORDON, DRAIN, SET_ADDR, LEASE, RELEASE, APPLY, DELETE, EXPLAIN)

# ``llmgw ctl cordon|uncordon|drain`` and the console's keys, by verb.
ADMIN = {e.verb: e for e in (CORDON, UNCORDON, DRAIN)}


def served_by(service: str) -> tuple[Endpoint, ...]:
    return tuple(e for e in ENDPOINTS if e.service == service)


def callable_by(role: str) -> tuple[Endpoint, ...]:
    return tuple(e for e in ENDPOINTS if role in e.callers)


@dataclass(frozen=True)
class Command:
    """A message a service sends one node's agent on ``llmgw.cmd.<node>.<verb>``.

    Not a nats.micro endpoint: the subject names the node, the agent answers in
    its tagged ``AgentReply`` (``schemas.decode_reply``), and only ``sender`` may
    send it to any node (the node itself only subscribes to its own)."""

    verb: str
    subject: Callable[[str], str]  # node -> subject
    request: Any  # None: an empty object ({})
    reply: Any  # None: no answer is asked for
    sender: str

    @property
    def every_node(self) -> str:
        """The subject on every node (a sender's publish right)."""
        return self.subject("*")


LAUNCH = Command("launch", S.cmd_launch, LaunchCommand, CommandAck, "scheduler")
STOP = Command("stop", S.cmd_stop, StopCommand, CommandAck, "scheduler")
# The full list of a node's engines (a full StatusReport): after the scheduler
# takes over, and when a report looks incomplete.
LIST = Command("list", S.cmd_list, None, StatusReport, "scheduler")
# An inventory the registry missed (the agent started before it).
INVENTORY = Command("inventory", S.cmd_inventory, None, Inventory, "registry")
# A gateway's traffic evidence for the replicas led from that node (progress probes).
TRAFFIC = Command("traffic", S.traffic, TrafficReport, None, "gateway")

# Pre-stage a weights source into a node's model cache (a spare, a rolling update's next spec).
STAGE = Command("stage", S.cmd_stage, StageCommand, CommandAck, "scheduler")

COMMANDS: tuple[Command, ...] = (LAUNCH, STOP, LIST, INVENTORY, TRAFFIC, STAGE)


def sent_by(role: str) -> tuple[Command, ...]:
    return tuple(c for c in COMMANDS if c.sender == role)


class ApiFailed(LlmgwError):
    """The service answered with an error (``code``: the service's, e.g. ``unknown_node``)."""

    code = "api"

    def __init__(self, description: str, code: str = "api"):
        super().__init__(description)
        self.code = code


def error_of(headers: dict | None, data: bytes) -> ApiFailed | None:
    """The service's refusal in a reply, or None for an answer."""
    if not (headers and headers.get("Nats-Service-Error-Code")):
        return None
    try:
        err = decode(data, ApiError)
    except WireError:
        return ApiFailed(headers.get("Nats-Service-Error", "request failed"))
    return ApiFailed(err.description, err.code)


async def call(nc, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float = 10.0) -> Rep:
    """Ask ``endpoint`` on the connection ``nc``.

    Raises ``BusError`` when no instance answers, ``ApiFailed`` when the service
    refused (its description), ``WireError`` for an answer that is not the reply type.
    """
    try:
        reply = await nc.request(endpoint.subject, encode(request), timeout=timeout)
    except Exception as e:
        raise BusError(f"the {endpoint.service} did not answer {endpoint.verb} ({type(e).__name__}); is 'llmgw {endpoint.service}' running?") from None
    failed = error_of(reply.headers, reply.data)
    if failed is not None:
        raise failed
    return decode(reply.data, endpoint.reply)
