"""The simulated engine's batch: admission, token pacing, and the NCCL-like stall.

Every decode step is a "collective" across the group. While all ranks are
present it costs ``1/token_rate`` seconds; once a rank is lost the collective
never completes, so requests in flight and new ones hang rather than fail -
which is how a real multi-node engine behaves when a peer dies, and what the
control plane has to detect by other means than /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from .metrics import EngineMetrics
from .tokens import Answer

# Below this a step's delay is not worth a timer; the step still yields.
MIN_DELAY = 1e-4


class EngineCore:
    def __init__(self, metrics: EngineMetrics, token_rate: float, max_num_seqs: int):
        self.metrics = metrics
        delay = 1.0 / token_rate if token_rate > 0 else 0.0
        self.step_delay = delay if delay >= MIN_DELAY else 0.0
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._intact = asyncio.Event()
        self._intact.set()
        self.broken_because: str | None = None

    def break_group(self, why: str) -> None:
        """A rank is gone: from now on every collective hangs."""
        self.broken_because = why
        self._intact.clear()

    async def collective(self) -> None:
        await self._intact.wait()

    @contextlib.asynccontextmanager
    async def admit(self, prompt_tokens: int) -> AsyncIterator[Sequence]:
        """A running batch slot for one request; waits while the batch is full."""
        m = self.metrics
        seq = Sequence(self, prompt_tokens)
        m.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            m.waiting.dec()
        m.running.inc()
        try:
            yield seq
        finally:
            m.running.dec()
            self._slots.release()
            if seq.finish_reason is None:
                m.finished("abort")  # client went away or the engine is stopping


class Sequence:
    """One request in the batch: paces its steps and records its metrics."""

    def __init__(self, core: EngineCore, prompt_tokens: int):
        self.core = core
        self.prompt_tokens = prompt_tokens
        self.arrived = time.monotonic()
        self.steps = 0
        self.finish_reason: str | None = None

    async def step(self, tokens: int) -> None:
        """One decode step producing ``tokens`` tokens (one per unfinished choice)."""
        if self.core.step_delay:
            await asyncio.sleep(self.core.step_delay)
        else:
            await asyncio.sleep(0)
        await self.core.collective()
        m = self.core.metrics
        if self.steps == 0:
            m.prompt_tokens.inc(self.prompt_tokens)
            m.ttft.observe(time.monotonic() - self.arrived)
        self.steps += 1
        m.generation_tokens.inc(tokens)

    async def decode(self, answers: list[Answer]) -> AsyncIterator[list[tuple[int, str]]]:
        """Per step, ``(choice index, token)`` for every choice still generating."""
        longest = max(a.length for a in answers)
        for i in range(longest):
            batch = [(j, a.token(i)) for j, a in enumerate(answers) if i < a.length]
            await self.step(len(batch))
            yield batch

    def finish(self, answers: list[Answer]) -> None:
        # vLLM counts a request once, by the reason its (first) choice ended.
        self.finish_reason = answers[0].finish_reason
        self.core.metrics.finished(self.finish_reason)
        self.core.metrics.e2e.observe(time.monotonic() - self.arrived)
