"""Every engine setting the README names reaches a served worker: each is given a value
other than its default, a third of them in the TOML file, a third as BATON_* variables,
a third as flags, and the worker `svc up` starts reports them all from its engine."""
from __future__ import annotations

import dataclasses
import json
import re

import torch

from common.config import env_name, flag_name, load_config
from common.engine.config import EngineConfig, EngineSettings, engine_settings
from services.client import Client
from services.local_cluster import REPO, start_cluster
from services.worker.main import engine_config

# A value other than the default for each setting, one the tiny model runs with here.
NON_DEFAULT = {
    "dtype": "float32",
    "device": "cuda:0" if torch.cuda.is_available() else "cpu",  # a CPU machine has no other
    "block_size": 32,
    "kv_cache_gb": 0.05,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "max_model_len": 1024,
    "queue_policy": "lpm",
    "attention_backend": "sdpa",
    "weight_blocks": False,
    "enable_prefix_caching": False,
    "wait_for_shared_prefill": False,
}
README_PARAGRAPH = re.compile(r"^Engine settings \(.*?(?=\n\n)", re.MULTILINE | re.DOTALL)


def readme_engine_settings() -> set[str]:
    """The engine fields the README's paragraph on engine settings names."""
    paragraph = README_PARAGRAPH.search((REPO / "README.md").read_text(encoding="utf-8"))
    assert paragraph, "README.md has no paragraph starting 'Engine settings ('"
    named = set(re.findall(r"`(\w+)`", paragraph.group(0)))
    return named & {spec.name for spec in dataclasses.fields(EngineConfig)}


def test_the_readme_names_exactly_the_operator_settings():
    assert readme_engine_settings() == {spec.name for spec in dataclasses.fields(EngineSettings)}


def test_the_walk_gives_every_setting_a_value_of_its_own():
    defaults = {spec.name: spec.default for spec in dataclasses.fields(EngineSettings)}
    assert set(NON_DEFAULT) == set(defaults)
    assert [name for name, value in NON_DEFAULT.items() if value == defaults[name]] in ([], ["device"])


def test_a_worker_engine_carries_every_engine_setting(tiny_model_dir):
    config = load_config(env={}, overrides={"model": str(tiny_model_dir), **NON_DEFAULT})
    built = engine_config(config, index=0)
    assert engine_settings(built) == NON_DEFAULT and built.model_dir == tiny_model_dir


def test_every_engine_setting_the_readme_names_reaches_a_served_worker(tiny_model_dir, tmp_path):
    names = sorted(readme_engine_settings())
    by_file, by_env, by_flag = names[0::3], names[1::3], names[2::3]
    config = tmp_path / "engine.toml"
    config.write_text("[engine]\n" + "".join(f"{name} = {_toml(NON_DEFAULT[name])}\n" for name in by_file),
                      encoding="utf-8")
    env = {env_name(name): _text(NON_DEFAULT[name]) for name in by_env}
    flags = [arg for name in by_flag for arg in (flag_name(name), _text(NON_DEFAULT[name]))]
    cluster = start_cluster(tiny_model_dir, extra=["--config", str(config), *flags], env=env)
    try:
        with Client(cluster.sdk, timeout_s=60) as client:
            served = client.generate("settings", max_tokens=4, temperature=0, ignore_eos=True)
        reported = _logged_engine_settings(cluster.lines)
    finally:
        cluster.stop()
    assert len(served.token_ids) == 4
    assert {name: reported[name] for name in names} == {name: NON_DEFAULT[name] for name in names}


def _logged_engine_settings(lines: list[str]) -> dict:
    """What worker-0 logged as its engine's settings."""
    for line in lines:
        if '"engine_settings"' in line:
            record = json.loads(line)
            if record.get("event") == "engine_settings" and record.get("worker_id") == "worker-0":
                return record
    raise AssertionError("no engine_settings line from worker-0:\n" + "".join(lines[-40:]))


def _toml(value) -> str:
    return json.dumps(value)  # a JSON bool, number or plain string is the same in TOML


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
