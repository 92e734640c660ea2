// ms_deform_attn forward and backward on the CPU, multi-threaded, float32: the arithmetic of a
// sample point is sampling.h's, shared with the Metal and CUDA kernels. ms_deform_attn.cpp runs it
// inside MLX operations.
//
// Both go head by head on a (B, H, L, C) value (a (B, L, H, C) one is copied so first), so that one
// head's rows stay in the cache and a tap's right-hand neighbour is the next row in memory. The
// forward's threads split the (batch, head, query) samples in that order; the backward's split the
// (batch, head) pairs and take a pair's queries in order: each thread writes the value-gradient rows
// of its own heads only (no atomics, no private copies).

#pragma once

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

using std::fabs;
using std::floor;
using std::fmod;

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif
#define LANES 1
INLINE uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

#include "parallel.h"
#include "sampling.h"

// On x86-64 the loops are compiled three times, for AVX-512 (rows of 16 floats), for AVX2 (8) and
// for the baseline, and chosen by what the CPU reports (CI machines may have AVX2 only). Not FMA: a
// fused u * size - 0.5 rounds once where PyTorch rounds twice, and a location that lands on a pixel
// then takes the other one-sided gradient.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WIDE_TARGET __attribute__((target("avx2")))
#define WIDEST_TARGET __attribute__((target("avx2,avx512f,avx512vl,avx512dq,avx512bw")))
static bool wide_supported() { return __builtin_cpu_supports("avx2"); }
static bool widest_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
}
#else
#define WIDE_TARGET
#define WIDEST_TARGET
static bool wide_supported() { return false; }
static bool widest_supported() { return false; }
#endif

namespace ms_deform_attn_cpu {

using kernels_native::parallel_rows;

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
// scalar add after another; 8 lanes make it one vector accumulator.
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

// A row of CHANNELS (a multiple of 8) floats held in vector registers, for the channel count fixed
// at compile time. Written out because GCC kept the plain loops in memory (the forward's sum loaded
// and stored at every tap) or scalar (the backward's dot); the arithmetic is theirs, in their order,
// so the results are bit for bit those of the plain loops (forward and dot()).
typedef float float8 __attribute__((vector_size(32)));
typedef float float4 __attribute__((vector_size(16)));
#if defined(__GNUC__) && !defined(__clang__)
// GCC notes that a 32-byte vector passed by value has another ABI in its baseline build than with
// AVX; these helpers are always inlined, never called across that boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

INLINE float8 load8(const float* from) {  // rows are not 32-byte aligned
  float8 v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
INLINE void store8(float* to, const float8& v) {
  std::memcpy(to, &v, sizeof v);
}
INLINE float8 splat8(float w) {
  return float8{w, w, w, w, w, w, w, w};
}
typedef int32_t int32x8 __attribute__((vector_size(32)));
INLINE int32x8 load8i(const int* from) {
  int32x8 v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
INLINE void store8i(int* to, const int32x8& v) {
  std::memcpy(to, &v, sizeof v);
}

// Vectors of W floats and of W ints: W = 8 in the AVX2 and baseline builds, 16 in the AVX-512 one.
template <int W>
struct Vec;
template <>
struct Vec<8> {
  typedef float8 F;
  typedef int32x8 I;
};
typedef float float16 __attribute__((vector_size(64)));
typedef int32_t int32x16 __attribute__((vector_size(64)));
template <>
struct Vec<16> {
  typedef float16 F;
  typedef int32x16 I;
};
template <class V>
INLINE V load_vector(const void* from) {
  V v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
template <class V>
INLINE void store_vector(void* to, const V& v) {
  std::memcpy(to, &v, sizeof v);
}
// w in every lane, as a shuffle of lane 0: GCC lowers a braced list of 16 lanes in these generic
// helpers (built for the baseline, then inlined into the AVX-512 loops) as 16 masked broadcasts.
template <class V>
INLINE V splat(float w) {
  V v{};
  v[0] = w;
  if constexpr (sizeof(V) == sizeof(float16)) {
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  } else {
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
  }
}

// A row of CHANNELS (a multiple of W) floats in vectors of W. Each channel's sums are those of the
// plain loops, in their order, whatever W; dots_with adds W = 16 products as two halves of 8 so that
// its 8 partial sums are dot()'s.
template <int CHANNELS, int W = 8>
struct Row {
  static_assert(CHANNELS % W == 0, "a row is whole vectors");
  typedef typename Vec<W>::F V;
  static constexpr int parts = CHANNELS / W;
  V part[parts];

  INLINE Row zero() {
    Row r;
    for (auto& v : r.part) {
      v = V{};
    }
    return r;
  }
  INLINE Row load(const float* from) {
    Row r;
    for (int i = 0; i < parts; ++i) {
      r.part[i] = load_vector<V>(from + W * i);
    }
    return r;
  }
  __attribute__((always_inline)) void store(float* to) const {
    for (int i = 0; i < parts; ++i) {
      store_vector(to + W * i, part[i]);
    }
  }
  // this += w * from
  __attribute__((always_inline)) void add_scaled(float w, const float* from) {
    const V scale = splat<V>(w);
    for (int i = 0; i < parts; ++i) {
      part[i] += scale * load_vector<V>(from + W * i);
    }
  }
  // to += w * this
  __attribute__((always_inline)) void add_scaled_to(float w, float* to) const {
    const V scale = splat<V>(w);
    for (int i = 0; i < parts; ++i) {
      store_vector(to + W * i, load_vector<V>(to + W * i) + scale * part[i]);
    }
  }
  // dot(from[k], this) for the k < 4 taps of a point, each in dot()'s order; the four reduced
  // together, so that the adds across lanes are 3 vector adds instead of 4 x 7 scalar ones.
  __attribute__((always_inline)) float4 dots_with(const float* const* from) const {
    float4 half[4];
    for (int k = 0; k < 4; ++k) {
      float8 lanes{};
      for (int i = 0; i < parts; ++i) {
        const V product = load_vector<V>(from[k] + W * i) * part[i];
        if constexpr (W == 8) {
          lanes += product;
        } else {
          lanes += __builtin_shufflevector(product, product, 0, 1, 2, 3, 4, 5, 6, 7);
          lanes += __builtin_shufflevector(product, product, 8, 9, 10, 11, 12, 13, 14, 15);
        }
      }
      half[k] = float4{lanes[0] + lanes[4], lanes[1] + lanes[5], lanes[2] + lanes[6], lanes[3] + lanes[7]};
    }
    // ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) of each
    return pair_sums(pair_sums(half[0], half[1]), pair_sums(half[2], half[3]));
  }

 private:
  INLINE float4 pair_sums(float4 x, float4 y) {
    return float4{x[0] + x[1], x[2] + x[3], y[0] + y[1], y[2] + y[3]};
  }
};

// The taps of one (batch, query, head): every level and point, located first (from per-point copies
// of the levels' sizes) and their rows prefetched, so that the memory reads of the 4 * levels *
// points rows overlap.
struct Gathered {
  int n;  // points of a sample: levels * points
  // per point, fixed by the problem
  std::vector<float> scale_x, scale_y, width_f, height_f;
  std::vector<int> width, height, start;
  // per point of the current sample
  std::vector<float> ux, uy, attention, chain_x, chain_y;
  int64_t first_point;  // where its inputs are
  // per tap
  std::vector<int> index;
  std::vector<float> weight, dx, dy;
  std::vector<int64_t> row;  // element offset of the tap's row in value

  explicit Gathered(const Problem& p)
      : n(p.levels * p.points), scale_x(n), scale_y(n), width_f(n), height_f(n), width(n), height(n), start(n),
        ux(n), uy(n), attention(n), chain_x(n), chain_y(n), index(4 * n), weight(4 * n), dx(4 * n), dy(4 * n),
        row(4 * n) {
    for (int i = 0; i < n; ++i) {
      const int level = i / p.points;
      height[i] = p.spatial_shapes[2 * level];
      width[i] = p.spatial_shapes[2 * level + 1];
      height_f[i] = float(height[i]);
      width_f[i] = float(width[i]);
      scale_x[i] = p.align_corners ? float(width[i] - 1) : float(width[i]);
      scale_y[i] = p.align_corners ? float(height[i] - 1) : float(height[i]);
      start[i] = p.level_start_index[level];
    }
  }

  // Where tap k (of 4) of point i is kept: a tap's four values for eight points side by side.
  int tap(int i, int k) const { return k * n + i; }

  // Every point's taps: eight points at a time in vector registers, the rest one by one. (Sixteen
  // in the AVX-512 build were slower: 0.33 against 0.21 s of CPU time for the encoder-like forward;
  // GCC lowers these generic helpers for the baseline before inlining them, lane by lane at 16.)
  // The lanes take the arithmetic of sampling.h's clip_coordinate, sanitize and bilinear_taps lane by lane, so
  // outputs and gradients are those of the one-by-one code bit for bit (tests/test_cpu_kernel.py).
  // Locating was most of the forward's time, one point after another. GRADIENTS: also the taps'
  // derivatives (the backward's).
  template <int PADDING, bool GRADIENTS>
  __attribute__((always_inline)) void locate_points(const float* locations, bool align_corners) {
    const float offset = align_corners ? 0.0f : 0.5f;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      float8 x, y;
      coordinates(locations, i, x, y);
      locate_lanes<8, PADDING, GRADIENTS>(i, x, y, offset);
    }
    for (; i < n; ++i) {
      const Padded x = pad_coordinate(ux[i] * scale_x[i] - offset, width_f[i], PADDING, align_corners);
      const Padded y = pad_coordinate(uy[i] * scale_y[i] - offset, height_f[i], PADDING, align_corners);
      const Taps taps = bilinear_taps(x.x, y.x, width[i], height[i]);
      for (int k = 0; k < 4; ++k) {
        index[tap(i, k)] = start[i] + taps.index[k];
        weight[tap(i, k)] = taps.weight[k];
        if constexpr (GRADIENTS) {
          dx[tap(i, k)] = taps.dx[k];
          dy[tap(i, k)] = taps.dy[k];
        }
      }
      if constexpr (GRADIENTS) {
        chain_x[i] = x.dx * scale_x[i];
        chain_y[i] = y.dx * scale_y[i];
      }
    }
  }

  // x and y of points i to i + 7 straight from `locations` into vector registers. (Copied a float at
  // a time into ux and uy first, each vector load of them waited on eight stores that the CPU cannot
  // forward to one load: a fifth of the forward's time in `perf`.)
  __attribute__((always_inline)) void coordinates(const float* locations, int i, float8& x, float8& y) const {
    const float* at = locations + location_x(i);
    if (location.stride == 1) {
      x = load8(at);
      y = load8(locations + location_y(i));
      return;
    }
    const float8 low = load8(at), high = load8(at + 8);  // x, y, x, y, ...
    x = __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14);
    y = __builtin_shufflevector(low, high, 1, 3, 5, 7, 9, 11, 13, 15);
  }

  template <int W, int PADDING, bool GRADIENTS>
  __attribute__((always_inline)) void locate_lanes(int i, typename Vec<W>::F u, typename Vec<W>::F v, float offset) {
    static_assert(PADDING == 0 || PADDING == 1, "zeros or border");
    typedef typename Vec<W>::F F;
    typedef typename Vec<W>::I I;
    const F size_x = load_vector<F>(&width_f[i]), size_y = load_vector<F>(&height_f[i]);
    F x = u * load_vector<F>(&scale_x[i]) - offset;
    F y = v * load_vector<F>(&scale_y[i]) - offset;
    F slope_x = splat<F>(1.0f), slope_y = splat<F>(1.0f);
    if constexpr (PADDING == 1) {  // clip_coordinate
      slope_x = (x > 0.0f) & (x < size_x - 1.0f) ? slope_x : 0.0f;
      slope_y = (y > 0.0f) & (y < size_y - 1.0f) ? slope_y : 0.0f;
      x = x < 0.0f ? 0.0f : (x > size_x - 1.0f ? size_x - 1.0f : x);
      y = y < 0.0f ? 0.0f : (y > size_y - 1.0f ? size_y - 1.0f : y);
    }
    x = sanitized(x, size_x);
    y = sanitized(y, size_y);
    const F x0 = floored(x), y0 = floored(y);
    const F fx = x - x0, fy = y - y0;
    const F last_x = size_x - 1.0f, last_y = size_y - 1.0f;  // float(width - 1), exactly
    const I width_w = load_vector<I>(&width[i]), start_w = load_vector<I>(&start[i]);
    for (int k = 0; k < 4; ++k) {
      const int up = k / 2, right = k % 2;
      const F xi = x0 + float(right), yi = y0 + float(up);
      const I inside = (xi >= 0.0f) & (xi <= last_x) & (yi >= 0.0f) & (yi <= last_y);
      const F wx = right ? fx : 1.0f - fx;
      const F wy = up ? fy : 1.0f - fy;
      const I flat = __builtin_convertvector(yi, I) * width_w + __builtin_convertvector(xi, I);
      store_vector<I>(&index[tap(i, k)], start_w + (inside ? flat : 0));
      store_vector<F>(&weight[tap(i, k)], inside ? wx * wy : 0.0f);
      if constexpr (GRADIENTS) {
        store_vector<F>(&dx[tap(i, k)], inside ? (right ? wy : -wy) : 0.0f);
        store_vector<F>(&dy[tap(i, k)], inside ? (up ? wx : -wx) : 0.0f);
      }
    }
    if constexpr (GRADIENTS) {
      store_vector<F>(&chain_x[i], slope_x * load_vector<F>(&scale_x[i]));
      store_vector<F>(&chain_y[i], slope_y * load_vector<F>(&scale_y[i]));
    }
  }

  // sanitize(): far outside for NaN, bounded for infinities
  template <class F>
  INLINE F sanitized(F x, F size) {
    x = x != x ? -8.0f : x;
    return x < -8.0f ? -8.0f : (x > size + 8.0f ? size + 8.0f : x);
  }
  // floor() of values within [-8, 2^23): truncated, one less where that rounded up. It gives +0 for
  // -0, whose fraction then is -0 instead of +0: a zero whose sign reaches only sums that start at
  // +0, and a select less per point.
  template <class F>
  INLINE F floored(F x) {
    typedef decltype(x < x) I;  // the ints of F's width
    const F truncated = __builtin_convertvector(__builtin_convertvector(x, I), F);
    return truncated > x ? truncated - 1.0f : truncated;
  }

  int64_t location_x(int i) const { return location.x + i * location.stride; }
  int64_t location_y(int i) const { return location.y + i * location.stride; }
  int64_t point(int i) const { return first_point + i; }

  // Where the x and the y of a sample's first point are in `locations`, and their stride.
  struct Offsets {
    int64_t x, y, stride;
  };
  __attribute__((always_inline)) Offsets location_offsets(const Problem& p, int64_t point, int b) const {
    if (p.locations_b2qhlp) {
      const int64_t x = 2 * b * p.batch_points() + (point - b * p.batch_points());
      return {x, x + p.batch_points(), 1};
    }
    return {2 * point, 2 * point + 1, 2};
  }

  Offsets location;  // of the current sample

  __attribute__((always_inline)) void find_inputs(const Problem& p, int64_t sample, int b) {
    first_point = sample * n;
    location = location_offsets(p, first_point, b);
  }

  // The backward takes one head's samples, H samples apart in memory: the hardware does not see the
  // stride across pages, and the first read of each sample's locations waited on memory (an eighth
  // of the backward's time at the encoder shape). So the backward asks for a later sample's inputs,
  // and for the lines of its gradients, ahead.
  // The forward too (head by head): its first load of a sample's locations was a fifth of its time.
  __attribute__((always_inline)) void prefetch_inputs(const Problem& p, int64_t sample, int b) const {
    const int64_t point = sample * n;
    const Offsets start = location_offsets(p, point, b);
    for (int64_t at = 0; at < start.stride * n; at += 16) {  // 16 floats: a cache line
      __builtin_prefetch(p.locations + start.x + at);
      __builtin_prefetch(p.locations + start.y + at);
    }
    for (int at = 0; at < n; at += 16) {
      __builtin_prefetch(p.weights + point + at);
    }
  }
  __attribute__((always_inline)) void prefetch_sample(const Problem& p, int64_t sample, int b, int channels,
                                                      const float* grad_output, float* grad_locations,
                                                      float* grad_weights) {
    prefetch_inputs(p, sample, b);
    const int64_t point = sample * n;
    const Offsets start = location_offsets(p, point, b);
    for (int64_t at = 0; at < start.stride * n; at += 16) {
      __builtin_prefetch(grad_locations + start.x + at, 1);
      __builtin_prefetch(grad_locations + start.y + at, 1);
    }
    for (int at = 0; at < n; at += 16) {
      __builtin_prefetch(grad_weights + point + at, 1);
    }
    for (int at = 0; at < channels; at += 16) {
      __builtin_prefetch(grad_output + sample * channels + at);
    }
  }

  __attribute__((always_inline)) void locate_forward(const Problem& p, int64_t sample) {
    locate_all<false>(p, sample, int(sample / (int64_t(p.queries) * p.heads)), int(sample % p.heads));
  }

  // Locates the sample's taps and prefetches the rows of value and, in the backward, of the value
  // gradient (to be written).
  template <bool GRADIENTS>
  __attribute__((always_inline)) void locate_all(const Problem& p, int64_t sample, int b, int head,
                                                 const float* grad_value = nullptr) {
    find_inputs(p, sample, b);
    for (int i = 0; i < n; ++i) {
      attention[i] = p.weights[first_point + i];
    }
    for (int i = n - n % 8; i < n; ++i) {  // the points located one by one
      ux[i] = p.locations[location_x(i)];
      uy[i] = p.locations[location_y(i)];
    }
    if (p.padding == 1) {  // the padding mode fixed for the loop over the points
      locate_points<1, GRADIENTS>(p.locations, p.align_corners);
    } else {
      locate_points<0, GRADIENTS>(p.locations, p.align_corners);
    }
    const int64_t base = p.value_base(b, head);
    const int64_t row_stride = p.row_stride();
    for (int t = 0; t < 4 * n; ++t) {
      row[t] = base + index[t] * row_stride;
      __builtin_prefetch(p.value + row[t]);
      __builtin_prefetch(p.value + row[t] + 16);
      if (grad_value != nullptr) {
        __builtin_prefetch(grad_value + row[t], 1);
        __builtin_prefetch(grad_value + row[t] + 16, 1);
      }
    }
  }
};

// How many samples ahead (of one head: H samples apart in memory) the inputs are asked for.
constexpr int PREFETCH_AHEAD = 4;

// The forward's samples head by head: task = (b * heads + head) * queries + q; sample = (b * queries
// + q) * heads + head.
INLINE int64_t forward_sample(const Problem& p, int64_t task) {
  const int64_t pair = task / p.queries, q = task % p.queries;
  return ((pair / p.heads) * p.queries + q) * p.heads + pair % p.heads;
}

// CHANNELS > 0 fixes the channel count at compile time (the model's 32), so that the channel loops
// unroll into whole vectors; 0 reads it from the problem.
template <int CHANNELS, int W>
INLINE void forward_rows(const Problem& p, float* __restrict__ output, int64_t begin, int64_t end) {
  const int c_count = CHANNELS > 0 ? CHANNELS : p.channels;
  Gathered taps(p);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t sample = forward_sample(p, task);
    if (task + PREFETCH_AHEAD < end && (task + PREFETCH_AHEAD) / p.queries == task / p.queries) {
      taps.prefetch_inputs(p, sample + PREFETCH_AHEAD * p.heads, int(sample / (int64_t(p.queries) * p.heads)));
    }
    taps.locate_forward(p, sample);
    float* __restrict__ out = output + sample * c_count;
    auto sum = Row<(CHANNELS > 0 ? CHANNELS : W), W>::zero();  // used where CHANNELS > 0
    if constexpr (CHANNELS == 0) {
      std::fill(out, out + c_count, 0.0f);
    }
    for (int i = 0; i < taps.n; ++i) {
      for (int k = 0; k < 4; ++k) {
        const int t = taps.tap(i, k);
        const float w = taps.attention[i] * taps.weight[t];
        if (w == 0.0f) {
          continue;
        }
        const float* __restrict__ v = p.value + taps.row[t];
        if constexpr (CHANNELS > 0) {
          sum.add_scaled(w, v);
        } else {
          for (int c = 0; c < c_count; ++c) {
            out[c] += w * v[c];
          }
        }
      }
    }
    if constexpr (CHANNELS > 0) {
      sum.store(out);
    }
  }
}

template <int CHANNELS, int W>
INLINE void backward_rows(const Problem& p, const float* __restrict__ grad_output, float* __restrict__ grad_value,
                             float* __restrict__ grad_locations, float* __restrict__ grad_weights, int64_t begin,
                             int64_t end) {
  const int c_count = CHANNELS > 0 ? CHANNELS : p.channels;
  Gathered taps(p);
  // pair = b * heads + head: one head's queries in order, so that the rows of value and of its
  // gradient that they read stay in the cache (one head's share of value).
  for (int64_t pair = begin; pair < end; ++pair) {
    const int b = int(pair / p.heads), head = int(pair % p.heads);
    for (int64_t q = 0; q < p.queries; ++q) {
      const int64_t sample = (int64_t(b) * p.queries + q) * p.heads + head;
      if (q + PREFETCH_AHEAD < p.queries) {
        taps.prefetch_sample(p, sample + PREFETCH_AHEAD * p.heads, b, c_count, grad_output, grad_locations,
                             grad_weights);
      }
      taps.template locate_all<true>(p, sample, b, head, grad_value);
      const float* __restrict__ g = grad_output + sample * c_count;
      Row<(CHANNELS > 0 ? CHANNELS : W), W> g_row;  // used where CHANNELS > 0
      if constexpr (CHANNELS > 0) {
        g_row = Row<CHANNELS, W>::load(g);
      }
      for (int i = 0; i < taps.n; ++i) {
        const float attention = taps.attention[i];
        float slope_weight = 0.0f, slope_x = 0.0f, slope_y = 0.0f;
        float4 dots;  // <value row, g> of the point's four taps, where CHANNELS > 0
        if constexpr (CHANNELS > 0) {
          const float* rows[4];
          for (int k = 0; k < 4; ++k) {
            rows[k] = p.value + taps.row[taps.tap(i, k)];
          }
          dots = g_row.dots_with(rows);
        }
        for (int k = 0; k < 4; ++k) {
          const int t = taps.tap(i, k);
          float* __restrict__ gv = grad_value + taps.row[t];
          const float w = attention * taps.weight[t];
          float dot_vg;
          if constexpr (CHANNELS > 0) {
            dot_vg = dots[k];
            g_row.add_scaled_to(w, gv);
          } else {
            dot_vg = dot(p.value + taps.row[t], g, c_count);
            for (int c = 0; c < c_count; ++c) {
              gv[c] += w * g[c];
            }
          }
          slope_weight += taps.weight[t] * dot_vg;
          slope_x += taps.dx[t] * dot_vg;
          slope_y += taps.dy[t] * dot_vg;
        }
        grad_weights[taps.point(i)] = slope_weight;
        grad_locations[taps.location_x(i)] = attention * slope_x * taps.chain_x[i];
        grad_locations[taps.location_y(i)] = attention * slope_y * taps.chain_y[i];
      }
    }
  }
}

// The builds of the loops; W = 16 only where AVX-512 is there to hold it.
template <int CHANNELS>
WIDEST_TARGET void forward_rows_widest(const Problem& p, float* output, int64_t begin, int64_t end) {
  forward_rows<CHANNELS, 16>(p, output, begin, end);
}
template <int CHANNELS>
WIDE_TARGET void forward_rows_wide(const Problem& p, float* output, int64_t begin, int64_t end) {
  forward_rows<CHANNELS, 8>(p, output, begin, end);
}
template <int CHANNELS>
void forward_rows_plain(const Problem& p, float* output, int64_t begin, int64_t end) {
  forward_rows<CHANNELS, 8>(p, output, begin, end);
}
template <int CHANNELS>
WIDEST_TARGET void backward_rows_widest(const Problem& p, const float* grad_output, float* grad_value,
                                        float* grad_locations, float* grad_weights, int64_t begin, int64_t end) {
  backward_rows<CHANNELS, 16>(p, grad_output, grad_value, grad_locations, grad_weights, begin, end);
}
template <int CHANNELS>
WIDE_TARGET void backward_rows_wide(const Problem& p, const float* grad_output, float* grad_value,
                                    float* grad_locations, float* grad_weights, int64_t begin, int64_t end) {
  backward_rows<CHANNELS, 8>(p, grad_output, grad_value, grad_locations, grad_weights, begin, end);
}
template <int CHANNELS>
void backward_rows_plain(const Problem& p, const float* grad_output, float* grad_value, float* grad_locations,
                         float* grad_weights, int64_t begin, int64_t end) {
  backward_rows<CHANNELS, 8>(p, grad_output, grad_value, grad_locations, grad_weights, begin, end);
}

// The build this CPU runs: 2 AVX-512, 1 AVX2, 0 the baseline. KERNELS_ATTENTION_ISA (0, 1 or 2) caps
// it, so that one machine can time and test the narrower builds.
inline int isa_level() {
  static const int level = [] {
    int found = widest_supported() ? 2 : (wide_supported() ? 1 : 0);
    if (const char* cap = std::getenv("KERNELS_ATTENTION_ISA"); cap != nullptr && *cap >= '0' && *cap <= '2') {
      found = std::min(found, *cap - '0');
    }
    return found;
  }();
  return level;
}
template <class F>
INLINE F chosen(F widest, F wide, F plain) {
  const int level = isa_level();
  return level == 2 ? widest : (level == 1 ? wide : plain);
}

// Between (B, L, H, C) and (B, H, L, C) (to_heads_first or back): threads take rows (b, l) of the
// (B, L, H, C) side, read or written in order, each the H rows of C on the other side. Walking the
// other side in order instead (the H-strided reads of a head at a time) took 1.5-2x as long.
inline void swap_axes(const float* from, float* to, int batch, int length, int heads, int channels,
                      bool to_heads_first, int threads) {
  parallel_rows(int64_t(batch) * length, threads, [&](int, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / length, l = row % length;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t by_length = (row * heads + h) * channels, by_head = ((b * heads + h) * length + l) * channels;
        std::memcpy(to + (to_heads_first ? by_head : by_length), from + (to_heads_first ? by_length : by_head),
                    sizeof(float) * channels);
      }
    }
  });
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

// value (B, L, H, C) or (B, H, L, C); locations (B, Q, H, levels, points, 2) or (B, 2, Q, H, levels,
// points); weights (B, Q, H, levels, points); output (B, Q, H * C).
//
// A (B, L, H, C) value is copied to (B, H, L, C) first, where a tap's right-hand neighbour is the
// next row: points spread over the map (bench/attention.py's uniform ones) took twice as long on the
// value as it is (forward 0.19-0.24 s against 0.11-0.13 s, copy included); points near their query
// (the encoder's) take about a tenth longer with the copy (0.095-0.116 against 0.082-0.106 s), their
// forward + backward the same (bench/README.md).
inline void forward(const Problem& p, int threads, float* output) {
  if (!p.value_bnlc) {
    const auto copy = aligned_floats(int64_t(p.batch) * p.length * p.heads * p.channels);
    swap_axes(p.value, copy.get(), p.batch, p.length, p.heads, p.channels, true, threads);
    Problem by_head = p;
    by_head.value = copy.get();
    by_head.value_bnlc = true;
    forward(by_head, threads, output);
    return;
  }
  const auto rows = p.channels == 32 ? chosen(forward_rows_widest<32>, forward_rows_wide<32>, forward_rows_plain<32>)
                                     : chosen(forward_rows_widest<0>, forward_rows_wide<0>, forward_rows_plain<0>);
  parallel_rows(int64_t(p.batch) * p.queries * p.heads, threads, [&](int, int64_t begin, int64_t end) { rows(p, output, begin, end); });
}

// Every gradient is written in full. Threads split the (batch, head) pairs. A (B, L, H, C) value is
// taken through (B, H, L, C) copies of it and of its gradient: in that order one head's rows are one
// block (uniform points, the kernel alone: backward 0.55-0.67 s on (B, L, H, C), 0.29-0.35 s on
// (B, H, L, C), kernels/README.md).
inline void backward(const Problem& p, int threads, const float* grad_output, float* grad_value,
                     float* grad_locations, float* grad_weights) {
  const int64_t size = int64_t(p.batch) * p.length * p.heads * p.channels;
  if (!p.value_bnlc) {
    // The value's copy is kept in grad_value's buffer, which is free until the gradient, made in a
    // buffer of its own, is copied over it: one fresh value-sized buffer instead of two.
    swap_axes(p.value, grad_value, p.batch, p.length, p.heads, p.channels, true, threads);
    const auto grad = aligned_floats(size);
    Problem by_head = p;
    by_head.value = grad_value;
    by_head.value_bnlc = true;
    backward(by_head, threads, grad_output, grad.get(), grad_locations, grad_weights);
    swap_axes(grad.get(), grad_value, p.batch, p.length, p.heads, p.channels, false, threads);
    return;
  }
  const auto rows = p.channels == 32
                        ? chosen(backward_rows_widest<32>, backward_rows_wide<32>, backward_rows_plain<32>)
                        : chosen(backward_rows_widest<0>, backward_rows_wide<0>, backward_rows_plain<0>);
  parallel_rows(int64_t(p.batch) * p.heads, threads, [&](int, int64_t begin, int64_t end) {
    // the taps add into the gradient rows of the thread's own pairs: one block, zeroed here
    const int64_t block = int64_t(p.length) * p.channels;
    std::fill(grad_value + begin * block, grad_value + end * block, 0.0f);
    rows(p, grad_output, grad_value, grad_locations, grad_weights, begin, end);
  });
}

}  // namespace ms_deform_attn_cpu
