// Metal built-ins as plain C++, for running kernels that MLX assembles for `mx.fast.metal_kernel`
// on the CPU (see runtime.h). Only what the kernels of this project use.
#pragma once

#include "runtime.h"

#define device
#define constant
#define thread

namespace metal {}

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};
typedef _Float16 half;
typedef _Float16 float16_t;
typedef shim::bfloat16 bfloat16_t;

template <typename T>
struct atomic {
  T value;
};
enum memory_order { memory_order_relaxed };

template <typename T>
inline void atomic_fetch_add_explicit(atomic<T>* object, T value, memory_order) {
  object->value += value;
}

template <typename To, typename From>
inline To as_type(From from) {
  return shim::bit_cast<To>(from);
}

inline float simd_sum(float x) { return shim::collective(shim::kSum, x, 0); }
