#!/usr/bin/env bash
# Set up (first run) and run Baton's main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv engine
"$VENV/bin/svc" generate --prompt "${1:-Baton passes the prompt along:}" --max-tokens 32 "${@:2}"
