// What the C++ Primitives share. prepared_encoder: what every eval_cpu does before queueing its
// work, allocate its outputs and register inputs and outputs with MLX's CPU command encoder (which
// keeps them alive until the work has run); the caller then queues the work with the returned
// encoder's dispatch, so that the operation stays lazy like MLX's own. chosen: a vjp's gradients;
// sum_over_rows: a broadcast row's.

#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace kernels_native {

// Whether `out` took over the buffer of the first input among `donors` that MLX lets go (nothing else
// holds it; the output's size and type), as MLX's own element-wise operations do: asked before the
// inputs are registered (which holds them).
inline bool took_buffer(const std::vector<mlx::core::array>& inputs, const std::vector<int>& donors,
                        mlx::core::array out) {
  for (int i : donors) {
    const auto& in = inputs[i];
    if (in.is_donatable() && in.flags().row_contiguous && in.dtype() == out.dtype() && in.size() == out.size() &&
        in.data_size() == out.size()) {
      out.copy_shared_buffer(in);
      return true;
    }
  }
  return false;
}

// `donors`: inputs whose buffer the first output may take over (an element-wise operation's; the work
// then reads and writes that buffer, no __restrict__ between them), so that the peak memory stays what
// MLX's ops had; the other outputs get fresh buffers.
inline mlx::core::cpu::CommandEncoder& prepared_encoder(mlx::core::Stream stream,
                                                        const std::vector<mlx::core::array>& inputs,
                                                        const std::vector<mlx::core::array>& outputs,
                                                        const std::vector<int>& donors = {}) {
  const bool donated = !outputs.empty() && took_buffer(inputs, donors, outputs[0]);
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto out = outputs[i];  // an array is a handle: the data is set on the shared array
    if (i > 0 || !donated) {
      out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    }
    encoder.set_output_array(out);
  }
  return encoder;
}

// The sum of a (..., C) cotangent over its rows (every axis but the last): the VJP of a (C,) array
// broadcast to rows.
inline mlx::core::array sum_over_rows(const mlx::core::array& a, mlx::core::Stream stream) {
  std::vector<int> rows(a.ndim() - 1);
  for (size_t axis = 0; axis < rows.size(); ++axis) {
    rows[axis] = int(axis);
  }
  return mlx::core::sum(a, rows, false, stream);
}

// A multi-output backward's gradients, those a vjp was asked for (argnums), in that order.
inline std::vector<mlx::core::array> chosen(const std::vector<mlx::core::array>& grads, const std::vector<int>& argnums) {
  std::vector<mlx::core::array> out;
  for (int arg : argnums) {
    out.push_back(grads[arg]);
  }
  return out;
}

}  // namespace kernels_native
