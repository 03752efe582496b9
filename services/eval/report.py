"""Run metrics and their report, shared by live runs (`svc bench`) and simulated runs (`svc sim`).

Both kinds of run hand `summarize` one `RequestRecord` per request (times in seconds,
relative to the start of the run) and the run's `RunTotals`; the summary is a plain,
JSON-serialisable dict per request class and overall (docs/evaluation.md §6).

Conventions, the same for every metric:
  * Latencies (TTFT, TPOT, end-to-end, the time breakdown) are taken over completed
    requests only; a request is completed when it was neither rejected nor failed and
    both its first and its last token times are known.
  * Percentiles are numpy's default definition ("linear": the value at rank
    q/100 × (n − 1) of the sorted sample, interpolated between neighbours).
  * A statistic over an empty set is 0.0, never None or NaN, so every value is a number
    in JSON and plots need no special case.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

import numpy as np


@dataclass
class RequestRecord:
    request_id: str
    slo_class: str
    arrival_s: float  # run-relative seconds
    num_prompt_tokens: int
    output_tokens: int = 0  # generated
    num_cached_tokens: int = 0
    first_token_s: float | None = None  # run-relative time of the first token
    finish_s: float | None = None  # run-relative time of the last token
    rejected: bool = False
    failed: bool = False  # an error other than rejection (timeout, worker lost...)
    queue_s: float = 0.0  # arrival to first scheduled (when known)
    prefill_s: float = 0.0
    transfer_s: float = 0.0  # first token to the KV landing on the decode worker (disaggregated)
    decode_wait_s: float = 0.0  # the KV landing to the decode worker's first step of it
    decode_s: float = 0.0
    ideal_s: float = 0.0  # service time alone on an idle worker (for slowdown); 0 = unknown
    worker_id: str = ""
    # Live runs: the run-relative time of the second token (None: unknown, or fewer than
    # two), and the split the workers reported for a disaggregated request (Result.timings:
    # queue_s, prefill_s, decode_wait_s, transfer_s; {} when one worker served it). They
    # feed the "ttft_split" section; the fields above are the simulator's.
    second_token_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


class SloLike(Protocol):
    @property
    def ttft_s(self) -> float: ...

    @property
    def tpot_s(self) -> float: ...


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass
class RunTotals:
    duration_s: float
    gpus: int
    evictions: int = 0
    eviction_recompute_s: float = 0.0
    transfer_bytes: int = 0


# --- per-request quantities -------------------------------------------------------------


def is_completed(r: RequestRecord) -> bool:
    return not (r.rejected or r.failed) and r.first_token_s is not None and r.finish_s is not None


def ttft_of(r: RequestRecord) -> float:
    """Arrival to first token; only meaningful for a completed request."""
    assert r.first_token_s is not None, f"{r.request_id} has no first token"
    return r.first_token_s - r.arrival_s


def tpot_of(r: RequestRecord) -> float:
    """(finish − first token) / (output tokens − 1); 0.0 for one output token or fewer."""
    if r.output_tokens <= 1:
        return 0.0
    assert r.finish_s is not None and r.first_token_s is not None, f"{r.request_id} is not completed"
    return (r.finish_s - r.first_token_s) / (r.output_tokens - 1)


def e2e_of(r: RequestRecord) -> float:
    assert r.finish_s is not None, f"{r.request_id} is not finished"
    return r.finish_s - r.arrival_s


def meets_slo(r: RequestRecord, slo: SloLike | None) -> bool:
    """Completed and within both targets; with no SLO, completion alone meets it."""
    if not is_completed(r):
        return False
    if slo is None:
        return True
    return ttft_of(r) <= slo.ttft_s and tpot_of(r) <= slo.tpot_s


# --- statistics over sets ---------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolation percentile; 0.0 for an empty set."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1.0 when all equal, 1/n when one holds all.

    0.0 for an empty set; 1.0 for an all-zero vector (everyone is treated the same).
    """
    if not len(values):
        return 0.0
    x = np.asarray(values, dtype=float)
    squares = float(np.sum(x * x))
    if squares == 0.0:
        return 1.0
    return float(np.sum(x)) ** 2 / (len(x) * squares)


def _slowdowns(done: Sequence[RequestRecord]) -> tuple[list[float], str]:
    """The vector fairness is measured over, and what it is.

    Normalised slowdown e2e / ideal_s over the requests whose ideal time is known
    ("ideal"); when none is known, the raw end-to-end latencies ("e2e"); "none" when
    nothing completed.
    """
    known = [e2e_of(r) / r.ideal_s for r in done if r.ideal_s > 0]
    if known:
        return known, "ideal"
    if done:
        return [e2e_of(r) for r in done], "e2e"
    return [], "none"


# --- the summary ------------------------------------------------------------------------


def _latency_stats(name: str, values: Sequence[float], qs: Iterable[int]) -> dict[str, float]:
    stats = {f"{name}_mean_s": mean(values)}
    stats.update({f"{name}_p{q}_s": percentile(values, q) for q in qs})
    return stats


def _summarize_group(
    records: Sequence[RequestRecord],
    slos: Mapping[str, SloLike],
    duration_s: float,
    gpus: int,
    attainment: float,
) -> dict:
    done = [r for r in records if is_completed(r)]
    meeting = sum(meets_slo(r, slos.get(r.slo_class)) for r in records)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    slowdowns, basis = _slowdowns(done)
    goodput_rps = meeting / duration_s if duration_s > 0 else 0.0
    slo_attainment = meeting / len(records) if records else 0.0
    summary: dict[str, float | str] = {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(r.rejected for r in records),
        # A request flagged both ways counts once, as rejected.
        "failed": sum(r.failed and not r.rejected for r in records),
        "output_tokens": sum(r.output_tokens for r in done),
    }
    summary.update(_latency_stats("ttft", [ttft_of(r) for r in done], (50, 95, 99)))
    summary.update(_latency_stats("tpot", [tpot_of(r) for r in done], (50, 95, 99)))
    summary.update(_latency_stats("e2e", [e2e_of(r) for r in done], (50, 95, 99)))
    summary.update(
        {
            "queue_mean_s": mean([r.queue_s for r in done]),
            "prefill_mean_s": mean([r.prefill_s for r in done]),
            "transfer_mean_s": mean([r.transfer_s for r in done]),
            "decode_wait_mean_s": mean([r.decode_wait_s for r in done]),
            "decode_mean_s": mean([r.decode_s for r in done]),
            "slo_attainment": slo_attainment,
            "slo_target": attainment,
            "meets_slo_target": bool(records) and slo_attainment >= attainment,
            "goodput_rps": goodput_rps,
            "goodput_per_gpu": goodput_rps / gpus if gpus > 0 else 0.0,
            "hit_rate": (
                sum(r.num_cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0
            ),
            "jain": jain_index(slowdowns),
            "max_slowdown": max(slowdowns) if basis == "ideal" else 0.0,
            "slowdown_basis": basis,
        }
    )
    return summary


SPLIT_KEYS = ("queue_s", "prefill_s", "decode_wait_s", "transfer_s")  # RequestRecord.timings' keys, in order


def _ratio_stats(name: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{name}_p50": percentile(values, 50), f"{name}_p90": percentile(values, 90)}


def ttft_split(records: Sequence[RequestRecord]) -> dict | None:
    """Where the time of the disaggregated requests went, as their workers measured it;
    None when no completed request carried timings (every one was served by one worker).

    Over the completed requests with timings ("requests" of "completed"), each key's
    median and p90 (`<key>_p50_s`, `<key>_p90_s`) among those that carry it (no
    transfer_s where the decode worker already held every block). The prefill worker
    streams the first token before the KV moves, so the transfer does not add to TTFT; it
    delays the second token instead:
      * transfer_share_of_first_decode_p50/_p90: per request, transfer_s / (time from
        sending to the second token), over the requests with a transfer and a second
        token (their count: second_token_requests; 0.0 when there are none);
      * transfer_over_ttft_p50/_p90: per request, transfer_s / TTFT, a size comparison
        (not a share: the two overlap, and it can exceed 1).
    """
    done = [r for r in records if is_completed(r)]
    split = [r for r in done if r.timings]
    if not split:
        return None
    section: dict[str, float] = {"requests": len(split), "completed": len(done)}
    for key in SPLIT_KEYS:
        values = [r.timings[key] for r in split if key in r.timings]
        name = key.removesuffix("_s")
        section.update({f"{name}_p50_s": percentile(values, 50), f"{name}_p90_s": percentile(values, 90)})
    moved = [r for r in split if "transfer_s" in r.timings]
    first_decode = [(r.timings["transfer_s"], r.second_token_s - r.arrival_s) for r in moved
                    if r.second_token_s is not None and r.second_token_s > r.arrival_s]
    section["second_token_requests"] = len(first_decode)
    section.update(_ratio_stats("transfer_share_of_first_decode", [t / d for t, d in first_decode]))
    section.update(_ratio_stats("transfer_over_ttft", [r.timings["transfer_s"] / ttft_of(r) for r in moved
                                                       if ttft_of(r) > 0]))
    return section


def summarize(
    records: Sequence[RequestRecord],
    slos: Mapping[str, SloLike],
    totals: RunTotals,
    attainment: float = 0.9,
) -> dict:
    """Summarise one run: {"overall": {...}, "classes": {class name: {...}}}.

    `slos` maps a class name to any object with `ttft_s` and `tpot_s` (e.g. `Slo`).
    Each summary holds, besides the counts and latency statistics:
      * slo_attainment: the fraction of ALL the group's requests that completed with
        TTFT ≤ ttft_s and TPOT ≤ tpot_s of their class; rejected and failed requests
        count as misses. A class with no SLO in `slos` has no targets to miss: every
        one of its completed requests counts as meeting (attainment over completed =
        1.0), its rejected and failed ones still as misses.
      * slo_target / meets_slo_target: `attainment`, and whether slo_attainment reaches it.
      * goodput_rps: requests meeting their SLO per second of `totals.duration_s`, and
        goodput_per_gpu = goodput_rps / gpus. DistServe defines goodput as the highest
        request rate at which attainment stays ≥ the target; that needs a search over
        rates (the planner's job). One run can only report its SLO-meeting requests/s.
      * hit_rate: cached / prompt tokens over completed requests.
      * jain: Jain's fairness index over each completed request's normalised slowdown
        e2e / ideal_s, among those with ideal_s > 0; when no request knows its ideal
        time, over raw end-to-end latencies instead. slowdown_basis says which
        ("ideal", "e2e", or "none" when nothing completed).
      * max_slowdown: the largest e2e / ideal_s; 0.0 when no ideal time is known.
    "overall" adds the run totals: duration_s, gpus, evictions, eviction_recompute_s,
    transfer_bytes. Classes are listed by name. A live run whose requests carried worker
    timings adds "ttft_split" (see `ttft_split`).
    """
    group = _summarize_group(records, slos, totals.duration_s, totals.gpus, attainment)
    overall = dict(group)
    overall.update(
        {
            "duration_s": totals.duration_s,
            "gpus": totals.gpus,
            "evictions": totals.evictions,
            "eviction_recompute_s": totals.eviction_recompute_s,
            "transfer_bytes": totals.transfer_bytes,
        }
    )
    by_class: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_class.setdefault(r.slo_class, []).append(r)
    if len(by_class) == 1:  # one class: its records are all of them, in order (a million-request run's ~10 s)
        classes = {name: group for name in by_class}
    else:
        classes = {
            name: _summarize_group(by_class[name], slos, totals.duration_s, totals.gpus, attainment)
            for name in sorted(by_class)
        }
    result = {"overall": overall, "classes": classes}
    split = ttft_split(records)
    if split is not None:
        result["ttft_split"] = split
    return result


# --- output -----------------------------------------------------------------------------

# (header, summary key, format); times are shown in milliseconds.
_COLUMNS = (
    ("reqs", "requests", "{:d}"),
    ("ttft_ms", "ttft_mean_s", "ms"),
    ("ttft_p99", "ttft_p99_s", "ms"),
    ("tpot_ms", "tpot_mean_s", "ms"),
    ("e2e_ms", "e2e_mean_s", "ms"),
    ("e2e_p99", "e2e_p99_s", "ms"),
    ("attain", "slo_attainment", "{:.3f}"),
    ("hit", "hit_rate", "{:.3f}"),
    ("jain", "jain", "{:.3f}"),
    ("rej", "rejected", "{:d}"),
)


def _cell(value: float, fmt: str) -> str:
    return f"{value * 1000:.1f}" if fmt == "ms" else fmt.format(value)


def print_table(results: Mapping[str, dict], file: TextIO | None = None) -> None:
    """One row per policy (its overall summary), its classes indented below it.

    `results` maps a policy name to a `summarize` result. Times are in milliseconds.
    """
    out = file if file is not None else sys.stdout
    rows = [("policy", *(header for header, _, _ in _COLUMNS))]
    for policy, result in results.items():
        groups = [(policy, result["overall"])]
        groups += [(f"  {name}", summary) for name, summary in result["classes"].items()]
        for label, summary in groups:
            rows.append((label, *(_cell(summary[key], fmt) for _, key, fmt in _COLUMNS)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("  ".join(cells), file=out)


def print_ttft_split(results: Mapping[str, dict], file: TextIO | None = None) -> None:
    """Each policy's "ttft_split" section, when it has one (see `ttft_split`): the
    workers' p50/p90 in milliseconds, then the transfer's share of the time to the
    second token (or, when no request had a second token, transfer / TTFT)."""
    out = file if file is not None else sys.stdout
    for policy, result in results.items():
        split = result.get("ttft_split")
        if split is None:
            continue
        print(f"TTFT split, {policy}: {split['requests']:d} of {split['completed']:d} completed requests "
              "disaggregated (worker-measured, ms)", file=out)
        print(f"  {'':<12}{'p50':>9}{'p90':>9}", file=out)
        for name in (key.removesuffix("_s") for key in SPLIT_KEYS):
            print(f"  {name:<12}{split[name + '_p50_s'] * 1000:>9.1f}{split[name + '_p90_s'] * 1000:>9.1f}",
                  file=out)
        if split["second_token_requests"]:
            print(f"  transfer_share_of_first_decode p50 {split['transfer_share_of_first_decode_p50']:.3f}  "
                  f"p90 {split['transfer_share_of_first_decode_p90']:.3f}: transfer_s / (sending to the 2nd "
                  "token); the 1st token comes from the prefill worker before the transfer, so the transfer "
                  "delays the 2nd token, not the 1st", file=out)
        else:
            print(f"  transfer_over_ttft p50 {split['transfer_over_ttft_p50']:.3f}  "
                  f"p90 {split['transfer_over_ttft_p90']:.3f}: transfer_s / TTFT, a size comparison only "
                  "(no request had a 2nd token; the transfer does not add to TTFT)", file=out)


def reported(results: Mapping[str, dict]) -> dict:
    """Each policy's result as reported in JSON: {"overall": ..., "classes": ...} and, for
    a simulated run, "simulation" (the simulator's own speed), for a live run with worker
    timings, "ttft_split"."""
    return {name: {key: r[key] for key in ("overall", "classes", "simulation", "ttft_split") if key in r}
            for name, r in results.items()}


def json_line(results: Mapping[str, dict]) -> str:
    """One line of JSON keyed by policy name, each value as `reported` gives it."""
    return json.dumps(reported(results), separators=(",", ":"))


def _file_stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def plot_sweep(
    sweep: Mapping[str, Mapping[float, dict]],
    variable: str,
    out_dir: Path,
    metrics: Sequence[str] = ("ttft_mean_s", "e2e_p99_s", "slo_attainment"),
) -> list[Path]:
    """Write one PNG per metric: its overall value vs `variable`, one line per policy.

    `sweep` maps a policy name to {value of the swept variable: `summarize` result}.
    Files are named `<variable>_<metric>.png` in `out_dir` (created if missing); the
    paths written are returned in `metrics` order. Needs matplotlib (the `test` extra).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_sweep needs matplotlib: pip install matplotlib") from e
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric in metrics:
        # A bare Figure on its own Agg canvas: no pyplot, so no process-wide backend
        # switch and no figure registry to leak.
        fig = Figure(figsize=(6, 4), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for policy, points in sweep.items():
            xs = sorted(points)
            ax.plot(xs, [points[x]["overall"][metric] for x in xs], marker="o", label=policy)
        ax.set_xlabel(variable)
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        if sweep:
            ax.legend()
        path = out_dir / f"{_file_stem(variable)}_{_file_stem(metric)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
