"""`cost_aware`: the worker with the least predicted latency for this request (docs/router.md §4.7).

E2's idea (place by prefix, price load, recompute and eviction in seconds) without its
ratio triggers. For each worker w, from the cost model (ClusterState, docs/router.md §3):

    cost(w) = queue_s(w)                      the prefills already placed there, ahead of it
            + held_prefill_s(matched blocks)  what w lacks of the prompt (store fetches priced)
            + eviction_cost_s(w)              hit-weighted recompute of what it would evict
            + expected output × ΔD(w)        its decode, and the others' slowdown, in the
                                              batch it would join: ΔD = (n+1)·T(n+1) − n·T(n)

and the ranking is by ascending cost, ties by worker id. The three rules E2 states as
triggers fall out of the one comparison, each firing on seconds, not on ratios:
  * overload: a holder whose queue exceeds what the prompt costs to recompute elsewhere
    loses the request; a holder with a high load ratio but a short queue keeps it;
  * replication: a hot prefix goes to a second worker on the first request for which its
    holders' queue exceeds the recompute there, and the placement makes that worker a
    holder at once (ClusterState.place credits the blocks), so no ramp;
  * a long private context stays: moving it costs its full recompute, which a queue must
    exceed before the comparison moves it.
Work per decision is O(workers): one prefill time per distinct held depth, an eviction
estimate only where the prompt does not fit in the worker's free blocks.
"""
from __future__ import annotations

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback, ranked


class CostAware(StatelessFeedback):
    name = "cost_aware"

    def choose(self, request: Request, cluster: ClusterState, now: float) -> list[str]:
        costs = predicted_latency_s(request, cluster, now)
        return ranked(cluster, costs.__getitem__)


def predicted_latency_s(request: Request, cluster: ClusterState, now: float) -> dict[str, float]:
    """Per worker id, the seconds from now to this request's last token if placed there
    (plus the recompute its evictions would cause others), as the cost model predicts."""
    expected_output = cluster.expected_output(request)
    blocks = -(-request.num_tokens // cluster.block_size)
    prefill_by_held: dict[int, float] = {}
    costs: dict[str, float] = {}
    for worker_id in cluster.worker_ids:
        held = request.matched.get(worker_id, 0)
        prefill_s = prefill_by_held.get(held)
        if prefill_s is None:
            prefill_s = prefill_by_held[held] = cluster.held_prefill_s(request, held)
        cost = cluster.queue_s(worker_id, now) + prefill_s \
            + expected_output * added_decode_step_s(request, cluster, worker_id)
        if cluster.free_blocks[worker_id] < blocks - held:
            cost += cluster.eviction_cost_s(request, worker_id, now)
        costs[worker_id] = cost
    return costs


def added_decode_step_s(request: Request, cluster: ClusterState, worker_id: str) -> float:
    """What joining the worker's decode batch adds to the seconds per step summed over
    its sequences: its own step time, plus each sequence already there slowed by the
    larger batch, (n + 1)·T(n + 1) − n·T(n). Times the output length, the latency the
    cluster's requests gain together, mean latency being what placement minimises."""
    worker = cluster.workers[worker_id]
    batch = len(worker.in_flight)
    joined = (batch + 1) * cluster.tpot_s(request, worker_id)
    if not batch:
        return joined
    return joined - batch * cluster.cost.decode_step_s(batch, worker.prompt_tokens_sum / batch)
