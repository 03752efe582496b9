"""Picking the decode worker of a disaggregated request (services/router/pairing.py,
docs/router.md §6), on constructed pool states with caller-given times."""
import numpy as np

from common.cost_model import TINY_CPU
from common.hashing import chain_hashes, root_hash
from services.router.cluster import ClusterState
from services.router.pairing import computes_locally, pick_decode_worker

BLOCK = 16
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def pool_of(*worker_ids: str, kv_blocks: int = 1000) -> ClusterState:
    pool = ClusterState(BLOCK, TINY_CPU)
    for worker_id in worker_ids:
        pool.add_worker(worker_id, kv_blocks)
    return pool


def load_with(pool: ClusterState, worker_id: str, requests: int, now: float = 0.0) -> None:
    """Place `requests` running requests (64 output tokens each) on the worker."""
    for n in range(requests):
        request = pool.prepare(f"{worker_id}-load-{n}", ROOT, tokens(1000 + n, 4 * BLOCK), 64, now)
        pool.place(request, worker_id, now)


def test_an_empty_pool_or_an_excluded_one_has_no_pick():
    prompt = tokens(1, 8 * BLOCK)
    assert pick_decode_worker(pool_of().prepare("r", ROOT, prompt, 16, 0.0), pool_of(), 0.0) is None
    pool = pool_of("d0")
    assert pick_decode_worker(pool.prepare("r", ROOT, prompt, 16, 0.0), pool, 0.0, frozenset({"d0"})) is None


def test_the_least_loaded_decode_worker_is_picked():
    pool = pool_of("d0", "d1", "d2")
    load_with(pool, "d0", 3)
    load_with(pool, "d2", 1)
    request = pool.prepare("r", ROOT, tokens(2, 8 * BLOCK), 16, 0.0)
    assert pick_decode_worker(request, pool, 0.0) == "d1"
    assert pick_decode_worker(request, pool, 0.0, frozenset({"d1"})) == "d2"


def test_a_worker_holding_the_prompt_wins_over_an_equally_loaded_one():
    pool = pool_of("d0", "d1")
    prompt = tokens(3, 40 * BLOCK)
    pool.kv_stored("d1", chain_hashes(ROOT, prompt[:32 * BLOCK], BLOCK), 0.0)
    request = pool.prepare("r", ROOT, prompt, 16, 0.0)
    assert request.matched == {"d1": 32}
    assert pick_decode_worker(request, pool, 0.0) == "d1"


def test_holding_the_prompt_does_not_outweigh_a_much_larger_decode_load():
    """Seconds against seconds: the prefill a held prefix saves against the decode work
    queued on its holder."""
    pool = pool_of("d0", "d1")
    prompt = tokens(4, 2 * BLOCK + 3)
    pool.kv_stored("d1", chain_hashes(ROOT, prompt[:2 * BLOCK], BLOCK), 0.0)
    load_with(pool, "d1", 40)
    request = pool.prepare("r", ROOT, prompt, 16, 0.0)
    saved_s = TINY_CPU.prefill_s(request.cached_tokens("d1"))
    assert pool.loads(0.0)["d1"] > saved_s  # the premise
    assert pick_decode_worker(request, pool, 0.0) == "d0"


def test_workers_without_room_for_the_request_are_passed_over_while_one_has_it():
    pool = pool_of("d0", "d1", kv_blocks=20)
    load_with(pool, "d1", 1)  # d1 is busier but has room
    pool.report("d0", running=1, waiting=0, kv_blocks_used=19, kv_blocks_cached=0)  # d0 is nearly full
    request = pool.prepare("r", ROOT, tokens(5, 8 * BLOCK), 16, 0.0)
    assert pick_decode_worker(request, pool, 0.0) == "d1"
    pool.report("d1", running=1, waiting=0, kv_blocks_used=20, kv_blocks_cached=0)  # now neither has room
    assert pick_decode_worker(request, pool, 0.0) in ("d0", "d1")


def test_conditional_disaggregation_counts_only_the_missing_prefill():
    pool = pool_of("d0")
    prompt = tokens(6, 100 * BLOCK)
    request = pool.prepare("r", ROOT, prompt, 16, 0.0)
    assert not computes_locally(request, "d0", max_local_prefill_tokens=1000)
    pool.kv_stored("d0", chain_hashes(ROOT, prompt[:60 * BLOCK], BLOCK), 0.0)
    request = pool.prepare("r", ROOT, prompt, 16, 0.0)
    assert computes_locally(request, "d0", max_local_prefill_tokens=1000)  # 640 tokens missing
    assert not computes_locally(request, "d0", max_local_prefill_tokens=639)
    assert computes_locally(pool.prepare("s", ROOT, tokens(7, 10), 16, 0.0), "d0", 10)
