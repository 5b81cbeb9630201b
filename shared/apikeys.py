"""The gateway's API key file: SHA-256 digests of bearer tokens, one per line.

The file holds digests, never tokens, so reading it (or a backup of it) gives
no one a key. One lowercase or uppercase hex digest per line; ``#`` starts a
comment; blank lines are ignored. Make a line with::

    python -m llmgw.services.gateway.auth hash TOKEN

Read here, apart from the gateway, because it is read twice by the same code:
when a configuration naming it is loaded (``shared/config.py``), and by the
gateway at start and on SIGHUP (``services/gateway/auth.py``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .errors import ConfigError

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_digests(path: str | Path) -> set[str]:
    """The digests in the file (lowercase), or a ConfigError saying what is wrong with it."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    digests: set[str] = set()
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not _HEX64.fullmatch(text):
            raise ConfigError(
                f"{p} line {n}: expected a SHA-256 hex digest (64 hex characters), not a token; make one with 'python -m llmgw.services.gateway.auth hash TOKEN'"
            )
        digests.add(text.lower())
    if not digests:
        # Refusing every request is safe but surely not meant; say so at start.
        raise ConfigError(f"{p} holds no keys; add one or remove gateway.api_keys_file to run without keys")
    return digests
