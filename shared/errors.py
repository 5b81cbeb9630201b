"""One exception base, a few families, precise leaves (after httpx).

Lower-layer errors are mapped onto these with ``raise … from None`` so a caller
handles an llmgw failure without knowing which library produced it, and every
message says what to do next.
"""


class LlmgwError(Exception):
    """Base of every error llmgw raises on purpose."""

    code = "error"


class ConfigError(LlmgwError):
    """A configuration file, flag or spec is wrong; the message names where."""

    code = "bad_config"


class WireError(LlmgwError):
    """A message on the bus could not be decoded into its schema.

    Services log and count these and keep running: one bad publisher must never
    take a service down.
    """

    code = "bad_message"

    def __init__(self, schema: str, reason: str):
        super().__init__(f"malformed {schema}: {reason}")
        self.schema = schema
        self.reason = reason


class PkiError(LlmgwError):
    """Certificate authority, issuing or ledger problem."""

    code = "pki"


class InvalidName(PkiError, ConfigError):
    """A node id or service name is not a single NATS token."""

    code = "invalid_name"


class BusError(LlmgwError):
    """The NATS server could not be reached or refused us."""

    code = "bus"


class NotAvailable(LlmgwError):
    """A capability that a later part of the build provides."""

    code = "not_available"
