"""KvLeases: the prefill side's bookkeeping of held blocks (pure CPU)."""
from __future__ import annotations

import pytest

from common.engine.leases import KvLeases, LeaseError


def test_held_release_and_the_gauge():
    leases = KvLeases()
    first = leases.held("r1", [4, 5, 6], [11, 12], num_tokens=40, last_token_id=9)
    second = leases.held("r2", [7], [], num_tokens=3, last_token_id=1)
    assert first.lease_id != second.lease_id and len(first.lease_id) == 32
    assert leases.num_blocks == 4 and sorted(leases.block_tables()) == [(4, 5, 6), (7,)]
    assert leases.get(second.lease_id, "r2") == second
    assert leases.release(first.lease_id, "r1") == (4, 5, 6)
    assert leases.release(second.lease_id, "r2") == (7,)
    assert len(leases) == 0 and leases.num_blocks == 0


def test_a_forged_stale_or_foreign_handle_frees_nothing():
    leases = KvLeases()
    lease = leases.held("r1", [1, 2], [3], num_tokens=20, last_token_id=5)
    for lease_id, request_id in [("0" * 32, "r1"), (lease.lease_id, "r2"), (lease.lease_id[:-1] + "x", "r1")]:
        with pytest.raises(LeaseError, match="no live KV lease"):
            leases.release(lease_id, request_id)
    assert leases.num_blocks == 2
    leases.release(lease.lease_id, "r1")
    with pytest.raises(LeaseError):  # released twice: stale
        leases.release(lease.lease_id, "r1")
    with pytest.raises(LeaseError):
        leases.get(lease.lease_id, "r1")
