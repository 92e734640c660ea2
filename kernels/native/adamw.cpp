// adamw_update: one AdamW step of a float32 parameter as mlx.optimizers.AdamW takes it (bias correction
// on), its gradient first multiplied by a scale (gradient clipping's factor), in one pass on every core.
// MLX makes about twelve passes of one thread each (multiply, add, square, sqrt, divide...): in an R50
// training step at 512 x 683 the optimizer took 0.25 s of a 5.7 s step on 2 cores (bench/step_parts.py),
// all of it on MLX's one stream thread. The same operations in the same order, each rounded as MLX
// rounds it (no fused multiply-adds: -ffp-contract=off), so the same bits. Its new parameter, m and v
// are new buffers (MLX's ops write most of theirs into their inputs'): an update holds three copies of
// the parameters more until it is evaluated, less than a training step's activations.

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

// factors: decay = 1 - lr * weight_decay, c1 = lr / (1 - beta1^step), c2 = rsqrt(1 - beta2^step),
// scale (the gradient's), each float32 as MLX computes them from the optimizer's state.
struct Constants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  bool operator==(const Constants&) const = default;
};

void adamw_span(const float* parameter, const float* gradient, const float* m, const float* v, const float* factors,
                const Constants& k, float* parameter_out, float* m_out, float* v_out, int64_t begin, int64_t end) {
  const float decay = factors[0], c1 = factors[1], c2 = factors[2], scale = factors[3];
  for (int64_t i = begin; i < end; ++i) {
    const float g = gradient[i] * scale;
    const float decayed = parameter[i] * decay;
    const float m_new = k.beta1 * m[i] + k.one_minus_beta1 * g;
    const float v_new = k.beta2 * v[i] + k.one_minus_beta2 * (g * g);
    const float numerator = c1 * m_new;
    const float denominator = std::sqrt(v_new) * c2 + k.eps;
    parameter_out[i] = decayed - numerator / denominator;
    m_out[i] = m_new;
    v_out[i] = v_new;
  }
}

class AdamW : public mx::Primitive {
 public:
  AdamW(mx::Stream stream, Constants constants, int threads)
      : mx::Primitive(stream), k_(constants), threads_(threads) {}

  // inputs: parameter, gradient, m, v (one shape), factors (4,); outputs: parameter, m, v
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    // fresh buffers: each of a multi-output primitive's outputs holds the inputs, so none is ever
    // MLX's to give away (the old parameter, m and v go when the update's evaluation ends)
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, outputs);
    const int64_t count = inputs[0].size();
    const int used = kernels_native::threads_for(count, threads_, 1 << 16);  // elements
    encoder.dispatch([p = inputs[0].data<float>(), g = inputs[1].data<float>(), m = inputs[2].data<float>(),
                      v = inputs[3].data<float>(), factors = inputs[4].data<float>(), k = k_,
                      p_out = outputs[0].data<float>(), m_out = outputs[1].data<float>(),
                      v_out = outputs[2].data<float>(), count, used]() {
      kernels_native::parallel_rows(count, used, [&](int, int64_t begin, int64_t end) {
        adamw_span(p, g, m, v, factors, k, p_out, m_out, v_out, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("kernels adamw_update runs on the CPU only");
  }

  const char* name() const override { return "KernelsAdamW"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AdamW&>(other);
    return k_ == o.k_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape(), inputs[0].shape()};
  }

 private:
  Constants k_;
  int threads_;
};

}  // namespace

std::vector<array> adamw_update(const array& parameter, const array& gradient, const array& m, const array& v,
                                const array& factors, float beta1, float one_minus_beta1, float beta2,
                                float one_minus_beta2, float eps, int threads) {
  for (const auto* a : {&parameter, &gradient, &m, &v, &factors}) {
    if (a->dtype() != mx::float32) throw std::invalid_argument("adamw_update: float32 arrays");
  }
  if (gradient.shape() != parameter.shape() || m.shape() != parameter.shape() || v.shape() != parameter.shape() ||
      factors.size() != 4) {
    throw std::invalid_argument("adamw_update: parameter, gradient, m and v of one shape, and 4 factors");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs;
  for (const auto* a : {&parameter, &gradient, &m, &v}) inputs.push_back(mx::contiguous(*a, false, stream));
  inputs.push_back(mx::contiguous(mx::reshape(factors, {4}, stream), false, stream));
  const Constants constants{beta1, one_minus_beta1, beta2, one_minus_beta2, eps};
  return array::make_arrays({parameter.shape(), parameter.shape(), parameter.shape()},
                            {mx::float32, mx::float32, mx::float32},
                            std::make_shared<AdamW>(stream, constants, threads), std::move(inputs));
}

}  // namespace kernels
