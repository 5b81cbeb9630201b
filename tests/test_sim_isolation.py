"""Two simulated clusters on one machine: one's `kill-node`/`down` touches only its own.

Both clusters have a node01 (the layout names nodes the same everywhere), and
before, `llmgw sim kill-node node01` and `llmgw down` killed every process on the
machine carrying LLMGW_SIM_NODE=node01 — another cluster's agents and engines,
or a test's. Real processes with the real markers, killed for real.
"""

from __future__ import annotations

import os
import subprocess
import sys

from llmgw.services.devcluster import simcluster

from .waiting import eventually_sync


def spawn(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **env}, start_new_session=True)


def test_kill_node_of_one_cluster_leaves_the_other_clusters_node_alone(tmp_path):
    mine = spawn(simcluster.cluster_env(tmp_path / "a", "node01"))
    theirs = spawn(simcluster.cluster_env(tmp_path / "b", "node01"))
    try:
        # Popen returns when exec closes its close-on-exec pipe, which the kernel does
        # before it lays out the new process's environment: for a moment after,
        # /proc/<pid>/environ is empty, and a kill-node then finds nothing (a hunt run
        # under load did: [] == [pid]). Both must carry their markers first.
        for p, d in ((mine, "a"), (theirs, "b")):
            eventually_sync(
                lambda d=d: simcluster.processes_of("node01", str((tmp_path / d).resolve())), [p.pid], what=f"cluster {d}'s node01 visible by its markers"
            )
        killed = simcluster.kill_node("node01", str((tmp_path / "a").resolve()))
        assert killed == [mine.pid]
        assert mine.wait(10) == -9
        assert theirs.poll() is None, "the other cluster's node01 was killed"
        assert simcluster.processes_of("node01", str((tmp_path / "b").resolve())) == [theirs.pid]
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait(10)


def test_up_puts_its_nodes_on_a_loopback_net_no_one_listens_on():
    """Two `llmgw up` clusters on one machine: the second's nodes move to the next free
    127.0.M.0/24 instead of sharing the first's addresses and engine ports."""
    import socket

    from llmgw.services.devcluster.up import _free_node_net

    first = _free_node_net(4)
    with socket.socket() as s:  # the first cluster's node02 engine, listening
        s.bind((f"{first}.2", 0))
        s.listen()
        second = _free_node_net(4)
        assert second != first
        from llmgw.shared.procnet import listening_sockets

        taken = {a for a, _ in listening_sockets()}
        assert not any(f"{second}.{i}" in taken for i in range(1, 5))
