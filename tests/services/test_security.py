"""CURVE on every socket: the right client key gets in, anything else is refused."""
import subprocess
import sys

import pytest
import zmq

from services.client import Client, ServerUnavailable
from services.local_cluster import REPO


@pytest.fixture(scope="module")
def curve_cluster(make_cluster, tmp_path_factory):
    keys = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate"], capture_output=True,
                          text=True, cwd=REPO, check=True, timeout=60, env={"PYTHONPATH": str(REPO)}).stdout
    config = tmp_path_factory.mktemp("curve") / "cluster.toml"
    config.write_text(keys)
    values = dict(line.replace('"', "").split(" = ") for line in keys.splitlines())
    running = make_cluster(workers=1, extra=["--config", str(config)])
    yield running, values
    running.stop()


def test_client_with_the_cluster_keys_is_served(curve_cluster):
    cluster, keys = curve_cluster
    curve = {"server_public": keys["curve_server_public"], "client_public": keys["curve_client_public"],
             "client_secret": keys["curve_client_secret"]}
    with Client(cluster.sdk, curve=curve, timeout_s=60) as client:
        assert len(client.generate("secret", max_tokens=3, ignore_eos=True).token_ids) == 3


@pytest.mark.parametrize("who", ["no keys", "a stranger's keys"])
def test_other_clients_are_refused(curve_cluster, who):
    cluster, keys = curve_cluster
    curve = None
    if who != "no keys":
        public, secret = zmq.curve_keypair()
        curve = {"server_public": keys["curve_server_public"], "client_public": public.decode(),
                 "client_secret": secret.decode()}
    with Client(cluster.sdk, curve=curve, connect_timeout_s=2) as client:
        with pytest.raises(ServerUnavailable):
            client.generate("let me in", max_tokens=2)
