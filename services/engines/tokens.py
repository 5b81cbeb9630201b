"""Deterministic text for the simulated engine.

The same prompt (and seed, and choice index) always yields the same tokens, so
tests and benchmarks can compare answers across replicas and restarts. Nothing
here knows about HTTP or timing.
"""

from __future__ import annotations

import hashlib
import re

# A small vocabulary; every token is one word followed by a space, so a token
# count is a word count and clients can check it.
VOCAB = (
    "the",
    "a",
    "fabric",
    "node",
    "replica",
    "leader",
    "worker",
    "token",
    "model",
    "engine",
    "gpu",
    "link",
    "rank",
    "group",
    "request",
    "stream",
    "batch",
    "cache",
    "layer",
    "tensor",
    "is",
    "runs",
    "serves",
    "waits",
    "joins",
    "loads",
    "moves",
    "holds",
    "of",
    "on",
    "and",
    "with",
    "fast",
    "idle",
    "ready",
    "whole",
    "every",
    "each",
    "one",
    "all",
)

_WORD = re.compile(r"\w+|[^\w\s]")

# vLLM's chat templates add a few special tokens around every message.
CHAT_TOKENS_PER_MESSAGE = 3


def tokenize(text: str) -> list[str]:
    """A rough tokenizer: words and punctuation marks, one token each."""
    return _WORD.findall(text)


def count_tokens(text: str) -> int:
    return len(_WORD.findall(text))


def chat_tokens(turns: list[tuple[str, str]]) -> list[str]:
    """A chat prompt as the engine tokenizes it: per message, its template's
    ``CHAT_TOKENS_PER_MESSAGE`` special tokens around the content's tokens."""
    out: list[str] = []
    for role, text in turns:
        out.append(f"<|{role}|>")
        out.append("<|content|>")
        out += _WORD.findall(text)
        out.append("<|end|>")
    return out


def prompt_key(*parts: object) -> bytes:
    """A stable digest of whatever identifies a prompt."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.digest()


MAX_NATURAL = 32  # the longest answer that ends by itself (without ignore_eos)


class Answer:
    """The tokens one choice will produce and why it stops.

    The natural length comes from the prompt, so some answers end with
    ``stop`` before ``max_tokens`` and others are cut with ``length``.

    ``skip``: this many of the answer's tokens are already in the prompt (a
    continuation, ``continuation_of``): the answer is what is left of the
    prompt's own answer, as a greedy language model would continue it, and
    ``max_tokens`` counts from there.
    """

    def __init__(self, key: bytes, index: int, max_tokens: int, ignore_eos: bool = False, skip: int = 0):
        self._seed = hashlib.blake2b(key + index.to_bytes(4, "big"), digest_size=16).digest()
        self.skip = skip
        natural = 4 + int.from_bytes(self._seed[:2], "big") % (MAX_NATURAL - 3)  # 4..32 tokens
        budget = max_tokens + skip
        if ignore_eos:
            natural = budget + 1
        self.length = max(min(natural, budget) - skip, 0)
        self.finish_reason = "stop" if natural <= budget else "length"

    def token(self, i: int) -> str:
        d = hashlib.blake2b(self._seed + (i + self.skip).to_bytes(4, "big"), digest_size=2).digest()
        return VOCAB[int.from_bytes(d, "big") % len(VOCAB)] + " "

    def tokens(self) -> list[str]:
        return [self.token(i) for i in range(self.length)]


# Token ids (/tokenize, /detokenize, prompts of ids): a word of VOCAB is its index; any
# other token of up to ID_BYTES UTF-8 bytes is spelled into its id (so it comes back
# from /detokenize as it went in); a longer one is hashed into [HASHED_BASE, SPELLED_BASE)
# and comes back as UNKNOWN. Every id is below 2**53, so JSON clients of any language
# read it exactly.
ID_BYTES = 5
HASHED_BASE = 64
SPELLED_BASE = 1 << 20
MAX_TOKEN_ID = SPELLED_BASE + (ID_BYTES + 1) * (1 << (8 * ID_BYTES)) - 1
UNKNOWN = "<unk>"
_VOCAB_IDS = {w: i for i, w in enumerate(VOCAB)}


def token_id(token: str) -> int:
    i = _VOCAB_IDS.get(token.strip())
    if i is not None:
        return i
    raw = token.encode("utf-8", "surrogatepass")
    if len(raw) <= ID_BYTES:
        return SPELLED_BASE + (len(raw) << (8 * ID_BYTES)) + int.from_bytes(raw, "big")
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")
    return HASHED_BASE + h % (SPELLED_BASE - HASHED_BASE)


def token_str(i: int) -> str:
    """The token an id stands for (UNKNOWN for a hashed one); ValueError for no id at all."""
    if not 0 <= i <= MAX_TOKEN_ID:
        raise ValueError(f"token id {i} is outside the vocabulary (0..{MAX_TOKEN_ID})")
    if i < len(VOCAB):
        return VOCAB[i]
    if i < SPELLED_BASE:
        return UNKNOWN
    n, value = divmod(i - SPELLED_BASE, 1 << (8 * ID_BYTES))
    if n > ID_BYTES or value >= 1 << (8 * n):
        raise ValueError(f"token id {i} is outside the vocabulary")
    return value.to_bytes(n, "big").decode("utf-8", "replace")


def detokenize(ids: list[int]) -> str:
    return " ".join(token_str(i) for i in ids)


def embedding(key: bytes, dimensions: int) -> list[float]:
    """A deterministic unit vector for a prompt (its key), ``dimensions`` long."""
    out: list[float] = []
    counter = 0
    while len(out) < dimensions:
        d = hashlib.blake2b(key + counter.to_bytes(4, "big"), digest_size=64).digest()
        out += [(int.from_bytes(d[k : k + 2], "big") / 32767.5) - 1.0 for k in range(0, 64, 2)]
        counter += 1
    out = out[:dimensions]
    norm = sum(x * x for x in out) ** 0.5 or 1.0
    return [x / norm for x in out]
