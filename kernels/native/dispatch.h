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

// A multi-output backward's gradients, those a vjp was asked for (argnums), in that order.
inline std::vector<mlx::core::array> chosen(const std::vector<mlx::core::array>& grads, const std::vector<int>& argnums) {
  std::vector<mlx::core::array> out;
  for (int arg : argnums) {
    out.push_back(grads[arg]);
  }
  return out;
}

}  // namespace kernels_native
