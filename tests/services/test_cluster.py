"""A real cluster (router, workers, tokenizer as processes) driven through the SDK."""
import asyncio
import subprocess
import sys
import time

import openai
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.step_log import read_step_log
from common.sampling_params import SamplingParams
from services.client import AsyncClient, Client, InvalidRequest, RequestTimeout
from services.local_cluster import LOWEST_PORT, PORTS_PER_CLUSTER, REPO, ephemeral_ports, free_port_base


def test_sdk_generate_matches_the_engine(cluster, tiny_model_dir):
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, dtype="float32", kv_cache_gb=0.05, max_model_len=1024))
    [expected] = engine.generate(["The baton passes"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    with Client(cluster.sdk, timeout_s=60) as client:
        result = client.generate("The baton passes", max_tokens=20, temperature=0, ignore_eos=True)
        by_ids = client.generate(token_ids=expected.prompt_token_ids, max_tokens=20, temperature=0,
                                 ignore_eos=True)
    assert result.token_ids == expected.token_ids == by_ids.token_ids
    assert result.text == expected.text
    assert result.finish_reason == "length" and result.num_prompt_tokens == len(expected.prompt_token_ids)
    assert result.ttft_s > 0 and result.e2e_s >= result.ttft_s


def test_workers_log_the_steps_they_run(cluster, random_prompts):
    prompt = random_prompts([40], seed=77)[0]  # fresh: its whole prompt is one prefill chunk
    started = time.time()
    with Client(cluster.sdk, timeout_s=60) as client:
        client.generate(token_ids=prompt, max_tokens=3, temperature=0, ignore_eos=True)
    logs = sorted(cluster.step_log_dir.glob("worker-*.steps.jsonl"))
    assert {path.name for path in logs} <= {"worker-0.steps.jsonl", "worker-1.steps.jsonl"} and logs
    steps = [step for path in logs for step in read_step_log(path) if step["t"] >= started]
    assert [40, 0] in [chunk for step in steps for chunk in step["prefill"]]
    assert sum(step["decode_seqs"] for step in steps) >= 2  # the 2nd and 3rd tokens


def test_stream_chunks_add_up_to_the_result(cluster):
    with Client(cluster.sdk, timeout_s=60) as client:
        chunks = list(client.stream("Streaming works", max_tokens=16, temperature=0, ignore_eos=True))
        whole = client.generate("Streaming works", max_tokens=16, temperature=0, ignore_eos=True)
    # A chunk carries the tokens of the steps its worker held (the stream interval) together.
    assert 1 < len(chunks) <= 16 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text


def test_stop_string_is_cut_from_the_stream(cluster):
    with Client(cluster.sdk, timeout_s=60) as client:
        free = client.generate("The baton passes", max_tokens=30, temperature=0, ignore_eos=True)
        visible = [ch for ch in free.text if ch.isprintable() and ch != "\ufffd"]
        stop = free.text[free.text.index(visible[len(visible) // 2]):][:2]
        chunks = list(client.stream("The baton passes", max_tokens=30, temperature=0, stop=[stop]))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == free.text[:free.text.index(stop)]


def test_async_client_runs_concurrent_requests(cluster):
    async def run():
        async with AsyncClient(cluster.sdk, timeout_s=60) as client:
            return await asyncio.gather(*[client.generate(f"request {i}", max_tokens=8, temperature=0,
                                                          ignore_eos=True) for i in range(12)])

    results = asyncio.run(run())
    assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)


def test_invalid_parameters_are_typed_errors(cluster):
    with Client(cluster.sdk, timeout_s=30) as client:
        with pytest.raises(InvalidRequest, match="temperature"):
            client.generate("x", temperature=-1)
        with pytest.raises(InvalidRequest, match="context window"):
            client.generate(token_ids=[5] * 2000, max_tokens=2)
        assert client.generate("still fine", max_tokens=2).finish_reason is not None


def test_an_slo_class_must_be_configured_via_sdk_and_http(cluster):
    async def run_async(slo_class: str):
        async with AsyncClient(cluster.sdk, timeout_s=30) as client:
            return await client.generate("x", max_tokens=2, slo_class=slo_class)

    with Client(cluster.sdk, timeout_s=30) as client:
        with pytest.raises(InvalidRequest, match="unknown SLO class 'bulk'; configured: interactive"):
            client.generate("x", max_tokens=2, slo_class="bulk")
        assert client.generate("x", max_tokens=2, slo_class="interactive").finish_reason is not None
        assert list(client.stream("x", max_tokens=2, slo_class="interactive"))[-1].finished
    with pytest.raises(InvalidRequest, match="'bulk'"):
        asyncio.run(run_async("bulk"))
    assert asyncio.run(run_async("interactive")).finish_reason is not None

    api = openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="unknown SLO class 'bulk'; configured: interactive"):
        api.completions.create(model="baton-default", prompt="x", max_tokens=2,
                               extra_headers={"X-Baton-SLO-Class": "bulk"})
    with pytest.raises(openai.BadRequestError, match="'bulk'"):  # a stream's admission keeps its status
        api.chat.completions.create(model="baton-default", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, stream=True, extra_body={"slo_class": "bulk"})
    completion = api.completions.create(model="baton-default", prompt="x", max_tokens=2,
                                        extra_headers={"X-Baton-SLO-Class": "interactive"})
    assert completion.choices[0].finish_reason is not None
    chat = api.chat.completions.create(model="baton-default", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"slo_class": "interactive"})
    assert chat.choices[0].finish_reason is not None


def test_status_lists_healthy_workers_with_load_and_kv(cluster):
    done = subprocess.run([sys.executable, "-m", "services.cli", "status", "--port-base", str(cluster.port_base),
                           "--json"], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert done.returncode == 0, done.stderr
    import json

    status = json.loads(done.stdout)
    assert {w["worker_id"] for w in status["workers"]} == {"worker-0", "worker-1"}
    assert all(w["healthy"] and w["kv_blocks_total"] > 0 for w in status["workers"])
    assert status["requests_routed"] > 0 and status["kv_events_received"] > 0


def test_a_request_past_its_deadline_times_out_and_frees_its_kv(cluster):
    with Client(cluster.sdk, timeout_s=60) as client:
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.generate("too slow", max_tokens=900, ignore_eos=True, timeout_s=0.3)
        assert time.monotonic() - started < 1.2  # the server's deadline, not the client's backstop
    cluster.wait_for(lambda: sum(cluster.worker_health(i)["kv_blocks_used"] for i in range(cluster.workers)) == 0,
                     10, "KV blocks to be freed after the timeout")


def test_port_ranges_for_test_clusters_lie_below_the_ephemeral_ports():
    """An outgoing connection's source port (from the ephemeral range) could take a chosen
    port between the check and the bind; below the range nothing is handed out that way."""
    low, _ = ephemeral_ports()
    for _ in range(20):
        base = free_port_base()
        assert LOWEST_PORT <= base and base + PORTS_PER_CLUSTER <= low
