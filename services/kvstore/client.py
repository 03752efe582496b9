"""What engines use to talk to the KV store (docs/kvstore.md §5).

On the store's host the client maps the store's DRAM pool (a file under /dev/shm the
store names in every reply) and copies between it and the engine's pool itself: a get
returns leased slot ids, a put reserves slots, the client fills them and commits with
CRC32C checksums the store verifies. Elsewhere, given a KvTransport over the engine's
pool, a get's blocks are pulled over the store's KV transport (the store copies the
leased slots into staging blocks and exposes those); without one the bytes travel as
raw frames, as puts always do. A reply from a new store instance (it restarted) re-maps
the pool and handshakes anew.

Synchronous, one thread, a deadline of config.kvstore_timeout_s on every call: past it, or
when the store is gone, StoreUnavailable (a ConnectionError), and the engine recomputes.
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import google_crc32c
import numpy as np
import zmq

from common.config import ClusterConfig
from common.engine.kv_layout import KVLayout
from common.kv_transfer import HandshakeRefused, KvTransport
from common.protocol import MAX_STORE_KEYS, ProtocolError, StoreReply, StoreRequest, decode
from common.sockets import MAX_MESSAGE_BYTES, Security, send
from kernels.kv_copy import BlockCopier
from kernels.native import load_native_ops

MAX_INLINE_BYTES = MAX_MESSAGE_BYTES // 2  # raw bytes one request or reply carries at most


class StoreUnavailable(ConnectionError):
    """The store did not answer within the deadline, or is gone."""


class StoreRefused(RuntimeError):
    """The store refused a request; `code` is the ErrorCode value, the text its reason."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code


class StoreClient:
    """One engine's connection to the store; see the module docstring."""

    def __init__(self, config: ClusterConfig, security: Security, client_id: str, layout: KVLayout,
                 shared_memory: bool = True, transport: KvTransport | None = None, native_copies: bool | None = None):
        """`transport`: the engine's KvTransport over the pool `fetch` fills (a CPU pool);
        used when the store's shared memory cannot be mapped. `native_copies`: copy and
        checksum blocks with Baton's C++ kernel (default: where it loads), else numpy."""
        if transport is not None and (transport.geometry.block_major
                                      or transport.geometry.bytes_per_block != layout.bytes_per_block):
            raise ValueError("the transport must serve a plane-major pool of this layout's blocks")
        self.config = config
        self.security = security
        self.client_id = client_id
        self.layout = layout
        self.block_bytes = layout.bytes_per_block
        self.num_planes = 2 * layout.num_layers
        self.allow_shared_memory = shared_memory
        self.timeout_s = config.kvstore_timeout_s
        self.instance_id = ""
        self.last_refusal = ""  # why the last put stopped short, for the engine's logs
        self.checksum_failures = 0  # fetched blocks whose copy did not match (not handed to the engine)
        self.transport = transport
        self.transport_refused = ""  # why the store's KV transport refused our pool (then: frames)
        self._kv_peer = ""  # the store KV address we have a handshake with, and the instance it was
        self._kv_instance = ""
        self._shm: np.ndarray | None = None
        self._copier = BlockCopier(self.num_planes, self.block_bytes,
                                   load_native_ops() if native_copies is None else native_copies)
        self._ids = itertools.count(1)
        self._socket: zmq.Socket = self._connect()

    @property
    def same_host(self) -> bool:
        """True once a reply named a shared-memory pool this process could map."""
        return self._shm is not None

    @property
    def pulls(self) -> bool:
        """True when gets pull their blocks over the KV transport."""
        return self.transport is not None and self._shm is None and not self.transport_refused

    # ---- the API

    def lookup(self, namespace: int, keys: Sequence[int]) -> list[int]:
        """The tier (0 DRAM, 1 SSD) of each block of the longest stored prefix of `keys`."""
        tiers: list[int] = []
        for start in range(0, len(keys), MAX_STORE_KEYS):
            chunk = list(keys[start:start + MAX_STORE_KEYS])
            reply, _ = self._call(StoreRequest("lookup", 0, namespace, keys=chunk))
            tiers += reply.tiers
            if len(reply.tiers) < len(chunk):
                break
        return tiers

    def fetch(self, namespace: int, keys: Sequence[int], dst_pool: np.ndarray, dst_block_ids: Sequence[int]) -> int:
        """Copy the longest stored prefix of `keys` into the engine pool's blocks
        `dst_block_ids` (block i of keys into dst_block_ids[i]); how many leading blocks
        landed. `dst_pool` is the flat uint8 pool, plane-major (docs/kvstore.md §5); with a
        transport, the pool it serves. A block whose CRC32C does not match may land all the
        same but is not counted: blocks past the returned count hold nothing usable."""
        if len(dst_block_ids) < len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dst_block_ids)} destination blocks")
        pool3 = self._pool3(dst_pool)
        landed = 0
        step = self._step()
        while landed < len(keys):
            chunk = list(keys[landed:landed + step])
            pulls = self.pulls
            if pulls and not self._is_transport_pool(dst_pool):
                raise ValueError("dst_pool is not the pool the client's KV transport serves")
            request = StoreRequest("get", 0, namespace, keys=chunk, inline=not self.same_host and not pulls,
                                   transfer=pulls)
            reply, frames = self._call(request)
            dst = dst_block_ids[landed:landed + len(reply.slots)]
            got = self._pull_out(reply, frames, pool3, dst) if reply.kv_address else \
                self._copy_out(reply, frames, pool3, dst)
            landed += got
            more = 0 < got == len(reply.slots) < reply.count  # the store served part (staging full): ask again
            if got < len(chunk) and not more:
                break
        return landed

    def put(self, namespace: int, keys: Sequence[int], parents: Sequence[int], values: np.ndarray) -> int:
        """Store blocks (root-first: each parent stored or earlier in `keys`; a chain's
        first block names the namespace as its parent); how many were newly stored. Keys
        already stored are skipped; a refusal (full, over quota) ends the put quietly,
        its reason in `last_refusal`."""
        if not len(keys) == len(parents) == len(values):
            raise ValueError(f"{len(keys)} keys, {len(parents)} parents, {len(values)} values")
        if values.ndim != 2 or values.shape[1] != self.block_bytes or values.dtype != np.uint8:
            raise ValueError(f"values must be (n, {self.block_bytes}) uint8, got {values.shape} {values.dtype}")
        values = np.ascontiguousarray(values)  # whole rows, so each value's CRC32C reads it in place
        stored, done = 0, 0
        step = self._step()
        while done < len(keys):
            chunk = list(keys[done:done + step])
            taken, newly = self._put_chunk(namespace, chunk, list(parents[done:done + step]),
                                           values[done:done + step])
            stored += newly
            done += taken
            if taken == 0:  # refused outright; a short take (slots all pending) goes on once committed
                break
        return stored

    def remove(self, namespace: int, keys: Sequence[int]) -> int:
        """Drop these blocks and every block stored under them; how many went."""
        return self._call(StoreRequest("remove", 0, namespace, keys=list(keys)), refuse=True)[0].count

    def pin(self, namespace: int, keys: Sequence[int]) -> None:
        self._call(StoreRequest("pin", 0, namespace, keys=list(keys)), refuse=True)

    def unpin(self, namespace: int, keys: Sequence[int]) -> None:
        self._call(StoreRequest("unpin", 0, namespace, keys=list(keys)), refuse=True)

    def stats(self) -> dict:
        reply, _ = self._call(StoreRequest("stats", 0), refuse=True)
        return {**reply.stats, "instance_id": reply.instance_id, "same_host": self.same_host}

    def close(self) -> None:
        """Close the socket and forget the store's KV peer; the transport is the engine's."""
        self._kv_forget()
        self._socket.close(0)
        self._shm = None

    # ---- copies

    def _pool3(self, pool: np.ndarray) -> np.ndarray:
        return self._copier.pool_view(pool)

    def _copy_out(self, reply: StoreReply, frames: list[np.ndarray], pool3: np.ndarray,
                  dst_block_ids: Sequence[int]) -> int:
        """Copy a get's leading verified blocks into the pool, then end its lease."""
        try:
            if not self._check_get(reply, frames):
                return 0
            if any(slot >= 0 for slot in reply.slots) and self._shm is None:
                raise StoreUnavailable("the store answered shared-memory slots this client cannot map")
            return self._land(reply.slots, reply.checksums, frames, pool3, dst_block_ids[:len(reply.slots)])
        finally:
            if reply.lease_id:
                self._notify(StoreRequest("release", 0, lease_id=reply.lease_id))

    def _check_get(self, reply: StoreReply, frames: list[np.ndarray]) -> int:
        """The number of blocks a get answered, once its checksums and frames add up."""
        count = len(reply.slots)
        if len(reply.checksums) != count:
            raise StoreUnavailable("the store's get reply lacks a checksum per block")
        inline = sum(1 for slot in reply.slots if slot < 0)
        if inline != len(frames) or any(f.size != self.block_bytes for f in frames):
            raise StoreUnavailable("the store's get reply does not match its frames")
        return count

    # ---- the KV transport path (docs/kvstore.md §6)

    def _pull_out(self, reply: StoreReply, frames: list[np.ndarray], pool3: np.ndarray,
                  dst_block_ids: Sequence[int]) -> int:
        """Pull a get's exposed staging blocks (its slots) into their blocks over the KV
        transport, place its inline blocks, then count the leading blocks whose landed bytes
        match their CRC32C; the release (freeing the staging blocks) follows, whatever happened."""
        try:
            count = self._check_get(reply, frames)
            pulled = [i for i, slot in enumerate(reply.slots) if slot >= 0]
            if pulled:
                self._pull(reply, [reply.slots[i] for i in pulled], [dst_block_ids[i] for i in pulled])
            frame_iter = iter(frames)
            pulled_checksums = iter(self._copier.pool_checksums(pool3, [dst_block_ids[i] for i in pulled]))
            for i in range(count):
                if reply.slots[i] < 0:
                    value = next(frame_iter)
                    if not self._matches(value, reply.checksums[i]):
                        return i
                    pool3[:, dst_block_ids[i], :] = value.reshape(self.num_planes, -1)
                elif not self._counts(next(pulled_checksums), reply.checksums[i]):
                    return i
            return count
        finally:
            if reply.lease_id:
                self._notify(StoreRequest("release", 0, lease_id=reply.lease_id))

    def _pull(self, reply: StoreReply, src_slots: list[int], dst_block_ids: list[int]) -> None:
        """Pull the slots within the deadline; StoreUnavailable if the pull did not finish."""
        assert self.transport is not None
        peer = self._kv_connect(reply.kv_address, reply.instance_id)
        transfer_id = f"{reply.instance_id}:{reply.lease_id}"  # the store's name for the lease's exposure
        try:
            handle = self.transport.pull(peer, transfer_id, src_slots, dst_block_ids,
                                         time.monotonic() + self.timeout_s)
            result = handle.wait(self.timeout_s + 1.0)  # the pull's own deadline ends it first
        except (TimeoutError, ConnectionError, RuntimeError) as error:
            try:
                self.transport.cancel(transfer_id)
            except (RuntimeError, TimeoutError):
                pass  # the transport is closed or stuck: its deadline ends the pull
            self._kv_forget()
            raise StoreUnavailable(f"pulling from the store's KV transport at {peer}: {error}") from None
        if result.status != "done":
            self._kv_forget()  # a store that died or restarted: handshake anew next time
            raise StoreUnavailable(f"the pull from the store's KV transport at {peer} ended {result.status}"
                                   f"{': ' + result.reason if result.reason else ''}")

    def _kv_connect(self, address: str, instance_id: str) -> str:
        """The store's KV peer, handshaking once per store instance."""
        assert self.transport is not None
        if self._kv_peer and (self._kv_peer != address or self._kv_instance != instance_id):
            self._kv_forget()
        if not self._kv_peer:
            try:
                self.transport.connect(address, server_role="kvstore")
            except HandshakeRefused as refusal:
                self.transport_refused = str(refusal)  # our pools do not match: frames from now on
                raise StoreUnavailable(f"the store's KV transport refused this engine's pool: {refusal}") from None
            except (TimeoutError, ConnectionError, RuntimeError) as error:
                raise StoreUnavailable(f"no KV handshake with the store at {address}: {error}") from None
            self._kv_peer, self._kv_instance = address, instance_id
        return self._kv_peer

    def _kv_forget(self) -> None:
        if self._kv_peer and self.transport is not None:
            try:
                self.transport.disconnect(self._kv_peer)
            except (RuntimeError, TimeoutError):
                pass  # a closed transport has no peers left
        self._kv_peer = self._kv_instance = ""

    def _is_transport_pool(self, pool: np.ndarray) -> bool:
        served = getattr(self.transport.pool, "array", None) if self.transport is not None else None
        return isinstance(served, np.ndarray) and served.nbytes == pool.nbytes and \
            served.__array_interface__["data"][0] == pool.__array_interface__["data"][0]

    def _land(self, slots: Sequence[int], checksums: Sequence[int], frames: list[np.ndarray], pool3: np.ndarray,
              dst_block_ids: Sequence[int]) -> int:
        """Place a get's blocks in the pool: inline frames (private memory already) checked,
        then placed; shared-memory slots copied in runs, each block checksummed as it lands,
        so a slot rewritten under an expired lease, or by a writer past its ticket, is never
        counted (docs/kvstore.md §4). The number of leading blocks that match."""
        frame_iter = iter(frames)
        count, i = len(slots), 0
        while i < count:
            if slots[i] < 0:
                value = next(frame_iter)
                if not self._matches(value, checksums[i]):
                    return i
                pool3[:, dst_block_ids[i], :] = value.reshape(self.num_planes, -1)
                i += 1
                continue
            end = i + 1
            while end < count and slots[end] >= 0:
                end += 1
            assert self._shm is not None
            landed = self._copier.slots_to_pool(self._shm, slots[i:end], pool3, dst_block_ids[i:end])
            for j, checksum in enumerate(landed):
                if not self._counts(checksum, checksums[i + j]):
                    return i + j
            i = end
        return count

    def _matches(self, value: np.ndarray, checksum: int) -> bool:
        return self._counts(google_crc32c.value(value), checksum)

    def _counts(self, landed: int, checksum: int) -> bool:
        if landed == checksum:
            return True
        self.checksum_failures += 1
        return False

    def _put_chunk(self, namespace: int, keys: list[int], parents: list[int], values: np.ndarray) -> tuple[int, int]:
        """(keys taken, blocks newly stored) of one request's worth."""
        if not self.same_host:
            checksums = [google_crc32c.value(row) for row in values]
            reply, _ = self._call(StoreRequest("put", 0, namespace, keys=keys, parents=parents, checksums=checksums),
                                  payloads=list(values))
            self.last_refusal = reply.reason
            return (len(reply.tickets), reply.count) if reply.ok else (0, reply.count)
        reply, _ = self._call(StoreRequest("put_start", 0, namespace, keys=keys, parents=parents))
        self.last_refusal = reply.reason
        if not reply.ok:
            return 0, 0
        taken = len(reply.tickets)
        writes = [i for i, ticket in enumerate(reply.tickets) if ticket]
        if not writes:
            return taken, 0
        tickets = [reply.tickets[i] for i in writes]
        try:
            checksums = self._write_slots([reply.slots[i] for i in writes], writes, values)
        except BaseException:
            self._call(StoreRequest("put_abort", 0, namespace, tickets=tickets))
            raise
        commit, _ = self._call(StoreRequest("put_commit", 0, namespace, tickets=tickets, checksums=checksums))
        if not commit.ok:
            self.last_refusal = commit.reason
        return taken, commit.count

    def _write_slots(self, slots: list[int], rows: list[int], values: np.ndarray) -> list[int]:
        """Copy values[rows[i]] into shared-memory slot slots[i]; the CRC32C of each value."""
        assert self._shm is not None
        chosen = values if rows == list(range(len(values))) else values[rows]
        return self._copier.rows_to_slots(chosen, self._shm, slots)

    def _step(self) -> int:
        """Keys per request: the protocol's limit, and with raw frames the message size."""
        if self.instance_id == "":
            self._hello()
        if self.same_host or self.pulls:
            return MAX_STORE_KEYS
        return max(1, min(MAX_STORE_KEYS, MAX_INLINE_BYTES // self.block_bytes))

    def _hello(self) -> None:
        if self.instance_id == "":
            self._call(StoreRequest("stats", 0))

    # ---- the wire

    def _connect(self) -> zmq.Socket:
        return self.security.client(zmq.DEALER, self.config.kvstore_control, "kvstore")

    def _call(self, request: StoreRequest, payloads: list[np.ndarray] | None = None,
              refuse: bool = False) -> tuple[StoreReply, list[np.ndarray]]:
        """Send and wait for the matching reply; StoreUnavailable past the deadline (the
        socket is then replaced, so nothing sent before reaches a store that comes back)."""
        request.request_id = next(self._ids)
        try:
            send(self._socket, request, payloads, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._reset()
            raise StoreUnavailable(f"the store at {self.config.kvstore_control} takes no requests") from None
        deadline_ms = int(self.timeout_s * 1000)
        while True:
            if not self._socket.poll(deadline_ms):
                self._reset()
                raise StoreUnavailable(f"no answer from the store at {self.config.kvstore_control} "
                                       f"within {self.timeout_s} s")
            frames = self._socket.recv_multipart(copy=False)
            try:
                reply, out = decode(cast(list[bytes], [frame.buffer for frame in frames]))
            except ProtocolError as error:
                self._reset()
                raise StoreUnavailable(f"the store answered a malformed message: {error}") from None
            if isinstance(reply, StoreReply) and reply.request_id == request.request_id:
                break
        self._track(reply)
        if refuse and not reply.ok:
            raise StoreRefused(reply.code, reply.reason)
        return reply, out

    def _notify(self, request: StoreRequest) -> None:
        """Send without waiting for the answer (the next call skips it): for a release,
        whose lease expires anyway if it is lost, so a fetch costs one round trip."""
        request.request_id = next(self._ids)
        try:
            send(self._socket, request, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _reset(self) -> None:
        self._socket.close(0)
        self._socket = self._connect()

    def _track(self, reply: StoreReply) -> None:
        """Notice a new store instance and (re-)map its shared-memory pool if we can."""
        if reply.instance_id == self.instance_id:
            return
        self.instance_id = reply.instance_id
        self._shm = None
        if not self.allow_shared_memory or not reply.shm_path or reply.block_bytes != self.block_bytes:
            return
        path = Path(reply.shm_path)
        try:
            size = os.stat(path).st_size
            if not size or size % self.block_bytes:
                return
            self._shm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size // self.block_bytes, self.block_bytes))
        except (OSError, ValueError):
            self._shm = None  # another host's path, or not ours to open: the bytes travel in frames
