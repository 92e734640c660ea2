// kernels._native: the Python face of ops.h (nanobind, in MLX's domain so that mlx.core.array
// passes through as mlx::core::array).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "attention_isa.h"
#include "mlx/version.h"
#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_native, m) {
  m.doc() =
      "MLX operations in C++ for kernels: ms_deform_attn on the CPU, linear_assignment, softmax, layer_norm, "
      "patches and unpatches, bernoulli16, channel_affine, broadcast_rows, sin_cos, masked_scale, relu, "
      "adamw_update";
  m.attr("mlx_version") = mlx::core::version();
  m.def(
      "ms_deform_attn",
      [](const kernels::array& value, const kernels::array& locations, const kernels::array& weights,
         std::vector<int> shapes, bool value_bnlc, bool locations_b2qhlp, bool align_corners, int padding,
         int threads) {
        return kernels::ms_deform_attn(value, locations, weights,
                                       {std::move(shapes), value_bnlc, locations_b2qhlp, align_corners, padding},
                                       threads);
      },
      "value"_a, "locations"_a, "weights"_a, "shapes"_a, "value_bnlc"_a, "locations_b2qhlp"_a, "align_corners"_a,
      "padding"_a, "threads"_a);
  m.def("linear_assignment", &kernels::linear_assignment, "cost"_a, "sizes"_a);
  m.def("softmax", &kernels::softmax, "x"_a, "threads"_a);
  m.def("layer_norm", &kernels::layer_norm, "x"_a, "weight"_a, "bias"_a, "eps"_a, "threads"_a);
  m.def("patches", &kernels::patches, "x"_a, "kernel_h"_a, "kernel_w"_a, "stride"_a, "padding"_a, "dilation"_a,
        "threads"_a);
  m.def("unpatches", &kernels::unpatches, "columns"_a, "height"_a, "width"_a, "kernel_h"_a, "kernel_w"_a, "stride"_a,
        "padding"_a, "dilation"_a, "threads"_a);
  m.def("bernoulli16", &kernels::bernoulli16, "key"_a, "shape"_a, "threshold"_a, "threads"_a);
  m.def("channel_affine", &kernels::channel_affine, "x"_a, "scale"_a, "shift"_a, "residual"_a.none(), "relu"_a,
        "threads"_a);
  m.def("broadcast_rows", &kernels::broadcast_rows, "row"_a, "shape"_a, "threads"_a);
  m.def("sin_cos", &kernels::sin_cos, "x"_a, "threads"_a);
  m.def("masked_scale", &kernels::masked_scale, "x"_a, "keep"_a, "scale"_a, "relu"_a, "threads"_a);
  m.def("relu", &kernels::relu, "x"_a, "threads"_a);
  m.def("scale_where_positive", &kernels::scale_where_positive, "x"_a, "output"_a, "scale"_a, "threads"_a);
  m.def("adamw_update", &kernels::adamw_update, "parameter"_a, "gradient"_a, "m"_a, "v"_a, "factors"_a, "beta1"_a,
        "one_minus_beta1"_a, "beta2"_a, "one_minus_beta2"_a, "eps"_a, "threads"_a);
  m.def("attention_isa", &kernels::attention_isa);
  // KERNELS_ATTENTION_ISA's value (kernels/settings.py), given when the module loads.
  m.def(
      "set_attention_isa",
      [](int cap) {
        if (cap < 0 || cap > 2) throw std::invalid_argument("set_attention_isa: 0, 1 or 2, not " + std::to_string(cap));
        ms_deform_attn_cpu::isa_cap() = cap;
      },
      "cap"_a);
}
