"""Validating OpenAI request bodies into what the simulated engine needs.

Every problem becomes an ``ApiError`` carrying OpenAI's error shape, so a bad
body is a 400 with a message naming the field, never a crash. Fields the
simulation has no use for (temperature, top_p, stop, ...) are accepted and
ignored, as a real server would accept them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TypeGuard

from .tokens import MAX_NATURAL, VOCAB, Answer, chat_tokens, prompt_key, tokenize

DEFAULT_MAX_TOKENS = 16
MAX_MODEL_LEN = 8192
MAX_N = 16


class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


@dataclass(frozen=True)
class Prompt:
    key: bytes
    tokens: int
    # The prompt's tokens as the engine counts them (what its prefix cache hashes
    # in blocks); ``tokens`` is their number, which usage.prompt_tokens reports.
    ids: tuple = field(default=(), compare=False, repr=False)
    # Tokens of this prompt's own answer at its end (a continuation): ``Answer(skip=)``.
    skip: int = 0

    @classmethod
    def of(cls, key: bytes, ids: list, skip: int = 0) -> Prompt:
        return cls(key, len(ids), tuple(ids), skip)


@dataclass(frozen=True)
class Generation:
    """A validated request: what to generate, how much, and how to answer."""

    model: str
    prompts: list[Prompt]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse_body(raw: bytes) -> dict:
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    return body


def _int_field(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise bad(f"'{name}' must be an integer, got {json.dumps(value)[:40]}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)[:40]}", name)
    return value


def _common(body: dict, served_model: str, prompts: list[Prompt], *, max_tokens_names: tuple[str, ...], max_model_len: int = MAX_MODEL_LEN) -> Generation:
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist; this engine serves `{served_model}`.", code="model_not_found", param="model")

    max_tokens = None
    for name in max_tokens_names:  # the first one given wins
        if body.get(name) is not None:
            max_tokens = _int_field(body, name, DEFAULT_MAX_TOKENS, 1, max_model_len)
            break
    if max_tokens is None:
        # Counted from the answer's start: a continuation (``skip``) gets what is left of it,
        # as vLLM's default (the context left) shrinks with a longer prompt.
        max_tokens = max(DEFAULT_MAX_TOKENS - max(p.skip for p in prompts), 0)
    prompt_tokens = max(p.tokens for p in prompts)
    if prompt_tokens + max_tokens > max_model_len:
        raise bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_tokens} and {max_tokens} more were requested",
            max_tokens_names[0],
            code="context_length_exceeded",
        )

    n = _int_field(body, "n", 1, 1, MAX_N)
    stream = _bool_field(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("'stream_options' can only be given when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = _bool_field(options, "include_usage")
    # vLLM's extension: generate exactly max_tokens (benchmarks, long streams).
    ignore_eos = _bool_field(body, "ignore_eos")
    return Generation(model=model, prompts=prompts, max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage, ignore_eos=ignore_eos)


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise bad("'seed' must be an integer", "seed")
    return seed


def _keyed(seed: int | None, *parts: object) -> bytes:
    """A prompt's key; the seed is part of it (another seed, another answer)."""
    key = prompt_key(*parts)
    return key if seed is None else prompt_key(key, seed)


def _answers(key: bytes, partial: str, ignore_eos: bool) -> bool:
    """Whether ``partial`` is how the answer to the prompt keyed ``key`` begins."""
    k = len(tokenize(partial))
    answer = Answer(key, 0, k, ignore_eos)
    return answer.length == k and "".join(answer.tokens()) == partial


# How far back a completion prompt is searched for an answer of its own start (the
# longest answer that ends by itself; with ignore_eos, answers are as long as asked).
MAX_CONTINUED = MAX_NATURAL
MAX_CONTINUED_IGNORE_EOS = 4096


def continued_text(text: str, seed: int | None, ignore_eos: bool) -> tuple[str, int] | None:
    """The prompt a completion prompt continues: ``(base, k)`` when ``text`` is
    ``base`` followed by the first ``k`` tokens of ``base``'s own answer, so
    generating from ``text`` goes on with the rest of that answer, as a greedy
    model continues text it wrote. Answer tokens are VOCAB words each followed
    by one space; the first may have merged with a word ``base`` ended in.

    Only a prompt ending in a space is looked at (cheap to refuse); the
    candidates are checked longest first, each by the hash of its base."""
    if not text.endswith(" "):
        return None
    limit = MAX_CONTINUED_IGNORE_EOS if ignore_eos else MAX_CONTINUED
    cuts: list[int] = []  # where the answer would start, for k = 1, 2, ...
    pos = len(text)
    while len(cuts) < limit and pos > 0 and text[pos - 1] == " ":
        start = text.rfind(" ", 0, pos - 1) + 1
        word = text[start : pos - 1]
        if word in _VOCAB_WORDS:
            cuts.append(start)
            pos = start
            continue
        merged = [w for w in VOCAB if word.endswith(w) and len(w) < len(word)]
        if merged:  # the answer's first token, after a base that ended mid-word
            cuts.append(pos - 1 - max(map(len, merged)))
        break
    for k in range(len(cuts), 0, -1):
        base = text[: cuts[k - 1]]
        if _answers(_keyed(seed, "text", base), text[cuts[k - 1] :], ignore_eos):
            return base, k
    return None


_VOCAB_WORDS = frozenset(VOCAB)


def _message_text(i: int, msg: object) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(f"'{where}' must be an object with 'role' and 'content'", where)
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise bad(f"'{where}.role' must be a non-empty string", f"{where}.role")
    content = msg.get("content")
    if content is None:
        # Assistant turns that only carry tool calls have no content.
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"'{where}.content[{k}]' must be an object with a 'type'", f"{where}.content")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{k}].text' must be a string", f"{where}.content")
                texts.append(part["text"])
        return role, "\n".join(texts)
    raise bad(f"'{where}.content' must be a string or a list of content parts", f"{where}.content")


def chat_request(body: dict, served_model: str, max_model_len: int = MAX_MODEL_LEN) -> Generation:
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    turns = [_message_text(i, m) for i, m in enumerate(messages)]
    seed = _seed(body)
    prompt = _chat_continuation(body, turns, seed) or Prompt.of(_keyed(seed, "chat", turns), chat_tokens(turns))
    return _common(body, served_model, [prompt], max_tokens_names=("max_completion_tokens", "max_tokens"), max_model_len=max_model_len)


def _chat_continuation(body: dict, turns: list[tuple[str, str]], seed: int | None) -> Prompt | None:
    """vLLM's ``continue_final_message``: the last (assistant) message is continued,
    not answered. When it is how the earlier messages' own answer begins, the rest
    of that answer follows (the prompt is the earlier messages, its answer's first
    tokens already given); otherwise the messages are a prompt like any other."""
    if not _bool_field(body, "continue_final_message"):
        return None
    add = body.get("add_generation_prompt", True)
    if not isinstance(add, bool):
        raise bad("'add_generation_prompt' must be true or false", "add_generation_prompt")
    if add:  # vLLM's own check and words
        raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "continue_final_message")
    role, partial = turns[-1]
    if role != "assistant":
        raise bad("'continue_final_message' continues the last message, which must be the assistant's", "continue_final_message")
    base = turns[:-1]
    ignore_eos = _bool_field(body, "ignore_eos")
    if not base or not _answers(_keyed(seed, "chat", base), partial, ignore_eos):
        return None
    given = tokenize(partial)
    return Prompt.of(_keyed(seed, "chat", base), chat_tokens(base) + given, skip=len(given))


def completion_request(body: dict, served_model: str, max_model_len: int = MAX_MODEL_LEN) -> Generation:
    raw = body.get("prompt")
    if raw is None:
        raise bad("'prompt' is required", "prompt", code="missing_field")
    seed = _seed(body)
    prompts = _prompts(raw, seed)
    if isinstance(raw, str) and body.get("n") in (None, 1):
        found = continued_text(raw, seed, _bool_field(body, "ignore_eos"))
        if found is not None:
            base, k = found
            prompts = [Prompt.of(_keyed(seed, "text", base), tokenize(base) + tokenize(raw[len(base) :]), skip=k)]
    return _common(body, served_model, prompts, max_tokens_names=("max_tokens",), max_model_len=max_model_len)


def _prompts(raw: object, seed: int | None = None) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of those lists."""

    def token_ids(x: object) -> TypeGuard[list[int]]:
        return isinstance(x, list) and bool(x) and all(type(t) is int and t >= 0 for t in x)

    if isinstance(raw, str):
        return [Prompt.of(_keyed(seed, "text", raw), tokenize(raw))]
    if token_ids(raw):
        return [Prompt.of(_keyed(seed, "ids", raw), raw)]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return [Prompt.of(_keyed(seed, "text", p), tokenize(p)) for p in raw]
        if all(token_ids(p) for p in raw):
            return [Prompt.of(_keyed(seed, "ids", p), p) for p in raw]
    raise bad("'prompt' must be a string, a non-empty list of strings, or token ids", "prompt")


# -- the other endpoints (vLLM's shapes) ------------------------------------------------


def _served(body: dict, served_model: str) -> str:
    model = body.get("model")
    if model is None:
        return served_model
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist; this engine serves `{served_model}`.", code="model_not_found", param="model")
    return model


@dataclass(frozen=True)
class Embedding:
    model: str
    prompts: list[Prompt]
    dimensions: int
    base64: bool


DEFAULT_DIMENSIONS = 64
MAX_DIMENSIONS = 4096


def embedding_request(body: dict, served_model: str, max_model_len: int = MAX_MODEL_LEN) -> Embedding:
    model = _served(body, served_model)
    raw = body.get("input")
    if raw is None:
        raise bad("'input' is required", "input", code="missing_field")
    try:
        prompts = _prompts(raw)
    except ApiError:
        raise bad("'input' must be a string, a non-empty list of strings, or token ids", "input") from None
    longest = max(p.tokens for p in prompts)
    if longest > max_model_len:
        raise bad(f"this model's maximum context length is {max_model_len} tokens; an input has {longest}", "input", code="context_length_exceeded")
    dimensions = _int_field(body, "dimensions", DEFAULT_DIMENSIONS, 1, MAX_DIMENSIONS)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise bad(f"'encoding_format' must be 'float' or 'base64', got {json.dumps(fmt)[:40]}", "encoding_format")
    return Embedding(model, prompts, dimensions, fmt == "base64")


def _response_turns(body: dict) -> list[tuple[str, str]]:
    turns: list[tuple[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        turns.append(("system", instructions))
    raw = body.get("input")
    if raw is None:
        raise bad("'input' is required", "input", code="missing_field")
    if isinstance(raw, str):
        return [*turns, ("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(raw):
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            # Responses' content parts are typed input_text (chat's are text).
            parts = [
                {"type": "text", "text": p.get("text")} if isinstance(p, dict) and p.get("type") in ("input_text", "output_text") else p
                for p in item["content"]
            ]
            item = {**item, "content": parts}
        role, text = _message_text(i, item)
        turns.append((role, text))
    return turns


def responses_request(body: dict, served_model: str, max_model_len: int = MAX_MODEL_LEN) -> Generation:
    turns = _response_turns(body)
    prompt = Prompt.of(_keyed(_seed(body), "chat", turns), chat_tokens(turns))
    n = body.get("n")
    if n not in (None, 1):
        raise bad("'n' is not supported by /v1/responses", "n")
    return _common(body, served_model, [prompt], max_tokens_names=("max_output_tokens",), max_model_len=max_model_len)


def tokenize_request(body: dict, served_model: str) -> tuple[str, list[str]]:
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``): the tokens."""
    model = _served(body, served_model)
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty list", "messages")
        return model, chat_tokens([_message_text(i, m) for i, m in enumerate(messages)])
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' (or 'messages') is required", "prompt", code="missing_field")
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string", "prompt")
    return model, tokenize(prompt)


def detokenize_request(body: dict, served_model: str) -> tuple[str, list[int]]:
    model = _served(body, served_model)
    ids = body.get("tokens")
    if ids is None:
        raise bad("'tokens' is required", "tokens", code="missing_field")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise bad("'tokens' must be a list of integer token ids", "tokens")
    return model, ids
