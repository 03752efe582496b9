"""ClusterConfig: defaults < TOML file < BATON_* environment < flags, and named errors."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.config import ClusterConfig, ConfigError, SloClass, UnknownSloClass, load_config
from common.engine.config import EngineConfig, EngineSettings
from common.sockets import generate_curve_keys


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "baton.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ---- sources and precedence -------------------------------------------------------


def test_defaults_need_no_file_and_ignore_unrelated_environment():
    config = load_config(env={"HOME": "/root", "BATON": "x"})
    assert config == ClusterConfig()
    assert (config.port_base, config.policy, config.api_keys) == (7100, "cost_aware", {})


def test_each_source_overrides_the_one_before(tmp_path):
    path = write(tmp_path, "port_base = 7200\nhttp_port = 8100\nmax_num_seqs = 32\nmodel_name = 'toml'\n")
    env = {"BATON_HTTP_PORT": "8200", "BATON_MAX_NUM_SEQS": "64"}
    overrides = {"max_num_seqs": 128, "model_name": None}  # None = flag not given

    config = load_config(path, env=env, overrides=overrides)
    assert config.port_base == 7200  # TOML over default
    assert config.http_port == 8200  # environment over TOML
    assert config.max_num_seqs == 128  # flag over environment
    assert config.model_name == "toml"  # a None flag changes nothing
    assert config.log_level == "info"  # untouched default


def test_toml_sections_are_flattened_and_api_keys_is_a_table(tmp_path):
    path = write(tmp_path, """
log_level = "debug"

[router]
policy = "least_load"
heartbeat_interval_s = 1   # an integer is fine for a float key

[engine]
block_size = 32

[api_keys]
sk-alpha = "tenant-a"
sk-beta = "tenant-b"
""")
    config = load_config(path, env={})
    assert (config.log_level, config.policy, config.block_size) == ("debug", "least_load", 32)
    assert config.heartbeat_interval_s == 1.0 and isinstance(config.heartbeat_interval_s, float)
    assert config.api_keys == {"sk-alpha": "tenant-a", "sk-beta": "tenant-b"}


def test_environment_parses_types_bools_and_api_keys(tmp_path):
    env = {"BATON_KV_CACHE_GB": "2.5", "BATON_CURVE_ENABLED": "no", "BATON_API_KEYS": "k1=t1,k2=t=2",
           "BATON_DEVICE": "cuda"}
    config = load_config(env=env)
    assert (config.kv_cache_gb, config.curve_enabled, config.device) == (2.5, False, "cuda")
    assert config.api_keys == {"k1": "t1", "k2": "t=2"}
    for raw, expected in [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("False", False)]:
        enabled = load_config(env={"BATON_CURVE_ENABLED": raw, **_curve_keys_env(tmp_path)}).curve_enabled
        assert enabled is expected, raw


def _curve_keys_env(tmp_path: Path) -> dict[str, str]:
    keys_dir = tmp_path / "keys"
    if not keys_dir.exists():
        generate_curve_keys(keys_dir)
    return {"BATON_CURVE_KEYS_DIR": str(keys_dir)}


# ---- engine settings: declared once, in EngineSettings -------------------------------


def test_every_engine_setting_is_a_cluster_key_from_every_source(tmp_path):
    path = write(tmp_path, "[engine]\nattention_backend = 'sdpa'\nmax_model_len = 512\n")
    env = {"BATON_ENABLE_PREFIX_CACHING": "false", "BATON_QUEUE_POLICY": "priority", "BATON_DTYPE": "float16"}
    config = load_config(path, env=env, overrides={"wait_for_shared_prefill": False, "block_size": 32})
    assert (config.attention_backend, config.max_model_len, config.enable_prefix_caching, config.queue_policy,
            config.dtype, config.wait_for_shared_prefill, config.block_size) == \
        ("sdpa", 512, False, "priority", "float16", False, 32)
    assert isinstance(config, EngineSettings)  # the cluster's keys include the engine's, declared there


def test_engine_only_fields_are_no_cluster_keys(tmp_path):
    code_only = {spec.name for spec in dataclasses.fields(EngineConfig)} - \
        {spec.name for spec in dataclasses.fields(EngineSettings)}
    assert code_only == {"model_dir", "num_kv_blocks", "tenant_salt", "adapter_id"}
    for name in code_only:
        with pytest.raises(ConfigError, match=rf"^{name}: unknown key in .*baton.toml"):
            load_config(write(tmp_path, f"{name} = 'x'\n"), env={})


def test_every_setting_declares_its_help():
    for cls in (ClusterConfig, EngineConfig):
        assert [spec.name for spec in dataclasses.fields(cls) if not spec.metadata.get("help")] == [], cls


def test_max_model_len_unset_means_the_model_s_own_and_zero_is_refused():
    assert ClusterConfig().max_model_len is None and EngineSettings().max_model_len is None
    with pytest.raises(ConfigError, match="^max_model_len: must be a positive integer, got 0"):
        load_config(env={"BATON_MAX_MODEL_LEN": "0"})


@pytest.mark.parametrize("overrides, key", [
    ({"attention_backend": "magic"}, "attention_backend"),
    ({"dtype": "int8"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"kv_cache_gb": float("inf")}, "kv_cache_gb"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
])
def test_an_engine_config_checks_its_settings_when_built(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        EngineConfig(model_dir=Path("."), **overrides)


def test_a_bad_value_names_where_it_was_set(tmp_path):
    with pytest.raises(ConfigError, match=r"^max_num_seqs: .*got 0 \(from environment BATON_MAX_NUM_SEQS\)$"):
        load_config(env={"BATON_MAX_NUM_SEQS": "0"})
    path = write(tmp_path, "[engine]\nqueue_policy = 'lifo'\n")
    with pytest.raises(ConfigError, match=rf"^queue_policy: unknown 'lifo'.*\(from {path}\)$"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"^block_size: .*\(from flag --block-size\)$"):
        load_config(path, env={}, overrides={"block_size": -1, "queue_policy": "lpm"})


# ---- derived addresses -------------------------------------------------------------


def test_addresses_are_counted_from_port_base_on_host():
    config = load_config(env={"BATON_HOST": "10.0.0.5", "BATON_PORT_BASE": "9000"})
    assert config.router == "tcp://10.0.0.5:9000"
    assert config.sdk == "tcp://10.0.0.5:9001"
    assert config.stream == "tcp://10.0.0.5:9002"
    assert config.router_metrics_port == 9003
    assert [config.worker_events_address(i) for i in (0, 1)] == ["tcp://10.0.0.5:9010", "tcp://10.0.0.5:9012"]
    assert [config.worker_metrics_port(i) for i in (0, 1)] == [9011, 9013]


def test_explicit_addresses_win_over_derived_ones():
    config = load_config(env={}, overrides={"router_address": "tcp://router:5555", "sdk_address": "ipc:///tmp/sdk"})
    assert (config.router, config.sdk, config.stream) == ("tcp://router:5555", "ipc:///tmp/sdk", "tcp://127.0.0.1:7102")


# ---- validation: every error names the key ----------------------------------------


@pytest.mark.parametrize("overrides, key", [
    ({"port_base": 0}, "port_base"),
    ({"http_port": 70000}, "http_port"),
    ({"policy": "random"}, "policy"),
    ({"queue_policy": "lifo"}, "queue_policy"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "gpu"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"log_level": "verbose"}, "log_level"),
    ({"block_size": 0}, "block_size"),
    ({"kv_cache_gb": 0.0}, "kv_cache_gb"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"router_address": "localhost:7100"}, "router_address"),
    ({"worker_timeout_s": 0.5, "heartbeat_interval_s": 0.5}, "worker_timeout_s"),
    ({"worker_timeout_s": 1.0, "heartbeat_interval_s": 2.0}, "worker_timeout_s"),
    ({"curve_enabled": True}, "curve_keys_dir"),
    ({"curve_enabled": True, "curve_keys_dir": "/definitely/not/keys"}, "curve_keys_dir"),
    ({"model": "/definitely/not/a/model/dir"}, "model"),
])
def test_invalid_values_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        load_config(env={}, overrides=overrides)


def test_curve_needs_a_key_directory(tmp_path):
    config = load_config(env={"BATON_CURVE_ENABLED": "1", **_curve_keys_env(tmp_path)})
    assert config.curve_keys_dir == str(tmp_path / "keys")


def test_model_directory_that_exists_is_accepted(tmp_path):
    assert load_config(env={}, overrides={"model": str(tmp_path)}).model == str(tmp_path)


def test_step_log_dir_may_be_new_but_not_a_file(tmp_path):
    new_dir = tmp_path / "steps"
    assert load_config(env={}, overrides={"step_log_dir": str(new_dir)}).step_log_dir == str(new_dir)
    a_file = write(tmp_path, "")
    with pytest.raises(ConfigError, match="^step_log_dir: must be a directory, .*baton.toml"):
        load_config(env={}, overrides={"step_log_dir": str(a_file)})


@pytest.mark.parametrize("env, key", [
    ({"BATON_PORT_BASE": "seventy"}, "port_base"),
    ({"BATON_MAX_NUM_SEQS": "1.5"}, "max_num_seqs"),
    ({"BATON_KV_CACHE_GB": "lots"}, "kv_cache_gb"),
    ({"BATON_CURVE_ENABLED": "maybe"}, "curve_enabled"),
    ({"BATON_API_KEYS": "no-equals-sign"}, "api_keys"),
])
def test_bad_environment_values_name_the_key_and_variable(env, key):
    (variable,) = env
    with pytest.raises(ConfigError, match=rf"^{key}: environment {variable}="):
        load_config(env=env)


@pytest.mark.parametrize("text, key", [
    ("port_bse = 7100\n", "port_bse"),  # unknown key
    ("[router]\npolcy = 'least_load'\n", "polcy"),  # unknown key inside a section
    ("port_base = '7100'\n", "port_base"),  # string for an int
    ("port_base = 7100.0\n", "port_base"),  # float for an int
    ("curve_enabled = 1\n", "curve_enabled"),  # int for a bool
    ("block_size = true\n", "block_size"),  # bool for an int
    ("kv_cache_gb = '1'\n", "kv_cache_gb"),  # string for a float
    ("api_keys = 'sk=tenant'\n", "api_keys"),  # string for the table
    ("[api_keys]\nsk = 1\n", "api_keys"),  # non-string tenant
])
def test_bad_toml_keys_and_types_name_the_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{key}: .*{path.name}"):
        load_config(path, env={})


def test_toml_values_are_validated_too(tmp_path):
    path = write(tmp_path, "[router]\nheartbeat_interval_s = 5.0\n")
    with pytest.raises(ConfigError, match="^worker_timeout_s:"):
        load_config(path, env={})
    # ...unless a later source repairs them.
    assert load_config(path, env={"BATON_WORKER_TIMEOUT_S": "10"}).worker_timeout_s == 10.0


def test_invalid_toml_and_missing_file_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "port_base = = 1\n"), env={})
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(ConfigError, match=rf"{missing}: config file not found"):
        load_config(missing, env={})


def test_unknown_override_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="bogus"):
        load_config(env={}, overrides={"bogus": 1})


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        ClusterConfig().port_base = 1  # type: ignore[misc]


# ---- gaps found in review, fixed ---------------------------------------------------


def test_unreadable_config_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError):
        load_config(tmp_path, env={})


def test_override_of_the_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="^port_base:"):
        load_config(env={}, overrides={"port_base": "7100"})


def test_port_base_leaves_room_for_derived_ports():
    with pytest.raises(ConfigError, match="^port_base:"):
        load_config(env={"BATON_PORT_BASE": "65535"})


# ---- router settings and SLO classes -------------------------------------------------

INTERACTIVE, BATCH = SloClass("interactive", 1.0, 0.1), SloClass("batch", 30.0, 1.0)


def test_router_settings_have_defaults_and_come_from_every_source(tmp_path):
    config = load_config(env={})
    assert (config.admission, config.index_mode, config.index_ttl_s, config.load_window_s, config.profile,
            config.slo_classes, config.default_slo_class) == (False, "events", 120.0, 180.0, "", (), "")
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    path = write(tmp_path, f"[router]\npolicy = 'e2'\nadmission = true\nindex_mode = 'approximate'\n"
                           f"profile = '{profile}'\n")
    config = load_config(path, env={"BATON_INDEX_TTL_S": "30", "BATON_LOAD_WINDOW_S": "60"},
                         overrides={"policy": "dynamo"})
    assert (config.policy, config.admission, config.index_mode, config.profile) == \
        ("dynamo", True, "approximate", str(profile))
    assert (config.index_ttl_s, config.load_window_s) == (30.0, 60.0)


def test_slo_classes_are_a_toml_table_of_tables(tmp_path):
    path = write(tmp_path, """
default_slo_class = "batch"

[slo_classes.interactive]
ttft_s = 1.0
tpot_s = 0.1

[slo_classes.batch]
ttft_s = 30   # an integer is fine
tpot_s = 1
""")
    config = load_config(path, env={})
    assert config.slo_classes == (INTERACTIVE, BATCH) and config.default_slo_class == "batch"
    assert isinstance(config.slo_classes[1].ttft_s, float)


def test_slo_classes_from_the_environment_and_overrides(tmp_path):
    env = {"BATON_SLO_CLASSES": " interactive:1.0:0.1, batch:30:1,", "BATON_DEFAULT_SLO_CLASS": "interactive"}
    config = load_config(env=env)
    assert config.slo_classes == (INTERACTIVE, BATCH) and config.default_slo_class == "interactive"
    path = write(tmp_path, "[slo_classes.interactive]\nttft_s = 5\ntpot_s = 5\n")
    overridden = load_config(path, env=env, overrides={"slo_classes": {"batch": {"ttft_s": 30, "tpot_s": 1}},
                                                       "default_slo_class": "batch"})
    assert overridden.slo_classes == (BATCH,)  # a later source replaces the whole set


def test_slo_class_of_a_request_is_the_named_one_else_the_tenant_s_else_the_default():
    tenants = SloClass("tenant-a", 2.0, 0.2)
    config = ClusterConfig(slo_classes=(INTERACTIVE, BATCH, tenants), default_slo_class="batch")
    assert config.slo_class("interactive", "tenant-a") == INTERACTIVE
    assert config.slo_class("", "tenant-a") == tenants
    assert config.slo_class("", "tenant-b") == config.slo_class("", "") == BATCH
    assert ClusterConfig(slo_classes=(INTERACTIVE,)).slo_class("", "tenant-a") is None
    with pytest.raises(UnknownSloClass, match="'bulk'.*configured: interactive, batch, tenant-a"):
        config.slo_class("bulk", "tenant-a")
    with pytest.raises(ValueError, match="no SLO classes are configured"):
        ClusterConfig().slo_class("interactive", "")


@pytest.mark.parametrize("overrides, key", [
    ({"policy": "fastest"}, "policy"),
    ({"index_mode": "guess"}, "index_mode"),
    ({"index_ttl_s": 0.0}, "index_ttl_s"),
    ({"load_window_s": -1.0}, "load_window_s"),
    ({"profile": "/definitely/not/a/profile.json"}, "profile"),
    ({"profile": "tiny-gpu"}, "profile"),
    ({"default_slo_class": "interactive"}, "default_slo_class"),
    ({"slo_classes": {"a": {"ttft_s": 0, "tpot_s": 1}}}, "slo_classes.a.ttft_s"),
    ({"slo_classes": {"a": {"ttft_s": 1, "tpot_s": -0.5}}}, "slo_classes.a.tpot_s"),
    ({"slo_classes": {"a": {"ttft_s": float("inf"), "tpot_s": 1}}}, "slo_classes.a.ttft_s"),
    ({"slo_classes": {"": {"ttft_s": 1, "tpot_s": 1}}}, "slo_classes"),
    ({"slo_classes": {"x" * 65: {"ttft_s": 1, "tpot_s": 1}}}, "slo_classes"),
    ({"slo_classes": "a:1:1"}, "slo_classes"),
])
def test_invalid_router_and_slo_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        load_config(env={}, overrides=overrides)


@pytest.mark.parametrize("raw, problem", [
    ("interactive:1", "is not name:ttft_s:tpot_s"),
    ("interactive:fast:0.1", "is not name:ttft_s:tpot_s"),
    ("a:1:1:1", "is not name:ttft_s:tpot_s"),
    ("a:1:1,a:2:2", "'a' is configured twice"),
    (":1:1", "a class name must have 1 to 64 characters"),
])
def test_bad_slo_classes_in_the_environment_say_what_is_wrong(raw, problem):
    with pytest.raises(ConfigError, match=rf"^slo_classes: .*{problem}"):
        load_config(env={"BATON_SLO_CLASSES": raw})


@pytest.mark.parametrize("text, key", [
    ("[slo_classes.a]\nttft_s = 1\ntpot_s = 1\nttft = 2\n", "slo_classes.a"),  # unknown subkey
    ("[slo_classes.a]\nttft_s = 1\n", "slo_classes.a.tpot_s"),  # missing target
    ("[slo_classes.a]\nttft_s = '1'\ntpot_s = 1\n", "slo_classes.a.ttft_s"),  # string for a number
    ("[slo_classes.a]\nttft_s = 1\ntpot_s = true\n", "slo_classes.a.tpot_s"),  # bool for a number
    ("[slo_classes]\na = 1\n", "slo_classes.a"),  # a number for a class table
    ("slo_classes = 'a:1:1'\n", "slo_classes"),  # the environment's form in a file
])
def test_bad_slo_classes_in_toml_name_the_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{key}: .*{path.name}"):
        load_config(path, env={})


def test_an_unknown_slo_subkey_error_says_what_a_class_has(tmp_path):
    path = write(tmp_path, "[slo_classes.a]\nttft_s = 1\ntpot_s = 1\nttft = 2\n")
    with pytest.raises(ConfigError, match="unknown key 'ttft'.*an SLO class has ttft_s and tpot_s"):
        load_config(path, env={})


def test_the_kv_store_sockets_sit_beside_its_control_endpoint():
    local = ClusterConfig(port_base=9000)
    assert (local.kvstore_control, local.kvstore_events_address, local.kvstore_kv_address,
            local.kvstore_metrics_port) == ("tcp://127.0.0.1:9004", "tcp://127.0.0.1:9005", "tcp://127.0.0.1:9007",
                                            9006)
    remote = ClusterConfig(kvstore_address="tcp://kv.example:7204")  # a store on its own host
    assert (remote.kvstore_events_address, remote.kvstore_kv_address) == ("tcp://kv.example:7205",
                                                                          "tcp://kv.example:7207")
    with pytest.raises(ConfigError, match="kvstore_low_watermark"):
        ClusterConfig(kvstore_low_watermark=0.95, kvstore_high_watermark=0.9)
