"""The agent's ``cache`` section: values that load, refusals word for word."""

from __future__ import annotations

import copy

import pytest

from llmgw.services.agent.config import load_agent_config, parse_size
from llmgw.shared.errors import ConfigError
from llmgw.shared.structconf import Invalid

from .test_agent_config import base, certs, write  # noqa: F401 - certs is a fixture

SIZES = [
    ("bytes", 1073741824, 1 << 30),
    ("binary unit", "200GiB", 200 << 30),
    ("decimal unit", "2TB", 2 * 10**12),
    ("lower case, spaced", "500 mib", 500 << 20),
    ("a fraction", "1.5GiB", 3 << 29),
    ("bare digits in a string", "4096", 4096),
]


@pytest.mark.parametrize(("value", "expected"), [r[1:] for r in SIZES], ids=[r[0] for r in SIZES])
def test_sizes(value, expected):
    assert parse_size(value, "budget") == expected


def test_a_cache_section_loads_with_paths_resolved_against_the_file(tmp_path, certs):
    data = base(certs)
    data["cache"] = {"dir": "cache", "budget": "20GiB", "mirror": "mirror", "copy_rate": "500MiB"}
    cfg = load_agent_config(write(tmp_path, data))
    assert cfg.cache is not None
    assert (cfg.cache.dir, cfg.cache.mirror) == (str(tmp_path / "cache"), str(tmp_path / "mirror"))
    assert (cfg.cache.budget_bytes, cfg.cache.copy_rate_bytes, cfg.cache.progress_interval) == (20 << 30, 500 << 20, 1.0)


def test_no_cache_section_means_no_cache(tmp_path, certs):
    assert load_agent_config(write(tmp_path, base(certs))).cache is None


REFUSALS = [
    ("no dir", {"budget": "1GiB"}, "cache.dir: must not be empty: give a directory on local disk with room for the budget"),
    ("a word for a size", {"dir": "/c", "budget": "lots"}, "cache.budget: 'lots' is not a size: write a number of bytes or one with a unit"),
    ("zero budget", {"dir": "/c", "budget": 0}, "cache.budget: must be greater than 0, got 0"),
    ("negative", {"dir": "/c", "budget": "-5GiB"}, "cache.budget: '-5GiB' is not a size"),
    ("a bad rate", {"dir": "/c", "copy_rate": "fast"}, "cache.copy_rate: 'fast' is not a size"),
    ("a typo", {"dir": "/c", "mirorr": "/m"}, "cache.mirorr: unknown key; did you mean 'mirror'?"),
    ("zero progress interval", {"dir": "/c", "progress_interval": "0s"}, "cache.progress_interval: must be greater than 0, got 0s"),
]


@pytest.mark.parametrize(("section", "expected"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_key(tmp_path, certs, section, expected):
    data = copy.deepcopy(base(certs))
    data["cache"] = section
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    assert str(e.value).startswith(f"{path}: {expected}"), str(e.value)


def test_a_boolean_is_no_size():
    with pytest.raises(Invalid, match="must be a size"):
        parse_size(True, "budget")
