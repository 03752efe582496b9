"""Settings declared once: each is a dataclass field whose metadata holds its help text,
its allowed choices and its check. `ClusterConfig` and `EngineConfig` are made of such
fields; the TOML keys, the BATON_* variables, the `svc` flags, their help and the
validation are all derived from the declaration, so none of them is a second list.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args, get_type_hints

SCALARS = (bool, int, float, str)  # the types a flag or an environment variable can carry


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message starts with the key."""


@dataclass(frozen=True)
class Check:
    """A condition on one value; `requirement` completes "must be ..." in the error."""

    holds: Callable[[Any], bool]
    requirement: str


POSITIVE_INT = Check(lambda value: value > 0, "a positive integer")
POSITIVE = Check(lambda value: math.isfinite(value) and value > 0, "a finite number > 0")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple = (),
            check: Check | None = None, switch: bool = False,
            default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field declaring one setting. `choices`: the only values allowed;
    `check`: a condition on the value (None, where that is the default, means unset and
    is not checked); `switch`: a bool whose flag takes no value (given = true)."""
    metadata = {"help": help, "choices": tuple(choices), "check": check, "switch": switch}
    return dataclasses.field(default=default, default_factory=default_factory or dataclasses.MISSING,
                             metadata=metadata)


@functools.cache
def setting_types(cls: type) -> dict[str, Any]:
    """Each field of dataclass `cls` and its type, `X | None` read as X (None only ever
    comes from the declared default: no source can write it)."""
    hints = get_type_hints(cls)
    return {spec.name: _unoptional(hints[spec.name]) for spec in dataclasses.fields(cls)}


def _unoptional(kind: Any) -> Any:
    if isinstance(kind, types.UnionType):
        (kind,) = (arg for arg in get_args(kind) if arg is not type(None))
    return kind


def is_a(value: Any, kind: Any) -> bool:
    """Whether `value` is of scalar type `kind` (an int is a float, a bool is no number);
    values of other types are left to their own checks."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind) if kind in SCALARS else True


def check_settings(instance: Any) -> None:
    """Raise ConfigError naming the first field of dataclass `instance` whose value is not
    of its type or breaks its declared choices or check."""
    cls: type = type(instance)
    kinds = setting_types(cls)
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        if value is None and spec.default is None:
            continue
        if not is_a(value, kinds[spec.name]):
            raise ConfigError(f"{spec.name}: must be {kinds[spec.name].__name__}, got {value!r}")
        choices, check = spec.metadata.get("choices"), spec.metadata.get("check")
        if choices and value not in choices:
            raise ConfigError(f"{spec.name}: unknown {value!r}; choose one of {', '.join(map(str, choices))}")
        if check is not None and not check.holds(value):
            raise ConfigError(f"{spec.name}: must be {check.requirement}, got {value!r}")
