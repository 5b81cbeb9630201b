"""Cache-aware routing: which replica owns a prompt's prefix. Pure: no I/O, no clock.

Engines keep the KV blocks of recent prompts (a prefix cache); a request whose
prompt starts like one a replica served lately skips most of its prefill there.
So the gateway sends a conversation where it went before, and it does so
without any per-gateway memory of past requests, so that any number of
gateways agree without talking:

* the *anchor* of a request is the part of its prompt that stays the same for
  the whole conversation: for ``/v1/chat/completions`` the messages rendered in
  order (role, then content as its JSON text, undecoded) up to and including
  the first ``user`` message (the system prompt(s) and the opening question;
  later turns resend all that and add to the end); for ``/v1/completions`` the
  prompt. Only the first ``max_chars`` bytes of each message count (and at
  most ``MAX_MESSAGES`` times that in all), so a 200 KB prompt costs about
  what a 16 KB one does (the JSON decoder still skips over the rest), and a
  long system prompt shared by many users does not crowd out the opening
  question that tells their conversations apart; for ``/v1/responses`` and
  ``/v1/embeddings`` the ``input`` as its JSON text (other bodies, and multipart
  forms, have no key and go by load). An
  opening shorter than one chunk is extended over the next messages to a
  chunk; a prompt shorter than a chunk in all has no key and is placed by load
  alone (a few cached blocks are not worth a busier replica);
* the key is the last link of the anchor's hash chain over ``chunk_chars``-byte
  chunks (link i: the first 64 bits of the SHA-256 of chunks 0..i, as llm-d's
  approximate prefix scorer and vLLM's block hashes chain theirs), stable
  across processes and machines (SHA-256 rather than BLAKE2b: OpenSSL's runs
  on the CPUs' SHA extensions, ~13 µs for 16 KB here against BLAKE2b's ~34).
  No index of past links is kept — that is the per-gateway state this design
  avoids — so only the last link is computed, in one pass, over the body's own
  bytes (``key_of``: the pieces are fed to the hash in place, never joined);
* the replicas of the model are ranked by rendezvous (highest-random-weight)
  hashing of the key with each replica's id — the ids every gateway mirrors
  from the replicas bucket — so every gateway ranks them the same, and a
  replica joining or leaving moves only the keys it wins or won (1/n of them);
* bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016): the request goes to the
  first replica in that ranking whose requests in flight through this gateway
  are under ``capacity = ceil(load_bound * (in flight + 1) / replicas) +
  slack``; the capacities add up to at least the load, so one always has
  room, and no replica takes more than its share (plus the slack) while
  others idle. Loads are local: two
  gateways may disagree on them, and then on where an overflow goes, but never
  on the owner of a key (docs/architecture.md).

The owner (first in the ranking) taking the request is what the gateway
counts as a prefix hit; the engines' own ``vllm:prefix_cache_hits`` say how
well that guess did.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import msgspec

CHUNK_CHARS = 256
MAX_CHARS = 16384
MAX_MESSAGES = 4  # an anchor spans at most this many messages' ``max_chars``
_MASK = (1 << 64) - 1
# A JSON null where a prompt would be, as a view (a view compares with a view).
_NULL = memoryview(b"null")


class _Message(msgspec.Struct):
    role: Any = None
    content: msgspec.Raw = msgspec.Raw(b"null")  # kept as sent: never decoded, only hashed


class Fields(msgspec.Struct):
    """What the gateway reads of a JSON request body, in one pass of the decoder:
    the model and whether it streams (server.py), the anchor's parts (here).
    Everything else is skipped undecoded, and the body is forwarded as sent.
    ``stream`` is not checked (the engine judges it): only ``true`` makes a stream."""

    model: str | None = None
    stream: Any = None
    messages: list[_Message] | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"null")
    input: msgspec.Raw = msgspec.Raw(b"null")  # /v1/responses and /v1/embeddings: taken as its JSON text


class _Head(msgspec.Struct):
    """``Fields`` less the prompt, for a body whose ``messages`` is not a list of objects."""

    model: str | None = None
    stream: Any = None


_decode_fields = msgspec.json.Decoder(Fields).decode
_decode_head = msgspec.json.Decoder(_Head).decode


def read(body: bytes) -> Fields:
    """The fields of a JSON request body. Raises as msgspec's decoder does:
    DecodeError (not JSON), ValidationError (not an object, or a ``model`` that is
    not a string), RecursionError (nested too deep for it). A ``messages`` that is
    not a list of objects is no error here — the engine judges the prompt — it only
    leaves the request without a prefix key (a second decode, on that rare body)."""
    try:
        return _decode_fields(body)
    except msgspec.ValidationError:
        head = _decode_head(body)  # the model's own error, if it is the model that is wrong
        return Fields(model=head.model, stream=head.stream)


def _anchor_parts(f: Fields, max_chars: int, min_chars: int) -> tuple[list, int] | None:
    """The anchor as the pieces it is made of (views into the body, not copies) and its
    length, or None (no prompt, or one shorter than ``min_chars``)."""
    if f.messages:
        parts: list = []
        size = 0
        opening = 0  # bytes up to the end of the first user message
        for m in f.messages:
            if opening and size >= min_chars:
                break  # the opening question is in, and the anchor is a chunk long
            role = m.role.encode("utf-8", "surrogatepass") if isinstance(m.role, str) else b""
            # Each message's start: a long system prompt shared by many users must not
            # crowd out the question that tells their conversations apart.
            content = memoryview(m.content)[:max_chars]
            parts += (role, b"\n", content, b"\n")
            size += len(role) + len(content) + 2
            if not opening and role == b"user":
                opening = size
            if size >= MAX_MESSAGES * max_chars:
                break
        length = min(size, max(opening, min_chars))
    else:
        text = memoryview(f.prompt)[:max_chars]
        if text == _NULL:
            text = memoryview(f.input)[:max_chars]
            if text == _NULL:
                return None
        parts, length = [text], len(text)
    # A short opening: the conversation is anchored on its first chunk (opening,
    # answer, ...) from the turn that makes it a chunk long, the same for every later one.
    return (parts, length) if length >= min_chars else None


def anchor(body: bytes, max_chars: int = MAX_CHARS, min_chars: int = CHUNK_CHARS) -> bytes | None:
    """The conversation-stable start of the request's prompt (``max_chars`` bytes of each message),
    or None when the body has no prompt to go by (malformed ones included: the engine
    judges them, or the gateway refuses them) or one shorter than ``min_chars`` (a chunk:
    too little to be worth caching — such a request is better placed by load alone).

    Contents are taken as their JSON text, undecoded: a 200 KB string is skipped
    over, not copied, and one client resends a turn the same way every time."""
    try:
        f = read(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    found = _anchor_parts(f, max_chars, min_chars)
    if found is None:
        return None
    parts, length = found
    return b"".join(parts)[:length]


def chain(text: bytes, chunk_chars: int = CHUNK_CHARS) -> list[int]:
    """The hash chain of ``text`` over ``chunk_chars``-byte chunks: link i is the
    SHA-256 of chunks 0..i, first 64 bits (a running hash, so each link covers the
    one before it). For inspection and tests: routing needs only the last link."""
    h = hashlib.sha256()
    links: list[int] = []
    for i in range(0, max(len(text), 1), chunk_chars):
        h.update(text[i : i + chunk_chars])
        links.append(int.from_bytes(h.copy().digest()[:8], "big"))
    return links


def key_of(f: Fields, max_chars: int = MAX_CHARS) -> int | None:
    """The routing key of a decoded body: the last link of its anchor's chain, or None.
    One pass of SHA-256 (C, hashlib) over at most ``max_chars`` bytes of each message,
    fed the body's own bytes in place: nothing is joined or copied first."""
    found = _anchor_parts(f, max_chars, CHUNK_CHARS)
    if found is None:
        return None
    parts, left = found
    h = hashlib.sha256()
    for p in parts:
        if len(p) >= left:
            h.update(p[:left])
            break
        h.update(p)
        left -= len(p)
    return int.from_bytes(h.digest()[:8], "big")


def prefix_key(body: bytes, *, max_chars: int = MAX_CHARS) -> int | None:
    """The routing key of a request body (``key_of`` its fields), or None — also for a
    body that is not JSON, or that the gateway would refuse."""
    try:
        f = read(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return key_of(f, max_chars)


def id_hash(replica_id: str) -> int:
    """A replica's fixed 64-bit identity for rendezvous hashing (same in every gateway)."""
    return int.from_bytes(hashlib.blake2b(replica_id.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big")


def weight(key: int, rid_hash: int) -> int:
    """Rendezvous weight of a replica for a key: a 64-bit mix (splitmix64's finaliser) of both."""
    z = (key ^ rid_hash) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def rank(key: int, rid_hashes: Sequence[int]) -> list[int]:
    """Indexes of ``rid_hashes`` from the key's owner down (highest weight first; ties by index)."""
    return sorted(range(len(rid_hashes)), key=lambda i: (-weight(key, rid_hashes[i]), i))


def capacity(total_in_flight: int, replicas: int, load_bound: float, slack: int = 0) -> int:
    """The most requests in flight one replica may hold, counting the one being placed:
    ``ceil(load_bound * mean) + slack``. The slack keeps a light load from being spread
    for the sake of it (two in flight on the owner while the others hold one each is
    no imbalance worth a cache miss), as SGLang's router's absolute threshold does."""
    return max(1, math.ceil(load_bound * (total_in_flight + 1) / replicas)) + slack


def choose(key: int, rid_hashes: Sequence[int], loads: Sequence[int], load_bound: float, total: int | None = None, slack: int = 0) -> tuple[int, bool]:
    """The index to route to and whether it is the key's owner.

    ``loads``: requests in flight on each candidate; ``total``: in flight on the
    model's replicas altogether (default: the candidates'), which sets the capacity."""
    order = rank(key, rid_hashes)
    cap = capacity(sum(loads) if total is None else total, len(rid_hashes), load_bound, slack)
    for pos, i in enumerate(order):
        if loads[i] < cap:
            return i, pos == 0
    # Every candidate full (only when some replicas are excluded or cooling): the least loaded.
    i = min(order, key=lambda j: loads[j])
    return i, i == order[0]
