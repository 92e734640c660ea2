// sin_cos: x -> (..., 2) [sin(x), cos(x)] as one MLX Primitive: mx.stack([mx.sin(x), mx.cos(x)], -1)
// bit for bit, on every core and in vector instructions. MLX's CPU sin and cos (simd/math.h's Cephes
// polynomial, with libm beyond |x| > 2^23) run one element at a time in its Linux build, each fma a
// libm call: about 29 ns an element, so R50's position encoding at 800 x 1066 (4.6 M sines and
// cosines) took ~0.12 s of a 2.7 s inference. Here both come from one argument reduction, as MLX
// computes each. Its VJP is in MLX operations.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

// MLX's simd::sincos for one float, the same operations in the same order, both results at once.
// emm2 = uint32(y): y < 2^24 whenever it is used (|x| <= 2^23); NaN gives 0, as MLX's baseline
// conversion does (and the result is NaN whatever emm2 is).
static inline __attribute__((always_inline)) void mlx_sincos(float in, float& sine, float& cosine) {
  uint32_t sign_sin = in < 0 ? 4u : 0u;  // masks as bit 4 (or 2), not bools: GCC vectorises these
  const float x_abs = std::fabs(in);
  float y = x_abs * 1.27323954473516f;  // 4 / pi
  uint32_t emm2 = uint32_t(int32_t(y < 16777216.0f ? y : 0.0f));
  emm2 = (emm2 + 1) & ~1u;
  y = float(int32_t(emm2));
  const uint32_t poly = emm2 & 2;
  float x = std::fma(y, -0.78515625f, x_abs);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);
  sign_sin = sign_sin ^ (emm2 & 4);
  const uint32_t sign_cos = (emm2 - 2) & 4;
  const float z = x * x;
  float y1 = std::fma(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = std::fma(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = std::fma(y1, z, 4.166664568298827e-2f);
  y2 = std::fma(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = std::fma(x, y2, x);
  y1 = std::fma(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  const float ys = poly ? y1 : y2, yc = poly ? y2 : y1;
  sine = sign_sin ? -ys : ys;
  cosine = sign_cos ? yc : -yc;
}

// The polynomial for every element, a block at a time (vectorisable loops: sines and cosines apart,
// then interleaved), then libm's sinf and cosf where MLX takes them (|x| > 2^23, infinities).
static inline __attribute__((always_inline)) void sin_cos_span(const float* __restrict in, float* __restrict out,
                                                               int64_t begin, int64_t end) {
  constexpr int64_t BLOCK = 256;
  float sines[BLOCK], cosines[BLOCK];
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t i = 0; i < n; ++i) {
      mlx_sincos(in[start + i], sines[i], cosines[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      out[2 * (start + i)] = sines[i];
      out[2 * (start + i) + 1] = cosines[i];
    }
  }
  for (int64_t i = begin; i < end; ++i) {
    if (std::fabs(in[i]) > 8388608.0f) {
      out[2 * i] = std::sin(in[i]);
      out[2 * i + 1] = std::cos(in[i]);
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// FMA is the polynomial's own (std::fma, one rounding as in MLX), not a contraction.
__attribute__((target("avx2,fma"))) void sin_cos_wide(const float* in, float* out, int64_t begin, int64_t end) {
  sin_cos_span(in, out, begin, end);
}
static bool wide_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
void sin_cos_wide(const float*, float*, int64_t, int64_t) {}
static bool wide_supported() { return false; }
#endif

void sin_cos_plain(const float* in, float* out, int64_t begin, int64_t end) { sin_cos_span(in, out, begin, end); }

class SinCos : public mx::UnaryPrimitive {
 public:
  SinCos(mx::Stream stream, int threads) : mx::UnaryPrimitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const auto& in = inputs[0];
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const int64_t count = in.size();
    encoder.dispatch([in_ptr = in.data<float>(), out_ptr = out.data<float>(), count, threads = threads_]() {
      static const bool wide = wide_supported();
      const auto run = wide ? sin_cos_wide : sin_cos_plain;
      const int used = kernels_native::threads_for(count, threads, 1 << 14);  // elements
      kernels_native::parallel_rows(count, used, [&](int, int64_t begin, int64_t end) {
        run(in_ptr, out_ptr, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels sin_cos runs on the CPU only");
  }

  // d sin = cos, d cos = -sin: g_sin * cos - g_cos * sin
  std::vector<array> vjp(const std::vector<array>&, const std::vector<array>& cotangents, const std::vector<int>&,
                         const std::vector<array>& outputs) override {
    const auto s = stream();
    const auto& g = cotangents[0];
    const auto& sc = outputs[0];
    const auto part = [&](const array& a, int i) { return mx::take(a, i, -1, s); };
    return {mx::subtract(mx::multiply(part(g, 0), part(sc, 1), s), mx::multiply(part(g, 1), part(sc, 0), s), s)};
  }

  const char* name() const override { return "KernelsSinCos"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const SinCos&>(other).threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.push_back(2);
    return {shape};
  }

 private:
  int threads_;
};

}  // namespace

array sin_cos(const array& x, int threads) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("sin_cos: float32 only (kernels.sin_cos hands other dtypes to mx.sin and mx.cos)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.push_back(2);
  return array(shape, mx::float32, std::make_shared<SinCos>(stream, threads), {mx::contiguous(x, false, stream)});
}

}  // namespace kernels
