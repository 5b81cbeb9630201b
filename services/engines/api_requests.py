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

from .tokens import chat_tokens, prompt_key, tokenize

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

    @classmethod
    def of(cls, key: bytes, ids: list) -> Prompt:
        return cls(key, len(ids), tuple(ids))


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
        max_tokens = DEFAULT_MAX_TOKENS
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
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise bad("'seed' must be an integer", "seed")
    if seed is not None:
        prompts = [Prompt(prompt_key(p.key, seed), p.tokens, p.ids) for p in prompts]
    return Generation(model=model, prompts=prompts, max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage, ignore_eos=ignore_eos)


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
    prompt = Prompt.of(prompt_key("chat", turns), chat_tokens(turns))
    return _common(body, served_model, [prompt], max_tokens_names=("max_completion_tokens", "max_tokens"), max_model_len=max_model_len)


def completion_request(body: dict, served_model: str, max_model_len: int = MAX_MODEL_LEN) -> Generation:
    raw = body.get("prompt")
    if raw is None:
        raise bad("'prompt' is required", "prompt", code="missing_field")
    return _common(body, served_model, _prompts(raw), max_tokens_names=("max_tokens",), max_model_len=max_model_len)


def _prompts(raw: object) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of those lists."""

    def token_ids(x: object) -> TypeGuard[list[int]]:
        return isinstance(x, list) and bool(x) and all(type(t) is int and t >= 0 for t in x)

    if isinstance(raw, str):
        return [Prompt.of(prompt_key("text", raw), tokenize(raw))]
    if token_ids(raw):
        return [Prompt.of(prompt_key("ids", raw), raw)]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return [Prompt.of(prompt_key("text", p), tokenize(p)) for p in raw]
        if all(token_ids(p) for p in raw):
            return [Prompt.of(prompt_key("ids", p), p) for p in raw]
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
    prompt = Prompt.of(prompt_key("chat", turns), chat_tokens(turns))
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
