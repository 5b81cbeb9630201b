"""Prove that a real Prometheus, pointed at the gateway's ``/sd/engines``, scrapes
every ready engine of an ``llmgw up`` cluster and drops a replica torn down.

    .venv/bin/python deploy/prometheus/prove-discovery.py

Needs the ``prometheus`` binary (Debian: ``apt-get install prometheus``). Starts
``llmgw up --detach`` in its own state directory (compressed timings), a
Prometheus with ``http_sd_configs`` on the gateway and 1 s refresh/scrape,
waits until its engine targets are the ready replicas and up, queries
``vllm:num_requests_running`` through Prometheus, scales the demo deployment
from 2 replicas to 1, waits until the torn-down replica's target is gone, and
stops everything. Prints what it saw at each step; exits non-zero on a failure.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

LLMGW = [sys.executable, "-m", "llmgw.services"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait(what: str, probe, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except Exception as e:  # not up yet
            last = f"{type(e).__name__}: {e}"
        else:
            if last:
                return last
        time.sleep(0.5)
    raise SystemExit(f"FAILED: {what} not reached within {timeout:g}s; last seen: {last}")


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def main() -> int:
    prom_bin = shutil.which("prometheus")
    if prom_bin is None:
        print("prometheus is not installed (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="llmgw-prom-sd-"))
    state = work / "llmgw"
    prom = None
    try:
        up = subprocess.run(
            [*LLMGW, "up", "--dir", str(state), "--detach", "--heartbeat-interval", "0.5s", "--node-lost-after", "3s", "--engine-load-time", "1s", "--gateway-port", str(free_port())],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        if up.returncode != 0:
            print(up.stdout, up.stderr, sep="\n", file=sys.stderr)
            return 1
        cluster = json.loads((state / "cluster.json").read_text())
        gw = cluster["gateway_url"]
        print(f"{stamp()} llmgw up: gateway {gw}")
        sd = get(f"{gw}/sd/engines")
        print(f"{stamp()} GET /sd/engines: {json.dumps(sd)}")

        port = free_port()
        conf = work / "prometheus.yml"
        conf.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: llmgw-engines\n"
            "    scrape_timeout: 1s\n"
            f"    http_sd_configs: [{{url: '{gw}/sd/engines', refresh_interval: 1s}}]\n"
        )
        log = open(work / "prometheus.log", "wb")
        prom = subprocess.Popen(
            [prom_bin, f"--config.file={conf}", f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        api = f"http://127.0.0.1:{port}/api/v1"
        print(f"{stamp()} prometheus on 127.0.0.1:{port}")

        def ready_replicas() -> dict[str, str]:
            reps = json.loads(
                subprocess.run(
                    [*LLMGW, "ctl", "replicas", "-o", "json", "--config", cluster["operator_config"]], capture_output=True, text=True, check=True
                ).stdout
            )
            return {r["id"]: r["endpoint"].split("://", 1)[1] for r in reps if r["state"] == "ready"}

        def targets() -> dict[str, tuple[str, str]]:
            active = get(f"{api}/targets?state=active")["data"]["activeTargets"]
            return {t["labels"]["replica"]: (t["labels"]["instance"], t["health"]) for t in active if t["labels"].get("job") == "llmgw-engines"}

        want = ready_replicas()
        print(f"{stamp()} ready replicas: {want}")
        got = wait("every ready engine a healthy target", lambda: (t := targets()) == {r: (a, "up") for r, a in want.items()} and t)
        print(f"{stamp()} Prometheus targets (replica: instance, health): {got}")

        def series():
            q = urllib.parse.quote("vllm:num_requests_running")
            res = get(f"{api}/query?query={q}")["data"]["result"]
            return (
                sorted((r["metric"]["replica"], r["metric"]["node"], r["metric"]["fabric"], r["metric"]["engine"]) for r in res)
                if len(res) == len(want)
                else None
            )

        print(f"{stamp()} vllm:num_requests_running scraped for (replica, node, fabric, engine): {wait('engine series in Prometheus', series)}")

        deps = json.loads(
            subprocess.run(
                [*LLMGW, "ctl", "deployments", "-o", "json", "--config", cluster["operator_config"]], capture_output=True, text=True, check=True
            ).stdout
        )
        demo = deps[0]
        demo["replicas"] = 1
        spec = {k: v for k, v in demo.items() if k not in ("applied_at", "last_generation", "failures", "last_failure", "retry_at")}
        (work / "demo.yaml").write_text(json.dumps(spec))
        subprocess.run(
            [*LLMGW, "ctl", "deploy", "apply", "-f", str(work / "demo.yaml"), "--config", cluster["operator_config"]], check=True, capture_output=True
        )
        print(f"{stamp()} scaled {demo['name']} to 1 replica")
        left = wait("one ready replica left", lambda: len(r := ready_replicas()) == 1 and r)
        gone = set(want) - set(left)
        got = wait("the torn-down replica's target dropped", lambda: (t := targets()) == {r: (a, "up") for r, a in left.items()} and t)
        print(f"{stamp()} torn down: {sorted(gone)}; Prometheus targets now: {got}")
        print("OK: Prometheus found every ready engine through /sd/engines and dropped the one torn down")
        return 0
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        subprocess.run([*LLMGW, "down", "--dir", str(state)], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
