"""Prometheus metrics without dependencies: counters, gauges and histograms.

There is no module-global state: each process builds a `Registry`, creates its metrics on
it and hands it to whatever renders `/metrics`. Every metric guards its samples with its
own lock, so any thread may update any metric.

    registry = Registry()
    requests = registry.counter("baton_requests_total", "Requests ended", labels=("outcome",))
    requests.inc(outcome="ok")
    latency = registry.histogram("baton_request_seconds", "Arrival to last token")
    latency.observe(0.42)
    text = registry.render()  # text exposition format 0.0.4, served as CONTENT_TYPE
"""
from __future__ import annotations

import bisect
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar, Union

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From 1 ms (one decode step of a small model on a GPU) to a minute (a long generation).
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)

METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Label names that would collide with the keyword parameters of inc/set/observe.
RESERVED_LABELS = frozenset({"amount", "value"})

LabelKey = tuple[str, ...]
CollectResult = Union[float, Mapping[LabelKey, float]]
_MetricT = TypeVar("_MetricT", bound="_Metric")

log = logging.getLogger(__name__)


# ---- formatting --------------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: +Inf, -Inf, NaN, integers without '.0'."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in zip(names, values))
    return "{" + pairs + "}"


def _sample(name: str, names: Sequence[str], values: Sequence[str], value: float) -> str:
    return f"{name}{_format_labels(names, values)} {format_value(value)}"


# ---- metrics -----------------------------------------------------------------------


class _Metric:
    """Name, help, label names and a lock; subclasses keep one sample state per label set."""

    kind = "untyped"
    reserved_labels: frozenset[str] = RESERVED_LABELS

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()):
        _check_name(name)
        self.name = name
        self.help = help
        # labels="outcome" means one label, not seven one-letter ones.
        self.labelnames: tuple[str, ...] = (labels,) if isinstance(labels, str) else tuple(labels)
        self._check_labelnames()
        self._lock = threading.Lock()

    def _check_labelnames(self) -> None:
        if len(set(self.labelnames)) != len(self.labelnames):
            raise ValueError(f"{self.name}: duplicate label names in {self.labelnames}")
        for label in self.labelnames:
            if not LABEL_NAME_RE.match(label) or label.startswith("__"):
                raise ValueError(f"{self.name}: invalid label name {label!r}")
            if label in self.reserved_labels:
                raise ValueError(f"{self.name}: label name {label!r} is reserved")

    def _key(self, labels: Mapping[str, object]) -> LabelKey:
        """The label values in declaration order; ValueError names missing or unknown labels."""
        if labels.keys() != set(self.labelnames):
            missing = sorted(set(self.labelnames) - labels.keys())
            unknown = sorted(labels.keys() - set(self.labelnames))
            problems = [f"missing {', '.join(missing)}"] if missing else []
            problems += [f"unknown {', '.join(unknown)}"] if unknown else []
            raise ValueError(f"{self.name}: wrong labels ({'; '.join(problems)}); "
                             f"expected ({', '.join(self.labelnames)})")
        return tuple(str(labels[label]) for label in self.labelnames)

    def exposed_names(self) -> tuple[str, ...]:
        """Every sample name this metric writes, for collision checks in the registry."""
        return (self.name,)

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines += self.samples()
        return "\n".join(lines) + "\n"


class Counter(_Metric):
    """A monotonically increasing total (name it `..._total`)."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()):
        super().__init__(name, help, labels)
        self._values: dict[LabelKey, float] = {} if self.labelnames else {(): 0.0}

    def inc(self, amount: float = 1, **labels: object) -> None:
        """Add `amount` (>= 0) to the label set's total; ValueError on a negative amount."""
        if not amount >= 0:  # also rejects NaN
            raise ValueError(f"{self.name}: a counter only goes up, got inc({amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: object) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            values = list(self._values.items())
        return [_sample(self.name, self.labelnames, key, value) for key, value in values]


class Gauge(_Metric):
    """A value that goes up and down, set directly or read from `collect` at render time.

    `collect` returns a float (unlabelled gauge) or {label values tuple: value}; a gauge
    with `collect` is read-only and set/inc/dec raise RuntimeError. A failing callback
    drops only this gauge's samples from the render (and logs), never the whole page.
    """

    kind = "gauge"

    def __init__(self, name: str, help: str, labels: Iterable[str] = (),
                 collect: Callable[[], CollectResult] | None = None):
        super().__init__(name, help, labels)
        self._collect = collect
        self._values: dict[LabelKey, float] = {} if self.labelnames else {(): 0.0}

    def set(self, value: float, **labels: object) -> None:
        key = self._writable_key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1, **labels: object) -> None:
        key = self._writable_key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1, **labels: object) -> None:
        self.inc(-amount, **labels)

    def value(self, **labels: object) -> float:
        key = self._key(labels)
        if self._collect is not None:
            return self._collected().get(key, 0.0)
        with self._lock:
            return self._values.get(key, 0.0)

    def _writable_key(self, labels: Mapping[str, object]) -> LabelKey:
        if self._collect is not None:
            raise RuntimeError(f"{self.name}: this gauge is read from its collect callback")
        return self._key(labels)

    def _collected(self) -> dict[LabelKey, float]:
        """The callback's result as {label key: value}; ValueError on a wrong shape."""
        result = self._collect()  # type: ignore[misc]
        if not isinstance(result, Mapping):
            if self.labelnames:
                raise ValueError(f"{self.name}: collect returned a number for a labelled gauge")
            return {(): float(result)}
        values = {}
        for key, value in result.items():
            key = key if isinstance(key, tuple) else (key,)
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: collect key {key!r} does not match labels "
                                 f"({', '.join(self.labelnames)})")
            values[tuple(str(part) for part in key)] = float(value)
        return values

    def samples(self) -> list[str]:
        if self._collect is not None:
            try:
                values = list(self._collected().items())
            except Exception:  # a broken callback must not take /metrics down
                log.exception("metrics: collect callback for %s failed", self.name)
                return []
        else:
            with self._lock:
                values = list(self._values.items())
        return [_sample(self.name, self.labelnames, key, value) for key, value in values]


class _HistogramState:
    __slots__ = ("counts", "sum")

    def __init__(self, num_buckets: int):
        self.counts = [0] * num_buckets  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0


class Histogram(_Metric):
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    kind = "histogram"
    reserved_labels = RESERVED_LABELS | {"le"}

    def __init__(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_LATENCY_BUCKETS,
                 labels: Iterable[str] = ()):
        super().__init__(name, help, labels)
        self.buckets = _check_buckets(name, buckets)
        self._states: dict[LabelKey, _HistogramState] = {}
        if not self.labelnames:
            self._states[()] = _HistogramState(len(self.buckets) + 1)

    def exposed_names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        # NaN compares false with every bound; Prometheus counts it in +Inf only.
        index = len(self.buckets) if math.isnan(value) else bisect.bisect_left(self.buckets, value)
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = _HistogramState(len(self.buckets) + 1)
            state.counts[index] += 1
            state.sum += value

    def snapshot(self, **labels: object) -> tuple[list[int], float, int]:
        """(cumulative bucket counts ending with +Inf, sum, count) for one label set."""
        key = self._key(labels)
        with self._lock:
            state = self._states.get(key)
            counts, total = (list(state.counts), state.sum) if state else ([0] * (len(self.buckets) + 1), 0.0)
        cumulative = _cumulative(counts)
        return cumulative, total, cumulative[-1]

    def samples(self) -> list[str]:
        with self._lock:
            states = [(key, list(state.counts), state.sum) for key, state in self._states.items()]
        lines: list[str] = []
        bounds = [format_value(bound) for bound in self.buckets] + ["+Inf"]
        for key, counts, total in states:
            cumulative = _cumulative(counts)
            for bound, count in zip(bounds, cumulative):
                lines.append(_sample(f"{self.name}_bucket", (*self.labelnames, "le"), (*key, bound), count))
            lines.append(_sample(f"{self.name}_sum", self.labelnames, key, total))
            lines.append(_sample(f"{self.name}_count", self.labelnames, key, cumulative[-1]))
        return lines


def _cumulative(counts: Sequence[int]) -> list[int]:
    running, out = 0, []
    for count in counts:
        running += count
        out.append(running)
    return out


def _check_name(name: str) -> None:
    if not METRIC_NAME_RE.match(name):
        raise ValueError(f"invalid metric name {name!r}: must match {METRIC_NAME_RE.pattern}")


def _check_buckets(name: str, buckets: Iterable[float]) -> tuple[float, ...]:
    """Finite, strictly increasing upper bounds; a trailing +Inf is implied and dropped."""
    bounds = [float(bound) for bound in buckets]
    if bounds and bounds[-1] == math.inf:
        bounds.pop()
    if any(not math.isfinite(bound) for bound in bounds):
        raise ValueError(f"{name}: bucket bounds must be finite (+Inf is implied), got {bounds}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}: bucket bounds must be strictly increasing, got {bounds}")
    return tuple(bounds)


# ---- registry ----------------------------------------------------------------------


class Registry:
    """The metrics of one process, rendered together in creation order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: list[_Metric] = []
        self._names: set[str] = set()

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Iterable[str] = (),
              collect: Callable[[], CollectResult] | None = None) -> Gauge:
        return self._register(Gauge(name, help, labels, collect=collect))

    def histogram(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_LATENCY_BUCKETS,
                  labels: Iterable[str] = ()) -> Histogram:
        return self._register(Histogram(name, help, buckets, labels))

    def _register(self, metric: _MetricT) -> _MetricT:
        """Add `metric`; ValueError if any sample name it writes is already taken."""
        names = metric.exposed_names()
        with self._lock:
            taken = sorted(self._names.intersection(names))
            if taken:
                raise ValueError(f"metric name already registered: {', '.join(taken)}")
            self._names.update(names)
            self._metrics.append(metric)
        return metric

    def render(self) -> str:
        """Every metric in the text exposition format 0.0.4 (serve it as CONTENT_TYPE)."""
        with self._lock:
            metrics = list(self._metrics)
        return "".join(metric.render() for metric in metrics)
