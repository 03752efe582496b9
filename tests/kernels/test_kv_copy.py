"""Block copies between store slots and a plane-major pool, with CRC32C (kernels/kv_copy.py):
the C++ kernel and the numpy path land the same bytes and the checksums google_crc32c gives."""
import google_crc32c
import numpy as np
import pytest

from kernels.kv_copy import BlockCopier

# (planes, piece bytes): the `small` model's shape, pieces that are no multiple of 8, one plane.
GEOMETRIES = [(24, 8192), (6, 36), (1, 1000), (4, 8)]


@pytest.fixture(params=["native", "numpy"])
def native(request):
    if request.param == "native":
        request.getfixturevalue("native_kernels")
    return request.param == "native"


def scattered(geometry, count, seed):
    """Random slot rows, a pool three times the blocks, and scattered ids on both sides."""
    planes, piece = geometry
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (2 * count + 1, planes * piece), dtype=np.uint8)
    pool = rng.integers(0, 256, 3 * count * planes * piece, dtype=np.uint8)
    slots = rng.permutation(len(rows))[:count].tolist()
    blocks = rng.permutation(3 * count)[:count].tolist()
    return rows, pool, slots, blocks


def block_of(pool3, block):
    return pool3[:, block, :].reshape(-1)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("count", [1, 5, 9])  # under, at and past the kernel's four blocks side by side
def test_slots_land_in_their_blocks_with_their_checksums(native, geometry, count):
    rows, pool, slots, blocks = scattered(geometry, count, count)
    copier = BlockCopier(geometry[0], rows.shape[1], native)
    pool3 = copier.pool_view(pool)
    untouched = [b for b in range(pool3.shape[1]) if b not in blocks]
    before = {b: block_of(pool3, b).copy() for b in untouched}
    checksums = copier.slots_to_pool(rows, slots, pool3, blocks)
    assert checksums == [google_crc32c.value(rows[slot]) for slot in slots]
    for slot, block in zip(slots, blocks):
        assert np.array_equal(block_of(pool3, block), rows[slot])
    assert all(np.array_equal(block_of(pool3, b), before[b]) for b in untouched)
    assert copier.pool_checksums(pool3, blocks) == checksums


@pytest.mark.parametrize("layout", ["contiguous", "strided", "read-only"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_rows_go_into_their_slots_with_their_checksums(native, geometry, layout):
    rows, _, slots, _ = scattered(geometry, 6, 1)
    values = np.random.default_rng(2).integers(0, 256, (12, rows.shape[1]), dtype=np.uint8)
    values = values[::2] if layout == "strided" else values[:6]
    if layout == "read-only":
        values.setflags(write=False)
    copier = BlockCopier(geometry[0], rows.shape[1], native)
    others = [s for s in range(len(rows)) if s not in slots]
    before = rows[others].copy()
    assert copier.rows_to_slots(values, rows, slots) == [google_crc32c.value(value) for value in values]
    assert np.array_equal(rows[slots], values)
    assert np.array_equal(rows[others], before)


def test_the_kernel_refuses_ids_out_of_range_by_name(native_kernels):
    rows, pool, slots, blocks = scattered((4, 8), 3, 0)
    copier = BlockCopier(4, 32, True)
    pool3 = copier.pool_view(pool)
    with pytest.raises(RuntimeError, match="slots holds 7"):
        copier.slots_to_pool(rows, [0, 7, 1], pool3, blocks)
    with pytest.raises(RuntimeError, match="blocks holds -1"):
        copier.pool_checksums(pool3, [0, -1])
    with pytest.raises(RuntimeError, match="3 slots but 2 blocks"):
        copier.slots_to_pool(rows, slots, pool3, blocks[:2])


def test_a_pool_that_is_not_whole_blocks_is_refused():
    copier = BlockCopier(4, 32, False)
    with pytest.raises(ValueError, match="multiple of 32 bytes"):
        copier.pool_view(np.zeros(40, dtype=np.uint8))
    with pytest.raises(ValueError, match="does not split into 5 planes"):
        BlockCopier(5, 32, False)
