"""The router's side of the prefill/decode hand-off (docs/router.md §6, docs/disaggregation.md §2).

A request whose missing prefill on the decode worker services/router/pairing.py picks is
short, or that no other engine can prefill, goes straight to that worker (conditional
disaggregation). Any other is placed like a co-located request, on an engine that
prefills, and when that is a prefill worker its Generate is held here as a pending
hand-off. When the prefill worker says KvReady (the prompt's KV held under a lease), the
prefill placement ends and the request goes, with a `kv_handle` naming the lease, to the
decode worker pairing picks. If none takes it, the hand-off is parked and sent to the
first decode worker that can take it, for up to half the lease; past that, or on an
abort, the lease is released. Decode workers' lease renewals and releases pass through
here to the prefill worker. A decode worker whose pull failed in a way another could
avoid hands the request back (KvPullFailed): it goes, with the same lease, to another
decode worker with room, at most `kv_pull_replacements` times, else the worker falls back
on kv_load_failure_policy (KvPullVerdict). A router that restarted holds no pending
hand-offs: a prefill worker that rejoined it sends KvReady with the request and its
prompt, and the hand-off is adopted here, parked for two heartbeats first so that a decode
worker that got it from the old router can rejoin with it (then it is left there, and
given the lease as KvMore). A prompt longer than a prefill chunk comes in parts while it
is prefilled (KvPart, docs/disaggregation.md §2.1): the first part picks the decode worker
and sends it the request; the later parts and the KvReady follow it there as KvMore.

`HandoffDesk` keeps this state and no socket or clock of its own: the router
(services/router/service.py) checks who sent each message, gives the time, and lends the
desk its send function, its two pools, its members and its policy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from msgspec.structs import replace

from common.config import ClusterConfig
from common.logs import get_logger
from common.metrics import Counter
from common.protocol import (
    Abort,
    Generate,
    Hello,
    KvHandle,
    KvLeaseUpdate,
    KvMore,
    KvPart,
    KvPullFailed,
    KvPullVerdict,
    KvReady,
)
from common.sockets import check_endpoint
from services.router.cluster import ClusterState
from services.router.members import Members
from services.router.pairing import computes_locally, pick_decode_worker
from services.router.policies.base import PlacementPolicy

log = get_logger("router")
PARKED_LEASE_SHARE = 0.5  # how much of a prefill lease a hand-off may wait for a decode worker
ADOPTION_WAIT_BEATS = 2  # heartbeats an adopted hand-off waits for decode workers to rejoin first


class Send(Protocol):
    """Send a message (and its payloads) to the peer on a connection; False if it failed."""

    def __call__(self, identity: bytes, message: Any, payloads: list | None = None, /) -> bool: ...


@dataclass
class Handoff:
    """A disaggregated request whose prefill runs: what its decode worker will be sent."""

    request: Generate
    prompt: Any  # the prompt's token id array (payload 0)
    prefill_worker_id: str
    decode_worker_id: str | None = None  # placed at its first part (docs/disaggregation.md §2.1)


@dataclass
class ParkedHandoff:
    """A prefilled request that no decode worker could take when its KV was ready (the
    decode pool is restarting, say): tried again as decode workers join, until `deadline`,
    well within the prefill worker's lease."""

    request: Generate
    prompt: Any
    ready: KvReady
    prefill_identity: bytes
    deadline: float
    earliest: float = 0.0  # not sent before (an adopted hand-off)
    adopted: bool = False  # from a KvReady that carried its request (this router restarted)


class HandoffDesk:
    """The hand-offs in flight: pending (a prefill runs) and parked (prefilled, waiting for
    a decode worker), and the leases they hold on prefill workers.

    `cluster` is the pool of engines that prefill, `decode_pool` the decode workers';
    `live(request_id)` says whether the request still has a tokenizer to answer (not
    aborted or ended meanwhile), and `fail(request_id, why)` ends it there as unavailable.
    `parked_total` counts parked hand-offs by outcome, `failed_pulls_total` decode workers'
    failed pulls by verdict (moved, local)."""

    def __init__(self, config: ClusterConfig, cluster: ClusterState, decode_pool: ClusterState, members: Members,
                 policy: PlacementPolicy, send: Send, root_hash: Callable[[str], int],
                 live: Callable[[str], bool], fail: Callable[[str, str], None], parked_total: Counter,
                 failed_pulls_total: Counter, adopt: Callable[[Generate], None]):
        self.config = config
        self.cluster = cluster
        self.decode_pool = decode_pool
        self.members = members
        self.policy = policy
        self.send = send
        self.root_hash = root_hash
        self.live = live
        self.fail = fail
        self.parked_total = parked_total
        self.failed_pulls_total = failed_pulls_total
        self.adopt = adopt  # the router takes an adopted request as its own (its tokenizer, say)
        self.pending: dict[str, Handoff] = {}  # request id -> its pending hand-off
        self.parked: dict[str, ParkedHandoff] = {}  # request id -> a prefilled request waiting for a decode worker

    # ---- before the prefill --------------------------------------------------------

    def place_on_decode(self, request: Generate, payloads: list, now: float) -> str | None:
        """Conditional disaggregation: send the request straight to a decode worker when its
        missing prefill is short (or nothing else can prefill); that worker's id. None:
        place it as usual."""
        candidate = self.decode_pool.prepare(request.request_id, self.root_hash(request.tenant), payloads[0],
                                             request.sampling.max_tokens, now, request.slo_class)
        worker_id = pick_decode_worker(candidate, self.decode_pool, now)
        if worker_id is None:
            return None
        if self.cluster.worker_ids and not computes_locally(candidate, worker_id,
                                                            self.config.max_local_prefill_tokens):
            return None
        store_from, store_tiers = self.decode_pool.store_hint(candidate, worker_id)
        sent = replace(request, store_from=store_from, store_tiers=store_tiers)
        if not self.send(self.members[worker_id].identity, sent, payloads):
            return None
        self.decode_pool.place(candidate, worker_id, now)
        return worker_id

    def hold(self, request: Generate, prompt: Any, prefill_worker_id: str) -> None:
        """The request's prefill was placed on a prefill worker: keep what its decode worker
        will be sent."""
        self.pending[request.request_id] = Handoff(request, prompt, prefill_worker_id)

    def forget(self, request_id: str) -> None:
        """The request ended (or its worker was lost) before its KV was ready: a decode
        worker importing its parts is told to stop."""
        handoff = self.pending.pop(request_id, None)
        if handoff is not None and handoff.decode_worker_id is not None:
            self._stop_import(request_id, handoff.decode_worker_id)

    def _stop_import(self, request_id: str, worker_id: str) -> None:
        """End a decode worker's import of a request's parts (the request cannot go on
        there): its placement ends, and the worker is told (Abort)."""
        placement = self.decode_pool.placements.get(request_id)
        if placement is not None and placement.worker_id == worker_id:
            self.decode_pool.finish(request_id)
        member = self.members.get(worker_id)
        if member is not None:
            self.send(member.identity, Abort(request_id=request_id, reason="its prefill ended"))

    def import_ended(self, request_id: str, worker_id: str) -> bool:
        """The decode worker `worker_id` ended (or lost) a request it imported from its
        parts while the prefill still runs: its placement there ends, and the whole
        prompt's lease goes to whichever decode worker pairing picks then. False if the
        request is no such import."""
        handoff = self.pending.get(request_id)
        if handoff is None or handoff.decode_worker_id != worker_id:
            return False
        handoff.decode_worker_id = None
        placement = self.decode_pool.placements.get(request_id)
        if placement is not None and placement.worker_id == worker_id:
            self.decode_pool.finish(request_id)
        return True

    def importing_on(self, request_id: str) -> str | None:
        """The decode worker importing a request's parts while its prefill runs, if any."""
        handoff = self.pending.get(request_id)
        return handoff.decode_worker_id if handoff is not None else None

    # ---- a prompt still being prefilled: its parts (docs/disaggregation.md §2.1) ----------

    def kv_part(self, identity: bytes, hello: Hello, part: KvPart, now: float) -> None:
        """The prefill worker `hello` holds a part of a prompt it is still prefilling: the
        request goes, with the part's handle, to the decode worker pairing picks now, or
        the part to the decode worker that has the request already. A part nobody takes
        is released (the whole prompt's lease brings its blocks later)."""
        handoff = self.pending.get(part.request_id)
        if handoff is None or handoff.prefill_worker_id != hello.worker_id:
            self._release(identity, part.request_id, part.lease_id)
            return
        handle = KvHandle(prefill_worker_id=hello.worker_id, kv_address=hello.kv_address,
                          prefill_instance_id=hello.instance_id, lease_id=part.lease_id, block_ids=part.block_ids,
                          block_hashes=part.block_hashes, num_tokens=part.num_tokens, first_token_id=-1, part=True,
                          first_block=part.first_block)
        if handoff.decode_worker_id is None:
            handoff.decode_worker_id = self._send_to_decode(replace(handoff.request, kv_handle=handle),
                                                            handoff.prompt, now)
            if handoff.decode_worker_id is None:
                self._release(identity, part.request_id, part.lease_id)
        elif not self._send_more(handoff.decode_worker_id, part.request_id, handle):
            self._release(identity, part.request_id, part.lease_id)

    def _send_more(self, worker_id: str, request_id: str, handle: KvHandle) -> bool:
        """Send more of a request's KV to the decode worker it is placed on; False if it is
        not (any more) or the send failed."""
        placement = self.decode_pool.placements.get(request_id)
        member = self.members.get(worker_id)
        if placement is None or placement.worker_id != worker_id or member is None:
            return False
        return self.send(member.identity, KvMore(request_id=request_id, kv_handle=handle))

    # ---- the prefill worker holds the KV -------------------------------------------

    def kv_ready(self, identity: bytes, hello: Hello, ready: KvReady, now: float, prompt: Any = None) -> None:
        """The prefill worker `hello` (on connection `identity`) holds a request's KV: finish
        its prefill placement and send the request, with the handle, to the decode worker
        pairing picks (or park it until one can take it). `prompt`: payload 0, sent with
        a KvReady that carries its request."""
        prefill_worker_id = hello.worker_id
        handoff = self.pending.get(ready.request_id)
        if handoff is None and ready.request is not None:
            self._adopt(identity, hello, ready, prompt, now)
            return
        if handoff is None or handoff.prefill_worker_id != prefill_worker_id:
            self._drop(identity, prefill_worker_id, ready)
            return
        del self.pending[ready.request_id]
        placement = self.cluster.finish(ready.request_id, now=now)
        if placement is not None:
            self.policy.finished(placement, ready.queue_s + ready.prefill_s, now)
        handle = self._handle(hello, ready)
        if handoff.decode_worker_id is not None:  # a decode worker is importing its parts
            if self._send_more(handoff.decode_worker_id, ready.request_id, handle):
                return
            self._stop_import(ready.request_id, handoff.decode_worker_id)
        request = replace(handoff.request, kv_handle=handle)
        if not self._send_to_decode(request, handoff.prompt, now):
            # Wait for a decode worker within the lease, leaving the other half of it for
            # the pull (docs/disaggregation.md §2).
            deadline = now + self.config.kv_lease_ttl_s * PARKED_LEASE_SHARE
            self.parked[ready.request_id] = ParkedHandoff(request, handoff.prompt, ready, identity, deadline)
            log.warning("handoff_parked", request_id=ready.request_id, wait_s=round(deadline - now, 1))

    @staticmethod
    def _handle(hello: Hello, ready: KvReady) -> KvHandle:
        return KvHandle(prefill_worker_id=hello.worker_id, kv_address=hello.kv_address,
                        prefill_instance_id=hello.instance_id, lease_id=ready.lease_id,
                        block_ids=ready.block_ids, block_hashes=ready.block_hashes, num_tokens=ready.num_tokens,
                        first_token_id=ready.first_token_id, queue_s=ready.queue_s, prefill_s=ready.prefill_s,
                        first_logprob=ready.first_logprob)

    def _adopt(self, identity: bytes, hello: Hello, ready: KvReady, prompt: Any, now: float) -> None:
        """A KvReady that carries its request, for a hand-off this router does not hold (it
        restarted during the prefill, or since the KvReady it lost): park it, to be sent
        once decode workers had two heartbeats to rejoin. A decode worker that rejoins
        holding the request (the old router had handed it off) keeps it: the hand-off is
        then dropped and the lease left to that worker's pull."""
        request = ready.request
        assert request is not None  # kv_ready checked
        request_id = ready.request_id
        why = ""
        if request.request_id != request_id or request.kv_handle is not None:
            why = "its request is another one, or handed off already"
        elif prompt is None or len(prompt) != ready.num_tokens:
            why = f"its prompt is not the {ready.num_tokens} tokens it names"
        else:
            try:
                check_endpoint(request.stream_address)
            except ValueError as error:
                why = str(error)
        if why:
            log.warning("kv_ready_refused", request_id=request_id, worker_id=hello.worker_id, why=why)
            self._release_lease(identity, ready)
            return
        placed = self.decode_pool.placements.get(request_id)
        if placed is not None or request_id in self.parked:
            log.info("kv_ready_again", request_id=request_id, worker_id=hello.worker_id)
            if placed is not None:  # it may be importing the prompt's parts: it needs this lease
                self._send_more(placed.worker_id, request_id, self._handle(hello, ready))
            return
        placement = self.cluster.finish(request_id, now=now)  # resumed when the prefill worker rejoined
        if placement is not None:
            self.policy.finished(placement, ready.queue_s + ready.prefill_s, now)
        self.adopt(request)
        deadline = now + self.config.kv_lease_ttl_s * PARKED_LEASE_SHARE
        earliest = now + ADOPTION_WAIT_BEATS * self.config.heartbeat_interval_s
        self.parked[request_id] = ParkedHandoff(replace(request, kv_handle=self._handle(hello, ready)), prompt,
                                                ready, identity, deadline, earliest, adopted=True)
        log.warning("handoff_adopted", request_id=request_id, worker_id=hello.worker_id)

    def _send_to_decode(self, request: Generate, prompt: Any, now: float, exclude: frozenset[str] = frozenset(),
                        roomy_only: bool = False) -> str | None:
        """Send a prefilled request to the decode worker pairing picks (not one of
        `exclude`; with `roomy_only`, only one with room for its blocks), the next one if
        that send fails; the worker's id, None if none took it."""
        candidate = self.decode_pool.prepare(request.request_id, self.root_hash(request.tenant), prompt,
                                             request.sampling.max_tokens, now, request.slo_class)
        tried = exclude
        while (worker_id := pick_decode_worker(candidate, self.decode_pool, now, tried)) is not None:
            if roomy_only and self.decode_pool.free_blocks[worker_id] < candidate.blocks_needed(worker_id):
                return None  # pairing prefers workers with room: none is left
            store_from, store_tiers = self.decode_pool.store_hint(candidate, worker_id)
            sent = replace(request, store_from=store_from, store_tiers=store_tiers)
            if self.send(self.members[worker_id].identity, sent, [prompt]):
                self.decode_pool.place(candidate, worker_id, now)
                return worker_id
            tried |= {worker_id}
        return None

    def retry_parked(self, now: float) -> None:
        """Send parked hand-offs to a decode worker that can take them now; end those
        whose wait is over."""
        for request_id, parked in list(self.parked.items()):
            if parked.adopted and request_id in self.decode_pool.placements:  # a rejoined decode worker has it
                del self.parked[request_id]
                log.info("handoff_adoption_dropped", request_id=request_id, why="a decode worker holds it")
                assert parked.request.kv_handle is not None  # adopted with its handle
                # It may be importing the prompt's parts: it needs the whole prompt's lease.
                self._send_more(self.decode_pool.placements[request_id].worker_id, request_id,
                                parked.request.kv_handle)
            elif not self.live(request_id):  # aborted or failed meanwhile
                del self.parked[request_id]
                self._release_lease(parked.prefill_identity, parked.ready)
            elif now < parked.earliest:
                continue
            elif self.decode_pool.worker_ids and self._send_to_decode(parked.request, parked.prompt, now):
                del self.parked[request_id]
                self.parked_total.inc(outcome="placed")
            elif now >= parked.deadline:
                del self.parked[request_id]
                self.parked_total.inc(outcome="expired")
                self._end(parked.prefill_identity, parked.ready,
                          "no decode worker could take the prefilled request within its lease")

    def abort(self, request_id: str) -> bool:
        """An abort of a parked hand-off releases its lease; False if it is not parked."""
        parked = self.parked.pop(request_id, None)
        if parked is None:
            return False
        self._release_lease(parked.prefill_identity, parked.ready)
        return True

    def _drop(self, identity: bytes, prefill_worker_id: str, ready: KvReady) -> None:
        """KvReady for a hand-off this router does not hold (it restarted since the
        placement, say): the request cannot go on without its Generate, so it ends."""
        log.warning("kv_ready_unknown", request_id=ready.request_id, worker_id=prefill_worker_id)
        if self.placed_elsewhere(ready.request_id, prefill_worker_id):
            self._release_lease(identity, ready)
            return
        self.cluster.finish(ready.request_id)
        self._end(identity, ready, "the router lost the request's hand-off (it restarted during the prefill)")

    def _end(self, identity: bytes, ready: KvReady, why: str) -> None:
        """Release the lease and fail the request to its tokenizer."""
        self._release_lease(identity, ready)
        self.fail(ready.request_id, why)

    def _release_lease(self, prefill_identity: bytes, ready: KvReady) -> None:
        self._release(prefill_identity, ready.request_id, ready.lease_id)

    def _release(self, prefill_identity: bytes, request_id: str, lease_id: str) -> None:
        prefill_worker_id = self.members.by_connection.get(prefill_identity, "")
        self.send(prefill_identity, KvLeaseUpdate(request_id=request_id, lease_id=lease_id,
                                                  prefill_worker_id=prefill_worker_id, action="release"))

    # ---- the decode worker holds the request ---------------------------------------

    def lease_update(self, sender: Hello, update: KvLeaseUpdate) -> str:
        """A decode worker (`sender`) renews or releases a lease of a request placed on it:
        pass it to the prefill worker. Returns why the sender may not ("" if it may)."""
        placement = self.decode_pool.placements.get(update.request_id)
        if sender.role != "decode" or (placement is not None and placement.worker_id != sender.worker_id):
            return f"request {update.request_id} is not placed on it"
        member = self.members.get(update.prefill_worker_id)
        if member is None or member.hello.role != "prefill":
            log.warning("lease_update_dropped", request_id=update.request_id, prefill=update.prefill_worker_id,
                        why="no such prefill worker")
            return ""
        self.send(member.identity, update)
        return ""

    def pull_failed(self, sender: Hello, failed: KvPullFailed, prompt: Any, now: float,
                    wall_time: float) -> KvPullVerdict | str:
        """A decode worker (`sender`) could not pull the KV of a request placed on it: send
        the request, with the same lease, to another decode worker with room, and return
        the sender's verdict: `moved`, or `local` (fall back on kv_load_failure_policy)
        when it was re-placed `kv_pull_replacements` times already, the report came past
        its `reply_by` (`wall_time` is time.time()), the prefill worker holding the lease
        is gone (not a member, or another process: the lease went with it) or no other
        decode worker has room. A str: why the sender may not ask (nothing is sent)."""
        request, handle = failed.request, failed.request.kv_handle
        placement = self.decode_pool.placements.get(request.request_id)
        if handle is None or placement is None or placement.worker_id != sender.worker_id:
            return f"request {request.request_id} is not handed off to it"
        prefill = self.members.get(handle.prefill_worker_id)
        if len(handle.failed_on) >= self.config.kv_pull_replacements:
            return self._verdict(handle, request, "local", f"re-placed {len(handle.failed_on)} time(s) already")
        if wall_time >= failed.reply_by:
            return self._verdict(handle, request, "local", "reported too late to be re-placed")
        if prefill is None or prefill.hello.role != "prefill" or \
                prefill.hello.instance_id != handle.prefill_instance_id:
            return self._verdict(handle, request, "local", f"the prefill worker {handle.prefill_worker_id} "
                                 "that held its KV is gone")
        # The address is the prefill worker's own, whatever the report says.
        failed_on = [*handle.failed_on, sender.worker_id]
        moved = replace(request, kv_handle=replace(handle, kv_address=prefill.hello.kv_address, failed_on=failed_on))
        # The failed placement ends before the next is matched: the blocks credited to the
        # sender never landed, and the match must not keep index nodes that settling drops.
        self.decode_pool.finish(request.request_id, now=now)
        worker_id = self._send_to_decode(moved, prompt, now, frozenset(failed_on), roomy_only=True)
        if worker_id is None:
            candidate = self.decode_pool.prepare(request.request_id, self.root_hash(request.tenant), prompt,
                                                 request.sampling.max_tokens, now, request.slo_class)
            self.decode_pool.place(candidate, sender.worker_id, now)
            return self._verdict(handle, request, "local", "no other decode worker has room")
        log.info("kv_pull_replaced", request_id=request.request_id, failed_on=sender.worker_id, worker_id=worker_id,
                 code=failed.code)
        return self._verdict(handle, request, "moved", worker_id=worker_id)

    def _verdict(self, handle: KvHandle, request: Generate, action: str, reason: str = "",
                 worker_id: str = "") -> KvPullVerdict:
        self.failed_pulls_total.inc(outcome=action)
        return KvPullVerdict(request_id=request.request_id, lease_id=handle.lease_id, action=action,
                             worker_id=worker_id, reason=reason)

    def placed_elsewhere(self, request_id: str, worker_id: str) -> bool:
        """Whether the request is placed on another worker than `worker_id` (it moved on
        from its prefill worker, say)."""
        placement = self.cluster.placements.get(request_id) or self.decode_pool.placements.get(request_id)
        return placement is not None and placement.worker_id != worker_id
