"""Serving an ASGI app with uvicorn (httptools' parser; uvloop when the role runs on it),
plus the guards uvicorn leaves to a proxy in front of it.

uvicorn bounds the idle time between requests and the shutdown, and streams with flow
control, but it lets a request head and body grow without limit and take as long as the
client likes, and it accepts any number of connections. `GuardedProtocol` adds those
bounds to uvicorn's own protocol (a subclass: no library offers them for uvicorn, and a
proxy is not part of every deployment):
- a request head larger than `max_header_bytes`, or with more than `max_headers` fields,
  is answered 431; one not complete within `header_timeout_s` of its first byte, 408;
- a body over `max_body_bytes`, declared or sent (chunked), is answered 413;
- connections are capped in total (`max_connections`) and per client address
  (`max_connections_per_client`; an IPv6 client counts by its /64): a connection over
  either cap closes the longest-idle connection it competes with (the same address's,
  or any) instead of being refused, and only when none is idle is it answered 503 (total)
  or 429 (per address) and closed at once, so idle connections cannot lock others out;
- a fresh connection that sends nothing for `idle_timeout_s` is closed (uvicorn arms its
  keep-alive timer only after a first response);
- protocol errors are answered in the app's JSON error shape (`error_body`), not text;
- a client that half-closes after its request still gets the answer; one that half-closes
  in the middle of its body gets a 400.
The body deadline, write deadlines and client disconnects are the app's to watch, with
the helpers at the end of this module: `read_body`, `EventStream`, `watch_disconnect`.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, TypeVar

import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.logs import get_logger

log = get_logger("http")

ErrorBody = Callable[[int, str], bytes]  # (status, message) -> a JSON error body
T = TypeVar("T")


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; the timeouts bound how long any client can hold a connection."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body_bytes: int = 8 * 2**20
    idle_timeout_s: float = 75.0  # a connection with no request in progress
    header_timeout_s: float = 30.0  # from a request's first byte to its blank line
    body_timeout_s: float = 60.0  # the whole body
    write_timeout_s: float = 60.0  # one write to drain (a client that stopped reading)
    max_connections: int = 1024
    max_connections_per_client: int = 256  # per client address (an IPv6 client's /64); 0: no cap
    shutdown_grace_s: float = 10.0  # busy connections may finish this long after stop


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request that breaks a limit."""


def client_key(client: tuple[str, int] | None) -> str:
    """What the per-client cap counts by: the client's IP address, an IPv6 one by its /64
    (one host is given a whole /64), an IPv4-mapped one as IPv4."""
    if not client:
        return ""
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return client[0]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address.packed, 64), strict=False))
    return str(address)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits, connection caps, idle deadline
    and JSON protocol errors described in the module docstring. `limits`, `error_body`
    and `by_client` are set on a subclass per server (uvicorn builds protocols from a
    class)."""

    limits: HttpLimits = HttpLimits()
    error_body: ErrorBody = staticmethod(lambda status, message: message.encode())
    by_client: ClassVar[dict[str, set[GuardedProtocol]]]  # the server's open connections by client_key

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_open = False  # between a request's first byte and its blank line
        self._head_bytes = 0  # received while the head is open (bounds what the parser buffers)
        self._head_size = 0  # the parsed head's own bytes
        self._head_fields = 0
        self._body_bytes = 0
        self._app_started = False  # the current request reached the app
        self._head_deadline: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._client_key = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._client_key = client_key(self.client)
        peers = self.by_client.setdefault(self._client_key, set())
        peers.add(self)
        per_client = self.limits.max_connections_per_client
        if per_client and len(peers) > per_client and not self._close_longest_idle(peers):
            self._refuse(429, f"this client address holds {per_client} connections, the limit per client")
            return
        if len(self.connections) > self.limits.max_connections and not self._close_longest_idle(self.connections):
            self._refuse(503, f"the server is at its limit of {self.limits.max_connections} connections")
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.idle_timeout_s,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self._leave()
        super().connection_lost(exc)

    def _close_longest_idle(self, candidates: Iterable[Any]) -> bool:  # uvicorn's set is of its protocols
        """Close the candidate idle longest (no request in progress: its keep-alive timer
        runs), to make room for this connection; False when none is idle."""
        idle = [peer for peer in candidates if peer is not self and peer.timeout_keep_alive_task is not None
                and not peer.transport.is_closing()]
        if not idle:
            return False
        victim = min(idle, key=lambda peer: peer.timeout_keep_alive_task.when())
        victim.timeout_keep_alive_handler()
        victim._leave()  # its slot is free now, not when the close completes
        log.info("http_idle_closed", client=victim._client_key, for_client=self._client_key)
        return True

    def _leave(self) -> None:
        """Stop counting this connection against the caps (it is closing)."""
        self.connections.discard(self)
        peers = self.by_client.get(self._client_key)
        if peers is not None:
            peers.discard(self)
            if not peers:
                del self.by_client[self._client_key]

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's: True keeps writing
        # A client may half-close once its request is sent (HTTP allows it; `nc -N` does):
        # keep the transport open to answer, then close.
        if self.cycle is None or self.cycle.response_complete:
            return None
        if self.cycle.more_body:
            self._refuse(400, "the request body ended before its declared length")
            return None
        self.cycle.keep_alive = False
        return True

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_open and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, f"the request head exceeds {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_bytes, self._head_size, self._head_fields = True, 0, 0, 0
        self._body_bytes, self._app_started = 0, False
        self._head_deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > self.limits.max_headers:
            self._stop_parsing(431, f"the request has more than {self.limits.max_headers} header fields")
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_head_deadline()
        declared = dict(self.headers).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            self._stop_parsing(413, f"the request body ({int(declared)} bytes) exceeds {self.limits.max_body_bytes}")
        super().on_headers_complete()
        self._app_started = True

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            self._stop_parsing(413, f"the request body exceeds {self.limits.max_body_bytes} bytes")
        super().on_body(body)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to input the parser refused (or a guard stopped)."""
        status, message = self._refusal or (400, f"malformed HTTP request: {msg}")
        self._refuse(status, message)

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self.limits.max_header_bytes:
            self._stop_parsing(431, f"the request head exceeds {self.limits.max_header_bytes} bytes")

    def _stop_parsing(self, status: int, message: str) -> None:
        """From a parser callback: httptools stops and uvicorn calls send_400_response."""
        self._refusal = (status, message)
        raise _HeadRefused()

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._head_open and not self.transport.is_closing():
            self._refuse(408, f"the request head did not arrive within {self.limits.header_timeout_s:g} s")

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with a JSON error and close the connection; only close it if
        the app has begun answering this request already (a 401 before the body, say)."""
        self._head_open = False
        self._cancel_head_deadline()
        self._unset_keepalive_if_required()
        if not (self._app_started and self.cycle is not None and self.cycle.response_started):
            body = self.error_body(status, message)
            head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("latin-1")
            self.transport.write(head + body)
        self.transport.close()
        self._leave()
        log.info("http_refused", status=status, reason=message)


def guarded_protocol(limits: HttpLimits, error_body: ErrorBody) -> type[GuardedProtocol]:
    return type("BoundGuardedProtocol", (GuardedProtocol,),
                {"limits": limits, "error_body": staticmethod(error_body), "by_client": {}})


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server inside a role's own event loop: the role owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(app: Any, host: str, port: int, stop: asyncio.Event, limits: HttpLimits,
                error_body: ErrorBody, ready: Callable[[int], None] | None = None) -> None:
    """Serve `app` on (host, port) until `stop` is set, then close gracefully: idle
    connections at once, busy ones after their response (at most shutdown_grace_s).
    `ready(bound_port)` is called once listening (port 0 picks a free port). A port that
    cannot be bound raises OSError here."""
    config = uvicorn.Config(
        app, http=guarded_protocol(limits, error_body), lifespan="off", log_config=None,
        access_log=False, server_header=False, proxy_headers=False,
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=max(1, round(limits.shutdown_grace_s)))
    listener = listen(host, port)
    bound_port = listener.getsockname()[1]
    server = _EmbeddedServer(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    stopping = asyncio.create_task(stop.wait())
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            log.info("http_listening", host=host, port=bound_port)
            if ready is not None:
                ready(bound_port)
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        server.should_exit = True
        await serving
        listener.close()
    log.info("http_stopped", host=host, port=bound_port)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), IPv4 or IPv6 as the host is written."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


# ---- what the app watches: body limits, write deadlines, disconnects ---------------------


class EventStream(Response):
    """A Server-Sent Events body, each event written as soon as it is produced.

    Unlike Starlette's StreamingResponse, every write has a deadline (`write_timeout_s`:
    a client that stopped reading loses its connection instead of holding it), and the
    stream ends as soon as the client goes. `events` is closed (aclose) however the
    stream ends, so the generator's `finally` aborts the request upstream. An HTTP/1.0
    client, which cannot read chunked framing (uvicorn's for any body of unknown length),
    gets the events at the end, as one body with its length."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str], write_timeout_s: float):
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})  # no length
        self.events = events
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = self._pump_whole if scope["http_version"] == "1.0" else self._pump
        self._sending_since: float | None = None  # when the send in progress began
        try:
            await watch_disconnect(receive, pump(send), guard=self._write_watchdog())
        except ClientGone:
            pass
        except TimeoutError:
            log.info("client_stopped_reading", path=scope["path"], timeout_s=self.write_timeout_s)
        finally:
            await aclose(self.events)

    async def _pump(self, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        async for event in self.events:
            await self._send(send, {"type": "http.response.body", "body": event, "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump_whole(self, send: Send) -> None:
        body = b"".join([event async for event in self.events])
        headers = [*self.raw_headers, (b"content-length", str(len(body)).encode())]
        await self._send(send, {"type": "http.response.start", "status": self.status_code, "headers": headers})
        await self._send(send, {"type": "http.response.body", "body": body, "more_body": False})

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        self._sending_since = asyncio.get_running_loop().time()
        await send(message)
        self._sending_since = None

    async def _write_watchdog(self) -> None:
        """Raise TimeoutError once one send has waited write_timeout_s for the client.
        One sleeping task per stream: a deadline per event (asyncio.timeout) cost ~6% of
        the gateway's CPU under load."""
        clock = asyncio.get_running_loop().time
        while True:
            await asyncio.sleep(self.write_timeout_s / 4)
            since = self._sending_since
            if since is not None and clock() - since >= self.write_timeout_s:
                raise TimeoutError()


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


async def watch_disconnect(receive: Receive, work: Awaitable[T], guard: Awaitable[None] | None = None) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone; if
    `guard` (a watchdog) raises first, cancel `work` and raise that. Call only once the
    request's body has been read (this takes the next messages)."""
    work_task: asyncio.Future[T] = asyncio.ensure_future(work)
    watchers: list[asyncio.Future[None]] = [asyncio.ensure_future(_disconnected(receive))]
    if guard is not None:
        watchers.append(asyncio.ensure_future(guard))
    tasks: list[asyncio.Future[Any]] = [work_task, *watchers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        for watcher in watchers[1:]:
            if watcher.done():
                watcher.result()  # the watchdog's error
        raise ClientGone()
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def aclose(iterator: Any) -> None:
    closer = getattr(iterator, "aclose", None)
    if closer is not None:
        with contextlib.suppress(Exception):
            await closer()


class BodyRefused(Exception):
    """A request body the app will not wait for: `status` is the answer (408)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The request's body, whole within `timeout_s` (else 408). Its size is bounded
    already: GuardedProtocol refuses a body over max_body_bytes."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    except TimeoutError:
        raise BodyRefused(408, f"the request body did not arrive within {timeout_s:g} s") from None
