"""A deployment as an operator writes it: the file, its checks, and how a replica relates to it.

Beside ``DeploymentSpec`` (``shared/schemas.py``) so that every reader — the
scheduler's apply API, ``llmgw ctl deploy apply`` checking a file before it
sends it, the console — refuses the same things with the same words, without
importing a service (the scheduler's module registers its metrics on import).
"""

from __future__ import annotations

import posixpath
import re
import sys
from typing import ClassVar

import msgspec
import yaml

from .config import read_yaml_any
from .errors import ConfigError
from .names import check_name
from .schemas import DeploymentSpec, Replica
from .structconf import convert

# What the scheduler keeps on the record, not the operator: generations, the
# crash-loop backoff, when it was applied.
SCHEDULER_FIELDS = frozenset({"applied_at", "last_generation", "failures", "last_failure", "retry_at"})
# What an operator writes, in the schema's order (for "known: …" and "did you mean …").
OPERATOR_FIELDS = tuple(f for f in DeploymentSpec.__struct_fields__ if f not in SCHEDULER_FIELDS)


class DeploymentFile(DeploymentSpec, forbid_unknown_fields=True):
    """A deployment as a file may write it: read through the same reader as every
    configuration file (``structconf.convert``), so the same words refuse it;
    the scheduler's own fields are unknown keys there."""

    not_in_files: ClassVar[tuple[str, ...]] = tuple(sorted(SCHEDULER_FIELDS))


def validate_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """Refuse what could never run, with the field named."""
    check_name(spec.name, "deployment name")
    if not spec.model:
        raise ConfigError("model: must not be empty")
    if spec.replicas < 0:
        raise ConfigError(f"replicas: must be 0 or more, got {spec.replicas}")
    if spec.spares < 0:
        raise ConfigError(f"spares: must be 0 or more (warm spares beside the serving replicas), got {spec.spares}")
    if spec.nodes_per_replica < 1:
        raise ConfigError(f"nodes_per_replica: must be at least 1, got {spec.nodes_per_replica}")
    if spec.gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node: must be 0 or more, got {spec.gpus_per_node}")
    if spec.startup_timeout <= 0:
        raise ConfigError(f"startup_timeout: must be positive, got {spec.startup_timeout}")
    for k in spec.env:
        if not k or "=" in k or not k.replace("_", "a").isalnum():
            raise ConfigError(f"env: {k!r} is not a valid environment variable name")
    check_weights(spec.weights_path, spec.weights_model)
    return spec


# A model id as hubs and mirrors lay them out: "name" or "org/name", each part
# letters, digits, '.', '_', '-' (not starting with '.'): it becomes a path
# under an agent's mirror directory, so nothing may climb out of it.
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,95})?")
MAX_WEIGHTS_PATH = 4096


def check_weights(weights_path: str, weights_model: str) -> None:
    """A deployment's weights source (``weights_path`` or ``weights_model``), the
    same words at apply, in ``ctl deploy apply`` and on the agent."""
    if weights_path and weights_model:
        raise ConfigError(
            f"weights_path ({weights_path!r}) and weights_model ({weights_model!r}) are both set; "
            "give one: a directory on shared storage, or a model id under the agents' mirror"
        )
    if weights_path:
        where = "weights_path"
        if len(weights_path) > MAX_WEIGHTS_PATH or "\0" in weights_path:
            raise ConfigError(f"{where}: not a usable path (at most {MAX_WEIGHTS_PATH} characters, no NUL byte)")
        if not weights_path.startswith("/"):
            raise ConfigError(f"{where}: {weights_path!r} is relative; give the absolute path every node mounts the weights at")
        if weights_path.strip("/") == "":
            raise ConfigError(f"{where}: '/' is the whole file system, not a model's directory")
        if posixpath.normpath(weights_path) != weights_path.rstrip("/") or "/../" in f"{weights_path}/":
            raise ConfigError(f"{where}: {weights_path!r} is not a plain absolute path; write it as {posixpath.normpath(weights_path)!r}")
    if weights_model and not _MODEL_ID.fullmatch(weights_model):
        raise ConfigError(
            f"weights_model: {weights_model!r} is not a model id: 'name' or 'org/name', letters, digits, '.', '_' and '-' "
            "(each part at most 96, not starting with '.'); it is looked up under each agent's cache.mirror directory"
        )


def load_deployments(path: str) -> list[DeploymentSpec]:
    """Read a deployment file: one mapping, a list, or ``deployments: [...]``
    (``-``: standard input). Each item is checked for unknown keys, types and
    durations here (``DeploymentFile``); ``validate_spec`` checks the values."""
    # Not read_yaml: that one wants a mapping at the top, and a list is a deployment file too.
    data = read_yaml_any(path) if path != "-" else yaml.safe_load(sys.stdin.read())
    items = data.get("deployments", data) if isinstance(data, dict) else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: expected a deployment mapping, a list of them, or 'deployments: [...]'")
    specs = []
    for i, item in enumerate(items):
        f = convert(item, DeploymentFile, path, at=f"deployments[{i}]")
        specs.append(DeploymentSpec(**msgspec.structs.asdict(f)))
    return specs


def is_outdated(replica: Replica, digest: str) -> bool:
    """The replica runs another engine template than ``digest`` (the deployment's
    ``template_digest`` now): the rolling update replaces it. A record from
    before digests were kept (``spec_digest`` "") is never outdated, and neither
    is anything when the deployment is gone (``digest`` "")."""
    return bool(digest) and bool(replica.spec_digest) and replica.spec_digest != digest
