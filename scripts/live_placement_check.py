#!/usr/bin/env python3
"""Placement policies on a live cluster: does the simulated advantage hold for real?

    PYTHONPATH=. .venv/bin/python scripts/live_placement_check.py \\
        [--policy cost_aware] [--baselines lpm,cache_aware,e2] [--workers 2] \\
        [--workloads toolbench:0.1,programming:0.25] [--seeds 0,1,2] [--duration 30] \\
        [--router-profile FILE] [--nice-workers N] [--json]

For each seed (a round) and each workload, every policy in turn (the order reversed every
other round, so neither end of a round is always the same policy's) gets a fresh
`svc up --workers N --policy P` on the tiny default model, on free loopback ports, and
one `svc bench --workload W --load L --duration D --seed R --json` against its SDK
socket; the cluster is stopped before the next. It prints each round's mean / p99
end-to-end latency in ms per policy, their medians over the rounds, and the judged
policy's median mean and p99 over the best baseline's (the lowest median, per
statistic). A 2-core machine is noisy: run it with nothing else running.

--router-profile gives the routers the cost profile to price with (`svc up --profile`);
without it they price with the profile `svc up` measures of this node's engine. The load
generator's rates stay those of the built-in tiny-cpu profile either way, so every run
sends the same requests.

--nice-workers N lowers the engines' CPU priority by N (every thread of each worker
process), so the router, the tokenizer and the load generator never wait behind an
engine step: what a node whose engines compute on accelerators gives them. Without it,
on a machine with fewer cores than processes, a policy that keeps both workers busy
also slows every request's trip through the frontends (docs/performance.md §3.9).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

from common.engine.default_model import default_model_dir
from services.local_cluster import child_env, start_cluster


def lower_priority(pid: int, niceness: int) -> None:
    """Add `niceness` to every thread of process `pid` (Linux keeps one per thread)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        tid = int(thread)
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def bench_once(policy: str, workers: int, workload: str, load: float, seed: int, duration: float,
               router_profile: str | None = None, nice_workers: int = 0) -> dict:
    """One fresh cluster, one `svc bench`: its JSON summary's "overall"."""
    extra = ["--policy", policy, *(["--profile", router_profile] if router_profile else [])]
    cluster = start_cluster(default_model_dir(), workers=workers, extra=extra)
    try:
        if nice_workers:
            for index in range(workers):
                lower_priority(cluster.worker_health(index)["pid"], nice_workers)
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "bench", "--workload", workload, "--load", str(load),
             "--duration", str(duration), "--seed", str(seed), "--address", cluster.sdk, "--json"],
            capture_output=True, text=True, env=child_env(), timeout=duration + 300, check=False)
    finally:
        cluster.stop()
    if done.returncode != 0:
        raise SystemExit(f"svc bench failed under {policy}:\n{done.stderr[-2000:]}")
    (summary,) = json.loads(done.stdout.strip().splitlines()[-1]).values()  # {run key: summary}
    return summary["overall"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="cost_aware")
    parser.add_argument("--baselines", default="lpm,cache_aware,e2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workloads", default="toolbench:0.1,programming:0.25", help="WORKLOAD:LOAD, comma separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--router-profile",
                        help="the cost profile the routers price with (default: svc up's measured one)")
    parser.add_argument("--nice-workers", type=int, default=0,
                        help="lower the engines' CPU priority by N, so the frontends never wait behind a step")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every round")
    args = parser.parse_args(argv)

    baselines = args.baselines.split(",")
    policies = [args.policy, *baselines]
    rounds: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for index, seed in enumerate(int(seed) for seed in args.seeds.split(",")):
        order = policies if index % 2 == 0 else policies[::-1]
        for item in args.workloads.split(","):
            workload, load = item.split(":")
            for policy in order:
                overall = bench_once(policy, args.workers, workload, float(load), seed, args.duration,
                                     args.router_profile, args.nice_workers)
                row = (overall["e2e_mean_s"] * 1000, overall["e2e_p99_s"] * 1000)
                rounds.setdefault(workload, {}).setdefault(policy, []).append(row)
                print(f"seed {seed} {workload} {policy}: {row[0]:.0f} / {row[1]:.0f} ms "
                      f"(hit rate {overall['hit_rate']:.3f}, {overall['completed']} requests)",
                      file=sys.stderr, flush=True)
    failed = False
    print("| workload | " + " | ".join(policies) + f" | {args.policy} / best baseline (median mean, p99) |")
    print("|" + "---|" * (len(policies) + 2))
    for workload, by_policy in rounds.items():
        medians = {policy: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                   for policy, runs in by_policy.items()}
        ratios = [medians[args.policy][stat] / min(medians[name][stat] for name in baselines) for stat in range(2)]
        failed |= max(ratios) > 1.0
        cells = [", ".join(f"{mean:.0f} / {p99:.0f}" for mean, p99 in by_policy[policy])
                 + f" (median {medians[policy][0]:.0f} / {medians[policy][1]:.0f})" for policy in policies]
        print(f"| {workload} | " + " | ".join(cells) + f" | {ratios[0]:.2f}, {ratios[1]:.2f} |")
    if args.json:
        print(json.dumps(rounds))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
