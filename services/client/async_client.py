"""The asyncio client: many concurrent requests over one socket."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

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


class AsyncClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str = "", timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, curve: dict | None = None, retry_unavailable: bool = True):
        """As Client's arguments."""
        self.retry_unavailable = retry_unavailable
        self.address = address
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.context = zmq.asyncio.Context()
        self.socket = connect_dealer(self.context, address, curve, send_timeout_s=connect_timeout_s)
        self.queues: dict[str, asyncio.Queue] = {}  # streams
        self.collectors: dict[str, tuple[Accumulator, asyncio.Future]] = {}  # generate() calls
        self.status_waiters: list[asyncio.Future] = []
        self.reader: asyncio.Task | None = None
        self.checked = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort every request in flight and close the socket."""
        for request_id in [*self.queues, *self.collectors]:
            await self.abort(request_id)
        if self.reader is not None:
            self.reader.cancel()
        self.socket.close(0)
        self.context.term()

    async def status(self, timeout_s: float | None = None) -> Status:
        self._ensure_reader()
        waiter = asyncio.get_running_loop().create_future()
        self.status_waiters.append(waiter)
        await self._send(encode(StatusRequest()))
        try:
            message = await asyncio.wait_for(waiter, timeout_s or self.connect_timeout_s)
        except TimeoutError:
            raise ServerUnavailable(f"no answer from {self.address}") from None
        finally:
            if waiter in self.status_waiters:
                self.status_waiters.remove(waiter)
        if isinstance(message, Error):
            raise_for(message)
        return message

    async def generate(self, prompt: str | None = None, *, token_ids=None, timeout_s: float | None = None,
                       slo_class: str = "", **sampling) -> Result:
        """Run one request to completion. Chunks are gathered by the reader as they arrive;
        this coroutine wakes once, at the end. `slo_class` names a configured SLO class
        ("" = the tenant's or the cluster's default). Refusals that ask for a retry are
        retried within the timeout, as Client does."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            try:
                if not self.checked:
                    await self.status()
                    self.checked = True
                return await self._generate_once(prompt, token_ids, deadline - time.monotonic(), slo_class, sampling)
            except ServerUnavailable as error:
                pause = retry_pause(error, deadline, self.retry_unavailable)
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def _generate_once(self, prompt, token_ids, timeout_s, slo_class, sampling) -> Result:
        request_id, frames = build_submit(prompt, token_ids, self.api_key, timeout_s, sampling, slo_class)
        done = asyncio.get_running_loop().create_future()
        self.collectors[request_id] = (Accumulator(request_id), done)
        try:
            await self._send(frames)
            try:
                message = await asyncio.wait_for(asyncio.shield(done), timeout_s + 1.0)
            except TimeoutError:
                raise RequestTimeout(f"no result within {timeout_s:.1f} s") from None
        finally:
            if self.collectors.pop(request_id, None) is not None and not done.done():
                await self.abort(request_id)
        if isinstance(message, Error):
            raise_for(message)
        return message.result()

    async def stream(self, prompt: str | None = None, *, token_ids=None, timeout_s: float | None = None,
                     slo_class: str = "", **sampling) -> AsyncIterator[StreamChunk]:
        """Yield chunks as they come; closing the iterator early aborts the request."""
        async for _, chunk in self._run(prompt, token_ids, timeout_s, slo_class, sampling):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.collectors.pop(request_id, None)
        if not self.socket.closed:
            try:
                await self.socket.send_multipart(encode(Abort(request_id=request_id)))
            except zmq.Again:  # nothing reaches the server: nothing runs there to abort
                pass

    async def _run(self, prompt, token_ids, timeout_s, slo_class, sampling):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            streamed = False
            try:
                if not self.checked:
                    await self.status()
                    self.checked = True
                async for item in self._attempt(prompt, token_ids, deadline - time.monotonic(), slo_class, sampling):
                    streamed = True
                    yield item
                return
            except ServerUnavailable as error:
                pause = retry_pause(error, deadline, self.retry_unavailable and not streamed)
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def _attempt(self, prompt, token_ids, timeout_s, slo_class, sampling):
        request_id, frames = build_submit(prompt, token_ids, self.api_key, timeout_s, sampling, slo_class)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        await self._send(frames)
        accumulator = Accumulator(request_id)
        deadline = asyncio.get_running_loop().time() + timeout_s + 1.0
        finished = False
        try:
            while not finished:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    message = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
                except TimeoutError:
                    raise RequestTimeout(f"no result within {timeout_s:.1f} s") from None
                if isinstance(message, Error):
                    finished = True
                    raise_for(message)
                chunk = accumulator.add(message)
                finished = chunk.finished
                yield accumulator, chunk
        finally:
            if not finished:
                await self.abort(request_id)
            self.queues.pop(request_id, None)

    async def _send(self, frames: list) -> None:
        try:
            await self.socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise ServerUnavailable(f"cannot reach {self.address}: no connection took the request") from None

    def _ensure_reader(self) -> None:
        if self.reader is None:
            self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = parse_reply(await self.socket.recv_multipart())
            if isinstance(message, (Status, Error)) and not getattr(message, "request_id", None):
                if self.status_waiters:
                    waiter = self.status_waiters.pop(0)
                    if not waiter.done():
                        waiter.set_result(message)
                continue
            for item in message.items if isinstance(message, ChunkBatch) else [message]:
                if isinstance(item, (Chunk, Error)):
                    self._dispatch(item)

    def _dispatch(self, item: Chunk | Error) -> None:
        queue = self.queues.get(item.request_id)
        if queue is not None:
            queue.put_nowait(item)
            return
        collector = self.collectors.get(item.request_id)
        if collector is None:
            return
        accumulator, done = collector
        if isinstance(item, Error):
            self._settle(done, item)
        elif accumulator.add(item).finished:
            self._settle(done, accumulator)

    @staticmethod
    def _settle(done: asyncio.Future, outcome) -> None:
        if not done.done():
            done.set_result(outcome)
