"""Step-time cost model (DESIGN §7): what prefill and decode cost on one worker.

Both phases use Preble's form T = a + b·n + c·ctx + d·n·ctx, in seconds:
  prefill: n = new tokens computed, ctx = cached context they attend to;
  decode:  n = sequences in the batch, ctx = their mean context length.
A profile is a JSON object {"name", "prefill": {a,b,c,d}, "decode": {a,b,c,d}}; the
router, the simulator and the profiler all read this one format.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


class ProfileError(ValueError):
    """A profile file or object that is not a valid cost model; the text says why."""


@dataclass(frozen=True)
class LatencyFit:
    """T(n, ctx) = a + b·n + c·ctx + d·n·ctx seconds."""

    a: float
    b: float
    c: float = 0.0
    d: float = 0.0

    def __call__(self, n: float, ctx: float = 0.0) -> float:
        return self.a + self.b * n + self.c * ctx + self.d * n * ctx

    def marginal(self, n: float, ctx: float = 0.0) -> float:
        """The cost of n more units without the fixed per-step term `a`."""
        return self.b * n + self.c * ctx + self.d * n * ctx


@dataclass(frozen=True)
class CostModel:
    name: str
    prefill: LatencyFit
    decode: LatencyFit

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
        return {"name": self.name, "prefill": asdict(self.prefill), "decode": asdict(self.decode)}

    @classmethod
    def from_json(cls, data: object, source: str = "profile") -> CostModel:
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        name = data.get("name", "")
        if not isinstance(name, str):
            raise ProfileError(f"{source}: name must be a string")
        return cls(name, _fit(data, "prefill", source), _fit(data, "decode", source))


def _fit(data: dict, phase: str, source: str) -> LatencyFit:
    coefficients = data.get(phase)
    if not isinstance(coefficients, dict):
        raise ProfileError(f"{source}: {phase} must be an object with coefficients a, b, c, d")
    unknown = set(coefficients) - {"a", "b", "c", "d"}
    if unknown:
        raise ProfileError(f"{source}: {phase} has unknown keys {sorted(unknown)}")
    values = {}
    for key in ("a", "b", "c", "d"):
        value = coefficients.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise ProfileError(f"{source}: {phase}.{key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    if values["a"] + values["b"] <= 0:
        raise ProfileError(f"{source}: {phase} predicts zero time (a and b are both 0)")
    return LatencyFit(**values)


# Fitted to the embedded tiny model in bfloat16 on one core of the 2-core development
# machine (prefill 16..2048 tokens over 0..2048 cached, decode batch 1..32 over 128..1024).
TINY_CPU = CostModel(
    name="tiny-cpu",
    prefill=LatencyFit(a=3.5e-3, b=5.5e-5, c=7.3e-6, d=1.75e-8),
    decode=LatencyFit(a=3.9e-3, b=1.7e-4, c=0.0, d=6.7e-7),
)


def load_cost_model(path: str | Path | None) -> CostModel:
    """The profile at `path`, or the built-in tiny-model profile when path is empty."""
    if not path:
        return TINY_CPU
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ProfileError(f"{path}: cannot read profile: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProfileError(f"{path}: not valid JSON: {error}") from None
    return CostModel.from_json(data, str(path))
