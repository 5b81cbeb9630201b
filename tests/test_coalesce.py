"""The coalescing selector: waits that would block nap first, ready work never does.

Only lower bounds and generous upper bounds are asserted (a nap of 2-5 s against
an answer expected at once), so load cannot make these fail.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from llmgw.services.runtime import LOOP_ENV, event_loop_runner
from llmgw.shared.coalesce import CoalescingSelector

WINDOW = 0.2


@pytest.fixture
def pair():
    r, w = socket.socketpair()
    r.setblocking(False)
    yield r, w
    r.close()
    w.close()


def test_a_wait_that_would_block_naps_first_and_returns_what_arrived(pair):
    r, w = pair
    sel = CoalescingSelector(WINDOW)
    sel.register(r, 1)
    try:
        w.sendall(b"a")
        w.sendall(b"b")
        t0 = time.monotonic()
        ready = sel.select(None)
        assert time.monotonic() - t0 >= WINDOW
        assert [key.fileobj for key, _ in ready] == [r]
        assert r.recv(16) == b"ab"  # both, in the one wake
    finally:
        sel.close()


def test_ready_work_and_the_next_timer_are_not_delayed_by_the_window(pair):
    r, w = pair
    sel = CoalescingSelector(5.0)
    sel.register(r, 1)
    try:
        w.sendall(b"a")
        t0 = time.monotonic()
        assert sel.select(0)  # the loop has work: poll, never nap
        assert time.monotonic() - t0 < 2.5
        r.recv(16)
        t0 = time.monotonic()
        assert sel.select(0.05) == []  # the loop's next timer is in 50 ms: nap no longer
        assert 0.05 <= time.monotonic() - t0 < 2.5
    finally:
        sel.close()


def test_a_service_with_a_window_runs_on_the_coalescing_loop(monkeypatch):
    monkeypatch.delenv(LOOP_ENV, raising=False)

    async def where():
        t0 = time.monotonic()
        await asyncio.sleep(0.05)  # a timer shorter than the window fires on time
        return type(asyncio.get_running_loop()._selector), time.monotonic() - t0  # type: ignore[attr-defined]

    kind, slept = event_loop_runner("asyncio", 5.0)(where())
    assert kind is CoalescingSelector and slept < 2.5
    assert event_loop_runner("asyncio", 0.0) is asyncio.run


def test_a_window_out_of_bounds_is_refused():
    with pytest.raises(ValueError, match="must be more than 0"):
        CoalescingSelector(0)
