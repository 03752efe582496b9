"""The cluster configuration every role reads: TOML file < BATON_* environment < flags.

One flat, frozen dataclass; each role takes the fields it needs. Addresses default to
ports counted from `port_base` on `host`, so a whole single-node cluster needs only one
number. Every value is validated at start; errors name the key and where it came from.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from common.engine.config import DEVICE_PATTERN, QUEUE_POLICIES

ENV_PREFIX = "BATON_"
ROUTER_POLICIES = ("round_robin", "least_load", "lpm", "cache_aware", "dynamo", "e2")
INDEX_MODES = ("events", "approximate")
SLO_CLASS_NAME_MAX_CHARS = 64  # the longest name a request may carry (HTTP checks it too)
TABLE_KEYS = ("api_keys", "slo_classes")  # TOML tables that are values, not sections


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key."""


class UnknownSloClass(ValueError):
    """A request names an SLO class the configuration does not have."""


@dataclass(frozen=True)
class SloClass:
    """A latency target: time to first token and time per output token after it, in seconds."""

    name: str
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class ClusterConfig:
    host: str = "127.0.0.1"
    advertise_host: str = ""  # how other hosts reach this role's bound sockets; default `host`
    port_base: int = 7100
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    router_address: str = ""  # default tcp://host:port_base
    sdk_address: str = ""  # default tcp://host:port_base+1
    stream_address: str = ""  # default tcp://host:port_base+2

    model: str = ""  # checkpoint directory; "" = the embedded tiny default
    model_name: str = "baton-default"
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_gb: float = 1.0
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0 = the model's own limit
    queue_policy: str = "fcfs"
    threads: int = 0  # torch threads per worker; 0 = torch's default (svc up splits the cores)
    step_log_dir: str = ""  # each worker appends its engine steps to DIR/worker-N.steps.jsonl; "" = off

    policy: str = "round_robin"
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 3.0
    worker_stall_timeout_s: float = 30.0  # a worker whose loop has not turned this long stops heartbeating
    max_queued_requests: int = 256  # per worker, beyond its running batch
    max_queued_tokens: int = 262144  # per worker, prompt tokens waiting
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 120.0  # a request with no token by then times out (capped by its own timeout)
    admission: bool = False  # SLO-aware admission control
    index_mode: str = "events"  # how the router knows workers' prefix caches: KV events or its own guess
    index_ttl_s: float = 120.0  # approximate index: how long a routed prefix is assumed cached
    load_window_s: float = 180.0  # how far back the router's load estimates look
    profile: str = ""  # JSON cost profile; "" = the built-in one

    slo_classes: tuple[SloClass, ...] = ()
    default_slo_class: str = ""  # for requests that name no class and whose tenant has none; "" = no SLO

    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    curve_enabled: bool = False
    curve_keys_dir: str = ""  # per-role CURVE key pairs, as `svc keys generate DIR` writes them
    insecure: bool = False  # allow binding beyond loopback with CURVE off (warned on every start)

    log_level: str = "info"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived addresses ---------------------------------------------------------

    def port(self, offset: int) -> int:
        return self.port_base + offset

    def address(self, offset: int) -> str:
        return f"tcp://{self.host}:{self.port(offset)}"

    @property
    def router(self) -> str:
        return self.router_address or self.address(0)

    @property
    def sdk(self) -> str:
        return self.sdk_address or self.address(1)

    @property
    def stream(self) -> str:
        return self.stream_address or self.address(2)

    @property
    def router_metrics_port(self) -> int:
        return self.port(3)

    def worker_events_address(self, index: int) -> str:
        return self.address(10 + 2 * index)

    def advertised(self, bound_address: str) -> str:
        """`bound_address` as peers must dial it (binding 0.0.0.0 is not dialable)."""
        if not self.advertise_host:
            return bound_address
        scheme, _, rest = bound_address.partition("://")
        return f"{scheme}://{self.advertise_host}:{rest.rsplit(':', 1)[1]}"

    def worker_metrics_port(self, index: int) -> int:
        return self.port(11 + 2 * index)

    # ---- SLO classes ---------------------------------------------------------------

    def slo_class(self, name: str, tenant: str) -> SloClass | None:
        """A request's SLO class: the one it names; else the one named like its tenant;
        else the default; None when none applies. An unknown `name` raises UnknownSloClass."""
        classes = {slo.name: slo for slo in self.slo_classes}
        if name:
            if name not in classes:
                raise UnknownSloClass(f"slo_class: unknown SLO class {name!r}; {_known_classes(self)}")
            return classes[name]
        return classes.get(tenant) or classes.get(self.default_slo_class)


def _known_classes(config: ClusterConfig) -> str:
    if not config.slo_classes:
        return "no SLO classes are configured"
    return "configured: " + ", ".join(slo.name for slo in config.slo_classes)


def _validate(config: ClusterConfig) -> None:
    if not 0 < config.port_base <= 65535 - 11:  # room for the derived ports up to worker 0's
        raise ConfigError(f"port_base: must be in 1..65524 (ports up to port_base+11 are derived), "
                          f"got {config.port_base}")
    if not 0 < config.http_port < 65536:
        raise ConfigError(f"http_port: must be a port number in 1..65535, got {config.http_port}")
    for name in ("kv_cache_gb", "heartbeat_interval_s", "worker_timeout_s", "worker_stall_timeout_s",
                 "request_timeout_s", "first_token_timeout_s", "index_ttl_s", "load_window_s"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name}: must be > 0, got {getattr(config, name)}")
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_queued_requests",
                 "max_queued_tokens"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {getattr(config, name)}")
    if config.threads < 0:
        raise ConfigError(f"threads: must be >= 0 (0 = torch's default), got {config.threads}")
    if config.max_model_len < 0:
        raise ConfigError(f"max_model_len: must be >= 0 (0 = the model's limit), got {config.max_model_len}")
    if config.worker_timeout_s <= config.heartbeat_interval_s:
        raise ConfigError("worker_timeout_s: must exceed heartbeat_interval_s "
                          f"({config.worker_timeout_s} <= {config.heartbeat_interval_s})")
    if config.policy not in ROUTER_POLICIES:
        raise ConfigError(f"policy: unknown {config.policy!r}; choose one of {', '.join(ROUTER_POLICIES)}")
    if config.queue_policy not in QUEUE_POLICIES:
        raise ConfigError(f"queue_policy: unknown {config.queue_policy!r}; "
                          f"choose one of {', '.join(QUEUE_POLICIES)}")
    if config.dtype not in ("bfloat16", "float32", "float16"):
        raise ConfigError(f"dtype: unsupported {config.dtype!r}")
    if not DEVICE_PATTERN.fullmatch(config.device):
        raise ConfigError(f"device: {config.device!r} is not cpu, cuda or cuda:N")
    for name in ("router_address", "sdk_address", "stream_address"):
        value = getattr(config, name)
        if value and "://" not in value:
            raise ConfigError(f"{name}: {value!r} is not a ZeroMQ endpoint like tcp://host:port")
    if config.model and not Path(config.model).is_dir():
        raise ConfigError(f"model: {config.model!r} is not a directory")
    keys_dir = Path(config.curve_keys_dir) if config.curve_keys_dir else None
    if config.curve_enabled and not (keys_dir and (keys_dir / "router.key").is_file()):
        raise ConfigError(f"curve_keys_dir: curve_enabled needs the directory of the cluster's keys, "
                          f"got {config.curve_keys_dir!r} (write one with `svc keys generate DIR`)")
    if config.log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level: unknown {config.log_level!r}")
    if config.index_mode not in INDEX_MODES:
        raise ConfigError(f"index_mode: unknown {config.index_mode!r}; choose {' or '.join(INDEX_MODES)}")
    if config.step_log_dir and Path(config.step_log_dir).exists() and not Path(config.step_log_dir).is_dir():
        raise ConfigError(f"step_log_dir: {config.step_log_dir!r} exists and is not a directory")
    if config.profile and not Path(config.profile).is_file():
        _validate_profile_name(config.profile)
    _validate_slo_classes(config)


def _validate_profile_name(name: str) -> None:
    """A profile that is not a file must be a built-in profile's name."""
    from common.cost_model import ProfileError  # numpy, only when a name is given
    from common.profiles import analytic_profile

    try:
        analytic_profile(name)
    except ProfileError as error:
        raise ConfigError(f"profile: {name!r} is not a file, and {error}") from None


def _validate_slo_classes(config: ClusterConfig) -> None:
    names: set[str] = set()
    for slo in config.slo_classes:
        if not slo.name or len(slo.name) > SLO_CLASS_NAME_MAX_CHARS:
            raise ConfigError(f"slo_classes: a class name must have 1 to {SLO_CLASS_NAME_MAX_CHARS} "
                              f"characters, got {slo.name!r}")
        if slo.name in names:
            raise ConfigError(f"slo_classes: {slo.name!r} is configured twice")
        names.add(slo.name)
        for target in ("ttft_s", "tpot_s"):
            value = getattr(slo, target)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"slo_classes.{slo.name}.{target}: must be a finite number > 0, got {value}")
    if config.default_slo_class and config.default_slo_class not in names:
        raise ConfigError(f"default_slo_class: {config.default_slo_class!r} is not an SLO class; "
                          f"{_known_classes(config)}")


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> ClusterConfig:
    """Defaults, then the TOML file, then BATON_* variables, then `overrides` (flags;
    None values are ignored). Raises ConfigError naming the bad key and its source."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_from_toml(Path(path)))
    values.update(_from_env(os.environ if env is None else env))
    values.update({k: _check_type(k, v, "overrides") for k, v in (overrides or {}).items() if v is not None})
    try:
        return ClusterConfig(**values)
    except TypeError as error:
        raise ConfigError(str(error)) from None


def _field_types() -> dict[str, Any]:
    hints = get_type_hints(ClusterConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ClusterConfig)}


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))  # TOML is UTF-8 whatever the locale
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as error:  # a directory, no permission, ...
        raise ConfigError(f"{path}: cannot read config file: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    # Sections only group keys for readers; TABLE_KEYS are the table values.
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        section = value if isinstance(value, dict) and key not in TABLE_KEYS else {key: value}
        for name, item in section.items():
            if name in flat:
                raise ConfigError(f"{name}: set twice in {path}")
            flat[name] = item
    return {key: _check_type(key, value, f"{path}") for key, value in flat.items()}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    types = _field_types()
    values = {}
    for name, kind in types.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        values[name] = _parse_env(name, raw, kind)
    return values


def _parse_env(name: str, raw: str, kind: Any) -> Any:
    source = f"environment {ENV_PREFIX}{name.upper()}"
    if name == "slo_classes":
        return _slo_classes_from_env(raw, source)
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is str:
            return raw
        # api_keys: "key1=tenant1,key2=tenant2"
        pairs = (item.split("=", 1) for item in raw.split(",") if item.strip())
        return {key.strip(): tenant.strip() for key, tenant in pairs}
    except ValueError:
        raise ConfigError(f"{name}: {source}={raw!r} is not a valid {getattr(kind, '__name__', kind)}") from None


def _slo_classes_from_env(raw: str, source: str) -> tuple[SloClass, ...]:
    """SLO classes from "interactive:1.0:0.1,batch:30:1" (ranges are checked later)."""
    classes = []
    for item in (item.strip() for item in raw.split(",")):
        if not item:
            continue
        try:
            name, ttft_s, tpot_s = item.split(":")
            classes.append(SloClass(name.strip(), float(ttft_s), float(tpot_s)))
        except ValueError:
            raise ConfigError(f"slo_classes: {source}={raw!r}: {item!r} is not name:ttft_s:tpot_s") from None
    return tuple(classes)


def _slo_classes_from_table(value: Any, source: str) -> tuple[SloClass, ...]:
    """The TOML form, {name: {"ttft_s": number, "tpot_s": number}}, as SLO classes."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"slo_classes: {source} gives {value!r}, expected a table of "
                          "[slo_classes.NAME] tables")
    return tuple(_slo_class_from_table(name, targets, source) for name, targets in value.items())


def _slo_class_from_table(name: str, targets: Any, source: str) -> SloClass:
    key = f"slo_classes.{name}"
    if not isinstance(targets, Mapping):
        raise ConfigError(f"{key}: {source} gives {targets!r}, expected a table with ttft_s and tpot_s")
    unknown = sorted(set(targets) - {"ttft_s", "tpot_s"})
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r} in {source}; an SLO class has ttft_s and tpot_s")
    for target in ("ttft_s", "tpot_s"):
        number = targets.get(target)
        if number is None:
            raise ConfigError(f"{key}.{target}: missing in {source}")
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            raise ConfigError(f"{key}.{target}: {source} gives {number!r}, expected float")
    return SloClass(name, float(targets["ttft_s"]), float(targets["tpot_s"]))


def _check_type(name: str, value: Any, source: str) -> Any:
    types = _field_types()
    if name not in types:
        raise ConfigError(f"{name}: unknown key in {source}")
    if name == "slo_classes":
        return _slo_classes_from_table(value, source)
    kind = types[name]
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(kind)
    if ok is None:  # the dict field
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    if not ok:
        raise ConfigError(f"{name}: {source} gives {value!r}, expected {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value
