"""The simulated engine's batch: admission, token pacing, and the NCCL-like stall.

Every decode step is a collective across the group, as a tensor- or
pipeline-parallel step is: on a multi-node leader one stepper runs the steps
for the whole running batch (one collective per step, not per request), and a
step completes only when every worker has acknowledged it over its rendezvous
link. A worker that does not answer (SIGSTOPped, or stalled by SIGUSR1) holds
every step - and so every request - for as long as it does not answer, and
nothing is logged about a lost peer: a slow collective is not a lost one, as
with NCCL. Only a link that drops, or stays silent past the peer timeout, is a
lost peer (see rendezvous.py); then the group is broken for good.

A single-node engine has no collective to wait on: each request paces its own
steps, which costs nothing the gateway benchmark would notice.

Prefill and the prefix cache (both off unless asked for, so nothing changes
for those who do not): with ``cache_tokens`` > 0 the engine keeps an LRU of
prompt blocks (``block_size`` tokens each, as vLLM's paged KV cache does),
each block named by a hash chained over the blocks before it, so a block is
found only after the same prompt start. A request's prompt tokens are looked
up when it is scheduled; the longest run of cached leading blocks is a hit
(never the whole prompt: as in vLLM, the last token is always computed), and
``vllm:prefix_cache_queries``/``_hits`` count the tokens. With
``prefill_rate`` > 0 the uncached tokens then cost ``uncached/prefill_rate``
seconds, one prefill chunk (``PREFILL_CHUNK`` tokens) at a time per engine,
the prompts waiting taking turns chunk by chunk as vLLM's chunked prefill
does (prefill is compute-bound: a GPU does not prefill two long prompts
faster than one after the other), so a busy replica's time to first token
grows with the uncached prompt tokens queued before it.

Stalls, all of which leave ``/health`` answering 200:

* a lost rank (``break_group``): every step hangs from then on;
* a silent stall (``stall``, SIGUSR1 to the leader): every step hangs, with no
  log line about peers, until ``resume`` (SIGUSR2) - what a hung collective
  looks like from outside;
* a worker that stops acknowledging steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Sequence as Seq

from .metrics import EngineMetrics
from .tokens import Answer

# Below this a step's delay is not worth a timer; the step still yields.
MIN_DELAY = 1e-4
# Prompt tokens prefilled per step (vLLM's chunked prefill): between steps the
# other prefills waiting get their turn.
PREFILL_CHUNK = 512

Collective = Callable[[], Awaitable[None]]


class PrefixCache:
    """An LRU of prompt blocks: ``capacity`` tokens in blocks of ``block_size``.

    A block's name is Python's hash of (the previous block's name, its tokens):
    stable within the engine's process, which is all a per-replica cache needs."""

    def __init__(self, capacity_tokens: int, block_size: int):
        self.block_size = block_size
        self.capacity = max(capacity_tokens // block_size, 0)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def names(self, ids: Seq) -> list[int]:
        """The chained names of the full blocks of ``ids``."""
        bs, out, prev = self.block_size, [], 0
        for i in range(0, len(ids) - bs + 1, bs):
            prev = hash((prev, tuple(ids[i : i + bs])))
            out.append(prev)
        return out

    def hit(self, names: list[int], tokens: int) -> int:
        """Cached tokens at the start of a prompt of ``tokens`` tokens named ``names`` (touched as used)."""
        usable = max(tokens - 1, 0) // self.block_size  # the last token is always computed
        n = 0
        for name in names[:usable]:
            if name not in self.blocks:
                break
            self.blocks.move_to_end(name)
            n += 1
        return n * self.block_size

    def insert(self, names: list[int]) -> None:
        blocks = self.blocks
        for name in names:
            if name in blocks:
                blocks.move_to_end(name)
            else:
                blocks[name] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    @property
    def usage(self) -> float:
        return len(self.blocks) / self.capacity if self.capacity else 0.0


class EngineCore:
    def __init__(
        self,
        metrics: EngineMetrics,
        token_rate: float,
        max_num_seqs: int,
        collective: Collective | None = None,
        *,
        prefill_rate: float = 0.0,
        cache_tokens: int = 0,
        block_size: int = 16,
    ):
        self.metrics = metrics
        self.prefill_rate = prefill_rate
        self.cache = PrefixCache(cache_tokens, block_size) if cache_tokens > 0 else None
        self._prefill = asyncio.Lock()
        delay = 1.0 / token_rate if token_rate > 0 else 0.0
        self.step_delay = delay if delay >= MIN_DELAY else 0.0
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._intact = asyncio.Event()
        self._intact.set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.broken_because: str | None = None
        self.stalled_because: str | None = None
        # The group's collective (the leader of a multi-node group): run once
        # per decode step for the whole batch by the stepper.
        self._collective = collective
        self._next: asyncio.Future | None = None
        self._arrived = asyncio.Event()
        self._stepper: asyncio.Task | None = None
        self.steps = 0

    # -- faults ----------------------------------------------------------------
    def break_group(self, why: str) -> None:
        """A rank is gone: from now on every collective hangs."""
        self.broken_because = why
        self._intact.clear()

    def stall(self, why: str) -> None:
        """Stop producing tokens, silently, until ``resume``."""
        self.stalled_because = why
        self._flowing.clear()

    def resume(self) -> None:
        self.stalled_because = None
        self._flowing.set()

    async def _gate(self) -> None:
        await self._intact.wait()
        await self._flowing.wait()

    # -- steps -------------------------------------------------------------------
    async def step(self) -> None:
        """Wait for the next decode step of the batch to complete."""
        if self._collective is None:
            if self.step_delay:
                await asyncio.sleep(self.step_delay)
            else:
                await asyncio.sleep(0)
            await self._gate()
            return
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._arrived.set()
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._run_steps(self._collective), name="sim-stepper")
        # Shielded: a request that goes away must not cancel everyone's step.
        await asyncio.shield(self._next)

    async def _run_steps(self, collective: Callable[[], Awaitable[None]]) -> None:
        while True:
            await self._arrived.wait()
            if self.step_delay:
                await asyncio.sleep(self.step_delay)
            else:
                await asyncio.sleep(0)
            # Requests arriving from here on wait for the step after this one.
            done, self._next = self._next, None
            self._arrived.clear()
            await self._gate()
            await collective()
            self.steps += 1
            if done is not None and not done.done():
                done.set_result(None)

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stepper

    async def prefill(self, prompts: Seq[Seq]) -> None:
        """Look the prompts up in the prefix cache and spend the prefill of what was not in it."""
        cache = self.cache
        if cache is None and not self.prefill_rate:
            return
        lock = self._prefill
        held = False
        try:
            if self.prefill_rate:
                await lock.acquire()  # scheduled now: looked up now
                held = True
            total = hits = 0
            named = []
            for ids in prompts:
                total += len(ids)
                if cache is not None:
                    names = cache.names(ids)
                    hits += cache.hit(names, len(ids))
                    named.append(names)
            if cache is not None:
                self.metrics.prefix_queries.inc(total)
                self.metrics.prefix_hits.inc(hits)
            # Chunked prefill, as vLLM schedules it: PREFILL_CHUNK tokens a step, the
            # prefills waiting taking turns (the lock is FIFO), so a short one is not
            # stuck behind a long one.
            left = total - hits if self.prefill_rate else 0
            while left > 0:
                n = min(left, PREFILL_CHUNK)
                await asyncio.sleep(n / self.prefill_rate)
                await self._gate()  # prefill is collective work too
                left -= n
                if left > 0 and lock._waiters:
                    lock.release()
                    held = False
                    await lock.acquire()
                    held = True
            if cache is not None:
                for names in named:
                    cache.insert(names)
                self.metrics.kv_usage.set(cache.usage)
        finally:
            if held:
                lock.release()

    def reset_prefix_cache(self) -> None:
        if self.cache is not None:
            self.cache.blocks.clear()
            self.metrics.kv_usage.set(0.0)

    @contextlib.asynccontextmanager
    async def admit(self, prompt_tokens: int, prompts: Seq[Seq] = ()) -> AsyncIterator[Sequence]:
        """A running batch slot for one request (prefilled: ``prompts`` are its prompts'
        tokens); waits while the batch is full."""
        m = self.metrics
        seq = Sequence(self, prompt_tokens)
        m.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            m.waiting.dec()
        m.running.inc()
        try:
            await self.prefill(prompts)
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
        await self.core.step()
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
