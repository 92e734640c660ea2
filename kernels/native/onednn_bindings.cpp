// kernels._onednn: the Python face of onednn.cpp. A module of its own beside kernels._native: it links
// oneDNN's library, which may be missing where _native still loads.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unordered_map.h>

#include "mlx/array.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kernels_onednn {
using mlx::core::array;
std::optional<array> conv2d(const array& x, const array& weight, int stride, int padding, int dilation, bool bfloat16,
                            bool keep_weight, int threads);
std::optional<array> product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                             bool transpose_b, bool bfloat16, bool keep_weight, int threads);
std::string describe();
std::string conv2d_implementation(const array& x, const array& weight, int stride, int padding, int dilation,
                                  bool bfloat16, bool backward);
std::unordered_map<std::string, size_t> caches();
void set_capacity(size_t plans, size_t weight_bytes);
}  // namespace kernels_onednn

NB_MODULE(_onednn, m) {
  m.doc() = "Convolutions and matrix products on oneDNN as MLX operations, with their gradients (kernels/onednn.py)";
  m.attr("mlx_version") = mlx::core::version();
  m.def("conv2d", &kernels_onednn::conv2d, "x"_a, "weight"_a, "stride"_a, "padding"_a, "dilation"_a, "bfloat16"_a,
        "keep_weight"_a, "threads"_a);
  m.def("product", &kernels_onednn::product, "a"_a, "b"_a, "bias"_a.none(), "transpose_a"_a, "transpose_b"_a,
        "bfloat16"_a, "keep_weight"_a, "threads"_a);
  m.def("describe", &kernels_onednn::describe);
  m.def("conv2d_implementation", &kernels_onednn::conv2d_implementation, "x"_a, "weight"_a, "stride"_a, "padding"_a,
        "dilation"_a, "bfloat16"_a, "backward"_a = false);
  m.def("caches", &kernels_onednn::caches);
  m.def("set_capacity", &kernels_onednn::set_capacity, "plans"_a, "weight_bytes"_a);
}
