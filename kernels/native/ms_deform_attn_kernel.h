// ms_deform_attn forward and backward on the CPU, multi-threaded, float32: the arithmetic of a
// sample point is that of fused/sampling.h (the Metal and CUDA kernels' source), written out lane by
// lane in vectors. The loops are in ms_deform_attn_rows.h; ms_deform_attn.cpp runs them inside MLX
// operations.
//
// Both go head by head: a thread copies the (L, C) rows of the head it works on into a block of its
// own, whatever value's layout, so that they stay in its cache and a tap's right-hand neighbour is
// the next row. The threads take runs from a shared counter (parallel.h): the forward's a (batch,
// head) pair's queries or a part of them, the backward's a whole pair, its queries in order: each
// thread sums the value gradient of the heads it took only (no atomics), in a block it then copies out.

#pragma once

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#include "attention_isa.h"
#include "parallel.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC notes that a 32-byte vector passed by value has another ABI in its baseline build than with
// AVX; the loops' helpers are inlined, never called across that boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace ms_deform_attn_cpu {

using kernels_native::parallel_runs;

struct Problem {
  const float* value;
  const int32_t* spatial_shapes;  // (levels, 2): height, width
  const int32_t* level_start_index;
  const float* locations;
  const float* weights;
  int batch, length, heads, channels, queries, levels, points;
  bool value_bnlc, locations_b2qhlp, align_corners;
  int padding;  // 0 zeros, 1 border

  int64_t value_base(int b, int head) const {
    return value_bnlc ? (int64_t(b) * heads + head) * length * channels
                      : (int64_t(b) * length * heads + head) * channels;
  }
  int64_t row_stride() const { return value_bnlc ? channels : int64_t(heads) * channels; }
  int64_t batch_points() const { return int64_t(queries) * heads * levels * points; }
};

// <a, b> over n channels in 8 partial sums: a compiler keeps a plain running sum in order, one
// scalar add after another; 8 lanes make it one vector accumulator. The backward's dots (rows.h)
// are summed in this order.
INLINE float dot(const float* __restrict__ a, const float* __restrict__ b, int n) {
  float lanes[8] = {};
  int c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int j = 0; j < 8; ++j) {
      lanes[j] += a[c + j] * b[c + j];
    }
  }
  for (; c < n; ++c) {
    lanes[0] += a[c] * b[c];
  }
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// A buffer of floats on a 64-byte boundary: at 32 channels each row is then two whole cache lines,
// and no 64-byte load of the AVX-512 loops straddles two (new float[] gives 16 bytes).
struct AlignedDelete {
  void operator()(float* floats) const { ::operator delete[](floats, std::align_val_t(64)); }
};
inline std::unique_ptr<float[], AlignedDelete> aligned_floats(int64_t count) {
  return std::unique_ptr<float[], AlignedDelete>(
      static_cast<float*>(::operator new[](sizeof(float) * size_t(count), std::align_val_t(64))));
}

// On x86-64 with GCC the loops are built three times, for AVX-512 (vectors of 16 floats), for AVX2
// (8) and for the baseline (8, as SSE pairs), and chosen by what the CPU reports (CI machines may
// have AVX2 only). Never compile-wide -mavx512f. Not FMA (-ffp-contract=off): a fused
// u * size - 0.5 rounds once where PyTorch rounds twice, and a location that lands on a pixel then
// takes the other one-sided gradient.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MS_DEFORM_ATTN_BUILDS 3
namespace widest {
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512vl,avx512dq,avx512bw")
#define ROWS_W 16
#include "ms_deform_attn_rows.h"
#undef ROWS_W
#pragma GCC pop_options
}  // namespace widest
namespace wide {
#pragma GCC push_options
#pragma GCC target("avx2")
#define ROWS_W 8
#include "ms_deform_attn_rows.h"
#undef ROWS_W
#pragma GCC pop_options
}  // namespace wide
static bool widest_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
}
static bool wide_supported() { return __builtin_cpu_supports("avx2"); }
#else
#define MS_DEFORM_ATTN_BUILDS 1
static bool widest_supported() { return false; }
static bool wide_supported() { return false; }
#endif
namespace plain {
#define ROWS_W 8
#include "ms_deform_attn_rows.h"
#undef ROWS_W
}  // namespace plain
#if MS_DEFORM_ATTN_BUILDS == 1
namespace widest = plain;
namespace wide = plain;
#endif

// The build this CPU runs: 2 AVX-512, 1 AVX2, 0 the baseline, at most isa_cap() (attention_isa.h:
// KERNELS_ATTENTION_ISA, set when the module loads).
inline int isa_level() {
  static const int found = widest_supported() ? 2 : (wide_supported() ? 1 : 0);
  return std::min(found, isa_cap().load(std::memory_order_relaxed));
}
template <class F>
INLINE F chosen(F widest, F wide, F plain) {
  const int level = isa_level();
  return level == 2 ? widest : (level == 1 ? wide : plain);
}

// value (B, L, H, C) or (B, H, L, C); locations (B, Q, H, levels, points, 2) or (B, 2, Q, H, levels,
// points); weights (B, Q, H, levels, points); output (B, Q, H * C).
template <int CHANNELS>
void forward_rows(const Problem& p, float* output, kernels_native::Runs& runs, int64_t split) {
  chosen(widest::forward_rows<CHANNELS>, wide::forward_rows<CHANNELS>, plain::forward_rows<CHANNELS>)(p, output, runs,
                                                                                                    split);
}
// The loops keep a tap's row as an int32 offset (row x channels) into a head's block.
inline void check_offsets(const Problem& p) {
  if ((int64_t(p.length) + 1) * p.channels >= (int64_t(1) << 31)) {
    throw std::invalid_argument("ms_deform_attn (cpu): a head's value of " + std::to_string(p.length) + " x " +
                                std::to_string(p.channels) + " floats is past the kernel's 32-bit row offsets");
  }
}
inline void forward(const Problem& p, int threads, float* output) {
  check_offsets(p);
  const auto rows = p.channels == 32 ? forward_rows<32> : forward_rows<0>;
  // a run: a (batch, head) pair's queries, or a part of them where there are fewer pairs than
  // RUNS_PER_THREAD x threads (each run a thread takes in another pair copies that head's rows)
  const int64_t pairs = int64_t(p.batch) * p.heads;
  if (pairs == 0) {
    return;
  }
  const int64_t split = std::min<int64_t>(std::max<int64_t>(1, p.queries),
                                          (int64_t(threads) * kernels_native::RUNS_PER_THREAD + pairs - 1) / pairs);
  parallel_runs(pairs * split, threads, [&](int, kernels_native::Runs& runs) { rows(p, output, runs, split); });
}

// Every gradient is written in full. A run: one (batch, head) pair.
template <int CHANNELS>
void backward_rows(const Problem& p, const float* grad_output, float* grad_value, float* grad_locations,
                   float* grad_weights, kernels_native::Runs& runs) {
  chosen(widest::backward_rows<CHANNELS>, wide::backward_rows<CHANNELS>, plain::backward_rows<CHANNELS>)(
      p, grad_output, grad_value, grad_locations, grad_weights, runs);
}
inline void backward(const Problem& p, int threads, const float* grad_output, float* grad_value,
                     float* grad_locations, float* grad_weights) {
  check_offsets(p);
  const auto rows = p.channels == 32 ? backward_rows<32> : backward_rows<0>;
  parallel_runs(int64_t(p.batch) * p.heads, threads, [&](int, kernels_native::Runs& runs) {
    rows(p, grad_output, grad_value, grad_locations, grad_weights, runs);
  });
}

}  // namespace ms_deform_attn_cpu
