"""A small HTTP/1.1 server on asyncio streams: what the OpenAI gateway needs, no framework.

Scope: request line + headers + a Content-Length body (chunked request bodies are refused
with 411), keep-alive, JSON responses and streamed responses (Server-Sent Events over
chunked transfer, or connection-close framing for HTTP/1.0 clients).

Robustness contract:
- every malformed or over-limit request gets a 4xx JSON error (then the connection
  closes) or, when nothing sensible can be sent, a closed connection; never a crash;
- every read has a deadline (idle keep-alive, request head, body) and every write one
  too, so a slow or stuck client cannot hold a connection forever;
- while a handler runs or a response streams, the connection is watched: when the client
  goes away (EOF or reset) the handler's task is cancelled, so async generators behind
  it get closed and the request is aborted upstream.
"""
from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import urlsplit

from common.logs import get_logger

log = get_logger("http")

T = TypeVar("T")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (method, header name)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # forbidden in field values (tab allowed)
_VERSION = re.compile(r"HTTP/\d\.\d")
_HEAD_END = b"\r\n\r\n"
_MAX_CONTENT_LENGTH_DIGITS = 15
_READ_SIZE = 65536


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; the timeouts bound how long any client can hold a connection."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body_bytes: int = 8 * 2**20
    idle_timeout_s: float = 75.0  # keep-alive: waiting for the next request's first byte
    header_timeout_s: float = 30.0  # from a request's first byte to its blank line
    body_timeout_s: float = 60.0  # the whole body
    write_timeout_s: float = 60.0  # one write to drain (a client that stopped reading)
    max_connections: int = 1024
    shutdown_grace_s: float = 10.0  # busy connections may finish this long after stop
    linger_s: float = 2.0  # after an error response, drain what the client still sends


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes = b""

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class StreamResponse:
    """A streamed body: each chunk is written (and flushed) as soon as it is produced.

    The server closes `chunks` (aclose) when the stream ends for any reason, including the
    client disconnecting, so a generator's `finally` blocks always run.
    """

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)


class HttpError(Exception):
    """A request the server answers with an error status; `close` ends the connection."""

    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = (),
                 close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)
        self.close = close


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]
ErrorRenderer = Callable[[HttpError], Response]


def json_response(value: Any, status: int = 200,
                  headers: Iterable[tuple[str, str]] = ()) -> Response:
    return Response(status, json_bytes(value), "application/json", list(headers))


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and infinities are refused (they are not JSON)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def sse_event(data: str) -> bytes:
    """One Server-Sent Event carrying `data` (multi-line data becomes several fields)."""
    return b"".join(b"data: " + line.encode() + b"\n" for line in data.split("\n")) + b"\n"


def default_error_response(error: HttpError) -> Response:
    return json_response({"error": {"message": error.message, "type": reason_phrase(error.status),
                                    "code": error.status}},
                         error.status, error.headers)


class Router:
    """Exact (method, path) → handler; unknown paths are 404, known paths with another
    method 405 with an Allow header. HEAD runs the GET handler (the server sends no body)."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path, {})[method.upper()] = handler

    def resolve(self, method: str, path: str) -> Handler:
        by_method = self._routes.get(path)
        if by_method is None:
            raise HttpError(404, f"no route for {path}")
        handler = by_method.get(method)
        if handler is None and method == "HEAD":
            handler = by_method.get("GET")
        if handler is None:
            allowed = ", ".join(sorted(by_method))
            raise HttpError(405, f"method {method} is not allowed on {path} (allowed: {allowed})",
                            headers=[("Allow", allowed)])
        return handler


class _ClientGone(Exception):
    """The client closed or reset the connection while its request was in progress."""


class _HeadTooLarge(Exception):
    pass


class _Input:
    """The connection's read side with its own buffer, so that the disconnect watcher can
    read ahead (a pipelined next request) without losing bytes."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.buffer = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        """Append what arrives next to the buffer; False at EOF or on a reset."""
        if self.eof:
            return False
        try:
            data = await self.reader.read(_READ_SIZE)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def wait_for_request(self) -> bool:
        """Wait for a request's first byte (blank lines before it are skipped, as RFC 9112
        allows); False if the peer closed first."""
        while True:
            while self.buffer[:2] == b"\r\n":
                del self.buffer[:2]
            if self.buffer and self.buffer != b"\r":
                return True
            if not await self.fill():
                return False

    async def read_head(self, limit: int) -> bytes:
        """Bytes up to and including the blank line ending a request head; raises
        _HeadTooLarge past `limit`, IncompleteReadError at EOF."""
        searched = 0
        while True:
            end = self.buffer.find(_HEAD_END, max(0, searched - len(_HEAD_END) + 1))
            size = end + len(_HEAD_END) if end >= 0 else len(self.buffer)
            if size > limit:
                raise _HeadTooLarge()
            if end >= 0:
                return self.take(size)
            searched = len(self.buffer)
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), None)

    async def read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buffer), size)
        return self.take(size)

    def take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 task: asyncio.Task | None):
        self.input = _Input(reader)
        self.writer = writer
        self.task = task
        self.busy = False


class HttpServer:
    """Serves a Router until a stop event; see the module docstring for the contract."""

    def __init__(self, router: Router, limits: HttpLimits = HttpLimits(),
                 render_error: ErrorRenderer = default_error_response, server_name: str = "baton"):
        self.router = router
        self.limits = limits
        self.render_error = render_error
        self.server_name = server_name
        self._connections: set[_Connection] = set()
        self._stopping = False

    async def serve(self, host: str, port: int, stop: asyncio.Event,
                    ready: Callable[[int], None] | None = None) -> None:
        """Listen on (host, port) until `stop` is set, then close gracefully: idle
        connections at once, busy ones after their response (at most shutdown_grace_s).
        `ready(bound_port)` is called once listening (port 0 picks a free port)."""
        server = await asyncio.start_server(self._on_connection, host, port, limit=_READ_SIZE)
        bound_port = server.sockets[0].getsockname()[1]
        log.info("http_listening", host=host, port=bound_port)
        try:
            if ready is not None:
                ready(bound_port)
            await stop.wait()
        finally:
            server.close()
            await self._close_connections()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), self.limits.shutdown_grace_s)
            log.info("http_stopped", port=bound_port)

    async def _close_connections(self) -> None:
        self._stopping = True
        for conn in list(self._connections):
            if not conn.busy and conn.task is not None:
                conn.task.cancel()
        tasks = {conn.task for conn in self._connections if conn.task is not None}
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.limits.shutdown_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # ---- one connection --------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        conn = _Connection(reader, writer, asyncio.current_task())
        try:
            if len(self._connections) >= self.limits.max_connections or self._stopping:
                await self._send_error_and_close(conn, HttpError(503, "server busy", close=True))
                return
            self._connections.add(conn)
            await self._serve_connection(conn)
        except (ConnectionError, asyncio.TimeoutError, asyncio.CancelledError, _ClientGone):
            pass  # the client went away, was too slow, or the server is stopping
        except Exception:  # a bug here must cost one connection, never the server
            log.exception("http_connection_failed")
        finally:
            self._connections.discard(conn)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_connection(self, conn: _Connection) -> None:
        while not self._stopping:
            try:
                request = await self._read_request(conn)
            except HttpError as error:
                await self._send_error_and_close(conn, error)
                return
            if request is None:
                return
            conn.busy = True
            try:
                keep_alive = await self._respond(conn, request)
            finally:
                conn.busy = False
            if not keep_alive:
                return

    # ---- reading -------------------------------------------------------------------

    async def _read_request(self, conn: _Connection) -> Request | None:
        """The next request, None on a clean close or idle timeout; HttpError if bad."""
        limits = self.limits
        try:
            if not await asyncio.wait_for(conn.input.wait_for_request(), limits.idle_timeout_s):
                return None
        except asyncio.TimeoutError:
            return None
        try:
            head = await asyncio.wait_for(conn.input.read_head(limits.max_header_bytes),
                                          limits.header_timeout_s)
        except _HeadTooLarge:
            raise HttpError(431, f"request head exceeds {limits.max_header_bytes} bytes",
                            close=True) from None
        except asyncio.IncompleteReadError:
            raise HttpError(400, "connection closed before the end of the request head",
                            close=True) from None
        except asyncio.TimeoutError:
            raise HttpError(408, "timed out reading the request head", close=True) from None
        method, target, version, headers = parse_head(head, limits)
        parts = urlsplit(target)
        request = Request(method, target, parts.path or "/", parts.query, version, headers)
        request.body = await self._read_body(conn, request)
        return request

    async def _read_body(self, conn: _Connection, request: Request) -> bytes:
        length = body_length(request.headers, self.limits.max_body_bytes)
        if length == 0:
            return b""
        expect = request.headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise HttpError(417, f"unsupported Expect: {expect}", close=True)
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await self._drain(conn)
        try:
            return await asyncio.wait_for(conn.input.read_exactly(length),
                                          self.limits.body_timeout_s)
        except asyncio.IncompleteReadError as error:
            raise HttpError(400, f"body ended after {len(error.partial)} of {length} bytes",
                            close=True) from None
        except asyncio.TimeoutError:
            raise HttpError(408, "timed out reading the request body", close=True) from None

    # ---- responding ------------------------------------------------------------------

    async def _respond(self, conn: _Connection, request: Request) -> bool:
        """Run the handler and send its response; True to keep the connection open."""
        keep_alive = wants_keep_alive(request) and not self._stopping
        try:
            handler = self.router.resolve(request.method, request.path)
            result = await self._run_watched(conn, handler(request))
        except HttpError as error:
            result = self.render_error(error)
            result.headers.extend(h for h in error.headers if h not in result.headers)
            keep_alive = keep_alive and not error.close
        except (_ClientGone, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("http_handler_failed", method=request.method, path=request.path)
            result = self.render_error(HttpError(500, "internal server error"))
        if request.method == "HEAD" and isinstance(result, StreamResponse):
            await aclose(result.chunks)
            result = Response(result.status, b"", result.content_type, result.headers)
        if isinstance(result, StreamResponse):
            return await self._send_stream(conn, request, result, keep_alive)
        await self._send(conn, result, keep_alive, with_body=request.method != "HEAD")
        return keep_alive

    async def _send(self, conn: _Connection, response: Response, keep_alive: bool,
                    with_body: bool = True) -> None:
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))),
                   ("Connection", "keep-alive" if keep_alive else "close"), *response.headers]
        conn.writer.write(self._head(response.status, headers)
                          + (response.body if with_body else b""))
        await self._drain(conn)

    async def _send_stream(self, conn: _Connection, request: Request, response: StreamResponse,
                           keep_alive: bool) -> bool:
        chunked = request.version == "HTTP/1.1"
        keep_alive = keep_alive and chunked  # without chunking, only close ends the body
        headers = [("Content-Type", response.content_type), ("Cache-Control", "no-cache"),
                   ("X-Accel-Buffering", "no"),
                   ("Connection", "keep-alive" if keep_alive else "close"), *response.headers]
        if chunked:
            headers.append(("Transfer-Encoding", "chunked"))

        async def pump() -> None:
            try:
                conn.writer.write(self._head(response.status, headers))
                await self._drain(conn)
                async for chunk in response.chunks:
                    if chunk:
                        framed = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
                        conn.writer.write(framed)
                        await self._drain(conn)
                if chunked:
                    conn.writer.write(b"0\r\n\r\n")
                    await self._drain(conn)
            finally:
                await aclose(response.chunks)

        try:
            await self._run_watched(conn, pump())
        except (_ClientGone, ConnectionError, asyncio.TimeoutError):
            return False
        except Exception:  # the body generator failed after the head was sent
            log.exception("http_stream_failed", path=request.path)
            return False
        return keep_alive

    async def _send_error_and_close(self, conn: _Connection, error: HttpError) -> None:
        """Answer a request the server could not frame, then linger: closing with unread
        input would make the kernel send a reset that can destroy the response."""
        response = self.render_error(error)
        response.headers.extend(h for h in error.headers if h not in response.headers)
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            await self._send(conn, response, keep_alive=False)
            if conn.writer.can_write_eof():
                conn.writer.write_eof()
            await asyncio.wait_for(_discard_until_eof(conn.input), self.limits.linger_s)

    async def _drain(self, conn: _Connection) -> None:
        await asyncio.wait_for(conn.writer.drain(), self.limits.write_timeout_s)

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason_phrase(status)}",
                 f"Date: {email.utils.formatdate(usegmt=True)}", f"Server: {self.server_name}",
                 *(f"{name}: {value}" for name, value in headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    # ---- disconnect detection --------------------------------------------------------

    async def _run_watched(self, conn: _Connection, work: Awaitable[T]) -> T:
        """Await `work` while watching the connection; if the client goes away, cancel
        `work` (its generators get closed) and raise _ClientGone.

        The watcher reads ahead into the connection's buffer, so a pipelined next request
        is kept; once a full read-ahead is buffered it stops (back-pressure), and from then
        on only the write timeout notices a vanished client."""
        work_task = asyncio.ensure_future(work)
        try:
            while not work_task.done():
                if conn.input.eof:
                    raise _ClientGone()
                if len(conn.input.buffer) >= _READ_SIZE:
                    await asyncio.wait({work_task})
                    break
                watch_task = asyncio.ensure_future(conn.input.fill())
                try:
                    await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # A StreamReader admits one waiter: the watcher must be gone before
                    # anyone reads the connection again.
                    watch_task.cancel()
                    await asyncio.wait({watch_task})
            return work_task.result()
        finally:
            if not work_task.done():
                work_task.cancel()
                with contextlib.suppress(BaseException):
                    await work_task


# ---- parsing (pure functions) -----------------------------------------------------------


def parse_head(head: bytes, limits: HttpLimits) -> tuple[str, str, str, dict[str, str]]:
    """(method, target, version, headers) of a request head ending in CRLF CRLF; raises
    HttpError(400/431/505) naming what is wrong."""
    lines = head.decode("latin-1").removesuffix("\r\n\r\n").split("\r\n")
    method, target, version = parse_request_line(lines[0])
    if len(lines) - 1 > limits.max_headers:
        raise HttpError(431, f"more than {limits.max_headers} header fields", close=True)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, value = parse_header_line(line)
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return method, target, version, headers


def parse_request_line(line: str) -> tuple[str, str, str]:
    parts = line.split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line", close=True)
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise HttpError(400, "malformed method in the request line", close=True)
    if not _VERSION.fullmatch(version):
        raise HttpError(400, "malformed HTTP version in the request line", close=True)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"{version} is not supported; use HTTP/1.1", close=True)
    if not target or _CONTROL.search(target) or " " in target or "\t" in target:
        raise HttpError(400, "malformed request target", close=True)
    if not (target.startswith("/") or target.startswith(("http://", "https://")) or target == "*"):
        raise HttpError(400, "malformed request target", close=True)
    return method, target, version


def parse_header_line(line: str) -> tuple[str, str]:
    if line[:1] in (" ", "\t"):
        raise HttpError(400, "obsolete header line folding is not accepted", close=True)
    name, colon, value = line.partition(":")
    if not colon or not _TOKEN.fullmatch(name):
        raise HttpError(400, "malformed header field", close=True)
    value = value.strip(" \t")
    if _CONTROL.search(value):
        raise HttpError(400, f"control character in header {name}", close=True)
    return name.lower(), value


def body_length(headers: dict[str, str], max_body_bytes: int) -> int:
    """The body's length from Content-Length; chunked or other transfer codings are
    refused (411/400), over-size bodies 413."""
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if "chunked" in coding.lower():
            raise HttpError(411, "chunked request bodies are not supported; send Content-Length",
                            close=True)
        raise HttpError(400, f"unsupported Transfer-Encoding: {coding}", close=True)
    declared = headers.get("content-length")
    if declared is None:
        return 0
    values = {value.strip() for value in declared.split(",")}
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length values", close=True)
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise HttpError(400, "malformed Content-Length", close=True)
    if len(value) > _MAX_CONTENT_LENGTH_DIGITS or int(value) > max_body_bytes:
        raise HttpError(413, f"body exceeds the limit of {max_body_bytes} bytes", close=True)
    return int(value)


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def wants_keep_alive(request: Request) -> bool:
    tokens = {token.strip().lower() for token in request.headers.get("connection", "").split(",")}
    if request.version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


# ---- stream helpers --------------------------------------------------------------------


async def aclose(iterator: Any) -> None:
    """Close an async iterator if it can be closed (async generators can)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def _discard_until_eof(conn_input: _Input) -> None:
    while await conn_input.fill():
        conn_input.buffer.clear()
