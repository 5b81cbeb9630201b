"""Engine adapters: one member of a replica -> the argv and environment that start it.

Pure functions of a ``LaunchCommand`` and two facts about this node (its
management address and interface). Every flag and variable here comes from the
engines' and NCCL's documentation; ``docs/engines.md`` lists each one with its
source and what has not been proven on real hardware. ``tests/test_adapters.py``
pins the exact output for a 2-node replica, so a change here is deliberate.

Parallelism, for a member with G GPUs in a replica of N nodes:

* vLLM: ``--tensor-parallel-size G --pipeline-parallel-size N`` — tensor
  parallel inside a node (NVLink), pipeline parallel across nodes, as vLLM's
  multi-node guide recommends ("set tensor_parallel_size to the number of GPUs
  per node and pipeline_parallel_size to the number of nodes").
* SGLang: ``--tensor-parallel-size G*N`` — SGLang's multi-node examples give
  the total TP across nodes (``--tp 16`` on two 8-GPU nodes); it has no
  per-node TP setting.

A user's own ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` in the
deployment's ``engine_args`` replaces ours. Flags that carry what llmgw
allocated (ports, ranks, addresses) cannot be overridden: a deployment setting
``--port`` would make the gateway route to a port nobody listens on, so such
engine_args are refused with ``AdapterError``. For vLLM that covers every
spelling its parser reads as one of those flags (short aliases such as ``-n``
and ``-r``, ``-n2``, unambiguous prefixes), and also the flags that would take
the replica's shape out of llmgw's hands: ``--data-parallel-*`` (llmgw's
replicas are its data parallelism), ``--api-server-count`` and ``--config``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import LaunchCommand

__all__ = ["ENGINES", "AdapterError", "EngineCommand", "ProgressProbe", "Weights", "build", "progress_probe", "served_model"]


class AdapterError(ConfigError):
    """A launch command cannot be turned into an engine command line."""

    code = "bad_launch"


@dataclass
class EngineCommand:
    """What to exec for one engine process.

    ``env`` holds only the variables llmgw sets: apply it on top of the agent's
    own environment (``{**os.environ, **env}``), never instead of it.
    ``serves_http`` is true when this process answers the OpenAI API and
    ``/health`` on ``http_port`` (the leader), false for workers.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    serves_http: bool = False


@dataclass(frozen=True)
class Weights:
    """Where this member reads its weights (a launch with a weights source):
    ``dir`` on this node, and whether they were in the node's model cache
    before the launch (``cached``) or were copied for it / read from the source."""

    dir: str
    cached: bool = False


# Variables a deployment's env may not set: they carry the scheduler's GPU
# allocation. CUDA_DEVICE_ORDER=FASTEST_FIRST would renumber devices away from
# nvidia-smi's (PCI) indices, so CUDA_VISIBLE_DEVICES would pick other GPUs.
_RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def _norm_flag(arg: str) -> str | None:
    """``--tensor_parallel_size=8`` -> ``--tensor-parallel-size``; None for a non-flag.

    vLLM accepts underscores in flag names; treating them alike everywhere only
    errs towards noticing a user's override.
    """
    if not arg.startswith("-") or arg == "-" or arg == "--":
        return None
    name = arg.split("=", 1)[0]
    dashes = len(name) - len(name.lstrip("-"))
    return name[:dashes] + name[dashes:].replace("_", "-")


def _flags(args: list[str]) -> set[str]:
    return {f for f in map(_norm_flag, args) if f}


def _check_engine_args(engine: str, args: list[str], reserved: tuple[str, ...]) -> set[str]:
    given = _flags(args)
    clash = sorted(given & set(reserved))
    if clash:
        raise AdapterError(
            f"{engine}: engine_args may not set {', '.join(clash)}: llmgw sets "
            f"{'it' if len(clash) == 1 else 'them'} from the replica's placement (ranks, addresses, ports)"
        )
    return given


def _base_env(cmd: LaunchCommand, mgmt_addr: str, mgmt_interface: str) -> dict[str, str]:
    clash = sorted(set(cmd.env) & set(_RESERVED_ENV))
    if clash:
        raise AdapterError(
            f"the deployment's env may not set {', '.join(clash)}: llmgw sets the GPUs this member was allocated ({','.join(map(str, cmd.gpus)) or 'none'})"
        )
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in cmd.gpus),
        # nvidia-smi and the scheduler number GPUs in PCI bus order; CUDA's
        # default (FASTEST_FIRST) may not, so pin it to match.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # "=" makes NCCL match the exact name, not a prefix ("eth0" would also
        # match "eth0.100").
        "NCCL_SOCKET_IFNAME": f"={mgmt_interface}",
        "GLOO_SOCKET_IFNAME": mgmt_interface,
        "VLLM_HOST_IP": mgmt_addr,
        "SGLANG_HOST_IP": mgmt_addr,
    }
    if cmd.fabric and cmd.hcas:
        # Exact names again: as a prefix "mlx5_1" also selects mlx5_10 and
        # mlx5_11, which on a 12-HCA node may be cabled to another fabric.
        env["NCCL_IB_HCA"] = "=" + ",".join(cmd.hcas)
    env.update(cmd.env)
    return env


def _check(cmd: LaunchCommand, *, need_gpus: bool) -> None:
    if cmd.nnodes < 1:
        raise AdapterError(f"replica {cmd.replica_id}: nnodes must be at least 1, got {cmd.nnodes}")
    if not 0 <= cmd.rank < cmd.nnodes:
        raise AdapterError(f"replica {cmd.replica_id}: rank {cmd.rank} is outside 0..{cmd.nnodes - 1}")
    if cmd.nnodes > 1 and not cmd.leader_addr:
        raise AdapterError(f"replica {cmd.replica_id}: a {cmd.nnodes}-node replica needs leader_addr")
    if cmd.nnodes > 1 and not 0 < cmd.rendezvous_port < 65536:
        raise AdapterError(f"replica {cmd.replica_id}: rendezvous_port {cmd.rendezvous_port} is not a port")
    if cmd.rank == 0 and not 0 < cmd.http_port < 65536:
        raise AdapterError(f"replica {cmd.replica_id}: the leader's http_port {cmd.http_port} is not a port")
    if need_gpus and not cmd.gpus:
        raise AdapterError(f"replica {cmd.replica_id}: engine {cmd.engine} needs at least one GPU, none allocated")
    if len(set(cmd.gpus)) != len(cmd.gpus) or any(g < 0 for g in cmd.gpus):
        raise AdapterError(f"replica {cmd.replica_id}: GPU indices {cmd.gpus} repeat or are negative")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# --------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------

_VLLM_TP = ("--tensor-parallel-size", "-tp")
_VLLM_PP = ("--pipeline-parallel-size", "-pp")

_VLLM_FAMILY = "--data-parallel-"  # every --data-parallel-* flag, present and future
_PLACEMENT = "llmgw sets {them} from the replica's placement (ranks, addresses, ports)"
# Every spelling vLLM's parser accepts for a flag llmgw must own, and why.
# Aliases as vllm-project/vllm declares them: ``vllm/engine/arg_utils.py``
# (EngineArgs.add_cli_args, the ParallelConfig group: ``"--nnodes", "-n"``,
# ``"--node-rank", "-r"``, ``"--data-parallel-size", "-dp"``, ``-dpn``, ``-dpr``,
# ``-dpl``, ``-dpa``, ``-dpp``, ``-dpb``, ``-dph``, ``-dpe``) and
# ``vllm/entrypoints/openai/cli_args.py`` (make_arg_parser: ``--headless``,
# ``"--api-server-count", "-asc"``, ``--config``; FrontendArgs: ``--host``,
# ``--port``, ``--uds``, which "if set, host and port arguments are ignored").
_VLLM_REFUSED: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("--nnodes", ("-n",), _PLACEMENT),
    ("--node-rank", ("-r",), _PLACEMENT),
    ("--master-addr", (), _PLACEMENT),
    ("--master-port", (), _PLACEMENT),
    ("--headless", (), _PLACEMENT),
    ("--host", (), _PLACEMENT),
    ("--port", (), _PLACEMENT),
    ("--uds", (), _PLACEMENT),
    ("--distributed-executor-backend", (), _PLACEMENT),
    (
        _VLLM_FAMILY + "*",
        ("-dp", "-dpn", "-dpr", "-dpl", "-dpa", "-dpp", "-dpb", "-dph", "-dpe"),
        # vLLM's data parallelism starts engines on other nodes with ranks, an
        # address and an RPC port of its own, none of which the scheduler placed.
        (
            "data parallelism in llmgw is a deployment's replicas (scale with `replicas`), and "
            "vLLM's own would start engines and open ports the scheduler never placed"
        ),
    ),
    (
        "--api-server-count",
        ("-asc",),
        # vLLM runs headless (no HTTP at all) for a count below 1, and more than
        # one API server process is a layout the agent's listener check does not know.
        "the leader runs exactly one API server on the port llmgw gave it (0 would serve no HTTP at all)",
    ),
    (
        "--config",
        (),
        ("a vLLM config file can set any flag, including those llmgw sets, out of this check's sight, so put its options in engine_args instead"),
    ),
)


def _vllm_refusal(arg: str) -> tuple[str, str] | None:
    """(the flag ``arg`` sets, why it is refused), or None if ``arg`` may be given.

    Matches what vLLM's argparse would read ``arg`` as: the long names, their
    aliases, a short alias with its value attached (``-n2``: argparse reads a
    one-letter option's value from the same token), and an unambiguous prefix
    (``--node-r``, ``-as``: argparse expands prefixes of long options, and of
    single-dash ones whatever ``allow_abbrev`` says). A prefix of several refused
    flags is refused too: vLLM would reject it as ambiguous anyway.
    """
    flag = _norm_flag(arg)
    if flag is None:
        return None
    single_dash = not flag.startswith("--")
    for long, aliases, why in _VLLM_REFUSED:
        if long == _VLLM_FAMILY + "*":
            if flag.startswith(_VLLM_FAMILY):
                return flag, why
            if not single_dash and _VLLM_FAMILY.startswith(flag):
                return f"{flag} ({long})", why
        elif flag == long:
            return long, why
        elif not single_dash and long.startswith(flag):
            return f"{flag} ({long})", why
        for alias in aliases:
            attached = single_dash and len(alias) == 2 and flag[:2] == alias
            if attached or (single_dash and alias.startswith(flag)):
                return f"{flag} ({long})", why
    return None


def _check_vllm_args(args: list[str]) -> set[str]:
    refused: dict[str, list[str]] = {}
    for arg in args:
        hit = _vllm_refusal(arg)
        if hit and hit[0] not in refused.get(hit[1], []):
            refused.setdefault(hit[1], []).append(hit[0])
    if refused:
        raise AdapterError(
            "vllm: "
            + "; ".join(
                f"engine_args may not set {', '.join(flags)}: " + why.format(them="it" if len(flags) == 1 else "them") for why, flags in refused.items()
            )
        )
    return _flags(args)


def _served_as(cmd: LaunchCommand, given: set[str], weights: Weights | None) -> list[str]:
    """An engine reading its weights from a directory would answer to the
    directory's name; clients (and the canary) ask for ``cmd.model``."""
    return ["--served-model-name", cmd.model] if weights is not None and "--served-model-name" not in given else []


def _vllm(cmd: LaunchCommand, mgmt_addr: str, mgmt_interface: str, python: str, weights: Weights | None = None) -> EngineCommand:
    _check(cmd, need_gpus=True)
    given = _check_vllm_args(cmd.engine_args)
    argv = ["vllm", "serve", weights.dir if weights else cmd.model, *_served_as(cmd, given, weights)]
    if not given & set(_VLLM_TP):
        argv += ["--tensor-parallel-size", str(len(cmd.gpus))]
    if not given & set(_VLLM_PP):
        argv += ["--pipeline-parallel-size", str(cmd.nnodes)]
    if cmd.nnodes > 1:
        argv += [
            "--nnodes", str(cmd.nnodes),
            "--node-rank", str(cmd.rank),
            "--master-addr", cmd.leader_addr,
            "--master-port", str(cmd.rendezvous_port),
        ]  # fmt: skip
    argv += ["--distributed-executor-backend", "mp"]
    if cmd.rank == 0:
        argv += ["--host", mgmt_addr, "--port", str(cmd.http_port)]
    else:
        argv += ["--headless"]
    argv += list(cmd.engine_args)
    return EngineCommand(argv=argv, env=_base_env(cmd, mgmt_addr, mgmt_interface), serves_http=cmd.rank == 0)


# --------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------

_SGLANG_TP = ("--tensor-parallel-size", "--tp-size", "--tp")
_SGLANG_RESERVED = ("--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr", "--host", "--port")


def _sglang(cmd: LaunchCommand, mgmt_addr: str, mgmt_interface: str, python: str, weights: Weights | None = None) -> EngineCommand:
    _check(cmd, need_gpus=True)
    given = _check_engine_args("sglang", cmd.engine_args, _SGLANG_RESERVED)
    argv = [python, "-m", "sglang.launch_server", "--model-path", weights.dir if weights else cmd.model, *_served_as(cmd, given, weights)]
    if not given & set(_SGLANG_TP):
        argv += ["--tensor-parallel-size", str(len(cmd.gpus) * cmd.nnodes)]
    if cmd.nnodes > 1:
        argv += [
            "--nnodes", str(cmd.nnodes),
            "--node-rank", str(cmd.rank),
            "--dist-init-addr", _hostport(cmd.leader_addr, cmd.rendezvous_port),
        ]  # fmt: skip
    # Ranks >= 1 open only a dummy health server on host:port; they are given
    # the member's (possibly 0 = ephemeral) port so two replicas' workers on
    # one node never both take SGLang's default 30000. Not registered as serving.
    argv += ["--host", mgmt_addr, "--port", str(cmd.http_port)]
    argv += list(cmd.engine_args)
    return EngineCommand(argv=argv, env=_base_env(cmd, mgmt_addr, mgmt_interface), serves_http=cmd.rank == 0)


# --------------------------------------------------------------------------
# llmgw's simulated engine
# --------------------------------------------------------------------------

_SIM_RESERVED = ("--model", "--nnodes", "--rank", "--leader-addr", "--rendezvous-port", "--host", "--port", "--weights", "--weights-cached")


def _sim(cmd: LaunchCommand, mgmt_addr: str, mgmt_interface: str, python: str, weights: Weights | None = None) -> EngineCommand:
    _check(cmd, need_gpus=False)
    _check_engine_args("sim", cmd.engine_args, _SIM_RESERVED)
    argv = [
        python, "-m", "llmgw.services", "engine", "sim",
        "--model", cmd.model,
        "--nnodes", str(cmd.nnodes),
        "--rank", str(cmd.rank),
        "--leader-addr", cmd.leader_addr,
        "--rendezvous-port", str(cmd.rendezvous_port),
        "--host", mgmt_addr,
        "--port", str(cmd.http_port),
    ]  # fmt: skip
    if weights is not None:
        # The sim's load time is --cached-load-time with --weights-cached, --load-time without.
        argv += ["--weights", weights.dir, *(["--weights-cached"] if weights.cached else [])]
    argv += cmd.engine_args
    return EngineCommand(argv=argv, env=_base_env(cmd, mgmt_addr, mgmt_interface), serves_http=cmd.rank == 0)


ENGINES = {"vllm": _vllm, "sglang": _sglang, "sim": _sim}


def build(cmd: LaunchCommand, *, mgmt_addr: str, mgmt_interface: str, python: str = sys.executable, weights: Weights | None = None) -> EngineCommand:
    """The argv and environment for member ``cmd.rank`` of replica ``cmd.replica_id`` on this node.

    ``python`` is the interpreter for Python-module engines (SGLang, sim); vLLM
    is started as its ``vllm`` console script from ``PATH``. Raises
    ``AdapterError`` for an unknown engine or a command that cannot be run.
    """
    adapter = ENGINES.get(cmd.engine)
    if adapter is None:
        raise AdapterError(f"unknown engine {cmd.engine!r}: this agent knows {', '.join(sorted(ENGINES))}")
    if not cmd.model:
        raise AdapterError(f"replica {cmd.replica_id}: no model given")
    if not mgmt_addr or not mgmt_interface:
        raise AdapterError("the node's mgmt_addr and mgmt_interface are required to launch an engine")
    return adapter(cmd, mgmt_addr, mgmt_interface, python, weights)


def served_model(cmd: LaunchCommand) -> str:
    """The model name the leader answers to, for the agent's canary request.

    Every engine here serves ``cmd.model`` unless the deployment's engine_args
    give ``--served-model-name`` (vLLM, SGLang and sim alike; vLLM accepts
    several names and answers to each, so the first is used).
    """
    args = list(cmd.engine_args)
    for i, arg in enumerate(args):
        flag = _norm_flag(arg)
        if flag != "--served-model-name":
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        else:
            continue
        if value.strip():
            return value
    return cmd.model


@dataclass(frozen=True)
class ProgressProbe:
    """The canary the agent sends a ready leader: ``body`` POSTed to ``path``."""

    path: str
    body: dict
    # What the answer must carry: "token" (a completion with text or completion_tokens
    # >= 1) or "embedding" (a non-empty data[0].embedding).
    expects: str


# vLLM flags that make it a pooling model, which answers /v1/embeddings and refuses
# /v1/completions ("--runner pooling", "--convert embed"; "--task embed" in older releases).
_VLLM_POOLING = {("--runner", "pooling"), ("--convert", "embed"), ("--task", "embed"), ("--task", "embedding")}


def _flag_values(args: list[str]) -> set[tuple[str, str]]:
    out = set()
    for i, arg in enumerate(args):
        flag = _norm_flag(arg)
        if flag is None:
            continue
        if "=" in arg:
            out.add((flag, arg.split("=", 1)[1]))
        elif i + 1 < len(args):
            out.add((flag, args[i + 1]))
    return out


def progress_probe(cmd: LaunchCommand, prompt: str) -> ProgressProbe:
    """The one-request canary for this member's leader: a one-token completion, or for
    a vLLM pooling (embedding) model, which has no completions route, one embedding.
    Either makes the engine run the model once, through every rank."""
    model = served_model(cmd)
    if cmd.engine == "vllm" and _flag_values(list(cmd.engine_args)) & _VLLM_POOLING:
        return ProgressProbe("/v1/embeddings", {"model": model, "input": prompt}, "embedding")
    return ProgressProbe("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1}, "token")
