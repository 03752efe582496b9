"""compose.yaml: every service is a valid `svc start` invocation of the shared config."""
import subprocess
import sys

import yaml

from common.config import load_config
from services.local_cluster import REPO

MOUNTED_CONFIG = "/etc/baton/cluster.toml"


def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def test_every_service_runs_a_valid_svc_start(tmp_path):
    services = compose()["services"]
    assert set(services) == {"keys", "router", "worker", "tokenizer"}
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
    assert f":{config.worker_metrics_port(0)}/health" in probes["worker"]
    assert f":{config.http_port}/health" in probes["tokenizer"]


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
