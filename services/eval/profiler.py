"""`svc profile`: time this machine's engine over a grid of steps and fit its cost profile
(docs/evaluation.md §2).

A prefill point times the one engine step that computes `n` new tokens of a prompt whose
first `ctx` tokens an earlier request left in the prefix cache (one such prefix per ctx).
A decode point times steps in which `batch` sequences, all past their prefill, add one
token each; its ctx is their mean context during those steps. Their contexts are loaded,
as a decode worker's are: one prompt of ctx tokens is prefilled and each sequence gets a
copy of its KV in blocks of its own. Each point is the median of `repeats` timed steps
after one untimed warm-up. `fit` then fits T = a + b·n + c·ctx + d·n·ctx to each phase (+ e·n²
for prefill). A wake point (`measure_wake`) times a short request after the engine sat
idle for a while against the same request back to back: a core (or GPU) left idle comes
back with cold caches and a lowered clock, and the first steps pay for it.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from common.cost_model import CostModel, LatencyFit, fit_error, fit_latency
from common.engine.config import DTYPES
from common.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine imports torch; callers build it
    from common.engine.engine import Engine

FIRST_PLAIN_ID = 4  # prompts avoid the special ids (0..3 in the default model)


@dataclass(frozen=True)
class Grid:
    """Where to measure: prefill over (new tokens x cached context), decode over
    (batch size x context). Points that do not fit max_model_len are skipped."""

    prefill_tokens: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    repeats: int = 3

    @property
    def max_batched_tokens(self) -> int:
        """The step budget an engine needs to run each prefill point in one step."""
        return max(max(self.prefill_tokens), max(self.decode_batches))


# The default (`svc profile`, and svc up's node profile): the fewest points that still
# span decode batches to 32 and contexts to 1,024 for both fits; on SmolLM2-135M at one
# thread it took a third of FULL_GRID's time, which --full still measures.
GRID = Grid((16, 128, 512, 1024), (0, 1024), (1, 8, 32), (64, 512), repeats=2)
FULL_GRID = Grid((16, 64, 256, 512, 1024), (0, 512, 1024, 2048), (1, 4, 16, 32), (64, 256, 1024))
QUICK_GRID = Grid((16, 128, 512), (0, 512), (1, 8), (64, 256), repeats=2)
WAKE_GAPS = (0.01, 0.03, 0.1, 0.3)  # idle seconds before a timed request (beyond 0.3 s it stayed flat)
WAKE_REPEATS = 7
WAKE_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Point:
    """One measured step time: n is new tokens (prefill) or batch size (decode)."""

    phase: str  # "prefill" or "decode"
    n: int
    ctx: float
    seconds: float


class ProfilerError(RuntimeError):
    """The engine cannot be measured as asked; the message says what to change."""


# ---- measuring -------------------------------------------------------------------------


def planned_points(grid: Grid, max_model_len: int) -> list[tuple[str, int, int]]:
    """(phase, n, ctx) of every grid point that fits max_model_len, in the order
    `measure` times them: prefill first."""
    prefill = [("prefill", n, ctx) for ctx, n in itertools.product(grid.prefill_contexts, grid.prefill_tokens)
               if ctx + n < max_model_len]
    decode = [("decode", batch, ctx) for ctx, batch in itertools.product(grid.decode_contexts, grid.decode_batches)
              if ctx + grid.repeats + 2 < max_model_len]
    return prefill + decode


def measure(engine: Engine, grid: Grid, seed: int = 0,
            on_point: Callable[[], object] | None = None) -> list[Point]:
    """Every grid point that fits the engine's max_model_len (planned_points), calling
    on_point after each. The engine must be idle, with prefix caching on and a step
    budget of grid.max_batched_tokens."""
    if engine.has_unfinished():
        raise ProfilerError("the engine must be idle")
    if not engine.config.enable_prefix_caching:
        raise ProfilerError("prefill over cached context needs prefix caching on")
    if engine.config.max_num_batched_tokens < grid.max_batched_tokens:
        raise ProfilerError(f"max_num_batched_tokens must be >= {grid.max_batched_tokens} "
                            f"to run each point in one step")
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}  # one cached context of each length for every prefill point over it
    points = []
    for phase, n, ctx in planned_points(grid, engine.max_model_len):
        if phase == "prefill":
            prefix = prefixes.setdefault(ctx, _random_ids(engine, rng, ctx))
            points.append(_prefill_point(engine, rng, n, prefix, grid.repeats))
        else:
            points.append(_decode_point(engine, rng, n, ctx, grid.repeats))
        if on_point is not None:
            on_point()
    return points


def _prefill_point(engine: Engine, rng: random.Random, n: int, prefix: list[int], repeats: int) -> Point:
    ctx = len(prefix)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if prefix:
        engine.generate([prefix], one_token)  # leaves the prefix in the prefix cache (or finds it there)
    times, cached = [], []
    for attempt in range(repeats + 1):
        request_id = f"profile-prefill-{n}-{ctx}-{attempt}"
        engine.add_request(request_id, prefix + _random_ids(engine, rng, n), one_token)
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        if engine.has_unfinished() or [o.finished for o in outputs] != [True]:
            raise ProfilerError(f"prefill of {n} tokens over {ctx} did not finish in one step")
        if attempt:
            times.append(elapsed)
            cached.append(outputs[0].num_cached_tokens)
    return Point("prefill", n, statistics.median(cached), statistics.median(times))


def _decode_point(engine: Engine, rng: random.Random, batch: int, ctx: int, repeats: int) -> Point:
    # The sequences run to max_model_len unless aborted, which they are once timed.
    params = SamplingParams(max_tokens=engine.max_model_len - ctx, temperature=0.0, ignore_eos=True)
    ids = [f"profile-decode-{batch}-{ctx}-{i}" for i in range(batch)]
    generated = dict.fromkeys(ids, 0)
    preemptions = engine.stats.num_preemptions
    try:
        _load_contexts(engine, rng, ids, ctx, params, generated)
        times, contexts = [], []
        for attempt in range(repeats + 1):
            context = ctx + statistics.mean(generated.values())
            started = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - started
            if len(outputs) != batch:
                raise ProfilerError(f"a decode step of batch {batch} ran {len(outputs)} sequences")
            _count_tokens(outputs, generated)
            if attempt:
                times.append(elapsed)
                contexts.append(context)
    finally:
        for request_id in ids:
            engine.abort(request_id)
    if engine.stats.num_preemptions != preemptions:
        raise ProfilerError(f"the KV pool cannot hold batch {batch} at context {ctx} without "
                            f"preemption; raise --kv-cache-gb")
    return Point("decode", batch, statistics.mean(contexts), statistics.median(times))


def measure_wake(engine: Engine, gaps: Sequence[float] = WAKE_GAPS, repeats: int = WAKE_REPEATS,
                 seed: int = 0) -> list[tuple[float, float]]:
    """(gap, extra seconds) per idle gap: the median time of a short request's prefill and
    first decode step after the engine sat idle `gap` seconds, less the median of the same
    back to back (never below 0). The engine must be idle."""
    if engine.has_unfinished():
        raise ProfilerError("the engine must be idle")
    rng = random.Random(seed)
    warm_s = _request_times(engine, rng, 0.0, repeats)
    return [(gap, max(0.0, _request_times(engine, rng, gap, repeats) - warm_s)) for gap in gaps]


def _request_times(engine: Engine, rng: random.Random, gap: float, repeats: int) -> float:
    """The median over `repeats` (after one untimed) of a fresh short prompt's first two
    steps, each run `gap` seconds after the last ended."""
    two_tokens = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    times = []
    for attempt in range(repeats + 1):
        engine.add_request(f"profile-wake-{gap}-{attempt}", _random_ids(engine, rng, WAKE_PROMPT_TOKENS), two_tokens)
        time.sleep(gap)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if attempt:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _load_contexts(engine: Engine, rng: random.Random, ids: list[str], ctx: int, params: SamplingParams,
                   generated: dict[str, int]) -> None:
    """Start each of `ids` decoding at a context of `ctx` tokens, as a decode worker takes
    a request a prefill worker computed (Engine.begin_load): one prompt of ctx tokens is
    prefilled here, and every sequence gets a copy of its KV in blocks of its own, under
    a prompt of its own. A step then reads as many distinct KV bytes as if each had
    prefilled its prompt, and the point costs one prefill of ctx tokens, not one per
    sequence (on a CPU computing in float32, most of the grid's time was those prefills)."""
    source = f"profile-context-{ctx}-{ids[0]}"
    engine.add_request(source, _random_ids(engine, rng, ctx),
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True)
    lease = None
    while lease is None:
        lease = next((output.kv_lease for output in engine.step() if output.request_id == source), None)
        if lease is None and not engine.has_unfinished():
            raise ProfilerError(f"the context of {ctx} tokens was computed but not held")
    try:
        values, first = engine.read_blocks(lease.block_ids), lease.first_token_id
    finally:
        engine.release_lease(lease.lease_id, source)
    for request_id in ids:
        load = engine.begin_load(request_id, _random_ids(engine, rng, ctx), params, first_token_id=first)
        if load is None:
            raise ProfilerError(f"the KV pool cannot hold batch {len(ids)} at context {ctx}; raise --kv-cache-gb")
        engine.write_blocks(load.dst_block_ids, values[load.first_block:load.first_block + len(load.dst_block_ids)])
        _count_tokens(engine.complete_load(request_id, len(load.dst_block_ids)), generated)


def _count_tokens(outputs, generated: dict[str, int]) -> None:
    for output in outputs:
        generated[output.request_id] += len(output.new_token_ids)


def _random_ids(engine: Engine, rng: random.Random, length: int) -> list[int]:
    """Fresh token ids, so no point reuses another's cached blocks by accident."""
    return [rng.randrange(FIRST_PLAIN_ID, engine.model_config.vocab_size) for _ in range(length)]


# ---- fitting ---------------------------------------------------------------------------


def fit(points: Sequence[Point]) -> tuple[LatencyFit, dict]:
    """The non-negative least-squares fit of one phase's points (prefill with its n² term,
    see common.cost_model), and its error ({"mean_abs_rel_error", "max_abs_rel_error", "points"})."""
    phases = {point.phase for point in points}
    if len(phases) > 1:
        raise ProfilerError("fit one phase at a time")
    triples = [(point.n, point.ctx, point.seconds) for point in points]
    latency = fit_latency(triples, quadratic=phases == {"prefill"})
    return latency, fit_error(latency, triples)


def profile_json(points: Sequence[Point], name: str, measured_on: dict,
                 wake: Sequence[tuple[float, float]] = ()) -> dict:
    """The profile file's object: the fits, their errors, the wake points, the points and
    where they were measured. Raises ProfileError if a fit is not a valid cost model (e.g.
    a phase has no points)."""
    phases = {phase: [p for p in points if p.phase == phase] for phase in ("prefill", "decode")}
    fits = {phase: fit(phase_points) for phase, phase_points in phases.items()}
    model = CostModel(name, fits["prefill"][0], fits["decode"][0], wake=tuple(wake))
    data = {**model.to_json(), "fit": {phase: error for phase, (_, error) in fits.items()},
            "source": "measured by svc profile", "measured_on": measured_on,
            "points": {phase: [[p.n, p.ctx, p.seconds] for p in phase_points]
                       for phase, phase_points in phases.items()}}
    CostModel.from_json(data, name)
    return data


def describe_machine(engine: Engine) -> dict:
    """Where a profile was measured, for its `measured_on` field."""
    import torch

    device = str(engine.device)
    return {
        "device": torch.cuda.get_device_name(engine.device) if device.startswith("cuda") else device,
        "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "dtype": engine.config.dtype, "model": str(engine.config.model_dir),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def node_profile_path(cache_root: Path, model_dir: Path, dtype: str, device: str, threads: int) -> Path:
    """Where `svc up` keeps the profile it measured of this node's engine: a name made
    from a digest of what the engine's step times depend on (the checkpoint's files, the
    dtype, device and torch threads, the processors, the torch build and the grid), so
    that changing any of them measures again. `dtype` is the one the engines compute in:
    `auto` is resolved first (common.engine.node_dtype), since it stands for a different
    dtype on another CPU. Reads no tensor and imports no torch."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: a node profile is keyed by a resolved dtype, one of {DTYPES}, not {dtype!r}")
    files = sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns)
                   for path in model_dir.iterdir() if path.is_file())
    facts = {"model": str(model_dir.resolve()), "files": files, "dtype": dtype, "device": device,
             "threads": threads, "processors": processor_names(device), "cpu_count": os.cpu_count(),
             "torch": _package_version("torch"), "grid": repr(GRID), "wake": WAKE_GAPS}
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root / "profiles" / f"{model_dir.name}-{device.replace(':', '')}-{digest}.json"


def processor_names(device: str) -> list[str]:
    """The CPU's model name (Linux: /proc/cpuinfo; else what platform says) and, for a
    CUDA device, the driver's names of the GPUs."""
    cpu = _field_values(Path("/proc/cpuinfo"), "model name")[:1]
    names = cpu or [platform.processor() or platform.machine()]
    if device.startswith("cuda"):
        for information in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            names += _field_values(information, "Model")
    return names


def _field_values(path: Path, key: str) -> list[str]:
    """The values of a `key: value` text file's lines that start with `key`; [] if unreadable."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith(key) and ":" in line]


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def run_profile(engine: Engine, grid: Grid, name: str) -> dict:
    """measure, then profile_json: what `svc profile` writes. Its progress goes to stderr
    (stdout may carry the profile): a bar on a terminal, else a line every 2 s."""
    from common.progress import heartbeat, progress

    total = len(planned_points(grid, engine.max_model_len))
    with progress(total, "profile", "point") as bar:
        points = measure(engine, grid, on_point=bar.update)
    with heartbeat("profile: timing requests after idle gaps"):
        wake = measure_wake(engine)
    return profile_json(points, name, describe_machine(engine), wake)
