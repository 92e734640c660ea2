// kernels._onednn: the Python face of onednn.h. A module of its own beside kernels._native: it links
// oneDNN's library, which may be missing where _native still loads.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unordered_map.h>

#include "mlx/version.h"
#include "onednn.h"

namespace nb = nanobind;
using namespace nb::literals;
using kernels_onednn::KeptWeights;

NB_MODULE(_onednn, m) {
  m.doc() = "Convolutions and matrix products on oneDNN as MLX operations, with their gradients (kernels/onednn.py)";
  m.attr("mlx_version") = mlx::core::version();
  nb::class_<KeptWeights>(m, "KeptWeights", "A model's store of its weights' copies in oneDNN's layouts (onednn.h)")
      .def(nb::init<size_t>(), "capacity_bytes"_a)
      .def_prop_ro("count", &KeptWeights::count)
      .def_prop_ro("bytes", &KeptWeights::bytes)
      .def_prop_ro("capacity", &KeptWeights::capacity);
  // The GIL let go while a call may make a plan (JIT compiling its primitives: a millisecond to tens of them,
  // onednn_shared.h's Plans): other Python threads (a server's event loop, its image decoding) run meanwhile.
  // Nothing there touches Python: the arguments are converted before, the result after.
  const auto without_gil = nb::call_guard<nb::gil_scoped_release>();
  m.def("conv2d", &kernels_onednn::conv2d, "x"_a, "weight"_a, "stride"_a, "padding"_a, "dilation"_a, "bfloat16"_a,
        "kept"_a.none(), "threads"_a, without_gil);
  m.def("conv2d_fused", &kernels_onednn::conv2d_fused, "x"_a, "weight"_a, "bias"_a.none(), "residual"_a.none(),
        "relu"_a, "result"_a, "stride"_a, "padding"_a, "dilation"_a, "bfloat16"_a, "kept"_a.none(),
        "threads"_a, without_gil);
  m.def("product", &kernels_onednn::product, "a"_a, "b"_a, "bias"_a.none(), "transpose_a"_a, "transpose_b"_a,
        "bfloat16"_a, "kept"_a.none(), "threads"_a, "relu"_a = false, "result"_a = "",
        "residual"_a.none() = nb::none(), without_gil);
  m.def("binary", &kernels_onednn::binary, "operation"_a, "a"_a, "b"_a, "threads"_a);
  m.def("max_pool2d", &kernels_onednn::max_pool2d, "x"_a, "kernel"_a, "stride"_a, "padding"_a, "threads"_a);
  m.def("cast", &kernels_onednn::cast, "x"_a, "dtype"_a, "threads"_a);
  m.def("describe", &kernels_onednn::describe);
  m.def("conv2d_implementation", &kernels_onednn::conv2d_implementation, "x"_a, "weight"_a, "stride"_a, "padding"_a,
        "dilation"_a, "bfloat16"_a, "backward"_a = false);
  m.def("product_implementation", &kernels_onednn::product_implementation, "a"_a, "b"_a, "bias"_a.none(),
        "transpose_a"_a, "transpose_b"_a, "bfloat16"_a = false, "weights_kept"_a = false);
  m.def("caches", &kernels_onednn::caches);
  m.def("set_capacity", &kernels_onednn::set_capacity, "plans"_a);
  m.def("set_slower_passes", &kernels_onednn::set_slower_passes, "keep"_a);  // KERNELS_ONEDNN_SLOWER_PASSES
}
