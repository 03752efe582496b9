"""A worker with the KV store (docs/architecture.md §8), real processes: a cluster of one
fp32 worker with a 12-block pool and a kvstore process on the cluster's ports. A prompt
the worker's own cache evicted is written back, then fetched: the same greedy tokens with
its full blocks not computed. A store that stops answering mid-fetch, then is killed,
makes the worker recompute, not hang."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.config import ClusterConfig
from common.hashing import chain_hashes
from common.sampling_params import SamplingParams
from common.sockets import Security
from services.client import Client
from services.local_cluster import REPO, child_env, start_cluster

pytest.importorskip("services.kvstore.service", reason="the kvstore role is not in this checkout")

POOL_GB = "0.00074"  # 12 blocks of 16 fp32 tokens of the tiny model (64 KiB each)
FLAGS = ["--dtype", "float32", "--kv-cache-gb", POOL_GB, "--max-model-len", "128", "--heartbeat-interval-s", "0.2",
         "--worker-timeout-s", "3", "--kvstore", "--kvstore-fetch", "always", "--kvstore-timeout-s", "1.0"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_TOKENS = 6


def get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


def metric(cluster, name: str, port_offset: int = 11, **labels: str) -> float:
    """A worker-0 metric's value (0 until it is first counted); another process's at
    `port_offset` (the router's is 3)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + port_offset}/metrics",
                                timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def stored_tiers(cluster, engine, prompt: list[int]) -> list[int]:
    """The store's tiers of the prompt's full blocks, asked by a client of our own."""
    from services.kvstore.client import StoreClient

    config = ClusterConfig(port_base=cluster.port_base, kvstore_timeout_s=5.0)
    context = zmq.Context()
    security = Security(context, config, "worker")
    client = StoreClient(config, security, "test", engine.kv_cache.layout)
    try:
        root = engine._root_hash("")
        return client.lookup(root, chain_hashes(root, prompt, 16))
    finally:
        client.close()
        security.stop()
        context.destroy(linger=0)


def the_router_knows_the_store(cluster) -> bool:
    """The router's index holds every block the store does (their events came): a request
    placed now is told which of its blocks the store holds (Generate.store_tiers), and its
    engine asks the store only for those."""
    blocks = get_json(f"http://127.0.0.1:{cluster.port_base + 6}/health").get("blocks", 0)
    return blocks > 0 and metric(cluster, "baton_router_store_blocks", port_offset=3) == blocks


@pytest.fixture
def store_cluster(tiny_model_dir):
    cluster = start_cluster(tiny_model_dir, workers=1, extra=FLAGS)
    argv = [sys.executable, "-m", "services.cli", "start", "kvstore", "--port-base", str(cluster.port_base),
            "--model", str(tiny_model_dir), "--dtype", "float32", "--kvstore-dram-gb", "0.01"]
    store = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                             env=child_env(), start_new_session=True)
    try:
        cluster.wait_for(lambda: get_json(f"http://127.0.0.1:{cluster.port_base + 6}/health").get("ok"), 60,
                         "the kvstore's health")
        yield cluster, store
    finally:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            if store.poll() is None:
                os.kill(store.pid, sig)
        try:
            store.wait(15)
        except subprocess.TimeoutExpired:
            store.kill()
            store.wait(5)
        cluster.stop()


def evict(client: Client, fillers: list[list[int]]) -> None:
    """Run prompts that need the whole pool, so every cached block is evicted."""
    for filler in fillers:
        client.generate(token_ids=filler, max_tokens=1, **GREEDY)


def test_an_evicted_prompt_is_fetched_back_and_a_dead_store_means_recompute(store_cluster, make_engine,
                                                                          random_prompts):
    cluster, store = store_cluster
    prompt, other, filler_a, filler_b = random_prompts([70, 70, 110, 110], seed=31)
    reference = make_engine(max_model_len=128)
    want = {tuple(p): reference.generate([p], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))[0].token_ids
            for p in (prompt, other)}
    with Client(cluster.sdk, timeout_s=60) as client:
        first = client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, **GREEDY)
        assert first.token_ids == want[tuple(prompt)] and first.num_cached_tokens == 0
        evict(client, [filler_a, filler_b])
        # The prompt's 4 full blocks were evicted and written back (the fillers' too).
        cluster.wait_for(lambda: metric(cluster, "baton_worker_kvstore_written_blocks_total") >= 4, 30,
                         "the write-back of the evicted blocks")
        cluster.wait_for(lambda: the_router_knows_the_store(cluster), 10, "the store's events at the router")
        # Every prompt before was new: the router's index said the store held none of its
        # blocks, and the worker did not ask the store.
        assert metric(cluster, "baton_worker_kv_source_choices_total", source="kvstore", choice="known_miss") >= 3
        assert metric(cluster, "baton_worker_kvstore_fetch_decisions_total", decision="miss") == 0
        again = client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, **GREEDY)
        assert again.token_ids == want[tuple(prompt)]
        assert again.num_cached_tokens == 64  # blocks 0-3 fetched; 6 prompt tokens computed
        cluster.wait_for(lambda: metric(cluster, "baton_worker_kvstore_fetched_blocks_total", tier="dram") == 4, 10,
                         "the fetched blocks counted")
        assert metric(cluster, "baton_worker_kvstore_fetch_decisions_total", decision="fetch") == 1

        assert stored_tiers(cluster, reference, prompt) == [0, 0, 0, 0]
        client.generate(token_ids=other, max_tokens=MAX_TOKENS, **GREEDY)
        evict(client, [filler_a[::-1], filler_b[::-1]])
        cluster.wait_for(lambda: stored_tiers(cluster, reference, other) == [0, 0, 0, 0], 30,
                         "the write-back of the second prompt")
        cluster.wait_for(lambda: the_router_knows_the_store(cluster), 10, "the store's events at the router")
        os.kill(store.pid, signal.SIGSTOP)  # the store stops answering: every call runs to its deadline
        stalled = client.generate(token_ids=other, max_tokens=MAX_TOKENS, **GREEDY)
        assert stalled.token_ids == want[tuple(other)] and stalled.num_cached_tokens == 0
        cluster.wait_for(lambda: metric(cluster, "baton_worker_kvstore_failures_total", op="fetch") >= 1, 10,
                         "the failed fetch counted")  # metrics follow the load report
        os.kill(store.pid, signal.SIGKILL)
        store.wait(10)
        evict(client, [filler_a, filler_b])
        gone = client.generate(token_ids=other, max_tokens=MAX_TOKENS, **GREEDY)  # the store is gone
        assert gone.token_ids == want[tuple(other)] and gone.num_cached_tokens == 0
    assert cluster.worker_health(0)["ok"]
