"""The work behind `svc sim` (services/eval/sim_command.py): build a workload once per
setting, simulate it under each placement policy, and report the summaries.

A setting is a SimSpec. Its defaults, resolved by `resolve`:
  * arrivals: the workload's own times ("trace") for mooncake, Poisson otherwise;
  * rate: --rate, else rate_for_load(requests, --load or DEFAULT_LOAD, instances, cost),
    instances counting co-located, prefill and decode workers alike.
    With trace arrivals, a rate or load rescales the trace's times so that its mean rate
    (requests / span of arrivals) is the target; without one the trace keeps its times
    (times --time-scale);
  * kv_blocks and max_num_batched_tokens: a profile that names a GPU and a model (the
    built-in "<gpu>/<model>[/tpN]" profiles and Preble's) gets the KV blocks its GPUs'
    memory holds (KV_MEMORY_UTILIZATION of it, less the weights) and 8,192 batched tokens
    per step; any other profile (a file, the tiny CPU default) gets DEFAULT_KV_BLOCKS and
    2,048 (the engine's default).
A sweep replaces one variable of the setting per value: load or rate (both are replaced,
so the value alone sets the arrival rate), workers, zipf (toolbench's zipf_a) or scale.
Disaggregated pools (--prefill-workers, --decode-workers) need a profile that names its
model: the KV transfer's bytes come from that model's layout (disagg.layout_for_model).

The KV store (--store-dram-gb, --store-ssd-gb; SimSpec.store) needs a profile that names
its model too (a block's bytes). With a store each policy runs twice, without it (keyed
POLICY, exactly the run without store options) and with it (keyed POLICY+store), so the
table and the JSON compare them side by side; store_baseline=False runs only the latter.

Progress counts simulated requests (finished or refused) across every setting and policy.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import inspect
import json
import math
import multiprocessing
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import INDEX_MODES, ClusterConfig
from common.cost_model import CostModel
from common.engine.config import QUEUE_POLICIES
from common.profiles import BYTES_PER_VALUE, GIB, GPUS, MODELS, PREBLE_NAME, PREBLE_TP
from services.eval.disagg import (
    DEFAULT_LINK,
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    LINKS,
    layout_for_model,
)
from services.eval.report import (
    Slo,
    json_line,
    mean,
    percentile,
    plot_sweep,
    print_table,
    reported,
    summarize,
)
from services.eval.sim_store import StoreModel
from services.eval.simulator import SimConfig, Simulator, decode_alone_s
from services.eval.workloads import WORKLOADS, WorkloadRequest, make_workload
from services.eval.workloads.arrivals import bursty, poisson, rate_for_load, trace
from services.router.policies import POLICIES

DEFAULT_NUM_REQUESTS = 1000  # generated workloads; a trace replays all its records by default
DEFAULT_LOAD = 0.8
DEFAULT_KV_BLOCKS = 32_768
GPU_BATCHED_TOKENS = 8192
OTHER_BATCHED_TOKENS = 2048
KV_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
SWEEP_VARIABLES = ("load", "rate", "workers", "zipf", "scale")
COMMON_WORKLOAD_KEYWORDS = ("vocab_size", "scale", "trace")  # make_workload's own, not --option's
_ANALYTIC_NAME = re.compile(r"(?P<gpu>[a-z0-9]+)/(?P<model>[a-z0-9.-]+)/tp(?P<tp>\d+)")


class SimUsageError(ValueError):
    """Options that do not make a valid run; the message names the option."""


@dataclass(frozen=True)
class SimSpec:
    """One setting to simulate under each of `policies`. None means "the default" (the
    module docstring); `resolve` fills those in."""

    workload: str
    policies: tuple[str, ...]
    workers: int
    cost: CostModel
    trace: str | None = None
    num_requests: int | None = None
    seed: int = 0
    arrival: str | None = None  # poisson, bursty or trace
    rate: float | None = None
    load: float | None = None
    time_scale: float | None = None
    scale: float = 1.0
    options: tuple[tuple[str, int | float | str], ...] = ()  # the workload shape's keywords
    queue_policy: str = "fcfs"
    kv_blocks: int | None = None  # per worker
    max_num_batched_tokens: int | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    admission: bool = False
    index_mode: str = "events"
    prefill_workers: int = 0
    decode_workers: int = 0
    link: str = DEFAULT_LINK
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    store: StoreModel = StoreModel()  # both tiers 0: no store
    store_baseline: bool = True  # with a store: also run each policy without it

    @property
    def instances(self) -> int:
        return self.workers + self.prefill_workers + self.decode_workers

    def variants(self) -> tuple[tuple[str, str, bool], ...]:
        """(result key, policy, with the store) of each simulation of a point."""
        if not self.store.enabled:
            return tuple((policy, policy, False) for policy in self.policies)
        runs: list[tuple[str, str, bool]] = []
        for policy in self.policies:
            if self.store_baseline:
                runs.append((policy, policy, False))
            runs.append((f"{policy}+store", policy, True))
        return tuple(runs)


@dataclass(frozen=True)
class Sweep:
    variable: str
    values: tuple[tuple[str, float], ...]  # (the value as written, the number)


@dataclass(frozen=True)
class Point:
    """A resolved setting with its timed requests; `label` is the swept value as written
    ("" when not sweeping)."""

    label: str
    value: float
    spec: SimSpec
    requests: list[WorkloadRequest]
    slos: Mapping[str, Slo]


# ---- parsing ---------------------------------------------------------------------------


def parse_policies(text: str) -> tuple[str, ...]:
    """"P[,P...]" as policy names; SimUsageError names an unknown one and lists POLICIES."""
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in POLICIES:
            raise SimUsageError(f"--policy: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise SimUsageError(f"--policy: a policy is named twice in {text!r}")
    return names


def parse_options(pairs: Iterable[str], zipf: float | None) -> tuple[tuple[str, int | float | str], ...]:
    """`--option key=value` pairs (values read as int, else float, else kept as text),
    plus zipf_a from --zipf; each key at most once."""
    options = [_parse_option(pair) for pair in pairs]
    if zipf is not None:
        options.append(("zipf_a", zipf))
    keys = [key for key, _ in options]
    for key in keys:
        if keys.count(key) > 1:
            raise SimUsageError(f"--option: {key} is given twice (--zipf sets zipf_a)")
    return tuple(options)


def _parse_option(pair: str) -> tuple[str, int | float | str]:
    key, sep, value = pair.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise SimUsageError(f"--option: expected KEY=VALUE, got {pair!r}")
    return key.strip(), _number(value.strip())


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_sweep(text: str) -> Sweep:
    """"VAR=a,b,c" with VAR one of SWEEP_VARIABLES and distinct numbers (integers for
    workers)."""
    variable, sep, values = text.partition("=")
    variable = variable.strip()
    if not sep or variable not in SWEEP_VARIABLES:
        raise SimUsageError(f"--sweep: expected VAR=a,b,c with VAR one of {', '.join(SWEEP_VARIABLES)}; "
                            f"got {text!r}")
    labels = [label.strip() for label in values.split(",")]
    numbers = [_sweep_value(variable, label) for label in labels]
    if len(set(numbers)) != len(numbers):
        raise SimUsageError(f"--sweep: a value of {variable} is given twice in {text!r}")
    return Sweep(variable, tuple(zip(labels, numbers)))


def _sweep_value(variable: str, label: str) -> float:
    number = _number(label)
    if isinstance(number, str) or not math.isfinite(number):
        raise SimUsageError(f"--sweep: {variable} value {label!r} is not a number")
    if variable == "workers" and (not isinstance(number, int) or number < 1):
        raise SimUsageError(f"--sweep: workers value {label!r} is not an integer >= 1")
    return number


def workload_source(workload: str | None, trace_path: str | None) -> tuple[str, str | None]:
    """(workload name, trace file) from --workload and --trace: a trace means mooncake."""
    if workload is None and trace_path is None:
        raise SimUsageError("give --workload NAME or --trace FILE")
    name = workload if workload is not None else "mooncake"
    if name not in WORKLOADS:
        raise SimUsageError(f"--workload: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if name == "mooncake" and trace_path is None:
        raise SimUsageError("the mooncake workload replays a trace: give --trace FILE")
    if name != "mooncake" and trace_path is not None:
        raise SimUsageError(f"--trace replays a Mooncake trace; it does not go with --workload {name}")
    return name, trace_path


# ---- settings --------------------------------------------------------------------------


def check(spec: SimSpec) -> None:
    """SimUsageError for options that contradict each other or name nothing known."""
    if spec.rate is not None and spec.load is not None:
        raise SimUsageError("give at most one of --rate and --load")
    if spec.time_scale is not None and arrival_of(spec) != "trace":
        raise SimUsageError("--time-scale applies to trace arrivals only")
    if spec.time_scale is not None and (spec.rate is not None or spec.load is not None):
        raise SimUsageError("give --time-scale or --rate/--load, not both (either sets the trace's pace)")
    if spec.queue_policy not in QUEUE_POLICIES:
        raise SimUsageError(f"--queue-policy: unknown {spec.queue_policy!r}; known: {', '.join(QUEUE_POLICIES)}")
    if spec.link not in LINKS:
        raise SimUsageError(f"--link: unknown {spec.link!r}; known: {', '.join(LINKS)}")
    if (spec.prefill_workers > 0) != (spec.decode_workers > 0):
        raise SimUsageError("--prefill-workers and --decode-workers go together (a prefill pool hands off to "
                            "a decode pool)")
    if spec.workers + spec.prefill_workers < 1:
        raise SimUsageError("no worker to prefill on: give --workers or --prefill-workers")
    if spec.decode_workers and gpu_model_of(spec.cost) is None:
        raise SimUsageError("disaggregated pools need a profile that names its model (e.g. h100/llama-3-8b): "
                            "the KV transfer's bytes come from its layout")
    if spec.store.enabled and gpu_model_of(spec.cost) is None:
        raise SimUsageError("the KV store (--store-dram-gb, --store-ssd-gb) needs a profile that names its model "
                            "(e.g. h100/llama-3-8b): a block's bytes come from its layout")
    if spec.store.enabled:
        _check_store(spec)
    if spec.index_mode not in INDEX_MODES:
        raise SimUsageError(f"--index-mode: unknown {spec.index_mode!r}; known: {', '.join(INDEX_MODES)}")
    accepted = workload_options(spec.workload)
    for key, _ in spec.options:
        if key not in accepted:
            raise SimUsageError(f"--option {key}: the {spec.workload} workload takes "
                                f"{', '.join(accepted) or 'no options'}")


def _check_store(spec: SimSpec) -> None:
    named = gpu_model_of(spec.cost)
    if named is None:
        return  # refused above
    block_bytes = layout_for_model(named[1], SimConfig.block_size).bytes_per_block
    for name, gb in spec.store.tiers():
        if gb * 1e9 < block_bytes:
            raise SimUsageError(f"--store-{name}-gb: {gb:g} GB holds no block of {named[1]} "
                                f"({block_bytes:,} bytes)")


def workload_options(name: str) -> tuple[str, ...]:
    """The keyword options of a workload shape's generator, beyond make_workload's own."""
    parameters = inspect.signature(WORKLOADS[name]).parameters.values()
    return tuple(p.name for p in parameters
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in COMMON_WORKLOAD_KEYWORDS)


def arrival_of(spec: SimSpec) -> str:
    if spec.arrival is not None:
        return spec.arrival
    return "trace" if spec.workload == "mooncake" else "poisson"


def gpu_model_of(cost: CostModel) -> tuple[str, str, int] | None:
    """(gpu, model, tensor-parallel degree) a profile is named for, or None."""
    if cost.name == PREBLE_NAME:
        return "h100", "llama-3-70b", PREBLE_TP
    match = _ANALYTIC_NAME.fullmatch(cost.name)
    if match is None or match["gpu"] not in GPUS or match["model"] not in MODELS:
        return None
    return match["gpu"], match["model"], int(match["tp"])


def default_kv_blocks(cost: CostModel, block_size: int) -> int:
    """KV blocks per worker: what KV_MEMORY_UTILIZATION of the named GPUs' memory holds
    beside the weights, or DEFAULT_KV_BLOCKS when the profile names no GPU and model."""
    named = gpu_model_of(cost)
    if named is None:
        return DEFAULT_KV_BLOCKS
    gpu, model = GPUS[named[0]], MODELS[named[1]]
    free = named[2] * gpu.memory_gib * GIB * KV_MEMORY_UTILIZATION - model.params * BYTES_PER_VALUE
    return max(1, int(free // (model.kv_bytes_per_token * block_size)))


def resolve(spec: SimSpec) -> SimSpec:
    """The spec with its defaults filled in (except rate, which needs the requests)."""
    named = gpu_model_of(spec.cost) is not None
    block_size = SimConfig.block_size
    return dataclasses.replace(
        spec,
        arrival=arrival_of(spec),
        kv_blocks=spec.kv_blocks or default_kv_blocks(spec.cost, block_size),
        max_num_batched_tokens=spec.max_num_batched_tokens or (GPU_BATCHED_TOKENS if named
                                                                else OTHER_BATCHED_TOKENS))


def swept(spec: SimSpec, variable: str, value: float) -> SimSpec:
    """`spec` with the swept variable set to `value`."""
    if variable == "load":
        return dataclasses.replace(spec, load=value, rate=None)
    if variable == "rate":
        return dataclasses.replace(spec, rate=value, load=None)
    if variable == "workers":
        return dataclasses.replace(spec, workers=int(value))
    if variable == "scale":
        return dataclasses.replace(spec, scale=value)
    options = tuple((key, v) for key, v in spec.options if key != "zipf_a") + (("zipf_a", value),)
    return dataclasses.replace(spec, options=options)


# ---- requests --------------------------------------------------------------------------


def prepare(spec: SimSpec, sweep: Sweep | None = None) -> list[Point]:
    """The points to simulate: one per swept value (one in all without a sweep), each
    with its timed requests. The workload is generated once per distinct (scale,
    options). SimUsageError for bad options; ValueError for bad data (a trace, a profile
    value) with the generator's message."""
    settings = [("", 0.0, spec)] if sweep is None else \
        [(label, value, swept(spec, sweep.variable, value)) for label, value in sweep.values]
    generated: dict[tuple, list[WorkloadRequest]] = {}
    points = []
    for label, value, setting in settings:
        check(setting)
        setting = resolve(setting)
        key = (setting.scale, setting.options)
        if key not in generated:
            generated[key] = _generate(setting)
        requests = timed(setting, generated[key])
        _check_fits(setting, requests)
        points.append(Point(label, value, setting, requests, slos_for(setting, requests)))
    return points


def _generate(spec: SimSpec) -> list[WorkloadRequest]:
    count = spec.num_requests if spec.num_requests is not None else (
        sys.maxsize if spec.trace is not None else DEFAULT_NUM_REQUESTS)
    options: dict[str, Any] = dict(spec.options)  # make_workload checks the shape's keywords
    requests = make_workload(spec.workload, count, spec.seed, scale=spec.scale, trace=spec.trace, **options)
    if not requests:
        raise ValueError(f"the {spec.workload} workload has no requests" +
                         (f" ({spec.trace} is empty)" if spec.trace else ""))
    return requests


def timed(spec: SimSpec, requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """The requests with the spec's arrival times (see the module docstring)."""
    if spec.arrival == "trace":
        return trace(requests, _time_scale(spec, requests))
    rate = spec.rate if spec.rate is not None else rate_for_load(
        requests, spec.load if spec.load is not None else DEFAULT_LOAD, spec.instances, spec.cost)
    arrive = poisson if spec.arrival == "poisson" else bursty
    return arrive(requests, rate, spec.seed)


def _time_scale(spec: SimSpec, requests: Sequence[WorkloadRequest]) -> float:
    if spec.rate is None and spec.load is None:
        return spec.time_scale if spec.time_scale is not None else 1.0
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    if span <= 0:
        raise SimUsageError("--rate/--load with trace arrivals rescale the workload's own times, but all its "
                            "requests arrive at once; use --arrival poisson or bursty")
    if spec.rate is not None:
        rate = spec.rate
    else:
        assert spec.load is not None  # neither given returned above
        rate = rate_for_load(requests, spec.load, spec.instances, spec.cost)
    if not rate > 0:
        raise SimUsageError(f"the arrival rate must be > 0, got {rate}")
    return len(requests) / span / rate


def _check_fits(spec: SimSpec, requests: Sequence[WorkloadRequest]) -> None:
    """A request larger than a worker's whole KV pool could never run."""
    longest = max(r.num_tokens + r.output_tokens for r in requests)
    assert spec.kv_blocks is not None  # a resolve()d spec
    capacity = spec.kv_blocks * SimConfig.block_size
    if longest > capacity:
        raise SimUsageError(f"--kv-blocks: {spec.kv_blocks} blocks hold {capacity} tokens per worker, but the "
                            f"longest request needs {longest} (prompt and output); raise --kv-blocks or "
                            f"lower --scale")


def slos_for(spec: SimSpec, requests: Sequence[WorkloadRequest]) -> dict[str, Slo]:
    """The same SLO for every class when either target is given (the other is then
    unbounded), else {} (no targets: every completed request meets its SLO)."""
    if spec.ttft_slo_s is None and spec.tpot_slo_s is None:
        return {}
    slo = Slo(spec.ttft_slo_s if spec.ttft_slo_s is not None else math.inf,
              spec.tpot_slo_s if spec.tpot_slo_s is not None else math.inf)
    return dict.fromkeys(sorted({r.slo_class for r in requests}), slo)


# ---- running ---------------------------------------------------------------------------


def sim_config(spec: SimSpec, policy: str, slos: Mapping[str, Slo], store: bool = False) -> SimConfig:
    """The simulator's configuration of a resolved spec under one policy, with the
    spec's store or without any."""
    ttl = ClusterConfig.index_ttl_s if spec.index_mode == "approximate" else None
    named = gpu_model_of(spec.cost)
    block_bytes = layout_for_model(named[1], SimConfig.block_size).bytes_per_block if named else 0
    assert spec.kv_blocks is not None and spec.max_num_batched_tokens is not None  # a resolve()d spec
    return SimConfig(workers=spec.workers, policy=policy, cost=spec.cost, kv_blocks=spec.kv_blocks,
                     max_num_batched_tokens=spec.max_num_batched_tokens, queue_policy=spec.queue_policy,
                     index_ttl_s=ttl, admission=spec.admission, slos=slos, prefill_workers=spec.prefill_workers,
                     decode_workers=spec.decode_workers, link=LINKS[spec.link], kv_bytes_per_block=block_bytes,
                     max_local_prefill_tokens=spec.max_local_prefill_tokens,
                     store=spec.store if store else StoreModel())


def total_requests(points: Sequence[Point]) -> int:
    """How many requests `run_points` simulates (its progress total)."""
    return sum(len(point.requests) * len(point.spec.variants()) for point in points)


def run_points(points: Sequence[Point], advance: Callable[[int], object] | None = None,
               jobs: int = 1) -> dict[str, dict]:
    """{point label: {result key: summarize result}}, calling `advance(n)` as n more
    requests finish or are refused. A result key is the policy, or POLICY+store for its
    run with the store (SimSpec.variants).

    With `jobs` > 1 up to that many runs go at once, each in a process of its own (a run
    is one thread of Python, so a sweep of many runs gains a core per job); every result
    is the one the run gives alone, and `advance` then moves a whole run at a time."""
    if jobs < 1:
        raise SimUsageError(f"jobs must be at least 1, got {jobs}")
    runs = [(point, key, policy, store) for point in points for key, policy, store in point.spec.variants()]
    if jobs == 1 or len(runs) == 1:
        summaries = []
        for index, (point, _, policy, store) in enumerate(runs):
            if index:
                _free_last_run()
            summaries.append(simulate_policy(point, policy, advance, store))
    else:
        summaries = _simulate_in_processes([(point, policy, store) for point, _, policy, store in runs],
                                           advance, jobs)
    results: dict[str, dict] = {}
    for (point, key, _, _), summary in zip(runs, summaries, strict=True):
        results.setdefault(point.label, {})[key] = summary
    return results


def _simulate_in_processes(runs: Sequence[tuple[Point, str, bool]], advance: Callable[[int], object] | None,
                           jobs: int) -> list[dict]:
    """simulate_policy of each run in a pool of `jobs` processes, in the order given.

    Spawned, not forked: a fork would copy the caller's threads' locks mid-use (a progress
    bar's, a logger's). The points and summaries pass between this process and its own
    children through the pool's pipes (pickled, as multiprocessing does); nothing here
    crosses a socket or comes from another program."""
    summaries: dict[int, dict] = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
        pending = {pool.submit(_simulate_and_free, point, policy, store): index
                   for index, (point, policy, store) in enumerate(runs)}
        for done in concurrent.futures.as_completed(pending):
            index = pending[done]
            summaries[index] = done.result()
            if advance is not None:
                advance(len(runs[index][0].requests))
    return [summaries[index] for index in range(len(runs))]


def simulate_policy(point: Point, policy: str, advance: Callable[[int], object] | None = None,
                    store: bool = False) -> dict:
    """One simulation of the point's requests under `policy` (with the spec's store when
    `store`), summarised, with the simulator's own speed under "simulation": requests,
    wall_s, requests_per_wall_s, index_blocks (the blocks the router's prefix indexes
    name at the end, its pools' together), engine_named_blocks and engine_runs (the named
    blocks the engines keep at the end, and the runs they keep them in), and with the store its report under
    overall["store"] (Simulator.store_report: prompt tokens served from the engine cache,
    DRAM, SSD or computed, their rates, the fetches and the store's counters)."""
    return _simulate(point, policy, advance, store)


def _free_last_run() -> None:
    """Collect what the last run left. Its engines and index are cyclic garbage that the
    simulator's rare collection (simulator._rare_gc) may leave uncollected: freed before
    the next run, or a sweep holds every run's (~1.9 GB each on the Mooncake trace at 16
    workers). Not after the last run: a collection traverses every object alive, half a
    minute after a million requests, and `svc sim` then ends without one (services.cli.end_program)."""
    gc.collect()


def _simulate_and_free(point: Point, policy: str, store: bool) -> dict:
    """simulate_policy in a pool's process, which the next run reuses: freed after each."""
    summary = simulate_policy(point, policy, None, store)
    _free_last_run()
    return summary


def _simulate(point: Point, policy: str, advance: Callable[[int], object] | None, store: bool) -> dict:
    started = time.perf_counter()
    simulator = Simulator(sim_config(point.spec, policy, point.slos, store))
    reported = 0

    def on_event(_now: float) -> None:
        nonlocal reported
        # Every arrived request has a record; admitted ones hold a sequence until they finish.
        done = len(simulator.records) - len(simulator.sequences)
        if done > reported:
            assert advance is not None  # on_event is passed only with advance
            advance(done - reported)
            reported = done

    result = simulator.run(point.requests, on_event if advance is not None else None)
    summary = summarize(result.records, point.slos, result.totals)
    if result.store is not None:
        summary["overall"]["store"] = result.store
    wall_s = time.perf_counter() - started
    index_blocks = sum(len(cluster.index) for cluster in (simulator.cluster, simulator.decode_cluster)
                       if cluster is not None)
    managers = [worker.block_manager for worker in simulator.workers.values()]
    summary["simulation"] = {"requests": len(point.requests), "wall_s": wall_s,
                             "requests_per_wall_s": len(point.requests) / wall_s, "index_blocks": index_blocks,
                             "engine_named_blocks": sum(manager.num_named for manager in managers),
                             "engine_runs": sum(len(manager.runs()) for manager in managers)}
    return summary


# ---- output ----------------------------------------------------------------------------


def e2e_floor(point: Point) -> tuple[float, float]:
    """Mean and p99 end-to-end latency if every request decoded alone from its first
    token: (output tokens − 1) decode steps of a batch of one at its prompt's context,
    with no queueing, no prefill and no network. Step costs only grow with batch and
    context, so no placement policy goes below it: it bounds what any policy can gain."""
    floors = [decode_alone_s(request, point.spec.cost) for request in point.requests]
    return mean(floors), percentile(floors, 99)


def print_results(points: Sequence[Point], results: Mapping[str, dict], variable: str | None) -> None:
    """The metrics table, then the e2e floor and the simulator's speed; with a sweep, one
    of each per value under a `VAR=value` heading."""
    for point in points:
        if variable is not None:
            print(f"{variable}={point.label}")
        print_table(results[point.label])
        if point.spec.decode_workers:
            for policy, r in results[point.label].items():
                overall = r["overall"]
                print(f"{policy}: KV transfer mean {overall['transfer_mean_s'] * 1000:.1f} ms (link wait "
                      f"included), decode wait mean {overall['decode_wait_mean_s'] * 1000:.1f} ms, "
                      f"{overall['transfer_bytes'] / 1e9:,.1f} GB moved")
        if point.spec.store.enabled:
            print_store(point.spec.store, results[point.label])
        floor_mean, floor_p99 = e2e_floor(point)
        print(f"floor: e2e mean {floor_mean * 1000:.1f} ms, p99 {floor_p99 * 1000:.1f} ms "
              "(each request decoding alone: no queue, no prefill; no policy goes below it)")
        speeds = ", ".join(f"{policy} {r['simulation']['wall_s']:.2f} s "
                           f"({r['simulation']['requests_per_wall_s']:,.0f} req/s)"
                           for policy, r in results[point.label].items())
        print(f"simulated {len(point.requests):,} requests on {_cluster_text(point.spec)} in: {speeds}")


def print_store(store: StoreModel, results: Mapping[str, dict]) -> None:
    """Per run with the store: where prompt tokens came from, the fetches, and the TTFT
    beside the same policy's run without the store when there is one."""
    tiers = ", ".join(f"{name} {gb:g} GB" for name, gb in store.tiers())
    for key, r in results.items():
        report = r["overall"].get("store")
        if report is None:
            continue
        text = (f"{key} ({tiers}): prompt tokens from engine cache {report['engine_hit_rate']:.3f}, "
                f"DRAM {report['dram_hit_rate']:.3f}, SSD {report['ssd_hit_rate']:.3f}, computed "
                f"{report['computed_rate']:.3f}; {report['fetches']:,} fetches "
                f"({report['fetched_blocks']:,} blocks, mean {_mean_ms(report['fetch_s'], report['fetches']):.1f} ms), "
                f"{report['fetches_skipped']:,} skipped as slower than recomputing; TTFT mean "
                f"{r['overall']['ttft_mean_s'] * 1000:.1f} ms")
        baseline = results.get(key.removesuffix("+store"))
        if baseline is not None and baseline is not r:
            text += (f" vs {baseline['overall']['ttft_mean_s'] * 1000:.1f} ms without the store "
                     f"(hit {baseline['overall']['hit_rate']:.3f})")
        print(text)


def _mean_ms(total_s: float, count: int) -> float:
    return total_s / count * 1000 if count else 0.0


def results_json(results: Mapping[str, dict], variable: str | None) -> str:
    """One line of JSON: json_line of the policies' results, or with a sweep
    {"sweep": VAR, "values": {value as written: {policy: {"overall", "classes", "simulation"}}}}."""
    if variable is None:
        return json_line(results[""])
    values = {label: reported(by_policy) for label, by_policy in results.items()}
    return json.dumps({"sweep": variable, "values": values}, separators=(",", ":"))


def write_plots(points: Sequence[Point], results: Mapping[str, dict], variable: str, out_dir: Path) -> list[Path]:
    """plot_sweep's PNGs of a sweep: each metric against `variable`, a line per policy."""
    by_policy: dict[str, dict[float, dict]] = {}
    for point in points:
        for policy, summary in results[point.label].items():
            by_policy.setdefault(policy, {})[point.value] = summary
    return plot_sweep(by_policy, variable, out_dir)


def _cluster_text(spec: SimSpec) -> str:
    """"8 workers", or with pools "2 prefill + 2 decode workers (+ 1 co-located) over rdma-400g"."""
    if not spec.decode_workers:
        return f"{spec.workers:,} workers"
    colocated = f" (+ {spec.workers:,} co-located)" if spec.workers else ""
    return (f"{spec.prefill_workers:,} prefill + {spec.decode_workers:,} decode workers{colocated} over "
            f"{spec.link}")
