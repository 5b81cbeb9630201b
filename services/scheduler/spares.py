"""Warm spares and restart in place: the arithmetic the cycle's cases read.

Pure helpers over one deployment's replicas; the cycle (``cycle.py``, cases 12
to 14) applies what they say. A deployment asks for ``replicas`` serving and
``spares`` standby; a replica on its way up (pending, launching,
waiting-for-workers, restarting) is neither yet: it becomes serving when it
comes up while the deployment is short of serving ones, else standby. Serving
replicas are placed before any spare of any deployment, and a serving replica
that fits nowhere takes a standby spare's GPUs (``preemption_victim``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.shared.schemas import Replica
from llmgw.shared.states import LAUNCHED_REPLICA, SERVING_REPLICA
from llmgw.shared.states import ReplicaState as RS

from .filters import Request

# A standby spare retired for a serving replica's GPUs: its reason starts so
# (while it reaps, no other spare is taken for the same shortage).
PREEMPTED = "preempted"
# A degraded replica whose group a peer says is broken: it waits a moment for
# an engine exit (restart in place), and serves no one meanwhile.
GROUP_BROKEN = "group broken"


def broken_group(replica: Replica) -> bool:
    """Degraded because a peer said its group broke: never serving again."""
    return replica.state == RS.DEGRADED and replica.reason.startswith(GROUP_BROKEN)


@dataclass(frozen=True)
class Roles:
    """One deployment's replicas (those it counts) by role."""

    serving: int  # ready or degraded
    standby: int
    coming: int  # placed and on their way up: launching, waiting-for-workers, restarting
    pending: int  # placed nowhere yet

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> Roles:
        serving = standby = coming = pending = 0
        for r in replicas:
            if r.state in SERVING_REPLICA and not broken_group(r):
                serving += 1
            elif r.state == RS.STANDBY:
                standby += 1
            elif r.state in LAUNCHED_REPLICA or r.state == RS.RESTARTING:
                coming += 1
            elif r.state == RS.PENDING:
                pending += 1
        return cls(serving, standby, coming, pending)

    def serving_gap(self, want: int) -> int:
        """How many more replicas must be placed to serve ``want``: the first to be
        placed, before any spare (what is on its way up serves first)."""
        return max(0, want - self.serving - self.coming)


def removal_order(replica: Replica, serving_excess: bool) -> tuple[int, int, int]:
    """Which of a deployment's replicas go first when it has too many (case 5):
    pending, then those on their way up, then — the role it has too many of
    first — standby or serving (degraded before ready), newest first."""
    if replica.state == RS.PENDING:
        group = 0
    elif replica.state not in SERVING_REPLICA and replica.state != RS.STANDBY:
        group = 1
    elif replica.state == RS.STANDBY:
        group = 3 if serving_excess else 2
    else:
        group = 2 if serving_excess else 3
    return (group, 0 if replica.state == RS.DEGRADED else 1, -replica.generation)


def covers(spare: Replica, request: Request) -> bool:
    """Whether freeing ``spare``'s GPUs makes room for one replica of ``request``:
    as many members (in one fabric, as every multi-node replica is) with at
    least as many GPUs each. The fabric rule holds by construction: the freed
    members share the spare's fabric."""
    if len(spare.members) < request.nodes_per_replica:
        return False
    if request.multi and not spare.fabric:
        return False
    return all(len(m.gpus) >= request.gpus_per_node for m in spare.members)


def preemption_victim(standby: Sequence[Replica], request: Request) -> Replica | None:
    """The standby spare of another deployment to take for a serving replica of
    ``request`` that fits nowhere: the smallest that covers it, newest first."""
    fits = [r for r in standby if r.deployment != request.deployment and covers(r, request)]
    if not fits:
        return None
    return min(fits, key=lambda r: (sum(len(m.gpus) for m in r.members), -r.generation, r.id))


def recent_restarts(replica: Replica, now: float, window: float) -> list[float]:
    """The replica's restarts in place within ``window`` of ``now`` (what its budget counts)."""
    return [t for t in replica.restarts if now - t < window]
