// The transformer layer's small ops, each one pass over its rows instead of torch's chain of
// ops (RMSNorm alone is eight on the CPU, ~45 us at 32 rows, for ~2 us of arithmetic).
//
// Each rounds where the reference (HF transformers' Llama, and common/engine/model.py's
// torch path) rounds: results of T-typed ops are rounded to T, sums and norms run in fp32.
// Rotary embedding gives the reference's bits exactly. RMSNorm's mean and SiLU's exponent
// differ from torch's in the last fp32 bits (summation order, polynomial), so a bf16 result
// can differ from torch's by one unit in the last place now and then.
//
// Contract: rows contiguous ([rows, width], or [tokens, heads, dim] with heads packed and
// any token stride for rotary), widths and head dims multiples of 16, one dtype throughout.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lanes.h"

namespace baton_elementwise {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

using namespace baton;

constexpr int64_t kElementsPerTask = 32768;  // a thread takes at least this many: small batches stay on one

int64_t grain_for(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / width); }

template <typename T>
void normalize_row(const T* src, const T* weight, T* dst, int64_t width, float eps) {
  Lanes squares = {};
  for (int64_t i = 0; i < width; i += kLanes) {
    const Lanes x = load_lanes(src + i);
    squares += x * x;
  }
  const float inverse_rms = 1.0f / std::sqrt(lane_sum(squares) / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; i += kLanes) {
    const Lanes normed = round_to<T>(load_lanes(src + i) * inverse_rms);
    store_lanes(dst + i, load_lanes(weight + i) * normed);
  }
}

template <typename T>
void add_row(T* residual, const T* delta, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes) store_lanes(residual + i, load_lanes(residual + i) + load_lanes(delta + i));
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* dst, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes) {
    const Lanes g = load_lanes(gate + i);
    const Lanes activated = round_to<T>(g / (1.0f + exp_lanes(-g)));
    store_lanes(dst + i, activated * load_lanes(up + i));
  }
}

// x * cos + swap_halves(x) * signed_sin, each product rounded to T before the sum, as the
// reference's three ops round.
template <typename T>
void rotate_head(T* x, const T* cos, const T* signed_sin, int64_t dim) {
  const int64_t half = dim / 2;
  Lanes rotated[512 / kLanes];
  for (int64_t i = 0; i < dim; i += kLanes) {
    const int64_t partner = i < half ? i + half : i - half;
    const Lanes straight = rounded_apart<T>(load_lanes(x + i) * load_lanes(cos + i));
    const Lanes swapped = rounded_apart<T>(load_lanes(x + partner) * load_lanes(signed_sin + i));
    rotated[i / kLanes] = straight + swapped;
  }
  for (int64_t i = 0; i < dim; i += kLanes) store_lanes(x + i, rotated[i / kLanes]);
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name, ": expected a contiguous CPU [rows, width]");
  TORCH_CHECK(t.size(1) % kWidthMultiple == 0, name, ": width must be a multiple of ", kWidthMultiple, ", got ",
              t.size(1));
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: expected a contiguous vector of the rows' width and dtype");
}

template <typename F>
void for_each_dtype(at::ScalarType dtype, const char* op, F&& body) {
  switch (dtype) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t width = x.size(1);
  for_each_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
    const T* w = reinterpret_cast<const T*>(weight.data_ptr());
    T* dst = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, x.size(0), grain_for(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) normalize_row(src + r * width, w, dst + r * width, width, eps);
    });
  });
  return out;
}

// residual += delta (rounded to T), then the RMSNorm of the sum: the residual stream's add
// and the next norm in one pass.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta: expected the residual's shape and dtype");
  check_weight(weight, residual);
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const int64_t width = residual.size(1);
  for_each_dtype(residual.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* sum = reinterpret_cast<T*>(residual.data_ptr());
    const T* d = reinterpret_cast<const T*>(delta.data_ptr());
    const T* w = reinterpret_cast<const T*>(weight.data_ptr());
    T* dst = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, residual.size(0), grain_for(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(sum + r * width, d + r * width, width);
        normalize_row(sum + r * width, w, dst + r * width, width, eps);
      }
    });
  });
  return out;
}

// gate_up [rows, 2 * width] (gate, then up) -> silu(gate) * up [rows, width].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % (2 * kWidthMultiple) == 0, "gate_up: width must be a multiple of ",
              2 * kWidthMultiple);
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  for_each_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(gate_up.data_ptr());
    T* dst = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, gate_up.size(0), grain_for(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(src + r * 2 * width, src + r * 2 * width + width, dst + r * width, width);
    });
  });
  return out;
}

void check_rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: expected [tokens, heads, dim] with heads packed and dim contiguous");
  const int64_t dim = x.size(2);
  TORCH_CHECK(dim % (2 * kWidthMultiple) == 0 && dim <= 512, "x: head dim must be a multiple of ",
              2 * kWidthMultiple, " up to 512, got ", dim);
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && cos.size(1) == dim && signed_sin.sizes() == cos.sizes() &&
                  signed_sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  signed_sin.scalar_type() == x.scalar_type(),
              "cos/signed_sin: expected contiguous [positions, dim] tables in x's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == x.size(0),
              "positions: expected a contiguous int64 vector, one per token");
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(position[t] >= 0 && position[t] < cos.size(0), "positions: ", position[t], " is outside the tables");
  }
}

// Rotates each token's heads of x (checked by check_rotary) in place, then calls
// after_token(t) while the token's rows are still in cache.
template <typename AfterToken>
void rotate_tokens(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& signed_sin,
                   int64_t grain, AfterToken&& after_token) {
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t dim = x.size(2), heads = x.size(1), token_stride = x.stride(0);
  for_each_dtype(x.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    T* data = reinterpret_cast<T*>(x.data_ptr());
    const T* c = reinterpret_cast<const T*>(cos.data_ptr());
    const T* s = reinterpret_cast<const T*>(signed_sin.data_ptr());
    at::parallel_for(0, x.size(0), grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          rotate_head(data + t * token_stride + h * dim, c + position[t] * dim, s + position[t] * dim, dim);
        }
        after_token(t);
      }
    });
  });
}

// x [tokens, heads, dim] rotated in place (GPT-NeoX half split) at each token's position;
// cos, signed_sin [positions, dim] tables (sin negated on the first half).
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& signed_sin) {
  check_rotary(x, positions, cos, signed_sin);
  rotate_tokens(x, positions, cos, signed_sin, grain_for(x.size(1) * x.size(2)), [](int64_t) {});
}

// rotary_embedding of query_key [tokens, q_heads + kv_heads, dim] (query heads first) with
// the layer's KV-cache write folded in: each token's rotated key heads and its value heads
// (value [tokens, kv_heads, dim]) go to its slot of kv_layer [2 (K, V), slots, kv_heads, dim]
// while they are in cache, instead of two index_copy_ passes over the step's K and V after.
void rotary_embedding_to_cache(at::Tensor& query_key, const at::Tensor& value, const at::Tensor& positions,
                               const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& kv_layer,
                               const at::Tensor& slot_mapping) {
  check_rotary(query_key, positions, cos, signed_sin);
  const int64_t tokens = query_key.size(0), heads = query_key.size(1), dim = query_key.size(2);
  TORCH_CHECK(kv_layer.device().is_cpu() && kv_layer.dim() == 4 && kv_layer.size(0) == 2 && kv_layer.is_contiguous() &&
                  kv_layer.size(3) == dim && kv_layer.size(2) < heads &&
                  kv_layer.scalar_type() == query_key.scalar_type(),
              "kv_layer: expected a contiguous [2, slots, kv_heads, dim] cache of query_key's dtype and head dim, "
              "with fewer KV heads than query_key has heads");
  const int64_t kv_heads = kv_layer.size(2), slots = kv_layer.size(1);
  TORCH_CHECK(value.device().is_cpu() && value.dim() == 3 && value.size(0) == tokens && value.size(1) == kv_heads &&
                  value.size(2) == dim && value.stride(2) == 1 && value.stride(1) == dim &&
                  value.scalar_type() == query_key.scalar_type(),
              "value: expected [tokens, kv_heads, dim] with heads packed and dim contiguous, in query_key's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == tokens,
              "slot_mapping: expected a contiguous int64 vector, one per token");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot_mapping: ", slot[t], " is outside the cache's ", slots,
                " slots");
  }
  const int64_t element = query_key.element_size(), row_bytes = kv_heads * dim * element;
  const char* keys = static_cast<const char*>(query_key.data_ptr()) + (heads - kv_heads) * dim * element;
  const char* values = static_cast<const char*>(value.data_ptr());
  const int64_t key_stride = query_key.stride(0) * element, value_stride = value.stride(0) * element;
  char* key_cache = static_cast<char*>(kv_layer.data_ptr());
  char* value_cache = key_cache + slots * row_bytes;
  rotate_tokens(query_key, positions, cos, signed_sin, grain_for((heads + kv_heads) * dim), [&](int64_t t) {
    std::memcpy(key_cache + slot[t] * row_bytes, keys + t * key_stride, row_bytes);
    std::memcpy(value_cache + slot[t] * row_bytes, values + t * value_stride, row_bytes);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor signed_sin) -> ()");
  m.def("rotary_embedding_to_cache(Tensor(a!) query_key, Tensor value, Tensor positions, Tensor cos, "
        "Tensor signed_sin, Tensor(b!) kv_layer, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_to_cache", &rotary_embedding_to_cache);
}

}  // namespace baton_elementwise
