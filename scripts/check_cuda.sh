#!/usr/bin/env bash
# The GPU checks CI cannot run (it has no GPU). Run on a machine with an NVIDIA GPU and a
# CUDA build of torch, from the repository root:
#
#   scripts/check_cuda.sh [OUT_DIR]          (PYTHON=... picks the interpreter; default python3)
#
# The interpreter needs the project's dependencies (pip install -e '.[engine,test,ucx]', or
# the wheels on PYTHONPATH; ucx for the pd and kv-transfer stages). Each stage writes
# OUT_DIR/<stage>.log; the script goes on past a failed stage and exits 1 if any failed.
# DEVICE=cpu runs the same stages on the CPU (a dry run of this script on a machine
# without a GPU); REPEATS sets the benchmarks' rounds (5); STAGES="cluster profile" runs
# only the stages named (a rerun of the failed ones). Stages:
#   facts        torch, CUDA, the GPU, whether flash-attn is importable, the auto backend
#   engine-tests the engine, kernel and profiler tests again with every engine on the GPU
#                (BATON_TEST_DEVICE): HF parity, batching, chunking, prefix hits,
#                preemption, sampling, block integrity
#   new-shapes   scripts/check_new_shapes.py: a decode step at a context length not met
#                before costs what one at a met length does (no per-shape kernel plans)
#   generate     `svc generate` fp32 on the CPU and on the GPU give the same greedy ids
#   cluster      `svc up --workers 2 --device cuda` serves greedy requests through the SDK
#                with the token ids the in-process engine gives on the GPU
#   pd           `svc up --workers 0 --prefill 1 --decode 1 --device cuda` (both engines on
#                the GPU: one, or two where torch sees two), every prompt prefilled remotely
#                (--max-local-prefill-tokens 0) and its KV moved GPU to GPU over UCX
#                (--kv-transport ucx; a failed pull fails the request): the SDK's greedy ids
#                equal the in-process engine's, and the decode worker's metrics show the pulls
#   kv-transfer  the KV transfer tests with GPU pools on both sides (UCX in GPU memory,
#                ZeroMQ staged through host memory), then scripts/bench_transfer.py --device
#   bench-tiny, bench-small   scripts/bench_engine.py --device (Baton vs HF on the GPU)
#   profile      `svc profile --quick` on the small model, on the GPU
set -u
out=${1:-${OUT:-/tmp/baton-cuda-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
repeats=${REPEATS:-5}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BATON_CACHE_DIR=${BATON_CACHE_DIR:-/tmp/baton-cuda-check-cache}  # models, outside OUT_DIR
failed=()
known="facts engine-tests new-shapes generate cluster pd kv-transfer bench-tiny bench-small profile"
for name in ${STAGES:-}; do
    case " $known " in *" $name "*) ;; *) echo "STAGES: no stage named $name (stages: $known)" >&2; exit 2 ;; esac
done

stage() {  # stage NAME SECONDS COMMAND...: run it, log to $out/NAME.log, show its tail
    local name=$1 limit=$2 started=$SECONDS rc=0
    shift 2
    case " ${STAGES:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    tail -n 15 "$out/$name.log"
    if [ "$rc" -ne 0 ]; then
        failed+=("$name")
        echo "== $name FAILED (exit $rc) after $((SECONDS - started)) s"
    else
        echo "== $name ok in $((SECONDS - started)) s"
    fi
}

facts() {
    "$py" - "$device" <<'PY'
import importlib.util, sys, torch
device = torch.device(sys.argv[1])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if device.type == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("gpu", torch.cuda.get_device_name(device), "capability", torch.cuda.get_device_capability(device))
print("flash_attn importable", importlib.util.find_spec("flash_attn") is not None)
from kernels.attention import select_backend
print(f"auto backend on {device}:", select_backend("auto", device, 128, torch.bfloat16).name)
PY
}

compare_generate() {
    local prompt="Baton serves long shared prompts." cpu other
    cpu=$("$py" -m services.cli generate --prompt "$prompt" --max-tokens 64 --ignore-eos \
        --dtype float32 --device cpu --json | tail -n 1) || return 1
    other=$("$py" -m services.cli generate --prompt "$prompt" --max-tokens 64 --ignore-eos \
        --dtype float32 --device "$device" --json | tail -n 1) || return 1
    "$py" - "$cpu" "$other" <<'PY'
import json, sys
cpu, other = (json.loads(line)["token_ids"] for line in sys.argv[1:3])
print("cpu   ", cpu[:16], "...", len(cpu), "tokens")
print("device", other[:16], "...", len(other), "tokens")
assert len(cpu) == 64 and cpu == other, "the CPU's and the device's greedy token ids differ"
print("identical")
PY
}

cluster() {
    "$py" - "$device" <<'PY'
import sys
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import Engine
from common.sampling_params import SamplingParams
from services.client import Client
from services.local_cluster import start_cluster

device, model = sys.argv[1], default_model_dir()
prompts = ["Baton passes the prompt along:", "Two workers, one GPU each where there are two."]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# One prompt at a time, as the client below sends them: a GPU's bf16 matmuls may round a
# row differently in a batch of two than alone (cuBLAS picks kernels by shape).
engine = Engine(EngineConfig(model_dir=model, device=device))
expected = [engine.generate([prompt], params)[0].token_ids for prompt in prompts]
del engine
cluster = start_cluster(model, workers=2, extra=["--device", device])
try:
    with Client(cluster.sdk, timeout_s=120) as client:
        served = [client.generate(p, max_tokens=32, temperature=0, ignore_eos=True).token_ids for p in prompts]
finally:
    cluster.stop()
print("served", [len(ids) for ids in served], "tokens; same as the engine:", served == expected)
assert served == expected, "the cluster's token ids differ from the in-process engine's"
PY
}

pd() {
    "$py" - "$device" <<'PY'
import sys
import urllib.request

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import Engine
from common.sampling_params import SamplingParams
from services.client import Client
from services.local_cluster import start_cluster

device, model = sys.argv[1], default_model_dir()
prompts = ["Baton hands the prompt's KV from prefill to decode:", "One GPU, two engines, the blocks move by UCX."]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
engine = Engine(EngineConfig(model_dir=model, device=device))  # one prompt at a time, as in `cluster`
expected = [engine.generate([prompt], params)[0].token_ids for prompt in prompts]
del engine
# Engines are numbered workers first: the prefill worker is engine 0, the decode worker 1.
cluster = start_cluster(model, workers=0, prefill=1, decode=1,
                        extra=["--device", device, "--max-local-prefill-tokens", "0", "--kv-transport", "ucx",
                               "--kv-load-failure-policy", "fail"])
try:
    with Client(cluster.sdk, timeout_s=120) as client:
        served = [client.generate(p, max_tokens=32, temperature=0, ignore_eos=True).token_ids for p in prompts]
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + 11 + 2 * 1}/metrics", timeout=5) as answer:
        metrics = answer.read().decode()
finally:
    cluster.stop()


def total(name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


pulled, failed = total("baton_kv_transfer_bytes_total"), total("baton_kv_transfer_failures_total")
print("decode worker pulled", int(pulled), "KV bytes;", int(failed), "pulls failed")
print("served", [len(ids) for ids in served], "tokens; same as the engine:", served == expected)
assert pulled > 0 and failed == 0, "the decode worker did not get the prompts' KV from the prefill worker"
assert served == expected, "the P/D cluster's token ids differ from the in-process engine's"
PY
}

kv_transfer() {  # the transfer tests' cases on this device (-k cpu or -k cuda), then the benchmark
    BATON_TEST_DEVICE="$device" "$py" -m pytest -q -p no:cacheprovider tests/common/test_kv_transfer.py \
        -k "${device%%:*}" || return 1
    "$py" scripts/bench_transfer.py --device "$device" --repeats "$repeats" --json
}

small_model() {
    "$py" -c 'from common.engine.default_model import default_model_dir; print(default_model_dir(size="small"))'
}

export -f facts compare_generate cluster pd kv_transfer
export out py device repeats
stage facts 60 bash -c facts
stage engine-tests 300 env BATON_TEST_DEVICE="$device" "$py" -m pytest -q -p no:cacheprovider \
    tests/common/engine tests/kernels tests/services/eval/test_profiler.py
stage new-shapes 120 "$py" scripts/check_new_shapes.py --device "$device"
stage generate 180 bash -c compare_generate
stage cluster 240 bash -c cluster
stage pd 300 bash -c pd
stage kv-transfer 420 bash -c kv_transfer
stage bench-tiny 300 "$py" scripts/bench_engine.py --device "$device" --repeats "$repeats" --json
stage bench-small 300 "$py" scripts/bench_engine.py --device "$device" --size small --repeats "$repeats" --json
stage profile 300 "$py" -m services.cli profile --device "$device" --quick --model "$(small_model)" \
    --out "$out/profile-small-$device.json"

if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
