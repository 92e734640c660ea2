// kernels._onednn: convolutions and matrix products on oneDNN (Intel's deep learning kernels: JIT code
// for AVX2, AVX-512, AVX512-BF16 and AMX, in blocked layouts) as MLX Primitives on MLX's CPU stream,
// with their gradients (convolution backward data and backward weights; products of the cotangent).
//
// Precision: the products run in bfloat16 (accumulating in float32) where asked (`bfloat16`) or where
// either operand is bfloat16, in float32 otherwise; an operand of the other dtype is converted on the
// way in (a oneDNN reorder on every core, into a scratch buffer; a convolution's weight is reordered
// anyway). The result has the first operand's dtype (x's, a's): float32 operands with bfloat16 products
// give a float32 result, and no bfloat16 copy of a weight is kept.
//
// Weights: a convolution's (O, kh, kw, C) weight is reordered into the layout oneDNN's kernel chose
// (`format_tag::any`; a plain one makes oneDNN 3.2 take its reference loops, 100x slower) at every
// evaluation: about 2% of an R50 forward, and always right, whatever the weight's version.
//
// Threads: oneDNN's OpenMP team, `threads` wide, set on MLX's stream thread before each call.

#include <omp.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "oneapi/dnnl/dnnl.hpp"

#include "dispatch.h"

namespace kernels_onednn {

namespace mx = mlx::core;
using mx::array;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

// The product's VJP makes products.
array product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a, bool transpose_b,
              bool bfloat16, int threads);

namespace {

dnnl::engine& engine() {
  static dnnl::engine cpu(dnnl::engine::kind::cpu, 0);
  return cpu;
}

dnnl::stream& stream_here() {
  thread_local dnnl::stream here(engine());
  return here;
}

dt dnnl_type(mx::Dtype type) {
  if (type == mx::float32) return dt::f32;
  if (type == mx::bfloat16) return dt::bf16;
  throw std::invalid_argument("kernels._onednn: float32 or bfloat16 only");
}

// Refuses oneDNN's reference loops (`ref:any`, `gemm:ref`): where they are all oneDNN has for a shape
// and dtype (bfloat16 on a CPU without AVX-512), the caller computes with MLX instead. A convolution
// also refuses oneDNN's im2col + GEMM (`gemm:jit`, taken for narrow images: a 7 x 7 stem on a 1 or 2
// pixel wide input), which crashed there (oneDNN 3.2) and is what the caller's own path does anyway.
template <typename Desc>
void require_fast(const Desc& pd, const std::string& what, bool convolution = false) {
  const std::string impl = pd.impl_info_str();
  if (impl.find("ref") != std::string::npos || (convolution && impl.find("gemm") != std::string::npos)) {
    throw std::runtime_error("kernels._onednn: " + what + " has only oneDNN's reference implementation here (" +
                             impl + ")");
  }
}

// `user` (a plain buffer of `user_desc`) as `wanted`: the same memory where the descriptions agree, else
// a reorder into a new buffer (layout and dtype) on every core.
dnnl::memory as_wanted(const dnnl::memory::desc& user_desc, const void* data, const dnnl::memory::desc& wanted) {
  dnnl::memory user(user_desc, engine(), const_cast<void*>(data));
  if (user_desc == wanted) return user;
  dnnl::memory converted(wanted, engine());
  dnnl::reorder(user, converted).execute(stream_here(), user, converted);
  return converted;
}

// ---------------------------------------------------------------------------------------------------
// Convolutions: x (N, H, W, C) and the result channels-last, the weight (O, kh, kw, C) as MLX keeps it.

struct ConvShape {
  int n, h, w, c, o, kh, kw, stride, padding, dilation;
  dt x_type, w_type, product;  // the operands' dtypes and the products'
  int out_h() const { return (h + 2 * padding - dilation * (kh - 1) - 1) / stride + 1; }
  int out_w() const { return (w + 2 * padding - dilation * (kw - 1) - 1) / stride + 1; }
  std::string key() const {
    return std::to_string(n) + "," + std::to_string(h) + "," + std::to_string(w) + "," + std::to_string(c) + "," +
           std::to_string(o) + "," + std::to_string(kh) + "," + std::to_string(kw) + "," + std::to_string(stride) +
           "," + std::to_string(padding) + "," + std::to_string(dilation) + "," + std::to_string(int(x_type)) + "," +
           std::to_string(int(w_type)) + "," + std::to_string(int(product));
  }
  dnnl::memory::desc x_plain(dt type) const { return {{n, c, h, w}, type, tag::nhwc}; }
  dnnl::memory::desc y_plain(dt type) const { return {{n, o, out_h(), out_w()}, type, tag::nhwc}; }
  dnnl::memory::desc w_plain(dt type) const { return {{o, c, kh, kw}, type, tag::ohwi}; }
  dnnl::memory::desc w_any() const { return {{o, c, kh, kw}, product, tag::any}; }
  dims strides() const { return {stride, stride}; }
  dims dilates() const { return {dilation - 1, dilation - 1}; }
  dims pads() const { return {padding, padding}; }
};

// The primitives of one shape, made once (at graph-building time, on the caller's thread) and kept.
struct ConvPlan {
  dnnl::convolution_forward::primitive_desc forward_pd;
  dnnl::convolution_forward forward;
  // made by the first VJP
  std::once_flag backward_once;
  dnnl::convolution_backward_data::primitive_desc data_pd;
  dnnl::convolution_backward_data data;
  dnnl::convolution_backward_weights::primitive_desc weights_pd;
  dnnl::convolution_backward_weights weights;
};

std::mutex plans_mutex;

ConvPlan& conv_plan(const ConvShape& s) {
  static std::map<std::string, std::unique_ptr<ConvPlan>> plans;
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto& slot = plans[s.key()];
  if (!slot) {
    // x and the result in the products' dtype for the kernel; the result may be float32 with bf16 products
    auto pd = dnnl::convolution_forward::primitive_desc(
        engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, s.x_plain(s.product),
        s.w_any(), s.y_plain(s.x_type), s.strides(), s.dilates(), s.pads(), s.pads());
    require_fast(pd, "this convolution", true);
    auto plan = std::make_unique<ConvPlan>();
    plan->forward_pd = pd;
    plan->forward = dnnl::convolution_forward(pd);
    slot = std::move(plan);
  }
  return *slot;
}

void make_backward(ConvPlan& plan, const ConvShape& s) {
  std::call_once(plan.backward_once, [&] {
    auto data_pd = dnnl::convolution_backward_data::primitive_desc(
        engine(), dnnl::algorithm::convolution_direct, s.x_plain(s.x_type), s.w_any(), s.y_plain(s.product),
        s.strides(), s.dilates(), s.pads(), s.pads(), plan.forward_pd);
    require_fast(data_pd, "this convolution's backward data", true);
    auto weights_pd = dnnl::convolution_backward_weights::primitive_desc(
        engine(), dnnl::algorithm::convolution_direct, s.x_plain(s.product),
        dnnl::memory::desc({s.o, s.c, s.kh, s.kw}, s.w_type == dt::f32 ? dt::f32 : s.product, tag::any),
        s.y_plain(s.product), s.strides(), s.dilates(), s.pads(), s.pads(), plan.forward_pd);
    require_fast(weights_pd, "this convolution's backward weights", true);
    plan.data_pd = data_pd;
    plan.data = dnnl::convolution_backward_data(data_pd);
    plan.weights_pd = weights_pd;
    plan.weights = dnnl::convolution_backward_weights(weights_pd);
  });
}

ConvShape conv_shape(const array& x, const array& w, int stride, int padding, int dilation, bool bfloat16) {
  if (x.ndim() != 4 || w.ndim() != 4 || x.shape(3) != w.shape(3)) {
    throw std::invalid_argument("kernels._onednn conv2d: x (N, H, W, C) and weight (O, kh, kw, C)");
  }
  const dt x_type = dnnl_type(x.dtype()), w_type = dnnl_type(w.dtype());
  const dt product = (bfloat16 || x_type == dt::bf16 || w_type == dt::bf16) ? dt::bf16 : dt::f32;
  ConvShape s{int(x.shape(0)), int(x.shape(1)), int(x.shape(2)), int(x.shape(3)), int(w.shape(0)), int(w.shape(1)),
              int(w.shape(2)), stride, padding, dilation, x_type, w_type, product};
  if (s.out_h() < 1 || s.out_w() < 1) throw std::invalid_argument("kernels._onednn conv2d: the kernel does not fit");
  return s;
}

enum class ConvPass { forward, data, weights };

// One Primitive for the three passes: forward (x, w) -> y; data (cotangent, w) -> grad x; weights (x,
// cotangent) -> grad w.
class Conv : public mx::UnaryPrimitive {
 public:
  Conv(mx::Stream stream, ConvShape shape, ConvPass pass, int threads)
      : mx::UnaryPrimitive(stream), s_(shape), pass_(pass), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    ConvPlan* plan = &conv_plan(s_);
    encoder.dispatch([plan, s = s_, pass = pass_, threads = threads_, first = inputs[0].data<void>(),
                      second = inputs[1].data<void>(), result = out.data<void>()]() {
      omp_set_num_threads(threads);
      auto& strm = stream_here();
      if (pass == ConvPass::forward) {
        auto& pd = plan->forward_pd;
        auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
        auto wei = as_wanted(s.w_plain(s.w_type), second, pd.weights_desc());
        dnnl::memory dst(pd.dst_desc(), engine(), result);
        plan->forward.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
      } else if (pass == ConvPass::data) {
        auto& pd = plan->data_pd;
        auto diff_dst = as_wanted(s.y_plain(s.x_type), first, pd.diff_dst_desc());
        auto wei = as_wanted(s.w_plain(s.w_type), second, pd.weights_desc());
        dnnl::memory diff_src(pd.diff_src_desc(), engine(), result);
        plan->data.execute(strm,
                           {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DIFF_SRC, diff_src}});
      } else {
        auto& pd = plan->weights_pd;
        auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
        auto diff_dst = as_wanted(s.y_plain(s.x_type), second, pd.diff_dst_desc());
        dnnl::memory user(s.w_plain(s.w_type), engine(), result);
        if (pd.diff_weights_desc() == user.get_desc()) {
          plan->weights.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, user}});
        } else {
          dnnl::memory blocked(pd.diff_weights_desc(), engine());
          plan->weights.execute(strm,
                                {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, blocked}});
          dnnl::reorder(blocked, user).execute(strm, blocked, user);
        }
      }
      strm.wait();
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    if (pass_ != ConvPass::forward) throw std::runtime_error("kernels._onednn conv2d: no second derivatives");
    const auto& x = primals[0];
    const auto& w = primals[1];
    try {
      make_backward(conv_plan(s_), s_);
    } catch (const std::runtime_error&) {  // oneDNN refused a backward pass for this shape: MLX's own
      return mlx_vjp(primals, cotangents, argnums);
    }
    auto cotangent = mx::contiguous(mx::astype(cotangents[0], x.dtype(), stream()), false, stream());
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(array(x.shape(), x.dtype(), std::make_shared<Conv>(stream(), s_, ConvPass::data, threads_),
                              {cotangent, w}));
      } else {
        grads.push_back(array(w.shape(), w.dtype(), std::make_shared<Conv>(stream(), s_, ConvPass::weights, threads_),
                              {x, cotangent}));
      }
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnConv"; }

  // The gradients of mx::conv2d of the operands as the products used them.
  std::vector<array> mlx_vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                             const std::vector<int>& argnums) {
    const auto product = s_.product == dt::bf16 ? mx::bfloat16 : mx::float32;
    const ConvShape s = s_;
    const mx::Stream on = stream();
    std::function<std::vector<array>(const std::vector<array>&)> forward = [s, product,
                                                                            on](const std::vector<array>& in) {
      auto x = mx::astype(in[0], product, on), w = mx::astype(in[1], product, on);
      return std::vector<array>{mx::conv2d(x, w, std::make_pair(s.stride, s.stride),
                                           std::make_pair(s.padding, s.padding),
                                           std::make_pair(s.dilation, s.dilation), 1, on)};
    };
    std::vector<array> cotangent{mx::astype(cotangents[0], product, on)};
    auto [outputs, all] = mx::vjp(forward, primals, cotangent);
    std::vector<array> grads;
    for (int arg : argnums) grads.push_back(mx::astype(all[arg], primals[arg].dtype(), stream()));
    return grads;
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Conv&>(other);
    return s_.key() == o.s_.key() && pass_ == o.pass_ && threads_ == o.threads_;
  }

 private:
  ConvShape s_;
  ConvPass pass_;
  int threads_;
};

// ---------------------------------------------------------------------------------------------------
// Matrix products: op(a) (M, K) @ op(b) (K, N) (+ bias (N,)), op a transpose where asked (a strided
// view: no copy).

struct ProductShape {
  int m, k, n;
  bool transpose_a, transpose_b, bias;
  dt a_type, b_type, bias_type, product;
  std::string key() const {
    return std::to_string(m) + "," + std::to_string(k) + "," + std::to_string(n) + "," +
           std::to_string(transpose_a) + std::to_string(transpose_b) + std::to_string(bias) + "," +
           std::to_string(int(a_type)) + "," + std::to_string(int(b_type)) + "," + std::to_string(int(bias_type)) +
           "," + std::to_string(int(product));
  }
  dnnl::memory::desc a_desc(dt type) const {
    return transpose_a ? dnnl::memory::desc({m, k}, type, dims{1, m}) : dnnl::memory::desc({m, k}, type, dims{k, 1});
  }
  dnnl::memory::desc b_desc(dt type) const {
    return transpose_b ? dnnl::memory::desc({k, n}, type, dims{1, k}) : dnnl::memory::desc({k, n}, type, dims{n, 1});
  }
  dnnl::memory::desc bias_desc() const { return {{1, n}, bias_type, dims{n, 1}}; }
  dnnl::memory::desc out_desc() const { return {{m, n}, a_type, dims{n, 1}}; }
};

struct ProductPlan {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul product;
};

ProductPlan& product_plan(const ProductShape& s) {
  static std::map<std::string, std::unique_ptr<ProductPlan>> plans;
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto& slot = plans[s.key()];
  if (!slot) {
    auto pd = s.bias ? dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), s.b_desc(s.product),
                                                    s.bias_desc(), s.out_desc())
                     : dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), s.b_desc(s.product), s.out_desc());
    require_fast(pd, "this matrix product");
    slot = std::make_unique<ProductPlan>(ProductPlan{pd, dnnl::matmul(pd)});
  }
  return *slot;
}

class Product : public mx::UnaryPrimitive {
 public:
  Product(mx::Stream stream, ProductShape shape, int threads)
      : mx::UnaryPrimitive(stream), s_(shape), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    ProductPlan* plan = &product_plan(s_);
    encoder.dispatch([plan, s = s_, threads = threads_, a = inputs[0].data<void>(), b = inputs[1].data<void>(),
                      bias = s_.bias ? inputs[2].data<void>() : nullptr, result = out.data<void>()]() {
      omp_set_num_threads(threads);
      auto& strm = stream_here();
      auto src = as_wanted(s.a_desc(s.a_type), a, plan->pd.src_desc());
      auto wei = as_wanted(s.b_desc(s.b_type), b, plan->pd.weights_desc());
      dnnl::memory dst(plan->pd.dst_desc(), engine(), result);
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
      if (s.bias) args.insert({DNNL_ARG_BIAS, dnnl::memory(s.bias_desc(), engine(), const_cast<void*>(bias))});
      plan->product.execute(strm, args);
      strm.wait();
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  // out = A @ B with A = op(a), B = op(b): dA = g @ B^T, dB = A^T @ g, each as a product of the stored
  // arrays with the transposes that give it (dA^T = B @ g^T where a is stored transposed).
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    const auto& a = primals[0];
    const auto& b = primals[1];
    auto g = mx::contiguous(mx::astype(cotangents[0], a.dtype(), stream()), false, stream());
    const bool ta = s_.transpose_a, tb = s_.transpose_b, bf16 = s_.product == dt::bf16;
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(ta ? product(b, g, std::nullopt, tb, true, bf16, threads_)
                           : product(g, b, std::nullopt, false, !tb, bf16, threads_));
      } else if (arg == 1) {
        auto grad = tb ? product(g, a, std::nullopt, true, ta, bf16, threads_)
                       : product(a, g, std::nullopt, !ta, false, bf16, threads_);
        grads.push_back(mx::astype(grad, b.dtype(), stream()));
      } else {
        grads.push_back(mx::astype(kernels_native::sum_over_rows(g, stream()), primals[2].dtype(), stream()));
      }
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnProduct"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Product&>(other);
    return s_.key() == o.s_.key() && threads_ == o.threads_;
  }

 private:
  ProductShape s_;
  int threads_;
};

}  // namespace

array conv2d(const array& x, const array& weight, int stride, int padding, int dilation, bool bfloat16,
             int threads) {
  const ConvShape s = conv_shape(x, weight, stride, padding, dilation, bfloat16);
  conv_plan(s);  // made here, where an error can reach the caller
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({s.n, s.out_h(), s.out_w(), s.o}, x.dtype(), std::make_shared<Conv>(stream, s, ConvPass::forward, threads),
               {mx::contiguous(x, false, stream), mx::contiguous(weight, false, stream)});
}

array product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a, bool transpose_b,
              bool bfloat16, int threads) {
  if (a.ndim() != 2 || b.ndim() != 2) throw std::invalid_argument("kernels._onednn product: two matrices");
  const int m = transpose_a ? a.shape(1) : a.shape(0), k = transpose_a ? a.shape(0) : a.shape(1);
  const int kb = transpose_b ? b.shape(1) : b.shape(0), n = transpose_b ? b.shape(0) : b.shape(1);
  if (k != kb || (bias && (bias->ndim() != 1 || bias->shape(0) != n))) {
    throw std::invalid_argument("kernels._onednn product: the shapes do not multiply");
  }
  const dt a_type = dnnl_type(a.dtype()), b_type = dnnl_type(b.dtype());
  const dt product_type = (bfloat16 || a_type == dt::bf16 || b_type == dt::bf16) ? dt::bf16 : dt::f32;
  ProductShape s{m, k, n, transpose_a, transpose_b, bool(bias), a_type, b_type,
                 bias ? dnnl_type(bias->dtype()) : dt::f32, product_type};
  product_plan(s);
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(a, false, stream), mx::contiguous(b, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  return array({m, n}, a.dtype(), std::make_shared<Product>(stream, s, threads), std::move(inputs));
}

std::string describe() {
  const auto* version = dnnl::version();
  return "oneDNN " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
         std::to_string(version->patch);
}

std::string conv2d_implementation(const array& x, const array& weight, int stride, int padding, int dilation,
                                  bool bfloat16) {
  return conv_plan(conv_shape(x, weight, stride, padding, dilation, bfloat16)).forward_pd.impl_info_str();
}

}  // namespace kernels_onednn
