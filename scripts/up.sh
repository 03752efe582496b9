#!/usr/bin/env bash
# Set up (first run) and start a single-node Baton cluster on the embedded default model:
# router, one worker, tokenizer (SDK on tcp://127.0.0.1:7101, HTTP on :8000), then send it
# one demo request. The cluster runs until Ctrl-C. `scripts/up.sh --demo-only` stops it
# after the demo; other arguments go to `svc up` (e.g. --workers 2 --http-port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv engine

demo_only=0
args=()
for arg in "$@"; do
    if [ "$arg" = "--demo-only" ]; then demo_only=1; else args+=("$arg"); fi
done

log=$(mktemp)
"$VENV/bin/svc" up "${args[@]}" > >(tee "$log") 2>&1 &
cluster=$!
trap 'kill -INT $cluster 2>/dev/null; wait $cluster 2>/dev/null; rm -f "$log"' EXIT

for _ in $(seq 600); do
    grep -q "^baton cluster up" "$log" && break
    kill -0 $cluster 2>/dev/null || { echo "svc up failed" >&2; exit 1; }
    sleep 0.5
done
grep -q "^baton cluster up" "$log" || { echo "the cluster did not come up in 5 minutes" >&2; exit 1; }
sdk=$(awk '/^  SDK/ {print $2}' "$log")

"$VENV/bin/python" - "$sdk" <<'PY'
import sys
from services.client import Client

with Client(sys.argv[1], timeout_s=60) as client:
    result = client.generate("Baton passes the prompt along:", max_tokens=32, temperature=0)
print(f"demo request: {len(result.token_ids)} tokens, ttft {result.ttft_s * 1000:.1f} ms, "
      f"{result.e2e_s * 1000:.1f} ms in all; text: {result.text!r}")
PY

if [ "$demo_only" = 1 ]; then exit 0; fi
echo "cluster running; Ctrl-C stops it"
wait $cluster
