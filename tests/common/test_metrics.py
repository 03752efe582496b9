"""Prometheus metrics: the text format parsed back, label checks, threads, the HTTP server."""
from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest

from common.metrics import CONTENT_TYPE, DEFAULT_LATENCY_BUCKETS, Registry
from common.metrics_server import MetricsServer, MetricsServerError

SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_labels(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    body, labels, position = text[1:-1], {}, 0
    while position < len(body):
        match = LABEL_RE.match(body, position)
        assert match, f"bad label syntax at {body[position:]!r}"
        labels[match.group(1)] = unescape(match.group(2))
        position = match.end()
    return labels


def parse(text: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, dict[str, str], float]]]:
    """({name: (help, type)}, [(sample name, labels, value)]); asserts every line is well-formed."""
    assert text.endswith("\n")
    meta: dict[str, list[str]] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            meta.setdefault(name, ["", ""])[0] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge", "histogram")
            meta.setdefault(name, ["", ""])[1] = kind
        else:
            match = SAMPLE_RE.match(line)
            assert match, f"bad sample line {line!r}"
            samples.append((match.group(1), parse_labels(match.group(2)), float(match.group(3))))
    return {name: (h, k) for name, (h, k) in meta.items()}, samples


def value_of(samples, name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and lab == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


# ---- rendering ---------------------------------------------------------------------


def test_render_round_trips_counters_gauges_and_escaped_labels():
    registry = Registry()
    requests = registry.counter("baton_requests_total", "Requests ended\nby outcome", labels=("outcome",))
    tokens = registry.counter("baton_tokens_total", "Tokens")
    running = registry.gauge("baton_running", "Running requests")
    requests.inc(outcome="ok")
    requests.inc(2, outcome='we"ird\\va\nlue')
    tokens.inc(0.5)
    running.set(7)
    running.dec(2)
    running.inc()

    meta, samples = parse(registry.render())
    assert meta["baton_requests_total"] == ("Requests ended\\nby outcome", "counter")
    assert meta["baton_running"][1] == "gauge"
    assert value_of(samples, "baton_requests_total", outcome="ok") == 1
    assert value_of(samples, "baton_requests_total", outcome='we"ird\\va\nlue') == 2
    assert value_of(samples, "baton_tokens_total") == 0.5
    assert value_of(samples, "baton_running") == 6


def test_unlabelled_metrics_render_zero_before_any_update_and_labelled_ones_nothing():
    registry = Registry()
    registry.counter("a_total", "A")
    registry.histogram("b_seconds", "B")
    registry.gauge("c", "C", labels=("kind",))
    text = registry.render()
    _, samples = parse(text)
    assert value_of(samples, "a_total") == 0
    assert value_of(samples, "b_seconds_count") == 0
    assert "# TYPE c gauge" in text and not [s for s in samples if s[0] == "c"]


def test_histogram_buckets_are_cumulative_and_end_with_inf_equal_to_count():
    registry = Registry()
    latency = registry.histogram("baton_ttft_seconds", "TTFT", buckets=(0.1, 1, 10), labels=("worker",))
    for value in [0.05, 0.1, 0.5, 3, 30]:
        latency.observe(value, worker="w0")

    meta, samples = parse(registry.render())
    assert meta["baton_ttft_seconds"][1] == "histogram"
    buckets = [(float(lab["le"]), v) for n, lab, v in samples
               if n == "baton_ttft_seconds_bucket" and lab["worker"] == "w0"]
    assert buckets == [(0.1, 2), (1, 3), (10, 4), (float("inf"), 5)]  # le is inclusive
    assert value_of(samples, "baton_ttft_seconds_count", worker="w0") == 5
    assert value_of(samples, "baton_ttft_seconds_sum", worker="w0") == pytest.approx(33.65)


def test_default_buckets_cover_llm_latencies():
    assert DEFAULT_LATENCY_BUCKETS[0] <= 0.005 and DEFAULT_LATENCY_BUCKETS[-1] >= 60
    assert list(DEFAULT_LATENCY_BUCKETS) == sorted(set(DEFAULT_LATENCY_BUCKETS))


def test_gauge_collect_callback_is_read_at_render_time():
    registry = Registry()
    depth = {"value": 1}
    registry.gauge("queue_depth", "Depth", collect=lambda: depth["value"])
    registry.gauge("broken", "Raises", collect=lambda: 1 / 0)
    depth["value"] = 4

    _, samples = parse(registry.render())  # the broken callback drops only its own samples
    assert value_of(samples, "queue_depth") == 4
    assert not [s for s in samples if s[0] == "broken"]
    with pytest.raises(ValueError, match="no labels"):
        registry.gauge("labelled_depth", "Depth", labels=("worker",), collect=lambda: 1)


# ---- errors ------------------------------------------------------------------------


def test_wrong_or_missing_labels_are_named():
    registry = Registry()
    counter = registry.counter("x_total", "X", labels=("route", "code"))
    with pytest.raises(ValueError, match=r"x_total: labels must be \['code', 'route'\], got \['route', 'status'\]"):
        counter.inc(route="/", status="200")
    with pytest.raises(ValueError, match=r"labels must be \['code', 'route'\], got \[\]"):
        counter.inc()
    with pytest.raises(ValueError, match=r"y: labels must be \[\], got \['extra'\]"):
        registry.gauge("y", "Y").set(1, extra="1")
    with pytest.raises(ValueError, match="non-negative"):
        counter.inc(-1, route="/", code="200")


@pytest.mark.parametrize("make", [
    lambda r: r.counter("9bad", "starts with a digit"),
    lambda r: r.gauge("bad-name", "dash"),
    lambda r: r.counter("ok_total", "bad label", labels=("bad-label",)),
    lambda r: r.counter("ok_total", "reserved label", labels=("__name",)),
    lambda r: r.histogram("ok_seconds", "le is the bucket label", labels=("le",)),
    lambda r: r.histogram("ok_seconds", "unsorted buckets", buckets=(1, 0.5)),
])
def test_invalid_names_labels_and_buckets_are_rejected(make):
    with pytest.raises(ValueError):
        make(Registry())


def test_duplicate_names_including_histogram_series_are_rejected():
    registry = Registry()
    registry.counter("dup_total", "first")
    with pytest.raises(ValueError, match="dup_total"):
        registry.gauge("dup_total", "second")
    registry.histogram("lat_seconds", "H")
    with pytest.raises(ValueError, match="lat_seconds_count"):
        registry.counter("lat_seconds_count", "clashes with the histogram's count")
    assert Registry().counter("dup_total", "another registry is independent")


def test_concurrent_increments_lose_nothing():
    registry = Registry()
    counter = registry.counter("hits_total", "Hits", labels=("t",))
    histogram = registry.histogram("obs_seconds", "Obs")
    threads_n, per_thread = 8, 2000

    def work(index: int) -> None:
        for _ in range(per_thread):
            counter.inc(t=str(index % 2))
            histogram.observe(0.01)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _, samples = parse(registry.render())
    assert value_of(samples, "hits_total", t="0") + value_of(samples, "hits_total", t="1") == threads_n * per_thread
    assert value_of(samples, "obs_seconds_count") == threads_n * per_thread


# ---- HTTP server -------------------------------------------------------------------


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


@pytest.fixture
def served():
    registry = Registry()
    registry.counter("served_total", "Served").inc(3)
    state = {"ok": True, "role": "test"}
    with MetricsServer("127.0.0.1", 0, registry, lambda: dict(state)) as server:
        yield f"http://127.0.0.1:{server.port}", state


def test_server_serves_metrics_health_and_404(served):
    base, state = served
    status, content_type, body = get(base + "/metrics")
    assert (status, content_type) == (200, CONTENT_TYPE)
    assert value_of(parse(body)[1], "served_total") == 3

    status, content_type, body = get(base + "/health")
    assert (status, content_type, json.loads(body)) == (200, "application/json", {"ok": True, "role": "test"})
    state["ok"] = False
    assert get(base + "/health")[0] == 503

    assert get(base + "/nope")[0] == 404


def test_failing_health_check_answers_503():
    with MetricsServer("127.0.0.1", 0, Registry(), lambda: {}["missing"]) as server:
        status, _, body = get(f"http://127.0.0.1:{server.port}/health")
    assert status == 503 and "KeyError" in json.loads(body)["error"]


def test_taken_port_raises_an_error_naming_the_address():
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = MetricsServer("127.0.0.1", port, Registry(), lambda: {"ok": True})
        with pytest.raises(MetricsServerError, match=f"127.0.0.1:{port}"):
            server.start()
        server.stop()  # never started: a no-op


def test_stop_releases_the_port():
    server = MetricsServer("127.0.0.1", 0, Registry())
    server.start()
    port = server.port
    server.stop()
    server.stop()
    with MetricsServer("127.0.0.1", port, Registry()) as again:
        assert get(f"http://127.0.0.1:{again.port}/health")[0] == 200
