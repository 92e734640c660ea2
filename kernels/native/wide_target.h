// On x86-64 the hot loops are compiled twice, for AVX2 and for the baseline, and chosen at run time
// by what the CPU reports: WIDE_TARGET marks the AVX2 copy, wide_supported() says whether it may run.
// Not FMA (that is another target flag): in the attention kernel a fused u * size - 0.5 rounds once
// where PyTorch rounds twice, and a location that lands on a pixel then takes the other one-sided
// gradient.

#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WIDE_TARGET __attribute__((target("avx2")))
static inline bool wide_supported() { return __builtin_cpu_supports("avx2"); }
#else
#define WIDE_TARGET
static inline bool wide_supported() { return false; }
#endif
