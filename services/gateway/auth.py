"""Optional API keys: a file of SHA-256 digests of bearer tokens.

The file holds digests, never tokens, so reading it (or a backup of it) gives
no one a key. One lowercase or uppercase hex digest per line; ``#`` starts a
comment; blank lines are ignored. Make a line with::

    python -m llmgw.services.gateway.auth hash TOKEN

A token is hashed once per request and looked up in a set: the digest of an
unguessable token reveals nothing through lookup timing worth having.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

from llmgw.shared.errors import ConfigError

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiKeys:
    def __init__(self, digests: set[str], source: str = ""):
        self.digests = digests
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        p = Path(path)
        try:
            lines = p.read_text().splitlines()
        except FileNotFoundError:
            raise ConfigError(f"gateway.api_keys_file: {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"gateway.api_keys_file: cannot read {p}: {e}") from None
        digests: set[str] = set()
        for n, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not _HEX64.fullmatch(text):
                raise ConfigError(
                    f"{p} line {n}: expected a SHA-256 hex digest (64 hex characters), not a token; "
                    "make one with 'python -m llmgw.services.gateway.auth hash TOKEN'"
                )
            digests.add(text.lower())
        if not digests:
            # Refusing every request is safe but surely not meant; say so at start.
            raise ConfigError(f"{p} holds no keys; add one or remove gateway.api_keys_file to run without keys")
        return cls(digests, str(p))

    def allows(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        return digest(token) in self.digests


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "hash":
        print("usage: python -m llmgw.services.gateway.auth hash TOKEN   (prints the line for gateway.api_keys_file)", file=sys.stderr)
        return 2
    if not args[1]:
        print("error: the token must not be empty", file=sys.stderr)
        return 2
    print(digest(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
