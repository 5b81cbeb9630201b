"""The engine wrapper: start one engine in its own process group and write down how it ended.

Run by the supervisor as ``python -m llmgw.services.agent.wrapper ENGINE_DIR``
in a new session, with the engine's environment. It execs nothing itself; it
starts ``spec.json``'s argv as a child, records the child's pid and start time
in ``pid``, waits, and writes the child's exit status to ``exit_code``.

Why a wrapper: an engine adopted by a restarted agent is not that agent's
child, so the agent cannot ``wait()`` for it and would never learn its exit
code. The wrapper is the engine's parent for its whole life, whoever the agent
is.

Why the engine gets a process group of its own, apart from the wrapper's: the
supervisor signals the engine's whole group (engines fork workers), and the
SIGKILL that ends a stuck engine must not end the wrapper that is to record
it. For the same reason the wrapper shrugs off SIGTERM, SIGINT and SIGHUP;
it exits by itself as soon as the engine has.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from llmgw.shared.procfs import start_time

from .enginedir import EngineDir, PidRecord

# Shell conventions, so an operator reading exit_code recognises them.
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def _note(log, text: str) -> None:
    log.write(f"[llmgw wrapper] {text}\n".encode())
    log.flush()


def run(engine_dir: Path) -> int:
    d = EngineDir(engine_dir)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # A handler, not SIG_IGN: an ignored signal stays ignored across exec,
        # so the engine would inherit it; a handled one is reset to default.
        signal.signal(sig, lambda *_: None)
    spec = d.read_spec()
    with open(d.log_path, "ab", buffering=0) as log:
        try:
            engine = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=d.path,
                process_group=0,
            )
        except OSError as e:
            code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_CANNOT_EXECUTE
            _note(log, f"cannot start {spec.argv[0] if spec.argv else '(empty argv)'}: {e.strerror or e}")
            d.write_exit_code(code)
            return 0
        d.write_pid(
            PidRecord(
                pid=engine.pid,
                start_time=start_time(engine.pid) or 0,  # a zombie still has its stat
                wrapper_pid=os.getpid(),
                wrapper_start_time=start_time(os.getpid()) or 0,
            )
        )
        # Wait without reaping: while the engine is a zombie its pid, and so its
        # group id, cannot be handed to anyone else, so the SIGKILL below can
        # only reach what the engine left behind in its group (orphaned
        # workers still holding GPU memory), never a stranger.
        while True:
            try:
                os.waitid(os.P_PID, engine.pid, os.WEXITED | os.WNOWAIT)
                break
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries; belt and braces
                continue
        try:
            os.killpg(engine.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = engine.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        _note(log, f"engine pid {engine.pid} {how}")
        d.write_exit_code(code)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m llmgw.services.agent.wrapper ENGINE_DIR", file=sys.stderr)
        return 2
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
