"""Every subject, bucket and stream name llmgw uses. Nothing else spells one.

Subjects are dot-separated tokens under ``llmgw.``; node ids are single tokens
(see ``names.check_name``) so ``llmgw.node.<node>.>`` is exactly one node's
space, which is what the server's per-identity permissions rely on.
"""

PREFIX = "llmgw"

# -- agent -> control plane ---------------------------------------------------
NODE_SPACE = f"{PREFIX}.node"


def node_space(node: str) -> str:
    """Everything a node may publish."""
    return f"{NODE_SPACE}.{node}.>"


def inventory(node: str) -> str:
    return f"{NODE_SPACE}.{node}.inventory"


def heartbeat(node: str) -> str:
    return f"{NODE_SPACE}.{node}.heartbeat"


def status(node: str) -> str:
    return f"{NODE_SPACE}.{node}.status"


ALL_INVENTORIES = f"{NODE_SPACE}.*.inventory"
ALL_HEARTBEATS = f"{NODE_SPACE}.*.heartbeat"
ALL_STATUS = f"{NODE_SPACE}.*.status"


def node_of(subject: str) -> str:
    """The node token of a ``llmgw.node.<node>.…`` subject ('' if not one)."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[0] == PREFIX and parts[1] == "node":
        return parts[2]
    return ""


# -- control plane -> agent ---------------------------------------------------
CMD_SPACE = f"{PREFIX}.cmd"


def cmd_space(node: str) -> str:
    """Everything a node may subscribe to (besides its inbox)."""
    return f"{CMD_SPACE}.{node}.>"


def cmd_launch(node: str) -> str:
    return f"{CMD_SPACE}.{node}.launch"


def cmd_stop(node: str) -> str:
    return f"{CMD_SPACE}.{node}.stop"


def cmd_list(node: str) -> str:
    """Ask an agent for the full list of its engines (reply: StatusReport)."""
    return f"{CMD_SPACE}.{node}.list"


def cmd_inventory(node: str) -> str:
    """Ask an agent for its inventory (reply: Inventory)."""
    return f"{CMD_SPACE}.{node}.inventory"


ALL_CMD_INVENTORY = f"{CMD_SPACE}.*.inventory"


def cmd_stage(node: str) -> str:
    """Ask an agent to copy a weights source into its model cache (StageCommand; reply: CommandAck)."""
    return f"{CMD_SPACE}.{node}.stage"


def traffic(node: str) -> str:
    """A gateway's traffic evidence for the replicas whose leader runs on ``node``
    (TrafficReport, no reply). In the node's command space so a node hears only
    about its own leaders, with no new subscribe right."""
    return f"{CMD_SPACE}.{node}.traffic"


ALL_TRAFFIC = f"{CMD_SPACE}.*.traffic"


# -- events (captured by the LLMGW_EVENTS stream) -----------------------------
EVENT_SPACE = f"{PREFIX}.event"
ALL_EVENTS = f"{EVENT_SPACE}.>"


def event(kind: str, ident: str, what: str) -> str:
    return f"{EVENT_SPACE}.{kind}.{ident}.{what}"


def event_kind_space(kind: str) -> str:
    return f"{EVENT_SPACE}.{kind}.>"


# -- request/reply APIs (nats.micro services) ---------------------------------
API_SPACE = f"{PREFIX}.api"


def api(service: str, verb: str) -> str:
    return f"{API_SPACE}.{service}.{verb}"


def api_space(service: str) -> str:
    return f"{API_SPACE}.{service}.>"


# nats.micro discovery subjects ($SRV.PING, $SRV.INFO.<name>, …)
MICRO_SPACE = "$SRV.>"


# -- inboxes ------------------------------------------------------------------
def inbox_prefix(role: str, name: str) -> str:
    """Per-identity inbox prefix.

    The role is part of it so that a node named like a service (``scheduler``)
    still has an inbox space disjoint from the service's: replies meant for the
    scheduler can never be read by that node.
    """
    return f"_INBOX_{role}_{name}"


# -- JetStream ----------------------------------------------------------------
BUCKET_NODES = "llmgw_nodes"
BUCKET_LEASES = "llmgw_leases"
BUCKET_DEPLOYMENTS = "llmgw_deployments"
BUCKET_REPLICAS = "llmgw_replicas"
# Leadership leases of services that must act alone (scheduler, health monitor).
BUCKET_LEADERS = "llmgw_leaders"

BUCKETS = (BUCKET_NODES, BUCKET_LEASES, BUCKET_DEPLOYMENTS, BUCKET_REPLICAS, BUCKET_LEADERS)

EVENT_STREAM = "LLMGW_EVENTS"


def kv_stream(bucket: str) -> str:
    """The stream JetStream keeps a KV bucket in."""
    return f"KV_{bucket}"


def kv_put_space(bucket: str) -> str:
    """What a writer publishes to (``$KV.<bucket>.<key>``)."""
    return f"$KV.{bucket}.>"
