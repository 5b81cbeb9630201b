#!/usr/bin/env python3
"""The llmgw image's HEALTHCHECK (installed as /usr/local/bin/llmgw-healthcheck).

Healthy when both hold:

- the process is on the bus: the container has an ESTABLISHED TCP connection
  to a NATS server port (``LLMGW_HEALTHCHECK_NATS_PORT``, default 4222), read
  from the container's own /proc/net/tcp{,6}. Every llmgw service and agent
  keeps one while it is connected; ``LLMGW_HEALTHCHECK_BUS=off`` skips this
  (the NATS server itself, or one-shot containers);
- ``LLMGW_HEALTHCHECK_URL``, when set, answers 200 within two seconds
  (the gateway's and NATS's ``/healthz``, the services' ``/metrics``).

Standard library only; exit 0 healthy, 1 not, with the reason on stdout
(``docker inspect`` shows it under .State.Health.Log).
"""

from __future__ import annotations

import os
import sys
import urllib.request

ESTABLISHED = "01"


def on_bus(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == ESTABLISHED and int(fields[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def main() -> int:
    url = os.environ.get("LLMGW_HEALTHCHECK_URL", "")
    if os.environ.get("LLMGW_HEALTHCHECK_BUS", "on") != "off":
        port = int(os.environ.get("LLMGW_HEALTHCHECK_NATS_PORT", "4222"))
        if not on_bus(port):
            print(f"no established connection to a NATS server on port {port}")
            return 1
    if url:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status != 200:
                    print(f"{url}: HTTP {r.status}")
                    return 1
        except Exception as e:  # any failure is "unhealthy", with its reason
            print(f"{url}: {e}")
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
