// ms_deform_attn as MLX Primitives: MSDeformAttn (forward) and MSDeformAttnBackward (its three
// gradients at once), each evaluated by ms_deform_attn_kernel.h on MLX's CPU stream.

#include <numeric>
#include <stdexcept>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ms_deform_attn_kernel.h"
#include "ops.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

void require_contiguous(const std::vector<array>& inputs) {
  for (const auto& a : inputs) {
    if (!a.flags().row_contiguous) {
      throw std::runtime_error("ms_deform_attn: an input is not row-contiguous");
    }
  }
}

// The kernel's view of a call; the level offsets live in `starts` (kept alive by the caller).
ms_deform_attn_cpu::Problem problem(const std::vector<array>& inputs, const AttentionSpec& spec,
                                    const std::vector<int32_t>& starts) {
  const array &value = inputs[0], &locations = inputs[1], &weights = inputs[2];
  ms_deform_attn_cpu::Problem p;
  p.value = value.data<float>();
  p.spatial_shapes = spec.shapes.data();
  p.level_start_index = starts.data();
  p.locations = locations.data<float>();
  p.weights = weights.data<float>();
  p.batch = weights.shape(0);
  p.queries = weights.shape(1);
  p.heads = weights.shape(2);
  p.levels = weights.shape(3);
  p.points = weights.shape(4);
  p.length = spec.value_bnlc ? value.shape(2) : value.shape(1);
  p.channels = value.shape(3);
  p.value_bnlc = spec.value_bnlc;
  p.locations_b2qhlp = spec.locations_b2qhlp;
  p.align_corners = spec.align_corners;
  p.padding = spec.padding;
  return p;
}

std::vector<int32_t> level_starts(const AttentionSpec& spec) {
  std::vector<int32_t> starts(spec.shapes.size() / 2, 0);
  for (size_t level = 1; level < starts.size(); ++level) {
    starts[level] = starts[level - 1] + spec.shapes[2 * level - 2] * spec.shapes[2 * level - 1];
  }
  return starts;
}

class MSDeformAttnBackward : public mx::Primitive {
 public:
  MSDeformAttnBackward(mx::Stream stream, AttentionSpec spec, int threads)
      : mx::Primitive(stream), spec_(std::move(spec)), threads_(threads) {}

  // inputs: value, locations, weights, cotangent of the output.
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, outputs);
    encoder.dispatch([inputs, outputs, spec = spec_, threads = threads_]() mutable {
      require_contiguous(inputs);
      const auto starts = level_starts(spec);
      const auto p = problem(inputs, spec, starts);
      ms_deform_attn_cpu::backward(p, threads, inputs[3].data<float>(), outputs[0].data<float>(),
                                   outputs[1].data<float>(), outputs[2].data<float>());
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("MSDeformAttnBackward runs on the CPU only");
  }
  const char* name() const override { return "MSDeformAttnBackward"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MSDeformAttnBackward&>(other);
    return spec_ == o.spec_ && threads_ == o.threads_;
  }

 private:
  AttentionSpec spec_;
  int threads_;
};

class MSDeformAttn : public mx::UnaryPrimitive {
 public:
  MSDeformAttn(mx::Stream stream, AttentionSpec spec, int threads)
      : mx::UnaryPrimitive(stream), spec_(std::move(spec)), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([inputs, out_ptr = out.data<float>(), spec = spec_, threads = threads_]() {
      require_contiguous(inputs);
      const auto starts = level_starts(spec);
      ms_deform_attn_cpu::forward(problem(inputs, spec, starts), threads, out_ptr);
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("MSDeformAttn runs on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    std::vector<array> inputs = primals;
    inputs.push_back(mx::contiguous(cotangents[0], false, stream()));
    auto grads = array::make_arrays({primals[0].shape(), primals[1].shape(), primals[2].shape()},
                                    {mx::float32, mx::float32, mx::float32},
                                    std::make_shared<MSDeformAttnBackward>(stream(), spec_, threads_), inputs);
    return kernels_native::chosen(grads, argnums);
  }

  const char* name() const override { return "MSDeformAttn"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MSDeformAttn&>(other);
    return spec_ == o.spec_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    const auto& w = inputs[2];
    return {{w.shape(0), w.shape(1), w.shape(2) * inputs[0].shape(3)}};
  }

 private:
  AttentionSpec spec_;
  int threads_;
};

}  // namespace

array ms_deform_attn(const array& value, const array& locations, const array& weights, const AttentionSpec& spec,
                     int threads) {
  if (value.ndim() != 4 || locations.ndim() != 6 || weights.ndim() != 5 || spec.shapes.size() % 2 != 0 ||
      int(spec.shapes.size() / 2) != weights.shape(3)) {
    throw std::invalid_argument("ms_deform_attn: inconsistent ranks or level count (kernels checks the shapes first)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  auto prepared = [&](const array& a) { return mx::contiguous(mx::astype(a, mx::float32, stream), false, stream); };
  const auto& w = weights;
  return array({w.shape(0), w.shape(1), w.shape(2) * value.shape(3)}, mx::float32,
               std::make_shared<MSDeformAttn>(stream, spec, threads),
               {prepared(value), prepared(locations), prepared(weights)});
}

int attention_isa() { return ms_deform_attn_cpu::isa_level(); }

}  // namespace kernels
