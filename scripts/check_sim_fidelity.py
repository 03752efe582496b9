#!/usr/bin/env python3
"""Run one workload live and in the simulator, and compare what they report.

    scripts/check_sim_fidelity.py [--json] [--workload toolbench] [--rate 8] [--duration 60]
                                  [--workers 1] [--policy round_robin] [--dtype bfloat16]
                                  [--profile FILE | --profile-source live|replay|svc [--quick-profile]]
                                  [--no-overheads]

Live: `svc up` on the tiny default model (--dtype, --workers workers with the machine's
cores but one split between them; see worker_threads), driven open loop through the SDK
by `svc bench`'s load generator. Simulated: the same requests on a SimConfig with the
cluster's worker count, policy, step budget, heartbeat interval and KV blocks (as the
router reports them), a cost profile of this machine's engine, and the services'
overheads. Reported: the relative error |sim − live| / live of mean TTFT, mean TPOT and
p95 end-to-end latency (target ≤ 15 % each), a table of both runs, and with --json one
JSON line with the errors, both runs' values, the overheads and the profile used. The
default run takes about 2 minutes.

The profile (the simulator's step times): --profile, else one of
  * live (the default): fitted to the live run's own engine steps, which its workers log
    (`--step-log-dir`, common.engine.step_log). The machine's speed drifts by tens of
    percent within a minute under its neighbours' load, so a profile measured before the
    run can be off by that much for reasons no simulator can know; fitting to the run's
    own steps leaves the simulator's mechanics (batching, chunking, queueing, delays) as
    what is checked. The run still measures the replay profile first (the router needs
    one), and reports the simulation with it as `sim_replay`, with its errors.
  * replay: fitted to an engine-only replay of the same workload shape with another seed
    (see replay), measured just before the live run.
  * svc: `svc profile` with the workers' dtype and threads. It times each point back to
    back after a warm-up step of the same size; on a CPU, a step after an idle gap, or of
    a size the process has not run lately (bfloat16's per-shape kernel setup), costs up
    to 2× that, and an open-loop run at moderate load is full of both: its sim then comes
    out ~50 % fast.

The overheads (see calibrate and Overheads), measured by the same paced requests on the
engine alone and through the idle cluster, in pairs: the one-way delay client → worker →
client (the simulator's network_s), what a first token takes on its way out beyond the
later ones (first_token_extra_s), and the worker loop's cost per step beyond
engine.step(), added to the profile's fixed step costs (with the live profile, measured
instead between the live run's own back-to-back steps). --no-overheads leaves them out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cost_model import CostModel, fit_latency, load_cost_model  # noqa: E402
from common.engine.step_log import busy_gaps, profile_points, read_step_log, step_record  # noqa: E402
from services.eval.loadgen import Target, WorkloadSpec, bench, plan_requests  # noqa: E402
from services.eval.report import print_table, summarize  # noqa: E402
from services.eval.simulator import SimConfig, simulate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.15  # the largest relative error accepted per metric
METRICS = ("ttft_mean_s", "tpot_mean_s", "e2e_p95_s")
MAX_NUM_BATCHED_TOKENS = 2048  # `svc up`'s default step budget, passed explicitly to both
HEARTBEAT_INTERVAL_S = 0.5
CALIBRATION_WARMUP, CALIBRATION_SAMPLES, CALIBRATION_PROMPT, CALIBRATION_OUTPUT = 5, 40, 16, 32
CALIBRATION_SHORT_OUTPUT = 2  # every other calibration request: one decode interval
REPLAY_S = 30.0  # seconds of arrivals the engine-only replay fits the profile to


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    tpot_s: float

    @staticmethod
    def median(timings: list[Timing]) -> Timing:
        return Timing(statistics.median(t.ttft_s for t in timings), statistics.median(t.tpot_s for t in timings))


@dataclass(frozen=True)
class Overheads:
    """What the services add to the engine, as the simulator takes it: the one-way delay
    each way, what a first token takes beyond that on its way out (negative: less), and
    the worker loop's cost per step beyond engine.step()."""
    network_s: float = 0.0
    first_token_extra_s: float = 0.0
    step_s: float = 0.0

    @staticmethod
    def from_pairs(ttft_s: float, short_span_s: float, long_span_s: float) -> Overheads:
        """From the median paired differences (cluster − engine alone) of TTFT and of the
        decode span (last token − first) at CALIBRATION_SHORT_OUTPUT and CALIBRATION_OUTPUT
        tokens. A span of n tokens grows by (n − 1)·step + (last token's way out − first's),
        TTFT by the way in + the first token's way out; the way in and a later token's way
        out are taken as equal."""
        step = max((long_span_s - short_span_s) / (CALIBRATION_OUTPUT - CALIBRATION_SHORT_OUTPUT), 0.0)
        last_minus_first = short_span_s - (CALIBRATION_SHORT_OUTPUT - 1) * step
        network = max((ttft_s + last_minus_first) / 2, 0.0)
        return Overheads(network, max(ttft_s - 2 * network, -network), step)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="toolbench")
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--scale", type=float, default=0.2, help="workload length scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="cost profile file (default: measure one, see --profile-source)")
    parser.add_argument("--profile-source", choices=("live", "replay", "svc"), default="live",
                        help="fit the profile to the live run's steps, to an engine-only replay of the "
                             "workload, or run svc profile")
    parser.add_argument("--quick-profile", action="store_true", help="with --profile-source svc: its quick grid")
    parser.add_argument("--no-overheads", action="store_true",
                        help="simulate without the services' measured overheads (see calibrate)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def worker_threads(workers: int) -> int:
    """Torch threads per worker: the machine's cores but one, split between the workers.
    `svc up`'s default (all cores split) leaves none for the tokenizer, the router and
    the client, and torch's threads then wait on each other whenever one is preempted:
    on a shared 2-core machine that took this check's live mean TTFT from ~15 ms to 1.8 s."""
    return max(1, ((os.cpu_count() or 1) - 1) // workers)


def measure_profile(threads: int, dtype: str, quick: bool, out: Path) -> Path:
    """`svc profile` with the workers' dtype and thread count, written to `out`. The full
    grid by default: the quick one times decode at contexts 64 and 256 only, and toolbench's
    contexts (~500 at scale 0.2) are then extrapolated, 10-25 % off either way."""
    subprocess.run([sys.executable, "-m", "services.cli", "profile", *(["--quick"] if quick else []),
                    "--dtype", dtype, "--threads", str(threads), "--out", str(out)], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return out


def calibration_prompts(seed: int = 0) -> list[list[int]]:
    """Short fresh prompts (nothing cached), the same for the engine alone and live."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(CALIBRATION_PROMPT)]
            for _ in range(CALIBRATION_WARMUP + CALIBRATION_SAMPLES)]


def calibration_gap_s(args) -> float:
    """The pause before each calibration request: a worker's mean gap between arrivals
    (at most a quarter second), so that the engine, and each service on the way, is as
    idle before it as before a request of the run; a machine woken from idle is slower
    than one kept busy."""
    return min(args.workers / args.rate, 0.25)


def build_engine(args, threads: int):
    """The engine the workers run (dtype, threads, step budget), in this process."""
    import torch

    from common.engine.config import EngineConfig
    from common.engine.default_model import default_model_dir
    from common.engine.engine import Engine

    torch.set_num_threads(threads)
    return Engine(EngineConfig(model_dir=default_model_dir(), dtype=args.dtype,
                               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS))


def replay_profile(engine, args) -> CostModel:
    """The cost model fitted to an engine-only replay of the workload shape with another
    seed, at one worker's share of the rate, for REPLAY_S seconds (see replay)."""
    requests = plan_requests(WorkloadSpec(args.workload, rate=args.rate / args.workers,
                                          duration_s=min(args.duration, REPLAY_S),
                                          scale=args.scale, vocab_size=512, seed=args.seed + 1))
    return fitted("replay", replay(engine, requests))


def replay(engine, requests) -> dict[str, list[tuple[float, float, float]]]:
    """Feed `requests` to `engine` open loop at their arrival times, as a worker would,
    and time each step: the cost model's fitting points (common.engine.step_log).
    Unlike `svc profile`, which times each point back to back after a warm-up step of the
    same size, these steps have the live run's variety of sizes and its idle gaps, both
    of which cost time on a CPU."""
    from common.sampling_params import SamplingParams

    records = []
    engine.step_observer = lambda plan, seconds: records.append(step_record(plan, seconds, time.time()))
    try:
        start, pending = time.perf_counter(), list(requests)
        while pending or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                request = pending.pop(0)
                engine.add_request(request.request_id, request.token_ids.tolist(), SamplingParams(
                    max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True))
            if not engine.has_unfinished():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            engine.step()
    finally:
        engine.step_observer = None
    return profile_points(records)


def alone(engine, prompt: list[int], outputs: int = CALIBRATION_OUTPUT):
    """One calibration request on the engine alone: its result (ttft_s, e2e_s)."""
    from common.sampling_params import SamplingParams

    [result] = engine.generate([prompt], SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True))
    return result


def timing(result) -> Timing:
    """A request result's TTFT and mean time per output token after the first."""
    return Timing(result.ttft_s, (result.e2e_s - result.ttft_s) / (len(result.token_ids) - 1))


def engine_speed(engine, gap_s: float, seed: int) -> Timing:
    """The median timing of paced calibration requests (prompts of `seed`) on the engine
    alone, the first few left out."""
    timings = []
    for prompt in calibration_prompts(seed):
        time.sleep(gap_s)
        timings.append(timing(alone(engine, prompt)))
    return Timing.median(timings[CALIBRATION_WARMUP:])


async def calibrate(address: str, engine, gap_s: float) -> tuple[object, Overheads, Timing]:
    """The router's status, what the services add to the engine (Overheads.from_pairs),
    and the engine's own timing. Each calibration request runs on `engine` alone, then
    through the idle cluster, each `gap_s` after the last answer, asking alternately for
    CALIBRATION_SHORT_OUTPUT and CALIBRATION_OUTPUT tokens; the medians of the paired
    differences (the first few pairs, warming both up, left out) give the overheads.
    TTFT grows by the way in and out (SDK socket, tokenizer, router, the worker's loop),
    the decode span by the worker loop's cost per step beyond engine.step() (sending
    tokens and KV events, polling its sockets) and by how much later or sooner the last
    token's way out is than the first's: on this machine the first's is ~1 ms slower,
    which at toolbench's ~8 output tokens is ~0.15 ms of TPOT. Pairing keeps the
    machine's drift out of the difference."""
    from services.client import AsyncClient

    ttft, spans, engine_timings = [], {CALIBRATION_SHORT_OUTPUT: [], CALIBRATION_OUTPUT: []}, []
    async with AsyncClient(address) as client:
        status = await client.status()
        for number, prompt in enumerate(calibration_prompts()):
            outputs = CALIBRATION_OUTPUT if number % 2 else CALIBRATION_SHORT_OUTPUT
            await asyncio.sleep(gap_s)
            engine_only = alone(engine, prompt, outputs)  # blocks the loop: nothing else runs now
            await asyncio.sleep(gap_s)
            live = await client.generate(token_ids=prompt, max_tokens=outputs, temperature=0.0, ignore_eos=True)
            if number < CALIBRATION_WARMUP:
                continue
            ttft.append(live.ttft_s - engine_only.ttft_s)
            spans[outputs].append((live.e2e_s - live.ttft_s) - (engine_only.e2e_s - engine_only.ttft_s))
            if outputs == CALIBRATION_OUTPUT:
                engine_timings.append(timing(engine_only))
    overheads = Overheads.from_pairs(statistics.median(ttft), statistics.median(spans[CALIBRATION_SHORT_OUTPUT]),
                                     statistics.median(spans[CALIBRATION_OUTPUT]))
    return status, overheads, Timing.median(engine_timings)


def run_live(args, requests, profile: Path, engine, threads: int,
             step_log_dir: Path) -> tuple[dict, int, Overheads, Timing, list[list[dict]]]:
    """The live run's summary, the KV blocks per worker the router reports, the
    services' overheads (see calibrate, which uses `engine`), the engine's drift (how
    much slower (> 0) or faster the engine alone is after the run than before it,
    relative, in TTFT and TPOT: the machine's speed changing under other load during
    the run shows there), and each worker's step records during the run."""
    from common.engine.default_model import default_model_dir
    from services.local_cluster import start_cluster

    gap_s = calibration_gap_s(args)
    cluster = start_cluster(default_model_dir(), workers=args.workers, extra=[
        "--dtype", args.dtype, "--threads", str(threads), "--policy", args.policy, "--profile", str(profile),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--heartbeat-interval-s",
        str(HEARTBEAT_INTERVAL_S), "--step-log-dir", str(step_log_dir)])
    try:
        status, overheads, before = asyncio.run(calibrate(cluster.sdk, engine, gap_s))
        bench_started = time.time()
        result = asyncio.run(bench(Target(address=cluster.sdk), requests, drain_timeout_s=120.0))
        after = engine_speed(engine, gap_s, seed=1)  # with the cluster up and idle, as before
    finally:
        cluster.stop()
    drift = Timing(after.ttft_s / before.ttft_s - 1, after.tpot_s / before.tpot_s - 1)
    steps = [[record for record in read_step_log(path) if record["t"] >= bench_started]
             for path in sorted(step_log_dir.glob("worker-*.steps.jsonl"))]
    return result.summary, min(worker.kv_blocks_total for worker in status.workers), overheads, drift, steps


def fitted(name: str, points: dict) -> CostModel:
    if min(len(phase) for phase in points.values()) < 4:
        raise SystemExit(f"too few {name} steps to fit a profile: {({k: len(v) for k, v in points.items()})}")
    return CostModel(name, fit_latency(points["prefill"], quadratic=True), fit_latency(points["decode"]))


def loop_overhead_s(steps: list[list[dict]]) -> float:
    """The mean gap between back-to-back steps over the workers' logs (step_log.busy_gaps)."""
    gaps = [gap for records in steps for gap in busy_gaps(records)]
    if not gaps:
        raise SystemExit("the live run's step logs hold no back-to-back steps to time the worker loop by")
    return statistics.fmean(gaps)


def run_sim(args, requests, cost: CostModel, kv_blocks: int, overheads: Overheads) -> dict:
    """The simulated run, with the services' overheads: the network delays as they are,
    `overheads.step_s` added to every step's fixed cost."""
    step = overheads.step_s
    cost = CostModel(cost.name, replace(cost.prefill, a=cost.prefill.a + step),
                     replace(cost.decode, a=cost.decode.a + step))
    config = SimConfig(workers=args.workers, policy=args.policy, cost=cost, kv_blocks=kv_blocks,
                       max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                       network_s=overheads.network_s, first_token_extra_s=overheads.first_token_extra_s)
    result = simulate(requests, config)
    return summarize(result.records, {}, result.totals)


def relative_errors(live: dict, sim: dict) -> dict[str, float]:
    return {metric: abs(sim[metric] - live[metric]) / live[metric] if live[metric] else float("inf")
            for metric in METRICS}


def report(args, live: dict, sims: dict[str, dict], extra: dict) -> None:
    """The table of every run, then each simulation's errors; the first simulation's
    are the check's."""
    errors = {name: relative_errors(live["overall"], sim["overall"]) for name, sim in sims.items()}
    print_table({"live": live, **sims})
    for name, sim in sims.items():
        for metric, error in errors[name].items():
            verdict = "ok" if error <= TARGET else f"over {TARGET:.0%}"
            print(f"{name:<10} {metric:<12} live {live['overall'][metric] * 1000:8.2f} ms  "
                  f"sim {sim['overall'][metric] * 1000:8.2f} ms  error {error:6.1%}  {verdict}")
    drift = extra["engine_drift"]
    print(f"overheads: one-way {extra['network_s'] * 1000:.2f} ms, "
          f"first token {extra['first_token_extra_s'] * 1000:+.2f} ms, "
          f"per step {extra['step_overhead_s'] * 1000:.2f} ms ({extra['step_overhead_source']}); "
          f"engine alone after the run vs before: TTFT {drift['ttft']:+.1%}, TPOT {drift['tpot']:+.1%}")
    if args.json:
        first = next(iter(sims))
        others = {f"rel_error_{name}": errors[name] for name in sims if name != first}
        print(json.dumps({"rel_error": errors[first], "ok": all(error <= TARGET for error in errors[first].values()),
                          **others, "live": {metric: live["overall"][metric] for metric in METRICS},
                          **{name: {metric: sim["overall"][metric] for metric in METRICS}
                             for name, sim in sims.items()},
                          "workload": args.workload, "rate": args.rate, "duration_s": args.duration,
                          "scale": args.scale, "workers": args.workers, "policy": args.policy,
                          "dtype": args.dtype, **extra}))


def main() -> None:
    args = parse_args()
    threads = worker_threads(args.workers)
    requests = plan_requests(WorkloadSpec(args.workload, rate=args.rate, duration_s=args.duration,
                                          scale=args.scale, vocab_size=512, seed=args.seed))
    source = "file" if args.profile else args.profile_source
    engine = build_engine(args, threads)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if source == "file":
            profile = Path(args.profile)
        elif source == "svc":
            profile = measure_profile(threads, args.dtype, args.quick_profile, scratch / "profile.json")
        else:  # replay, and live: the router needs a profile before the run
            profile = scratch / "replay.json"
            profile.write_text(json.dumps(replay_profile(engine, args).to_json()), encoding="utf-8")
        cost = load_cost_model(profile)
        live, kv_blocks, measured, drift, steps = run_live(args, requests, profile, engine, threads, scratch / "steps")
    points = profile_points(record for records in steps for record in records)
    # The live profile comes from the workers' own steps, so their own loop is what is
    # added to it; the replay and svc profiles time the engine in this process, and the
    # calibration's step cost also holds what running in a worker process costs it.
    live_overheads = replace(measured, step_s=loop_overhead_s(steps))
    runs = ({"sim": (fitted("live", points), live_overheads), "sim_replay": (cost, measured)} if source == "live"
            else {"sim": (cost, measured)})
    if args.no_overheads:
        runs = {name: (model, Overheads()) for name, (model, _) in runs.items()}
    sims = {name: run_sim(args, requests, model, kv_blocks, overheads) for name, (model, overheads) in runs.items()}
    model, overheads = runs["sim"]
    report(args, live, sims, {"profile_source": source, "requests": len(requests), "threads": threads,
                              "kv_blocks": kv_blocks, "network_s": overheads.network_s,
                              "first_token_extra_s": overheads.first_token_extra_s, "step_overhead_s": overheads.step_s,
                              "step_overhead_source": ("none" if args.no_overheads else
                                                       "live steps" if source == "live" else "calibration"),
                              "measured": {"network_s": measured.network_s,
                                           "first_token_extra_s": measured.first_token_extra_s,
                                           "calibrated_step_s": measured.step_s,
                                           "live_loop_step_s": live_overheads.step_s},
                              "engine_drift": {"ttft": drift.ttft_s, "tpot": drift.tpot_s},
                              "live_steps_fitted": {phase: len(values) for phase, values in points.items()},
                              "profile": model.to_json()})


if __name__ == "__main__":
    main()
