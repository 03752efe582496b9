"""`svc plan`: DistServe's search for the prefill/decode split with the best goodput per GPU (docs/evaluation.md §4).

A plan is a prefill pool of g_p GPUs and a decode pool of g_d GPUs (instances × tensor-
parallel degree each). With Γ_p and Γ_d the per-GPU goodputs of one instance of each
phase, the plan serves

    Γ(g_p, g_d) = min(g_p·Γ_p, g_d·Γ_d) / (g_p + g_d)   requests/s per GPU,

since every request passes through both pools and the slower pool bounds the whole.
`search` tries every split with g_p + g_d ≤ the GPU budget (both ≥ 1, each a multiple of
its pool's tp) and, beside it, the best co-located deployment of the whole budget.

With per-phase goodputs given (`parse_capacities`, `--capacities`), `search` applies
that formula. Pools scale linearly there: n instances serve n times one instance's rate
(DistServe's assumption too).

Simulated (`search_layouts`, what `svc plan --profile --workload` runs): every layout of
a number of instances, all co-located or each P:D split, is simulated whole, with the
disaggregated simulator (the router's policy, the decode pairing, the KV transfer over
the chosen link, conditional local prefill), and its goodput is DistServe's: the highest
Poisson rate at which the target fraction (90 % by default) of requests meets both the
TTFT and the TPOT SLO, found by bracketing and bisection (`highest_passing_rate`). A
handed-off request's TPOT includes its transfer and its wait for the decode batch. The
best split is then compared with co-located per GPU.

Run length. A run too short for its rate is absorbed by the running batches and passes at
any rate, so each run holds enough requests for its arrivals to span STEADY_LIFETIMES
SLO-bound request lifetimes (run_length), between --num-requests and MAX_REQUESTS_FACTOR
times that. Backlogs near capacity still grow slowly, so estimates of long-reply
workloads stay optimistic (on the earlier per-phase planner, chat on a100/opt-13b gave
4.8 req/s at 3 lifetimes, 4.5 at 6, 4.0 at 12, 3.7 at 24). The bias is alike across
layouts, so the choice suffers less than the absolute numbers; a larger --num-requests
lengthens every run.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.cost_model import CostModel, load_cost_model
from common.profiles import (
    GPUS,
    MODELS,
    PREBLE_NAME,
    PREBLE_TP,
    TP_DEGREES,
    fits,
    roofline_profile,
)
from services.eval.disagg import (
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    layout_for_model,
    link_named,
)
from services.eval.report import Slo, meets_slo
from services.eval.sim_runner import GPU_BATCHED_TOKENS, default_kv_blocks, gpu_model_of
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads.arrivals import poisson, rate_for_load
from services.eval.workloads.base import WorkloadRequest

PHASES = ("prefill", "decode", "colocated")
PRECISION = 0.03  # the bisection stops when the bracket is within 3% (hi / lo ≤ 1.03)
MAX_BRACKET_STEPS = 10  # doublings (or halvings) of the start rate before giving up
STEADY_LIFETIMES = 3  # a run's arrivals span at least this many request lifetimes (run_length)
MAX_REQUESTS_FACTOR = 10  # the longest run: this many times the shortest (--num-requests)
TIE_TOLERANCE = 1e-9  # relative: goodputs closer than this are a tie


class PlanError(ValueError):
    """Input the planner cannot plan for; the text says what is wrong."""


@dataclass(frozen=True)
class PhaseGoodputs:
    """Per-GPU goodput (requests/s per GPU) of one instance of each phase, keyed by the
    instance's tensor-parallel degree. A degree missing from a phase is not a candidate
    for that phase."""

    prefill: Mapping[int, float]
    decode: Mapping[int, float]
    colocated: Mapping[int, float]


@dataclass(frozen=True)
class Pool:
    """`instances` instances of `tp` GPUs each, serving `goodput_per_gpu` requests/s per GPU."""

    instances: int
    tp: int
    goodput_per_gpu: float

    @property
    def gpus(self) -> int:
        return self.instances * self.tp

    def to_json(self) -> dict:
        return {"instances": self.instances, "tp": self.tp, "gpus": self.gpus,
                "goodput_per_gpu": self.goodput_per_gpu}


@dataclass(frozen=True)
class Plan:
    """The chosen split, its Γ, and the best co-located use of the whole budget.

    `prefill.goodput_per_gpu` and `decode.goodput_per_gpu` are each pool's own Γ_p and
    Γ_d; `colocated.goodput_per_gpu` is per GPU of the whole budget (GPUs its tp degree
    leaves over count, idle)."""

    prefill: Pool
    decode: Pool
    goodput_per_gpu: float
    colocated: Pool
    budget: int

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    def to_json(self) -> dict:
        return {"prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
                "goodput_per_gpu": self.goodput_per_gpu, "gpus": self.gpus, "budget_gpus": self.budget,
                "colocated": self.colocated.to_json()}


# ---- the search ------------------------------------------------------------------------


def disaggregated_goodput(prefill_gpus: int, prefill_per_gpu: float, decode_gpus: int,
                          decode_per_gpu: float) -> float:
    """Γ = min(g_p·Γ_p, g_d·Γ_d) / (g_p + g_d): requests/s per GPU of the two pools together."""
    return min(prefill_gpus * prefill_per_gpu, decode_gpus * decode_per_gpu) / (prefill_gpus + decode_gpus)


def search(goodputs: PhaseGoodputs, gpus: int) -> Plan:
    """The split of at most `gpus` GPUs with the highest Γ, and the co-located alternative.

    Ties (within TIE_TOLERANCE) go, in order, to the plan with the fewest GPUs (the same
    goodput per GPU from a smaller unit, which the rest of the budget can replicate),
    the smaller prefill tp, the smaller decode tp, then the larger prefill pool.
    PlanError when no split fits: the budget is below 2 or no degree fits beside the
    other pool.
    """
    best: tuple[float, int, int, int, int] | None = None
    for prefill_gpus, prefill_tp, decode_gpus, decode_tp in _splits(goodputs, gpus):
        value = disaggregated_goodput(prefill_gpus, goodputs.prefill[prefill_tp], decode_gpus,
                                      goodputs.decode[decode_tp])
        if best is None or value > best[0] * (1 + TIE_TOLERANCE):
            best = (value, prefill_gpus, prefill_tp, decode_gpus, decode_tp)
    if best is None:
        raise PlanError(f"no prefill/decode split fits in {gpus} GPUs: prefill tp degrees "
                        f"{sorted(goodputs.prefill)}, decode tp degrees {sorted(goodputs.decode)}")
    value, prefill_gpus, prefill_tp, decode_gpus, decode_tp = best
    return Plan(Pool(prefill_gpus // prefill_tp, prefill_tp, goodputs.prefill[prefill_tp]),
                Pool(decode_gpus // decode_tp, decode_tp, goodputs.decode[decode_tp]),
                value, best_colocated(goodputs.colocated, gpus), gpus)


def _splits(goodputs: PhaseGoodputs, gpus: int) -> Iterator[tuple[int, int, int, int]]:
    """(g_p, tp_p, g_d, tp_d) for every split of at most `gpus` GPUs, in `search`'s
    order of preference among ties."""
    for total in range(2, gpus + 1):
        for prefill_tp in sorted(goodputs.prefill):
            for decode_tp in sorted(goodputs.decode):
                for prefill_gpus in range(total - decode_tp, 0, -1):
                    decode_gpus = total - prefill_gpus
                    if prefill_gpus % prefill_tp == 0 and decode_gpus % decode_tp == 0:
                        yield prefill_gpus, prefill_tp, decode_gpus, decode_tp


def best_colocated(per_gpu: Mapping[int, float], gpus: int) -> Pool:
    """All `gpus` GPUs as co-located instances of the tp degree that serves most; its
    goodput per GPU is over the whole budget. Ties go to the smaller tp."""
    candidates = [(gpus // tp * tp / gpus * rate, tp) for tp, rate in sorted(per_gpu.items()) if tp <= gpus]
    if not candidates:
        raise PlanError(f"no co-located tp degree fits in {gpus} GPUs: {sorted(per_gpu)}")
    value, tp = candidates[0]
    for candidate_value, candidate_tp in candidates[1:]:
        if candidate_value > value * (1 + TIE_TOLERANCE):
            value, tp = candidate_value, candidate_tp
    return Pool(gpus // tp, tp, value)


# ---- capacities given ------------------------------------------------------------------


def parse_capacities(text: str) -> PhaseGoodputs:
    """`prefill=5.6,decode=10,colocated=1.6`: per-GPU goodputs of tp-1 instances (all three
    phases, each once, each > 0). PlanError naming the bad part otherwise."""
    values: dict[str, float] = {}
    for part in (piece.strip() for piece in text.split(",")):
        name, sep, number = (side.strip() for side in part.partition("="))
        if not sep or not name:
            raise PlanError(f"{part!r} is not NAME=NUMBER (names: {', '.join(PHASES)})")
        if name not in PHASES:
            raise PlanError(f"{part!r}: unknown phase {name!r} (names: {', '.join(PHASES)})")
        if name in values:
            raise PlanError(f"{part!r}: {name} is given twice")
        try:
            value = float(number)
        except ValueError:
            raise PlanError(f"{part!r}: {number!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise PlanError(f"{part!r}: a capacity must be a finite number > 0")
        values[name] = value
    missing = [name for name in PHASES if name not in values]
    if missing:
        raise PlanError(f"missing {', '.join(missing)} (give all of {', '.join(PHASES)})")
    return PhaseGoodputs(*({1: values[name]} for name in PHASES))


# ---- capacities simulated --------------------------------------------------------------


def instance_profiles(spec: str) -> dict[int, CostModel]:
    """tp degree → cost model of one instance, for the profile file or name `spec`.

    An analytic name without /tp<N> ("a100/opt-13b") gives every degree whose weights fit;
    with one, only that degree. Preble's profile is tp PREBLE_TP; a profile file is one
    instance on one GPU (tp 1). ProfileError (listing the known names) for anything else.
    """
    if not spec.strip():
        raise PlanError("no profile given")
    if Path(spec).is_file():
        return {1: load_cost_model(spec)}
    cost = load_cost_model(spec)  # a built-in name from here on; ProfileError otherwise
    key = spec.strip().lower()
    if key == PREBLE_NAME:
        return {PREBLE_TP: cost}
    gpu_key, model_key, *tp = key.split("/")
    if tp:
        return {int(tp[0].removeprefix("tp")): cost}
    gpu, model = GPUS[gpu_key], MODELS[model_key]
    return {degree: roofline_profile(gpu_key, model_key, degree)[0] for degree in TP_DEGREES
            if fits(gpu, model, degree)}


def lifetime_s(requests: Sequence[WorkloadRequest], slo: Slo) -> float:
    """The longest a request may live and still meet its SLO, on average over the
    sample: the TTFT target plus (output tokens − 1) × the TPOT target."""
    decode_s = slo.tpot_s * sum(max(r.output_tokens - 1, 0) for r in requests) / len(requests)
    return slo.ttft_s + decode_s


def run_length(lifetime: float, rate: float, min_requests: int, available: int) -> int:
    """How many requests a run at `rate` needs: enough that their arrivals span
    STEADY_LIFETIMES request lifetimes, so that a cluster that cannot keep up builds a
    backlog that shows in the SLOs (a run shorter than that is absorbed by the running
    batches, however high the rate); at least `min_requests`, at most `available`."""
    needed = math.ceil(STEADY_LIFETIMES * rate * lifetime)
    return min(max(min_requests, needed), available)


def highest_passing_rate(passes: Callable[[float], bool], start: float, precision: float = PRECISION,
                         max_steps: int = MAX_BRACKET_STEPS) -> float:
    """The highest rate at which `passes` holds, assuming it holds below some rate only.

    Brackets from `start`: doubles while it passes (or halves while it fails), at most
    `max_steps` times, then bisects (geometrically) until hi/lo ≤ 1 + precision and
    returns lo. 0.0 when even start / 2**max_steps fails; start·2**max_steps when that
    still passes. At most 2·max_steps + log2(log(2)/log(1 + precision)) + 2 calls.
    """
    low: float | None
    high: float | None
    if passes(start):
        low, high = start, None
        for _ in range(max_steps):
            if not passes(low * 2):
                high = low * 2
                break
            low *= 2
        if high is None:
            return low
    else:
        low, high = None, start
        for _ in range(max_steps):
            if passes(high / 2):
                low = high / 2
                break
            high /= 2
        if low is None:
            return 0.0
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if passes(middle) else (low, middle)
    return low


# ---- simulated pools -------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """`colocated` co-located instances, or a prefill pool of `prefill` and a decode pool of
    `decode` instances; every instance has the same tensor-parallel degree."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def instances(self) -> int:
        return self.colocated + self.prefill + self.decode

    @property
    def label(self) -> str:
        return f"{self.prefill}P:{self.decode}D" if self.decode else f"{self.colocated} co-located"


@dataclass(frozen=True)
class LayoutGoodput:
    """A layout's goodput: the highest Poisson rate (requests/s) at which the target
    fraction of requests meets both SLOs, and that per GPU."""

    layout: Layout
    tp: int
    goodput_rps: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / (self.layout.instances * self.tp)

    def to_json(self) -> dict:
        layout = self.layout
        return {"layout": layout.label, "colocated": layout.colocated, "prefill": layout.prefill,
                "decode": layout.decode, "tp": self.tp, "gpus": layout.instances * self.tp,
                "goodput_rps": self.goodput_rps, "goodput_per_gpu": self.goodput_per_gpu}


@dataclass(frozen=True)
class PoolPlan:
    """Every layout tried, the best P:D split among them, and the co-located one."""

    candidates: tuple[LayoutGoodput, ...]
    link: str
    target: float

    @property
    def colocated(self) -> LayoutGoodput:
        return next(c for c in self.candidates if not c.layout.decode)

    @property
    def best_split(self) -> LayoutGoodput:
        """The split with the highest goodput per GPU; a tie goes to the one tried first
        (fewer prefill instances)."""
        best = None
        for candidate in self.candidates:
            if candidate.layout.decode and (best is None or candidate.goodput_per_gpu >
                                            best.goodput_per_gpu * (1 + TIE_TOLERANCE)):
                best = candidate
        assert best is not None  # search_layouts tries every P:D split of its >= 2 instances
        return best

    @property
    def winner(self) -> str:
        """"disaggregated" when the best split beats co-located by more than a tie."""
        split, colocated = self.best_split, self.colocated
        return "disaggregated" if split.goodput_per_gpu > colocated.goodput_per_gpu * (1 + TIE_TOLERANCE) \
            else "colocated"

    def to_json(self) -> dict:
        return {"link": self.link, "attainment": self.target, "winner": self.winner,
                "best_split": self.best_split.to_json(), "colocated": self.colocated.to_json(),
                "candidates": [c.to_json() for c in self.candidates]}


def base_config(cost: CostModel, link: str, policy: str = "e2",
                max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS) -> SimConfig:
    """The simulator settings every layout of a search shares: a profile that names its GPU
    and model (the KV blocks its memory holds, the model's KV bytes per block), the link,
    the router's policy and the local-prefill threshold; `search_layouts` sets the counts.
    PlanError for a profile that names no model or an unknown link."""
    named = gpu_model_of(cost)
    if named is None:
        raise PlanError(f"profile {cost.name!r} names no model to size KV transfers by: give a built-in name "
                        f"such as a6000/mistral-7b")
    try:
        chosen = link_named(link)
    except ValueError as error:
        raise PlanError(str(error)) from None
    block_size = SimConfig.block_size
    return SimConfig(workers=1, policy=policy, cost=cost, link=chosen,
                     kv_bytes_per_block=layout_for_model(named[1], block_size).bytes_per_block,
                     max_local_prefill_tokens=max_local_prefill_tokens,
                     kv_blocks=default_kv_blocks(cost, block_size), max_num_batched_tokens=GPU_BATCHED_TOKENS)


def layouts(instances: int) -> list[Layout]:
    """All `instances` co-located, then every P:D split of them (1P first)."""
    if instances < 2:
        raise PlanError(f"a prefill/decode split needs at least 2 instances, got {instances}")
    return [Layout(colocated=instances)] + [Layout(prefill=p, decode=instances - p) for p in range(1, instances)]


def cluster_attainment(base: SimConfig, layout: Layout, requests: Sequence[WorkloadRequest], rate: float,
                       slo: Slo, seed: int) -> float:
    """The fraction of `requests`, arriving as Poisson at `rate`, that the simulated
    cluster of `layout` (and `base`'s other settings) serves within both SLOs."""
    config = dataclasses.replace(base, workers=layout.colocated, prefill_workers=layout.prefill,
                                 decode_workers=layout.decode)
    result = simulate(poisson(list(requests), rate, seed), config)
    return sum(meets_slo(record, slo) for record in result.records) / len(result.records)


def layout_goodput(base: SimConfig, layout: Layout, tp: int, requests: Sequence[WorkloadRequest], slo: Slo,
                   target: float, min_requests: int, seed: int = 0, precision: float = PRECISION) -> LayoutGoodput:
    """DistServe's goodput of one layout: the highest rate at which SLO attainment is at
    least `target`, by highest_passing_rate from the rate of load 1 on its instances. Each
    run takes the first run_length requests of the sample `requests`."""
    lifetime = lifetime_s(requests[:min_requests], slo)

    def passes(rate: float) -> bool:
        count = run_length(lifetime, rate, min_requests, len(requests))
        return cluster_attainment(base, layout, requests[:count], rate, slo, seed) >= target

    start = rate_for_load(requests[:min_requests], 1.0, layout.instances, base.cost)
    return LayoutGoodput(layout, tp, highest_passing_rate(passes, start, precision))


def search_layouts(base: SimConfig, tp: int, instances: int, requests: Sequence[WorkloadRequest], slo: Slo,
                   target: float, min_requests: int, seed: int = 0, link_name: str = "",
                   precision: float = PRECISION) -> PoolPlan:
    """The goodput of every layout of `instances` instances (co-located and each P:D
    split), each simulated whole with `base`'s link and KV layout."""
    if min_requests < 1 or len(requests) < min_requests:
        raise PlanError(f"need a sample of at least min_requests = {min_requests} >= 1 requests, "
                        f"got {len(requests)}")
    candidates = tuple(layout_goodput(base, layout, tp, requests, slo, target, min_requests, seed, precision)
                       for layout in layouts(instances))
    return PoolPlan(candidates, link_name or base.link.name, target)
