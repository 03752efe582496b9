// The argument checks both paged attention kernels share (paged_attention.cpp,
// amx_attention.cpp): layouts, index vectors, and every sequence's rows, context and
// blocks in range, so a bad batch is refused by name instead of read out of bounds.
// Dtypes and head dims are each kernel's own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace baton {

inline void check_index(const at::Tensor& t, const char* name, int64_t num_seqs) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.size(0) == num_seqs,
              name, ": expected a contiguous int64 vector of ", num_seqs, " entries");
}

inline void check_paged_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_table, const at::Tensor& query_starts,
                               const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
                               const at::Tensor& out) {
  TORCH_CHECK(query.device().is_cpu(), "paged attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: expected [tokens, heads, dim] with heads packed and dim contiguous");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.is_contiguous(),
              "key_cache/value_cache: expected equal contiguous [slots, kv_heads, dim]");
  TORCH_CHECK(key_cache.size(2) == query.size(2), "key_cache: head dim differs from the query's");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out: expected contiguous, query's shape");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous(),
              "block_table: expected contiguous int64 [seqs, width]");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t num_seqs = block_table.size(0), width = block_table.size(1);
  check_index(query_starts, "query_starts", num_seqs);
  check_index(query_lens, "query_lens", num_seqs);
  check_index(context_lens, "context_lens", num_seqs);
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t cache_blocks = key_cache.size(0) / block_size;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && contexts[s] >= lens[s] && starts[s] >= 0 && starts[s] + lens[s] <= query.size(0),
                "sequence ", s, ": query rows or context length out of range");
    const int64_t used_blocks = (contexts[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= width, "sequence ", s, ": context longer than its block table row");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int64_t block = table[s * width + b];
      TORCH_CHECK(block >= 0 && block < cache_blocks, "sequence ", s, ": block ", block, " is outside the cache");
    }
  }
}

}  // namespace baton
