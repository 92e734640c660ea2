// softmax over the last axis as an MLX Primitive: MLX's CPU arithmetic (mlx/backend/cpu/softmax.cpp
// with its exp polynomial, simd/math.h), bit for bit, on every core and in vector instructions.
// MLX's Linux build evaluates that polynomial one element at a time, each fma a libm call (about 16
// ns an element); here the row's exponentials are one vectorisable loop. float32, or bfloat16 read
// into float32 and each result rounded back once, as MLX's precise bfloat16 softmax. Its VJP is MLX's
// (s * g - s * sum(s * g), each operation rounded to the dtype as MLX's ops round it, the sum
// accumulated in float32 as MLX's) in one primitive on every core, where MLX's ops made four passes
// and a reduction on one thread each.

#include <cmath>
#include <cstring>
#include <limits>
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

// simd::exp of MLX, the same operations in the same order.
static inline __attribute__((always_inline)) float mlx_exp(float x_init) {
  const float x = x_init * 1.442695f;  // log2(e)
  const float ipart = float(std::floor(double(x) + 0.5));  // MLX adds the double 0.5
  const float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = std::fma(p, fpart, 1.000000000000000f);
  // 2**ipart from its bits; clamped first (NaN to -127) only where the result is replaced below
  float clamped = ipart >= -127.0f ? ipart : -127.0f;
  clamped = clamped <= 128.0f ? clamped : 128.0f;
  const uint32_t bits = uint32_t(int32_t(clamped) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float result = x_init != x_init ? x_init : scale * p;
  result = x_init > 88.0f ? std::numeric_limits<float>::infinity() : result;
  return x_init < -88.0f ? 0.0f : result;
}

// One row as MLX's N = 1 loop: a NaN-propagating maximum, the exponentials summed in order from
// zero, then each multiplied by the reciprocal of the sum. `exps`: n floats of scratch (out itself
// for float32: the exponentials are stored there as MLX's loop does).
template <typename T>
static inline __attribute__((always_inline)) void softmax_row(const T* __restrict in, T* out, float* exps, int n) {
  float maximum = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    const float v = kernels_native::to_float(in[i]);
    maximum = std::isnan(v) ? v : (v > maximum ? v : maximum);
  }
  for (int i = 0; i < n; ++i) {
    exps[i] = mlx_exp(kernels_native::to_float(in[i]) - maximum);
  }
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += exps[i];
  }
  const float reciprocal = 1 / sum;
  for (int i = 0; i < n; ++i) {
    out[i] = kernels_native::from_float<T>(exps[i] * reciprocal);
  }
}

// The VJP of one row from the output s and the cotangent g, as MLX's ops compute s * g - s * sum(s * g)
// in T: each product and the difference rounded to T, the sum accumulated in float32 in order from
// zero and rounded to T once. s * g is computed again in the second loop rather than kept. dx may be g's
// buffer (element i read before it is written).
template <typename T>
static inline __attribute__((always_inline)) void softmax_vjp_row(const T* __restrict s, const T* g, T* dx, int n) {
  using kernels_native::rounded_to, kernels_native::to_float;
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += rounded_to<T>(to_float(s[i]) * to_float(g[i]));
  }
  const float total = rounded_to<T>(sum);
  for (int i = 0; i < n; ++i) {
    const float sv = rounded_to<T>(to_float(s[i]) * to_float(g[i]));
    dx[i] = kernels_native::from_float<T>(sv - rounded_to<T>(to_float(s[i]) * total));
  }
}

// Rows [begin, end) of rows of n: the forward (FORWARD, from x) or the VJP (from s and g).
template <typename T, bool FORWARD>
static inline __attribute__((always_inline)) void rows_body(const void* a, const void* b, void* out, int n,
                                                            int64_t begin, int64_t end) {
  std::vector<float> scratch(std::is_same_v<T, float> || !FORWARD ? 0 : n);
  for (int64_t row = begin; row < end; ++row) {
    const T* first = static_cast<const T*>(a) + row * n;
    T* o = static_cast<T*>(out) + row * n;
    if constexpr (!FORWARD) {
      softmax_vjp_row(first, static_cast<const T*>(b) + row * n, o, n);
    } else if constexpr (std::is_same_v<T, float>) {
      softmax_row(first, o, o, n);
    } else {
      softmax_row(first, o, scratch.data(), n);
    }
  }
}

using RowsRun = void (*)(const void*, const void*, void*, int, int64_t, int64_t);

template <typename T, bool FORWARD>
void rows_plain(const void* a, const void* b, void* out, int n, int64_t begin, int64_t end) {
  rows_body<T, FORWARD>(a, b, out, n, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// FMA is the polynomial's own (std::fma, one rounding as in MLX), not a contraction.
template <typename T, bool FORWARD>
__attribute__((target("avx2,fma"))) void rows_wide(const void* a, const void* b, void* out, int n, int64_t begin,
                                                   int64_t end) {
  rows_body<T, FORWARD>(a, b, out, n, begin, end);
}
static bool wide_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
template <typename T, bool FORWARD>
void rows_wide(const void*, const void*, void*, int, int64_t, int64_t) {}
static bool wide_supported() { return false; }
#endif

template <bool FORWARD>
RowsRun rows_for(mx::Dtype dtype) {
  static const bool wide = wide_supported();
  if (dtype == mx::bfloat16) {
    return wide ? rows_wide<kernels_native::bfloat16, FORWARD> : rows_plain<kernels_native::bfloat16, FORWARD>;
  }
  return wide ? rows_wide<float, FORWARD> : rows_plain<float, FORWARD>;
}

// rows of n of `out`'s size, run on up to `threads` threads
void run_rows(RowsRun run, const void* a, const void* b, void* out, int n, int64_t size, int threads) {
  const int64_t rows = n == 0 ? 0 : size / n;
  const int used = kernels_native::threads_for(rows * n, threads, 4096);  // elements
  kernels_native::parallel_rows(rows, used, [&](int, int64_t begin, int64_t end) { run(a, b, out, n, begin, end); });
}

// inputs: s (the softmax), g (the cotangent), of one dtype -> the gradient of the softmax's input
class SoftmaxVjp : public mx::UnaryPrimitive {
 public:
  SoftmaxVjp(mx::Stream stream, int threads) : mx::UnaryPrimitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out}, {1});
    const int n = out.ndim() == 0 ? 1 : out.shape(-1);
    encoder.dispatch([s = inputs[0].data<void>(), g = inputs[1].data<void>(), o = out.data<void>(), n,
                      size = int64_t(out.size()), run = rows_for<false>(out.dtype()), threads = threads_]() {
      run_rows(run, s, g, o, n, size, threads);  // o may be g's buffer: each row reads g before writing it
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels softmax runs on the CPU only");
  }
  const char* name() const override { return "KernelsSoftmaxVjp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const SoftmaxVjp&>(other).threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int threads_;
};

class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream stream, int threads) : mx::UnaryPrimitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const auto& in = inputs[0];
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const int n = in.ndim() == 0 ? 1 : in.shape(-1);
    encoder.dispatch([x = in.data<void>(), o = out.data<void>(), n, size = int64_t(in.size()),
                      run = rows_for<true>(in.dtype()), threads = threads_]() {
      run_rows(run, x, nullptr, o, n, size, threads);
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels softmax runs on the CPU only");
  }

  // MLX's Softmax::vjp, s * g - s * sum(s * g), as one primitive
  std::vector<array> vjp(const std::vector<array>&, const std::vector<array>& cotangents, const std::vector<int>&,
                         const std::vector<array>& outputs) override {
    const auto& s = outputs[0];
    const auto g = mx::contiguous(mx::astype(cotangents[0], s.dtype(), stream()), false, stream());
    return {array(s.shape(), s.dtype(), std::make_shared<SoftmaxVjp>(stream(), threads_), {s, g})};
  }

  const char* name() const override { return "KernelsSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const Softmax&>(other).threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int threads_;
};

}  // namespace

array softmax(const array& x, int threads) {
  if (!kernels_native::float32_or_bfloat16(x.dtype())) {
    throw std::invalid_argument("softmax: float32 or bfloat16 (kernels.softmax hands other dtypes to mx.softmax)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array(x.shape(), x.dtype(), std::make_shared<Softmax>(stream, threads), {mx::contiguous(x, false, stream)});
}

}  // namespace kernels
