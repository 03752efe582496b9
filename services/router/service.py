"""The `router` role: knows the workers, places requests, notices the dead.

Workers and tokenizers connect DEALER sockets to one ROUTER socket. A worker says Hello
(refused on a protocol or model mismatch) and then heartbeats its load and the requests
it finished; a tokenizer sends Generate and Abort. A worker silent for
`worker_timeout_s` is dropped and each of its requests is failed back to the tokenizer
that sent it (WORKER_LOST), which retries it elsewhere when nothing was streamed yet.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import zmq

from common.config import ClusterConfig
from common.logs import get_logger
from common.metrics import Registry
from common.metrics_server import MetricsServer
from common.protocol import (PROTOCOL_VERSION, Abort, Error, ErrorCode, Generate, Heartbeat, Hello,
                             KvEvents, ProtocolError, Status, StatusRequest, Welcome, WorkerStatus, decode)
from common.sockets import Auth, send, server_socket, split_routed, subscriber
from services.router.policy import PlacementRequest, WorkerLoad, make_policy

log = get_logger("router")
OVERLOAD_RETRY_AFTER_S = 1.0


@dataclass
class WorkerState:
    hello: Hello
    identity: bytes
    last_seen: float
    heartbeat: Heartbeat | None = None
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens

    @property
    def queued(self) -> int:
        """Requests placed here beyond the worker's running batch."""
        running = self.heartbeat.running if self.heartbeat else 0
        return max(0, len(self.in_flight) - running)

    @property
    def queued_tokens(self) -> int:
        return sum(self.in_flight.values()) if self.queued else 0

    def load(self) -> WorkerLoad:
        beat = self.heartbeat
        return WorkerLoad(self.hello.worker_id, beat.running if beat else 0, beat.waiting if beat else 0,
                          len(self.in_flight), beat.kv_blocks_used if beat else 0,
                          beat.kv_blocks_total if beat else self.hello.kv_blocks)


class RouterMetrics:
    def __init__(self, registry: Registry):
        self.placed = registry.counter("baton_router_requests_total", "Requests by outcome",
                                       labels=("outcome",))
        self.kv_events = registry.counter("baton_router_kv_events_total", "KV block events received",
                                          labels=("kind",))
        self.workers = registry.gauge("baton_router_workers", "Healthy workers")
        self.bad_messages = registry.counter("baton_router_bad_messages_total", "Malformed messages")


class RouterService:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.policy = make_policy(config.policy)
        self.registry = Registry()
        self.metrics = RouterMetrics(self.registry)
        self.workers: dict[str, WorkerState] = {}
        self.origins: dict[str, bytes] = {}  # request id -> tokenizer identity
        self.placed_on: dict[str, str] = {}  # request id -> worker id
        self.model_fingerprint: str | None = None
        self.requests_routed = 0
        self.kv_events_received = 0
        self.context = zmq.Context()
        self.auth = Auth(self.context, config)
        self.socket = server_socket(self.context, zmq.ROUTER, config, config.router)
        self.events = subscriber(self.context, config)
        self.subscribed: set[str] = set()
        self.metrics_server = MetricsServer(config.host, config.router_metrics_port, self.registry, self.health)
        self.handlers = {Hello: self._on_hello, Heartbeat: self._on_heartbeat, Generate: self._on_generate,
                         Abort: self._on_abort, StatusRequest: self._on_status}

    def run(self, stop: threading.Event) -> None:
        self.metrics_server.start()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        log.info("ready", role="router", address=self.config.router, policy=self.policy.name,
                 metrics=f"http://{self.config.host}:{self.metrics_server.port}/metrics")
        print(f"baton router ready on {self.config.router}", flush=True)
        try:
            while not stop.is_set():
                ready = dict(poller.poll(100))
                if self.socket in ready:
                    self._drain(self.socket, self._on_routed)
                if self.events in ready:
                    self._drain(self.events, self._on_event)
                self._drop_silent_workers()
        finally:
            self.close()

    def close(self) -> None:
        self.metrics_server.stop()
        self.socket.close(0)
        self.events.close(0)
        self.auth.stop()
        self.context.term()

    def health(self) -> dict:
        return {"ok": True, "role": "router", "pid": os.getpid(), "workers": len(self.workers)}

    # ---- input ---------------------------------------------------------------------

    @staticmethod
    def _drain(socket: zmq.Socket, handle) -> None:
        for _ in range(1000):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    def _on_routed(self, frames: list[bytes]) -> None:
        try:
            identity, body = split_routed(frames)
            message, payloads = decode(body)
        except ProtocolError as error:
            self.metrics.bad_messages.inc()
            log.warning("bad_message", error=str(error))
            if len(frames) >= 2:
                self._reply(frames[0], Error(request_id="", code=ErrorCode.INVALID_REQUEST, message=str(error)))
            return
        handler = self.handlers.get(type(message))
        if handler is None:
            self._reply(identity, Error(request_id="", code=ErrorCode.INVALID_REQUEST,
                                        message=f"the router does not take {type(message).__name__}"))
            return
        handler(identity, message, payloads)

    def _on_event(self, frames: list[bytes]) -> None:
        try:
            message, _ = decode(frames)
        except ProtocolError as error:
            log.warning("bad_kv_event", error=str(error))
            return
        if isinstance(message, KvEvents):
            self.kv_events_received += len(message.stored) + len(message.removed)
            self.metrics.kv_events.inc(len(message.stored), kind="stored")
            self.metrics.kv_events.inc(len(message.removed), kind="removed")

    def _reply(self, identity: bytes, message, payloads=None) -> bool:
        try:
            send(self.socket, message, payloads, identity=identity)
            return True
        except zmq.ZMQError as error:  # the peer is gone (ROUTER_MANDATORY) or its queue is full
            log.warning("reply_failed", peer=identity.decode(errors="replace"), error=str(error))
            return False

    # ---- workers -------------------------------------------------------------------

    def _on_hello(self, identity: bytes, hello: Hello, _payloads) -> None:
        refusal = self._refusal(hello)
        if refusal:
            log.error("worker_refused", worker_id=hello.worker_id, reason=refusal)
            self._reply(identity, Welcome(accepted=False, reason=refusal))
            return
        self.model_fingerprint = self.model_fingerprint or hello.model_fingerprint
        previous = self.workers.pop(hello.worker_id, None)
        state = WorkerState(hello, identity, time.monotonic())
        if previous is not None and previous.hello.instance_id == hello.instance_id:
            state.in_flight = previous.in_flight  # the same process saying hello again
        elif previous is not None:  # a restart: whatever the old process held is lost
            self._fail_requests(previous, "the worker restarted")
        self.workers[hello.worker_id] = state
        if hello.events_address not in self.subscribed:
            self.events.connect(hello.events_address)
            self.subscribed.add(hello.events_address)
        self.metrics.workers.set(len(self.workers))
        log.info("worker_joined", worker_id=hello.worker_id, kv_blocks=hello.kv_blocks)
        self._reply(identity, Welcome(accepted=True))

    def _refusal(self, hello: Hello) -> str:
        if hello.protocol_version != PROTOCOL_VERSION:
            return (f"protocol version mismatch: worker {hello.worker_id} speaks "
                    f"{hello.protocol_version}, router speaks {PROTOCOL_VERSION}")
        if self.model_fingerprint and hello.model_fingerprint != self.model_fingerprint:
            return (f"model mismatch: worker {hello.worker_id} serves model {hello.model_fingerprint}, "
                    f"the cluster serves {self.model_fingerprint}")
        return ""

    def _on_heartbeat(self, identity: bytes, beat: Heartbeat, _payloads) -> None:
        worker = self.workers.get(beat.worker_id)
        if worker is None:
            self._reply(identity, Welcome(accepted=False, reason="unknown worker", rehello=True,
                                          beat_seq=beat.seq))
            return
        worker.last_seen = time.monotonic()
        worker.heartbeat = beat
        for finished in beat.finished:
            request_id = finished.request_id
            worker.in_flight.pop(request_id, None)
            self.origins.pop(request_id, None)
            self.placed_on.pop(request_id, None)

    def _drop_silent_workers(self) -> None:
        now = time.monotonic()
        for worker_id in [w for w, s in self.workers.items() if now - s.last_seen > self.config.worker_timeout_s]:
            worker = self.workers.pop(worker_id)
            self.metrics.workers.set(len(self.workers))
            log.error("worker_lost", worker_id=worker_id, in_flight=len(worker.in_flight),
                      silent_s=round(now - worker.last_seen, 2))
            self._fail_requests(worker, f"worker {worker_id} stopped answering")

    def _fail_requests(self, worker: WorkerState, why: str) -> None:
        for request_id in worker.in_flight:
            origin = self.origins.pop(request_id, None)
            self.placed_on.pop(request_id, None)
            if origin is not None:
                self.metrics.placed.inc(outcome="worker_lost")
                self._reply(origin, Error(request_id=request_id, code=ErrorCode.WORKER_LOST, message=why,
                                          worker_id=worker.hello.worker_id))

    # ---- requests ------------------------------------------------------------------

    def _on_generate(self, identity: bytes, request: Generate, payloads) -> None:
        prompt_len = len(payloads[0])
        if not self.workers:
            self.metrics.placed.inc(outcome="unavailable")
            self._reply(identity, Error(request_id=request.request_id, code=ErrorCode.UNAVAILABLE,
                                        message="no worker is available", retry_after_s=OVERLOAD_RETRY_AFTER_S))
            return
        loads = [w.load() for w in self.workers.values()]
        for worker_id in self.policy.choose(PlacementRequest(request.request_id, prompt_len, request.tenant), loads):
            worker = self.workers[worker_id]
            if worker.queued >= self.config.max_queued_requests or \
                    worker.queued_tokens + prompt_len > self.config.max_queued_tokens:
                continue
            if not self._reply(worker.identity, request, payloads):
                continue
            worker.in_flight[request.request_id] = prompt_len
            self.origins[request.request_id] = identity
            self.placed_on[request.request_id] = worker_id
            self.requests_routed += 1
            self.metrics.placed.inc(outcome="placed")
            return
        self.metrics.placed.inc(outcome="overloaded")
        self._reply(identity, Error(request_id=request.request_id, code=ErrorCode.OVERLOADED,
                                    message="every worker's queue is full", retry_after_s=OVERLOAD_RETRY_AFTER_S))

    def _on_abort(self, identity: bytes, abort: Abort, _payloads) -> None:
        worker_id = self.placed_on.get(abort.request_id)
        worker = self.workers.get(worker_id) if worker_id else None
        if worker is not None:
            self._reply(worker.identity, abort)

    def _on_status(self, identity: bytes, _request, _payloads) -> None:
        now = time.monotonic()
        workers = []
        for worker in self.workers.values():
            beat = worker.heartbeat
            workers.append(WorkerStatus(
                worker_id=worker.hello.worker_id, healthy=True, last_seen_s=round(now - worker.last_seen, 3),
                running=beat.running if beat else 0, waiting=beat.waiting if beat else 0,
                in_flight=len(worker.in_flight), kv_blocks_used=beat.kv_blocks_used if beat else 0,
                kv_blocks_cached=beat.kv_blocks_cached if beat else 0,
                kv_blocks_total=worker.hello.kv_blocks, metrics_address=worker.hello.metrics_address))
        self._reply(identity, Status(policy=self.policy.name, workers=workers,
                                     requests_routed=self.requests_routed,
                                     kv_events_received=self.kv_events_received))
