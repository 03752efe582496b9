"""KV bytes over UCX (ucxx's tag send/receive), read and written in place in the pools:
host memory, or GPU memory for a CUDA pool (pool.py: its pieces are tensor slices, which
UCX's CUDA transports copy, between processes on one host by CUDA IPC).

ucxx's Python API has no one-sided get/put, so a pull posts one tag receive per piece
into a view of its destination blocks, then asks; the server sends each piece from a view
of its source blocks. On one host UCX moves a large message by reading the sender's
memory from the receiver (CMA), with no staging copy; on a cluster, RDMA. The tag of a
piece is the pull's random 40-bit nonce and the piece's 24-bit index, so no other
transfer's message can match a posted receive.

Endpoints are made from worker addresses exchanged in the (CURVE-authenticated) ZeroMQ
handshake, without a UCX listener, and without UCX's peer error handling, since that
excludes the shared-memory transports on one host; a dead peer is found by the deadline.

ucxx cannot cancel a single posted receive from Python, so a pull that ends early
settles its receives by sending itself an empty message on each unmatched tag: an empty
message matches and completes a receive without writing a byte. Once every receive of
the pull has completed (with data, poison or an error), UCX will write nothing more into
those blocks. A server message that finds no receive any more, and any poison that
finds none, waits in UCX's unexpected queue; every turn drains that queue into scratch
memory, since every message a pull expects has its receive posted before it is asked for.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from common.kv_transfer.netdev import interface_addresses, ucx_device_options
from common.kv_transfer.plan import MAX_PIECES
from common.kv_transfer.transport import MAX_PIECE_BYTES, KvTransport, TransferEvent, _Pull, _Serve, log
from common.protocol import ErrorCode, KvHello

PIECE_BITS = 24
MAX_UCX_ADDRESS_BYTES = 1 << 16
assert MAX_PIECES == 1 << PIECE_BITS


def _tag(nonce: int, index: int) -> int:
    return (nonce << PIECE_BITS) | index


class UcxTransport(KvTransport):
    name = "ucx"
    # Fewer, larger messages: each costs a rendezvous round trip; 4 MiB beat 1 MiB here
    # (docs/kv-transfer.md §4).
    default_piece_bytes = 4 << 20

    def _start_data_plane(self) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._api, self._array = ucx_api, Array
        # UCX's TCP transport listens on every interface it uses: keep it to the host's. Given
        # in the context's config rather than as UCX_* variables, which would reach every UCX
        # context of the process and its children, and stay after this transport.
        device_options = ucx_device_options(self.options.host, interface_addresses())
        self._context = ucx_api.UCXContext(config_dict=device_options,
                                           feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        if self.pool.on_device and not self._context.cuda_support:
            raise RuntimeError("this UCX has no CUDA support (a UCX built without CUDA, or UCX_TLS without "
                               "cuda_copy), so it cannot move a GPU pool: kv_transport = zmq stages it "
                               "through host memory")
        self._worker = ucx_api.UCXWorker(self._context)
        # The service loop sleeps in its poll on UCX's event fd too, instead of spinning.
        self._worker.init_blocking_progress_mode()
        self._poller.register(self._worker.epoll_file_descriptor, zmq.POLLIN)
        self._address = bytes(self._worker.address)
        self._self_endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
            self._worker, self._worker.address, False)
        self._empty = Array(np.empty(0, dtype=np.uint8))
        self._poison: list = []  # empty sends to ourselves, kept until complete
        self._drains: list = []  # (receive, scratch) of unexpected messages
        log.info("kv_transport_started", transport=self.name, ucx_version=".".join(map(str, ucx_api.get_ucx_version())),
                 tls=self._context.config.get("TLS", ""), net_devices=self._context.config.get("NET_DEVICES", ""),
                 host=self.options.host, huge_pages=self.huge_pages)

    def _stop_data_plane(self) -> None:
        for client in self._clients.values():
            client.ucx_endpoint = None
        self._self_endpoint = None
        self._poison, self._drains = [], []
        self._worker = None
        self._context = None

    def _own_ucx_address(self) -> bytes:
        return self._address

    def _client_endpoint(self, hello: KvHello) -> Any:  # a ucxx endpoint (ucxx is untyped)
        if not 0 < len(hello.ucx_address) <= MAX_UCX_ADDRESS_BYTES:
            raise ValueError(f"a UCX worker address of {len(hello.ucx_address)} bytes")
        address = self._api.UCXAddress.create_from_buffer(hello.ucx_address)
        return self._api.UCXEndpoint.create_from_worker_address(self._worker, address, False)

    # ---- the loop ------------------------------------------------------------------------------

    def _busy(self) -> bool:
        """Busy unless UCX could be armed: arming fails while events wait to be progressed."""
        now = time.monotonic()
        sendable = any(serve.ending is None and not serve.all_sent and len(serve.in_flight) < self.options.window
                       and now >= serve.next_send_at for serve in self._serving())
        return sendable or not self._worker.arm()

    def _progress(self) -> None:
        while self._worker.progress_once():
            pass
        for pull in list(self._pulls.values()):
            self._collect_receives(pull)
        for serve in self._serving():
            self._collect_sends(serve)
        self._poison = [request for request in self._poison if not request.completed]
        self._drain_unexpected()

    # ---- the puller's receives -----------------------------------------------------------------

    def _post_receives(self, pull: _Pull) -> None:
        for index, piece in enumerate(pull.pieces):
            view = self.pool.view(piece.dst_offset, piece.length)
            pull.requests.append(self._worker.tag_recv(self._array(view), self._api.UCXXTag(_tag(pull.nonce, index))))

    def _collect_receives(self, pull: _Pull) -> None:
        """Count receives completed in order; fail the pull on the first that failed."""
        while pull.received < len(pull.requests) and pull.requests[pull.received].completed:
            request = pull.requests[pull.received]
            try:
                request.check_error()
            except Exception as error:  # truncated, or the transport failed
                self._finish_pull(pull, "failed", ErrorCode.INTERNAL, f"piece {pull.received}: {error}",
                                  tell_server=True)
                return
            self._piece_landed(pull, pull.pieces[pull.received].length)
            if pull.transfer_id not in self._pulls:
                return

    def _settle_receives(self, pull: _Pull) -> bool:
        for index, request in enumerate(pull.requests):
            if not request.completed:
                tag = self._api.UCXXTag(_tag(pull.nonce, index))
                self._poison.append(self._self_endpoint.tag_send(self._empty, tag))
        deadline = time.monotonic() + self.options.settle_timeout_s
        while not all(request.completed for request in pull.requests):
            if time.monotonic() >= deadline:
                log.error("kv_receives_unsettled", transfer_id=pull.transfer_id)
                return False
            self._worker.progress()
        return True

    def _drain_unexpected(self) -> None:
        self._drains = [(request, scratch) for request, scratch in self._drains if not request.completed]
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(0), self._api.UCXXTagMask(0), True)
            if not probe.matched:
                return
            self.counters["late_frames"] += 1
            scratch = np.empty(min(probe.length, MAX_PIECE_BYTES), dtype=np.uint8)
            self._drains.append((self._worker.tag_recv_with_handle(self._array(scratch), probe), scratch))

    # ---- the server's sends ---------------------------------------------------------------------

    def _prepare_serve(self, serve: _Serve) -> None:
        serve.all_sent = not serve.pieces

    def _send_some(self, serve: _Serve, now: float) -> None:
        endpoint = serve.client.ucx_endpoint
        while serve.next_index < len(serve.pieces) and len(serve.in_flight) < self.options.window:
            piece = serve.pieces[serve.next_index]
            view = self.pool.view(piece.src_offset, piece.length)
            tag = self._api.UCXXTag(_tag(serve.nonce, serve.next_index))
            serve.in_flight.append(endpoint.tag_send(self._array(view), tag))
            serve.next_index += 1
            if self.options.send_pause_s:
                serve.next_send_at = now + self.options.send_pause_s
                break
        serve.all_sent = serve.next_index >= len(serve.pieces)

    def _collect_sends(self, serve: _Serve) -> None:
        done = [request for request in serve.in_flight if request.completed]
        serve.in_flight = [request for request in serve.in_flight if not request.completed]
        for request in done:
            try:
                request.check_error()
            except Exception as error:
                self._end_serve(serve, TransferEvent(serve.exposure.transfer_id, "failed", f"send failed: {error}"),
                                tell_code=ErrorCode.INTERNAL)
                return

    def _sends_settled(self, serve: _Serve) -> bool:
        serve.in_flight = [request for request in serve.in_flight if not request.completed]
        return not serve.in_flight
