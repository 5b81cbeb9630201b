"""shared/structconf.py: how msgspec's refusals of a configuration read, for shapes
the services' and the agent's files (tests/test_service_config.py,
tests/test_agent_config.py) do not have."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest

from llmgw.shared.errors import ConfigError
from llmgw.shared.structconf import Duration, Invalid, Section, convert


class Pool(Section, frozen=True):
    name: str
    size: int = 1

    def __post_init__(self):
        if self.size < 1:
            raise Invalid("size", f"must be at least 1, got {self.size}")


class Plan(Section, frozen=True):
    mode: Literal["fast", "careful"] = "careful"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    pools: tuple[Pool, ...] = ()
    grace: Duration = 1.0
    limit: float = 0.5


REFUSALS = [
    ("choice", {"mode": "reckless"}, "mode: 'reckless' is not one of fast, careful"),
    ("mapping-value", {"labels": {"team": 7}}, "labels[...]: expected a string, got an integer"),
    ("list-element-not-a-mapping", {"pools": ["a"]}, "pools[0]: expected a mapping of keys, got a string 'a'"),
    ("list-element-unknown-key", {"pools": [{"name": "a"}, {"name": "b", "sise": 2}]}, "pools[1].sise: unknown key; did you mean 'size'?"),
    ("list-element-missing-key", {"pools": [{"size": 2}]}, "pools[0].name: required key is missing"),
    ("list-element-value", {"pools": [{"name": "a", "size": 0}]}, "pools[0].size: must be at least 1, got 0"),
    ("number-as-string", {"limit": "half"}, "limit: expected a number, got a string 'half'"),
    ("duration", {"grace": "1 minute"}, "grace: '1 minute' is not a duration; write e.g. 500ms, 5s, 1m or 1h30m"),
    ("top-level-not-a-mapping", ["mode"], "top level: expected a mapping of keys, got a list"),
]


@pytest.mark.parametrize("data, expected", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_word_for_word(data, expected):
    with pytest.raises(ConfigError) as e:
        convert(data, Plan, "plan.yaml")
    assert str(e.value) == f"plan.yaml: {expected}"


def test_a_section_read_under_a_key_is_named_by_its_full_path():
    with pytest.raises(ConfigError) as e:
        convert({"name": "a", "size": "two"}, Pool, "plan.yaml", at="pools[3]")
    assert str(e.value) == "plan.yaml: pools[3].size: expected a whole number, got a string 'two'"


def test_what_loads_is_plain_values():
    plan = convert({"mode": "fast", "grace": "1m30s", "limit": 1, "pools": [{"name": "a"}], "labels": None}, Plan, "plan.yaml")
    assert plan == Plan(mode="fast", grace=90.0, limit=1.0, pools=(Pool("a"),))
    assert type(plan.grace) is float and type(plan.limit) is float
    # A struct read from a file can go on the wire as it is.
    assert msgspec.json.decode(msgspec.json.encode(plan), type=Plan) == plan


def test_a_struct_built_in_code_is_checked_too():
    with pytest.raises(ConfigError, match="size: must be at least 1, got 0"):
        Pool("a", size=0)
