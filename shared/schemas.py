"""Wire schemas: every message on the bus and every value in a KV bucket.

One base Struct, its options chosen once here:

* ``kw_only`` — messages are built with keywords, so adding a field never
  reorders a constructor call. msgspec applies ``kw_only`` per class (to the
  fields that class defines), so every subclass repeats it.
* ``omit_defaults`` — keeps heartbeats and KV values small.
* Unknown fields are *ignored* on the wire (msgspec's default), unlike
  configuration files, which forbid them (``config.py``): during a rolling
  upgrade a newer agent may send a field an older control plane does not know,
  and that must not make its inventory undecodable. Typos are a configuration
  problem, not a wire problem.

Decoding goes through :func:`decode`, which turns every failure — bad JSON,
wrong type, missing field, oversized payload — into one ``WireError`` that a
service logs, counts and survives.
"""

from __future__ import annotations

import hashlib
import time
import typing
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec

from .errors import WireError
from .names import HCA_NAME_PATTERN
from .states import REPORTED_ENGINE, AdminBy, AdminState, EngineState, EventKind, EventWhat, LeaseState, ReplicaState
from .structconf import Duration

# NATS' default max_payload; nothing llmgw sends legitimately comes close.
MAX_PAYLOAD = 1024 * 1024

# -- Sanity bounds on what a node may claim ---------------------------------------
# A node's certificate proves who it is, not that what it says is sane: a message
# outside these bounds is refused whole by ``decode`` (a ``WireError``, logged and
# counted by the receiving service), never stored. The bounds are generous for
# real hardware and tight enough that one node cannot claim 10,000 GPUs, a GPU
# index of 2**70, or a heartbeat sequence that outruns every real one.
MAX_GPUS = 64  # GPUs per node (an 8-GPU HGX board is the common case)
MAX_HCAS = 64  # HCAs per node, and per fabric
MAX_FABRICS = 16
MAX_PORTS_PER_HCA = 16
MAX_ENGINES = 1024  # engine facts in one status report
MAX_SEQ = 2**53 - 1  # exact in a double: JSON readers elsewhere (jq, JS) keep it
MAX_ID = 128  # node ids are 63 (shared/names.py); replica ids are deployment + "-g<N>"
MAX_TEXT = 4096  # operator-facing words from a node (details, problems)
MAX_ADDRS = 16  # addresses one management name resolves to

Short = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Host = Annotated[str, msgspec.Meta(max_length=253)]  # and shared.names.check_host where it is used
IpAddr = Annotated[str, msgspec.Meta(max_length=45)]  # and shared.addresses.is_ip where it is used
GpuIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS - 1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# \Z, not $: msgspec matches with Python's re.search, where $ also matches
# before a final newline, so "mlx5_0\n" passed (hypothesis found "0\n").
HcaName = Annotated[str, msgspec.Meta(pattern=HCA_NAME_PATTERN)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]


class Base(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of every wire and KV schema."""


def now() -> float:
    return time.time()


# --------------------------------------------------------------------------
# Inventory: agent -> registry on llmgw.node.<node>.inventory
# --------------------------------------------------------------------------


class Gpu(Base, kw_only=True):
    index: GpuIndex
    uuid: Short
    name: Annotated[str, msgspec.Meta(max_length=256)]
    # None when the driver reports "[N/A]" (seen on some MIG and vGPU setups).
    memory_mib: Annotated[int, msgspec.Meta(ge=0, le=2**31)] | None = None
    pci_bus_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # Health as the agent last read it (docs/hardware.md): an unhealthy GPU fails the
    # replica holding it and takes no new work; problem says why, in the
    # driver's words ("XID 79: GPU has fallen off the bus", "2 uncorrectable
    # ECC errors"). foreign_* is memory held by processes llmgw did not start:
    # such a GPU is not offered to placement (it is not "unhealthy").
    healthy: bool = True
    problem: Text = ""
    foreign_mib: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    foreign_pids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31)]], msgspec.Meta(max_length=1024)] = []


class HcaPort(Base, kw_only=True):
    port: Annotated[int, msgspec.Meta(ge=0, le=255)]
    state: Short  # "ACTIVE", "DOWN", … (the word after "4: ")
    phys_state: Short = ""  # "LinkUp", …
    rate: Short = ""  # "200 Gb/sec (4X HDR)"
    link_layer: Short = ""  # "InfiniBand" | "Ethernet"


class Hca(Base, kw_only=True):
    name: HcaName
    ports: Annotated[list[HcaPort], msgspec.Meta(max_length=MAX_PORTS_PER_HCA)] = []
    # A configured HCA is usable when it exists and has an ACTIVE port.
    usable: bool = False
    problem: Text = ""


class FabricMembership(Base, kw_only=True):
    """A fabric this node is configured to sit on, and whether it can use it now."""

    name: Short
    hcas: Annotated[list[HcaName], msgspec.Meta(max_length=MAX_HCAS)] = []
    usable: bool = True
    problem: Text = ""


MAX_CACHE_ENTRIES = 256  # models one node's cache reports (a node holds a handful)
MAX_BYTES = 2**62  # a cache entry's size or budget: far beyond any disk, exact in JSON readers that use int64
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
WeightsText = Annotated[str, msgspec.Meta(max_length=4096)]  # a path or a model id


class CacheEntry(Base, kw_only=True):
    """One model's weights in a node's model cache (``services/agent/modelcache.py``),
    as the agent reports it in its inventory and the registry keeps it.

    ``source`` is the deployment's weights source in one word (``weights_source``):
    placement matches on it. ``staged_bytes`` < ``size`` while the copy runs
    (``complete`` false): progress, reported as it goes.
    """

    source: WeightsText
    digest: Short = ""  # "sha256:<hex>" of the staged files (relative path, size, bytes)
    size: Bytes = 0
    staged_bytes: Bytes = 0
    complete: bool = False
    last_use: float = 0.0  # the node's clock: when an engine last launched from it (or it was staged)
    in_use: bool = False  # a running engine reads it: never evicted
    problem: Text = ""  # why the last staging of this source failed ("" when it did not)


class ModelCacheReport(Base, kw_only=True):
    """A node's model cache: where, how big it may grow, and what it holds."""

    budget: Bytes = 0
    used: Bytes = 0
    entries: Annotated[list[CacheEntry], msgspec.Meta(max_length=MAX_CACHE_ENTRIES)] = []


class Inventory(Base, kw_only=True, tag="inventory"):
    node_id: Short
    boot_id: Short
    hostname: Host = ""
    agent_version: Short = ""
    # What the node says; the registry keeps the address recorded at onboarding
    # (``NodeRecord.recorded_addr``) and refuses an inventory that claims another.
    mgmt_addr: Host
    mgmt_interface: Short = ""
    # What mgmt_addr resolves to on the node and is the node's own (the first
    # is where its engines bind), and why that is empty when it is ("does not
    # resolve", "none of which is an address of this machine").
    mgmt_ips: Annotated[list[IpAddr], msgspec.Meta(max_length=MAX_ADDRS)] = []
    addr_problem: Text = ""
    gpus: Annotated[list[Gpu], msgspec.Meta(max_length=MAX_GPUS)] = []
    fabrics: Annotated[list[FabricMembership], msgspec.Meta(max_length=MAX_FABRICS)] = []
    hcas: Annotated[list[Hca], msgspec.Meta(max_length=MAX_HCAS)] = []
    # None: the agent keeps no model cache (none configured, or an agent older than the cache).
    model_cache: ModelCacheReport | None = None
    sent_at: float = 0.0


# --------------------------------------------------------------------------
# Heartbeat: agent -> health monitor on llmgw.node.<node>.heartbeat
# --------------------------------------------------------------------------


class Heartbeat(Base, kw_only=True):
    node_id: Short
    boot_id: Short
    # 1, 2, 3, … per agent incarnation (boot id). The health monitor also
    # refuses a jump no real agent could make (``leases.LeaseBook``).
    seq: Seq
    sent_at: float = 0.0


# --------------------------------------------------------------------------
# Engine status: agent -> scheduler on llmgw.node.<node>.status
# --------------------------------------------------------------------------


class EngineFact(Base, kw_only=True):
    """What an agent knows about one engine process it supervises."""

    replica_id: Short
    generation: Seq
    deployment: Short = ""
    rank: Annotated[int, msgspec.Meta(ge=0, le=4095)] = 0
    serves_http: bool = False
    pid: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    # One of ``states.REPORTED_ENGINE``: "absent" and "" are the scheduler's own
    # words, refused from a node (``__post_init__``, which msgspec runs on decode).
    state: EngineState = EngineState.STARTING
    # What the agent saw that put the engine in this state, in words for an
    # operator ("canary sent 12:00:01 got no token in 3s", "log: rank 1 lost").
    detail: Text = ""
    exit_code: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31)] | None = None
    gpus: Annotated[list[GpuIndex], msgspec.Meta(max_length=MAX_GPUS)] = []
    http_port: Port = 0
    rendezvous_port: Port = 0
    # The agent's supervisor.log_lines (512) lines of at most 2,000 characters;
    # the payload limit bounds the whole.
    log_tail: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    since: float = 0.0

    def __post_init__(self) -> None:
        if self.state not in REPORTED_ENGINE:
            raise ValueError(f"state: {self.state.value!r} is not a state an agent reports (one of {', '.join(sorted(REPORTED_ENGINE))})")


class StatusReport(Base, kw_only=True, tag="status"):
    """Engine facts from a node.

    ``full`` is true when ``engines`` is the complete list (sent on every
    (re)connect and on request), false when it carries only what changed.
    """

    node_id: Short
    boot_id: Short
    full: bool = False
    engines: Annotated[list[EngineFact], msgspec.Meta(max_length=MAX_ENGINES)] = []
    sent_at: float = 0.0


# --------------------------------------------------------------------------
# Commands: scheduler -> agent, request/reply on llmgw.cmd.<node>.launch|stop
# --------------------------------------------------------------------------

EngineName = Literal["vllm", "sglang", "sim"]


class LaunchCommand(Base, kw_only=True):
    """Launch one member of a replica on the receiving node."""

    replica_id: str
    generation: int
    deployment: str
    model: str
    engine: EngineName
    nnodes: int
    rank: int
    leader_addr: str
    rendezvous_port: int
    http_port: int
    gpus: list[int]
    fabric: str | None = None
    hcas: list[str] = []
    engine_args: list[str] = []
    env: dict[str, str] = {}
    # The deployment's weights source (``DeploymentSpec.weights_path`` /
    # ``weights_model``): the agent stages it into its model cache and points
    # the engine at the cached copy. Both empty: the engine finds ``model`` itself.
    weights_path: str = ""
    weights_model: str = ""


class StageCommand(Base, kw_only=True):
    """Pre-stage a weights source into the receiving node's model cache
    (``llmgw.cmd.<node>.stage``): for a replica that may come here (a spare, a
    rolling update's next spec). Answered at once; progress is in the
    inventory's ``model_cache`` and the node's ``staging``/``staged`` events."""

    weights_path: str = ""
    weights_model: str = ""
    reason: str = ""


class StopCommand(Base, kw_only=True):
    replica_id: str
    # Stop engines of this replica with generation <= this; 0 means any.
    generation: int = 0
    reason: str = ""


class CommandAck(Base, kw_only=True, tag="ack"):
    ok: bool
    # A stable reason constant when refused ("stale_generation", "gpu_busy", …).
    code: str = ""
    reason: str = ""
    pid: int = 0


# --------------------------------------------------------------------------
# Traffic evidence: gateway -> the agent of a replica's leader node, on
# llmgw.cmd.<node>.traffic. The agent judges its leaders' progress by it: a
# replica that completed real requests needs no canary, and one with requests
# in flight that sends no byte for ``stall_after`` is stalled.
# --------------------------------------------------------------------------


class ReplicaTraffic(Base, kw_only=True):
    replica_id: str
    # Requests this gateway saw complete on the replica since the gateway
    # started: only ever grows, so a receiver compares it with the last value.
    completed: int = 0
    in_flight: int = 0
    # Seconds since the replica last sent a byte for any request in flight
    # (0 with nothing in flight). An age, not a time: clocks differ by machine.
    silent_for: float = 0.0


class TrafficReport(Base, kw_only=True):
    gateway: str
    node_id: str
    replicas: list[ReplicaTraffic] = []
    sent_at: float = 0.0


# --------------------------------------------------------------------------
# Events: services -> LLMGW_EVENTS on llmgw.event.<kind>.<id>.<what>
# --------------------------------------------------------------------------


class Event(Base, kw_only=True):
    time: float
    # A word this build does not list is kept, not refused (``states.EventKind``):
    # the stream, and a replica record's outbox, outlive the build that reads them.
    kind: EventKind
    subject: str  # the node id, replica id or deployment name
    what: EventWhat
    detail: str = ""
    data: dict[str, str] = {}


# --------------------------------------------------------------------------
# KV values
# --------------------------------------------------------------------------


class NodeRecord(Base, kw_only=True):
    """``llmgw_nodes[<node>]``, written by the registry alone."""

    node_id: str
    identity: str = ""  # the certificate subject the inventory came under
    hostname: str = ""
    mgmt_addr: str = ""
    mgmt_interface: str = ""
    boot_id: str = ""
    gpus: list[Gpu] = []
    fabrics: list[FabricMembership] = []
    hcas: list[Hca] = []
    admin: AdminState = AdminState.ACTIVE
    # Why the node is cordoned or draining, and who said so ("3 replica
    # failures in 10m: …" from the scheduler). Cleared by uncordon.
    admin_reason: str = ""
    # Who set the admin state; unset on records from before it was kept.
    admin_by: AdminBy = AdminBy.UNSET
    registered_at: float = 0.0
    updated_at: float = 0.0
    # The management address an operator recorded at onboarding (``llmgw ctl
    # node set-addr``, ``llmgw up``, ``deploy/onboard-node.sh``). When set,
    # ``mgmt_addr`` is always this, whatever the node's inventory claims (an
    # inventory claiming another is refused); "" on a node onboarded before
    # addresses were recorded: its inventory's word is taken ("unverified").
    recorded_addr: str = ""
    # Where the node's mgmt_addr resolves on the node, its own addresses (its
    # inventory's ``mgmt_ips``), and why the node cannot be used at its
    # address: the agent's own problem, or the registry's refusal of its
    # latest address claim. Placement skips a node with a problem.
    mgmt_ips: list[str] = []
    addr_problem: str = ""
    # The node's model cache as its latest inventory reported it (None: it keeps
    # none). Placement prefers nodes whose cache holds a replica's weights.
    model_cache: ModelCacheReport | None = None


class Lease(Base, kw_only=True):
    """``llmgw_leases[<node>]``, written by the health monitor alone.

    Times are the monitor's own wall clock, never the agent's.
    """

    node_id: str
    state: LeaseState
    boot_id: str
    last_seq: int = 0
    last_renew: float
    since: float
    # When the monitor first heard this boot id (its clock): a new agent
    # incarnation's reports are trusted for teardown only once it has held the
    # lease a few heartbeats without another agent answering for the node.
    boot_since: float = 0.0
    # Heartbeats accepted from this boot id (capped): counted by the monitor,
    # not taken from the sequence, which the node chooses.
    boot_heartbeats: int = 0
    # Non-empty: two agents answer for this node (boot ids heartbeating in
    # alternation); why, in words. Nothing is launched on it and its status
    # reports tear nothing down until an operator releases it
    # (``llmgw ctl node release``).
    quarantine: str = ""


class DeploymentSpec(Base, kw_only=True):
    """``llmgw_deployments[<name>]``: a deployment as the operator applied it."""

    name: str
    model: str
    engine: EngineName
    replicas: int
    gpus_per_node: int
    nodes_per_replica: int = 1
    engine_args: list[str] = []
    env: dict[str, str] = {}
    # A Duration so a deployment file may say 10m; on the wire it is seconds.
    startup_timeout: Duration = 600.0
    # Where the weights come from, at most one of: a directory on storage every
    # node mounts at the same path, or a model id looked up under each agent's
    # ``cache.mirror`` directory. Set: the agent copies it into its model cache
    # before launching and points the engine at the copy (docs/operations.md).
    weights_path: str = ""
    weights_model: str = ""
    # Warm spares: this many replicas more than ``replicas``, placed, launched,
    # loaded and watched, but not routed (state ``standby``); one takes a failed
    # serving replica's place at once. The first GPUs a shortage takes back.
    spares: int = 0
    applied_at: float = 0.0
    # Maintained by the scheduler, not the operator: the last replica generation
    # issued for this deployment, so generations only ever grow (fencing).
    last_generation: int = 0
    # Also the scheduler's: crash-loop backoff. Consecutive replica failures
    # before serving, the last one's reason, and the earliest time (scheduler
    # clock) a replica may be launched again; a replica that becomes ready
    # clears them, and so does the operator applying the deployment again.
    failures: int = 0
    last_failure: str = ""
    retry_at: float = 0.0


def weights_source(weights_path: str, weights_model: str) -> str:
    """A weights source in one word, as cache entries and placement name it:
    ``path:/srv/models/llama-8b``, ``model:meta-llama/Llama-3.1-8B``, or "" (none)."""
    if weights_path:
        return f"path:{weights_path}"
    if weights_model:
        return f"model:{weights_model}"
    return ""


def template_digest(spec: DeploymentSpec) -> str:
    """What a replica of ``spec`` runs, as a short digest (``Replica.spec_digest``):
    a change here replaces running replicas (the scheduler's rolling update); a
    change of the replica count or a timeout does not.

    A weights source is part of the template (other bytes, another model): a
    change of it replaces replicas. It joins the digest only when set, so a
    deployment without one keeps the digest it had before sources existed (an
    upgrade replaces nothing)."""
    template: tuple = (spec.model, spec.engine, spec.gpus_per_node, spec.nodes_per_replica, spec.engine_args, sorted(spec.env.items()))
    if source := weights_source(spec.weights_path, spec.weights_model):
        template = (*template, source)
    return hashlib.sha256(msgspec.json.encode(template)).hexdigest()[:16]


MemberRole = Literal["leader", "worker"]


class ReplicaMember(Base, kw_only=True):
    node_id: str
    rank: int
    role: MemberRole
    gpus: list[int]
    rendezvous_port: int = 0
    http_port: int = 0
    serves_http: bool = False
    # Last engine state the agent reported for this member ("" until launched;
    # "absent" when a full report lacks it), and what the agent saw.
    engine_state: EngineState = EngineState.UNREPORTED
    engine_detail: str = ""
    pid: int = 0


class Replica(Base, kw_only=True):
    """``llmgw_replicas[<id>]``, written by the scheduler alone."""

    id: str
    deployment: str
    model: str
    engine: EngineName
    generation: int
    state: ReplicaState
    fabric: str | None = None
    members: list[ReplicaMember] = []
    rendezvous_addr: str = ""  # "host:port" of the leader's rendezvous
    endpoint: str = ""  # "http://host:port" of the leader, once it serves
    created_at: float = 0.0
    since: float = 0.0
    reason: str = ""
    # Digest of the deployment's engine template (model, engine, shape, args,
    # env) this replica was made from; a different one means it is outdated
    # and is replaced (rolling update). "" (records from before): never outdated.
    spec_digest: str = ""
    # When it was restarted in place (scheduler clock), those within the
    # scheduler's ``restart_window``: what its ``restart_in_place`` budget counts.
    restarts: list[float] = []
    # The event outbox (no event lost to a crash): the events of the transition that produced this
    # record, written with it. The acting scheduler (or one taking over after a
    # crash between the record and its events) publishes any LLMGW_EVENTS lacks,
    # under a Nats-Msg-Id (shared/events.py), so none is lost and none doubled.
    pending_events: list[Event] = []


class LeaderLease(Base, kw_only=True):
    """``llmgw_leaders[<service>]``: who acts for a service that must act alone."""

    holder: str
    acquired_at: float
    renewed_at: float


# --------------------------------------------------------------------------
# Operator API replies (request/reply on llmgw.api.<service>.<verb>)
# --------------------------------------------------------------------------


class ApiError(Base, kw_only=True):
    code: str
    description: str


class NameRequest(Base, kw_only=True):
    """The scheduler's ``delete`` and ``explain``: which deployment."""

    name: str


class NodeRequest(Base, kw_only=True):
    """The registry's ``cordon``, ``uncordon`` and ``drain``: which node.

    ``reason`` says why, in words (kept on the record as ``admin_reason``);
    ``auto`` marks the scheduler's auto-cordon, counted by its circuit breaker.
    """

    node_id: str
    reason: str = ""
    auto: bool = False


class NodeAddrRequest(Base, kw_only=True):
    """The registry's ``set-addr``: the management address an operator vouches for."""

    node_id: str
    addr: str


# The scheduler's ``explain``. Every field is sent, defaults included
# (``omit_defaults`` off): ``llmgw ctl explain -o json`` prints this reply as it
# came, and scripts read its keys.
class _Whole(Base, kw_only=True, omit_defaults=False):
    pass


class PlacementShape(_Whole, kw_only=True):
    """What one replica of the deployment asks for."""

    deployment: str
    gpus_per_node: int
    nodes_per_replica: int


class NodeVerdict(_Whole, kw_only=True):
    """Could this node take a member of the next replica, and why not."""

    node_id: str
    ok: bool
    reason: str  # "" when ok
    detail: str
    fabrics: list[str]
    free_gpus: int
    total_gpus: int
    # Placement's node scores, by scorer name (``services/scheduler/scorers.py``):
    # {"weights_cached": 1.0} when the node's model cache holds the replica's weights.
    scores: dict[str, float] = {}


class BackoffState(_Whole, kw_only=True):
    failures: int
    last_failure: str
    retry_at: float
    active: bool
    message: str  # "" unless active


class ExplainedMember(_Whole, kw_only=True):
    node: str
    rank: int
    engine_state: EngineState
    engine_detail: str


class ExplainedReplica(_Whole, kw_only=True):
    id: str
    state: ReplicaState
    reason: str
    members: list[ExplainedMember]


class ExplainReply(_Whole, kw_only=True):
    """Where the next replica would go, node by node; the crash-loop backoff; the
    deployment's replicas as they stand (oldest generation first)."""

    deployment: str
    request: PlacementShape
    nodes: list[NodeVerdict]
    # fabric -> how many nodes there fit one member (multi-node replicas only)
    fabrics: dict[str, int]
    placeable: bool
    fabric: str | None  # where the next replica would go
    leader: str | None
    summary: str
    backoff: BackoffState
    replicas: list[ExplainedReplica]


# --------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _decoder_for(schema: Any) -> msgspec.json.Decoder:
    dec = _decoders.get(schema)
    if dec is None:
        dec = _decoders[schema] = msgspec.json.Decoder(schema)
    return dec


def _schema_name(schema: Any) -> str:
    if args := typing.get_args(schema):  # a union: "StatusReport | Inventory | CommandAck"
        return " | ".join(_schema_name(a) for a in args)
    return getattr(schema, "__name__", None) or str(schema)


def decode(data: bytes | bytearray | memoryview | str, schema: type[T]) -> T:
    """Decode ``data`` as ``schema`` or raise ``WireError`` — never anything else."""
    if isinstance(data, str):
        data = data.encode()
    if len(data) > MAX_PAYLOAD:
        raise WireError(_schema_name(schema), f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD}")
    try:
        return _decoder_for(schema).decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise WireError(_schema_name(schema), str(e)) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(_schema_name(schema), f"{type(e).__name__}: {e}") from None


# What an agent answers a command with (``llmgw.cmd.<node>.*``). Tagged (``"type":
# "status" | "inventory" | "ack"``), so that a requester tells a refusal (a
# ``CommandAck`` with ``ok`` false: the agent is there and said no) from the
# answer it asked for, and a malformed answer from no answer at all.
AgentReply = StatusReport | Inventory | CommandAck


def decode_reply(data: bytes | bytearray | memoryview | str, expected: type[T]) -> T | CommandAck:
    """An agent's answer to a command that asked for ``expected``: that, or the
    agent's ``CommandAck`` (a refusal, or an error that stopped the handler).
    Raises ``WireError`` for anything else — a malformed answer, or one of
    another kind — which is not the same as no answer.

    An answer without a ``type`` comes from an agent older than the tags: it is
    read as ``expected``, so a control plane upgraded first keeps its nodes.
    """
    try:
        # A union is a schema msgspec decodes, but ``type[T]`` cannot spell one (that is
        # PEP 747's TypeForm); the cast names the same union as a type.
        reply = decode(data, cast("type[AgentReply]", AgentReply))
    except WireError as e:
        if "missing required field `type`" not in str(e):
            raise
        return decode(data, expected)
    if not isinstance(reply, (expected, CommandAck)):
        raise WireError(_schema_name(expected), f"the agent answered with {type(reply).__name__}")
    return reply


def to_builtins(obj: Any) -> Any:
    """Plain dicts/lists, for ``--output json`` and the console."""
    return msgspec.to_builtins(obj)


# Every schema that travels or is stored; tests round-trip each one.
WIRE_SCHEMAS: tuple[type[Base], ...] = (
    Gpu,
    HcaPort,
    Hca,
    FabricMembership,
    Inventory,
    Heartbeat,
    EngineFact,
    StatusReport,
    LaunchCommand,
    StageCommand,
    StopCommand,
    CommandAck,
    CacheEntry,
    ModelCacheReport,
    ReplicaTraffic,
    TrafficReport,
    Event,
    NodeRecord,
    Lease,
    DeploymentSpec,
    ReplicaMember,
    Replica,
    LeaderLease,
    ApiError,
    NameRequest,
    NodeRequest,
    NodeAddrRequest,
    ExplainReply,
)
