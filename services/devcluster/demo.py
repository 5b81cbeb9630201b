"""The demo deployment ``llmgw up`` applies and the scenarios serve requests to.

Its own module so that ``up`` (which runs the scenarios) and ``scenario``
(which needs the model name) both read it without importing each other.
"""

from __future__ import annotations

DEMO_MODEL = "sim-70b"
