"""A real router process with `--kvstore` subscribes to the store's events publisher
(docs/router.md §7): a PUB socket bound here at config.kvstore_events_address stands in for
the store, and the router's metrics show what it applied and what it refused."""
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import zmq

from common.config import ClusterConfig
from common.protocol import StatusRequest, StoreEvents, encode
from services.local_cluster import REPO, child_env, free_port_base
from services.router.service import RouterService

KEYS = [11, 12, 13]  # block names; the router need not have seen their tokens


def metric(port: int, name: str, **labels: str) -> float:
    """The value of one sample on the router's /metrics (0 when it is not there yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode("utf-8")
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if wanted else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_until(condition, what: str, timeout_s: float = 20.0, step=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.05)


@pytest.fixture
def router_with_store():
    """A router on free ports with the store switched on, and a PUB socket bound where it
    expects the store's events; both stopped at the end."""
    base = free_port_base()
    config = ClusterConfig(port_base=base)
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(config.kvstore_events_address)
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "start", "router", "--port-base", str(base),
                                "--kvstore", "--policy", "e2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the router prints its ready line once it serves
        assert "router ready" in line, (line, process.stderr.read() if process.poll() is not None else "")
        yield process, publisher, config.router_metrics_port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        context.destroy(linger=0)


def test_the_router_applies_the_stores_events_and_counts_bad_ones(router_with_store):
    process, publisher, port = router_with_store
    stored = StoreEvents(store_id="store-1", stored=KEYS, stored_tiers=[0, 0, 1])
    # A subscription takes a moment to reach the publisher; what is sent before is dropped,
    # so the first message is sent again until it lands (storing a block twice is one block).
    wait_until(lambda: metric(port, "baton_router_store_blocks") == 3, "the stored blocks",
               step=lambda: publisher.send_multipart(encode(stored)))
    assert metric(port, "baton_router_store_events_total", kind="stored") >= 3

    publisher.send_multipart(encode(StoreEvents(store_id="store-1", moved=[13], moved_tiers=[0], evicted=[11])))
    publisher.send_multipart([b"\x17", b"not msgpack"])  # the StoreEvents type with a broken body
    publisher.send_multipart(encode(StatusRequest()))  # a message the store never sends
    publisher.send_multipart(encode(StoreEvents(store_id="store-1", stored=[14], stored_tiers=[7])))  # no such tier
    wait_until(lambda: metric(port, "baton_router_store_bad_messages_total") == 3, "the three bad messages")
    assert metric(port, "baton_router_store_blocks") == 2  # 11 evicted; the bad one stored nothing
    assert metric(port, "baton_router_store_events_total", kind="moved") == 1
    assert metric(port, "baton_router_store_events_total", kind="evicted") == 1

    publisher.send_multipart(encode(StoreEvents(store_id="store-1", evicted=[12, 13])))
    wait_until(lambda: metric(port, "baton_router_store_blocks") == 0, "the last evictions")
    assert process.poll() is None  # none of it stopped the router


@pytest.mark.parametrize("settings, priced", [
    ({}, None),
    ({"kvstore": True, "kvstore_fetch": "never"}, None),
    ({"kvstore": True}, "min"),
    ({"kvstore": True, "kvstore_fetch": "always"}, "always"),
])
def test_the_router_subscribes_and_prices_the_store_only_where_engines_fetch_from_it(settings, priced):
    service = RouterService(ClusterConfig(port_base=free_port_base(), **settings))
    try:
        assert (service.store_events is not None) == (priced is not None)
        for pool in (service.cluster, service.decode_pool):
            assert (pool.store is not None) == (priced is not None)
            assert pool.store is None or pool.store.always_fetch == (priced == "always")
    finally:
        service.close()
