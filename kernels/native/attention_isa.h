// The widest build of the CPU attention kernel (ms_deform_attn_kernel.h) a process may run: 2 AVX-512, 1 AVX2,
// 0 the baseline. kernels/native/__init__.py sets it from KERNELS_ATTENTION_ISA (kernels/settings.py) when it
// loads kernels._native, before the kernel's first use (the C++ reads no environment): one machine can then
// test and time the narrower builds.
#pragma once

#include <atomic>

namespace ms_deform_attn_cpu {

inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap = 2;
  return cap;
}

}  // namespace ms_deform_attn_cpu
