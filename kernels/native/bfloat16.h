// bfloat16 in the C++ operations: held as its 16 bits (MLX's layout), read into float32 exactly and
// rounded back as MLX rounds (mlx/types/bf16.h: to nearest even, NaN to 0x7FC0), so that an operation
// on bfloat16 gives MLX's bits. MLX's own type (a struct with a branch in its conversion) kept the
// compiler from vectorising a loop that reads it; these are plain integer operations.

#pragma once

#include <bit>
#include <cstdint>

#include "mlx/dtype.h"

namespace kernels_native {

using bfloat16 = uint16_t;

// float32 or bfloat16 (by `dtype`) read into float32
inline float to_float(float x) { return x; }
inline float to_float(bfloat16 bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

// float32 -> T (float or bfloat16), as MLX's conversion rounds
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline bfloat16 from_float<bfloat16>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto rounded = bfloat16((bits + ((bits >> 16) & 1) + 0x7FFFu) >> 16);
  return x != x ? bfloat16(0x7FC0) : rounded;
}

// x as T rounds it (x itself for float)
template <typename T>
inline float rounded_to(float x) {
  return to_float(from_float<T>(x));
}

// Whether the C++ operations that read float32 or bfloat16 take `dtype`.
inline bool float32_or_bfloat16(mlx::core::Dtype dtype) {
  return dtype == mlx::core::float32 || dtype == mlx::core::bfloat16;
}

}  // namespace kernels_native
