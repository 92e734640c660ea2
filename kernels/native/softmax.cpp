// softmax over the last axis as an MLX Primitive: MLX's CPU arithmetic (mlx/backend/cpu/softmax.cpp
// with its exp polynomial, simd/math.h), bit for bit, on every core and in vector instructions.
// MLX's Linux build evaluates that polynomial one element at a time, each fma a libm call (about 16
// ns an element); here the row's exponentials are one vectorisable loop. Its VJP is MLX's, in MLX
// operations (they are not where the time goes).

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/primitives.h"

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
// zero, then each multiplied by the reciprocal of the sum.
static inline __attribute__((always_inline)) void softmax_row(const float* __restrict in, float* __restrict out, int n) {
  float maximum = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    maximum = std::isnan(in[i]) ? in[i] : (in[i] > maximum ? in[i] : maximum);
  }
  for (int i = 0; i < n; ++i) {
    out[i] = mlx_exp(in[i] - maximum);
  }
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += out[i];
  }
  const float reciprocal = 1 / sum;
  for (int i = 0; i < n; ++i) {
    out[i] *= reciprocal;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// FMA is the polynomial's own (std::fma, one rounding as in MLX), not a contraction.
__attribute__((target("avx2,fma"))) void softmax_rows_wide(const float* in, float* out, int n, int64_t begin,
                                                          int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    softmax_row(in + row * n, out + row * n, n);
  }
}
static bool wide_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
void softmax_rows_wide(const float*, float*, int, int64_t, int64_t) {}
static bool wide_supported() { return false; }
#endif

void softmax_rows_plain(const float* in, float* out, int n, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    softmax_row(in + row * n, out + row * n, n);
  }
}

class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream stream, int threads) : mx::UnaryPrimitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const auto& in = inputs[0];
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const int n = in.ndim() == 0 ? 1 : in.shape(-1);
    const int64_t rows = n == 0 ? 0 : int64_t(in.size()) / n;
    encoder.dispatch([in_ptr = in.data<float>(), out_ptr = out.data<float>(), n, rows, threads = threads_]() {
      static const bool wide = wide_supported();
      const auto run = wide ? softmax_rows_wide : softmax_rows_plain;
      const int used = kernels_native::threads_for(rows * n, threads, 4096);  // elements
      kernels_native::parallel_rows(rows, used, [&](int, int64_t begin, int64_t end) {
        run(in_ptr, out_ptr, n, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels softmax runs on the CPU only");
  }

  // MLX's Softmax::vjp: s * g - s * sum(s * g)
  std::vector<array> vjp(const std::vector<array>&, const std::vector<array>& cotangents, const std::vector<int>&,
                         const std::vector<array>& outputs) override {
    const auto& s = outputs[0];
    auto sv = mx::multiply(s, cotangents[0], stream());
    return {mx::subtract(sv, mx::multiply(s, mx::sum(sv, std::vector<int>{-1}, true, stream()), stream()), stream())};
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
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("softmax: float32 only (kernels.softmax hands other dtypes to mx.softmax)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array(x.shape(), mx::float32, std::make_shared<Softmax>(stream, threads), {mx::contiguous(x, false, stream)});
}

}  // namespace kernels
