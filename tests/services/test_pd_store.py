"""One request's prompt KV from several sources, real processes: `svc up --prefill 1
--decode 1` with the KV store, float32, small pools. A prompt both workers' caches
evicted was written back to the store; a longer prompt sharing its first blocks is then
prefilled with those blocks fetched from the store, and reaches the decode worker with
the same blocks fetched from the store and only the rest pulled from the prefill
worker's lease (services/worker/kv_loads.py), token for token as the in-process engine
gives them; with the prompt's first blocks in the decode worker's own cache, one request
takes blocks from all three. Engines: prefill-0 is engine 0, decode-1 engine 1."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.sampling_params import SamplingParams
from services.client import Client
from services.local_cluster import start_cluster
from tests.services.worker.test_worker_store import stored_tiers, the_router_knows_the_store

pytest.importorskip("services.kvstore.service", reason="the kvstore role is not in this checkout")

PREFILL, DECODE = 0, 1
POOL_GB = "0.00074"  # 12 blocks of 16 fp32 tokens of the tiny model (64 KiB each)
FLAGS = ["--dtype", "float32", "--kv-cache-gb", POOL_GB, "--max-model-len", "128", "--heartbeat-interval-s", "0.2",
         "--worker-timeout-s", "3", "--profile", "tiny-cpu", "--max-local-prefill-tokens", "0",
         "--kv-transport", "zmq", "--kvstore-fetch", "always", "--kvstore-timeout-s", "2.0"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_TOKENS = 6
BLOCK_BYTES = 64 << 10


def metric(cluster, index: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(cluster.worker_metrics_url(index), timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
def pd_store(tiny_model_dir):
    cluster = start_cluster(tiny_model_dir, workers=0, prefill=1, decode=1, extra=FLAGS, kvstore=True)
    yield cluster
    cluster.stop()


@pytest.fixture
def pd_store_parts(tiny_model_dir):
    """Prefill chunks of 32 tokens and a part at each: the prompt's blocks from the lease
    may come in a part before its whole lease (docs/disaggregation.md §2.1)."""
    cluster = start_cluster(tiny_model_dir, workers=0, prefill=1, decode=1, kvstore=True,
                            extra=[*FLAGS, "--max-num-batched-tokens", "32", "--kv-part-blocks", "1"])
    yield cluster
    cluster.stop()


def test_a_decode_worker_takes_blocks_from_the_store_and_the_rest_from_the_lease(pd_store, make_engine,
                                                                                random_prompts):
    cluster = pd_store
    shared, tail, filler_a, filler_b = random_prompts([64, 40, 110, 110], seed=61)
    first_prompt, second_prompt = shared + tail[:6], shared + tail  # 4 shared full blocks; 70 and 104 tokens
    reference = make_engine(max_model_len=128)
    want = {len(p): reference.generate([p], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))[0].token_ids
            for p in (first_prompt, second_prompt)}
    with Client(cluster.sdk, timeout_s=60) as client:
        first = client.generate(token_ids=first_prompt, max_tokens=MAX_TOKENS, **GREEDY)
        assert first.token_ids == want[70]
        for filler in (filler_a, filler_b):  # decoded there too: both workers' pools turn over
            client.generate(token_ids=filler, max_tokens=2, **GREEDY)
        cluster.wait_for(lambda: stored_tiers(cluster, reference, shared) == [0, 0, 0, 0], 30,
                         "the write-back of the shared blocks")  # by whichever worker evicted them first
        cluster.wait_for(lambda: the_router_knows_the_store(cluster), 10, "the store's events at the router")
        pulled_before = metric(cluster, DECODE, "baton_kv_transfer_bytes_total")
        fetched_before = [metric(cluster, i, "baton_worker_kvstore_fetched_blocks_total") for i in (PREFILL, DECODE)]

        second = client.generate(token_ids=second_prompt, max_tokens=MAX_TOKENS, **GREEDY)
        assert second.token_ids == want[104]
        # Both workers fetched blocks 0-3 from the store; the lease gave blocks 4-6 (the last partial).
        cluster.wait_for(lambda: [metric(cluster, i, "baton_worker_kvstore_fetched_blocks_total") - before
                                  for i, before in zip((PREFILL, DECODE), fetched_before)] == [4, 4], 10,
                         "both workers' fetches counted")
        pulled = metric(cluster, DECODE, "baton_kv_transfer_bytes_total") - pulled_before
        assert pulled == 3 * BLOCK_BYTES
    for index in (PREFILL, DECODE):
        assert cluster.worker_health(index)["ok"]


def test_one_request_takes_blocks_from_the_cache_the_store_and_the_lease(pd_store, make_engine, random_prompts):
    takes_blocks_from_every_source(pd_store, make_engine, random_prompts)


def test_one_request_takes_blocks_from_the_cache_the_store_and_the_lease_in_parts(pd_store_parts, make_engine,
                                                                                  random_prompts):
    """As above, prompts prefilled in chunks of 2 blocks and handed off in parts: the
    decode worker gets each request at its first part, and the lease's blocks come from
    parts and the whole lease together (which, depends on how the pulls and the prefill
    interleave), still each once and token for token."""
    takes_blocks_from_every_source(pd_store_parts, make_engine, random_prompts)
    pd_store_parts.wait_for(lambda: metric(pd_store_parts, PREFILL, "baton_kv_part_exposures_total") > 0, 10,
                            "the prefill worker's parts to end")


def takes_blocks_from_every_source(cluster, make_engine, random_prompts) -> None:
    shared, tail, head_tail, filler_a, filler_b = random_prompts([64, 40, 5, 110, 110], seed=62)
    first_prompt, head_prompt, second_prompt = shared + tail[:6], shared[:32] + head_tail, shared + tail
    reference = make_engine(max_model_len=128)
    want = {len(p): reference.generate([p], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))[0].token_ids
            for p in (first_prompt, head_prompt, second_prompt)}

    def fetched() -> list[float]:
        return [metric(cluster, i, "baton_worker_kvstore_fetched_blocks_total") for i in (PREFILL, DECODE)]

    with Client(cluster.sdk, timeout_s=60) as client:
        assert client.generate(token_ids=first_prompt, max_tokens=MAX_TOKENS, **GREEDY).token_ids == want[70]
        for filler in (filler_a, filler_b):
            client.generate(token_ids=filler, max_tokens=2, **GREEDY)
        cluster.wait_for(lambda: stored_tiers(cluster, reference, shared) == [0, 0, 0, 0], 30,
                         "the write-back of the shared blocks")
        cluster.wait_for(lambda: the_router_knows_the_store(cluster), 10, "the store's events at the router")
        # Blocks 0-1 come back into both workers' caches (from the store), and stay there.
        assert client.generate(token_ids=head_prompt, max_tokens=MAX_TOKENS, **GREEDY).token_ids == want[37]
        cluster.wait_for(lambda: fetched() == [2, 2], 10, "both workers' fetches of blocks 0-1 counted")
        reused_before = metric(cluster, DECODE, "baton_kv_import_blocks_reused_total")
        pulled_before = metric(cluster, DECODE, "baton_kv_transfer_bytes_total")

        second = client.generate(token_ids=second_prompt, max_tokens=MAX_TOKENS, **GREEDY)
        assert second.token_ids == want[104]
        # Decode: blocks 0-1 its own, 2-3 from the store, 4-6 from the lease. Prefill: 0-1
        # its own, 2-3 from the store, 4-6 computed.
        cluster.wait_for(lambda: fetched() == [4, 4], 10, "both workers' fetches of blocks 2-3 counted")
        assert metric(cluster, DECODE, "baton_kv_import_blocks_reused_total") - reused_before == 2
        assert metric(cluster, DECODE, "baton_kv_transfer_bytes_total") - pulled_before == 3 * BLOCK_BYTES
    for index in (PREFILL, DECODE):
        assert cluster.worker_health(index)["ok"]
