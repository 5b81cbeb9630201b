#!/usr/bin/env bash
# Type-check services/, shared/ and tui/ under their installed import names.
#
# setup.py maps the three top folders beneath the namespace package `llmgw`, and the
# editable install reaches them through an import hook that mypy does not run. Checked as
# plain folders, every `from llmgw.… import` would be a missing import read as Any, so
# this builds build/typecheck/llmgw/ out of symlinks to the folders and checks the
# packages by their real names. mypy keeps the symlinked paths (no "found twice"); the
# output is rewritten to the repository's own paths so editors and greps can follow it.
#
# Usage: scripts/typecheck.sh [extra mypy arguments]; PYTHON picks the interpreter
# (default .venv/bin/python). Settings are in pyproject.toml [tool.mypy].
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
tree=build/typecheck
mkdir -p "$tree/llmgw"
for top in services shared tui; do
  ln -sfn "$PWD/$top" "$tree/llmgw/$top"
done
MYPYPATH=$tree "$python" -m mypy --cache-dir build/mypy-cache \
  -p llmgw.services -p llmgw.shared -p llmgw.tui "$@" 2>&1 | sed "s#^$tree/llmgw/##"
