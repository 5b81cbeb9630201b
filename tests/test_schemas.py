"""Every wire schema round-trips, and no input makes a decoder raise anything but WireError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.shared import schemas as W
from llmgw.shared.errors import WireError
from llmgw.shared.schemas import CommandAck, Inventory, StatusReport, decode_reply, encode


def _example(schema: type) -> object:
    """A fully populated instance of ``schema``, built from its field types."""
    samples = {
        W.Gpu: W.Gpu(index=3, uuid="GPU-1234", name="NVIDIA H200", memory_mib=143771, pci_bus_id="00000000:19:00.0"),
        W.HcaPort: W.HcaPort(port=1, state="ACTIVE", phys_state="LinkUp", rate="200 Gb/sec (4X HDR)", link_layer="InfiniBand"),
    }
    if schema in samples:
        return samples[schema]
    kwargs = {}
    for f in msgspec.structs.fields(schema):
        kwargs[f.name] = _value(f.type, f.name)
    return schema(**kwargs)


def _value(tp, name):
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:  # a bounded field (shared/schemas.py): the sample fits the bounds
        return _value(args[0], name)
    if tp is int:
        return 7
    if tp is float:
        return 1700000000.5
    if tp is bool:
        return True
    if tp is str:
        return f"{name}-x"
    if origin is typing.Literal:
        return args[-1]
    if isinstance(tp, type) and issubclass(tp, __import__("enum").Enum):
        return list(tp)[1]  # not the first (often the default, or ""), and one an agent may report
    if origin in (typing.Union, __import__("types").UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _value(non_none[0], name)
    if origin is list:
        return [_value(args[0], name)]
    if origin is dict:
        return {"k": _value(args[1], name)}
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _example(tp)
    raise AssertionError(f"no sample for {tp!r}")


@pytest.mark.parametrize("schema", W.WIRE_SCHEMAS, ids=lambda s: s.__name__)
def test_round_trip(schema):
    obj = _example(schema)
    assert W.decode(W.encode(obj), schema) == obj


@pytest.mark.parametrize("schema", W.WIRE_SCHEMAS, ids=lambda s: s.__name__)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512))
def test_random_bytes_raise_only_wire_error(schema, data):
    try:
        W.decode(data, schema)
    except WireError:
        pass


@pytest.mark.parametrize("schema", W.WIRE_SCHEMAS, ids=lambda s: s.__name__)
@settings(max_examples=60, deadline=None)
@given(
    data=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=12,
    )
)
def test_random_json_raises_only_wire_error(schema, data):
    """Well-formed JSON of the wrong shape is the commoner accident than random bytes."""
    try:
        W.decode(msgspec.json.encode(data), schema)
    except WireError:
        pass


def test_oversized_payload_is_refused_before_parsing():
    big = b'{"node_id": "' + b"x" * (W.MAX_PAYLOAD + 1) + b'"}'
    with pytest.raises(WireError, match="exceeds"):
        W.decode(big, W.Heartbeat)


def test_wire_error_names_the_schema_and_field():
    with pytest.raises(WireError) as e:
        W.decode(b'{"node_id": "node01", "boot_id": "b", "seq": "one"}', W.Heartbeat)
    assert e.value.schema == "Heartbeat"
    assert "seq" in str(e.value)


def test_unknown_fields_are_ignored_for_rolling_upgrades():
    hb = W.decode(b'{"node_id": "n1", "boot_id": "b", "seq": 1, "from_the_future": true}', W.Heartbeat)
    assert hb.seq == 1


def test_literal_fields_are_enforced():
    with pytest.raises(WireError):
        W.decode(b'{"node_id": "n1", "state": "confused", "boot_id": "b", "last_renew": 1, "since": 1}', W.Lease)


def test_a_state_this_build_does_not_know_is_refused_as_before():
    """Lease and admin states were Literals on the wire and are StrEnums now: a word
    outside them is still refused whole (a record no reader can act on)."""
    with pytest.raises(WireError, match="state"):
        W.decode(b'{"node_id": "n1", "state": "dozing", "boot_id": "b", "last_renew": 1, "since": 1}', W.Lease)
    with pytest.raises(WireError, match="admin"):
        W.decode(b'{"node_id": "n1", "admin": "frozen"}', W.NodeRecord)
    with pytest.raises(WireError, match="admin_by"):
        W.decode(b'{"node_id": "n1", "admin_by": "robot"}', W.NodeRecord)


def test_state_fields_are_their_words_on_the_wire():
    """A StrEnum encodes as its word: records written before and after the
    vocabularies became enums are the same bytes, and decode to the members."""
    from llmgw.shared.states import AdminBy, AdminState, EventKind, EventWhat, LeaseState

    node = W.NodeRecord(node_id="n1", admin=AdminState.CORDONED, admin_by=AdminBy.AUTO)
    assert W.encode(node) == b'{"node_id":"n1","admin":"cordoned","admin_by":"auto"}'
    assert W.encode(W.NodeRecord(node_id="n1")) == b'{"node_id":"n1"}'  # the defaults are still left out
    fresh = W.decode(b'{"node_id":"n1"}', W.NodeRecord)
    assert fresh.admin is AdminState.ACTIVE and fresh.admin_by is AdminBy.UNSET
    lease = W.decode(b'{"node_id":"n1","state":"suspect","boot_id":"b","last_renew":1.0,"since":1.0}', W.Lease)
    assert lease.state is LeaseState.SUSPECT
    assert W.encode(lease) == b'{"node_id":"n1","state":"suspect","boot_id":"b","last_renew":1.0,"since":1.0}'
    ev = W.Event(time=1.0, kind=EventKind.REPLICA, subject="sim-g1", what=EventWhat.WAITING)
    assert W.encode(ev) == b'{"time":1.0,"kind":"replica","subject":"sim-g1","what":"waiting-for-workers"}'
    assert W.decode(W.encode(ev), W.Event).what is EventWhat.WAITING


def test_an_event_word_this_build_does_not_know_is_kept():
    """The event stream and a replica record's outbox outlive the build reading them:
    an event a newer peer wrote with a new kind or word decodes (as ``Event.what: str``
    always did), keeps its word through a re-encode, and equals no word this build
    lists, so nothing here mistakes it for one it acts on."""
    from llmgw.shared.states import EventKind, EventWhat

    data = b'{"time":1.0,"kind":"fabric","subject":"ib-a","what":"partitioned","detail":"x"}'
    ev = W.decode(data, W.Event)
    assert (ev.kind, ev.what) == ("fabric", "partitioned")
    assert isinstance(ev.what, EventWhat) and not ev.what.known and not ev.kind.known
    assert ev.what not in set(EventWhat) and ev.kind not in set(EventKind)
    assert W.encode(ev) == data
    replica = b'{"id":"sim-g1","deployment":"sim","model":"m","engine":"sim","generation":1,"state":"ready","pending_events":[%s]}' % data
    assert W.decode(replica, W.Replica).pending_events == [ev]
    assert EventWhat("ready") is EventWhat.READY and EventWhat.READY.known
    # A word must still be a word.
    with pytest.raises(WireError, match="what"):
        W.decode(b'{"time":1.0,"kind":"node","subject":"n1","what":5}', W.Event)


def test_a_node_reports_exactly_the_reported_engine_states():
    """EngineFact.state takes every state in states.REPORTED_ENGINE, so an agent can
    report every state the scheduler acts on, and refuses the rest: the scheduler's
    own words and words of no vocabulary."""
    from llmgw.shared.states import REPORTED_ENGINE, EngineState

    for state in EngineState:
        data = b'{"replica_id": "r-g1", "generation": 1, "state": "%s"}' % state.value.encode()
        if state in REPORTED_ENGINE:
            assert W.decode(data, W.EngineFact).state is state
        else:
            with pytest.raises(WireError, match="not a state an agent reports"):
                W.decode(data, W.EngineFact)
    with pytest.raises(WireError):
        W.decode(b'{"replica_id": "r-g1", "generation": 1, "state": "confused"}', W.EngineFact)


@pytest.mark.parametrize(
    "data, expected, answer",
    [
        # the answer asked for, tagged
        (encode(StatusReport(node_id="n1", boot_id="b")), StatusReport, StatusReport(node_id="n1", boot_id="b")),
        # a refusal: the agent is there and said no — not "unreachable", not malformed
        (encode(CommandAck(ok=False, code="gpu_busy", reason="r")), StatusReport, CommandAck(ok=False, code="gpu_busy", reason="r")),
        (encode(CommandAck(ok=True, pid=7)), CommandAck, CommandAck(ok=True, pid=7)),
        # an agent older than the tags: read as what was asked for
        (b'{"node_id": "n1", "boot_id": "b", "engines": []}', StatusReport, StatusReport(node_id="n1", boot_id="b")),
    ],
    ids=["status", "refusal", "ack", "untagged"],
)
def test_an_agent_reply_is_the_answer_asked_for_or_a_command_ack(data, expected, answer):
    assert decode_reply(data, expected) == answer


@pytest.mark.parametrize(
    "data, expected, message",
    [
        (encode(Inventory(node_id="n1", boot_id="b", mgmt_addr="10.0.0.1")), StatusReport, "the agent answered with Inventory"),
        (b'{"type": "ack"}', StatusReport, "StatusReport | Inventory | CommandAck: Object missing required field `ok`"),
        (b'{"type": "mystery", "ok": true}', CommandAck, "Invalid value 'mystery'"),
        (b"not json", CommandAck, "malformed"),
    ],
    ids=["another-kind", "malformed-ack", "unknown-tag", "not-json"],
)
def test_an_agent_reply_of_another_kind_or_malformed_is_a_wire_error(data, expected, message):
    with pytest.raises(WireError) as e:
        decode_reply(data, expected)
    assert message in str(e.value)
