"""A tiny HTTP server for one role's `/metrics` and `/health`, in a daemon thread.

    server = MetricsServer("127.0.0.1", 0, registry, health=lambda: {"ok": True})
    server.start()          # binds now; MetricsServerError names host:port if taken
    server.port             # the bound port (port 0 picks a free one)
    server.stop()

GET /metrics -> registry.render() as the Prometheus text format; GET /health -> health()
as JSON, 200 when its "ok" is true and 503 otherwise; anything else -> 404.
"""
from __future__ import annotations

import json
import logging
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from common.metrics import CONTENT_TYPE, Registry

log = logging.getLogger(__name__)

HealthCheck = Callable[[], dict]
# How often serve_forever looks for a shutdown request: stop() waits up to this long.
_POLL_INTERVAL_S = 0.05


class MetricsServerError(OSError):
    """The metrics server could not bind its address; the message names host:port."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: Registry, health: HealthCheck):
        self.registry = registry
        self.health = health
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host), a reverse-DNS lookup
        # that can stall start-up for seconds on hosts without working DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._metrics()
        elif path == "/health":
            self._health()
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /health\n")

    def _metrics(self) -> None:
        try:
            body = self.server.registry.render().encode()
        except Exception:  # answer 500 rather than dropping the connection
            log.exception("metrics: render failed")
            self._send(500, "text/plain; charset=utf-8", b"metrics render failed\n")
            return
        self._send(200, CONTENT_TYPE, body)

    def _health(self) -> None:
        try:
            report = dict(self.server.health())
        except Exception as error:  # a failing check is itself unhealthy
            report = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        status = 200 if report.get("ok") else 503
        body = json.dumps(report, default=str).encode()
        self._send(status, "application/json", body)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Scrapes arrive every few seconds; access lines would drown the role's logs.
        log.debug("metrics http: " + format, *args)


class MetricsServer:
    """Serves `registry` and `health` over HTTP on host:port from a daemon thread."""

    def __init__(self, host: str, port: int, registry: Registry,
                 health: HealthCheck | None = None):
        self.host = host
        self._requested_port = port
        self._bound_port = port
        self.registry = registry
        self.health: HealthCheck = health or (lambda: {"ok": True})
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the real one when asked for port 0)."""
        return self._bound_port

    def start(self) -> None:
        """Bind and start serving; MetricsServerError naming host:port if binding fails."""
        if self._server is not None:
            raise RuntimeError(f"metrics server on {self.host}:{self.port} already started")
        try:
            server = _Server((self.host, self._requested_port), self.registry, self.health)
        except OSError as error:
            raise MetricsServerError(
                error.errno, f"metrics server cannot listen on {self.host}:{self._requested_port}: "
                f"{error.strerror or error} (is another process using that port?)") from error
        self._server = server
        self._bound_port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, args=(_POLL_INTERVAL_S,),
                                        name=f"metrics-http-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the port; safe to call twice or before start."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
