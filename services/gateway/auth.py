"""Optional API keys: bearer tokens checked against the digests of the key file.

The file's format and its reader are ``shared/apikeys.py`` (a configuration
naming the file is checked with the same reader when it is loaded). Make a
line for it with::

    python -m llmgw.services.gateway.auth hash TOKEN

A token is hashed once per request and looked up in a set: the digest of an
unguessable token reveals nothing through lookup timing worth having.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.shared.apikeys import digest, read_digests
from llmgw.shared.errors import ConfigError


class ApiKeys:
    def __init__(self, digests: set[str], source: str = ""):
        self.digests = digests
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        try:
            return cls(read_digests(path), str(path))
        except ConfigError as e:
            raise ConfigError(f"gateway.api_keys_file: {e}") from None

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
