"""The tables that cross process boundaries, and the NATS rights derived from them.

``shared/buckets.py`` holds each bucket and stream once (name, schema, writers;
the first writer owns the stream); ``shared/api.py`` each endpoint once
(service, verb, request, reply, callers), and each command a service sends an
agent (verb, subject, request, reply, sender). Every identity's rights are exactly
what those rows imply — no more (a right nobody's row asks for), no less (a
writer or caller the server would refuse). That the server enforces the stream
rights is tests/test_js_permissions.py's, against a real nats-server.
"""

from __future__ import annotations

import pytest

from llmgw.shared import api
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.names import ROLES, SERVICE_ROLES
from llmgw.shared.permissions import for_identity
from llmgw.shared.schemas import WIRE_SCHEMAS


def test_each_bucket_and_stream_is_one_row():
    names = [s.name for s in B.STREAMS]
    assert len(names) == len(set(names))
    assert sorted(b.name for b in B.BUCKETS) == sorted(S.BUCKETS)  # every bucket the bus knows has its row
    assert B.EVENTS.name == S.EVENT_STREAM
    for s in B.STREAMS:
        assert s.schema in WIRE_SCHEMAS, s.name
        assert s.writers and set(s.writers) <= set(SERVICE_ROLES), s.name
        assert len(set(s.writers)) == len(s.writers), s.name


def test_each_endpoint_is_one_row():
    keys = [(e.service, e.verb) for e in api.ENDPOINTS]
    assert len(keys) == len(set(keys))
    assert len({e.subject for e in api.ENDPOINTS}) == len(keys)
    for e in api.ENDPOINTS:
        assert e.service in SERVICE_ROLES, e
        assert e.request in WIRE_SCHEMAS and e.reply in WIRE_SCHEMAS, e
        assert api.OPERATOR in e.callers and set(e.callers) <= set(ROLES), e
        assert e.service not in e.callers, e  # a service never asks itself over the bus


def test_each_command_is_one_row():
    assert len({c.verb for c in api.COMMANDS}) == len(api.COMMANDS)
    for c in api.COMMANDS:
        assert c.sender in SERVICE_ROLES, c
        assert c.subject("node01") == f"{S.CMD_SPACE}.node01.{c.verb}"  # in the node's command space
        for schema in (c.request, c.reply):
            assert schema is None or schema in WIRE_SCHEMAS, c
    assert api.INVENTORY.every_node == S.ALL_CMD_INVENTORY and api.TRAFFIC.every_node == S.ALL_TRAFFIC


def _js(subjects: list[str], api_name: str) -> set[str]:
    prefix = f"$JS.API.{api_name}."
    return {s.removeprefix(prefix) for s in subjects if s.startswith(prefix)}


@pytest.mark.parametrize("role", ROLES)
def test_rights_are_exactly_what_the_tables_imply(role):
    p = for_identity(role, f"{role}1")
    pub = p.publish
    # buckets: a writer puts into exactly its buckets
    assert {s for s in pub if s.startswith("$KV.")} == {S.kv_put_space(b.name) for b in B.written_by(role)}
    # streams: a writer creates what it writes, only an owner updates, no one deletes or purges
    assert _js(pub, "STREAM.CREATE") == {s.stream for s in B.STREAMS if role in s.writers}
    assert _js(pub, "STREAM.UPDATE") == {s.stream for s in B.STREAMS if s.owner == role}
    for never in ("STREAM.DELETE", "STREAM.PURGE", "STREAM.RESTORE", "STREAM.MSG.DELETE"):
        assert not _js(pub, never), never
    # events: exactly the event stream's writers publish them
    assert (S.ALL_EVENTS in pub) == (role in B.EVENTS.writers)
    # endpoints: ask exactly those the table lists the role as a caller of; answer its own
    asks = {s for s in pub if s.startswith(f"{S.API_SPACE}.")}
    assert asks == {e.subject for e in api.ENDPOINTS if role in e.callers}
    # commands: a sender to every node's agent; a node hears only its own
    assert {s for s in pub if s.startswith(f"{S.CMD_SPACE}.")} == {c.every_node for c in api.COMMANDS if c.sender == role}
    if role == "node":
        assert [s for s in p.subscribe if s.startswith(f"{S.CMD_SPACE}.")] == [S.cmd_space("node1")]
    if role != api.OPERATOR:  # the operator reads every subject (it answers none: no role's publish right names its inbox)
        answers = {s for s in p.subscribe if s.startswith(f"{S.API_SPACE}.")}
        assert answers == {e.subject for e in api.ENDPOINTS if e.service == role}


def test_only_one_owner_per_stream():
    owners = {s.stream: [r for r in ROLES if s.stream in B.owned_by(r)] for s in B.STREAMS}
    assert all(len(o) == 1 for o in owners.values()), owners
