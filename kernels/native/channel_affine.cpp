// channel_affine: x * scale + shift over the last axis, optionally + residual, then optionally
// max(., 0), as one MLX Primitive on every core: a frozen batch norm and what follows it in a ResNet.
// MLX's CPU ops make a pass and one thread of each (multiply, add, add, maximum: 41 ms for a
// (1, 200, 267, 256) map with the residual, here 11). The same operations in the same order, so
// the same bits; the maximum propagates NaN as MLX's does. Like MLX's element-wise ops it writes into
// x's (or the residual's) buffer where nothing else holds it. Its VJP is in MLX operations.

#include <cmath>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

template <bool RESIDUAL, bool RELU>
void affine_rows(const float* x, const float* __restrict__ scale, const float* __restrict__ shift, const float* residual,
                 float* out, int64_t channels, int64_t begin, int64_t end) {  // out may be x's or residual's buffer
  for (int64_t row = begin; row < end; ++row) {
    const int64_t at = row * channels;
    for (int64_t c = 0; c < channels; ++c) {
      float y = x[at + c] * scale[c];
      y = y + shift[c];
      if constexpr (RESIDUAL) {
        y = y + residual[at + c];
      }
      if constexpr (RELU) {
        y = y != y ? y : (y > 0.0f ? y : 0.0f);  // MLX's Maximum(y, 0): NaN stays, -0 becomes +0
      }
      out[at + c] = y;
    }
  }
}

class ChannelAffine : public mx::UnaryPrimitive {
 public:
  ChannelAffine(mx::Stream stream, bool relu, int threads)
      : mx::UnaryPrimitive(stream), relu_(relu), threads_(threads) {}

  // inputs: x, scale, shift[, residual]
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const bool residual = inputs.size() == 4;
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out},
                                                     residual ? std::vector<int>{0, 3} : std::vector<int>{0});
    const int64_t channels = inputs[1].size();
    const int64_t rows = channels == 0 ? 0 : int64_t(inputs[0].size()) / channels;
    const auto run = residual ? (relu_ ? affine_rows<true, true> : affine_rows<true, false>)
                              : (relu_ ? affine_rows<false, true> : affine_rows<false, false>);
    encoder.dispatch([x = inputs[0].data<float>(), scale = inputs[1].data<float>(), shift = inputs[2].data<float>(),
                      r = residual ? inputs[3].data<float>() : nullptr, o = out.data<float>(), channels, rows, run,
                      threads = threads_]() {
      const int used = kernels_native::threads_for(rows * channels, threads, 1 << 16);  // elements
      kernels_native::parallel_rows(rows, used, [&](int, int64_t begin, int64_t end) {
        run(x, scale, shift, r, o, channels, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels channel_affine runs on the CPU only");
  }

  // g = the cotangent where the output is positive (with relu): x's g * scale, scale's and shift's the
  // sums over the rows of g * x and g, the residual's g.
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>& outputs) override {
    const auto s = stream();
    auto g = cotangents[0];
    if (relu_) {
      g = mx::where(mx::greater(outputs[0], mx::array(0.0f), s), g, mx::array(0.0f), s);
    }
    std::vector<array> grads{mx::multiply(g, primals[1], s),
                             kernels_native::sum_over_rows(mx::multiply(g, primals[0], s), s),
                             kernels_native::sum_over_rows(g, s)};
    if (primals.size() == 4) {
      grads.push_back(g);
    }
    return kernels_native::chosen(grads, argnums);
  }

  const char* name() const override { return "KernelsChannelAffine"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ChannelAffine&>(other);
    return relu_ == o.relu_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  bool relu_;
  int threads_;
};

}  // namespace

array channel_affine(const array& x, const array& scale, const array& shift, const std::optional<array>& residual,
                     bool relu, int threads) {
  const int channels = x.ndim() == 0 ? 0 : x.shape(-1);
  if (x.ndim() == 0 || scale.ndim() != 1 || shift.ndim() != 1 || scale.size() != size_t(channels) ||
      shift.size() != size_t(channels)) {
    throw std::invalid_argument("channel_affine: scale and shift must be (C,) for x (..., C)");
  }
  if (residual && residual->shape() != x.shape()) {
    throw std::invalid_argument("channel_affine: residual must have x's shape");
  }
  for (const auto* a : {&x, &scale, &shift, residual ? &*residual : &x}) {
    if (a->dtype() != mx::float32) {
      throw std::invalid_argument("channel_affine: float32 only (kernels.channel_affine hands others to MLX's ops)");
    }
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(x, false, stream), mx::contiguous(scale, false, stream),
                            mx::contiguous(shift, false, stream)};
  if (residual) {
    inputs.push_back(mx::contiguous(*residual, false, stream));
  }
  return array(x.shape(), mx::float32, std::make_shared<ChannelAffine>(stream, relu, threads), std::move(inputs));
}

}  // namespace kernels
