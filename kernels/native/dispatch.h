// What the C++ Primitives share. prepared_encoder: what every eval_cpu does before queueing its
// work, allocate its outputs and register inputs and outputs with MLX's CPU command encoder (which
// keeps them alive until the work has run); the caller then queues the work with the returned
// encoder's dispatch, so that the operation stays lazy like MLX's own. chosen: a vjp's gradients.

#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace kernels_native {

inline mlx::core::cpu::CommandEncoder& prepared_encoder(mlx::core::Stream stream,
                                                        const std::vector<mlx::core::array>& inputs,
                                                        const std::vector<mlx::core::array>& outputs) {
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto out : outputs) {  // an array is a handle: the data is set on the shared array
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  return encoder;
}

// prepared_encoder for one output of an element-wise operation, which takes over the buffer of the
// first input among `donors` that MLX lets go (nothing else holds it; the output's size and type), as
// MLX's own element-wise operations do, else a fresh one: the work then reads and writes that buffer
// (no __restrict__ between them), and the peak memory stays what MLX's ops had.
inline mlx::core::cpu::CommandEncoder& prepared_encoder_in_place(mlx::core::Stream stream,
                                                                 const std::vector<mlx::core::array>& inputs,
                                                                 mlx::core::array out, std::vector<int> donors) {
  bool donated = false;
  for (int i : donors) {
    const auto& in = inputs[i];
    if (in.is_donatable() && in.flags().row_contiguous && in.dtype() == out.dtype() && in.size() == out.size() &&
        in.data_size() == out.size()) {
      out.copy_shared_buffer(in);
      donated = true;
      break;
    }
  }
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  if (!donated) {
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  }
  encoder.set_output_array(out);
  return encoder;
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
