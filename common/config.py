"""The cluster configuration every role reads: TOML file < BATON_* environment < flags.

One flat, frozen dataclass; each role takes the fields it needs. Every field is declared
once (common/settings.py): the engine's settings in `EngineSettings`, which it inherits,
the cluster's own here. Its TOML keys, BATON_* variables and `svc` flags are the field
names. Addresses default to ports counted from `port_base` on `host`, so a whole
single-node cluster needs only one number. Every value is validated at start; errors name
the key and where it came from.
"""
from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.cpus import is_cpu_list
from common.engine.config import EngineSettings
from common.settings import (
    POSITIVE,
    POSITIVE_INT,
    Check,
    ConfigError as ConfigError,  # re-exported: every role imports it from here
    is_a,
    setting,
    setting_types,
)

ENV_PREFIX = "BATON_"
ROUTER_POLICIES = ("round_robin", "least_load", "lpm", "cache_aware", "dynamo", "e2", "cost_aware")
INDEX_MODES = ("events", "approximate")
LOG_LEVELS = ("debug", "info", "warning", "error")
KV_TRANSPORTS = ("auto", "ucx", "zmq")  # common/kv_transfer's make_transport takes these
KVSTORE_FETCH_POLICIES = ("auto", "always", "never")
KVSTORE_PORT_OFFSET = 4  # the KV store: control +4, events +5, metrics +6, KV transport +7
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
SLO_CLASS_NAME_MAX_CHARS = 64  # the longest name a request may carry (HTTP checks it too)
TABLE_KEYS = ("api_keys", "slo_classes")  # TOML tables that are values, not sections

KV_PORT_OFFSET = 40  # prefill worker i serves KV on port_base + 40 + i
MAX_ENGINES = (KV_PORT_OFFSET - 10) // 2  # engine i's ports, 10 + 2i and 11 + 2i, stay below the KV ports
DEFAULT_MODEL_NAME = "baton-default"
PORT_BASE = Check(lambda value: 0 < value <= 65535 - 11, "in 1..65524 (ports up to port_base+11 are derived)")
PORT = Check(lambda value: 0 < value < 65536, "a port number in 1..65535")
ENDPOINT = Check(lambda value: not value or "://" in value, "a ZeroMQ endpoint like tcp://host:port")
# A checkpoint directory, or a GGUF file (common/engine/gguf.py converts it into one).
MODEL_PATH = Check(lambda value: not value or Path(value).is_dir() or Path(value).is_file(),
                   "an existing checkpoint directory or GGUF file")
NEW_OR_DIRECTORY = Check(lambda value: not (value and Path(value).exists() and not Path(value).is_dir()),
                         "a directory, or a path with nothing there yet")
NOT_NEGATIVE = Check(lambda value: value >= 0, ">= 0")
FRACTION = Check(lambda value: 0 < value <= 1, "a fraction in (0, 1]")


class UnknownSloClass(ValueError):
    """A request names an SLO class the configuration does not have."""


@dataclass(frozen=True)
class SloClass:
    """A latency target: time to first token and time per output token after it, in seconds."""

    name: str
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, kw_only=True)
class ClusterConfig(EngineSettings):
    """Every setting of every role: the engine's (inherited) and the cluster's below."""

    host: str = setting("127.0.0.1", "host the cluster's sockets bind and connect on")
    advertise_host: str = setting("", "host name peers use to reach this role's sockets (default: host)")
    port_base: int = setting(7100, "first of the cluster's ZeroMQ ports", check=PORT_BASE)
    http_host: str = setting("127.0.0.1", "address the HTTP gateway binds")
    http_port: int = setting(8000, "port of the HTTP gateway", check=PORT)
    http_max_connections_per_client: int = setting(
        256, "HTTP connections one client address (an IPv6 client's /64) may hold; at the cap its longest-idle "
        "one is closed for a new one, else 429 (0: no cap; raise it behind a proxy, whose clients share its "
        "address)", check=NOT_NEGATIVE)
    max_prompt_bytes: int = setting(0, "a text prompt of more UTF-8 bytes is refused before it is tokenized (0: "
                                    "only the bound the tokenizer and the context length prove)", check=NOT_NEGATIVE)
    router_address: str = setting("", "the router's ZeroMQ endpoint (default: tcp://host:port_base)",
                                  check=ENDPOINT)
    sdk_address: str = setting("", "the client SDK's endpoint (default: tcp://host:port_base+1)", check=ENDPOINT)
    stream_address: str = setting("", "the token stream's endpoint (default: tcp://host:port_base+2)",
                                  check=ENDPOINT)

    model: str = setting("", "checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)",
                         check=MODEL_PATH)
    model_name: str = setting(DEFAULT_MODEL_NAME, "the model's name in the OpenAI API (left as it is: a GGUF "
                              "file's name)")
    threads: int = setting(0, "torch threads per worker (0: torch's default; svc up splits the cores)",
                           check=NOT_NEGATIVE)
    cpus: str = setting("", "the CPUs this process runs on, a Linux CPU list such as 1-2 ('': all it may use; "
                        "svc up gives each engine cores of its own where they go round)",
                        check=Check(is_cpu_list, "a CPU list such as 0-3,6"))
    io_cpus: str = setting("", "the CPUs an engine's ZeroMQ I/O threads run on, off its compute cores ('': "
                           "where the engine runs; svc up gives them the other roles' cores)",
                           check=Check(is_cpu_list, "a CPU list such as 0-3,6"))
    step_log_dir: str = setting("", "each worker appends its engine steps (sizes, seconds) to "
                                "DIR/worker-N.steps.jsonl (default: off)", check=NEW_OR_DIRECTORY)

    policy: str = setting("cost_aware", "how the router places requests (docs/router.md §4)",
                          choices=ROUTER_POLICIES)
    heartbeat_interval_s: float = setting(0.5, "how often workers report", check=POSITIVE)
    stream_interval_ms: float = setting(5.0, "a worker sends a request's new tokens at most this often, its first and "
                                        "last at once (0: after every step)", check=NOT_NEGATIVE)
    worker_timeout_s: float = setting(3.0, "a worker silent this long is dropped", check=POSITIVE)
    worker_stall_timeout_s: float = setting(30.0, "a worker whose loop has not turned this long stops "
                                            "heartbeating", check=POSITIVE)
    max_queued_requests: int = setting(256, "per worker, beyond its running batch; more are refused",
                                       check=POSITIVE_INT)
    max_queued_tokens: int = setting(262144, "per worker, prompt tokens waiting; more are refused",
                                     check=POSITIVE_INT)
    request_timeout_s: float = setting(600.0, "default deadline of a request", check=POSITIVE)
    first_token_timeout_s: float = setting(120.0, "a request with no token by then ends with a timeout "
                                           "(never later than its own deadline)", check=POSITIVE)
    admission: bool = setting(False, "refuse at once what would miss its SLO class")
    index_mode: str = setting("events", "the router's prefix index: from the workers' KV events, or "
                              "approximate (from its own placements)", choices=INDEX_MODES)
    index_ttl_s: float = setting(120.0, "approximate index: how long a routed prefix counts as cached",
                                 check=POSITIVE)
    load_window_s: float = setting(180.0, "how far back the router's load estimates look", check=POSITIVE)
    profile: str = setting("", "the cost profile the router prices with: a JSON file or a built-in name "
                           "(default: svc up measures this node's engine once and keeps it; svc start "
                           "uses tiny-cpu, the tiny model's)")

    slo_classes: tuple[SloClass, ...] = setting((), "latency targets by class: TOML [slo_classes.NAME] "
                                                "tables, or name:ttft_s:tpot_s,...")
    default_slo_class: str = setting("", "the class of requests that name none and whose tenant has none "
                                     "(default: no SLO)")

    kv_transport: str = setting("auto", "how prefill and decode workers move KV: ucx, zmq, or auto (UCX when it "
                                "starts, else ZeroMQ with a warning)", choices=KV_TRANSPORTS)
    kv_transfer_timeout_s: float = setting(10.0, "deadline of one KV pull, both sides", check=POSITIVE)
    kv_lease_ttl_s: float = setting(30.0, "how long a prefill worker holds a prompt's KV blocks for a decode "
                                    "worker that has neither pulled nor renewed them", check=POSITIVE)
    max_local_prefill_tokens: int = setting(1000, "a prompt whose missing prefill is at most this many tokens is "
                                            "computed by its decode worker itself: no KV moves",
                                            check=NOT_NEGATIVE)
    kv_part_blocks: int = setting(0, "a prefill worker hands off a prompt still being prefilled in parts: at each "
                                  "prefill chunk's end, once at least this many full blocks were computed since "
                                  "the last part, they are leased and the decode worker pulls them while the rest "
                                  "is computed (0: off, the prompt moves whole after its prefill; parts come only "
                                  "for prompts longer than a chunk, max_num_batched_tokens)", check=NOT_NEGATIVE)
    kv_load_failure_policy: str = setting("recompute", "a decode worker whose KV pull failed recomputes the "
                                          "prompt, or fails the request (kv_transfer_failed)",
                                          choices=KV_LOAD_FAILURE_POLICIES)
    kv_pull_replacements: int = setting(1, "a request whose KV pull failed on its decode worker (a timeout, an "
                                        "unreachable prefill worker) is placed on another decode worker with "
                                        "room at most this many times, then kv_load_failure_policy applies "
                                        "(0: never)", check=NOT_NEGATIVE)
    kv_send_pause_s: float = setting(0.0, "fault injection: a prefill worker pauses this long before each KV "
                                     "piece it sends (tests slow transfers with it)", check=NOT_NEGATIVE)

    kvstore: bool = setting(False, "engines write evicted KV blocks back to the cluster's KV store and fetch "
                            "prefixes from it when that beats recomputing (svc up turns it on)", switch=True)
    kvstore_address: str = setting("", "the KV store's control endpoint (default: tcp://host:port_base+4)",
                                   check=ENDPOINT)
    kvstore_dram_gb: float = setting(1.0, "size of the KV store's DRAM tier, GB", check=POSITIVE)
    kvstore_ssd_dir: str = setting("", "directory of the KV store's SSD tier files (default: no SSD tier)",
                                   check=NEW_OR_DIRECTORY)
    kvstore_ssd_gb: float = setting(4.0, "size of the KV store's SSD tier, GB (with kvstore_ssd_dir)",
                                    check=POSITIVE)
    kvstore_high_watermark: float = setting(0.9, "a store tier fuller than this fraction evicts ...",
                                            check=FRACTION)
    kvstore_low_watermark: float = setting(0.8, "... down to this fraction", check=FRACTION)
    kvstore_quota_blocks: int = setting(0, "most blocks one namespace (model and tenant) may hold in the store "
                                        "(0: no quota)", check=NOT_NEGATIVE)
    kvstore_timeout_s: float = setting(2.0, "deadline of one KV store call; past it the engine recomputes",
                                       check=POSITIVE)
    kvstore_fetch: str = setting("auto", "fetch a prefix the store holds: auto (when the cost model says it beats "
                                 "recomputing), always, or never", choices=KVSTORE_FETCH_POLICIES)
    kvstore_writeback_min_hits: int = setting(0, "write back only evicted blocks reused at least this often "
                                              "(0: every evicted block the store lacks)", check=NOT_NEGATIVE)
    kvstore_writeback_queue_blocks: int = setting(256, "blocks staged for write-back at most; more are dropped, "
                                                  "never waited for", check=POSITIVE_INT)

    api_keys: dict[str, str] = setting(default_factory=dict, help="HTTP bearer key -> tenant: a TOML "
                                       "[api_keys] table, or key=tenant,...")
    curve_enabled: bool = setting(False, "encrypt and authenticate every ZeroMQ socket with CURVE")
    curve_keys_dir: str = setting("", "the cluster's CURVE key pairs, as `svc keys generate DIR` writes them")
    insecure: bool = setting(False, "allow binding beyond loopback with CURVE off (anyone who reaches a "
                             "socket can pose as any role; warned on every start)", switch=True)

    log_level: str = setting("info", "log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        super().__post_init__()
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

    def worker_kv_address(self, index: int) -> str:
        """Where prefill worker `index` serves its leased KV blocks."""
        return self.address(KV_PORT_OFFSET + index)

    @property
    def kvstore_control(self) -> str:
        return self.kvstore_address or self.address(KVSTORE_PORT_OFFSET)

    @property
    def kvstore_events_address(self) -> str:
        """Beside the store's control socket (+1), on its host: what the router dials."""
        return self._beside_kvstore(1)

    @property
    def kvstore_metrics_port(self) -> int:
        return self.port(KVSTORE_PORT_OFFSET + 2)

    @property
    def kvstore_kv_address(self) -> str:
        """Where the store's KV transport listens (+3 from its control socket)."""
        return self._beside_kvstore(3)

    def _beside_kvstore(self, offset: int) -> str:
        if not self.kvstore_address:
            return self.address(KVSTORE_PORT_OFFSET + offset)
        endpoint, _, port = self.kvstore_address.rpartition(":")
        return f"{endpoint}:{int(port) + offset}"

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
    """What no single field's declaration can check: fields together, files' contents."""
    if config.worker_timeout_s <= config.heartbeat_interval_s:
        raise ConfigError("worker_timeout_s: must exceed heartbeat_interval_s "
                          f"({config.worker_timeout_s} <= {config.heartbeat_interval_s})")
    keys_dir = Path(config.curve_keys_dir) if config.curve_keys_dir else None
    if config.curve_enabled and not (keys_dir and (keys_dir / "router.key").is_file()):
        raise ConfigError(f"curve_keys_dir: curve_enabled needs the directory of the cluster's keys, "
                          f"got {config.curve_keys_dir!r} (write one with `svc keys generate DIR`)")
    if config.kvstore_low_watermark > config.kvstore_high_watermark:
        raise ConfigError("kvstore_low_watermark: must not exceed kvstore_high_watermark "
                          f"({config.kvstore_low_watermark} > {config.kvstore_high_watermark})")
    if config.profile and not Path(config.profile).is_file():
        _validate_profile_name(config.profile)
    _validate_slo_classes(config)


def _validate_profile_name(name: str) -> None:
    """A profile that is not a file must be a built-in profile's name."""
    from common.cost_model import ProfileError, load_cost_model  # numpy, only when a name is given

    try:
        load_cost_model(name)
    except ProfileError as error:
        raise ConfigError(f"profile: {error}") from None


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


def model_dir(config: ClusterConfig) -> Path:
    """The checkpoint directory the roles that read the model run on. `svc start` and `svc
    up` set `model` to it before a role starts (a GGUF file's conversion, or the packaged
    default model's when none is named: services/cli.py), so every role of a node reads
    the same one; an empty `model` here is a role started some other way."""
    if not config.model:
        raise ConfigError("model: no checkpoint directory; start the role with `svc start` or `svc up`, "
                          "which resolve the default model")
    return Path(config.model)


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> ClusterConfig:
    """Defaults, then the TOML file, then BATON_* variables, then `overrides` (flags;
    None values are ignored). Raises ConfigError naming the bad key and its source."""
    given: dict[str, tuple[Any, str]] = {}  # key -> (value, where it was given)
    if path is not None:
        given.update(_from_toml(Path(path)))
    given.update(_from_env(os.environ if env is None else env))
    given.update({name: (_check_type(name, value, f"flag {flag_name(name)}"), f"flag {flag_name(name)}")
                  for name, value in (overrides or {}).items() if value is not None})
    try:
        return ClusterConfig(**{name: value for name, (value, _) in given.items()})
    except ConfigError as error:
        key = str(error).split(":", 1)[0].split(".", 1)[0]
        if key not in given:
            raise
        raise ConfigError(f"{error} (from {given[key][1]})") from None


def flag_name(key: str) -> str:
    """The `svc` flag of a configuration key: max_num_seqs -> --max-num-seqs."""
    return "--" + key.replace("_", "-")


def env_name(key: str) -> str:
    """The environment variable of a configuration key: max_num_seqs -> BATON_MAX_NUM_SEQS."""
    return ENV_PREFIX + key.upper()


def _from_toml(path: Path) -> dict[str, tuple[Any, str]]:
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
    return {key: (_check_type(key, value, str(path)), str(path)) for key, value in flat.items()}


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    values = {}
    for name, kind in setting_types(ClusterConfig).items():
        raw = env.get(env_name(name))
        if raw is not None:
            values[name] = (_parse_env(name, raw, kind), f"environment {env_name(name)}")
    return values


def _parse_env(name: str, raw: str, kind: Any) -> Any:
    source = f"environment {env_name(name)}"
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
    types = setting_types(ClusterConfig)
    if name not in types:
        raise ConfigError(f"{name}: unknown key in {source}")
    if name == "slo_classes":
        return _slo_classes_from_table(value, source)
    kind = types[name]
    if name == "api_keys":
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    else:
        ok = is_a(value, kind)
    if not ok:
        raise ConfigError(f"{name}: {source} gives {value!r}, expected {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value
