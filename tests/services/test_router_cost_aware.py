"""cost_aware on constructed cluster states, one test per rule (docs/router.md §4.7).

Queues are set as the router's queue model holds them (ClusterState.set_prefill_free_at).
Outside the decode test the cost model's decode step does not grow with the batch, and
requests ask for one output token, so each test isolates the term it is about."""
import dataclasses

import numpy as np

from common.cost_model import TINY_CPU, LatencyFit
from services.router.cluster import ClusterState
from services.router.policies import make_policy
from services.router.policies.cost_aware import (
    MAX_RECOMPUTE_WEIGHT,
    MIN_RECOMPUTE_WEIGHT,
    added_decode_step_s,
    added_latency_s,
    recompute_weight,
    tail_weight,
)
from services.router.policies.e2 import E2
from tests.services.test_router_policy import BLOCK, ROOT, cache, tokens

FLAT_DECODE = dataclasses.replace(TINY_CPU, decode=LatencyFit(TINY_CPU.decode.a, 0.0))


def cluster_of(*worker_ids: str, kv_blocks: int = 10_000, flat_decode: bool = True) -> ClusterState:
    cluster = ClusterState(BLOCK, FLAT_DECODE if flat_decode else TINY_CPU)
    for worker_id in worker_ids:
        cluster.add_worker(worker_id, kv_blocks)
    return cluster


def queued(cluster: ClusterState, worker_id: str, seconds: float, now: float = 0.0) -> None:
    """The worker's queue model: prefills placed there end `seconds` after `now`."""
    cluster.set_prefill_free_at(worker_id, now + seconds)


def request_for(cluster: ClusterState, prompt: np.ndarray, now: float = 0.0, request_id: str = "r",
                max_tokens: int = 1):
    return cluster.prepare(request_id, ROOT, prompt, max_tokens, now)


def first(cluster: ClusterState, prompt: np.ndarray, now: float = 0.0, max_tokens: int = 1) -> str:
    return make_policy("cost_aware").choose(request_for(cluster, prompt, now, max_tokens=max_tokens),
                                             cluster, now)[0]


def test_an_overloaded_holder_loses_a_prefix_another_worker_recomputes_sooner():
    cluster = cluster_of("holder", "idle")
    shared = tokens(1, 1024)
    cache(cluster, "holder", shared)
    prompt = np.concatenate([shared, tokens(2, 64)])
    recompute_s = cluster.held_prefill_s(request_for(cluster, prompt), 0)
    # A queue beyond the recompute and the charge for the compute it spends (an idle
    # cluster: the least charge)
    queued(cluster, "holder", (1.1 + MIN_RECOMPUTE_WEIGHT) * recompute_s)
    assert first(cluster, prompt) == "idle"
    queued(cluster, "holder", recompute_s / 2)  # a queue under the recompute: the holder keeps it
    assert first(cluster, prompt) == "holder"


def test_a_high_load_ratio_with_a_short_queue_keeps_the_prefix_where_e2_moves_it():
    """Ten requests for the prefix ran on the holder and ended: its windowed load is all
    the cluster's (E2's ratio trigger fires), but nothing waits there."""
    cluster = cluster_of("holder", "other")
    shared = tokens(1, 2048)
    cache(cluster, "holder", shared)
    for index in range(10):
        request = request_for(cluster, np.concatenate([shared, tokens(100 + index, 64)]), request_id=f"old-{index}")
        cluster.place(request, "holder", 0.0)
        cluster.finish(request.request_id, 1)
    now = 60.0
    loads = cluster.loads(now)
    assert loads["holder"] > 0 and loads["other"] == 0 and cluster.queue_s("holder", now) == 0
    prompt = np.concatenate([shared, tokens(3, 64)])
    assert E2().choose(request_for(cluster, prompt, now), cluster, now)[0] == "other"
    assert first(cluster, prompt, now) == "holder"


def test_a_hot_prefix_gets_a_second_holder_once_the_queue_exceeds_a_recompute():
    """Requests for one prefix arrive together: each lengthens the holder's queue (and
    batch) by its suffix, and the first whose wait there exceeds a recompute elsewhere
    goes elsewhere, which makes that worker a holder at once."""
    cluster = cluster_of("a", "b", "c")
    shared = tokens(1, 2048)
    cache(cluster, "a", shared)
    policy = make_policy("cost_aware")
    chosen = []
    for index in range(12):
        request = request_for(cluster, np.concatenate([shared, tokens(100 + index, 256)]), request_id=f"r{index}")
        worker_id = policy.choose(request, cluster, 0.0)[0]
        if len(request.matched) == 1:  # "a" the only holder: it stays only while waiting costs less
            # What the request adds on "a": its wait (charged again, at k, for the share
            # of the prompt nobody holds), and its suffix's prefill, which each sequence
            # decoding there waits out too (less the step's fixed cost); elsewhere: the
            # whole prompt's prefill.
            suffix_s = cluster.prefill_s(request, "a")
            slowed_s = len(cluster.workers["a"].in_flight) * (suffix_s - cluster.cost.prefill.a)
            weight = recompute_weight(cluster.prefill_utilization(0.0))
            new_share = 1 - request.best_cached_tokens / request.num_tokens
            on_a = (1 + weight * new_share) * cluster.queue_s("a", 0.0) + suffix_s + slowed_s
            cold_s = cluster.held_prefill_s(request, 0)
            elsewhere = cold_s + weight * (cold_s - suffix_s)  # its own wait, the compute spent
            assert (on_a <= elsewhere) == (worker_id == "a")
        cluster.place(request, worker_id, 0.0)
        chosen.append(worker_id)
    second = next(w for w in chosen if w != "a")
    spread_at = chosen.index(second)
    assert chosen[:spread_at] == ["a"] * spread_at and spread_at >= 1
    assert request_for(cluster, shared).matched[second] == len(shared) // BLOCK  # placed: now a holder


def spread_point(waiting: int) -> int:
    """How many requests for one prefix its holder "a" takes before one goes elsewhere,
    with `waiting` of its two requests in flight queued at its last report, and no free
    blocks there."""
    cluster = cluster_of("a", "b", "c", kv_blocks=100_000)
    for index in range(2):  # two requests in flight on "a", 125 new blocks each, their prefills done by now
        cluster.place(request_for(cluster, tokens(50 + index, 2000), request_id=f"old-{index}"), "a", 0.0)
    now = 100.0
    cluster.report("a", running=2 - waiting, waiting=waiting, kv_blocks_used=99_900, kv_blocks_cached=100)
    shared = tokens(1, 8000)
    cache(cluster, "a", shared, now)
    policy = make_policy("cost_aware")
    for index in range(100):
        request = request_for(cluster, np.concatenate([shared, tokens(100 + index, 32)]), now, f"r{index}")
        worker_id = policy.choose(request, cluster, now)[0]
        if worker_id != "a":
            return index
        cluster.place(request, "a", now)
    raise AssertionError("the prefix never spread")


def test_a_holder_whose_queue_will_evict_the_prefix_queues_its_recompute_and_spreads_it_sooner():
    """The request waiting there will allocate ~125 blocks where none are free and 100
    are cached: what "a" holds will be gone when the next request runs, so each placed
    there queues the whole prompt's prefill, not its suffix's (ClusterState.cache_survival),
    and the queue passes a recompute elsewhere after fewer requests."""
    assert 1 <= spread_point(waiting=1) < spread_point(waiting=0)


def test_a_long_private_context_stays_with_its_holder_under_a_queue_shorter_than_its_recompute():
    cluster = cluster_of("holder", "idle")
    document = tokens(1, 8000)  # one stream's context: a question after it
    cache(cluster, "holder", document)
    prompt = np.concatenate([document, tokens(2, 32)])
    request = request_for(cluster, prompt)
    saved_s = cluster.held_prefill_s(request, 0) - cluster.prefill_s(request, "holder")  # the document's recompute
    # A wait longer than the recompute: it stays, until the wait exceeds the recompute and
    # the compute it would spend, charged at the idle cluster's weight (capacity the
    # requests after it would wait for).
    assert cluster.prefill_utilization(0.0) == 0.0
    bound = 1 + MIN_RECOMPUTE_WEIGHT
    queued(cluster, "holder", 1.1 * saved_s)
    assert first(cluster, prompt) == "holder"
    queued(cluster, "holder", 0.95 * bound * saved_s)
    assert first(cluster, prompt) == "holder"
    queued(cluster, "holder", 1.05 * bound * saved_s)
    assert first(cluster, prompt) == "idle"


def test_a_new_prefix_is_charged_the_queue_its_later_sharers_will_wait_out_too():
    """A document no worker holds becomes a new prefix where it goes, and the requests
    that share it later wait out that worker's queue as well: the queue counts
    (1 + k·u) times, u the share of the prompt nobody holds. So a document no longer
    waits behind a queue merely to spare the sequences decoding elsewhere its prefill."""
    cluster = cluster_of("queued", "busy")
    for index in range(8):
        cluster.place(request_for(cluster, tokens(500 + index, 64), request_id=f"busy-{index}"), "busy", 0.0)
    queued(cluster, "busy", 0.0)
    document = request_for(cluster, tokens(1, 4000))
    assert document.best_cached_tokens == 0
    stalled_s = 8 * (cluster.held_prefill_s(document, 0) - cluster.cost.prefill.a)  # the busy batch's wait
    weight = recompute_weight(cluster.prefill_utilization(0.0))
    queued(cluster, "queued", 0.9 * stalled_s)  # shorter than the stall: latency alone would queue it
    costs = added_latency_s(document, cluster, 0.0)
    assert abs(costs["queued"] - costs["busy"] - ((1 + weight) * 0.9 - 1) * stalled_s) < 1e-9
    assert first(cluster, tokens(1, 4000)) == "busy"
    queued(cluster, "queued", 0.9 * stalled_s / (1 + weight))
    assert first(cluster, tokens(1, 4000)) == "queued"


def test_a_busy_batch_costs_its_sequences_the_prefill_and_the_slower_step():
    """Two idle-queued workers without the prompt, one with 20 sequences decoding: there
    each of them waits out the prompt's prefill (less the step's fixed cost, which their
    step pays anyway) and decodes slower in the larger batch."""
    cluster = cluster_of("a", "b", flat_decode=False)
    for index in range(20):
        request = request_for(cluster, tokens(500 + index, 64), request_id=f"a-{index}")
        cluster.place(request, "a", 0.0)
    queued(cluster, "a", 0.0)
    request = request_for(cluster, tokens(1, 64), max_tokens=64)
    decode, a = cluster.cost.decode, cluster.workers["a"]
    joined = 21 * cluster.tpot_s(request, "a") - 20 * cluster.cost.decode_step_s(20, a.prompt_tokens_sum / 20)
    assert abs(added_decode_step_s(decode, 20, a.prompt_tokens_sum, 64) - joined) < 1e-12
    alone = added_decode_step_s(decode, 0, 0, 64)
    assert abs(alone - cluster.tpot_s(request, "b")) < 1e-12 and alone < joined
    costs = added_latency_s(request, cluster, 0.0)
    assert costs["a"] - costs["b"] > 20 * (cluster.prefill_s(request, "a") - cluster.cost.prefill.a)
    assert first(cluster, tokens(1, 64), max_tokens=64) == "b"


def decoding(cluster: ClusterState, worker_id: str, sequences: int) -> None:
    """`sequences` 64-token prompts placed on the worker, decoding (no queue)."""
    for index in range(sequences):
        request = request_for(cluster, tokens(10_000 + index, 64), request_id=f"{worker_id}-{index}")
        cluster.place(request, worker_id, 0.0)
    queued(cluster, worker_id, 0.0)


def test_a_hot_prefix_leaves_a_holder_whose_step_is_the_slowest_sooner_than_the_sum_alone_would():
    """A burst's hot prefix on a holder decoding 24 sequences, beside a worker decoding 8,
    neither with a queue: moving the request stalls those 8 for its whole prefill, staying
    slows the holder's 24 a little each step. The sum of latencies picks the holder; the
    decode terms there weigh t = T_holder / T_other (the requests nearest the tail are the
    ones slowed), and the request goes to the other worker."""
    cluster = cluster_of("holder", "other", flat_decode=False)
    shared = tokens(1, 2048)
    cache(cluster, "holder", shared)
    decoding(cluster, "holder", 24)
    decoding(cluster, "other", 8)
    prompt = np.concatenate([shared, tokens(2, 32)])
    request = request_for(cluster, prompt, max_tokens=16)
    weight = tail_weight(cluster.tpot_s(request, "holder"), cluster.tpot_s(request, "other"))
    assert weight > 1.0
    holder = cluster.workers["holder"]
    decode_s = cluster.censored_expected_output(request, 0.0) * added_decode_step_s(
        cluster.cost.decode, 24, holder.prompt_tokens_sum, request.num_tokens)
    costs = added_latency_s(request, cluster, 0.0)
    assert costs["holder"] - (weight - 1.0) * decode_s < costs["other"] < costs["holder"]  # the weight decides
    assert first(cluster, prompt, max_tokens=16) == "other"

    # With prefills queued on the holder its queue terms price the overload, and the
    # decode terms there weigh 1
    queue_s = 0.001
    queued(cluster, "holder", queue_s)
    request = request_for(cluster, prompt, max_tokens=16)
    queue_weight = 1.0 + recompute_weight(cluster.prefill_utilization(0.0)) * (
        1.0 - request.best_cached_tokens / request.num_tokens)
    queued_costs = added_latency_s(request, cluster, 0.0)
    assert abs(queued_costs["holder"] - costs["holder"] - (queue_weight * queue_s - (weight - 1.0) * decode_s)) < 1e-9
    assert queued_costs["other"] == costs["other"]


def test_the_tail_weight_is_the_step_over_the_fastest_and_at_least_one():
    assert tail_weight(0.05, 0.05) == 1.0 and tail_weight(0.04, 0.05) == 1.0
    assert tail_weight(0.375, 0.25) == 1.5 and tail_weight(0.5, 0.125) == 4.0
    assert tail_weight(0.05, 0.0) == 1.0  # a profile without a step time weighs nothing
    # Equal batches weigh alike: the weight orders only workers whose steps differ
    cluster = cluster_of("a", "b", flat_decode=False)
    decoding(cluster, "a", 10)
    decoding(cluster, "b", 10)
    request = request_for(cluster, tokens(3, 64), max_tokens=16)
    costs = added_latency_s(request, cluster, 0.0)
    assert costs["a"] == costs["b"]


def test_eviction_is_priced_where_the_prompt_does_not_fit():
    cluster = cluster_of("a", "b", kv_blocks=200)
    hot = tokens(1, 3000)
    cache(cluster, "a", hot)
    for index in range(5):  # hits make a's blocks expensive to evict
        cluster.place(request_for(cluster, hot, request_id=f"h{index}"), "a", 0.0)
        cluster.finish(f"h{index}", 1)
    cluster.report("a", 0, 0, 0, len(hot) // BLOCK)
    cluster.report("b", 0, 0, 0, 0)
    queued(cluster, "a", 0.0)
    prompt = tokens(2, 1600)  # 100 blocks: fits in b's 200 free, not in a's 13
    request = request_for(cluster, prompt)
    costs = added_latency_s(request, cluster, 0.0)
    eviction_s = cluster.eviction_cost_s(request, "a", 0.0, per_hit=False)
    assert eviction_s > 0 and abs(costs["a"] - costs["b"] - eviction_s) < 1e-9
    # Each evicted block counts once, not per hit: one recompute brings it back.
    assert cluster.eviction_cost_s(request, "a", 0.0) > eviction_s


def test_ties_go_to_the_least_windowed_work_then_the_smallest_id():
    cluster = cluster_of("c", "a", "b", "d")
    policy = make_policy("cost_aware")
    assert list(policy.choose(request_for(cluster, tokens(1, 100)), cluster, 0.0)) == ["a", "b", "c", "d"]
    for worker_id in ("a", "b"):  # work placed there and finished: queues and batches idle again
        request = request_for(cluster, tokens(2, 500), request_id=f"done-{worker_id}")
        cluster.place(request, worker_id, 0.0)
        cluster.finish(request.request_id, 1)
    assert policy.choose(request_for(cluster, tokens(1, 100), now=10.0), cluster, 10.0)[:2] == ["c", "d"]


def test_the_recompute_charge_grows_with_utilization_within_its_bounds():
    weights = [recompute_weight(rho) for rho in (0.0, 0.1, 0.2, 0.5, 0.6, 0.9, 0.99)]
    assert weights[0] == MIN_RECOMPUTE_WEIGHT and weights[-1] == MAX_RECOMPUTE_WEIGHT
    assert weights == sorted(weights) and weights[3] == 2.0  # 2ρ/(1−ρ) between the bounds


def test_a_busy_cluster_keeps_a_prefix_on_a_holder_an_idle_one_would_move_it_from():
    """The same holder queue, the same recompute: on an idle cluster the prompt moves to
    the idle worker; where prefills have kept the workers busy over the window, the
    compute the recompute spends costs the requests after it more, and it stays."""
    def holder_or_idle(background_s: float) -> str:
        cluster = cluster_of("holder", "idle", "other")
        shared = tokens(1, 1024)
        cache(cluster, "holder", shared)
        prompt = np.concatenate([shared, tokens(2, 64)])
        recompute_s = cluster.held_prefill_s(request_for(cluster, prompt), 0)
        # Prefills placed on "other" at t=0 (the sequences they leave in flight there keep
        # it from being the cheapest)
        for index in range(int(background_s / recompute_s)):
            other = request_for(cluster, tokens(1000 + index, 1088), now=0.0, request_id=f"bg-{index}")
            cluster.place(other, "other", 0.0)
        now = 20.0
        cluster.set_prefill_free_at("other", 0.0)
        queued(cluster, "holder", 3 * recompute_s, now)
        assert abs(cluster.prefill_utilization(now) - background_s / (3 * now)) < 0.05
        return first(cluster, prompt, now)

    assert holder_or_idle(0.0) == "idle"
    assert holder_or_idle(45.0) == "holder"  # 45 s of the workers' 60: ρ 0.75, weight 4



def test_an_idle_worker_is_priced_its_wake_from_the_moment_its_last_request_ended():
    """With a profile's wake points, a worker with nothing in flight costs what its first
    steps lose after that long idle: nothing just after its last request ended, the whole
    extra once it has sat idle past the last point. A worker with work in flight pays none."""
    woken = dataclasses.replace(FLAT_DECODE, wake=((0.01, 0.0002), (0.1, 0.001)))
    cluster = ClusterState(BLOCK, woken)
    for worker_id in ("busy", "rested", "fresh", "never"):
        cluster.add_worker(worker_id, 10_000)
    for worker_id in ("busy", "rested", "fresh"):
        cluster.place(request_for(cluster, tokens(10, 64), request_id=f"old-{worker_id}"), worker_id, 0.0)
    now = 5.0
    cluster.finish("old-rested", 1, now=0.0)
    cluster.finish("old-fresh", 1, now=now - 0.005)

    def added(cost) -> dict[str, float]:
        cluster.cost = cost
        return added_latency_s(request_for(cluster, tokens(3, 64), now), cluster, now)

    unpriced, priced = added(FLAT_DECODE), added(woken)
    wake = {worker_id: priced[worker_id] - unpriced[worker_id] for worker_id in priced}
    assert wake["busy"] == 0.0
    assert abs(wake["fresh"] - 0.0001) < 1e-12  # halfway to the first point
    assert abs(wake["rested"] - 0.001) < 1e-12 and abs(wake["never"] - 0.001) < 1e-12
