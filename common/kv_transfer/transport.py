"""The KV transport interface and its control plane, shared by both implementations.

One KvTransport per engine process serves its own pool (`listen`, `expose`) and pulls
into it from peers (`connect`, `pull`). Everything that touches a socket or the UCX
worker runs on one service thread; the public methods hand it commands through a
bounded queue and wait with a deadline. The control messages (KvHello … KvEnd, in
common/protocol.py) travel over ZeroMQ with the role security of common/sockets.py;
where the KV bytes go is the subclass's business (`_post_receives`, `_send_some`, …).

Contracts (docs/kv-transfer.md §2):
- a pull posts its receives into views of the destination blocks before it asks;
- every transfer has a deadline on both sides, and whichever side gives up first tells
  the other with KvEnd at once;
- once `cancel` (or a failure) has been reported as settled, no byte of that transfer
  lands in the destination blocks any more; the server reports an exposure's end only
  once no send reads its blocks any more (or says it could not make sure: settled=False);
- every exposure ends with exactly one TransferEvent, and the engine frees its blocks then.
"""
from __future__ import annotations

import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import zmq

from common.kv_transfer.plan import (
    Piece,
    PlanError,
    PoolGeometry,
    check_block_ids,
    compat_hash,
    compat_of,
    first_mismatch,
    plan_pieces,
)
from common.kv_transfer.pool import as_pool
from common.logs import get_logger
from common.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    KvData,
    KvEnd,
    KvHello,
    KvPull,
    KvWelcome,
    ProtocolError,
    decode,
    encode,
    peek_request_id,
)
from common.sockets import Security, check_bind_address, check_endpoint

if TYPE_CHECKING:
    import torch  # only for the annotation: the transports import it only for a CUDA pool

T = TypeVar("T")

log = get_logger("kv_transfer")

SERVER_ROLE = "prefill"  # the role whose pool is pulled from by default (its key, with CURVE)
MIN_PIECE_BYTES = 4 << 10
MAX_PIECE_BYTES = 64 << 20
MAX_TIMEOUT_S = 600.0
MAX_ID_CHARS = 256
MAX_CLIENTS = 1024  # pullers one server keeps a handshake (and UCX endpoint) for
IDLE_POLL_S = 0.05
MESSAGES_PER_TURN = 256  # per socket and loop turn, so that one busy peer cannot starve timers


def host_endpoint(host: str) -> str:
    """tcp://HOST:0, an IPv6 address in brackets: how check_bind_address takes a host."""
    bare = host.strip("[]") if isinstance(host, str) else ""
    if not bare or any(c.isspace() or c in "/;@" for c in bare):
        raise ValueError(f"host: {host!r} is not a host name or address")
    return f"tcp://[{bare}]:0" if ":" in bare else f"tcp://{bare}:0"


class HandshakeRefused(ConnectionError):
    """The peer's pool is incompatible; `field` names the first field that differs."""

    def __init__(self, reason: str, field_name: str):
        super().__init__(reason)
        self.field = field_name


@dataclass(frozen=True)
class TransferOptions:
    max_piece_bytes: int = 0  # one UCX message / one ZeroMQ frame at most; 0: the transport's default
    message_bytes: int = 1 << 20  # ZeroMQ: pieces are packed into messages of about this size
    window: int = 32  # pieces (UCX) or messages (ZeroMQ) of one transfer in flight
    settle_timeout_s: float = 5.0  # how long a cancel waits for in-flight bytes to settle
    handshake_timeout_s: float = 5.0
    command_timeout_s: float = 10.0
    max_transfers: int = 4096  # pulls plus exposures at once
    max_events: int = 65536
    huge_pages: bool = True  # back the pool with transparent huge pages (memory.py)
    send_pause_s: float = 0.0  # tests only: the server waits this long before each piece/message
    ignore_puller_end: bool = False  # tests only: the server goes on sending after a cancel
    puller_roles: tuple[str, ...] = ("decode",)  # the roles a server hands KV to (the store's: every engine role)
    host: str = "127.0.0.1"  # the host the role's sockets bind (ClusterConfig.host): the data plane's only one


@dataclass
class PullResult:
    """How a pull ended. status: done, failed, timeout or cancelled. settled is False only
    when in-flight bytes could not be ruled out within settle_timeout_s: the destination
    blocks must then not be reused."""

    transfer_id: str
    status: str
    code: str = ""
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    settled: bool = True


@dataclass
class TransferEvent:
    """How an exposure ended on the serving side: done (the puller acknowledged; free the
    blocks), failed, cancelled (by the puller), expired (lease ended, never pulled) or
    withdrawn. settled as in PullResult, for the source blocks."""

    transfer_id: str
    status: str
    reason: str = ""
    settled: bool = True


class PullHandle:
    """A pull in flight; `wait` returns its PullResult."""

    def __init__(self, transfer_id: str):
        self.transfer_id = transfer_id
        self._future: Future[PullResult] = Future()

    def wait(self, timeout: float) -> PullResult:
        """The result; TimeoutError if it has not ended within `timeout` seconds (the pull's
        own deadline still ends it)."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"pull {self.transfer_id} not ended within {timeout} s") from None

    def done(self) -> bool:
        return self._future.done()

    def _resolve(self, result: PullResult) -> None:
        if not self._future.done():
            self._future.set_result(result)


@dataclass
class _Peer:
    """A server this transport pulls from (one DEALER socket, one handshake)."""

    address: str
    socket: zmq.Socket
    welcome: Future = field(default_factory=Future)
    accepted: bool = False
    pool_blocks: int = 0
    block_major: bool = False


@dataclass
class _Client:
    """A puller this transport serves, by its ROUTER identity."""

    identity: bytes
    peer_id: str
    geometry: PoolGeometry
    ucx_endpoint: Any = None


@dataclass
class _Pull:
    transfer_id: str
    nonce: int
    peer: _Peer
    pieces: list[Piece]
    deadline: float
    handle: PullHandle
    started: float
    received: int = 0  # pieces landed (ZeroMQ) or completed receives (UCX)
    requests: list = field(default_factory=list)  # UCX receive requests
    nbytes: int = 0


@dataclass
class _Exposure:
    transfer_id: str
    block_ids: frozenset[int]
    lease_deadline: float
    serve: _Serve | None = None
    reopen: bool = False  # a failed pull leaves it exposed for another (expose's reopen_on_failure)


@dataclass
class _Serve:
    exposure: _Exposure
    client: _Client
    nonce: int
    pieces: list[Piece]
    deadline: float
    next_index: int = 0  # the next piece (UCX) or message group (ZeroMQ) to send
    next_send_at: float = 0.0
    in_flight: list = field(default_factory=list)  # UCX send requests or ZeroMQ trackers
    groups: list[tuple[int, int]] = field(default_factory=list)
    all_sent: bool = False
    ending: TransferEvent | None = None  # set when it is over: waiting for in-flight sends
    settle_deadline: float = 0.0
    reopen: bool = False  # once settled, its exposure may be pulled again instead of ending


class KvTransport:
    """Base of UcxTransport and ZmqTransport: the control plane and the bookkeeping."""

    name = "base"
    default_piece_bytes = 1 << 20

    def __init__(self, pool: np.ndarray | torch.Tensor, geometry: PoolGeometry, model_fingerprint: str,
                 security: Security, peer_id: str, options: TransferOptions | None = None):
        """`pool` is the flat uint8 view of the whole KV pool (see `pool_bytes`): a numpy
        array (CPU) or a CUDA tensor (pool.py), the only memory the transport ever reads or
        writes."""
        self.pool = as_pool(pool)
        if self.pool.nbytes != geometry.pool_bytes:
            raise ValueError(f"pool has {self.pool.nbytes} bytes, its geometry {geometry.pool_bytes}")
        self.options = options or TransferOptions()
        if not self.options.max_piece_bytes:
            self.options = replace(self.options, max_piece_bytes=self.default_piece_bytes)
        if not MIN_PIECE_BYTES <= self.options.max_piece_bytes <= MAX_PIECE_BYTES:
            raise ValueError(f"max_piece_bytes must be in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}]")
        # The data plane listens too (UCX's TCP transport), so the control socket's rule holds for it.
        check_bind_address(host_endpoint(self.options.host), security.curve, security.insecure)
        self.huge_pages = self.pool.advise_huge_pages() if self.options.huge_pages else "off"
        self.geometry = geometry
        self.compat = compat_of(geometry, model_fingerprint)
        self.compat_hash = compat_hash(self.compat)
        self.security = security
        self.peer_id = peer_id
        self.counters = {"bad_frames": 0, "late_frames": 0, "refused": 0, "events_dropped": 0, "pieces_landed": 0}
        self._commands: queue.Queue = queue.Queue(maxsize=1024)
        self._events: queue.Queue[TransferEvent] = queue.Queue(maxsize=self.options.max_events)
        self._server: zmq.Socket | None = None
        self._peers: dict[str, _Peer] = {}
        self._peers_by_socket: dict[zmq.Socket, _Peer] = {}
        self._clients: dict[bytes, _Client] = {}
        self._pulls: dict[str, _Pull] = {}
        self._exposures: dict[str, _Exposure] = {}
        self._settling: list[_Serve] = []
        self._poller = zmq.Poller()
        with self.pool.current():  # a CUDA pool's device is current where UCX starts
            self._start_data_plane()  # may raise (UCX that does not start): nothing to undo yet
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._running = True
        self._thread = threading.Thread(target=self._serve_forever, name=f"kv-{self.name}", daemon=True)
        self._thread.start()

    # ---- the public interface: each call runs on the service thread -------------------

    def listen(self, address: str) -> str:
        """Serve this pool on `address` (a ZeroMQ endpoint; port 0 picks one); returns the
        bound endpoint."""
        return self._call(self._do_listen, address)

    def connect(self, address: str, server_role: str = SERVER_ROLE) -> str:
        """Handshake with the server at `address` (once per peer), which must prove it has
        `server_role`'s key under CURVE; returns the key to pull with. HandshakeRefused
        names the first incompatible field; TimeoutError if no answer within
        handshake_timeout_s."""
        peer = self._call(self._do_connect, address, server_role)
        try:
            peer.welcome.result(self.options.handshake_timeout_s)
        except TimeoutError:
            self._call(self._drop_peer, address)
            raise TimeoutError(f"no KV handshake answer from {address} within "
                               f"{self.options.handshake_timeout_s} s") from None
        except HandshakeRefused:
            self._call(self._drop_peer, address)
            raise
        return address

    def disconnect(self, address: str) -> None:
        """Forget the server at `address` (a new process serves there now): its running
        pulls fail, and the next `connect` handshakes anew."""
        self._call(self._drop_peer, address)

    def expose(self, transfer_id: str, block_ids: list[int], lease_s: float, reopen_on_failure: bool = False) -> None:
        """Let a peer pull these blocks under `transfer_id` until the lease ends; the
        exposure ends with one TransferEvent (see `next_event`). With `reopen_on_failure`
        a pull that fails (its deadline, either side's transport) does not end it: once
        that pull's sends have settled it may be pulled again, by any accepted peer, until
        the lease ends. The caller's writes to the blocks must be queued already: a CUDA
        pool waits for the caller's stream here."""
        self.pool.settle_caller()
        self._call(self._do_expose, transfer_id, list(block_ids), lease_s, reopen_on_failure)

    def renew(self, transfer_id: str, lease_s: float) -> bool:
        """Extend a waiting exposure's lease to now + lease_s; False if it is gone."""
        return self._call(self._do_renew, transfer_id, lease_s)

    def withdraw(self, transfer_id: str) -> bool:
        """End an exposure (and any pull of it, which is failed to the puller)."""
        return self._call(self._do_withdraw, transfer_id)

    def serving(self, transfer_id: str) -> bool:
        """Whether a peer's pull of this exposure is running now."""
        return self._call(self._do_serving, transfer_id)

    def pull(self, peer: str, transfer_id: str, src_block_ids: list[int], dst_block_ids: list[int],
             deadline: float) -> PullHandle:
        """Pull the peer's exposed `src_block_ids` into our `dst_block_ids` (same order),
        ending by `deadline` (time.monotonic() seconds) at the latest. A CUDA pool first
        waits for the caller's stream, whose kernels may still use the destination blocks."""
        self.pool.settle_caller()
        handle = PullHandle(transfer_id)
        self._call(self._do_pull, peer, transfer_id, list(src_block_ids), list(dst_block_ids), deadline, handle)
        return handle

    def cancel(self, transfer_id: str) -> bool:
        """Abort our pull of `transfer_id`: tell the server, and return only once no byte of
        it can land any more (True), or after settle_timeout_s without that certainty (False:
        keep the destination blocks out of use). False too if no such pull is running."""
        return self._call(self._do_cancel, transfer_id,
                          timeout=self.options.settle_timeout_s + self.options.command_timeout_s)

    def counters_snapshot(self) -> dict[str, int]:
        """A copy of the counters: bad_frames, late_frames (bytes that arrived for no running
        pull and were dropped), refused, events_dropped, pieces_landed."""
        return dict(self.counters)

    def next_event(self, timeout: float) -> TransferEvent | None:
        """The next ended exposure, or None after `timeout` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop the service thread and close every socket; pulls still running fail."""
        if not self._running:
            return
        try:
            self._call(self._do_close)
        finally:
            self._thread.join(self.options.command_timeout_s)
            os.close(self._wake_read)
            os.close(self._wake_write)

    def __enter__(self) -> KvTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the command channel ---------------------------------------------------------------

    def _call(self, function: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        if not self._running:
            raise RuntimeError("the KV transport is closed")
        result: Future[T] = Future()
        try:
            self._commands.put((function, args, result), timeout=self.options.command_timeout_s)
        except queue.Full:
            raise RuntimeError("the KV transport's command queue stayed full") from None
        self._wake()
        try:
            return result.result(timeout or self.options.command_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the KV transport did not answer {function.__name__} in time") from None

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:  # the pipe is full: the thread is awake anyway
            pass

    def _run_commands(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                function, args, result = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result.set_result(function(*args))
            except Exception as error:  # handed to the caller, who raises it
                result.set_exception(error)

    # ---- the service loop ----------------------------------------------------------------

    def _serve_forever(self) -> None:
        self.pool.bind_thread()
        while self._running:
            try:
                self._turn()
            except Exception:  # a bug must not leave callers waiting forever: log, go on
                log.exception("kv_transfer_loop_error", transport=self.name)
                time.sleep(0.01)
        self._teardown()

    def _turn(self) -> None:
        self._progress()
        self._drive_serves()
        self._check_deadlines()
        timeout_ms = 0 if self._busy() else math.ceil(self._idle_wait_s() * 1000)
        for socket, _ in self._poller.poll(timeout_ms):  # the data plane may add its own fd
            if socket == self._wake_read:
                self._run_commands()
            elif self._server is not None and socket is self._server:
                self._receive_all(self._server, self._on_server_frames)
            elif socket in self._peers_by_socket:
                self._receive_all(socket, self._on_peer_frames)

    def _idle_wait_s(self) -> float:
        now = time.monotonic()
        times = [pull.deadline for pull in self._pulls.values()]
        times += [exposure.lease_deadline for exposure in self._exposures.values() if exposure.serve is None]
        times += [serve.next_send_at for serve in self._serving() if not serve.all_sent]
        times += [serve.deadline for serve in self._serving()]
        times += [serve.settle_deadline for serve in self._settling]
        return max(0.0, min([IDLE_POLL_S, *(t - now for t in times)]))

    def _receive_all(self, socket: zmq.Socket, handler: Callable) -> None:
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(socket, frames)

    def _serving(self) -> list[_Serve]:
        return [exposure.serve for exposure in self._exposures.values() if exposure.serve is not None]

    # ---- server side: handshake, pulls, sends ---------------------------------------------

    def _do_listen(self, address: str) -> str:
        if self._server is not None:
            raise RuntimeError("this KV transport already listens")
        self._server = self.security.server(zmq.ROUTER, address, accept=self.options.puller_roles)
        self._poller.register(self._server, zmq.POLLIN)
        bound = self._server.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("kv_transport_listening", transport=self.name, address=bound)
        return bound

    def _on_server_frames(self, socket: zmq.Socket, raw: list) -> None:
        if len(raw) < 2:
            self.counters["bad_frames"] += 1
            return
        identity, frames = bytes(raw[0]), [frame.buffer for frame in raw[1:]]
        try:
            message, _ = decode(frames)
        except ProtocolError as error:
            self._refuse(identity, peek_request_id(frames), 0, ErrorCode.INVALID_REQUEST, str(error), bad=True)
            return
        if isinstance(message, KvHello):
            self._on_hello(identity, message)
        elif isinstance(message, KvPull):
            self._on_pull(identity, message)
        elif isinstance(message, KvEnd):
            self._on_puller_end(identity, message)
        else:
            self._refuse(identity, "", 0, ErrorCode.INVALID_REQUEST,
                         f"a KV server does not take {type(message).__name__}", bad=True)

    def _on_hello(self, identity: bytes, hello: KvHello) -> None:
        mismatch = first_mismatch(self.compat, hello.compat, PROTOCOL_VERSION, hello.protocol_version)
        field_name = mismatch.partition(":")[0] if mismatch else ""
        if mismatch is None and hello.transport != self.name:
            mismatch, field_name = f"transport: {self.name!r} here, {hello.transport!r} there", "transport"
        if mismatch is None and hello.compat_hash != compat_hash(hello.compat, hello.protocol_version):
            mismatch, field_name = "compat_hash: does not match the fields it came with", "compat_hash"
        if mismatch is None and not 0 < hello.pool_blocks <= 1 << 31:
            mismatch, field_name = f"pool_blocks: {hello.pool_blocks} is not a pool size", "pool_blocks"
        if mismatch is None and identity not in self._clients and len(self._clients) >= MAX_CLIENTS:
            mismatch, field_name = f"peers: this server already serves {MAX_CLIENTS}", "peers"
        if mismatch is None:
            mismatch = self._accept_client(identity, hello)
            field_name = "ucx_address" if mismatch else ""
        if mismatch is not None:
            self.counters["refused"] += 1
            log.warning("kv_handshake_refused", peer=hello.peer_id[:MAX_ID_CHARS], reason=mismatch)
        self._send_to_client(identity, KvWelcome(accepted=mismatch is None, reason=mismatch or "",
                                                 field=field_name, transport=self.name,
                                                 pool_blocks=self.geometry.num_blocks,
                                                 block_major=self.geometry.block_major))

    def _accept_client(self, identity: bytes, hello: KvHello) -> str | None:
        """Record the puller; None, or why its data-plane address is unusable."""
        geometry = replace(self.geometry, num_blocks=hello.pool_blocks, block_major=hello.block_major)
        client = _Client(identity, hello.peer_id[:MAX_ID_CHARS], geometry)
        try:
            client.ucx_endpoint = self._client_endpoint(hello)
        except Exception as error:
            return f"ucx_address: cannot reach it: {error}"
        self._clients[identity] = client
        return None

    def _on_pull(self, identity: bytes, pull: KvPull) -> None:
        client = self._clients.get(identity)
        exposure = self._exposures.get(pull.transfer_id)
        refusal = self._pull_refusal(client, exposure, pull)
        if refusal is None:
            assert client is not None and exposure is not None  # _pull_refusal refuses a missing one
            try:
                pieces = plan_pieces(self.geometry, client.geometry, pull.src_block_ids, pull.dst_block_ids,
                                     pull.max_piece_bytes)
            except PlanError as error:
                refusal = str(error)
        if refusal is not None:
            self._refuse(identity, pull.transfer_id, pull.nonce, ErrorCode.REFUSED, refusal)
            return
        assert client is not None and exposure is not None  # as above
        timeout = min(pull.timeout_s, MAX_TIMEOUT_S)
        serve = _Serve(exposure, client, pull.nonce, pieces, time.monotonic() + timeout)
        serve.next_send_at = time.monotonic() + self.options.send_pause_s
        self._prepare_serve(serve)
        exposure.serve = serve

    def _pull_refusal(self, client: _Client | None, exposure: _Exposure | None, pull: KvPull) -> str | None:
        if client is None:
            return "no accepted handshake from this peer"
        if exposure is None:
            return f"unknown transfer id {pull.transfer_id[:MAX_ID_CHARS]!r}"
        if exposure.serve is not None:
            return f"transfer {pull.transfer_id!r} is already being pulled"
        if not 0 < pull.timeout_s <= MAX_TIMEOUT_S:
            return f"timeout_s {pull.timeout_s} is not in (0, {MAX_TIMEOUT_S}]"
        if not MIN_PIECE_BYTES <= pull.max_piece_bytes <= MAX_PIECE_BYTES:
            return f"max_piece_bytes {pull.max_piece_bytes} is not in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}]"
        if not 0 < pull.nonce < 1 << 40:
            return "nonce out of range"
        if not set(pull.src_block_ids) <= exposure.block_ids:
            return f"transfer {pull.transfer_id!r} does not expose every requested block"
        return None

    def _on_puller_end(self, identity: bytes, end: KvEnd) -> None:
        exposure = self._exposures.get(end.transfer_id)
        serve = exposure.serve if exposure is not None else None
        if serve is None or serve.client.identity != identity or serve.nonce != end.nonce:
            self.counters["late_frames"] += 1
            return
        status = {"done": "done", "cancelled": "cancelled"}.get(end.status, "failed")
        if status != "done" and self.options.ignore_puller_end:
            return
        if status == "done" and not serve.all_sent:
            status, end.reason = "failed", "the puller reported done before every piece was sent"
        self._end_serve(serve, TransferEvent(end.transfer_id, status, end.reason))

    def _drive_serves(self) -> None:
        now = time.monotonic()
        for serve in self._serving():
            if serve.ending is None and not serve.all_sent and now >= serve.next_send_at:
                try:
                    self._send_some(serve, now)
                except zmq.ZMQError as error:  # the puller is gone (ROUTER_MANDATORY)
                    self._end_serve(serve, TransferEvent(serve.exposure.transfer_id, "failed",
                                                         f"cannot send to the puller: {error}"))
        for serve in list(self._settling):
            self._try_settle(serve, now)

    def _end_serve(self, serve: _Serve, event: TransferEvent, tell_code: str = "") -> None:
        """Stop sending (telling the puller with KvEnd when tell_code is given); the exposure's
        event goes out once in-flight sends have settled."""
        if serve.ending is not None:
            return
        if tell_code:
            self._send_to_client(serve.client.identity,
                                 KvEnd(event.transfer_id, serve.nonce, "failed", tell_code, event.reason))
        serve.ending = event
        serve.settle_deadline = time.monotonic() + self.options.settle_timeout_s
        serve.reopen = serve.exposure.reopen and event.status == "failed"
        if not serve.reopen:
            self._exposures.pop(event.transfer_id, None)
        self._settling.append(serve)
        self._try_settle(serve, time.monotonic())

    def _try_settle(self, serve: _Serve, now: float) -> None:
        settled = self._sends_settled(serve)
        if settled or now >= serve.settle_deadline:
            assert serve.ending is not None  # only an ending serve is settling
            self._settling.remove(serve)
            serve.ending.settled = settled
            if serve.reopen:
                self._reopen(serve)
            else:
                self._emit(serve.ending)

    def _reopen(self, serve: _Serve) -> None:
        """A failed pull of a reopening exposure has settled: the exposure waits for another
        pull (or its lease's end) again."""
        exposure = serve.exposure
        if self._exposures.get(exposure.transfer_id) is exposure and exposure.serve is serve:
            exposure.serve = None
            log.info("kv_exposure_reopened", transfer_id=exposure.transfer_id)

    def _emit(self, event: TransferEvent) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self.counters["events_dropped"] += 1
            log.error("kv_event_dropped", transfer_id=event.transfer_id, status=event.status)

    def _refuse(self, identity: bytes, transfer_id: str, nonce: int, code: ErrorCode, reason: str,
                bad: bool = False) -> None:
        self.counters["bad_frames" if bad else "refused"] += 1
        log.warning("kv_message_refused", transfer_id=transfer_id[:MAX_ID_CHARS], reason=reason[:500])
        nonce = nonce if isinstance(nonce, int) and 0 <= nonce < 1 << 40 else 0
        self._send_to_client(identity, KvEnd(transfer_id[:MAX_ID_CHARS], nonce, "failed", code, reason[:500]))

    @property
    def _bound_server(self) -> zmq.Socket:
        """The control socket pullers talk to (it exists once the transport listens)."""
        if self._server is None:
            raise RuntimeError("the KV transport is not listening")
        return self._server

    def _send_to_client(self, identity: bytes, message: msgspec.Struct) -> None:
        try:
            self._bound_server.send_multipart([identity, *encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as error:  # gone or not reading: its own deadline ends its side
            log.warning("kv_reply_lost", error=str(error), message=type(message).__name__)

    # ---- server side: exposures --------------------------------------------------------------

    def _do_expose(self, transfer_id: str, block_ids: list[int], lease_s: float, reopen: bool) -> None:
        if not transfer_id or len(transfer_id) > MAX_ID_CHARS:
            raise ValueError(f"transfer id must have 1..{MAX_ID_CHARS} characters")
        if transfer_id in self._exposures:
            raise ValueError(f"transfer {transfer_id!r} is already exposed")
        if not 0 < lease_s < math.inf:
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s}")
        if len(self._exposures) + len(self._pulls) >= self.options.max_transfers:
            raise RuntimeError(f"{self.options.max_transfers} transfers at once, the limit")
        check_block_ids(block_ids, self.geometry.num_blocks, "exposed")
        self._exposures[transfer_id] = _Exposure(transfer_id, frozenset(block_ids), time.monotonic() + lease_s,
                                                 reopen=reopen)

    def _do_renew(self, transfer_id: str, lease_s: float) -> bool:
        exposure = self._exposures.get(transfer_id)
        if exposure is None:
            return False
        exposure.lease_deadline = max(exposure.lease_deadline, time.monotonic() + lease_s)
        return True

    def _do_serving(self, transfer_id: str) -> bool:
        exposure = self._exposures.get(transfer_id)
        return exposure is not None and exposure.serve is not None

    def _do_withdraw(self, transfer_id: str) -> bool:
        exposure = self._exposures.get(transfer_id)
        if exposure is None:
            return False
        serve = exposure.serve
        if serve is not None and serve.reopen:  # a failed pull settling: the exposure ends with it instead
            serve.reopen = False
            serve.ending = TransferEvent(transfer_id, "withdrawn", "withdrawn by the server")
            del self._exposures[transfer_id]
        elif serve is not None:
            self._end_serve(serve, TransferEvent(transfer_id, "withdrawn", "withdrawn by the server"),
                            tell_code=ErrorCode.UNAVAILABLE)
        else:
            del self._exposures[transfer_id]
            self._emit(TransferEvent(transfer_id, "withdrawn", "withdrawn by the server"))
        return True

    # ---- puller side --------------------------------------------------------------------------

    def _do_connect(self, address: str, server_role: str) -> _Peer:
        check_endpoint(address)
        peer = self._peers.get(address)
        if peer is not None and peer.accepted:
            return peer
        if peer is not None:
            self._drop_peer(address)
        socket = self.security.client(zmq.DEALER, address, server_role)
        peer = _Peer(address, socket)
        self._peers[address] = peer
        self._peers_by_socket[socket] = peer
        self._poller.register(socket, zmq.POLLIN)
        hello = KvHello(PROTOCOL_VERSION, self.peer_id, self.name, self.compat, self.compat_hash,
                        self.geometry.num_blocks, self._own_ucx_address(), self.geometry.block_major)
        socket.send_multipart(encode(hello), zmq.NOBLOCK)
        return peer

    def _drop_peer(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is None:
            return
        for pull in [p for p in self._pulls.values() if p.peer is peer]:
            self._finish_pull(pull, "failed", ErrorCode.UNAVAILABLE, "the peer was dropped", tell_server=False)
        self._peers_by_socket.pop(peer.socket, None)
        self._poller.unregister(peer.socket)
        peer.socket.close(0)

    def _do_pull(self, address: str, transfer_id: str, src_ids: list[int], dst_ids: list[int], deadline: float,
                 handle: PullHandle) -> None:
        peer = self._peers.get(address)
        if peer is None or not peer.accepted:
            raise ConnectionError(f"no accepted KV handshake with {address!r}: call connect first")
        if transfer_id in self._pulls:
            raise ValueError(f"a pull of {transfer_id!r} is already running")
        if not transfer_id or len(transfer_id) > MAX_ID_CHARS:
            raise ValueError(f"transfer id must have 1..{MAX_ID_CHARS} characters")
        if len(self._exposures) + len(self._pulls) >= self.options.max_transfers:
            raise RuntimeError(f"{self.options.max_transfers} transfers at once, the limit")
        now = time.monotonic()
        if deadline <= now:
            raise ValueError("the pull's deadline has already passed")
        source = replace(self.geometry, num_blocks=peer.pool_blocks, block_major=peer.block_major)
        pieces = plan_pieces(source, self.geometry, src_ids, dst_ids,
                             self.options.max_piece_bytes)
        pull = _Pull(transfer_id, self._new_nonce(), peer, pieces, deadline, handle, now)
        self._post_receives(pull)  # before asking: the bytes must find their place ready
        self._pulls[transfer_id] = pull
        request = KvPull(transfer_id, pull.nonce, src_ids, dst_ids, min(deadline - now, MAX_TIMEOUT_S),
                         self.options.max_piece_bytes)
        peer.socket.send_multipart(encode(request), zmq.NOBLOCK)
        if not pieces:
            self._finish_pull(pull, "done", "", "", tell_server=True)

    def _new_nonce(self) -> int:
        used = {pull.nonce for pull in self._pulls.values()}
        while True:
            nonce = int.from_bytes(secrets.token_bytes(5), "little")
            if nonce and nonce not in used:
                return nonce

    def _on_peer_frames(self, socket: zmq.Socket, raw: list) -> None:
        peer = self._peers_by_socket[socket]
        frames = [frame.buffer for frame in raw]
        try:
            message, payloads = decode(frames)
        except ProtocolError as error:
            self.counters["bad_frames"] += 1
            log.warning("kv_bad_frame_from_server", peer=peer.address, error=str(error))
            return
        if isinstance(message, KvWelcome):
            self._on_welcome(peer, message)
        elif isinstance(message, KvData):
            self._on_data(peer, message, payloads)
        elif isinstance(message, KvEnd):
            self._on_server_end(peer, message)
        else:
            self.counters["bad_frames"] += 1
            log.warning("kv_unexpected_message", peer=peer.address, message=type(message).__name__)

    def _on_welcome(self, peer: _Peer, welcome: KvWelcome) -> None:
        if peer.welcome.done():
            self.counters["late_frames"] += 1
            return
        if welcome.accepted and not 0 < welcome.pool_blocks <= 1 << 31:
            peer.welcome.set_exception(HandshakeRefused(f"{peer.address} sent no pool size", "pool_blocks"))
        elif welcome.accepted:
            peer.accepted = True
            peer.pool_blocks = welcome.pool_blocks
            peer.block_major = welcome.block_major
            peer.welcome.set_result(True)
            log.info("kv_peer_accepted", transport=self.name, peer=peer.address)
        else:
            peer.welcome.set_exception(HandshakeRefused(f"KV handshake with {peer.address} refused: "
                                                        f"{welcome.reason}", welcome.field))

    def _on_server_end(self, peer: _Peer, end: KvEnd) -> None:
        pull = self._pulls.get(end.transfer_id)
        if pull is None or pull.peer is not peer or pull.nonce != end.nonce:
            self.counters["late_frames"] += 1
            if end.transfer_id == "" or end.nonce == 0:  # a refusal of something we sent
                log.warning("kv_server_refusal", peer=peer.address, code=end.code, reason=end.reason)
            return
        status = "timeout" if end.code == ErrorCode.TIMEOUT else "failed"
        self._finish_pull(pull, status, end.code or ErrorCode.INTERNAL, f"server: {end.reason}", tell_server=False)

    def _on_data(self, peer: _Peer, data: KvData, payloads: list[np.ndarray]) -> None:
        """KV bytes on the control socket: only the ZeroMQ transport takes them."""
        self.counters["bad_frames"] += 1
        log.warning("kv_unexpected_message", peer=peer.address, message="KvData")

    def _piece_landed(self, pull: _Pull, nbytes: int) -> None:
        self.counters["pieces_landed"] += 1
        pull.received += 1
        pull.nbytes += nbytes
        if pull.received == len(pull.pieces):
            self._finish_pull(pull, "done", "", "", tell_server=True)

    def _finish_pull(self, pull: _Pull, status: str, code: str, reason: str, tell_server: bool) -> None:
        """End a pull once: settle its receives, tell the server if it does not know, resolve."""
        if self._pulls.get(pull.transfer_id) is not pull:
            return
        del self._pulls[pull.transfer_id]
        settled = True if status == "done" else self._settle_receives(pull)
        if tell_server:
            end = KvEnd(pull.transfer_id, pull.nonce, "done" if status == "done" else
                        "cancelled" if status == "cancelled" else "failed", code, reason)
            try:
                pull.peer.socket.send_multipart(encode(end), zmq.NOBLOCK)
            except zmq.ZMQError as error:
                log.warning("kv_end_lost", transfer_id=pull.transfer_id, error=str(error))
        if status != "done":
            log.warning("kv_pull_ended", transfer_id=pull.transfer_id, status=status, reason=reason)
        pull.handle._resolve(PullResult(pull.transfer_id, status, code, reason, pull.nbytes,
                                        time.monotonic() - pull.started, settled))

    def _do_cancel(self, transfer_id: str) -> bool:
        pull = self._pulls.get(transfer_id)
        if pull is None:
            return False
        self._finish_pull(pull, "cancelled", "cancelled", "cancelled by the puller", tell_server=True)
        return pull.handle._future.result(0).settled

    # ---- deadlines -------------------------------------------------------------------------

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for pull in [p for p in self._pulls.values() if now >= p.deadline]:
            self._finish_pull(pull, "timeout", ErrorCode.TIMEOUT, "deadline passed before every piece landed",
                              tell_server=True)
        for serve in self._serving():
            if serve.ending is None and now >= serve.deadline:
                self._end_serve(serve, TransferEvent(serve.exposure.transfer_id, "failed",
                                                     "deadline passed before the puller acknowledged"),
                                tell_code=ErrorCode.TIMEOUT)
        for exposure in [e for e in self._exposures.values() if e.serve is None and now >= e.lease_deadline]:
            del self._exposures[exposure.transfer_id]
            self._emit(TransferEvent(exposure.transfer_id, "expired", "the lease ended before a pull"))

    # ---- shutdown ----------------------------------------------------------------------------

    def _do_close(self) -> None:
        for pull in list(self._pulls.values()):
            self._finish_pull(pull, "failed", ErrorCode.UNAVAILABLE, "the transport closed", tell_server=True)
        for serve in self._serving():
            self._end_serve(serve, TransferEvent(serve.exposure.transfer_id, "failed", "the transport closed"),
                            tell_code=ErrorCode.UNAVAILABLE)
        deadline = time.monotonic() + self.options.settle_timeout_s
        while self._settling and time.monotonic() < deadline:
            self._progress()
            self._drive_serves()
        self._running = False

    def _teardown(self) -> None:
        for peer in list(self._peers.values()):
            peer.socket.close(0)
        if self._server is not None:
            self._server.close(0)
        self._stop_data_plane()

    # ---- what each data plane provides -------------------------------------------------------

    def _start_data_plane(self) -> None:
        """Set up the data plane (called once, before the service thread starts)."""

    def _stop_data_plane(self) -> None:
        """Release the data plane (on the service thread, last)."""

    def _own_ucx_address(self) -> bytes:
        return b""

    def _client_endpoint(self, hello: KvHello) -> Any:
        """The data-plane endpoint to a new puller (None where the control socket carries data)."""
        return None

    def _busy(self) -> bool:
        """True while the loop must not wait: the data plane has work it can do now. Called
        right before the loop would wait, after _progress and _drive_serves."""
        return False

    def _progress(self) -> None:
        """Advance the data plane: complete receives (calling _piece_landed) and sends."""

    def _post_receives(self, pull: _Pull) -> None:
        """Make the destination blocks ready for the pull's pieces (before it is asked)."""

    def _settle_receives(self, pull: _Pull) -> bool:
        """Make sure no more bytes of this pull land; True once sure, False after settle_timeout_s."""
        return True

    def _prepare_serve(self, serve: _Serve) -> None:
        """Called once a pull is accepted, before the first _send_some."""

    def _send_some(self, serve: _Serve, now: float) -> None:
        """Send what the window allows; set serve.all_sent once the last piece is on its way."""
        raise NotImplementedError

    def _sends_settled(self, serve: _Serve) -> bool:
        """True once no send of this serve reads the source blocks any more."""
        return True

