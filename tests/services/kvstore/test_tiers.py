"""The store's tiers behind the index: the shared-memory DRAM pool and the SSD adapter with
its rebuild. Real files, in-process."""
from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from services.kvstore.dram import TierError
from services.kvstore.index import IndexConfig, KVIndex
from services.kvstore.ssd import FILE_HEADER_BYTES, HEADER_BYTES, SsdTier
from services.kvstore.tiers import (
    DamagedBlock,
    ShmDramTier,
    SsdIndexTier,
    crc32c,
    namespace_bytes,
    rebuild,
    ssd_config,
    sweep_stale_pools,
)

BB = 4096
NS = namespace_bytes(0xABCD)


def value(key: int) -> bytes:
    return key.to_bytes(8, "little") * (BB // 8)


def open_store(shm: Path, ssd_dir: Path, dram: int = 4,
               on_damaged=None) -> tuple[KVIndex, ShmDramTier, SsdIndexTier]:
    ssd = SsdIndexTier(SsdTier(ssd_config(ssd_dir, 0.0002, BB)), BB, on_damaged)
    pool = ShmDramTier(dram, BB, uuid.uuid4().hex, shm)
    return KVIndex(IndexConfig(demote_min_hits=0), [pool, ssd], crc32c), pool, ssd


def put_chain(index: KVIndex, keys: list[int]) -> None:
    parent = None
    for key in keys:
        ticket = index.start_put(NS, key, parent, BB, 0.0)
        index.view(ticket.slot)[:] = value(key)
        index.commit(ticket, crc32c(value(key)))
        parent = key


def close(pool: ShmDramTier, ssd: SsdIndexTier) -> None:
    ssd.ssd.close()
    pool.close()


def test_the_pool_is_a_private_file_gone_on_close(tmp_path):
    pool = ShmDramTier(3, BB, "x1", tmp_path)
    assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o600 and os.stat(pool.path).st_size == 3 * BB
    slot = pool.alloc()
    assert slot is not None
    pool.write(slot, value(7))
    assert bytes(pool.read(slot, 16)) == value(7)[:16]
    with pytest.raises(FileExistsError):
        ShmDramTier(3, BB, "x1", tmp_path)  # never two stores on one file
    pool.close()
    assert not pool.path.exists()


def test_a_pool_larger_than_the_room_in_its_directory_is_refused_naming_the_setting(tmp_path):
    stat_ = os.statvfs(tmp_path)
    room = stat_.f_bavail * stat_.f_frsize
    with pytest.raises(ValueError, match="kvstore_dram_gb"):
        ShmDramTier(room // BB + 1, BB, "too-big", tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_a_dead_stores_pool_is_swept_and_a_live_ones_is_not(tmp_path):
    live = ShmDramTier(1, BB, "live", tmp_path)
    (tmp_path / "baton-kvstore-dead").write_bytes(b"\0" * BB)  # nobody holds its lock
    assert sweep_stale_pools(tmp_path) == 1
    assert live.path.exists() and not (tmp_path / "baton-kvstore-dead").exists()
    live.close()


def test_the_index_is_rebuilt_from_the_ssd_with_its_parent_links(tmp_path):
    index, pool, ssd = open_store(tmp_path, tmp_path / "ssd")
    put_chain(index, list(range(1, 11)))
    index.empty_tier(0)
    assert index.lookup(NS, range(1, 11)).tiers == ("ssd",) * 10
    close(pool, ssd)
    index, pool, ssd = open_store(tmp_path, tmp_path / "ssd")
    found = rebuild(index, 1, ssd)
    assert (found.blocks, found.orphans, found.damaged) == (10, 0, 0)
    index.check_integrity()
    lease = index.get(NS, range(1, 11), 0.0)
    tiers: dict[str, ShmDramTier | SsdIndexTier] = {"dram": pool, "ssd": ssd}
    assert [bytes(tiers[b.tier].read(b.slot, b.nbytes)) for b in lease.blocks] == [value(k) for k in range(1, 11)]
    close(pool, ssd)


def test_a_broken_chain_is_dropped_below_the_break_and_counted(tmp_path):
    index, pool, ssd = open_store(tmp_path, tmp_path / "ssd")
    put_chain(index, list(range(1, 11)))
    index.empty_tier(0)
    slots = {key: slot for (_, key), slot in ssd.ssd.entries().items()}
    config = ssd.ssd.config
    close(pool, ssd)
    with open(tmp_path / "ssd" / "slots-000.bkv", "r+b") as file:  # damage block 4's value
        file.seek(FILE_HEADER_BYTES + slots[4] * config.slot_bytes + HEADER_BYTES + 100)
        file.write(b"\xff\xfe")
    index, pool, ssd = open_store(tmp_path, tmp_path / "ssd")
    found = rebuild(index, 1, ssd)
    assert (found.blocks, found.orphans, found.damaged) == (3, 6, 1)
    assert index.lookup(NS, range(1, 11)).length == 3
    index.check_integrity()
    assert len(ssd.ssd.entries()) == 3  # the orphans' records are freed, not left to confuse the next start
    close(pool, ssd)


def test_a_record_damaged_while_open_fails_the_get_without_leaking_a_lease(tmp_path):
    found: list[str] = []
    index, pool, ssd = open_store(tmp_path, tmp_path / "ssd", on_damaged=lambda: found.append("damaged"))
    put_chain(index, [1, 2])
    index.empty_tier(0)
    real = ssd.ssd.entries()[(NS, 1)]
    with open(tmp_path / "ssd" / "slots-000.bkv", "r+b") as file:
        file.seek(FILE_HEADER_BYTES + real * ssd.ssd.config.slot_bytes + HEADER_BYTES + 50)
        file.write(b"\x00\xff\x00")
    with capture_logs() as logs, pytest.raises(DamagedBlock):
        index.get(NS, [1, 2], 0.0)
    assert index.stats()["leases"] == 0
    index.check_integrity()
    assert ssd.damaged_reads == 1 and found == ["damaged"]
    assert logs == [{"event": "kvstore_ssd_record_damaged", "log_level": "warning", "namespace": "0xabcd",
                     "key": "0x1", "ssd_slot": real, "reason": "CRC32C mismatch", "action": "dropped"}]
    assert ssd.ssd.entries() == {(NS, 2): ssd.ssd.entries()[(NS, 2)]}  # its record is freed, the other kept
    close(pool, ssd)


def test_the_ssd_adapter_needs_a_blocks_identity_before_its_bytes(tmp_path):
    ssd = SsdIndexTier(SsdTier(ssd_config(tmp_path, 0.0001, BB)), BB)
    slot = ssd.alloc()
    assert slot is not None
    with pytest.raises(TierError, match="label first"):
        ssd.write(slot, value(1))
    ssd.label(slot, NS, 1, None)
    ssd.write(slot, value(1))
    assert bytes(ssd.read(slot, BB)) == value(1)
    ssd.free(slot)
    assert ssd.ssd.entries() == {}
    ssd.ssd.close()
