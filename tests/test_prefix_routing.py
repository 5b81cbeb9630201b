"""Cache-aware routing, as tables: the prefix key, rendezvous ranking, bounded loads,
and the router's choices (services/gateway/prefix.py, router.py). Pure: no I/O."""

from __future__ import annotations

import json
import math
import re

import pytest

from llmgw.services.gateway import prefix
from llmgw.services.gateway.router import NoReadyReplica, Router
from tests.gateway_helpers import replica

SYSTEM = "You are a careful assistant for the fabric team. " * 40
PAD = " Please explain each step, and what could go wrong." * 6  # a chunk's worth (>256 bytes)
LONG = "x" * 300


def q(text: str) -> str:
    return text + PAD


def chat(*turns: tuple[str, str], model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": r, "content": c} for r, c in turns], "max_tokens": 4}).encode()


def conversation(user: str, turns: int) -> list[bytes]:
    """Each turn resends the history and adds an answer and a question."""
    history = [("system", SYSTEM), ("user", user)]
    bodies = []
    for t in range(turns):
        bodies.append(chat(*history))
        history += [("assistant", f"answer {t} to {user}"), ("user", f"follow-up {t}")]
    return bodies


def router(ids, *, routing="prefix", clock=None, load_bound=1.15, **kw) -> Router:
    r = Router(cooldown=10, failures_before_cooldown=3, retry_after=1, routing=routing, load_bound=load_bound, **({"clock": clock} if clock else {}), **kw)
    for rid in ids:
        r.on_replica(rid, None, replica(rid, "m", f"http://127.0.0.1:{9000 + len(rid)}"))
    return r


IDS = [f"m-{i}" for i in range(4)]


def test_a_conversation_keeps_its_key_through_every_turn_and_users_differ():
    keys = {prefix.prefix_key(b) for b in conversation("how do I drain node02?", 6)}
    assert len(keys) == 1
    others = {prefix.prefix_key(conversation(f"question {i}", 1)[0]) for i in range(50)}
    assert len(others) == 50  # same system prompt, different opening question: different keys


@pytest.mark.parametrize(
    "body, has_key",
    [
        (b'{"model": "m", "prompt": "%s"}' % LONG.encode(), True),
        (b'{"model": "m", "prompt": ["%s", "b"]}' % LONG.encode(), True),
        (b'{"model": "m", "prompt": [%s]}' % b", ".join([b"123"] * 100), True),
        (b'{"model": "m", "prompt": "once upon a time"}', False),  # shorter than a chunk: load decides
        (b'{"model": "m", "prompt": ""}', False),
        (b'{"model": "m"}', False),
        (b'{"model": "m", "messages": "hello"}', False),
        (b'{"model": "m", "messages": [1, 2]}', False),
        (b'{"model": "m", "messages": []}', False),
        (b"not json", False),
        (b"[]", False),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % LONG.encode(), True),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', False),
    ],
)
def test_prefix_key_of_each_body_shape(body, has_key):
    assert (prefix.prefix_key(body) is not None) == has_key


def test_a_short_opening_is_anchored_on_its_first_chunk_once_the_conversation_is_a_chunk_long():
    history = [("user", "hi")]
    assert prefix.prefix_key(chat(*history)) is None  # turn 1: too short to be worth caching
    keys = set()
    for t in range(4):
        history += [("assistant", f"hello, this is answer {t}. " * 12), ("user", f"and then {t}?")]
        keys.add(prefix.prefix_key(chat(*history)))
    assert len(keys) == 1 and None not in keys


def test_a_long_shared_system_prompt_does_not_hide_the_opening_question():
    system = "rules " * 10000  # 60 KB, past max_chars
    keys = {prefix.prefix_key(chat(("system", system), ("user", q(f"question {i}")))) for i in range(20)}
    assert len(keys) == 20


def test_only_the_first_max_chars_count():
    long_a = chat(("user", "x" * 20000 + "tail one"))
    long_b = chat(("user", "x" * 20000 + "tail two"))
    assert prefix.prefix_key(long_a) == prefix.prefix_key(long_b)
    assert prefix.prefix_key(long_a, max_chars=30000) != prefix.prefix_key(long_b, max_chars=30000)


def test_chain_links_cover_their_predecessors_and_the_key_is_the_last_link():
    text = prefix.anchor(chat(("system", SYSTEM), ("user", "q")))
    links = prefix.chain(text, 256)
    assert len(links) == math.ceil(len(text) / 256)
    # Same start, different end: the links agree up to the chunk that differs, then never again.
    other = prefix.chain(text[:512] + b"Z" + text[513:], 256)
    assert links[:2] == other[:2] and all(a != b for a, b in zip(links[2:], other[2:], strict=True))
    body = chat(("system", SYSTEM), ("user", "q"))
    assert prefix.prefix_key(body) == prefix.chain(prefix.anchor(body))[-1]


def test_the_key_hashed_in_place_is_the_last_link_of_the_joined_anchor():
    """key_of feeds the hash the body's own bytes piece by piece (no join); the cut may
    fall inside any message. It must equal the chain of the anchor made whole."""
    history = [("user", "hi")]
    bodies = [chat(("system", SYSTEM), ("user", q("q"))), chat(("user", "x" * 20000)), b'{"model": "m", "prompt": "%s"}' % LONG.encode()]
    for t in range(4):  # a short opening: the cut lands inside a later message
        history += [("assistant", f"hello, this is answer {t}. " * 12), ("user", f"and then {t}?")]
        bodies.append(chat(*history))
    for body in bodies:
        key = prefix.key_of(prefix.read(body))
        assert key is not None and key == prefix.chain(prefix.anchor(body))[-1] == prefix.prefix_key(body)


@pytest.mark.parametrize(
    "body, model, stream, error",
    [
        (b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}', "m", True, None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "m"}', "m", None, None),  # any order
        # A prompt the engine must judge is no error here: the model is still read, there is no key.
        (b'{"model": "m", "messages": "hello", "stream": false}', "m", False, None),
        (b'{"model": "m", "messages": [1, 2]}', "m", None, None),
        (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', None, None, "`$.model`"),
        (b'{"model": 5, "messages": "hello"}', None, None, "`$.model`"),  # the model's error, not the messages'
        (b"[]", None, None, "Expected `object`"),
    ],
)
def test_one_decode_reads_model_stream_and_prompt(body, model, stream, error):
    if error:
        with pytest.raises(prefix.msgspec.ValidationError, match=re.escape(error)):
            prefix.read(body)
        return
    f = prefix.read(body)
    assert (f.model, f.stream) == (model, stream)


@pytest.mark.parametrize(
    "in_flight, replicas, bound, cap",
    [(0, 4, 1.15, 1), (3, 4, 1.15, 2), (39, 4, 1.25, 13), (100, 2, 1.1, 56), (7, 1, 1.0, 8)],
)
def test_capacity_is_ceil_bound_times_mean(in_flight, replicas, bound, cap):
    assert prefix.capacity(in_flight, replicas, bound) == cap
    assert prefix.capacity(in_flight, replicas, bound, slack=2) == cap + 2


def test_with_a_slack_a_light_load_stays_on_the_owner_and_a_heavy_one_still_spreads():
    r = router(IDS, load_bound=1.15, load_slack=2)
    body = chat(("user", q("one conversation")))
    held = [r.pick("m", body=body) for _ in range(3)]
    assert len({b.id for b in held}) == 1  # 3 in flight: capacity ceil(1.15 * 3 / 4) + 2 = 3
    held += [r.pick("m", body=body) for _ in range(37)]
    loads = sorted(b.outstanding for b in r.backends())
    assert sum(loads) == 40 and loads[-1] <= prefix.capacity(39, 4, 1.15, 2) == 14, loads


def test_same_conversation_same_replica_in_two_routers_that_learned_replicas_in_another_order():
    a, b = router(IDS), router(list(reversed(IDS)))
    for user in range(40):
        for body in conversation(f"user {user}", 3):
            pa, pb = a.pick("m", body=body), b.pick("m", body=body)
            assert pa.id == pb.id
            a.release(pa), b.release(pb)
    assert a.decisions["prefix"] == 120 and a.decisions["load-bound-overflow"] == 0


def test_owners_spread_over_the_replicas():
    r = router(IDS)
    owners = {rid: 0 for rid in IDS}
    for i in range(2000):
        b = r.pick("m", body=chat(("user", q(f"q{i}"))))
        owners[b.id] += 1
        r.release(b)
    assert all(300 < n < 700 for n in owners.values()), owners  # 500 each expected


def test_bounded_load_no_replica_over_capacity_while_others_idle():
    r = router(IDS, load_bound=1.25)
    body = chat(("system", SYSTEM), ("user", "the one hot question"))
    held = []
    for n in range(1, 41):
        held.append(r.pick("m", body=body))
        loads = sorted(b.outstanding for b in r.backends())
        assert loads[-1] <= prefix.capacity(n - 1, 4, 1.25), (n, loads)
    loads = sorted(b.outstanding for b in r.backends())
    # One hot key, 40 in flight: it fills its owner up to the capacity, then the next
    # in its ranking, and so on: ceil(1.25 * 40 / 4) = 13 is never passed.
    assert loads == [2, 12, 13, 13], loads
    owner = held[0]
    assert owner.outstanding == 13
    assert r.decisions["prefix"] >= 10 and r.decisions["load-bound-overflow"] >= 1
    for b in held:
        r.release(b)
    # With the load gone, the hot key is back on its owner.
    assert r.pick("m", body=body) is owner


def test_a_replica_leaving_or_joining_moves_only_its_share():
    keys = [chat(("user", q(f"conversation {i}"))) for i in range(2000)]

    def owners(r):
        out = {}
        for k in keys:
            b = r.pick("m", body=k)
            out[k] = b.id
            r.release(b)
        return out

    before = owners(router(IDS))
    # m-2 leaves: only its keys move.
    r = router(IDS)
    r.on_replica("m-2", None, replica("m-2", "m", state="failed"))
    after = owners(r)
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "m-2" for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == "m-2")
    # m-4 joins: only keys it now owns move, about a fifth of them.
    r = router([*IDS, "m-4"])
    joined = owners(r)
    moved = [k for k in keys if before[k] != joined[k]]
    assert all(joined[k] == "m-4" for k in moved)
    assert 0.12 * len(keys) < len(moved) < 0.28 * len(keys)


def test_degraded_and_cooling_replicas_are_never_chosen():
    now = [0.0]
    r = router(IDS, clock=lambda: now[0])
    body = chat(("user", q("a question someone owns")))
    owner = r.pick("m", body=body)
    r.release(owner)
    r.on_replica(owner.id, None, replica(owner.id, "m", state="degraded"))
    second = r.pick("m", body=body)
    assert second.id != owner.id
    r.release(second)
    r.eject(second, "stalled")
    for i in range(200):
        b = r.pick("m", body=chat(("user", q(f"q{i}"))))
        assert b.id not in (owner.id, second.id)
        r.release(b)
    now[0] = 11.0  # the cool-down is over: the second owner gets its keys back
    assert r.pick("m", body=body) is second


def test_retry_and_bodies_without_a_prompt_fall_back_to_least_outstanding():
    r = router(IDS)
    body = chat(("user", q("retried")))
    first = r.pick("m", body=body)
    again = r.pick("m", exclude=(first,), body=body)
    assert again is not first
    busy = {first, again}
    spare = r.pick("m", body=b'{"model": "m"}')
    assert spare not in busy  # least outstanding: one of the idle two
    assert r.decisions == {"prefix": 1, "load-bound-overflow": 0, "least-outstanding": 1, "retry": 1}
    r.release(first), r.release(again), r.release(spare)
    r.eject(r.backend("m-0"), "x"), r.eject(r.backend("m-1"), "x"), r.eject(r.backend("m-2"), "x")
    last = r.pick("m", body=body)
    assert last.id == "m-3"
    with pytest.raises(NoReadyReplica):
        r.pick("m", exclude=(last,), body=body)


def test_least_outstanding_routing_ignores_the_body():
    r = router(IDS, routing="least-outstanding")
    body = chat(("user", q("same")))
    picked = [r.pick("m", body=body) for _ in range(4)]
    assert len({b.id for b in picked}) == 4
    assert r.decisions["least-outstanding"] == 4 and r.decisions["prefix"] == 0


@pytest.mark.parametrize("kw", [{"routing": "random"}, {"load_bound": 0.9}, {"load_bound": float("nan")}])
def test_bad_router_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Router(cooldown=1, failures_before_cooldown=1, retry_after=1, **kw)
