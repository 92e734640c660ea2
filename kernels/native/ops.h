// MLX operations of kernels._native: C++ Primitives evaluated on MLX's CPU stream, so that they
// stay lazy inside a traced or compiled function (no host synchronisation), unlike a ctypes call.

#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"

namespace kernels {

using mlx::core::array;

struct AttentionSpec {
  std::vector<int> shapes;  // (height, width) of each level, flattened
  bool value_bnlc, locations_b2qhlp, align_corners;
  int padding;  // 0 zeros, 1 border

  bool operator==(const AttentionSpec&) const = default;
};

// value (B, L, H, C) or (B, H, L, C); locations (B, Q, H, levels, points, 2) or (B, 2, Q, H, levels,
// points); weights (B, Q, H, levels, points): float32, row-contiguous. -> (B, Q, H * C) float32.
array ms_deform_attn(const array& value, const array& locations, const array& weights, const AttentionSpec& spec,
                     int threads);
// The build ms_deform_attn runs in this process: 2 AVX-512, 1 AVX2, 0 the baseline (the CPU's widest, capped by
// KERNELS_ATTENTION_ISA: attention_isa.h).
int attention_isa();

// cost (B, Q, T): the cost of each query of image b against every target of the batch, whose targets
// are the consecutive runs of `sizes` (image b's: columns sizes[0] + ... + sizes[b - 1] onwards).
// -> (T,) int32: the query assigned to each target by a minimum-cost one-to-one assignment of image
// b's targets to its queries (each size <= Q).
array linear_assignment(const array& cost, const std::vector<int>& sizes);

// x float32 or bfloat16 (computed in float32, each result rounded back), any shape: the softmax over its last
// axis, MLX's CPU softmax bit for bit; its VJP MLX's s * g - s * sum(s * g), rounded as MLX's ops round it, in
// one pass.
array softmax(const array& x, int threads);

// x float32 or bfloat16 (..., n), weight and bias float32 (n,): the layer norm over the last axis, MLX's CPU
// layer norm bit for bit (bfloat16: computed in float32, the result and dx in x's dtype); its VJP from the
// input alone.
array layer_norm(const array& x, const array& weight, const array& bias, float eps, int threads);

// x float32 (N, H, W, C) -> (N, Ho, Wo, kernel_h * kernel_w * C): each output pixel's taps (ky, kx,
// c), zeros outside the input; its product with a (O, kernel_h, kernel_w, C) weight reshaped to
// (O, -1) is the convolution. Not differentiable: kernels.patches takes its gradient from unpatches.
array patches(const array& x, int kernel_h, int kernel_w, int stride, int padding, int dilation, int threads);

// The transpose of patches (col2im): columns (N, Ho, Wo, kernel_h * kernel_w * C) of a (height,
// width) image -> (N, height, width, C), each pixel the sum of the columns' entries that patches
// copies from it (the gradient of patches w.r.t. x).
array unpatches(const array& columns, int height, int width, int kernel_h, int kernel_w, int stride, int padding,
                int dilation, int threads);

// A bool array of `shape`, each element true with probability threshold / 65536, from `key` (two
// uint32): the same key gives the same array.
array bernoulli16(const array& key, const std::vector<int>& shape, int threshold, int threads);

// x float32 (..., C), scale and shift (C,), residual as x or none: x * scale + shift (+ residual), then
// max(., 0) with relu: MLX's multiply, add(s) and maximum bit for bit, in one pass on every core.
array channel_affine(const array& x, const array& scale, const array& shift, const std::optional<array>& residual,
                     bool relu, int threads);

// row float32 (C,) -> `shape` (..., C), every row a copy of it, written on every core; VJP the sum
// over the rows.
array broadcast_rows(const array& row, const std::vector<int>& shape, int threads);

// x float32, any shape -> x.shape + (2,): [sin(x), cos(x)], MLX's CPU sin and cos bit for bit (one
// argument reduction for both), on every core; VJP g_sin * cos - g_cos * sin.
array sin_cos(const array& x, int threads);

// x float32 or bfloat16 (MLX's bfloat16 ops: the scale rounded to bfloat16; the output of x's dtype), keep bool
// of x's shape: where(keep, x * scale, 0), or with relu where(keep, max(x, 0) *
// scale, 0) (dropout, dropout after a ReLU); scale_where_positive: where(output > 0, x * scale, 0) (x
// unscaled for scale 1: a ReLU's gradient from its output). MLX's ops bit for bit, one pass on every
// core; VJPs of the same kind (with relu from the output).
array masked_scale(const array& x, const array& keep, float scale, bool relu, int threads);
array scale_where_positive(const array& x, const array& output, float scale, int threads);
// x float32 or bfloat16: max(x, 0), MLX's maximum bit for bit (NaN kept, -0 to +0), on every core; VJP
// scale_where_positive of the output.
array relu(const array& x, int threads);

// One AdamW step (mlx.optimizers.AdamW with bias correction) of a float32 parameter, the gradient first
// multiplied by factors[3]: factors (4,) = [1 - lr * weight_decay, lr / (1 - beta1^step),
// rsqrt(1 - beta2^step), gradient scale]. -> [parameter, m, v] new, MLX's ops bit for bit, one pass on
// every core. Not differentiable.
std::vector<array> adamw_update(const array& parameter, const array& gradient, const array& m, const array& v,
                                const array& factors, float beta1, float one_minus_beta1, float beta2,
                                float one_minus_beta2, float eps, int threads);

}  // namespace kernels
