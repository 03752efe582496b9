"""The kvstore role's SSD tier: durable fixed-size slots in preallocated files, in the
shape of Mooncake Store's single-file backend. Keys are the chained block hashes of
docs/kv-identity.md §1, each under a namespace fingerprint (model, dtype, block size,
layout) so that mismatched engines never share a block.

Layout. A tier is a directory of `files` slot files (`slots-000.bkv`, ...). Each file
starts with a 4 KiB file header (magic, version, slot_bytes, num_slots, files, this file's
index, CRC32C) so that a tier reopened with a different shape is refused instead of
misread; slots follow it, striped across the files (slot s lives in file s % files).
A slot holds one record: a 64-byte record header, then the payload:

    magic 4s | version u16 | namespace length u8 | reserved u8 | namespace 16s |
    key u64 | payload length u32 | reserved 4x | sequence u64 | reserved 12x | CRC32C u32

little-endian; an 8-byte namespace is zero-padded to 16. The CRC32C (google-crc32c, in
hardware where the CPU has it) covers the header's first 60 bytes and the payload. The
sequence number is monotonic per tier, so when a crash leaves two records of one
(namespace, key) the rebuild keeps the newest.

Durability contract.
- A record is committed once its CRC'd header and payload are written in one positioned
  write into a slot that held no live record; `write()` returning means that write is done.
  A committed record survives the writing process being killed (the data is in the
  kernel's page cache); it survives power loss once it is synced: on return under
  `SyncPolicy.PER_WRITE`, after the next `sync()` (or every `sync_every_writes` writes,
  or `close()`) under `SyncPolicy.BATCHED`.
- A half-written record fails its CRC, so it is never served: not by `read()`, not by the
  rebuild, which drops and counts it.
- `free()` zeroes the record's magic, so a rebuild does not resurrect it; that zeroing is
  durable under the same policy as writes. Rewriting a key writes the new record into a
  free slot first and frees the old one after it; a crash in between leaves both on disk
  and the rebuild keeps the newer (higher sequence) and drops the older as stale.
- `open` (the constructor) rebuilds the index by scanning every slot: valid records are
  kept (newest per key); stale ones are dropped, counted and their magic zeroed; damaged
  or half-written ones are dropped, counted and their whole header zeroed.

An OSError from a write, free or sync (EIO, say) leaves what happened since the last
sync unknown: the caller closes the tier and reopens it, and the rebuild says what is
there (fsync failures are not retried: the kernel may have dropped the dirty pages).

Not thread-safe: the store serialises calls into one tier. One process at a time may
open a tier directory (an exclusive flock on its `lock` file; the kernel drops it when
the holder dies, even by SIGKILL).

Privacy. Records hold prompts' KV, from which a prompt's tokens can be recovered, so the
tier is the opening process's alone: its directory is created mode 0700 and every file in
it (slots, lock, temporaries) 0600, each made with that mode (no chmod window; a umask
only removes bits). A directory or file that has any group or other permission bit, or
that another user owns (an earlier Baton made them 0755 and 0644), is refused with
TierExposed naming the path and its mode: the operator fixes it or removes it.
"""
from __future__ import annotations

import enum
import errno
import fcntl
import heapq
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import google_crc32c

RECORD_MAGIC = b"BKV1"
RECORD_VERSION = 1
# magic, version, namespace length, reserved, namespace, key, payload length, reserved,
# sequence, reserved: the CRC'd part; the CRC32C itself follows.
_RECORD_BODY = struct.Struct("<4sHBx16sQI4xQ12x")
_CRC = struct.Struct("<I")
HEADER_BYTES = _RECORD_BODY.size + _CRC.size
assert HEADER_BYTES == 64
NAMESPACE_LENGTHS = (8, 16)
MAX_KEY = 2**64 - 1
_MAGIC_ZERO = bytes(len(RECORD_MAGIC))

FILE_MAGIC = b"BATONSSD"
FILE_VERSION = 1
FILE_HEADER_BYTES = 4096  # keeps slots 4 KiB aligned when slot_bytes is a multiple of 4 KiB
_FILE_BODY = struct.Struct("<8sHxxQQII")  # magic, version, slot_bytes, num_slots, files, file index
_MAX_PAYLOAD = 2**32 - 1  # the header's payload length is a u32
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_OTHERS = 0o077  # group and other permission bits


class SsdTierError(Exception):
    """Base of the SSD tier's own errors."""


class DamagedRecord(SsdTierError):
    """A slot's record failed its checks (magic, version, lengths or CRC32C) on read."""

    def __init__(self, slot: int, reason: str) -> None:
        super().__init__(f"slot {slot}: damaged record ({reason})")
        self.slot = slot
        self.reason = reason


class TierFull(SsdTierError):
    """No free slot is left; the caller evicts (frees) before writing again."""


class SlotNotInUse(SsdTierError):
    """`read()` or `free()` of a slot that holds no live record."""


class LayoutMismatch(SsdTierError):
    """The directory holds a tier of another shape or version, or an incomplete one."""


class TierLocked(SsdTierError):
    """Another process holds the tier directory open."""


class TierExposed(SsdTierError):
    """The tier's directory or one of its files is open to other users (a group or other
    permission bit is set) or owned by another user."""


class SyncPolicy(enum.Enum):
    PER_WRITE = "per_write"  # fdatasync after every write and free: durable on return
    BATCHED = "batched"  # fdatasync every sync_every_writes mutations, on sync() and on close()


@dataclass(frozen=True)
class SsdTierConfig:
    """The tier's shape and sync policy. `slot_bytes` includes the 64-byte record header;
    a multiple of 4096 keeps every slot page aligned."""

    directory: Path
    slot_bytes: int
    num_slots: int
    files: int = 1
    sync: SyncPolicy = SyncPolicy.PER_WRITE
    sync_every_writes: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.directory, Path):
            raise TypeError(f"directory must be a pathlib.Path, got {type(self.directory).__name__}")
        _require_int("slot_bytes", self.slot_bytes, HEADER_BYTES + 1, HEADER_BYTES + _MAX_PAYLOAD)
        _require_int("num_slots", self.num_slots, 1, 2**40)
        _require_int("files", self.files, 1, min(self.num_slots, 999))
        if not isinstance(self.sync, SyncPolicy):
            raise TypeError(f"sync must be a SyncPolicy, got {self.sync!r}")
        _require_int("sync_every_writes", self.sync_every_writes, 1, 2**31)

    @property
    def max_payload(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    def slots_in_file(self, index: int) -> int:
        """Slots s with s % files == index."""
        return (self.num_slots - index + self.files - 1) // self.files

    def file_bytes(self, index: int) -> int:
        return FILE_HEADER_BYTES + self.slots_in_file(index) * self.slot_bytes


@dataclass(frozen=True)
class SsdTierStats:
    """Counts since open. dropped_* and rebuild_seconds are the open's rebuild;
    damaged_reads counts `read()` calls that met a damaged record."""

    slots: int
    used: int
    free: int
    dropped_damaged: int
    dropped_stale: int
    damaged_reads: int
    rebuild_seconds: float


@dataclass(frozen=True)
class _Header:
    magic: bytes
    namespace: bytes
    key: int
    payload_length: int
    seq: int
    crc: int


def _require_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_namespace(namespace: object) -> bytes:
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be bytes, got {type(namespace).__name__}")
    if len(namespace) not in NAMESPACE_LENGTHS:
        raise ValueError(f"namespace must be 8 or 16 bytes long, got {len(namespace)}")
    return namespace


def _encode_header(namespace: bytes, key: int, payload: bytes, seq: int) -> bytes:
    body = _RECORD_BODY.pack(RECORD_MAGIC, RECORD_VERSION, len(namespace), namespace, key, len(payload), seq)
    crc = google_crc32c.extend(google_crc32c.value(body), payload)
    return body + _CRC.pack(crc)


def _decode_header(raw: bytes) -> _Header | None:
    """The header's fields, or None when they cannot be a record's (bad version or lengths)."""
    magic, version, ns_length, namespace, key, length, seq = _RECORD_BODY.unpack_from(raw)
    if version != RECORD_VERSION or ns_length not in NAMESPACE_LENGTHS:
        return None
    if any(namespace[ns_length:]):  # padding must be zero, else the header is garbage
        return None
    (crc,) = _CRC.unpack_from(raw, _RECORD_BODY.size)
    return _Header(magic, namespace[:ns_length], key, length, seq, crc)


def _crc_matches(raw: bytes, payload: bytes, crc: int) -> bool:
    return google_crc32c.extend(google_crc32c.value(raw[: _RECORD_BODY.size]), payload) == crc


def _encode_file_header(config: SsdTierConfig, index: int) -> bytes:
    body = _FILE_BODY.pack(FILE_MAGIC, FILE_VERSION, config.slot_bytes, config.num_slots, config.files, index)
    return (body + _CRC.pack(google_crc32c.value(body))).ljust(FILE_HEADER_BYTES, b"\0")


def _make_private_directory(directory: Path) -> None:
    """Creates the tier directory mode 0700 (its parents as the umask says), or checks that
    the one there is a directory private to this user."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, DIRECTORY_MODE)
    except FileExistsError:
        pass
    status = os.stat(directory)
    if not stat.S_ISDIR(status.st_mode):
        raise SsdTierError(f"ssd tier: {directory} is not a directory")
    _require_private(directory, status, DIRECTORY_MODE)


def _open_private(path: Path, flags: int) -> int:
    """A descriptor of `path` (created mode 0600 under O_CREAT), checked private through
    the descriptor itself, so what is checked is what is used. Symbolic links are refused."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        _require_private(path, os.fstat(fd), FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_private(path: Path, status: os.stat_result, wanted: int) -> None:
    """TierExposed, naming the path, unless this user owns it and no one else has any bit."""
    if status.st_uid != os.geteuid():
        raise TierExposed(f"ssd tier: {path} is owned by uid {status.st_uid}, not by this process's uid "
                          f"{os.geteuid()}; chown it or remove it")
    mode = stat.S_IMODE(status.st_mode)
    if mode & _OTHERS:
        exposure = "readable by other users" if mode & 0o044 else "open to other users"
        files = f" and {FILE_MODE:o} the files in it" if stat.S_ISDIR(status.st_mode) else ""
        advice = f"chmod {wanted:o} it{files}"
        raise TierExposed(f"ssd tier: {path} is mode {mode:04o}, {exposure}; {advice}, or remove it")


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now, so a write never fails for space later; filesystems without
    fallocate get a sparse file of the right size instead."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:  # preallocated files are never short unless truncated behind our back
        raise SsdTierError(f"short read: {len(data)} of {size} bytes at offset {offset}")
    return data


class SsdTier:
    """Records (namespace, key, payload) in fixed-size slots; see the module docstring for
    the layout and the durability contract. The constructor creates the files on first
    open and otherwise rebuilds the index from them."""

    def __init__(self, config: SsdTierConfig) -> None:
        if not isinstance(config, SsdTierConfig):
            raise TypeError(f"config must be an SsdTierConfig, got {type(config).__name__}")
        self.config = config
        self._fds: list[int] = []
        self._lock_fd = -1
        self._slot_of: dict[tuple[bytes, int], int] = {}
        self._record_of: dict[int, tuple[bytes, int]] = {}
        self._free: list[int] = []  # a min-heap: the lowest free slot is reused first
        self._dirty: set[int] = set()
        self._unsynced = 0
        self._next_seq = 1
        self._dropped_damaged = 0
        self._dropped_stale = 0
        self._damaged_reads = 0
        self._rebuild_seconds = 0.0
        try:
            self._lock()
            self._open_files()
            self._rebuild()
        except BaseException:
            self._close_fds()
            raise

    # ---- public API

    def write(self, namespace: bytes, key: int, payload: bytes | bytearray | memoryview) -> int:
        """Writes a record into a free slot and returns the slot. A record already held
        for (namespace, key) is freed once the new one is written. Raises TierFull."""
        namespace = _check_namespace(namespace)
        _require_int("key", key, 0, MAX_KEY)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"payload must be bytes-like, got {type(payload).__name__}")
        # google_crc32c takes bytes only; bytes(b) of a bytes object is that object, no copy
        data = bytes(payload)
        if len(data) > self.config.max_payload:
            raise ValueError(f"payload is {len(data)} bytes; a slot holds at most {self.config.max_payload}")
        self._require_open()
        if not self._free:
            raise TierFull(f"all {self.config.num_slots} slots are in use")
        slot = heapq.heappop(self._free)
        seq = self._next_seq
        self._next_seq += 1
        fd, offset = self._locate(slot)
        try:
            # One positioned write of header and payload: a torn one fails the CRC.
            _pwrite_all(fd, _encode_header(namespace, key, data, seq) + data, offset)
        except BaseException:
            heapq.heappush(self._free, slot)  # whatever landed is not committed: CRC or magic fails
            raise
        self._mutated(slot)
        previous = self._slot_of.get((namespace, key))
        self._slot_of[(namespace, key)] = slot
        self._record_of[slot] = (namespace, key)
        if previous is not None:
            self._release(previous)
        return slot

    def read(self, slot: int) -> tuple[bytes, int, bytes]:
        """(namespace, key, payload) of a live slot, its CRC32C checked. A damaged record
        raises DamagedRecord, is counted and is dropped (its slot freed); a free slot
        raises SlotNotInUse."""
        self._require_live(slot)
        fd, offset = self._locate(slot)
        raw = _pread_exact(fd, self.config.slot_bytes, offset)
        reason, header, payload = self._check_record(raw, self._record_of[slot])
        if reason is not None or header is None:
            self._damaged_reads += 1
            self._release(slot)
            raise DamagedRecord(slot, reason or "bad header")
        return header.namespace, header.key, payload

    def free(self, slot: int) -> None:
        """Frees a live slot: its magic is zeroed so no rebuild resurrects the record."""
        self._require_live(slot)
        self._release(slot)

    def slot_of(self, namespace: bytes, key: int) -> int | None:
        """The slot holding (namespace, key), or None."""
        _check_namespace(namespace)
        _require_int("key", key, 0, MAX_KEY)
        return self._slot_of.get((namespace, key))

    def entries(self) -> dict[tuple[bytes, int], int]:
        """A copy of the index: (namespace, key) -> slot."""
        return dict(self._slot_of)

    def stats(self) -> SsdTierStats:
        used = len(self._record_of)
        return SsdTierStats(
            slots=self.config.num_slots, used=used, free=self.config.num_slots - used,
            dropped_damaged=self._dropped_damaged, dropped_stale=self._dropped_stale,
            damaged_reads=self._damaged_reads, rebuild_seconds=self._rebuild_seconds,
        )

    def sync(self) -> None:
        """Makes every write and free so far durable (fdatasync of each file touched)."""
        self._require_open()
        for index in sorted(self._dirty):
            os.fdatasync(self._fds[index])
        self._dirty.clear()
        self._unsynced = 0

    def close(self) -> None:
        """Syncs and closes; a second close does nothing."""
        if self._fds:
            try:
                self.sync()
            finally:
                self._close_fds()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    # ---- slots and sync

    def _locate(self, slot: int) -> tuple[int, int]:
        """(file descriptor, byte offset) of a slot."""
        position, index = divmod(slot, self.config.files)
        return self._fds[index], FILE_HEADER_BYTES + position * self.config.slot_bytes

    def _require_open(self) -> None:
        if not self._fds:
            raise SsdTierError("the tier is closed")

    def _require_live(self, slot: object) -> None:
        _require_int("slot", slot, 0, self.config.num_slots - 1)
        self._require_open()
        if slot not in self._record_of:
            raise SlotNotInUse(f"slot {slot} holds no live record")

    def _release(self, slot: int) -> None:
        """Zeroes the slot's magic and returns it to the free list."""
        fd, offset = self._locate(slot)
        _pwrite_all(fd, _MAGIC_ZERO, offset)
        self._mutated(slot)
        record = self._record_of.pop(slot, None)
        if record is not None and self._slot_of.get(record) == slot:
            del self._slot_of[record]
        heapq.heappush(self._free, slot)

    def _mutated(self, slot: int) -> None:
        self._dirty.add(slot % self.config.files)
        self._unsynced += 1
        if self.config.sync is SyncPolicy.PER_WRITE or self._unsynced >= self.config.sync_every_writes:
            self.sync()

    def _damage(self, raw: bytes, expected: tuple[bytes, int] | None) -> str | None:
        """Why a slot's bytes are not a valid record (of `expected`, when given), or None."""
        return self._check_record(raw, expected)[0]

    def _check_record(self, raw: bytes, expected: tuple[bytes, int] | None
                      ) -> tuple[str | None, _Header | None, bytes]:
        """(why the bytes are not a valid record, or None; its header; its payload), the
        payload cut once: it is what a read returns."""
        header = _decode_header(raw)
        if header is None or header.magic != RECORD_MAGIC:
            return "bad header", None, b""
        if header.payload_length > self.config.max_payload:
            return f"payload length {header.payload_length} exceeds the slot", header, b""
        payload = raw[HEADER_BYTES : HEADER_BYTES + header.payload_length]
        if not _crc_matches(raw, payload, header.crc):
            return "CRC32C mismatch", header, b""
        if expected is not None and (header.namespace, header.key) != expected:
            return "holds another key than the index says", header, b""
        return None, header, payload

    # ---- opening

    def _lock(self) -> None:
        _make_private_directory(self.config.directory)
        self._lock_fd = _open_private(self.config.directory / "lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierLocked(f"{self.config.directory} is open in another process") from None

    def _path(self, index: int) -> Path:
        return self.config.directory / f"slots-{index:03d}.bkv"

    def _open_files(self) -> None:
        present = sorted(self.config.directory.glob("slots-*.bkv"))
        expected = [self._path(index) for index in range(self.config.files)]
        if not present:
            self._create_files()
        elif present != expected:
            raise LayoutMismatch(f"{self.config.directory} holds {[p.name for p in present]}, "
                                 f"expected {[p.name for p in expected]}")
        for index, path in enumerate(expected):
            self._fds.append(_open_private(path, os.O_RDWR))
            self._check_file(index, path)

    def _create_files(self) -> None:
        """Each file is preallocated and headed under a temporary name, then all are
        renamed: a crash mid-creation leaves no half-made file under a real name."""
        for index in range(self.config.files):
            temporary = self._path(index).with_suffix(".tmp")
            # A crash's leftover keeps its old mode under O_TRUNC: make a new file instead.
            temporary.unlink(missing_ok=True)
            fd = _open_private(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                _preallocate(fd, self.config.file_bytes(index))
                _pwrite_all(fd, _encode_file_header(self.config, index), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        for index in range(self.config.files):
            os.rename(self._path(index).with_suffix(".tmp"), self._path(index))
        directory_fd = os.open(self.config.directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)

    def _check_file(self, index: int, path: Path) -> None:
        fd = self._fds[index]
        if os.fstat(fd).st_size != self.config.file_bytes(index):
            raise LayoutMismatch(f"{path} is {os.fstat(fd).st_size} bytes, expected {self.config.file_bytes(index)}")
        raw = _pread_exact(fd, _FILE_BODY.size + _CRC.size, 0)
        (crc,) = _CRC.unpack_from(raw, _FILE_BODY.size)
        if google_crc32c.value(raw[: _FILE_BODY.size]) != crc:
            raise LayoutMismatch(f"{path}: damaged or foreign file header")
        found = _FILE_BODY.unpack_from(raw)
        wanted = _FILE_BODY.unpack_from(_encode_file_header(self.config, index))
        if found != wanted:
            names = ("magic", "version", "slot_bytes", "num_slots", "files", "file index")
            differences = {name: (f, w) for name, f, w in zip(names, found, wanted) if f != w}
            raise LayoutMismatch(f"{path} was made for another tier (found, expected): {differences}")

    def _rebuild(self) -> None:
        """Scans every slot: keeps the newest valid record per key, drops (counts and
        zeroes the magic of) damaged and stale ones."""
        started = time.perf_counter()
        best: dict[tuple[bytes, int], tuple[int, int]] = {}  # key -> (seq, slot)
        highest_seq = 0
        for slot in range(self.config.num_slots):
            fd, offset = self._locate(slot)
            head = _pread_exact(fd, HEADER_BYTES, offset)
            seq, record, damaged = self._scan_slot(slot, head)
            highest_seq = max(highest_seq, seq)
            if damaged:
                # The whole header is zeroed, not just the magic: a torn header's sequence
                # field may be garbage and must not feed the high-water mark next time.
                self._dropped_damaged += 1
                _pwrite_all(fd, bytes(HEADER_BYTES), offset)
                self._dirty.add(slot % self.config.files)
            elif record is not None:
                self._keep_newest(best, record, seq, slot)
        for slot in range(self.config.num_slots):
            if slot not in self._record_of:
                self._free.append(slot)  # ascending: already a valid heap
        self._next_seq = highest_seq + 1
        self.sync()
        self._rebuild_seconds = time.perf_counter() - started

    def _scan_slot(self, slot: int, head: bytes) -> tuple[int, tuple[bytes, int] | None, bool]:
        """(sequence seen, the record's key if valid, damaged?) for one slot. A freed
        slot's old sequence still counts for the high-water mark, so a record freed but
        resurrected by a lost zeroing (BATCHED, power loss) cannot outrank a later one."""
        if head[: len(RECORD_MAGIC)] == _MAGIC_ZERO:
            if not any(head):
                return 0, None, False  # never written
            header = _decode_header(head)
            return (header.seq, None, False) if header is not None else (0, None, True)
        header = _decode_header(head)
        if header is None or header.magic != RECORD_MAGIC or header.payload_length > self.config.max_payload:
            return 0, None, True
        fd, offset = self._locate(slot)
        raw = head + _pread_exact(fd, header.payload_length, offset + HEADER_BYTES)
        if self._damage(raw, None) is not None:
            return 0, None, True
        return header.seq, (header.namespace, header.key), False

    def _keep_newest(self, best: dict[tuple[bytes, int], tuple[int, int]], record: tuple[bytes, int],
                     seq: int, slot: int) -> None:
        """Indexes the record unless a newer one of its key is indexed; the loser is freed."""
        current = best.get(record)
        loser: int | None = None
        if current is not None and current[0] >= seq:
            loser = slot
        else:
            if current is not None:
                loser = current[1]
                del self._record_of[loser]
            best[record] = (seq, slot)
            self._slot_of[record] = slot
            self._record_of[slot] = record
        if loser is not None:
            self._dropped_stale += 1
            fd, offset = self._locate(loser)
            _pwrite_all(fd, _MAGIC_ZERO, offset)
            self._dirty.add(loser % self.config.files)

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
