"""Console benchmark: ``llmgw tui`` in a real terminal, against a cluster of N nodes and R replicas.

Not a test: it prints figures (and ``--json FILE`` writes them, with the
control plane's). Run from the repository root with the project's virtual
environment::

    python bench/console.py                                  # 2,000 nodes x 8 GPUs, 1,000 replicas
    python bench/console.py --nodes 10000 --replicas 4000    # 80,000 GPUs
    python bench/console.py --nodes 20 --replicas 5 --steady 3s --node-lost-after 3s \\
        --heartbeat 0.5s --rounds 1 --lease-nodes 3 --lease-cycles 1   # smoke, about a minute

The cluster is ``bench/control_plane.py``'s, built by its own code (every one
of its flags works here: ``--nodes``, ``--replicas``, ``--heartbeat``,
``--steady``, ``--until``, ``--no-restart``, ``--dir``, ``--json`` …): a
real nats-server, the registry, health monitor and scheduler as processes,
and one simulated agent per node, each on its own TLS connection.

The console is the real one, ``python -m llmgw.services tui --config
DIR/config/operator.yaml``, in a ``--size`` (200x50) tmux session on a tmux
server of the bench's own; the bench types into it (``send-keys``) and reads
the screen back (``capture-pane``) through one tmux control-mode client, so a
key's latency is from the key sent to the terminal showing its result, as an
operator sees it. It is started before the agents connect, as an operator who
opens it during a bring-up would.

What it measures, each phase reported with the machine's load average:

1. bring-up: the console's CPU while 10,000 agents connect and register, and
   how long after the last lease was ready the screen shows every node ready;
2. steady state (heartbeats only): the console's CPU and RSS over the control
   plane bench's steady window, nothing pressed; then ``--rounds`` rounds of
   keys (below), real cordon and uncordon included; then the lag from a lease
   change on the bus (the time the server stored it) to its row on screen: the
   nodes on the first page are taken to suspect and back, ``--lease-nodes``
   at once, ``--lease-cycles`` times each (a node's agent stops
   heartbeating until its lease turns suspect, then resumes);
3. placement of ``--replicas`` replicas: the console's CPU, and keys pressed
   throughout (cordon asked and cancelled, not sent); then its CPU idle with
   every replica placed; then the console quits (q) and a new one is opened
   on the whole cluster, as an operator arriving now: the time until every
   node and replica is on screen, its CPU and memory (it stays for phase 4);
4. the nats-server restart and the herd of agents reconnecting: the same as 3.

Keys, one round: Home, Down x10 (scroll), PageDown x3 and PageUp (page), End
and Left (jump), ``/`` and a node's name typed letter by letter, Enter (filter:
each letter until the list title says so), Enter (node detail), Esc (back),
``c`` (cordon asked), ``y`` or ``n``, ``u`` ``y`` (steady only), ``/`` Esc
(filter cleared). Esc is reported apart: Textual delivers a lone Esc only
after ``ESCDELAY`` (100 ms) with no further byte, since Esc also begins a
key's escape sequence — a terminal convention, not the console's time.

Targets (at 10,000 nodes x 8 GPUs, 4,000 replicas; 2 cores): the console
<= 10 % of one core in steady state; <= 300 MB RSS; every key answered
<= 100 ms p99 in steady state and <= 250 ms p99 during placement and the
restart herd; a lease change on screen within 1 s p99.

tmux is installed with apt-get when missing (as root); everything started is
stopped on exit, Ctrl-C or failure (``llmgw down --dir DIR`` if this process
is killed outright; the tmux server is named ``llmgw-console-bench-PID``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import control_plane as cp

from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.durations import format_duration
from llmgw.shared.kvmirror import KvMirror, open_bucket

TARGETS = {"steady_cpu_pct": 10.0, "rss_mib": 300.0, "key_p99_s": 0.100, "busy_key_p99_s": 0.250, "lease_p99_s": 1.0}
KEY_TIMEOUT = 15.0  # a key whose result is not on screen by then counts as this long
POLL = 0.005  # seconds between two looks at the screen while a key is out
PAUSE = 0.05  # between two keys, as a fast typist
ESC_KINDS = ("back (Esc)", "filter cleared (Esc)")


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f}/{five:.2f}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --------------------------------------------------------------------------
# A real terminal: tmux, driven through one control-mode client
# --------------------------------------------------------------------------


def ensure_tmux() -> str:
    """tmux's path; installed with apt-get when missing and this process may."""
    path = shutil.which("tmux")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("tmux not found: installing it (apt-get install -y tmux)", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], check=False, stdout=subprocess.DEVNULL)
        if (path := shutil.which("tmux")) is None:
            subprocess.run(["apt-get", "update", "-q"], check=False, stdout=subprocess.DEVNULL)
            subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], check=False, stdout=subprocess.DEVNULL)
            path = shutil.which("tmux")
    if path is None:
        raise cp.BenchError("tmux is needed (the console runs in a real terminal): install it, e.g. 'apt-get install -y tmux'")
    return path


class Terminal:
    """A ``width`` x ``height`` tmux session running one command, on a tmux server of its own."""

    def __init__(self, root: Path, width: int, height: int) -> None:
        self.root = root
        self.width, self.height = width, height
        self.socket = f"llmgw-console-bench-{os.getpid()}"
        self.conf = root / "tmux.conf"
        self.tmux = ensure_tmux()
        self.client: asyncio.subprocess.Process | None = None
        self.replies: asyncio.Queue[tuple[bool, list[str]]] = asyncio.Queue()
        self.lock = asyncio.Lock()
        self.reader: asyncio.Task | None = None
        self.pid = 0
        self.syncs = 0

    def argv(self, *args: str) -> list[str]:
        return [self.tmux, "-L", self.socket, "-f", str(self.conf), *args]

    async def start(self, command: list[str], env: dict[str, str]) -> int:
        # No status line (the whole window is the console's), a fixed size whoever
        # attaches, and a pane that stays after its process ends (to read why).
        # (tmux 3.3a's server exits at start with window-size in its configuration: set after.)
        self.conf.write_text(
            f"set -g status off\nset -g default-size {self.width}x{self.height}\nsetw -g remain-on-exit on\nset -g history-limit 100\nset -g escape-time 0\n"
        )
        shell = "exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command)
        await self._run("new-session", "-d", "-s", "console", "-x", str(self.width), "-y", str(self.height), shell)
        await self._run("set-option", "-w", "-t", "console", "window-size", "manual")
        self.pid = int((await self._run("display-message", "-p", "-t", "console", "#{pane_pid}")).strip())
        # no-output: the pane's output is not copied to this client (a screenful is one
        # long %output line); the screen is read with capture-pane instead.
        self.client = await asyncio.create_subprocess_exec(
            *self.argv("-C", "attach-session", "-f", "no-output", "-t", "console"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            limit=1 << 24,
        )
        self.reader = asyncio.create_task(self._read())
        return self.pid

    async def _run(self, *args: str) -> str:
        p = await asyncio.create_subprocess_exec(*self.argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await p.communicate()
        if p.returncode:
            raise cp.BenchError(f"tmux {' '.join(args[:2])}: {err.decode(errors='replace').strip()}")
        return out.decode()

    async def _read(self) -> None:
        assert self.client is not None and self.client.stdout is not None
        block: list[str] | None = None
        while line := await self.client.stdout.readline():
            text = line.decode(errors="replace").rstrip("\n")
            if block is None:
                # Only answers to this client's commands (flags 1), not the attach's own.
                if text.startswith("%begin") and text.rsplit(" ", 1)[-1] == "1":
                    block = []
                continue  # notifications (%output, %session-changed, …) between replies
            if text.startswith("%end") or text.startswith("%error"):
                self.replies.put_nowait((text.startswith("%end"), block))
                block = None
            else:
                block.append(text)

    def _write(self, line: str) -> None:
        assert self.client is not None and self.client.stdin is not None
        self.client.stdin.write((line + "\n").encode())

    async def command(self, line: str) -> list[str]:
        """Run one tmux command; its output lines.

        Each command is followed by a marker of ours (``display-message -p
        llmgw-N``): tmux answers each in a block of its own, in order, so the
        command's answer is the block before the marker's, whatever came before it
        (a late answer to a command that timed out)."""
        async with self.lock:
            self.syncs += 1
            marker = f"llmgw-{self.syncs}"
            self._write(f"{line} ; display-message -p {marker}")
            previous: tuple[bool, list[str]] | None = None
            try:
                async with asyncio.timeout(30):
                    while True:
                        if self.reader is not None and self.reader.done():
                            raise cp.BenchError(f"the tmux control client stopped: {self.reader.exception() or 'it exited'}")
                        try:
                            reply = await asyncio.wait_for(self.replies.get(), 1)
                        except TimeoutError:
                            continue
                        if reply[1] == [marker]:
                            break
                        previous = reply
            except TimeoutError:
                raise cp.BenchError(f"tmux did not answer {line!r} within 30s") from None
        if previous is None:
            raise cp.BenchError(f"tmux {line!r}: no answer before the next command's")
        ok, lines = previous
        if not ok:
            raise cp.BenchError(f"tmux {line!r}: {' '.join(lines)}")
        return lines

    async def screen(self) -> str:
        for attempt in range(3):  # an answer tmux left out is asked again
            try:
                return "\n".join(await self.command("capture-pane -p -t console"))
            except cp.BenchError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def respawn(self) -> int:
        """The command again, in the same terminal (its process had ended); its pid."""
        await self.command("respawn-pane -t console")
        return int((await self.command("display-message -p -t console '#{pane_pid}'"))[0])

    async def keys(self, *keys: str) -> None:
        """Key names as tmux knows them (Down, PageDown, Enter, Escape, …)."""
        await self.command("send-keys -t console " + " ".join(shlex.quote(k) for k in keys))

    async def text(self, text: str) -> None:
        await self.command("send-keys -t console -l " + shlex.quote(text))

    async def dead(self) -> bool:
        return (await self.command("display-message -p -t console '#{pane_dead}'")) == ["1"]

    async def close(self) -> None:
        with contextlib.suppress(cp.BenchError):
            await self._run("kill-server")
        if self.client is not None:
            with contextlib.suppress(ProcessLookupError):
                self.client.kill()
            await self.client.wait()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):  # a server killed outright leaves its socket
            (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / self.socket).unlink()


# --------------------------------------------------------------------------
# Reading the console's screen
# --------------------------------------------------------------------------

_CURSOR = re.compile(r"│▶ (node\d+) ")


def cursor_node(screen: str) -> str:
    m = _CURSOR.search(screen)
    return m.group(1) if m else ""


def row_state(screen: str, node: str) -> str:
    """A node's state word in its row of the node list ('' when not on screen)."""
    m = re.search(rf"│[▶ ] {re.escape(node)} +(ready|suspect|lost|cordoned|draining|unknown) ", screen)
    return m.group(1) if m else ""


def fabrics_title(screen: str) -> str:
    """The fabrics panel's title: the whole cluster's aggregates."""
    return next((line for line in screen.splitlines() if line.startswith("╭─ Fabrics")), "")


def _totals(title: str) -> str:
    """The fabrics title without its count of nodes by state."""
    return re.sub(r" nodes \([^)]*\)", " nodes", title).strip("╭─╮ ")


def list_height(screen: str) -> int:
    """How many lines the node list shows (between its borders)."""
    rows = screen.splitlines()
    top = next(i for i, line in enumerate(rows) if line.startswith("╭─ Nodes"))
    return next(i for i in range(top + 1, len(rows)) if rows[i].startswith("╰")) - top - 1


def paged(lines: list[str], node: str, height: int, delta: int) -> str:
    """Where PageDown (+1) / PageUp (-1) puts the cursor: a page of lines on, onto the
    nearest row (a header is skipped forwards, else backwards), within the list."""
    i = max(0, min(len(lines) - 1, lines.index(node) + delta * height))
    if lines[i]:
        return lines[i]
    after = next((lines[j] for j in range(i + 1, len(lines)) if lines[j]), "")
    return after or next(lines[j] for j in range(i - 1, -1, -1) if lines[j])


def rows_shown(screen: str) -> list[str]:
    return re.findall(r"│[▶ ] (node\d+) +(?:ready|suspect|lost|cordoned|draining|unknown) ", screen)


# --------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------


class Missed(Exception):
    """A key's result never showed (it is counted as KEY_TIMEOUT)."""


@dataclass
class Keys:
    """Key latencies by kind (seconds), and the keys whose result never showed."""

    by_kind: dict[str, list[float]] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)
    # kind -> the console's CPU seconds from each key sent to its result shown: with the
    # latency, whether a slow key was work or a wait for a core (/proc counts in 10 ms ticks:
    # read the mean over many)
    cpu_by_kind: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, cpu: float | None = None) -> None:
        self.by_kind.setdefault(kind, []).append(seconds)
        if cpu is not None:
            self.cpu_by_kind.setdefault(kind, []).append(cpu)

    def keys(self) -> list[float]:
        """Every key but Esc (delivered only after ESCDELAY) and the bus round trips."""
        return [s for k, v in self.by_kind.items() if k not in ESC_KINDS and "round trip" not in k for s in v]

    def figures(self) -> dict:
        out = {
            k: {
                "n": len(v),
                "p50_s": percentile(v, 50),
                "p99_s": percentile(v, 99),
                "max_s": max(v),
                "cpu_mean_s": statistics.fmean(self.cpu_by_kind.get(k) or [0.0]),
            }
            for k, v in self.by_kind.items()
        }
        every = self.keys()
        cpu = [c for k, v in self.cpu_by_kind.items() if k not in ESC_KINDS and "round trip" not in k for c in v]
        out["keys"] = {
            "n": len(every),
            "p50_s": percentile(every, 50),
            "p99_s": percentile(every, 99),
            "max_s": max(every, default=float("nan")),
            "cpu_mean_s": statistics.fmean(cpu or [0.0]),
        }
        out["missed"] = self.missed
        return out


class ConsoleBench(cp.Bench):
    def __init__(self, args, root: Path) -> None:
        super().__init__(args, root)
        self.term = Terminal(root, *args.size)
        self.console_pid = 0
        self.con: dict = {"size": f"{args.size[0]}x{args.size[1]}"}
        self.order: list[tuple[str, str]] = []  # (fabric, node) as the console lists them

    # -- the control plane bench's hooks ----------------------------------------

    def stop_extra(self) -> None:
        # if run() never got to closing the terminal: its tmux server (and the console with it)
        subprocess.run(self.term.argv("kill-server"), check=False, capture_output=True)

    def summaries(self) -> list[str]:
        return [console_summary(self.args, self.con)]

    def json_extra(self) -> dict:
        return {"console": self.con}

    # -- the console ------------------------------------------------------------

    def cpu(self) -> float:
        return cp.cpu_seconds(self.console_pid)

    async def check_console(self) -> None:
        if await self.term.dead():
            screen = await self.term.screen()
            raise cp.BenchError(f"the console exited; its terminal shows:\n{screen[-3000:]}")

    async def connect_agents(self) -> dict[str, float]:
        """Start the console first, as an operator opening it during a bring-up."""
        self.order = sorted((ag.fabric, ag.node_id) for ag in self.agents)
        config = self.root / "config" / "operator.yaml"
        env = {"TERM": os.environ.get("TERM", "xterm-256color") if os.environ.get("TERM", "dumb") != "dumb" else "xterm-256color", "LLMGW_CONFIG": str(config)}
        self.console_pid = await self.term.start([sys.executable, "-m", "llmgw.services", "tui", "--config", str(config)], env)
        self.out(f"the console runs in a {self.con['size']} tmux terminal (pid {self.console_pid}), before any agent connects; {load()}")
        self.t_console = time.monotonic()
        self.c_console = self.cpu()
        return await super().connect_agents()

    async def caught_up(self) -> None:
        """Until the screen says every node is ready: the console has folded the bring-up."""
        n = len(self.agents)
        want = f"{n:,} nodes ({n:,} ready)"
        t = time.monotonic()
        while want not in (screen := await self.term.screen()):
            await self.check_console()
            if time.monotonic() - t > 300:
                raise cp.BenchError(f"the console did not show {want!r} within 300 s; it shows:\n{screen}")
            await asyncio.sleep(0.05)
        span = time.monotonic() - self.t_console
        self.con["bringup_cpu_pct"] = 100 * (self.cpu() - self.c_console) / span
        self.con["bringup_rss_mib"] = rss_mib(self.console_pid)
        self.con["caught_up_s"] = time.monotonic() - t
        self.out(
            f"console: every node ready on screen {self.con['caught_up_s']:.2f}s after the bench saw it; during the bring-up "
            f"it used {self.con['bringup_cpu_pct']:.1f}% of a core and holds {self.con['bringup_rss_mib']:.0f} MiB; {load()}"
        )

    async def measure(self, name: str, work) -> float:
        """The console's CPU (% of one core) while ``work`` runs."""
        c0, t0 = self.cpu(), time.monotonic()
        l0 = load()
        await work
        pct = 100 * (self.cpu() - c0) / (time.monotonic() - t0)
        self.con[f"{name}_cpu_pct"] = pct
        self.con[f"{name}_rss_mib"] = rss_mib(self.console_pid)
        self.con[f"{name}_load"] = f"{l0} -> {load()}"
        self.out(f"console, {name}: {pct:.1f}% of one core over {time.monotonic() - t0:.0f}s, {self.con[f'{name}_rss_mib']:.0f} MiB ({l0} -> {load()})")
        return pct

    # -- keys -------------------------------------------------------------------

    async def key(self, keys: Keys, kind: str, send: Callable, shows: Callable[[str], bool]) -> str:
        c0 = self.cpu()
        t0 = time.monotonic()
        check_at = t0 + 2
        await send()
        while True:
            screen = await self.term.screen()
            if shows(screen):
                keys.add(kind, time.monotonic() - t0, self.cpu() - c0)
                await asyncio.sleep(PAUSE)
                return screen
            if time.monotonic() > check_at:  # a console that died answers nothing: say so at once
                await self.check_console()
                check_at += 2
            if time.monotonic() - t0 > KEY_TIMEOUT:
                keys.add(kind, KEY_TIMEOUT)
                keys.missed.append(kind)
                self.out(f"  {kind}: not on screen after {KEY_TIMEOUT:.0f}s; the screen:\n{screen}")
                await self.check_console()
                raise Missed(kind)
            await asyncio.sleep(POLL)

    async def round(self, keys: Keys, target: str, *, confirm: bool) -> None:
        order = [node for _, node in self.order]
        first_of = {}
        for fabric, node in self.order:
            first_of.setdefault(fabric, node)
        fabrics = list(first_of)
        t = self.term

        def press(*k):
            return lambda: t.keys(*k)

        await self.key(keys, "jump (Home)", press("Home"), lambda s: cursor_node(s) == order[0])
        for i in range(1, 11):
            await self.key(keys, "scroll (Down)", press("Down"), lambda s, i=i: cursor_node(s) == order[i])
        lines = self.lines()
        for k in ("PageDown", "PageDown", "PageDown", "PageUp"):
            screen = await t.screen()
            now, height = cursor_node(screen), list_height(screen)
            want = paged(lines, now, height, +1 if k == "PageDown" else -1)
            if want == now:
                continue  # already on the last (first) page: nothing would show
            await self.key(keys, f"page ({k})", press(k), lambda s, w=want: cursor_node(s) == w)
        await self.key(keys, "jump (End)", press("End"), lambda s: cursor_node(s) == order[-1])
        if len(fabrics) > 1:
            await self.key(keys, "jump (Left: fabric)", press("Left"), lambda s: cursor_node(s) == first_of[fabrics[-2]])
        await self.key(keys, "filter", press("/"), lambda s: "filter: words to match" in s)
        for j in range(len(target)):
            await self.key(keys, "filter", lambda j=j: t.text(target[j]), lambda s, typed=target[: j + 1]: f'Nodes matching "{typed}"' in s)
        await self.key(keys, "filter", press("Enter"), lambda s: cursor_node(s) == target)
        await self.key(keys, "detail (Enter)", press("Enter"), lambda s: f"╭─ node {target} " in s and "lease " in s)
        await self.key(keys, "back (Esc)", press("Escape"), lambda s: f"╭─ node {target} " not in s and cursor_node(s) == target)
        await self.key(keys, "cordon (c)", press("c"), lambda s: f"Cordon {target}?" in s)
        if confirm:
            t0 = time.monotonic()
            await self.key(keys, "cordon (y)", press("y"), lambda s: f"Cordon {target}?" not in s)
            await self.key(keys, "cordon round trip (y -> row cordoned, via the registry)", _noop, lambda s: row_state(s, target) == "cordoned")
            keys.by_kind["cordon round trip (y -> row cordoned, via the registry)"][-1] = time.monotonic() - t0 - PAUSE
            await self.key(keys, "cordon (u)", press("u"), lambda s: f"Uncordon {target}?" in s)
            t0 = time.monotonic()
            await self.key(keys, "cordon (y)", press("y"), lambda s: f"Uncordon {target}?" not in s)
            await self.key(keys, "cordon round trip (y -> row cordoned, via the registry)", _noop, lambda s: row_state(s, target) == "ready")
            keys.by_kind["cordon round trip (y -> row cordoned, via the registry)"][-1] = time.monotonic() - t0 - PAUSE
        else:
            await self.key(keys, "cordon (n)", press("n"), lambda s: f"Cordon {target}?" not in s)
        await t.keys("/")
        await asyncio.sleep(PAUSE)
        await self.key(keys, "filter cleared (Esc)", press("Escape"), lambda s: "Nodes matching" not in s and "Nodes · " in s)

    async def recover(self) -> None:
        """Back to the main screen with no filter, no question and no detail: Esc closes each."""
        t = time.monotonic()
        while True:
            await self.term.keys("Escape")
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                s = await self.term.screen()
                if "Nodes · " in s and "Nodes matching" not in s and "╭─ node " not in s and "no (Esc)" not in s:
                    self.out(f"  back on the main screen {time.monotonic() - t:.1f}s after the miss; the next round starts")
                    return
                await asyncio.sleep(0.05)
            await self.check_console()
            if time.monotonic() - t > 60:
                raise cp.BenchError(f"the console did not come back to its main screen within 60 s of Esc; it shows:\n{s}")

    def lines(self) -> list[str]:
        """The node list's lines as the console lays them out: a header ("") before each fabric's rows."""
        out, fabric = [], None
        for fab, node in self.order:
            if fab != fabric:
                out.append("")
                fabric = fab
            out.append(node)
        return out

    def targets(self) -> list[str]:
        """A node to filter for in each round: the next to last first (node09999 at 10,000), then spread out."""
        order = [node for _, node in self.order]
        picks = [order[-2], order[len(order) // 2], order[len(order) // 3], order[1]]
        return picks

    async def rounds(self, keys: Keys, *, n: int | None = None, until: asyncio.Task | None = None, confirm: bool) -> None:
        """``n`` rounds, or rounds until ``until`` is done (at least one)."""
        targets = self.targets()
        k = 0
        while True:
            try:
                await self.round(keys, targets[k % len(targets)], confirm=confirm)
            except Missed:
                # The rest of this round expects the missed key's screen: it is dropped
                # (the miss is counted, at KEY_TIMEOUT), and the next round starts from the
                # main screen again, so one miss is not every later key missed too.
                await self.recover()
            k += 1
            if (n is not None and k >= n) or (until is not None and until.done()):
                return

    def report_keys(self, name: str, keys: Keys) -> None:
        fig = keys.figures()
        self.con[f"{name}_keys"] = fig
        every = fig["keys"]
        self.out(
            f"console, {name}: {every['n']} keys answered p50 {1000 * every['p50_s']:.0f} ms, p99 {1000 * every['p99_s']:.0f} ms, "
            f"max {1000 * every['max_s']:.0f} ms; the console's CPU per key {1000 * every['cpu_mean_s']:.1f} ms on average"
        )
        for kind, f in fig.items():
            if kind in ("keys", "missed"):
                continue
            self.out(
                f"  {kind:58s} n={f['n']:4d}  p50 {1000 * f['p50_s']:6.0f} ms  p99 {1000 * f['p99_s']:6.0f} ms  max {1000 * f['max_s']:6.0f} ms  "
                f"CPU {1000 * f['cpu_mean_s']:5.1f} ms"
            )
        if keys.missed:
            self.out(f"  not shown within {KEY_TIMEOUT:.0f}s: {', '.join(keys.missed)}")

    # -- a lease change on screen ---------------------------------------------------

    async def lease_lag(self) -> None:
        """Nodes on the first page go suspect and back; the lag is from the server storing
        each lease to its row showing the new state."""
        a = self.args
        await self.term.keys("Home")
        await asyncio.sleep(0.5)
        shown = rows_shown(await self.term.screen())
        nodes = [n for n in shown if not self.fleet.views[n].silent][: a.lease_nodes]
        if not nodes:
            raise cp.BenchError("no node row on screen to change")
        kv = await open_bucket(self.js, S.BUCKET_LEASES)
        mirror: KvMirror = KvMirror(kv, B.LEASES)
        stored: dict[str, list[tuple[str, float]]] = {n: [] for n in nodes}  # node -> (state, server time) of each write
        changed = asyncio.Event()

        def on_lease(key, old, new):
            if key in stored and new is not None and mirror.entry is not None and (old is None or old.state != new.state):
                stored[key].append((new.state, mirror.entry.created.timestamp()))
                changed.set()

        mirror.listeners.append(on_lease)
        await mirror.start(timeout=60)
        samples: list[float] = []
        shown_upto = {n: 0 for n in nodes}  # node -> how many of its lease changes its row has shown
        all_shown = asyncio.Event()

        async def watch_screen(stop: asyncio.Event) -> None:
            """A row showing a lease's state shows that change and every earlier one
            (a suspect lease turned ready again within one frame is drawn ready)."""
            while not stop.is_set():
                screen = await self.term.screen()
                now = time.time()
                for node in nodes:
                    changes, done = stored[node], shown_upto[node]
                    if done == len(changes):
                        continue
                    state = row_state(screen, node)
                    last = next((j for j in range(len(changes) - 1, done - 1, -1) if changes[j][0] == state), None)
                    if last is not None:
                        samples.extend(now - at for _, at in changes[done : last + 1])
                        shown_upto[node] = last + 1
                        all_shown.set()
                await asyncio.sleep(POLL)

        async def stored_state(node: str, want: str, since: int) -> None:
            deadline = time.monotonic() + a.node_lost_after + 30
            while not any(st == want for st, _ in stored[node][since:]):
                if time.monotonic() > deadline:
                    raise cp.BenchError(f"{node}'s lease did not turn {want}")
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.5)

        async def cycle(node: str, delay: float) -> None:
            await asyncio.sleep(delay)
            for _ in range(a.lease_cycles):
                # Silent until its row shows the lease suspect (or lost, should the screen
                # be later than the monitor's lost_after), then heartbeating again until its
                # row shows it ready: each change is seen on a row that showed the one before.
                for want, act in (("suspect", self.fleet.silence), ("ready", self.fleet.resume)):
                    seen = len(stored[node])
                    await act(node)
                    await stored_state(node, want, seen)
                    deadline = time.monotonic() + 60
                    while shown_upto[node] < len(stored[node]):
                        all_shown.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(all_shown.wait(), 1)
                        if time.monotonic() > deadline:
                            await self.check_console()
                            screen = await self.term.screen()
                            row = [line for line in screen.splitlines() if f" {node} " in line]
                            raise cp.BenchError(
                                f"{node}'s lease changed ({stored[node][shown_upto[node] :]}) and its row did not show it in 60 s: {row}; "
                                f"the screen's top: {screen.splitlines()[:3]}"
                            )

        def pending() -> list[str]:
            return [n for n in nodes if shown_upto[n] < len(stored[n])]

        async def progress() -> None:
            while True:
                await asyncio.sleep(10)
                if watcher.done():
                    raise cp.BenchError(f"watching the screen stopped: {watcher.exception()!r}")
                waiting = pending()
                self.out(f"  lease changes on screen so far: {len(samples)}; {len(waiting)} row(s) behind their lease ({load()})")
                if waiting and os.environ.get("LLMGW_BENCH_DEBUG"):
                    node = waiting[0]
                    screen = await self.term.screen()
                    self.out(f"  {node}: stored {stored[node]}, shown {shown_upto[node]}; row: {[line for line in screen.splitlines() if node in line]}")

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_screen(stop))
        l0 = load()
        bound = a.lease_cycles * (2 * a.node_lost_after + 2 * a.heartbeat + 60) + a.heartbeat
        try:
            async with asyncio.timeout(bound):
                async with asyncio.TaskGroup() as tg:  # one failing stops the others
                    reporter = tg.create_task(progress())

                    async def every_cycle() -> None:
                        async with asyncio.TaskGroup() as cycles:
                            for i, n in enumerate(nodes):
                                cycles.create_task(cycle(n, a.heartbeat * i / len(nodes)))
                        reporter.cancel()

                    tg.create_task(every_cycle())
        except TimeoutError:
            raise cp.BenchError(f"the lease changes did not all reach the screen within {bound:.0f}s ({len(samples)} did)") from None
        except ExceptionGroup as group:
            first = group.exceptions[0]
            while isinstance(first, ExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher, 30)
            await mirror.stop()
        self.con["lease_lag"] = {
            "n": len(samples),
            "p50_s": percentile(samples, 50),
            "p99_s": percentile(samples, 99),
            "max_s": max(samples),
            "load": f"{l0} -> {load()}",
        }
        f = self.con["lease_lag"]
        self.out(
            f"console: a lease change (server store -> its row on screen), {len(nodes)} nodes to suspect and back {a.lease_cycles}x: "
            f"n={f['n']} p50 {1000 * f['p50_s']:.0f} ms, p99 {1000 * f['p99_s']:.0f} ms, max {1000 * f['max_s']:.0f} ms ({l0} -> {load()})"
        )

    # -- phases -----------------------------------------------------------------

    async def run(self) -> None:
        until = cp.PHASES.index(self.args.until)
        try:
            await self.bring_up()
            await self.caught_up()
            if until >= cp.PHASES.index("steady"):
                await self.steady_phase()
            if until >= cp.PHASES.index("placement"):
                await self.placement_phase()
                await self.reopen()
            if until >= cp.PHASES.index("restart") and self.args.restart and self.args.nats_servers == 1:
                await self.restart_phase()
            self.con["rss_peak_mib"] = max(self.con.get("rss_peak_mib", 0.0), cp.peak_mib(self.console_pid))
            self.out(f"console: peak RSS {self.con['rss_peak_mib']:.0f} MiB (of both consoles)")
        finally:
            with contextlib.suppress(Exception):
                self.con.setdefault("rss_peak_mib", cp.peak_mib(self.console_pid))
            await self.term.close()
            t = time.monotonic()
            await self.close()
            self.out(f"closed {len(self.agents)} agent connections in {time.monotonic() - t:.1f}s")

    async def steady_phase(self) -> None:
        await self.measure("steady", self.steady())
        await self.check_console()
        keys = Keys()
        l0 = load()
        await self.rounds(keys, n=self.args.rounds, confirm=True)
        self.con["steady_keys_load"] = f"{l0} -> {load()}"
        self.report_keys("steady", keys)
        await self.lease_lag()

    async def busy(self, name: str, phase: asyncio.Task) -> None:
        """Keys pressed while the control plane bench's ``phase`` runs (no cordon sent),
        and the console's CPU meanwhile."""
        keys = Keys()
        l0 = load()

        async def both():
            await self.rounds(keys, until=phase, confirm=False)
            await phase

        await self.measure(name, both())
        self.con[f"{name}_keys_load"] = f"{l0} -> {load()}"
        self.report_keys(name, keys)

    async def placement_phase(self) -> None:
        # the control plane bench's placement, its own steady window after it included
        await self.busy("placement", asyncio.create_task(self.placement()))
        await self.measure("placed", asyncio.sleep(self.args.steady))

    async def reopen(self) -> None:
        """An operator opening the console now, on the whole cluster: the first console
        quits (q), a new one starts in the same terminal; until it shows every node and
        replica, its CPU and memory."""
        self.con["rss_peak_mib"] = cp.peak_mib(self.console_pid)
        before = fabrics_title(await self.term.screen())
        await self.term.keys("q")
        t = time.monotonic()
        while not await self.term.dead():
            if time.monotonic() - t > 30:
                raise cp.BenchError("the console did not quit on q within 30 s")
            await asyncio.sleep(0.05)
        self.out(f"console: quit on q in {time.monotonic() - t:.2f}s; it showed {before.strip('╭─╮ ')}")
        # everything on screen: the whole cluster's aggregates as the first console had them
        l0, t = load(), time.monotonic()
        self.console_pid = await self.term.respawn()
        while True:
            screen = await self.term.screen()
            # every node (each with its lease: none "unknown") and every replica in: the
            # same totals as the first console, whichever nodes are suspect just now (at
            # 10,000 a few tens flicker to suspect and back under the bench's own load)
            title = fabrics_title(screen)
            if _totals(title) == _totals(before) and "unknown" not in title:
                break
            await self.check_console()
            if time.monotonic() - t > 120:
                raise cp.BenchError(f"the new console did not show {before!r} within 120 s; it shows:\n{screen}")
            await asyncio.sleep(0.02)
        self.con["open_s"] = time.monotonic() - t
        self.con["open_cpu_s"] = self.cpu()
        self.con["open_rss_mib"] = rss_mib(self.console_pid)
        self.con["open_load"] = f"{l0} -> {load()}"
        self.out(
            f"console: opened on {len(self.agents):,} nodes and {self.args.replicas:,} replicas, everything on screen in {self.con['open_s']:.2f}s "
            f"({self.con['open_cpu_s']:.2f} CPU-s, {self.con['open_rss_mib']:.0f} MiB; {self.con['open_load']})"
        )

    async def restart_phase(self) -> None:
        await self.busy("restart", asyncio.create_task(self.nats_restart()))


async def _noop() -> None:
    return None


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------


def console_summary(args, con: dict) -> str:
    def row(phase, what, value, target="", ok=None):
        mark = "" if ok is None else ("ok" if ok else "MISSED")
        return f"| {phase:10s} | {what:58s} | {value:>22s} | {target:>9s} | {mark:6s} |"

    def ms(f):
        return f"{1000 * f['p50_s']:.0f} / {1000 * f['p99_s']:.0f} ms (n={f['n']})"

    def cpu(f):
        return f"{1000 * f.get('cpu_mean_s', 0.0):.1f} ms"

    lines = [
        "",
        "== CONSOLE SUMMARY ==",
        f"nodes {args.nodes} x {args.gpus} GPUs, {args.replicas} replicas, terminal {con.get('size')} (tmux); {os.cpu_count()} cores",
        f"| {'phase':10s} | {'figure':58s} | {'value':>22s} | {'target':>9s} | {'':6s} |",
        "|" + "-" * 12 + "|" + "-" * 60 + "|" + "-" * 24 + "|" + "-" * 11 + "|" + "-" * 8 + "|",
    ]
    if "bringup_cpu_pct" in con:
        lines.append(row("bring-up", "console CPU, % of one core", f"{con['bringup_cpu_pct']:.1f} %"))
        lines.append(row("bring-up", "every node ready on screen after the bench saw it", f"{con['caught_up_s']:.2f} s"))
    if "steady_cpu_pct" in con:
        lines.append(
            row(
                "steady",
                f"console CPU, nothing pressed ({con['steady_load']})",
                f"{con['steady_cpu_pct']:.1f} %",
                "<= 10 %",
                con["steady_cpu_pct"] <= TARGETS["steady_cpu_pct"],
            )
        )
        lines.append(row("steady", "console RSS", f"{con['steady_rss_mib']:.0f} MiB"))
    for phase, target, limit in (
        ("steady", "<= 100 ms", TARGETS["key_p99_s"]),
        ("placement", "<= 250 ms", TARGETS["busy_key_p99_s"]),
        ("restart", "<= 250 ms", TARGETS["busy_key_p99_s"]),
    ):
        fig = con.get(f"{phase}_keys")
        if not fig:
            continue
        if phase != "steady":
            lines.append(row(phase, f"console CPU, keys pressed ({con[f'{phase}_load']})", f"{con[f'{phase}_cpu_pct']:.1f} %"))
        lines.append(row(phase, "keys p50 / p99 (every key but Esc)", ms(fig["keys"]), target, fig["keys"]["p99_s"] <= limit and not fig["missed"]))
        lines.append(row(phase, "  the console's CPU per key, mean (sent -> shown)", cpu(fig["keys"])))
        for kind, f in fig.items():
            if kind not in ("keys", "missed"):
                lines.append(row("", f"  {kind}", ms(f)))
    if "lease_lag" in con:
        f = con["lease_lag"]
        lines.append(row("steady", f"a lease change on screen p50 / p99 ({f['load']})", ms(f), "<= 1 s", f["p99_s"] <= TARGETS["lease_p99_s"]))
    if "open_s" in con:
        lines.append(row("opened", f"a new console: every node and replica on screen ({con['open_load']})", f"{con['open_s']:.2f} s"))
        lines.append(row("opened", "  its CPU until then", f"{con['open_cpu_s']:.2f} s"))
        lines.append(row("opened", "  its RSS then", f"{con['open_rss_mib']:.0f} MiB"))
    if "placed_cpu_pct" in con:
        lines.append(row("placed", f"console CPU, every replica placed ({con['placed_load']})", f"{con['placed_cpu_pct']:.1f} %"))
    if "rss_peak_mib" in con:
        lines.append(row("all", "console peak RSS", f"{con['rss_peak_mib']:.0f} MiB", "<= 300 MB", con["rss_peak_mib"] * 1.048576 <= TARGETS["rss_mib"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\nThe cluster is")[0],
        epilog="Every other flag is bench/control_plane.py's (see its --help): --nodes, --replicas, --steady, --until, --dir, --json …",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="200x50", help="the terminal, COLUMNSxLINES (default 200x50)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of keys in steady state (default 5, about 30 keys each)")
    p.add_argument("--lease-nodes", type=int, default=30, help="nodes on the first page taken to suspect and back at once (default 30)")
    p.add_argument("--lease-cycles", type=int, default=3, help="times each (default 3: two lease changes each time)")
    own, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
        raise SystemExit(0)
    m = re.fullmatch(r"(\d+)x(\d+)", own.size)
    if not m or int(m.group(1)) < 80 or int(m.group(2)) < 24:
        p.error(f"--size {own.size!r}: COLUMNSxLINES, at least 80x24")
    if own.rounds < 1 or own.lease_nodes < 1 or own.lease_cycles < 1:
        p.error("--rounds, --lease-nodes and --lease-cycles: at least 1")
    if "--floor" in rest:
        p.error("--floor runs no control plane: there is nothing for the console to show")
    args = cp.parse_args(rest)
    if args.nats_servers > 1:
        p.error("--nats-servers: the console bench runs one server (its restart phase restarts it)")
    args.size = (int(m.group(1)), int(m.group(2)))
    args.rounds, args.lease_nodes, args.lease_cycles = own.rounds, own.lease_nodes, own.lease_cycles
    return args


def main(argv: list[str] | None = None) -> int:
    argv_full = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    args = parse_args(argv_full[1:])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="llmgw-consolebench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"llmgw console bench: work dir {root} (if this process is killed: llmgw down --dir {root}; tmux -L llmgw-console-bench-{os.getpid()} kill-server)",
        flush=True,
    )
    print(f"{load()} at the start; steady window {format_duration(args.steady)}", flush=True)
    try:
        print(cp.raise_fd_limit(args.nodes), flush=True)
    except cp.BenchError as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    return cp.run_bench(ConsoleBench(args, root), argv_full)


if __name__ == "__main__":
    sys.exit(main())
