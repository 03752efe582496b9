#!/usr/bin/env bash
# Set up (first run), lint and type-check, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export BATON_CACHE_DIR="${BATON_CACHE_DIR:-$PWD/.cache}"  # before ensure_venv: the router's build goes there
source scripts/_venv.sh
ensure_venv engine,test,ucx  # ucx: the KV transfer tests run over UCX too
# Settings in pyproject.toml ([tool.ruff], [tool.mypy]); any error fails the run. Both
# keep their caches under .cache/, so a second run re-checks only what changed.
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m mypy
"$VENV/bin/python" -m pytest -q "$@"
