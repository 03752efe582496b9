"""How a decode worker takes a handed-off request: it continues requests whose prompt a
prefill worker computed, pulling their KV over the KV transport (docs/disaggregation.md).
The worker service (services/worker/service.py) runs the `decode` role with this part.

A Generate with a `kv_handle` is imported: the engine allocates blocks for the prompt,
reusing those it holds by hash (`Engine.begin_load`); the KV store, when the cluster has
one and its blocks cost less than a pull, is asked for what it holds of the rest, and
the transport pulls whatever is still missing from the prefill worker's lease
(services/worker/kv_loads.py chooses). While the pool or
the batch is full the request waits here and its lease is renewed through the router.
Once every byte has landed the request joins the decode batch with the prefill worker's
first token (which the client has had already). A request whose prompt comes in parts
(docs/disaggregation.md §2.1) arrives with its first part's handle: its load pulls each
part as it comes (KvMore) and waits, then the whole prompt's lease brings the rest and the
first token. A pull that fails or passes its deadline
is cancelled, and only once no late byte can land are its blocks freed. A failure
another decode worker could avoid (REPLACEABLE_CAUSES) is reported to the router
(KvPullFailed), which places the request on another decode worker with the same lease,
or says to go on here; otherwise, or without its word within VERDICT_WAIT_S,
`kv_load_failure_policy` says what happens: `recompute` (the prompt and first token are
prefilled here) or `fail` (kv_transfer_failed to the client). A Generate without a
handle is the service's to serve whole (conditional disaggregation: the router sends short
prefills straight to a decode worker).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from msgspec.structs import replace

from common.config import ClusterConfig
from common.engine.engine import Engine, RequestOutput
from common.engine.kv_connector import KvLoad, KvLoadError, StoreHint
from common.kv_transfer import HandshakeRefused, KvTransport, PullResult
from common.logs import get_logger
from common.metrics import Registry
from common.protocol import (
    ErrorCode,
    Generate,
    KvHandle,
    KvLeaseUpdate,
    KvMore,
    KvPullFailed,
    KvPullVerdict,
    Tokens,
    params_from_sampling,
)
from common.sampling_params import InvalidRequestError
from services.decode.lease_source import LeaseSource, pull_result
from services.worker.kv_loads import KvLoads, LoadDone
from services.worker.role import SendToRouter
from services.worker.store_source import StoreSource

log = get_logger("decode")
UNREACHABLE_S = 5.0  # a KV peer whose handshake failed is not tried again for this long
# Pull failures another decode worker could avoid: the deadline passed (a slow path or a
# stalled transport between this worker and the prefill worker) or the prefill worker did
# not answer this worker's handshake. A prefill worker that is gone looks the same from
# here; the router, which knows whether it is still a member, tells the two apart.
REPLACEABLE_CAUSES = frozenset({ErrorCode.TIMEOUT.value, "unreachable"})
# Failures after which the prefill worker exposes the lease no more (withdrawn, closed, or
# never known): a release would only be refused there.
EXPOSURE_GONE = frozenset({ErrorCode.UNAVAILABLE.value, ErrorCode.REFUSED.value})
MISNAMED = ("kv_handle.block_hashes: the prefill engine names this prompt's blocks otherwise (its model, "
            "tokenizer, dtype, block size or the request's tenant differ from this engine's)")
VERDICT_WAIT_S = 4.0  # a hand-back waits this long for the router's KvPullVerdict, then falls back here
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DecodeMetrics:
    def __init__(self, registry: Registry):
        self.bytes = registry.counter("baton_kv_transfer_bytes_total", "KV bytes pulled from prefill workers")
        self.seconds = registry.histogram("baton_kv_transfer_seconds", "Duration of KV pulls that completed",
                                          buckets=TRANSFER_BUCKETS)
        self.failures = registry.counter("baton_kv_transfer_failures_total", "KV pulls that did not complete, "
                                         "by cause", labels=("cause",))
        self.blocks_reused = registry.counter("baton_kv_import_blocks_reused_total",
                                              "Prompt blocks not pulled: this worker held them by hash")
        self.waiting = registry.gauge("baton_kv_imports_waiting", "Handed-off requests waiting for KV room")
        self.renewals = registry.counter("baton_kv_lease_renewals_total",
                                         "Lease renewals sent for requests waiting here for room")
        self.recomputed = registry.counter("baton_kv_imports_recomputed_total",
                                           "Requests whose pull failed and whose prompt was computed here")
        self.part_blocks = registry.counter("baton_kv_part_blocks_total", "Prompt blocks pulled from parts of "
                                            "prompts still being prefilled, before their whole lease came")
        self.replaced = registry.counter("baton_kv_imports_replaced_total", "Requests whose pull failed here "
                                         "and which the router placed on another decode worker")


@dataclass
class Import:
    """A handed-off request on this worker, from its handle to its first decode step."""

    request: Generate
    handle: KvHandle
    prompt_ids: list[int]
    arrived: float  # monotonic
    renewed: float  # monotonic: when its lease was last renewed
    store_hint: StoreHint | None  # what the router's index says the KV store holds of the prompt
    load: KvLoad | None = None  # its blocks, once it has them
    pull_started: float = 0.0  # monotonic: when its load began
    timings: dict[str, float] = field(default_factory=dict)
    failure: str = ""  # how its pull failed, while handed back to the router
    verdict_by: float = 0.0  # monotonic: handed back, it falls back here if no verdict came by then
    # Imported from its parts (docs/disaggregation.md §2.1): `handle` is the first part's
    # until the whole prompt's comes (KvMore); `parts` are every part's handle.
    parts: list[KvHandle] = field(default_factory=list)
    last_part: float = 0.0  # monotonic: when its latest part came
    landed: LoadDone | None = None  # every block landed before the whole prompt's handle came
    whole_came: float = 0.0  # monotonic: when the whole prompt's handle came after its parts


class Imports:
    """The decode role's part of the worker service: the handed-off requests (Generates
    with a `kv_handle`) from their arrival to their first decode step, and the first
    token's copy their first output carries."""

    def __init__(self, config: ClusterConfig, engine: Engine, transport: KvTransport, store: StoreSource | None,
                 kv_loads: KvLoads, registry: Registry, send_to_router: SendToRouter, *,
                 emit: Callable[[list[RequestOutput]], None], fail: Callable[[str, ErrorCode, str], None],
                 forget: Callable[[str, str, bool], None]):
        self.config = config
        self.engine = engine
        self.transport = transport
        self.store = store
        self.kv_loads = kv_loads
        self.send_to_router = send_to_router
        self.emit = emit  # the service's: the outputs' tokens to their tokenizers
        self.fail = fail  # the service's: an error to the request's tokenizer, and forget it
        self.forget = forget  # the service's: stop tracking a request (request id, outcome, report)
        self.metrics = DecodeMetrics(registry)
        self.pending: dict[str, Import] = {}  # request id -> import not yet decoding
        self.handed_back: dict[str, Import] = {}  # request id -> import whose failed pull the router may re-place
        self.timings: dict[str, dict[str, float]] = {}  # request id -> its split, sent with its last tokens
        self.recomputed: set[str] = set()  # requests whose prompt (plus first token) is prefilled here
        # Request id -> the prefill worker's first token (and its logprob), sent again with
        # the request's next output at position 0: the tokenizer may get this copy first.
        self.replay: dict[str, tuple[int, dict | None]] = {}  # ... for a request recomputed here
        self.landing: dict[str, dict | None] = {}  # ... for an import: its output holds the token already
        self.peers: dict[str, str] = {}  # KV address handshaken with -> the prefill process (instance id) there
        self.unreachable: dict[str, float] = {}  # KV address -> until when not to try it again
        self.refused_room: tuple[int, int] | None = None  # _room() when waiting imports last found none
        self.lease_source = LeaseSource(transport, config.kv_transfer_timeout_s,
                                        engine.kv_cache.layout.bytes_per_block)

    # ---- requests ------------------------------------------------------------------

    def admit(self, request: Generate, prompt_ids: list[int], store_hint: StoreHint | None) -> None:
        """Take a handed-off request (`request.kv_handle` set; InvalidRequestError names a
        bad parameter or a handle that does not fit the prompt). `store_hint`: what the
        router's index says the KV store holds of the prompt."""
        handle = request.kv_handle
        assert handle is not None
        check_handle(handle, prompt_ids, self.engine.config.block_size)
        params_from_sampling(request.sampling).validate()
        now = time.monotonic()
        item = Import(request, handle, prompt_ids, now, now, store_hint, last_part=now)
        if handle.part:
            item.parts.append(handle)
        self.pending[request.request_id] = item
        self._begin(item)

    def _begin(self, item: Import) -> None:
        """Take blocks and start loading them (from the store, when there is one and it is
        worth asking, and from the lease); leaves the import waiting when there is no room."""
        request, handle = item.request, item.handle
        try:
            self._connect(handle.kv_address, handle.prefill_instance_id)
            whole = not handle.part
            load = self.engine.begin_load(request.request_id, item.prompt_ids, params_from_sampling(request.sampling),
                                          request.tenant, first_token_id=handle.first_token_id if whole else None,
                                          block_hashes=handle.block_hashes if whole else None,
                                          store_hint=item.store_hint, through_prompt_end=True)
        except (KvLoadError, InvalidRequestError, HandshakeRefused) as error:
            self._give_up(item, ErrorCode.INVALID_REQUEST, str(error))
            return
        except (TimeoutError, ConnectionError, ValueError) as error:
            self._pull_failed(item, PullResult(request.request_id, "failed", "unreachable", str(error)))
            return
        if load is None:
            return
        if not all(self._names_fit(request.request_id, part) for part in item.parts):
            self.engine.cancel_load(request.request_id)  # nothing was asked to land yet
            self._give_up(item, ErrorCode.INVALID_REQUEST, MISNAMED)
            return
        item.load = load
        self.metrics.blocks_reused.inc(load.first_block)
        item.timings["decode_wait_s"] = round(time.monotonic() - item.arrived, 6)
        item.pull_started = time.monotonic()
        for lease in [*item.parts, handle] if whole else item.parts:
            self.lease_source.expect(request.request_id, lease)
        sources = (self.store, self.lease_source) if self.store is not None else (self.lease_source,)
        self.kv_loads.begin(load, sources)

    def _connect(self, address: str, instance_id: str) -> None:
        """Handshake once per prefill process; a peer that just failed one fails at once (a
        dead prefill worker must not cost each of its requests a handshake timeout)."""
        known = self.peers.get(address)
        if known == instance_id:
            return
        if known is not None:  # the prefill worker there restarted: its handshake is gone
            self.transport.disconnect(address)
            del self.peers[address]
            self.unreachable.pop(address, None)
        if self.unreachable.get(address, 0.0) > time.monotonic():
            raise ConnectionError(f"the KV peer {address} did not answer a handshake in the last {UNREACHABLE_S} s")
        try:
            self.transport.connect(address)
        except (TimeoutError, ConnectionError):
            self.unreachable[address] = time.monotonic() + UNREACHABLE_S
            raise
        self.unreachable.pop(address, None)
        self.peers[address] = instance_id

    def _room(self) -> tuple[int, int]:
        """Free blocks and free batch slots: while they stay as they were when the waiting
        imports found no room, trying them again (about 0.3 ms each for a 2,048-token
        prompt) would find none either."""
        scheduler = self.engine.scheduler
        return self.engine.block_manager.num_available, len(scheduler.running) + len(scheduler.receiving)

    def tend(self) -> None:
        """Each turn: imports waiting for room try again (when room changed) and renew
        their leases; hand-backs without a verdict fall back here."""
        now = time.monotonic()
        renew_every = self.config.kv_lease_ttl_s / 3
        retry = self._room() != self.refused_room
        for item in list(self.pending.values()):
            if item.load is None:
                if retry:
                    self._begin(item)
                if item.load is None and item.request.request_id in self.pending \
                        and now - item.renewed >= renew_every:
                    item.renewed = now
                    self._update_lease(item, "renew")
                    self.metrics.renewals.inc()
        stalled = [i for i in self.pending.values() if i.handle.part and now - i.last_part > self.config.kv_lease_ttl_s]
        for item in stalled:
            request_id = item.request.request_id
            log.warning("kv_parts_stalled", request_id=request_id, wait_s=self.config.kv_lease_ttl_s)
            self.abort(request_id)
            self.fail(request_id, ErrorCode.UNAVAILABLE, f"no more of the prompt's KV came from "
                      f"{item.handle.prefill_worker_id} within {self.config.kv_lease_ttl_s} s")
        for item in [i for i in self.handed_back.values() if now >= i.verdict_by]:
            del self.handed_back[item.request.request_id]
            log.warning("kv_verdict_missing", request_id=item.request.request_id, wait_s=VERDICT_WAIT_S)
            self._fall_back(item, f"{item.failure}; no word from the router", release=True)
        waiting = sum(item.load is None for item in self.pending.values())
        if retry:
            self.refused_room = self._room() if waiting else None
        self.metrics.waiting.set(waiting)

    def load_done(self, done: LoadDone) -> bool:
        """An import's sources are done: it decodes if its whole prompt landed, else its
        pull failed. False for any other load (a short prefill's fetch from the store)."""
        request_id = done.load.request_id
        pulled = self.lease_source.pulled(request_id)
        self.lease_source.forget(request_id)
        item = self.pending.get(request_id)
        if item is None or item.load is not done.load:
            return False
        lease_parts = [part for part in done.parts if part.source == self.lease_source.name]
        part_leases = {handle.lease_id for handle in item.parts}
        for part in lease_parts:
            result = pull_result(part)
            if result.status == "done":
                self.metrics.bytes.inc(result.nbytes)
                self.metrics.seconds.observe(result.seconds)
                if result.transfer_id in part_leases:
                    self.metrics.part_blocks.inc(part.landed)
        if done.whole:
            if item.handle.part:  # the first token comes with the whole prompt's lease
                item.landed = done
                return True
            if not pulled:  # the store, this worker's cache and the parts had every block
                self._update_lease(item, "release")
            self._landed(item)
            return True
        result = pull_result(lease_parts[-1]) if lease_parts else \
            PullResult(request_id, "failed", "unreachable", "no source had the prompt's KV")
        if not done.settled:
            result.settled = False
        self._pull_failed(item, result)
        return True

    def _landed(self, item: Import) -> None:
        request_id = item.request.request_id
        del self.pending[request_id]
        # From the pull's start, or, for a prompt imported from its parts, from when its
        # whole lease came: what the transfer added to the decode's start.
        item.timings["transfer_s"] = round(time.monotonic() - max(item.pull_started, item.whole_came), 6)
        self.timings[request_id] = item.timings
        self.landing[request_id] = item.handle.first_logprob
        assert item.load is not None  # load_done lands only begun imports
        self.emit(self.engine.complete_load(request_id, len(item.load.dst_block_ids), item.handle.first_token_id))

    def _pull_failed(self, item: Import, result: PullResult) -> None:
        """Settle a pull that did not complete; then hand the request back to the router if
        another decode worker could avoid the failure, else apply kv_load_failure_policy."""
        request_id = item.request.request_id
        # The transports give the code as an ErrorCode or as its value: label with the value.
        cause = result.code.value if isinstance(result.code, ErrorCode) else result.code or result.status
        self.metrics.failures.inc(cause=cause)
        log.warning("kv_pull_failed", request_id=request_id, status=result.status, code=result.code,
                    reason=result.reason, policy=self.config.kv_load_failure_policy)
        del self.pending[request_id]
        if not result.settled:  # late bytes may still land: the blocks stay out of use
            log.error("kv_blocks_quarantined", request_id=request_id)
            self.fail(request_id, ErrorCode.KV_TRANSFER_FAILED, f"KV transfer {result.status}: {result.reason}")
            return
        if item.load is not None:
            self.engine.cancel_load(request_id)
        why = f"{result.status} ({result.reason})"
        if item.handle.part:  # no first token to go on from: the prompt is still being prefilled
            self.fail(request_id, ErrorCode.KV_TRANSFER_FAILED, f"a part of the prompt's KV could not be moved from "
                      f"{item.handle.prefill_worker_id}: {why}")
            return
        if cause in REPLACEABLE_CAUSES and len(item.handle.failed_on) < self.config.kv_pull_replacements:
            self._hand_back(item, cause, why)
        else:
            self._fall_back(item, why, release=cause not in EXPOSURE_GONE)

    def _hand_back(self, item: Import, cause: str, why: str) -> None:
        """Ask the router to place the request on another decode worker (KvPullFailed), the
        lease kept for it; its KvPullVerdict, or VERDICT_WAIT_S without one, decides what
        happens here. The router re-places only until half that wait has passed, so that a
        late verdict can never find the request recomputed here and running there too."""
        item.failure = why
        item.verdict_by = time.monotonic() + VERDICT_WAIT_S
        self.handed_back[item.request.request_id] = item
        self.send_to_router(KvPullFailed(request=item.request, code=cause, reason=why[:500],
                                         reply_by=time.time() + VERDICT_WAIT_S / 2),
                            [np.asarray(item.prompt_ids, dtype=np.uint32)])

    def _on_verdict(self, verdict: KvPullVerdict) -> None:
        item = self.handed_back.get(verdict.request_id)
        if item is None or item.handle.lease_id != verdict.lease_id:
            log.warning("kv_verdict_unexpected", request_id=verdict.request_id, action=verdict.action)
            return
        del self.handed_back[verdict.request_id]
        if verdict.action == "moved":
            self.metrics.replaced.inc()
            log.info("kv_pull_replaced", request_id=verdict.request_id, worker_id=verdict.worker_id)
            self.forget(verdict.request_id, "replaced", False)  # the router moved it already
            return
        self._fall_back(item, f"{item.failure}; not re-placed: {verdict.reason}", release=True)

    def _fall_back(self, item: Import, why: str, release: bool) -> None:
        """kv_load_failure_policy for a request whose pull failed: release the lease (when
        the prefill worker may still expose it), then recompute here or fail it."""
        if release:
            self._update_lease(item, "release")
        if self.config.kv_load_failure_policy == "fail":
            self.fail(item.request.request_id, ErrorCode.KV_TRANSFER_FAILED,
                       f"the prompt's KV could not be moved from {item.handle.prefill_worker_id}: {why}")
            return
        self._recompute(item)

    def _recompute(self, item: Import) -> None:
        """Prefill the prompt and the first token here, and go on from there (the prefill
        worker gave the prompt logprobs already)."""
        request = item.request
        sampling = replace(request.sampling, max_tokens=request.sampling.max_tokens - 1, prompt_logprobs=None)
        try:
            self.engine.add_request(request.request_id, [*item.prompt_ids, item.handle.first_token_id],
                                    params_from_sampling(sampling), tenant_salt=request.tenant)
        except InvalidRequestError as error:
            self.fail(request.request_id, ErrorCode.KV_TRANSFER_FAILED, f"recompute refused: {error}")
            return
        self.recomputed.add(request.request_id)
        self.replay[request.request_id] = (item.handle.first_token_id, item.handle.first_logprob)
        self.metrics.recomputed.inc()

    def _give_up(self, item: Import, code: ErrorCode, why: str) -> None:
        self.pending.pop(item.request.request_id, None)
        self._update_lease(item, "release")
        self.fail(item.request.request_id, code, why)

    def _update_lease(self, item: Import, action: str) -> None:
        """Renew or release the lease on the whole prompt; a part's lease is the prefill
        worker's to end (with the request's, or at its deadline)."""
        if item.handle.part:
            return
        self.send_to_router(KvLeaseUpdate(request_id=item.request.request_id, lease_id=item.handle.lease_id,
                                          prefill_worker_id=item.handle.prefill_worker_id, action=action), [])

    def handle(self, message) -> bool:
        """The router's verdict on a hand-back, or more of a request imported from its
        parts; False if `message` is neither."""
        if isinstance(message, KvPullVerdict):
            self._on_verdict(message)
        elif isinstance(message, KvMore):
            self._more(message.request_id, message.kv_handle)
        else:
            return False
        return True

    def _more(self, request_id: str, handle: KvHandle) -> None:
        """Another part of a request imported from its parts, or the lease on its whole
        prompt, with the first token: the load goes on (or, every block landed, the
        request decodes)."""
        item = self.pending.get(request_id)
        if item is None or not item.handle.part:  # not importing (any more), or not from parts
            log.info("kv_more_unexpected", request_id=request_id, part=handle.part)
            if not handle.part and item is None and request_id not in self.handed_back:  # nobody here will pull it
                self.send_to_router(KvLeaseUpdate(request_id=request_id, lease_id=handle.lease_id,
                                                  prefill_worker_id=handle.prefill_worker_id, action="release"), [])
            return
        try:
            check_handle(handle, item.prompt_ids, self.engine.config.block_size)
        except InvalidRequestError as error:
            self.abort(request_id)
            self.fail(request_id, ErrorCode.INVALID_REQUEST, str(error))
            return
        if item.load is not None and not self._names_fit(request_id, handle):
            self.abort(request_id)
            self.fail(request_id, ErrorCode.INVALID_REQUEST, MISNAMED)
            return
        if handle.prefill_instance_id != item.handle.prefill_instance_id:
            self.abort(request_id)
            self.fail(request_id, ErrorCode.INVALID_REQUEST, "kv_handle: its parts came from another prefill process")
            return
        item.last_part = time.monotonic()
        if handle.part:
            item.parts.append(handle)
        else:
            item.handle = handle
            item.whole_came = item.last_part
        if item.load is None:
            return
        if item.landed is not None:  # every block is here: only the first token was missing
            if not handle.part:
                self._update_lease(item, "release")
                self._landed(item)
            return
        self.lease_source.expect(request_id, handle)
        self.kv_loads.resume(request_id)

    def _names_fit(self, request_id: str, handle: KvHandle) -> bool:
        """Whether a handle (a part, or the whole prompt's) names its full blocks as this
        engine does."""
        names = self.engine.block_names(request_id)
        first = handle.first_block
        return list(handle.block_hashes) == list(names[first:first + len(handle.block_hashes)])

    def abort(self, request_id: str) -> bool:
        """Stop a handed-off request still importing or handed back; False for any other
        request (the engine's to abort)."""
        handed_back = self.handed_back.pop(request_id, None)
        if handed_back is not None:  # its blocks are freed already
            self._update_lease(handed_back, "release")
            return True
        item = self.pending.pop(request_id, None)
        if item is None:
            self.recomputed.discard(request_id)
            self.replay.pop(request_id, None)
            self.timings.pop(request_id, None)
            return False
        if item.load is None:
            self._update_lease(item, "release")
            return True
        pulled = self.lease_source.pulled(request_id)
        if self.kv_loads.cancel(request_id):
            self.lease_source.forget(request_id)
            self.engine.cancel_load(request_id)
        else:  # the part out cannot be stopped: the load ends through load_done, the request with it
            self.engine.abort(request_id)
        if not pulled:
            self._update_lease(item, "release")
        return True

    # ---- output --------------------------------------------------------------------

    def tokens(self, output: RequestOutput, tokens: Tokens) -> Tokens:
        """What the tokenizer gets of a request's output here: a landed or recomputed
        import's first output carries the prefill worker's first token again (position 0),
        and its last carries the TTFT split."""
        request_id = output.request_id
        if request_id in self.landing:  # complete_load's output: the first token, sent again
            logprob = self.landing.pop(request_id)
            tokens = replace(tokens, position=0, logprobs=[logprob] if logprob else [])
        elif request_id in self.replay:
            first, logprob = self.replay.pop(request_id)
            tokens = replace(tokens, token_ids=[first, *tokens.token_ids], position=0,
                             logprobs=[logprob, *tokens.logprobs] if logprob else tokens.logprobs)
        if request_id in self.recomputed:
            tokens = replace(tokens, num_prompt_tokens=tokens.num_prompt_tokens - 1)
        if output.finished:
            self.recomputed.discard(request_id)
            tokens = replace(tokens, timings=self.timings.pop(request_id, {}))
        return tokens


def check_handle(handle: KvHandle, prompt_ids: list[int], block_size: int) -> None:
    """A handle from the wire must describe this prompt's blocks, or a part of its full
    blocks (InvalidRequestError if not)."""
    blocks = -(-len(prompt_ids) // block_size)
    if handle.num_tokens != len(prompt_ids):
        raise InvalidRequestError("kv_handle.num_tokens", f"{handle.num_tokens}, the prompt has {len(prompt_ids)}")
    if handle.part:
        full, first, count = len(prompt_ids) // block_size, handle.first_block, len(handle.block_ids)
        if not 0 <= first < full or not 0 < count <= full - first or len(set(handle.block_ids)) != count:
            raise InvalidRequestError("kv_handle.block_ids", f"a part must name 1 to {max(0, full - first)} distinct "
                                      f"full blocks from block {first} of {full}, got {count}")
        if len(handle.block_hashes) != count:
            raise InvalidRequestError("kv_handle.block_hashes", f"must name the part's {count} blocks, got "
                                      f"{len(handle.block_hashes)}")
        return
    if handle.first_block:
        raise InvalidRequestError("kv_handle.first_block", f"{handle.first_block}: a whole prompt's lease starts at 0")
    if len(handle.block_ids) != blocks or len(set(handle.block_ids)) != blocks:
        raise InvalidRequestError("kv_handle.block_ids", f"must be {blocks} distinct ids, got {len(handle.block_ids)}")
    if len(handle.block_hashes) != len(prompt_ids) // block_size:
        raise InvalidRequestError("kv_handle.block_hashes", f"must name the {len(prompt_ids) // block_size} full "
                                  f"blocks, got {len(handle.block_hashes)}")
