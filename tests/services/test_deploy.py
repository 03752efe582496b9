"""compose.yaml: every service is a valid `svc start` invocation of the shared config,
by default and with the P/D profile (`docker compose --profile pd up`)."""
import dataclasses
import subprocess
import sys
import tomllib

import yaml

from common.config import KV_PORT_OFFSET, MAX_ENGINES, ClusterConfig, load_config
from services.local_cluster import REPO

MOUNTED_CONFIG = "/etc/baton/cluster.toml"
ENGINE_ROLES = ("worker", "prefill", "decode")
PD_KEYS = ("kv_transport", "kv_transfer_timeout_s", "max_local_prefill_tokens", "kv_load_failure_policy",
           "kv_lease_ttl_s", "kv_pull_replacements")


def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def flag(service: dict, name: str) -> str:
    """The value of `name` in a service's command."""
    command = service["command"]
    return command[command.index(name) + 1]


def test_the_default_stays_co_located_and_the_pd_profile_adds_prefill_and_decode():
    services = compose()["services"]
    default = {name for name, service in services.items() if "profiles" not in service}
    assert default == {"keys", "router", "kvstore", "worker", "tokenizer"}
    assert {name for name in services if name not in default} == {"prefill", "decode"}
    assert all(services[name]["profiles"] == ["pd"] for name in ("prefill", "decode"))


def test_every_service_runs_a_valid_svc_start(tmp_path):
    services = compose()["services"]
    assert set(services) == {"keys", "router", "kvstore", "worker", "prefill", "decode", "tokenizer"}
    keys = services.pop("keys")
    keys_dir = tmp_path / "keys"
    done = _svc([*(str(keys_dir) if part == "/keys" else part for part in keys["command"])], tmp_path, {})
    assert done.returncode == 0 and (keys_dir / "tokenizer.key_secret").is_file(), done.stderr
    assert _svc(["keys", "generate", str(keys_dir), "--keep"], tmp_path, {}).returncode == 0
    for name, service in services.items():
        assert [v.split(":")[1] for v in service["volumes"] if "cluster.toml" in v] == [MOUNTED_CONFIG]
        command = [str(REPO / "deploy" / "cluster.toml") if part == MOUNTED_CONFIG else part
                   for part in service["command"]]
        assert command[:2] == ["start", name]
        environment = {key: str(keys_dir) if value == "/keys" else value
                       for key, value in service["environment"].items()}
        assert environment["BATON_CURVE_ENABLED"] == "true"  # every role binds 0.0.0.0
        done = _svc([*command, "--check-config"], tmp_path, environment)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        assert f"config ok for {name}" in done.stdout


def _svc(argv: list[str], tmp_path, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env={"PYTHONPATH": str(REPO), "BATON_CACHE_DIR": str(tmp_path), **environment})


def test_health_checks_probe_the_ports_the_config_gives():
    config = load_config(REPO / "deploy" / "cluster.toml", env={})
    services = compose()["services"]
    probes = {name: " ".join(service["healthcheck"]["test"]) for name, service in services.items()
              if name != "keys"}
    assert f":{config.router_metrics_port}/health" in probes["router"]
    for role in ENGINE_ROLES:
        assert f":{config.worker_metrics_port(int(flag(services[role], '--index')))}/health" in probes[role], role
    assert f":{config.http_port}/health" in probes["tokenizer"]
    assert f":{config.kvstore_metrics_port}/health" in probes["kvstore"]


def test_engines_have_their_own_index_and_advertise_their_service_name():
    services = compose()["services"]
    indexes = [int(flag(services[role], "--index")) for role in ENGINE_ROLES]
    assert len(set(indexes)) == len(indexes) and all(0 <= index < MAX_ENGINES for index in indexes)
    for role in ENGINE_ROLES:
        assert flag(services[role], "--advertise-host") == role  # peers dial the compose service name
        assert flag(services[role], "--router-address") == "tcp://router:7100"
        assert services[role]["depends_on"] == {"router": {"condition": "service_healthy"}}


def test_the_prefill_worker_exposes_the_kv_port_the_config_gives():
    config = load_config(REPO / "deploy" / "cluster.toml", env={})
    prefill = compose()["services"]["prefill"]
    index = int(flag(prefill, "--index"))
    kv_port = int(config.worker_kv_address(index).rsplit(":", 1)[1])
    assert kv_port == config.port_base + KV_PORT_OFFSET + index
    assert [str(port) for port in prefill["expose"]] == [str(kv_port)]


def test_the_cluster_file_sets_every_pd_key_and_they_parse():
    raw = tomllib.loads((REPO / "deploy" / "cluster.toml").read_text())
    assert set(PD_KEYS) <= set(raw["disaggregation"])  # documented where an operator looks
    config = load_config(REPO / "deploy" / "cluster.toml", env={})
    assert {key: getattr(config, key) for key in PD_KEYS} == raw["disaggregation"]


def test_device_flag_is_checked_with_the_config():
    done = subprocess.run([sys.executable, "-m", "services.cli", "start", "worker", "--device", "gpu0",
                           "--check-config"], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={"PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "device" in done.stderr and "cuda:N" in done.stderr


def test_check_config_rejects_a_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("port_base = 'seven'\n")
    done = subprocess.run([sys.executable, "-m", "services.cli", "start", "router", "--config", str(bad),
                           "--check-config"], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={"PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "port_base" in done.stderr


def test_the_cluster_file_sets_every_kvstore_key_and_they_parse():
    raw = tomllib.loads((REPO / "deploy" / "cluster.toml").read_text())
    keys = {spec.name for spec in dataclasses.fields(ClusterConfig) if spec.name.startswith("kvstore")}
    assert keys - set(raw["kvstore"]) == {"kvstore_address"}  # documented, commented: it derives from host
    config = load_config(REPO / "deploy" / "cluster.toml", env={})
    assert {key: getattr(config, key) for key in raw["kvstore"]} == raw["kvstore"]


def test_the_store_keeps_its_ssd_tier_in_a_volume_and_the_engines_reach_it():
    config = load_config(REPO / "deploy" / "cluster.toml", env={})
    services = compose()["services"]
    store = services["kvstore"]
    assert any(volume.endswith(f":{config.kvstore_ssd_dir}") for volume in store["volumes"])
    assert store["network_mode"] == "service:router"  # the router's derived events address reaches it
    port = config.kvstore_control.rsplit(":", 1)[1]
    for role in ENGINE_ROLES:
        assert flag(services[role], "--kvstore-address") == f"tcp://router:{port}"


def test_the_kv_store_has_room_in_shared_memory_for_its_dram_tier():
    """Docker gives a container 64 MB of /dev/shm; a DRAM tier larger than its room dies
    with SIGBUS once the writes pass it."""
    import tomllib

    store = compose()["services"]["kvstore"]
    room_mb = float(store["shm_size"].removesuffix("mb"))
    dram_gb = tomllib.loads((REPO / "deploy" / "cluster.toml").read_text())["kvstore"]["kvstore_dram_gb"]
    assert room_mb * 1e6 > dram_gb * 1e9
