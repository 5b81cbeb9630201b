"""The continuation builder (``services/gateway/continuation.py``), table-tested:
what can be continued, the request that goes on, the token budget, the usage,
the events rewritten — and the sim engine's side of it: generation from a prompt
plus the start of its own answer yields the rest of that answer."""

from __future__ import annotations

import json

import pytest

from llmgw.services.engines.api_requests import ApiError, chat_request, completion_request
from llmgw.services.engines.tokens import Answer
from llmgw.services.gateway import continuation as C

CHAT, COMPLETIONS = C.CHAT, C.COMPLETIONS
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (CHAT, {"messages": MSGS}, None),
        (CHAT, {"messages": MSGS, "temperature": 0.7}, None),  # a fresh sample of the same conditional
        (CHAT, {"messages": MSGS, "seed": 3, "temperature": 0}, None),  # greedy: the seed changes nothing
        (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, None),  # text so far is continued; a tool call delta is not
        (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, None),
        (COMPLETIONS, {"prompt": "p"}, None),
        ("/v1/responses", {"input": "x"}, "only chat and completions"),
        (CHAT, {"messages": MSGS, "n": 2}, "n > 1"),
        (COMPLETIONS, {"prompt": "p", "best_of": 3}, "n > 1"),
        (CHAT, {"messages": MSGS, "logprobs": True}, "log-probabilities"),
        (COMPLETIONS, {"prompt": "p", "logprobs": 2}, "log-probabilities"),
        (COMPLETIONS, {"prompt": "p", "logprobs": 0}, "log-probabilities"),
        (CHAT, {"messages": MSGS, "logprobs": False, "top_logprobs": 0}, None),
        (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "structured output"),
        (CHAT, {"messages": MSGS, "response_format": {"type": "text"}}, None),
        (CHAT, {"messages": MSGS, "guided_json": {"type": "object"}}, "structured output"),
        (CHAT, {"messages": MSGS, "stop": ["x"]}, "stop sequences"),
        (CHAT, {"messages": MSGS, "stop": []}, None),
        (CHAT, {"messages": MSGS, "presence_penalty": 0.5}, "penalties"),
        (CHAT, {"messages": MSGS, "frequency_penalty": 0}, None),
        (CHAT, {"messages": MSGS, "seed": 3}, "seeded sampled"),
        (COMPLETIONS, {"prompt": "p", "echo": True}, "echo"),
        (CHAT, {"messages": MSGS, "stream_options": {"continuous_usage_stats": True}}, "per-chunk usage"),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, "one string"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "one string"),
        (COMPLETIONS, {"prompt": "p", "suffix": "s"}, "suffix"),
        (CHAT, {"messages": []}, "no list of messages"),
        (CHAT, {"messages": [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}], "continue_final_message": True}, "a string"),
        (CHAT, {"messages": MSGS, "add_generation_prompt": False}, "generation prompt"),
        (CHAT, [1, 2], "not a JSON object"),
    ],
)
def test_what_can_be_continued(path, body, why):
    got = C.cannot_continue(path, body)
    assert (got is None) if why is None else (got is not None and why in got), got


@pytest.mark.parametrize(
    ("path", "body", "text", "given", "want"),
    [
        # chat: the text as an assistant message to continue; the budget less what was sent
        (
            CHAT,
            {"model": "m", "messages": MSGS, "max_tokens": 10},
            "the node ",
            2,
            {"model": "m", "messages": [*MSGS, {"role": "assistant", "content": "the node "}], "max_tokens": 8,
             "continue_final_message": True, "add_generation_prompt": False},
        ),
        (
            CHAT,
            {"messages": MSGS, "max_completion_tokens": 5, "max_tokens": 9, "min_tokens": 3},
            "a b c d ",
            4,
            {"messages": [*MSGS, {"role": "assistant", "content": "a b c d "}], "max_completion_tokens": 1, "max_tokens": 5, "min_tokens": 0,
             "continue_final_message": True, "add_generation_prompt": False},
        ),
        # chat without a budget: the context left (the engine's default) already shrinks
        (
            CHAT,
            {"messages": MSGS},
            "x ",
            1,
            {"messages": [*MSGS, {"role": "assistant", "content": "x "}], "continue_final_message": True, "add_generation_prompt": False},
        ),
        # a chat that continued its own assistant message: the text is appended to it
        (
            CHAT,
            {"messages": [*MSGS, {"role": "assistant", "content": "Sure: "}], "continue_final_message": True, "add_generation_prompt": False},
            "one two ",
            2,
            {"messages": [*MSGS, {"role": "assistant", "content": "Sure: one two "}], "continue_final_message": True, "add_generation_prompt": False},
        ),
        # completions: prompt + text; OpenAI's default budget of 16 when none is named
        (COMPLETIONS, {"prompt": "P: ", "max_tokens": 30}, "a b ", 2, {"prompt": "P: a b ", "max_tokens": 28}),
        (COMPLETIONS, {"prompt": "P: "}, "a b c ", 3, {"prompt": "P: a b c ", "max_tokens": 13}),
        # the budget spent: no continuation, the answer ends with "length"
        (CHAT, {"messages": MSGS, "max_tokens": 4}, "a b c d ", 4, None),
        (COMPLETIONS, {"prompt": "P"}, "x " * 16, 16, None),
    ],
)  # fmt: skip
def test_the_continuation_request(path, body, text, given, want):
    assert C.continuation(path, body, text, given) == want


@pytest.mark.parametrize(
    ("usage", "given", "want"),
    [
        ({"prompt_tokens": 25, "completion_tokens": 30, "total_tokens": 55}, 10, {"prompt_tokens": 15, "completion_tokens": 40, "total_tokens": 55}),
        ({"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5, "prompt_tokens_details": None}, 0,
         {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5, "prompt_tokens_details": None}),
        ({"prompt_tokens": "x"}, 3, {"prompt_tokens": "x"}),  # not ours to guess: passed as it came
    ],
)  # fmt: skip
def test_a_continuations_usage_counts_the_text_it_was_given_as_completion(usage, given, want):
    assert C.merged_usage(usage, given) == want


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def test_the_transcript_reads_back_what_the_client_got():
    t = C.Transcript(chat=True)
    head = {"id": "chatcmpl-1", "created": 7, "model": "m", "object": "chat.completion.chunk"}
    t.feed(_sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    t.feed(
        _sse(
            {**head, "choices": [{"index": 0, "delta": {"content": "the "}, "logprobs": None}]},
            {**head, "choices": [{"index": 0, "delta": {"content": "node "}}]},
        )
    )
    assert (t.text, t.chunks, t.id, t.created, t.finish, t.problem) == ("the node ", 2, "chatcmpl-1", 7, None, None)
    t.feed(_sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, {**head, "choices": [], "usage": {"prompt_tokens": 1}}, b"[DONE]"))
    assert (t.finish, t.usage, t.done) == ("length", {"prompt_tokens": 1}, True)


@pytest.mark.parametrize(
    ("choice", "why"),
    [
        ({"index": 0, "delta": {"tool_calls": [{"index": 0}]}}, "tool-call"),
        ({"index": 0, "delta": {"reasoning_content": "hmm"}}, "reasoning"),
        ({"index": 0, "delta": {"reasoning": "hmm"}}, "reasoning"),
        ({"index": 1, "delta": {"content": "x"}}, "n > 1"),
        ({"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}}, "log-probabilities"),
    ],
)
def test_what_a_stream_carried_that_cannot_be_continued(choice, why):
    t = C.Transcript(chat=True)
    t.feed(_sse({"id": "c", "choices": [choice]}))
    assert t.problem is not None and why in t.problem


def test_an_error_event_or_a_non_json_event_is_not_continued():
    t = C.Transcript(chat=False)
    t.feed(_sse({"error": {"message": "boom"}}))
    assert "error event" in (t.problem or "")
    t = C.Transcript(chat=False)
    t.feed(b"data: {not json\n\n")
    assert "not JSON" in (t.problem or "")


def test_a_continuations_events_go_on_as_the_clients_stream():
    first = C.Transcript(chat=True)
    first.feed(_sse({"id": "chatcmpl-A", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"content": "x "}}]}))
    relay = C.StreamRelay(CHAT, b"{}", max_migrations=2, max_text=100)
    relay.transcript, relay.given = first, 1
    head = {"id": "chatcmpl-B", "created": 9, "model": "m"}
    out = relay.rewritten(
        _sse(
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # dropped: the client had one
            {**head, "choices": [{"index": 0, "delta": {"content": "y "}}]},
            {**head, "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}},
            b"[DONE]",
        )
    )
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3 and events[-1] == b"data: [DONE]"
    chunk, usage = (json.loads(e.removeprefix(b"data: ")) for e in events[:2])
    assert (chunk["id"], chunk["created"], chunk["choices"][0]["delta"]["content"]) == ("chatcmpl-A", 1, "y ")
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_a_stream_is_not_continued_past_its_bounds():
    relay = C.StreamRelay(CHAT, json.dumps({"messages": MSGS}).encode(), max_migrations=1, max_text=5)
    relay.sent(_sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "abc"}}]}))
    assert relay.why_not() is None
    relay.sent(_sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "def"}}]}))
    assert "passed 5 characters" in (relay.why_not() or "")
    relay.max_text, relay.migrations = 100, 1
    assert "moved 1 time(s)" in (relay.why_not() or "")


def test_the_ending_of_an_answer_whose_budget_was_spent():
    first = C.Transcript(chat=False)
    first.id, first.created, first.model = "cmpl-1", 3, "m"
    events = C.ending(first, False, "length", {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}).split(b"\n\n")
    finish, usage = (json.loads(e.removeprefix(b"data: ")) for e in events[:2])
    assert finish["choices"] == [{"index": 0, "finish_reason": "length", "text": ""}] and finish["id"] == "cmpl-1"
    assert usage["usage"]["completion_tokens"] == 16 and events[2] == b"data: [DONE]"
    assert C.ending(first, True, None, None) == b"data: [DONE]\n\n"  # the client had its finish


# -- the sim engine continues its own answers ---------------------------------------


def _answer(gen) -> tuple[str, str]:
    p = gen.prompts[0]
    a = Answer(p.key, 0, gen.max_tokens, gen.ignore_eos, p.skip)
    return "".join(a.tokens()), a.finish_reason


@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_sim_continues_a_chat_answer_exactly(seed, ignore_eos):
    body = {"messages": MSGS, "max_tokens": 40, "ignore_eos": ignore_eos, **({"seed": seed} if seed is not None else {})}
    whole = chat_request(body, "m")
    text, finish = _answer(whole)
    words = text.split(" ")[:-1]
    for k in range(len(words)):
        given = "".join(w + " " for w in words[:k])
        body2 = C.continuation(CHAT, body, given, k)
        assert body2 is not None
        cont = chat_request(body2, "m")
        rest, finish2 = _answer(cont)
        assert (given + rest, finish2) == (text, finish), k
        assert cont.prompts[0].tokens == whole.prompts[0].tokens + k  # usage: first attempt's prompt = this less k


@pytest.mark.parametrize("prompt", ["Fabrics hold replicas:", "a node ", "mid-wor", "the"])
def test_the_sim_continues_a_completion_exactly(prompt):
    body = {"prompt": prompt, "max_tokens": 30}
    text, finish = _answer(completion_request(body, "m"))
    words = text.split(" ")[:-1]
    for k in range(1, len(words)):
        given = "".join(w + " " for w in words[:k])
        body2 = C.continuation(COMPLETIONS, body, given, k)
        assert body2 is not None
        rest, finish2 = _answer(completion_request(body2, "m"))
        assert (given + rest, finish2) == (text, finish), (prompt, k)


def test_the_sims_default_budget_counts_from_the_answers_start():
    """No max_tokens: 16 in all, whether the answer is given whole or continued."""
    body = {"messages": MSGS, "ignore_eos": True}
    text, finish = _answer(chat_request(body, "m"))
    assert (len(text.split()), finish) == (16, "length")
    for k in (1, 10, 16):
        given = "".join(w + " " for w in text.split()[:k])
        cont = chat_request(C.continuation(CHAT, body, given, k), "m")
        assert "max_tokens" not in C.continuation(CHAT, body, given, k)
        rest, finish2 = _answer(cont)
        assert (given + rest, finish2) == (text, finish), k


def test_the_sim_refuses_what_vllm_refuses_in_a_continuation():
    with pytest.raises(ApiError, match="Cannot set both"):
        chat_request({"messages": [*MSGS, {"role": "assistant", "content": "x"}], "continue_final_message": True}, "m")
    with pytest.raises(ApiError, match="must be the assistant's"):
        chat_request({"messages": MSGS, "continue_final_message": True, "add_generation_prompt": False}, "m")


def test_an_assistant_message_that_is_not_the_sims_own_answer_is_a_prompt_like_any_other():
    body = {"messages": [*MSGS, {"role": "assistant", "content": "zebra "}], "continue_final_message": True, "add_generation_prompt": False}
    assert chat_request(body, "m").prompts[0].skip == 0


# -- a vLLM stream goes on from its token ids ---------------------------------------


def test_a_stream_to_vllm_asks_for_token_ids_and_the_client_never_sees_them():
    body = b'{"model": "m", "messages": []}'
    assert C.splice_token_ids(body) == b'{"return_token_ids":true,"model": "m", "messages": []}'
    assert C.splice_token_ids(b'{"return_token_ids": false}') is None  # the client's word wins
    assert C.splice_token_ids(b"{ }") is None
    event = b'data: {"id":"c","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":"x"},"token_ids":[7]}]}\n\n'
    assert C.strip_token_ids(event) == b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    assert C.strip_token_ids(b'{"a":1,"token_ids":null}') == b'{"a":1}'
    relay = C.StreamRelay(CHAT, body, max_migrations=2, max_text=100)
    assert relay.upstream_body("sim") == body and not relay.strip
    assert relay.upstream_body("vllm").startswith(b'{"return_token_ids":true,') and relay.strip


@pytest.mark.parametrize("chat", [True, False])
def test_the_transcript_keeps_the_token_ids_vllm_reported(chat):
    t = C.Transcript(chat=chat)
    if chat:  # vLLM's chat: prompt ids at the top of the first chunk, answer ids per choice
        t.feed(_sse({"id": "c", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}))
        t.feed(_sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "cod"}, "token_ids": [40, 41]}]}))
        t.feed(_sse({"id": "c", "choices": [{"index": 0, "delta": {}, "token_ids": [42]}]}))  # a token with no text yet
    else:  # its completions: prompt ids in the first choice
        t.feed(_sse({"id": "c", "choices": [{"index": 0, "text": "cod", "prompt_token_ids": [1, 2, 3], "token_ids": [40, 41]}]}))
        t.feed(_sse({"id": "c", "choices": [{"index": 0, "text": "", "token_ids": [42]}]}))
    assert (t.prompt_ids, t.ids, t.text, C.by_tokens(t)) == ([1, 2, 3], [40, 41, 42], "cod", True)
    relay = C.StreamRelay(CHAT if chat else COMPLETIONS, b"{}", max_migrations=2, max_text=100)
    relay.transcript = t
    assert relay.exact_on("vllm") is None
    assert "does not take" in (relay.exact_on("sim") or "")


def test_text_without_its_token_ids_or_from_an_engine_whose_text_is_not_exact_is_not_continued():
    t = C.Transcript(chat=True)
    t.feed(_sse({"id": "c", "prompt_token_ids": [1], "choices": [{"index": 0, "delta": {"content": "x"}}]}))
    relay = C.StreamRelay(CHAT, b"{}", max_migrations=2, max_text=100)
    relay.transcript = t
    assert "did not report the token ids" in (relay.exact_on("vllm") or "")
    relay = C.StreamRelay(CHAT, b"{}", max_migrations=2, max_text=100)
    relay.upstream_body("sglang")
    assert "sglang engine's text is not an exact prompt" in (relay.exact_on("sim") or "")


@pytest.mark.parametrize(
    ("path", "body", "max_model_len", "want"),
    [
        (CHAT, {"messages": MSGS, "max_tokens": 10, "temperature": 0, "top_k": 5, "tools": [], "ignore_eos": True,
                "stream_options": {"include_usage": True}},
         None,
         {"model": "m", "prompt": [1, 2, 3, 40, 41], "stream": True, "return_token_ids": True, "max_tokens": 8, "temperature": 0,
          "top_k": 5, "ignore_eos": True, "stream_options": {"include_usage": True}}),
        # a chat with no budget: the context left
        (CHAT, {"messages": MSGS, "min_tokens": 5}, 100,
         {"model": "m", "prompt": [1, 2, 3, 40, 41], "stream": True, "return_token_ids": True, "max_tokens": 95, "min_tokens": 3}),
        # a completion with none: OpenAI's 16
        (COMPLETIONS, {"prompt": "p"}, None, {"model": "m", "prompt": [1, 2, 3, 40, 41], "stream": True, "return_token_ids": True, "max_tokens": 14}),
        (CHAT, {"messages": MSGS, "max_completion_tokens": 2}, None, None),  # spent
    ],
)  # fmt: skip
def test_the_token_continuation_request(path, body, max_model_len, want):
    t = C.Transcript(chat=path == CHAT)
    t.prompt_ids, t.ids = [1, 2, 3], [40, 41]
    assert C.token_continuation(path, body, t, "m", max_model_len) == want


def test_a_completion_chunk_goes_on_as_a_chat_chunk():
    first = C.Transcript(chat=True)
    first.id, first.created, first.model = "chatcmpl-A", 1, "m"
    out = C.rewrite(
        json.dumps({"id": "cmpl-B", "object": "text_completion", "created": 9, "model": "m",
                    "choices": [{"index": 0, "text": "d", "logprobs": None, "finish_reason": None, "token_ids": [41]}]}).encode(),
        first, 2, chat_from_completion=True,
    )  # fmt: skip
    assert json.loads(out) == {
        "id": "chatcmpl-A", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "d"}, "logprobs": None, "finish_reason": None, "token_ids": [41]}],
    }  # fmt: skip
