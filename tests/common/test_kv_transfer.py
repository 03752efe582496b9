"""KV transfer between real processes on loopback, over each transport (docs/kv-transfer.md §2).

The serving side runs in a spawned child process that fills its pool from a seed and
takes commands over a pipe; the pulling side is this process. UCX cases skip only where
ucxx does not import. The `cuda` cases move GPU pools (both sides on the GPU) and run
only with BATON_TEST_DEVICE=cuda (scripts/check_cuda.sh, stage kv-transfer).
"""
from __future__ import annotations

import ipaddress
import multiprocessing
import os
import time
from dataclasses import replace

import numpy as np
import pytest
import zmq

from common.config import ClusterConfig, ConfigError
from common.engine.kv_layout import KVLayout
from common.kv_transfer import (
    HandshakeRefused,
    PlanError,
    PoolGeometry,
    TransferOptions,
    ZmqTransport,
    make_transport,
    plan_pieces,
    pool_bytes,
    ucx_available,
)
from common.kv_transfer.netdev import interface_addresses, ucx_device_options
from common.kv_transfer.plan import compat_hash, compat_of, group_pieces, paired_runs
from common.protocol import PROTOCOL_VERSION, ErrorCode, KvEnd, KvHello, KvPull, KvWelcome, decode, encode
from common.sockets import Security
from tests.services.test_listeners import listening_sockets, socket_inodes

UCX_MISSING = ucx_available()
TRANSPORTS = ["zmq", pytest.param("ucx", marks=pytest.mark.skipif(
    UCX_MISSING is not None, reason=f"ucxx does not import: {UCX_MISSING}"))]
GEOMETRY = PoolGeometry(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16"),
                        num_blocks=64)
FINGERPRINT = "model-a"
SERVER_SEED = 7
TEST_DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
DEVICES = ["cpu", pytest.param(TEST_DEVICE, id="cuda", marks=pytest.mark.skipif(
    not TEST_DEVICE.startswith("cuda"), reason="GPU pools: run with BATON_TEST_DEVICE=cuda"))]
WAIT_S = 20.0  # no single wait in these tests may take longer than this


def seeded_pool(geometry: PoolGeometry, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, geometry.pool_bytes, dtype=np.uint8)


def on_device(pool: np.ndarray, device: str):
    """The pool a transport is given: the array itself on the CPU, a copy as a flat uint8
    tensor on a GPU."""
    if device == "cpu":
        return pool
    import torch

    return torch.from_numpy(pool).to(device)


def host(pool) -> np.ndarray:
    """A pool's bytes as a numpy array (a copy of a GPU pool's)."""
    return pool if isinstance(pool, np.ndarray) else pool.cpu().numpy()


def write(pool, start: int, data: np.ndarray) -> None:
    """Overwrite pool bytes from `start` on, as an engine writing KV would."""
    if isinstance(pool, np.ndarray):
        pool[start:start + data.nbytes] = data
    else:
        import torch

        pool[start:start + data.nbytes].copy_(torch.from_numpy(data))


def block_bytes(pool, geometry: PoolGeometry, block: int) -> bytes:
    """Every byte of `block`: its run in each plane, in plane order."""
    pool, size = host(pool), geometry.plane_block_bytes
    return b"".join(pool[geometry.offset(plane, block):geometry.offset(plane, block) + size].tobytes()
                    for plane in range(geometry.num_planes))


def _security(keys_dir: str = "", role: str = "decode", insecure: bool = False) -> Security:
    config = ClusterConfig(curve_enabled=True, curve_keys_dir=keys_dir) if keys_dir else ClusterConfig(
        insecure=insecure)
    return Security(zmq.Context.instance(), config, role)


def _serve(conn, transport: str, geometry: PoolGeometry, fingerprint: str, options: TransferOptions,
           keys_dir: str, device: str, role: str) -> None:
    """The child: serve a seeded pool and answer the test's commands until told to stop."""
    pool = on_device(seeded_pool(geometry, SERVER_SEED), device)
    security = _security(keys_dir, role=role)
    server = make_transport(transport, pool, geometry, fingerprint, security, f"{role}-0", options)
    conn.send(server.listen("tcp://127.0.0.1:0"))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            server.close()
            conn.send("stopped")
            return
        if command == "expose":
            server.expose(*args)
            conn.send("ok")
        elif command == "event":
            event = server.next_event(args[0])
            conn.send(None if event is None else (event.transfer_id, event.status, event.reason, event.settled))
        elif command == "counters":
            conn.send(dict(server.counters))
        elif command == "serving":
            conn.send(server.serving(args[0]))


class ServerProcess:
    def __init__(self, transport: str, geometry: PoolGeometry = GEOMETRY, fingerprint: str = FINGERPRINT,
                 options: TransferOptions | None = None, keys_dir: str = "", device: str = "cpu",
                 role: str = "prefill"):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, transport, geometry, fingerprint,
                                                            options or TransferOptions(), keys_dir, device, role),
                                       daemon=True)
        self.process.start()
        self.geometry = geometry
        self.address = self._answer()

    def _answer(self):
        if not self.conn.poll(WAIT_S * 2):  # the first answer waits for the child's imports
            raise TimeoutError("the server process did not answer")
        return self.conn.recv()

    def ask(self, *command):
        self.conn.send(command)
        return self._answer()

    def event(self, timeout: float = WAIT_S):
        return self.ask("event", timeout)

    def stop(self) -> None:
        try:
            self.ask("stop")
        finally:
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()


@pytest.fixture
def spawn_server():
    servers = []

    def start(*args, **kwargs) -> ServerProcess:
        servers.append(ServerProcess(*args, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def puller(transport: str, geometry: PoolGeometry = GEOMETRY, fingerprint: str = FINGERPRINT,
           options: TransferOptions | None = None, seed: int = 11, security: Security | None = None,
           device: str = "cpu"):
    pool = on_device(seeded_pool(geometry, seed), device)
    return make_transport(transport, pool, geometry, fingerprint, security or _security(), "decode-0",
                          options), pool


def test_a_block_major_pool_keeps_each_block_in_one_run():
    store = replace(GEOMETRY, block_major=True)
    assert [store.offset(plane, 3) for plane in range(store.num_planes)] == [
        3 * store.bytes_per_block + plane * store.plane_block_bytes for plane in range(store.num_planes)]
    pieces = plan_pieces(store, GEOMETRY, [4, 5], [10, 11], max_piece_bytes=1 << 20)
    assert len(pieces) == 2 * GEOMETRY.num_planes  # nothing coalesces across a block-major side
    assert {piece.length for piece in pieces} == {GEOMETRY.plane_block_bytes}


# ---- plans (pure) ------------------------------------------------------------------------------

def test_runs_pair_only_where_both_sides_step_by_one():
    assert paired_runs([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]


def test_plan_coalesces_runs_per_plane_and_cuts_them():
    pieces = plan_pieces(GEOMETRY, GEOMETRY, [4, 5, 6, 7], [10, 11, 12, 13], max_piece_bytes=1 << 20)
    assert len(pieces) == GEOMETRY.num_planes  # one run per plane
    assert all(piece.length == 4 * GEOMETRY.plane_block_bytes for piece in pieces)
    cut = plan_pieces(GEOMETRY, GEOMETRY, [4, 5, 6, 7], [10, 11, 12, 13], max_piece_bytes=GEOMETRY.plane_block_bytes)
    assert len(cut) == 4 * GEOMETRY.num_planes
    assert group_pieces(cut, 3 * GEOMETRY.plane_block_bytes, 1024)[0] == (0, 3)


@pytest.mark.parametrize("src,dst", [([1, 2], [3]), ([1, 1], [2, 3]), ([64], [0]), ([0], [-1])])
def test_plan_refuses_bad_block_lists(src, dst):
    with pytest.raises(PlanError):
        plan_pieces(GEOMETRY, GEOMETRY, src, dst, 1 << 20)


@pytest.mark.parametrize("device", DEVICES)
def test_geometry_offsets_match_the_engine_pool_tensor(device):
    import torch

    from common.engine.kv_cache import KVCache

    layout = GEOMETRY.layout
    cache = KVCache(layout, GEOMETRY.num_blocks, torch.device(device))
    cache.data.copy_(torch.randn(cache.data.shape))
    flat = pool_bytes(cache)
    assert isinstance(flat, np.ndarray) == (device == "cpu")  # a GPU pool stays a tensor, in GPU memory
    flat = host(flat)
    geometry = PoolGeometry(layout, cache.num_blocks)
    assert flat.nbytes == geometry.pool_bytes and geometry.bytes_per_block == layout.bytes_per_block
    block, slots = 5, slice(5 * GEOMETRY.layout.block_size, 6 * GEOMETRY.layout.block_size)
    expected = b"".join(cache.data[layer, kv, slots].cpu().contiguous().view(torch.uint8).numpy().tobytes()
                        for layer in range(GEOMETRY.layout.num_layers) for kv in range(2))
    assert block_bytes(flat, geometry, block) == expected


# ---- selection ---------------------------------------------------------------------------------

def test_selection_by_setting_and_fallback(monkeypatch):
    import common.kv_transfer as kv_transfer

    pool = seeded_pool(GEOMETRY, 1)
    with pytest.raises(ValueError, match="kv_transport"):
        make_transport("rdma", pool, GEOMETRY, FINGERPRINT, _security(), "x")
    with make_transport("zmq", pool, GEOMETRY, FINGERPRINT, _security(), "x") as chosen:
        assert chosen.name == "zmq"

    def broken(*args):
        raise RuntimeError("no UCX here")

    monkeypatch.setattr(kv_transfer, "_start_ucx", broken)
    with make_transport("auto", pool, GEOMETRY, FINGERPRINT, _security(), "x") as chosen:
        assert isinstance(chosen, ZmqTransport)
    with pytest.raises(RuntimeError, match="kv_transport = ucx"):
        make_transport("ucx", pool, GEOMETRY, FINGERPRINT, _security(), "x")


# ---- where the data plane listens (docs/kv-transfer.md §5) ------------------------------------

INTERFACES = {"lo": {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")},
              "eth0": {ipaddress.ip_address("192.0.2.2"), ipaddress.ip_address("fd00::2")},
              "docker0": {ipaddress.ip_address("172.17.0.1")}}


def test_ucx_is_kept_to_the_interfaces_owning_the_host():
    assert ucx_device_options("127.0.0.1", INTERFACES) == {"NET_DEVICES": "^docker0,eth0", "TCP_AF_PRIO": "inet"}
    assert ucx_device_options("[::1]", INTERFACES) == {"NET_DEVICES": "^docker0,eth0", "TCP_AF_PRIO": "inet6"}
    assert ucx_device_options("fd00::2", INTERFACES) == {"NET_DEVICES": "^docker0,lo", "TCP_AF_PRIO": "inet6"}
    assert ucx_device_options("localhost", INTERFACES)["NET_DEVICES"] == "^docker0,eth0"  # a name is resolved
    assert ucx_device_options("0.0.0.0", INTERFACES) == {}  # every interface, as ZeroMQ binds it
    assert ucx_device_options("127.0.0.1", {"lo": INTERFACES["lo"]}) == {"TCP_AF_PRIO": "inet"}
    with pytest.raises(ValueError, match="'198.51.100.7'.*not an address of any network interface"):
        ucx_device_options("198.51.100.7", INTERFACES)
    with pytest.raises(ValueError, match="host"):
        ucx_device_options("", INTERFACES)


def test_the_machine_interfaces_are_read_with_their_addresses():
    assert ipaddress.ip_address("127.0.0.1") in interface_addresses()["lo"]


def test_without_curve_the_data_plane_refuses_a_host_beyond_loopback():
    pool, beyond = seeded_pool(GEOMETRY, 1), TransferOptions(host="198.51.100.7")
    with pytest.raises(ConfigError, match="refusing to bind"):
        make_transport("zmq", pool, GEOMETRY, FINGERPRINT, _security(), "x", beyond)
    with pytest.raises(ValueError, match="host"):
        make_transport("zmq", pool, GEOMETRY, FINGERPRINT, _security(), "x", TransferOptions(host="a b"))
    with make_transport("zmq", pool, GEOMETRY, FINGERPRINT, _security(insecure=True), "x", beyond) as transport:
        assert transport.options.host == "198.51.100.7"


@pytest.mark.skipif(UCX_MISSING is not None, reason=f"ucxx does not import: {UCX_MISSING}")
def test_a_ucx_transport_listens_on_its_host_only():
    """UCX's TCP transport opens a listener on each interface it uses: here only loopback's,
    and a host that no interface owns is an error naming it."""
    before = socket_inodes(os.getpid())
    with puller("ucx")[0]:
        listening = listening_sockets()
        added = [listening[inode] for inode in socket_inodes(os.getpid()) - before if inode in listening]
    assert added, "UCX opened no TCP listener: nothing was checked"
    assert all(address.startswith("127.0.0.1:") for address in added), added
    with pytest.raises(RuntimeError, match="198.51.100.7.*not an address of any network interface"):
        make_transport("ucx", seeded_pool(GEOMETRY, 1), GEOMETRY, FINGERPRINT, _security(insecure=True), "x",
                       TransferOptions(host="198.51.100.7"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_without_an_accepted_handshake_is_refused_and_serves_nothing(spawn_server, transport):
    """A peer that skipped the handshake, or whose handshake was refused, gets KvEnd
    `refused` for a pull of an exposed transfer, which stays for the peer that handshakes."""
    server = spawn_server(transport)
    server.ask("expose", "req-9", [3, 4], 30.0)
    pull = KvPull("req-9", 77, [3, 4], [3, 4], WAIT_S, 4 << 10)
    stranger = _security().client(zmq.DEALER, server.address, "prefill")
    try:
        stranger.send_multipart(encode(pull))
        assert stranger.poll(WAIT_S * 1000), "no answer to a pull without a handshake"
        answer, _ = decode(stranger.recv_multipart())
        assert isinstance(answer, KvEnd) and answer.code == ErrorCode.REFUSED, answer
        assert "no accepted handshake" in answer.reason
        other = compat_of(GEOMETRY, "model-b")
        stranger.send_multipart(encode(KvHello(PROTOCOL_VERSION, "decode-9", transport, other,
                                               compat_hash(other), GEOMETRY.num_blocks, b"\x01" * 64)))
        assert stranger.poll(WAIT_S * 1000)
        welcome, _ = decode(stranger.recv_multipart())
        assert isinstance(welcome, KvWelcome) and not welcome.accepted and welcome.field == "model_fingerprint"
        stranger.send_multipart(encode(pull))
        assert stranger.poll(WAIT_S * 1000)
        answer, _ = decode(stranger.recv_multipart())
        assert isinstance(answer, KvEnd) and "no accepted handshake" in answer.reason, answer
    finally:
        stranger.close(0)
    client, pool = puller(transport)
    with client:
        peer = client.connect(server.address)
        assert client.pull(peer, "req-9", [3, 4], [8, 9], time.monotonic() + WAIT_S).wait(WAIT_S).status == "done"
        source = seeded_pool(GEOMETRY, SERVER_SEED)
        assert block_bytes(pool, GEOMETRY, 9) == block_bytes(source, GEOMETRY, 4)
    assert server.event()[:2] == ("req-9", "done")


# ---- transfers between processes -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pulled_blocks_equal_the_source_and_the_server_learns_done(spawn_server, transport, device):
    server = spawn_server(transport, device=device)
    client, pool = puller(transport, options=TransferOptions(max_piece_bytes=8 << 10, message_bytes=20 << 10),
                          device=device)
    with client:
        peer = client.connect(server.address)
        src = [3, 4, 5, 6, 20, 40, 41, 2, 63]  # runs, singles, a step back
        dst = [10, 11, 12, 50, 51, 0, 1, 2, 30]
        server.ask("expose", "req-1", src + [7, 8], 30.0)
        untouched = {block: block_bytes(pool, GEOMETRY, block) for block in range(GEOMETRY.num_blocks)
                     if block not in dst}
        result = client.pull(peer, "req-1", src, dst, time.monotonic() + WAIT_S).wait(WAIT_S)
        assert result.status == "done", result
        assert result.nbytes == len(src) * GEOMETRY.bytes_per_block
        source = seeded_pool(GEOMETRY, SERVER_SEED)
        for s, d in zip(src, dst):
            assert block_bytes(pool, GEOMETRY, d) == block_bytes(source, GEOMETRY, s), (s, d)
        assert all(block_bytes(pool, GEOMETRY, block) == data for block, data in untouched.items())
        assert server.event() == ("req-1", "done", "", True)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("field,change", [
    ("block_size", {"geometry": replace(GEOMETRY, layout=replace(GEOMETRY.layout, block_size=8))}),
    ("kv_dtype", {"geometry": replace(GEOMETRY, layout=replace(GEOMETRY.layout, dtype="float16"))}),
    ("num_layers", {"geometry": replace(GEOMETRY, layout=replace(GEOMETRY.layout, num_layers=3))}),
    ("model_fingerprint", {"fingerprint": "model-b"}),
])
def test_handshake_refuses_a_mismatch_naming_the_field(spawn_server, transport, field, change):
    server = spawn_server(transport)
    client, _ = puller(transport, **change)
    with client:
        with pytest.raises(HandshakeRefused, match=field) as refused:
            client.connect(server.address)
        assert refused.value.field == field


def test_handshake_refuses_another_transport(spawn_server):
    if UCX_MISSING is not None:
        pytest.skip(f"ucxx does not import: {UCX_MISSING}")
    server = spawn_server("ucx")
    client, _ = puller("zmq")
    with client, pytest.raises(HandshakeRefused, match="transport") as refused:
        client.connect(server.address)
    assert refused.value.field == "transport"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unknown_or_unexposed_transfers_are_refused_and_service_goes_on(spawn_server, transport):
    server = spawn_server(transport)
    client, pool = puller(transport)
    with client:
        peer = client.connect(server.address)
        before = pool.copy()
        forged = client.pull(peer, "never-exposed", [1, 2], [1, 2], time.monotonic() + WAIT_S).wait(WAIT_S)
        assert (forged.status, forged.code) == ("failed", ErrorCode.REFUSED)
        assert "unknown transfer id" in forged.reason
        server.ask("expose", "req-2", [1, 2], 30.0)
        beyond = client.pull(peer, "req-2", [1, 2, 3], [1, 2, 3], time.monotonic() + WAIT_S).wait(WAIT_S)
        assert beyond.status == "failed" and "does not expose" in beyond.reason
        assert np.array_equal(pool, before)
        assert client.pull(peer, "req-2", [1, 2], [5, 6], time.monotonic() + WAIT_S).wait(WAIT_S).status == "done"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_frames_get_an_error_and_the_server_goes_on(spawn_server, transport):
    server = spawn_server(transport)
    socket = _security().client(zmq.DEALER, server.address, "prefill")
    try:
        for frames in ([b"\x12", b"\xc1"], [b"\xff", b""], [b"\x13", encode(KvEnd("x", 1, "done"))[1], b"zz"]):
            socket.send_multipart(frames)
            assert socket.poll(WAIT_S * 1000), "no answer to a bad frame"
            answer, _ = decode(socket.recv_multipart())
            assert isinstance(answer, KvEnd) and answer.code == ErrorCode.INVALID_REQUEST, answer
    finally:
        socket.close(0)
    client, _ = puller(transport)
    with client:
        peer = client.connect(server.address)
        server.ask("expose", "req-3", [9], 30.0)
        assert client.pull(peer, "req-3", [9], [9], time.monotonic() + WAIT_S).wait(WAIT_S).status == "done"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deadline_expiry_tells_both_sides_without_hanging(spawn_server, transport):
    slow = TransferOptions(send_pause_s=0.2, max_piece_bytes=4 << 10)
    server = spawn_server(transport, options=slow)
    client, _ = puller(transport, options=TransferOptions(max_piece_bytes=4 << 10))
    with client:
        peer = client.connect(server.address)
        blocks = list(range(0, GEOMETRY.num_blocks, 2))  # 128 pieces, 0.2 s apart
        server.ask("expose", "req-4", blocks, 30.0)
        started = time.monotonic()
        result = client.pull(peer, "req-4", blocks, blocks, started + 1.0).wait(WAIT_S)
        assert result.status == "timeout" and result.code == ErrorCode.TIMEOUT, result
        assert time.monotonic() - started < 3.0
        transfer_id, status, reason, settled = server.event(5.0)
        assert (transfer_id, status, settled) == ("req-4", "failed", True)
        assert "deadline" in reason
        assert time.monotonic() - started < 6.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reopening_exposure_outlives_a_failed_pull_and_another_peer_pulls_it(spawn_server, transport):
    """expose(..., reopen_on_failure=True), as a prefill worker exposes a lease: a pull past
    its deadline fails on both sides without ending the exposure (no event), and once
    that pull has settled another puller pulls the blocks whole; then it ends done."""
    small = TransferOptions(max_piece_bytes=4 << 10)
    server = spawn_server(transport, options=TransferOptions(send_pause_s=0.2, max_piece_bytes=4 << 10))
    first, _ = puller(transport, options=small)
    second, pool = puller(transport, options=small, seed=12)
    with first, second:
        server.ask("expose", "req-r", [9, 10], 30.0, True)
        failed = first.pull(first.connect(server.address), "req-r", [9, 10], [9, 10], time.monotonic() + 0.3)
        assert failed.wait(WAIT_S).status == "timeout"
        assert server.event(1.0) is None  # still exposed
        peer = second.connect(server.address)
        deadline = time.monotonic() + WAIT_S
        while (result := second.pull(peer, "req-r", [9, 10], [20, 21], time.monotonic() + WAIT_S).wait(WAIT_S)) \
                .status != "done":
            assert "already being pulled" in result.reason and time.monotonic() < deadline, result  # settling
            time.sleep(0.1)
        source = seeded_pool(GEOMETRY, SERVER_SEED)
        assert [block_bytes(pool, GEOMETRY, b) for b in (20, 21)] == [block_bytes(source, GEOMETRY, b)
                                                                       for b in (9, 10)]
    assert server.event()[:2] == ("req-r", "done")


SLOW_PIECES = 4 << 10  # bytes a piece, with a pause before each: a pull of half the pool takes seconds


def slow_pull(spawn_server, transport: str, transfer_id: str):
    """A server that pauses 50 ms before each 4 KiB piece, half its pool exposed under
    `transfer_id`, and a puller; the puller's transport, the server, the pull's peer and
    the exposed blocks (enter the transport to close it)."""
    server = spawn_server(transport, options=TransferOptions(send_pause_s=0.05, max_piece_bytes=SLOW_PIECES))
    client, _ = puller(transport, options=TransferOptions(max_piece_bytes=SLOW_PIECES))
    try:
        peer = client.connect(server.address)
        blocks = list(range(0, GEOMETRY.num_blocks, 2))
        server.ask("expose", transfer_id, blocks, 30.0)
    except BaseException:
        client.close()
        raise
    return client, server, peer, blocks


def wait_pieces(client, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while client.counters_snapshot()["pieces_landed"] < count and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancel_tells_the_server_which_ends_the_exposure_settled(spawn_server, transport):
    client, server, peer, blocks = slow_pull(spawn_server, transport, "req-7")
    with client:
        handle = client.pull(peer, "req-7", blocks, blocks, time.monotonic() + WAIT_S)
        wait_pieces(client, 2)
        started = time.monotonic()
        assert client.cancel("req-7") is True and handle.wait(1.0).status == "cancelled"
        assert server.event(5.0) == ("req-7", "cancelled", "cancelled by the puller", True)
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_server_knows_which_exposures_a_peer_is_pulling(spawn_server, transport):
    """`serving` is True while a pull of the exposure runs, False before and after (a
    prefill worker rejoining a restarted router does not hand such a lease off again)."""
    client, server, peer, blocks = slow_pull(spawn_server, transport, "req-9")
    with client:
        assert server.ask("serving", "req-9") is False and server.ask("serving", "nothing") is False
        handle = client.pull(peer, "req-9", blocks, blocks, time.monotonic() + WAIT_S)
        wait_pieces(client, 2)
        assert server.ask("serving", "req-9") is True
        assert handle.wait(WAIT_S).status == "done"
        assert server.event(5.0)[:2] == ("req-9", "done")
        assert server.ask("serving", "req-9") is False


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lease_expires_without_a_pull(spawn_server, transport):
    server = spawn_server(transport)
    server.ask("expose", "req-5", [1, 2], 0.3)
    assert server.event(5.0)[:2] == ("req-5", "expired")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_mid_transfer_lets_no_late_byte_land_in_reused_blocks(spawn_server, transport, device):
    """The server is slowed and deaf to the cancel, so it keeps sending after it; the
    destination blocks are reused at once with new bytes, which must stay as written."""
    sender = TransferOptions(send_pause_s=0.02, max_piece_bytes=4 << 10, ignore_puller_end=True)
    server = spawn_server(transport, options=sender, device=device)
    client, pool = puller(transport, options=TransferOptions(max_piece_bytes=4 << 10), device=device)
    with client:
        peer = client.connect(server.address)
        blocks = list(range(1, GEOMETRY.num_blocks, 2))  # no runs: one small piece per block and plane
        server.ask("expose", "req-6", blocks, 30.0)
        handle = client.pull(peer, "req-6", blocks, blocks, time.monotonic() + WAIT_S)
        wait_pieces(client, 5)
        assert not handle.done(), "the slowed transfer finished before the abort"
        assert client.cancel("req-6") is True
        assert handle.wait(1.0).status == "cancelled"
        reused = np.random.default_rng(99).integers(0, 256, GEOMETRY.pool_bytes, dtype=np.uint8)
        for block in blocks:  # another request now owns these blocks and writes its own KV
            for plane in range(GEOMETRY.num_planes):
                start = GEOMETRY.offset(plane, block)
                write(pool, start, reused[start:start + GEOMETRY.plane_block_bytes])
        expected = {block: block_bytes(pool, GEOMETRY, block) for block in blocks}
        late_before = client.counters_snapshot()["late_frames"]
        deadline = time.monotonic() + WAIT_S
        while client.counters_snapshot()["late_frames"] < late_before + 5 and time.monotonic() < deadline:
            time.sleep(0.02)  # the deaf server goes on sending: let several late pieces arrive
        assert client.counters_snapshot()["late_frames"] >= late_before + 5
        assert all(block_bytes(pool, GEOMETRY, block) == expected[block] for block in blocks)


def test_a_pool_is_a_flat_uint8_array_or_a_cuda_tensor():
    import torch

    with pytest.raises(ValueError, match="flat, contiguous uint8 array"):
        make_transport("zmq", np.zeros(GEOMETRY.pool_bytes // 4, dtype=np.float32), GEOMETRY, FINGERPRINT,
                       _security(), "x")
    with pytest.raises(ValueError, match="CUDA tensor, not Tensor on cpu"):  # a CPU pool is given as numpy
        make_transport("zmq", torch.zeros(GEOMETRY.pool_bytes, dtype=torch.uint8), GEOMETRY, FINGERPRINT,
                       _security(), "x")


def test_huge_pages_keep_the_pool_contents():
    from common.kv_transfer.memory import advise_huge_pages

    pool = seeded_pool(replace(GEOMETRY, num_blocks=512), 5)  # 8 MiB: several huge pages
    before = pool.copy()
    assert isinstance(advise_huge_pages(pool), str)
    assert np.array_equal(pool, before)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_with_curve_only_decode_workers_get_a_handshake(spawn_server, transport, tmp_path):
    from common.sockets import generate_curve_keys

    generate_curve_keys(tmp_path)
    server = spawn_server(transport, keys_dir=str(tmp_path))
    stranger, _ = puller(transport, security=_security(str(tmp_path), role="tokenizer"),
                         options=TransferOptions(handshake_timeout_s=1.0))
    with stranger, pytest.raises(TimeoutError, match="handshake"):
        stranger.connect(server.address)  # ZAP drops a tokenizer's key: no answer at all
    client, pool = puller(transport, security=_security(str(tmp_path)))
    with client:
        peer = client.connect(server.address)
        server.ask("expose", "req-8", [4, 5], 30.0)
        assert client.pull(peer, "req-8", [4, 5], [6, 7], time.monotonic() + WAIT_S).wait(WAIT_S).status == "done"
        source = seeded_pool(GEOMETRY, SERVER_SEED)
        assert block_bytes(pool, GEOMETRY, 7) == block_bytes(source, GEOMETRY, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_pulls_from_one_peer_each_land_in_their_own_blocks(spawn_server, transport, device):
    server = spawn_server(transport, device=device)
    client, pool = puller(transport, options=TransferOptions(max_piece_bytes=4 << 10), device=device)
    with client:
        peer = client.connect(server.address)
        jobs = {"a": ([1, 2, 3], [40, 41, 42]), "b": ([3, 9, 27], [5, 6, 7]), "c": ([60, 61], [20, 22])}
        for name, (src, _) in jobs.items():
            server.ask("expose", name, src, 30.0)
        handles = {name: client.pull(peer, name, src, dst, time.monotonic() + WAIT_S)
                   for name, (src, dst) in jobs.items()}
        assert {name: handle.wait(WAIT_S).status for name, handle in handles.items()} == dict.fromkeys(jobs, "done")
        source = seeded_pool(GEOMETRY, SERVER_SEED)
        for src, dst in jobs.values():
            assert all(block_bytes(pool, GEOMETRY, d) == block_bytes(source, GEOMETRY, s) for s, d in zip(src, dst))
        assert sorted(server.event()[:2] for _ in jobs) == [(name, "done") for name in sorted(jobs)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_kv_store_serves_its_block_major_pool_to_engine_roles_only(spawn_server, transport, tmp_path):
    """The store's DRAM pool (block-major, services/kvstore) lands block by block in a
    worker's plane-major pool; under CURVE a tokenizer gets no handshake."""
    from common.sockets import generate_curve_keys

    generate_curve_keys(tmp_path)
    store = replace(GEOMETRY, num_blocks=16, block_major=True)
    server = spawn_server(transport, geometry=store, keys_dir=str(tmp_path), role="kvstore",
                          options=TransferOptions(puller_roles=("worker", "prefill", "decode")))
    stranger, _ = puller(transport, security=_security(str(tmp_path), role="tokenizer"),
                         options=TransferOptions(handshake_timeout_s=1.0))
    with stranger, pytest.raises(TimeoutError, match="handshake"):
        stranger.connect(server.address, server_role="kvstore")
    client, pool = puller(transport, security=_security(str(tmp_path), role="worker"))
    with client:
        peer = client.connect(server.address, server_role="kvstore")
        src, dst = [2, 3, 9], [40, 41, 7]
        server.ask("expose", "fetch-1", src, 30.0)
        result = client.pull(peer, "fetch-1", src, dst, time.monotonic() + WAIT_S).wait(WAIT_S)
        assert result.status == "done", result
        source = seeded_pool(store, SERVER_SEED)
        for s, d in zip(src, dst):
            value = source[s * store.bytes_per_block:(s + 1) * store.bytes_per_block].tobytes()
            assert block_bytes(pool, GEOMETRY, d) == value, (s, d)
