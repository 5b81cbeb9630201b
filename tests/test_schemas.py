"""Every wire schema round-trips, and no input makes a decoder raise anything but WireError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw.shared import schemas as W
from llmgw.shared.errors import WireError


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
