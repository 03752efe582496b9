"""The `prefill` role: computes prompts, streams each one's first token, and holds the
prompt's KV under a lease until a decode worker has pulled it (docs/disaggregation.md).

A Generate runs in the engine with one output token and `hold_kv`. When that token is
out, either it ends the request (end of sequence, a stop, max_tokens = 1: the lease is
let go at once) or the blocks stay held: the KV transport exposes them under the lease
id for `kv_lease_ttl_s`, the token goes to the tokenizer unfinished, and KvReady tells
the router, which picks the decode worker. The exposure's one TransferEvent (pulled,
failed, cancelled, expired, withdrawn) frees the blocks, normally once no send reads
them any more. A send to a puller that died may never complete (UCX without peer error
handling); those blocks are freed all the same, since a send only reads them and the
puller settles or quarantines its own receives (services/decode/service.py).
The transport's lease is the one clock: the decode worker renews it through the router
while the request waits there for room (KvLeaseUpdate), and a lost decode worker costs
at most one lease of held blocks.

A router that restarts forgets the hand-offs it held. So each request's Generate and
prompt stay here until its lease ends: a KvReady for a request that came before this
worker's latest (re)join carries them, and on a rejoin the KvReady of every lease no
decode worker has claimed yet is sent again with them; the new router takes the
hand-off from there (docs/disaggregation.md §2).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from msgspec.structs import replace

from common.config import ClusterConfig
from common.engine.engine import Engine, RequestOutput
from common.engine.leases import LeaseError
from common.kv_transfer import TransferEvent
from common.logs import get_logger
from common.metrics import Registry
from common.protocol import Generate, KvLeaseUpdate, KvReady, Tokens, params_from_sampling
from common.sockets import send
from services.worker.service import KvEventBuffer, TransferringService

log = get_logger("prefill")
EVENTS_PER_TURN = 1024


@dataclass
class Held:
    """A request as the router sent it, kept until its lease ends."""

    request: Generate
    prompt: np.ndarray
    session: str  # the router registration it came (or its KvReady went) under
    ready: KvReady | None = None  # once the prompt is computed
    claimed: bool = False  # a decode worker renewed or released the lease: its router knows


class PrefillMetrics:
    def __init__(self, registry: Registry):
        self.leased_blocks = registry.gauge("baton_kv_leased_blocks", "KV blocks held for decode workers")
        self.exposures = registry.counter("baton_kv_exposures_total", "Leases that ended, by how",
                                          labels=("outcome",))
        self.lease_refused = registry.counter("baton_kv_lease_updates_refused_total",
                                              "Lease renewals or releases naming no live lease of that request")


class PrefillService(TransferringService):
    role = "prefill"

    def __init__(self, config: ClusterConfig, index: int, engine: Engine, events: KvEventBuffer):
        super().__init__(config, index, engine, events)
        self.kv_metrics = PrefillMetrics(self.registry)
        self.max_tokens: dict[str, int] = {}  # request id -> the max_tokens it asked for
        self.exposed: dict[str, str] = {}  # lease id -> request id, until its TransferEvent
        self.ready: list[KvReady] = []  # hand-offs of this step, sent once its tokens are pushed
        self.held: dict[str, Held] = {}  # request id -> its Generate, until its lease ends
        try:
            self.bound_kv_address = self.transport.listen(config.worker_kv_address(index))
        except BaseException:
            self.close()
            raise

    def _kv_address(self) -> str:
        return self.config.advertised(self.bound_kv_address)

    # ---- requests ------------------------------------------------------------------

    def _admit(self, request: Generate, prompt_ids: list[int]) -> None:
        params_from_sampling(request.sampling).validate()  # what the decode worker would refuse
        first_only = params_from_sampling(replace(request.sampling, max_tokens=1))
        if not self._load_from_store(request, prompt_ids, first_only, hold_kv=True):
            self.engine.add_request(request.request_id, prompt_ids, first_only, tenant_salt=request.tenant,
                                    hold_kv=True)
        self.max_tokens[request.request_id] = request.sampling.max_tokens
        self.held[request.request_id] = Held(request, np.asarray(prompt_ids, dtype=np.uint32), self.session)

    def _abort(self, request_id: str) -> bool:
        self.max_tokens.pop(request_id, None)
        return super()._abort(request_id)

    def _forget(self, request_id: str, outcome: str, report: bool = True) -> None:
        if outcome != "handed_off":  # a handed-off request's Generate stays until its lease ends
            self.held.pop(request_id, None)
        super()._forget(request_id, outcome, report)

    def _tokens(self, output: RequestOutput) -> Tokens | None:
        tokens = super()._tokens(output)
        lease = output.kv_lease
        if lease is None or tokens is None:
            return tokens
        max_tokens = self.max_tokens.pop(output.request_id, 1)
        if output.finish_reason != "length" or max_tokens <= 1:  # the first token ended it
            self.engine.release_lease(lease.lease_id, lease.request_id)
            return tokens
        progress = self.progress.get(output.request_id)
        queue_s = output.queue_s or 0.0
        prefill_s = max(0.0, time.monotonic() - progress.received - queue_s) if progress else 0.0
        try:
            # A failed pull leaves the exposure for the decode worker the router may re-place
            # the request on (docs/disaggregation.md §3); the lease's end still bounds it.
            self.transport.expose(lease.lease_id, list(lease.block_ids), self.config.kv_lease_ttl_s,
                                  reopen_on_failure=True)
        except Exception as error:  # noqa: BLE001 (the transport is gone or full: the request ends here)
            log.error("kv_expose_failed", request_id=output.request_id, error=str(error))
            self.engine.release_lease(lease.lease_id, lease.request_id)
            return replace(tokens, finished=True, finish_reason="length")
        self.exposed[lease.lease_id] = lease.request_id
        self.ready.append(KvReady(request_id=lease.request_id, lease_id=lease.lease_id,
                                  block_ids=list(lease.block_ids), block_hashes=list(lease.block_hashes),
                                  num_tokens=lease.num_tokens, first_token_id=lease.first_token_id,
                                  queue_s=round(queue_s, 6), prefill_s=round(prefill_s, 6),
                                  first_logprob=output.logprobs[0] if output.logprobs else None))
        held = self.held.get(output.request_id)
        if held is not None:
            held.ready = self.ready[-1]
        self._note_progress(output)
        self._forget(output.request_id, "handed_off", report=False)
        return replace(tokens, finished=False, finish_reason=None, position=0,
                       timings={"queue_s": round(queue_s, 6), "prefill_s": round(prefill_s, 6)})

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Push the step's tokens, then hand the requests off, so that the first token
        usually reaches the tokenizer before the decode worker's copy of it (either order
        is right: Tokens.position)."""
        try:
            super()._emit(outputs)
        finally:
            ready, self.ready = self.ready, []
            for message in ready:
                self._send_ready(message)

    def _send_ready(self, ready: KvReady) -> None:
        """KvReady to the router; with the request and its prompt when the router may not
        hold the hand-off (this worker joined it after the request came). Not sent while
        the worker must join again: the rejoin sends it."""
        held = self.held.get(ready.request_id)
        if held is None or held.session == self.session:
            send(self.router, ready)
        elif self.joined:
            held.session = self.session
            send(self.router, replace(ready, request=held.request), [held.prompt])

    def _rejoined(self) -> None:
        """Send again, with the request, the KvReady of every lease no decode worker has
        claimed that went to an earlier registration: this router may never have had it."""
        for held in self.held.values():
            if held.ready is not None and not held.claimed and held.session != self.session:
                self._send_ready(held.ready)

    # ---- leases --------------------------------------------------------------------

    def _handle_role_message(self, message) -> bool:
        if not isinstance(message, KvLeaseUpdate):
            return False
        lease_id, request_id = message.lease_id, message.request_id
        try:
            self.engine.lease(lease_id, request_id)
            if self.exposed.get(lease_id) != request_id:
                raise LeaseError("not exposed")
        except LeaseError:
            self.kv_metrics.lease_refused.inc()
            log.warning("lease_update_refused", request_id=request_id, action=message.action,
                        why="no live lease of that request")
            return True
        held = self.held.get(request_id)
        if held is not None:
            held.claimed = True
        if message.action == "renew":
            self.transport.renew(lease_id, self.config.kv_lease_ttl_s)
        elif message.action == "release":
            self.transport.withdraw(lease_id)  # its TransferEvent frees the blocks
        else:
            log.warning("lease_update_refused", request_id=request_id, action=message.action,
                        why="unknown action")
        return True

    def _tend(self) -> None:
        for _ in range(EVENTS_PER_TURN):
            event = self.transport.next_event(0)
            if event is None:
                return
            self._exposure_ended(event)

    def _exposure_ended(self, event: TransferEvent) -> None:
        request_id = self.exposed.pop(event.transfer_id, None)
        if request_id is None:
            return
        self.held.pop(request_id, None)
        self.kv_metrics.exposures.inc(outcome=event.status)
        if not event.settled:  # a send still pending (its puller gone) only reads the blocks
            log.error("kv_sends_unsettled", request_id=request_id, status=event.status, reason=event.reason)
        elif event.status != "done":
            log.warning("kv_lease_ended", request_id=request_id, status=event.status, reason=event.reason)
        self.engine.release_lease(event.transfer_id, request_id)

    def _report(self) -> None:
        self.kv_metrics.leased_blocks.set(self.engine.leases.num_blocks)
        super()._report()

    def health(self) -> dict:
        return super().health() | {"kv_blocks_leased": self.engine.leases.num_blocks,
                                   "kv_address": self._kv_address()}
