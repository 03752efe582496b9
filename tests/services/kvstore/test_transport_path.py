"""Remote engines' gets over the store's KV transport (docs/kvstore.md §6), with real
store processes: the store copies leased DRAM slots into its plane-major staging pool and
exposes them, the engine's transport pulls them into its plane-major pool. UCX cases skip
only where ucxx does not import."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from common.engine.checkpoint import fingerprints
from common.kv_transfer import KvTransport, PoolGeometry, TransferOptions, make_transport
from common.protocol import StoreRequest
from common.sockets import Security
from services.kvstore.client import StoreClient, StoreUnavailable
from tests.common.test_kv_transfer import TRANSPORTS
from tests.services.kvstore import test_service
from tests.services.kvstore.test_service import (
    NS_A,
    Store,
    _ask,
    _client,
    _raw,
    block_of,
    chain,
    parents_of,
    values_for,
)

scratch = test_service.scratch  # the store fixtures, shared
stores = test_service.stores

POOL_BLOCKS = 24


class Engine:
    """What a remote engine holds: a plane-major pool, its KvTransport, a StoreClient that
    may not map the store's shared memory."""

    def __init__(self, store: Store, transport_name: str):
        self.layout = store.layout
        self.pool = np.zeros(POOL_BLOCKS * self.layout.bytes_per_block, dtype=np.uint8)
        self.context: zmq.Context = zmq.Context()
        security = Security(self.context, store.config, "worker")
        fingerprint, _ = fingerprints(Path(store.config.model))
        self.transport: KvTransport = make_transport(
            transport_name, self.pool, PoolGeometry(self.layout, POOL_BLOCKS), fingerprint, security, "worker-0",
            TransferOptions(handshake_timeout_s=store.config.kvstore_timeout_s))
        self.client = StoreClient(store.config, security, "worker-0", self.layout, shared_memory=False,
                                  transport=self.transport)

    def fetch(self, keys: list[int], dst: list[int]) -> int:
        return self.client.fetch(NS_A, keys, self.pool, dst)

    def block(self, block: int) -> np.ndarray:
        return block_of(self.pool, self.layout, block, POOL_BLOCKS)

    def close(self) -> None:
        self.client.close()
        self.transport.close()
        self.context.destroy(0)


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(store: Store, transport_name: str) -> Engine:
        made.append(Engine(store, transport_name))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_lands_the_same_bytes_as_the_same_host_path(stores, engines, transport):
    store = stores(kv_transport=transport)
    writer = _client(stores, store)
    keys = chain(200, 7)
    values = values_for(keys, store.layout.bytes_per_block)
    assert writer.put(NS_A, keys, parents_of(NS_A, keys), values) == 7
    engine = engines(store, transport)
    dst = [20, 3, 4, 5, 11, 10, 0]  # runs and jumps
    assert engine.fetch(keys + [999], dst + [1]) == 7
    assert engine.client.pulls and not engine.client.same_host
    same_host = np.zeros_like(engine.pool)
    assert writer.fetch(NS_A, keys, same_host, dst) == 7
    for i, block in enumerate(dst):
        assert np.array_equal(engine.block(block), values[i]), f"block {i} differs"
        assert np.array_equal(engine.block(block), block_of(same_host, store.layout, block, POOL_BLOCKS))
    deadline = time.monotonic() + 30
    while writer.stats()["leases"]:  # the store released the lease (its release, or the transport's event)
        assert time.monotonic() < deadline, "the pull's lease was never released"
        time.sleep(0.05)
    assert engine.fetch(keys[2:4], [7, 8]) == 2  # the handshake is kept: a second pull
    assert np.array_equal(engine.block(8), values[3])


def test_a_pulled_block_rewritten_behind_the_stores_back_is_not_counted(stores, engines):
    store = stores(kv_transport="zmq")
    bb = store.layout.bytes_per_block
    keys = chain(40, 4)
    values = values_for(keys, bb)
    _client(stores, store).put(NS_A, keys, parents_of(NS_A, keys), values)
    context, socket = _raw(store)
    try:
        lease, _ = _ask(socket, StoreRequest("get", 1, NS_A, keys=keys))
        shm = np.memmap(lease.shm_path, dtype=np.uint8, mode="r+").reshape(-1, bb)
        shm[lease.slots[2], 500] ^= 0xFF  # a stray writer
        _ask(socket, StoreRequest("release", 2, lease_id=lease.lease_id))
    finally:
        context.destroy(0)
    engine = engines(store, "zmq")
    assert engine.fetch(keys, [0, 1, 2, 3]) == 2
    assert engine.client.checksum_failures == 1


def test_a_store_killed_mid_pull_fails_the_fetch_and_a_restarted_one_serves_again(stores, engines):
    store = stores(kv_transport="zmq", kv_send_pause_s=0.2, kvstore_dram_gb=0.01)  # a pull lasts seconds
    keys = chain(300, 8)
    values = values_for(keys, store.layout.bytes_per_block)
    watcher = _client(stores, store)
    watcher.put(NS_A, keys, parents_of(NS_A, keys), values)
    engine = engines(store, "zmq")

    def kill_once_leased() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if watcher.stats()["staging_exposures"]:
                    break
            except StoreUnavailable:
                break
            time.sleep(0.02)
        store.stop(signal.SIGKILL)

    killer = threading.Thread(target=kill_once_leased)
    killer.start()
    try:
        with pytest.raises(StoreUnavailable):
            engine.fetch(keys, list(range(8)))
    finally:
        killer.join(30)
    assert not killer.is_alive()

    store.start()  # the same ports: a new instance, its pool empty
    watcher = _client(stores, store)
    watcher.put(NS_A, keys[:3], parents_of(NS_A, keys[:3]), values[:3])
    engine.client.timeout_s = 30.0  # the restarted store still pauses 0.2 s per piece
    assert engine.fetch(keys[:3], [5, 6, 7]) == 3
    assert np.array_equal(engine.block(7), values[2])


def test_without_a_transport_a_remote_engine_keeps_the_inline_frames(stores):
    store = stores(kv_transport="zmq")
    keys = chain(500, 3)
    values = values_for(keys, store.layout.bytes_per_block)
    _client(stores, store).put(NS_A, keys, parents_of(NS_A, keys), values)
    client: StoreClient = _client(stores, store, shared_memory=False)
    pool = np.zeros(POOL_BLOCKS * store.layout.bytes_per_block, dtype=np.uint8)
    assert client.fetch(NS_A, keys, pool, [9, 10, 11]) == 3 and not client.pulls
    assert np.array_equal(block_of(pool, store.layout, 11, POOL_BLOCKS), values[2])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_get_larger_than_the_staging_pool_lands_over_several_calls_and_frees_it(stores, engines, transport):
    store = stores(kv_transport=transport)
    writer = _client(stores, store)
    staging = int(writer.stats()["staging_blocks"])
    keys = chain(700, staging + 5)
    assert len(keys) < POOL_BLOCKS
    values = values_for(keys, store.layout.bytes_per_block)
    assert writer.put(NS_A, keys, parents_of(NS_A, keys), values) == len(keys)
    engine = engines(store, transport)
    dst = list(range(POOL_BLOCKS - 1, POOL_BLOCKS - 1 - len(keys), -1))  # descending: no runs to coalesce
    assert engine.fetch(keys, dst) == len(keys)
    assert engine.client.pulls and engine.client.checksum_failures == 0
    for i, block in enumerate(dst):
        assert np.array_equal(engine.block(block), values[i]), f"block {i} differs"
    deadline = time.monotonic() + 30
    while (stats := writer.stats())["staging_free"] < staging or stats["staging_exposures"] or stats["leases"]:
        assert time.monotonic() < deadline, f"staging blocks were never freed: {stats}"
        time.sleep(0.05)
