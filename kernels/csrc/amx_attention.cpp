// Paged attention for prefill chunks over cached context, in bf16 on AMX tiles.
//
// A prefix-cache hit runs its new tokens (a chunk) against thousands of cached keys. With
// torch's SDPA that takes a gather of the context out of the paged pool, then SDPA's
// vector kernels (~0.25 ms a layer for 32 tokens over 2,080 keys on this machine). This
// kernel reads the pool in place, lays each (sequence, KV head)'s keys and values out once
// in the tiles' pair-interleaved format, and runs both products on the tiles; only the
// softmax runs on vector lanes.
//
// Rows (a sequence's tokens x the query heads sharing one KV head) go 32 at a time, keys in
// chunks of 256 with an online softmax: per chunk, scores (fp32) and weights (rounded to
// bf16, as SDPA's reduced-precision path rounds them before its second product) stay in
// L1, and the rows' fp32 value sums are rescaled when a row's running max moves. At the
// end each row is divided by its fp32 weight total and rounded once to bf16.
//
// In-engine on this 2-core VM (tiny model, bf16), a 32-token hit over a 2,048-token
// prefix took 4.4 ms with this kernel against 5.2 ms with gather + SDPA.
//
// Contract: paged_attention's (kernels/csrc/paged_attention.cpp) for bf16 and head dims
// that are multiples of 32 up to 256, any block size.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "lanes.h"
#include "paged_inputs.h"

namespace baton_amx_attention {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

constexpr int64_t kMaxHeadDim = 256;

#if BATON_AMX

using namespace baton;

constexpr int64_t kKeyTile = 16;   // keys in a score tile's columns
constexpr int64_t kKeyPairTile = 32;  // keys along a weight tile's row (the value product's K)
constexpr int64_t kDimBlock = 16;  // head dims in a result tile's columns
// Keys per online-softmax step: a 32-row block's scores (32 KB) and weights stay in L1.
constexpr int64_t kChunkKeys = 256;

struct Problem {
  const uint16_t* query;
  int64_t query_stride;
  const uint16_t* key_cache;
  const uint16_t* value_cache;
  int64_t cache_stride;  // kv_heads * dim
  const int64_t* block_table;
  int64_t table_width;
  const int64_t* query_starts;
  const int64_t* query_lens;
  const int64_t* context_lens;
  int64_t heads, kv_heads, dim, block_size;
  float scale;
  uint16_t* out;
};

// One thread's buffers for one (sequence, KV head), sized by its context.
struct Scratch {
  std::vector<uint16_t> keys;     // [key tiles][dim / 32][16 dim pairs][16 keys][2]
  std::vector<uint16_t> values;   // [key pair tiles][dim / 16][16 key pairs][16 dims][2]
  std::vector<float> scores;      // [32 rows][kChunkKeys]
  std::vector<uint16_t> weights;  // [32 rows][kChunkKeys] bf16
  std::vector<uint16_t> query;    // [32 rows][dim] bf16
  std::vector<float> acc;         // [32 rows][dim]: weighted value sums at the running max
  std::vector<float> running_max, total;  // [32 rows]
  std::vector<float> result;      // [16 rows][16 dims]

  Scratch(int64_t dim)
      : scores(2 * kTileRows * kChunkKeys), weights(2 * kTileRows * kChunkKeys), query(2 * kTileRows * dim),
        acc(2 * kTileRows * dim), running_max(2 * kTileRows), total(2 * kTileRows), result(kTileRows * kDimBlock) {}

  void size_for(int64_t padded_keys, int64_t dim) {
    keys.resize(padded_keys * dim);  // lay_out_context writes all of them
    values.resize(padded_keys * dim);
  }
};

inline const uint16_t* slot_row(const Problem& p, const uint16_t* cache, const int64_t* table, int64_t position,
                                int64_t kv_head) {
  const int64_t slot = table[position / p.block_size] * p.block_size + position % p.block_size;
  return cache + slot * p.cache_stride + kv_head * p.dim;
}

// Transposes a 16 x 16 matrix of 32-bit words held as 16 rows.
inline void transpose_16x16(__m512i rows[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    rows[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    rows[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    rows[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    rows[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Now each 128-bit lane L of rows[j] holds row-group L's column group j. Swap lanes.
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      const __m512i a = rows[i + 8 * j], b = rows[i + 4 + 8 * j];
      t[i + 8 * j] = _mm512_shuffle_i32x4(a, b, 0x88);      // lanes 0, 2 of a, then of b
      t[i + 4 + 8 * j] = _mm512_shuffle_i32x4(a, b, 0xDD);  // lanes 1, 3
    }
  }
  for (int i = 0; i < 8; ++i) {
    const __m512i a = t[i], b = t[i + 8];
    rows[i] = _mm512_shuffle_i32x4(a, b, 0x88);
    rows[i + 8] = _mm512_shuffle_i32x4(a, b, 0xDD);
  }
}

// Keys and values of positions [0, context) in the tiles' pair-interleaved layouts, with
// zeros past the context up to the next multiple of 32.
void lay_out_context(const Problem& p, int64_t seq, int64_t kv_head, int64_t context, Scratch& s) {
  const int64_t* table = p.block_table + seq * p.table_width;
  const int64_t dim_tiles = p.dim / kTileBf16, dim_blocks = p.dim / kDimBlock;
  const int64_t padded = (context + kKeyPairTile - 1) / kKeyPairTile * kKeyPairTile;
  // Keys: tile (t, d) holds, in row i, dim pair i of dim tile d for keys 16t..16t+15: the
  // transpose of those keys' 16-word slices.
  for (int64_t first = 0; first < padded; first += kKeyTile) {
    const uint16_t* key_rows[kKeyTile];
    for (int64_t i = 0; i < kKeyTile; ++i) {
      key_rows[i] = first + i < context ? slot_row(p, p.key_cache, table, first + i, kv_head) : nullptr;
    }
    for (int64_t d = 0; d < dim_tiles; ++d) {
      __m512i rows[kKeyTile];
      for (int64_t i = 0; i < kKeyTile; ++i) {
        rows[i] = key_rows[i] != nullptr ? _mm512_loadu_si512(key_rows[i] + d * kTileBf16) : _mm512_setzero_si512();
      }
      transpose_16x16(rows);
      uint16_t* tile = s.keys.data() + ((first / kKeyTile) * dim_tiles + d) * kTileValues;
      for (int64_t i = 0; i < kTileRows; ++i) _mm512_storeu_si512(tile + i * kTileBf16, rows[i]);
    }
  }
  // Values: tile (t, b) holds, in row i, keys 32t+2i and 32t+2i+1 interleaved over dims
  // 16b..16b+15.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                               23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = 0; k < padded; k += 2) {
    const uint16_t* even = k < context ? slot_row(p, p.value_cache, table, k, kv_head) : nullptr;
    const uint16_t* odd = k + 1 < context ? slot_row(p, p.value_cache, table, k + 1, kv_head) : nullptr;
    uint16_t* row = s.values.data() + (k / kKeyPairTile) * dim_blocks * kTileValues + ((k % kKeyPairTile) / 2) * kTileBf16;
    for (int64_t b = 0; b < dim_blocks; ++b) {
      const __m256i low = even != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + b * kDimBlock))
                                          : _mm256_setzero_si256();
      const __m256i high = odd != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + b * kDimBlock))
                                          : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      _mm512_storeu_si512(row + b * kTileValues, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// 2^t lane by lane: t = n + f with n the nearest integer, 2^f by its degree-5 Taylor
// polynomial on [-0.5, 0.5] (relative error < 3e-6, against bf16's 4e-3 that the weights
// are rounded to next), and scalef to multiply by 2^n, which saturates to 0 or infinity
// where fp32 would underflow or overflow. Half the instructions of exp_lanes: the
// softmax's exponentials, not the tiles, bounded a long prefill's attention.
inline __m512 exp2_lanes(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 lanes_below(int64_t count, int64_t k) {
  if (count <= k) return 0;
  return count - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (count - k)) - 1);
}

// The online softmax's step for one chunk of keys: for each row, its running max and total
// move to include the chunk's visible keys (those before visible[r], from chunk_start on),
// its accumulated output is rescaled to the new max, and the chunk's weights are written
// as bf16 (zero for keys the row does not see).
void softmax_chunk(Scratch& s, const int64_t* visible, int64_t rows, int64_t chunk_start, int64_t chunk_keys,
                   int64_t dim, float scale) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 scale_lanes = _mm512_set1_ps(scale * kLog2e);  // scores to base-2 exponents
  for (int64_t r = 0; r < rows; ++r) {
    const float* scores = s.scores.data() + r * kChunkKeys;
    uint16_t* weights = s.weights.data() + r * kChunkKeys;
    const int64_t count = std::min(visible[r] - chunk_start, chunk_keys);  // keys of the chunk this row sees
    if (count <= 0) {
      std::memset(weights, 0, chunk_keys * 2);
      continue;
    }
    __m512 max_lanes = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < count; k += 16) {
      max_lanes = _mm512_mask_max_ps(max_lanes, lanes_below(count, k), max_lanes, _mm512_loadu_ps(scores + k));
    }
    const float old_max = s.running_max[r];
    const float new_max = std::max(old_max, _mm512_reduce_max_ps(max_lanes) * scale);
    const __m512 max_lanes_new = _mm512_set1_ps(new_max * kLog2e);
    __m512 sum_lanes = _mm512_setzero_ps();
    for (int64_t k = 0; k < chunk_keys; k += 16) {
      const __m512 shifted = _mm512_fmsub_ps(_mm512_loadu_ps(scores + k), scale_lanes, max_lanes_new);
      const __m512 weight = _mm512_maskz_mov_ps(lanes_below(count, k), exp2_lanes(shifted));
      sum_lanes = _mm512_add_ps(sum_lanes, weight);
      const __m256bh rounded = _mm512_cvtneps_pbh(weight);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + k), reinterpret_cast<const __m256i&>(rounded));
    }
    const float correction = old_max == -INFINITY ? 0.0f : std::exp(old_max - new_max);
    s.running_max[r] = new_max;
    s.total[r] = s.total[r] * correction + _mm512_reduce_add_ps(sum_lanes);
    if (correction != 1.0f) {
      float* acc = s.acc.data() + r * dim;
      const __m512 factor = _mm512_set1_ps(correction);
      for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));
    }
  }
}

// Adds a result tile (stored to s.result) to rows [row, row + 16) of the accumulators at
// head dims [16 dim_block, +16).
void accumulate_result(Scratch& s, int64_t row, int64_t dim, int64_t dim_block) {
  for (int64_t r = 0; r < kTileRows; ++r) {
    float* acc = s.acc.data() + (row + r) * dim + dim_block * kDimBlock;
    _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_loadu_ps(&s.result[r * kDimBlock])));
  }
}

// Rows [row, row + rows), rows <= 32, of one (sequence, KV head): row r is token r / group's
// query head kv_head * group + r % group. Keys go in chunks of up to kChunkKeys, whose
// scores and weights stay in L1; both products run 2 x 2 tiles at a time (two 16-row
// blocks by two key or dim blocks), as amx_linear does.
void attend_rows(const Problem& p, int64_t seq, int64_t kv_head, int64_t row, int64_t rows, Scratch& s) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t query_len = p.query_lens[seq], context = p.context_lens[seq], start = p.query_starts[seq];
  const int64_t dim = p.dim, dim_tiles = dim / kTileBf16, dim_blocks = dim / kDimBlock;
  const bool two = rows > kTileRows;  // a second 16-row block
  const int64_t block_rows = two ? 2 * kTileRows : kTileRows;
  int64_t visible[2 * kTileRows];
  std::fill(s.query.begin(), s.query.end(), 0);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.running_max.begin(), s.running_max.end(), -INFINITY);
  std::fill(s.total.begin(), s.total.end(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = (row + r) / group, head = kv_head * group + (row + r) % group;
    visible[r] = context - query_len + token + 1;
    std::memcpy(&s.query[r * dim], p.query + (start + token) * p.query_stride + head * dim, dim * 2);
  }
  for (int64_t r = rows; r < block_rows; ++r) visible[r] = 0;  // padding rows: no weights, never written
  const int64_t keys_seen = *std::max_element(visible, visible + rows);
  const int64_t keys_padded = (keys_seen + kKeyPairTile - 1) / kKeyPairTile * kKeyPairTile;
  const uint16_t* query0 = s.query.data();
  const uint16_t* query1 = query0 + kTileRows * dim;
  const uint16_t* weights0 = s.weights.data();
  const uint16_t* weights1 = weights0 + kTileRows * kChunkKeys;

  for (int64_t chunk = 0; chunk < keys_padded; chunk += kChunkKeys) {
    const int64_t chunk_keys = std::min(kChunkKeys, keys_padded - chunk);
    // Scores, 32 keys at a time: tiles 4-7 = queries (0, 1) x keys (2, 3) over the head dim.
    for (int64_t k = 0; k < chunk_keys; k += kKeyPairTile) {
      zero_results();
      const uint16_t* keys0 = s.keys.data() + (chunk + k) / kKeyTile * dim_tiles * kTileValues;
      const uint16_t* keys1 = keys0 + dim_tiles * kTileValues;
      for (int64_t d = 0; d < dim_tiles; ++d) {
        tile_step_2x2(query0 + d * kTileBf16, query1 + d * kTileBf16, dim, keys0 + d * kTileValues,
                      keys1 + d * kTileValues, two);
      }
      float* scores = s.scores.data() + k;
      _tile_stored(4, scores, kChunkKeys * 4);
      _tile_stored(5, scores + kKeyTile, kChunkKeys * 4);
      if (two) {
        _tile_stored(6, scores + kTileRows * kChunkKeys, kChunkKeys * 4);
        _tile_stored(7, scores + kTileRows * kChunkKeys + kKeyTile, kChunkKeys * 4);
      }
    }
    softmax_chunk(s, visible, block_rows, chunk, chunk_keys, dim, p.scale);
    // Values, 32 head dims at a time: tiles 4-7 = weights (0, 1) x values (2, 3) over the chunk.
    for (int64_t b = 0; b < dim_blocks; b += 2) {
      zero_results();
      for (int64_t k = 0; k < chunk_keys; k += kKeyPairTile) {
        const uint16_t* values0 = s.values.data() + ((chunk + k) / kKeyPairTile * dim_blocks + b) * kTileValues;
        tile_step_2x2(weights0 + k, weights1 + k, kChunkKeys, values0, values0 + kTileValues, two);
      }
      float* result = s.result.data();
      _tile_stored(4, result, kTileFloats * 4);
      accumulate_result(s, 0, dim, b);
      _tile_stored(5, result, kTileFloats * 4);
      accumulate_result(s, 0, dim, b + 1);
      if (two) {
        _tile_stored(6, result, kTileFloats * 4);
        accumulate_result(s, kTileRows, dim, b);
        _tile_stored(7, result, kTileFloats * 4);
        accumulate_result(s, kTileRows, dim, b + 1);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = (row + r) / group, head = kv_head * group + (row + r) % group;
    uint16_t* out = p.out + (start + token) * p.heads * dim + head * dim;
    const __m512 inverse_total = _mm512_set1_ps(1.0f / s.total[r]);
    for (int64_t d = 0; d < dim; d += 16) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&s.acc[r * dim + d]), inverse_total));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), reinterpret_cast<const __m256i&>(rounded));
    }
  }
}

void run(const Problem& p, int64_t num_seqs) {
  const int64_t group = p.heads / p.kv_heads;
  at::parallel_for(0, num_seqs * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    Scratch scratch(p.dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / p.kv_heads, kv_head = item % p.kv_heads;
      const int64_t context = p.context_lens[seq];
      const int64_t padded = (context + kKeyPairTile - 1) / kKeyPairTile * kKeyPairTile;
      scratch.size_for(padded, p.dim);
      lay_out_context(p, seq, kv_head, context, scratch);
      const int64_t rows = p.query_lens[seq] * group;
      for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
        attend_rows(p, seq, kv_head, row, std::min(2 * kTileRows, rows - row), scratch);
      }
    }
    _tile_release();
  });
}

#endif  // BATON_AMX

void amx_paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_table, const at::Tensor& query_starts, const at::Tensor& query_lens,
                         const at::Tensor& context_lens, int64_t block_size, double scale, at::Tensor& out) {
#if BATON_AMX
  TORCH_CHECK(tiles_permitted(), "amx_paged_attention: the kernel refused AMX tile state to this process");
  check_paged_inputs(query, key_cache, value_cache, block_table, query_starts, query_lens, context_lens, block_size,
                     out);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "query, caches and out: expected bf16");
  const int64_t dim = query.size(2);
  TORCH_CHECK(dim % kTileBf16 == 0 && dim <= kMaxHeadDim, "head dim: a multiple of ", kTileBf16, " up to ",
              kMaxHeadDim, " expected, got ", dim);
  const int64_t num_seqs = block_table.size(0);
  const Problem p{reinterpret_cast<const uint16_t*>(query.data_ptr()), query.stride(0),
                  reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
                  reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), key_cache.size(1) * dim,
                  block_table.data_ptr<int64_t>(),
                  block_table.size(1), query_starts.data_ptr<int64_t>(), query_lens.data_ptr<int64_t>(),
                  context_lens.data_ptr<int64_t>(), query.size(1), key_cache.size(1), dim, block_size,
                  static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr())};
  run(p, num_seqs);
#else
  TORCH_CHECK(false, "amx_paged_attention: this build has no AMX (the CPU or compiler lacks it)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("amx_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_starts, Tensor query_lens, Tensor context_lens, int block_size, float scale, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("amx_paged_attention", &amx_paged_attention); }

}  // namespace baton_amx_attention
