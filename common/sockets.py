"""ZeroMQ sockets as every role makes them: bounded queues, no linger, optional CURVE.

With CURVE on, servers (binding sockets) encrypt with the server key pair and accept only
clients presenting the configured client public key (checked by a ZAP authenticator);
clients (connecting sockets) present the client key pair and pin the server's public key.
"""
from __future__ import annotations

import zmq
import zmq.auth.thread

from common.config import ClusterConfig
from common.protocol import ProtocolError, decode, encode

HIGH_WATER_MARK = 10000
MAX_MESSAGE_BYTES = 64 << 20


class Auth:
    """The ZAP authenticator for one context (started only when CURVE is on)."""

    def __init__(self, context: zmq.Context, config: ClusterConfig):
        self.thread = None
        if config.curve_enabled:
            allowed = config.curve_client_public.encode()
            self.thread = zmq.auth.thread.ThreadAuthenticator(context)
            self.thread.start()
            self.thread.configure_curve_callback("*", credentials_provider=_AllowKey(allowed))

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()


class _AllowKey:
    """pyzmq's credentials provider: called with the client's Z85 public key."""

    def __init__(self, allowed_z85: bytes):
        self.allowed = allowed_z85

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


def server_socket(context: zmq.Context, kind: int, config: ClusterConfig, address: str) -> zmq.Socket:
    """A socket that binds `address` (ROUTER, PULL, PUB)."""
    socket = _socket(context, kind)
    if config.curve_enabled:
        socket.curve_server = True
        socket.curve_publickey = config.curve_server_public.encode()
        socket.curve_secretkey = config.curve_server_secret.encode()
    if kind == zmq.ROUTER:
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its identity back
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises, not drops
    try:
        socket.bind(address)
    except zmq.ZMQError as error:
        socket.close(0)
        raise RuntimeError(f"cannot bind {address}: {error}") from None
    return socket


def client_socket(context: zmq.Context, kind: int, config: ClusterConfig, address: str,
                  identity: str | None = None) -> zmq.Socket:
    """A socket that connects to `address` (DEALER, PUSH, SUB)."""
    socket = _socket(context, kind)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity.encode())
    if config.curve_enabled:
        socket.curve_serverkey = config.curve_server_public.encode()
        socket.curve_publickey = config.curve_client_public.encode()
        socket.curve_secretkey = config.curve_client_secret.encode()
    socket.connect(address)
    return socket


def subscriber(context: zmq.Context, config: ClusterConfig) -> zmq.Socket:
    """A SUB socket taking every topic; connect it to publishers as they appear."""
    socket = _socket(context, zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    if config.curve_enabled:
        socket.curve_serverkey = config.curve_server_public.encode()
        socket.curve_publickey = config.curve_client_public.encode()
        socket.curve_secretkey = config.curve_client_secret.encode()
    return socket


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return socket


def send(socket: zmq.Socket, message, payloads=None, identity: bytes | None = None, flags: int = 0) -> None:
    frames = encode(message, payloads)
    if identity is not None:
        frames = [identity, *frames]
    socket.send_multipart(frames, flags=flags, copy=False)


def split_routed(frames: list[bytes]) -> tuple[bytes, list[bytes]]:
    """(identity, message frames) of what a ROUTER socket received."""
    if len(frames) < 2:
        raise ProtocolError("routed message without an identity frame")
    return frames[0], frames[1:]


def generate_curve_keys() -> dict[str, str]:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {"curve_server_public": server_public.decode(), "curve_server_secret": server_secret.decode(),
            "curve_client_public": client_public.decode(), "curve_client_secret": client_secret.decode()}


__all__ = ["Auth", "client_socket", "decode", "generate_curve_keys", "send", "server_socket", "split_routed",
           "subscriber"]
