"""The `worker` role: an engine doing both prefill and decode, served over ZeroMQ.

One thread runs the loop: drain the router's messages without blocking, step the engine,
push each request's new tokens to the tokenizer that asked for them, publish KV events,
and refresh the load report. The loop waits on sockets only while the engine is idle.
A second thread sends that report as the heartbeat, on its own socket, so that a long
engine step never makes a healthy worker look dead.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

from msgspec.structs import replace

import numpy as np
import zmq

from common.config import ClusterConfig
from common.engine.engine import Engine, RequestOutput
from common.logs import get_logger
from common.metrics import Registry
from common.metrics_server import MetricsServer
from common.protocol import (PROTOCOL_VERSION, Abort, Error, ErrorCode, FinishedRequest, Generate, Heartbeat, Hello,
                             KvEvents, ProtocolError, Tokens, TokensBatch, Welcome, decode, params_from_sampling)
from common.sampling_params import InvalidRequestError
from common.sockets import Auth, client_socket, send, server_socket

log = get_logger("worker")
HELLO_TIMEOUT_S = 10.0
MAX_MESSAGES_PER_TURN = 256  # bounds how long one turn drains before the engine steps again


class WorkerRefused(RuntimeError):
    """The router refused this worker (protocol or model mismatch)."""


class KvEventBuffer:
    """Collects the engine's KV events (it is the BlockManager's KVEventSink) between
    publishes."""

    def __init__(self) -> None:
        self._stored: list[int] = []
        self._removed: list[int] = []

    def stored(self, block_hashes: list[int]) -> None:
        self._stored.extend(block_hashes)

    def removed(self, block_hashes: list[int]) -> None:
        self._removed.extend(block_hashes)

    def drain(self) -> tuple[list[int], list[int]]:
        drained = self._stored, self._removed
        self._stored, self._removed = [], []
        return drained


@dataclass
class RequestProgress:
    received: float  # monotonic seconds when the Generate arrived
    ttft_s: float = -1.0
    output_tokens: int = 0


class WorkerMetrics:
    def __init__(self, registry: Registry):
        self.requests = registry.counter("baton_worker_requests_total", "Requests ended, by outcome",
                                         labels=("outcome",))
        self.generated = registry.counter("baton_worker_generated_tokens_total", "Tokens generated")
        self.prefix_hits = registry.counter("baton_worker_prefix_hit_tokens_total",
                                            "Prompt tokens served from the prefix cache")
        self.queue_time = registry.histogram("baton_worker_queue_seconds", "Arrival to first step")
        self.running = registry.gauge("baton_worker_running_requests", "Requests in the running batch")
        self.waiting = registry.gauge("baton_worker_waiting_requests", "Requests waiting for admission")
        self.kv_used = registry.gauge("baton_worker_kv_blocks_used", "KV blocks referenced")
        self.kv_cached = registry.gauge("baton_worker_kv_blocks_cached", "KV blocks free but cached")


class WorkerService:
    def __init__(self, config: ClusterConfig, index: int, engine: Engine, events: KvEventBuffer):
        self.config = config
        self.index = index
        self.worker_id = f"worker-{index}"
        self.engine = engine
        self.events = events
        self.registry = Registry()
        self.metrics = WorkerMetrics(self.registry)
        self.streams: dict[str, str] = {}  # request id -> tokenizer stream address
        self.deadlines: dict[str, float] = {}
        self.finished: list[FinishedRequest] = []
        self.progress: dict[str, RequestProgress] = {}  # what the router learns when each ends
        self.context = zmq.Context()
        self.auth = Auth(self.context, config)
        self.router = client_socket(self.context, zmq.DEALER, config, config.router, self.worker_id)
        self.publisher = server_socket(self.context, zmq.PUB, config, config.worker_events_address(index))
        self.pushers: dict[str, zmq.Socket] = {}
        self.metrics_server = MetricsServer(config.host, config.worker_metrics_port(index),
                                            self.registry, self.health)
        self.last_report = 0.0
        self.reported_prefix_hits = 0
        self.beat_lock = threading.Lock()
        self.beat: Heartbeat | None = None  # the latest load report, sent by the heartbeat thread
        self.rehello = threading.Event()  # the router forgot us: say hello again
        self.instance_id = uuid.uuid4().hex
        self.beats_sent = 0
        self.joined_after_beat = 0  # rehellos answering heartbeats up to this one are stale

    # ---- lifecycle -----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.metrics_server.start()
        try:
            self._hello()
            log.info("ready", role="worker", worker_id=self.worker_id, router=self.config.router,
                     events=self.config.worker_events_address(self.index),
                     metrics=f"http://{self.config.host}:{self.metrics_server.port}/metrics")
            print(f"baton worker {self.worker_id} ready", flush=True)
            self._report()
            beats = threading.Thread(target=self._heartbeat_loop, args=(stop,), name="heartbeat", daemon=True)
            beats.start()
            while not stop.is_set():
                self._turn()
            beats.join(5)
        finally:
            self.close()

    def close(self) -> None:
        self.metrics_server.stop()
        for socket in [self.router, self.publisher, *self.pushers.values()]:
            socket.close(0)
        self.auth.stop()
        self.context.term()

    def health(self) -> dict:
        return {"ok": True, "role": "worker", "worker_id": self.worker_id, "pid": os.getpid(),
                "running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                "kv_blocks_used": self.engine.block_manager.num_used,
                "kv_blocks_total": self.engine.block_manager.num_blocks}

    def _hello(self) -> None:
        self.joined_after_beat = self.beats_sent
        engine = self.engine
        hello = Hello(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id, role="worker",
            model_fingerprint=engine.model_fingerprint, tokenizer_fingerprint=engine.tokenizer_fingerprint,
            kv_blocks=engine.block_manager.num_blocks, block_size=engine.config.block_size,
            max_model_len=engine.max_model_len, kv_dtype=engine.config.dtype,
            adapter_id=engine.config.adapter_id, instance_id=self.instance_id,
            events_address=self.config.advertised(self.config.worker_events_address(self.index)),
            metrics_address=f"http://{self.config.advertise_host or self.config.host}:{self.metrics_server.port}")
        send(self.router, hello)
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.router.poll(100):
                continue
            message, _ = self._receive()
            if isinstance(message, Welcome):
                if not message.accepted:
                    raise WorkerRefused(f"router refused {self.worker_id}: {message.reason}")
                return
        raise TimeoutError(f"no answer from the router at {self.config.router} within {HELLO_TIMEOUT_S:.0f} s")

    # ---- the loop ------------------------------------------------------------------

    def _turn(self) -> None:
        if self.rehello.is_set():
            self._rejoin()
        busy = self.engine.has_unfinished()
        wait_ms = 0 if busy else int(self.config.heartbeat_interval_s * 500)
        if self.router.poll(wait_ms):
            for _ in range(MAX_MESSAGES_PER_TURN):
                self._handle(*self._receive())
                if not self.router.poll(0):
                    break
        self._expire_deadlines()
        if self.engine.has_unfinished():
            self._emit(self.engine.step())
        self._publish_events()
        if time.monotonic() - self.last_report >= self.config.heartbeat_interval_s:
            self._report()

    def _receive(self):
        frames = self.router.recv_multipart(copy=True)
        try:
            message, payloads = decode(frames)
        except ProtocolError as error:
            log.warning("bad_message", source="router", error=str(error))
            return None, []
        return message, payloads

    def _handle(self, message, payloads: list[np.ndarray]) -> None:
        if isinstance(message, Generate):
            self._start(message, payloads[0])
        elif isinstance(message, Abort):
            if self.engine.abort(message.request_id):
                self._forget(message.request_id, "aborted")
        elif message is not None:
            log.warning("unexpected_message", type=type(message).__name__)

    def _start(self, request: Generate, prompt: np.ndarray) -> None:
        request_id = request.request_id
        self.streams[request_id] = request.stream_address
        self.progress[request_id] = RequestProgress(time.monotonic())
        try:
            params = params_from_sampling(request.sampling)
            prompt_ids = prompt.astype(np.int64).tolist()
            self.engine.add_request(request_id, prompt_ids, params, tenant_salt=request.tenant)
        except InvalidRequestError as error:
            self._fail(request_id, ErrorCode.INVALID_REQUEST, str(error))
            return
        if request.deadline:
            self.deadlines[request_id] = request.deadline

    def _expire_deadlines(self) -> None:
        if not self.deadlines:
            return
        now = time.time()
        for request_id in [r for r, deadline in self.deadlines.items() if deadline <= now]:
            self.engine.abort(request_id)
            self._fail(request_id, ErrorCode.TIMEOUT, "the request's deadline passed on the worker")

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """One TokensBatch per tokenizer per step, not one message per token."""
        batches: dict[str, list[Tokens]] = {}
        for output in outputs:
            address = self.streams.get(output.request_id)
            if address is not None:
                batches.setdefault(address, []).append(Tokens(
                    request_id=output.request_id, token_ids=output.new_token_ids, finished=output.finished,
                    finish_reason=output.finish_reason, worker_id=self.worker_id, logprobs=output.logprobs,
                    num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens))
            if output.queue_s is not None:
                self.metrics.queue_time.observe(output.queue_s)
            self._note_progress(output)
            if output.finished:
                self._forget(output.request_id, output.finish_reason or "stop")
        self.metrics.generated.inc(len(outputs))
        for address, items in batches.items():
            self._push_to(address, TokensBatch(items=items))

    def _fail(self, request_id: str, code: ErrorCode, text: str) -> None:
        self._push(request_id, Error(request_id=request_id, code=code, message=text, worker_id=self.worker_id))
        self._forget(request_id, code.value)

    def _note_progress(self, output: RequestOutput) -> None:
        progress = self.progress.get(output.request_id)
        if progress is not None and output.new_token_ids:
            if progress.ttft_s < 0:
                progress.ttft_s = time.monotonic() - progress.received
            progress.output_tokens += len(output.new_token_ids)

    def _forget(self, request_id: str, outcome: str) -> None:
        self.streams.pop(request_id, None)
        self.deadlines.pop(request_id, None)
        progress = self.progress.pop(request_id, None) or RequestProgress(0.0)
        self.finished.append(FinishedRequest(request_id, round(progress.ttft_s, 6), progress.output_tokens))
        self.metrics.requests.inc(outcome=outcome)

    def _push(self, request_id: str, message) -> None:
        address = self.streams.get(request_id)
        if address is not None:
            self._push_to(address, message)

    def _push_to(self, address: str, message) -> None:
        pusher = self.pushers.get(address)
        if pusher is None:
            pusher = client_socket(self.context, zmq.PUSH, self.config, address)
            self.pushers[address] = pusher
        try:  # never block the engine on a slow or dead tokenizer
            send(pusher, message, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("stream_backpressure_drop", stream=address)

    def _publish_events(self) -> None:
        stored, removed = self.events.drain()
        if stored or removed:
            send(self.publisher, KvEvents(worker_id=self.worker_id, stored=stored, removed=removed))

    def _rejoin(self) -> None:
        """The router dropped us (silent too long, e.g. stopped) and failed our requests
        over; finishing them now would only waste KV and compute."""
        self.rehello.clear()
        log.warning("router_forgot_worker", worker_id=self.worker_id, dropping=len(self.streams))
        for request_id in list(self.streams):
            self.engine.abort(request_id)
            # The tokenizer ignores this if the router already failed the request over.
            self._fail(request_id, ErrorCode.WORKER_LOST, f"{self.worker_id} lost contact with the router")
        self._hello()

    def _report(self) -> None:
        """Refresh the load report (and metrics) that the heartbeat thread sends."""
        engine = self.engine
        manager = engine.block_manager
        scheduler = engine.scheduler
        self.metrics.running.set(len(scheduler.running))
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.kv_used.set(manager.num_used)
        self.metrics.kv_cached.set(manager.num_cached)
        self.metrics.prefix_hits.inc(engine.stats.num_prefix_hit_tokens - self.reported_prefix_hits)
        self.reported_prefix_hits = engine.stats.num_prefix_hit_tokens
        with self.beat_lock:
            unsent = self.beat.finished if self.beat is not None else []
            self.beat = Heartbeat(
                worker_id=self.worker_id, running=len(scheduler.running), waiting=len(scheduler.waiting),
                kv_blocks_used=manager.num_used, kv_blocks_cached=manager.num_cached,
                kv_blocks_total=manager.num_blocks, prefix_hit_tokens=engine.stats.num_prefix_hit_tokens,
                computed_tokens=engine.stats.num_computed_tokens, finished=unsent + self.finished)
        self.finished = []
        self.last_report = time.monotonic()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        """Send the latest report every interval from this thread's own socket."""
        socket = client_socket(self.context, zmq.DEALER, self.config, self.config.router, f"{self.worker_id}/beat")
        try:
            while not stop.wait(self.config.heartbeat_interval_s):
                with self.beat_lock:
                    self.beats_sent += 1
                    beat, self.beat = replace(self.beat, seq=self.beats_sent), replace(self.beat, finished=[])
                send(socket, beat)
                while socket.poll(0):
                    self._on_beat_reply(socket.recv_multipart())
        except zmq.ZMQError as error:
            if not stop.is_set():
                log.error("heartbeat_failed", error=str(error))
        finally:
            socket.close(0)

    def _on_beat_reply(self, frames: list[bytes]) -> None:
        try:
            reply, _ = decode(frames)
        except ProtocolError as error:
            log.warning("bad_message", source="router", error=str(error))
            return
        if isinstance(reply, Welcome) and reply.rehello and reply.beat_seq > self.joined_after_beat:
            self.rehello.set()
