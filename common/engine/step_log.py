"""Engine steps as JSON lines: what each step ran and how long it took.

A worker started with `--step-log-dir DIR` appends one line per step to
`DIR/worker-N.steps.jsonl`:

    {"t": 1764513600.25, "s": 0.0041, "decode_seqs": 12, "decode_ctx": 5120, "prefill": [[32, 2048]]}

`t` is the wall-clock time the step ended (Unix seconds), `s` its duration (scheduling,
the forward pass and sampling), `decode_seqs` the sequences that each added one
generated token and `decode_ctx` the sum of their contexts before it, `prefill` one
[new tokens, tokens already computed] pair per prompt chunk. `profile_points` turns
steps into the cost model's fitting points, so a profile can be fitted to what a serving
worker actually did, and `busy_gaps` the time its loop took between steps
(scripts/check_sim_fidelity.py uses both).
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

from common.engine.scheduler import SchedulePlan


class StepLogError(ValueError):
    """A step log line is malformed; the message names the file and line."""


def step_record(plan: SchedulePlan, seconds: float, ended_at: float) -> dict:
    """One step's line (see the module docstring)."""
    decode_seqs = decode_ctx = 0
    prefill = []
    for chunk in plan.chunks:
        if chunk.num_new == 1 and chunk.start >= chunk.seq.prompt_len:
            decode_seqs += 1
            decode_ctx += chunk.start
        else:
            prefill.append([chunk.num_new, chunk.start])
    return {"t": round(ended_at, 6), "s": round(seconds, 7), "decode_seqs": decode_seqs,
            "decode_ctx": decode_ctx, "prefill": prefill}


class StepLogWriter:
    """An engine step observer that appends each step's line to `path`. Line-buffered:
    one write per step (microseconds against a step's milliseconds), so a reader sees
    every finished step and a crash loses none."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8", buffering=1)

    def __call__(self, plan: SchedulePlan, seconds: float) -> None:
        self._file.write(json.dumps(step_record(plan, seconds, time.time()), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_log(path: Path) -> list[dict]:
    """Every line of a step log, checked; raises StepLogError naming the bad line."""
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(_checked(json.loads(line)))
            except (ValueError, TypeError) as error:
                raise StepLogError(f"{path}:{number}: {error}") from None
    return records


def _checked(record: object) -> dict:
    if not isinstance(record, dict):
        raise ValueError("a step must be a JSON object")
    for key in ("t", "s"):
        value = record.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key!r} must be a finite number >= 0, got {value!r}")
    for key in ("decode_seqs", "decode_ctx"):
        if not _count(record.get(key)):
            raise ValueError(f"{key!r} must be an integer >= 0, got {record.get(key)!r}")
    prefill = record.get("prefill")
    if not isinstance(prefill, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(map(_count, pair)) for pair in prefill):
        raise ValueError(f"'prefill' must be a list of [new tokens, context] integer pairs, got {prefill!r}")
    return record


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def profile_points(records: Iterable[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """The cost model's fitting points: a step of decode tokens only is a decode point
    (batch, mean context, seconds); a step of one prompt chunk alone is a prefill point
    (new tokens, context before them, seconds). Steps mixing several are left out: the
    cost model prices those from the two phases."""
    points: dict[str, list[tuple[float, float, float]]] = {"prefill": [], "decode": []}
    for record in records:
        seqs, prefill = record["decode_seqs"], record["prefill"]
        if seqs and not prefill:
            points["decode"].append((seqs, record["decode_ctx"] / seqs, record["s"]))
        elif len(prefill) == 1 and not seqs:
            new, context = prefill[0]
            points["prefill"].append((new, context, record["s"]))
    return points


def busy_gaps(records: list[dict]) -> list[float]:
    """One worker's seconds between back-to-back steps, in its log's order: the gap before
    each step that decodes, whose sequences were therefore unfinished when the step before
    it ended, so the loop went straight on (no idle wait). What the worker's loop costs
    per step beyond engine.step(): receiving, sending tokens and events, polling."""
    return [max(step["t"] - step["s"] - before["t"], 0.0)
            for before, step in zip(records, records[1:]) if step["decode_seqs"]]
