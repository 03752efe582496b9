"""scripts/bench_engine.py: its vLLM binding (by default the bench leaves vLLM-CPU's thread
binding to vLLM, like for like with vLLM run alone, and says which it used), and its
decode-only, prefill and machine-limit figures measured on the tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

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


def test_decode_only_prefill_and_the_machine_s_limit_on_the_tiny_model(tiny_model_dir, test_device):
    """A round of the bench's own measurements on a small workload: decode-only leaves
    out the prompts' prefill, FLOPs per token follow from the model's config, and the
    decode rate is a share of the limit the bench measured for this machine."""
    bench = load_script("bench_engine")
    engine = bench.build_engine(tiny_model_dir, 4096, test_device)
    hf_model = bench.load_hf(tiny_model_dir, test_device)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    seqs, new_tokens = 4, 8
    work = bench.make_workload(config["vocab_size"], seed=0, decode_seqs=seqs, decode_new_tokens=new_tokens,
                               prefill_seqs=1, prefill_prompt_len=64, prefix_len=64)
    run = bench.run_in_process(engine, hf_model, work, repeats=1)
    result = bench.summarize(run)

    for key in ("baton_decode_tok_s", "baton_decode_only_tok_s", "baton_prefill_tok_s", "hf_decode_only_tok_s",
                "ratio_vs_hf", "ratio_vs_hf_decode_only", "gemm_gflop_s", "decode_limit_tok_s",
                "decode_vs_limit", "decode_vs_limit_paired"):
        assert result[key] > 0, key
    assert 0 < result["decode_vs_limit"] <= 1
    # The first token of each sequence comes from its prefill step: decode-only has the rest.
    assert result["baton_decode_only_tokens"] == run["hf_decode_only_tokens"] == seqs * (new_tokens - 1)
    raw = run["raw"]
    assert raw["baton_decode_only_s"][0] < raw["baton_decode_s"][0]
    assert raw["hf_decode_only_s"][0] < raw["hf_decode_s"][0]
    assert result["mflop_per_token"] * 1e6 == pytest.approx(flops_per_token(config, context=32 + new_tokens / 2))


def flops_per_token(config: dict, context: float) -> float:
    """2 per weight of the q/k/v, o, gate, up, down projections and the LM head, plus
    attention's 4 per query-head dimension per context position, from config.json."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    weights = config["num_hidden_layers"] * per_layer + config["vocab_size"] * hidden
    return 2 * weights + 4 * config["num_hidden_layers"] * q_size * context


def test_a_process_trees_cpu_time_counts_its_children():
    """What the bench waits on after each vLLM round: a child's busy loop counts for its
    parent's tree, and a quiet tree's count stays put."""
    bench = load_script("bench_engine")
    busy = ("import sys, time\nend = time.process_time() + 0.6\n"
            "while time.process_time() < end: pass\nsys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
                               f"'-c', {busy!r}])"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while bench.process_tree_cpu_s(parent.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bench.process_tree_cpu_s(parent.pid) >= 0.6  # the child's loop, seen from the parent
        time.sleep(0.2)  # past the loop's last tick
        used = bench.process_tree_cpu_s(parent.pid)
        time.sleep(0.5)
        assert bench.process_tree_cpu_s(parent.pid) - used < 0.05  # the child now waits on its stdin
    finally:
        parent.kill()
        parent.wait()
