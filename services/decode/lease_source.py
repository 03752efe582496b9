"""A prefill worker's lease as a KvSource (common/engine/kv_connector.py): the blocks a
decode worker still lacks are pulled over the KV transport from the prefill worker that
holds the prompt under a lease (docs/disaggregation.md)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.engine.kv_connector import KvLoad, Landed, Offer
from common.kv_transfer import KvTransport, PullHandle, PullResult
from common.protocol import KvHandle
from services.worker.kv_store_use import Ewma

# bytes/s of a pull before any is measured: as fast as the KV store's seeded DRAM tier, so
# an unmeasured decode worker pulls (the store's latency makes it the slower) until its
# pulls show the store faster
SEED_PULL_BANDWIDTH = 1e9


@dataclass
class Pull:
    handles: list[KvHandle]  # the parts in arrival order, then the whole prompt's
    failed: set[str] = field(default_factory=set)  # leases whose pull failed: not asked again
    pull: PullHandle | None = None  # the pull out, if any
    lease_id: str = ""  # ... its lease
    asked: int = 0  # ... and the blocks it brings
    reported: bool = False  # poll has given its part
    whole_pulled: bool = False  # a pull of the whole prompt's lease was started

    @property
    def whole(self) -> bool:
        """Whether the lease on the whole prompt came (no more parts will)."""
        return any(not handle.part for handle in self.handles)

    def covering(self, block: int) -> KvHandle | None:
        """The lease that holds the most blocks from prompt block `block` on."""
        best, best_end = None, block
        for handle in self.handles:
            end = handle.first_block + len(handle.block_ids)
            if handle.lease_id not in self.failed and handle.first_block <= block < end and end > best_end:
                best, best_end = handle, end
        return best


class LeaseSource:
    """Pulls of the loads whose handles `expect` named. A part's `detail` is its PullResult.
    The lease on the whole prompt holds every block of it; a request imported from its
    parts (KvHandle.part: its prompt was still being prefilled) has the leases of those
    parts first, and until the whole prompt's comes its offers are `coming`. A block costs
    its bytes over the measured bandwidth of this worker's pulls."""

    name = "lease"

    def __init__(self, transport: KvTransport, timeout_s: float, bytes_per_block: int):
        self.transport = transport
        self.timeout_s = timeout_s
        self.bytes_per_block = bytes_per_block
        self.bandwidth = Ewma(SEED_PULL_BANDWIDTH)  # bytes/s of the pulls that completed
        self.pulls: dict[str, Pull] = {}  # request id -> the leases it was handed off with, and its pull

    def expect(self, request_id: str, handle: KvHandle) -> None:
        """The lease a load of `request_id` pulls from, before its load begins; another
        for the same request (a later part, or the whole prompt's) adds to it."""
        entry = self.pulls.get(request_id)
        if entry is None:
            self.pulls[request_id] = Pull([handle])
        else:
            entry.handles.append(handle)

    def pulled(self, request_id: str) -> bool:
        """Whether a pull of the whole prompt's lease was started for this request (then
        that lease ends through the transport; otherwise the decode worker releases it)."""
        entry = self.pulls.get(request_id)
        return entry is not None and entry.whole_pulled

    def forget(self, request_id: str) -> None:
        self.pulls.pop(request_id, None)

    def _run(self, load: KvLoad, start: int) -> tuple[KvHandle | None, int, bool]:
        """The lease to pull the load's blocks from `start` on, how many it holds of them,
        and whether more will come."""
        entry = self.pulls.get(load.request_id)
        if entry is None or start >= len(load.dst_block_ids):
            return None, 0, False
        block = load.first_block + start
        handle = entry.covering(block)
        if handle is None:
            return None, 0, not entry.whole
        end = min(handle.first_block + len(handle.block_ids), load.first_block + len(load.dst_block_ids))
        return handle, end - block, not entry.whole

    def match(self, load: KvLoad, start: int) -> Offer:
        handle, count, coming = self._run(load, start)
        if handle is None:
            return Offer(0, math.inf, why="nothing", coming=coming)
        return Offer(count, self.bytes_per_block / self.bandwidth.value, sure=True, coming=coming)

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool:
        handle, count, _ = self._run(load, start)
        if handle is None:
            return False
        entry = self.pulls[load.request_id]
        first = load.first_block + start - handle.first_block
        entry.lease_id, entry.asked, entry.reported = handle.lease_id, count, False
        entry.whole_pulled |= not handle.part
        source = list(handle.block_ids[first:first + count])
        entry.pull = self.transport.pull(handle.kv_address, handle.lease_id, source,
                                         list(load.dst_block_ids[start:start + count]),
                                         time.monotonic() + self.timeout_s)
        return True

    def poll(self) -> list[Landed]:
        parts = []
        for request_id, entry in self.pulls.items():
            if entry.pull is None or entry.reported or not entry.pull.done():
                continue
            entry.reported = True
            result = entry.pull.wait(0)
            landed = entry.asked if result.status == "done" else 0
            if landed and result.nbytes > 0 and result.seconds > 0:
                self.bandwidth.update(result.nbytes / result.seconds)
            if not landed:
                entry.failed.add(entry.lease_id)
            parts.append(Landed(request_id, landed, self.name, error=result.reason, settled=result.settled,
                                detail=result))
        return parts

    def cancel(self, request_id: str) -> bool:
        entry = self.pulls.get(request_id)
        if entry is None or entry.pull is None:
            return True
        if entry.pull.done():
            return entry.pull.wait(0).settled
        return self.transport.cancel(entry.lease_id)


def pull_result(part: Landed) -> PullResult:
    """The PullResult behind a lease part (one made up for a part of another source)."""
    result = part.detail
    return result if isinstance(result, PullResult) else PullResult("", "failed", "unreachable", part.error)
