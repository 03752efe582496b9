"""The SSD tier on real files: round trips, rebuild on reopen, damaged and half-written
records dropped and counted, a writer killed with SIGKILL mid-run, freed slots staying
free, the newest of two records of a key winning, preallocation and argument checks, and
files private to their user."""
from __future__ import annotations

import inspect
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.kvstore.ssd import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    DamagedRecord,
    LayoutMismatch,
    SlotNotInUse,
    SsdTier,
    SsdTierConfig,
    SyncPolicy,
    TierExposed,
    TierFull,
    TierLocked,
)
from services.local_cluster import REPO, child_env

NS = b"model-a\0"
NS16 = bytes(range(16))


def _config(directory: Path, **overrides) -> SsdTierConfig:
    settings = {"slot_bytes": 4096, "num_slots": 16, "files": 1} | overrides
    return SsdTierConfig(directory, **settings)


def _payload(key: int, generation: int, max_bytes: int) -> bytes:
    """Deterministic in any process: random.Random with an int seed is."""
    rng = random.Random(key * 1_000_003 + generation)
    return rng.randbytes(rng.randint(1, max_bytes))


def _slot_offset(config: SsdTierConfig, slot: int) -> tuple[Path, int]:
    position, index = divmod(slot, config.files)
    return config.directory / f"slots-{index:03d}.bkv", FILE_HEADER_BYTES + position * config.slot_bytes


def _flip_byte(config: SsdTierConfig, slot: int, at: int) -> None:
    path, offset = _slot_offset(config, slot)
    with open(path, "r+b") as file:
        file.seek(offset + at)
        byte = file.read(1)
        file.seek(offset + at)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_write_read_round_trip_and_stats(tmp_path):
    config = _config(tmp_path, files=3, num_slots=10)
    with SsdTier(config) as tier:
        slots = {}
        for key in range(6):
            slots[key] = tier.write(NS, key, _payload(key, 0, config.max_payload))
        slots[2**64 - 1] = tier.write(NS16, 2**64 - 1, b"")
        slots[7] = tier.write(NS, 7, bytearray(config.max_payload))  # a full slot
        assert len(set(slots.values())) == len(slots)
        for key, slot in slots.items():
            namespace, read_key, payload = tier.read(slot)
            assert read_key == key and tier.slot_of(namespace, key) == slot
        assert tier.read(slots[3])[2] == _payload(3, 0, config.max_payload)
        assert tier.read(slots[2**64 - 1]) == (NS16, 2**64 - 1, b"")
        stats = tier.stats()
        assert (stats.slots, stats.used, stats.free) == (10, 8, 2)
        assert (stats.dropped_damaged, stats.dropped_stale, stats.damaged_reads) == (0, 0, 0)


def test_namespaces_keep_equal_keys_apart(tmp_path):
    with SsdTier(_config(tmp_path)) as tier:
        a, b = tier.write(NS, 5, b"a"), tier.write(NS16, 5, b"b")
        assert a != b
        assert tier.read(a) == (NS, 5, b"a") and tier.read(b) == (NS16, 5, b"b")


@pytest.mark.parametrize("sync", list(SyncPolicy))
def test_reopen_rebuilds_every_record(tmp_path, sync):
    config = _config(tmp_path, files=2, num_slots=33, sync=sync, sync_every_writes=4)
    with SsdTier(config) as tier:
        slots = {key: tier.write(NS, key, _payload(key, 0, config.max_payload)) for key in range(20)}
    with SsdTier(config) as tier:
        assert tier.entries() == {(NS, key): slot for key, slot in slots.items()}
        for key, slot in slots.items():
            assert tier.read(slot) == (NS, key, _payload(key, 0, config.max_payload))
        stats = tier.stats()
        assert (stats.used, stats.free, stats.dropped_damaged, stats.dropped_stale) == (20, 13, 0, 0)
        assert stats.rebuild_seconds > 0
        # the sequence goes on past every record on disk: a rewrite wins the next rebuild
        tier.write(NS, 3, b"newer")
    with SsdTier(config) as tier:
        assert tier.read(tier.slot_of(NS, 3)) == (NS, 3, b"newer")


def test_a_corrupted_payload_is_dropped_and_counted_on_rebuild(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        slots = [tier.write(NS, key, b"x" * 100) for key in range(4)]
    _flip_byte(config, slots[1], HEADER_BYTES + 50)
    _flip_byte(config, slots[2], 20)  # inside the header: the key
    with SsdTier(config) as tier:
        assert tier.entries() == {(NS, 0): slots[0], (NS, 3): slots[3]}
        stats = tier.stats()
        assert (stats.used, stats.dropped_damaged) == (2, 2)
        with pytest.raises(SlotNotInUse):
            tier.read(slots[1])
    with SsdTier(config) as tier:  # dropped once: the next rebuild finds nothing to drop
        assert tier.stats().dropped_damaged == 0 and tier.stats().used == 2


def test_a_damaged_record_read_directly_raises_and_is_counted(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        slot = tier.write(NS, 9, b"payload" * 10)
        other = tier.write(NS, 10, b"fine")
        _flip_byte(config, slot, HEADER_BYTES + 3)
        with pytest.raises(DamagedRecord, match="CRC32C") as raised:
            tier.read(slot)
        assert raised.value.slot == slot
        assert tier.stats().damaged_reads == 1
        assert tier.slot_of(NS, 9) is None  # dropped: never served again
        with pytest.raises(SlotNotInUse):
            tier.read(slot)
        assert tier.read(other) == (NS, 10, b"fine")


def test_a_half_written_record_is_never_served(tmp_path):
    """A crash inside the single write: the header landed, the payload's tail did not."""
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        tier.write(NS, 1, b"a" * 1000)
        freed = tier.write(NS, 2, b"b" * 1000)
        tier.free(freed)
    path, offset = _slot_offset(config, freed)
    with SsdTier(config) as tier:
        tier.write(NS, 3, b"c" * 1000)  # reuses the freed slot over the old bytes
    with open(path, "r+b") as file:  # put back half of the old payload: a torn write
        file.seek(offset + HEADER_BYTES + 500)
        file.write(b"b" * 500)
    with SsdTier(config) as tier:
        assert tier.slot_of(NS, 3) is None and tier.stats().dropped_damaged == 1
        assert tier.read(tier.slot_of(NS, 1)) == (NS, 1, b"a" * 1000)


WRITER = """
import random
from pathlib import Path
from services.kvstore.ssd import SsdTier, SsdTierConfig
NS = {namespace!r}
{payload_source}
config = SsdTierConfig(Path({directory!r}), slot_bytes={slot_bytes}, num_slots={num_slots}, files=2)
tier = SsdTier(config)
generation = 0
while True:
    for key in range({keys}):
        slot = tier.write(NS, key, _payload(key, generation, config.max_payload))
        print(slot, key, generation, flush=True)
    generation += 1
"""


def test_kill_9_mid_writes_keeps_every_committed_record(tmp_path):
    """A child rewrites 24 keys round after round and reports each write once it returned;
    SIGKILL lands mid-run. Reopened, every key holds its last reported generation intact
    (or the next one, if that write was in flight and completed), and nothing else is served."""
    keys, committed = 24, 150
    config = SsdTierConfig(tmp_path / "tier", slot_bytes=256 * 1024, num_slots=32, files=2)
    script = WRITER.format(namespace=NS, payload_source=inspect.getsource(_payload), directory=str(config.directory),
                           slot_bytes=config.slot_bytes, num_slots=config.num_slots, keys=keys)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env=child_env())
    reported: dict[int, tuple[int, int]] = {}  # key -> (slot, generation)
    try:
        assert child.stdout is not None
        for _ in range(committed):
            line = child.stdout.readline()
            assert line, f"the writer died: {child.wait()}"
            slot, key, generation = map(int, line.split())
            reported[key] = (slot, generation)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        for line in child.stdout:  # writes reported before the kill landed
            if line.endswith("\n"):  # a report cut by the kill is no report
                slot, key, generation = map(int, line.split())
                reported[key] = (slot, generation)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    with SsdTier(config) as tier:
        served = tier.entries()
        assert set(served) == {(NS, key) for key in range(keys)}
        in_flight = 0
        for key, (slot, generation) in reported.items():
            namespace, read_key, payload = tier.read(served[(NS, key)])
            assert (namespace, read_key) == (NS, key)
            if served[(NS, key)] == slot:
                assert payload == _payload(key, generation, config.max_payload)
            else:  # the one write that completed after its predecessor was reported
                in_flight += 1
                assert payload == _payload(key, generation + 1, config.max_payload)
        assert in_flight <= 1
        assert tier.stats().dropped_stale <= 1


def test_freed_slots_are_not_resurrected(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        slots = [tier.write(NS, key, b"v%d" % key) for key in range(3)]
        tier.free(slots[1])
        with pytest.raises(SlotNotInUse):
            tier.free(slots[1])
    with SsdTier(config) as tier:
        assert tier.entries() == {(NS, 0): slots[0], (NS, 2): slots[2]}
        assert tier.stats().used == 2 and tier.stats().dropped_damaged == 0
        assert tier.write(NS, 5, b"reuse") == slots[1]  # the lowest free slot is reused first


def test_rewriting_a_key_frees_the_old_record(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        first = tier.write(NS, 1, b"old")
        second = tier.write(NS, 1, b"new")
        assert first != second and tier.stats().used == 1
        assert tier.read(second) == (NS, 1, b"new")
    with SsdTier(config) as tier:
        assert tier.entries() == {(NS, 1): second} and tier.stats().dropped_stale == 0


@pytest.mark.parametrize("newer_first", [True, False])
def test_newest_sequence_wins_when_a_crash_left_both_records(tmp_path, newer_first):
    """A crash between committing a rewrite and freeing the old record: both are on disk
    (simulated by putting the old record's magic back); the rebuild keeps the newer."""
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        if newer_first:  # make the newer record land in a lower slot than the older one
            placeholder = tier.write(NS, 99, b"placeholder")
            old = tier.write(NS, 1, b"old")
            tier.free(placeholder)
        else:
            old = tier.write(NS, 1, b"old")
        new = tier.write(NS, 1, b"new")
        assert (new < old) == newer_first
    path, offset = _slot_offset(config, old)
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(b"BKV1")
    with SsdTier(config) as tier:
        assert tier.entries() == {(NS, 1): new}
        assert tier.read(new) == (NS, 1, b"new")
        assert tier.stats().dropped_stale == 1 and tier.stats().used == 1
    with SsdTier(config) as tier:  # the stale one was freed for good
        assert tier.stats().dropped_stale == 0 and tier.stats().used == 1


def test_files_are_preallocated_to_their_full_size(tmp_path):
    config = _config(tmp_path, slot_bytes=8192, num_slots=10, files=3)
    SsdTier(config).close()
    sizes = {path.name: path.stat() for path in tmp_path.glob("slots-*.bkv")}
    assert sorted(sizes) == ["slots-000.bkv", "slots-001.bkv", "slots-002.bkv"]
    for index, slots in enumerate([4, 3, 3]):  # slot s lives in file s % 3
        stat = sizes[f"slots-{index:03d}.bkv"]
        assert stat.st_size == FILE_HEADER_BYTES + slots * 8192
        assert stat.st_blocks * 512 >= stat.st_size  # blocks reserved, not a sparse file
    assert not list(tmp_path.glob("*.tmp"))


def test_a_full_tier_refuses_writes(tmp_path):
    with SsdTier(_config(tmp_path, num_slots=2)) as tier:
        tier.write(NS, 1, b"a")
        tier.write(NS, 2, b"b")
        with pytest.raises(TierFull):
            tier.write(NS, 3, b"c")
        tier.free(tier.slot_of(NS, 1))
        tier.write(NS, 3, b"c")


def test_a_tier_opens_in_one_process_at_a_time(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config):
        with pytest.raises(TierLocked):
            SsdTier(config)
    SsdTier(config).close()  # closing released the lock


@pytest.mark.parametrize("change", [{"slot_bytes": 8192}, {"num_slots": 17}, {"files": 2}])
def test_reopening_with_another_shape_is_refused(tmp_path, change):
    SsdTier(_config(tmp_path)).close()
    with pytest.raises(LayoutMismatch):
        SsdTier(_config(tmp_path, **change))
    SsdTier(_config(tmp_path)).close()  # the refused open changed nothing


def test_a_damaged_file_header_is_refused(tmp_path):
    config = _config(tmp_path)
    SsdTier(config).close()
    with open(tmp_path / "slots-000.bkv", "r+b") as file:
        file.seek(10)
        file.write(b"\xff")
    with pytest.raises(LayoutMismatch, match="file header"):
        SsdTier(config)


@pytest.mark.parametrize("settings, error, match", [
    ({"slot_bytes": HEADER_BYTES}, ValueError, "slot_bytes"),
    ({"slot_bytes": 4096.0}, TypeError, "slot_bytes"),
    ({"num_slots": 0}, ValueError, "num_slots"),
    ({"files": 0}, ValueError, "files"),
    ({"files": 17}, ValueError, "files"),
    ({"files": True}, TypeError, "files"),
    ({"sync": "per_write"}, TypeError, "SyncPolicy"),
    ({"sync_every_writes": 0}, ValueError, "sync_every_writes"),
])
def test_bad_config_is_refused(tmp_path, settings, error, match):
    with pytest.raises(error, match=match):
        _config(tmp_path, **settings)


def test_a_directory_given_as_str_is_refused():
    with pytest.raises(TypeError, match="pathlib.Path"):
        SsdTierConfig("/tmp/tier", slot_bytes=4096, num_slots=1)  # type: ignore[arg-type]


def test_bad_calls_are_refused(tmp_path):
    config = _config(tmp_path)
    with SsdTier(config) as tier:
        slot = tier.write(NS, 1, b"x")
        with pytest.raises(ValueError, match="8 or 16 bytes"):
            tier.write(b"short", 1, b"x")
        with pytest.raises(TypeError, match="namespace"):
            tier.write("model-a!", 1, b"x")
        with pytest.raises(ValueError, match="key"):
            tier.write(NS, -1, b"x")
        with pytest.raises(ValueError, match="key"):
            tier.write(NS, 2**64, b"x")
        with pytest.raises(TypeError, match="key"):
            tier.write(NS, True, b"x")
        with pytest.raises(TypeError, match="payload"):
            tier.write(NS, 1, "text")
        with pytest.raises(ValueError, match="at most"):
            tier.write(NS, 1, bytes(config.max_payload + 1))
        for call in (tier.read, tier.free):
            with pytest.raises(ValueError, match="slot"):
                call(config.num_slots)
            with pytest.raises(TypeError, match="slot"):
                call("0")
            with pytest.raises(SlotNotInUse):
                call(slot + 1)
        assert tier.stats().used == 1  # no refused call changed anything
    with pytest.raises(Exception, match="closed"):
        tier.write(NS, 2, b"x")
    with pytest.raises(TypeError, match="SsdTierConfig"):
        SsdTier(tmp_path)


# ---- the files are their user's alone ------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_fresh_tier_is_private_even_under_a_permissive_umask(tmp_path):
    directory = tmp_path / "parent" / "ssd"
    previous = os.umask(0)  # the modes must come from creation, not from the umask
    try:
        SsdTier(_config(directory, files=3)).close()
    finally:
        os.umask(previous)
    assert _mode(directory) == 0o700
    names = sorted(path.name for path in directory.iterdir())
    assert names == ["lock", "slots-000.bkv", "slots-001.bkv", "slots-002.bkv"]  # no temporary left
    assert {name: _mode(directory / name) for name in names} == {name: 0o600 for name in names}


def test_a_crashs_leftover_temporary_is_not_reused_with_its_mode(tmp_path):
    directory = tmp_path / "ssd"
    os.mkdir(directory, 0o700)
    leftover = directory / "slots-000.tmp"
    leftover.write_bytes(b"half made")
    leftover.chmod(0o644)
    SsdTier(_config(directory)).close()
    assert _mode(directory / "slots-000.bkv") == 0o600 and not leftover.exists()


@pytest.mark.parametrize("name,mode,exposure", [("slots-000.bkv", 0o644, "readable by other users"),
                                                ("slots-001.bkv", 0o604, "readable by other users"),
                                                ("lock", 0o620, "open to other users")])
def test_a_file_open_to_other_users_is_refused_naming_it(tmp_path, name, mode, exposure):
    config = _config(tmp_path / "ssd", files=2)
    with SsdTier(config) as tier:
        tier.write(NS, 1, b"prompt")
    (config.directory / name).chmod(mode)
    with pytest.raises(TierExposed) as refusal:
        SsdTier(config)
    assert str(refusal.value) == (f"ssd tier: {config.directory / name} is mode {mode:04o}, {exposure}; "
                                  f"chmod 600 it, or remove it")
    (config.directory / name).chmod(0o600)
    with SsdTier(config) as tier:  # once fixed, the records are all there
        assert [tier.read(slot)[2] for slot in tier.entries().values()] == [b"prompt"]


def test_a_directory_an_earlier_baton_made_0755_is_refused_naming_it(tmp_path):
    directory = tmp_path / "ssd"
    directory.mkdir()
    directory.chmod(0o755)
    with pytest.raises(TierExposed) as refusal:
        SsdTier(_config(directory))
    assert str(refusal.value) == (f"ssd tier: {directory} is mode 0755, readable by other users; "
                                  f"chmod 700 it and 600 the files in it, or remove it")
    assert list(directory.iterdir()) == []  # refused before anything was made in it


def test_a_symbolic_link_in_place_of_a_file_is_refused(tmp_path):
    config = _config(tmp_path / "ssd")
    SsdTier(config).close()
    real = tmp_path / "elsewhere.bkv"
    (config.directory / "slots-000.bkv").rename(real)
    (config.directory / "slots-000.bkv").symlink_to(real)
    with pytest.raises(OSError):
        SsdTier(config)


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user")


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")


@ROOT_ONLY
def test_a_file_another_user_owns_is_refused_naming_it(tmp_path):
    nobody = _nobody()
    config = _config(tmp_path / "ssd")
    SsdTier(config).close()
    os.chown(config.directory / "slots-000.bkv", nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(TierExposed, match=f"slots-000.bkv is owned by uid {nobody.pw_uid}, not by this process"):
        SsdTier(config)


# Run as root, then become the other user for good, then try to read each path.
_READ_AS = """
import os, sys
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
for path in sys.argv[3:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as file:
                file.read(1)
        print("read", path)
    except PermissionError:
        print("denied", path)
"""


@ROOT_ONLY
def test_another_user_cannot_read_the_tier():
    nobody = _nobody()
    # Under a parent every user may pass through (pytest's own is root's alone, which would
    # hide what the tier's modes do), beside a file anyone may read that shows they can.
    parent = Path(tempfile.mkdtemp(prefix="baton-ssd-privacy-"))
    try:
        parent.chmod(0o755)
        control = parent / "anyone-may-read"
        control.write_bytes(b"x")
        control.chmod(0o644)
        config = _config(parent / "ssd", files=2)
        with SsdTier(config) as tier:
            tier.write(NS, 1, b"prompt tokens")
        paths = [control, config.directory, *sorted(config.directory.iterdir())]
        result = subprocess.run([sys.executable, "-c", _READ_AS, str(nobody.pw_uid), str(nobody.pw_gid),
                                 *map(str, paths)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [f"read {control}"] + [f"denied {path}" for path in paths[1:]]
    finally:
        shutil.rmtree(parent)
