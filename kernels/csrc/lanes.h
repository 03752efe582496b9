// fp32 lanes as one value (GCC/Clang vector extensions), and the loads, stores and maths
// Baton's CPU kernels share. A Lanes is one register of what the build targets
// (kernels/native.py): sixteen lanes with AVX-512, eight without. GCC keeps a vector wider
// than the target's registers in memory and compares, selects, shuffles and broadcasts it
// lane by lane: sixteen lanes on an AVX2 build made its attention 4.8x slower than the
// AVX-512 build's. Kernels take kLanes as it is (sums over lanes then group their terms
// differently on the two builds, in the last bits).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace baton {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
// Widths and head dims the kernels take are multiples of this on every build, whatever
// kLanes is: a checkpoint that runs on one CPU runs on all.
constexpr int64_t kWidthMultiple = 16;
static_assert(kWidthMultiple % kLanes == 0, "a width the kernels take must be whole Lanes");
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t UintLanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t HalfwordLanes __attribute__((vector_size(kLanes * sizeof(uint16_t))));

constexpr float kInfinity = std::numeric_limits<float>::infinity();

inline Lanes splat(float value) { return Lanes{} + value; }

// 0, 1, ..., kLanes - 1.
inline IntLanes lane_numbers() {
  IntLanes numbers;
  for (int32_t i = 0; i < kLanes; ++i) numbers[i] = i;
  return numbers;
}

inline Lanes load_lanes(const float* src) {
  Lanes out;
  std::memcpy(&out, src, sizeof(out));
  return out;
}

inline Lanes load_lanes(const c10::BFloat16* src) {
  HalfwordLanes raw;
  std::memcpy(&raw, src, sizeof(raw));
  const UintLanes bits = __builtin_convertvector(raw, UintLanes) << 16;  // bf16 is fp32's top half
  return reinterpret_cast<const Lanes&>(bits);
}

inline Lanes load_lanes(const c10::Half* src) {
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<float>(src[i]);
  return out;
}

inline void store_lanes(float* dst, Lanes value) { std::memcpy(dst, &value, sizeof(value)); }

// Rounded to nearest, ties to even, as torch rounds fp32 to bf16; NaN stays a quiet NaN.
inline void store_lanes(c10::BFloat16* dst, Lanes value) {
  const UintLanes bits = reinterpret_cast<const UintLanes&>(value);
  const UintLanes rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const UintLanes result = value != value ? UintLanes{} + 0x7FC0u : rounded;
  const HalfwordLanes narrow = __builtin_convertvector(result, HalfwordLanes);
  std::memcpy(dst, &narrow, sizeof(narrow));
}

inline void store_lanes(c10::Half* dst, Lanes value) {
  for (int64_t i = 0; i < kLanes; ++i) dst[i] = static_cast<c10::Half>(value[i]);
}

// Through T and back: the rounding torch applies when an op's result is stored as T.
template <typename T>
inline Lanes round_to(Lanes value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // store_lanes' rounding, kept in fp32
    const UintLanes bits = reinterpret_cast<const UintLanes&>(value);
    const UintLanes rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const Lanes result = reinterpret_cast<const Lanes&>(rounded);
    return value != value ? value : result;
  } else {
    T stored[kLanes];
    store_lanes(stored, value);
    return load_lanes(stored);
  }
}

// round_to<T>, and for fp32 a barrier the compiler cannot see through, so that a product
// stays rounded on its own instead of being fused into a following add (which skips a
// rounding the reference makes).
template <typename T>
inline Lanes rounded_apart(Lanes value) {
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("" : "+m"(value));
    return value;
  } else {
    return round_to<T>(value);
  }
}

// e^x lane by lane (Cephes' expf polynomial after a Cody-Waite reduction; relative error
// ~1e-7; inputs clamped to [-87, 88], where fp32 neither overflows nor goes subnormal).
inline Lanes exp_lanes(Lanes x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  // Round to nearest by adding and removing 1.5 * 2^23.
  const Lanes n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const Lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const IntLanes bits = (__builtin_convertvector(n, IntLanes) + 127) << 23;
  return p * reinterpret_cast<const Lanes&>(bits);
}

inline Lanes lanes_max(Lanes a, Lanes b) { return a > b ? a : b; }

// The largest and the sum of the lanes, folded in halves: lane i with lane i + 8 (with
// sixteen lanes), then i + 4, i + 2, i + 1.
inline float lane_max(Lanes x) {
#if defined(__AVX512F__)
  x = lanes_max(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = lanes_max(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = lanes_max(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = lanes_max(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  x = lanes_max(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
  x = lanes_max(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
  x = lanes_max(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return x[0];
}

inline float lane_sum(Lanes x) {
#if defined(__AVX512F__)
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return x[0];
}

}  // namespace baton
