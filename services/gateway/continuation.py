"""Continuing a stream on another replica: what the client already has, and
the request that goes on from there. Pure: no I/O, no clock.

A stream that loses its replica after the client got chunks is re-issued to
another ready replica as a *continuation* of the text the client has (the
proxy does the I/O, ``proxy.py``):

* chat: the original messages plus an assistant message holding the text so
  far, with ``continue_final_message: true`` and ``add_generation_prompt:
  false`` (vLLM's and SGLang's parameters for exactly this); a request that
  already continued its own assistant message gets the text appended to it;
* completions: the prompt plus the text so far;
* the token budget less the tokens already sent: ``max_tokens`` /
  ``max_completion_tokens`` when given; for completions, OpenAI's default of
  16 when not (a chat's default budget is the context left, which the longer
  prompt already shrinks).

The client sees one stream: the continuation's chunks carry the first
attempt's ``id``, ``created`` and ``model``; its opening role-only chunk is
dropped (the client had one); a final ``usage`` counts the first attempt's
prompt and the completion tokens of every attempt.

What can be continued exactly is decided here, feature by feature
(``cannot_continue`` for the request, ``Transcript.problem`` for what the
stream itself carried); docs/architecture.md has the table and the reasons.
A stream that cannot be continued exactly ends as before, with an error event.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# OpenAI's (and vLLM's) budget for a completion that names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
# Events end with an empty line; engines use LF, a proxy in between may use CRLF.
_EVENT_END = re.compile(rb"\r?\n\r?\n")


# How a stream goes on exactly, by the engine that serves it: the sim's text
# round-trips through its tokenizer by construction (its answers are whole words),
# so the text sent is an exact prompt; vLLM's does not in general (a word generated
# as two pieces is read back as one, and greedy decoding then goes elsewhere), so a
# vLLM stream is asked for its token ids (``return_token_ids``, stripped from what
# the client gets) and continued from them, through ``/v1/completions`` with the
# prompt's and the answer's ids. Any other engine's stream is not continued.
TEXT_ENGINES = frozenset({"sim"})
TOKEN_ENGINES = frozenset({"vllm"})
_TOKEN_FIELDS = re.compile(rb',"(?:prompt_token_ids|token_ids)":(?:\[[0-9,]*\]|null)')
# Sampling settings a chat request shares with a completion one (vLLM's names): what a
# token continuation carries over; everything else is the chat's own (messages,
# templates, tools) or was refused by ``cannot_continue``.
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "user", "priority",
)  # fmt: skip


def splice_token_ids(body: bytes) -> bytes | None:
    """``body`` (a JSON object) asking for its token ids too; None when it cannot be
    done by splicing (an empty object) or the client asked for them itself."""
    if b'"return_token_ids"' in body:
        return None
    i = body.find(b"{")
    rest = body[i + 1 :]
    if i < 0 or rest.lstrip()[:1] == b"}":
        return None
    return body[:i] + b'{"return_token_ids":true,' + rest


def strip_token_ids(events: bytes) -> bytes:
    """Events without the token ids the gateway asked for (vLLM writes them as
    ``,"token_ids":[...]`` and ``,"prompt_token_ids":[...]``: a pattern a JSON string
    cannot hold unescaped)."""
    return _TOKEN_FIELDS.sub(b"", events)


def _truthy(value: Any) -> bool:
    """Given and not its "off" value (null, false, 0, "", an empty list)."""
    return bool(value)


def _structured(body: dict) -> bool:
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return True
    return any(_truthy(body.get(name)) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"))


def _per_chunk_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and _truthy(options.get("continuous_usage_stats"))


# Features whose continuation would differ from the unbroken answer, and why
# (docs/architecture.md, "Stream migration", has the table): state the engine
# keeps that a new prompt does not carry (a grammar mid-document, penalties on
# the tokens generated so far, a seeded sampler's position), or an answer that
# is not one text (several choices, log-probabilities already sent).
_NOT_CONTINUED: tuple[tuple[Callable[[dict], bool], str], ...] = (
    (lambda b: b.get("n") not in (None, 1) or b.get("best_of") not in (None, 1), "several choices (n > 1) are not continued"),
    (
        # completions' logprobs: 0 still asks for the sampled token's; only null or false is off
        lambda b: (b.get("logprobs") is not None and b.get("logprobs") is not False) or b.get("prompt_logprobs") is not None or _truthy(b.get("top_logprobs")),
        "log-probabilities are not continued (those of the text already sent cannot be given again)",
    ),
    (_structured, "structured output is not continued: its grammar would start over mid-document"),
    (lambda b: _truthy(b.get("stop")), "stop sequences are not continued: one could span the text sent and the text to come"),
    (
        lambda b: _truthy(b.get("presence_penalty")) or _truthy(b.get("frequency_penalty")),
        "presence and frequency penalties are not continued: they count the tokens generated, and those sent would become prompt",
    ),
    (
        lambda b: b.get("seed") is not None and b.get("temperature", 1.0) not in (0, 0.0),
        "a seeded sampled answer is not continued: another replica cannot resume the sampler where it was",
    ),
    (lambda b: _truthy(b.get("echo")), "echo is not continued"),
    (_per_chunk_usage, "per-chunk usage (continuous_usage_stats) is not continued"),
)
_NOT_CONTINUED_COMPLETION: tuple[tuple[Callable[[dict], bool], str], ...] = (
    (lambda b: not isinstance(b.get("prompt"), str), "only a prompt that is one string is continued (not token ids or a batch)"),
    (lambda b: _truthy(b.get("suffix")), "a completion with a suffix is not continued"),
)
_NOT_CONTINUED_CHAT: tuple[tuple[Callable[[dict], bool], str], ...] = (
    (lambda b: not isinstance(b.get("messages"), list) or not b["messages"], "the request has no list of messages"),
    (
        lambda b: b.get("continue_final_message") is True and not (isinstance(b["messages"][-1], dict) and isinstance(b["messages"][-1].get("content"), str)),
        "a continued final message is continued only when its content is a string",
    ),
    (
        lambda b: b.get("continue_final_message") is not True and b.get("add_generation_prompt") is False,
        "a chat without a generation prompt is not continued",
    ),
)


def cannot_continue(path: str, body: Any) -> str | None:
    """Why a stream of this request could not go on elsewhere exactly, or None."""
    if path not in (CHAT, COMPLETIONS):
        return f"only chat and completions streams are continued, not {path}"
    if not isinstance(body, dict):
        return "the request body is not a JSON object"
    for rules in (_NOT_CONTINUED, _NOT_CONTINUED_CHAT if path == CHAT else _NOT_CONTINUED_COMPLETION):
        for applies, why in rules:
            if applies(body):
                return why
    return None


class Transcript:
    """What the client was sent, read back from the events relayed to it (with the
    token ids the engine reported, which the client was not sent).

    Fed only when it is needed (a migration) or when the bytes kept pass a
    threshold (``proxy.StreamRelay``), never per chunk."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.parts: list[str] = []
        self.chars = 0
        self.chunks = 0  # chunks that carried text
        self.finish: str | None = None
        self.usage: dict | None = None  # a usage chunk the client got
        self.done = False  # [DONE] was sent
        self.problem: str | None = None  # what in the stream itself cannot be continued
        # The engine's token ids, when it reported them: the prompt's (first chunk) and
        # the answer's; ``untracked``: chunks that carried text without their ids.
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.untracked = 0

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def feed(self, events: bytes) -> None:
        """Read whole events (the bytes end on an event boundary)."""
        for payload in payloads(events):
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                obj = _decode(payload)
            except msgspec.DecodeError:
                self.problem = self.problem or "the stream carried an event that is not JSON"
                continue
            if isinstance(obj, dict):
                self._chunk(obj)

    def _chunk(self, obj: dict) -> None:
        if "error" in obj:
            self.problem = self.problem or "the replica sent an error event"
            return
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        prompt_ids = obj.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_ids is None:
            self.prompt_ids = prompt_ids
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice)

    def _not_continued(self, why: str) -> None:
        self.problem = self.problem or why

    def _choice(self, choice: dict) -> None:
        if choice.get("index", 0) != 0:
            self._not_continued("several choices (n > 1) are not continued")
        if choice.get("logprobs") is not None:
            self._not_continued("log-probabilities are not continued")
        text = self._delta_text(choice.get("delta") or {}) if self.chat else choice.get("text")
        prompt_ids = choice.get("prompt_token_ids")  # vLLM's completions put them here, its chat at the top
        if isinstance(prompt_ids, list) and self.prompt_ids is None:
            self.prompt_ids = prompt_ids
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.ids += ids
        if isinstance(text, str) and text:
            self.parts.append(text)
            self.chars += len(text)
            self.chunks += 1
            if not isinstance(ids, list):
                self.untracked += 1
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]

    def _delta_text(self, delta: Any) -> Any:
        if not isinstance(delta, dict):
            return None
        if delta.get("tool_calls"):
            self._not_continued("tool-call deltas are not continued (a tool call cannot be resumed half-written)")
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self._not_continued("reasoning content is not continued (the template would not put it back where it was)")
        return delta.get("content")


def payloads(events: bytes) -> list[bytes]:
    """The data of each whole event in ``events`` (its ``data:`` lines joined)."""
    out = []
    for event in _EVENT_END.split(events):
        data = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


def budget(path: str, body: dict, given: int) -> dict[str, int] | None:
    """The token budget fields of the continuation, after ``given`` tokens were sent;
    None when the budget is spent (the answer ends with ``length``)."""
    out: dict[str, int] = {}
    names = ("max_completion_tokens", "max_tokens") if path == CHAT else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if type(value) is int:
            out[name] = value - given
    if path == COMPLETIONS and "max_tokens" not in out:
        out["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS - given
    if any(v <= 0 for v in out.values()):
        return None
    return out


def continuation(path: str, body: dict, text: str, given: int) -> dict | None:
    """The request that goes on from ``text`` (``given`` tokens), or None when its
    budget is spent. ``body`` passed ``cannot_continue``."""
    limits = budget(path, body, given)
    if limits is None:
        return None
    out = {**body, **limits}
    if type(body.get("min_tokens")) is int:
        out["min_tokens"] = max(body["min_tokens"] - given, 0)
    if path == COMPLETIONS:
        out["prompt"] = body["prompt"] + text
        return out
    messages = list(body["messages"])
    if body.get("continue_final_message") is True:
        last = dict(messages[-1])
        last["content"] = last["content"] + text
        messages[-1] = last
    else:
        messages.append({"role": "assistant", "content": text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


def by_tokens(t: Transcript) -> bool:
    """Whether the stream so far can go on from its token ids."""
    return t.prompt_ids is not None and t.untracked == 0


def token_continuation(path: str, body: dict, t: Transcript, model: str, max_model_len: int | None) -> dict | None:
    """A ``/v1/completions`` request that goes on from the prompt's and the answer's
    token ids (``by_tokens``), or None when the budget is spent. A chat with no
    budget gets the context left (``max_model_len``), as vLLM's chat default is."""
    prompt = [*(t.prompt_ids or ()), *t.ids]
    limits = budget(path, body, len(t.ids))
    if limits is None:
        return None
    left = limits.get("max_completion_tokens", limits.get("max_tokens"))
    if left is None and max_model_len is not None:
        left = max_model_len - len(prompt)
        if left <= 0:
            return None
    out: dict[str, Any] = {k: body[k] for k in _SAMPLING if k in body}
    out.update(model=model, prompt=prompt, stream=True, return_token_ids=True)
    if left is not None:
        out["max_tokens"] = left
    if type(body.get("min_tokens")) is int:
        out["min_tokens"] = max(body["min_tokens"] - len(t.ids), 0)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        out["stream_options"] = {"include_usage": True}
    return out


def as_chat_chunk(obj: dict) -> dict:
    """A completion chunk as a chat one (a chat continued through ``/v1/completions``)."""
    out = {k: v for k, v in obj.items() if k != "choices"}
    out["object"] = "chat.completion.chunk"
    choices = []
    for c in obj.get("choices") or ():
        if not isinstance(c, dict):
            continue
        choice: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": c["text"]} if c.get("text") else {}, "logprobs": None}
        choice["finish_reason"] = c.get("finish_reason")
        if "token_ids" in c:
            choice["token_ids"] = c["token_ids"]
        choices.append(choice)
    out["choices"] = choices
    return out


def merged_usage(usage: dict, given: int) -> dict:
    """A continuation's usage as the whole answer's: the text it was given counts as
    completion, not prompt."""
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:
        return usage
    out = dict(usage)
    out["prompt_tokens"] = max(prompt - given, 0)
    out["completion_tokens"] = completion + given
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def rewrite(payload: bytes, first: Transcript, given: int, chat_from_completion: bool = False) -> bytes | None:
    """A continuation's event data as the client's stream goes on: the first
    attempt's id, created and model; its usage merged; its opening role-only
    chunk dropped (None); a completion chunk shaped as a chat one when a chat
    goes on through ``/v1/completions``. [DONE] and anything not a JSON object
    pass as they are."""
    if payload == b"[DONE]":
        return payload
    try:
        obj = _decode(payload)
    except msgspec.DecodeError:
        return payload
    if not isinstance(obj, dict) or "error" in obj:
        return payload
    if chat_from_completion:
        obj = as_chat_chunk(obj)
    if first.id is not None:
        obj["id"], obj["created"], obj["model"] = first.id, first.created, first.model
    usage = obj.get("usage")
    if isinstance(usage, dict):
        obj["usage"] = merged_usage(usage, given)
    choices = obj.get("choices")
    if first.chat and isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        c = choices[0]
        delta = c.get("delta")
        if isinstance(delta, dict) and not delta.get("content") and not c.get("finish_reason") and set(delta) <= {"role", "content"}:
            if not isinstance(usage, dict) and not c.get("token_ids"):
                return None
    return _encode(obj)


def ending(first: Transcript, chat: bool, finish: str | None, usage: dict | None) -> bytes:
    """The events that end a stream whose answer is complete without another
    replica: its finish chunk (None: the client has it), the usage asked for, [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": first.id, "object": kind, "created": first.created, "model": first.model}
    out = b""
    if finish is not None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        out += b"data: " + _encode({**head, "choices": [choice]}) + b"\n\n"
    if usage is not None:
        out += b"data: " + _encode({**head, "choices": [], "usage": usage}) + b"\n\n"
    return out + b"data: [DONE]\n\n"


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def encode(obj: Any) -> bytes:
    return _encode(obj)


def token_count(answer: bytes, field: str = "count") -> int | None:
    """``field`` of a ``/tokenize`` answer (``count``, or the length of ``tokens``;
    ``max_model_len``); None if it has none."""
    try:
        obj = _decode(answer)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    value = obj.get(field)
    if type(value) is int and value >= 0:
        return value
    tokens = obj.get("tokens")
    return len(tokens) if field == "count" and isinstance(tokens, list) else None


def prompt_request(path: str, body: dict, model: str) -> dict:
    """A ``/tokenize`` request for the prompt of ``body`` as its engine counts it."""
    if path == CHAT:
        return {"model": model, "messages": body["messages"], "add_generation_prompt": body.get("add_generation_prompt", True) is not False}
    return {"model": model, "prompt": body["prompt"]}


# Bytes of relayed events kept unread; past this they are read into the transcript
# (a long stream costs one decode per event, in batches, never one per chunk as it passes).
KEEP_RAW = 64 * 1024


class StreamRelay:
    """One stream's record for its continuation: the events the client got (kept
    raw, read only when needed), the replicas tried, the migrations spent.

    The hot path adds one bytearray append per event written (``sent``)."""

    def __init__(self, path: str, body: bytes, *, max_migrations: int, max_text: int):
        self.path = path
        self.body = body
        self.chat = path == CHAT
        self.raw = bytearray()
        self.transcript = Transcript(self.chat)
        self.max_migrations = max_migrations
        self.max_text = max_text
        self.migrations = 0
        self.request: Any = None  # the body decoded, on first need
        self.last_write = 0.0  # perf_counter of the last write to the client (the proxy sets it)
        self.given = 0  # tokens of text the current continuation was given
        self.asked_ids = b""  # the body sent upstream when the gateway asked for token ids
        self.strip = False  # the client did not ask for token ids: they are taken out of its events
        self.chat_from_completion = False  # the current continuation is a chat going on through /v1/completions
        self.source = ""  # the engine of the replica the stream started on
        self.moving: Any = None  # the move under way (proxy.Migration), until it writes to the client or fails

    def sent(self, data: bytes) -> None:
        raw = self.raw
        raw += data
        if len(raw) > KEEP_RAW:
            self.settle()

    def settle(self) -> Transcript:
        if self.raw:
            self.transcript.feed(bytes(self.raw))
            self.raw.clear()
        return self.transcript

    def decoded(self) -> Any:
        if self.request is None:
            try:
                self.request = _decode(self.body)
            except msgspec.DecodeError:
                self.request = False
        return self.request

    def why_not(self) -> str | None:
        """Why this stream cannot be continued now, or None."""
        if self.migrations >= self.max_migrations:
            return f"it was moved {self.migrations} time(s) already (gateway.max_migrations)"
        t = self.settle()
        if t.problem:
            return t.problem
        if t.chars > self.max_text:
            return f"its text passed {self.max_text} characters (gateway.stream_migration_max_text)"
        return cannot_continue(self.path, self.decoded())

    def exact_on(self, engine: str) -> str | None:
        """Why the stream cannot go on exactly on a replica of ``engine``, or None."""
        t = self.settle()
        if by_tokens(t):
            return None if engine in TOKEN_ENGINES else f"it is continued from token ids, which a {engine or 'unknown'} engine does not take"
        if t.prompt_ids is not None:
            return "the engine did not report the token ids of all the text sent"
        for e in (self.source, engine):
            if e not in TEXT_ENGINES:
                return f"a {e or 'unknown'} engine's text is not an exact prompt, and it reported no token ids"
        return None

    @property
    def include_usage(self) -> bool:
        body = self.decoded()
        options = body.get("stream_options") if isinstance(body, dict) else None
        return isinstance(options, dict) and options.get("include_usage") is True

    def upstream_body(self, engine: str) -> bytes:
        """The body for a replica of ``engine``: asking for the token ids when the
        stream would be continued from them."""
        self.source = engine
        if engine in TOKEN_ENGINES:
            if not self.asked_ids:
                self.asked_ids = splice_token_ids(self.body) or self.body
            self.strip = self.asked_ids is not self.body
            return self.asked_ids
        return self.body

    def rewritten(self, events: bytes) -> bytes:
        """A continuation's whole events as the client's stream goes on (``rewrite``)."""
        out = []
        for payload in payloads(events):
            data = rewrite(payload, self.transcript, self.given, self.chat_from_completion)
            if data is not None:
                out.append(event(data))
        return b"".join(out)
