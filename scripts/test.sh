#!/usr/bin/env bash
# Set up (first run) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv engine,test
export BATON_CACHE_DIR="${BATON_CACHE_DIR:-$PWD/.cache}"
"$VENV/bin/python" -m pytest -q "$@"
