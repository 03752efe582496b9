"""KvLeases: the prefill side's bookkeeping of held blocks (pure CPU)."""
from __future__ import annotations

import pytest

from common.engine.leases import KvLeases, LeaseError


def test_grant_renew_release_and_the_gauge():
    leases = KvLeases(ttl_s=30.0)
    first = leases.grant("r1", [4, 5, 6], [11, 12], num_tokens=40, first_token_id=9, now=0.0)
    second = leases.grant("r2", [7], [], num_tokens=3, first_token_id=1, now=0.0)
    assert first.lease_id != second.lease_id and len(first.lease_id) == 32
    assert leases.num_blocks == 4 and sorted(leases.block_tables()) == [(4, 5, 6), (7,)]
    assert leases.renew(first.lease_id, "r1", now=20.0) == 50.0
    assert [lease.request_id for lease in leases.expire(now=31.0)] == ["r2"]  # r1 was renewed
    assert leases.release(first.lease_id, "r1") == (4, 5, 6)
    assert len(leases) == 0 and leases.num_blocks == 0


def test_a_forged_stale_or_foreign_handle_frees_nothing():
    leases = KvLeases(ttl_s=1.0)
    lease = leases.grant("r1", [1, 2], [3], num_tokens=20, first_token_id=5, now=0.0)
    for lease_id, request_id in [("0" * 32, "r1"), (lease.lease_id, "r2"), (lease.lease_id[:-1] + "x", "r1")]:
        with pytest.raises(LeaseError, match="no live KV lease"):
            leases.release(lease_id, request_id)
    assert leases.num_blocks == 2
    leases.release(lease.lease_id, "r1")
    with pytest.raises(LeaseError):  # released twice: stale
        leases.release(lease.lease_id, "r1")
    with pytest.raises(LeaseError):
        leases.renew(lease.lease_id, "r1", now=0.5)


def test_expiry_is_at_the_ttl():
    leases = KvLeases(ttl_s=30.0)
    leases.grant("r1", [1], [], num_tokens=1, first_token_id=0, now=100.0)
    assert leases.expire(now=129.9) == [] and len(leases) == 1
    assert len(leases.expire(now=130.0)) == 1 and len(leases) == 0
    with pytest.raises(ValueError):
        KvLeases(ttl_s=0)
