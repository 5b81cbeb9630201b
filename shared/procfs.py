"""Process facts from ``/proc``: start times, liveness, and signals that never hit a reused pid.

A pid alone does not name a process: after an engine exits, the kernel hands its
number to the next process that starts. An agent that adopted or signalled by pid
alone could take over, or kill, an unrelated process after a restart. So every
process the supervisor remembers is remembered as (pid, start time), the start
time being field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), which two
processes holding the same pid one after the other cannot share.

In shared/ because two sides read the same facts: the agent (its supervisor and
the engine wrapper) and the dev cluster's ``llmgw up``/``down``, which records
and stops what it started by the same (pid, start time).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["ProcStat", "describe", "holders", "is_alive", "signal_group", "socket_inodes", "start_time", "stat", "tree"]


@dataclass(frozen=True)
class ProcStat:
    state: str  # field 3: R, S, D, Z (zombie), X (dead), …
    pgid: int  # field 5
    start_time: int  # field 22
    ppid: int = 0  # field 4
    sid: int = 0  # field 6: the session


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
        return ProcStat(state=rest[0].decode(), pgid=int(rest[2]), start_time=int(rest[19]), ppid=int(rest[1]), sid=int(rest[3]))
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


# -- who holds a socket ----------------------------------------------------------
# A listening socket is proved to be an engine's by its inode: the kernel's
# socket table (shared/procnet.py) gives the inode of each listener, and
# /proc/<pid>/fd/* of the process holding it links to "socket:[inode]".


def _pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open; empty when gone or not ours to read."""
    out: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                pass
    return out


def tree(pid: int) -> set[int]:
    """``pid``, its descendants and the members of its process group: the engine's processes.

    Engines fork (vLLM's API server and engine core, uvicorn workers) and the
    listening socket may sit in any of them; a descendant that left the group
    (setsid) is still found through its parent.
    """
    children: dict[int, list[int]] = {}
    found = {pid}
    for p in _pids():
        st = stat(p)
        if st is None or st.state in ("Z", "X"):
            continue
        children.setdefault(st.ppid, []).append(p)
        if st.pgid == pid:
            found.add(p)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def holders(inodes: set[int]) -> dict[int, int]:
    """inode -> pid of a process holding it, for as many of ``inodes`` as can be seen.

    Reads every process's fd table, so it is used only once a socket is known
    not to be ours. A process of another user whose fds cannot be read is not
    found (the agent runs as root on a real node and sees everyone).
    """
    out: dict[int, int] = {}
    left = set(inodes)
    for p in _pids():
        if not left:
            break
        held = socket_inodes(p) & left
        for i in held:
            out[i] = p
        left -= held
    return out


def describe(pid: int, limit: int = 120) -> str:
    """``pid``'s command line (or its name when that cannot be read), for a message."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if argv:
        argv[0] = os.path.basename(argv[0])
        text = " ".join(argv)
    else:
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return "command unknown"
    return text if len(text) <= limit else text[: limit - 1] + "…"
