"""ZeroMQ sockets as every role makes them: bounded queues, no linger, per-role CURVE.

With CURVE on, each role holds its own key pair (`svc keys generate DIR` writes a set as
pyzmq certificate files: DIR/<role>.key public, DIR/<role>.key_secret secret). A binding
socket encrypts with its role's key pair and names the roles it accepts; one ZAP handler
per process maps each connecting peer's public key to its role and admits only those, and
stamps every message with the role as its ZMQ "User-Id" (read with `peer_role`). A
connecting socket presents its role's key pair and pins the public key of the role it
dials. Extra client keys (`client-NAME.key`, one per SDK user) may sit beside client.key.

With CURVE off there is no proof of role, so sockets bind to loopback only unless the
operator passes `insecure` (see `check_bind_policy`).
"""
from __future__ import annotations

import ipaddress
import os
import socket as stdlib_socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import zmq
import zmq.auth
import zmq.auth.thread
from zmq.utils import z85

from common.config import ClusterConfig, ConfigError
from common.cpus import parse_cpu_list
from common.protocol import ProtocolError, decode, encode

if TYPE_CHECKING:
    import msgspec
    import numpy.typing as npt

HIGH_WATER_MARK = 10000
MAX_MESSAGE_BYTES = 64 << 20
ROLES = ("router", "worker", "prefill", "decode", "tokenizer", "client", "kvstore")
ENGINE_ROLES = ("worker", "prefill", "decode")  # the roles that run an engine and join the router
USER_ID = "User-Id"


@dataclass(frozen=True)
class CurveKeys:
    """One role's key pair and every known public key with its role."""

    role: str
    public: bytes
    secret: bytes
    roles_by_key: Mapping[bytes, str]  # Z85 public key -> role

    def public_of(self, role: str) -> bytes:
        """The public key a socket dialling `role` pins (router, worker and tokenizer each have one)."""
        for key, owner in self.roles_by_key.items():
            if owner == role:
                return key
        raise ConfigError(f"curve_keys_dir: no public key for the {role} role ({role}.key)")


def load_curve_keys(keys_dir: Path, role: str) -> CurveKeys:
    """The key set of `role` from a directory `svc keys generate` wrote; ConfigError
    naming the missing or damaged file."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    roles_by_key: dict[bytes, str] = {}
    for owner in ROLES:
        paths = [keys_dir / f"{owner}.key"]
        if owner == "client":
            paths += sorted(keys_dir.glob("client-*.key"))
        for path in paths:
            public, _ = _read_certificate(path, secret=False)
            if public in roles_by_key:
                raise ConfigError(f"curve_keys_dir: {path} repeats the key of a {roles_by_key[public]} key")
            roles_by_key[public] = owner
    public, secret = _read_certificate(keys_dir / f"{role}.key_secret", secret=True)
    assert secret is not None  # _read_certificate(secret=True) checked it is there
    if roles_by_key.get(public) != role:
        raise ConfigError(f"curve_keys_dir: {keys_dir / (role + '.key_secret')} does not match {role}.key")
    return CurveKeys(role, public, secret, MappingProxyType(roles_by_key))


def _read_certificate(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except OSError as error:
        raise ConfigError(f"curve_keys_dir: cannot read {path}: {error.strerror or error} "
                          "(write a set with `svc keys generate DIR`)") from None
    except (ValueError, KeyError, UnicodeDecodeError) as error:
        raise ConfigError(f"curve_keys_dir: {path} is not a CURVE certificate: {error}") from None
    if len(public) != 40 or (secret and (secret_key is None or len(secret_key) != 40)):
        raise ConfigError(f"curve_keys_dir: {path} does not hold a 40-character Z85 "
                          f"{'secret' if secret else 'public'} key")
    return public, secret_key


def generate_curve_keys(keys_dir: Path) -> list[Path]:
    """Write a fresh key pair for every role into `keys_dir` (made 0700 if new), each
    secret created 0600; refuses to overwrite one."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [keys_dir / f"{role}.{suffix}" for role in ROLES for suffix in ("key", "key_secret")
                if (keys_dir / f"{role}.{suffix}").exists()]
    if existing:
        raise FileExistsError(f"{existing[0]} exists; remove the old set first")
    written = []
    for role in ROLES:
        public, secret = zmq.curve_keypair()
        written += [_write_certificate(keys_dir / f"{role}.key", public, None),
                    _write_certificate(keys_dir / f"{role}.key_secret", public, secret)]
    return written


def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> Path:
    """A certificate in the format zmq.auth.load_certificate reads. Written here rather
    than by zmq.auth.create_certificates, which opens with the default mode: a secret is
    created 0600 (public 0644), so no other user ever sees it readable."""
    lines = ["#   ZeroMQ CURVE " + ("**Secret** Certificate: keep it to this role's host" if secret
                                   else "Public Certificate"),
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write("\n".join(lines) + "\n")
    return path


class _RoleAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """ZAP in a thread: a peer's User-Id is the role of its public key."""

    def __init__(self, context: zmq.Context, roles_by_key: Mapping[bytes, str]):
        super().__init__(context)
        self.roles_by_key = roles_by_key

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.roles_by_key[z85.encode(client_public_key)]


class _AcceptRoles:
    """pyzmq's credentials provider for one ZAP domain: admits the keys of these roles."""

    def __init__(self, roles_by_key: Mapping[bytes, str], accept: frozenset[str]):
        self.roles_by_key = roles_by_key
        self.accept = accept

    def callback(self, domain: str, key: bytes) -> bool:
        return self.roles_by_key.get(key) in self.accept


# The sockets a context makes: zmq.Socket, or zmq.asyncio.Socket from a zmq.asyncio.Context.
SocketT = TypeVar("SocketT", bound=zmq.Socket)


class Security(Generic[SocketT]):
    """How one process of role `role` makes its sockets: one per context, stopped with it."""

    def __init__(self, context: zmq.Context[SocketT], config: ClusterConfig, role: str):
        self.context = context
        self.insecure = config.insecure
        self.keys = load_curve_keys(Path(config.curve_keys_dir), role) if config.curve_enabled else None
        self.auth: _RoleAuthenticator | None = None
        self.domains: set[str] = set()

    @property
    def curve(self) -> bool:
        return self.keys is not None

    def server(self, kind: int, address: str, accept: tuple[str, ...]) -> SocketT:
        """A socket that binds `address` (ROUTER, PULL, PUB) and admits only peers of the
        `accept` roles (with CURVE off: any peer, on loopback unless insecure)."""
        check_bind_address(address, self.curve, self.insecure)
        socket = _socket(self.context, kind)
        if self.keys is not None:
            socket.zap_domain = self._domain(frozenset(accept)).encode()
            socket.curve_server = True
            socket.curve_publickey = self.keys.public
            socket.curve_secretkey = self.keys.secret
        if kind == zmq.ROUTER:
            # No ROUTER_HANDOVER: a connection never takes over another's routing id, so an id
            # names one connection for its life (docs/architecture.md §3).
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises, not drops
        try:
            socket.bind(address)
        except zmq.ZMQError as error:
            socket.close(0)
            raise RuntimeError(f"cannot bind {address}: {error}") from None
        return socket

    def client(self, kind: int, address: str, server_role: str, identity: str | None = None) -> SocketT:
        """A socket that connects to `address`, a socket of `server_role` (DEALER, PUSH);
        ValueError (and nothing left open) for an address that is not a ZeroMQ endpoint."""
        check_endpoint(address)
        socket = _socket(self.context, kind)
        try:
            if identity is not None:
                socket.setsockopt(zmq.IDENTITY, identity.encode())
            self._present_key(socket, server_role)
            socket.connect(address)
        except zmq.ZMQError as error:
            socket.close(0)
            raise ValueError(f"cannot connect to {address!r}: {error}") from None
        return socket

    def subscriber(self, server_role: str) -> SocketT:
        """A SUB socket taking every topic; connect it with `connect` as publishers appear."""
        socket = _socket(self.context, zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._present_key(socket, server_role)
        return socket

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def _present_key(self, socket: zmq.Socket, server_role: str) -> None:
        if self.keys is not None:
            socket.curve_serverkey = self.keys.public_of(server_role)
            socket.curve_publickey = self.keys.public
            socket.curve_secretkey = self.keys.secret

    def _domain(self, accept: frozenset[str]) -> str:
        unknown = accept - set(ROLES)
        if unknown or not accept:
            raise ValueError(f"a socket must accept known roles, got {sorted(accept)}")
        domain = "+".join(sorted(accept))
        assert self.keys is not None  # only a server with CURVE on has a ZAP domain
        if self.auth is None:
            self.auth = _RoleAuthenticator(self.context, self.keys.roles_by_key)
            self.auth.start()
        if domain not in self.domains:
            self.auth.configure_curve_callback(domain, credentials_provider=_AcceptRoles(self.keys.roles_by_key,
                                                                                         accept))
            self.domains.add(domain)
        return domain


def peer_role(frame: zmq.Frame) -> str | None:
    """The role a received message's sender proved with its key; None with CURVE off."""
    try:
        # A metadata property (a str name) reads as a str; pyzmq's stub says int | str.
        return cast(str, frame.get(USER_ID)) or None
    except zmq.ZMQError:  # no ZAP user id on this message: CURVE is off
        return None


def connect(socket: zmq.Socket, address: str) -> None:
    """Connect an existing socket (a SUB to one more publisher) to a checked endpoint."""
    check_endpoint(address)
    try:
        socket.connect(address)
    except zmq.ZMQError as error:
        raise ValueError(f"cannot connect to {address!r}: {error}") from None


def check_endpoint(address: str) -> None:
    """ValueError unless `address` is tcp://HOST:PORT or ipc://PATH (what peers may hand us)."""
    if not isinstance(address, str) or len(address) > 512:
        raise ValueError("endpoint must be a string of at most 512 characters")
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc" and rest:
        return
    if not sep or scheme != "tcp":
        raise ValueError(f"{address!r} is not a tcp://host:port or ipc:// endpoint")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not a tcp://host:port endpoint")
    if host.startswith("[") != host.endswith("]") or any(c.isspace() or c in "/;@" for c in host):
        raise ValueError(f"{address!r} has a malformed host")


def check_bind_address(address: str, curve: bool, insecure: bool) -> None:
    """Without CURVE no peer proves its role, so only loopback may be bound unless the
    operator said insecure."""
    if curve or insecure or not address.startswith("tcp://"):
        return
    host = address[len("tcp://"):].rpartition(":")[0]
    if not is_loopback(host):
        raise ConfigError(f"host: refusing to bind {address} without CURVE, where anyone who reaches it "
                          "could pose as any role; set curve_enabled with curve_keys_dir (svc keys generate) "
                          "or pass --insecure")


def check_bind_policy(config: ClusterConfig) -> None:
    """What a role checks at start: its ZeroMQ host may be bound under the CURVE rule."""
    check_bind_address(f"tcp://{config.host}:{config.port_base}", config.curve_enabled, config.insecure)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: loopback only if every address it resolves to is
        try:
            infos = stdlib_socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def engine_context(io_cpus: str) -> zmq.Context:
    """The ZeroMQ context of an engine process, its I/O threads on `io_cpus` (a CPU list;
    "": where the process runs). Every send wakes an I/O thread, which on the engine's own
    core takes that core from the engine until it has sent: on a 2-core machine a
    32-sequence decode step's send then cost 139 µs instead of 85 (common/cpus.py). Call
    it before the process makes any socket: the threads start with the first."""
    context = zmq.Context()
    for cpu in sorted(parse_cpu_list(io_cpus)) if io_cpus else ():
        context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    return context


def _socket(context: zmq.Context[SocketT], kind: int) -> SocketT:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return socket


def send(socket: zmq.Socket, message: msgspec.Struct, payloads: Sequence[npt.ArrayLike] | None = None,
         identity: bytes | None = None, flags: int = 0) -> None:
    frames = encode(message, payloads)
    if identity is not None:
        frames = [identity, *frames]
    socket.send_multipart(frames, flags=flags, copy=False)


def split_routed(frames: list) -> tuple[bytes, list]:
    """(identity, message frames) of what a ROUTER socket received."""
    if len(frames) < 2:
        raise ProtocolError("routed message without an identity frame")
    return bytes(frames[0]), frames[1:]


__all__ = ["CurveKeys", "ROLES", "Security", "check_bind_policy", "check_endpoint", "connect", "decode",
           "engine_context", "generate_curve_keys", "is_loopback", "load_curve_keys", "peer_role", "send",
           "split_routed"]
