"""One HCA-name rule, held by every place a name enters: the agent's configuration
(``fabrics[i].hcas``, read from the file) and the wire (``Hca.name`` in an
inventory, ``FabricMembership.hcas``). One table drives both, so a name the
configuration accepts is never refused on the wire, nor the other way round."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.services.agent.config import FabricConfig
from llmgw.shared.errors import ConfigError, WireError
from llmgw.shared.names import HCA_NAME_MAX, hca_problem
from llmgw.shared.schemas import FabricMembership, Hca, decode
from llmgw.shared.structconf import convert

# (name, whether it is an HCA name)
HCA_NAMES = [
    ("mlx5_0", True),
    ("ibp12s0", True),
    ("rxe0", True),
    ("mlx5_bond_0", True),
    ("irdma-ens1f0", True),
    ("hfi1.0", True),
    ("a", True),
    ("a" * HCA_NAME_MAX, True),
    ("a" * (HCA_NAME_MAX + 1), False),  # accepted by the configuration and refused on the wire, once
    ("", False),
    ("mlx5:0", False),  # NCCL_IB_HCA's port separator (the wire once accepted it)
    ("mlx5_0,mlx5_1", False),  # NCCL_IB_HCA's device separator
    ("_mlx5", False),  # the wire once accepted a leading '_', '.' or '-'
    ("-mlx5", False),
    (".", False),
    ("..", False),
    ("../mlx5_0", False),  # a sysfs path component
    ("mlx5/0", False),
    ("mlx5 0", False),
    ("mlx5_0\n", False),
]
IDS = [n[:12] + (f"…({len(n)})" if len(n) > 12 else "") or "empty" for n, _ in HCA_NAMES]


def in_configuration(name: str) -> bool:
    try:
        convert({"name": "fabric-a", "hcas": [name]}, FabricConfig, "agent.yaml", at="fabrics[0]")
    except ConfigError as e:
        assert str(e).startswith("agent.yaml: fabrics[0].hcas[0]: "), e
        return False
    return True


def on_the_wire(name: str) -> bool:
    """Whether both wire fields that carry an HCA name take it (they must agree)."""
    results = []
    for schema, value in ((Hca, Hca(name=name)), (FabricMembership, FabricMembership(name="fabric-a", hcas=[name]))):
        try:
            decode(msgspec.json.encode(value), schema)
            results.append(True)
        except WireError:
            results.append(False)
    assert results[0] == results[1], f"Hca.name and FabricMembership.hcas disagree on {name!r}"
    return results[0]


@pytest.mark.parametrize("name, valid", HCA_NAMES, ids=IDS)
def test_configuration_and_wire_take_the_same_hca_names(name, valid):
    assert (in_configuration(name), on_the_wire(name), hca_problem(name) == "") == (valid, valid, valid)
