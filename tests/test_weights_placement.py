"""Placement prefers nodes whose model cache holds a replica's weights: the
scorer as a table, and what ``place`` and ``explain`` make of it."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.services.scheduler.filters import Request
from llmgw.services.scheduler.placement import GROUP_SCORERS, PlacementCache, _indexes, explain, place
from llmgw.services.scheduler.scorers import STAGING_WEIGHT, FabricWeightsCached, WeightsCached
from llmgw.services.scheduler.view import ClusterView, node_view
from llmgw.shared.schemas import CacheEntry, ModelCacheReport, NodeRecord

from .builders import cluster, make_deployment, make_lease, make_node

SOURCE = "path:/srv/models/llama-8b"


def cached(record: NodeRecord, *entries: CacheEntry) -> NodeRecord:
    return msgspec.structs.replace(record, model_cache=ModelCacheReport(budget=1 << 40, entries=list(entries)))


def done(source: str = SOURCE, size: int = 100) -> CacheEntry:
    return CacheEntry(source=source, digest="sha256:x", size=size, staged_bytes=size, complete=True)


def copying(copied: int, size: int = 100) -> CacheEntry:
    return CacheEntry(source=SOURCE, size=size, staged_bytes=copied, complete=False)


NODE_SCORES = [
    ("holds the weights", [done()], SOURCE, 1.0),
    ("holds them among others", [done("path:/other"), done()], SOURCE, 1.0),
    ("copying them, half way", [copying(50)], SOURCE, STAGING_WEIGHT / 2),
    ("copying them, not started", [copying(0)], SOURCE, 0.0),
    ("holds other weights", [done("path:/other")], SOURCE, 0.0),
    ("its last copy of them failed", [CacheEntry(source=SOURCE, problem="disk full")], SOURCE, 0.0),
    ("an empty cache", [], SOURCE, 0.0),
    ("no cache at all", None, SOURCE, 0.0),
    ("the deployment names no source", [done()], "", 0.0),
    ("a model id is another source than a path", [done("model:srv/models/llama-8b")], SOURCE, 0.0),
]


@pytest.mark.parametrize(("entries", "wanted", "score"), [r[1:] for r in NODE_SCORES], ids=[r[0] for r in NODE_SCORES])
def test_weights_cached_scores_a_node(entries, wanted, score):
    record = make_node("node01", None, 8)
    if entries is not None:
        record = cached(record, *entries)
    view = ClusterView.build({"node01": record}, {"node01": make_lease("node01")}, [])
    node = node_view("node01", record, make_lease("node01"))
    assert WeightsCached().score(node, Request("d", 4, 1, wanted), view) == pytest.approx(score)


def view_of(*records: NodeRecord) -> ClusterView:
    nodes, leases = cluster(*records)
    return ClusterView.build(nodes, leases, [])


def test_a_single_node_replica_goes_where_its_weights_are_not_where_it_packs_best():
    # node01 is the fullest fit (bin-packing's choice) but node03 holds the weights.
    view = view_of(make_node("node01", None, 4), make_node("node02", None, 8), cached(make_node("node03", None, 8), done()))
    view.nodes["node01"].used_gpus.update({0, 1})
    assert place(Request("d", 2, 1), view).members[0].node_id == "node01"  # no source: packing decides
    assert place(Request("d", 2, 1, SOURCE), view).members[0].node_id == "node03"
    # A node holding the weights that cannot take the member is not chosen for them.
    view.nodes["node03"].used_gpus.update(range(7))
    assert place(Request("d", 2, 1, SOURCE), view).members[0].node_id == "node01"


def test_a_multi_node_replica_prefers_the_fabric_holding_its_weights_and_leads_from_a_holder():
    view = view_of(
        make_node("node01", "ib-a"),
        make_node("node02", "ib-a"),
        make_node("node03", "ib-b"),
        cached(make_node("node04", "ib-b"), done()),
    )
    result = place(Request("d", 4, 2, SOURCE), view)
    assert result.fabric == "ib-b" and [m.node_id for m in result.members] == ["node04", "node03"]
    assert place(Request("d", 4, 2), view).fabric == "ib-a"  # without a source: ties by name
    ranks = {type(s).__name__: i for i, s in enumerate(GROUP_SCORERS)}
    assert ranks["FabricSpread"] < ranks["FabricWeightsCached"] < ranks["FabricBinPack"]  # the fabric rule first


def test_the_fabric_score_counts_holders_up_to_the_replica_size():
    view = view_of(cached(make_node("node01", "ib-a"), done()), cached(make_node("node02", "ib-a"), done()), make_node("node03", "ib-a"))
    (index,) = _indexes(view, PlacementCache(), True).values()
    scorer = FabricWeightsCached()
    assert scorer.score("ib-a", index, Request("d", 4, 2, SOURCE), view) == 1.0
    assert scorer.score("ib-a", index, Request("d", 4, 4, SOURCE), view) == 0.5
    assert scorer.score("ib-a", index, Request("d", 9, 2, SOURCE), view) == 0.0  # none fits a member
    assert scorer.score("ib-a", index, Request("d", 4, 2), view) == 0.0


def test_explain_shows_each_nodes_weights_score():
    spec = make_deployment(replicas=1, nodes_per_replica=1, gpus_per_node=2)
    spec = msgspec.structs.replace(spec, weights_path="/srv/models/llama-8b")
    view = view_of(make_node("node01", None, 4), cached(make_node("node02", None, 8), done()))
    ex = explain(spec, view)
    assert {n.node_id: n.scores for n in ex.nodes} == {"node01": {"weights_cached": 0.0}, "node02": {"weights_cached": 1.0}}
    assert ex.leader == "node02"
