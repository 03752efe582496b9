"""The KV store's block bookkeeping and DRAM tier: pure CPU, virtual time."""
from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.kvstore.dram import DramTier
from services.kvstore.index import (
    BlockBusy,
    ChecksumMismatch,
    IndexConfig,
    KVIndex,
    KVStoreError,
    MissingParent,
    ParentNotCommitted,
    PutInProgress,
    QuotaExceeded,
    StoreFull,
    UnknownLease,
    UnknownTicket,
)

BLOCK = 64
NS = b"model-a/bf16/tenant-1"


def make(dram: int = 10, ssd: int | None = None, **config) -> KVIndex:
    tiers = [DramTier(dram, BLOCK)]
    if ssd is not None:
        tiers.append(DramTier(ssd, BLOCK, name="ssd"))  # a second in-memory tier stands in for the SSD
    return KVIndex(IndexConfig(**config), tiers)


def payload(key: int) -> bytes:
    return key.to_bytes(8, "little") * (BLOCK // 8)


def put(index: KVIndex, key: int, parent: int | None = None, ns=NS, now: float = 0.0) -> None:
    ticket = index.start_put(ns, key, parent, BLOCK, now)
    if ticket.already_stored:
        return
    index.view(ticket.slot)[:] = payload(key)
    index.commit(ticket, zlib.crc32(payload(key)))


def put_chain(index: KVIndex, keys: list[int], ns=NS, parent: int | None = None) -> None:
    for key in keys:
        put(index, key, parent, ns)
        parent = key


def read(index: KVIndex, lease, i: int) -> bytes:
    location = lease.blocks[i]
    tier = next(t for t in index.tiers if t.name == location.tier)
    return bytes(tier.read(location.slot, location.nbytes))


# ---- two-phase put ----------------------------------------------------------------


def test_an_uncommitted_block_is_invisible_until_commit():
    index = make()
    ticket = index.start_put(NS, 1, None, BLOCK, now=0)
    index.view(ticket.slot)[:] = payload(1)
    assert index.lookup(NS, [1]).length == 0
    lease = index.get(NS, [1], now=0)
    assert lease.blocks == ()
    index.release(lease)
    index.commit(ticket, zlib.crc32(payload(1)))
    assert index.lookup(NS, [1]).tiers == ("dram",)
    lease = index.get(NS, [1], now=0)
    assert read(index, lease, 0) == payload(1)
    index.release(lease)
    assert [e.kind for e in index.drain_events()] == ["stored"]
    index.check_integrity()


def test_a_bad_checksum_is_refused_and_the_slot_freed():
    index = make()
    ticket = index.start_put(NS, 1, None, BLOCK, now=0)
    index.view(ticket.slot)[:] = payload(1)
    with pytest.raises(ChecksumMismatch):
        index.commit(ticket, zlib.crc32(payload(2)))
    assert index.tiers[0].used == 0 and index.lookup(NS, [1]).length == 0
    with pytest.raises(UnknownTicket):
        index.commit(ticket, zlib.crc32(payload(1)))
    index.check_integrity()
    put(index, 1)  # the key is free to be put again
    assert index.lookup(NS, [1]).length == 1


def test_put_is_idempotent_and_a_second_writer_is_told_a_put_is_in_progress():
    index = make()
    put(index, 1)
    again = index.start_put(NS, 1, None, BLOCK, now=0)
    assert again.already_stored and again.slot == -1
    index.commit(again, 0)  # a no-op
    assert index.tiers[0].used == 1
    index.start_put(NS, 2, 1, BLOCK, now=0)
    with pytest.raises(PutInProgress):
        index.start_put(NS, 2, 1, BLOCK, now=0)
    index.check_integrity()


def test_parents_must_be_stored_and_committed_first():
    index = make()
    with pytest.raises(MissingParent):
        index.start_put(NS, 2, 1, BLOCK, now=0)
    first = index.start_put(NS, 1, None, BLOCK, now=0)
    second = index.start_put(NS, 2, 1, BLOCK, now=0)  # writes may overlap ...
    index.view(second.slot)[:] = payload(2)
    with pytest.raises(ParentNotCommitted):  # ... commits go in chain order
        index.commit(second, zlib.crc32(payload(2)))
    index.view(first.slot)[:] = payload(1)
    index.commit(first, zlib.crc32(payload(1)))
    index.commit(second, zlib.crc32(payload(2)))
    assert index.lookup(NS, [1, 2]).length == 2
    index.check_integrity()


def test_a_put_never_committed_is_reclaimed_after_the_timeout_with_the_puts_under_it():
    index = make(put_timeout_s=5)
    first = index.start_put(NS, 1, None, BLOCK, now=0)
    index.start_put(NS, 2, 1, BLOCK, now=3)
    assert index.reclaim(now=4.9) == 0
    assert index.reclaim(now=5) == 1  # block 1 and the pending block 2 under it
    assert index.tiers[0].used == 0
    with pytest.raises(UnknownTicket):
        index.commit(first, 0)
    index.check_integrity()


# ---- lookup and namespaces --------------------------------------------------------


def test_lookup_finds_the_longest_committed_prefix():
    index = make()
    put_chain(index, [1, 2, 3])
    assert index.lookup(NS, [1, 2, 3, 4]).length == 3
    assert index.lookup(NS, [1, 2, 9, 3]).length == 2
    assert index.lookup(NS, [9, 1]).length == 0
    assert index.lookup(NS, []).length == 0


def test_namespaces_are_isolated():
    index = make()
    other = b"model-a/bf16/tenant-2"
    put_chain(index, [1, 2])
    assert index.lookup(other, [1, 2]).length == 0
    with pytest.raises(MissingParent):  # a chain cannot hang off another namespace's block
        index.start_put(other, 2, 1, BLOCK, now=0)
    put(index, 1, ns=other)
    assert index.tiers[0].used == 3  # the same key in two namespaces is two blocks
    index.remove(NS, 1)
    assert index.lookup(other, [1]).length == 1 and index.lookup(NS, [1]).length == 0
    index.check_integrity()


# ---- eviction ---------------------------------------------------------------------


def test_eviction_is_leaf_first_then_lru():
    index = make(dram=10, high_watermark=0.9, low_watermark=0.7)
    put_chain(index, [1, 2, 3])  # oldest chain
    put_chain(index, [11, 12, 13])
    put_chain(index, [21, 22, 23])
    index.drain_events()
    put(index, 31)  # 10 blocks > 9: evict down to 7
    evicted = [e.key for e in index.drain_events() if e.kind == "evicted"]
    assert evicted == [3, 2, 1]  # the LRU chain, leaf first, never a parent before its child
    index.check_integrity()


def test_a_hit_refreshes_a_chain_against_eviction():
    index = make(dram=10, high_watermark=0.9, low_watermark=0.7)
    put_chain(index, [1, 2, 3])
    put_chain(index, [11, 12, 13])
    put_chain(index, [21, 22, 23])
    index.release(index.get(NS, [1, 2, 3], now=0))
    index.drain_events()
    put(index, 31)
    assert [e.key for e in index.drain_events() if e.kind == "evicted"] == [13, 12, 11]


def test_leased_and_pinned_blocks_are_not_evicted():
    index = make(dram=4, high_watermark=0.75, low_watermark=0.5)
    put(index, 1)
    put(index, 2)
    lease = index.get(NS, [1], now=0)
    index.pin(NS, 2)
    put(index, 3)
    put(index, 4)  # 4 > 3: evict to 2, only 3 may go
    assert index.lookup(NS, [1]).length == index.lookup(NS, [2]).length == 1
    assert index.lookup(NS, [3]).length == 0
    with pytest.raises(BlockBusy):
        index.remove(NS, 2)
    put(index, 5)
    with pytest.raises(StoreFull):  # 1 leased, 2 pinned, and pending puts are never evicted either:
        for key in range(100, 110):  # once they fill the rest, a put finds no slot to take
            index.start_put(NS, key, None, BLOCK, now=0)
    index.check_integrity()
    index.release(lease)
    with pytest.raises(UnknownLease):
        index.release(lease)
    index.unpin(NS, 2)
    index.reclaim(now=1e9)
    index.check_integrity()


def test_an_expired_lease_no_longer_protects():
    index = make(dram=2, high_watermark=1.0, low_watermark=0.5, lease_timeout_s=10)
    put(index, 1)
    index.get(NS, [1], now=0)  # never released
    put(index, 2)
    with pytest.raises(StoreFull):
        index.start_put(NS, 3, 2, BLOCK, now=0)  # 2 is the new block's parent, 1 is leased
    assert index.reclaim(now=10) == 1
    put(index, 3, parent=2)
    assert index.lookup(NS, [1]).length == 0
    index.check_integrity()


def test_demotion_to_the_second_tier_and_promotion_on_get():
    index = make(dram=4, ssd=4, high_watermark=0.75, low_watermark=0.5, demote_min_hits=1)
    put_chain(index, [1, 2])
    index.release(index.get(NS, [1, 2], now=0))  # hit once: worth keeping
    put(index, 3)  # never hit: dropped
    index.drain_events()
    put(index, 4)  # 4 > 3: evict to 2
    events = [e for e in index.drain_events() if e.kind != "stored"]
    assert [(e.kind, e.key, e.tier, e.from_tier) for e in events] == [
        ("moved", 2, "ssd", "dram"), ("moved", 1, "ssd", "dram")]  # 2 first (the leaf), LRU before 3
    assert index.lookup(NS, [1, 2]).tiers == ("ssd", "ssd")
    lease = index.get(NS, [1, 2], now=0)
    assert [b.tier for b in lease.blocks] == ["dram", "dram"]
    assert read(index, lease, 0) == payload(1) and read(index, lease, 1) == payload(2)
    index.release(lease)
    assert index.stats()["promoted"] == 2
    index.check_integrity()


def test_a_parent_with_a_child_below_is_demoted_never_dropped():
    index = make(dram=2, ssd=4, high_watermark=1.0, low_watermark=0.5, demote_min_hits=1)
    put_chain(index, [1, 2])
    index.release(index.get(NS, [2], now=0))  # only the child is worth keeping
    put(index, 3)  # DRAM full: the leaf 2 goes down
    put(index, 4)  # DRAM full again: 1 is LRU, never hit, but its child is stored below
    assert index.lookup(NS, [1, 2]).tiers == ("ssd", "ssd")
    index.check_integrity()


def test_without_room_below_a_block_worth_keeping_is_dropped():
    index = make(dram=2, ssd=1, high_watermark=1.0, low_watermark=0.5)
    for key in (1, 2, 3):
        put(index, key)
        index.release(index.get(NS, [key], now=0))
    put(index, 4)
    kinds = [(e.kind, e.key) for e in index.drain_events() if e.kind != "stored"]
    assert ("moved", 1) in kinds and ("evicted", 2) in kinds
    index.check_integrity()


def test_remove_takes_the_blocks_stored_under_it_and_says_so():
    index = make(max_events=3)
    put_chain(index, [1, 2, 3])
    put(index, 12, parent=1)
    assert len(index.drain_events()) == 3  # bounded: the oldest "stored" fell off
    assert index.remove(NS, 2) == 2
    assert {(e.kind, e.key) for e in index.drain_events()} == {("removed", 2), ("removed", 3)}
    assert index.lookup(NS, [1, 12]).length == 2 and index.tiers[0].used == 2
    index.check_integrity()


def test_the_dram_view_is_the_pool_itself():
    tier = DramTier(2, BLOCK)
    slot = tier.alloc()
    tier.view(slot)[:4] = [1, 2, 3, 4]
    assert bytes(tier.pool[slot, :4]) == bytes([1, 2, 3, 4]) == bytes(tier.read(slot, 4))
    tier.free(slot)
    tier.check_integrity(set())


# ---- quotas -----------------------------------------------------------------------


def test_a_quota_evicts_the_namespaces_own_leaves_but_never_the_new_blocks_parent():
    other = b"tenant-2"
    index = make(dram=10, quota_blocks=3)
    put(index, 100, ns=other)
    put_chain(index, [1, 2])
    put(index, 5)
    put(index, 6, parent=5)  # over quota: 2 is the LRU leaf (5 would be, but it is the parent)
    assert index.lookup(NS, [1, 2]).length == 1 and index.lookup(NS, [5, 6]).length == 2
    put(index, 7, parent=6)  # 1 became a leaf when 2 went: it goes now
    assert index.lookup(NS, [1]).length == 0
    with pytest.raises(QuotaExceeded):  # the only leaf is 7, the parent of the new block
        put(index, 8, parent=7)
    index.check_integrity()
    assert index.stats()["quota_evictions"] == 2 and index.stats()["quota_refusals"] == 1
    assert index.lookup(other, [100]).length == 1


def test_a_quota_with_the_refuse_policy_refuses():
    index = make(dram=10, quotas={NS: 2}, quota_policy="refuse")
    put_chain(index, [1, 2])
    with pytest.raises(QuotaExceeded):
        index.start_put(NS, 3, 2, BLOCK, now=0)
    put(index, 1, ns=b"unlimited")
    index.check_integrity()


# ---- randomized operation sequences -------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["put"] * 4 + ["start"] * 2 + ["commit", "bad_commit", "abort"]
                                         + ["get"] * 4 + ["release", "pin", "unpin", "remove", "tick"]),
                         st.integers(0, 1), st.integers(0, 11), st.integers(0, 12)),
               min_size=10, max_size=150)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.sampled_from([4, 8]), st.sampled_from([None, 3, 5]), st.sampled_from(["evict", "refuse"]),
       st.integers(0, 1))
def test_bookkeeping_stays_consistent_under_random_operations(ops, dram, quota, quota_policy, demote_min_hits):
    index = make(dram=dram, ssd=4, high_watermark=0.8, low_watermark=0.5, put_timeout_s=3, lease_timeout_s=4,
                 quota_blocks=quota, quota_policy=quota_policy, demote_min_hits=demote_min_hits)
    namespaces = [b"ns-0", b"ns-1"]
    tickets, leases, pins = [], [], []
    now = 0.0
    for op, ns_i, key, other in ops:
        ns = namespaces[ns_i]
        # two chain families per namespace, base -> base+1 -> ...; a prompt is a prefix of one
        base = 100 * (other % 2)
        parent = base + key - 1 if key else None
        try:
            if op == "put":
                put_chain(index, list(range(base, base + key + 1)), ns)
            elif op == "start":
                ticket = index.start_put(ns, base + key, parent, BLOCK, now)
                if not ticket.already_stored:
                    index.view(ticket.slot)[:] = payload(base + key)
                    tickets.append(ticket)
            elif op in ("commit", "bad_commit", "abort") and tickets:
                ticket = tickets.pop(other % len(tickets))
                if op == "abort":
                    index.abort(ticket)
                else:
                    index.commit(ticket, zlib.crc32(payload(ticket.key + (op == "bad_commit"))))
            elif op == "get":
                lease = index.get(ns, range(base, base + key), now)
                for i, block in enumerate(lease.blocks):
                    assert read(index, lease, i) == payload(block.key)  # moves carry the bytes
                leases.append(lease)
            elif op == "release" and leases:
                index.release(leases.pop(other % len(leases)))
            elif op == "pin":
                index.pin(ns, base + key)
                pins.append((ns, base + key))
            elif op == "unpin" and pins:
                index.unpin(*pins.pop(other % len(pins)))
            elif op == "remove":
                index.remove(ns, base + key)
            elif op == "tick":
                now += other / 4
                index.reclaim(now)
        except KVStoreError:
            pass
        index.check_integrity()
