"""A prefill worker's lease as a KvSource (common/engine/kv_connector.py): the blocks a
decode worker still lacks are pulled over the KV transport from the prefill worker that
holds the prompt under a lease (docs/disaggregation.md)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from common.engine.kv_connector import KvLoad, Landed, Offer, no_offer
from common.kv_transfer import KvTransport, PullHandle, PullResult
from common.protocol import KvHandle
from services.worker.kv_store_use import Ewma

# bytes/s of a pull before any is measured: as fast as the KV store's seeded DRAM tier, so
# an unmeasured decode worker pulls (the store's latency makes it the slower) until its
# pulls show the store faster
SEED_PULL_BANDWIDTH = 1e9


@dataclass
class Pull:
    handle: KvHandle
    pull: PullHandle | None = None
    asked: int = 0  # blocks the pull brings
    reported: bool = False  # poll has given its part


class LeaseSource:
    """Pulls of the loads whose handles `expect` named. A part's `detail` is its PullResult.
    The lease holds every block of its prompt; a block costs its bytes over the measured
    bandwidth of this worker's pulls."""

    name = "lease"

    def __init__(self, transport: KvTransport, timeout_s: float, bytes_per_block: int):
        self.transport = transport
        self.timeout_s = timeout_s
        self.bytes_per_block = bytes_per_block
        self.bandwidth = Ewma(SEED_PULL_BANDWIDTH)  # bytes/s of the pulls that completed
        self.pulls: dict[str, Pull] = {}  # request id -> the handle it was handed off with, and its pull

    def expect(self, request_id: str, handle: KvHandle) -> None:
        """The lease a load of `request_id` pulls from, before its load begins."""
        self.pulls[request_id] = Pull(handle)

    def pulled(self, request_id: str) -> bool:
        """Whether a pull was started for this request (then the lease ends through the
        transport; otherwise the decode worker releases it)."""
        entry = self.pulls.get(request_id)
        return entry is not None and entry.pull is not None

    def forget(self, request_id: str) -> None:
        self.pulls.pop(request_id, None)

    def match(self, load: KvLoad, start: int) -> Offer:
        if load.request_id not in self.pulls or start >= len(load.dst_block_ids):
            return no_offer("nothing")
        return Offer(len(load.dst_block_ids) - start, self.bytes_per_block / self.bandwidth.value, sure=True)

    def start(self, load: KvLoad, start: int, rival_block_s: float) -> bool:
        entry = self.pulls.get(load.request_id)
        if entry is None or start >= len(load.dst_block_ids):
            return False
        handle = entry.handle
        source = list(handle.block_ids[load.first_block + start:])
        entry.asked = len(load.dst_block_ids) - start
        entry.pull = self.transport.pull(handle.kv_address, handle.lease_id, source,
                                         list(load.dst_block_ids[start:]), time.monotonic() + self.timeout_s)
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
            parts.append(Landed(request_id, landed, self.name, error=result.reason, settled=result.settled,
                                detail=result))
        return parts

    def cancel(self, request_id: str) -> bool:
        entry = self.pulls.get(request_id)
        if entry is None or entry.pull is None:
            return True
        if entry.pull.done():
            return entry.pull.wait(0).settled
        return self.transport.cancel(entry.handle.lease_id)


def pull_result(part: Landed) -> PullResult:
    """The PullResult behind a lease part (one made up for a part of another source)."""
    result = part.detail
    return result if isinstance(result, PullResult) else PullResult("", "failed", "unreachable", part.error)
