"""The `kvstore` role: the cluster's tiered KV block store (docs/kvstore.md).

One thread runs the loop: answer the engines' StoreRequests on one ROUTER socket, then on
each turn reclaim stale puts and expired leases and publish what changed as StoreEvents.
Block bookkeeping is services/kvstore/index.py; the bytes live in a DRAM pool in POSIX
shared memory (same-host engines copy in and out of it themselves; remote engines pull
leased slots over the store's KV transport, or get them as frames) and, with
kvstore_ssd_dir, in the SSD tier, from which a restarted store rebuilds its index.
Every request is validated; a refusal is a StoreReply with ok false naming what is wrong,
and nothing an engine sends stops the loop.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import zmq

from common.config import ClusterConfig
from common.engine.kv_layout import KVLayout
from common.kv_transfer import KvTransport, PoolGeometry, TransferOptions, make_transport
from common.logs import get_logger
from common.metrics import Registry
from common.metrics_server import MetricsServer
from common.protocol import (
    MAX_STORE_KEYS,
    STORE_OPS,
    ErrorCode,
    ProtocolError,
    StoreEvents,
    StoreReply,
    StoreRequest,
    decode,
)
from common.sockets import ENGINE_ROLES, MAX_MESSAGE_BYTES, Security, send, split_routed
from services.kvstore.dram import TierError
from services.kvstore.index import (
    BlockBusy,
    IndexConfig,
    KVIndex,
    KVStoreError,
    PutTicket,
    QuotaExceeded,
    ReadLease,
    StoreFull,
)
from services.kvstore.ssd import SsdTier, SsdTierError
from services.kvstore.tiers import (
    SHM_DIR,
    DamagedBlock,
    Recovered,
    ShmDramTier,
    SsdIndexTier,
    crc32c,
    namespace_bytes,
    rebuild,
    ssd_config,
)

log = get_logger("kvstore")
STORE_ID = "kvstore"
MAX_MESSAGES_PER_TURN = 256
TURN_S = 0.05  # the longest the loop waits for a request before its periodic work
MAX_KEY = 2**64 - 1
MAX_INLINE_BYTES = MAX_MESSAGE_BYTES // 2  # raw bytes in one reply; the client asks in chunks under it
STAGING_BYTES = 256 << 20  # the KV transport's staging pool at most (docs/kvstore.md §6)


class Refused(Exception):
    """A request the store answers with ok false: `code` (ErrorCode) and the reason."""

    def __init__(self, code: ErrorCode, reason: str):
        super().__init__(reason)
        self.code = code


@dataclass
class Staged:
    """The staging blocks a get with transfer exposes under its lease's transfer id."""

    blocks: np.ndarray
    released: bool = False  # the engine's release came (its exposure was withdrawn then)


@dataclass(frozen=True)
class StoreOptions:
    """What the store derives from the cluster config (docs/kvstore.md §1)."""

    dram_slots: int
    block_bytes: int
    ssd_dir: Path | None
    ssd_gb: float
    index: IndexConfig
    staging_blocks: int  # the plane-major pool the KV transport serves gets from

    @classmethod
    def from_config(cls, config: ClusterConfig, layout: KVLayout) -> StoreOptions:
        block_bytes = layout.bytes_per_block
        slots = int(config.kvstore_dram_gb * 1e9) // block_bytes
        if slots < 1:
            raise ValueError(f"kvstore_dram_gb: {config.kvstore_dram_gb} GB holds no {block_bytes}-byte block")
        timeout_s = max(1.0, 5 * config.kvstore_timeout_s)  # well past one client call's deadline
        index = IndexConfig(high_watermark=config.kvstore_high_watermark,
                            low_watermark=config.kvstore_low_watermark, put_timeout_s=timeout_s,
                            lease_timeout_s=timeout_s, quota_blocks=config.kvstore_quota_blocks or None,
                            demote_min_hits=0)  # engines write back what they may reuse: keep it on SSD
        staging = max(1, min(slots // 2, STAGING_BYTES // block_bytes))  # memory on top of the DRAM tier
        return cls(slots, block_bytes, Path(config.kvstore_ssd_dir) if config.kvstore_ssd_dir else None,
                   config.kvstore_ssd_gb, index, staging)


class StoreMetrics:
    """The store's counters, made before its tiers (the SSD tier counts the damage it meets);
    `watch` adds the gauges read from the running service at scrape time."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.requests = registry.counter("baton_kvstore_requests_total", "Store requests, by op and outcome",
                                         labels=("op", "outcome"))
        self.damaged_records = registry.counter(
            "baton_kvstore_damaged_records_total",
            "SSD records that failed their checks and were dropped, by when: restart (the warm-up's scan) "
            "or read (while serving)", labels=("found",))
        for found in ("restart", "read"):
            self.damaged_records.inc(0, found=found)  # both series from the first scrape

    def watch(self, service: StoreService) -> None:
        registry, index = self.registry, service.index
        registry.gauge("baton_kvstore_blocks", "Committed blocks held",
                       collect=lambda: float(service.stats()["blocks"]))
        for number, tier in enumerate(index.tiers):
            registry.gauge(f"baton_kvstore_{tier.name}_used_slots", f"Slots in use in tier {number} ({tier.name})",
                           collect=_reader(tier, "used"))
            registry.gauge(f"baton_kvstore_{tier.name}_capacity_slots", f"Slots in tier {number} ({tier.name})",
                           collect=_reader(tier, "capacity"))
        registry.gauge("baton_kvstore_warmup_seconds", "Seconds the restart's rebuild from the SSD took",
                       collect=lambda: service.recovered.seconds)
        registry.gauge("baton_kvstore_warmup_blocks", "Blocks the restart's rebuild recovered",
                       collect=lambda: service.recovered.blocks)


def _reader(tier: object, name: str) -> Callable[[], float]:
    return lambda: float(getattr(tier, name))


class StoreService:
    """The store's state and its request handlers; `run` serves them until `stop` is set."""

    def __init__(self, config: ClusterConfig, layout: KVLayout, model_fingerprint: str, shm_dir: Path = SHM_DIR):
        self.config = config
        self.layout = layout
        self.options = StoreOptions.from_config(config, layout)
        self.instance_id = uuid.uuid4().hex[:16]
        self.block_bytes = self.options.block_bytes
        self.registry = Registry()
        self.metrics = StoreMetrics(self.registry)
        self.dram = ShmDramTier(self.options.dram_slots, self.block_bytes, self.instance_id, shm_dir)
        self.ssd: SsdIndexTier | None = None
        self.recovered = Recovered(0, 0, 0, 0, 0.0)
        try:
            tiers: list = [self.dram]
            if self.options.ssd_dir is not None:
                self.ssd = SsdIndexTier(SsdTier(ssd_config(self.options.ssd_dir, self.options.ssd_gb,
                                                           self.block_bytes)), self.block_bytes,
                                        on_damaged=partial(self.metrics.damaged_records.inc, found="read"))
                tiers.append(self.ssd)
            self.index = KVIndex(self.options.index, tiers, crc32c)
            if self.ssd is not None:
                self.recovered = rebuild(self.index, 1, self.ssd)
                self.metrics.damaged_records.inc(self.recovered.damaged, found="restart")
        except BaseException:
            self._close_tiers()
            raise
        self.tier_numbers = {tier.name: number for number, tier in enumerate(self.index.tiers)}
        self.tickets: dict[int, PutTicket] = {}
        self.damaged: set[tuple[bytes, int]] = set()  # blocks whose SSD record failed a read
        self.leases: dict[int, ReadLease] = {}
        self.pulled: dict[int, float] = {}  # exposures that ended before the engine's release came, until it does
        self.staging = np.zeros(self.options.staging_blocks * self.block_bytes, dtype=np.uint8)
        self.staging_used = np.zeros(self.options.staging_blocks, dtype=bool)
        self.staged: dict[int, Staged] = {}  # by lease id, until the transport reports its exposure ended
        self.quarantined: list[tuple[float, np.ndarray]] = []  # (free at, blocks) of unsettled exposures
        self.metrics.watch(self)
        self.context: zmq.Context = zmq.Context()
        self.security: Security = Security(self.context, config, "kvstore")
        self.control = self.security.server(zmq.ROUTER, config.kvstore_control, accept=ENGINE_ROLES)
        self.publisher = self.security.server(zmq.PUB, config.kvstore_events_address, accept=("router",))
        self.metrics_server = MetricsServer(config.host, config.kvstore_metrics_port, self.registry,
                                            health=self.health)
        try:
            self.transport, self.kv_address = self._start_transport(model_fingerprint)
        except BaseException:
            self.control.close(0)
            self.publisher.close(0)
            self.security.stop()
            self.context.term()
            self._close_tiers()
            raise
        self.handlers: dict[str, Callable[[StoreRequest, list[np.ndarray], float], tuple[StoreReply, list]]] = {
            "lookup": self._lookup, "get": self._get, "release": self._release, "put_start": self._put_start,
            "put_commit": self._put_commit, "put_abort": self._put_abort, "put": self._put,
            "remove": self._remove, "pin": self._pin, "unpin": self._pin, "stats": self._stats,
        }

    # ---- the loop

    def run(self, stop: threading.Event) -> None:
        self.metrics_server.start()
        log.info("kvstore_ready", instance_id=self.instance_id, control=self.config.kvstore_control,
                 kv_address=self.kv_address, kv_transport=self.transport.name,
                 shm_path=str(self.dram.path), dram_slots=self.dram.capacity, block_bytes=self.block_bytes,
                 ssd_slots=self.ssd.capacity if self.ssd else 0, warmup_s=round(self.recovered.seconds, 4),
                 recovered_blocks=self.recovered.blocks, dropped_orphans=self.recovered.orphans,
                 dropped_damaged=self.recovered.damaged, stale_pools_removed=self.dram.swept)
        print(f"baton kvstore ready on {self.config.kvstore_control}", flush=True)  # the supervisor waits for it
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        try:
            while not stop.is_set():
                if poller.poll(int(TURN_S * 1000)):
                    for _ in range(MAX_MESSAGES_PER_TURN):
                        try:
                            frames = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._serve(frames)
                self.tend(time.monotonic())
        finally:
            self.close()

    def tend(self, now: float) -> None:
        """Periodic work: undo stale puts and expired leases, then publish what changed."""
        self.index.reclaim(now)
        self.tickets = {t: ticket for t, ticket in self.tickets.items() if ticket.deadline > now}
        self.leases = {i: lease for i, lease in self.leases.items() if lease.expires_at > now}
        self.pulled = {i: expires_at for i, expires_at in self.pulled.items() if expires_at > now}
        self._end_transfers(now)
        for ns, key in list(self.damaged):
            try:
                self.index.remove(ns, key)
            except BlockBusy:
                continue  # leased or pinned: next turn
            except KVStoreError:
                pass  # gone already
            self.damaged.discard((ns, key))
        self._publish()

    def close(self) -> None:
        if self.ssd is not None:  # what fits goes to the SSD tier, so the next start finds it
            try:
                self.index.empty_tier(0)
            except (OSError, SsdTierError, TierError) as error:
                log.warning("kvstore_flush_failed", error=str(error))
        self.metrics_server.stop()
        self.transport.close()  # before the pool it reads goes
        self.control.close(0)
        self.publisher.close(0)
        self.security.stop()
        self.context.term()
        self._close_tiers()
        log.info("kvstore_stopped", instance_id=self.instance_id)

    def health(self) -> dict:
        return {"ok": True, "instance_id": self.instance_id, "blocks": self.index.stats()["blocks"],
                "warmup_s": self.recovered.seconds, "recovered_blocks": self.recovered.blocks}

    def _close_tiers(self) -> None:
        if self.ssd is not None:
            self.ssd.ssd.close()
        self.dram.close()

    def _serve(self, frames: list[zmq.Frame]) -> None:
        """Answer one routed message; nothing it holds can stop the loop."""
        try:
            identity, body = split_routed(frames)
        except ProtocolError:
            return
        request_id, op = 0, "invalid"
        try:
            try:
                message, payloads = decode([frame.buffer for frame in body])
            except ProtocolError as error:
                raise Refused(ErrorCode.INVALID_REQUEST, str(error)) from None
            if not isinstance(message, StoreRequest):
                raise Refused(ErrorCode.INVALID_REQUEST,
                              f"the store answers StoreRequest only, got {type(message).__name__}")
            request_id, op = message.request_id, message.op
            _validate(message, payloads)
            reply, out = self.handlers[op](message, payloads, time.monotonic())
            outcome = "ok" if reply.ok else reply.code
        except Refused as refusal:
            reply, out, outcome = self._refusal(request_id, refusal.code, str(refusal)), [], refusal.code.value
        except Exception as error:  # a bug must not take the store down: say so, log it, go on
            log.exception("kvstore_request_failed", op=op)
            reply, out, outcome = self._refusal(request_id, ErrorCode.INTERNAL, f"{type(error).__name__}: {error}"), \
                [], "internal"
        self.metrics.requests.inc(op=op if op in STORE_OPS else "invalid", outcome=str(outcome))
        try:
            send(self.control, reply, out, identity=identity, flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:  # the engine is gone or not reading: its leases expire
            log.warning("kvstore_reply_dropped", op=op, error=str(error))

    def _reply(self, request: StoreRequest, **fields: object) -> StoreReply:
        return StoreReply(request.request_id, True, self.instance_id, shm_path=str(self.dram.path),
                          block_bytes=self.block_bytes, **fields)  # type: ignore[arg-type]

    def _partial(self, request: StoreRequest, committed: int, error: str) -> StoreReply:
        """A commit that failed part way: the puts before it stand (count), the rest are undone."""
        return StoreReply(request.request_id, False, self.instance_id, code=ErrorCode.INVALID_REQUEST.value,
                          reason=f"{committed} committed, then {error}", shm_path=str(self.dram.path),
                          block_bytes=self.block_bytes, count=committed)

    def _refusal(self, request_id: int, code: ErrorCode, reason: str) -> StoreReply:
        return StoreReply(request_id, False, self.instance_id, code=code.value, reason=reason,
                          shm_path=str(self.dram.path), block_bytes=self.block_bytes)

    # ---- handlers: each returns the reply and its raw frames

    def _lookup(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        match = self.index.lookup(namespace_bytes(request.namespace), request.keys)
        return self._reply(request, tiers=[self.tier_numbers[t] for t in match.tiers]), []

    def _get(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        """The leased blocks: tier-0 ones by slot (shared memory), or with `transfer` copied into
        staging blocks the KV transport exposes (those that fit; as frames if none is free), the
        rest as frames while they fit in one message. `count` is the stored prefix: an engine
        answered fewer blocks asks again for the rest."""
        ns = namespace_bytes(request.namespace)
        try:
            lease = self.index.get(ns, request.keys, now)
        except DamagedBlock:  # a promotion met a damaged SSD record: drop it, serve what is left
            self._drop_damaged(ns, request.keys)
            lease = self.index.get(ns, request.keys, now)
        in_place = 0 if request.inline else len(lease.blocks)
        staging = None
        if request.transfer and not request.inline:
            self._end_transfers(now)  # the engine's last pull may just have freed its blocks
            staging = self._take_staging(sum(1 for block in lease.blocks if block.tier == self.dram.name))
            in_place = len(staging)
        tiers, slots, frames, checksums = [], [], [], []
        budget = MAX_INLINE_BYTES
        for block in lease.blocks:
            tier = self.tier_numbers[block.tier]
            if tier == 0 and in_place:
                in_place -= 1
                slots.append(block.slot)
            elif tier == 0 and staging is not None and len(staging):
                break  # the staging pool is full: the engine asks again for the rest
            else:
                if budget < block.nbytes:
                    break
                try:
                    # a copy: the lease may end before ZeroMQ sends the frame
                    data = np.frombuffer(bytes(self.index.tiers[tier].read(block.slot, block.nbytes)), np.uint8)
                except DamagedBlock:
                    self.damaged.add((ns, block.key))  # removed once no lease holds it
                    break
                budget -= block.nbytes
                slots.append(-1)
                frames.append(data)
            tiers.append(tier)
            checksums.append(block.checksum)
        served = dict(tiers=tiers, checksums=checksums, count=len(lease.blocks))
        if staging is not None:
            used = sum(1 for slot in slots if slot >= 0)  # fewer than taken if a frame ended the reply early
            self.staging_used[staging[used:]] = False
            staging = staging[:used]
        if staging is not None and len(staging):
            return self._expose_staged(request, lease, slots, staging, served), frames
        if all(slot < 0 for slot in slots):  # nothing left for the engine to read in place
            self.index.release(lease)
            return self._reply(request, slots=slots, **served), frames
        self.leases[lease.lease_id] = lease
        return self._reply(request, slots=slots, lease_id=lease.lease_id, **served), frames

    def _release(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        lease = self.leases.pop(request.lease_id, None)
        if lease is not None:
            self.index.release(lease)
            return self._reply(request), []
        staged = self.staged.get(request.lease_id)
        if staged is not None:  # a pull given up on, or its end not reported yet: no send may start now
            if not staged.released:
                staged.released = True
                self.transport.withdraw(self.transfer_id(request.lease_id))  # its blocks go with its event
            return self._reply(request), []
        if self.pulled.pop(request.lease_id, None) is not None:
            return self._reply(request), []  # its exposure ended first
        raise Refused(ErrorCode.INVALID_REQUEST, f"lease {request.lease_id} was released or expired")

    def _put_start(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        tickets, slots, reason = self._start(request, now)
        return self._reply(request, tickets=[t.ticket_id for t in tickets], slots=slots, reason=reason), []

    def _start(self, request: StoreRequest, now: float) -> tuple[list[PutTicket], list[int], str]:
        """Tickets for the leading keys the store takes (already stored ones included) and,
        if it stopped short, why."""
        ns = namespace_bytes(request.namespace)
        tickets: list[PutTicket] = []
        for key, parent in zip(request.keys, request.parents):
            try:
                ticket = self.index.start_put(ns, key, None if parent == request.namespace else parent,
                                              self.block_bytes, now)
            except (StoreFull, QuotaExceeded, KVStoreError) as error:
                if not tickets:
                    code = ErrorCode.OVERLOADED if isinstance(error, StoreFull | QuotaExceeded) else \
                        ErrorCode.INVALID_REQUEST
                    raise Refused(code, f"key {key:#x}: {error}") from None
                return tickets, [t.slot for t in tickets], f"key {key:#x}: {error}"
            if not ticket.already_stored:
                self.tickets[ticket.ticket_id] = ticket
            tickets.append(ticket)
        return tickets, [t.slot for t in tickets], ""

    def _put_commit(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        committed, error = self._commit([self._ticket(t) for t in request.tickets], request.checksums)
        if error:
            return self._partial(request, committed, error), []
        return self._reply(request, count=committed), []

    def _commit(self, tickets: list[PutTicket | None], checksums: list[int]) -> tuple[int, str]:
        """Commit in order (parents first); past the first failure, abort the rest."""
        committed, error = 0, ""
        for ticket, checksum in zip(tickets, checksums):
            if ticket is None:
                continue  # already stored
            if error:
                self._abort(ticket)
                continue
            try:
                self.index.commit(ticket, checksum)
                committed += 1
            except KVStoreError as failure:
                error = f"key {ticket.key:#x}: {failure}"
                self._abort(ticket)
            self.tickets.pop(ticket.ticket_id, None)
        return committed, error

    def _put_abort(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        for ticket_id in reversed(request.tickets):
            ticket = self._ticket(ticket_id)
            if ticket is not None:
                self._abort(ticket)
        return self._reply(request), []

    def _put(self, request: StoreRequest, payloads: list[np.ndarray], now: float) -> tuple[StoreReply, list]:
        """A remote engine's put: values in the frames, written and committed here."""
        for i, value in enumerate(payloads):
            if value.size != self.block_bytes:
                raise Refused(ErrorCode.INVALID_REQUEST,
                              f"value {i} is {value.size} bytes, a block is {self.block_bytes}")
        tickets, _, reason = self._start(request, now)
        pending: list[PutTicket | None] = []
        for ticket, value in zip(tickets, payloads):
            if ticket.already_stored:
                pending.append(None)
                continue
            self.index.view(ticket.slot)[:] = value.data
            pending.append(ticket)
        committed, error = self._commit(pending, request.checksums)
        if error:
            return self._partial(request, committed, error), []
        return self._reply(request, count=committed, tickets=[t.ticket_id for t in tickets], reason=reason), []

    def _remove(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        ns = namespace_bytes(request.namespace)
        removed = 0
        for key in request.keys:
            try:
                removed += self.index.remove(ns, key)
            except KVStoreError as error:
                raise Refused(ErrorCode.INVALID_REQUEST, f"{removed} removed, then key {key:#x}: {error}") from None
        return self._reply(request, count=removed), []

    def _pin(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        ns = namespace_bytes(request.namespace)
        action = self.index.pin if request.op == "pin" else self.index.unpin
        for done, key in enumerate(request.keys):
            try:
                action(ns, key)
            except KVStoreError as error:
                raise Refused(ErrorCode.INVALID_REQUEST, f"{done} done, then key {key:#x}: {error}") from None
        return self._reply(request, count=len(request.keys)), []

    def _stats(self, request: StoreRequest, _: list, now: float) -> tuple[StoreReply, list]:
        return self._reply(request, stats=self.stats()), []

    def stats(self) -> dict[str, float]:
        """The index's counters, each tier's use, and the restart's warm-up, flattened."""
        stats: dict[str, float] = {}
        for name, value in self.index.stats().items():
            if isinstance(value, dict):
                for tier, use in value.items():
                    for field, number in use.items():
                        stats[f"{tier}_{field}"] = float(number)
            elif isinstance(value, int | float):
                stats[name] = float(value)
        stats.update(staging_blocks=float(self.staging_used.size),
                     staging_free=float(self.staging_used.size - np.count_nonzero(self.staging_used)),
                     staging_exposures=float(len(self.staged)),
                     warmup_seconds=self.recovered.seconds, warmup_blocks=float(self.recovered.blocks),
                     warmup_dropped_orphans=float(self.recovered.orphans),
                     warmup_dropped_damaged=float(self.recovered.damaged),
                     warmup_dropped_stale=float(self.recovered.stale),
                     ssd_damaged_reads=float(self.ssd.damaged_reads if self.ssd else 0))
        return stats

    # ---- internals

    def _ticket(self, ticket_id: int) -> PutTicket | None:
        """The pending put of `ticket_id`; None for 0 (already stored); Refused if unknown."""
        if ticket_id == 0:
            return None
        ticket = self.tickets.get(ticket_id)
        if ticket is None:
            raise Refused(ErrorCode.INVALID_REQUEST, f"ticket {ticket_id} was committed, aborted or reclaimed")
        return ticket

    def _abort(self, ticket: PutTicket) -> None:
        self.tickets.pop(ticket.ticket_id, None)
        try:
            self.index.abort(ticket)
        except KVStoreError:
            pass  # a parent's abort took it already

    def _drop_damaged(self, ns: bytes, keys: list[int]) -> None:
        """Remove the blocks among `keys` whose SSD record no longer reads back."""
        for key, tier in zip(keys, self.index.lookup(ns, keys).tiers):
            if tier != "ssd" or self.ssd is None:
                continue
            try:
                self.index.release(self.index.get(ns, [key], time.monotonic()))  # reads it back, or raises
                continue
            except DamagedBlock:
                pass
            except (KVStoreError, TierError, SsdTierError):
                continue
            try:
                self.index.remove(ns, key)
            except KVStoreError:
                pass  # leased or pinned: it goes when those end

    def _publish(self) -> None:
        events = self.index.drain_events()
        if not events:
            return
        message = StoreEvents(STORE_ID)
        for event in events:
            tier = self.tier_numbers[event.tier]
            if event.kind == "stored":
                message.stored.append(event.key)
                message.stored_tiers.append(tier)
            elif event.kind == "moved":
                message.moved.append(event.key)
                message.moved_tiers.append(tier)
            else:
                message.evicted.append(event.key)
        try:
            send(self.publisher, message, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kvstore_events_dropped", events=len(events))

    def shared_pool(self) -> np.ndarray:
        """The DRAM pool, (slots, block_bytes), which same-host engines map."""
        return self.dram.pool

    # ---- the KV transport (docs/kvstore.md §6)

    def _start_transport(self, model_fingerprint: str) -> tuple[KvTransport, str]:
        """A KvTransport over the staging pool (plane-major, like the engines' pools, so a run
        of blocks moves as one piece per plane) serving the engine roles at kvstore_kv_address;
        (it, the address engines dial)."""
        geometry = PoolGeometry(self.layout, self.options.staging_blocks)
        options = TransferOptions(puller_roles=ENGINE_ROLES, send_pause_s=self.config.kv_send_pause_s,
                                  host=self.config.host)
        transport = make_transport(self.config.kv_transport, self.staging, geometry, model_fingerprint,
                                   self.security, f"{STORE_ID}-{self.instance_id}", options)
        try:
            return transport, self.config.advertised(transport.listen(self.config.kvstore_kv_address))
        except BaseException:
            transport.close()
            raise

    def transfer_id(self, lease_id: int) -> str:
        """The transfer id a get's lease is exposed under: unique across store restarts."""
        return f"{self.instance_id}:{lease_id}"

    def _take_staging(self, wanted: int) -> np.ndarray:
        """Up to `wanted` free staging block ids, marked used: one consecutive run where one
        fits (the transport then moves it as one piece per plane), else the first free ones."""
        free = np.flatnonzero(~self.staging_used)
        count = min(wanted, free.size)
        if count == 0:
            return free[:0]
        starts = np.flatnonzero(np.diff(free, prepend=-2) != 1)
        lengths = np.diff(np.append(starts, free.size))
        fits = np.flatnonzero(lengths >= count)
        first = starts[fits[0]] if fits.size else 0
        taken = free[first:first + count]
        self.staging_used[taken] = True
        return taken

    def _expose_staged(self, request: StoreRequest, lease: ReadLease, slots: list[int], staging: np.ndarray,
                       served: dict) -> StoreReply:
        """Copy the in-place DRAM slots into the staging blocks in one transposing copy, end
        the lease (the bytes are ours now), expose the staging blocks; the reply names them."""
        rows = [i for i, slot in enumerate(slots) if slot >= 0]
        count, planes = len(rows), 2 * self.layout.num_layers
        try:
            source = _rows(self.dram.pool, [slots[i] for i in rows]).reshape(count, planes, -1)
            staging3 = self.staging.reshape(planes, self.options.staging_blocks, -1)
            staging3[:, _rows_index(staging), :] = source.transpose(1, 0, 2)
        finally:
            self.index.release(lease)
        try:
            self.transport.expose(self.transfer_id(lease.lease_id), staging.tolist(),
                                  self.options.index.lease_timeout_s)
        except BaseException:
            self.staging_used[staging] = False
            raise
        self.staged[lease.lease_id] = Staged(staging)
        for row, block in zip(rows, staging.tolist()):
            slots[row] = block
        return self._reply(request, slots=slots, lease_id=lease.lease_id, kv_address=self.kv_address, **served)

    def _end_transfers(self, now: float) -> None:
        """Free the staging blocks of every exposure the transport says ended (pulled, given
        up, withdrawn, or never pulled before its lease ended) once no send reads them; an
        unsettled one's blocks stay out of use for another lease time."""
        lease_s = self.options.index.lease_timeout_s
        while (event := self.transport.next_event(0)) is not None:
            _, _, number = event.transfer_id.rpartition(":")
            staged = self.staged.pop(int(number) if number.isdigit() else 0, None)
            if staged is None:
                continue
            if event.settled:
                self.staging_used[staged.blocks] = False
            else:
                log.warning("kvstore_sends_unsettled", transfer_id=event.transfer_id, status=event.status)
                self.quarantined.append((now + lease_s, staged.blocks))
            if not staged.released:
                self.pulled[int(number)] = now + lease_s  # the engine's release may still come
        while self.quarantined and self.quarantined[0][0] <= now:
            self.staging_used[self.quarantined.pop(0)[1]] = False


def _rows(pool: np.ndarray, rows: list[int]) -> np.ndarray:
    """pool[rows]: a view where the rows run on, else a gathered copy."""
    if all(b == a + 1 for a, b in zip(rows, rows[1:])):
        return pool[rows[0]:rows[0] + len(rows)]
    return pool[np.asarray(rows, dtype=np.int64)]


def _rows_index(ids: np.ndarray) -> slice | np.ndarray:
    """A slice where the ids run on (a strided copy), else the ids (a scatter)."""
    if ids.size and int(ids[-1]) - int(ids[0]) == ids.size - 1:
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def _validate(request: StoreRequest, payloads: list[np.ndarray]) -> None:
    """Refused naming the field unless the request is well formed for its op."""
    if request.op not in STORE_OPS:
        raise Refused(ErrorCode.INVALID_REQUEST, f"op: {request.op!r} is not one of {', '.join(STORE_OPS)}")
    if not 0 <= request.namespace <= MAX_KEY:
        raise Refused(ErrorCode.INVALID_REQUEST, "namespace: not a 64-bit unsigned int")
    if len(request.keys) > MAX_STORE_KEYS:
        raise Refused(ErrorCode.INVALID_REQUEST, f"keys: {len(request.keys)}, over {MAX_STORE_KEYS} per request")
    for name in ("keys", "parents", "checksums"):
        values = getattr(request, name)
        if any(not 0 <= v <= MAX_KEY for v in values):
            raise Refused(ErrorCode.INVALID_REQUEST, f"{name}: every entry must be a 64-bit unsigned int")
    if request.op in ("put_start", "put") and len(request.parents) != len(request.keys):
        raise Refused(ErrorCode.INVALID_REQUEST, f"parents: {len(request.parents)} for {len(request.keys)} keys")
    if request.op == "put" and (len(request.checksums) != len(request.keys) or len(payloads) != len(request.keys)):
        raise Refused(ErrorCode.INVALID_REQUEST, f"put: {len(request.keys)} keys need as many checksums "
                      f"({len(request.checksums)}) and value frames ({len(payloads)})")
    if request.op == "put_commit" and len(request.checksums) != len(request.tickets):
        raise Refused(ErrorCode.INVALID_REQUEST,
                      f"checksums: {len(request.checksums)} for {len(request.tickets)} tickets")
    if request.op != "put" and payloads:
        raise Refused(ErrorCode.INVALID_REQUEST, f"{request.op} carries no value frames, got {len(payloads)}")
