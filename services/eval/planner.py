"""`svc plan`: DistServe's search for the prefill/decode split with the best goodput per GPU (docs/evaluation.md §4).

A plan is a prefill pool of g_p GPUs and a decode pool of g_d GPUs (instances × tensor-
parallel degree each). With Γ_p and Γ_d the per-GPU goodputs of one instance of each
phase, the plan serves

    Γ(g_p, g_d) = min(g_p·Γ_p, g_d·Γ_d) / (g_p + g_d)   requests/s per GPU,

since every request passes through both pools and the slower pool bounds the whole.
`search` tries every split with g_p + g_d ≤ the GPU budget (both ≥ 1, each a multiple of
its pool's tp) and, beside it, the best co-located deployment of the whole budget.

Per-phase goodputs come either from given capacities (`parse_capacities`) or from the
simulator (`simulated_goodputs`): one instance per phase and tp degree, the highest
Poisson rate at which SLO attainment reaches the target, found by bracketing and
bisection (`highest_passing_rate`). Pools scale linearly: n instances serve n times one
instance's rate (DistServe's assumption too; the router's placement across instances is
not simulated).

The simulator has co-located workers only until disaggregation lands, so the phases are
APPROXIMATED with it, not simulated as DistServe does:
  * prefill pool: the workload's requests each generate one token on a plain simulated
    worker; only the TTFT SLO counts.
  * decode pool: the requests arrive with their prompt's KV as good as present: the
    worker's cost model keeps the profile's decode fit and a prefill fit of
    PREFILL_FREE_S_PER_TOKEN only, so a prompt's prefill is ~free; only the TPOT SLO
    counts, measured from arrival (the first token came from the prefill pool), so
    waiting for a batch slot counts against it.
  * co-located: the plain simulation, both SLOs.
The KV transfer from prefill to decode instances is not modelled yet (free and
instantaneous), and neither is a GPU's KV memory (the simulator's default block count per
worker, whatever the profile's GPU). Replace this module's phase models with the P/D
simulator when it exists.

Run length. A run too short for its rate is absorbed by the running batch and passes at
any rate, so each run holds enough requests for its arrivals to span STEADY_LIFETIMES
SLO-bound request lifetimes (run_length), between --num-requests and MAX_REQUESTS_FACTOR
times that. Backlogs near capacity still grow slowly, so estimates of long-reply
workloads stay optimistic: chat (251-token replies) on a100/opt-13b, TTFT 0.25 s / TPOT
0.1 s, decode tp1 gave 4.8 req/s at 3 lifetimes, 4.5 at 6, 4.0 at 12, 3.7 at 24. The
bias is alike across phases and degrees, so the choice of split suffers less than the
absolute numbers; a larger --num-requests lengthens every run.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.cost_model import CostModel, LatencyFit, load_cost_model
from common.profiles import GPUS, MODELS, PREBLE_NAME, PREBLE_TP, TP_DEGREES, fits, roofline_profile
from services.eval.report import RequestRecord, Slo, e2e_of, is_completed, meets_slo
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads.arrivals import poisson, rate_for_load
from services.eval.workloads.base import WorkloadRequest

PHASES = ("prefill", "decode", "colocated")
PRECISION = 0.03  # the bisection stops when the bracket is within 3% (hi / lo ≤ 1.03)
MAX_BRACKET_STEPS = 10  # doublings (or halvings) of the start rate before giving up
STEADY_LIFETIMES = 3  # a run's arrivals span at least this many request lifetimes (run_length)
MAX_REQUESTS_FACTOR = 10  # the longest run: this many times the shortest (--num-requests)
PREFILL_FREE_S_PER_TOKEN = 1e-9  # the decode pool's prefill: 2 µs for a 2,048-token chunk
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


@dataclass(frozen=True)
class PhaseModel:
    """One `phase` instance approximated on the co-located simulator (module docstring):
    the requests it serves (the whole sample; a run takes a prefix), its cost model, and
    the SLO targets that count for it (math.inf where a target does not count)."""

    phase: str
    requests: list[WorkloadRequest]
    cost: CostModel
    ttft_s: float
    tpot_s: float

    def meets(self, record: RequestRecord) -> bool:
        """Completed within the phase's targets. A decode instance's requests had their
        first token from the prefill pool when they arrived, so their TPOT runs from
        arrival: time waiting for a batch slot counts against it."""
        if self.phase != "decode":
            return meets_slo(record, Slo(self.ttft_s, self.tpot_s))
        if not is_completed(record) or record.output_tokens <= 1:
            return is_completed(record)
        return e2e_of(record) / (record.output_tokens - 1) <= self.tpot_s

    @property
    def lifetime_s(self) -> float:
        """The longest a request may live on this instance and still meet its targets, on
        average over the sample: the time that counts against TTFT, plus (output tokens − 1)
        × TPOT where TPOT counts."""
        decode_s = 0.0 if math.isinf(self.tpot_s) else \
            self.tpot_s * sum(max(r.output_tokens - 1, 0) for r in self.requests) / len(self.requests)
        return (0.0 if math.isinf(self.ttft_s) else self.ttft_s) + decode_s


def phase_model(phase: str, requests: Sequence[WorkloadRequest], cost: CostModel, slo: Slo) -> PhaseModel:
    """The requests, cost model and targets that approximate one `phase` instance."""
    if phase == "prefill":
        return PhaseModel(phase, [dataclasses.replace(r, output_tokens=1) for r in requests], cost,
                          slo.ttft_s, math.inf)
    if phase == "decode":
        free = CostModel(f"{cost.name}/prefill-free", LatencyFit(0.0, PREFILL_FREE_S_PER_TOKEN), cost.decode)
        return PhaseModel(phase, list(requests), free, math.inf, slo.tpot_s)
    if phase == "colocated":
        return PhaseModel(phase, list(requests), cost, slo.ttft_s, slo.tpot_s)
    raise PlanError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")


def run_length(model: PhaseModel, rate: float, min_requests: int) -> int:
    """How many requests a run at `rate` needs: enough that their arrivals span
    STEADY_LIFETIMES request lifetimes (model.lifetime_s), so that an instance that
    cannot keep up builds a backlog that shows in the SLOs (a run shorter than that is
    absorbed by the running batch, however high the rate); at least `min_requests`, at
    most the whole sample."""
    needed = math.ceil(STEADY_LIFETIMES * rate * model.lifetime_s)
    return min(max(min_requests, needed), len(model.requests))


def attainment_at(model: PhaseModel, rate: float, num_requests: int, seed: int) -> float:
    """SLO attainment of one simulated instance serving the first `num_requests` of the
    sample under Poisson arrivals at `rate` requests/s. Every run uses the same seed, so
    a run's arrivals are a prefix of a longer run's, stretched in time."""
    requests = poisson(model.requests[:num_requests], rate, seed)
    result = simulate(requests, SimConfig(workers=1, policy="round_robin", cost=model.cost))
    return sum(model.meets(record) for record in result.records) / len(result.records)


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


def instance_goodput(model: PhaseModel, target: float, min_requests: int, seed: int) -> float:
    """Goodput (requests/s) of one instance: the highest Poisson rate at which the
    fraction of requests meeting the phase's targets is ≥ `target`, each run as long as
    run_length says. The search starts at the rate rate_for_load gives for load 1 on one
    instance of the phase's own cost model."""
    start = rate_for_load(model.requests[:min_requests], 1.0, 1, model.cost)
    return highest_passing_rate(
        lambda rate: attainment_at(model, rate, run_length(model, rate, min_requests), seed) >= target, start)


def simulated_goodputs(profiles: Mapping[int, CostModel], requests: Sequence[WorkloadRequest], slo: Slo,
                       target: float, gpus: int, min_requests: int, seed: int = 0) -> PhaseGoodputs:
    """Per-GPU goodput of each phase at each tp degree of `profiles` that can take part in
    a plan of `gpus` GPUs (a pool needs tp ≤ gpus − 1, so the other pool has a GPU; the
    co-located alternative tp ≤ gpus): one instance's goodput over its tp. `requests` is
    the sample runs take their prefixes of (its length bounds a run; at least
    `min_requests`), e.g. MAX_REQUESTS_FACTOR × min_requests of a workload."""
    if min_requests < 1 or len(requests) < min_requests:
        raise PlanError(f"need a sample of at least min_requests = {min_requests} >= 1 requests, "
                        f"got {len(requests)}")
    limits = {"prefill": gpus - 1, "decode": gpus - 1, "colocated": gpus}
    per_phase = {phase: {tp: instance_goodput(phase_model(phase, requests, cost, slo), target, min_requests, seed)
                         / tp for tp, cost in sorted(profiles.items()) if tp <= limits[phase]}
                 for phase in PHASES}
    return PhaseGoodputs(**per_phase)
