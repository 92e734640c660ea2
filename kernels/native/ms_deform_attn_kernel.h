// ms_deform_attn forward and backward on the CPU, multi-threaded, float32: the arithmetic of a
// sample point is sampling.h's, shared with the Metal and CUDA kernels. ms_deform_attn.cpp runs it
// inside MLX operations.
//
// Threads split the (batch, query) rows. The backward scatters the value gradient into one buffer
// per thread (the first is the output), summed at the end: no atomics in the inner loop.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

using std::fabs;
using std::floor;
using std::fmod;

#define INLINE static inline
#define LANES 1
INLINE uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

#include "sampling.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTORIZE __attribute__((target_clones("avx2", "default")))
#else
#define VECTORIZE
#endif

namespace ms_deform_attn_cpu {

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
    return value_bnlc ? int64_t(b * heads + head) * length * channels
                      : (int64_t(b) * length * heads + head) * channels;
  }
  int64_t row_stride() const { return value_bnlc ? channels : int64_t(heads) * channels; }
  int64_t batch_points() const { return int64_t(queries) * heads * levels * points; }
  int64_t location_x(int b, int64_t point) const {
    return locations_b2qhlp ? 2 * b * batch_points() + (point - b * batch_points()) : 2 * point;
  }
  int64_t location_y(int b, int64_t point) const {
    return locations_b2qhlp ? location_x(b, point) + batch_points() : 2 * point + 1;
  }
};

// Where a point samples: taps, and d pixel / d location for each axis.
struct Sample {
  Taps taps;
  float chain_x, chain_y;
};

INLINE Sample locate(const Problem& p, int level, float ux, float uy) {
  const int height = p.spatial_shapes[2 * level];
  const int width = p.spatial_shapes[2 * level + 1];
  const float scale_x = p.align_corners ? float(width - 1) : float(width);
  const float scale_y = p.align_corners ? float(height - 1) : float(height);
  const float offset = p.align_corners ? 0.0f : 0.5f;
  const Padded x = pad_coordinate(ux * scale_x - offset, float(width), p.padding, p.align_corners);
  const Padded y = pad_coordinate(uy * scale_y - offset, float(height), p.padding, p.align_corners);
  Sample s;
  s.taps = bilinear_taps(x.x, y.x, width, height);
  s.chain_x = x.dx * scale_x;
  s.chain_y = y.dx * scale_y;
  return s;
}

template <typename Work>
void parallel_rows(int rows, int threads, Work work) {
  threads = threads < 1 ? 1 : (threads > rows ? (rows > 0 ? rows : 1) : threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back(work, t, int64_t(rows) * t / threads, int64_t(rows) * (t + 1) / threads);
  }
  work(0, 0, int64_t(rows) / threads);
  for (auto& thread : pool) {
    thread.join();
  }
}

// CHANNELS > 0 fixes the channel count at compile time (the model's 32), so that the channel loops
// unroll into whole vectors; 0 reads it from the problem.
// The taps of one (batch, query, head): every level and point, located first and their rows
// prefetched, so that the memory reads of the 4 * levels * points rows overlap.
struct Gathered {
  std::vector<int64_t> row;  // element offset of the tap's row in value
  std::vector<float> weight, dx, dy;
  std::vector<float> chain_x, chain_y, attention;  // per point
  std::vector<int64_t> location_x, location_y, point;

  explicit Gathered(const Problem& p)
      : row(4 * p.levels * p.points), weight(row.size()), dx(row.size()), dy(row.size()),
        chain_x(p.levels * p.points), chain_y(chain_x.size()), attention(chain_x.size()),
        location_x(chain_x.size()), location_y(chain_x.size()), point(chain_x.size()) {}

  // Prefetches the rows of value and, in the backward, of the value gradient (to be written).
  void locate_all(const Problem& p, int64_t sample, int b, int head, const float* grad_value = nullptr) {
    const int64_t base = p.value_base(b, head);
    const int64_t row_stride = p.row_stride();
    for (int level = 0, i = 0; level < p.levels; ++level) {
      const int start = p.level_start_index[level];
      for (int point_index = 0; point_index < p.points; ++point_index, ++i) {
        point[i] = (sample * p.levels + level) * p.points + point_index;
        location_x[i] = p.location_x(b, point[i]);
        location_y[i] = p.location_y(b, point[i]);
        const Sample s = locate(p, level, p.locations[location_x[i]], p.locations[location_y[i]]);
        attention[i] = p.weights[point[i]];
        chain_x[i] = s.chain_x;
        chain_y[i] = s.chain_y;
        for (int k = 0; k < 4; ++k) {
          const int t = 4 * i + k;
          row[t] = base + (start + s.taps.index[k]) * row_stride;
          weight[t] = s.taps.weight[k];
          dx[t] = s.taps.dx[k];
          dy[t] = s.taps.dy[k];
          __builtin_prefetch(p.value + row[t]);
          __builtin_prefetch(p.value + row[t] + 16);
          if (grad_value != nullptr) {
            __builtin_prefetch(grad_value + row[t], 1);
            __builtin_prefetch(grad_value + row[t] + 16, 1);
          }
        }
      }
    }
  }
};

// CHANNELS > 0 fixes the channel count at compile time (the model's 32), so that the channel loops
// unroll into whole vectors; 0 reads it from the problem.
template <int CHANNELS>
VECTORIZE void forward_rows(const Problem& p, float* __restrict__ output, int64_t begin, int64_t end) {
  const int c_count = CHANNELS > 0 ? CHANNELS : p.channels;
  Gathered taps(p);
  for (int64_t row = begin; row < end; ++row) {  // row = b * queries + q
    const int b = int(row / p.queries);
    for (int head = 0; head < p.heads; ++head) {
      const int64_t sample = row * p.heads + head;
      taps.locate_all(p, sample, b, head);
      float* __restrict__ out = output + sample * c_count;
      for (int c = 0; c < c_count; ++c) {
        out[c] = 0.0f;
      }
      for (size_t t = 0; t < taps.row.size(); ++t) {
        const float w = taps.attention[t / 4] * taps.weight[t];
        if (w == 0.0f) {
          continue;
        }
        const float* __restrict__ v = p.value + taps.row[t];
        for (int c = 0; c < c_count; ++c) {
          out[c] += w * v[c];
        }
      }
    }
  }
}

template <int CHANNELS>
VECTORIZE void backward_rows(const Problem& p, const float* __restrict__ grad_output, float* __restrict__ grad_value,
                             float* __restrict__ grad_locations, float* __restrict__ grad_weights, int64_t begin,
                             int64_t end) {
  const int c_count = CHANNELS > 0 ? CHANNELS : p.channels;
  Gathered taps(p);
  for (int64_t row = begin; row < end; ++row) {
    const int b = int(row / p.queries);
    for (int head = 0; head < p.heads; ++head) {
      const int64_t sample = row * p.heads + head;
      taps.locate_all(p, sample, b, head, grad_value);
      const float* __restrict__ g = grad_output + sample * c_count;
      for (size_t i = 0; i < taps.point.size(); ++i) {
        const float attention = taps.attention[i];
        float slope_weight = 0.0f, slope_x = 0.0f, slope_y = 0.0f;
        for (int k = 0; k < 4; ++k) {
          const size_t t = 4 * i + k;
          const float* __restrict__ v = p.value + taps.row[t];
          float* __restrict__ gv = grad_value + taps.row[t];
          const float w = attention * taps.weight[t];
          float dot = 0.0f;
          for (int c = 0; c < c_count; ++c) {  // one pass: <grad, tap value> and the value gradient
            dot += v[c] * g[c];
            gv[c] += w * g[c];
          }
          slope_weight += taps.weight[t] * dot;
          slope_x += taps.dx[t] * dot;
          slope_y += taps.dy[t] * dot;
        }
        grad_weights[taps.point[i]] = slope_weight;
        grad_locations[taps.location_x[i]] = attention * slope_x * taps.chain_x[i];
        grad_locations[taps.location_y[i]] = attention * slope_y * taps.chain_y[i];
      }
    }
  }
}

// value (B, L, H, C) or (B, H, L, C); locations (B, Q, H, levels, points, 2) or (B, 2, Q, H, levels,
// points); weights (B, Q, H, levels, points); output (B, Q, H * C).
inline void forward(const Problem& p, int threads, float* output) {
  parallel_rows(p.batch * p.queries, threads, [&](int, int64_t begin, int64_t end) {
    if (p.channels == 32) {
      forward_rows<32>(p, output, begin, end);
    } else {
      forward_rows<0>(p, output, begin, end);
    }
  });
}

// grad_value must hold zeros; grad_locations and grad_weights are written in full.
inline void backward(const Problem& p, int threads, const float* grad_output, float* grad_value,
                     float* grad_locations, float* grad_weights) {
  const int rows = p.batch * p.queries;
  threads = threads < 1 ? 1 : (threads > rows ? (rows > 0 ? rows : 1) : threads);
  const int64_t size = int64_t(p.batch) * p.length * p.heads * p.channels;
  std::vector<std::vector<float>> private_buffers(threads - 1, std::vector<float>());
  parallel_rows(rows, threads, [&](int t, int64_t begin, int64_t end) {
    float* buffer = grad_value;
    if (t > 0) {
      private_buffers[t - 1].assign(size, 0.0f);
      buffer = private_buffers[t - 1].data();
    }
    if (p.channels == 32) {
      backward_rows<32>(p, grad_output, buffer, grad_locations, grad_weights, begin, end);
    } else {
      backward_rows<0>(p, grad_output, buffer, grad_locations, grad_weights, begin, end);
    }
  });
  if (threads > 1) {  // sum the private buffers into the output, split by element ranges
    parallel_rows(threads, threads, [&](int t, int64_t, int64_t) {
      const int64_t lo = size * t / threads, hi = size * (t + 1) / threads;
      for (const auto& buffer : private_buffers) {
        for (int64_t i = lo; i < hi; ++i) {
          grad_value[i] += buffer[i];
        }
      }
    });
  }
}

}  // namespace ms_deform_attn_cpu
