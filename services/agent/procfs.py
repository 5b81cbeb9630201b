"""Process facts from ``/proc``: start times, liveness, and signals that never hit a reused pid.

A pid alone does not name a process: after an engine exits, the kernel hands its
number to the next process that starts. An agent that adopted or signalled by pid
alone could take over, or kill, an unrelated process after a restart. So every
process the supervisor remembers is remembered as (pid, start time), the start
time being field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), which two
processes holding the same pid one after the other cannot share.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["ProcStat", "is_alive", "signal_group", "start_time", "stat"]


@dataclass(frozen=True)
class ProcStat:
    state: str  # field 3: R, S, D, Z (zombie), X (dead), …
    pgid: int  # field 5
    start_time: int  # field 22


def stat(pid: int) -> ProcStat | None:
    """The facts of a running (or zombie) process, None when there is no such pid."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # gone (ENOENT, ESRCH) or not ours to read: either way not adoptable
        return None
    # Field 2 (comm) is in parentheses and may itself contain ") ", so split
    # after the last ')'. What follows starts at field 3.
    end = data.rfind(b")")
    if end < 0:
        return None
    rest = data[end + 2 :].split()
    try:
        return ProcStat(state=rest[0].decode(), pgid=int(rest[2]), start_time=int(rest[19]))
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    st = stat(pid)
    return st.start_time if st else None


def is_alive(pid: int, started: int) -> bool:
    """True when ``pid`` is still the very process that started at ``started``.

    A zombie counts as dead: it has exited and only waits to be reaped.
    """
    st = stat(pid)
    return st is not None and st.start_time == started and st.state not in ("Z", "X")


def signal_group(pgid: int, started: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the process group led by ``pgid``, if its leader is the one we started.

    The whole group, because real engines fork workers that must go with them.
    Returns False (and signals nothing) when the leader is gone or its pid now
    belongs to someone else. The check and the kill are two system calls; the
    window between them is the kernel's pid reuse over microseconds, which is
    as close as process groups allow (pidfds name processes, not groups).
    """
    if not is_alive(pgid, started):
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
