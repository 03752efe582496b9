"""The relay that stands in for a bad link (relay.py), on loopback: no namespaces needed."""
from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from tests.services.netns.relay import Relay


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def relay():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    link = Relay("127.0.0.1", "127.0.0.1", server.server_address[1], seed=1).start()
    yield link
    link.close()
    server.shutdown()
    server.server_close()


def connect(link: Relay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", link.listen_port), timeout=5)


def round_trip(conn: socket.socket, payload: bytes) -> float:
    started = time.monotonic()
    conn.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = conn.recv(65536)
        assert chunk, "the relay closed the connection"
        received += chunk
    assert received == payload
    return time.monotonic() - started


def test_each_direction_is_delayed(relay):
    relay.set(delay_s=0.05)
    with connect(relay) as conn:
        times = [round_trip(conn, f"ping {i}".encode()) for i in range(5)]
    assert all(0.1 <= t < 0.3 for t in times), times


def test_loss_delays_by_an_rto_and_loses_no_byte(relay):
    relay.set(delay_s=0.0, loss=0.3, rto_s=0.2)
    with connect(relay) as conn:
        times = [round_trip(conn, bytes([i]) * 1000) for i in range(20)]
    slow = [t for t in times if t >= 0.2]
    assert slow and len(slow) < len(times), times  # some crossings "lost", not all
    assert relay.stats().lost_chunks >= len(slow)  # a slow round trip had a loss on one crossing or both


def test_a_cut_is_silence_not_a_close_and_the_heal_delivers_what_was_held(relay):
    with connect(relay) as conn:
        round_trip(conn, b"before")
        relay.cut()
        time.sleep(0.05)
        conn.sendall(b"during")
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.recv(100)  # neither data nor EOF: a pulled cable
        relay.heal()
        conn.settimeout(5)
        assert conn.recv(100) == b"during"
