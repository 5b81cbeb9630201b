"""Waiting on conditions, never on time.

Every wait in the suite goes through ``eventually``: it polls an observation until
it holds and, when it does not within the timeout, fails saying what it waited for,
what it expected and the last value it saw. Nothing here imports pytest, so
``bench/`` helpers may use it too.

The rule the suite keeps (docs/testing.md): a wait's condition is as strong as
the assertion after it. Wait for the exact value you will assert, or assert
inside the wait — never for "something arrived" followed by an assertion on
what arrived.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

_UNSET: Any = object()


def _describe(what: str, timeout: float, last: Any, expected: Any, error: BaseException | None) -> str:
    msg = f"{what}: not reached within {timeout:g}s; last seen: {last!r}"
    if expected is not _UNSET:
        msg += f"; expected: {expected!r}"
    if error is not None:
        msg += f"; last error: {error!r}"
    return msg


def _holds(value: Any, expected: Any) -> bool:
    return bool(value) if expected is _UNSET else value == expected


async def eventually(
    observe: Callable[[], Any],
    expected: Any = _UNSET,
    *,
    what: str = "condition",
    timeout: float = 10.0,
    interval: float = 0.02,
    pause: Callable[[float], Awaitable[Any]] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``observe()`` (sync, or returning an awaitable) until it is truthy, or
    equal to ``expected`` when given; return that value.

    ``pause`` is how to let time pass between looks (``asyncio.sleep`` unless a
    Textual pilot's ``pause`` is given, which also lets the app process messages).
    Exceptions of the types in ``ignore`` count as "not yet" (and are reported
    if the wait fails).
    """
    pause = pause or asyncio.sleep
    deadline = time.monotonic() + timeout
    last: Any = _UNSET
    error: BaseException | None = None
    while True:
        try:
            value = observe()
            if inspect.isawaitable(value):
                value = await value
        except ignore as e:
            error = e
        else:
            last, error = value, None
            if _holds(value, expected):
                return value
        if time.monotonic() > deadline:
            raise AssertionError(_describe(what, timeout, None if last is _UNSET else last, expected, error))
        await pause(interval)


def eventually_sync(
    observe: Callable[[], Any],
    expected: Any = _UNSET,
    *,
    what: str = "condition",
    timeout: float = 10.0,
    interval: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """``eventually`` for synchronous tests (blocks the thread between looks)."""
    deadline = time.monotonic() + timeout
    last: Any = _UNSET
    error: BaseException | None = None
    while True:
        try:
            value = observe()
        except ignore as e:
            error = e
        else:
            last, error = value, None
            if _holds(value, expected):
                return value
        if time.monotonic() > deadline:
            raise AssertionError(_describe(what, timeout, None if last is _UNSET else last, expected, error))
        time.sleep(interval)


async def passes(
    check: Callable[[], Any],
    *,
    what: str = "assertions",
    timeout: float = 10.0,
    interval: float = 0.02,
    pause: Callable[[float], Awaitable[Any]] | None = None,
) -> Any:
    """Run ``check()`` (assertions on a live view; sync or async) until it stops raising
    AssertionError; return its result. The wait is then exactly as strong as the
    assertions, by construction. On timeout, fail with the last assertion's message."""
    pause = pause or asyncio.sleep
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            return value
        except AssertionError as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still failing after {timeout:g}s: {e}") from e
        await pause(interval)
