"""A worker exports its measured decode rate (EngineStats.decode_*) as two counters, which
scripts/bench_serving.py reads for the served side of decode_rate_ratio_vs_inprocess."""
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from services.client import Client

COUNTERS = ("baton_worker_decode_tokens_total", "baton_worker_decode_seconds_total")


def decode_counters(url: str) -> tuple[float, ...]:
    with urllib.request.urlopen(url, timeout=5) as response:
        samples = {sample.name: sample.value
                   for family in text_string_to_metric_families(response.read().decode())
                   for sample in family.samples}
    return tuple(samples[name] for name in COUNTERS)


def settled(url: str, timeout_s: float = 10.0) -> tuple[float, ...]:
    """The counters once two reads a few heartbeats apart agree (each report refreshes them)."""
    deadline = time.monotonic() + timeout_s
    last = decode_counters(url)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = decode_counters(url)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the decode counters kept moving for {timeout_s} s")


def test_a_request_alone_counts_its_decode_steps_but_the_last(make_cluster):
    cluster = make_cluster()
    url = cluster.worker_metrics_url(0)
    tokens_before, seconds_before = settled(url)
    with Client(cluster.sdk, timeout_s=120) as client:
        started = time.perf_counter()
        result = client.generate("The baton passes", max_tokens=16, temperature=0, ignore_eos=True)
        wall = time.perf_counter() - started
    assert len(result.token_ids) == 16
    tokens, seconds = settled(url)
    # The prefill made token 1; steps 2-15 decoded with work after them; step 16 ended it.
    assert tokens - tokens_before == 14
    assert 0 < seconds - seconds_before < wall
