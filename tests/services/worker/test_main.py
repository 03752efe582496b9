"""The worker role's engine settings from the cluster config."""
import pytest

from common.config import load_config
from services.worker.main import engine_config, worker_device


@pytest.mark.parametrize("device, index, visible_gpus, expected", [
    ("cuda", 0, 8, "cuda:0"),
    ("cuda", 5, 8, "cuda:5"),
    ("cuda", 9, 8, "cuda:1"),   # more workers than GPUs: round the GPUs again
    ("cuda", 3, 1, "cuda:0"),   # one GPU per host (svc start worker --index 3)
    ("cuda", 2, 0, "cuda"),     # no GPU: left for the engine to refuse by name
    ("cuda:3", 0, 8, "cuda:3"),  # a named GPU is taken as given
    ("cpu", 4, 8, "cpu"),
])
def test_workers_spread_over_the_gpus_they_see(device, index, visible_gpus, expected):
    assert worker_device(device, index, visible_gpus) == expected


def test_engine_config_carries_the_cluster_settings(tiny_model_dir):
    config = load_config(env={}, overrides={"model": str(tiny_model_dir), "dtype": "float32",
                                            "kv_cache_gb": 0.25, "max_num_seqs": 7})
    engine = engine_config(config, index=1)
    assert (engine.model_dir, engine.dtype, engine.device, engine.kv_cache_gb, engine.max_num_seqs) == \
        (tiny_model_dir, "float32", "cpu", 0.25, 7)
