"""Step-time cost model (docs/evaluation.md §1): what prefill and decode cost on one worker.

Both phases use Preble's form T = a + b·n + c·ctx + d·n·ctx, in seconds, plus e·n²:
  prefill: n = new tokens computed, ctx = cached context they attend to; e·n² is the new
           tokens attending to each other (DistServe's Σlen² term), fitted for measured
           profiles: on the tiny model a cold 400-token prompt took 10-20 % longer than the
           linear form fitted to a serving mix of cold prompts and prefix hits said;
  decode:  n = sequences in the batch, ctx = their mean context length (e stays 0).
A profile is a JSON object {"name", "prefill": {a,b,c,d[,e]}, "decode": {a,b,c,d}}, and
optionally "wake": [[idle seconds, extra seconds], ...], what a worker's first request
after that long idle takes beyond a warm worker's (its caches went cold, its clock down;
`svc profile` measures it). The router, the simulator and the profiler all read this one
format. A profile may also carry metadata that readers ignore: "fit" (the fit's error per
phase), "source", "measured_on" and "points" (what was measured). `load_cost_model` also takes a profile name
(common/profiles.py: analytic GPU profiles such as "a6000/mistral-7b", published fits).
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REWEIGHTS = 3  # fit_latency's passes relative to its own predictions (it converges in 1-2)
COEFFICIENTS = ("a", "b", "c", "d", "e")


class ProfileError(ValueError):
    """A profile file or object that is not a valid cost model; the text says why."""


@dataclass(frozen=True)
class LatencyFit:
    """T(n, ctx) = a + b·n + c·ctx + d·n·ctx + e·n² seconds."""

    a: float
    b: float
    c: float = 0.0
    d: float = 0.0
    e: float = 0.0

    def __call__(self, n: float, ctx: float = 0.0) -> float:
        # Written out, not a + marginal(): the router and the simulator call this per decision.
        return self.a + self.b * n + self.c * ctx + self.d * n * ctx + self.e * n * n

    def marginal(self, n: float, ctx: float = 0.0) -> float:
        """The cost of n more units without the fixed per-step term `a`."""
        return self.b * n + self.c * ctx + self.d * n * ctx + self.e * n * n


@dataclass(frozen=True)
class CostModel:
    name: str
    prefill: LatencyFit
    decode: LatencyFit
    kv_bytes_per_token: int = 0  # the model's KV cache per token (all layers, K and V); 0: not known
    wake: tuple[tuple[float, float], ...] = ()  # (idle s, extra s), idle ascending; (): not measured

    def wake_s(self, idle_s: float) -> float:
        """What a request on a worker idle for `idle_s` takes beyond one on a busy worker:
        linear between (0, 0) and the measured points, the last point's beyond it."""
        idle_before, extra_before = 0.0, 0.0
        for idle, extra in self.wake:
            if idle_s < idle:
                return extra_before + (extra - extra_before) * max(0.0, idle_s - idle_before) / (idle - idle_before)
            idle_before, extra_before = idle, extra
        return extra_before

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill `new_tokens` on top of `cached_tokens` of reused context."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill(new_tokens, cached_tokens)

    def recompute_s(self, num_tokens: int, depth_tokens: int = 0) -> float:
        """Marginal prefill time of `num_tokens` that start `depth_tokens` into a prompt."""
        return self.prefill.marginal(num_tokens, depth_tokens)

    def decode_step_s(self, batch_size: int, mean_context: float) -> float:
        """One decode iteration for `batch_size` sequences: also the TPOT they see."""
        return self.decode(max(batch_size, 1), mean_context)

    def to_json(self) -> dict:
        data: dict[str, object] = {"name": self.name, "prefill": asdict(self.prefill),
                                   "decode": asdict(self.decode)}
        if self.kv_bytes_per_token:
            data["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.wake:
            data["wake"] = [list(point) for point in self.wake]
        return data

    @classmethod
    def from_json(cls, data: object, source: str = "profile") -> CostModel:
        """The cost model of a profile object; keys beside name, prefill and decode (the
        metadata) are ignored, unknown keys inside prefill or decode are refused."""
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        name = data.get("name", "")
        if not isinstance(name, str):
            raise ProfileError(f"{source}: name must be a string")
        kv_bytes = data.get("kv_bytes_per_token", 0)
        if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < 0:
            raise ProfileError(f"{source}: kv_bytes_per_token must be an integer >= 0, got {kv_bytes!r}")
        return cls(name, _fit(data, "prefill", source), _fit(data, "decode", source), kv_bytes,
                   _wake(data.get("wake", []), source))


def _wake(points: object, source: str) -> tuple[tuple[float, float], ...]:
    """A profile's "wake" points, checked: [idle s, extra s] pairs of finite numbers >= 0,
    idle > 0 and ascending."""
    def number(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
            and value >= 0

    if not isinstance(points, list):
        raise ProfileError(f"{source}: wake must be a list of [idle seconds, extra seconds] pairs")
    wake, idle_before = [], 0.0
    for index, point in enumerate(points):
        if not (isinstance(point, list) and len(point) == 2 and all(number(value) for value in point)):
            raise ProfileError(f"{source}: wake[{index}] must be [idle seconds, extra seconds], "
                               f"two finite numbers >= 0, got {point!r}")
        if point[0] <= idle_before:
            raise ProfileError(f"{source}: wake[{index}]'s idle seconds must exceed the point before's "
                               f"({point[0]!r} <= {idle_before!r})")
        idle_before = float(point[0])
        wake.append((float(point[0]), float(point[1])))
    return tuple(wake)


def _fit(data: dict, phase: str, source: str) -> LatencyFit:
    coefficients = data.get(phase)
    if not isinstance(coefficients, dict):
        raise ProfileError(f"{source}: {phase} must be an object with coefficients a, b, c, d (and e)")
    unknown = set(coefficients) - set(COEFFICIENTS)
    if unknown:
        raise ProfileError(f"{source}: {phase} has unknown keys {sorted(unknown)}")
    values = {}
    for key in COEFFICIENTS:
        value = coefficients.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise ProfileError(f"{source}: {phase}.{key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    if values["a"] + values["b"] <= 0:
        raise ProfileError(f"{source}: {phase} predicts zero time (a and b are both 0)")
    return LatencyFit(**values)


@dataclass(frozen=True)
class TierLink:
    """How a KV store tier's blocks reach an engine: bytes per second, plus a fixed latency per fetch."""

    bandwidth_bytes_s: float
    latency_s: float


# Conservative: a same-host DRAM copy through shared memory runs at several GB/s, a read of
# the SSD tier's slot files at about one; a fetch also pays a control round trip and a lease.
DRAM_LINK = TierLink(bandwidth_bytes_s=5e9, latency_s=1e-3)
SSD_LINK = TierLink(bandwidth_bytes_s=1e9, latency_s=2e-3)
# Used when the profile does not say how large a token's KV is: Llama-3-8B's in bf16
# (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes), larger than the small models'
# so a fetch is priced slow rather than fast.
DEFAULT_KV_BYTES_PER_TOKEN = 131072


@dataclass(frozen=True)
class StorePricing:
    """What fetching blocks from the cluster's KV store costs (docs/router.md §7): per tier
    (0 = DRAM, 1 = SSD), blocks x bytes_per_block / bandwidth + latency."""

    bytes_per_block: int
    tiers: tuple[TierLink, ...] = (DRAM_LINK, SSD_LINK)
    always_fetch: bool = False  # engines fetch even where recomputing is quicker (kvstore_fetch = always)

    @classmethod
    def for_model(cls, cost: CostModel, block_size: int, tiers: tuple[TierLink, ...] = (DRAM_LINK, SSD_LINK),
                  always_fetch: bool = False) -> StorePricing:
        """The pricing for blocks of `block_size` tokens of the profile's model."""
        per_token = cost.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
        return cls(per_token * block_size, tiers, always_fetch)

    def fetch_s(self, blocks_per_tier: Sequence[int]) -> float:
        """Seconds to fetch blocks_per_tier[t] blocks from each tier t (0: nothing to fetch)."""
        seconds = 0.0
        for tier, blocks in enumerate(blocks_per_tier):
            if blocks:
                link = self.tiers[tier]
                seconds += blocks * self.bytes_per_block / link.bandwidth_bytes_s + link.latency_s
        return seconds


# Fitted to the embedded tiny model in bfloat16 on one core of the 2-core development
# machine (prefill 16..2048 tokens over 0..2048 cached, decode batch 1..32 over 128..1024).
TINY_CPU = CostModel(
    name="tiny-cpu",
    prefill=LatencyFit(a=3.5e-3, b=5.5e-5, c=7.3e-6, d=1.75e-8),
    decode=LatencyFit(a=3.9e-3, b=1.7e-4, c=0.0, d=6.7e-7),
)


def load_cost_model(path_or_name: str | Path | None) -> CostModel:
    """The profile in the file `path_or_name`, else the built-in profile of that name
    (common/profiles.py, or "tiny-cpu"), else ProfileError; the tiny-model profile when it
    is empty."""
    if not path_or_name or path_or_name == TINY_CPU.name:
        return TINY_CPU
    path = Path(path_or_name)
    if not path.is_file():
        from common.profiles import analytic_profile  # it imports this module

        try:
            return analytic_profile(str(path_or_name))
        except ProfileError as error:
            raise ProfileError(f"{path_or_name}: no such profile file, and {error}") from None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ProfileError(f"{path}: cannot read profile: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProfileError(f"{path}: not valid JSON: {error}") from None
    return CostModel.from_json(data, str(path))


# ---- fitting ---------------------------------------------------------------------------


def fit_latency(points: Iterable[tuple[float, float, float]], quadratic: bool = False) -> LatencyFit:
    """The T = a + b·n + c·ctx + d·n·ctx (+ e·n² with `quadratic`, for prefill) with all
    coefficients >= 0 that best fits the (n, ctx, seconds) points in least squares of the
    relative error.

    Relative, because step times span orders of magnitude and the router needs short steps
    as right as long ones. Relative to the fit's own prediction, not to each measured time:
    dividing by the measurement weighs a step that happened to run slow less than one that
    ran fast, and on a noisy machine that pulled the fit ~13 % under the mean step time
    (a simulator on it then ran that much fast). So the first pass divides by the measured
    times and REWEIGHTS passes divide by the previous pass's predictions.
    Raises ProfileError on no points or a time that is not > 0.
    """
    data = np.asarray(list(points), dtype=float).reshape(-1, 3)
    if not len(data):
        raise ProfileError("no points to fit")
    if not np.all(np.isfinite(data)) or np.any(data[:, 2] <= 0):
        raise ProfileError("every point needs finite n and ctx and a time > 0")
    n, ctx, seconds = data.T
    features = np.column_stack([np.ones_like(n), n, ctx, n * ctx, *([n * n] if quadratic else [])])
    relative_to = seconds
    for _ in range(REWEIGHTS + 1):
        coefficients = _nonnegative_least_squares(features / relative_to[:, None], seconds / relative_to)
        predicted = features @ coefficients
        if not np.all(predicted > 0):  # a zero fit of some point: keep this pass's
            break
        relative_to = predicted
    return LatencyFit(*(_same_on_every_cpu(float(value)) for value in coefficients))


def _same_on_every_cpu(value: float) -> float:
    """`value` to 12 significant digits. numpy's LAPACK picks its kernels by the CPU
    (AVX-512 or not), and they differ in the last bits of a fit: rounded, the same points
    give the same profile, and the same simulated results, on every machine."""
    return float(f"{value:.12g}")


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ‖design·x − target‖ over x >= 0, for few columns, exactly: the optimum is
    the unconstrained fit on some subset of the columns, so every subset is fitted and
    the best feasible one kept."""
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0  # a term no point exercises (ctx always 0) stays at 0
    design = design / scale
    columns_count = design.shape[1]
    best_residual, best = math.inf, np.zeros(columns_count)
    for size in range(1, columns_count + 1):
        for support in itertools.combinations(range(columns_count), size):
            columns = list(support)
            solution, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
            if np.any(solution < 0):
                continue
            coefficients = np.zeros(columns_count)
            coefficients[columns] = solution
            residual = float(np.sum((design @ coefficients - target) ** 2))
            if residual < best_residual * (1 - 1e-9):  # a larger support must really help
                best_residual, best = residual, coefficients
    return best / scale


def fit_error(fit: LatencyFit, points: Iterable[tuple[float, float, float]]) -> dict:
    """How far `fit` is from the (n, ctx, seconds) points, relative to each measured time:
    {"mean_abs_rel_error", "max_abs_rel_error", "points"}."""
    errors = [abs(fit(n, ctx) - seconds) / seconds for n, ctx, seconds in points]
    if not errors:
        raise ProfileError("no points to measure the fit's error on")
    return {"mean_abs_rel_error": sum(errors) / len(errors), "max_abs_rel_error": max(errors),
            "points": len(errors)}
