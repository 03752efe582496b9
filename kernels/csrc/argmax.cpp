// Each row's argmax for greedy sampling, read from the logits in the model's dtype.
//
// torch's CPU argmax is a scalar loop (~1 ms for 32 rows of a 32k vocabulary), and the
// engine's torch way around it (common/engine/sampler.py argmax_rows: amax over blocks of
// columns, then argmax inside the best block) needs fp32 logits: for SmolLM2's 49,152
// columns at 32 rows, the bf16 -> fp32 copy and the block maxima took ~0.9 ms of a ~22 ms
// decode step. Here one pass keeps, per lane, its best value and where it first was.
//
// Result: torch.argmax(values, dim=-1)'s: the first index of the largest value; a NaN
// counts as larger than any number (the first NaN wins); a row of -inf gives 0.
// Contract: values [rows, width] fp32, bf16 or fp16 with unit column stride (any row
// stride), width >= 1; returns int64 [rows].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "lanes.h"

namespace baton_argmax {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

using namespace baton;

constexpr int64_t kElementsPerTask = 65536;  // a thread takes at least this many values

template <typename T>
int64_t argmax_row(const T* row, int64_t width) {
  Lanes best = splat(-kInfinity);
  IntLanes best_at = lane_numbers();  // a lane of -inf keeps its first
  IntLanes at = best_at;
  IntLanes nan = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes, at += static_cast<int32_t>(kLanes)) {
    const Lanes x = load_lanes(row + i);
    const IntLanes greater = x > best;  // strict: a lane keeps the first index of its best
    best = greater ? x : best;
    best_at = greater ? at : best_at;
    nan |= x != x;
  }
  float top = -kInfinity;
  int64_t top_at = width;  // beyond any index: the lanes' minimum below replaces it
  if (i > 0) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      if (nan[lane]) {  // rare: the first NaN, by a scalar pass
        for (int64_t j = 0;; ++j) {
          const float value = static_cast<float>(row[j]);
          if (value != value) return j;
        }
      }
    }
    top = lane_max(best);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      if (best[lane] == top && best_at[lane] < top_at) top_at = best_at[lane];
    }
  }
  for (; i < width; ++i) {  // the tail, after every lane's indices: only a larger value wins
    const float value = static_cast<float>(row[i]);
    if (value != value) return i;
    if (value > top || top_at == width) {
      top = value;
      top_at = i;
    }
  }
  return top_at;
}

at::Tensor argmax_rows(const at::Tensor& values) {
  TORCH_CHECK(values.device().is_cpu() && values.dim() == 2 && values.size(1) >= 1 && values.stride(1) == 1,
              "values: expected a CPU [rows, width] tensor with width >= 1 and unit column stride");
  const int64_t rows = values.size(0), width = values.size(1), row_stride = values.stride(0);
  at::Tensor out = at::empty({rows}, values.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* data = reinterpret_cast<const T*>(values.data_ptr());
    at::parallel_for(0, rows, std::max<int64_t>(1, kElementsPerTask / width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(data + r * row_stride, width);
    });
  };
  switch (values.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "argmax_rows: unsupported dtype ", values.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) { m.def("argmax_rows(Tensor values) -> Tensor"); }

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

}  // namespace baton_argmax
