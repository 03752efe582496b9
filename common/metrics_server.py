"""One role's `/metrics` and `/health` over HTTP, in a daemon thread.

    server = MetricsServer("127.0.0.1", 0, registry, health=lambda: {"ok": True})
    server.start()          # binds now; MetricsServerError names host:port if taken
    server.port             # the bound port (port 0 picks a free one)
    server.stop()

GET /metrics is prometheus_client's own WSGI app over the role's registry (content
negotiation and compression included); GET /health -> health() as JSON, 200 when its
"ok" is true and 503 otherwise; anything else -> 404. The server is the WSGI server that
prometheus_client's `start_http_server` runs, wrapped so that /health sits beside it.
"""
from __future__ import annotations

import json
import logging
import socketserver
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from common.metrics import Registry

log = logging.getLogger(__name__)

HealthCheck = Callable[[], dict]
# How often serve_forever looks for a shutdown request: stop() waits up to this long.
_POLL_INTERVAL_S = 0.05


class MetricsServerError(OSError):
    """The metrics server could not bind its address; the message names host:port."""


class _Server(ThreadingWSGIServer):
    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host), a reverse-DNS lookup
        # that can stall start-up for seconds on hosts without working DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        # Scrapes arrive every few seconds; access lines would drown the role's logs.
        log.debug("metrics http: " + format, *args)


def _app(registry: Registry, health: HealthCheck) -> WSGIApplication:
    metrics = make_wsgi_app(registry.collectors)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/health":
            report = _health_report(health)
            body = json.dumps(report, default=str).encode()
            start_response("200 OK" if report.get("ok") else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        body = b"not found: try /metrics or /health\n"
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return app


def _health_report(health: HealthCheck) -> dict:
    try:
        return dict(health())
    except Exception as error:  # a failing check is itself unhealthy
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}


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
            server = make_server(self.host, self._requested_port, _app(self.registry, self.health),
                                 server_class=_Server, handler_class=_QuietHandler)
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
