"""The `router` role: knows the workers, places requests, notices the dead.

Workers and tokenizers connect DEALER sockets to one ROUTER socket. A worker says Hello
(refused on a protocol, model or block-naming mismatch) and then heartbeats its load and
the requests it finished; its KV events feed the prefix index. A tokenizer sends Generate
and Abort. Each Generate is matched against the index, ranked by the placement policy
and admitted (or refused early) by admission control; see services/router/cluster.py.
With prefill and decode pools, the hand-off from a prefill worker to a decode worker is
services/router/handoff.py's (docs/router.md §6).
A worker silent for `worker_timeout_s` is dropped and each of its requests is failed
back to the tokenizer that sent it (WORKER_LOST), which retries it elsewhere when nothing
was streamed yet.

Peers prove their role with their CURVE key (common/sockets.py): only workers may say
Hello, heartbeat or report KV, only tokenizers may send Generate and Abort. An engine is
the connection it joined on, not the id its messages name (docs/architecture.md §3): a
Hello binds the worker id to that connection's routing id, which the router assigns and
no other connection can take; what an engine sends later is believed only from that
connection, its heartbeats (from a second connection) only with the registration's secret
session, and its KV events only from the publisher its Hello named. Tokens never pass
through the router, so a restarted router loses no stream: each worker rejoins with the
requests it is serving and its whole prefix cache, and the router rebuilds its state.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from msgspec.structs import replace

from common.config import ClusterConfig
from common.cost_model import StorePricing, load_cost_model
from common.hashing import root_hash
from common.logs import get_logger
from common.metrics import Registry
from common.metrics_server import MetricsServer
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    ErrorCode,
    Generate,
    Heartbeat,
    Hello,
    KvEvents,
    KvLeaseUpdate,
    KvPart,
    KvPullFailed,
    KvReady,
    Placed,
    ProtocolError,
    RequestsFinished,
    Status,
    StatusRequest,
    StoreEvents,
    Welcome,
    WorkerStatus,
    decode,
    peek_request_id,
)
from common.sockets import ENGINE_ROLES, Security, check_endpoint, connect, peer_role, send, split_routed
from services.router.admission import AdmissionConfig, AdmissionControl
from services.router.cluster import ClusterState, Placement
from services.router.handoff import HandoffDesk
from services.router.members import Member, Members
from services.router.native import compiled
from services.router.policies import make_policy

log = get_logger("router")
UNAVAILABLE_RETRY_AFTER_S = 1.0
# 10 µs to 50 ms: a placement takes ~0.1 ms at bench_router's sizes (docs/router.md §8), more behind a burst of events.
PLACEMENT_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05)
MAX_BLOCK_HASH = 2**64 - 1  # block names are 64-bit (docs/kv-identity.md §1)
# What each role may send the router; with CURVE off no role is proven and all may.
ROLE_MESSAGES = {"worker": (Hello, Heartbeat, KvEvents, RequestsFinished),
                 "prefill": (Hello, Heartbeat, KvEvents, KvReady, KvPart, RequestsFinished),
                 "decode": (Hello, Heartbeat, KvEvents, KvLeaseUpdate, KvPullFailed, RequestsFinished),
                 "tokenizer": (Generate, Abort, StatusRequest)}


class RouterMetrics:
    def __init__(self, registry: Registry):
        self.placed = registry.counter("baton_router_requests_total", "Requests by outcome",
                                       labels=("outcome",))
        self.rejected = registry.counter("baton_router_rejected_total",
                                         "Requests refused by admission control, by SLO class",
                                         labels=("slo_class",))
        self.kv_events = registry.counter("baton_router_kv_events_total", "KV block events received",
                                          labels=("kind",))
        self.workers = registry.gauge("baton_router_workers", "Healthy workers")
        self.index_blocks = registry.gauge("baton_router_index_blocks", "Blocks in the cluster prefix index")
        self.bad_messages = registry.counter("baton_router_bad_messages_total", "Malformed messages")
        self.store_events = registry.counter("baton_router_store_events_total",
                                             "KV store block events applied to the prefix index",
                                             labels=("kind",))
        self.store_bad = registry.counter("baton_router_store_bad_messages_total",
                                          "Malformed or unexpected messages on the KV store's events socket")
        self.store_blocks = registry.gauge("baton_router_store_blocks",
                                           "Blocks the KV store holds, as far as the router knows")
        self.identity_refused = registry.counter(
            "baton_router_identity_refused_total", "Messages speaking for an engine from a connection that is not "
            "its registration (a Hello naming a live engine, a heartbeat without its session, KV events or "
            "reports from elsewhere), refused", labels=("message",))
        self.handoffs_parked = registry.counter(
            "baton_router_handoffs_parked_total", "Prefilled requests that waited for a decode worker, by outcome",
            labels=("outcome",))
        self.failed_pulls = registry.counter(
            "baton_router_failed_pulls_total", "Decode workers' KV pulls that failed in a way another decode worker "
            "could avoid, by verdict: moved (re-placed on another) or local (the reporting worker falls back on "
            "kv_load_failure_policy)", labels=("outcome",))
        self.placement_seconds = registry.histogram(
            "baton_router_placement_seconds", "A placed request's time in the router: Generate received to "
            "sent on to its worker (index match, policy, admission, forwarding)", PLACEMENT_BUCKETS)


class RouterService:
    def __init__(self, config: ClusterConfig):
        self.config = config
        # Sent with each Status: a tokenizer that sees it change knows that what it sent the
        # last instance and had not seen placed is lost with it.
        self.instance_id = uuid.uuid4().hex[:16]
        self.policy = make_policy(config.policy)
        ttl = config.index_ttl_s if config.index_mode == "approximate" else None
        cost = load_cost_model(config.profile)
        # The engines fetch from the store as kvstore_fetch says; with "never" it saves no prefill.
        store = StorePricing.for_model(cost, config.block_size, always_fetch=config.kvstore_fetch == "always") \
            if config.kvstore and config.kvstore_fetch != "never" else None
        # The engines that prefill (co-located workers and the prefill pool), which the policy
        # places on, and the decode pool, which pairing picks from (docs/router.md §6).
        chunk = config.max_num_batched_tokens  # the engines' own setting, from the same config
        self.cluster = ClusterState(config.block_size, cost, config.load_window_s, ttl, store, chunk)
        self.decode_pool = ClusterState(config.block_size, cost, config.load_window_s, ttl, store, chunk)
        self.store_tiers = len(store.tiers) if store else 0
        self.store_id = ""  # the store instance whose events the index holds
        self.prefill_pool: set[str] = set()  # the prefill workers among self.cluster's
        self.admission = AdmissionControl(
            AdmissionConfig(config.admission, config.max_queued_requests, config.max_queued_tokens),
            {slo.name: slo for slo in config.slo_classes})
        self.registry = Registry()
        self.metrics = RouterMetrics(self.registry)
        self.members = Members()
        self.origins: dict[str, bytes] = {}  # request id -> tokenizer identity
        self.hash_root: HashRoot | None = None  # what names blocks: set by the first worker
        self.root_hashes: dict[str, int] = {}  # tenant -> root of its hash chains
        self.model_fingerprint: str | None = None
        self.requests_routed = 0
        self.kv_events_received = 0
        self.failed_over: dict[str, set[str]] = {}  # dropped worker -> its requests failed meanwhile
        # The P/D hand-offs in flight (docs/router.md §6): pending, parked, and their leases.
        self.handoffs = HandoffDesk(config, self.cluster, self.decode_pool, self.members, self.policy, self._reply,
                                    self._root_hash, self.origins.__contains__, self._fail_unavailable,
                                    self.metrics.handoffs_parked, self.metrics.failed_pulls, self._adopt_request)
        self.context = zmq.Context()
        self.security = Security(self.context, config, "router")
        self.socket = self.security.server(zmq.ROUTER, config.router, accept=(*ENGINE_ROLES, "tokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.subscribed: dict[zmq.Socket, str] = {}  # each member's KV events subscriber -> its worker id
        self.store_events = self._subscribe_store() if store is not None else None
        if self.store_events is not None:
            self.poller.register(self.store_events, zmq.POLLIN)
        self.metrics_server = MetricsServer(config.host, config.router_metrics_port, self.registry, self.health)
        # message type -> handler(identity, message of that type, payloads)
        self.handlers: dict[type, Callable[[bytes, Any, list], None]] = {
            Hello: self._on_hello, Heartbeat: self._on_heartbeat, Generate: self._on_generate,
            Abort: self._on_abort, StatusRequest: self._on_status, KvEvents: self._on_kv_report,
            KvReady: self._on_kv_ready, KvPart: self._on_kv_part, KvLeaseUpdate: self._on_lease_update,
            KvPullFailed: self._on_kv_pull_failed, RequestsFinished: self._on_requests_finished}

    def run(self, stop: threading.Event) -> None:
        self.metrics_server.start()
        log.info("ready", role="router", address=self.config.router, policy=self.policy.name,
                 profile=self.cluster.cost.name, compiled=compiled(),
                 metrics=f"http://{self.config.host}:{self.metrics_server.port}/metrics")
        print(f"baton router ready on {self.config.router}", flush=True)
        try:
            while not stop.is_set():
                ready = dict(self.poller.poll(100))
                if self.socket in ready:
                    self._drain(self.socket, self._on_routed)
                for socket in ready:  # only the subscribers with events: a fleet has thousands
                    worker_id = self.subscribed.get(socket)
                    if worker_id is not None:
                        self._drain(socket, lambda frames, w=worker_id: self._on_event(w, frames))
                if self.store_events is not None and self.store_events in ready:
                    self._drain(self.store_events, self._on_store_event)
                self._drop_silent_workers()
                self.handoffs.retry_parked(time.monotonic())
        finally:
            self.close()

    def close(self) -> None:
        self.metrics_server.stop()
        self.security.stop()
        self.context.destroy(linger=0)  # closes every socket first, so this cannot block

    def health(self) -> dict:
        """Ok only while a request would be placed: some worker is registered."""
        return {"ok": bool(self.members), "role": "router", "pid": os.getpid(), "workers": len(self.members)}

    # ---- input ---------------------------------------------------------------------

    @staticmethod
    def _drain(socket: zmq.Socket, handle) -> None:
        for _ in range(1000):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _on_routed(self, frames: list[zmq.Frame]) -> None:
        role = peer_role(frames[-1])
        raw = [frame.bytes for frame in frames]
        try:
            identity, body = split_routed(raw)
            message, payloads = decode(body)
        except ProtocolError as error:
            self.metrics.bad_messages.inc()
            log.warning("bad_message", error=str(error))
            if len(raw) >= 2:
                self._reply(raw[0], Error(request_id=peek_request_id(raw[1:]), code=ErrorCode.INVALID_REQUEST,
                                          message=str(error)))
            return
        handler = self.handlers.get(type(message))
        if handler is None or (role is not None and type(message) not in ROLE_MESSAGES.get(role, ())):
            self.metrics.bad_messages.inc()
            log.warning("message_refused", type=type(message).__name__, role=role)
            self._reply(identity, Error(request_id=getattr(message, "request_id", ""),
                                        code=ErrorCode.INVALID_REQUEST,
                                        message=f"the router does not take {type(message).__name__} "
                                                f"from {role or 'this peer'}"))
            return
        if isinstance(message, Hello) and role is not None and message.role != role:
            self._reply(identity, Welcome(accepted=False, reason=f"a {role} key cannot join as {message.role!r}"))
            return
        handler(identity, message, payloads)

    def _on_event(self, worker_id: str, frames: list[zmq.Frame]) -> None:
        """A message from the KV events publisher that `worker_id`'s Hello named: only its
        own events are applied."""
        try:
            message, _ = decode([frame.bytes for frame in frames])
        except ProtocolError as error:
            log.warning("bad_kv_event", error=str(error))
            return
        if not isinstance(message, KvEvents):
            return
        if message.worker_id != worker_id:
            self._identity_refused("KvEvents", message.worker_id, f"published by {worker_id}'s events")
            return
        self._apply_kv_events(message)

    def _on_kv_report(self, identity: bytes, message: KvEvents, _payloads) -> None:
        """A rejoining worker's prefix cache, sent on the router socket after its Hello."""
        member = self._member_on(identity, "KvEvents")
        if member is None:
            return
        if message.worker_id != member.hello.worker_id:
            self._identity_refused("KvEvents", message.worker_id, f"sent on {member.hello.worker_id}'s connection")
            return
        self._apply_kv_events(message)

    def _apply_kv_events(self, message: KvEvents) -> None:
        self.kv_events_received += len(message.stored) + len(message.removed)
        self.metrics.kv_events.inc(len(message.stored), kind="stored")
        self.metrics.kv_events.inc(len(message.removed), kind="removed")
        if message.worker_id in self.members:
            pool = self._pool_of(message.worker_id)
            pool.kv_removed(message.worker_id, message.removed)
            pool.kv_stored(message.worker_id, message.stored, time.monotonic())
        self.metrics.index_blocks.set(len(self.cluster.index) + len(self.decode_pool.index))

    # ---- who speaks for an engine (docs/architecture.md §3) ---------------------------

    def _member_on(self, identity: bytes, message: str) -> Member | None:
        """The member registered on this connection; None (refused, counted, and the sender
        told to say Hello) if none is."""
        member = self.members.on(identity)
        if member is not None:
            return member
        self._identity_refused(message, "", "from a connection that has not joined")
        self._reply(identity, Welcome(accepted=False, rehello=True,
                                      reason=f"{message} from a connection that has not joined: say Hello"))
        return None

    def _identity_refused(self, message: str, worker_id: str, why: str) -> None:
        self.metrics.identity_refused.inc(message=message)
        log.warning("identity_refused", message=message, worker_id=worker_id, why=why)

    # ---- the KV store's events (docs/router.md §7) ------------------------------------

    def _subscribe_store(self) -> zmq.Socket:
        """A SUB socket on the store's events publisher (it may start after the router:
        ZeroMQ connects when it appears)."""
        socket = self.security.subscriber("kvstore")
        connect(socket, self.config.kvstore_events_address)
        return socket

    def _on_store_event(self, frames: list[zmq.Frame]) -> None:
        """Apply one message from the store's publisher; anything else is counted and
        logged, and the router goes on."""
        try:
            message, _ = decode([frame.bytes for frame in frames])
        except ProtocolError as error:
            self._bad_store_message(str(error))
            return
        if not isinstance(message, StoreEvents):
            self._bad_store_message(f"expected StoreEvents, got {type(message).__name__}")
            return
        problem = store_events_problem(message, self.store_tiers)
        if problem:
            self._bad_store_message(problem)
            return
        self._apply_store_events(message)

    def _bad_store_message(self, why: str) -> None:
        self.metrics.store_bad.inc()
        log.warning("bad_store_event", error=why)

    def _apply_store_events(self, message: StoreEvents) -> None:
        if message.store_id != self.store_id:
            if self.store_id:  # a new store instance: what the old one held is not known to be there
                log.warning("store_changed", old=self.store_id, new=message.store_id)
            for pool in (self.cluster, self.decode_pool):
                pool.index.drop_store()
            self.store_id = message.store_id
        for pool in (self.cluster, self.decode_pool):
            pool.store_evicted(message.evicted)
            pool.store_stored(message.moved, message.moved_tiers)
            pool.store_stored(message.stored, message.stored_tiers)
        self.metrics.store_events.inc(len(message.stored), kind="stored")
        self.metrics.store_events.inc(len(message.moved), kind="moved")
        self.metrics.store_events.inc(len(message.evicted), kind="evicted")
        self.metrics.store_blocks.set(self.cluster.index.store_blocks)
        self.metrics.index_blocks.set(len(self.cluster.index) + len(self.decode_pool.index))

    def _pool_of(self, worker_id: str) -> ClusterState:
        member = self.members.get(worker_id)
        return self._pool_for(member.hello.role if member else "worker")

    def _pool_for(self, role: str) -> ClusterState:
        return self.decode_pool if role == "decode" else self.cluster

    def _reply(self, identity: bytes, message, payloads=None) -> bool:
        try:
            send(self.socket, message, payloads, identity=identity)
            return True
        except zmq.ZMQError as error:  # the peer is gone (ROUTER_MANDATORY) or its queue is full
            peer = self.members.by_connection.get(identity) or identity.decode(errors="replace")
            log.warning("reply_failed", peer=peer, error=str(error))
            return False

    # ---- workers -------------------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: Hello, _payloads) -> None:
        why = self.members.claim_refusal(identity, hello, self.config.worker_timeout_s)
        if why:
            self._identity_refused("Hello", hello.worker_id, why)
            self._reply(identity, Welcome(accepted=False, reason=why, retry_after_s=self.config.worker_timeout_s))
            return
        previous = self.members.get(hello.worker_id)
        events = self._refusal(hello) or self._events_of(hello, previous)
        if isinstance(events, str):  # the refusal's reason
            log.error("worker_refused", worker_id=hello.worker_id, reason=events)
            self._reply(identity, Welcome(accepted=False, reason=events))
            return
        self.model_fingerprint = self.model_fingerprint or hello.model_fingerprint
        self.hash_root = self.hash_root or _hash_root(hello)
        member, same_process = self.members.join(identity, hello, events, time.monotonic())
        pool = self._pool_for(hello.role)
        if hello.role == "prefill":
            self.prefill_pool.add(hello.worker_id)
        if not same_process:
            # A new process, or one this router has not met: what an old one held is gone.
            self._fail_requests(pool.remove_worker(hello.worker_id), hello.worker_id, "the worker restarted")
            pool.add_worker(hello.worker_id, hello.kv_blocks)
        abort = self._resume(hello)
        self.metrics.workers.set(len(self.members))
        log.info("worker_joined", worker_id=hello.worker_id, kv_blocks=hello.kv_blocks,
                 resumed=len(hello.running) - len(abort), aborted=len(abort))
        self._reply(identity, Welcome(accepted=True, abort=abort, session=member.session))
        if hello.role == "decode":
            self.handoffs.retry_parked(time.monotonic())

    def _events_of(self, hello: Hello, previous: Member | None) -> zmq.Socket | str:
        """The subscriber to this worker's KV events (its own socket, so that whatever
        arrives on it is known to come from the publisher its Hello named); the refusal's
        reason if the address is bad."""
        if previous is not None:
            if previous.hello.events_address == hello.events_address:
                return previous.events
            self._unsubscribe(previous)
        events = self.security.subscriber(hello.role)
        try:
            connect(events, hello.events_address)
        except ValueError as error:
            events.close(0)
            return f"events_address: {error}"
        self.poller.register(events, zmq.POLLIN)
        self.subscribed[events] = hello.worker_id
        return events

    def _unsubscribe(self, member: Member) -> None:
        self.poller.unregister(member.events)
        self.subscribed.pop(member.events, None)
        member.events.close(0)

    def _resume(self, hello: Hello) -> list[str]:
        """Take back the requests a rejoining worker is still serving; returns those this
        router failed over while the worker was away, which the worker must drop."""
        failed = self.failed_over.pop(hello.worker_id, set())
        abort = []
        now = time.monotonic()
        pool = self._pool_for(hello.role)
        for running in hello.running:
            placement = self.cluster.placements.get(running.request_id) or \
                self.decode_pool.placements.get(running.request_id)
            if running.request_id in failed or (placement and placement.worker_id != hello.worker_id):
                abort.append(running.request_id)
                continue
            if placement is not None:  # still known here: nothing to take back
                continue
            pool.resume(running.request_id, hello.worker_id, running.num_prompt_tokens,
                        max(running.max_tokens - running.output_tokens, 1), now)
            self.origins[running.request_id] = running.origin.encode()
        return abort

    def _refusal(self, hello: Hello) -> str:
        if hello.role not in ENGINE_ROLES:
            return f"role: {hello.role!r} is not one of {', '.join(ENGINE_ROLES)}"
        if hello.role == "prefill":
            try:
                check_endpoint(hello.kv_address)
            except ValueError as error:
                return f"kv_address: {error}"
        if hello.protocol_version != PROTOCOL_VERSION:
            return (f"protocol version mismatch: worker {hello.worker_id} speaks "
                    f"{hello.protocol_version}, router speaks {PROTOCOL_VERSION}")
        if self.model_fingerprint and hello.model_fingerprint != self.model_fingerprint:
            return (f"model mismatch: worker {hello.worker_id} serves model {hello.model_fingerprint}, "
                    f"the cluster serves {self.model_fingerprint}")
        if hello.block_size != self.config.block_size:
            return (f"block size mismatch: worker {hello.worker_id} uses {hello.block_size}-token blocks, "
                    f"the cluster {self.config.block_size}")
        if self.hash_root and _hash_root(hello) != self.hash_root:
            return (f"KV naming mismatch: worker {hello.worker_id} names blocks by "
                    f"(tokenizer, adapter, kv dtype) = {_hash_root(hello)[1:4]}, the cluster by "
                    f"{self.hash_root[1:4]}")
        return ""

    def _on_heartbeat(self, identity: bytes, beat: Heartbeat, _payloads) -> None:
        member = self.members.get(beat.worker_id)
        if member is None:
            self._reply(identity, Welcome(accepted=False, reason="unknown worker", rehello=True,
                                          beat_seq=beat.seq))
            return
        if not self.members.shows_session(member, beat.session):
            # Never keeps the member alive. A real worker whose session is stale (it rejoined
            # meanwhile) says Hello again on its own connection, which repairs it.
            self._identity_refused("Heartbeat", beat.worker_id, "without the registration's session")
            self._reply(identity, Welcome(accepted=False, reason="heartbeat without this worker's session",
                                          rehello=True, beat_seq=beat.seq))
            return
        member.last_seen = time.monotonic()
        member.heartbeat = beat
        pool = self._pool_for(member.hello.role)
        pool.report(beat.worker_id, beat.running, beat.waiting, beat.kv_blocks_used, beat.kv_blocks_cached)

    def _on_requests_finished(self, identity: bytes, message: RequestsFinished, _payloads) -> None:
        """A worker ended these requests: they leave its loads now, not at its next heartbeat."""
        member = self._member_on(identity, "RequestsFinished")
        if member is None:
            return
        worker_id = member.hello.worker_id
        now = time.monotonic()
        pool = self._pool_for(member.hello.role)
        for finished in message.finished:
            request_id = finished.request_id
            if pool is self.decode_pool and self.handoffs.import_ended(request_id, worker_id):
                continue  # it imported the prompt's parts; the prefill goes on, its hand-off with it
            if self.handoffs.placed_elsewhere(request_id, worker_id):
                continue  # this worker's part ended; the request goes on on another
            self.origins.pop(request_id, None)
            self.handoffs.forget(request_id)
            placement = pool.finish(request_id, finished.output_tokens, now)
            if placement is not None and pool is self.cluster:
                self.policy.finished(placement, finished.ttft_s, now)

    def _drop_silent_workers(self) -> None:
        now = time.monotonic()
        silent = [w for w, m in self.members.items() if now - m.last_seen > self.config.worker_timeout_s]
        for worker_id in silent:
            member = self.members.drop(worker_id)
            self._unsubscribe(member)
            self.prefill_pool.discard(worker_id)
            self.metrics.workers.set(len(self.members))
            placements = [placement for placement in self._pool_for(member.hello.role).remove_worker(worker_id)
                          if not self.handoffs.import_ended(placement.request_id, worker_id)]
            log.error("worker_lost", worker_id=worker_id, in_flight=len(placements),
                      silent_s=round(now - member.last_seen, 2))
            self.failed_over[worker_id] = {placement.request_id for placement in placements}
            self._fail_requests(placements, worker_id, f"worker {worker_id} stopped answering")

    def _fail_requests(self, placements: list[Placement], worker_id: str, why: str) -> None:
        for placement in placements:
            self.handoffs.forget(placement.request_id)
            origin = self.origins.pop(placement.request_id, None)
            if origin is not None:
                self.metrics.placed.inc(outcome="worker_lost")
                self._reply(origin, Error(request_id=placement.request_id, code=ErrorCode.WORKER_LOST,
                                          message=why, worker_id=worker_id))

    # ---- requests ------------------------------------------------------------------

    def _on_generate(self, identity: bytes, request: Generate, payloads) -> None:
        started = time.perf_counter()
        try:
            check_endpoint(request.stream_address)
        except ValueError as error:
            self._refuse(identity, request, ErrorCode.INVALID_REQUEST, f"stream_address: {error}", 0.0,
                         "invalid_request")
            return
        request.origin = identity.decode(errors="replace")
        if not self.members or self.hash_root is None:
            self._refuse(identity, request, ErrorCode.UNAVAILABLE, "no worker is available",
                         UNAVAILABLE_RETRY_AFTER_S, "unavailable")
            return
        now = time.monotonic()
        if self.decode_pool.worker_ids:
            decode_worker = self.handoffs.place_on_decode(request, payloads, now)
            if decode_worker is not None:
                self._placed(identity, request.request_id, decode_worker)
                self.metrics.placement_seconds.observe(time.perf_counter() - started)
                return
        candidate = self.cluster.prepare(request.request_id, self._root_hash(request.tenant), payloads[0],
                                         request.sampling.max_tokens, now, request.slo_class)
        preference = self.policy.choose(candidate, self.cluster, now)
        if self.prefill_pool and not self.decode_pool.worker_ids:  # a prefill alone cannot finish a request
            preference = [w for w in preference if w not in self.prefill_pool]
        while preference:
            verdict = self.admission.decide(candidate, preference, self.cluster, now)
            if verdict.worker_id is None:
                self.metrics.rejected.inc(slo_class=request.slo_class or "none")
                self._refuse(identity, request, ErrorCode.OVERLOADED, verdict.reason, verdict.retry_after_s,
                             "overloaded")
                return
            store_from, store_tiers = self.cluster.store_hint(candidate, verdict.worker_id)
            sent = replace(request, store_from=store_from, store_tiers=store_tiers)
            if self._reply(self.members[verdict.worker_id].identity, sent, payloads):
                self.cluster.place(candidate, verdict.worker_id, now)
                if verdict.worker_id in self.prefill_pool:
                    self.handoffs.hold(request, payloads[0], verdict.worker_id)
                self._placed(identity, request.request_id, verdict.worker_id)
                self.metrics.placement_seconds.observe(time.perf_counter() - started)
                return
            preference = [w for w in preference if w != verdict.worker_id]
        self._refuse(identity, request, ErrorCode.UNAVAILABLE, "no worker could take the request",
                     UNAVAILABLE_RETRY_AFTER_S, "unavailable")

    def _placed(self, identity: bytes, request_id: str, worker_id: str) -> None:
        self.origins[request_id] = identity
        self.requests_routed += 1
        self.metrics.placed.inc(outcome="placed")
        self._reply(identity, Placed(request_id=request_id, worker_id=worker_id))

    def _on_kv_ready(self, identity: bytes, ready: KvReady, payloads) -> None:
        """A prefill worker holds a request's KV: the hand-off goes on (services/router/handoff.py)."""
        member = self._member_on(identity, "KvReady")
        if member is not None:
            self.handoffs.kv_ready(identity, member.hello, ready, time.monotonic(), payloads[0] if payloads else None)

    def _on_kv_part(self, identity: bytes, part: KvPart, _payloads) -> None:
        """A prefill worker holds a part of a prompt it is still prefilling
        (services/router/handoff.py)."""
        member = self._member_on(identity, "KvPart")
        if member is not None:
            self.handoffs.kv_part(identity, member.hello, part, time.monotonic())

    def _adopt_request(self, request: Generate) -> None:
        """A hand-off this router did not place (it restarted) goes on: its tokenizer is
        the one the request names."""
        self.origins.setdefault(request.request_id, request.origin.encode())

    def _fail_unavailable(self, request_id: str, why: str) -> None:
        """Tell a request's tokenizer that its hand-off cannot go on (unavailable)."""
        origin = self.origins.pop(request_id, None)
        if origin is not None:
            self.metrics.placed.inc(outcome="unavailable")
            self._reply(origin, Error(request_id=request_id, code=ErrorCode.UNAVAILABLE, message=why))

    def _on_lease_update(self, identity: bytes, update: KvLeaseUpdate, _payloads) -> None:
        """A decode worker renews or releases a lease of a request placed on it: passed to
        the prefill worker, or refused if the request is not placed on the sender."""
        sender = self._member_on(identity, "KvLeaseUpdate")
        if sender is None:
            return
        why = self.handoffs.lease_update(sender.hello, update)
        if why:
            self._identity_refused("KvLeaseUpdate", sender.hello.worker_id, why)

    def _on_kv_pull_failed(self, identity: bytes, failed: KvPullFailed, payloads) -> None:
        """A decode worker could not pull a request's KV: re-placed on another decode worker,
        or the worker told to fall back (services/router/handoff.py); refused if the request
        is not placed on the sender (which then falls back on its own)."""
        sender = self._member_on(identity, "KvPullFailed")
        if sender is None:
            return
        verdict = self.handoffs.pull_failed(sender.hello, failed, payloads[0], time.monotonic(), time.time())
        if isinstance(verdict, str):
            self._identity_refused("KvPullFailed", sender.hello.worker_id, verdict)
            return
        self._reply(identity, verdict)

    def _refuse(self, identity: bytes, request: Generate, code: ErrorCode, why: str, retry_after_s: float,
                outcome: str) -> None:
        self.metrics.placed.inc(outcome=outcome)
        self._reply(identity, Error(request_id=request.request_id, code=code, message=why,
                                    retry_after_s=round(retry_after_s, 3)))

    def _root_hash(self, tenant: str) -> int:
        if tenant not in self.root_hashes:
            assert self.hash_root is not None  # _on_generate refuses requests until a worker joined
            model, tokenizer, adapter, kv_dtype, block_size = self.hash_root
            self.root_hashes[tenant] = root_hash(model, tokenizer, adapter, kv_dtype, block_size, tenant)
        return self.root_hashes[tenant]

    def _on_abort(self, identity: bytes, abort: Abort, _payloads) -> None:
        if self.handoffs.abort(abort.request_id):  # a parked hand-off: its lease released
            self.origins.pop(abort.request_id, None)
            return
        placement = self.cluster.placements.get(abort.request_id) or \
            self.decode_pool.placements.get(abort.request_id)
        member = self.members.get(placement.worker_id) if placement else None
        if member is not None:
            self._reply(member.identity, abort)
        importing = self.handoffs.importing_on(abort.request_id)  # its parts, while the prefill runs
        member = self.members.get(importing) if importing is not None else None
        if member is not None:
            self._reply(member.identity, abort)

    def _on_status(self, identity: bytes, _request, _payloads) -> None:
        now = time.monotonic()
        workers = []
        for worker_id, member in self.members.items():
            state = self._pool_for(member.hello.role).workers[worker_id]
            beat = member.heartbeat
            workers.append(WorkerStatus(
                worker_id=worker_id, healthy=True, last_seen_s=round(now - member.last_seen, 3),
                running=state.running, waiting=state.waiting, in_flight=len(state.in_flight),
                kv_blocks_used=state.kv_blocks_used, kv_blocks_cached=beat.kv_blocks_cached if beat else 0,
                kv_blocks_total=member.hello.kv_blocks, metrics_address=member.hello.metrics_address,
                role=member.hello.role))
        self._reply(identity, Status(policy=self.policy.name, workers=workers,
                                     requests_routed=self.requests_routed,
                                     kv_events_received=self.kv_events_received, instance_id=self.instance_id))


def store_events_problem(message: StoreEvents, num_tiers: int) -> str:
    """What is wrong with a StoreEvents message ("" if nothing): a tier list whose length
    differs from its keys', a tier this router does not price, a key that is no block name."""
    if not message.store_id or len(message.store_id) > 256:
        return "store_id must be 1 to 256 characters"
    for keys, tiers, name in ((message.stored, message.stored_tiers, "stored"),
                              (message.moved, message.moved_tiers, "moved")):
        if len(keys) != len(tiers):
            return f"{name} has {len(keys)} keys but {name}_tiers {len(tiers)} tiers"
        if tiers and (min(tiers) < 0 or max(tiers) >= num_tiers):
            return f"{name}_tiers: tiers are 0..{num_tiers - 1}, got {min(tiers)}..{max(tiers)}"
    for keys, name in ((message.stored, "stored"), (message.moved, "moved"), (message.evicted, "evicted")):
        if keys and (min(keys) < 0 or max(keys) > MAX_BLOCK_HASH):
            return f"{name}: a block hash is a 64-bit unsigned integer"
    return ""


# (model fingerprint, tokenizer fingerprint, adapter id, KV dtype, block size)
HashRoot = tuple[str, str, str, str, int]


def _hash_root(hello: Hello) -> HashRoot:
    """The fields (besides the tenant) that root a worker's block hashes (docs/kv-identity.md §3)."""
    return (hello.model_fingerprint, hello.tokenizer_fingerprint, hello.adapter_id, hello.kv_dtype,
            hello.block_size)
