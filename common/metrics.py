"""Prometheus metrics through `prometheus_client`, one registry per process.

There is no module-global state: each process builds a `Registry` (its own
`CollectorRegistry`, never the library's default one), creates its metrics on it and
hands it to whatever serves `/metrics`. `prometheus_client` does the locking and the
exposition; this module keeps Baton's calling convention (labels as keyword arguments,
one call per update) and gauges read from a callback at scrape time.

    registry = Registry()
    requests = registry.counter("baton_requests_total", "Requests ended", labels=("outcome",))
    requests.inc(outcome="ok")
    latency = registry.histogram("baton_request_seconds", "Arrival to last token")
    latency.observe(0.42)
    text = registry.render()  # the text exposition format, served as CONTENT_TYPE
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any, overload

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# What render() writes: the classic text format, as prometheus_client's own /metrics
# answers a scraper that asks for nothing newer.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# From 1 ms (one decode step of a small model on a GPU) to a minute (a long generation).
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)

# The classic names every Prometheus scrapes (prometheus_client also takes UTF-8 names,
# which Prometheus before 3.0 and most dashboards cannot query).
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

log = logging.getLogger(__name__)


class _Labelled:
    """A prometheus_client metric updated as `update(amount, label=value, ...)`."""

    # `metric` is a prometheus_client Counter, Gauge or Histogram (their update methods differ).
    def __init__(self, name: str, metric: Any, labels: tuple[str, ...]):
        self._name = name
        self._metric = metric
        self._labels = labels

    def _child(self, labels: dict[str, object]) -> Any:
        if set(labels) != set(self._labels):
            raise ValueError(f"{self._name}: labels must be {sorted(self._labels)}, got {sorted(labels)}")
        return self._metric.labels(**{name: str(value) for name, value in labels.items()}) if labels else self._metric


class Counter(_Labelled):
    def inc(self, amount: float = 1, **labels: object) -> None:
        self._child(labels).inc(amount)


class Gauge(_Labelled):
    def set(self, value: float, **labels: object) -> None:
        self._child(labels).set(value)

    def inc(self, amount: float = 1, **labels: object) -> None:
        self._child(labels).inc(amount)

    def dec(self, amount: float = 1, **labels: object) -> None:
        self._child(labels).dec(amount)


class Histogram(_Labelled):
    def observe(self, value: float, **labels: object) -> None:
        self._child(labels).observe(value)


class _CallbackGauge:
    """A gauge whose value a callback gives at scrape time; a failing callback drops
    only its own sample (and is logged), never the rest of the scrape."""

    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = name, help, read

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.help)]

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.help)
        try:
            family.add_metric([], float(self.read()))
        except Exception:  # noqa: BLE001 (one broken reading must not fail the scrape)
            log.exception("metric_collect_failed", extra={"metric": self.name})
        return [family]


class Registry:
    """The metrics of one process. Names are checked by prometheus_client: a duplicate
    or an invalid name or label raises ValueError."""

    def __init__(self) -> None:
        self.collectors = prometheus_client.CollectorRegistry(auto_describe=True)

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        labels = _checked(name, labels)
        return Counter(name, prometheus_client.Counter(name, help, labels, registry=self.collectors), labels)

    @overload
    def gauge(self, name: str, help: str, labels: Iterable[str] = (), collect: None = None) -> Gauge: ...

    @overload
    def gauge(self, name: str, help: str, labels: Iterable[str] = (), *, collect: Callable[[], float]) -> None: ...

    def gauge(self, name: str, help: str, labels: Iterable[str] = (),
              collect: Callable[[], float] | None = None) -> Gauge | None:
        """A gauge to set; with `collect`, one read from the callback at scrape time
        (unlabelled, nothing to set: None is returned)."""
        labels = _checked(name, labels)
        if collect is not None:
            if labels:
                raise ValueError(f"{name}: a gauge read from a callback takes no labels")
            self.collectors.register(_CallbackGauge(name, help, collect))
            return None
        return Gauge(name, prometheus_client.Gauge(name, help, labels, registry=self.collectors), labels)

    def histogram(self, name: str, help: str, buckets: Iterable[float] = DEFAULT_LATENCY_BUCKETS,
                  labels: Iterable[str] = ()) -> Histogram:
        labels = _checked(name, labels)
        return Histogram(name, prometheus_client.Histogram(name, help, labels, buckets=tuple(buckets),
                                                           registry=self.collectors), labels)

    def render(self) -> str:
        """Every metric in the text exposition format (serve it as CONTENT_TYPE)."""
        return prometheus_client.generate_latest(self.collectors).decode("utf-8")


def _checked(name: str, labels: Iterable[str]) -> tuple[str, ...]:
    labels = tuple(labels)
    if not METRIC_NAME_RE.match(name):
        raise ValueError(f"metric name {name!r} is not [a-zA-Z_:][a-zA-Z0-9_:]*")
    for label in labels:
        if not LABEL_NAME_RE.match(label):
            raise ValueError(f"{name}: label name {label!r} is not [a-zA-Z_][a-zA-Z0-9_]*")
    return labels
