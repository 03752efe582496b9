"""The blocking client: one request at a time per Client, every wait bounded."""
from __future__ import annotations

import time
from collections.abc import Iterator

import zmq

from common.errors import RequestTimeout, ServerUnavailable
from common.protocol import Abort, Chunk, ChunkBatch, Error, Status, StatusRequest, encode
from services.client._shared import (
    DEFAULT_ADDRESS,
    Accumulator,
    Result,
    StreamChunk,
    build_submit,
    connect_dealer,
    parse_reply,
    raise_for,
    retry_pause,
)


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str = "", timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, curve: dict | None = None, retry_unavailable: bool = True):
        """`curve`: {"server_public", "client_public", "client_secret"} Z85 keys when the
        cluster runs with CURVE on (`curve_keys(DIR)` reads them from a key directory).
        `retry_unavailable`: retry a request the cluster refused as unavailable with a
        retry_after_s (before any of its tokens came) until its timeout."""
        self.address = address
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.context = zmq.Context()
        self.socket = connect_dealer(self.context, address, curve, send_timeout_s=connect_timeout_s)
        self.active: str | None = None
        self.checked = False
        self.retry_unavailable = retry_unavailable

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Abort the request in flight, if any, and close the socket."""
        if self.socket.closed:
            return
        if self.active is not None:
            self.abort(self.active)
        self.socket.close(0)
        self.context.term()

    def status(self, timeout_s: float | None = None) -> Status:
        """The cluster's workers as the router sees them; ServerUnavailable if no answer."""
        self._send(encode(StatusRequest()))
        deadline = time.monotonic() + (timeout_s or self.connect_timeout_s)
        while True:
            message = self._receive(deadline, ServerUnavailable(f"no answer from {self.address}"))
            if isinstance(message, Status):
                return message
            if isinstance(message, Error) and not message.request_id:
                raise_for(message)

    def generate(self, prompt: str | None = None, *, token_ids=None, timeout_s: float | None = None,
                 slo_class: str = "", **sampling) -> Result:
        """Run one request to completion. `slo_class` names a configured SLO class ("" =
        the tenant's or the cluster's default)."""
        stream = self._run(prompt, token_ids, timeout_s, slo_class, sampling)
        accumulator: Accumulator | None = None
        for accumulator, _ in stream:  # noqa: B007 -- the last one holds the result
            pass
        assert accumulator is not None  # _attempt ends with a finished chunk or raises
        return accumulator.result()

    def stream(self, prompt: str | None = None, *, token_ids=None, timeout_s: float | None = None,
               slo_class: str = "", **sampling) -> Iterator[StreamChunk]:
        """Yield chunks as they come; closing the iterator early aborts the request."""
        for _, chunk in self._run(prompt, token_ids, timeout_s, slo_class, sampling):
            yield chunk

    def abort(self, request_id: str) -> None:
        if self.active == request_id:
            self.active = None
        try:
            self.socket.send_multipart(encode(Abort(request_id=request_id)))
        except zmq.Again:  # nothing reaches the server: nothing runs there to abort
            pass

    def _run(self, prompt, token_ids, timeout_s, slo_class, sampling):
        """The request's chunks; a ServerUnavailable that asks for a retry (the router is
        restarting, say) and comes before any chunk is retried within the deadline."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            streamed = False
            try:
                if not self.checked:
                    self.status()
                    self.checked = True
                for item in self._attempt(prompt, token_ids, deadline - time.monotonic(), slo_class, sampling):
                    streamed = True
                    yield item
                return
            except ServerUnavailable as error:
                pause = retry_pause(error, deadline, self.retry_unavailable and not streamed)
                if pause is None:
                    raise
                time.sleep(pause)

    def _attempt(self, prompt, token_ids, timeout_s, slo_class, sampling):
        request_id, frames = build_submit(prompt, token_ids, self.api_key, timeout_s, sampling, slo_class)
        self._send(frames)
        self.active = request_id
        accumulator = Accumulator(request_id)
        deadline = time.monotonic() + timeout_s + 1.0  # the server's own deadline fires first
        try:
            while True:
                received = self._receive(deadline, RequestTimeout(f"no result within {timeout_s:.1f} s"))
                for message in received.items if isinstance(received, ChunkBatch) else [received]:
                    if getattr(message, "request_id", None) != request_id:
                        continue  # a late reply to an earlier, abandoned request
                    if isinstance(message, Error):
                        self.active = None
                        raise_for(message)
                    if isinstance(message, Chunk):
                        chunk = accumulator.add(message)
                        if chunk.finished:
                            self.active = None
                        yield accumulator, chunk
                        if chunk.finished:
                            return
        finally:
            if self.active == request_id:
                self.abort(request_id)

    def _send(self, frames: list) -> None:
        try:
            self.socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise ServerUnavailable(f"cannot reach {self.address}: no connection took the request") from None

    def _receive(self, deadline: float, on_timeout: Exception):
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not self.socket.poll(remaining_ms):
            raise on_timeout
        return parse_reply(self.socket.recv_multipart())
