import pytest

from tests.services.cluster import start_cluster


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    """Two float32 workers (exact comparisons with an in-process engine)."""
    running = start_cluster(tiny_model_dir, workers=2, extra=["--dtype", "float32"])
    yield running
    running.stop()
