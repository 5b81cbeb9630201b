"""The operator's read model (``shared/readmodel.py``) and the deployment checks beside the spec
(``shared/specs.py``): table tests on plain records, with the clock passed in.

``ctl`` and the console print what these functions return, so a case here is a
fact both show the same way.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap

import msgspec
import pytest

from llmgw.shared.errors import ConfigError
from llmgw.shared.readmodel import (
    age_since,
    backing_off,
    backoff_cell,
    deployment_status,
    gpu_counts,
    gpu_holders,
    gpus_in_use,
    lease_age_text,
    lease_line,
    node_gpu_counts,
    node_rows,
    node_state,
)
from llmgw.shared.schemas import Lease, Replica, ReplicaMember, template_digest
from llmgw.shared.specs import OPERATOR_FIELDS, is_outdated, load_deployments, validate_spec
from llmgw.shared.states import HOLDING_REPLICA, NodeState, ReplicaState

from .builders import cluster, make_deployment, make_node

NOW = 1_700_000_000.0


def replica(rid: str, state: str, members: list[tuple[str, list[int]]], *, digest: str = "", deployment: str = "sim") -> Replica:
    return Replica(
        id=rid,
        deployment=deployment,
        model="sim-model",
        engine="sim",
        generation=int(rid.rsplit("-g", 1)[1]),
        state=state,
        members=[ReplicaMember(node_id=n, rank=i, role="leader" if i == 0 else "worker", gpus=g) for i, (n, g) in enumerate(members)],
        spec_digest=digest,
    )


def lease(node: str, state: str = "ready", *, renewed: float = NOW, since: float = NOW - 60) -> Lease:
    return Lease(node_id=node, state=state, boot_id=f"boot-{node}-0123456789", last_renew=renewed, since=since)


def with_gpu(record, index: int, **change):
    gpus = list(record.gpus)
    gpus[index] = msgspec.structs.replace(gpus[index], **change)
    return msgspec.structs.replace(record, gpus=gpus)


# --------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "listed, held, blocked, counts",
    [
        ([0, 1, 2, 3], [], [], (4, 4, 0, 0)),
        ([0, 1, 2, 3], [0, 1], [], (4, 2, 2, 0)),
        ([0, 1, 2, 3], [], [3], (4, 3, 0, 1)),
        # held and out of service: out of service (it is why its replica fails)
        ([0, 1, 2, 3], [0], [0, 2], (4, 2, 0, 2)),
        # a member naming a GPU the inventory no longer lists frees nothing and uses nothing
        ([0, 1], [7], [], (2, 2, 0, 0)),
        ([], [], [], (0, 0, 0, 0)),
    ],
    ids=["idle", "held", "blocked", "held-and-blocked", "unlisted-held", "no-gpus"],
)
def test_gpu_counts(listed, held, blocked, counts):
    c = gpu_counts(listed, held, blocked)
    assert (c.total, c.free, c.used, c.out_of_service) == counts


@pytest.mark.parametrize("state", list(ReplicaState))
def test_every_replica_state_but_gone_holds_its_gpus(state):
    in_use = gpus_in_use({"sim-g1": replica("sim-g1", state, [("node01", [0, 1]), ("node02", [2])])})
    holds = state != ReplicaState.GONE
    assert (state in HOLDING_REPLICA) is holds
    assert in_use == ({"node01": {0, 1}, "node02": {2}} if holds else {})


def test_a_gpu_named_by_a_replica_being_reaped_and_its_replacement_is_held_by_the_replacement():
    reps = {
        "sim-g1": replica("sim-g1", "reaping", [("node01", [0, 1])]),
        "sim-g2": replica("sim-g2", "launching", [("node01", [0])]),
    }
    held = gpu_holders(reps)["node01"]
    assert (held[0].id, held[1].id) == ("sim-g2", "sim-g1")
    assert gpus_in_use(reps) == {"node01": {0, 1}}


def test_the_read_model_counts_free_gpus_as_the_scheduler_places_them():
    """The scheduler's view decides placement; ctl and the console must never show
    a GPU free that it would not offer, nor the reverse (its capacity gauges read the same)."""
    from llmgw.services.scheduler.view import ClusterView

    node01 = with_gpu(with_gpu(make_node("node01", gpus=8), 1, healthy=False, problem="XID 79"), 2, foreign_mib=2048, foreign_pids=[4242])
    node02 = with_gpu(make_node("node02", gpus=8), 0, healthy=False)
    nodes, leases = cluster(node01, node02, make_node("node03", None, gpus=2))
    reps = {
        rid: replica(rid, state, members)
        for rid, state, members in [
            ("a-g1", "ready", [("node01", [0, 1]), ("node02", [0, 3])]),
            ("b-g1", "reaping", [("node01", [4]), ("node02", [5])]),
            ("c-g1", "pending", [("node03", [1])]),
            ("d-g1", "gone", [("node01", [6, 7]), ("node03", [0])]),
        ]
    }
    view = ClusterView.build(nodes, leases, reps.values())
    in_use = gpus_in_use(reps)
    rows = {r["node_id"]: r for r in node_rows(nodes, leases, reps, NOW)}
    for node_id, v in view.nodes.items():
        ours = node_gpu_counts(nodes[node_id], in_use)
        assert ours == gpu_counts(v.gpus, v.used_gpus, v.blocked), node_id
        assert rows[node_id]["gpus_free"] == ours.free == v.free_gpu_count(), node_id
    # node01: 0, 1 and 4 held, 1 unhealthy, 2 busy; d-g1 is gone and holds nothing
    assert [rows[n]["gpus_free"] for n in ("node01", "node02", "node03")] == [4, 5, 1]


# --------------------------------------------------------------------------
# nodes: state word, lease age, the ctl nodes -o json contract
# --------------------------------------------------------------------------


@pytest.mark.parametrize("lease_state", ["ready", "suspect", "lost", None])
@pytest.mark.parametrize("admin", ["active", "cordoned", "draining"])
def test_a_node_word_is_one_of_the_node_states(lease_state, admin):
    word = node_state(make_node("node01", admin=admin), lease("node01", lease_state) if lease_state else None)
    assert isinstance(word, NodeState)


@pytest.mark.parametrize(
    "state, age, text",
    [
        # ready: its renewal was checkpointed that long ago; the node was heard since
        ("ready", 0.44, "≤0.4s"),
        ("ready", 27.0, "≤27s"),
        ("ready", 75.0, "≤1m15s"),
        # suspect and lost are written when they change, with the last heartbeat: exact
        ("suspect", 4.0, "4.0s"),
        ("lost", 66.0, "1m06s"),
        ("unknown", None, "-"),
    ],
)
def test_lease_age_text_claims_no_more_than_the_record_knows(state, age, text):
    assert lease_age_text(state, age) == text


@pytest.mark.parametrize(
    "the_lease, line",
    [
        (lease("node01", renewed=NOW - 0.4), "ready for 1m00s, renewed ≤0.4s ago, boot boot-nod"),
        (lease("node01", "lost", renewed=NOW - 66, since=NOW - 6), "lost for 6.0s, renewed 1m06s ago, boot boot-nod"),
        (None, "no lease yet"),
    ],
)
def test_lease_line(the_lease, line):
    assert lease_line(the_lease, NOW) == line


NODE_ROW_FIELDS = {
    "node_id", "fabrics", "unusable_fabrics", "gpus_total", "gpus_free", "gpus_out_of_service", "state", "admin",
    "admin_reason", "admin_by", "mgmt_addr", "addr_verified", "mgmt_ips", "addr_problem", "quarantine", "lease_age",
}  # fmt: skip


def test_ctl_nodes_json_keeps_its_fields_and_values():
    """Operators script against ``ctl nodes -o json``: the names and meanings stay."""
    node01 = with_gpu(make_node("node01", gpus=4), 3, healthy=False, problem="XID 79")
    nodes, leases = cluster(node01, make_node("node02", gpus=2))
    leases = {"node01": lease("node01", renewed=NOW - 2.5)}  # node02: registered, no lease yet
    rows = node_rows(nodes, leases, {"sim-g1": replica("sim-g1", "ready", [("node01", [0])])}, NOW)
    assert [set(r) for r in rows] == [NODE_ROW_FIELDS, NODE_ROW_FIELDS]
    first, second = json.loads(json.dumps(rows))
    assert {k: first[k] for k in ("node_id", "fabrics", "gpus_total", "gpus_free", "gpus_out_of_service", "state", "lease_age")} == {
        "node_id": "node01",
        "fabrics": ["ib-a"],
        "gpus_total": 4,
        "gpus_free": 2,
        "gpus_out_of_service": {"3": "unhealthy: XID 79"},
        "state": "ready",
        "lease_age": 2.5,
    }
    assert (second["state"], second["lease_age"], second["gpus_free"]) == ("unknown", None, 2)


# --------------------------------------------------------------------------
# deployments: ready, outdated, backoff
# --------------------------------------------------------------------------

SPEC = make_deployment("sim", replicas=3)
CURRENT = template_digest(SPEC)


@pytest.mark.parametrize(
    "state, digest, deployment, ready, outdated",
    [
        ("ready", CURRENT, "sim", 1, 0),
        ("ready", "0ld", "sim", 1, 1),
        ("degraded", "0ld", "sim", 0, 1),
        ("launching", "0ld", "sim", 0, 1),
        ("pending", "0ld", "sim", 0, 1),
        # on its way out already: the rolling update has nothing left to do with it
        ("failed", "0ld", "sim", 0, 0),
        ("reaping", "0ld", "sim", 0, 0),
        ("gone", "0ld", "sim", 0, 0),
        # a record from before digests were kept is never outdated
        ("ready", "", "sim", 1, 0),
        ("ready", "0ld", "other", 0, 0),
    ],
)
def test_deployment_status(state, digest, deployment, ready, outdated):
    status = deployment_status(SPEC, [replica("x-g1", state, [("node01", [0])], digest=digest, deployment=deployment)])
    assert (status.ready, status.wanted, status.outdated) == (ready, 3, outdated)


@pytest.mark.parametrize("spec_digest, digest, outdated", [("a", "a", False), ("a", "b", True), ("", "b", False), ("a", "", False)])
def test_is_outdated(spec_digest, digest, outdated):
    assert is_outdated(replica("sim-g1", "ready", [], digest=spec_digest), digest) is outdated


@pytest.mark.parametrize(
    "failures, retry_in, waiting, cell",
    [(0, 0.0, False, "-"), (2, 5.0, True, "2×, next {at}"), (2, -1.0, False, "2×"), (0, 5.0, False, "-")],
    ids=["none", "waiting", "retrying", "no-failures"],
)
def test_backoff(failures, retry_in, waiting, cell):
    spec = msgspec.structs.replace(SPEC, failures=failures, retry_at=NOW + retry_in, last_failure="x")
    assert backing_off(spec, NOW) is waiting
    assert backoff_cell(spec, NOW) == cell.format(at=dt.datetime.fromtimestamp(NOW + retry_in).strftime("%H:%M:%S"))


@pytest.mark.parametrize("t, text", [(0.0, "-"), (NOW - 2, "2.0s"), (NOW - 75, "1m15s")])
def test_age_since(t, text):
    assert age_since(t, NOW) == text


# --------------------------------------------------------------------------
# specs: what an operator writes
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "Bad_Name"}, "invalid deployment name 'Bad_Name'"),
        ({"model": ""}, "model: must not be empty"),
        ({"replicas": -1}, "replicas: must be 0 or more, got -1"),
        ({"nodes_per_replica": 0}, "nodes_per_replica: must be at least 1, got 0"),
        ({"gpus_per_node": -2}, "gpus_per_node: must be 0 or more, got -2"),
        ({"startup_timeout": 0.0}, "startup_timeout: must be positive, got 0.0"),
        ({"env": {"A=B": "x"}}, "env: 'A=B' is not a valid environment variable name"),
    ],
)
def test_validate_spec_names_the_field(change, message):
    with pytest.raises(ConfigError) as e:
        validate_spec(msgspec.structs.replace(SPEC, **change))
    assert message in str(e.value)


def test_validate_spec_passes_what_can_run():
    assert validate_spec(SPEC) is SPEC


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: demo\nmodel: m\nengine: sim\nreplicas: 1\ngpus_per_nod: 2\n", "deployments[0].gpus_per_nod: unknown key; did you mean 'gpus_per_node'?"),
        (
            "name: demo\nmodel: m\nengine: sim\nreplicas: 1\ngpus_per_node: 2\nfailures: 3\n",
            "deployments[0].failures: unknown key (known keys here: name, model,",
        ),
        ("name: demo\nmodel: m\nengine: sim\nreplicas: two\ngpus_per_node: 2\n", "deployments[0].replicas: expected a whole number, got a string 'two'"),
        ("- name: demo\n  model: m\n  engine: simm\n  replicas: 1\n  gpus_per_node: 2\n", "deployments[0].engine: 'simm' is not one of vllm, sglang, sim"),
        ("- 3\n", "deployments[0]: expected a mapping"),
        ("deployments: []\n", "expected a deployment mapping, a list of them, or 'deployments: [...]'"),
        ("name: demo\nmodel: m\nengine: sim\nreplicas: 1\ngpus_per_node: 2\nstartup_timeout: soon\n", "deployments[0].startup_timeout"),
    ],
    ids=["misspelt", "schedulers-field", "wrong-type", "unknown-engine", "not-a-mapping", "empty", "bad-duration"],
)
def test_load_deployments_refuses_with_the_item_and_key_named(tmp_path, text, message):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_deployments(str(path))
    assert message in str(e.value) and str(path) in str(e.value)


ONE = "name: {n}\nmodel: m\nengine: sim\nreplicas: 1\ngpus_per_node: 2\nstartup_timeout: 90s\n"


@pytest.mark.parametrize(
    "text",
    [
        ONE.format(n="a"),
        "- " + ONE.format(n="a").replace("\n", "\n  ").rstrip() + "\n- " + ONE.format(n="b").replace("\n", "\n  ").rstrip() + "\n",
        "deployments:\n  - " + ONE.format(n="a").replace("\n", "\n    ").rstrip() + "\n",
    ],
    ids=["mapping", "list", "deployments-key"],
)
def test_load_deployments_reads_a_mapping_a_list_or_a_deployments_key(tmp_path, text):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    specs = load_deployments(str(path))
    assert [s.name for s in specs] == ["a", "b"][: len(specs)] and specs[0].startup_timeout == 90.0
    assert len(specs) == (2 if text.startswith("- ") else 1)


def test_an_operator_writes_no_field_the_scheduler_keeps():
    assert not {"applied_at", "last_generation", "failures", "last_failure", "retry_at"} & set(OPERATOR_FIELDS)
    assert {"name", "model", "engine", "replicas", "gpus_per_node", "engine_args", "env", "startup_timeout"} <= set(OPERATOR_FIELDS)


# --------------------------------------------------------------------------
# what reading costs: no service imported
# --------------------------------------------------------------------------


def test_ctl_and_the_console_import_no_service_module(tmp_path):
    """``llmgw ctl`` and the console read through the read model; importing a
    service's module would register its metrics and drag in its dependencies.
    The probe walks the paths that once imported one lazily: ``ctl nodes`` rows,
    the console's node detail, and ``ctl deploy apply`` checking a file."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nmodel: m\nengine: sim\nreplicas: -1\ngpus_per_node: 2\n")
    probe = textwrap.dedent(
        f"""
        import argparse, sys
        from llmgw.services.ctl import ops
        from llmgw.shared.errors import ConfigError
        from llmgw.shared.schemas import Gpu, NodeRecord
        from llmgw.tui.cluster import NODES, ClusterModel
        from llmgw.tui.model import node_detail

        node = NodeRecord(node_id="node01", identity="CN=node01,OU=node", gpus=[Gpu(index=0, uuid="GPU-0", name="H200")])
        ops.node_rows({{"node01": node}}, {{}}, {{}})
        model = ClusterModel()
        model.fold(NODES, "node01", node)
        node_detail("node01", model, [], 0.0)
        try:
            ops.deploy(argparse.Namespace(deploy_cmd="apply", file={str(bad)!r}))
        except ConfigError as e:
            assert "replicas: must be 0 or more" in str(e), e
        else:
            raise SystemExit("deploy apply accepted replicas: -1")
        print([m for m in sys.modules if m.startswith("llmgw.services.") and not m.startswith("llmgw.services.ctl")])
        """
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
