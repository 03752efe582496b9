// What Baton's AMX kernels share: whether this build targets the tiles, the process's
// permission to use them, and the one tile shape they all use (16 rows of 64 bytes).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATON_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace baton {

constexpr int64_t kTileRows = 16;   // rows in every tile
constexpr int64_t kTileBf16 = 32;   // bf16 values in a row of an input tile (64 bytes)
constexpr int64_t kTileFloats = 16; // fp32 values in a row of a result tile (64 bytes)
constexpr int64_t kTileValues = kTileRows * kTileBf16;  // bf16 values in one input tile

// Linux hands out AMX state only to processes that ask for it (once; it covers every thread).
inline bool tiles_permitted() {
  constexpr int kArchRequestXcompPermission = 0x1023;  // arch_prctl(ARCH_REQ_XCOMP_PERM, ...)
  constexpr int kXfeatureTileData = 18;                // XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kArchRequestXcompPermission, kXfeatureTileData) == 0;
  return permitted;
}

struct alignas(64) TileShape {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles as 16 rows of 64 bytes; a thread calls this before its first tile op.
// Not GCC 12's _tile_loadconfig: its asm declares a read of only the config's first 8
// bytes, so the compiler may drop or delay the stores of the rest (tiles then fault as
// unconfigured). This asm reads the whole object.
inline void configure_tiles() {
  TileShape shape;
  for (int tile = 0; tile < 8; ++tile) {
    shape.rows[tile] = kTileRows;
    shape.bytes_per_row[tile] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(shape));
}

// The tiles' 2 x 2 step, the inner step of every AMX product here: tiles 4, 5 += A block
// `a0` (tile 0) x B blocks `b0`, `b1` (tiles 2, 3), and with `two`, tiles 6, 7 += A block
// `a1` (tile 1) x the same. A blocks are 16 rows of 32 bf16, `a_stride` bf16 apart; B
// blocks are packed tiles (16 rows of 64 bytes, contiguous).
inline void tile_step_2x2(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1,
                          bool two) {
  _tile_loadd(0, a0, a_stride * 2);
  _tile_loadd(2, b0, 64);
  _tile_loadd(3, b1, 64);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(5, 0, 3);
  if (two) {
    _tile_loadd(1, a1, a_stride * 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

inline void zero_results() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

}  // namespace baton

#else
#define BATON_AMX 0
#endif
