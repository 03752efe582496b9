"""The `tokenizer` role: the cluster's front door.

It owns the client sockets (the SDK's ROUTER socket and the HTTP gateway), turns text
into token ids, sends each request to the router, receives the worker's tokens on a PULL
socket, detokenises them incrementally (holding back text that could still become a stop
string) and streams the result to the client. A worker lost before it streamed anything
is retried transparently; after that the client gets a typed error.

While the router is unreachable (no status answer within `worker_timeout_s`, or no
connection to it at all) new requests are refused at once with ServerUnavailable and a
retry_after_s, and so are those sent that it never acknowledged as placed (Placed);
streams already running go on, since workers push tokens here directly. A router that
restarts sooner than that answers as another instance (Status.instance_id), and what was
sent to the old one and never placed fails the same way.
Tokens for a request this tokenizer does not know (it restarted, or the request ended
here first) make it abort that request upstream, so no worker computes for nobody.
The timings workers attach to a disaggregated request's Tokens (its queue, prefill, decode
wait and KV transfer) are checked, merged over its stream and sent on its final event: the
SDK's final Chunk, and the HTTP gateway's usage (`ttft_split`, docs/openai-api.md).
A text prompt is held to `prompt_byte_limit` before it is tokenized, and a long one is
tokenized on `pool`, off the event loop, on either door (services/tokenizer/text_prompts.py).
An empty text prompt is tokenized like any other, as the HTTP gateway and vLLM do: served
when the tokenizer adds a BOS token, refused as empty when it adds nothing.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import zmq
import zmq.asyncio
from msgspec.structs import replace

from common.config import ClusterConfig, UnknownSloClass
from common.detokenizer import IncrementalDetokenizer
from common.engine.checkpoint import load_model_config, load_tokenizer
from common.errors import (
    BatonError,
    InternalError,
    InvalidRequest,
    RequestTimeout,
    ServerUnavailable,
    Unauthorized,
    error_from_code,
)
from common.logs import get_logger
from common.metrics import Registry
from common.protocol import (
    MAX_BODY_BYTES,
    Abort,
    Chunk,
    ChunkBatch,
    Error,
    ErrorCode,
    Generate,
    Placed,
    ProtocolError,
    Status,
    StatusRequest,
    Submit,
    Tokens,
    TokensBatch,
    decode,
    encode,
    pack_by_prompt_logprobs,
    params_from_sampling,
    peek_request_id,
    sampling_from_params,
)
from common.sampling_params import InvalidRequestError, SamplingParams, validate_prompt
from common.sockets import ENGINE_ROLES, Security, split_routed
from services.tokenizer.frontend_api import StreamEvent
from services.tokenizer.text_prompts import INLINE_PROMPT_CHARS, TokenizePool, prompt_byte_limit, token_byte_bound

log = get_logger("tokenizer")
MAX_TRANSPARENT_RETRIES = 2
STREAM_QUEUE_LIMIT = 4096
ROUTER_WAIT_S = 10.0
UNAVAILABLE_RETRY_AFTER_S = 1.0
RECENT_ABORTS = 4096  # unknown requests already aborted upstream, so each is aborted once
TIMING_KEYS = frozenset({"queue_s", "prefill_s", "decode_wait_s", "transfer_s"})  # Tokens.timings' known keys


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    detokenizer: IncrementalDetokenizer
    deadline: float
    slo_class: str = ""  # the resolved class; "" = none
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(STREAM_QUEUE_LIMIT))
    released_chars: int = 0
    tokens_sent: int = 0
    retries: int = 0
    placed: bool = False  # the router said it is on a worker (or a token came)
    unplaceable: bool = False  # failed because the router was lost before placing it
    router_instance: str = ""  # the router instance it was sent to (the last that answered a status)
    first_token_at: float | None = None
    done: bool = False
    lost_workers: set[str] = field(default_factory=set)  # a late token from these is stale
    sink: Callable[[object], None] | None = None  # takes events directly (SDK) instead of `queue`
    timer: asyncio.TimerHandle | None = None
    timings: dict[str, float] = field(default_factory=dict)  # the valid Tokens.timings so far, merged
    prompt_logprobs_sent: int = 0  # prompt logprob records delivered (params.prompt_logprobs)
    held: list[Tokens] = field(default_factory=list)  # tokens that came before the prompt logprobs did

    @property
    def awaits_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_sent < len(self.prompt_ids)


def valid_timings(message: Tokens) -> dict[str, float]:
    """The entries of a worker's `Tokens.timings` kept for the client: a known key
    (TIMING_KEYS) with a finite, non-negative number. A worker's message is input from
    outside this process: anything else is dropped, with a debug log."""
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for key, value in message.timings.items():
        if key in TIMING_KEYS and type(value) in (int, float) and 0 <= value < math.inf:
            kept[key] = float(value)
        else:
            dropped.append(key[:64])
    if dropped:
        log.debug("timings_dropped", request_id=message.request_id, worker_id=message.worker_id,
                  keys=dropped[:8], count=len(dropped))
    return kept


class TokenizerMetrics:
    def __init__(self, registry: Registry):
        self.ttft = registry.histogram("baton_ttft_seconds", "Time to first token")
        self.tpot = registry.histogram("baton_tpot_seconds", "Time per output token after the first")
        self.e2e = registry.histogram("baton_e2e_seconds", "Request latency, arrival to last token")
        self.requests = registry.counter("baton_requests_total", "Requests by outcome", labels=("outcome",))
        self.retries = registry.counter("baton_request_retries_total", "Requests re-placed after a lost worker")
        self.bad_messages = registry.counter("baton_tokenizer_bad_messages_total", "Malformed messages")
        self.running = registry.gauge("baton_tokenizer_requests_in_flight", "Requests in flight")


class TokenizerService:
    """Implements services.tokenizer.frontend_api.FrontendApi over the cluster."""

    def __init__(self, config: ClusterConfig, model_dir: Path):
        self.config = config
        self.tokenizer = load_tokenizer(model_dir)
        model_config = load_model_config(model_dir)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(config.max_model_len or model_config.context_limit, model_config.context_limit)
        self.prompt_byte_limit = prompt_byte_limit(token_byte_bound(self.tokenizer.to_str()), self.max_model_len,
                                                   config.max_prompt_bytes)
        self.pool = TokenizePool()
        self.model_name = config.model_name
        self.model_dir = model_dir
        self.registry = Registry()
        self.metrics = TokenizerMetrics(self.registry)
        self.registry.gauge("baton_tokenizer_workers", "Healthy workers the router reports",
                            collect=lambda: len(self.last_status.workers) if self.last_status else 0)
        self.requests: dict[str, RequestState] = {}
        self.sdk_requests: dict[tuple[bytes, str], RequestState] = {}  # (client, its id) -> request
        self.sdk_tokenizing: dict[tuple[bytes, str], asyncio.Task] = {}  # long text prompts on the pool
        self.outbox: dict[bytes, list[Chunk]] = {}
        self.last_status: Status | None = None
        self.last_status_at = 0.0
        self.identity = f"tokenizer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.aborted_unknown: OrderedDict[str, None] = OrderedDict()
        self.context = zmq.asyncio.Context()
        self.security = Security(self.context, config, "tokenizer")
        self.sdk = self.security.server(zmq.ROUTER, config.sdk, accept=("client",))
        self.stream = self.security.server(zmq.PULL, config.stream, accept=ENGINE_ROLES)
        self.router = self.security.client(zmq.DEALER, config.router, "router", self.identity)
        self.router.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a router that is not there

    # ---- FrontendApi ---------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        if len(text) > INLINE_PROMPT_CHARS:  # encode_batch releases the GIL while it works; encode does not
            return self.tokenizer.encode_batch([text])[0].ids
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tenant_for(self, api_key: str | None) -> str:
        if not self.config.api_keys:
            return ""
        tenant = self.config.api_keys.get(api_key or "")
        if tenant is None:
            raise Unauthorized("missing or unknown API key")
        return tenant

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       tenant: str, timeout_s: float = 0.0, slo_class: str = "") -> AsyncIterator[StreamEvent]:
        state = self._admit(request_id, prompt_ids, params, tenant, timeout_s, slo_class=slo_class)
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BatonError):
                    self.metrics.requests.inc(outcome=item.code.value)
                    raise item
                yield item
                if item.finished:
                    self._record_finish(state, item)
                    return
        finally:
            self._release(state)

    async def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is not None and not state.done:
            state.done = True
            await self._send_router(Abort(request_id=request_id))
            self._deliver(state, StreamEvent([], "", finished=True, finish_reason="abort", timings=dict(state.timings)))

    def router_reachable(self) -> bool:
        return time.monotonic() - self.last_status_at < self.config.worker_timeout_s

    def health(self) -> dict:
        fresh = self.router_reachable()
        workers = len(self.last_status.workers) if self.last_status and fresh else 0
        return {"ok": fresh and workers > 0, "role": "tokenizer", "pid": os.getpid(), "router_reachable": fresh,
                "workers": workers, "in_flight": len(self.requests)}

    def metrics_text(self) -> str:
        return self.registry.render()

    # ---- requests ------------------------------------------------------------------

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tenant: str,
               timeout_s: float, sink: Callable[[object], None] | None = None,
               slo_class: str = "") -> RequestState:
        """Validate, register and place a request; its events go to `sink` if given,
        else to its queue. Every admitted request ends with `_release`."""
        if not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
            raise InvalidRequest(f"timeout_s: must be a finite number >= 0 (0 = the server's default), "
                                 f"got {timeout_s!r}")
        timeout_s = timeout_s if timeout_s > 0 else self.config.request_timeout_s
        try:
            params.validate(self.vocab_size)
            validate_prompt(prompt_ids, self.vocab_size, self.max_model_len)
            slo_class = self._resolve_slo_class(slo_class, tenant)
        except (InvalidRequestError, UnknownSloClass) as error:
            self.metrics.requests.inc(outcome="invalid_request")
            raise InvalidRequest(str(error)) from None
        if request_id in self.requests:
            raise InvalidRequest(f"request_id: {request_id!r} is already in flight")
        state = RequestState(request_id, list(prompt_ids), params, tenant,
                             IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop),
                             deadline=time.monotonic() + timeout_s, slo_class=slo_class)
        state.sink = sink
        self.requests[request_id] = state
        self.metrics.running.set(len(self.requests))
        try:
            self._arm_first_token_timer(state, timeout_s)
            self._place(state)
        except Exception as error:  # a registered request never leaks: it ends, typed
            state.done = True  # the router never took it: nothing to abort
            self._release(state)
            raise self._typed(error) from None
        return state

    # One timer per request, rather than a timed wait per token: until the first token it
    # holds the first-token deadline, then the request's own.

    def _arm_first_token_timer(self, state: RequestState, timeout_s: float) -> None:
        first_token_s = self.config.first_token_timeout_s
        if first_token_s >= timeout_s:
            self._arm_request_timer(state)
            return
        state.timer = asyncio.get_running_loop().call_later(first_token_s, self._first_token_expired,
                                                            state, first_token_s)

    def _arm_request_timer(self, state: RequestState) -> None:
        if state.timer is not None:
            state.timer.cancel()
        timeout_s = state.deadline - state.arrival
        state.timer = asyncio.get_running_loop().call_later(
            max(state.deadline - time.monotonic(), 0.0), self._deliver, state,
            RequestTimeout(f"no result within {timeout_s:.1f} s"))

    def _first_token_expired(self, state: RequestState, first_token_s: float) -> None:
        if state.done or state.first_token_at is not None:
            return
        state.done = True
        asyncio.ensure_future(self._send_router(Abort(request_id=state.request_id, reason="first token timeout")))
        self._deliver(state, RequestTimeout(f"no token within first_token_timeout_s ({first_token_s:g} s)"))

    @staticmethod
    def _typed(error: Exception) -> BatonError:
        if isinstance(error, BatonError):
            return error
        log.error("request_failed", error=f"{type(error).__name__}: {error}", exc_info=error)
        return InternalError(f"the request could not be sent: {type(error).__name__}")

    def _resolve_slo_class(self, name: str, tenant: str) -> str:
        """The name of the request's SLO class ("" for none); the router gets it resolved,
        so every role agrees on it. Raises UnknownSloClass for a name not configured."""
        slo_class = self.config.slo_class(name, tenant)
        return slo_class.name if slo_class is not None else ""

    def _release(self, state: RequestState) -> None:
        """Forget a request; one that did not finish is aborted on its worker."""
        if state.timer is not None:
            state.timer.cancel()
        self.requests.pop(state.request_id, None)
        self.metrics.running.set(len(self.requests))
        if not state.done:
            state.done = True
            asyncio.ensure_future(self._send_router(Abort(request_id=state.request_id, reason="client gone")))

    def _place(self, state: RequestState) -> None:
        """Send the request to the router; ServerUnavailable if the router is unreachable."""
        if not self.router_reachable():
            raise ServerUnavailable("the router is not reachable", UNAVAILABLE_RETRY_AFTER_S)
        generate = Generate(request_id=state.request_id, sampling=sampling_from_params(state.params),
                            stream_address=self.config.advertised(self.config.stream), tenant=state.tenant,
                            arrival_time=time.time(),
                            deadline=time.time() + max(state.deadline - time.monotonic(), 0.0),
                            slo_class=state.slo_class)
        frames = encode(generate, [state.prompt_ids])
        if len(frames[1]) > MAX_BODY_BYTES:
            raise InvalidRequest(f"sampling: the request's message is {len(frames[1])} bytes, over the "
                                 f"protocol's limit of {MAX_BODY_BYTES}")
        state.placed = False
        state.router_instance = self.last_status.instance_id if self.last_status else ""
        if not self._send_now(frames):
            raise ServerUnavailable("the router is not reachable", UNAVAILABLE_RETRY_AFTER_S)

    def _send_now(self, frames: list) -> bool:
        """Send to the router unless no connection to it is up (IMMEDIATE): never queued
        for a router that is not there."""
        # An asyncio Future (pyzmq's annotation says only Awaitable).
        sent = cast("asyncio.Future[zmq.MessageTracker | None]",
                    self.router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False))
        return not (sent.done() and sent.exception() is not None)

    def _fail_unplaced(self, kept_instance: str | None = None) -> None:
        """The router is lost: what it never said it placed will not be (a request it did
        place anyway gets its tokens aborted here as unknown). With `kept_instance`, the
        router restarted as that instance: only what was sent to another is lost."""
        for state in [s for s in self.requests.values() if not (s.placed or s.done or s.unplaceable)
                      and s.router_instance != kept_instance]:
            state.unplaceable = True
            self._deliver(state, ServerUnavailable("the router became unreachable before placing the request",
                                                   UNAVAILABLE_RETRY_AFTER_S))

    async def _send_router(self, message) -> None:
        try:
            await self.router.send_multipart(encode(message), copy=False)
        except zmq.ZMQError as error:
            log.warning("router_send_failed", error=str(error))

    def _record_finish(self, state: RequestState, event: StreamEvent) -> None:
        state.done = True
        now = time.monotonic()
        self.metrics.requests.inc(outcome=event.finish_reason or "stop")
        self.metrics.e2e.observe(now - state.arrival)
        if state.first_token_at is not None and state.tokens_sent > 1:
            self.metrics.tpot.observe((now - state.first_token_at) / (state.tokens_sent - 1))

    def _on_tokens(self, message: Tokens) -> None:
        state = self.requests.get(message.request_id)
        if state is None and not message.finished:
            self._abort_unknown(message.request_id)
        if state is None or state.done or message.worker_id in state.lost_workers:
            return
        state.placed = True
        state.timings.update(valid_timings(message))
        if state.params.prompt_logprobs is None:
            self._on_new_tokens(state, message)
            return
        self._deliver_prompt_logprobs(state, message)
        if state.awaits_prompt_logprobs:
            # A disaggregated request's decode worker may stream before the prefill
            # worker's last prompt logprobs arrive: its tokens wait for them.
            if message.token_ids or message.finished:
                state.held.append(message)
            return
        held, state.held = state.held, []
        for item in [message, *held]:
            if not state.done and (item.token_ids or item.finished):
                self._on_new_tokens(state, item)

    def _deliver_prompt_logprobs(self, state: RequestState, message: Tokens) -> None:
        """The prompt logprob records of `message` the request has not had: each comes
        once, in prompt order, whichever worker sent it (a retry on another worker, or
        a prefill worker, computes them from the start: docs/wire.md §3)."""
        skip = state.prompt_logprobs_sent - message.prompt_logprobs_start
        if not message.prompt_logprobs or skip < 0:
            return
        records = message.prompt_logprobs[skip:len(state.prompt_ids) - message.prompt_logprobs_start]
        if records:
            state.prompt_logprobs_sent += len(records)
            self._deliver(state, StreamEvent([], "", num_prompt_tokens=message.num_prompt_tokens,
                                             num_cached_tokens=message.num_cached_tokens, prompt_logprobs=records))

    def _on_new_tokens(self, state: RequestState, message: Tokens) -> None:
        unseen = _unseen(message, state.tokens_sent)
        if unseen is None:
            return
        message = unseen
        if state.first_token_at is None and message.token_ids:
            state.first_token_at = time.monotonic()
            self._arm_request_timer(state)
            self.metrics.ttft.observe(state.first_token_at - state.arrival)
        state.tokens_sent += len(message.token_ids)
        detokenizer = state.detokenizer
        stopped = False
        for index, token_id in enumerate(message.token_ids):
            if detokenizer.find_stop(detokenizer.push(token_id)) is not None:
                stopped = True
                if index + 1 < len(message.token_ids):  # a message of several steps: what came after is not output
                    message = replace(message, token_ids=message.token_ids[:index + 1],
                                      logprobs=message.logprobs[:index + 1])
                break
        finished = message.finished or stopped
        text = self._releasable_text(state, finished)
        event = StreamEvent(message.token_ids, text, finished,
                            "stop" if stopped else message.finish_reason,
                            message.num_prompt_tokens, message.num_cached_tokens, message.logprobs,
                            timings=dict(state.timings) if finished else {})
        if stopped and not message.finished:
            asyncio.ensure_future(self._send_router(Abort(request_id=state.request_id, reason="stop string")))
        self._deliver(state, event)

    def _on_tokens_checked(self, message: Tokens) -> None:
        """Tokens that cannot be detokenised (ids outside the vocabulary, say) fail their
        request, typed, rather than the loop that serves every request."""
        try:
            bad = [token_id for token_id in message.token_ids if not 0 <= token_id < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            self._on_tokens(message)
        except Exception as error:
            log.error("bad_tokens", request_id=message.request_id, worker_id=message.worker_id,
                      error=f"{type(error).__name__}: {error}")
            state = self.requests.get(message.request_id)
            if state is not None and not state.done:
                self._deliver(state, InternalError(f"the worker's tokens could not be decoded: {error}"))

    def _abort_unknown(self, request_id: str) -> None:
        if request_id in self.aborted_unknown:
            return
        self.aborted_unknown[request_id] = None
        if len(self.aborted_unknown) > RECENT_ABORTS:
            self.aborted_unknown.popitem(last=False)
        asyncio.ensure_future(self._send_router(Abort(request_id=request_id, reason="unknown to the tokenizer")))

    @staticmethod
    def _releasable_text(state: RequestState, finished: bool) -> str:
        """New text, less a tail that could be the start of a stop string."""
        text = state.detokenizer.text
        end = len(text)
        if not finished and state.detokenizer.longest_stop > 1:
            end = max(state.released_chars, end - (state.detokenizer.longest_stop - 1))
        released = text[state.released_chars:end]
        state.released_chars = end
        return released

    def _on_error(self, message: Error) -> None:
        if not message.request_id:
            log.warning("peer_reported_error", code=message.code.value, message=message.message)
            return
        state = self.requests.get(message.request_id)
        if state is None or state.done:
            return
        if message.worker_id in state.lost_workers:
            return  # that worker was already given up on for this request
        if message.worker_id:
            state.lost_workers.add(message.worker_id)
        if message.code == ErrorCode.WORKER_LOST and state.tokens_sent == 0 \
                and state.retries < MAX_TRANSPARENT_RETRIES:
            state.retries += 1
            self.metrics.retries.inc()
            log.warning("request_replaced", request_id=state.request_id, why=message.message)
            try:
                self._place(state)
            except Exception as error:
                self._deliver(state, self._typed(error))
            return
        self._deliver(state, error_from_code(message.code, message.message, message.retry_after_s))

    def _deliver(self, state: RequestState, item) -> None:
        if state.sink is not None:
            state.sink(item)
            return
        try:
            state.queue.put_nowait(item)
        except asyncio.QueueFull:
            log.error("stream_queue_full", request_id=state.request_id)
            state.queue = asyncio.Queue(1)
            state.queue.put_nowait(ServerUnavailable("the client is not reading its stream"))

    # ---- the loops -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event, serve_http=None) -> None:
        """Serve until `stop` is set; `serve_http(stop)` runs the HTTP gateway beside."""
        tasks = [asyncio.create_task(loop()) for loop in
                 (self._stream_loop, self._router_loop, self._sdk_loop, self._status_loop)]
        if serve_http is not None:
            tasks.append(asyncio.create_task(serve_http(stop)))
        await self._await_router(ROUTER_WAIT_S)
        log.info("ready", role="tokenizer", sdk=self.config.sdk, stream=self.config.stream,
                 router=self.config.router, router_reachable=self.last_status is not None,
                 max_prompt_bytes=self.prompt_byte_limit.max_bytes)
        print(f"baton tokenizer ready: sdk {self.config.sdk}", flush=True)
        try:
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception() if task is not stopper else None
                if error is not None:
                    raise error
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    async def _await_router(self, timeout_s: float) -> None:
        """Give the router a moment to answer, so "ready" means requests can flow."""
        deadline = time.monotonic() + timeout_s
        while self.last_status is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.last_status is None:
            log.warning("router_not_reachable_yet", router=self.config.router)

    def close(self) -> None:
        for task in self.sdk_tokenizing.values():
            task.cancel()
        self.pool.close()
        self.security.stop()
        self.context.destroy(linger=0)  # closes every socket first, so this cannot block

    async def _stream_loop(self) -> None:
        while True:
            frames = await self.stream.recv_multipart()
            message, _ = self._decode(frames, "worker stream")
            if isinstance(message, TokensBatch):
                for item in message.items:
                    self._on_tokens_checked(item)
            elif isinstance(message, Error):
                self._on_error(message)

    async def _router_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            message, _ = self._decode(frames, "router")
            if isinstance(message, Error):
                self._on_error(message)
            elif isinstance(message, Status):
                restarted = self.last_status is not None and message.instance_id != self.last_status.instance_id
                self.last_status, self.last_status_at = message, time.monotonic()
                if restarted:  # back before a status went unanswered for long: the same loss
                    self._fail_unplaced(kept_instance=message.instance_id)
            elif isinstance(message, Placed):
                state = self.requests.get(message.request_id)
                if state is not None:
                    state.placed = True

    async def _status_loop(self) -> None:
        """Ask the router for its status every interval; while it does not answer, fail
        what it has not placed."""
        while True:
            self._send_now(encode(StatusRequest()))
            if not self.router_reachable():
                self._fail_unplaced()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _decode(self, frames: list[bytes], source: str):
        try:
            message, payloads = decode(frames)
        except ProtocolError as error:
            self.metrics.bad_messages.inc()
            log.warning("bad_message", source=source, error=str(error))
            return None, []
        return message, payloads

    # ---- the SDK socket ------------------------------------------------------------

    async def _sdk_loop(self) -> None:
        while True:
            frames = await self.sdk.recv_multipart()
            try:
                identity, body = split_routed(frames)
            except ProtocolError:
                continue
            try:
                message, payloads = decode(body)
            except ProtocolError as error:  # answered to the request it names, when it names one
                self.metrics.bad_messages.inc()
                log.warning("bad_message", source="client", error=str(error))
                await self._reply(identity, Error(request_id=peek_request_id(body), code=ErrorCode.INVALID_REQUEST,
                                                  message=str(error)))
                continue
            if isinstance(message, Submit):
                self._on_submit(identity, message, payloads)
            elif isinstance(message, Abort):
                self._abort_sdk_request((identity, message.request_id))
            elif isinstance(message, StatusRequest):
                await self._reply(identity, self._status_for_client(message))
            else:
                await self._reply(identity, Error(request_id=getattr(message, "request_id", ""),
                                                  code=ErrorCode.INVALID_REQUEST,
                                                  message=f"clients may not send {type(message).__name__}"))

    def _status_for_client(self, _request) -> Status | Error:
        if self.last_status is None or not self.health()["router_reachable"]:
            return Error(request_id="", code=ErrorCode.UNAVAILABLE, message="the router is not reachable",
                         retry_after_s=UNAVAILABLE_RETRY_AFTER_S)
        return self.last_status

    def _on_submit(self, identity: bytes, submit: Submit, payloads: list) -> None:
        """Admit a client's request; its events are turned into Chunks by `_on_sdk_event`
        as they arrive, with no task per request (but one while a long text prompt is
        tokenized on the pool)."""
        key = (identity, submit.request_id)
        try:
            if key in self.sdk_requests or key in self.sdk_tokenizing:
                raise InvalidRequest(f"request_id: {submit.request_id!r} is already in flight")
            tenant = self.tenant_for(submit.api_key)
            if submit.prompt is not None:
                self._check_prompt_bytes(submit.prompt)
                if len(submit.prompt) > INLINE_PROMPT_CHARS:
                    self.sdk_tokenizing[key] = asyncio.ensure_future(self._submit_long_text(key, submit, tenant))
                    return
                prompt_ids = self.tokenize(submit.prompt)
            elif payloads:
                prompt_ids = payloads[0].astype("int64").tolist()
            else:
                raise InvalidRequest("prompt: give text or token ids")
            self._admit_sdk(key, submit, prompt_ids, tenant)
        except Exception as error:  # typed for the client; the loop serves the others
            self._send_error(identity, submit.request_id, self._typed(error))

    def _check_prompt_bytes(self, text: str) -> None:
        try:
            self.prompt_byte_limit.check(text, "prompt")
        except InvalidRequestError as error:
            raise InvalidRequest(str(error)) from None

    async def _submit_long_text(self, key: tuple[bytes, str], submit: Submit, tenant: str) -> None:
        try:
            prompt_ids = await self.pool.run(self.tokenize, cast(str, submit.prompt))
            self._admit_sdk(key, submit, prompt_ids, tenant)
        except Exception as error:  # typed for the client; cancelled (aborted) ends quietly
            self._send_error(key[0], submit.request_id, self._typed(error))
        finally:
            self.sdk_tokenizing.pop(key, None)

    def _admit_sdk(self, key: tuple[bytes, str], submit: Submit, prompt_ids: list[int], tenant: str) -> None:
        params = params_from_sampling(submit.sampling)
        self.sdk_requests[key] = self._admit(f"sdk-{uuid.uuid4().hex}", prompt_ids, params, tenant,
                                             submit.timeout_s, sink=lambda item: self._on_sdk_event(key, item),
                                             slo_class=submit.slo_class)

    def _on_sdk_event(self, key: tuple[bytes, str], item) -> None:
        identity, client_id = key
        state = self.sdk_requests.get(key)
        if state is None:
            return
        if isinstance(item, BatonError):
            self.metrics.requests.inc(outcome=item.code.value)
            self._send_error(identity, client_id, item)
        else:
            self._queue_chunk(identity, Chunk(
                request_id=client_id, token_ids=item.token_ids, text=item.text, finished=item.finished,
                finish_reason=item.finish_reason, num_prompt_tokens=item.num_prompt_tokens,
                num_cached_tokens=item.num_cached_tokens, logprobs=item.logprobs,
                timings=item.timings, prompt_logprobs=item.prompt_logprobs))
            if not item.finished:
                return
            self._record_finish(state, item)
        del self.sdk_requests[key]
        self._release(state)

    def _abort_sdk_request(self, key: tuple[bytes, str]) -> None:
        tokenizing = self.sdk_tokenizing.pop(key, None)
        if tokenizing is not None:
            tokenizing.cancel()
        state = self.sdk_requests.pop(key, None)
        if state is not None:
            self._release(state)

    def _send_error(self, identity: bytes, client_id: str, error: BatonError) -> None:
        asyncio.ensure_future(self._reply(identity, Error(request_id=client_id, code=error.code,
                                                          message=error.message,
                                                          retry_after_s=error.retry_after_s)))

    def _queue_chunk(self, identity: bytes, chunk: Chunk) -> None:
        """Chunks for one client leave together, once the tasks now ready have run."""
        pending = self.outbox.setdefault(identity, [])
        pending.append(chunk)
        if len(pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush_chunks, identity)

    def _flush_chunks(self, identity: bytes) -> None:
        items = self.outbox.pop(identity, [])
        if not items:
            return
        if not any(item.prompt_logprobs for item in items):
            asyncio.ensure_future(self._reply(identity, ChunkBatch(items=items)))
            return
        for group in pack_by_prompt_logprobs(items):  # each fits a message (docs/wire.md §3)
            asyncio.ensure_future(self._reply(identity, ChunkBatch(items=group)))

    async def _reply(self, identity: bytes, message) -> None:
        try:
            await self.sdk.send_multipart([identity, *encode(message)], copy=False)
        except zmq.ZMQError as error:  # the client is gone
            log.info("client_gone", error=str(error))


def _unseen(message: Tokens, tokens_sent: int) -> Tokens | None:
    """`message` less the tokens the request has already had (a message that gives their
    output position may repeat some: docs/wire.md §2); None if nothing is left to deliver."""
    seen = tokens_sent - message.position if message.position >= 0 else 0
    if seen <= 0:
        return message
    if seen >= len(message.token_ids) and not message.finished:
        return None
    return replace(message, token_ids=message.token_ids[seen:], logprobs=message.logprobs[seen:])
