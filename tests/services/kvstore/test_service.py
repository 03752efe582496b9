"""The kvstore role as a real process: its socket, shared-memory pool, SSD tier and client."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.config import ClusterConfig, load_config
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv_layout import KVLayout
from common.protocol import StoreEvents, StoreReply, StoreRequest, decode, encode
from common.sockets import Security
from services.kvstore.client import StoreClient, StoreUnavailable
from services.kvstore.main import store_layout
from services.kvstore.ssd import FILE_HEADER_BYTES, HEADER_BYTES, RECORD_MAGIC, SsdTier
from services.kvstore.tiers import ssd_config
from services.local_cluster import REPO, _health, child_env, free_port_base

NS_A = 0xA1A1_0000_0000_0001
NS_B = 0xB2B2_0000_0000_0002
DRAM_GB = 0.001  # 30 slots of the tiny model's 32 KiB blocks


class Store:
    """`svc start kvstore` in a child process on free loopback ports."""

    def __init__(self, model_dir: Path, scratch: Path, **settings: object):
        self.port_base = free_port_base()
        self.config_path = scratch / f"store-{self.port_base}.toml"
        # bfloat16 unless a test says otherwise: the slot counts below are those of its blocks
        # on any CPU (`auto` is float32 on one without native bf16).
        settings = {"model": model_dir, "port_base": self.port_base, "kvstore_dram_gb": DRAM_GB,
                    "kvstore_timeout_s": 2.0, "dtype": "bfloat16", **settings}
        lines = [f"{key} = {_toml(value)}" for key, value in settings.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        self.config: ClusterConfig = load_config(self.config_path)
        self.layout = store_layout(self.config)
        self.process: subprocess.Popen | None = None
        self.log = scratch / f"store-{self.port_base}.log"

    def start(self) -> Store:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "services.cli", "start", "kvstore", "--config",
                                             str(self.config_path)], stdout=log, stderr=subprocess.STDOUT,
                                            env=child_env(), cwd=REPO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if _health(self.config.kvstore_metrics_port).get("ok"):
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("the store did not come up:\n" + self.log.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def client(self, role: str = "worker", shared_memory: bool = True, config: ClusterConfig | None = None,
               native_copies: bool | None = None):
        context: zmq.Context = zmq.Context()
        config = config or self.config
        return StoreClient(config, Security(context, config, role), f"{role}-0", self.layout,
                           shared_memory=shared_memory, native_copies=native_copies), context


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | Path):
        return f'"{value}"'
    return str(value)


def values_for(keys: list[int], block_bytes: int) -> np.ndarray:
    """A value per key that only that key has (so a wrong or torn block shows)."""
    rng = np.random.default_rng(keys[0] if keys else 0)
    out = rng.integers(0, 256, size=(len(keys), block_bytes), dtype=np.uint8)
    out[:, :8] = np.array([list(k.to_bytes(8, "little")) for k in keys], dtype=np.uint8)
    return out


def chain(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def parents_of(namespace: int, keys: list[int]) -> list[int]:
    return [namespace, *keys[:-1]]


def block_of(pool: np.ndarray, layout: KVLayout, block: int, num_blocks: int) -> np.ndarray:
    planes = 2 * layout.num_layers
    return pool.reshape(planes, num_blocks, -1)[:, block, :].reshape(-1)


@pytest.fixture
def scratch(tmp_path):
    return tmp_path


@pytest.fixture
def stores(tiny_model_dir, scratch):
    started: list[Store] = []
    contexts: list = []

    def make(**settings) -> Store:
        store = Store(tiny_model_dir, scratch, **settings)
        started.append(store)
        return store.start()

    make.contexts = contexts  # type: ignore[attr-defined]
    yield make
    for store in started:
        store.stop()
    for context in contexts:
        context.destroy(0)


def _client(stores, store: Store, **kwargs) -> StoreClient:
    client, context = store.client(**kwargs)
    stores.contexts.append(context)
    return client


def _fetch_check(client: StoreClient, namespace: int, keys: list[int], expected: np.ndarray, layout) -> int:
    num_blocks = len(keys) + 3
    pool = np.zeros(num_blocks * layout.bytes_per_block, dtype=np.uint8)
    dst = [num_blocks - 1 - i for i in range(len(keys))]  # reversed, so the mapping matters
    landed = client.fetch(namespace, keys, pool, dst)
    for i in range(landed):
        assert np.array_equal(block_of(pool, layout, dst[i], num_blocks), expected[i]), f"block {i} differs"
    return landed


# ---- round trips ---------------------------------------------------------------------


# Same-host copies run in Baton's C++ kernel where it loads (None) and in numpy (False).
PATHS = pytest.mark.parametrize("shared_memory,native_copies", [(True, None), (True, False), (False, None)],
                                ids=["same-host", "same-host-numpy", "frames"])


@PATHS
def test_put_lookup_fetch_round_trip(stores, shared_memory, native_copies):
    store = stores()
    client = _client(stores, store, shared_memory=shared_memory, native_copies=native_copies)
    keys = chain(100, 6)
    values = values_for(keys, store.layout.bytes_per_block)
    assert client.put(NS_A, keys, parents_of(NS_A, keys), values) == 6
    assert client.same_host is shared_memory
    assert client.put(NS_A, keys, parents_of(NS_A, keys), values) == 0  # idempotent
    assert client.lookup(NS_A, keys + [999]) == [0] * 6
    assert client.lookup(NS_A, keys[2:]) == [0] * 4  # may start mid-chain
    assert _fetch_check(client, NS_A, keys + [999], np.vstack([values, values[:1]]), store.layout) == 6
    other = _client(stores, store, shared_memory=not shared_memory)  # the other path reads the same bytes
    assert _fetch_check(other, NS_A, keys, values, store.layout) == 6
    # A same-host fetch releases its lease without waiting for the answer, on its own socket.
    deadline = time.monotonic() + 10
    while client.stats()["leases"]:
        assert time.monotonic() < deadline, "a fetch's lease was never released"
        time.sleep(0.05)
    assert client.stats()["blocks"] == 6
    assert client.remove(NS_A, keys[3:4]) == 3
    assert client.lookup(NS_A, keys) == [0] * 3


def test_a_store_of_dtype_auto_takes_the_blocks_of_the_engines_of_its_node(stores, tiny_model_dir):
    """The store loads no torch, yet resolves `auto` as an engine on this CPU does: the
    engine's blocks fit its slots, so its DRAM pool maps into the engine and blocks round-trip."""
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, kv_cache_gb=0.05, max_model_len=1024, device="cpu"))
    store = stores(dtype="auto")
    context: zmq.Context = zmq.Context()
    stores.contexts.append(context)
    client = StoreClient(store.config, Security(context, store.config, "worker"), "worker-0",
                         engine.kv_cache.layout, shared_memory=True)
    keys = chain(300, 4)
    values = values_for(keys, engine.kv_cache.layout.bytes_per_block)
    assert client.put(NS_A, keys, parents_of(NS_A, keys), values) == 4
    assert client.same_host  # the store offers its pool only to a client of its block size
    assert _fetch_check(client, NS_A, keys, values, engine.kv_cache.layout) == 4


def test_a_namespace_never_sees_another(stores):
    store = stores()
    client = _client(stores, store)
    keys = chain(1, 4)
    client.put(NS_A, keys, parents_of(NS_A, keys), values_for(keys, store.layout.bytes_per_block))
    assert client.lookup(NS_B, keys) == []
    pool = np.zeros(8 * store.layout.bytes_per_block, dtype=np.uint8)
    assert client.fetch(NS_B, keys, pool, list(range(4))) == 0
    assert not pool.any()
    with pytest.raises(Exception, match="no committed block"):
        client.remove(NS_B, keys[:1])
    assert client.lookup(NS_A, keys) == [0] * 4


def test_quota_caps_a_namespace_and_not_the_others(stores):
    store = stores(kvstore_quota_blocks=5)
    client = _client(stores, store)
    bb = store.layout.bytes_per_block
    keys = chain(1, 8)
    assert client.put(NS_A, keys, parents_of(NS_A, keys), values_for(keys, bb)) == 5
    assert "quota" in client.last_refusal
    assert len(client.lookup(NS_A, keys)) == 5
    others = chain(50, 5)
    assert client.put(NS_B, others, parents_of(NS_B, others), values_for(others, bb)) == 5
    assert client.stats()["quota_refusals"] >= 1


# ---- two-phase put ---------------------------------------------------------------------


def _raw(store: Store, role: str = "worker"):
    context: zmq.Context = zmq.Context()
    socket = Security(context, store.config, role).client(zmq.DEALER, store.config.kvstore_control, "kvstore")
    return context, socket


def _ask(socket: zmq.Socket, request: StoreRequest, payloads=None) -> tuple[StoreReply, list]:
    socket.send_multipart(encode(request, payloads))
    assert socket.poll(5000), "the store did not answer"
    reply, frames = decode(socket.recv_multipart())
    assert isinstance(reply, StoreReply)
    return reply, frames


def test_a_half_written_block_is_never_readable(stores):
    store = stores()
    bb = store.layout.bytes_per_block
    context, socket = _raw(store)
    try:
        reader = _client(stores, store)
        keys = chain(7, 2)
        values = values_for(keys, bb)
        start, _ = _ask(socket, StoreRequest("put_start", 1, NS_A, keys=keys, parents=parents_of(NS_A, keys)))
        assert start.ok and len(start.slots) == 2 and all(start.tickets)
        shm = np.memmap(start.shm_path, dtype=np.uint8, mode="r+").reshape(-1, bb)
        assert oct(os.stat(start.shm_path).st_mode & 0o777) == "0o600"
        shm[start.slots[0], : bb // 2] = values[0, : bb // 2]  # half written
        assert reader.lookup(NS_A, keys) == []
        pool = np.zeros(4 * bb, dtype=np.uint8)
        assert reader.fetch(NS_A, keys, pool, [0, 1]) == 0
        from google_crc32c import value as crc

        bad, _ = _ask(socket, StoreRequest("put_commit", 2, NS_A, tickets=start.tickets,
                                           checksums=[crc(values[0].tobytes()), crc(values[1].tobytes())]))
        assert not bad.ok and "checksum" in bad.reason and bad.count == 0  # the half block fails; both undone
        assert reader.lookup(NS_A, keys) == []
        assert reader.put(NS_A, keys, parents_of(NS_A, keys), values) == 2
        assert _fetch_check(reader, NS_A, keys, values, store.layout) == 2
    finally:
        context.destroy(0)


def test_readers_racing_writers_only_ever_see_whole_blocks(stores):
    store = stores()
    bb = store.layout.bytes_per_block
    chains = [chain(1000 * (c + 1), 4) for c in range(12)]
    errors: list[str] = []
    done = threading.Event()

    def write() -> None:
        writer = _client(stores, store)
        for keys in chains:  # 48 blocks through 30 slots: eviction runs while readers read
            writer.put(NS_A, keys, parents_of(NS_A, keys), values_for(keys, bb))
        done.set()

    def read() -> None:
        reader = _client(stores, store)
        while not done.is_set():
            for keys in chains:
                try:
                    _fetch_check(reader, NS_A, keys, values_for(keys, bb), store.layout)
                except AssertionError as error:
                    errors.append(str(error))
                    return

    threads = [threading.Thread(target=write), *(threading.Thread(target=read) for _ in range(2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert done.is_set() and not errors


def test_leases_keep_blocks_from_eviction(stores):
    store = stores()
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    held = chain(1, 3)
    client.put(NS_A, held, parents_of(NS_A, held), values_for(held, bb))
    context, socket = _raw(store)
    try:
        lease, _ = _ask(socket, StoreRequest("get", 1, NS_A, keys=held))
        assert lease.ok and lease.lease_id and len(lease.slots) == 3
        for c in range(20):  # 60 blocks through 30 slots
            keys = chain(100 * (c + 1), 3)
            client.put(NS_B, keys, parents_of(NS_B, keys), values_for(keys, bb))
        assert client.lookup(NS_A, held) == [0, 0, 0]
        shm = np.memmap(lease.shm_path, dtype=np.uint8, mode="r").reshape(-1, bb)
        assert np.array_equal(shm[lease.slots], values_for(held, bb))
        released, _ = _ask(socket, StoreRequest("release", 2, lease_id=lease.lease_id))
        assert released.ok
        for c in range(20):
            keys = chain(10_000 * (c + 1), 3)
            client.put(NS_B, keys, parents_of(NS_B, keys), values_for(keys, bb))
        assert client.lookup(NS_A, held) == []  # unleased, it ages out
    finally:
        context.destroy(0)


# ---- the SSD tier across restarts --------------------------------------------------------


def _find_tier_slots(store: Store) -> dict[int, int]:
    """key -> real slot of each record in the (closed) store's SSD directory."""
    config = ssd_config(Path(store.config.kvstore_ssd_dir), store.config.kvstore_ssd_gb, store.layout.bytes_per_block)
    with SsdTier(config) as ssd:
        return {key: slot for (_, key), slot in ssd.entries().items()}


def test_kill_during_put_then_restart_serves_every_committed_ssd_block(stores, scratch):
    store = stores(kvstore_ssd_dir=str(scratch / "ssd"), kvstore_ssd_gb=0.004)
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    keys = chain(1, 60)  # 60 blocks through 30 DRAM slots: the older ones demote to SSD
    values = values_for(keys, bb)
    assert client.put(NS_A, keys, parents_of(NS_A, keys), values) == 60
    tiers = client.lookup(NS_A, keys)
    on_ssd = [i for i, tier in enumerate(tiers) if tier == 1]
    head_length = next(i for i, tier in enumerate(tiers) if tier == 0)  # the chain's head, demoted first
    assert head_length >= 10
    context, socket = _raw(store)
    try:
        start, _ = _ask(socket, StoreRequest("put_start", 1, NS_B, keys=[777], parents=[NS_B]))
        shm = np.memmap(start.shm_path, dtype=np.uint8, mode="r+").reshape(-1, bb)
        shm[start.slots[0], :100] = 1
        store.stop(signal.SIGKILL)  # mid-put
    finally:
        context.destroy(0)
    assert Path(start.shm_path).exists()  # SIGKILL left the pool behind ...
    store.start()
    assert not Path(start.shm_path).exists()  # ... and the next store removed it
    fresh = _client(stores, store)
    assert fresh.lookup(NS_B, [777]) == []
    assert fresh.lookup(NS_A, keys) == [1] * head_length
    assert _fetch_check(fresh, NS_A, keys, values, store.layout) == head_length
    stats = fresh.stats()
    # SSD blocks whose parent was only in DRAM lost their chain with it: dropped, counted
    assert stats["warmup_blocks"] == head_length and stats["warmup_seconds"] > 0
    assert stats["warmup_dropped_orphans"] == len(on_ssd) - head_length
    assert "warmup_s" in (scratch / f"store-{store.port_base}.log").read_text()
    old = client.stats()  # the first client notices the new instance and re-maps
    assert old["instance_id"] == stats["instance_id"]
    assert _fetch_check(client, NS_A, keys, values, store.layout) == head_length


def test_a_graceful_stop_keeps_every_block_for_the_next_start(stores, scratch):
    store = stores(kvstore_ssd_dir=str(scratch / "ssd"), kvstore_ssd_gb=0.004)
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    keys = chain(1, 40)
    values = values_for(keys, bb)
    client.put(NS_A, keys, parents_of(NS_A, keys), values)
    assert client.lookup(NS_A, keys).count(0) > 0  # some only in DRAM
    assert store.stop() == 0
    store.start()
    assert client.lookup(NS_A, keys) == [1] * 40
    assert _fetch_check(client, NS_A, keys, values, store.layout) == 40
    assert client.lookup(NS_A, keys)[0] == 0  # the get promoted what DRAM holds back to it
    stats = client.stats()
    assert stats["warmup_blocks"] == 40 and stats["warmup_dropped_orphans"] == 0


def test_a_corrupted_ssd_record_is_dropped_with_its_descendants(stores, scratch):
    store = stores(kvstore_ssd_dir=str(scratch / "ssd"), kvstore_ssd_gb=0.004)
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    keys = chain(1, 60)
    values = values_for(keys, bb)
    client.put(NS_A, keys, parents_of(NS_A, keys), values)
    store.stop()  # a graceful stop flushes DRAM to the SSD tier
    slots = _find_tier_slots(store)
    victim = 5
    config = ssd_config(Path(store.config.kvstore_ssd_dir), store.config.kvstore_ssd_gb, bb)
    with open(Path(store.config.kvstore_ssd_dir) / "slots-000.bkv", "r+b") as file:
        file.seek(FILE_HEADER_BYTES + slots[keys[victim]] * config.slot_bytes + 64 + 1000)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
    store.start()
    fresh = _client(stores, store)
    assert fresh.lookup(NS_A, keys) == [1] * victim
    assert _fetch_check(fresh, NS_A, keys, values, store.layout) == victim
    stats = fresh.stats()
    assert stats["warmup_dropped_damaged"] == 1
    assert stats["warmup_dropped_orphans"] == len(keys) - victim - 1
    assert stats["warmup_blocks"] == victim
    assert _damaged_records(store) == {"restart": 1, "read": 0}


def _damaged_records(store: Store) -> dict[str, float]:
    """baton_kvstore_damaged_records_total by its `found` label, from the store's /metrics."""
    url = f"http://127.0.0.1:{store.config.kvstore_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {sample.labels["found"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "baton_kvstore_damaged_records_total"}


def _record_offset(store: Store, namespace: int, key: int) -> int:
    """Where in slots-000.bkv the live record of (namespace, key) starts, read off the
    record headers (docs: ssd.py's layout) while the store holds the tier open."""
    config = ssd_config(Path(store.config.kvstore_ssd_dir), store.config.kvstore_ssd_gb, store.layout.bytes_per_block)
    wanted = namespace.to_bytes(8, "little").ljust(16, b"\0")
    with open(Path(store.config.kvstore_ssd_dir) / "slots-000.bkv", "rb") as file:
        for slot in range(config.num_slots):
            offset = FILE_HEADER_BYTES + slot * config.slot_bytes
            file.seek(offset)
            head = file.read(HEADER_BYTES)
            # magic 4s | version u16 | namespace length u8 | reserved u8 | namespace 16s | key u64
            if head[:4] == RECORD_MAGIC and head[8:24] == wanted and struct.unpack_from("<Q", head, 24)[0] == key:
                return offset
    raise AssertionError(f"no record of key {key:#x} on the SSD")


def test_a_record_damaged_while_the_store_runs_is_logged_counted_dropped_and_the_rest_serve(stores, scratch):
    store = stores(kvstore_ssd_dir=str(scratch / "ssd"), kvstore_ssd_gb=0.004)
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    keys_a, keys_b = chain(1, 40), chain(1000, 40)
    values_a, values_b = values_for(keys_a, bb), values_for(keys_b, bb)
    client.put(NS_A, keys_a, parents_of(NS_A, keys_a), values_a)
    client.put(NS_B, keys_b, parents_of(NS_B, keys_b), values_b)  # 80 blocks, 30 DRAM slots: NS_A demotes
    victim = 5
    assert client.lookup(NS_A, keys_a)[: victim + 1] == [1] * (victim + 1)
    assert _damaged_records(store) == {"restart": 0, "read": 0}
    with open(Path(store.config.kvstore_ssd_dir) / "slots-000.bkv", "r+b") as file:
        file.seek(_record_offset(store, NS_A, keys_a[victim]) + HEADER_BYTES + 1000)  # into its value
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
    assert _fetch_check(client, NS_A, keys_a, values_a, store.layout) == victim  # the blocks before it only
    assert _damaged_records(store) == {"restart": 0, "read": 1}
    damage = [json.loads(line) for line in store.log.read_text().splitlines() if "kvstore_ssd_record_damaged" in line]
    assert [(d["level"], d["namespace"], d["key"], d["reason"]) for d in damage] == \
        [("warning", f"{NS_A:#x}", f"{keys_a[victim]:#x}", "CRC32C mismatch")]
    assert len(client.lookup(NS_A, keys_a)) == victim  # dropped from the index, with the blocks under it
    assert _fetch_check(client, NS_A, keys_a, values_a, store.layout) == victim  # not met again
    assert _fetch_check(client, NS_B, keys_b, values_b, store.layout) == len(keys_b)  # the store goes on
    assert _damaged_records(store) == {"restart": 0, "read": 1}


def test_a_store_refuses_an_ssd_directory_other_users_can_read(tiny_model_dir, scratch):
    ssd_dir = scratch / "ssd"
    ssd_dir.mkdir()
    ssd_dir.chmod(0o755)  # as an earlier Baton made it
    store = Store(tiny_model_dir, scratch, kvstore_ssd_dir=str(ssd_dir), kvstore_ssd_gb=0.004)
    # A store that wrongly came up would outlive the timeout: run() kills it and the test fails.
    result = subprocess.run([sys.executable, "-m", "services.cli", "start", "kvstore", "--config",
                             str(store.config_path)], capture_output=True, text=True, env=child_env(), cwd=REPO,
                            timeout=120)
    assert result.returncode != 0
    assert f"ssd tier: {ssd_dir} is mode 0755, readable by other users" in result.stdout + result.stderr
    assert list(ssd_dir.iterdir()) == []


# ---- who may talk, and what ------------------------------------------------------------


def test_a_malformed_frame_is_refused_by_name_and_the_store_goes_on(stores):
    store = stores()
    context, socket = _raw(store)
    try:
        socket.send_multipart([bytes([24]), b"\xc1 not msgpack"])
        reply, _ = decode(socket.recv_multipart()) if socket.poll(5000) else (None, None)
        assert isinstance(reply, StoreReply) and not reply.ok and "STORE_REQUEST" in reply.reason
        for request, text in [(StoreRequest("frobnicate", 2), "op: 'frobnicate'"),
                              (StoreRequest("put_start", 3, NS_A, keys=[1, 2], parents=[NS_A]), "parents"),
                              (StoreRequest("lookup", 4, NS_A, keys=[-1]), "keys"),
                              (StoreRequest("release", 5, lease_id=42), "lease 42")]:
            answer, _ = _ask(socket, request)
            assert not answer.ok and text in answer.reason, answer.reason
        socket.send_multipart([bytes([99]), msgspec.msgpack.encode({})])
        assert socket.poll(5000)
        unknown, _ = decode(socket.recv_multipart())
        assert isinstance(unknown, StoreReply) and "unknown message type 99" in unknown.reason
        good, _ = _ask(socket, StoreRequest("stats", 6))
        assert good.ok and good.stats["blocks"] == 0
    finally:
        context.destroy(0)


def test_store_events_reach_a_subscriber(stores):
    store = stores()
    context: zmq.Context = zmq.Context()
    try:
        sub = Security(context, store.config, "router").subscriber("kvstore")
        sub.connect(store.config.kvstore_events_address)
        time.sleep(0.3)  # the slow joiner: a SUB misses what is published before it joins
        client = _client(stores, store)
        keys = chain(5, 3)
        client.put(NS_A, keys, parents_of(NS_A, keys), values_for(keys, store.layout.bytes_per_block))
        seen: list[int] = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            if sub.poll(500):
                events, _ = decode(sub.recv_multipart())
                assert isinstance(events, StoreEvents) and events.store_id == "kvstore"
                seen += events.stored
                assert events.stored_tiers == [0] * len(events.stored)
        assert seen == keys
    finally:
        context.destroy(0)


def test_under_curve_only_engine_roles_are_served(stores, scratch):
    keys_dir = scratch / "keys"
    done = subprocess.run([sys.executable, "-m", "services.cli", "keys", "generate", str(keys_dir)],
                          capture_output=True, text=True, cwd=REPO, timeout=60, env=child_env())
    assert done.returncode == 0, done.stderr
    store = stores(curve_enabled=True, curve_keys_dir=str(keys_dir), kvstore_timeout_s=1.0)
    for role in ("worker", "prefill", "decode"):
        assert _client(stores, store, role=role).stats()["blocks"] == 0
    for role in ("tokenizer", "client"):
        with pytest.raises(StoreUnavailable):
            _client(stores, store, role=role).stats()


@PATHS
def test_a_block_rewritten_behind_the_stores_back_is_never_handed_over(stores, shared_memory, native_copies):
    store = stores()
    bb = store.layout.bytes_per_block
    writer = _client(stores, store)
    keys = chain(40, 4)
    values = values_for(keys, bb)
    writer.put(NS_A, keys, parents_of(NS_A, keys), values)
    context, socket = _raw(store)
    try:
        lease, _ = _ask(socket, StoreRequest("get", 1, NS_A, keys=keys))
        shm = np.memmap(lease.shm_path, dtype=np.uint8, mode="r+").reshape(-1, bb)
        shm[lease.slots[2], 500] ^= 0xFF  # a stray writer (a put past its ticket, say)
        _ask(socket, StoreRequest("release", 2, lease_id=lease.lease_id))
    finally:
        context.destroy(0)
    reader = _client(stores, store, shared_memory=shared_memory, native_copies=native_copies)
    assert _fetch_check(reader, NS_A, keys, values, store.layout) == 2
    assert reader.checksum_failures == 1


def test_a_lease_never_released_expires_and_a_put_never_committed_is_reclaimed(stores):
    store = stores(kvstore_timeout_s=0.1)  # leases and tickets last max(1 s, 5 × it)
    bb = store.layout.bytes_per_block
    client = _client(stores, store)
    keys = chain(60, 2)
    client.put(NS_A, keys, parents_of(NS_A, keys), values_for(keys, bb))
    context, socket = _raw(store)
    try:
        lease, _ = _ask(socket, StoreRequest("get", 1, NS_A, keys=keys))
        start, _ = _ask(socket, StoreRequest("put_start", 2, NS_B, keys=[9], parents=[NS_B]))
        assert lease.lease_id and start.tickets[0]
        deadline = time.monotonic() + 30
        while client.stats()["leases"] or client.stats()["pending"]:
            assert time.monotonic() < deadline, "the lease or the put never ended"
            time.sleep(0.2)
        stats = client.stats()
        assert stats["leases_expired"] == 1 and stats["puts_reclaimed"] == 1
        late, _ = _ask(socket, StoreRequest("put_commit", 3, NS_B, tickets=start.tickets, checksums=[0]))
        assert not late.ok and "reclaimed" in late.reason
        assert client.lookup(NS_B, [9]) == []
    finally:
        context.destroy(0)
