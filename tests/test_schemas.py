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
        return list(tp)[-2]  # a real state (the last EngineState is "")
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


def test_the_reported_engine_states_on_the_wire_are_the_states_module_s():
    """The wire Literal and states.REPORTED_ENGINE say the same thing, so an agent
    can report every state the scheduler acts on, and nothing it must not."""
    import typing

    from llmgw.shared.states import REPORTED_ENGINE

    assert set(typing.get_args(W.ReportedEngineState)) == {str(s) for s in REPORTED_ENGINE}


def test_a_node_cannot_report_a_state_only_the_scheduler_writes():
    for state in ("absent", ""):
        with pytest.raises(WireError):
            W.decode(b'{"replica_id": "r-g1", "generation": 1, "state": "%s"}' % state.encode(), W.EngineFact)


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
