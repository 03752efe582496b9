"""An engine is the connection it joined on (docs/architecture.md §3), on a real cluster,
with CURVE on (the impostor holds a real engine key) and off (loopback): a Hello naming a
live engine from another connection is refused and counted and never displaces it;
heartbeats from another connection never keep a stopped engine alive; KV events and
reports are believed only from the engine they name."""
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.engine.checkpoint import fingerprints
from common.protocol import PROTOCOL_VERSION, Generate, Heartbeat, Hello, KvEvents, KvReady, Welcome, decode, encode
from common.sockets import load_curve_keys
from services.client import Client, curve_keys
from services.local_cluster import REPO, child_env

ENGINES = ["worker-0", "worker-1"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["curve", "plain"])
def guarded(request, make_cluster, tmp_path_factory):
    """Two co-located workers; with `curve`, every socket under the cluster's keys."""
    extra: list[str] = []
    keys_dir = None
    if request.param == "curve":
        keys_dir = tmp_path_factory.mktemp("identity") / "keys"
        done = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate", str(keys_dir)],
                              capture_output=True, text=True, cwd=REPO, timeout=60, env=child_env())
        assert done.returncode == 0, done.stderr
        config = keys_dir.parent / "cluster.toml"
        config.write_text(f'curve_enabled = true\ncurve_keys_dir = "{keys_dir}"\n')
        extra = ["--config", str(config)]
    running = make_cluster(workers=2, extra=extra)
    running.keys_dir = keys_dir
    yield running
    running.stop()


class Impostor:
    """A DEALER on the router socket that is not the engine it names: with CURVE it holds
    a real key of `role` (what a second engine of that role, or a thief of its key, has)."""

    def __init__(self, cluster, role: str = "worker"):
        self.context = zmq.Context()
        self.keys = load_curve_keys(cluster.keys_dir, role) if cluster.keys_dir else None
        self.socket = self._socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDTIMEO, 2000)
        if self.keys is not None:
            self.socket.curve_serverkey = self.keys.public_of("router")
            self.socket.curve_publickey, self.socket.curve_secretkey = self.keys.public, self.keys.secret
        self.socket.connect(cluster.router)

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        return socket

    def send(self, message) -> None:
        self.socket.send_multipart(encode(message))

    def reply(self, wait_s: float = 5):
        """The next message the router sent this connection."""
        assert self.socket.poll(int(wait_s * 1000)), "the router did not answer"
        return decode(self.socket.recv_multipart())[0]

    def replies(self, wait_s: float) -> list:
        """Every message the router sent this connection within `wait_s`."""
        received = []
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000)):
                received.append(decode(self.socket.recv_multipart())[0])
        return received

    def publisher(self) -> tuple[zmq.Socket, str]:
        """A PUB socket the router may subscribe to, as an engine's KV events socket."""
        socket = self._socket(zmq.PUB)
        if self.keys is not None:
            socket.curve_server = True
            socket.curve_publickey, socket.curve_secretkey = self.keys.public, self.keys.secret
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        return socket, f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        self.context.destroy(linger=0)


def real_hello(tiny_model_dir, worker_id: str, events_address: str = "tcp://127.0.0.1:1") -> Hello:
    """A Hello that passes every check but who sends it: the served model's fingerprints."""
    model, tokenizer = fingerprints(tiny_model_dir)
    return Hello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, role="worker", model_fingerprint=model,
                 tokenizer_fingerprint=tokenizer, kv_blocks=1_000_000, block_size=16, max_model_len=1024,
                 kv_dtype="bfloat16", events_address=events_address, metrics_address="",
                 instance_id=uuid.uuid4().hex)


def client(cluster, timeout_s: float = 60) -> Client:
    curve = curve_keys(cluster.keys_dir) if cluster.keys_dir else None
    return Client(cluster.sdk, curve=curve, timeout_s=timeout_s)


def refused(cluster, message: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port_base + 3}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "baton_router_identity_refused_total" and sample.labels.get("message") == message)


def workers(cluster) -> list[str]:
    with client(cluster, 10) as sdk:
        return sorted(w.worker_id for w in sdk.status().workers)


def serve(cluster, count: int, tag: str) -> list[int]:
    """Send `count` requests at once; the number of tokens each got."""
    def one(n: int) -> int:
        with client(cluster) as sdk:
            return len(sdk.generate(f"{tag} {n}", max_tokens=3, **GREEDY).token_ids)
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_a_hello_naming_a_live_engine_is_refused_and_the_impostor_leaving_changes_nothing(guarded, tiny_model_dir):
    """The takeover that sent tenant prompts to an impostor and then 503s for 11 minutes:
    a Hello naming worker-0 from another connection (fingerprints right, key right under
    CURVE) is refused with a retry-after, counted, and sent nothing; requests meanwhile go
    to the real engines; when the impostor leaves the cluster serves at once."""
    before = refused(guarded, "Hello")
    impostor = Impostor(guarded)
    try:
        impostor.send(real_hello(tiny_model_dir, "worker-0"))
        welcome = impostor.reply()
        assert isinstance(welcome, Welcome) and not welcome.accepted and welcome.retry_after_s > 0
        assert "worker-0 is registered on another connection" in welcome.reason
        assert refused(guarded, "Hello") == before + 1
        for _ in range(3):  # it insists while requests are placed
            impostor.send(real_hello(tiny_model_dir, "worker-0"))
        assert serve(guarded, 4, "while an impostor knocks") == [3] * 4
        got = impostor.replies(1)
        assert not [m for m in got if isinstance(m, Generate)], "a request reached the impostor"
        assert all(isinstance(m, Welcome) and not m.accepted for m in got)
    finally:
        impostor.close()
    started = time.monotonic()
    assert serve(guarded, 4, "after the impostor left") == [3] * 4
    assert time.monotonic() - started < 30
    assert workers(guarded) == ENGINES
    assert refused(guarded, "Hello") == before + 4


def test_heartbeats_from_another_connection_never_keep_a_stopped_engine_alive(guarded):
    """worker-1 is SIGSTOPped while an impostor heartbeats in its name (no session, or a
    guessed one): the router drops worker-1 after its own silence as if no one spoke for
    it, and every request is served by worker-0; resumed, worker-1 rejoins."""
    pid = guarded.worker_health(1)["pid"]
    before = refused(guarded, "Heartbeat")
    impostor = Impostor(guarded)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            served = pool.submit(serve, guarded, 6, "worker-1 is stopped")
            seq = 0
            while workers(guarded) != ["worker-0"]:
                assert time.monotonic() - stopped < 10, "the router kept the stopped worker"
                seq += 1
                impostor.send(Heartbeat(worker_id="worker-1", running=0, waiting=0, kv_blocks_used=0,
                                        kv_blocks_cached=0, kv_blocks_total=100, seq=seq,
                                        session="" if seq % 2 else uuid.uuid4().hex))
                time.sleep(0.1)
            assert served.result(timeout=90) == [3] * 6
        assert refused(guarded, "Heartbeat") >= before + 1
    finally:
        os.kill(pid, signal.SIGCONT)
        impostor.close()
    guarded.wait_for(lambda: workers(guarded) == ENGINES, 30, "worker-1 to rejoin")
    assert serve(guarded, 2, "worker-1 is back") == [3] * 2


def test_kv_events_count_only_from_the_engine_they_name(guarded, tiny_model_dir):
    """KV events naming worker-0 from a connection that has not joined, and from the
    publisher of another engine the impostor registered, are refused and counted; the
    index does not change."""
    impostor = Impostor(guarded)
    before = refused(guarded, "KvEvents")
    forged = KvEvents(worker_id="worker-0", stored=list(range(1, 200)))
    try:
        impostor.send(forged)
        reply = impostor.reply()
        assert isinstance(reply, Welcome) and reply.rehello and "has not joined" in reply.reason
        assert refused(guarded, "KvEvents") == before + 1
        publisher, address = impostor.publisher()
        impostor.send(real_hello(tiny_model_dir, "worker-7", address))
        welcome = impostor.reply()
        assert isinstance(welcome, Welcome) and welcome.accepted, welcome
        deadline = time.monotonic() + 15
        while refused(guarded, "KvEvents") < before + 2:  # until the router's subscription is up
            assert time.monotonic() < deadline, "the router never read the impostor's publisher"
            impostor.send(Heartbeat(worker_id="worker-7", running=0, waiting=0, kv_blocks_used=0,
                                    kv_blocks_cached=0, kv_blocks_total=100, session=welcome.session))
            publisher.send_multipart(encode(forged))
            time.sleep(0.2)
        assert "worker-7" in workers(guarded)  # its own session kept it, as it keeps a real engine
    finally:
        impostor.close()
    guarded.wait_for(lambda: workers(guarded) == ENGINES, 10, "the router to drop worker-7")
    assert serve(guarded, 2, "index untouched") == [3] * 2


def test_a_kv_ready_from_a_connection_that_has_not_joined_is_refused(guarded):
    impostor = Impostor(guarded, "prefill")
    before = refused(guarded, "KvReady")
    try:
        impostor.send(KvReady(request_id="r-1", lease_id="0" * 32, block_ids=[1], block_hashes=[], num_tokens=3,
                              first_token_id=5))
        reply = impostor.reply()
        assert isinstance(reply, Welcome) and not reply.accepted and reply.rehello
        assert refused(guarded, "KvReady") == before + 1
    finally:
        impostor.close()
