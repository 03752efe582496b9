"""`cost_aware`: the worker where the request adds the least latency (docs/router.md §4.7).

E2's idea (place by prefix, price load, recompute and eviction in seconds) without its
ratio triggers. For each worker w with n sequences in flight, from the cost model
(ClusterState, docs/router.md §3):

    cost(w) = queue_s(w)                    the prefills already placed there, ahead of it
            + P(w)                          the prefill of what w lacks (store fetches priced)
            + n · (P(w) − a)                which its n sequences wait out too: chunked
                                            prefill joins their decode step, whose fixed
                                            cost a (the prefill fit's) is paid anyway
            + eviction_cost_s(w)            the recompute of what it would evict that was
                                            hit in the window, once per block: its next
                                            use computes it again, and it is cached again
            + expected output · ΔD(w) · t(w)  its decode in the batch it joins, and the
                                            others' slowdown: ΔD = (n+1)·T(n+1) − n·T(n);
                                            the output is the median of recent ones,
                                            censored by those still decoding until 256
                                            have finished (censored_expected_output);
                                            on a worker without a queue t(w) = T_w(n+1)
                                            over the least of it among the workers
                                            (tail_weight: seconds added where steps are
                                            slowest are added to the tail), else 1
            + k(ρ) · (P(w) − min P)         the compute a recompute spends beyond the best
                                            holder's: capacity later requests wait for,
                                            k = 2ρ/(1−ρ) within [0.5, 4], ρ the cluster's
                                            prefill utilization
            + k(ρ) · u · queue_s(w)         the share u of the prompt no worker holds
                                            becomes a new prefix where it goes: the
                                            requests that will share it wait out that
                                            queue too (or recompute it elsewhere)
            + wake(idle_s(w))               on a worker with nothing in flight, what its
                                            first steps after idle_s lose to cold caches
                                            and clocks (the profile's measured wake
                                            points; 0 where it has none)

ranked by ascending cost, ties by windowed load (E2's L), then by worker id. The three
rules E2 states as triggers fall out of this one comparison, each on seconds, not ratios:
  * overload: a holder whose queue exceeds what the prompt costs to recompute elsewhere,
    plus the charge for that compute, loses the request; a holder with a high load ratio
    but a short queue keeps it;
  * replication: a hot prefix goes to a second worker on the first request for which its
    holder's wait exceeds that there, and the placement makes that worker a holder at
    once (ClusterState.place credits the blocks), so there is no ramp;
  * a long private context stays: moving it costs its full recompute and its charge,
    which the holder's wait must exceed first.
Work per decision is O(workers): one prefill time per distinct held depth, an eviction
estimate only where the prompt does not fit in the worker's free blocks and the ranking
reaches the worker (the other terms bound its cost from below; docs/router.md §8.6).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from common.cost_model import LatencyFit
from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback
from services.router.ranking import Ranking

# Compute spent recomputing what another worker holds is capacity no later request gets
# back: charged as recompute_weight(ρ) seconds of their latency per second spent, ρ the
# cluster's prefill utilization. The form is M/M/1's (the wait grows as ρ/(1−ρ)); the
# factor and the bounds were chosen on the sweep's seed 0 (docs/router.md §4.7).
WEIGHT_PER_UTILIZATION = 2.0
MIN_RECOMPUTE_WEIGHT = 0.5
MAX_RECOMPUTE_WEIGHT = 4.0


class CostAware(StatelessFeedback):
    name: ClassVar[str] = "cost_aware"  # ClassVar: compiled (mypyc), a plain annotation is per instance

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Ranking:
        costs, evicting = costs_before_eviction(request, cluster, now)
        wakes = wake_costs(cluster, now)
        bounds = list(costs)
        for slot, wake_s in wakes.items():
            bounds[slot] += wake_s
        slot_ids = cluster.slot_ids

        def price(slot: int) -> float:  # as added_latency_by_slot sums it
            cost = costs[slot] + cluster.eviction_cost_s(request, slot_ids[slot], now, per_hit=False)
            wake_s = wakes.get(slot)
            return cost if wake_s is None else cost + wake_s

        # Equal costs (idle workers, none holding the prompt) go to the least windowed
        # work, E2's L: spreading new prefixes spreads what the caches must keep. Eviction
        # is priced only for the workers the order reaches (an eviction costs nothing
        # less than 0, so the other terms bound the cost from below).
        cluster.loads(now)
        return cluster.ranking(bounds, cluster.loads_by_slot, evicting, price)


def added_latency_s(request: Request, cluster: ClusterState, now: float) -> dict[str, float]:
    """Per worker id, the latency placing the request there adds, its own and that of
    the requests it slows or makes recompute, in seconds as the cost model predicts."""
    return dict(zip(cluster.slot_ids, added_latency_by_slot(request, cluster, now)))


def added_latency_by_slot(request: Request, cluster: ClusterState, now: float) -> list[float]:
    """added_latency_s by worker slot."""
    costs, evicting = costs_before_eviction(request, cluster, now)
    slot_ids = cluster.slot_ids
    for slot in evicting:
        costs[slot] += cluster.eviction_cost_s(request, slot_ids[slot], now, per_hit=False)
    for slot, wake_s in wake_costs(cluster, now).items():
        costs[slot] += wake_s
    return costs


def costs_before_eviction(request: Request, cluster: ClusterState, now: float) -> tuple[list[float], list[int]]:
    """By slot, added_latency_by_slot's sum before the eviction and wake terms, and the
    slots where the prompt does not fit in the free blocks (where eviction is priced).
    Each term is priced once per distinct held depth where it depends on that alone; per
    worker, its sum is made in the same order."""
    slots = cluster.slots
    helds = [0] * len(slots)
    for worker_id, held in request.matched.items():
        slot = slots.get(worker_id)
        if slot is not None:
            helds[slot] = held
    step_s = cluster.cost.prefill.a  # a step's fixed cost: paid by the decode step the prefill joins
    prefill_by_held = {held: cluster.held_prefill_s(request, held) for held in set(helds)}
    least_prefill_s = _least(prefill_by_held.values())
    weight = recompute_weight(cluster.prefill_utilization(now))
    queue_weight = 1.0 + weight * (1.0 - request.best_cached_tokens / max(request.num_tokens, 1))
    # Per held depth: the prefill, what each sequence in flight waits of it, its charge.
    terms = {held: (prefill_s, max(0.0, prefill_s - step_s), weight * (prefill_s - least_prefill_s))
             for held, prefill_s in prefill_by_held.items()}
    expected_output = cluster.censored_expected_output(request, now)
    decode = cluster.cost.decode
    a, b, c, d, e = decode.a, decode.b, decode.c, decode.d, decode.e
    prompt = request.num_tokens
    batches, contexts, free_ats = cluster.batch_by_slot, cluster.context_by_slot, cluster.prefill_free_by_slot
    fit = cluster.decode_fit  # T(n+1) at the mean context with the prompt joined, as ClusterState.tpot_s
    steps = [fit.at(batch + 1, (context + prompt) / (batch + 1)) for batch, context in zip(batches, contexts)]
    fastest_step_s = _least(steps)
    costs = []
    cold = terms.get(0, (0.0, 0.0, 0.0))  # a worker holding none of it: most of them, one lookup
    for slot in range(len(helds)):
        held = helds[slot]
        prefill_s, waited_s, charge_s = terms[held] if held else cold
        batch = batches[slot]
        wait_s = free_ats[slot] - now  # queue_s: the prefills placed there, ahead of it
        decode_s = expected_output * _added_step_s(a, b, c, d, e, batch, contexts[slot], prompt)
        if wait_s > 0.0:  # a queue: its terms price the overload
            costs.append(queue_weight * wait_s + prefill_s + batch * waited_s + decode_s + charge_s)
        else:
            costs.append(prefill_s + batch * waited_s + decode_s * tail_weight(steps[slot], fastest_step_s)
                         + charge_s)
    blocks = -(-request.num_tokens // cluster.block_size)
    evicting = [slot for slot, free in enumerate(cluster.free_by_slot) if free < blocks - helds[slot]]
    return costs, evicting


def wake_costs(cluster: ClusterState, now: float) -> dict[int, float]:
    """By slot, the wake term of each worker with nothing in flight (none where the
    profile has no wake points)."""
    cost = cluster.cost
    if not cost.wake:
        return {}
    return {slot: cost.wake_s(now - idle_since) for slot, idle_since in enumerate(cluster.idle_by_slot)
            if not cluster.batch_by_slot[slot]}


def _least(values: Iterable[float]) -> float:
    """min(values, default=0.0) without its call by keyword, which compiled code makes
    generic (the same comparisons, so the same float)."""
    least, found = 0.0, False
    for value in values:
        if not found or value < least:
            least, found = value, True
    return least


def recompute_weight(utilization: float) -> float:
    """Seconds of later requests' latency per second of compute a placement spends beyond
    the cheapest worker's, at the cluster's prefill utilization (in [0, 1))."""
    weight = WEIGHT_PER_UTILIZATION * utilization / (1.0 - utilization)
    return min(MAX_RECOMPUTE_WEIGHT, max(MIN_RECOMPUTE_WEIGHT, weight))


def tail_weight(step_s: float, fastest_step_s: float) -> float:
    """t(w): a worker's decode step (the batch the request would join) over the fastest
    worker's, at least 1.

    A sum of latencies is indifferent to who waits. Left alone, it piles a burst's hot
    prefix onto its holder: each request there slows a batch already slow a little, where
    a move would stall a smaller batch for a whole prefill, so the holder's batch grows
    while the burst lasts, and its requests make the p99 (docs/router.md §4.7). Weighting
    the decode terms by how slow the step already is there charges more for the seconds
    added to the requests nearest the tail. Only on a worker without a queue: where
    prefills wait, the queue terms price the overload, and weighting there too moved
    questions off their documents' holders (loogle at load 8, 4,000 requests: 1.23 / 1.29
    of lpm's mean / p99, against 0.95 / 0.88; docs/performance.md §2.4)."""
    if fastest_step_s <= 0.0 or step_s <= fastest_step_s:
        return 1.0
    return step_s / fastest_step_s


def added_decode_step_s(decode: LatencyFit, batch: int, context: int, prompt: int) -> float:
    """What a prompt of `prompt` tokens joining a decode batch of `batch` sequences with
    `context` tokens in all adds to one step summed over the sequences: its own step time,
    plus each sequence already there slowed by the larger batch, (n+1)·T(n+1) − n·T(n)."""
    return _added_step_s(decode.a, decode.b, decode.c, decode.d, decode.e, batch, context, prompt)


def _added_step_s(a: float, b: float, c: float, d: float, e: float, n: int, context: int, prompt: int) -> float:
    """added_decode_step_s written out for the fit's form T(n, ctx) = a + b·n + c·ctx +
    d·n·ctx + e·n² with ctx the mean context, on the fit's terms: the router runs it for
    every worker on every decision, and compiled, a call with unboxed numbers allocates
    nothing."""
    return a + b * (2 * n + 1) + c * prompt + d * (context + (n + 1) * prompt) + e * (3 * n * n + 3 * n + 1)
