// Paged attention on the CPU, reading K/V from the block pool in place.
//
// torch's CPU SDPA pays a fixed cost per (sequence, head) that dwarfs the arithmetic of a
// decode step (~240 us a layer for 32 sequences of ~100 tokens here), and needs each
// sequence's context gathered out of the paged pool, or kept in a dense copy, first. This
// kernel walks each sequence's block table directly, a Lanes of keys at a time, with an online
// softmax in fp32. It takes any query length, but the SDPA backend sends it decode tokens
// only: for a 32-token chunk over 2,048 cached tokens SDPA's matrix kernels were ~5x faster
// (and on AMX CPUs amx_attention.cpp takes chunks).
//
// Contract (checked below): query [tokens, heads, dim] with dim contiguous and heads packed
// (any token stride); key_cache/value_cache [slots, kv_heads, dim] contiguous, slot =
// block * block_size + offset; block_table [seqs, width] int64; query_starts, query_lens,
// context_lens [seqs] int64, where a sequence's query rows are the last query_len of its
// context_len positions and each sees the keys at or before its own position; out
// [tokens, heads, dim] contiguous: only the rows of the given sequences are written.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lanes.h"
#include "paged_inputs.h"

namespace baton_paged_attention {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

using namespace baton;

constexpr int64_t kKeyTile = kLanes;  // keys scored together: one Lanes of scores
constexpr int64_t kRowTile = 32;  // query rows per work item
constexpr int64_t kMaxDim = 256;  // head dims: multiples of 16 up to this

const Lanes lane_index = __builtin_convertvector(lane_numbers(), Lanes);

// Lane i of the result is the sum of p[i]'s lanes: kLanes horizontal sums at once. Each
// level pairs vectors and adds each source's two halves, keeping sources in order.
inline Lanes transpose_sum(const Lanes* p) {
#if defined(__AVX512F__)
  Lanes halves[8], quarters[4], eighths[2];
  for (int j = 0; j < 8; ++j) {
    const Lanes a = p[2 * j], b = p[2 * j + 1];
    halves[j] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int j = 0; j < 4; ++j) {
    const Lanes a = halves[2 * j], b = halves[2 * j + 1];
    quarters[j] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int j = 0; j < 2; ++j) {
    const Lanes a = quarters[2 * j], b = quarters[2 * j + 1];
    eighths[j] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  const Lanes a = eighths[0], b = eighths[1];
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  Lanes quarters[4], eighths[2];
  for (int j = 0; j < 4; ++j) {
    const Lanes a = p[2 * j], b = p[2 * j + 1];
    quarters[j] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int j = 0; j < 2; ++j) {
    const Lanes a = quarters[2 * j], b = quarters[2 * j + 1];
    eighths[j] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  const Lanes a = eighths[0], b = eighths[1];
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

template <typename T>
struct Problem {
  const T* query;
  int64_t query_stride;  // elements between tokens
  const T* key_cache;
  const T* value_cache;
  int64_t cache_stride;  // elements between slots: kv_heads * dim
  const int64_t* block_table;
  int64_t table_width;
  const int64_t* query_starts;
  const int64_t* query_lens;
  const int64_t* context_lens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  float scale;
  T* out;
};

struct WorkItem {
  int64_t seq;
  int64_t kv_head_begin;  // the item's KV heads: [kv_head_begin, kv_head_end)
  int64_t kv_head_end;
  int64_t row_begin;  // each head's rows are (token j, group member g) in that order: r = j * group + g
  int64_t row_end;
};

// One thread's buffers, sized for a work item of at most kRowTile rows (over all its heads).
struct Scratch {
  explicit Scratch(int64_t dim)
      : query(kRowTile * dim / kKeyTile), acc(kRowTile * dim / kKeyTile), running_max(kRowTile),
        total(kRowTile), limit(kRowTile) {}
  std::vector<Lanes> query;  // [rows][dim / kKeyTile], pre-scaled
  std::vector<Lanes> acc;    // [rows][dim / kKeyTile]: each row's weighted sum of values
  std::vector<float> running_max, total;
  std::vector<int64_t> limit;  // keys row r may see: positions [0, limit)
};

// The keys [start, start + count) of one sequence that one tile scores: at most kKeyTile,
// within one block, before `end`; `first_slot` is the first one's slot in the pool.
struct Tile {
  int64_t first_slot;
  int64_t count;
};

// What attend_tile asks for while it works, key by key: `next`, this sequence's next tile
// of its own head, into L1, and `ahead`, the same tile of the thread's next item (head
// `ahead_head`), into L2. Spread over the tile's work, the requests stay within what the
// core keeps in flight, where a burst of them (a tile is 6 KB a head) stalled it.
struct Upcoming {
  Tile next;
  Tile ahead;
  int64_t ahead_head;
};

// One tile of `count` keys (from `first_slot` on) for kRows consecutive rows from `row`,
// each seeing `visible[r]` >= 1 of them: scores, the online softmax's update, and the
// weighted values. Each key's and value's lanes are loaded once for all kRows rows, and
// the rows' value sums stay in registers for the whole tile. With key i it prefetches key i
// of `upcoming`'s tiles.
template <typename T, int64_t kDim, int64_t kRows>
void attend_tile(const Problem<T>& p, int64_t first_slot, int64_t kv_head, int64_t count, const int64_t* visible,
                 int64_t row, int64_t chunks, const Upcoming& upcoming, Scratch& scratch) {
  constexpr int64_t kChunks = kDim > 0 ? kDim / kKeyTile : kMaxDim / kKeyTile;
  const int64_t dim = chunks * kKeyTile;
  const T* keys = p.key_cache + first_slot * p.cache_stride + kv_head * dim;
  const T* values = p.value_cache + first_slot * p.cache_stride + kv_head * dim;
  const Lanes* q = &scratch.query[row * chunks];

  constexpr int64_t kLine = 64 / sizeof(T);  // elements in a cache line
  const Tile next = upcoming.next, ahead = upcoming.ahead;
  const T* next_keys = p.key_cache + next.first_slot * p.cache_stride + kv_head * dim;
  const T* next_values = p.value_cache + next.first_slot * p.cache_stride + kv_head * dim;
  const T* ahead_keys = p.key_cache + ahead.first_slot * p.cache_stride + upcoming.ahead_head * dim;
  const T* ahead_values = p.value_cache + ahead.first_slot * p.cache_stride + upcoming.ahead_head * dim;
  Lanes partial[kRows][kKeyTile];  // per row and key: lane-wise products, summed over chunks
  for (int64_t i = 0; i < kKeyTile; ++i) {
    if (i < next.count) {
      for (int64_t e = 0; e < dim; e += kLine) {
        __builtin_prefetch(next_keys + i * p.cache_stride + e, 0, 3);
        __builtin_prefetch(next_values + i * p.cache_stride + e, 0, 3);
      }
    }
    if (i < ahead.count) {
      for (int64_t e = 0; e < dim; e += kLine) {
        __builtin_prefetch(ahead_keys + i * p.cache_stride + e, 0, 2);
        __builtin_prefetch(ahead_values + i * p.cache_stride + e, 0, 2);
      }
    }
    if (i >= count) {
      for (int64_t r = 0; r < kRows; ++r) partial[r][i] = Lanes{};
      continue;
    }
    Lanes key[kChunks];
    for (int64_t c = 0; c < chunks; ++c) key[c] = load_lanes(keys + i * p.cache_stride + c * kKeyTile);
    for (int64_t r = 0; r < kRows; ++r) {
      Lanes sum = q[r * chunks] * key[0];
      for (int64_t c = 1; c < chunks; ++c) sum += q[r * chunks + c] * key[c];
      partial[r][i] = sum;
    }
  }

  Lanes weights[kRows];
  float correction[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const auto seen = lane_index < static_cast<float>(visible[r]);  // keys at or before this row
    const Lanes scores = seen ? transpose_sum(partial[r]) : splat(-kInfinity);
    float& running_max = scratch.running_max[row + r];
    const float new_max = std::max(running_max, lane_max(scores));
    weights[r] = seen ? exp_lanes(scores - new_max) : Lanes{};
    correction[r] = new_max == running_max ? 1.0f : exp_lanes(splat(running_max - new_max))[0];  // ~0 at first
    running_max = new_max;
    scratch.total[row + r] = scratch.total[row + r] * correction[r] + lane_sum(weights[r]);
  }

  Lanes acc[kRows][kChunks];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < chunks; ++c) acc[r][c] = scratch.acc[(row + r) * chunks + c] * correction[r];
  for (int64_t i = 0; i < count; ++i) {
    Lanes value[kChunks];
    for (int64_t c = 0; c < chunks; ++c) value[c] = load_lanes(values + i * p.cache_stride + c * kKeyTile);
    for (int64_t r = 0; r < kRows; ++r) {
      const float w = weights[r][i];  // 0 where row r does not see key i
      for (int64_t c = 0; c < chunks; ++c) acc[r][c] += w * value[c];
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < chunks; ++c) scratch.acc[(row + r) * chunks + c] = acc[r][c];
}

template <typename T, int64_t kDim>
void attend_rows(const Problem<T>& p, int64_t first_slot, int64_t kv_head, int64_t count, const int64_t* visible,
                 int64_t row, int64_t rows, int64_t chunks, const Upcoming& upcoming, Scratch& scratch) {
  switch (rows) {
    case 1: attend_tile<T, kDim, 1>(p, first_slot, kv_head, count, visible, row, chunks, upcoming, scratch); break;
    case 2: attend_tile<T, kDim, 2>(p, first_slot, kv_head, count, visible, row, chunks, upcoming, scratch); break;
    case 3: attend_tile<T, kDim, 3>(p, first_slot, kv_head, count, visible, row, chunks, upcoming, scratch); break;
    default: attend_tile<T, kDim, 4>(p, first_slot, kv_head, count, visible, row, chunks, upcoming, scratch); break;
  }
}

template <typename T>
Tile tile_at(const Problem<T>& p, int64_t seq, int64_t start, int64_t end) {
  const int64_t block = start / p.block_size, offset = start % p.block_size;
  return {p.block_table[seq * p.table_width + block] * p.block_size + offset,
          std::min({kKeyTile, p.block_size - offset, end - start})};
}

// Asks for an item's first tile (K and V lines of heads [kv_head_begin, kv_head_end)) into
// L1; attend_tile asks for the later ones. A sequence's next tile is often in another
// block, where the hardware's prefetchers cannot follow, and a decode step's KV comes from
// DRAM (between two layers the weights pass through the caches).
template <typename T>
void prefetch_tile(const Problem<T>& p, Tile tile, int64_t kv_head_begin, int64_t kv_head_end, int64_t dim) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements in a cache line
  for (int64_t i = 0; i < tile.count; ++i) {
    const int64_t base = (tile.first_slot + i) * p.cache_stride;
    for (int64_t e = kv_head_begin * dim; e < kv_head_end * dim; e += kLine) {
      __builtin_prefetch(p.key_cache + base + e, 0, 3);
      __builtin_prefetch(p.value_cache + base + e, 0, 3);
    }
  }
}

// One work item: rows [row_begin, row_end) of each of one sequence's KV heads in
// [kv_head_begin, kv_head_end), the query heads sharing it. Scratch row hi * head_rows + r
// holds row r of the item's hi-th head. A tile's keys are read for every head of the item
// before the next tile, so a decode item with all heads reads each slot's K and V whole.
// While it works on a tile, attend_tile fetches the next tile's keys into L1 and the same
// tile of the thread's next item (`ahead`, or null) into L2.
// kDim > 0 fixes the head dim at compile time (the common 64 and 128), so the rows' sums
// stay in registers; 0 reads `dim` (a multiple of 16, at most kMaxDim).
template <typename T, int64_t kDim>
void attend_item(const Problem<T>& p, const WorkItem& item, const WorkItem* ahead, int64_t dim_at_runtime,
                 Scratch& scratch) {
  constexpr int64_t kRowBlock = 4;  // rows sharing each key's and value's loads
  const int64_t dim = kDim > 0 ? kDim : dim_at_runtime;
  const int64_t chunks = dim / kKeyTile;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t seq = item.seq;
  const int64_t query_len = p.query_lens[seq];
  const int64_t context_len = p.context_lens[seq];
  const int64_t query_start = p.query_starts[seq];
  const int64_t head_rows = item.row_end - item.row_begin;
  const int64_t heads = item.kv_head_end - item.kv_head_begin;
  const int64_t rows = heads * head_rows;

  int64_t* limit = scratch.limit.data();
  std::fill(scratch.acc.begin(), scratch.acc.begin() + rows * chunks, Lanes{});
  std::fill(scratch.running_max.begin(), scratch.running_max.begin() + rows, -kInfinity);
  std::fill(scratch.total.begin(), scratch.total.begin() + rows, 0.0f);
  for (int64_t r = 0; r < head_rows; ++r) limit[r] = context_len - query_len + (item.row_begin + r) / group + 1;
  for (int64_t hi = 0; hi < heads; ++hi) {
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = item.row_begin + r;
      const int64_t token = row / group, head = (item.kv_head_begin + hi) * group + row % group;
      const T* src = p.query + (query_start + token) * p.query_stride + head * dim;
      Lanes* dst = &scratch.query[(hi * head_rows + r) * chunks];
      for (int64_t c = 0; c < chunks; ++c) dst[c] = load_lanes(src + c * kKeyTile) * p.scale;
    }
  }
  const int64_t keys_needed = limit[head_rows - 1];  // rows ascend by token, so by limit

  int64_t first_seeing = 0;  // rows before it see none of this tile or any later one
  int64_t visible[kRowTile];
  Tile tile = tile_at(p, seq, 0, keys_needed);
  prefetch_tile(p, tile, item.kv_head_begin, item.kv_head_end, dim);
  for (int64_t tile_start = 0;;) {
    const int64_t next_start = tile_start + tile.count;
    const Tile next = next_start < keys_needed ? tile_at(p, seq, next_start, keys_needed) : Tile{0, 0};
    const Tile ahead_tile = ahead != nullptr && tile_start < p.context_lens[ahead->seq]
                                ? tile_at(p, ahead->seq, tile_start, p.context_lens[ahead->seq]) : Tile{0, 0};
    while (limit[first_seeing] <= tile_start) ++first_seeing;
    for (int64_t r = first_seeing; r < head_rows; ++r) visible[r] = std::min(tile.count, limit[r] - tile_start);
    for (int64_t hi = 0; hi < heads; ++hi) {
      for (int64_t r = first_seeing; r < head_rows; r += kRowBlock) {
        const bool first = r == first_seeing;  // prefetches once a head
        const bool ahead_has_head = ahead != nullptr && hi < ahead->kv_head_end - ahead->kv_head_begin;
        const Upcoming upcoming{first ? next : Tile{0, 0}, first && ahead_has_head ? ahead_tile : Tile{0, 0},
                                ahead_has_head ? ahead->kv_head_begin + hi : 0};
        attend_rows<T, kDim>(p, tile.first_slot, item.kv_head_begin + hi, tile.count, &visible[r], hi * head_rows + r,
                             std::min(kRowBlock, head_rows - r), chunks, upcoming, scratch);
      }
    }
    if (next.count == 0) break;
    tile_start = next_start;
    tile = next;
  }

  const int64_t out_stride = p.num_heads * dim;
  for (int64_t hi = 0; hi < heads; ++hi) {
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t row = item.row_begin + r, at = hi * head_rows + r;
      const int64_t token = row / group, head = (item.kv_head_begin + hi) * group + row % group;
      T* dst = p.out + (query_start + token) * out_stride + head * dim;
      const float inverse = 1.0f / scratch.total[at];
      for (int64_t c = 0; c < chunks; ++c) store_lanes(dst + c * kKeyTile, scratch.acc[at * chunks + c] * inverse);
    }
  }
}

template <typename T>
void run(const Problem<T>& p, const std::vector<WorkItem>& items, int64_t dim) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(dim);
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem* ahead = i + 1 < end ? &items[i + 1] : nullptr;
      if (dim == 64) {
        attend_item<T, 64>(p, items[i], ahead, dim, scratch);
      } else if (dim == 128) {
        attend_item<T, 128>(p, items[i], ahead, dim, scratch);
      } else {
        attend_item<T, 0>(p, items[i], ahead, dim, scratch);
      }
    }
  });
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_table, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
                     double scale, at::Tensor& out) {
  check_paged_inputs(query, key_cache, value_cache, block_table, query_starts, query_lens, context_lens, block_size,
                     out);
  TORCH_CHECK(query.size(2) % kWidthMultiple == 0 && query.size(2) <= kMaxDim, "head dim: a multiple of ",
              kWidthMultiple, " up to ", kMaxDim, " expected, got ", query.size(2));
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, caches and out must share one dtype");
  const int64_t num_seqs = block_table.size(0);
  const int64_t heads = query.size(1), kv_heads = key_cache.size(1), dim = query.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  // A sequence whose rows for all its KV heads fit one item is one item, unless that leaves
  // too few items to share among the threads.
  const bool whole_sequences = num_seqs >= 2 * at::get_num_threads();
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = lens[s] * group;
    if (whole_sequences && rows * kv_heads <= kRowTile) {
      items.push_back({s, 0, kv_heads, 0, rows});
      continue;
    }
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t r = 0; r < rows; r += kRowTile) items.push_back({s, kv, kv + 1, r, std::min(rows, r + kRowTile)});
  }

  auto dispatch = [&](auto tag) {
    using T = decltype(tag);
    const Problem<T> p{reinterpret_cast<const T*>(query.data_ptr()), query.stride(0),
                       reinterpret_cast<const T*>(key_cache.data_ptr()),
                       reinterpret_cast<const T*>(value_cache.data_ptr()), kv_heads * dim,
                       block_table.data_ptr<int64_t>(), block_table.size(1), starts, lens, contexts,
                       heads, kv_heads, block_size, static_cast<float>(scale),
                       reinterpret_cast<T*>(out.data_ptr())};
    run<T>(p, items, dim);
  };
  switch (query.scalar_type()) {
    case at::kFloat: dispatch(float{}); break;
    case at::kBFloat16: dispatch(c10::BFloat16{}); break;
    case at::kHalf: dispatch(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_starts, Tensor query_lens, Tensor context_lens, int block_size, float scale, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("paged_attention", &paged_attention); }

}  // namespace baton_paged_attention
