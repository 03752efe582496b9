"""Per-role CURVE keys, the ZAP handler that maps keys to roles, and endpoint checks,
on real ZeroMQ sockets over loopback."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common.config import ClusterConfig, ConfigError
from common.sockets import (
    ROLES,
    Security,
    check_bind_address,
    check_endpoint,
    generate_curve_keys,
    load_curve_keys,
    peer_role,
)


@pytest.fixture
def keys_dir(tmp_path) -> Path:
    generate_curve_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.mark.parametrize("role", ["router", "worker", "prefill", "decode", "tokenizer", "client", "kvstore"])
def test_each_role_loads_its_own_key_pair_and_knows_every_role(keys_dir, role):
    keys = load_curve_keys(keys_dir, role)
    assert keys.roles_by_key[keys.public] == role
    assert sorted(keys.roles_by_key.values()) == ["client", "decode", "kvstore", "prefill", "router", "tokenizer",
                                                  "worker"]
    assert len({keys.public_of(other) for other in ("router", "worker", "prefill", "decode", "kvstore")}) == 5


def test_extra_client_keys_count_as_clients(keys_dir):
    zmq.auth.create_certificates(keys_dir, "client-alice")
    keys = load_curve_keys(keys_dir, "router")
    assert sorted(keys.roles_by_key.values()) == ["client", "client", "decode", "kvstore", "prefill", "router",
                                                  "tokenizer", "worker"]


@pytest.mark.parametrize("damage", ["missing secret", "foreign secret", "garbage public"])
def test_a_damaged_key_directory_names_the_file(keys_dir, damage):
    if damage == "missing secret":
        (keys_dir / "worker.key_secret").unlink()
        expected = "worker.key_secret"
    elif damage == "foreign secret":
        (keys_dir / "worker.key_secret").write_bytes((keys_dir / "client.key_secret").read_bytes())
        expected = "does not match worker.key"
    else:
        (keys_dir / "tokenizer.key").write_text("not a certificate\n")
        expected = "tokenizer.key"
    with pytest.raises(ConfigError, match=f"^curve_keys_dir: .*{expected}"):
        load_curve_keys(keys_dir, "worker")


def test_keys_generate_refuses_to_overwrite_and_keeps_secrets_private(keys_dir):
    before = (keys_dir / "router.key_secret").read_bytes()
    with pytest.raises(FileExistsError):
        generate_curve_keys(keys_dir)
    assert (keys_dir / "router.key_secret").read_bytes() == before
    assert (keys_dir / "router.key_secret").stat().st_mode & 0o077 == 0


def test_secrets_are_created_private_even_under_a_permissive_umask(tmp_path):
    """Each secret is created 0600 (no window in which it is readable), the directory
    0700; public keys stay readable; the set loads."""
    previous = os.umask(0)
    try:
        written = generate_curve_keys(tmp_path / "keys")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in written}
    assert {name: mode for name, mode in modes.items() if name.endswith(".key_secret")} == \
        {f"{role}.key_secret": 0o600 for role in ROLES}
    assert {name: mode for name, mode in modes.items() if name.endswith(".key")} == \
        {f"{role}.key": 0o644 for role in ROLES}
    assert load_curve_keys(tmp_path / "keys", "decode").role == "decode"


def _config(keys_dir: Path) -> ClusterConfig:
    return ClusterConfig(curve_enabled=True, curve_keys_dir=str(keys_dir))


def _exchange(server: zmq.Socket, client: zmq.Socket, timeout_ms: int = 1500) -> str | None:
    """Send from `client`; the role the server saw, or None if nothing got through (a
    refused peer's connection is dropped, so its send can find none to queue on)."""
    try:
        client.send(b"ping", flags=zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not server.poll(timeout_ms):
        return None
    *_, frame = server.recv_multipart(copy=False)
    return peer_role(frame) or "?"


@pytest.fixture
def router_side(keys_dir):
    """A ROUTER socket that accepts workers and tokenizers, as the router binds it."""
    context = zmq.Context()
    security = Security(context, _config(keys_dir), "router")
    server = security.server(zmq.ROUTER, "tcp://127.0.0.1:*", accept=("worker", "tokenizer"))
    yield server, server.getsockopt_string(zmq.LAST_ENDPOINT), context
    security.stop()
    context.destroy(linger=0)


@pytest.mark.parametrize("role, admitted", [("worker", True), ("tokenizer", True), ("client", False)])
def test_a_socket_admits_only_its_roles_and_stamps_each_message_with_the_role(keys_dir, router_side, role,
                                                                              admitted):
    server, address, context = router_side
    peer = Security(context, _config(keys_dir), role).client(zmq.DEALER, address, "router")
    assert _exchange(server, peer) == (role if admitted else None)


def test_a_key_outside_the_directory_is_refused(keys_dir, router_side, tmp_path):
    server, address, context = router_side
    stranger = tmp_path / "stranger"
    generate_curve_keys(stranger)
    for name in ("router.key",):  # the stranger knows the router's public key, not a role's secret
        (stranger / name).write_bytes((keys_dir / name).read_bytes())
    peer = Security(context, _config(stranger), "worker").client(zmq.DEALER, address, "router")
    assert _exchange(server, peer) is None


def test_without_curve_no_role_is_claimed():
    context = zmq.Context()
    try:
        security = Security(context, ClusterConfig(), "router")
        server = security.server(zmq.ROUTER, "tcp://127.0.0.1:*", accept=("worker",))
        peer = security.client(zmq.DEALER, server.getsockopt_string(zmq.LAST_ENDPOINT), "router")
        assert _exchange(server, peer) == "?"
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("address", ["garbage-not-an-endpoint", "tcp://", "tcp://host", "tcp://host:0",
                                     "tcp://host:70000", "tcp://:5555", "udp://host:5", "tcp://a b:5",
                                     "inproc://x", "tcp://h:5;tcp://i:6", 42, "tcp://" + "h" * 600 + ":5"])
def test_bad_endpoints_are_refused(address):
    with pytest.raises(ValueError):
        check_endpoint(address)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:7100", "tcp://router.example:7100", "tcp://[::1]:7100",
                                     "ipc:///tmp/baton.sock"])
def test_good_endpoints_pass(address):
    check_endpoint(address)


def test_a_failed_connect_leaves_no_socket_open():
    """A socket left open by a refused connect made zmq_ctx_term block forever."""
    context = zmq.Context()
    security = Security(context, ClusterConfig(), "worker")
    with pytest.raises(ValueError):
        security.client(zmq.PUSH, "tcp://no-such-host-!!:5", "tokenizer")
    context.term()  # returns only if no socket is open


@pytest.mark.parametrize("host, allowed", [("127.0.0.1", True), ("localhost", True), ("[::1]", True),
                                           ("0.0.0.0", False), ("10.1.2.3", False)])
def test_without_curve_only_loopback_may_be_bound(host, allowed):
    address = f"tcp://{host}:7100"
    if allowed:
        check_bind_address(address, curve=False, insecure=False)
    else:
        with pytest.raises(ConfigError, match="^host: refusing to bind .*--insecure"):
            check_bind_address(address, curve=False, insecure=False)
    check_bind_address(address, curve=True, insecure=False)
    check_bind_address(address, curve=False, insecure=True)
