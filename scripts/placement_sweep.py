#!/usr/bin/env python3
"""Sweep placement policies in the simulator and judge one against the best baseline.

    PYTHONPATH=. .venv/bin/python scripts/placement_sweep.py --out /tmp/sweep \\
        [--workloads agent,chat,...] [--loads 0.5,0.8,2,4,8] [--seeds 0,1,2] \\
        [--workers 8] [--profile a6000/mistral-7b] [--policy cost_aware] \\
        [--baselines round_robin,least_load,lpm,cache_aware,dynamo] [--reference e2] \\
        [--trace FILE --trace-workers 16 --trace-profile h100/llama-3-70b --trace-loads 0.8,2,4] \\
        [--markdown docs/placement_sweep.md] [--plot docs/placement_sweep.png] [--summarize-only] [--jobs N]

Runs `svc sim --sweep load=... --json` once per workload, seed and policy group (the
baselines with the reference in one run, the judged policy in another), keeping each
run's JSON in --out as `<workload>_s<seed>_<group>.json` and skipping those already there,
so an interrupted sweep resumes and a changed policy reruns alone (delete its files).
--jobs N runs up to N of a run's simulations at once, a process each (`svc sim --jobs`).
With --trace, the Mooncake-format trace is one more workload ("mooncake"), its arrivals
time-scaled to each of --trace-loads on its own cluster.

Then it judges every cell (workload, load, seed): the policy's mean and p99 end-to-end
latency over the best baseline's (the lowest of the baselines, per statistic), within
--tolerance (5 %) passing, and over the reference's (e2: the policy it must beat). It
writes a markdown table (per workload and load: each policy's mean / p99 averaged over
the seeds, the worst seed's ratios, pass or not) and two plots (per workload, each
policy's mean latency over the best baseline's against load; the same for the p99 in
<plot>_p99.png), and prints the verdict.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("agent", "chat", "loogle", "programming", "toolbench", "videoqa")
BASELINES = ("round_robin", "least_load", "lpm", "cache_aware", "dynamo")
TRACE_WORKLOAD = "mooncake"
STATS = ("e2e_mean_s", "e2e_p99_s")


@dataclass(frozen=True)
class Grid:
    """One cluster setting swept over loads: what `svc sim` is asked per workload."""

    workloads: tuple[str, ...]
    loads: tuple[str, ...]
    seeds: tuple[int, ...]
    workers: int
    profile: str
    num_requests: int | None
    trace: str | None = None
    jobs: int = 1


@dataclass(frozen=True)
class Cell:
    """One workload at one load: each policy's (mean, p99) per seed."""

    workload: str
    load: str
    by_seed: dict[int, dict[str, tuple[float, float]]]


def sim_command(grid: Grid, workload: str, seed: int, policies: Sequence[str]) -> list[str]:
    command = [sys.executable, "-m", "services.cli", "sim", "--sweep", f"load={','.join(grid.loads)}",
               "--workers", str(grid.workers), "--profile", grid.profile, "--seed", str(seed),
               "--policy", ",".join(policies), "--jobs", str(grid.jobs), "--json"]
    if workload == TRACE_WORKLOAD and grid.trace is not None:
        command += ["--trace", grid.trace]
    else:
        command += ["--workload", workload]
    if grid.num_requests is not None:
        command += ["--num-requests", str(grid.num_requests)]
    return command


def run_missing(grid: Grid, groups: Mapping[str, Sequence[str]], out_dir: Path) -> None:
    """Run every (workload, seed, group) whose JSON is not in `out_dir` yet."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for workload in grid.workloads:
        for seed in grid.seeds:
            for group, policies in groups.items():
                path = out_dir / f"{workload}_s{seed}_{group}.json"
                if path.exists():
                    continue
                print(f"sim {workload} seed {seed}: {', '.join(policies)}", file=sys.stderr, flush=True)
                done = subprocess.run(sim_command(grid, workload, seed, policies), capture_output=True,
                                      text=True, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"svc sim failed for {workload} seed {seed}:\n{done.stderr[-2000:]}")
                path.write_text(done.stdout.strip().splitlines()[-1] + "\n")


def load_cells(grid: Grid, groups: Mapping[str, Sequence[str]], out_dir: Path) -> list[Cell]:
    """Every (workload, load) of the grid with what the runs in `out_dir` measured."""
    cells = []
    for workload in grid.workloads:
        by_load: dict[str, dict[int, dict[str, tuple[float, float]]]] = {load: {} for load in grid.loads}
        for seed in grid.seeds:
            for group in groups:
                result = json.loads((out_dir / f"{workload}_s{seed}_{group}.json").read_text())
                for load, policies in result["values"].items():
                    if load not in by_load:
                        continue
                    row = by_load[load].setdefault(seed, {})
                    for policy, summary in policies.items():
                        row[policy] = (summary["overall"][STATS[0]], summary["overall"][STATS[1]])
        cells += [Cell(workload, load, by_seed) for load, by_seed in by_load.items()]
    return cells


@dataclass(frozen=True)
class Verdict:
    best_baseline: tuple[str, str]  # the baseline with the lowest mean, and the lowest p99
    ratio: tuple[float, float]  # the policy's (mean, p99) over the best baseline's, worst seed
    vs_reference: tuple[float, float]  # the policy's (mean, p99) over the reference's, worst seed
    passed: bool


def judge(cell: Cell, policy: str, baselines: Sequence[str], reference: str, tolerance: float) -> Verdict:
    ratios: list[tuple[float, float]] = []
    versus: list[tuple[float, float]] = []
    best_names = ("", "")
    for row in cell.by_seed.values():
        best = [min(baselines, key=lambda name: row[name][stat]) for stat in range(2)]
        best_names = (best[0], best[1])
        ratios.append(tuple(row[policy][stat] / row[best[stat]][stat] for stat in range(2)))  # type: ignore[arg-type]
        versus.append(tuple(row[policy][stat] / row[reference][stat] for stat in range(2)))  # type: ignore[arg-type]
    worst = (max(r[0] for r in ratios), max(r[1] for r in ratios))
    worst_versus = (max(v[0] for v in versus), max(v[1] for v in versus))
    return Verdict(best_names, worst, worst_versus, max(worst) <= 1 + tolerance)


def seed_mean(cell: Cell, policy: str) -> tuple[float, float]:
    rows = list(cell.by_seed.values())
    return (sum(r[policy][0] for r in rows) / len(rows), sum(r[policy][1] for r in rows) / len(rows))


def markdown(cells: Sequence[Cell], policy: str, baselines: Sequence[str], reference: str,
             tolerance: float, title: str) -> str:
    shown = [*baselines, reference, policy]
    lines = [f"## {title}", "",
             "Mean / p99 end-to-end latency in seconds, averaged over the seeds; the ratios are the "
             f"worst seed's, {policy}'s over the best baseline's (per statistic) and over {reference}'s.", "",
             "| workload | load | " + " | ".join(shown) + " | / best baseline (mean, p99) | / "
             + reference + " | within " + f"{tolerance:.0%}" + " |",
             "|" + "---|" * (len(shown) + 5)]
    for cell in cells:
        verdict = judge(cell, policy, baselines, reference, tolerance)
        values = []
        for name in shown:
            mean, p99 = seed_mean(cell, name)
            text = f"{mean:.2f} / {p99:.2f}"
            values.append(f"**{text}**" if name == verdict.best_baseline[0] else text)
        lines.append(f"| {cell.workload} | {cell.load} | " + " | ".join(values)
                     + f" | {verdict.ratio[0]:.3f}, {verdict.ratio[1]:.3f} ({verdict.best_baseline[0]}"
                     + (f", {verdict.best_baseline[1]}" if verdict.best_baseline[1] != verdict.best_baseline[0] else "")
                     + f") | {verdict.vs_reference[0]:.3f}, {verdict.vs_reference[1]:.3f} | "
                     + ("yes" if verdict.passed else "**no**") + " |")
    passed = sum(judge(cell, policy, baselines, reference, tolerance).passed for cell in cells)
    lines += ["", f"{policy} within {tolerance:.0%} of the best baseline in {passed} of {len(cells)} cells "
              "(worst seed, mean and p99).", ""]
    return "\n".join(lines)


def plot(cells: Sequence[Cell], policies: Sequence[str], baselines: Sequence[str], path: Path, stat: int) -> None:
    """Per workload, each policy's mean (stat 0) or p99 (1) latency over the best
    baseline's (seed means) against load."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    workloads = list(dict.fromkeys(cell.workload for cell in cells))
    columns = 3
    rows = math.ceil(len(workloads) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for index, workload in enumerate(workloads):
        axes = figure.add_subplot(rows, columns, index + 1)
        mine = [cell for cell in cells if cell.workload == workload]
        loads = [float(cell.load) for cell in mine]
        best = [min(seed_mean(cell, name)[stat] for name in baselines) for cell in mine]
        for name in policies:
            axes.plot(loads, [seed_mean(cell, name)[stat] / b for cell, b in zip(mine, best, strict=True)],
                      marker="o", label=name, linewidth=2.5 if name == policies[-1] else 1.0)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xticks(loads)
        axes.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        axes.axhline(1.05, color="grey", linestyle=":", linewidth=1)
        axes.set_title(workload)
        axes.set_xlabel("load")
        axes.set_ylabel(f"{('mean', 'p99')[stat]} e2e / best baseline")
        axes.grid(True, alpha=0.3)
    figure.axes[0].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where each run's JSON is kept")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default="0.5,0.8,2,4,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="a6000/mistral-7b")
    parser.add_argument("--num-requests", type=int, help="per run [default: svc sim's]")
    parser.add_argument("--policy", default="cost_aware", help="the policy judged")
    parser.add_argument("--baselines", default=",".join(BASELINES))
    parser.add_argument("--reference", default="e2", help="the policy the judged one must beat")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--trace", help="also the Mooncake-format trace, on its own cluster")
    parser.add_argument("--trace-workers", type=int, default=16)
    parser.add_argument("--trace-profile", default="h100/llama-3-70b")
    parser.add_argument("--trace-loads", default="0.8,2,4")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--summarize-only", action="store_true", help="run nothing; read --out")
    parser.add_argument("--jobs", type=int, default=1, help="simulations at once, a process each (svc sim --jobs)")
    args = parser.parse_args(argv)

    baselines = tuple(args.baselines.split(","))
    groups = {"baselines": (*baselines, args.reference), args.policy: (args.policy,)}
    seeds = tuple(int(seed) for seed in args.seeds.split(","))
    grids = [(f"{args.workers} workers, {args.profile or 'the tiny model on CPU'}", Grid(
        tuple(args.workloads.split(",")), tuple(args.loads.split(",")), seeds, args.workers, args.profile,
        args.num_requests, jobs=args.jobs))]
    if args.trace:
        grids.append((f"the Mooncake-format trace, {args.trace_workers} workers, {args.trace_profile}", Grid(
            (TRACE_WORKLOAD,), tuple(args.trace_loads.split(",")), seeds[:1], args.trace_workers,
            args.trace_profile, None, args.trace, args.jobs)))
    tables, all_cells, failed = [], [], 0
    for title, grid in grids:
        if not args.summarize_only:
            run_missing(grid, groups, args.out)
        cells = load_cells(grid, groups, args.out)
        all_cells += cells
        tables.append(markdown(cells, args.policy, baselines, args.reference, args.tolerance, title))
        failed += sum(not judge(cell, args.policy, baselines, args.reference, args.tolerance).passed
                      for cell in cells)
    command = " ".join(["scripts/placement_sweep.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([f"# Placement sweep\n\nWritten by `{command}`; see docs/performance.md §2.\n", *tables])
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        shown = (*baselines, args.reference, args.policy)
        plot(all_cells, shown, baselines, args.plot, 0)
        plot(all_cells, shown, baselines, args.plot.with_name(f"{args.plot.stem}_p99{args.plot.suffix}"), 1)
    print(f"{args.policy}: {len(all_cells) - failed} of {len(all_cells)} cells within "
          f"{args.tolerance:.0%} of the best baseline", file=sys.stderr)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
