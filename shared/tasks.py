"""Ending background tasks for sure.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives in the
same loop turn as its inner future completing: it returns the result instead of
raising ``CancelledError`` (fixed in 3.12, whose ``wait_for`` is built on
``asyncio.timeout``). nats-py wraps every request, flush and watcher read in
``wait_for``, so a reader task cancelled at the moment its message arrives
carries on as if never asked to stop — and an ``await task`` after a single
``cancel()`` waits for ever on a loop that looks idle. Cancelling again until the
task is done ends it at its next ``await``; the bound keeps a stop from hanging
on a task that does not end at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_EVERY = 0.05  # seconds between cancels of a task that is still running


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], timeout: float = 5.0) -> set[asyncio.Task]:
    """Cancel ``tasks`` (``None``s are skipped) and wait up to ``timeout`` seconds for
    them to end, cancelling again those that swallowed a cancel. Returns the tasks
    still running at the deadline (none, normally); never raises their exceptions."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY, left))
    for t in given:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: a task that failed on its way out is not logged as unretrieved
    return pending
