// masked_scale: where(keep, x * scale, 0), where(keep, max(x, 0) * scale, 0), where(output > 0, x *
// scale, 0) and max(x, 0) as one MLX Primitive on every core: dropout, dropout after a ReLU, the
// gradient of either (or of a ReLU) from its output, and a ReLU. MLX's CPU select, multiply, maximum
// and comparison each make a pass on one thread; in an R50 training step at 512 x 683 its select alone was ~8% of the
// CPU time (perf), most of it these (in bfloat16 training 15%). The same operations, so the same bits: float32,
// or bfloat16 read into float32 and the product rounded back once, as MLX's bfloat16 operations do (the
// scale too is rounded to bfloat16 first, as MLX's multiply by a Python float rounds it). Like MLX's element-wise
// ops it writes into x's buffer where nothing else holds it.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <utility>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "bfloat16.h"
#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

// KEEP_VJP: KEEP's gradient as MLX's autodiff of the where gives it, (x * float(keep)) * scale: a
// dropped element is x * 0 (-0 for negative x, NaN for infinite), not +0.
// RELU: max(x, 0) * scale, no condition (a ReLU: scale 1).
enum Mode { KEEP = 0, KEEP_RELU = 1, POSITIVE = 2, KEEP_VJP = 3, RELU = 4 };

// T: float or bfloat16 (bfloat16.h: MLX's rounding). condition: keep
// (bool) or a ReLU's output (T, kept where positive); none for RELU. Written without branches, and built
// with -fno-trapping-math, so that the compiler makes vector selects of it: as branches on random keeps
// and signs (a ReLU's input) it mispredicted about every other element.
template <typename T, int MODE, bool SCALED>
static inline __attribute__((always_inline)) void masked_loop(const T* x, const void* condition, float scale, T* out,
                                                              int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {  // out may be x's buffer: element i is read before it is written
    const float xi = kernels_native::to_float(x[i]);
    float v = xi;
    if constexpr (MODE == KEEP_RELU || MODE == RELU) {
      const float positive = v > 0.0f ? v : 0.0f;
      v = v != v ? v : positive;  // MLX's Maximum(v, 0): NaN stays, -0 becomes +0
    }
    if constexpr (SCALED) {
      v = v * scale;  // where(output > 0, g, 0), a ReLU's gradient, has no multiply
    }
    if constexpr (MODE == RELU) {
      out[i] = kernels_native::from_float<T>(v);
    } else if constexpr (MODE == POSITIVE) {
      const float positive = kernels_native::to_float(static_cast<const T*>(condition)[i]);
      out[i] = kernels_native::from_float<T>(positive > 0.0f ? v : 0.0f);
    } else if constexpr (MODE == KEEP_VJP) {
      // MLX rounds x * float(keep) and then its product with the scale; x * 1 and x * 0 are exact, so one rounding
      const float dropped = SCALED ? (xi * 0.0f) * scale : xi * 0.0f;
      out[i] = kernels_native::from_float<T>(static_cast<const uint8_t*>(condition)[i] != 0 ? v : dropped);
    } else {
      out[i] = kernels_native::from_float<T>(static_cast<const uint8_t*>(condition)[i] != 0 ? v : 0.0f);
    }
  }
}

template <typename T, int MODE>
static inline __attribute__((always_inline)) void masked_span_body(const void* x, const void* condition, float scale,
                                                                   void* out, int64_t begin, int64_t end) {
  const T* in = static_cast<const T*>(x);
  T* o = static_cast<T*>(out);
  if (scale == 1.0f) {
    masked_loop<T, MODE, false>(in, condition, scale, o, begin, end);
  } else {
    masked_loop<T, MODE, true>(in, condition, scale, o, begin, end);
  }
}

template <typename T, int MODE>
void masked_span(const void* x, const void* condition, float scale, void* out, int64_t begin, int64_t end) {
  masked_span_body<T, MODE>(x, condition, scale, out, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same loops in AVX2's 8-wide registers (no FMA: nothing here multiplies and adds).
template <typename T, int MODE>
__attribute__((target("avx2"))) void masked_span_wide(const void* x, const void* condition, float scale, void* out,
                                                      int64_t begin, int64_t end) {
  masked_span_body<T, MODE>(x, condition, scale, out, begin, end);
}
static bool wide_supported() { return __builtin_cpu_supports("avx2"); }
#else
template <typename T, int MODE>
void masked_span_wide(const void*, const void*, float, void*, int64_t, int64_t) {}
static bool wide_supported() { return false; }
#endif

using Span = void (*)(const void*, const void*, float, void*, int64_t, int64_t);
template <typename T>
constexpr Span SPANS[] = {masked_span<T, KEEP>, masked_span<T, KEEP_RELU>, masked_span<T, POSITIVE>,
                          masked_span<T, KEEP_VJP>, masked_span<T, RELU>};  // by Mode
template <typename T>
constexpr Span WIDE_SPANS[] = {masked_span_wide<T, KEEP>, masked_span_wide<T, KEEP_RELU>,
                               masked_span_wide<T, POSITIVE>, masked_span_wide<T, KEEP_VJP>,
                               masked_span_wide<T, RELU>};

// The loop for x's dtype (float32 or bfloat16) and the mode; the scale as the multiply sees it (MLX's
// bfloat16 multiply by a Python float rounds the float to bfloat16 first).
std::pair<Span, float> span_for(mx::Dtype dtype, int mode, float scale) {
  static const bool wide = wide_supported();
  if (dtype == mx::bfloat16) {
    using kernels_native::bfloat16;
    return {(wide ? WIDE_SPANS<bfloat16> : SPANS<bfloat16>)[mode], kernels_native::rounded_to<bfloat16>(scale)};
  }
  return {(wide ? WIDE_SPANS<float> : SPANS<float>)[mode], scale};
}

class MaskedScale : public mx::UnaryPrimitive {
 public:
  MaskedScale(mx::Stream stream, int mode, float scale, int threads)
      : mx::UnaryPrimitive(stream), mode_(mode), scale_(scale), threads_(threads) {}

  // inputs: x (float32 or bfloat16), and (but for RELU) keep (bool) or output (x's dtype, kept where positive)
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out}, {0});
    const int64_t count = inputs[0].size();
    const void* x = inputs[0].data<void>();
    void* o = out.data<void>();
    const void* condition = inputs.size() > 1 ? inputs[1].data<void>() : nullptr;
    const int used = kernels_native::threads_for(count, threads_, 1 << 16);  // elements
    const auto [run, scale] = span_for(out.dtype(), mode_, scale_);
    encoder.dispatch([x, condition, o, count, scale, used, run]() {
      kernels_native::parallel_rows(count, used, [&](int, int64_t begin, int64_t end) {
        run(x, condition, scale, o, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels masked_scale runs on the CPU only");
  }

  // x's: the cotangent through the same condition and scale (KEEP's as MLX's autodiff of the where);
  // with the ReLU, where the output is positive (kept and x > 0), so that only the output is kept for
  // it. The condition's: zeros.
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>& outputs) override {
    const auto s = stream();
    const auto& output = outputs[0];
    const auto g = mx::astype(cotangents[0], output.dtype(), s);  // (already of it from MLX's autodiff)
    const auto through = [&](int mode, const array& condition) {
      return array(g.shape(), g.dtype(), std::make_shared<MaskedScale>(s, mode, scale_, threads_), {g, condition});
    };
    const bool from_output = mode_ == KEEP_RELU || mode_ == RELU;
    const array grad_x =
        from_output ? through(POSITIVE, output) : through(mode_ == POSITIVE ? POSITIVE : KEEP_VJP, primals[1]);
    if (mode_ == RELU) {
      return {grad_x};
    }
    return kernels_native::chosen({grad_x, mx::zeros_like(primals[1], s)}, argnums);
  }

  const char* name() const override { return "KernelsMaskedScale"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MaskedScale&>(other);
    return mode_ == o.mode_ && scale_ == o.scale_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int mode_;
  float scale_;
  int threads_;
};

array masked(const array& x, const std::optional<array>& condition, int mode, float scale, int threads) {
  if (!kernels_native::float32_or_bfloat16(x.dtype()) || (condition && condition->shape() != x.shape())) {
    throw std::invalid_argument("masked_scale: x float32 or bfloat16 and a condition of its shape");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(x, false, stream)};
  if (condition) {
    inputs.push_back(mx::contiguous(*condition, false, stream));
  }
  return array(x.shape(), x.dtype(), std::make_shared<MaskedScale>(stream, mode, scale, threads), std::move(inputs));
}

}  // namespace

array masked_scale(const array& x, const array& keep, float scale, bool relu, int threads) {
  if (keep.dtype() != mx::bool_) {
    throw std::invalid_argument("masked_scale: keep must be bool");
  }
  return masked(x, keep, relu ? KEEP_RELU : KEEP, scale, threads);
}

array relu(const array& x, int threads) { return masked(x, std::nullopt, RELU, 1.0f, threads); }

array scale_where_positive(const array& x, const array& output, float scale, int threads) {
  if (output.dtype() != x.dtype()) {
    throw std::invalid_argument("scale_where_positive: output must be of x's dtype");
  }
  return masked(x, output, POSITIVE, scale, threads);
}

}  // namespace kernels
