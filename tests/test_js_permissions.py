"""JetStream rights against a real nats-server: the operator (and every service)
reads through an explicit allow-list and commands nothing through JetStream.

Two attacks that worked with the operator's old ``$JS.API.>``:

* ``$JS.API.STREAM.UPDATE.LLMGW_EVENTS`` with ``max_msgs=1`` dropped the event
  history to one message;
* ``$JS.API.STREAM.CREATE`` of a stream on ``llmgw.api.>`` plus a push consumer
  delivering to ``llmgw.cmd.node01.launch`` made the agent on node01 run the
  operator's message, though a direct publish there is refused.

nats-server does not check a push consumer's ``deliver_subject`` against its
creator's publish rights (asserted below, so a server that starts to is
noticed), so anyone who may create a consumer can replay a stream's messages
onto a command subject. The agent therefore obeys only a request published on
its own command subject with a reply: a JetStream delivery keeps its stream's
subject, and a reply redirected onto a command subject has no reply.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, StreamConfig

from llmgw.shared import buckets as B
from llmgw.shared import bus
from llmgw.shared import subjects as S
from llmgw.shared.names import ROLES
from llmgw.shared.schemas import encode

from .agent_helpers import AgentProcess, Tap, fake_ib_root, fake_nvidia_smi, kill_engines, make_launch, recorded_engines, write_agent_yaml
from .waiting import eventually

pytestmark = pytest.mark.timeout(60)

NODE = "node01"


def violation(connector, label: str, subject: str):
    """The permissions violations ``label``'s connection was told about for ``subject``."""
    needle = f'permissions violation for publish to "{subject}"'.lower()
    return [str(e) for e in connector.errors.get(label, []) if needle in str(e).lower()]


async def refused(connector, nc, label: str, subject: str, payload: bytes) -> None:
    """Request ``subject`` and see the server refuse it: a violation, and no answer."""
    req = asyncio.create_task(nc.request(subject, payload, timeout=2))
    await eventually(lambda: violation(connector, label, subject), what=f"{label} refused {subject}", timeout=5)
    with pytest.raises(NatsTimeout):
        await req


@pytest.fixture
async def idents(connector, nats_server):
    """Operator, scheduler and gateway connections (one reload), and the event stream with history."""
    tls = {
        "ops": connector.identity("ops", "operator", reload=False),
        "scheduler": connector.identity("scheduler", "scheduler", reload=False),
        "gw1": connector.identity("gw1", "gateway", reload=False),
    }
    nats_server.reload()
    ncs = {k: await connector.connect(v, label=k) for k, v in tls.items()}
    js = ncs["scheduler"].jetstream(timeout=5)
    await bus.provision(js, (S.BUCKET_REPLICAS,), events=True)
    for i in range(5):
        await js.publish(f"{S.EVENT_SPACE}.replica.r{i}.created", b"{}")
    return ncs


async def test_operator_cannot_shrink_the_event_history(connector, idents):
    ops = idents["ops"]
    cfg = StreamConfig(name=S.EVENT_STREAM, subjects=[S.ALL_EVENTS], max_msgs=1)
    await refused(connector, ops, "ops", f"$JS.API.STREAM.UPDATE.{S.EVENT_STREAM}", json.dumps(cfg.as_dict()).encode())
    info = await idents["scheduler"].jetstream().stream_info(S.EVENT_STREAM)
    assert info.state.messages == 5
    assert info.config.max_msgs != 1


async def test_operator_cannot_create_or_delete_streams(connector, idents):
    ops = idents["ops"]
    evil = StreamConfig(name="EVIL", subjects=[f"{S.API_SPACE}.evil.>"])
    # a durable consumer is state the operator would leave behind in the server
    durable = json.dumps({"stream_name": S.EVENT_STREAM, "config": {"durable_name": "mine", "ack_policy": "explicit"}}).encode()
    # All at once: each waits out its own request's timeout (no answer), on its own subject.
    await asyncio.gather(
        refused(connector, ops, "ops", "$JS.API.STREAM.CREATE.EVIL", json.dumps(evil.as_dict()).encode()),
        refused(connector, ops, "ops", f"$JS.API.STREAM.PURGE.{S.EVENT_STREAM}", b""),
        refused(connector, ops, "ops", f"$JS.API.STREAM.DELETE.{S.kv_stream(S.BUCKET_REPLICAS)}", b""),
        refused(connector, ops, "ops", f"$JS.API.CONSUMER.DURABLE.CREATE.{S.EVENT_STREAM}.mine", durable),
    )
    names = [s.config.name for s in await ops.jetstream().streams_info()]
    assert "EVIL" not in names and S.EVENT_STREAM in names


async def test_gateway_cannot_touch_streams(connector, idents):
    gw = idents["gw1"]
    cfg = StreamConfig(name=S.EVENT_STREAM, subjects=[S.ALL_EVENTS], max_msgs=1)
    await asyncio.gather(  # at once, as above
        refused(connector, gw, "gw1", f"$JS.API.STREAM.UPDATE.{S.EVENT_STREAM}", json.dumps(cfg.as_dict()).encode()),
        refused(connector, gw, "gw1", "$JS.API.STREAM.CREATE.EVIL", json.dumps(StreamConfig(name="EVIL", subjects=["x.>"]).as_dict()).encode()),
    )


async def test_the_gateway_publishes_request_events_only(connector, idents):
    """Its one kind of event (a stream moved between replicas); never a replica's or a node's."""
    gw = idents["gw1"]
    ack = await gw.jetstream(timeout=5).publish(f"{S.EVENT_SPACE}.request.chatcmpl-1.migrated", b"{}")
    assert ack.stream == S.EVENT_STREAM
    for subject in (f"{S.EVENT_SPACE}.replica.r1.failed", f"{S.EVENT_SPACE}.node.node01.lost"):
        await refused(connector, gw, "gw1", subject, b"{}")


async def test_operator_read_paths_work(idents):
    """What ctl, the console and `nats kv/stream` use: info, list, get, keys, watch, an event feed."""
    kv = await idents["scheduler"].jetstream().key_value(S.BUCKET_REPLICAS)
    await kv.put("r1", b'{"replica_id": "r1"}')
    js = idents["ops"].jetstream(timeout=5)
    assert (await js.stream_info(S.EVENT_STREAM)).state.messages == 5
    assert S.kv_stream(S.BUCKET_REPLICAS) in [s.config.name for s in await js.streams_info()]
    okv = await js.key_value(S.BUCKET_REPLICAS)
    assert (await okv.get("r1")).value == b'{"replica_id": "r1"}'
    assert await okv.keys() == ["r1"]
    w = await okv.watchall()
    first = await w.updates(timeout=5)
    assert first.key == "r1"
    await w.stop()
    sub = await js.subscribe(S.ALL_EVENTS, ordered_consumer=True)
    got = [await sub.next_msg(timeout=5) for _ in range(5)]
    assert [m.subject for m in got] == [f"{S.EVENT_SPACE}.replica.r{i}.created" for i in range(5)]
    await sub.unsubscribe()


# --------------------------------------------------------------------------
# only a stream's owner may change it
# --------------------------------------------------------------------------


@pytest.fixture
async def every_identity(connector, nats_server):
    """A connection under each role (one reload), and every stream provisioned by its
    writers, each holding a message."""
    tls = {role: connector.identity(f"{role}1" if role == "node" else role, role, reload=False) for role in ROLES}
    nats_server.reload()
    ncs = {role: await connector.connect(t, label=role) for role, t in tls.items()}
    for role in ("registry", "health", "scheduler"):
        js = ncs[role].jetstream(timeout=5)
        await bus.provision(js, tuple(b.name for b in B.written_by(role)), events=B.publishes_events(role))
        for b in B.written_by(role):
            await (await js.key_value(b.name)).put(role, b"{}")
    await ncs["scheduler"].jetstream(timeout=5).publish(f"{S.EVENT_SPACE}.replica.r1.created", b"{}")
    return ncs


async def _answered(nc, subject: str, payload: bytes) -> dict:
    reply = await nc.request(subject, payload, timeout=5)
    return json.loads(reply.data)


async def test_only_a_streams_owner_may_update_it_and_no_one_deletes_one(connector, every_identity):
    """Every identity tries to cut every stream to one message and to delete it:
    the owner's update is answered, everything else is refused by the server."""
    ncs = every_identity
    js = ncs["operator"].jetstream(timeout=5)
    before = {s.stream: await js.stream_info(s.stream) for s in B.STREAMS}
    attempts = []
    for stream in B.STREAMS:
        info = before[stream.stream]
        cut = info.config.as_dict() | {"max_msgs": 1}
        for role, nc in ncs.items():
            update = f"$JS.API.STREAM.UPDATE.{stream.stream}"
            if role != stream.owner:
                attempts.append(refused(connector, nc, role, update, json.dumps(cut).encode()))
            attempts.append(refused(connector, nc, role, f"$JS.API.STREAM.DELETE.{stream.stream}", b""))
    await asyncio.gather(*attempts)  # at once: each waits out its own request's timeout
    for stream in B.STREAMS:
        info = await js.stream_info(stream.stream)
        assert info.state.messages == before[stream.stream].state.messages > 0, stream.stream
        assert info.config.max_msgs == before[stream.stream].config.max_msgs, stream.stream
    # The owner may (its provisioning brings the replica count to the configured one):
    # an update leaving the configuration as it is, answered without an error.
    for stream in B.STREAMS:
        answer = await _answered(ncs[stream.owner], f"$JS.API.STREAM.UPDATE.{stream.stream}", json.dumps(before[stream.stream].config.as_dict()).encode())
        assert "error" not in answer, (stream.owner, stream.stream, answer)


async def test_a_writer_that_does_not_own_a_stream_cannot_recreate_it_smaller(every_identity):
    """Every writer may create the streams it writes (it need not wait for the owner
    to start); on a stream that exists, a create with another configuration is an error."""
    js = every_identity["operator"].jetstream(timeout=5)
    shared = [s for s in B.STREAMS if len(s.writers) > 1]
    assert shared  # the event stream and the leadership leases
    for stream in shared:
        for role in stream.writers[1:]:
            cfg = (await js.stream_info(stream.stream)).config.as_dict() | {"max_msgs": 1}
            answer = await _answered(every_identity[role], f"$JS.API.STREAM.CREATE.{stream.stream}", json.dumps(cfg).encode())
            assert answer.get("error"), (role, stream.stream, answer)
            assert (await js.stream_info(stream.stream)).config.max_msgs != 1


# --------------------------------------------------------------------------
# replaying a stream onto a node's command subject
# --------------------------------------------------------------------------


@pytest.fixture
async def agent(tmp_path, nats_server, connector, idents):
    """A real agent on node01, announced (its full status report seen), with an operator tap."""
    tls = nats_server.issue(NODE, "node")
    nats_server.reload()
    work = tmp_path / "work"
    cfg = write_agent_yaml(
        tmp_path / "agent.yaml",
        node_id=NODE,
        server=nats_server.url,
        tls=tls,
        work_dir=work,
        nvidia_smi=fake_nvidia_smi(tmp_path / "nvidia-smi", NODE),
        ib_root=fake_ib_root(tmp_path / "ib"),
    )
    tap = await Tap(NODE).start(idents["ops"])
    proc = AgentProcess(cfg, tmp_path / "agent.log").start()
    await eventually(lambda: any(r.full for r in tap.statuses), what="the agent's full status report")
    yield proc, tap, work
    proc.kill()
    kill_engines(work)


@pytest.mark.parametrize("attacker", ["ops", "gw1"])
async def test_a_push_consumer_onto_a_command_subject_is_not_obeyed(agent, idents, attacker):
    proc, tap, work = agent
    # A record that happens to decode as a launch command (the single writer put it there).
    kv = await idents["scheduler"].jetstream().key_value(S.BUCKET_REPLICAS)
    await kv.put("r-evil", encode(make_launch("r-evil")))
    # nats-server lets the consumer deliver to a subject its creator may not publish to.
    js = idents[attacker].jetstream(timeout=5)
    info = await js._jsm.add_consumer(
        S.kv_stream(S.BUCKET_REPLICAS), ConsumerConfig(deliver_subject=S.cmd_launch(NODE), filter_subject="$KV.llmgw_replicas.r-evil")
    )
    assert info.config.deliver_subject == S.cmd_launch(NODE)
    # The agent saw the delivery and ignored it (the predicate names this very message) …
    await eventually(lambda: "$KV.llmgw_replicas.r-evil: not a command request" in proc.log(), what="the agent ignoring the replayed record")
    # … so it launched nothing.
    assert recorded_engines(work) == {}
    assert not any(f.replica_id == "r-evil" for r in tap.statuses for f in r.engines)


async def test_a_reply_redirected_onto_a_command_subject_is_not_obeyed(agent, idents):
    proc, tap, work = agent
    kv = await idents["scheduler"].jetstream().key_value(S.BUCKET_REPLICAS)
    await kv.put("r-evil", encode(make_launch("r-evil")))
    ops = idents["ops"]
    # The operator may not publish on llmgw.cmd.>, but a request's reply subject is not checked:
    # the JetStream API answers (the record, wrapped in its JSON envelope) onto the agent's
    # launch subject. Before, the agent handled it (here: a decode error, for `list` a full
    # answer); now it is not a command at all.
    await ops.publish(
        f"$JS.API.STREAM.MSG.GET.{S.kv_stream(S.BUCKET_REPLICAS)}", json.dumps({"last_by_subj": "$KV.llmgw_replicas.r-evil"}).encode(), reply=S.cmd_launch(NODE)
    )
    await ops.flush()
    await eventually(lambda: f"{S.cmd_launch(NODE)}: not a command request (reply '')" in proc.log(), what="the agent ignoring the redirected reply")
    assert recorded_engines(work) == {}
    assert not any(f.replica_id == "r-evil" for r in tap.statuses for f in r.engines)
