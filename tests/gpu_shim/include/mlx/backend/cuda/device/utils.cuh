// Stand-in for MLX's device utilities: the argument types of assembled custom kernels.
#pragma once
#include <array>
#include <cstdint>
#define MAX_NDIM 10
using Shape = std::array<int32_t, MAX_NDIM>;
using Strides = std::array<int64_t, MAX_NDIM>;
