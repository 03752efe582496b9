"""A real disaggregated cluster (one prefill, one decode worker, every prompt's KV moved):
the split its workers measure reaches the SDK's result, the HTTP gateway's usage and `svc
bench`'s report."""
from __future__ import annotations

import json

import openai
import pytest
from click.testing import CliRunner

from services.cli import main
from services.client import Client

SPLIT = {"queue_s", "prefill_s", "decode_wait_s", "transfer_s"}


@pytest.fixture(scope="module")
def pd_cluster(make_cluster):
    running = make_cluster(workers=0, prefill=1, decode=1, extra=["--max-local-prefill-tokens", "0"])
    yield running
    running.stop()


def test_the_result_and_the_final_chunk_carry_the_whole_split(pd_cluster, random_prompts):
    first, second = random_prompts([120, 120], seed=7)  # fresh prompts: the decode worker holds none of it
    with Client(pd_cluster.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=first, max_tokens=4, temperature=0, ignore_eos=True)
        chunks = list(client.stream(token_ids=second, max_tokens=4, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
    assert set(result.timings) == SPLIT and all(value >= 0 for value in result.timings.values())
    assert sum(len(chunk.token_ids) for chunk in chunks) == 4
    assert all(chunk.timings == {} for chunk in chunks[:-1])
    assert set(chunks[-1].timings) == SPLIT and all(value >= 0 for value in chunks[-1].timings.values())


def test_the_http_usage_carries_the_split_streamed_and_not(pd_cluster, random_prompts):
    api = openai.OpenAI(base_url=pd_cluster.http + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt, = random_prompts([120], seed=11)
    chunks = list(api.completions.create(model="baton-default", prompt=prompt, max_tokens=4, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage.model_dump()
    assert usage["completion_tokens"] == 4
    assert set(usage["ttft_split"]) == SPLIT and all(value >= 0 for value in usage["ttft_split"].values())
    assert all(chunk.usage is None for chunk in chunks[:-1])
    chat = api.chat.completions.create(model="baton-default", max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "a fresh question " * 20}])
    split = chat.usage.model_dump()["ttft_split"]
    assert set(split) == SPLIT and split["prefill_s"] > 0


def test_svc_bench_reports_the_split_of_a_disaggregated_cluster(pd_cluster):
    """At this scale every request has two output tokens or more: none ends on its prefill worker."""
    outcome = CliRunner().invoke(main, ["bench", "--workload", "toolbench", "--scale", "0.1", "--vocab-size", "512",
                                        "--rate", "10", "--num-requests", "8", "--address", pd_cluster.sdk, "--json"])
    assert outcome.exit_code == 0, outcome.output
    [result] = json.loads(outcome.stdout.strip().splitlines()[-1]).values()
    split = result["ttft_split"]
    assert split["requests"] == split["completed"] == result["overall"]["completed"] == 8
    assert all(split[f"{key.removesuffix('_s')}_p50_s"] >= 0 for key in SPLIT)
    assert 0 <= split["transfer_share_of_first_decode_p50"] <= split["transfer_share_of_first_decode_p90"] <= 1
    assert "TTFT split" in outcome.stdout
