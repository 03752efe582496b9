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
            + expected output · ΔD(w)       its decode in the batch it joins, and the
                                            others' slowdown: ΔD = (n+1)·T(n+1) − n·T(n)
            + k(ρ) · (P(w) − min P)         the compute a recompute spends beyond the best
                                            holder's: capacity later requests wait for,
                                            k = 2ρ/(1−ρ) within [0.5, 4], ρ the cluster's
                                            prefill utilization
            + k(ρ) · u · queue_s(w)         the share u of the prompt no worker holds
                                            becomes a new prefix where it goes: the
                                            requests that will share it wait out that
                                            queue too (or recompute it elsewhere)

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
estimate only where the prompt does not fit in the worker's free blocks.
"""
from __future__ import annotations

from common.cost_model import LatencyFit
from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback, ranked

# Compute spent recomputing what another worker holds is capacity no later request gets
# back: charged as recompute_weight(ρ) seconds of their latency per second spent, ρ the
# cluster's prefill utilization. The form is M/M/1's (the wait grows as ρ/(1−ρ)); the
# factor and the bounds were chosen on the sweep's seed 0 (docs/router.md §4.7).
WEIGHT_PER_UTILIZATION = 2.0
MIN_RECOMPUTE_WEIGHT = 0.5
MAX_RECOMPUTE_WEIGHT = 4.0


class CostAware(StatelessFeedback):
    name = "cost_aware"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> list[str]:
        costs = added_latency_s(request, cluster, now)
        # Equal costs (idle workers, none holding the prompt) go to the least windowed
        # work, E2's L: spreading new prefixes spreads what the caches must keep.
        loads = cluster.loads(now)
        return ranked(cluster, lambda worker_id: (costs[worker_id], loads[worker_id]))


def added_latency_s(request: Request, cluster: ClusterState, now: float) -> dict[str, float]:
    """Per worker id, the latency placing the request there adds, its own and that of
    the requests it slows or makes recompute, in seconds as the cost model predicts."""
    expected_output = cluster.expected_output(request)
    step_s = cluster.cost.prefill.a  # a step's fixed cost: paid by the decode step the prefill joins
    decode = cluster.cost.decode
    blocks = -(-request.num_tokens // cluster.block_size)
    prefill_by_held: dict[int, float] = {}
    for worker_id in cluster.worker_ids:
        held = request.matched.get(worker_id, 0)
        if held not in prefill_by_held:
            prefill_by_held[held] = cluster.held_prefill_s(request, held)
    least_prefill_s = min(prefill_by_held.values(), default=0.0)
    weight = recompute_weight(cluster.prefill_utilization(now))
    queue_weight = 1.0 + weight * (1.0 - request.best_cached_tokens / max(request.num_tokens, 1))
    costs: dict[str, float] = {}
    for worker_id in cluster.worker_ids:
        held = request.matched.get(worker_id, 0)
        prefill_s = prefill_by_held[held]
        worker = cluster.workers[worker_id]
        batch = len(worker.in_flight)
        cost = queue_weight * cluster.queue_s(worker_id, now) + prefill_s + batch * max(0.0, prefill_s - step_s) \
            + expected_output * added_decode_step_s(decode, batch, worker.prompt_tokens_sum, request.num_tokens) \
            + weight * (prefill_s - least_prefill_s)
        if cluster.free_blocks[worker_id] < blocks - held:
            cost += cluster.eviction_cost_s(request, worker_id, now, per_hit=False)
        costs[worker_id] = cost
    return costs


def recompute_weight(utilization: float) -> float:
    """Seconds of later requests' latency per second of compute a placement spends beyond
    the cheapest worker's, at the cluster's prefill utilization (in [0, 1))."""
    weight = WEIGHT_PER_UTILIZATION * utilization / (1.0 - utilization)
    return min(MAX_RECOMPUTE_WEIGHT, max(MIN_RECOMPUTE_WEIGHT, weight))


def added_decode_step_s(decode: LatencyFit, batch: int, context: int, prompt: int) -> float:
    """What a prompt of `prompt` tokens joining a decode batch of `batch` sequences with
    `context` tokens in all adds to one step summed over the sequences: its own step time,
    plus each sequence already there slowed by the larger batch, (n+1)·T(n+1) − n·T(n).

    Written out for the fit's form T(n, ctx) = a + b·n + c·ctx + d·n·ctx + e·n² with ctx
    the mean context: the router runs this per worker per decision."""
    n = batch
    return (decode.a + decode.b * (2 * n + 1) + decode.c * prompt + decode.d * (context + (n + 1) * prompt)
            + decode.e * (3 * n * n + 3 * n + 1))
