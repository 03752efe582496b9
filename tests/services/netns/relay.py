"""A TCP relay that stands in for a bad network link between two roles.

This machine's kernel has no netem qdisc (and no iptables or nft), so delay, loss and
partitions between network namespaces are made here, in user space: a role is pointed at
the relay's address instead of its peer's, and the relay forwards each connection's
bytes to the real peer, both directions, through:

* a one-way delay (`delay_s`, each direction): every chunk read from one side is
  written to the other `delay_s` later;
* loss as TCP sees it (`loss`, `rto_s`): TCP does not lose bytes, it retransmits a lost
  segment after a retransmission timeout and holds everything sent after it until the
  retransmission arrives (in-order delivery). So a fraction `loss` of the chunks is
  delayed by an extra `rto_s` (200 ms, Linux's minimum RTO), and every later chunk of
  that direction waits behind it (head-of-line blocking): no byte is ever dropped;
* a cut (`cut()` ... `heal()`), modelling a pulled cable: nothing is forwarded and
  nothing is closed, so neither side sees a FIN or RST, only silence; bytes sent during
  the cut are held and delivered after `heal()`, as TCP's retransmissions deliver them
  once a cable is plugged back in. A connection opened during a cut is accepted but
  reaches the peer only after the heal (a real SYN would be retransmitted until then).

The relay runs its own asyncio loop in a daemon thread, so a test can drive it from
synchronous code. It keeps counts (`stats()`) of chunks, bytes and simulated losses.
"""
from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass


@dataclass
class Stats:
    connections: int = 0
    chunks: int = 0
    bytes: int = 0
    lost_chunks: int = 0  # chunks delayed by an extra RTO, as a retransmitted segment is


class Relay:
    def __init__(self, listen_host: str, target_host: str, target_port: int, *, listen_port: int = 0,
                 seed: int = 0):
        self.listen_host = listen_host
        self.listen_port = listen_port  # 0: any free port; the bound one after start()
        self.target = (target_host, target_port)
        self.delay_s = 0.0
        self.loss = 0.0
        self.rto_s = 0.2
        self.random = random.Random(seed)
        self.counts = Stats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.server: asyncio.base_events.Server | None = None
        self.flowing: asyncio.Event | None = None  # set = forwarding; clear = cut
        self.tasks: set[asyncio.Task] = set()
        self.writers: set[asyncio.StreamWriter] = set()

    # ---- control, from any thread ----------------------------------------------------

    @property
    def address(self) -> str:
        return f"tcp://{self.listen_host}:{self.listen_port}"

    def start(self, timeout_s: float = 10.0) -> Relay:
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self._listen())
            except BaseException as error:  # reported to start()'s caller
                failure.append(error)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._shutdown())
            self.loop.close()

        self.thread = threading.Thread(target=main, name=f"relay-{self.target[0]}", daemon=True)
        self.thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"relay to {self.target} did not start within {timeout_s} s")
        if failure:
            raise RuntimeError(f"relay to {self.target} could not listen: {failure[0]}")
        return self

    def set(self, delay_s: float = 0.0, loss: float = 0.0, rto_s: float = 0.2) -> None:
        """The link's one-way delay, the fraction of chunks "lost" (delayed by `rto_s`)."""
        if delay_s < 0 or not 0 <= loss < 1 or rto_s < 0:
            raise ValueError(f"bad link settings: delay {delay_s}, loss {loss}, rto {rto_s}")
        self.delay_s, self.loss, self.rto_s = delay_s, loss, rto_s

    def cut(self) -> None:
        self._call(self.flowing.clear)

    def heal(self) -> None:
        self._call(self.flowing.set)

    def stats(self) -> Stats:
        return Stats(**vars(self.counts))

    def close(self) -> None:
        if self.loop is not None and self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def _call(self, function) -> None:
        self.loop.call_soon_threadsafe(function)

    # ---- the loop ------------------------------------------------------------------

    async def _listen(self) -> None:
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = self.server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _accept(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        self.writers.add(down_writer)
        self.counts.connections += 1
        up_writer = None
        try:
            await self.flowing.wait()  # a connection opened during a cut waits for the heal
            await asyncio.sleep(self.delay_s)  # the handshake crosses the link too
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                down_writer.transport.abort()  # the peer refused: pass the refusal on
                return
            self.writers.add(up_writer)
            await asyncio.gather(self._spawn(self._pump(down_reader, up_writer)),
                                 self._spawn(self._pump(up_reader, down_writer)))
        finally:
            for writer in (down_writer, up_writer):
                if writer is not None:
                    self.writers.discard(writer)
                    writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read chunks, give each its release time, write them in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            last_release = 0.0
            try:
                while data := await reader.read(65536):
                    lost = self.loss > 0 and self.random.random() < self.loss
                    release = loop.time() + self.delay_s + (self.rto_s if lost else 0.0)
                    last_release = max(release, last_release)  # in order: nothing overtakes a retransmission
                    self.counts.lost_chunks += lost
                    queue.put_nowait((last_release, data))
            except OSError:
                pass
            queue.put_nowait((0.0, b""))

        reading = self._spawn(read())
        try:
            while True:
                release, data = await queue.get()
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self.flowing.wait()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                self.counts.chunks += 1
                self.counts.bytes += len(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            reading.cancel()
