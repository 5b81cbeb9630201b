"""The engine supervisor against real engine processes (``llmgw engine sim``), no bus.

Every engine here runs as the agent runs it: through the wrapper, in a session
of its own. Timings are compressed (health every 200 ms; SIGKILL 1 s after an ignored SIGTERM);
no test asserts how fast anything happens, only what happens.
"""

from __future__ import annotations

import os
import shutil
import signal

import msgspec
import pytest

from llmgw.services.agent.config import SupervisorConfig
from llmgw.services.agent.enginedir import EngineDir, EngineSpec, PidRecord
from llmgw.services.agent.supervisor import Supervisor
from llmgw.shared import procfs
from llmgw.shared.natsserver import free_port
from llmgw.shared.schemas import EngineFact

from . import spawning
from .agent_helpers import eventually, group_alive, kill_engines, make_launch, recorded_engines

pytestmark = pytest.mark.timeout(60)

NODE_GPUS = set(range(8))


class Recorder:
    """Every EngineFact the supervisor reports, in order."""

    def __init__(self):
        self.facts: list[EngineFact] = []

    def __call__(self, fact: EngineFact) -> None:
        self.facts.append(fact)

    def last(self, replica_id: str, rank: int = 0) -> EngineFact | None:
        for f in reversed(self.facts):
            if f.replica_id == replica_id and f.rank == rank:
                return f
        return None

    def state(self, replica_id: str, rank: int = 0) -> str | None:
        f = self.last(replica_id, rank)
        return f.state if f else None


@pytest.fixture
def work_dir(tmp_path):
    wd = tmp_path / "agent"
    yield wd
    kill_engines(wd)


# A clean stop waits on the exit, so a generous SIGKILL deadline costs nothing; 1 s was
# shorter than a sim engine's interpreter teardown on a loaded 2-core CI machine, and
# its "stopped (exit 0)" then ended as signal 9. The escalation test asks for 1 s itself.
CLEAN_STOP_TIMEOUT = 15.0
ESCALATION_STOP_TIMEOUT = 1.0


@pytest.fixture
async def supervisors(work_dir):
    """Make supervisors over one work dir, as successive agents on one node would be."""
    made: list[Supervisor] = []

    async def make(stop_timeout: float = CLEAN_STOP_TIMEOUT) -> Supervisor:
        cfg = SupervisorConfig(work_dir=str(work_dir), log_lines=20, stop_timeout=stop_timeout, health_interval=0.2, probe_interval=1.0, probe_timeout=1.0)
        sup = Supervisor(cfg, mgmt_addr="127.0.0.1", mgmt_interface="lo", on_change=Recorder())
        await sup.adopt()
        sup.start()
        made.append(sup)
        return sup

    yield make
    for sup in made:
        await sup.close()


def zombie_children() -> list[int]:
    """Children of this process that exited and were never reaped."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2 :].split()
            if fields[0] == "Z" and int(fields[1]) == me:
                out.append(int(entry))
    return out


def facts_by_rank(sup: Supervisor) -> dict[tuple[str, int], EngineFact]:
    return {(f.replica_id, f.rank): f for f in sup.facts()}


async def test_leader_becomes_ready_and_a_repeated_launch_starts_nothing(supervisors, work_dir):
    sup = await supervisors()
    cmd = make_launch("r1", gpus=(0, 1))
    first = await sup.launch(cmd, NODE_GPUS)
    assert first.ok and first.pid > 0, first
    await eventually(lambda: sup.on_change.state("r1") == "ready", "the leader to answer /health")
    before = recorded_engines(work_dir)

    again = await sup.launch(cmd, NODE_GPUS)
    assert again.ok and again.pid == first.pid, again
    assert "nothing started" in again.reason
    assert recorded_engines(work_dir) == before
    assert [f.pid for f in sup.facts()] == [first.pid]

    # The same member with other GPUs is not a repeat: it is a different launch.
    changed = await sup.launch(msgspec.structs.replace(cmd, gpus=[2]), NODE_GPUS)
    assert not changed.ok and changed.code == "launch_conflict", changed
    assert recorded_engines(work_dir) == before


async def test_a_worker_that_joins_its_leader_is_joined_not_starting(supervisors, work_dir):
    # A worker serves nothing, so nothing can be asked of it; its connection to the
    # leader's rendezvous (the kernel's table, matched to its own process) says it joined.
    sup = await supervisors()
    port = free_port()
    worker = await sup.launch(make_launch("r2", rank=1, nnodes=2, gpus=(2, 3), rendezvous_port=port), NODE_GPUS)
    assert worker.ok, worker
    assert sup.on_change.state("r2", rank=1) == "starting"  # no leader yet: nothing to join
    leader = await sup.launch(make_launch("r2", rank=0, nnodes=2, gpus=(0, 1), rendezvous_port=port), NODE_GPUS)
    assert leader.ok, leader
    await eventually(lambda: (sup.on_change.state("r2", rank=0), sup.on_change.state("r2", rank=1)) == ("ready", "joined"), "leader ready, worker joined")


async def test_launches_that_cannot_run_here_are_refused_with_a_reason(supervisors, work_dir):
    sup = await supervisors()
    running = await sup.launch(make_launch("r1", generation=2, gpus=(0, 1)), NODE_GPUS)
    assert running.ok, running
    stopped = await sup.stop("r7", 3, reason="reaped")  # nothing of r7 here, but generation 3 is now fenced
    assert stopped.ok, stopped

    cases = [
        ("older generation of a replica running here", make_launch("r1", generation=1, gpus=(4,)), "stale_generation", "generation 2"),
        ("generation already stopped here", make_launch("r7", generation=3, gpus=(5,)), "stale_generation", "already stopped"),
        ("GPU the node does not have", make_launch("r2", gpus=(6, 8)), "unknown_gpu", "GPU 8"),
        ("GPU held by another engine", make_launch("r2", gpus=(1, 2)), "gpu_busy", "r1.g2.r0"),
        ("replica id that cannot name a directory", make_launch("../r3", gpus=(3,)), "bad_launch", "replica id"),
        ("flag llmgw allocates", make_launch("r4", gpus=(3,), extra=("--port", "80")), "bad_launch", "--port"),
    ]
    if shutil.which("vllm") is None:
        vllm = msgspec.structs.replace(make_launch("r5", gpus=(3,)), engine="vllm", engine_args=[])
        cases.append(("engine binary that is not installed", vllm, "spawn_failed", "vllm"))
    for name, cmd, code, says in cases:
        ack = await sup.launch(cmd, NODE_GPUS)
        assert (ack.ok, ack.code) == (False, code), f"{name}: {ack}"
        assert says in ack.reason, f"{name}: reason {ack.reason!r} does not mention {says!r}"
    # Nothing refused left an engine or a directory behind.
    assert [f.replica_id for f in sup.facts()] == ["r1"]
    assert sorted(os.listdir(work_dir / "engines")) == ["r1.g2.r0"]


async def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(supervisors, work_dir):
    sup = await supervisors(stop_timeout=ESCALATION_STOP_TIMEOUT)
    ack = await sup.launch(make_launch("r1", extra=("--ignore-sigterm",)), NODE_GPUS)
    assert ack.ok, ack
    # Ready means the engine is past installing its SIGTERM disposition.
    await eventually(lambda: sup.on_change.state("r1") == "ready", "the leader to be ready")
    ((pid, started),) = recorded_engines(work_dir).values()
    (engine_dir,) = (work_dir / "engines").iterdir()
    wrapper = EngineDir(engine_dir).read_pid().wrapper_pid
    assert wrapper > 0

    stop = await sup.stop("r1", 1, reason="test")
    assert stop.ok and "SIGKILL after 1s" in stop.reason, stop
    assert procfs.is_alive(pid, started), "the stop is acked at once and completes in the background"

    exited = await eventually(lambda: (f := sup.on_change.last("r1")) and f.state == "exited" and f, "the engine to exit")
    assert exited.exit_code == -signal.SIGKILL, "SIGTERM was ignored, so only SIGKILL can have ended it"
    assert any("killed by signal 9" in line for line in exited.log_tail), exited.log_tail
    assert not group_alive(pid, started)
    # Stopped and reported: the record and its directory are gone, the wrapper reaped.
    await eventually(lambda: not sup.facts(), "the record to be dropped")
    assert os.listdir(work_dir / "engines") == []
    # Its own wrapper, by pid: zombies other tests' processes left are not this test's business.
    await eventually(lambda: wrapper not in zombie_children() and not os.path.exists(f"/proc/{wrapper}"), "the wrapper to be reaped")


async def test_a_leader_that_stops_answering_is_stalled_until_it_makes_progress(supervisors, work_dir):
    sup = await supervisors()
    assert (await sup.launch(make_launch("r1"), NODE_GPUS)).ok
    await eventually(lambda: sup.on_change.state("r1") == "ready", "the leader to be ready")
    ((pid, _),) = recorded_engines(work_dir).values()
    os.kill(pid, signal.SIGSTOP)  # frozen: alive, but answering nothing
    try:
        await eventually(lambda: sup.on_change.state("r1") == "stalled", "the frozen leader to be stalled")
    finally:
        os.kill(pid, signal.SIGCONT)
    await eventually(lambda: sup.on_change.state("r1") == "ready", "the thawed leader to be ready again")
    # State changes, in order (a slow wrapper adds a second "starting" fact with the pid).
    changes = [f for i, f in enumerate(sup.on_change.facts) if i == 0 or f.state != sup.on_change.facts[i - 1].state]
    assert [f.state for f in changes] == ["starting", "ready", "stalled", "ready"]
    stalled = changes[2]
    assert stalled.detail.startswith(("/health failed 2 times in a row", "canary sent")), stalled.detail


async def test_a_new_supervisor_adopts_running_engines_and_learns_their_exit_codes(supervisors, work_dir):
    first = await supervisors()
    rdzv = make_launch("r1").rendezvous_port
    leader = make_launch("r1", nnodes=2, rank=0, gpus=(0,), rendezvous_port=rdzv)
    worker = make_launch("r1", nnodes=2, rank=1, gpus=(1,), rendezvous_port=rdzv)
    assert (await first.launch(worker, NODE_GPUS)).ok
    assert (await first.launch(leader, NODE_GPUS)).ok
    await eventually(lambda: first.on_change.state("r1", 0) == "ready", "the leader to be ready once its worker joined")
    running = recorded_engines(work_dir)
    await first.close()  # the agent goes away; its engines must not

    second = await supervisors()
    facts = facts_by_rank(second)
    assert {k: f.pid for k, f in facts.items()} == {("r1", 0): running["r1.g1.r0"][0], ("r1", 1): running["r1.g1.r1"][0]}
    assert facts[("r1", 0)].state == "ready", "a serving leader is adopted as ready, not re-announced as starting"
    assert facts[("r1", 1)].state == "joined", "a worker holding its leader's link is adopted as joined"
    assert all(procfs.is_alive(pid, started) for pid, started in running.values()), "adoption restarted or killed an engine"
    assert recorded_engines(work_dir) == running

    # They are not this supervisor's children, yet their exit codes are known.
    assert (await second.stop("r1", 0)).ok
    await eventually(lambda: second.on_change.state("r1", 0) == "exited" and second.on_change.state("r1", 1) == "exited", "both to exit")
    assert second.on_change.last("r1", 0).exit_code == 0
    assert second.on_change.last("r1", 1).exit_code == 0
    assert not any(group_alive(pid, started) for pid, started in running.values())


async def test_an_engine_that_exits_is_reported_with_its_log_and_kept_until_stopped(supervisors, work_dir):
    sup = await supervisors()
    ack = await sup.launch(make_launch("r1", gpus=(0,), load_time="soon"), NODE_GPUS)
    assert ack.ok, ack  # it starts, then refuses its arguments
    exited = await eventually(lambda: (f := sup.on_change.last("r1")) and f.state == "exited" and f, "the engine to exit")
    assert exited.exit_code == 2
    assert any("not a duration" in line for line in exited.log_tail), exited.log_tail

    # Its GPU is free again, but the record stays, also for the next agent, until a stop.
    assert (await sup.launch(make_launch("r2", gpus=(0,)), NODE_GPUS)).ok
    await sup.close()
    again = await supervisors()
    kept = facts_by_rank(again)[("r1", 0)]
    assert (kept.state, kept.exit_code, kept.pid) == ("exited", 2, exited.pid)
    stop = await again.stop("r1", 1)
    assert stop.ok and "removed exited r1.g1.r0" in stop.reason, stop
    assert [f.replica_id for f in again.facts()] == ["r2"]
    assert not (work_dir / "engines" / "r1.g1.r0").exists()


async def test_a_reused_pid_is_neither_adopted_nor_signalled(supervisors, work_dir, tmp_path):
    # An unrelated process that happens to hold the pid the engine once had.
    stranger = await spawning.start(["sleep", "60"], start_new_session=True)
    try:
        started = procfs.start_time(stranger.pid)
        cmd = make_launch("r1", gpus=(0,))
        d = EngineDir(work_dir / "engines" / "r1.g1.r0")
        d.path.mkdir(parents=True)
        d.write_spec(EngineSpec(command=cmd, argv=["true"], serves_http=True, health_url=f"http://127.0.0.1:{cmd.http_port}/health"))
        d.write_pid(PidRecord(pid=stranger.pid, start_time=started - 1, wrapper_pid=stranger.pid, wrapper_start_time=started - 1))

        sup = await supervisors()
        fact = facts_by_rank(sup)[("r1", 0)]
        assert fact.state == "exited" and fact.exit_code is None, fact
        assert any("belongs to another process" in line for line in fact.log_tail), fact.log_tail
        assert (await sup.launch(make_launch("r2", gpus=(0,)), NODE_GPUS)).ok, "an engine that is not running holds no GPU"

        assert (await sup.stop("r1", 1)).ok
        assert not d.path.exists()
        assert stranger.poll() is None and procfs.is_alive(stranger.pid, started), "the stranger was signalled"
    finally:
        stranger.kill()
        stranger.wait()


async def test_an_unreadable_engine_directory_is_left_for_a_person(supervisors, work_dir):
    broken = work_dir / "engines" / "r1.g1.r0"
    broken.mkdir(parents=True)
    (broken / "spec.json").write_text("{not json")
    sup = await supervisors()
    assert sup.facts() == []
    assert (broken / "spec.json").read_text() == "{not json"
    # A launch of that very member keeps the old directory, moved aside.
    assert (await sup.launch(make_launch("r1", gpus=(0,)), NODE_GPUS)).ok
    aside = [n for n in os.listdir(work_dir / "engines") if n.startswith(".r1.g1.r0.unreadable")]
    assert len(aside) == 1 and (work_dir / "engines" / aside[0] / "spec.json").read_text() == "{not json"
