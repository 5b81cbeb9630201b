"""What a node may claim on the wire (a node is not trusted): the bounds in shared/schemas.py and
the one address validator in shared/names.py, as properties over generated input."""

from __future__ import annotations

import ipaddress
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw.shared import schemas as W
from llmgw.shared.errors import InvalidName, WireError
from llmgw.shared.names import check_host, host_problem

ANY_INT = st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.sampled_from([-1, 0, 63, 64, 2**53 - 1, 2**53, 2**63, 2**70]))


def decodes(payload: dict, schema) -> bool:
    try:
        W.decode(json.dumps(payload).encode(), schema)
        return True
    except WireError:
        return False


def inventory(gpus: list[dict], **kw) -> dict:
    return {"node_id": "node01", "boot_id": "b", "mgmt_addr": "10.0.0.1", "gpus": gpus, **kw}


def gpu(index) -> dict:
    return {"index": index, "uuid": f"GPU-{index}", "name": "H200"}


@settings(max_examples=200, deadline=None)
@given(index=ANY_INT)
def test_a_gpu_index_is_accepted_exactly_within_0_to_63(index):
    assert decodes(inventory([gpu(index)]), W.Inventory) == (0 <= index < W.MAX_GPUS)


@settings(max_examples=30, deadline=None)
@given(count=st.integers(min_value=0, max_value=200))
def test_an_inventory_lists_at_most_64_gpus(count):
    assert decodes(inventory([gpu(i % W.MAX_GPUS) for i in range(count)]), W.Inventory) == (count <= W.MAX_GPUS)


def test_ten_thousand_gpus_are_refused_not_stored():
    with pytest.raises(WireError, match="gpus"):
        W.decode(json.dumps(inventory([gpu(i % 64) for i in range(10_000)])).encode(), W.Inventory)


@settings(max_examples=200, deadline=None)
@given(seq=ANY_INT)
def test_a_heartbeat_seq_is_accepted_exactly_within_0_to_2_53(seq):
    ok = decodes({"node_id": "node01", "boot_id": "b", "seq": seq}, W.Heartbeat)
    assert ok == (0 <= seq <= W.MAX_SEQ)


@settings(max_examples=150, deadline=None)
@given(rank=ANY_INT, port=ANY_INT, gen=ANY_INT)
def test_engine_fact_numbers_are_bounded(rank, port, gen):
    ok = decodes({"replica_id": "r-g1", "generation": gen, "rank": rank, "http_port": port}, W.EngineFact)
    assert ok == (0 <= rank <= 4095 and 0 <= port <= 65535 and 0 <= gen <= W.MAX_SEQ)


@settings(max_examples=150, deadline=None)
@given(name=st.text(max_size=80))
@example(name="0\n")  # a final newline: found by a hunt, when the pattern ended in $
@example(name="mlx5_0")
def test_hca_names_are_short_plain_tokens(name):
    ok = decodes(inventory([], hcas=[{"name": name}]), W.Inventory)
    # As under /sys/class/infiniband: a letter or digit first, then those and '_', '.', '-'
    # (no ':' or ',': NCCL_IB_HCA's separators). The configuration holds the same rule (test_hca_names.py).
    plain = 1 <= len(name) <= 64 and name[0].isascii() and name[0].isalnum() and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)
    assert ok == plain


def test_long_strings_and_long_lists_are_refused():
    assert not decodes({"node_id": "n" * 200, "boot_id": "b", "seq": 1}, W.Heartbeat)
    assert not decodes({"node_id": "node01", "boot_id": "b" * 200, "seq": 1}, W.Heartbeat)
    assert not decodes({"node_id": "node01", "boot_id": "b", "engines": [{"replica_id": "r", "generation": 1}] * (W.MAX_ENGINES + 1)}, W.StatusReport)
    assert decodes({"node_id": "node01", "boot_id": "b", "engines": [{"replica_id": "r", "generation": 1}] * W.MAX_ENGINES}, W.StatusReport)
    assert not decodes({"replica_id": "r", "generation": 1, "detail": "x" * (W.MAX_TEXT + 1)}, W.EngineFact)
    assert not decodes(inventory([], mgmt_addr="h" * 300), W.Inventory)


# -- addresses ---------------------------------------------------------------------------


@given(addr=st.ip_addresses())
def test_every_ip_address_is_a_host(addr):
    assert check_host(str(addr)) == str(addr)


@given(addr=st.ip_addresses(v=4), port=st.integers(min_value=0, max_value=65535))
def test_a_host_with_a_port_is_refused(addr, port):
    assert "port" in host_problem(f"{addr}:{port}")
    assert host_problem(f"[{ipaddress.ip_address('::1')}]:{port}")


@given(
    addr=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z]([a-z0-9-]{0,10}[a-z0-9])?){0,3}", fullmatch=True),
    scheme=st.sampled_from(["http://", "https://", "tls://"]),
    path=st.sampled_from(["/", "/v1", "/x?y"]),
)
def test_dns_names_are_hosts_but_not_with_a_scheme_or_path(addr, scheme, path):
    assert host_problem(addr) == "" or addr.replace(".", "").isdigit()
    assert host_problem(scheme + addr)
    assert host_problem(addr + path)
    assert host_problem("user@" + addr)


@given(junk=st.text(max_size=40))
def test_check_host_raises_only_invalid_name(junk):
    try:
        check_host(junk)
    except InvalidName as e:
        assert repr(junk) in str(e)
