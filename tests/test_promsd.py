"""Prometheus HTTP service discovery of the engines (``GET /sd/engines``, promsd.py).

The table tests feed records to the pure builder; the others run a real
gateway on a real nats-server, fed replica records under the scheduler's
identity, in front of a real ``sim`` engine whose ``/metrics`` the discovered
target must serve.
"""

from __future__ import annotations

import aiohttp
import pytest

from llmgw.services.gateway.auth import digest
from llmgw.services.gateway.promsd import engine_targets, target_of
from llmgw.shared.schemas import Replica, ReplicaMember

from .gateway_helpers import HOST, Board, gateway_config, replica, start_gateway, start_sims, wait_for

pytestmark = pytest.mark.timeout(60)


def rec(
    rid="r1", state="ready", endpoint="http://10.0.0.1:8000", *, deployment="llama", model="meta/llama", fabric="ib-a", engine="vllm", members=None
) -> Replica:
    if members is None:
        members = [
            ReplicaMember(node_id="node02", rank=1, role="worker", gpus=[0]),
            ReplicaMember(node_id="node01", rank=0, role="leader", gpus=[0], http_port=8000, serves_http=True),
        ]
    return Replica(id=rid, deployment=deployment, model=model, engine=engine, generation=1, state=state, fabric=fabric, members=members, endpoint=endpoint)


LABELS = {"deployment": "llama", "replica": "r1", "model": "meta/llama", "node": "node01", "fabric": "ib-a", "engine": "vllm"}


@pytest.mark.parametrize(
    "records, expected",
    [
        ([], []),
        ([rec()], [{"targets": ["10.0.0.1:8000"], "labels": LABELS}]),
        # only ready replicas: every other state is dropped, as from routing
        *[([rec(state=s)], []) for s in ("pending", "launching", "waiting-for-workers", "degraded", "failed", "reaping", "gone")],
        # no endpoint yet, or one that names no usable host:port
        ([rec(endpoint="")], []),
        ([rec(endpoint="10.0.0.1:8000")], []),
        ([rec(endpoint="ftp://10.0.0.1:21")], []),
        ([rec(endpoint="http://10.0.0.1:notaport")], []),
        ([rec(endpoint="http://:8000")], []),
        # https: the scheme travels as Prometheus's __scheme__ label
        ([rec(endpoint="https://gpu1.example:8443")], [{"targets": ["gpu1.example:8443"], "labels": {**LABELS, "__scheme__": "https"}}]),
        # IPv6 keeps its brackets; a path on the endpoint is not part of the target
        ([rec(endpoint="http://[fd00::1]:8000/")], [{"targets": ["[fd00::1]:8000"], "labels": LABELS}]),
        # no leader member recorded, no fabric: empty labels, not missing ones
        ([rec(members=[], fabric=None)], [{"targets": ["10.0.0.1:8000"], "labels": {**LABELS, "node": "", "fabric": ""}}]),
        # sorted by deployment, then replica, whatever order the records come in
        (
            [
                rec("r2", deployment="b", endpoint="http://h:2"),
                rec("r9", deployment="a", endpoint="http://h:9"),
                rec("r1", deployment="b", endpoint="http://h:1"),
            ],
            [("a", "r9", "h:9"), ("b", "r1", "h:1"), ("b", "r2", "h:2")],
        ),
    ],
)
def test_engine_targets(records, expected):
    got = engine_targets(records)
    if expected and isinstance(expected[0], tuple):
        got = [(g["labels"]["deployment"], g["labels"]["replica"], g["targets"][0]) for g in got]
    assert got == expected


@pytest.mark.parametrize("endpoint", ["http://h", "https://h"])
def test_an_endpoint_without_a_port_is_the_host_alone(endpoint):
    # Prometheus then uses the scheme's default port
    assert target_of(endpoint) == ("h", endpoint.split(":")[0])


async def sd(gw, **headers) -> tuple[int, str, object]:
    async with aiohttp.ClientSession() as s, s.get(f"http://{HOST}:{gw.port}/sd/engines", headers=headers) as r:
        return r.status, r.headers.get("content-type", ""), await r.json(content_type=None)


async def test_discovery_lists_ready_engines_whose_metrics_answer_and_drops_one_torn_down(nats_server, tmp_path):
    starting = start_sims(tmp_path, [("a", "org/alpha", 0.0), ("b", "org/alpha", 0.0)])
    board = await Board.open(nats_server)
    cfg = gateway_config(nats_server, "gw0")
    nats_server.reload()
    sims = await starting
    gw = None
    try:
        gw = await start_gateway(cfg)
        await board.put(replica("alpha-1", "org/alpha", sims[0].endpoint, deployment="alpha", node="node01"))
        await board.put(replica("alpha-2", "org/alpha", sims[1].endpoint, deployment="alpha", node="node03"))
        await board.put(replica("alpha-3", "org/alpha", state="launching", deployment="alpha", node="node02"))

        def targets():
            return [(g["labels"]["replica"], g["labels"]["node"], g["targets"][0]) for g in engine_targets(gw.replicas.items.values())]

        want = [("alpha-1", "node01", f"{HOST}:{sims[0].port}"), ("alpha-2", "node03", f"{HOST}:{sims[1].port}")]
        await wait_for(targets, "both ready replicas in the gateway's copy", expected=want)
        status, ctype, body = await sd(gw)
        assert (status, ctype) == (200, "application/json")
        assert [(g["labels"]["replica"], g["labels"]["node"], g["targets"][0]) for g in body] == want
        assert body[0]["labels"] == {"deployment": "alpha", "replica": "alpha-1", "model": "org/alpha", "node": "node01", "fabric": "", "engine": "sim"}
        # what Prometheus will scrape there: the engine's own metrics
        async with aiohttp.ClientSession() as s:
            for g in body:
                async with s.get(f"http://{g['targets'][0]}/metrics") as r:
                    assert r.status == 200
                    assert "vllm:num_requests_running" in await r.text()

        # torn down: the record leaves ready, then goes; the target leaves the list
        await board.put(replica("alpha-2", "org/alpha", state="reaping", deployment="alpha", node="node03"))
        await wait_for(targets, "alpha-2 dropped", expected=want[:1])
        assert [g["labels"]["replica"] for g in (await sd(gw))[2]] == ["alpha-1"]
        await board.delete("alpha-1")
        await wait_for(targets, "alpha-1 dropped", expected=[])
        assert (await sd(gw))[2] == []
    finally:
        if gw is not None:
            await gw.stop()
        for sim in sims:
            sim.kill()
        await board.close()


async def test_discovery_asks_for_the_same_api_keys_as_the_api(nats_server, tmp_path):
    (tmp_path / "keys").write_text(digest("s3cret") + "\n")
    board = await Board.open(nats_server)
    cfg = gateway_config(nats_server, "gw0", api_keys_file=str(tmp_path / "keys"))
    nats_server.reload()
    gw = await start_gateway(cfg)
    try:
        await board.put(replica("alpha-1", "org/alpha", "http://127.0.0.1:9", deployment="alpha"))
        await wait_for(lambda: list(gw.replicas.items), "the record in the gateway's copy", expected=["alpha-1"])
        status, _, body = await sd(gw)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, _, body = await sd(gw, Authorization="Bearer wrong")
        assert status == 401
        status, _, body = await sd(gw, Authorization="Bearer s3cret")
        assert status == 200 and [g["targets"] for g in body] == [["127.0.0.1:9"]]
        # any other method is refused with the one allowed
        async with aiohttp.ClientSession() as s, s.post(f"http://{HOST}:{gw.port}/sd/engines", headers={"Authorization": "Bearer s3cret"}) as r:
            assert (r.status, r.headers.get("Allow")) == (405, "GET")
    finally:
        await gw.stop()
        await board.close()
