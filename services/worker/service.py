"""The engine roles' service: an engine served over ZeroMQ. One class runs all three roles
(services/worker/role.py): `worker` does both prefill and decode; `prefill` adds the lease
exposure of services/prefill/exposure.py (what it does at a prompt's end) and `decode` the
imports of services/decode/imports.py (how it takes a handed-off request), each over a KV
transport the service makes (docs/disaggregation.md).

One thread runs the loop: drain the router's messages without blocking, step the engine,
push each request's new tokens to the tokenizer that asked for them, publish KV events,
and refresh the load report. The loop waits on sockets only while the engine is idle.
A second thread sends that report as the heartbeat, on its own socket, so that a long
engine step never makes a healthy worker look dead; it stops beating once the loop has not
turned for `worker_stall_timeout_s`, so a wedged worker is dropped, and /health says so.

A router that restarted, or that dropped this worker while the link was down, answers a
heartbeat with `rehello`: the worker says Hello again listing the requests it is serving
(it keeps streaming them meanwhile: tokens go straight to the tokenizers), drops those the
router says it failed over, and reports its whole prefix cache so the index is rebuilt.

With `kvstore` on, a third thread talks to the cluster's KV store (docs/architecture.md §8):
it writes back the blocks the engine's prefix cache evicts, and fetches a prompt's blocks
the store holds past the local cache when that beats computing them; the loop hands it
jobs and takes its results without waiting.
"""
from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import zmq
from msgspec.structs import replace

from common.config import ClusterConfig
from common.engine.engine import Engine, RequestOutput
from common.kv_transfer import KvTransport, TransferOptions, transport_for_cache
from common.logs import get_logger
from common.metrics import Registry
from common.metrics_server import MetricsServer
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    ErrorCode,
    FinishedRequest,
    Generate,
    Heartbeat,
    Hello,
    KvEvents,
    ProtocolError,
    RequestsFinished,
    RunningRequest,
    Tokens,
    TokensBatch,
    Welcome,
    decode,
    pack_by_prompt_logprobs,
    params_from_sampling,
    split_prompt_logprobs,
)
from common.sampling_params import InvalidRequestError
from common.sockets import Security, check_endpoint, engine_context, send
from services.decode.imports import Imports
from services.prefill.exposure import LeaseExposure
from services.worker.kv_loads import KvLoads, LoadDone
from services.worker.kv_store_use import StoreAPI
from services.worker.role import ROLES, Role
from services.worker.store_source import StoreSource

log = get_logger("worker")
HELLO_TIMEOUT_S = 10.0
MAX_MESSAGES_PER_TURN = 256  # bounds how long one turn drains before the engine steps again
MAX_STREAMS = 64  # tokenizers pushed to at once; the least recently used is closed beyond
CACHE_REPORT_BLOCKS = 50_000  # block hashes per KvEvents message of a rejoin's cache report (~450 KB)
LOAD_POLL_MS = 2  # a turn's wait for messages while KV loads are out: their parts come on no socket


def joinable(held: Tokens, tokens: Tokens) -> bool:
    """Whether `tokens` may be appended to `held`, the same request's tokens sent
    before them and not yet sent: plain tokens both (appended at the stream's end, no
    prompt logprobs, no timings), `held` not finished, and logprobs on both or neither."""
    return (held.position < 0 and tokens.position < 0 and not held.finished
            and not (held.prompt_logprobs or tokens.prompt_logprobs or held.timings or tokens.timings)
            and bool(held.logprobs) == bool(tokens.logprobs))


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
    origin: str = ""  # the tokenizer that sent it, reported back on a rejoin
    num_prompt_tokens: int = 0
    max_tokens: int = 0
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
        self.decode_tokens = registry.counter("baton_worker_decode_tokens_total",
                                              "Tokens of decode steps (steps that prefilled nothing)")
        self.decode_seconds = registry.counter("baton_worker_decode_seconds_total",
                                               "Wall seconds of decode steps, each from its start to the next "
                                               "step's: decode tokens over these is the served decode rate")
        self.running = registry.gauge("baton_worker_running_requests", "Requests in the running batch")
        self.waiting = registry.gauge("baton_worker_waiting_requests", "Requests waiting for admission")
        self.kv_used = registry.gauge("baton_worker_kv_blocks_used", "KV blocks referenced")
        self.kv_cached = registry.gauge("baton_worker_kv_blocks_cached", "KV blocks free but cached")


class WorkerService:
    """An engine role's service. The roles differ by the parts `role` gives it: the prefill
    role's `exposure` (at a prompt's end its KV is held and the request handed off) and the
    decode role's `imports` (requests handed off to it load their KV from the store and the
    prefill worker's lease), both over its KV `transport`."""

    def __init__(self, config: ClusterConfig, index: int, engine: Engine, events: KvEventBuffer,
                 role: Role = ROLES["worker"]):
        self.config = config
        self.index = index
        self.role = role.name
        self.worker_id = f"{self.role}-{index}"
        self.engine = engine
        self.events = events
        self.registry = Registry()
        self.metrics = WorkerMetrics(self.registry)
        self.streams: dict[str, str] = {}  # request id -> tokenizer stream address
        self.deadlines: dict[str, float] = {}
        self.finished: list[FinishedRequest] = []  # ended this turn: sent when it ends
        self.progress: dict[str, RequestProgress] = {}  # what the router learns when each ends
        self.context = engine_context(config.io_cpus)
        self.security = Security(self.context, config, self.role)
        # No chosen identity: the router names each connection itself, and believes the one
        # this worker joined on (docs/architecture.md §3).
        self.router = self.security.client(zmq.DEALER, config.router, "router")
        self.publisher = self.security.server(zmq.PUB, config.worker_events_address(index), accept=("router",))
        self.pushers: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self.unsent: dict[str, list[Tokens]] = {}  # tokenizer stream address -> tokens the interval holds
        # Request id -> its last item in `unsent` while later tokens may join it (_hold_tokens).
        self.unsent_tails: dict[str, Tokens] = {}
        self.last_flush = 0.0
        self.metrics_server = MetricsServer(config.host, config.worker_metrics_port(index),
                                            self.registry, self.health)
        self.last_report = 0.0
        self.reported_prefix_hits = 0
        self.reported_decode: tuple[int, float] = (0, 0.0)  # EngineStats.decode_* at the last report
        self.beat_lock = threading.Lock()
        self.beat: Heartbeat | None = None  # the latest load report, sent by the heartbeat thread
        self.rehello = threading.Event()  # the router forgot us: say hello again
        self.instance_id = uuid.uuid4().hex
        self.session = ""  # the router's secret for this registration (Welcome.session); heartbeats carry it
        self.beats_sent = 0
        self.joined_after_beat = 0  # rehellos answering heartbeats up to this one are stale
        self.joined = False  # the router has welcomed us and not asked us to say hello again
        self.last_turn = time.monotonic()  # when the loop last went round: a stall means a wedge
        # requests whose prompt KV is arriving (common/engine/kv_connector.py)
        self.kv_loads = KvLoads(engine, self.registry)
        self.transport: KvTransport | None = None
        self.exposure: LeaseExposure | None = None
        self.imports: Imports | None = None
        self.store: StoreSource | None = None
        try:
            self._make_parts(role)
        except BaseException:
            self.close()
            raise

    def _make_parts(self, role: Role) -> None:
        config, engine = self.config, self.engine
        if role.transport:
            self.transport = transport_for_cache(config.kv_transport, engine.kv_cache, engine.model_fingerprint,
                                                 self.security, self.worker_id,
                                                 TransferOptions(send_pause_s=config.kv_send_pause_s, host=config.host))
        if config.kvstore:
            self.store = StoreSource(config, engine, self._make_store_client, self.registry)
        if role.hands_off:
            assert self.transport is not None
            self.exposure = LeaseExposure(config, self.index, engine, self.transport, self.registry,
                                          self._send_to_router)
        if role.imports:
            assert self.transport is not None
            self.imports = Imports(config, engine, self.transport, self.store, self.kv_loads, self.registry,
                                   self._send_to_router, emit=self._emit, fail=self._fail, forget=self._forget)

    def _make_store_client(self) -> StoreAPI:
        """The KV store's client, made on (and used only from) the store thread."""
        from services.kvstore.client import StoreClient  # the kvstore role's module, only when used

        # A store on another host sends the fetches over this role's KV transport; a
        # co-located worker runs none (inline frames).
        return StoreClient(self.config, self.security, self.worker_id, self.engine.kv_cache.layout,
                           transport=self.transport)

    # ---- lifecycle -----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.metrics_server.start()
        try:
            self._hello()
            log.info("ready", role=self.role, worker_id=self.worker_id, router=self.config.router,
                     events=self.config.worker_events_address(self.index),
                     metrics=f"http://{self.config.host}:{self.metrics_server.port}/metrics")
            print(f"baton {self.role} {self.worker_id} ready", flush=True)
            self._report()
            beats = threading.Thread(target=self._heartbeat_loop, args=(stop,), name="heartbeat", daemon=True)
            beats.start()
            if self.store is not None:
                self.store.start_thread()
            while not stop.is_set():
                self._turn()
            beats.join(5)
        finally:
            self.close()

    def close(self) -> None:
        try:
            if self.store is not None:
                self.store.close()
            if self.transport is not None:
                self.transport.close()
        finally:
            self.metrics_server.stop()
            self.security.stop()
            self.context.destroy(linger=0)  # closes every socket first, so this cannot block

    def stalled(self) -> bool:
        return time.monotonic() - self.last_turn > self.config.worker_stall_timeout_s

    def health(self) -> dict:
        """Ok only while requests would be served: joined to the router, loop turning."""
        stalled = self.stalled()
        health = {"ok": self.joined and not stalled, "joined": self.joined, "stalled": stalled,
                  "role": self.role, "worker_id": self.worker_id, "pid": os.getpid(),
                  "running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                  "kv_blocks_used": self.engine.block_manager.num_used,
                  "kv_blocks_total": self.engine.block_manager.num_blocks}
        return health | self.exposure.health() if self.exposure is not None else health

    def _hello(self) -> None:
        """Say Hello and wait for the Welcome (messages that come first are handled),
        saying it again when the router asks to retry (another live connection holds this
        worker id: an old process of ours not yet dropped); WorkerRefused if refused,
        TimeoutError if the router does not answer in time."""
        self.joined_after_beat = self.beats_sent
        engine = self.engine
        hello = Hello(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id, role=self.role,
            model_fingerprint=engine.model_fingerprint, tokenizer_fingerprint=engine.tokenizer_fingerprint,
            kv_blocks=engine.block_manager.num_blocks, block_size=engine.config.block_size,
            max_model_len=engine.max_model_len, kv_dtype=engine.config.dtype,
            adapter_id=engine.config.adapter_id, instance_id=self.instance_id,
            events_address=self.config.advertised(self.config.worker_events_address(self.index)),
            metrics_address=f"http://{self.config.advertise_host or self.config.host}:{self.metrics_server.port}",
            running=self._running_requests(), session=self.session,
            kv_address=self.exposure.kv_address if self.exposure is not None else "")
        send(self.router, hello)
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.router.poll(100):
                continue
            message, payloads = self._receive()
            if not isinstance(message, Welcome) or message.rehello:
                self._handle_safely(message, payloads)
                continue
            if not message.accepted and message.retry_after_s > 0:
                log.warning("hello_deferred", worker_id=self.worker_id, reason=message.reason)
                time.sleep(min(message.retry_after_s, max(deadline - time.monotonic(), 0.0)))
                send(self.router, hello)
                continue
            if not message.accepted:
                raise WorkerRefused(f"router refused {self.worker_id}: {message.reason}")
            self.session = message.session
            for request_id in message.abort:
                self.engine.abort(request_id)
                self._forget(request_id, "failed_over")
            self.joined = True
            return
        raise TimeoutError(f"no answer from the router at {self.config.router} within {HELLO_TIMEOUT_S:.0f} s")

    def _running_requests(self) -> list[RunningRequest]:
        return [RunningRequest(request_id, progress.origin, progress.num_prompt_tokens, progress.output_tokens,
                               progress.max_tokens) for request_id, progress in self.progress.items()]

    def _report_cache(self) -> None:
        """Every block of the prefix cache, for a router that rebuilds its index."""
        cached = self.engine.block_manager.names()
        for start in range(0, len(cached), CACHE_REPORT_BLOCKS):
            send(self.router, KvEvents(worker_id=self.worker_id, stored=cached[start:start + CACHE_REPORT_BLOCKS]))

    # ---- the loop ------------------------------------------------------------------

    def _turn(self) -> None:
        self.last_turn = time.monotonic()
        if self.rehello.is_set():
            self._rejoin()
        if self.router.poll(self._wait_ms()):
            for _ in range(MAX_MESSAGES_PER_TURN):
                self._handle_safely(*self._receive())
                if not self.router.poll(0):
                    break
        self._expire_deadlines()
        if self.store is not None:
            self.store.observe_engine()
        for done in self.kv_loads.tend():
            self._load_done(done)
        if self.exposure is not None:
            self.exposure.tend()
        if self.imports is not None:
            self.imports.tend()
        if self.engine.has_unfinished():
            self._emit(self.engine.step())
        if self.unsent and self._flush_wait_s() <= 0:
            self._flush()
        self._publish_events()
        self._send_finished()
        if time.monotonic() - self.last_report >= self.config.heartbeat_interval_s:
            self._report()

    def _wait_ms(self) -> int:
        """How long a turn may wait for a message: not at all while the engine has work."""
        wait_ms = 0 if self.engine.has_unfinished() else int(self.config.heartbeat_interval_s * 500)
        if self.unsent:  # never negative: poll(-1) would wait for a message, however long
            wait_ms = min(wait_ms, max(0, math.ceil(self._flush_wait_s() * 1000)))
        return min(wait_ms, LOAD_POLL_MS) if self.kv_loads.parts_out else wait_ms

    def _receive(self):
        frames = self.router.recv_multipart(copy=True)
        try:
            message, payloads = decode(frames)
        except ProtocolError as error:
            log.warning("bad_message", source="router", error=str(error))
            return None, []
        return message, payloads

    def _handle_safely(self, message, payloads: list[np.ndarray]) -> None:
        """One message's failure is logged and ends no more than that message."""
        try:
            self._handle(message, payloads)
        except Exception:  # noqa: BLE001 (the loop serves every other request; it must go on)
            log.exception("message_failed", type=type(message).__name__,
                          request_id=getattr(message, "request_id", None))

    def _handle(self, message, payloads: list[np.ndarray]) -> None:
        if isinstance(message, Generate):
            try:
                check_endpoint(message.stream_address)
            except ValueError as error:  # nowhere to send an error: the router checks this first
                log.warning("bad_stream_address", request_id=message.request_id, error=str(error))
                return
            self._start(message, payloads[0])
        elif isinstance(message, Abort):
            if self._abort(message.request_id):
                self._forget(message.request_id, "aborted")
        elif isinstance(message, Welcome) and message.rehello:  # the router does not know this connection
            self.rehello.set()
        elif message is not None and not self._role_message(message):
            log.warning("unexpected_message", type=type(message).__name__)

    def _role_message(self, message) -> bool:
        """A message only this role's parts take (lease updates, pull verdicts); False if
        it is not one."""
        return (self.exposure is not None and self.exposure.handle(message)) or \
            (self.imports is not None and self.imports.handle(message))

    def _start(self, request: Generate, prompt: np.ndarray) -> None:
        request_id = request.request_id
        if request_id in self.progress:
            log.warning("duplicate_request", request_id=request_id)
            return
        self.streams[request_id] = request.stream_address
        self.progress[request_id] = RequestProgress(time.monotonic(), request.origin, len(prompt),
                                                    request.sampling.max_tokens)
        if request.deadline:
            self.deadlines[request_id] = request.deadline
        try:
            self._admit(request, prompt.astype(np.int64).tolist())
        except InvalidRequestError as error:
            self._fail(request_id, ErrorCode.INVALID_REQUEST, str(error))

    def _admit(self, request: Generate, prompt_ids: list[int]) -> None:
        """Hand the request to the engine (InvalidRequestError names a bad parameter):
        through the KV store when it holds the prompt's blocks past the local cache. A
        handed-off request goes to the decode role's imports; on a prefill worker the engine
        computes the first token only and holds the KV for the hand-off."""
        store_hint = self.store.hint(request, len(prompt_ids)) if self.store is not None else None
        if request.kv_handle is not None and self.imports is not None:
            self.imports.admit(request, prompt_ids, store_hint)
            return
        hold_kv = self.exposure is not None
        if self.exposure is not None:
            params = self.exposure.admit(request, prompt_ids, self.session)
        else:
            params = params_from_sampling(request.sampling)
        if self.store is None or not self.store.accepting():
            self.engine.add_request(request.request_id, prompt_ids, params, tenant_salt=request.tenant,
                                    hold_kv=hold_kv)
            return
        # The store is asked for the prompt's blocks past the local cache when it is worth
        # it (it holds them, as the router's index says, and fetching beats computing).
        sources, recompute = (self.store,), self.store.recompute_s
        load = self.engine.add_request(request.request_id, prompt_ids, params, tenant_salt=request.tenant,
                                       hold_kv=hold_kv, plan=self.kv_loads.plan(sources, recompute),
                                       store_hint=store_hint)
        if load is not None:
            self.kv_loads.begin(load, sources, recompute)

    def _load_done(self, done: LoadDone) -> None:
        """A load's sources are done: a handed-off request's is the imports'; any other
        request prefills what did not land (or ends, if it was aborted meanwhile). Blocks a
        source may still write stay out of use."""
        if self.imports is not None and self.imports.load_done(done):
            return
        if not done.settled:
            log.error("kv_blocks_quarantined", request_id=done.load.request_id)
            return
        self._emit(self.engine.complete_load(done.load.request_id, done.landed))

    def _abort(self, request_id: str) -> bool:
        """Stop a request this worker serves; False if it serves no such request."""
        if self.imports is not None and self.imports.abort(request_id):
            return True
        return self.engine.abort(request_id)

    def _expire_deadlines(self) -> None:
        if not self.deadlines:
            return
        now = time.time()
        for request_id in [r for r, deadline in self.deadlines.items() if deadline <= now]:
            self._abort(request_id)
            self._fail(request_id, ErrorCode.TIMEOUT, "the request's deadline passed on the worker")

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hold the step's tokens for their tokenizers, and send what is held at once when
        a request's first or last tokens are among them; else the turn sends it once the
        stream interval has passed: steps shorter than the interval share one send
        (docs/architecture.md §4). On a prefill worker a request whose prompt's end is among
        them is handed off (after its first token is pushed, so that the token usually
        reaches the tokenizer before the decode worker's copy: either order is right,
        Tokens.position)."""
        try:
            self._hold(outputs)
        finally:
            if self.exposure is not None:
                self.exposure.send_ready(self.session, self.joined)

    def _hold(self, outputs: list[RequestOutput]) -> None:
        urgent = False
        generated = 0
        for output in outputs:
            progress = self.progress.get(output.request_id)
            first = progress is not None and progress.output_tokens == 0
            address = self.streams.get(output.request_id)
            tokens = self._tokens(output)
            handed_off = False
            if self.exposure is not None and output.kv_lease is not None:
                tokens, handed_off = self.exposure.hand_off(output, tokens, progress.received if progress else None)
            if address is not None:
                self._hold_tokens(address, tokens)
                urgent = urgent or first or tokens.finished or tokens.position >= 0 or bool(tokens.prompt_logprobs)
            if output.queue_s is not None:
                self.metrics.queue_time.observe(output.queue_s)
            self._note_progress(output)
            generated += len(output.new_token_ids)
            if handed_off:  # KvReady reports it to the router
                self._forget(output.request_id, "handed_off", report=False)
            elif tokens.finished:
                self._forget(output.request_id, output.finish_reason or "stop")
        self.metrics.generated.inc(generated)
        if urgent:
            self._flush()

    def _hold_tokens(self, address: str, tokens: Tokens) -> None:
        """Hold `tokens` for the tokenizer at `address`: appended to the request's held
        item where both are plain tokens (one message, and one stream event, for every
        step the interval held), else an item of their own."""
        tail = self.unsent_tails.get(tokens.request_id)
        if tail is not None and joinable(tail, tokens):
            tail.token_ids = tail.token_ids + tokens.token_ids
            if tokens.logprobs:
                tail.logprobs = tail.logprobs + tokens.logprobs
            tail.finished, tail.finish_reason = tokens.finished, tokens.finish_reason
            tail.num_prompt_tokens, tail.num_cached_tokens = tokens.num_prompt_tokens, tokens.num_cached_tokens
            return
        self.unsent.setdefault(address, []).append(tokens)
        self.unsent_tails[tokens.request_id] = tokens

    def _flush_wait_s(self) -> float:
        """How long until the held tokens are due (<= 0: now)."""
        return self.last_flush + self.config.stream_interval_ms / 1000 - time.monotonic()

    def _flush(self, only: str | None = None) -> None:
        """Send the held tokens (of one tokenizer: `only`): one TokensBatch per tokenizer,
        more where prompt logprobs would not fit one message (docs/wire.md §3)."""
        addresses = [only] if only is not None else list(self.unsent)
        for address in addresses:
            items = self.unsent.pop(address, None)
            if not items:
                continue
            for item in items:
                self.unsent_tails.pop(item.request_id, None)
            if not any(item.prompt_logprobs for item in items):
                self._send_to(address, TokensBatch(items=items))
                continue
            pieces = [piece for item in items for piece in split_prompt_logprobs(item)]
            for group in pack_by_prompt_logprobs(pieces):
                self._send_to(address, TokensBatch(items=group))
        if only is None:
            self.last_flush = time.monotonic()

    def _tokens(self, output: RequestOutput) -> Tokens:
        """What the tokenizer gets of one output."""
        tokens = Tokens(request_id=output.request_id, token_ids=output.new_token_ids, finished=output.finished,
                        finish_reason=output.finish_reason, worker_id=self.worker_id, logprobs=output.logprobs,
                        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
                        prompt_logprobs=output.prompt_logprobs, prompt_logprobs_start=output.prompt_logprobs_start)
        return self.imports.tokens(output, tokens) if self.imports is not None else tokens

    def _fail(self, request_id: str, code: ErrorCode, text: str) -> None:
        self._push(request_id, Error(request_id=request_id, code=code, message=text, worker_id=self.worker_id))
        self._forget(request_id, code.value)

    def _note_progress(self, output: RequestOutput) -> None:
        progress = self.progress.get(output.request_id)
        if progress is not None and output.new_token_ids:
            if progress.ttft_s < 0:
                progress.ttft_s = time.monotonic() - progress.received
            progress.output_tokens += len(output.new_token_ids)

    def _forget(self, request_id: str, outcome: str, report: bool = True) -> None:
        """Stop tracking a request; `report` tells the router it ended here (a prefill
        worker's hand-off is reported by KvReady instead)."""
        self.streams.pop(request_id, None)
        self.deadlines.pop(request_id, None)
        if self.exposure is not None:
            self.exposure.forget(request_id, outcome)
        progress = self.progress.pop(request_id, None) or RequestProgress(0.0)
        if report:
            self.finished.append(FinishedRequest(request_id, round(progress.ttft_s, 6), progress.output_tokens))
        self.metrics.requests.inc(outcome=outcome)

    def _push(self, request_id: str, message) -> None:
        address = self.streams.get(request_id)
        if address is not None:
            self._push_to(address, message)

    def _push_to(self, address: str, message) -> None:
        """Send `message` after the tokens held for the same tokenizer (an error ends a
        stream after its tokens)."""
        self._flush(only=address)
        self._send_to(address, message)

    def _send_to(self, address: str, message) -> None:
        pusher = self.pushers.get(address)
        if pusher is None:
            if len(self.pushers) >= MAX_STREAMS:
                self.pushers.popitem(last=False)[1].close(0)
            pusher = self.pushers[address] = self.security.client(zmq.PUSH, address, "tokenizer")
        self.pushers.move_to_end(address)
        try:  # never block the engine on a slow or dead tokenizer
            send(pusher, message, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("stream_backpressure_drop", stream=address)

    def _publish_events(self) -> None:
        stored, removed = self.events.drain()
        if stored or removed:
            send(self.publisher, KvEvents(worker_id=self.worker_id, stored=stored, removed=removed))

    def _rejoin(self) -> None:
        """The router does not know us (it restarted, or dropped us while we were cut off
        or stopped): join again with what we are serving, and report our cache."""
        self.rehello.clear()
        self.joined = False
        log.warning("rejoining_router", worker_id=self.worker_id, running=len(self.progress))
        try:
            self._hello()
        except TimeoutError as error:  # the router went away again: the next rehello retries
            log.error("rejoin_failed", error=str(error))
            return
        self._report_cache()
        if self.exposure is not None:  # hand-offs this router may never have had
            self.exposure.rejoined(self.session)

    def _send_to_router(self, message, payloads: list[np.ndarray]) -> None:
        send(self.router, message, payloads)

    def _send_finished(self) -> None:
        """Tell the router at once which requests ended (its loads count them until then).
        Never blocks the engine: if the socket's queue is full they go with a later turn."""
        if not self.finished:
            return
        try:
            send(self.router, RequestsFinished(finished=self.finished), flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        self.finished = []

    def _report(self) -> None:
        """Refresh the load report (and metrics) that the heartbeat thread sends."""
        engine = self.engine
        manager = engine.block_manager
        scheduler = engine.scheduler
        self.metrics.running.set(len(scheduler.running))
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.kv_used.set(manager.num_used)
        self.metrics.kv_cached.set(manager.num_cached)
        stats = engine.stats
        self.metrics.prefix_hits.inc(stats.num_prefix_hit_tokens - self.reported_prefix_hits)
        self.metrics.decode_tokens.inc(stats.decode_tokens - self.reported_decode[0])
        self.metrics.decode_seconds.inc(stats.decode_seconds - self.reported_decode[1])
        self.reported_prefix_hits = stats.num_prefix_hit_tokens
        self.reported_decode = (stats.decode_tokens, stats.decode_seconds)
        if self.store is not None:
            self.store.report()
        if self.exposure is not None:
            self.exposure.report()
        with self.beat_lock:
            self.beat = Heartbeat(
                worker_id=self.worker_id, running=len(scheduler.running), waiting=len(scheduler.waiting),
                kv_blocks_used=manager.num_used, kv_blocks_cached=manager.num_cached,
                kv_blocks_total=manager.num_blocks, prefix_hit_tokens=stats.num_prefix_hit_tokens,
                computed_tokens=stats.num_computed_tokens)
        self.last_report = time.monotonic()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        """Send the latest report every interval from this thread's own socket."""
        socket = self.security.client(zmq.DEALER, self.config.router, "router")
        try:
            while not stop.wait(self.config.heartbeat_interval_s):
                if self.stalled():
                    log.error("worker_stalled", since_s=round(time.monotonic() - self.last_turn, 1))
                    continue  # let the router drop a worker that serves nothing
                with self.beat_lock:
                    assert self.beat is not None  # run() makes the first report before it starts this thread
                    self.beats_sent += 1
                    beat = replace(self.beat, seq=self.beats_sent, session=self.session)
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

