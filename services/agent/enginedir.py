"""One engine's directory under the agent's ``work_dir``: what it runs, as which process, how it ended.

``<work_dir>/engines/<replica_id>.g<generation>.r<rank>/``

================  ===========================================================  ==========
file              what                                                         written by
================  ===========================================================  ==========
``spec.json``     the LaunchCommand, the built argv/env, serves_http, the      agent
                  health URL
``pid``           engine pid + start time, wrapper pid + start time (JSON)     wrapper
``engine.log``    the engine's stdout and stderr (and the wrapper's)           both
``exit_code``     the engine's exit status; negative = killed by that signal   wrapper
``stop``          a stop was requested (reason, time): a restarted agent       agent
                  finishes it instead of adopting the engine as wanted
================  ===========================================================  ==========

The directory is the engine's record: it outlives the agent, and a new agent
rebuilds its view from it alone. Every file but the log is written atomically
(temporary file, fsync, rename), so a reader, or an agent killed halfway,
never sees half a file.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import msgspec

from llmgw.shared.errors import WireError
from llmgw.shared.files import write_atomic
from llmgw.shared.schemas import Base, LaunchCommand, decode, encode

__all__ = [
    "EngineDir",
    "EngineSpec",
    "PidRecord",
    "StopRequest",
    "atomic_write",
    "check_replica_id",
    "dir_name",
    "tail_lines",
]

SPEC = "spec.json"
PID = "pid"
LOG = "engine.log"
EXIT_CODE = "exit_code"
STOP = "stop"

# A replica id becomes a path component: no separators, no leading dot, bounded.
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

# A log tail travels in status reports, whose payload NATS caps at 1 MiB: an
# engine printing megabyte lines must not make its own exit unreportable.
MAX_LINE_CHARS = 2000
MAX_TAIL_BYTES = 32 * 1024


class EngineSpec(Base):
    command: LaunchCommand
    argv: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)  # only what llmgw sets, on top of the agent's environment
    serves_http: bool = False
    health_url: str = ""
    created_at: float = 0.0
    # The address the engine was told to bind (--host): the first of the
    # node's mgmt_addr addresses that is this machine's, at launch. A socket
    # does not move when DNS changes, so the ownership and health checks of
    # this engine look here for its life. "" in specs written before names
    # were resolved: the agent's mgmt_addr, which then was an address.
    bind_addr: str = ""
    # What the member's leader address resolved to on this node at launch:
    # where the kernel shows a worker's connection to its leader's rendezvous.
    leader_addrs: list[str] = msgspec.field(default_factory=list)


class PidRecord(Base):
    pid: int  # the engine; also its process group id
    start_time: int
    wrapper_pid: int = 0
    wrapper_start_time: int = 0


class StopRequest(Base):
    reason: str = ""
    requested_at: float = 0.0


def check_replica_id(replica_id: str) -> str | None:
    """None when ``replica_id`` can name a directory, else why not."""
    if not _REPLICA_ID.fullmatch(replica_id):
        return f"replica id {replica_id!r} cannot name an engine directory: use up to 128 letters, digits, '_', '.' and '-', starting with a letter or digit"
    return None


def dir_name(replica_id: str, generation: int, rank: int) -> str:
    return f"{replica_id}.g{generation}.r{rank}"


def atomic_write(path: Path, data: bytes) -> None:
    # Durable before the rename: a restarted agent rebuilds its view from these files.
    write_atomic(path, data, mode=0o644, fsync=True)


def tail_lines(path: Path, lines: int, *, max_bytes: int = MAX_TAIL_BYTES) -> list[str]:
    """The last ``lines`` lines of a file, reading backwards (engine logs grow to gigabytes)."""
    if lines <= 0:
        return []
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        end = f.seek(0, os.SEEK_END)
        pos, buf = end, b""
        while pos > 0 and buf.count(b"\n") <= lines and len(buf) < max_bytes:
            step = min(8192, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
    text = buf[-max_bytes:].decode("utf-8", errors="replace")
    out = text.splitlines()
    if (pos > 0 or len(buf) > max_bytes) and out:
        out[0] = "…" + out[0]  # cut somewhere in its middle: say so rather than drop it
    out = out[-lines:]
    return [ln if len(ln) <= MAX_LINE_CHARS else ln[: MAX_LINE_CHARS - 1] + "…" for ln in out]


class EngineDir:
    """Typed access to the files of one engine directory."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def log_path(self) -> Path:
        return self.path / LOG

    def __repr__(self) -> str:
        return f"EngineDir({str(self.path)!r})"

    # -- spec ----------------------------------------------------------------
    def write_spec(self, spec: EngineSpec) -> None:
        atomic_write(self.path / SPEC, encode(spec))

    def read_spec(self) -> EngineSpec:
        """Raises ``WireError`` (malformed) or ``OSError`` (unreadable)."""
        return decode((self.path / SPEC).read_bytes(), EngineSpec)

    # -- pid -----------------------------------------------------------------
    def write_pid(self, rec: PidRecord) -> None:
        atomic_write(self.path / PID, encode(rec))

    def read_pid(self) -> PidRecord | None:
        """None while the wrapper has not written it yet; ``WireError`` when it is garbage."""
        try:
            data = (self.path / PID).read_bytes()
        except FileNotFoundError:
            return None
        return decode(data, PidRecord)

    # -- exit code -----------------------------------------------------------
    def write_exit_code(self, code: int) -> None:
        atomic_write(self.path / EXIT_CODE, f"{code}\n".encode())

    def read_exit_code(self) -> int | None:
        """None while the engine has not exited (or nobody could record how)."""
        try:
            text = (self.path / EXIT_CODE).read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return int(text)
        except ValueError:
            raise WireError("exit_code", f"{self.path / EXIT_CODE} holds {text[:40]!r}, not an integer") from None

    # -- stop ----------------------------------------------------------------
    def write_stop(self, reason: str) -> None:
        atomic_write(self.path / STOP, encode(StopRequest(reason=reason, requested_at=time.time())))

    def read_stop(self) -> StopRequest | None:
        try:
            data = (self.path / STOP).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode(data, StopRequest)
        except WireError:
            # Even a garbled request is a request: the file exists only because
            # someone asked for a stop.
            return StopRequest(reason="stop requested (unreadable stop file)")

    # -- whole directory -------------------------------------------------------
    def log_tail(self, lines: int) -> list[str]:
        return tail_lines(self.log_path, lines)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
