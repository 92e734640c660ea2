// layer_norm over the last axis as MLX Primitives, on every core. x float32 or bfloat16 (read into
// float32: the numbers of MLX's layer norm of x widened to float32), weight and bias float32, the result
// in x's dtype (bfloat16 rounded once, as MLX's astype after it); the backward reads x and the cotangent
// in x's dtype, writes dx in it and dw, db in float32. Where a bfloat16 model widened its activations
// to float32 around the norm (two more passes each way), it now reads and writes them as they are.
//
// Forward: MLX's CPU layer norm bit for bit. On the CPU `mx.fast.layer_norm` is its fallback, a
// chain of MLX operations (mlx/fast.cpp): mean = sum * float(1.0 / n), the sums in order from zero;
// xc = x - mean; var = sum(xc * xc) * float(1.0 / n); y = xc * (1 / sqrt(var + eps)) * w + b, each
// step rounded. Those are about ten passes over the input on one thread, and the backward
// differentiates all of them; here a row is read once per pass, eight rows at a time.
// Backward: the usual closed form from the input (not MLX's graph, so not bit for bit):
// dx = r (g w - mean(g w) - xhat mean(g w xhat)), dw = sum(g xhat), db = sum(g) over the rows, the
// weight and bias sums in fixed blocks of rows added in order, whatever the thread count.

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "bfloat16.h"
#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

constexpr int ROWS = 8;             // rows whose sums run side by side (independent add chains)
constexpr int64_t BLOCK_ROWS = 64;  // rows per partial sum of the weight and bias gradients
constexpr int64_t ELEMENTS_PER_THREAD = 16384;  // the least a thread is given (parallel.h)

struct Rows {
  const void* x;  // float32 or bfloat16: the functions' T
  int64_t rows;
  int n;
  float inverse_n, eps;
};

using kernels_native::from_float, kernels_native::to_float;

// mean and 1 / sqrt(var + eps) of rows [row, row + count) of x (float32, rows of p.n), count <= ROWS, as MLX
// rounds them.
static inline __attribute__((always_inline)) void moments(const Rows& p, const float* x, int count, float* mean,
                                                          float* rstd) {
  float sum[ROWS] = {}, squares[ROWS] = {};
  for (int i = 0; i < p.n; ++i) {
    for (int r = 0; r < ROWS; ++r) {
      sum[r] += r < count ? x[r * p.n + i] : 0.0f;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    mean[r] = sum[r] * p.inverse_n;
  }
  for (int i = 0; i < p.n; ++i) {
    for (int r = 0; r < ROWS; ++r) {
      const float centred = (r < count ? x[r * p.n + i] : 0.0f) - mean[r];
      squares[r] += centred * centred;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    rstd[r] = 1.0f / std::sqrt(squares[r] * p.inverse_n + p.eps);
  }
}

// f(row, x, mean, rstd) for each row of [begin, end), x the row in float32, the moments computed ROWS rows at a
// time. bfloat16 rows are widened ROWS at a time into a float32 block first (a contiguous, vectorised pass over
// what then stays in the cache): the loops after it are float32's.
template <typename T, typename F>
static inline __attribute__((always_inline)) void each_row(const Rows& p, int64_t begin, int64_t end, F f) {
  float mean[ROWS], rstd[ROWS];
  std::vector<float> block(std::is_same_v<T, float> ? 0 : size_t(ROWS) * p.n);
  for (int64_t row = begin; row < end; row += ROWS) {
    const int count = int(std::min<int64_t>(ROWS, end - row));
    const T* x = static_cast<const T*>(p.x) + row * p.n;
    const float* rows = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      rows = x;
    } else {
      for (int64_t i = 0; i < int64_t(count) * p.n; ++i) {
        block[i] = to_float(x[i]);
      }
      rows = block.data();
    }
    moments(p, rows, count, mean, rstd);
    for (int r = 0; r < count; ++r) {
      f(row + r, rows + r * p.n, mean[r], rstd[r]);
    }
  }
}

template <typename T>
static inline __attribute__((always_inline)) void forward_body(const Rows& p, const float* w, const float* b,
                                                               void* out, int64_t begin, int64_t end) {
  each_row<T>(p, begin, end, [&](int64_t row, const float* x, float mean, float rstd) {
    T* y = static_cast<T*>(out) + row * p.n;
    for (int i = 0; i < p.n; ++i) {
      y[i] = from_float<T>((x[i] - mean) * rstd * w[i] + b[i]);
    }
  });
}

// dx for rows [begin, end); the rows' g * xhat and g added to dw_part and db_part (n each). x, g and dx of T.
template <typename T>
static inline __attribute__((always_inline)) void backward_body(const Rows& p, const float* w, const void* g,
                                                                void* dx, float* dw_part, float* db_part,
                                                                int64_t begin, int64_t end) {
  each_row<T>(p, begin, end, [&](int64_t row, const float* x, float mean, float rstd) {
    const T* gr = static_cast<const T*>(g) + row * p.n;
    T* d = static_cast<T*>(dx) + row * p.n;
    float sum_wg = 0.0f, sum_wg_xhat = 0.0f;
    for (int i = 0; i < p.n; ++i) {
      const float xhat = (x[i] - mean) * rstd;
      const float gi = to_float(gr[i]);
      const float wg = w[i] * gi;
      sum_wg += wg;
      sum_wg_xhat += wg * xhat;
      dw_part[i] += gi * xhat;
      db_part[i] += gi;
    }
    const float mean_wg = sum_wg * p.inverse_n, mean_wg_xhat = sum_wg_xhat * p.inverse_n;
    for (int i = 0; i < p.n; ++i) {
      const float xhat = (x[i] - mean) * rstd;
      d[i] = from_float<T>(rstd * (w[i] * to_float(gr[i]) - mean_wg - xhat * mean_wg_xhat));
    }
  });
}

using Forward = void (*)(const Rows&, const float*, const float*, void*, int64_t, int64_t);
using Backward = void (*)(const Rows&, const float*, const void*, void*, float*, float*, int64_t, int64_t);

template <typename T>
void forward_plain(const Rows& p, const float* w, const float* b, void* out, int64_t begin, int64_t end) {
  forward_body<T>(p, w, b, out, begin, end);
}
template <typename T>
void backward_plain(const Rows& p, const float* w, const void* g, void* dx, float* dw_part, float* db_part,
                    int64_t begin, int64_t end) {
  backward_body<T>(p, w, g, dx, dw_part, db_part, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same loops in AVX2's registers (no FMA: the sums and products round as MLX's do).
template <typename T>
__attribute__((target("avx2"))) void forward_wide(const Rows& p, const float* w, const float* b, void* out,
                                                  int64_t begin, int64_t end) {
  forward_body<T>(p, w, b, out, begin, end);
}
template <typename T>
__attribute__((target("avx2"))) void backward_wide(const Rows& p, const float* w, const void* g, void* dx,
                                                   float* dw_part, float* db_part, int64_t begin, int64_t end) {
  backward_body<T>(p, w, g, dx, dw_part, db_part, begin, end);
}
static bool wide_supported() { return __builtin_cpu_supports("avx2"); }
#else
template <typename T>
void forward_wide(const Rows&, const float*, const float*, void*, int64_t, int64_t) {}
template <typename T>
void backward_wide(const Rows&, const float*, const void*, void*, float*, float*, int64_t, int64_t) {}
static bool wide_supported() { return false; }
#endif

// The loops for x's dtype, in the widest registers this CPU has
Forward forward_for(mx::Dtype dtype) {
  static const bool wide = wide_supported();
  if (dtype == mx::bfloat16) {
    return wide ? forward_wide<kernels_native::bfloat16> : forward_plain<kernels_native::bfloat16>;
  }
  return wide ? forward_wide<float> : forward_plain<float>;
}
Backward backward_for(mx::Dtype dtype) {
  static const bool wide = wide_supported();
  if (dtype == mx::bfloat16) {
    return wide ? backward_wide<kernels_native::bfloat16> : backward_plain<kernels_native::bfloat16>;
  }
  return wide ? backward_wide<float> : backward_plain<float>;
}

Rows rows_of(const array& x, float eps) {
  const int n = x.shape(-1);
  return {x.data<void>(), n == 0 ? 0 : int64_t(x.size()) / n, n, float(1.0 / n), eps};
}

class LayerNormBackward : public mx::Primitive {
 public:
  LayerNormBackward(mx::Stream stream, float eps, int threads) : mx::Primitive(stream), eps_(eps), threads_(threads) {}

  // inputs: x, w, cotangent (x's dtype); outputs: dx (x's dtype), dw, db (float32)
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, outputs);
    encoder.dispatch([inputs, outputs, eps = eps_, threads = threads_]() mutable {
      const auto p = rows_of(inputs[0], eps);
      const float* w = inputs[1].data<float>();
      const void* g = inputs[2].data<void>();
      void* dx = outputs[0].data<void>();
      float *dw = outputs[1].data<float>(), *db = outputs[2].data<float>();
      const auto rows = backward_for(inputs[0].dtype());
      const int64_t blocks = (p.rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
      std::vector<float> parts(size_t(blocks) * 2 * p.n, 0.0f);  // per block: dw, then db
      const int used = kernels_native::threads_for(p.rows * p.n, threads, ELEMENTS_PER_THREAD);
      kernels_native::parallel_rows(blocks, used, [&](int, int64_t first, int64_t last) {
        for (int64_t block = first; block < last; ++block) {
          float* part = parts.data() + block * 2 * p.n;
          rows(p, w, g, dx, part, part + p.n, block * BLOCK_ROWS, std::min(p.rows, (block + 1) * BLOCK_ROWS));
        }
      });
      std::fill(dw, dw + p.n, 0.0f);
      std::fill(db, db + p.n, 0.0f);
      for (int64_t block = 0; block < blocks; ++block) {
        const float* part = parts.data() + block * 2 * p.n;
        for (int i = 0; i < p.n; ++i) {
          dw[i] += part[i];
          db[i] += part[p.n + i];
        }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("kernels layer_norm runs on the CPU only");
  }
  const char* name() const override { return "KernelsLayerNormBackward"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LayerNormBackward&>(other);
    return eps_ == o.eps_ && threads_ == o.threads_;
  }

 private:
  float eps_;
  int threads_;
};

class LayerNorm : public mx::UnaryPrimitive {
 public:
  LayerNorm(mx::Stream stream, float eps, int threads) : mx::UnaryPrimitive(stream), eps_(eps), threads_(threads) {}

  // inputs: x, w, b
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([inputs, out_ptr = out.data<void>(), eps = eps_, threads = threads_]() {
      const auto p = rows_of(inputs[0], eps);
      const float *w = inputs[1].data<float>(), *b = inputs[2].data<float>();
      const auto rows = forward_for(inputs[0].dtype());
      const int used = kernels_native::threads_for(p.rows * p.n, threads, ELEMENTS_PER_THREAD);
      kernels_native::parallel_rows(p.rows, used, [&](int, int64_t begin, int64_t end) {
        rows(p, w, b, out_ptr, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels layer_norm runs on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    const auto dtype = primals[0].dtype();
    const auto g = mx::contiguous(mx::astype(cotangents[0], dtype, stream()), false, stream());
    auto grads = array::make_arrays({primals[0].shape(), primals[1].shape(), primals[2].shape()},
                                    {dtype, mx::float32, mx::float32},
                                    std::make_shared<LayerNormBackward>(stream(), eps_, threads_),
                                    {primals[0], primals[1], g});
    return kernels_native::chosen(grads, argnums);
  }

  const char* name() const override { return "KernelsLayerNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LayerNorm&>(other);
    return eps_ == o.eps_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
  int threads_;
};

}  // namespace

array layer_norm(const array& x, const array& weight, const array& bias, float eps, int threads) {
  const int n = x.ndim() == 0 ? 0 : x.shape(-1);
  if (!kernels_native::float32_or_bfloat16(x.dtype()) || weight.dtype() != mx::float32 || bias.dtype() != mx::float32) {
    throw std::invalid_argument(
        "layer_norm: x float32 or bfloat16, weight and bias float32 (kernels.layer_norm hands other dtypes to MLX)");
  }
  if (x.ndim() == 0 || weight.ndim() != 1 || bias.ndim() != 1 || weight.shape(0) != n || bias.shape(0) != n) {
    throw std::invalid_argument("layer_norm: weight and bias must be (n,) for an input (..., n)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  auto prepared = [&](const array& a) { return mx::contiguous(a, false, stream); };
  return array(x.shape(), x.dtype(), std::make_shared<LayerNorm>(stream, eps, threads),
               {prepared(x), prepared(weight), prepared(bias)});
}

}  // namespace kernels
