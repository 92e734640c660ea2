// kernels._onednn's matrix products (onednn.cpp has the story: precision, plans, weights, threads): op(a)
// (M, K) @ op(b) (K, N) (+ bias (N,)), op a transpose where asked (a strided view: no copy); its VJP makes
// products of the cotangent (gradient_product).

#include <omp.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "onednn_shared.h"

namespace kernels_onednn {

using mx::array;

// The product's VJP makes products (never refused: the forward's plan was made for these dtypes); a
// weight's gradient on AVX2 is MLX's (OpenBLAS's), faster there.
array gradient_product(const array& a, const array& b, bool transpose_a, bool transpose_b, bool bfloat16, int threads);

// A shape's primitives (its key: ProductShape's, below).
struct ProductPlan {
  std::string refused;  // as ConvPlan's
  bool lasting = false;  // as ConvPlan's: oneDNN 3.2's products free all they make (measured as ConvPlan's)
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul product;
  // Where set, the product runs as a 1 x 1 convolution of one image of 1 x m pixels of k channels (see below).
  std::optional<dnnl::convolution_forward::primitive_desc> convolution_pd;
  dnnl::convolution_forward convolution;
};

Plans<ProductPlan>& product_plans() {
  static Plans<ProductPlan> plans;
  return plans;
}

namespace {

struct ProductShape {
  int m, k, n;
  bool transpose_a, transpose_b, bias;
  dt a_type, b_type, bias_type, product;
  bool weights_kept = false;  // b is a weight whose copies in oneDNN's layouts a Detector keeps (inference)
  bool relu = false;  // max(., 0) as the product's post-op (an FFN's first layer)
  dt out_type = a_type;  // the result's: a's, or bfloat16 handed to the next product (the FFN's second layer)
  bool residual = false;  // an (m, n) added as the product's post-op (before the ReLU): a layer's residual
  dt residual_type = dt::f32;
  std::string key() const {
    std::string key;
    for (int v : {m, k, n, int(transpose_a), int(transpose_b), int(bias), int(a_type), int(b_type), int(bias_type),
                  int(product), int(weights_kept), int(relu), int(out_type), int(residual), int(residual_type)}) {
      key += std::to_string(v) + ",";
    }
    return key;
  }
  dnnl::memory::desc a_desc(dt type) const {
    return transpose_a ? dnnl::memory::desc({m, k}, type, dims{1, m}) : dnnl::memory::desc({m, k}, type, dims{k, 1});
  }
  dnnl::memory::desc b_desc(dt type) const {
    return transpose_b ? dnnl::memory::desc({k, n}, type, dims{1, k}) : dnnl::memory::desc({k, n}, type, dims{n, 1});
  }
  // b as it lies: `strides` (of its stored dims, in elements) where it is a view (a kept weight's slice)
  dnnl::memory::desc b_desc(dt type, const mx::Strides& strides) const {
    return transpose_b ? dnnl::memory::desc({k, n}, type, dims{strides[1], strides[0]})
                       : dnnl::memory::desc({k, n}, type, dims{strides[0], strides[1]});
  }
  dnnl::memory::desc bias_desc() const { return {{1, n}, bias_type, dims{n, 1}}; }
  dnnl::memory::desc out_desc() const { return {{m, n}, out_type, dims{n, 1}}; }
  dnnl::memory::desc residual_desc() const { return {{m, n}, residual_type, dims{n, 1}}; }
  // Every primitive's attributes (onednn.cpp's), with the residual's addition and the ReLU as post-ops where asked.
  dnnl::primitive_attr attr() const {
    if (!relu && !residual) return attributes();
    dnnl::primitive_attr with;  // a new one: a copy of attributes()' handle would share it
    with.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::post_ops ops;
    if (residual) ops.append_binary(dnnl::algorithm::binary_add, residual_desc());
    if (relu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    with.set_post_ops(ops);
    return with;
  }
};

// oneDNN 3.2's float32 products on AVX2 have its sgemm only (gemm:jit), which ran products whose reduction is
// long against their width at 130-150 GFLOP/s ((14640, 1024) x (1024, 256): an FFN's second layer, and the
// first's backward data) where its 1 x 1 convolution (brgconv_1x1:avx2) ran the same at 170-205 and OpenBLAS at
// 150-180, while for (14640, 256) x (256, 1024) the sgemm was as fast or faster (bench/conv_backward.py).
// A row-major (m, k) is an image (1, k, 1, m) in nhwc, the result (1, n, 1, m) likewise: the same memory.
constexpr int CONVOLUTION_FROM_REDUCTION_OVER_WIDTH = 4;

void plan_convolution(const ProductShape& s, ProductPlan& plan) {
  const bool float32 =
      s.a_type == dt::f32 && s.b_type == dt::f32 && s.product == dt::f32 && (!s.bias || s.bias_type == dt::f32);
  // Not where a Detector keeps its weights' copies (inference): the convolution wants each weight in a blocked
  // layout of its own (one more copy kept, and another for each layout it picks for a new row count): the
  // quick start's model over 300 image sizes as AVX2 kept 59 copies against 46 and grew 37-39 MiB from the
  // tenth size against 26 (bench/shape_memory.py). In training the weight is reordered at each call (for
  // (256, 1024), 1 MB, about 0.2 ms).
  if (keep_slower_passes() || !float32 || s.weights_kept || s.relu || s.residual || s.out_type != s.a_type || s.transpose_a ||
      s.k < CONVOLUTION_FROM_REDUCTION_OVER_WIDTH * s.n ||
      std::string(plan.pd.impl_info_str()).rfind("gemm:jit", 0) != 0) {
    return;
  }
  try {
    const dnnl::memory::desc src({1, s.k, 1, s.m}, dt::f32, tag::nhwc), dst({1, s.n, 1, s.m}, dt::f32, tag::nhwc);
    const dnnl::memory::desc weights({s.n, s.k, 1, 1}, dt::f32, tag::any);
    const auto prop = dnnl::prop_kind::forward_inference;
    const auto direct = dnnl::algorithm::convolution_direct;
    auto pd = s.bias ? dnnl::convolution_forward::primitive_desc(engine(), prop, direct, src, weights,
                                                                 s.bias_desc().reshape({s.n}), dst, {1, 1}, {0, 0},
                                                                 {0, 0}, attributes())
                     : dnnl::convolution_forward::primitive_desc(engine(), prop, direct, src, weights, dst, {1, 1},
                                                                 {0, 0}, {0, 0}, attributes());
    if (std::string(pd.impl_info_str()).rfind("brgconv", 0) != 0) return;  // not the kernel measured
    plan.convolution = dnnl::convolution_forward(pd);
    plan.convolution_pd = pd;
  } catch (const std::exception&) {
    // none: the sgemm it is
  }
}

std::shared_ptr<ProductPlan> product_plan(const ProductShape& s) {
  return product_plans().get(s.key(), [&s] {
    auto plan = std::make_shared<ProductPlan>();
    try {
      const auto described = [&s](const dnnl::memory::desc& b) {
        return s.bias ? dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), b, s.bias_desc(), s.out_desc(),
                                                     s.attr())
                      : dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), b, s.out_desc(), s.attr());
      };
      // A kept weight in the layout oneDNN's brgemm kernel wants (packed for AVX-512's and AMX's blocks), made once:
      // given as it lies, the kernel packs its blocks again at every call (R50's encoder products 5-10% slower).
      // Not for the sgemm (gemm:jit, float32 on AVX2), which reads it as it lies: a copy would be memory for nothing.
      plan->pd = described(s.weights_kept ? dnnl::memory::desc({s.k, s.n}, s.product, tag::any) : s.b_desc(s.product));
      if (s.weights_kept && std::string(plan->pd.impl_info_str()).rfind("brg", 0) != 0) {
        plan->pd = described(s.b_desc(s.product));
      }
      plan->refused = refusal(plan->pd, "this matrix product");
      if (plan->refused.empty()) plan->product = dnnl::matmul(plan->pd);
      if (plan->refused.empty()) plan_convolution(s, *plan);
    } catch (const std::exception& error) {
      plan->refused = error.what();
    }
    return plan;
  });
}

class Product : public mx::UnaryPrimitive {
 public:
  Product(mx::Stream stream, ProductShape shape, std::shared_ptr<ProductPlan> plan,
          std::shared_ptr<WeightCopies> kept, int threads)
      : mx::UnaryPrimitive(stream), s_(shape), plan_(std::move(plan)), kept_(std::move(kept)), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([plan = plan_, s = s_, threads = threads_, a = inputs[0].data<void>(), b = inputs[1].data<void>(),
                      kept = kept_, source = kept_ ? inputs[1].data_shared_ptr() : nullptr,
                      b_strides = inputs[1].strides(),
                      bias = s_.bias ? inputs[2].data<void>() : nullptr,
                      residual = s_.residual ? inputs[s_.bias ? 3 : 2].data<void>() : nullptr,
                      result = out.data<void>()]() {
      omp_set_num_threads(threads);
      if (plan->convolution_pd) {
        const auto& pd = *plan->convolution_pd;
        // b as the convolution's (n, k, 1, 1) weight: stored (n, k) where transposed, else (k, n)
        const dnnl::memory::desc given({s.n, s.k, 1, 1}, dt::f32,
                                       s.transpose_b ? dims{s.k, 1, s.k, s.k} : dims{1, s.n, s.n * s.k, s.n * s.k});
        auto wei = weight_as_wanted(kept, source, b, given, pd.weights_desc());
        dnnl::memory src(pd.src_desc(), engine(), const_cast<void*>(a)), dst(pd.dst_desc(), engine(), result);
        std::unordered_map<int, dnnl::memory> args{
            {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei.memory}, {DNNL_ARG_DST, dst}};
        if (s.bias) args.insert({DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), engine(), const_cast<void*>(bias))});
        execute(plan->convolution, pd.scratchpad_desc(), std::move(args));
        return;
      }
      auto src = as_wanted(s.a_desc(s.a_type), a, plan->pd.src_desc());
      auto wei = weight_as_wanted(kept, source, b, s.b_desc(s.b_type, b_strides), plan->pd.weights_desc());
      dnnl::memory dst(plan->pd.dst_desc(), engine(), result);
      std::unordered_map<int, dnnl::memory> args{
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei.memory}, {DNNL_ARG_DST, dst}};
      if (s.bias) args.insert({DNNL_ARG_BIAS, dnnl::memory(s.bias_desc(), engine(), const_cast<void*>(bias))});
      if (s.residual) {
        args.insert({DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                     dnnl::memory(s.residual_desc(), engine(), const_cast<void*>(residual))});
      }
      execute(plan->product, plan->pd.scratchpad_desc(), std::move(args));
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  // out = A @ B with A = op(a), B = op(b): dA = g @ B^T, dB = A^T @ g, each as a product of the stored
  // arrays with the transposes that give it (dA^T = B @ g^T where a is stored transposed).
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>& outputs) override {
    const auto& a = primals[0];
    const auto& b = primals[1];
    // a fused ReLU's gradient first (in the result's dtype), then as the product's operands
    const array given = s_.relu ? relu_gradient(cotangents[0], outputs[0], threads_) : cotangents[0];
    auto g = mx::contiguous(mx::astype(given, a.dtype(), stream()), false, stream());
    const bool ta = s_.transpose_a, tb = s_.transpose_b, bf16 = s_.product == dt::bf16;
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(ta ? gradient_product(b, g, tb, true, bf16, threads_)
                           : gradient_product(g, b, false, !tb, bf16, threads_));
      } else if (arg == 1) {
        auto grad = tb ? gradient_product(g, a, true, ta, bf16, threads_)
                       : gradient_product(a, g, !ta, false, bf16, threads_);
        grads.push_back(mx::astype(grad, b.dtype(), stream()));
      } else if (arg == 2 && s_.bias) {
        grads.push_back(mx::astype(kernels_native::sum_over_rows(g, stream()), primals[2].dtype(), stream()));
      } else {  // the residual's: the (masked) cotangent itself
        grads.push_back(mx::astype(given, primals[arg].dtype(), stream()));
      }
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnProduct"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Product&>(other);
    return s_.key() == o.s_.key() && kept_ == o.kept_ && threads_ == o.threads_;
  }

 private:
  ProductShape s_;
  std::shared_ptr<ProductPlan> plan_;
  std::shared_ptr<WeightCopies> kept_;
  int threads_;
};

ProductShape product_shape(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                           bool transpose_b, bool bfloat16, bool weights_kept = false, bool relu = false,
                           const std::string& result = "", const std::optional<array>& residual = std::nullopt) {
  if (a.ndim() != 2 || b.ndim() != 2) throw std::invalid_argument("kernels._onednn product: two matrices");
  const int m = transpose_a ? a.shape(1) : a.shape(0), k = transpose_a ? a.shape(0) : a.shape(1);
  const int kb = transpose_b ? b.shape(1) : b.shape(0), n = transpose_b ? b.shape(0) : b.shape(1);
  if (k != kb || (bias && (bias->ndim() != 1 || bias->shape(0) != n)) ||
      (residual && (residual->ndim() != 2 || residual->shape(0) != m || residual->shape(1) != n))) {
    throw std::invalid_argument("kernels._onednn product: the shapes do not multiply");
  }
  const dt a_type = dnnl_type(a.dtype()), b_type = dnnl_type(b.dtype());
  const dt product_type = (bfloat16 || a_type == dt::bf16 || b_type == dt::bf16) ? dt::bf16 : dt::f32;
  return {m,        k,     n,
          transpose_a, transpose_b, bool(bias),
          a_type,   b_type, bias ? dnnl_type(bias->dtype()) : dt::f32,
          product_type, weights_kept, relu,
          result_type(result, a_type),
          bool(residual),
          residual ? dnnl_type(residual->dtype()) : dt::f32};
}

array product_array(const ProductShape& s, std::shared_ptr<ProductPlan> plan, const array& a, const array& b,
                    const std::optional<array>& bias, std::shared_ptr<WeightCopies> kept, int threads,
                    const std::optional<array>& residual = std::nullopt) {
  const auto stream = mx::default_stream(mx::Device::cpu);
  // A kept weight as it lies, not through mx::contiguous: that copies a slice of a larger buffer (a slice of
  // MultiheadAttention's in_proj_weight) at every call, and a fresh buffer is a weight the store has not seen:
  // each forward added a copy of each slice, held with its buffer (the server at `auto` on a bfloat16 CPU grew
  // by 1.5 GB in a minute). Its layout is read from its strides at the call (b_desc); the copy is dense.
  std::vector<array> inputs{mx::contiguous(a, false, stream), kept ? b : mx::contiguous(b, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  if (residual) inputs.push_back(mx::contiguous(*residual, false, stream));
  return array({s.m, s.n}, s.out_type == dt::bf16 ? mx::bfloat16 : mx::float32, std::make_shared<Product>(stream, s, std::move(plan), std::move(kept), threads),
               std::move(inputs));
}

}  // namespace

std::optional<array> product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                             bool transpose_b, bool bfloat16, const KeptWeights* kept, int threads, bool relu,
                             const std::string& result, const std::optional<array>& residual) {
  const ProductShape s =
      product_shape(a, b, bias, transpose_a, transpose_b, bfloat16, kept != nullptr, relu, result, residual);
  auto plan = product_plan(s);
  if (!plan->refused.empty()) return std::nullopt;
  return product_array(s, std::move(plan), a, b, bias, kept ? kept->copies : nullptr, threads, residual);
}

array gradient_product(const array& a, const array& b, bool transpose_a, bool transpose_b, bool bfloat16, int threads) {
  const ProductShape s = product_shape(a, b, std::nullopt, transpose_a, transpose_b, bfloat16);
  auto plan = product_plan(s);
  if (!plan->refused.empty()) throw std::runtime_error("kernels._onednn: " + plan->refused);
  const bool float32 = s.a_type == dt::f32 && s.b_type == dt::f32 && s.product == dt::f32;
  if (float32 && transpose_a && std::string(plan->pd.impl_info_str()).rfind("gemm:jit", 0) == 0) {
    // A weight's gradient (a long reduction, a stored transposed): oneDNN 3.2's sgemm, all it has for float32
    // products on AVX2, took 1.2-2.2x OpenBLAS's time for R50's (bench/conv_backward.py): MLX's.
    const auto stream = mx::default_stream(mx::Device::cpu);
    return mx::matmul(mx::transpose(a, stream), transpose_b ? mx::transpose(b, stream) : b, stream);
  }
  return product_array(s, std::move(plan), a, b, std::nullopt, nullptr, threads);
}

std::string product_implementation(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                                   bool transpose_b, bool bfloat16, bool weights_kept) {
  auto plan = product_plan(product_shape(a, b, bias, transpose_a, transpose_b, bfloat16, weights_kept));
  if (!plan->refused.empty()) return "refused: " + plan->refused;
  const std::string product = plan->pd.impl_info_str();
  if (!plan->convolution_pd) return product;
  return std::string(plan->convolution_pd->impl_info_str()) + ", as a 1 x 1 convolution (" + product + ")";
}

}  // namespace kernels_onednn
