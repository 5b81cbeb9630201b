"""What a reconcile decided, for the shell to apply (Nomad's ``reconcileResults``).

Apply in this order, so a crash between steps never leaves an engine running
that no record accounts for:

1. ``generations`` and ``backoffs`` — persist each deployment's
   ``last_generation`` (and its crash-loop backoff) first, so a generation is
   never issued twice even if the rest is lost;
2. ``writes`` then ``deletes`` — the replica records (KV); a placed replica's
   ``launches`` may go out as soon as its own record is written (the shell
   pipelines them, so the first launches need not wait for the last of
   thousands of writes);
3. the remaining ``launches`` and the ``stops`` — the commands to agents;
4. ``events`` — history, published last so it never claims what did not happen.

Then ``implicated`` joins the shell's per-node failure history (it feeds the
next reconcile's auto-cordon), the nodes in ``settled`` have theirs dropped,
and each of ``cordons`` is asked of the registry (the single writer of node
records), which records the reason and tells the event stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.shared.schemas import Event, LaunchCommand, Replica, ReplicaMember, StopCommand


@dataclass(frozen=True)
class Launch:
    """Launch one member: send ``command`` to ``llmgw.cmd.<node_id>.launch``."""

    node_id: str
    replica_id: str
    member: ReplicaMember
    command: LaunchCommand


@dataclass(frozen=True)
class Stop:
    """Stop engines of ``replica_id`` with generation <= ``generation`` on ``node_id``."""

    node_id: str
    replica_id: str
    generation: int
    reason: str

    @property
    def command(self) -> StopCommand:
        return StopCommand(replica_id=self.replica_id, generation=self.generation, reason=self.reason)


@dataclass(frozen=True)
class Backoff:
    """A deployment's crash-loop backoff, as ``DeploymentSpec`` stores it."""

    failures: int = 0
    retry_at: float = 0.0
    last_failure: str = ""


@dataclass(frozen=True)
class NodeFailure:
    """A replica failure that implicates ``node_id`` (auto-cordon evidence)."""

    node_id: str
    time: float
    reason: str
    # "peer-lost": a peer of the node's member said it was gone. Until the node
    # is heard from again (a heartbeat after ``time``), placement avoids it.
    kind: str = ""


@dataclass(frozen=True)
class Cordon:
    """Ask the registry to cordon ``node_id`` on the scheduler's behalf."""

    node_id: str
    reason: str


@dataclass
class Plan:
    # replica id -> the record to write (new or changed), in write order
    writes: dict[str, Replica] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    # replica ids whose records are deleted (they reached ``gone``)
    deletes: list[str] = field(default_factory=list)
    # deployment -> its new ``last_generation`` (only deployments that issued one)
    generations: dict[str, int] = field(default_factory=dict)
    # one per replica state transition (kind "replica", what = the new state)
    events: list[Event] = field(default_factory=list)
    # deployment -> why its pending replicas could not be placed this cycle
    pending: dict[str, str] = field(default_factory=dict)
    # deployment -> its crash-loop backoff, where it changed
    backoffs: dict[str, Backoff] = field(default_factory=dict)
    # the nodes each replica failure of this cycle implicates
    implicated: list[NodeFailure] = field(default_factory=list)
    # nodes to cordon (auto-cordon), and nodes whose failure history is used up
    # (cordoned now, withheld by the circuit breaker, or no longer active)
    cordons: list[Cordon] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.writes
            or self.launches
            or self.stops
            or self.deletes
            or self.generations
            or self.events
            or self.backoffs
            or self.implicated
            or self.cordons
            or self.settled
        )
