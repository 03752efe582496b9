import pytest

from services.local_cluster import start_cluster

# Small pools and fast failure detection, so fault tests finish in seconds.
TEST_FLAGS = ["--kv-cache-gb", "0.05", "--max-model-len", "1024", "--heartbeat-interval-s", "0.2",
              "--worker-timeout-s", "1.5", "--profile", "tiny-cpu"]


@pytest.fixture(scope="session")
def make_cluster(tiny_model_dir):
    """Start clusters on the tiny model with the test flags; stops them all at the end."""
    started = []

    def make(workers: int = 1, extra: list[str] | None = None, prefill: int = 0, decode: int = 0, env=None):
        cluster = start_cluster(tiny_model_dir, workers=workers, extra=TEST_FLAGS + (extra or []),
                                prefill=prefill, decode=decode, env=env)
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        cluster.stop()


# The shared cluster's config file: what no flag sets.
CLUSTER_TOML = """
[slo_classes.interactive]
ttft_s = 5.0
tpot_s = 1.0
"""


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    """Two float32 workers (exact comparisons with an in-process engine), one SLO class,
    step logs in `running.step_log_dir`."""
    scratch = tmp_path_factory.mktemp("cluster")
    config = scratch / "cluster.toml"
    config.write_text(CLUSTER_TOML, encoding="utf-8")
    running = make_cluster(workers=2, extra=["--dtype", "float32", "--config", str(config),
                                             "--step-log-dir", str(scratch / "steps")])
    running.step_log_dir = scratch / "steps"
    yield running
    running.stop()
