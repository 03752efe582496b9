// y = x Wᵀ (+ b) in bf16 on Intel AMX tiles, for the few-row multiplies of decode steps and
// short chunks.
//
// At 32 rows, oneDNN's bf16 inner product costs ~25-35 us a call on this machine whatever
// the size (its dispatch, not its arithmetic: the tile work of a 32 x 256 x 512 multiply is
// ~3 us), and a decode step of the tiny model makes 17 of them. This kernel keeps the weight
// in the tiles' own layout, loads no per-call state beyond the tile shape, and splits across
// threads only when a call holds enough work to pay for it.
//
// Numbers: each output is the fp32 sum of bf16 products over K in tile order (32 at a time,
// in order), plus the bias in fp32, rounded once to bf16 (nearest even). The sum does not
// depend on the number of rows or on which rows share a call, so results are the same
// whatever the batch; at up to 32 rows they are also oneDNN's bits where oneDNN keeps the
// sum on one thread (tested on one; with 16, it splits K for narrow layers and differs).
//
// amx_block_linear multiplies by a weight kept in GGUF's quantized blocks (32 values along K
// sharing a scale and a minimum: value = scale * q + min, the form of Q4_0, Q4_1, Q5_0, Q5_1
// and Q8_0) and widens each tile to bf16 in registers just before the tiles read it. A
// decode step reads every weight once from DRAM, so 4-bit blocks read ~3.2x fewer bytes than
// bf16 (0.625 against 2 a value). The widened tile holds bf16(fp32(scale * q + min)), the
// value the GGUF loader's float32 dequantization rounds to bf16 (scale * q is exact in
// fp32: an fp16 scale times an integer below 256), so the result has the same bits as
// amx_linear on that loader's bf16 weight.
//
// Contract: x [rows, K] bf16 (rows may be strided); weight packed by amx_pack_linear_weight
// from W [N, K] with N and K multiples of 32 (or, for amx_block_linear, by
// kernels/linear.py pack_weight_blocks); bias [N] bf16 or none. Built only where the
// compiler targets AMX (-march=native on such a CPU); elsewhere amx_supported() says
// false and the other AMX ops refuse.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"

namespace baton_amx_linear {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

constexpr int64_t kTileK = 32;      // bf16 values along K in a tile row (64 bytes)
constexpr int64_t kTileCols = 16;   // output columns in a tile
constexpr int64_t kPackedBlock = kTileK * kTileCols;  // bf16 values in one packed weight tile
// A thread takes at least this many multiply-adds: below it, waking the second thread costs
// more than it saves (measured: a 32 x 256 x 512 call ran fastest on one).
constexpr int64_t kMacsPerTask = 4 << 20;

void check_weight_shape(int64_t out_features, int64_t in_features) {
  TORCH_CHECK(out_features > 0 && out_features % (2 * kTileCols) == 0, "weight: out features must be a positive ",
              "multiple of ", 2 * kTileCols, ", got ", out_features);
  TORCH_CHECK(in_features > 0 && in_features % kTileK == 0, "weight: in features must be a positive multiple of ",
              kTileK, ", got ", in_features);
}

#if BATON_AMX

using namespace baton;

// The fp32 sums of up to 32 rows x 32 columns into tiles 4-7 (6-7 only with two row blocks).
void multiply_block(const at::BFloat16* x, int64_t x_stride, bool two_row_blocks, const at::BFloat16* w0,
                    const at::BFloat16* w1, int64_t k_tiles) {
  zero_results();
  for (int64_t k = 0; k < k_tiles; ++k) {
    tile_step_2x2(x + k * kTileK, x + kTileRows * x_stride + k * kTileK, x_stride, w0 + k * kPackedBlock,
                  w1 + k * kPackedBlock, two_row_blocks);
  }
}

// Rounds a 16 x 16 fp32 tile (plus the bias) to bf16 rows of `out`, the first `rows` of them.
void store_rounded(const float* sums, const float* bias, at::BFloat16* out, int64_t out_stride, int64_t rows) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + r * kTileCols), b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride), reinterpret_cast<const __m256i&>(rounded));
  }
}

// Rounds the sums in tiles 4-7 (rows [row, row + 32) of columns [col, col + 32); tiles 6-7
// only with two row blocks) plus the bias to bf16 rows of `out`, of which there are `rows`.
void store_results(int64_t row, int64_t rows, int64_t col, bool two_row_blocks, const float* bias,
                   at::BFloat16* out, int64_t out_features) {
  alignas(64) float sums[kTileRows * kTileCols];
  const float* b0 = bias != nullptr ? bias + col : nullptr;
  const float* b1 = bias != nullptr ? bias + col + kTileCols : nullptr;
  const int64_t first_rows = std::min(kTileRows, rows - row);
  at::BFloat16* first = out + row * out_features + col;
  _tile_stored(4, sums, kTileCols * 4);
  store_rounded(sums, b0, first, out_features, first_rows);
  _tile_stored(5, sums, kTileCols * 4);
  store_rounded(sums, b1, first + kTileCols, out_features, first_rows);
  if (two_row_blocks) {
    const int64_t second_rows = std::min(kTileRows, rows - row - kTileRows);
    at::BFloat16* second = first + kTileRows * out_features;
    _tile_stored(6, sums, kTileCols * 4);
    store_rounded(sums, b0, second, out_features, second_rows);
    _tile_stored(7, sums, kTileCols * 4);
    store_rounded(sums, b1, second + kTileCols, out_features, second_rows);
  }
}

// What both multiplies check and prepare: x [rows, in_features] bf16 (padded with zero
// rows to whole tiles where ragged: tiles read 16 rows at a time), the bias in fp32 (or
// undefined) and the output.
struct Operands {
  at::Tensor x;
  at::Tensor bias;
  at::Tensor out;
  int64_t rows;
  int64_t padded_rows;
};

Operands prepare_operands(const at::Tensor& x_in, const std::optional<at::Tensor>& bias, int64_t out_features,
                          int64_t in_features) {
  check_weight_shape(out_features, in_features);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 &&
                  x_in.size(1) == in_features,
              "x: expected bf16 [rows, ", in_features, "], got ", x_in.scalar_type(), " ", x_in.sizes());
  Operands operands;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kBFloat16,
                "bias: expected bf16 [", out_features, "]");
    operands.bias = bias->to(at::kFloat).contiguous();
  }
  operands.rows = x_in.size(0);
  operands.padded_rows = (operands.rows + kTileRows - 1) / kTileRows * kTileRows;
  operands.out = at::empty({operands.rows, out_features}, x_in.options());
  operands.x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  if (operands.padded_rows != operands.rows) {
    operands.x = at::zeros({operands.padded_rows, in_features}, x_in.options());
    operands.x.narrow(0, 0, operands.rows).copy_(x_in);
  }
  return operands;
}

at::Tensor amx_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight: expected a 2-D bf16 CPU tensor");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  check_weight_shape(out_features, in_features);
  const at::Tensor plain = weight.contiguous();
  // [N/16][K/32][16 pairs of K][16 columns][2]: one 16 x 32 tile of Wᵀ per (column block, K
  // block), K pairs interleaved as tdpbf16ps reads them.
  at::Tensor packed = at::empty({out_features / kTileCols, in_features / kTileK, kTileK / 2, kTileCols * 2},
                                weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(plain.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t k_tiles = in_features / kTileK;
  at::parallel_for(0, out_features / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t k = 0; k < k_tiles; ++k) {
        uint16_t* tile = dst + (block * k_tiles + k) * kPackedBlock;
        for (int64_t pair = 0; pair < kTileK / 2; ++pair) {
          for (int64_t col = 0; col < kTileCols; ++col) {
            const uint16_t* row = src + (block * kTileCols + col) * in_features + k * kTileK + 2 * pair;
            tile[(pair * kTileCols + col) * 2] = row[0];
            tile[(pair * kTileCols + col) * 2 + 1] = row[1];
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles_permitted(), "amx_linear: the kernel refused AMX tile state to this process");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kTileK / 2 && packed.size(3) == 2 * kTileCols,
              "packed: expected the output of amx_pack_linear_weight");
  const int64_t out_features = packed.size(0) * kTileCols, in_features = packed.size(1) * kTileK;
  const Operands ops = prepare_operands(x_in, bias, out_features, in_features);
  if (ops.rows == 0) return ops.out;
  const at::BFloat16* x_data = reinterpret_cast<const at::BFloat16*>(ops.x.data_ptr());
  const int64_t x_stride = ops.x.stride(0), rows = ops.rows;
  const at::BFloat16* w_data = reinterpret_cast<const at::BFloat16*>(packed.data_ptr());
  const float* bias_values = ops.bias.defined() ? ops.bias.data_ptr<float>() : nullptr;
  at::BFloat16* out_data = reinterpret_cast<at::BFloat16*>(ops.out.data_ptr());
  const int64_t k_tiles = in_features / kTileK;
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / (ops.padded_rows * in_features * 2 * kTileCols));
  at::parallel_for(0, out_features / (2 * kTileCols), grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t pair = begin; pair < end; ++pair) {
      const at::BFloat16* w0 = w_data + 2 * pair * k_tiles * kPackedBlock;
      const at::BFloat16* w1 = w0 + k_tiles * kPackedBlock;
      for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
        const bool two_row_blocks = row + kTileRows < rows;
        multiply_block(x_data + row * x_stride, x_stride, two_row_blocks, w0, w1, k_tiles);
        store_results(row, rows, pair * 2 * kTileCols, two_row_blocks, bias_values, out_data, out_features);
      }
    }
    _tile_release();
  });
  return ops.out;
}

// One packed tile of quantized blocks (kernels/linear.py pack_weight_blocks): the values of
// 16 columns x 32 K, 4 or 8 bits each, then the 16 columns' fp16 scales, then their fp16
// minimums. Values go per K pair in the tile row's order (column c's even and odd K at
// lanes 2c and 2c + 1): 8-bit, as 32 signed bytes; 4-bit, as 16 bytes whose low nibbles
// hold lanes 0-15 and high nibbles lanes 16-31, so that each half widens to one fp32 vector
// and cvtne2ps joins the two in the tile row's order.
template <int kBits>
struct BlockTile {
  static constexpr int64_t kValueBytes = kPackedBlock * kBits / 8;
  static constexpr int64_t kPairBytes = kValueBytes / (kTileK / 2);
  static constexpr int64_t kBytes = kValueBytes + 2 * kTileCols * 2;
};

// Writes the bf16 tile amx_pack_linear_weight would hold for these blocks into `tile`.
template <int kBits>
inline void widen_tile(const uint8_t* packed, at::BFloat16* tile) {
  using Layout = BlockTile<kBits>;
  const uint8_t* scales = packed + Layout::kValueBytes;
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
  const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
  // Lane j of a tile row's first half is column j / 2's; of its second half, column 8 + j / 2's.
  const __m512i first_columns = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second_columns = _mm512_add_epi32(first_columns, _mm512_set1_epi32(8));
  const __m512 scale_first = _mm512_permutexvar_ps(first_columns, scale);
  const __m512 scale_second = _mm512_permutexvar_ps(second_columns, scale);
  const __m512 minimum_first = _mm512_permutexvar_ps(first_columns, minimum);
  const __m512 minimum_second = _mm512_permutexvar_ps(second_columns, minimum);
  for (int64_t pair = 0; pair < kTileK / 2; ++pair) {
    const uint8_t* row = packed + pair * Layout::kPairBytes;
    __m512i first, second;
    if constexpr (kBits == 4) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      first = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF));
      second = _mm512_srli_epi32(bytes, 4);
    } else {
      first = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      second = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kTileCols)));
    }
    const __m512 first_values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), scale_first, minimum_first);
    const __m512 second_values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), scale_second, minimum_second);
    _mm512_store_si512(tile + pair * kTileCols * 2,
                       reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second_values, first_values)));
  }
}

// Asks for a weight stream's tile kTilesAhead tiles on: DRAM's latency is longer than the
// widening of a few tiles, and the hardware's prefetchers follow two streams per thread
// (w0, w1) too late. Past a column pair's last tile lies the next pair's first (or, at the
// tensor's end, memory a prefetch may name without faulting).
template <int kBits>
inline void prefetch_ahead(const uint8_t* tile) {
  constexpr int64_t kTilesAhead = 4;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(tile) + kTilesAhead * BlockTile<kBits>::kBytes;
  for (int64_t line = 0; line < BlockTile<kBits>::kBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
}

template <int kBits>
void block_linear_rows(const at::BFloat16* x_data, int64_t x_stride, int64_t rows, const uint8_t* w_data,
                       int64_t k_tiles, const float* bias_values, at::BFloat16* out_data, int64_t out_features,
                       int64_t begin, int64_t end) {
  constexpr int64_t kTileBytes = BlockTile<kBits>::kBytes;
  // Two buffers, a K step's tiles in one while the tiles still read the other's.
  alignas(64) at::BFloat16 widened[2][2][kPackedBlock];
  for (int64_t pair = begin; pair < end; ++pair) {
    const uint8_t* w0 = w_data + 2 * pair * k_tiles * kTileBytes;
    const uint8_t* w1 = w0 + k_tiles * kTileBytes;
    for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
      const bool two_row_blocks = row + kTileRows < rows;
      const at::BFloat16* x = x_data + row * x_stride;
      zero_results();
      for (int64_t k = 0; k < k_tiles; ++k) {
        at::BFloat16 (&buffer)[2][kPackedBlock] = widened[k & 1];
        prefetch_ahead<kBits>(w0 + k * kTileBytes);
        prefetch_ahead<kBits>(w1 + k * kTileBytes);
        widen_tile<kBits>(w0 + k * kTileBytes, buffer[0]);
        widen_tile<kBits>(w1 + k * kTileBytes, buffer[1]);
        // The tile loads are asm that tells the compiler only the buffer's address: without
        // this, it may drop or delay the stores of the widened values, never read in C++.
        __asm__ volatile("" : : "r"(widened) : "memory");
        tile_step_2x2(x + k * kTileK, x + kTileRows * x_stride + k * kTileK, x_stride, buffer[0], buffer[1],
                      two_row_blocks);
      }
      store_results(row, rows, pair * 2 * kTileCols, two_row_blocks, bias_values, out_data, out_features);
    }
  }
}

at::Tensor amx_block_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t bits,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles_permitted(), "amx_block_linear: the kernel refused AMX tile state to this process");
  TORCH_CHECK(bits == 4 || bits == 8, "amx_block_linear: bits must be 4 or 8, got ", bits);
  const int64_t tile_bytes = bits == 4 ? BlockTile<4>::kBytes : BlockTile<8>::kBytes;
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.size(2) == tile_bytes,
              "packed: expected the output of pack_weight_blocks for ", bits, "-bit blocks");
  const int64_t out_features = packed.size(0) * kTileCols, in_features = packed.size(1) * kTileK;
  const Operands ops = prepare_operands(x_in, bias, out_features, in_features);
  if (ops.rows == 0) return ops.out;
  const at::BFloat16* x_data = reinterpret_cast<const at::BFloat16*>(ops.x.data_ptr());
  const uint8_t* w_data = packed.data_ptr<uint8_t>();
  const float* bias_values = ops.bias.defined() ? ops.bias.data_ptr<float>() : nullptr;
  at::BFloat16* out_data = reinterpret_cast<at::BFloat16*>(ops.out.data_ptr());
  const int64_t k_tiles = in_features / kTileK, x_stride = ops.x.stride(0), rows = ops.rows;
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / (ops.padded_rows * in_features * 2 * kTileCols));
  at::parallel_for(0, out_features / (2 * kTileCols), grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    if (bits == 4) {
      block_linear_rows<4>(x_data, x_stride, rows, w_data, k_tiles, bias_values, out_data, out_features, begin, end);
    } else {
      block_linear_rows<8>(x_data, x_stride, rows, w_data, k_tiles, bias_values, out_data, out_features, begin, end);
    }
    _tile_release();
  });
  return ops.out;
}

bool amx_supported() { return tiles_permitted(); }

#else  // no AMX in this build: the engine keeps oneDNN

at::Tensor amx_pack_linear_weight(const at::Tensor&) {
  TORCH_CHECK(false, "amx_pack_linear_weight: this build has no AMX (the CPU or compiler lacks it)");
}

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_linear: this build has no AMX (the CPU or compiler lacks it)");
}

at::Tensor amx_block_linear(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_block_linear: this build has no AMX (the CPU or compiler lacks it)");
}

bool amx_supported() { return false; }

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("amx_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_block_linear(Tensor x, Tensor packed, int bits, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("amx_pack_linear_weight", &amx_pack_linear_weight);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_block_linear", &amx_block_linear);
}

}  // namespace baton_amx_linear
