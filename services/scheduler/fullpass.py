"""The periodic full pass, computed beside the event loop.

The scheduler's steps are incremental (``incremental.Reconciler``); every
``scheduler.full_pass_interval`` (60 s) a full one rebuilds the view from nothing and looks at
every replica and deployment, the safety net under the incremental index. At
10,000 nodes and 4,000 replicas that is 1-2 s of CPU. Run on the event loop it
held up everything else: a lease that went lost meanwhile waited for it (a
2.2 s failover in the 10,000-node bench, against 0.2 s otherwise).

So the pass runs in a worker thread, on a snapshot of its inputs and with a
``Reconciler`` of its own, while the loop goes on with incremental steps. When
it has ended, the shell asks ``collect`` whether it may use it:

* **adopted** when the shell applied no plan since the snapshot (``epoch``
  unchanged): the records are still those the pass saw, so its plan is the
  one a full step on the loop would have made then, and its reconciler,
  rebuilt from nothing, replaces the shell's. The next incremental step catches
  up with whatever changed since the snapshot by its identity walk, as after
  any step.
* **dropped** otherwise: its plan may repeat or contradict what was applied
  meanwhile (a replica placed twice, a generation issued twice). It starts
  again on the next cycle; after ``MAX_DROPPED`` drops in a row the shell runs
  the next one on the loop, as before, so a cluster that never stops changing
  still gets its safety net.

The thread shares the GIL with the loop, which gets it back at least every
``sys.getswitchinterval()`` (5 ms) while the pass runs: an incremental step of
tens of milliseconds takes perhaps twice as long, instead of waiting out the
whole pass. Nothing here is shared with the loop while the pass runs: the
snapshot's mappings are copies, and the records in them are never changed in
place (a new record is a new object).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.shared.schemas import DeploymentSpec, Lease, NodeRecord, Replica
from llmgw.shared.tasks import cancel_and_wait

from .cycle import ReconcileConfig
from .incremental import Reconciler
from .plan import NodeFailure, Plan

# Full passes dropped in a row (the shell applied a plan while each ran) before
# the next runs on the loop, holding it up as before but never skipped for good.
MAX_DROPPED = 3


@dataclass(frozen=True)
class Snapshot:
    """A full step's inputs, copied on the loop when the pass starts."""

    deployments: Mapping[str, DeploymentSpec]
    base: Mapping[str, Replica]  # the replica records as stored
    replicas: Mapping[str, Replica]  # the same with the agents' reports folded in
    nodes: Mapping[str, NodeRecord]
    leases: Mapping[str, Lease]
    now: float
    failures: Mapping[str, Sequence[NodeFailure]]

    @classmethod
    def copy(cls, deployments, base, replicas, nodes, leases, now: float, failures) -> Snapshot:
        return cls(dict(deployments), dict(base), dict(replicas), dict(nodes), dict(leases), now, {n: list(fs) for n, fs in failures.items()})


@dataclass(frozen=True)
class Outcome:
    """An adopted full pass: the reconciler it rebuilt, its plan, and what it saw."""

    reconciler: Reconciler
    plan: Plan
    snapshot: Snapshot
    took: float  # seconds of wall time, on the worker thread


class FullPass:
    """At most one full pass in a worker thread, and whether its result may be used."""

    def __init__(self, config: ReconcileConfig, log: logging.Logger):
        self.config = config
        self.log = log
        self.task: asyncio.Task | None = None
        self.epoch = -1  # the shell's epoch when the running (or ended) pass took its snapshot
        self.dropped = 0  # dropped in a row, since the last adopted or on-loop full pass
        self._inputs: tuple[Reconciler, Snapshot] | None = None  # the running (or ended) pass's

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def ended(self) -> bool:
        return self.task is not None and self.task.done()

    def start(self, snapshot: Snapshot, epoch: int, on_end: Callable[[], None]) -> None:
        """Compute a full step of ``snapshot`` in a worker thread; ``on_end`` is
        called on the loop when it has ended (the shell wakes to collect it)."""
        if self.running:
            raise RuntimeError("a full pass is already running")
        reconciler = Reconciler(self.config)
        self.epoch = epoch

        async def run() -> tuple[Plan, float]:
            started = time.monotonic()
            plan = await asyncio.to_thread(self.compute, reconciler, snapshot)
            return plan, time.monotonic() - started

        self.task = asyncio.create_task(run())
        self._inputs = (reconciler, snapshot)
        self.task.add_done_callback(lambda _t: on_end())

    def compute(self, reconciler: Reconciler, snapshot: Snapshot) -> Plan:
        """The full step itself; runs on the worker thread."""
        s = snapshot
        return reconciler.step(s.deployments, s.replicas, s.nodes, s.leases, s.now, failures=s.failures, full=True)

    def collect(self, epoch: int) -> Outcome | None:
        """The ended pass, if it may be adopted at ``epoch`` (the shell's now);
        None when it was dropped (or failed). Either way it is done with."""
        task, self.task = self.task, None
        inputs, self._inputs = self._inputs, None
        if task is None or inputs is None or not task.done():
            raise RuntimeError("no full pass has ended")
        if task.cancelled():
            return None
        error = task.exception()
        if error is not None:
            # A bug in the pure core: the same step on the loop would raise it too.
            self.dropped += 1
            self.log.error("the full reconcile pass failed beside the loop: %r", error, exc_info=error)
            return None
        plan, took = task.result()
        if epoch != self.epoch:
            self.dropped += 1
            self.log.debug("full pass dropped: a plan was applied while it ran (%d in a row)", self.dropped)
            return None
        self.dropped = 0
        return Outcome(inputs[0], plan, inputs[1], took)

    @property
    def must_run_on_loop(self) -> bool:
        return self.dropped >= MAX_DROPPED

    def ran_on_loop(self) -> None:
        """The shell ran a full step on the loop: the drops in a row start afresh."""
        self.dropped = 0

    async def stop(self) -> None:
        """Forget a running pass. Its thread cannot be interrupted: it ends on its
        own (a second or two), and the loop's executor waits for it at close."""
        task, self.task = self.task, None
        self._inputs = None
        if task is not None:
            await cancel_and_wait([task])
