// kernels._onednn's C++ face (onednn.cpp, onednn_conv.cpp, onednn_product.cpp), which onednn_bindings.cpp gives
// to Python.

#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "mlx/array.h"

namespace kernels_onednn {

using mlx::core::array;

class WeightCopies;

// A model's store of its weights' copies in the layouts and dtypes oneDNN's kernels want (a convolution's
// blocked weight, a bfloat16 copy), one copy of each weight (in the layout last asked), at most
// `capacity_bytes`, the least recently used out first; each copy keyed by its weight's buffer, which the
// store holds (MLX then neither frees nor reuses it). For a model whose weights do not change while it
// keeps one (a Detector); freed with it.
struct KeptWeights {
  explicit KeptWeights(size_t capacity_bytes);
  size_t count() const;
  size_t bytes() const;
  size_t capacity() const;
  std::shared_ptr<WeightCopies> copies;  // shared with the Primitives in flight
};

// mx::conv2d(x, weight, stride, padding, dilation) (x (N, H, W, C), weight (O, kh, kw, C)) on oneDNN,
// differentiable; None where oneDNN has no fast kernel for its forward. `bfloat16`: the products in
// bfloat16; `kept`: where the weight's copy comes from (none: made at every call).
std::optional<array> conv2d(const array& x, const array& weight, int stride, int padding, int dilation, bool bfloat16,
                            const KeptWeights* kept, int threads);
// op(a) @ op(b) (+ bias), differentiable; None where oneDNN has no fast kernel for it.
// conv2d's result with `bias` (O,) added, then `residual` (its shape), then max(., 0) where `relu`, as post-ops
// of oneDNN's convolution (one pass); `result`: its dtype, "float32" or "bfloat16" ("": x's). Differentiable.
std::optional<array> conv2d_fused(const array& x, const array& weight, const std::optional<array>& bias,
                                  const std::optional<array>& residual, bool relu, const std::string& result, int stride,
                                  int padding, int dilation, bool bfloat16, const KeptWeights* kept, int threads);
// `residual` (m, n): added as the product's post-op, then `relu`: max(., 0) as the next; `result`: the result's
// dtype, "float32" or "bfloat16" ("": a's).
std::optional<array> product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                             bool transpose_b, bool bfloat16, const KeptWeights* kept, int threads, bool relu = false,
                             const std::string& result = "", const std::optional<array>& residual = std::nullopt);
// a + b ("add") or a * b ("multiply"), b of a's shape or broadcast along dimensions of 1, float32 or bfloat16, in
// a's dtype, on every core; differentiable. None for shapes it does not take (other ranks, another broadcast).
std::optional<array> binary(const std::string& operation, const array& a, const array& b, int threads);
// Max pooling of x (N, H, W, C) over k x k windows at `stride`, `padding` each side; forward only (no VJP).
std::optional<array> max_pool2d(const array& x, int kernel, int stride, int padding, int threads);
// x cast between float32 and bfloat16 (to nearest even) on every core; differentiable. None for the same dtype.
std::optional<array> cast(const array& x, mlx::core::Dtype dtype, int threads);
std::string describe();
std::string conv2d_implementation(const array& x, const array& weight, int stride, int padding, int dilation,
                                  bool bfloat16, bool backward);
// The implementation the product op(a) @ op(b) (+ bias) runs on ("gemm:jit:f32"; a 1 x 1 convolution's, with the
// product's it stands in for: "brgconv_1x1:avx2, as a 1 x 1 convolution (gemm:jit:f32)"), or why it is refused;
// `weights_kept`: as a Detector runs it, its weights' copies kept (inference).
std::string product_implementation(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                                   bool transpose_b, bool bfloat16, bool weights_kept);
std::unordered_map<std::string, size_t> caches();
void set_capacity(size_t plans);
// KERNELS_ONEDNN_SLOWER_PASSES (onednn_shared.h's keep_slower_passes), given when kernels/onednn.py loads the module.
void set_slower_passes(bool keep);

}  // namespace kernels_onednn
