"""The router's cluster state: matching, the prefill queue model, windowed loads and
eviction cost (docs/router.md §3, docs/evaluation.md §1), on constructed states with caller-given times."""
import numpy as np
import pytest

from common.cost_model import TINY_CPU, LatencyFit
from common.hashing import chain_hashes, root_hash
from common.profiles import analytic_profile
from services.router.cluster import (
    CENSORED_REFRESH_S,
    RECENT_OUTPUTS,
    ClusterState,
    EvictionSample,
    Fit,
    kaplan_meier_median,
)
from services.router.policies import make_policy

BLOCK = 16
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def cluster_of(*worker_ids: str, kv_blocks: int = 1000, window_s: float = 180.0,
               index_ttl_s: float | None = None) -> ClusterState:
    cluster = ClusterState(BLOCK, TINY_CPU, window_s, index_ttl_s)
    for worker_id in worker_ids:
        cluster.add_worker(worker_id, kv_blocks)
    return cluster


def cache(cluster: ClusterState, worker_id: str, prompt: np.ndarray, now: float = 0.0) -> list[int]:
    hashes = chain_hashes(ROOT, prompt, BLOCK)
    cluster.kv_stored(worker_id, hashes, now)
    return hashes


# ---- the compiled fit -------------------------------------------------------------------


@pytest.mark.parametrize("fit", [TINY_CPU.prefill, TINY_CPU.decode, LatencyFit(2, 3, 0, 1, 0),
                                 analytic_profile("h100/llama-3-70b").prefill])
def test_fit_prices_exactly_as_the_cost_model(fit: LatencyFit):
    """The router prices fits through Fit: every double must be the cost model's, or the
    simulator's results and the bench's digests would drift (integer terms included)."""
    compiled = Fit(fit)
    for n, ctx in [(1, 0), (7, 3.5), (8192, 0), (4096, 12288), (63, 1234.75), (1, 1e6)]:
        assert compiled.at(n, ctx) == fit(n, ctx)


# ---- prepare ----------------------------------------------------------------------------


def test_prepare_reports_matched_blocks_and_the_deepest_held_prefix():
    cluster = cluster_of("a", "b", "c")
    prompt = tokens(1, 10 * BLOCK + 5)
    hashes = cache(cluster, "a", prompt[:6 * BLOCK])
    cache(cluster, "b", prompt[:2 * BLOCK])
    request = cluster.prepare("r", ROOT, prompt, 32, 0.0)
    assert request.num_tokens == len(prompt)
    assert request.matched == {"a": 6, "b": 2}
    assert request.best_blocks == 6
    assert request.best_cached_tokens == 6 * BLOCK
    assert request.cached_tokens("a") == 6 * BLOCK
    assert request.cached_tokens("b") == 2 * BLOCK
    assert request.cached_tokens("c") == 0
    assert request.prefix_key == hashes[5]
    assert [node.block_hash for node in request.path] == hashes
    assert request.blocks_needed("a") == 11 - 6
    assert request.blocks_needed("c") == 11


def test_cached_tokens_leave_the_last_prompt_token_to_compute():
    cluster = cluster_of("a")
    prompt = tokens(1, 4 * BLOCK)  # whole blocks, all held
    cache(cluster, "a", prompt)
    request = cluster.prepare("r", ROOT, prompt, 32, 0.0)
    assert request.matched == {"a": 4}
    assert request.best_cached_tokens == 4 * BLOCK - 1
    assert request.cached_tokens("a") == 4 * BLOCK - 1
    assert cluster.prefill_s(request, "a") == pytest.approx(TINY_CPU.prefill_s(1, 4 * BLOCK - 1))


def test_prepare_without_a_match_has_no_prefix_key():
    cluster = cluster_of("a")
    cache(cluster, "a", tokens(1, 4 * BLOCK))
    request = cluster.prepare("r", ROOT, tokens(2, 4 * BLOCK), 32, 0.0)
    assert request.matched == {}
    assert request.path == []
    assert request.best_blocks == 0
    assert request.best_cached_tokens == 0
    assert request.prefix_key is None


def test_another_tenants_root_matches_nothing():
    cluster = cluster_of("a")
    prompt = tokens(1, 4 * BLOCK)
    cache(cluster, "a", prompt)
    salted = root_hash("model", "tokenizer", "", "bfloat16", BLOCK, tenant_salt="t")
    assert cluster.prepare("r", salted, prompt, 32, 0.0).matched == {}


# ---- place: the prefill queue and windowed loads ------------------------------------------


def test_place_queues_the_prefill_of_the_missing_tokens():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 8 * BLOCK)
    cache(cluster, "a", shared)
    prompt = np.concatenate([shared, tokens(2, 100)])
    assert cluster.queue_s("a", 0.0) == 0.0

    first = cluster.prepare("r1", ROOT, prompt, 32, 0.0)
    expected_first = TINY_CPU.prefill_s(len(prompt) - 8 * BLOCK, 8 * BLOCK)
    assert cluster.prefill_s(first, "a") == pytest.approx(expected_first)
    placement = cluster.place(first, "a", 0.0)
    assert placement.prefill_s == pytest.approx(expected_first)
    assert placement.predicted_ttft_s == pytest.approx(expected_first)
    assert placement.prefix_key == first.prefix_key
    assert cluster.queue_s("a", 0.0) == pytest.approx(expected_first)
    assert cluster.queue_s("b", 0.0) == 0.0

    second = cluster.prepare("r2", ROOT, tokens(3, 300), 32, 0.0)
    expected_second = TINY_CPU.prefill_s(300, 0)
    placement = cluster.place(second, "a", 0.0)
    # Behind r1 it joins steps that pay the fixed cost anyway: it queues its marginal time.
    queued_second = expected_second - TINY_CPU.prefill.a
    assert placement.predicted_ttft_s == pytest.approx(expected_first + queued_second)
    assert cluster.queue_s("a", 0.0) == pytest.approx(expected_first + queued_second)
    # Time drains the queue, never below zero.
    later = expected_first / 2
    assert cluster.queue_s("a", later) == pytest.approx(expected_first + queued_second - later)
    assert cluster.queue_s("a", 100.0) == 0.0
    # A prefill placed on an idle queue starts now, not when the old one ended (r1 and r2
    # still decode there, so it still queues its marginal time only)...
    third = cluster.prepare("r3", ROOT, tokens(4, 300), 32, 100.0)
    assert cluster.place(third, "a", 100.0).predicted_ttft_s == pytest.approx(queued_second)
    assert cluster.queue_s("a", 100.0) == pytest.approx(queued_second)
    # ...and on a worker with nothing in flight it pays the step's fixed cost too.
    fourth = cluster.prepare("r4", ROOT, tokens(5, 300), 32, 100.0)
    assert cluster.place(fourth, "b", 100.0).predicted_ttft_s == pytest.approx(expected_second)


def test_a_prefill_longer_than_the_engines_step_budget_is_priced_chunk_by_chunk():
    chunked = ClusterState(BLOCK, TINY_CPU, prefill_chunk_tokens=512)
    one_step = ClusterState(BLOCK, TINY_CPU)
    assert chunked.chunked_prefill_s(512, 100) == TINY_CPU.prefill_s(512, 100)  # within the budget
    # Each chunk a step that attends to everything before it
    by_chunk = TINY_CPU.prefill_s(512, 0) + TINY_CPU.prefill_s(512, 512) + TINY_CPU.prefill_s(200, 1024)
    assert chunked.chunked_prefill_s(1224, 0) == pytest.approx(by_chunk)
    assert chunked.chunked_prefill_s(1224, 0) > one_step.chunked_prefill_s(1224, 0) == TINY_CPU.prefill_s(1224, 0)
    for cluster in (chunked, one_step):
        cluster.add_worker("a", 1000)
    prompt = tokens(1, 1224)
    cache(chunked, "a", prompt[:20 * BLOCK])
    request = chunked.prepare("r", ROOT, prompt, 8, 0.0)
    assert chunked.prefill_s(request, "a") == pytest.approx(TINY_CPU.prefill_s(512, 320) + TINY_CPU.prefill_s(392, 832))
    assert one_step.prefill_s(one_step.prepare("r", ROOT, prompt, 8, 0.0), "a") == TINY_CPU.prefill_s(1224, 0)


def test_a_held_prefix_survives_a_queue_whose_allocations_fit_in_the_free_blocks():
    cluster = cluster_of("a", kv_blocks=1000)
    for index in range(4):  # four requests in flight, each allocating 50 new blocks
        cluster.place(cluster.prepare(f"r{index}", ROOT, tokens(index, 50 * BLOCK), 8, 0.0), "a", 0.0)
    assert cluster.cache_survival("a") == 1.0  # nothing reported waiting
    cluster.report("a", running=2, waiting=2, kv_blocks_used=100, kv_blocks_cached=400)
    assert cluster.cache_survival("a") == 1.0  # the two waiting take 100 of 500 free blocks


def test_a_queue_that_allocates_more_than_the_free_blocks_evicts_a_share_of_the_cached_ones():
    cluster = cluster_of("a", kv_blocks=1000)
    for index in range(4):
        cluster.place(cluster.prepare(f"r{index}", ROOT, tokens(index, 50 * BLOCK), 8, 0.0), "a", 0.0)
    # Two waiting allocate ~100 blocks where 20 are free: 80 of the 400 cached ones go.
    cluster.report("a", running=2, waiting=2, kv_blocks_used=580, kv_blocks_cached=400)
    assert cluster.cache_survival("a") == pytest.approx(1 - 80 / 400)
    cluster.report("a", running=2, waiting=2, kv_blocks_used=930, kv_blocks_cached=60)
    assert cluster.cache_survival("a") == 0.0  # more than all of them
    cluster.finish("r0")
    cluster.finish("r1")
    cluster.finish("r2")
    cluster.finish("r3")
    assert cluster.workers["a"].new_blocks_sum == 0
    assert cluster.cache_survival("a") == 1.0  # nothing left in flight


def test_the_queue_holds_the_expected_recompute_of_a_prefix_its_queue_may_evict():
    """An engine matches a waiting request's prefix when it schedules it: behind a queue
    that evicts half the cache, a held prefix is recomputed half the time, and the queue
    model holds that expectation, while the placement's own prefill (its load) stays the
    held one."""
    cluster = cluster_of("holder", kv_blocks=1000)
    shared = tokens(1, 16 * BLOCK)
    cache(cluster, "holder", shared)
    for index in range(2):
        cluster.place(cluster.prepare(f"q{index}", ROOT, tokens(10 + index, 50 * BLOCK), 8, 0.0), "holder", 0.0)
    cluster.report("holder", running=0, waiting=2, kv_blocks_used=800, kv_blocks_cached=200)
    assert cluster.cache_survival("holder") == pytest.approx(0.5)  # ~100 blocks to allocate, none free
    before = cluster.queue_s("holder", 0.0)
    request = cluster.prepare("r", ROOT, np.concatenate([shared, tokens(2, 100)]), 8, 0.0)
    held_s, cold_s = cluster.held_prefill_s(request, 16), cluster.held_prefill_s(request, 0)
    placement = cluster.place(request, "holder", 0.0)
    assert placement.prefill_s == pytest.approx(held_s)
    expected_s = (held_s + cold_s) / 2 - TINY_CPU.prefill.a  # behind others: its marginal time
    assert cluster.queue_s("holder", 0.0) - before == pytest.approx(expected_s)


def test_load_is_windowed_prefill_plus_decode_work():
    cluster = cluster_of("a", window_s=10.0)
    assert cluster.load_s("a", 0.0) == 0.0
    r1 = cluster.prepare("r1", ROOT, tokens(1, 200), 40, 0.0)
    p1 = cluster.place(r1, "a", 0.0)
    assert p1.expected_output == 40  # no finished outputs yet: max_tokens
    decode_one = 40 * TINY_CPU.decode_step_s(1, 200)
    assert cluster.load_s("a", 0.0) == pytest.approx(p1.prefill_s + decode_one)

    r2 = cluster.prepare("r2", ROOT, tokens(2, 400), 60, 4.0)
    p2 = cluster.place(r2, "a", 4.0)
    decode_two = (40 + 60) * TINY_CPU.decode_step_s(2, 300)
    assert cluster.load_s("a", 4.0) == pytest.approx(p1.prefill_s + p2.prefill_s + decode_two)
    assert cluster.workers["a"].decode_work_s == pytest.approx(decode_two)
    assert cluster.tpot_s(cluster.prepare("r3", ROOT, tokens(3, 600), 8, 4.0), "a") == \
        pytest.approx(TINY_CPU.decode_step_s(3, 400))

    # Finishing a request removes its decode work, not its prefill (still in the window).
    assert cluster.finish("r1", output_tokens=30) is p1
    decode_left = 60 * TINY_CPU.decode_step_s(1, 400)
    assert cluster.load_s("a", 5.0) == pytest.approx(p1.prefill_s + p2.prefill_s + decode_left)
    assert cluster.finish("r1") is None  # only once

    # The window drops each prefill window_s after its placement.
    assert cluster.load_s("a", 9.9) == pytest.approx(p1.prefill_s + p2.prefill_s + decode_left)
    assert cluster.load_s("a", 10.5) == pytest.approx(p2.prefill_s + decode_left)
    assert [p.request_id for p in cluster.in_window("a", 10.5)] == ["r2"]
    cluster.finish("r2", output_tokens=50)
    assert cluster.load_s("a", 13.9) == pytest.approx(p2.prefill_s)
    assert cluster.load_s("a", 14.5) == 0.0
    assert list(cluster.in_window("a", 20.0)) == []


def test_expected_output_follows_the_median_of_finished_requests():
    cluster = cluster_of("a")
    for index, output in enumerate((10, 30, 20)):
        request = cluster.prepare(f"r{index}", ROOT, tokens(index, 50), 100, 0.0)
        cluster.place(request, "a", 0.0)
        cluster.finish(f"r{index}", output_tokens=output)
    assert cluster.expected_output(cluster.prepare("x", ROOT, tokens(9, 50), 100, 1.0)) == 20
    assert cluster.expected_output(cluster.prepare("y", ROOT, tokens(9, 50), 15, 1.0)) == 15  # capped


def test_kaplan_meier_median_counts_censored_lengths_as_at_risk_only_up_to_their_bound():
    assert kaplan_meier_median([1, 2, 3], []) == 2  # nothing censored: the plain median
    assert kaplan_meier_median([1, 2, 3, 4], []) == 2  # survival 3/4, then 1/2
    # Two short ones finished among ten: survival after them is 0.8, never a half, so the
    # median is past what was seen: at least the longest bound.
    assert kaplan_meier_median([4, 4], [50] * 8) == 50
    # Bounds below a finished length are not at risk there: 2/3, then 1/3 at 20.
    assert kaplan_meier_median([10, 20, 30], [1, 2]) == 20
    # One bound past 10 keeps survival at 3/4 there; at 20, 3/4 · 1/2.
    assert kaplan_meier_median([10, 20, 30], [15]) == 20
    assert kaplan_meier_median([10, 20], [25, 25, 25]) == 25  # 4/5, then 3/4 of it: never a half


def test_cost_aware_prices_outputs_censored_by_the_requests_still_decoding():
    cluster = cluster_of("a", "b")
    # Ten requests placed at t=0, alternately on b and a; one finishes at once with 3
    # tokens, the others decode on.
    placements = [cluster.place(cluster.prepare(f"r{index}", ROOT, tokens(index, 50), 4000, 0.0),
                                "b" if index % 2 == 0 else "a", 0.0) for index in range(10)]
    cluster.finish("r0", output_tokens=3, now=0.5)
    probe = cluster.prepare("x", ROOT, tokens(99, 50), 4000, 0.5)
    assert cluster.expected_output(probe) == 3  # the plain median: only the short one finished
    # Each in flight is taken to decode from its predicted first token at its worker's step
    # time (b: 4 sequences of 50 tokens). All nine are past 3 tokens by t=2: survival
    # after 3 is 9/10, never a half, so the median is the longest bound, r2's on b.
    bound = int((2.0 - placements[2].predicted_ttft_s) / TINY_CPU.decode_step_s(4, 50.0))
    assert bound > 100
    assert cluster.censored_expected_output(probe, 2.0) == bound
    capped = cluster.prepare("y", ROOT, tokens(98, 50), 40, 2.0)
    assert cluster.censored_expected_output(capped, 2.0) == 40
    # The median stands for CENSORED_REFRESH_S (it reads every request in flight), then is made again.
    assert cluster.censored_expected_output(probe, 2.0 + CENSORED_REFRESH_S / 2) == bound
    later = 2.0 + 2 * CENSORED_REFRESH_S
    assert cluster.censored_expected_output(probe, later) == \
        int((later - placements[2].predicted_ttft_s) / TINY_CPU.decode_step_s(4, 50.0)) > bound
    # Before any has decoded a token, the finished one decides alone.
    assert cluster.censored_expected_output(probe, placements[1].predicted_ttft_s) == 3
    # Once RECENT_OUTPUTS requests have finished, the plain median again.
    for index in range(10, 10 + RECENT_OUTPUTS):
        cluster.place(cluster.prepare(f"r{index}", ROOT, tokens(index, 50), 4000, 30.0), "a", 30.0)
        cluster.finish(f"r{index}", output_tokens=7, now=30.0)
    assert cluster.censored_expected_output(probe, 40.0) == cluster.expected_output(probe) == 7


def test_place_records_hits_on_the_blocks_the_worker_reuses():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 6 * BLOCK)
    cache(cluster, "a", shared)
    cache(cluster, "b", shared[:2 * BLOCK])
    request = cluster.prepare("r", ROOT, shared, 32, 0.0)
    cluster.place(request, "b", 0.0)
    assert [cluster.index.hits(node, 0.0) for node in request.path] == [1, 1, 0, 0, 0, 0]
    cluster.place(cluster.prepare("r2", ROOT, shared, 32, 0.0), "a", 0.0)
    assert [cluster.index.hits(node, 0.0) for node in request.path] == [2, 2, 1, 1, 1, 1]


# ---- eviction cost ----------------------------------------------------------------------


def test_eviction_cost_is_zero_with_free_blocks_and_prices_hit_blocks_it_would_evict():
    cluster = cluster_of("a", kv_blocks=100)
    hot = tokens(1, 10 * BLOCK)
    cache(cluster, "a", hot)
    hit = cluster.prepare("hit", ROOT, hot, 8, 0.0)
    cluster.place(hit, "a", 0.0)  # one hit on each of the 10 blocks
    cluster.finish("hit")
    fresh = cluster.prepare("new", ROOT, tokens(2, 20 * BLOCK), 8, 1.0)
    assert fresh.blocks_needed("a") == 20

    cluster.report("a", running=0, waiting=0, kv_blocks_used=0, kv_blocks_cached=10)
    assert cluster.workers["a"].free_blocks == 90
    assert cluster.eviction_cost_s(fresh, "a", 1.0) == 0.0

    # 16 free blocks: four of the LRU (hit) blocks must go.
    cluster.report("a", running=0, waiting=0, kv_blocks_used=74, kv_blocks_cached=10)
    assert cluster.workers["a"].free_blocks == 16
    expected = sum(TINY_CPU.recompute_s(BLOCK, depth * BLOCK) for depth in range(4))
    four = cluster.eviction_cost_s(fresh, "a", 1.0)
    assert four > 0
    assert four == pytest.approx(expected)

    # More to evict costs more; once the hits age out of the window it costs nothing.
    cluster.report("a", running=0, waiting=0, kv_blocks_used=82, kv_blocks_cached=10)
    assert cluster.eviction_cost_s(fresh, "a", 1.0) > four
    assert cluster.eviction_cost_s(fresh, "a", 1000.0) == 0.0


def test_eviction_cost_is_zero_when_the_lru_blocks_were_never_hit():
    cluster = cluster_of("a", kv_blocks=100)
    cache(cluster, "a", tokens(1, 10 * BLOCK))
    cluster.report("a", running=0, waiting=0, kv_blocks_used=85, kv_blocks_cached=10)
    fresh = cluster.prepare("new", ROOT, tokens(2, 20 * BLOCK), 8, 1.0)
    assert cluster.eviction_cost_s(fresh, "a", 1.0) == 0.0


def test_eviction_cost_weighs_by_hits_and_reads_lru_blocks_first():
    cluster = cluster_of("a", kv_blocks=100)
    cold, hot = tokens(1, 4 * BLOCK), tokens(2, 4 * BLOCK)
    cache(cluster, "a", cold)
    cache(cluster, "a", hot)
    for index in range(3):
        cluster.place(cluster.prepare(f"h{index}", ROOT, hot, 8, 0.0), "a", 0.0)
        cluster.finish(f"h{index}")
    fresh = cluster.prepare("new", ROOT, tokens(3, 10 * BLOCK), 8, 1.0)
    # Evicting 4 blocks takes the cold (never hit) ones: free.
    cluster.report("a", running=0, waiting=0, kv_blocks_used=86, kv_blocks_cached=8)
    assert cluster.workers["a"].free_blocks == 6
    assert cluster.eviction_cost_s(fresh, "a", 1.0) == 0.0
    # Evicting all 8 reaches the hot ones, each hit 3 times.
    cluster.report("a", running=0, waiting=0, kv_blocks_used=90, kv_blocks_cached=8)
    once = sum(TINY_CPU.recompute_s(BLOCK, depth * BLOCK) for depth in range(4))
    assert cluster.eviction_cost_s(fresh, "a", 1.0) == pytest.approx(3 * once)
    # Once per hit block: each is recomputed on its next use, then cached again.
    assert cluster.eviction_cost_s(fresh, "a", 1.0, per_hit=False) == pytest.approx(once)
    assert cluster.eviction_cost_s(fresh, "a", 1000.0, per_hit=False) == 0.0  # hits aged out


def test_eviction_cost_once_per_block_extrapolates_beyond_the_sample(monkeypatch):
    monkeypatch.setattr("services.router.cluster.EVICTION_SAMPLE", 4)
    cluster = cluster_of("a", kv_blocks=100)
    hot = tokens(2, 8 * BLOCK)
    cache(cluster, "a", hot)
    for index in range(2):
        cluster.place(cluster.prepare(f"h{index}", ROOT, hot, 8, 0.0), "a", 0.0)
        cluster.finish(f"h{index}")
    cluster.report("a", running=0, waiting=0, kv_blocks_used=92, kv_blocks_cached=8)
    fresh = cluster.prepare("new", ROOT, tokens(3, 8 * BLOCK), 8, 1.0)
    # Evicting all 8 reads the 4 LRU blocks (stored head first, so the prefix's head)
    # and extrapolates their mean per block.
    sampled = sum(TINY_CPU.recompute_s(BLOCK, depth * BLOCK) for depth in range(4))
    assert cluster.eviction_cost_s(fresh, "a", 1.0, per_hit=False) == pytest.approx(8 * sampled / 4)
    assert cluster.eviction_cost_s(fresh, "a", 1.0) == pytest.approx(2 * 8 * sampled / 4)


def test_placements_take_blocks_until_the_next_report():
    cluster = cluster_of("a", kv_blocks=100)
    cluster.report("a", running=0, waiting=0, kv_blocks_used=50, kv_blocks_cached=0)
    cluster.place(cluster.prepare("r", ROOT, tokens(1, 10 * BLOCK + 1), 8, 0.0), "a", 0.0)
    assert cluster.workers["a"].free_blocks == 50 - 11
    cluster.report("a", running=1, waiting=0, kv_blocks_used=61, kv_blocks_cached=0)
    assert cluster.workers["a"].free_blocks == 39


# ---- membership ---------------------------------------------------------------------------


def test_remove_worker_returns_its_placements_and_forgets_its_blocks():
    cluster = cluster_of("a", "b")
    prompt = tokens(1, 6 * BLOCK)
    cache(cluster, "a", prompt)
    cache(cluster, "b", prompt[:3 * BLOCK])
    on_a = [cluster.place(cluster.prepare(f"a{i}", ROOT, tokens(10 + i, 100), 8, 0.0), "a", 0.0)
            for i in range(2)]
    on_b = cluster.place(cluster.prepare("b0", ROOT, tokens(20, 100), 8, 0.0), "b", 0.0)
    cluster.finish("a0")

    returned = cluster.remove_worker("a")
    assert [p.request_id for p in returned] == ["a1"]
    assert returned[0] is on_a[1]
    assert "a" not in cluster.workers
    assert set(cluster.placements) == {"b0"}
    assert cluster.finish("a1") is None
    assert cluster.index.num_blocks("a") == 0
    assert len(cluster.index) == 3 + 6  # b's cached prefix, and b0's 6 blocks held on credit
    assert cluster.prepare("r", ROOT, prompt, 8, 1.0).matched == {"b": 3}
    assert cluster.finish("b0") is on_b
    assert len(cluster.index) == 3  # no KV event confirmed b0's blocks
    # Unknown workers: nothing to return; their late KV events are ignored.
    assert cluster.remove_worker("a") == []
    cluster.kv_stored("a", chain_hashes(ROOT, prompt, BLOCK), 2.0)
    assert cluster.prepare("r", ROOT, prompt, 8, 2.0).matched == {"b": 3}


def test_kv_removed_cuts_the_match():
    cluster = cluster_of("a")
    prompt = tokens(1, 6 * BLOCK)
    hashes = cache(cluster, "a", prompt)
    cluster.kv_removed("a", hashes[2:])
    request = cluster.prepare("r", ROOT, prompt, 8, 0.0)
    assert request.matched == {"a": 2}
    assert request.prefix_key == hashes[1]


# ---- blocks held on credit (events mode) ---------------------------------------------------


def test_a_placed_prompt_is_found_before_its_kv_events_arrive():
    cluster = cluster_of("a", "b")
    prompt = tokens(1, 5 * BLOCK + 3)
    cluster.place(cluster.prepare("first", ROOT, prompt, 8, 0.0), "a", 0.0)
    follower = cluster.prepare("follower", ROOT, prompt, 8, 0.1)
    assert follower.matched == {"a": 5}
    assert [node.block_hash for node in follower.path] == chain_hashes(ROOT, prompt, BLOCK)


def test_the_credit_ends_with_the_request_except_where_events_confirmed_it():
    cluster = cluster_of("a")
    prompt = tokens(1, 5 * BLOCK)
    hashes = chain_hashes(ROOT, prompt, BLOCK)
    cluster.place(cluster.prepare("r", ROOT, prompt, 8, 0.0), "a", 0.0)
    cluster.kv_stored("a", hashes[:3], 0.5)  # the first chunk's blocks
    cluster.finish("r")
    assert cluster.prepare("next", ROOT, prompt, 8, 1.0).matched == {"a": 3}
    assert cluster.index.num_blocks("a") == 3


def test_only_the_blocks_the_worker_lacks_are_credited():
    cluster = cluster_of("a")
    prompt = tokens(1, 6 * BLOCK)
    hashes = cache(cluster, "a", prompt[:2 * BLOCK])
    placement = cluster.place(cluster.prepare("r", ROOT, prompt, 8, 0.0), "a", 0.0)
    assert placement.credited is not None
    assert cluster.index.credited(placement.credited) == chain_hashes(ROOT, prompt, BLOCK)[2:]
    cluster.finish("r")
    assert cluster.prepare("next", ROOT, prompt, 8, 1.0).matched == {"a": 2}
    assert [node.block_hash for node in cluster.index.lru_blocks("a")] == hashes


def test_a_removed_event_cuts_a_credit_and_a_later_store_confirms_the_block():
    cluster = cluster_of("a")
    prompt = tokens(1, 4 * BLOCK)
    hashes = chain_hashes(ROOT, prompt, BLOCK)
    cluster.place(cluster.prepare("r", ROOT, prompt, 8, 0.0), "a", 0.0)
    cluster.kv_removed("a", hashes[2:])  # e.g. preempted before those blocks were named
    assert cluster.prepare("x", ROOT, prompt, 8, 0.1).matched == {"a": 2}
    cluster.kv_stored("a", hashes, 0.2)  # recomputed and stored
    cluster.finish("r")
    assert cluster.prepare("y", ROOT, prompt, 8, 0.3).matched == {"a": 2 + 2}


def test_approximate_mode_credits_nothing():
    cluster = cluster_of("a", index_ttl_s=30.0)
    placement = cluster.place(cluster.prepare("r", ROOT, tokens(1, 4 * BLOCK), 8, 0.0), "a", 0.0)
    assert placement.credited is None


class CountingDict(dict):
    """The index's nodes, counting each lookup, store and deletion: its work per block."""

    def __init__(self, items: dict):
        super().__init__(items)
        self.touched = 0

    def get(self, key, default=None):
        self.touched += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.touched += 1
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self.touched += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.touched += 1
        super().__delitem__(key)

    def __contains__(self, key):
        self.touched += 1
        return super().__contains__(key)


def credit_work(new_blocks: int, others: int) -> tuple[int, int]:
    """Node operations of placing, on a worker that holds its first 8 blocks, a prompt
    whose next `new_blocks` no worker holds, and then of naming and settling its credit;
    beside `others` requests of 16 blocks each placed on another worker, whose blocks are
    indexed and on credit, never confirmed."""
    cluster = cluster_of("a", "b")
    for n in range(others):
        cluster.place(cluster.prepare(f"o{n}", ROOT, tokens(100 + n, 16 * BLOCK), 8, 0.0), "b", 0.0)
    shared = tokens(1, 8 * BLOCK)
    cache(cluster, "a", shared)  # an event: names the others' credits
    assert sum(map(len, cluster.index.unconfirmed.values())) == 16 * others
    request = cluster.prepare("r", ROOT, np.concatenate([shared, tokens(2, new_blocks * BLOCK)]), 8, 1.0)
    nodes = cluster.index.nodes = CountingDict(cluster.index.nodes)
    cluster.place(request, "a", 1.0)
    placing = nodes.touched
    cluster.kv_stored("b", [], 1.5)  # any event names the credit
    cluster.finish("r")  # unconfirmed: settling forgets its blocks
    return placing, nodes.touched - placing


def test_a_credit_costs_work_in_its_new_blocks_not_in_the_index_or_the_other_credits():
    assert credit_work(10, 0)[0] == credit_work(40, 50)[0] == 0  # placing names nothing
    work = {blocks: credit_work(blocks, 0)[1] for blocks in (10, 20, 40)}
    assert credit_work(10, 50)[1] == work[10]
    assert credit_work(40, 50)[1] == work[40]
    per_block = (work[20] - work[10]) / 10
    assert 0 < per_block <= 6
    assert work[40] - work[20] == 20 * per_block  # linear in the new blocks


# ---- approximate mode ---------------------------------------------------------------------


def test_approximate_mode_predicts_placements_and_expires_them():
    cluster = cluster_of("a", "b", index_ttl_s=30.0)
    assert cluster.approximate
    prompt = tokens(1, 5 * BLOCK + 3)
    cluster.kv_stored("b", chain_hashes(ROOT, prompt, BLOCK), 0.0)  # events are ignored
    first = cluster.prepare("r1", ROOT, prompt, 8, 0.0)
    assert first.matched == {}
    cluster.place(first, "a", 0.0)
    second = cluster.prepare("r2", ROOT, prompt, 8, 10.0)
    assert second.matched == {"a": 5}
    assert [node.block_hash for node in second.path] == chain_hashes(ROOT, prompt, BLOCK)
    assert cluster.prepare("r3", ROOT, prompt, 8, 30.0).matched == {}
    assert len(cluster.index) == 0  # prepare expired the entries


def test_eviction_cost_never_counts_the_prefix_the_request_itself_reuses():
    cluster = cluster_of("a", kv_blocks=100)
    hot = tokens(1, 10 * BLOCK)
    cache(cluster, "a", hot)
    cluster.place(cluster.prepare("hit", ROOT, hot, 8, 0.0), "a", 0.0)
    cluster.finish("hit")
    cluster.report("a", running=0, waiting=0, kv_blocks_used=86, kv_blocks_cached=10)  # 4 free
    reuse = cluster.prepare("reuse", ROOT, np.concatenate([hot, tokens(2, 8 * BLOCK)]), 8, 1.0)
    assert reuse.blocks_needed("a") == 8
    assert cluster.eviction_cost_s(reuse, "a", 1.0) == 0.0  # its own prefix is pinned, not evicted
    other = cluster.prepare("other", ROOT, tokens(3, 8 * BLOCK), 8, 1.0)
    assert cluster.eviction_cost_s(other, "a", 1.0) > 0.0


def test_explore_costs_are_load_plus_prefill_plus_eviction_for_every_worker():
    """The one-pass pricing E2 explores with agrees with the per-worker terms, also
    after LRU changes (stale samples) and as the hit window moves on."""
    cluster = cluster_of("a", "b", "c", "d", kv_blocks=60)
    shared, other = tokens(1, 12 * BLOCK), tokens(2, 6 * BLOCK)
    cache(cluster, "a", shared)
    cache(cluster, "b", shared[:5 * BLOCK])
    cache(cluster, "c", other)
    for index in range(3):  # hits make evicting these blocks cost something
        cluster.place(cluster.prepare(f"h{index}", ROOT, shared, 8, 0.0), "a", 0.0)
        cluster.place(cluster.prepare(f"o{index}", ROOT, other, 8, 0.0), "c", 0.0)
    cluster.report("a", running=1, waiting=0, kv_blocks_used=40, kv_blocks_cached=12)
    cluster.report("b", running=0, waiting=0, kv_blocks_used=50, kv_blocks_cached=5)
    cluster.report("c", running=2, waiting=0, kv_blocks_used=30, kv_blocks_cached=6)

    def check(now: float) -> dict[str, float]:
        """The eviction term of each worker, after checking the sum."""
        request = cluster.prepare(f"q{now}", ROOT, np.concatenate([shared, tokens(3, 20 * BLOCK)]), 8, now)
        costs = cluster.explore_costs(request, now)
        evictions = {worker_id: cluster.eviction_cost_s(request, worker_id, now) for worker_id in cluster.workers}
        expected = {worker_id: cluster.load_s(worker_id, now) + cluster.prefill_s(request, worker_id)
                    + evictions[worker_id] for worker_id in cluster.workers}
        assert costs == pytest.approx(expected)
        return evictions

    assert check(1.0)["c"] > 0  # c must evict its hit blocks; a holds the prompt, pinned
    cache(cluster, "c", tokens(5, 4 * BLOCK), 2.0)  # c's LRU changes: its sample is stale
    assert check(2.0)["c"] > 0
    assert set(check(400.0).values()) == {0.0}  # the hits have left the window


# ---- the kept per-worker arrays ---------------------------------------------------------


def utilization_by_loop(cluster: ClusterState, now: float) -> float:
    """prefill_utilization as a loop over the workers computes it."""
    busy_s, start = 0.0, now
    for worker in cluster.workers.values():
        busy_s += worker.window_prefill_s
        if worker.window:
            start = min(start, worker.window[0].placed_at)
    span_s = max(1.0, min(cluster.window_s, now - start)) * max(1, len(cluster.workers))
    return min(0.99, busy_s / span_s)


def added_latency_by_loop(request, cluster: ClusterState, now: float) -> dict[str, float]:
    """cost_aware's added_latency_s as a plain loop over the workers computes it."""
    from services.router.policies.cost_aware import added_decode_step_s, recompute_weight, tail_weight

    blocks = -(-request.num_tokens // cluster.block_size)
    prefill = {w: cluster.prefill_s(request, w) for w in cluster.worker_ids}
    least_prefill_s = min(prefill.values(), default=0.0)
    weight = recompute_weight(cluster.prefill_utilization(now))
    queue_weight = 1.0 + weight * (1.0 - request.best_cached_tokens / max(request.num_tokens, 1))
    fastest_step_s = min((cluster.tpot_s(request, w) for w in cluster.worker_ids), default=0.0)
    costs = {}
    for w in cluster.worker_ids:
        worker, prefill_s = cluster.workers[w], prefill[w]
        batch = len(worker.in_flight)
        step_s = added_decode_step_s(cluster.cost.decode, batch, worker.prompt_tokens_sum, request.num_tokens)
        waited_s = max(0.0, prefill_s - cluster.cost.prefill.a)
        decode_s = cluster.expected_output(request) * step_s
        if cluster.queue_s(w, now) > 0.0:
            cost = queue_weight * cluster.queue_s(w, now) + prefill_s + batch * waited_s + decode_s
        else:
            cost = prefill_s + batch * waited_s + decode_s * tail_weight(cluster.tpot_s(request, w), fastest_step_s)
        cost += weight * (prefill_s - least_prefill_s)
        if cluster.free_blocks[w] < blocks - request.matched.get(w, 0):
            cost += cluster.eviction_cost_s(request, w, now, per_hit=False)
        costs[w] = cost
    return costs


def ranked(cluster: ClusterState, key) -> list[str]:
    """The worker ids by ascending key, ties by id: the order every ranking must give."""
    return sorted(cluster.worker_ids, key=key)


def assert_baselines_rank_as_their_sorts(cluster: ClusterState, request, now: float) -> None:
    """Each baseline's ranking is the sort of every worker by the key its rule states."""
    from services.router.policies.cache_aware import CacheAware, CacheAwareConfig

    chosen = {name: list(make_policy(name).choose(request, cluster, now)) for name in ("least_load", "lpm", "dynamo")}
    matched = request.matched
    in_flight = {w: len(state.in_flight) for w, state in cluster.workers.items()}
    exact = {w: cluster.load_s(w, now) for w in cluster.worker_ids}  # (expires the windows: after choose)
    logits = {w: request.blocks_needed(w) + state.kv_blocks_used + state.blocks_since_report
              for w, state in cluster.workers.items()}
    assert chosen["least_load"] == ranked(cluster, lambda w: (exact[w], in_flight[w]))
    assert chosen["lpm"] == ranked(cluster, lambda w: (-matched.get(w, 0), in_flight[w]))
    assert chosen["dynamo"] == ranked(cluster, logits.__getitem__)
    by_load = ranked(cluster, in_flight.__getitem__)
    by_match = ranked(cluster, lambda w: (-matched.get(w, 0), in_flight[w]))
    for config, expected in [(CacheAwareConfig(cache_threshold=0.0), by_match),
                             (CacheAwareConfig(cache_threshold=1.0), by_load),
                             (CacheAwareConfig(balance_abs=0, balance_rel=1.0, cache_threshold=0.0),
                              by_load if max(in_flight.values()) > min(in_flight.values()) else by_match)]:
        assert list(CacheAware(config).choose(request, cluster, now)) == expected


def assert_kept_state_agrees(cluster: ClusterState, request, now: float) -> None:
    """The arrays by slot hold the dicts' values; the orders are ranked()'s, and
    cost_aware's costs by slot are the plain loop's, to the bit."""
    from services.router.policies.cost_aware import added_latency_s

    assert cluster.slot_ids == list(cluster.workers)
    loads = cluster.loads(now)
    assert list(cluster.loads_by_slot) == [loads[w] for w in cluster.slot_ids]
    assert list(cluster.free_by_slot) == [cluster.free_blocks[w] for w in cluster.slot_ids]
    assert list(cluster.batch_by_slot) == [len(cluster.workers[w].in_flight) for w in cluster.slot_ids]
    assert list(cluster.context_by_slot) == [cluster.workers[w].prompt_tokens_sum for w in cluster.slot_ids]
    assert list(cluster.prefill_free_by_slot) == [cluster.workers[w].prefill_free_at for w in cluster.slot_ids]
    added = added_latency_s(request, cluster, now)
    assert added == added_latency_by_loop(request, cluster, now)
    chosen = make_policy("cost_aware").choose(request, cluster, now)
    assert list(chosen) == ranked(cluster, lambda w: (added[w], loads[w]))
    assert cluster.free_blocks == {w: state.free_blocks for w, state in cluster.workers.items()}
    by_load = ranked(cluster, loads.__getitem__)
    assert list(cluster.load_order(now)) == by_load
    for lead in (by_load[-1], by_load[len(by_load) // 2], by_load[0]):
        assert list(cluster.load_order(now, lead)) == [lead] + [w for w in by_load if w != lead]
    costs = cluster.explore_costs(request, now)
    assert list(costs) == list(cluster.workers)
    assert list(cluster.explore_order(request, now)) == ranked(cluster, costs.__getitem__)
    assert cluster.prefill_utilization(now) == utilization_by_loop(cluster, now)
    assert_baselines_rank_as_their_sorts(cluster, request, now)


@pytest.mark.parametrize("joined", [("a", "b", "c", "d", "e", "f"), ("f", "d", "b", "e", "c", "a")])
def test_a_ranking_orders_as_the_sort_on_the_exact_costs_and_prices_only_what_it_reaches(joined):
    cluster = cluster_of(*joined)
    rng = np.random.default_rng(7)
    for _ in range(50):
        exact = [float(x) for x in rng.integers(0, 4, len(joined))]  # small integers: many ties
        then = [float(x) for x in rng.integers(0, 2, len(joined))]
        pending = [slot for slot in range(len(joined)) if rng.random() < 0.5]
        bounds = [cost - float(rng.integers(0, 3)) if slot in pending else cost for slot, cost in enumerate(exact)]
        priced: list[int] = []

        def price(slot: int, exact: list[float] = exact, priced: list[int] = priced) -> float:
            priced.append(slot)
            return exact[slot]

        ranking = cluster.ranking(bounds, then, pending, price)
        first = ranking[0]
        key = {worker_id: (exact[slot], then[slot], cluster.worker_ids.index(worker_id))
               for slot, worker_id in enumerate(cluster.slot_ids)}
        # Only the pending slots whose bound comes before the first worker's exact key (or
        # is it: the first worker's own)
        assert sorted(priced) == sorted(slot for slot in pending
                                        if (bounds[slot], then[slot], key[cluster.slot_ids[slot]][2]) <= key[first])
        assert list(ranking) == sorted(cluster.worker_ids, key=key.__getitem__)  # (exact, then, id)
        assert len(ranking) == len(joined)
        assert sorted(priced) == sorted(pending)  # all of them, once, for the whole order
        assert ranking[-1] == ranking[len(joined) - 1] and ranking[1:3] == list(ranking)[1:3]
    with pytest.raises(IndexError):
        cluster_of("a").ranking([0.0], [0.0], [], float)[1]


@pytest.mark.parametrize("joined", [("a", "b", "c", "d"), ("d", "c", "b", "a")])
def test_the_baselines_break_ties_by_requests_in_flight_and_price_load_at_the_instant(joined):
    cluster = cluster_of(*joined, window_s=10.0)
    shared = tokens(1, 8 * BLOCK)
    for worker_id in ("a", "b", "c", "d"):
        cache(cluster, worker_id, shared[:4 * BLOCK])  # every worker matches 4 blocks
    cache(cluster, "c", shared)
    placements = [("a", 0.0), ("d", 0.02), ("a", 0.5), ("c", 1.5), ("c", 1.7), ("a", 9.0), ("b", 9.5)]
    for n, (worker_id, now) in enumerate(placements):  # in flight: a 3, c 2, b and d 1
        cluster.place(cluster.prepare(f"r{n}", ROOT, tokens(10 + n, 40 * BLOCK), 8, now), worker_id, now)
    probe = cluster.prepare("p", ROOT, np.concatenate([shared[:4 * BLOCK], tokens(3, 8 * BLOCK)]), 8, 10.0)
    cluster.loads(10.0)  # loads() refreshed now; by 10.04 d's prefill has left the window
    # lpm: equal matches, the fewest in flight (b, not a); least_load: d's load at 10.04
    # is its decode alone, b's still counts its prefill
    assert [make_policy(name).choose(probe, cluster, 10.04)[0] for name in ("lpm", "least_load")] == ["b", "d"]
    assert_baselines_rank_as_their_sorts(cluster, probe, 10.04)


@pytest.mark.parametrize("joined", [("a", "b", "c", "d"), ("d", "b", "c", "a")])  # slots in id order or not
def test_the_kept_arrays_and_orders_agree_with_the_dicts_through_joins_places_and_leaves(joined):
    cluster = cluster_of(*joined, kv_blocks=40, window_s=10.0)
    shared = tokens(1, 12 * BLOCK)
    cache(cluster, "b", shared)
    cache(cluster, "c", shared[:6 * BLOCK])
    probe = cluster.prepare("p0", ROOT, np.concatenate([shared, tokens(2, 30 * BLOCK)]), 8, 0.0)
    assert_kept_state_agrees(cluster, probe, 0.0)  # idle: equal costs, ties by id
    for n, (worker_id, now) in enumerate([("b", 1.0), ("d", 2.0), ("b", 3.0), ("a", 4.0)]):
        cluster.place(cluster.prepare(f"r{n}", ROOT, shared, 8, now), worker_id, now)
        assert_kept_state_agrees(cluster, probe, now)
    cluster.report("c", running=0, waiting=0, kv_blocks_used=30, kv_blocks_cached=8)  # c must evict
    assert_kept_state_agrees(cluster, probe, 5.0)
    cluster.finish("r0", 20)
    assert_kept_state_agrees(cluster, probe, 12.5)  # the first placements left the window
    cluster.remove_worker("b")
    cluster.add_worker("e", 40)
    cluster.add_worker("b", 40)  # back, in a new slot: the slots leave id order
    assert cluster.slot_ids != cluster.worker_ids
    probe = cluster.prepare("p1", ROOT, np.concatenate([shared, tokens(2, 30 * BLOCK)]), 8, 13.0)
    assert_kept_state_agrees(cluster, probe, 13.0)
    assert_kept_state_agrees(cluster, probe, 40.0)  # every window empty


def test_a_prompt_pins_the_sampled_blocks_among_its_first_held_blocks_only():
    cluster = cluster_of("a", "b")
    prompt = tokens(1, 8 * BLOCK)
    cache(cluster, "a", prompt)
    cache(cluster, "b", tokens(2, 8 * BLOCK))
    other = cluster.prepare("o", ROOT, tokens(2, 8 * BLOCK), 8, 0.0).path
    request = cluster.prepare("r", ROOT, prompt, 8, 0.0)
    path = request.path

    def sample(*nodes):  # as an eviction sample keeps what it read
        return EvictionSample([], [], [node.depth for node in nodes], list(nodes))

    assert request.pins(sample(other[1], path[2], other[0]), 3)
    assert not request.pins(sample(other[1], path[3]), 3)  # past the held blocks
    assert not request.pins(sample(*other), 8)
    assert not request.pins(sample(path[0]), 0)
