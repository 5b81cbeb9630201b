"""Launches that name a weights source: stage first, then start the engine on the copy.

A launch without a weights source goes straight to the supervisor. One with a
source is checked as the supervisor would (fenced, stale, GPUs) and then:

* its weights are in the node's model cache: the engine starts at once,
  pointed at the cached copy and told so (``adapters.Weights.cached``);
* they are not: the launch is acknowledged at once (a copy may take minutes;
  the scheduler's command timeout is seconds, and the replica's
  ``startup_timeout`` is what bounds the whole), the member is reported
  ``starting`` with the copy's progress as its detail, and the engine starts
  when the copy is complete — or the member is reported ``exited`` with why
  (source unreadable, copy failed, launch refused after the copy).

A stop that arrives while a member waits for its weights ends the wait (the
copy itself runs on: the weights are useful to the next launch). Pre-staging
(``StageCommand``) is the same copy with no engine waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.shared.errors import LlmgwError
from llmgw.shared.schemas import CommandAck, EngineFact, LaunchCommand, StageCommand
from llmgw.shared.states import EngineState

from .adapters import Weights
from .enginedir import dir_name
from .staging import Outcome, Stager, WeightsUnavailable, resolve
from .supervisor import EngineKey, Supervisor

log = logging.getLogger("llmgw.agent.weights")

WEIGHTS_UNAVAILABLE = WeightsUnavailable.code


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class _Waiting:
    """A member whose engine starts once its weights are here."""

    cmd: LaunchCommand
    source: str
    task: asyncio.Task | None = None
    since: float = field(default_factory=time.time)
    state: EngineState = EngineState.STARTING
    detail: str = ""


class WeightsLauncher:
    def __init__(self, supervisor: Supervisor, stager: Stager, *, on_change: Callable[[EngineFact], None]):
        self.supervisor = supervisor
        self.stager = stager
        self.on_change = on_change
        self.waiting: dict[EngineKey, _Waiting] = {}
        # How each launch with a source found its weights, for logs and tests: "hit" | "staged" | "uncached".
        self.outcomes: dict[EngineKey, str] = {}

    # -- facts ---------------------------------------------------------------------
    def facts(self) -> list[EngineFact]:
        """The members waiting for their weights (not yet the supervisor's)."""
        return [self._fact(w) for k, w in sorted(self.waiting.items()) if not self.supervisor.has(k)]

    def _fact(self, w: _Waiting) -> EngineFact:
        c = w.cmd
        detail = w.detail
        if w.state == EngineState.STARTING:
            p = self.stager.progress(w.source)
            detail = f"staging weights {w.source}: {_size(p[0])} of {_size(p[1])} ({100 * p[0] // max(p[1], 1)}%)" if p else "waiting for its weights"
        return EngineFact(
            replica_id=c.replica_id,
            generation=c.generation,
            deployment=c.deployment,
            rank=c.rank,
            serves_http=c.rank == 0,
            state=w.state,
            detail=detail,
            gpus=list(c.gpus),
            http_port=c.http_port,
            rendezvous_port=c.rendezvous_port,
            since=w.since,
        )

    def progressed(self) -> None:
        """A copy moved on: members waiting for it report its progress."""
        for k, w in self.waiting.items():
            if w.state == EngineState.STARTING and not self.supervisor.has(k):
                self.on_change(self._fact(w))

    # -- commands --------------------------------------------------------------------
    async def launch(self, cmd: LaunchCommand, node_gpus: set[int]) -> CommandAck:
        if not (cmd.weights_path or cmd.weights_model):
            return await self.supervisor.launch(cmd, node_gpus)
        key = (cmd.replica_id, cmd.generation, cmd.rank)
        label = dir_name(*key)
        if self.supervisor.has(key):
            return await self.supervisor.launch(cmd, node_gpus)  # its idempotence, its conflicts
        w = self.waiting.get(key)
        if w is not None:
            if w.cmd != cmd:
                return CommandAck(ok=False, code="launch_conflict", reason=f"{label} already waits here for its weights under a different launch command")
            return CommandAck(ok=True, reason=f"already launched: {label} waits for its weights ({self._fact(w).detail}); nothing started")
        refusal = self.supervisor.precheck(cmd, node_gpus)
        if refusal is not None:
            log.warning("launch of %s refused (%s): %s", label, refusal.code, refusal.reason)
            return refusal
        try:
            source = resolve(cmd.weights_path, cmd.weights_model, self.stager.mirror)
        except WeightsUnavailable as e:
            log.warning("launch of %s refused (%s): %s", label, e.code, e)
            return CommandAck(ok=False, code=e.code, reason=str(e))
        w = self.waiting[key] = _Waiting(cmd, source.key)
        staging = asyncio.create_task(self.stager.ensure(source), name=f"weights-{label}")
        # Cached (or no cache): the answer is quick, the engine starts within this command.
        done, _ = await asyncio.wait({staging}, timeout=0.5)
        if done:
            del self.waiting[key]
            try:
                outcome = staging.result()
            except LlmgwError as e:
                log.warning("launch of %s refused (%s): %s", label, e.code, e)
                return CommandAck(ok=False, code=e.code, reason=str(e))
            return await self._start(cmd, node_gpus, outcome)
        w.task = asyncio.create_task(self._wait_then_start(key, w, staging, node_gpus), name=f"launch-{label}")
        self.on_change(self._fact(w))
        return CommandAck(ok=True, reason=f"staging the weights of {label} ({source.key}) into this node's model cache; the engine starts when they are here")

    async def _start(self, cmd: LaunchCommand, node_gpus: set[int], outcome: Outcome) -> CommandAck:
        key = (cmd.replica_id, cmd.generation, cmd.rank)
        self.outcomes[key] = outcome.how
        if outcome.why:
            log.warning("%s reads its weights from %s, not the model cache: %s", dir_name(*key), outcome.dir, outcome.why)
        return await self.supervisor.launch(cmd, node_gpus, Weights(outcome.dir, cached=outcome.cached))

    async def _wait_then_start(self, key: EngineKey, w: _Waiting, staging: asyncio.Task, node_gpus: set[int]) -> None:
        label = dir_name(*key)
        try:
            outcome = await staging
            ack = await self._start(w.cmd, node_gpus, outcome)
            if ack.ok:
                del self.waiting[key]
                return
            why = f"launch refused after its weights were staged ({ack.code}): {ack.reason}"
        except LlmgwError as e:
            why = f"its weights could not be staged: {e}"
        except asyncio.CancelledError:
            if self.waiting.get(key) is w:
                del self.waiting[key]
            raise
        log.warning("%s: %s", label, why)
        w.state, w.detail, w.since = EngineState.EXITED, why, time.time()
        self.on_change(self._fact(w))

    async def stop(self, replica_id: str, generation: int) -> list[str]:
        """End the waits of this replica's members (generation <= ``generation``; 0: all)."""
        ended = []
        for key, w in list(self.waiting.items()):
            if key[0] == replica_id and (generation == 0 or key[1] <= generation):
                del self.waiting[key]
                if w.task is not None:
                    w.task.cancel()
                if w.state == EngineState.STARTING:
                    w.state, w.detail, w.since = EngineState.EXITED, "stopped while it waited for its weights", time.time()
                    self.on_change(self._fact(w))
                ended.append(dir_name(*key))
        return ended

    async def stage(self, cmd: StageCommand) -> CommandAck:
        """Pre-stage: start the copy (if not cached) and answer at once."""
        try:
            source = resolve(cmd.weights_path, cmd.weights_model, self.stager.mirror)
        except WeightsUnavailable as e:
            return CommandAck(ok=False, code=e.code, reason=str(e))
        if self.stager.cache is None:
            return CommandAck(ok=False, code="no_cache", reason="this agent keeps no model cache (no cache section in its configuration)")
        task = asyncio.create_task(self.stager.ensure(source), name=f"prestage-{source.key}")
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done:
            task.add_done_callback(_log_prestage)
            return CommandAck(ok=True, reason=f"staging {source.key}{f' ({cmd.reason})' if cmd.reason else ''}; progress in this node's inventory and events")
        try:
            outcome = task.result()
        except LlmgwError as e:
            return CommandAck(ok=False, code=e.code, reason=str(e))
        if outcome.how == "uncached":
            return CommandAck(ok=False, code="not_cached", reason=f"{source.key} is not cached here: {outcome.why}")
        return CommandAck(ok=True, reason=f"{source.key} is {'already ' if outcome.how == 'hit' else ''}in this node's model cache")

    async def close(self) -> None:
        tasks = [w.task for w in self.waiting.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.stager.close()


def _log_prestage(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        log.warning("pre-staging failed: %s", e)
    elif task.result().how == "uncached":
        log.warning("pre-staging did not cache: %s", task.result().why)
