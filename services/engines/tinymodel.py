"""A tiny Llama-shaped model directory for real vLLM on a machine without GPUs.

``write(dir)`` writes what ``vllm serve DIR --load-format dummy`` needs and
nothing it must download: a ``config.json`` (``LlamaForCausalLM``, hidden 128,
4 layers, 4 heads, a vocabulary of 2048), a tokenizer (``tokenizer.json`` in
the Hugging Face ``tokenizers`` format, with ``tokenizer_config.json`` naming
its special tokens and a chat template) and no weights: the dummy load format
gives random weights of the right shapes. What it answers is noise; what it
does is real — scheduling, the prefix cache, pipeline stages across ranks,
the OpenAI server — which is what llmgw's tests and benches need from it.

The tokenizer is a WordPiece one, written here by hand so llmgw needs neither
``tokenizers`` nor ``transformers`` to make it: a word in its vocabulary is one
token; any other ASCII word is spelled in pieces (two letters, then one, as
``##``-continuations), so two different prompts are two different token
sequences — a word-level tokenizer that mapped unknown words to ``<unk>``
would make every prompt of unknown words share one prefix, and the prefix
cache's hit ratio meaningless. Text is lowercased.

``llmgw engine tiny-model DIR`` runs it; ``llmgw up --engine vllm``, the
real-vLLM tests and the benches call ``write``.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

from llmgw.shared.errors import ConfigError

# The name clients ask for: vLLM serves a model directory under its path unless
# --served-model-name says otherwise, and llmgw passes this one.
SERVED_NAME = "tiny-llama"
VOCAB_SIZE = 2048
HIDDEN = 128
LAYERS = 4
HEADS = 4
DEFAULT_MAX_POSITIONS = 8192

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLES = ("system", "user", "assistant", "tool")
SPECIALS = (UNK, BOS, EOS, PAD, *(f"<|{r}|>" for r in ROLES), "<|end|>")
# Words llmgw's tests, benches and demo send, kept whole (one token each).
WORDS = (
    "hello", "hi", "are", "you", "still", "there", "ping", "pong", "the", "a", "an", "and", "or", "of", "to", "in", "on", "is", "it",
    "what", "who", "why", "how", "say", "tell", "me", "about", "this", "that", "user", "asks", "follows", "up", "one", "off",
    "assistant", "system", "fabric", "node", "replica", "leader", "worker", "token", "model", "engine", "gpu", "link", "rank",
    "group", "cache", "layer", "tensor", "batch", "prefix", "route", "gateway", "request", "answer", "question", "document",
)  # fmt: skip
# Chat: each message as its role's marker, its content, and <|end|>; then the
# assistant's marker when a reply is wanted. Plain Jinja, as transformers and
# vLLM render it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    " <|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def vocabulary() -> list[str]:
    """The tokens, by id: specials, punctuation and single characters (each also as a
    ``##`` continuation), llmgw's words, two-letter pieces, then three-letter
    continuations up to VOCAB_SIZE: every id the model can sample decodes."""
    singles = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = [*SPECIALS, *singles, *(f"##{c}" for c in singles)]
    tokens += [w for w in WORDS if w not in tokens]
    pairs = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    for p in pairs:  # continuations first: they shorten every unknown word
        tokens.append(f"##{p}")
    tokens += [p for p in pairs if p not in tokens]
    # The rest: three-letter continuations, consonant-vowel-consonant first.
    vowels = "aeiou"
    consonants = [c for c in string.ascii_lowercase if c not in vowels]
    for a in consonants:
        for v in vowels:
            for b in consonants:
                if len(tokens) >= VOCAB_SIZE:
                    return tokens
                tokens.append(f"##{a}{v}{b}")
    return tokens


def _added(token: str, id_: int) -> dict:
    return {"id": id_, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}


def tokenizer_json() -> dict:
    vocab = vocabulary()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added(t, i) for i, t in enumerate(vocab) if t in SPECIALS],
        "normalizer": {"type": "Lowercase"},
        # Splits on whitespace and punctuation, as BERT's does.
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {
            "type": "WordPiece",
            "unk_token": UNK,
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {t: i for i, t in enumerate(vocab)},
        },
    }


def config_json(max_positions: int = DEFAULT_MAX_POSITIONS, *, hidden: int = HIDDEN, layers: int = LAYERS) -> dict:
    vocab = vocabulary()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": hidden // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": vocab.index(BOS),
        "eos_token_id": vocab.index(EOS),
        "pad_token_id": vocab.index(PAD),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def tokenizer_config_json() -> dict:
    vocab = vocabulary()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(i): {k: v for k, v in _added(t, i).items() if k != "id"} for i, t in enumerate(vocab) if t in SPECIALS},
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "model_max_length": DEFAULT_MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write(directory: str | Path, *, max_positions: int = DEFAULT_MAX_POSITIONS, hidden: int = HIDDEN, layers: int = LAYERS) -> Path:
    """Write the model into ``directory`` (created; existing files of the same names
    are replaced, anything else left) and return its resolved path. ``hidden`` and
    ``layers`` size it: the routing bench makes a prefill cost compute, as it does
    on a GPU with a real model, where the default's cost is all per-step overhead."""
    if max_positions < 64:
        raise ConfigError(f"max_positions {max_positions}: at least 64 (a chat turn and its answer)")
    if hidden < HEADS or hidden % HEADS or layers < 1:
        raise ConfigError(f"hidden {hidden}, layers {layers}: hidden a multiple of {HEADS} heads, at least one layer")
    d = Path(directory).resolve()
    try:
        d.mkdir(parents=True, exist_ok=True)
        files = {
            "config.json": config_json(max_positions, hidden=hidden, layers=layers),
            "tokenizer.json": tokenizer_json(),
            "tokenizer_config.json": tokenizer_config_json(),
            "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD},
            "generation_config.json": {k: v for k, v in config_json(max_positions).items() if k.endswith("_token_id")},
        }
        for name, body in files.items():
            tmp = d / f".{name}.tmp"
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            tmp.replace(d / name)
    except OSError as e:
        raise ConfigError(f"cannot write the tiny model into {d}: {e.strerror or e}") from None
    return d


def main(args) -> int:
    """``llmgw engine tiny-model DIR``."""
    d = write(args.dir, max_positions=args.max_positions)
    print(d)
    return 0


def write_hf_cache(cache: str | Path, repo: str, *, max_positions: int = DEFAULT_MAX_POSITIONS, hidden: int = HIDDEN, layers: int = LAYERS) -> Path:
    """Write the model into a Hugging Face hub cache (``HF_HUB_CACHE``) as repository
    ``repo`` ("llmgw/tiny-llama"), so ``vllm serve llmgw/tiny-llama`` finds it there
    with ``HF_HUB_OFFLINE=1``, as a node with a model cache serves a hub model:
    ``models--llmgw--tiny-llama/snapshots/<revision>/`` and ``refs/main`` naming it.
    The revision is a digest of the files, so rewriting the same model changes nothing.
    Returns the snapshot directory."""
    owner, sep, name = repo.partition("/")
    if not sep or not owner or not name or "/" in name or ".." in repo:
        raise ConfigError(f"{repo!r} is not a hub repository name like 'llmgw/tiny-llama'")
    root = Path(cache).resolve() / f"models--{owner}--{name}"
    config = config_json(max_positions, hidden=hidden, layers=layers)
    digest = hashlib.sha1(json.dumps([config, tokenizer_json(), tokenizer_config_json()], sort_keys=True).encode()).hexdigest()
    snapshot = write(root / "snapshots" / digest, max_positions=max_positions, hidden=hidden, layers=layers)
    try:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        tmp = root / "refs" / ".main.tmp"
        tmp.write_text(digest)
        tmp.replace(root / "refs" / "main")
    except OSError as e:
        raise ConfigError(f"cannot write the tiny model's hub reference under {root}: {e.strerror or e}") from None
    return snapshot
