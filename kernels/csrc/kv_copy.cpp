// Block copies between the KV store's slots (one block's K and V for every layer, plane-major,
// contiguous) and an engine's plane-major pool ([planes, blocks, piece]: a block's planes lie
// one pool plane apart), each block's CRC32C taken over the bytes as they are copied
// (docs/kvstore.md §4). numpy needs two passes for this (copy into private memory, then a
// checksum over it, then the strided copy); here it is one, so a fetch runs near memcpy speed.
// Blocks go four side by side where SSE4.2 is there: each CRC32C instruction waits on the one
// before it in the same chain, and four independent chains keep the unit busy.
//
// The checksum is of the words the copy loaded and stored, never of a second read of either
// side: a slot rewritten while it is copied (an expired lease) shows as a mismatch, as the
// bytes that landed are the bytes checked. CRC32C here is Castagnoli's, with google_crc32c's
// conventions (initial value and final xor all ones), so the store's checksums compare as is.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace baton_kv_copy {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

#if !defined(__SSE4_2__)
// Without the instruction: one table lookup per byte (reflected polynomial 0x82F63B78).
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> entries{};
    for (uint32_t byte = 0; byte < 256; ++byte) {
      uint32_t crc = byte;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
      entries[byte] = crc;
    }
    return entries;
  }();
  return table;
}
#endif

// Copy n bytes src -> dst (dst may be null: checksum only), extending the running CRC
// (pre-inverted) over them.
uint32_t copy_extend(uint32_t crc, const uint8_t* src, uint8_t* dst, int64_t n) {
#if defined(__SSE4_2__)
  uint64_t state = crc;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t words[4];
    std::memcpy(words, src + i, 32);
    if (dst != nullptr) std::memcpy(dst + i, words, 32);
    state = _mm_crc32_u64(state, words[0]);
    state = _mm_crc32_u64(state, words[1]);
    state = _mm_crc32_u64(state, words[2]);
    state = _mm_crc32_u64(state, words[3]);
  }
  uint32_t tail = static_cast<uint32_t>(state);
  for (; i < n; ++i) {
    const uint8_t byte = src[i];
    if (dst != nullptr) dst[i] = byte;
    tail = _mm_crc32_u8(tail, byte);
  }
  return tail;
#else
  const auto& table = crc_table();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = src[i];
    if (dst != nullptr) dst[i] = byte;
    crc = table[(crc ^ byte) & 0xFFu] ^ (crc >> 8);
  }
  return crc;
#endif
}

void check_uint8(const at::Tensor& tensor, const char* name, int64_t dims) {
  TORCH_CHECK(tensor.scalar_type() == at::kByte, name, " must be uint8, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.dim() == dims, name, " must have ", dims, " dimensions, got ", tensor.dim());
  TORCH_CHECK(tensor.is_contiguous(), name, " must be contiguous");
}

// The ids as int64 values, each checked against its bound.
std::vector<int64_t> checked_ids(const at::Tensor& ids, int64_t bound, const char* name) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, name, " must be a 1-d int64 tensor");
  const at::Tensor flat = ids.contiguous();
  const int64_t* data = flat.data_ptr<int64_t>();
  std::vector<int64_t> values(data, data + flat.numel());
  for (int64_t value : values) TORCH_CHECK(0 <= value && value < bound, name, " holds ", value, ", not in [0, ", bound, ")");
  return values;
}

struct Geometry {
  int64_t planes, pool_blocks, piece;
};

Geometry pool_geometry(const at::Tensor& pool, const at::Tensor& rows) {
  check_uint8(pool, "pool", 3);
  const Geometry geometry{pool.size(0), pool.size(1), pool.size(2)};
  if (rows.defined()) {
    check_uint8(rows, "rows", 2);
    TORCH_CHECK(rows.size(1) == geometry.planes * geometry.piece, "rows of ", rows.size(1),
                " bytes do not hold one block of the pool (", geometry.planes, " planes of ", geometry.piece, " bytes)");
  }
  return geometry;
}

at::Tensor checksums_for(int64_t count) { return at::empty({count}, at::TensorOptions().dtype(at::kLong)); }

// Direction of a copy between slots and pool blocks.
enum class Way { kIntoPool, kIntoSlots };

#if defined(__SSE4_2__)
constexpr int64_t kLockstep = 4;  // blocks copied side by side: four CRC chains hide the instruction's latency

// Blocks first..first+kLockstep, word by word in lockstep; pieces a multiple of 8 bytes.
void copy_lockstep(const std::vector<uint8_t*>& rows, const std::vector<uint8_t*>& pieces, int64_t first,
                   const Geometry& g, Way way, int64_t* out) {
  uint64_t crc[kLockstep];
  for (int64_t k = 0; k < kLockstep; ++k) crc[k] = 0xFFFFFFFFu;
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const uint8_t* src[kLockstep];
    uint8_t* dst[kLockstep];
    for (int64_t k = 0; k < kLockstep; ++k) {
      uint8_t* row = rows[first + k] + plane * g.piece;
      uint8_t* piece = pieces[first + k] + plane * g.pool_blocks * g.piece;
      src[k] = way == Way::kIntoPool ? row : piece;
      dst[k] = way == Way::kIntoPool ? piece : row;
    }
    for (int64_t offset = 0; offset < g.piece; offset += 8) {
      for (int64_t k = 0; k < kLockstep; ++k) {
        uint64_t word;
        std::memcpy(&word, src[k] + offset, 8);
        std::memcpy(dst[k] + offset, &word, 8);
        crc[k] = _mm_crc32_u64(crc[k], word);
      }
    }
  }
  for (int64_t k = 0; k < kLockstep; ++k) out[first + k] = static_cast<int64_t>(static_cast<uint32_t>(crc[k]) ^ 0xFFFFFFFFu);
}
#endif

at::Tensor copy_blocks(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& pool,
                       const at::Tensor& blocks, Way way) {
  const Geometry g = pool_geometry(pool, rows);
  const auto slot_ids = checked_ids(slots, rows.size(0), "slots");
  const auto block_ids = checked_ids(blocks, g.pool_blocks, "blocks");
  TORCH_CHECK(slot_ids.size() == block_ids.size(), slot_ids.size(), " slots but ", block_ids.size(), " blocks");
  const int64_t count = static_cast<int64_t>(slot_ids.size());
  at::Tensor checksums = checksums_for(count);
  int64_t* out = checksums.data_ptr<int64_t>();
  const int64_t block_bytes = g.planes * g.piece;
  std::vector<uint8_t*> row_of(count), piece_of(count);  // each block's row, and its first plane's piece
  for (int64_t i = 0; i < count; ++i) {
    row_of[i] = rows.data_ptr<uint8_t>() + slot_ids[i] * block_bytes;
    piece_of[i] = pool.data_ptr<uint8_t>() + block_ids[i] * g.piece;
  }
  int64_t i = 0;
#if defined(__SSE4_2__)
  if (g.piece % 8 == 0)
    for (; i + kLockstep <= count; i += kLockstep) copy_lockstep(row_of, piece_of, i, g, way, out);
#endif
  for (; i < count; ++i) {
    uint32_t crc = 0xFFFFFFFFu;
    for (int64_t plane = 0; plane < g.planes; ++plane) {
      uint8_t* piece = piece_of[i] + plane * g.pool_blocks * g.piece;
      uint8_t* in_row = row_of[i] + plane * g.piece;
      crc = way == Way::kIntoPool ? copy_extend(crc, in_row, piece, g.piece) : copy_extend(crc, piece, in_row, g.piece);
    }
    out[i] = static_cast<int64_t>(crc ^ 0xFFFFFFFFu);
  }
  return checksums;
}

// kv_slots_to_pool: rows[slots[i]] -> pool[:, blocks[i], :]; the CRC32C of each block copied.
at::Tensor kv_slots_to_pool(at::Tensor rows, at::Tensor slots, at::Tensor pool, at::Tensor blocks) {
  return copy_blocks(rows, slots, pool, blocks, Way::kIntoPool);
}

// kv_pool_to_slots: pool[:, blocks[i], :] -> rows[slots[i]]; the CRC32C of each block copied.
at::Tensor kv_pool_to_slots(at::Tensor pool, at::Tensor blocks, at::Tensor rows, at::Tensor slots) {
  return copy_blocks(rows, slots, pool, blocks, Way::kIntoSlots);
}

// kv_pool_checksums: the CRC32C of each pool block, its planes in order, nothing copied.
at::Tensor kv_pool_checksums(at::Tensor pool, at::Tensor blocks) {
  const Geometry g = pool_geometry(pool, at::Tensor());
  const auto block_ids = checked_ids(blocks, g.pool_blocks, "blocks");
  at::Tensor checksums = checksums_for(static_cast<int64_t>(block_ids.size()));
  int64_t* out = checksums.data_ptr<int64_t>();
  const uint8_t* pool_base = pool.data_ptr<uint8_t>();
  for (size_t i = 0; i < block_ids.size(); ++i) {
    uint32_t crc = 0xFFFFFFFFu;
    for (int64_t plane = 0; plane < g.planes; ++plane)
      crc = copy_extend(crc, pool_base + (plane * g.pool_blocks + block_ids[i]) * g.piece, nullptr, g.piece);
    out[i] = static_cast<int64_t>(crc ^ 0xFFFFFFFFu);
  }
  return checksums;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("kv_slots_to_pool(Tensor rows, Tensor slots, Tensor(a!) pool, Tensor blocks) -> Tensor");
  m.def("kv_pool_to_slots(Tensor pool, Tensor blocks, Tensor(a!) rows, Tensor slots) -> Tensor");
  m.def("kv_pool_checksums(Tensor pool, Tensor blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("kv_slots_to_pool", &kv_slots_to_pool);
  m.impl("kv_pool_to_slots", &kv_pool_to_slots);
  m.impl("kv_pool_checksums", &kv_pool_checksums);
}

}  // namespace baton_kv_copy
