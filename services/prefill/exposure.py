"""What a prefill worker does at a prompt's end: it holds the prompt's KV under a lease
until a decode worker has pulled it, and hands the request off (docs/disaggregation.md).
The worker service (services/worker/service.py) runs the `prefill` role with this part.

A Generate runs in the engine with one output token and `hold_kv`. When that token is
out, either it ends the request (end of sequence, a stop, max_tokens = 1: the lease is
let go at once) or the blocks stay held: the KV transport exposes them under the lease
id for `kv_lease_ttl_s`, the token goes to the tokenizer unfinished, and KvReady tells
the router, which picks the decode worker. The exposure's one TransferEvent (pulled,
failed, cancelled, expired, withdrawn) frees the blocks, normally once no send reads
them any more. A send to a puller that died may never complete (UCX without peer error
handling); those blocks are freed all the same, since a send only reads them and the
puller settles or quarantines its own receives (services/decode/imports.py).
The transport's lease is the one clock: the decode worker renews it through the router
while the request waits there for room (KvLeaseUpdate), and a lost decode worker costs
at most one lease of held blocks.

A router that restarts forgets the hand-offs it held. So each request's Generate and
prompt stay here until its lease ends: a KvReady for a request that came before this
worker's latest (re)join carries them, and on a rejoin the KvReady of every lease no
decode worker has claimed yet is sent again with them; the new router takes the
hand-off from there (docs/disaggregation.md §2).

A prompt longer than a prefill chunk is exposed in parts while it is prefilled: at a
chunk's end its newly computed full blocks go under a lease of their own (KvPart), so the
decode worker pulls them while the rest is computed (docs/disaggregation.md §2.1). A
part's exposure ends when pulled, or is withdrawn when the request's lease ends or the
request ends without one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from msgspec.structs import replace

from common.config import ClusterConfig
from common.engine.engine import Engine, RequestOutput
from common.engine.leases import LeaseError
from common.kv_transfer import KvTransport, TransferEvent
from common.logs import get_logger
from common.metrics import Registry
from common.protocol import Generate, KvLeaseUpdate, KvPart, KvReady, Tokens, params_from_sampling
from common.sampling_params import SamplingParams
from services.worker.role import SendToRouter

log = get_logger("prefill")
EVENTS_PER_TURN = 1024


@dataclass
class Held:
    """A request as the router sent it, kept until its lease ends."""

    request: Generate
    prompt: np.ndarray
    session: str  # the router registration it came (or its KvReady went) under
    ready: KvReady | None = None  # once the prompt is computed
    claimed: bool = False  # a decode worker renewed, released or is pulling the lease: its router knows
    parts: list[str] = field(default_factory=list)  # the leases of its parts (docs/disaggregation.md §2.1)
    parts_end: int = 0  # prompt blocks held in parts so far


class PrefillMetrics:
    def __init__(self, registry: Registry):
        self.leased_blocks = registry.gauge("baton_kv_leased_blocks", "KV blocks held for decode workers")
        self.exposures = registry.counter("baton_kv_exposures_total", "Leases that ended, by how",
                                          labels=("outcome",))
        self.lease_refused = registry.counter("baton_kv_lease_updates_refused_total",
                                              "Lease renewals or releases naming no live lease of that request")
        self.parts = registry.counter("baton_kv_part_exposures_total", "Leases on parts of prompts still being "
                                      "prefilled that ended, by how", labels=("outcome",))


class LeaseExposure:
    """The prefill role's part of the worker service: each request computes its prompt and
    first token only, and at its prompt's end is handed off (its KV exposed under a lease,
    KvReady to the router) unless that token ended it."""

    def __init__(self, config: ClusterConfig, index: int, engine: Engine, transport: KvTransport,
                 registry: Registry, send_to_router: SendToRouter):
        self.config = config
        self.engine = engine
        self.transport = transport
        self.send_to_router = send_to_router
        self.metrics = PrefillMetrics(registry)
        self.max_tokens: dict[str, int] = {}  # request id -> the max_tokens it asked for
        self.exposed: dict[str, str] = {}  # lease id -> request id, until its TransferEvent
        self.parts_exposed: dict[str, str] = {}  # a part's lease id -> request id, until its TransferEvent
        self.ready: list[KvReady] = []  # hand-offs of this step, sent once its tokens are pushed
        self.held: dict[str, Held] = {}  # request id -> its Generate, until its lease ends
        self.kv_address = config.advertised(transport.listen(config.worker_kv_address(index)))

    # ---- requests ------------------------------------------------------------------

    def admit(self, request: Generate, prompt_ids: list[int], session: str) -> SamplingParams:
        """What the engine runs of `request`: its first token only, the KV held. The request
        is kept until its lease ends (or `forget`)."""
        params_from_sampling(request.sampling).validate()  # what the decode worker would refuse
        self.max_tokens[request.request_id] = request.sampling.max_tokens
        self.held[request.request_id] = Held(request, np.asarray(prompt_ids, dtype=np.uint32), session)
        return params_from_sampling(replace(request.sampling, max_tokens=1))

    def forget(self, request_id: str, outcome: str) -> None:
        if outcome != "handed_off":  # a handed-off request's Generate stays until its lease ends
            held = self.held.pop(request_id, None)
            self.max_tokens.pop(request_id, None)
            if held is not None:
                self._withdraw_parts(held)

    def hand_off(self, output: RequestOutput, tokens: Tokens, received: float | None) -> tuple[Tokens, bool]:
        """At the prompt's end (`output` carries the lease): the tokens to send, and whether
        the request was handed off (it then leaves this worker, not finished). `received`:
        when its Generate arrived (monotonic), for its prefill time."""
        lease = output.kv_lease
        assert lease is not None
        max_tokens = self.max_tokens.pop(output.request_id, 1)
        if output.finish_reason != "length" or max_tokens <= 1:  # the first token ended it
            self.engine.release_lease(lease.lease_id, lease.request_id)
            return tokens, False
        queue_s = output.queue_s or 0.0
        prefill_s = max(0.0, time.monotonic() - received - queue_s) if received is not None else 0.0
        try:
            # A failed pull leaves the exposure for the decode worker the router may re-place
            # the request on (docs/disaggregation.md §3); the lease's end still bounds it.
            self.transport.expose(lease.lease_id, list(lease.block_ids), self.config.kv_lease_ttl_s,
                                  reopen_on_failure=True)
        except Exception as error:  # noqa: BLE001 (the transport is gone or full: the request ends here)
            log.error("kv_expose_failed", request_id=output.request_id, error=str(error))
            self.engine.release_lease(lease.lease_id, lease.request_id)
            return replace(tokens, finished=True, finish_reason="length"), False
        self.exposed[lease.lease_id] = lease.request_id
        ready = KvReady(request_id=lease.request_id, lease_id=lease.lease_id, block_ids=list(lease.block_ids),
                        block_hashes=list(lease.block_hashes), num_tokens=lease.num_tokens,
                        first_token_id=lease.first_token_id, queue_s=round(queue_s, 6),
                        prefill_s=round(prefill_s, 6),
                        first_logprob=output.logprobs[0] if output.logprobs else None)
        self.ready.append(ready)
        held = self.held.get(output.request_id)
        if held is not None:
            held.ready = ready
        return replace(tokens, finished=False, finish_reason=None, position=0,
                       timings={"queue_s": round(queue_s, 6), "prefill_s": round(prefill_s, 6)}), True

    def send_ready(self, session: str, joined: bool) -> None:
        """The step's hand-offs to the router, once its tokens are pushed: the first token
        usually reaches the tokenizer before the decode worker's copy of it (either order is
        right: Tokens.position). Before them, the parts the step computed of prompts still
        being prefilled."""
        if self.config.kv_part_blocks > 0:
            self._send_parts(session, joined)
        ready, self.ready = self.ready, []
        for message in ready:
            self._send_ready(message, session, joined)

    def _send_parts(self, session: str, joined: bool) -> None:
        """Hold under a lease of its own, expose and announce (KvPart) each run of at least
        `kv_part_blocks` full prompt blocks computed since a request's last part, while its
        prompt is still being prefilled (docs/disaggregation.md §2.1). Only to the router
        the request came through: another would not know the hand-off."""
        for request_id, held in self.held.items():
            if held.ready is not None or held.session != session or not joined:
                continue
            lease = self.engine.lease_part(request_id, held.parts_end, self.config.kv_part_blocks)
            if lease is None:
                continue
            try:
                self.transport.expose(lease.lease_id, list(lease.block_ids), self.config.kv_lease_ttl_s)
            except Exception as error:  # noqa: BLE001 (the transport is gone or full: the whole lease still comes)
                log.warning("kv_part_expose_failed", request_id=request_id, error=str(error))
                self.engine.release_lease(lease.lease_id, request_id)
                continue
            held.parts.append(lease.lease_id)
            held.parts_end = lease.first_block + len(lease.block_ids)
            self.parts_exposed[lease.lease_id] = request_id
            self.send_to_router(KvPart(request_id=request_id, lease_id=lease.lease_id, first_block=lease.first_block,
                                       block_ids=list(lease.block_ids), block_hashes=list(lease.block_hashes),
                                       num_tokens=lease.num_tokens), [])

    def _withdraw_parts(self, held: Held) -> None:
        """End the request's part leases still exposed: its whole prompt's lease ended, or
        it ended without one. A part being pulled ends once its sends settle."""
        for lease_id in held.parts:
            if lease_id in self.parts_exposed:
                self.transport.withdraw(lease_id)
        held.parts = []

    def _send_ready(self, ready: KvReady, session: str, joined: bool) -> None:
        """KvReady to the router; with the request and its prompt when the router may not
        hold the hand-off (this worker joined it after the request came). Not sent while
        the worker must join again: the rejoin sends it."""
        held = self.held.get(ready.request_id)
        if held is None or held.session == session:
            self.send_to_router(ready, [])
        elif joined:
            held.session = session
            self.send_to_router(replace(ready, request=held.request), [held.prompt])

    def rejoined(self, session: str) -> None:
        """Send again, with the request, the KvReady of every lease no decode worker has
        claimed that went to an earlier registration: this router may never have had it.
        A lease a decode worker is pulling now is claimed: that worker has the request,
        and tells the router so when it rejoins."""
        for held in self.held.values():
            if held.ready is None or held.claimed or held.session == session:
                continue
            if self.transport.serving(held.ready.lease_id):
                held.claimed = True
                continue
            self._send_ready(held.ready, session, joined=True)

    # ---- leases --------------------------------------------------------------------

    def handle(self, message) -> bool:
        """A lease update from a decode worker, through the router; False if `message` is
        not one."""
        if not isinstance(message, KvLeaseUpdate):
            return False
        lease_id, request_id = message.lease_id, message.request_id
        part = self.parts_exposed.get(lease_id) == request_id
        try:
            self.engine.lease(lease_id, request_id)
            if self.exposed.get(lease_id) != request_id and not part:
                raise LeaseError("not exposed")
        except LeaseError:
            self.metrics.lease_refused.inc()
            log.warning("lease_update_refused", request_id=request_id, action=message.action,
                        why="no live lease of that request")
            return True
        if part:  # a part nobody takes (the router found no decode worker for it)
            if message.action == "release":
                self.transport.withdraw(lease_id)  # its TransferEvent frees the blocks
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

    def tend(self) -> None:
        """Each turn: free the blocks of the exposures that ended."""
        for _ in range(EVENTS_PER_TURN):
            event = self.transport.next_event(0)
            if event is None:
                return
            self._exposure_ended(event)

    def _exposure_ended(self, event: TransferEvent) -> None:
        part_of = self.parts_exposed.pop(event.transfer_id, None)
        if part_of is not None:
            self.metrics.parts.inc(outcome=event.status)
            if not event.settled:
                log.error("kv_sends_unsettled", request_id=part_of, status=event.status, reason=event.reason)
            self.engine.release_lease(event.transfer_id, part_of)
            return
        request_id = self.exposed.pop(event.transfer_id, None)
        if request_id is None:
            return
        held = self.held.pop(request_id, None)
        if held is not None:
            self._withdraw_parts(held)
        self.metrics.exposures.inc(outcome=event.status)
        if not event.settled:  # a send still pending (its puller gone) only reads the blocks
            log.error("kv_sends_unsettled", request_id=request_id, status=event.status, reason=event.reason)
        elif event.status != "done":
            log.warning("kv_lease_ended", request_id=request_id, status=event.status, reason=event.reason)
        self.engine.release_lease(event.transfer_id, request_id)

    def report(self) -> None:
        self.metrics.leased_blocks.set(self.engine.leases.num_blocks)

    def health(self) -> dict:
        return {"kv_blocks_leased": self.engine.leases.num_blocks, "kv_address": self.kv_address}
