"""Per-role CURVE on a real cluster: each socket admits only the roles that belong on it,
the tenant comes from the API key alone, and without CURVE nothing binds beyond loopback."""
import subprocess
import sys
import time
import urllib.request

import pytest
import zmq
import zmq.auth

from common.engine.checkpoint import fingerprints
from common.protocol import (
    PROTOCOL_VERSION,
    Error,
    Generate,
    Hello,
    KvLeaseUpdate,
    KvReady,
    Sampling,
    Welcome,
    decode,
    encode,
)
from common.sockets import load_curve_keys
from services.client import Client, ServerUnavailable, curve_keys
from services.local_cluster import REPO, child_env

API_KEYS = '[api_keys]\n"sk-alice" = "alice"\n'
ENGINES = ["decode-2", "prefill-1", "worker-0"]


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("curve") / "keys"
    done = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate", str(directory)],
                          capture_output=True, text=True, cwd=REPO, timeout=60, env=child_env())
    assert done.returncode == 0, done.stderr
    assert "curve_keys_dir" in done.stdout
    zmq.auth.create_certificates(directory, "client-bob")  # a second SDK user's own key
    return directory


@pytest.fixture(scope="module")
def curve_cluster(make_cluster, keys_dir):
    config = keys_dir.parent / "cluster.toml"
    config.write_text(f'curve_enabled = true\ncurve_keys_dir = "{keys_dir}"\n{API_KEYS}')
    # A co-located worker beside a prefill/decode pair: every role, and the KV transport,
    # under its own key; no local prefill, so requests alternate between the two paths.
    running = make_cluster(workers=1, prefill=1, decode=1,
                           extra=["--config", str(config), "--max-local-prefill-tokens", "0"])
    yield running
    running.stop()


@pytest.mark.parametrize("who", ["client", "client-bob"])
def test_clients_holding_a_client_key_are_served(curve_cluster, keys_dir, who):
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir / f"{who}.key_secret"), api_key="sk-alice",
                timeout_s=60) as client:
        assert len(client.generate("secret", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_under_curve_requests_take_both_paths_of_a_mixed_cluster(curve_cluster, keys_dir):
    """Round robin alternates the prefill between worker-0 and prefill-1: some requests are
    served co-located, others have their KV pulled by decode-2 from prefill-1, each peer
    proving its own role."""
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir), api_key="sk-alice", timeout_s=60) as client:
        for n in range(4):
            assert len(client.generate(f"both paths {n}", max_tokens=3, ignore_eos=True).token_ids) == 3
    assert _metric(curve_cluster, 0, "baton_worker_requests_total") > 0
    assert _metric(curve_cluster, 1, "baton_kv_exposures_total", 'outcome="done"') > 0
    assert _metric(curve_cluster, 2, "baton_kv_transfer_bytes_total") > 0


def _metric(cluster, index: int, name: str, labels: str = "") -> float:
    """The sum of engine `index`'s samples of `name` whose label text contains `labels`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + 11 + 2 * index}/metrics",
                                timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and not line.startswith(name + "_") and labels in line)


@pytest.mark.parametrize("who", ["no keys", "a stranger's keys", "the worker's keys"])
def test_anyone_else_is_refused_on_the_sdk_socket(curve_cluster, keys_dir, who):
    curve = None
    if who == "a stranger's keys":
        public, secret = zmq.curve_keypair()
        curve = dict(curve_keys(keys_dir), client_public=public.decode(), client_secret=secret.decode())
    elif who == "the worker's keys":
        curve = curve_keys(keys_dir / "worker.key_secret")
    with Client(curve_cluster.sdk, curve=curve, connect_timeout_s=2) as client:
        with pytest.raises(ServerUnavailable):
            client.generate("let me in", max_tokens=2)


def _dealer_as(keys_dir, role: str, address: str, identity: bytes | None = None):
    """A DEALER presenting `role`'s key and pinning the router's."""
    keys = load_curve_keys(keys_dir, role)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 2000)  # a refused key's connection is dropped: sends may find none
    if identity:
        socket.setsockopt(zmq.IDENTITY, identity)
    socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = (
        keys.public_of("router"), keys.public, keys.secret)
    socket.connect(address)
    return context, socket


def _worker_hello(worker_id: str) -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, role="worker", model_fingerprint="m",
                 tokenizer_fingerprint="t", kv_blocks=10, block_size=16, max_model_len=1024,
                 events_address="tcp://127.0.0.1:1", metrics_address="")


def _generate(request_id: str) -> list:
    request = Generate(request_id=request_id, sampling=Sampling(max_tokens=2),
                       stream_address="tcp://127.0.0.1:1", tenant="alice")
    return encode(request, [[5, 6, 7]])


def test_a_client_key_can_neither_register_a_worker_nor_place_a_request(curve_cluster, keys_dir):
    """The attack that read other users' prompts: a client posing as worker-0."""
    context, socket = _dealer_as(keys_dir, "client", curve_cluster.router, b"worker-0")
    try:
        try:
            socket.send_multipart(encode(_worker_hello("worker-0")))
            socket.send_multipart(_generate("stolen"))
        except zmq.Again:
            pass  # refused before it could even queue: nothing got through either
        assert not socket.poll(2000), "the router answered a client"
    finally:
        context.destroy(linger=0)
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir), api_key="sk-alice", timeout_s=60) as client:
        assert sorted(w.worker_id for w in client.status().workers) == ENGINES
        assert client.generate("still mine", max_tokens=2).token_ids


def _kv_ready() -> list:
    return encode(KvReady(request_id="r-1", lease_id="0" * 32, block_ids=[1], block_hashes=[], num_tokens=3,
                          first_token_id=5))


def _lease_release() -> list:
    return encode(KvLeaseUpdate(request_id="r-1", lease_id="0" * 32, prefill_worker_id="prefill-1",
                                action="release"))


PROBES = {"hello": lambda: encode(_worker_hello("worker-9")), "generate": lambda: _generate("g-1"),
          "kv_ready": _kv_ready, "lease": _lease_release}


@pytest.mark.parametrize("role, message, refused", [
    ("tokenizer", "hello", "Hello from tokenizer"),
    ("worker", "generate", "Generate from worker"),
    ("prefill", "generate", "Generate from prefill"),
    ("worker", "kv_ready", "KvReady from worker"),
    ("decode", "kv_ready", "KvReady from decode"),
    ("prefill", "lease", "KvLeaseUpdate from prefill"),
    ("tokenizer", "lease", "KvLeaseUpdate from tokenizer"),
])
def test_each_role_may_send_only_its_own_messages(curve_cluster, keys_dir, role, message, refused):
    context, socket = _dealer_as(keys_dir, role, curve_cluster.router, f"{role}-probe".encode())
    try:
        socket.send_multipart(PROBES[message]())
        assert socket.poll(5000), "no answer"
        reply, _ = decode(socket.recv_multipart())
        assert isinstance(reply, Error) and refused in reply.message
    finally:
        context.destroy(linger=0)
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir), api_key="sk-alice", timeout_s=30) as client:
        assert sorted(w.worker_id for w in client.status().workers) == ENGINES


def test_a_key_joins_only_as_its_own_role(curve_cluster, keys_dir):
    """A worker's key cannot register a prefill worker (whose KV address decode workers
    would then pull from), nor a decode worker."""
    for claimed in ("prefill", "decode"):
        context, socket = _dealer_as(keys_dir, "worker", curve_cluster.router, f"{claimed}-9".encode())
        try:
            hello = _worker_hello(f"{claimed}-9")
            hello.role, hello.kv_address = claimed, "tcp://127.0.0.1:1"
            socket.send_multipart(encode(hello))
            assert socket.poll(5000), "no answer"
            reply, _ = decode(socket.recv_multipart())
            assert isinstance(reply, Welcome) and not reply.accepted
            assert f"a worker key cannot join as '{claimed}'" in reply.reason
        finally:
            context.destroy(linger=0)


def test_a_bad_events_address_is_refused_and_the_router_carries_on(curve_cluster, keys_dir, tiny_model_dir):
    """A Hello with the model's real fingerprints and a garbage events_address crashed the router."""
    context, socket = _dealer_as(keys_dir, "worker", curve_cluster.router, b"worker-7")
    try:
        model, tokenizer = fingerprints(tiny_model_dir)
        hello = _worker_hello("worker-7")
        hello.model_fingerprint, hello.tokenizer_fingerprint, hello.kv_dtype = model, tokenizer, "bfloat16"
        hello.events_address = "garbage-endpoint"
        socket.send_multipart(encode(hello))
        assert socket.poll(5000), "no answer"
        reply, _ = decode(socket.recv_multipart())
        assert isinstance(reply, Welcome) and not reply.accepted
        assert "events_address" in reply.reason
    finally:
        context.destroy(linger=0)
    assert curve_cluster.process.poll() is None
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir), api_key="sk-alice", timeout_s=30) as client:
        assert client.generate("router still up", max_tokens=2).token_ids


def _start(role: str, *flags: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "start", role, *flags], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout_s, env=child_env())


def test_without_curve_a_public_bind_is_refused_at_start():
    done = _start("router", "--host", "0.0.0.0", "--check-config")
    assert done.returncode != 0
    assert "refusing to bind tcp://0.0.0.0" in done.stderr and "--insecure" in done.stderr


def test_insecure_allows_it_with_a_warning_on_every_start():
    done = _start("router", "--host", "0.0.0.0", "--insecure", "--check-config")
    assert done.returncode == 0, done.stderr
    assert "WARNING: router runs insecure" in done.stderr


def test_curve_without_the_roles_secret_stops_the_role_naming_the_file(keys_dir, tmp_path):
    partial = tmp_path / "keys"
    partial.mkdir()
    for path in keys_dir.glob("*.key"):
        (partial / path.name).write_bytes(path.read_bytes())
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "start", "router", "--port-base", "9300"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env=child_env(BATON_CURVE_ENABLED="1", BATON_CURVE_KEYS_DIR=str(partial)))
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0 and "router.key_secret" in stderr


def test_the_tenant_comes_from_the_api_key_only(curve_cluster, keys_dir):
    """Generate's tenant is set by the tokenizer from the key; a client cannot name one."""
    started = time.monotonic()
    with Client(curve_cluster.sdk, curve=curve_keys(keys_dir), api_key="sk-wrong", timeout_s=30) as client:
        with pytest.raises(Exception) as refused:
            client.generate("whose tenant?", max_tokens=2)
    assert type(refused.value).__name__ == "Unauthorized" and time.monotonic() - started < 10


def test_a_public_http_gateway_without_api_keys_is_warned_of(tiny_model_dir):
    done = _start("tokenizer", "--http-host", "0.0.0.0", "--model", str(tiny_model_dir), "--check-config")
    assert done.returncode == 0, done.stderr
    assert "HTTP gateway on 0.0.0.0 takes requests from anyone" in done.stderr
    quiet = _start("tokenizer", "--model", str(tiny_model_dir), "--check-config")
    assert "HTTP gateway" not in quiet.stderr
