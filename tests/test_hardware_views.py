"""What an operator sees of hardware out of service (docs/hardware.md): ``ctl nodes`` rows and the console's GPU cells."""

from __future__ import annotations

import msgspec

from llmgw.services.ctl.ops import node_rows
from llmgw.tui.cluster import LEASES, NODES, ClusterModel
from llmgw.tui.model import FOREIGN_MARK, UNHEALTHY_MARK, MarkBook, node_detail, node_view

from .builders import cluster, make_node

XID79 = "XID 79: GPU has fallen off the bus"


def degraded_node01():
    rec = make_node("node01", "ib-a", gpus=4, usable=False, problem="mlx5_0: no ACTIVE port: port 1 is 1: DOWN")
    gpus = list(rec.gpus)
    gpus[1] = msgspec.structs.replace(gpus[1], healthy=False, problem=XID79)
    gpus[2] = msgspec.structs.replace(gpus[2], foreign_mib=2048, foreign_pids=[4242])
    return msgspec.structs.replace(rec, gpus=gpus)


def test_ctl_nodes_rows_name_each_gpu_and_fabric_out_of_service_and_do_not_count_them_free():
    nodes, leases = cluster(degraded_node01())
    (row,) = node_rows(nodes, leases, {})
    assert row["gpus_free"] == 2 and row["gpus_total"] == 4
    assert row["gpus_out_of_service"] == {
        "1": f"unhealthy: {XID79}",
        "2": "busy: 2048 MiB held by process(es) llmgw did not start (pid 4242)",
    }
    assert row["unusable_fabrics"] == {"ib-a": "mlx5_0: no ACTIVE port: port 1 is 1: DOWN"}


def test_console_cells_mark_an_unhealthy_gpu_and_a_foreign_one_and_the_detail_says_why():
    nodes, leases = cluster(degraded_node01())
    model = ClusterModel()
    model.replace(NODES, nodes)
    model.replace(LEASES, leases)
    view = node_view(model, "ib-a", "node01", 0.0, MarkBook())
    assert [(c.mark, c.tone) for c in view.cells] == [("·", "free"), (UNHEALTHY_MARK, "broken"), (FOREIGN_MARK, "foreign"), ("·", "free")]
    assert view.gpus_free == 2
    assert f"GPU 1 unhealthy: {XID79}" in view.problem and "ib-a: mlx5_0: no ACTIVE port" in view.problem
    detail = node_detail("node01", model, [], 0.0)
    assert [(g.index, g.problem) for g in detail.gpus] == [
        (0, ""),
        (1, f"unhealthy: {XID79}"),
        (2, "busy: 2048 MiB held by process(es) llmgw did not start (pid 4242)"),
        (3, ""),
    ]
