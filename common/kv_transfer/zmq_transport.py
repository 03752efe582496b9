"""KV bytes over the ZeroMQ control socket itself: KvData messages of about
`message_bytes`, one frame per piece, sent without copying from a CPU source pool (a
CUDA pool's pieces are copied to host memory first, and to the GPU as they land: pool.py).

The server's frames are views of its pool handed to ZeroMQ with copy=False and tracked,
so a serve counts as settled only once ZeroMQ has let go of every one of them. The
puller copies each frame into its destination view on the service thread, and only while
the pull (transfer id and nonce) is still running: a frame that arrives after a cancel,
a failure or for an unknown transfer is dropped, so no late byte reaches a block.
"""
from __future__ import annotations

import time

import numpy as np
import zmq

from common.kv_transfer.plan import group_pieces
from common.kv_transfer.transport import KvTransport, _Peer, _Pull, _Serve, log
from common.protocol import MAX_KV_FRAMES, ErrorCode, KvData, encode

TRACKER_POLL_S = 0.001


class ZmqTransport(KvTransport):
    name = "zmq"

    def _busy(self) -> bool:
        """Busy only while a serve can send now. A full window or settling waits on trackers,
        which do not wake the poll: that waits a millisecond at a time (see _idle_wait_s)
        rather than spinning, since spinning takes the core ZeroMQ's I/O thread needs."""
        now = time.monotonic()
        return any(self._can_send(serve, now) for serve in self._serving())

    def _can_send(self, serve: _Serve, now: float) -> bool:
        if serve.ending is not None or serve.all_sent or now < serve.next_send_at:
            return False
        serve.in_flight = [tracker for tracker in serve.in_flight if not tracker.done]
        return len(serve.in_flight) < self.options.window

    def _idle_wait_s(self) -> float:
        waiting = self._settling or any(serve.in_flight for serve in self._serving())
        return min(super()._idle_wait_s(), TRACKER_POLL_S) if waiting else super()._idle_wait_s()

    def _prepare_serve(self, serve: _Serve) -> None:
        # The slowed test sender sends one piece per message, so that a cancel falls between them.
        per_message = 1 if self.options.send_pause_s else MAX_KV_FRAMES
        serve.groups = group_pieces(serve.pieces, self.options.message_bytes, per_message)
        if not serve.groups:
            serve.all_sent = True

    def _send_some(self, serve: _Serve, now: float) -> None:
        serve.in_flight = [tracker for tracker in serve.in_flight if not tracker.done]
        while serve.next_index < len(serve.groups) and len(serve.in_flight) < self.options.window:
            first, end = serve.groups[serve.next_index]
            views = [self.pool.to_host(piece.src_offset, piece.length) for piece in serve.pieces[first:end]]
            frames = [serve.client.identity, *encode(KvData(serve.exposure.transfer_id, serve.nonce, first), views)]
            try:
                tracker = self._bound_server.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:  # the puller's queue is full: try again next turn
                return
            serve.in_flight.append(tracker)
            serve.next_index += 1
            if self.options.send_pause_s:
                serve.next_send_at = now + self.options.send_pause_s
                break
        serve.all_sent = serve.next_index >= len(serve.groups)

    def _sends_settled(self, serve: _Serve) -> bool:
        return all(tracker.done for tracker in serve.in_flight)

    def _on_data(self, peer: _Peer, data: KvData, payloads: list[np.ndarray]) -> None:
        pull = self._pulls.get(data.transfer_id)
        if pull is None or pull.peer is not peer or pull.nonce != data.nonce:
            self.counters["late_frames"] += 1  # ended or never ours: never written anywhere
            return
        problem = self._data_problem(pull, data, payloads)
        if problem is not None:
            self.counters["bad_frames"] += 1
            self._finish_pull(pull, "failed", ErrorCode.INVALID_REQUEST, problem, tell_server=True)
            return
        for index, payload in enumerate(payloads, data.first_piece):
            piece = pull.pieces[index]
            self.pool.from_host(piece.dst_offset, payload)
            self._piece_landed(pull, piece.length)

    def _data_problem(self, pull: _Pull, data: KvData, payloads: list[np.ndarray]) -> str | None:
        if data.first_piece != pull.received:  # one socket, in order: anything else is not our server's
            return f"KvData starts at piece {data.first_piece}, expected {pull.received}"
        if data.first_piece + len(payloads) > len(pull.pieces):
            return f"KvData carries pieces past the plan's {len(pull.pieces)}"
        for index, payload in enumerate(payloads, data.first_piece):
            if payload.nbytes != pull.pieces[index].length:
                return f"piece {index} has {payload.nbytes} bytes, the plan {pull.pieces[index].length}"
        return None

    def _start_data_plane(self) -> None:
        log.info("kv_transport_started", transport=self.name, message_bytes=self.options.message_bytes,
                 huge_pages=self.huge_pages)
