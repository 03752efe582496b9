"""The OpenAI-compatible gateway of a real cluster, with the unmodified `openai` client."""
import http.client
import json
import urllib.request

import openai
import pytest

from services.client import Client


@pytest.fixture(scope="module")
def api(cluster):
    return openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completion_matches_the_sdk(cluster, api):
    with Client(cluster.sdk, timeout_s=60) as client:
        expected = client.generate("Open the gate", max_tokens=12, temperature=0, ignore_eos=True)
    completion = api.completions.create(model="baton-default", prompt="Open the gate", max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == 12
    streamed = api.completions.create(model="baton-default", prompt="Open the gate", max_tokens=12,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text


def test_chat_stream_and_non_stream_agree(api):
    messages = [{"role": "user", "content": "Say something"}]
    whole = api.chat.completions.create(model="baton-default", messages=messages, max_tokens=10, temperature=0)
    parts = api.chat.completions.create(model="baton-default", messages=messages, max_tokens=10, temperature=0,
                                        stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in parts if chunk.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content


def test_errors_in_openai_shape(api):
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="baton-default", prompt="x", temperature=-2)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model="baton-default", prompt=[5] * 5000, max_tokens=1)
    assert "context" in str(too_long.value)


def test_models_health_and_metrics(cluster, api):
    assert [m.id for m in api.models.list().data] == ["baton-default"]
    with urllib.request.urlopen(cluster.http + "/health", timeout=5) as response:
        assert json.loads(response.read())["ok"] is True
    with urllib.request.urlopen(cluster.http + "/metrics", timeout=5) as response:
        body = response.read().decode()
    for name in ("baton_ttft_seconds_bucket", "baton_tpot_seconds_bucket", "baton_e2e_seconds_count",
                 "baton_requests_total", "baton_tokenizer_requests_in_flight"):
        assert name in body
    host, port = cluster.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", "/metrics")
    assert conn.getresponse().getheader("Content-Type").startswith("text/plain")


def test_http_client_leaving_mid_stream_frees_kv(cluster):
    host, port = cluster.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": "baton-default", "prompt": "leave early", "max_tokens": 900, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()
    assert sum(cluster.worker_health(i)["kv_blocks_used"] for i in range(cluster.workers)) > 0
    conn.sock.close()
    conn.close()
    cluster.wait_for(lambda: sum(cluster.worker_health(i)["kv_blocks_used"] for i in range(cluster.workers)) == 0,
                     10, "KV blocks to be freed after the HTTP client left")


def test_worker_metrics_are_exposed(cluster):
    port = cluster.port_base + 11
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body = response.read().decode()
    for name in ("baton_worker_queue_seconds_bucket", "baton_worker_kv_blocks_used",
                 "baton_worker_kv_blocks_cached", "baton_worker_prefix_hit_tokens_total",
                 "baton_worker_running_requests", "baton_worker_waiting_requests"):
        assert name in body
