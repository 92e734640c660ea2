// CUDA built-ins as plain C++, for running kernels that MLX assembles for `mx.fast.cuda_kernel` on
// the CPU (see runtime.h). Only what the kernels of this project use; include/ stands in for the
// headers MLX's assembled source includes.
#pragma once

#include "runtime.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __grid_constant__

struct dim3 {
  unsigned int x, y, z;
};
#define threadIdx (dim3{unsigned(shim::current.index % shim::current.group), 0, 0})
#define blockIdx (dim3{unsigned(shim::current.index / shim::current.group), 0, 0})
#define blockDim (dim3{unsigned(shim::current.group), 1, 1})
#define gridDim (dim3{unsigned(shim::current.groups), 1, 1})

typedef _Float16 __half;
typedef shim::bfloat16 __nv_bfloat16;

inline unsigned int __float_as_uint(float x) { return shim::bit_cast<unsigned int>(x); }

inline float __shfl_xor_sync(unsigned int mask, float value, int lane_mask, int width = 32) {
  (void)mask;
  (void)width;
  return shim::collective(shim::kXor, value, lane_mask);
}

inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}
