// kernels._onednn's convolutions (onednn.cpp has the story: precision, plans, weights, threads): x (N, H,
// W, C) and the result channels-last, the weight (O, kh, kw, C) as MLX keeps it; the forward, and the
// backward data and weights passes (oneDNN's, or the patches' where oneDNN's lose or are wrong) as its VJP.

#include <omp.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "dispatch.h"
#include "onednn_shared.h"
#include "ops.h"  // patches, unpatches: the backward where oneDNN has no fast one

namespace kernels_onednn {

using mx::array;

namespace {

struct ConvShape {
  int n, h, w, c, o, kh, kw, stride, padding, dilation;
  dt x_type, w_type, product;  // the operands' dtypes and the products'
  int out_h() const { return (h + 2 * padding - dilation * (kh - 1) - 1) / stride + 1; }
  int out_w() const { return (w + 2 * padding - dilation * (kw - 1) - 1) / stride + 1; }
  std::string key() const {
    std::string key;
    for (int v : {n, h, w, c, o, kh, kw, stride, padding, dilation, int(x_type), int(w_type), int(product)}) {
      key += std::to_string(v) + ",";
    }
    return key;
  }
  dnnl::memory::desc x_plain(dt type) const { return {{n, c, h, w}, type, tag::nhwc}; }
  dnnl::memory::desc y_plain(dt type) const { return {{n, o, out_h(), out_w()}, type, tag::nhwc}; }
  dnnl::memory::desc w_plain(dt type) const { return {{o, c, kh, kw}, type, tag::ohwi}; }
  dnnl::memory::desc w_any() const { return {{o, c, kh, kw}, product, tag::any}; }
  dims strides() const { return {stride, stride}; }
  dims dilates() const { return {dilation - 1, dilation - 1}; }
  dims pads() const { return {padding, padding}; }
};

// Why a backward pass goes to the patches (im2col / col2im on every core and OpenBLAS's products, as
// deformable_detr/models/convolution.py's) rather than oneDNN's `kernel` for it, or "": oneDNN 3.2's older
// direct JIT kernels lose to them on AVX2 for both passes (weights 1.3-6.7x, a strided convolution's data
// up to 8x, R50's shapes) and on any ISA for a strided 1 x 1 (1.2-1.6x); its brgemm kernels do not
// (bench/conv_backward.py; bench/results/cpu/*/conv_backward_cpu.txt). Float32 only: the patches have no
// bfloat16.
std::string slower_than_patches(const std::string& kernel, const ConvShape& s) {
  const bool direct_jit = !keep_slower_passes() && (kernel.rfind("jit:", 0) == 0 || kernel.rfind("jit_1x1:", 0) == 0);
  if (!direct_jit || s.product != dt::f32 || s.x_type != dt::f32 || s.w_type != dt::f32) return "";
  if (kernel.size() > 5 && kernel.compare(kernel.size() - 5, 5, ":avx2") == 0) {
    return "oneDNN's " + kernel + " is slower than the patches";
  }
  if (s.kh == 1 && s.kw == 1 && s.stride > 1) {
    return "oneDNN's " + kernel + " is slower than the patches for a strided 1 x 1";
  }
  return "";
}

}  // namespace

// The primitives of one shape. `refused`: why oneDNN has no fast forward for it ("" where it has one).
// The backward passes are made by the first VJP, once: each oneDNN's, or, where `data_refused` or
// `weights_refused` says why not (no fast kernel, a wrong one, or one the patches beat), the patches'.
struct ConvPlan {
  std::string refused;
  // Kept whatever the cache's capacity: an AMX convolution (brgconv:avx512_core_amx). oneDNN 3.2 keeps
  // every brgemm kernel its convolutions JIT-compile in a store for the process's life
  // (BRGEMM_KERNEL_GLOBAL_STORAGE, disabled in oneDNN 3.4: uxlfoundation/oneDNN#1757), and those of an AMX
  // convolution differ each time it is made, so every plan made again added its kernels for good: about
  // 90 KB a bfloat16 3 x 3 convolution of 64 channels made again (1,000 remakes: +90 MiB; float32, AVX512-BF16
  // and products: 0-7 KB), and a server at `auto` meeting more sizes than the cache holds grew without end.
  // Kept, each shape is made once: the memory grows with the shapes met, as it would with one remake.
  bool lasting = false;
  dnnl::convolution_forward::primitive_desc forward_pd;
  dnnl::convolution_forward forward;
  std::once_flag backward_made;  // what it makes is assigned, never thrown: a refusal is remembered
  std::string data_refused, weights_refused;
  dnnl::convolution_backward_data::primitive_desc data_pd;
  dnnl::convolution_backward_data data;
  dnnl::convolution_backward_weights::primitive_desc weights_pd;
  dnnl::convolution_backward_weights weights;

  void make_backward(const ConvShape& s) {
    std::call_once(backward_made, [&] {
      try {
        data_pd = dnnl::convolution_backward_data::primitive_desc(
            engine(), dnnl::algorithm::convolution_direct, s.x_plain(s.x_type), s.w_any(), s.y_plain(s.product),
            s.strides(), s.dilates(), s.pads(), s.pads(), forward_pd, attributes());
        data_refused = refusal(data_pd, "its backward data", true);
        if (data_refused.empty()) data_refused = slower_than_patches(data_pd.impl_info_str(), s);
        if (data_refused.empty()) data = dnnl::convolution_backward_data(data_pd);
      } catch (const std::exception& error) {  // dnnl::error: no implementation at all
        data_refused = std::string("its backward data: ") + error.what();
      }
      try {
        weights_pd = dnnl::convolution_backward_weights::primitive_desc(
            engine(), dnnl::algorithm::convolution_direct, s.x_plain(s.product),
            dnnl::memory::desc({s.o, s.c, s.kh, s.kw}, s.w_type == dt::f32 ? dt::f32 : s.product, tag::any),
            s.y_plain(s.product), s.strides(), s.dilates(), s.pads(), s.pads(), forward_pd, attributes());
        weights_refused = refusal(weights_pd, "its backward weights", true);
        const std::string kernel = weights_pd.impl_info_str();  // a const char*: compared as a string
        if (weights_refused.empty() && kernel == "jit_1x1:avx2" && s.stride > 1 && s.c < 8) {
          weights_refused = "its backward weights: oneDNN 3.2's jit_1x1:avx2 is wrong for a strided 1 x 1 on "
                            "fewer than 8 channels (tests/test_onednn.py)";
        }
        if (weights_refused.empty()) weights_refused = slower_than_patches(kernel, s);
        if (weights_refused.empty()) weights = dnnl::convolution_backward_weights(weights_pd);
      } catch (const std::exception& error) {
        weights_refused = std::string("its backward weights: ") + error.what();
      }
    });
  }
};

Plans<ConvPlan>& conv_plans() {
  static Plans<ConvPlan> plans;
  return plans;
}

namespace {

std::shared_ptr<ConvPlan> conv_plan(const ConvShape& s) {
  return conv_plans().get(s.key(), [&s] {
    auto plan = std::make_shared<ConvPlan>();
    try {
      // x and the result in the products' dtype for the kernel; the result may be float32 with bf16 products
      plan->forward_pd = dnnl::convolution_forward::primitive_desc(
          engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, s.x_plain(s.product),
          s.w_any(), s.y_plain(s.x_type), s.strides(), s.dilates(), s.pads(), s.pads(), attributes());
      plan->refused = refusal(plan->forward_pd, "this convolution", true);
      if (plan->refused.empty()) plan->forward = dnnl::convolution_forward(plan->forward_pd);
      const std::string kernel = plan->forward_pd.impl_info_str();
      plan->lasting = plan->refused.empty() && kernel.find("amx") != std::string::npos;
    } catch (const std::exception& error) {  // dnnl::error: no implementation at all (bfloat16 on AVX2)
      plan->refused = error.what();
    }
    return plan;
  });
}

enum class ConvPass { forward, data, weights };

std::vector<array> conv_gradients(const ConvShape& s, const std::shared_ptr<ConvPlan>& plan,
                                  const std::vector<array>& primals, const array& cotangent_given,
                                  const std::vector<int>& argnums, int threads, mx::Stream on);

// One Primitive for the three passes: forward (x, w) -> y; data (cotangent, w) -> grad x; weights (x,
// cotangent) -> grad w. It holds its plan: an evicted plan lives while a graph still uses it.
class Conv : public mx::UnaryPrimitive {
 public:
  Conv(mx::Stream stream, ConvShape shape, std::shared_ptr<ConvPlan> plan, ConvPass pass,
       std::shared_ptr<WeightCopies> kept, int threads)
      : mx::UnaryPrimitive(stream),
        s_(shape),
        plan_(std::move(plan)),
        pass_(pass),
        kept_(std::move(kept)),
        threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([plan = plan_, s = s_, pass = pass_, threads = threads_, first = inputs[0].data<void>(),
                      second = inputs[1].data<void>(), kept = kept_,
                      source = kept_ ? inputs[1].data_shared_ptr() : nullptr,
                      result = out.data<void>()]() {
      omp_set_num_threads(threads);
      if (pass == ConvPass::forward) {
        auto& pd = plan->forward_pd;
        auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
        auto wei = weight_as_wanted(kept, source, second, s.w_plain(s.w_type), pd.weights_desc());
        dnnl::memory dst(pd.dst_desc(), engine(), result);
        execute(plan->forward, pd.scratchpad_desc(),
                {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei.memory}, {DNNL_ARG_DST, dst}});
      } else if (pass == ConvPass::data) {
        auto& pd = plan->data_pd;
        auto diff_dst = as_wanted(s.y_plain(s.x_type), first, pd.diff_dst_desc());
        auto wei = as_wanted(s.w_plain(s.w_type), second, pd.weights_desc());
        dnnl::memory diff_src(pd.diff_src_desc(), engine(), result);
        execute(plan->data, pd.scratchpad_desc(),
                {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DIFF_SRC, diff_src}});
      } else {
        auto& pd = plan->weights_pd;
        auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
        auto diff_dst = as_wanted(s.y_plain(s.x_type), second, pd.diff_dst_desc());
        dnnl::memory user(s.w_plain(s.w_type), engine(), result);
        if (pd.diff_weights_desc() == user.get_desc()) {
          execute(plan->weights, pd.scratchpad_desc(),
                  {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, user}});
        } else {
          dnnl::memory blocked(pd.diff_weights_desc(), engine());
          execute(plan->weights, pd.scratchpad_desc(),
                  {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, blocked}});
          dnnl::reorder(blocked, user).execute(stream_here(), blocked, user);
          stream_here().wait();
        }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    if (pass_ != ConvPass::forward) throw std::runtime_error("kernels._onednn conv2d: no second derivatives");
    return conv_gradients(s_, plan_, primals, cotangents[0], argnums, threads_, stream());
  }

  const char* name() const override { return "KernelsOnednnConv"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Conv&>(other);
    return s_.key() == o.s_.key() && pass_ == o.pass_ && kept_ == o.kept_ && threads_ == o.threads_;
  }

 private:
  ConvShape s_;
  std::shared_ptr<ConvPlan> plan_;
  ConvPass pass_;
  std::shared_ptr<WeightCopies> kept_;
  int threads_;
};

// A gradient as deformable_detr/models/convolution.py's patches take it (float32), on every core: the
// weight's (arg 1), the cotangent times the input's patches (im2col); the input's (arg 0), the transpose
// of patches (col2im) of the cotangent times the weight. For a pass oneDNN has no fast or right kernel
// for, or one the patches beat (ConvPlan).
array patches_gradient(const ConvShape& s, int arg, const array& x, const array& w, const array& cotangent, int threads,
                       mx::Stream on) {
  const auto rows = mx::reshape(cotangent, {-1, s.o}, on);
  if (arg == 0) {
    auto columns = mx::matmul(rows, mx::reshape(w, {s.o, -1}, on), on);
    columns = mx::reshape(columns, {s.n, s.out_h(), s.out_w(), -1}, on);
    return kernels::unpatches(columns, s.h, s.w, s.kh, s.kw, s.stride, s.padding, s.dilation, threads);
  }
  auto columns = kernels::patches(x, s.kh, s.kw, s.stride, s.padding, s.dilation, threads);
  columns = mx::reshape(columns, {-1, s.kh * s.kw * s.c}, on);
  return mx::reshape(mx::matmul(mx::transpose(rows, on), columns, on), w.shape(), on);
}

// The gradients of mx::conv2d of the operands as the products used them (bfloat16 operands or products).
std::vector<array> mlx_gradients(const ConvShape& s, const std::vector<array>& primals, const array& cotangent,
                                 const std::vector<int>& argnums, mx::Stream on) {
  const auto product = s.product == dt::bf16 ? mx::bfloat16 : mx::float32;
  std::function<std::vector<array>(const std::vector<array>&)> forward = [s, product,
                                                                          on](const std::vector<array>& in) {
    auto x = mx::astype(in[0], product, on), w = mx::astype(in[1], product, on);
    return std::vector<array>{mx::conv2d(x, w, std::make_pair(s.stride, s.stride),
                                         std::make_pair(s.padding, s.padding),
                                         std::make_pair(s.dilation, s.dilation), 1, on)};
  };
  std::vector<array> cotangents{mx::astype(cotangent, product, on)};
  auto [outputs, all] = mx::vjp(forward, {primals[0], primals[1]}, cotangents);
  std::vector<array> grads;
  for (int arg : argnums) grads.push_back(mx::astype(all[arg], primals[arg].dtype(), on));
  return grads;
}

// The gradients w.r.t. x (arg 0) and the weight (arg 1) of the convolution of shape `s` (`plan`: its plan),
// given the cotangent of its result: oneDNN's backward passes, or the patches' where ConvPlan says why not, or
// MLX's where neither runs (bfloat16).
std::vector<array> conv_gradients(const ConvShape& s, const std::shared_ptr<ConvPlan>& plan,
                                  const std::vector<array>& primals, const array& cotangent_given,
                                  const std::vector<int>& argnums, int threads, mx::Stream on) {
  plan->make_backward(s);
  const bool float32 = s.x_type == dt::f32 && s.w_type == dt::f32 && s.product == dt::f32;
  for (int arg : argnums) {  // a pass neither oneDNN nor the patches run (bfloat16): MLX's, all of them
    if (!float32 && !(arg == 0 ? plan->data_refused : plan->weights_refused).empty()) {
      return mlx_gradients(s, primals, cotangent_given, argnums, on);
    }
  }
  const auto& x = primals[0];
  const auto& w = primals[1];
  auto cotangent = mx::contiguous(mx::astype(cotangent_given, x.dtype(), on), false, on);
  std::vector<array> grads;
  for (int arg : argnums) {
    if (arg == 0 && plan->data_refused.empty()) {
      grads.push_back(array(x.shape(), x.dtype(), std::make_shared<Conv>(on, s, plan, ConvPass::data, nullptr, threads),
                            {cotangent, w}));
    } else if (arg == 1 && plan->weights_refused.empty()) {
      grads.push_back(array(w.shape(), w.dtype(),
                            std::make_shared<Conv>(on, s, plan, ConvPass::weights, nullptr, threads), {x, cotangent}));
    } else {
      grads.push_back(patches_gradient(s, arg, x, w, cotangent, threads, on));
    }
  }
  return grads;
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


// ---------------------------------------------------------------------------------------------------
// A convolution and what follows it in a network, as OpenVINO and TensorRT run them: a bias (a frozen batch
// norm folded into the weight and this bias, deformable_detr/models/convolution.py), a residual added and a
// ReLU, as oneDNN post-ops of the convolution (its binary add reads the residual, its eltwise ReLU runs on the
// accumulator before the result is stored), the result in `y_type` (bfloat16 where the next convolution takes
// bfloat16: no float32 copy between them). One pass over memory where the unfused way made three more.

struct Fusion {
  bool bias = false, residual = false, relu = false;
  dt bias_type = dt::f32, residual_type = dt::f32, y_type = dt::f32;
  std::string key() const {
    std::string key = "fused:";
    for (int v : {int(bias), int(residual), int(relu), int(bias_type), int(residual_type), int(y_type)}) {
      key += std::to_string(v) + ",";
    }
    return key;
  }
};

std::shared_ptr<ConvPlan> fused_plan(const ConvShape& s, const Fusion& f) {
  return conv_plans().get(f.key() + s.key(), [&s, &f] {
    auto plan = std::make_shared<ConvPlan>();
    try {
      dnnl::primitive_attr attr;  // a new one: attributes() is shared, and a copy of a handle shares it
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      dnnl::post_ops ops;
      if (f.residual) ops.append_binary(dnnl::algorithm::binary_add, s.y_plain(f.residual_type));
      if (f.relu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
      attr.set_post_ops(ops);
      const auto prop = dnnl::prop_kind::forward_training;
      const auto direct = dnnl::algorithm::convolution_direct;
      plan->forward_pd =
          f.bias ? dnnl::convolution_forward::primitive_desc(
                       engine(), prop, direct, s.x_plain(s.product), s.w_any(),
                       dnnl::memory::desc({s.o}, f.bias_type, tag::a), s.y_plain(f.y_type), s.strides(), s.dilates(),
                       s.pads(), s.pads(), attr)
                 : dnnl::convolution_forward::primitive_desc(engine(), prop, direct, s.x_plain(s.product), s.w_any(),
                                                             s.y_plain(f.y_type), s.strides(), s.dilates(), s.pads(),
                                                             s.pads(), attr);
      plan->refused = refusal(plan->forward_pd, "this convolution with its post-ops", true);
      if (plan->refused.empty()) plan->forward = dnnl::convolution_forward(plan->forward_pd);
      plan->lasting = plan->refused.empty() && std::string(plan->forward_pd.impl_info_str()).find("amx") != std::string::npos;
    } catch (const std::exception& error) {
      plan->refused = error.what();
    }
    return plan;
  });
}

// inputs: x, weight[, bias][, residual]. Its VJP: the cotangent where the result is positive (ReLU), which is
// the residual's gradient, summed over pixels the bias's, and the convolution's own (conv_gradients, of the
// convolution without post-ops).
class FusedConv : public mx::UnaryPrimitive {
 public:
  FusedConv(mx::Stream stream, ConvShape shape, Fusion fusion, std::shared_ptr<ConvPlan> plan,
            std::shared_ptr<WeightCopies> kept, int threads)
      : mx::UnaryPrimitive(stream), s_(shape), f_(fusion), plan_(std::move(plan)), kept_(std::move(kept)),
        threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const int residual_at = f_.bias ? 3 : 2;
    encoder.dispatch([plan = plan_, s = s_, f = f_, threads = threads_, x = inputs[0].data<void>(),
                      w = inputs[1].data<void>(), kept = kept_, source = kept_ ? inputs[1].data_shared_ptr() : nullptr,
                      bias = f_.bias ? inputs[2].data<void>() : nullptr,
                      residual = f_.residual ? inputs[residual_at].data<void>() : nullptr, result = out.data<void>()]() {
      omp_set_num_threads(threads);
      auto& pd = plan->forward_pd;
      auto src = as_wanted(s.x_plain(s.x_type), x, pd.src_desc());
      auto wei = weight_as_wanted(kept, source, w, s.w_plain(s.w_type), pd.weights_desc());
      std::unordered_map<int, dnnl::memory> args{
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei.memory}, {DNNL_ARG_DST, dnnl::memory(pd.dst_desc(), engine(), result)}};
      if (f.bias) args.insert({DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), engine(), const_cast<void*>(bias))});
      if (f.residual) {
        args.insert({DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                     dnnl::memory(s.y_plain(f.residual_type), engine(), const_cast<void*>(residual))});
      }
      execute(plan->forward, pd.scratchpad_desc(), std::move(args));
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>& outputs) override {
    const mx::Stream on = stream();
    array g = mx::astype(cotangents[0], outputs[0].dtype(), on);
    if (f_.relu) g = relu_gradient(g, outputs[0], threads_);
    std::vector<int> convolution_args;
    for (int arg : argnums) {
      if (arg < 2) convolution_args.push_back(arg);
    }
    std::vector<array> convolution_grads;
    if (!convolution_args.empty()) {
      convolution_grads = conv_gradients(s_, conv_plan(s_), primals, g, convolution_args, threads_, on);
    }
    std::vector<array> grads;
    size_t next = 0;
    const int bias_at = f_.bias ? 2 : -1, residual_at = f_.residual ? (f_.bias ? 3 : 2) : -1;
    for (int arg : argnums) {
      if (arg < 2) {
        grads.push_back(convolution_grads[next++]);
      } else if (arg == bias_at) {
        auto rows = mx::reshape(mx::astype(g, mx::float32, on), {-1, s_.o}, on);
        grads.push_back(mx::astype(kernels_native::sum_over_rows(rows, on), primals[arg].dtype(), on));
      } else if (arg == residual_at) {
        grads.push_back(mx::astype(g, primals[arg].dtype(), on));
      }
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnFusedConv"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FusedConv&>(other);
    return s_.key() == o.s_.key() && f_.key() == o.f_.key() && kept_ == o.kept_ && threads_ == o.threads_;
  }

 private:
  ConvShape s_;
  Fusion f_;
  std::shared_ptr<ConvPlan> plan_;
  std::shared_ptr<WeightCopies> kept_;
  int threads_;
};

}  // namespace

std::optional<array> conv2d(const array& x, const array& weight, int stride, int padding, int dilation, bool bfloat16,
                            const KeptWeights* kept, int threads) {
  const ConvShape s = conv_shape(x, weight, stride, padding, dilation, bfloat16);
  auto plan = conv_plan(s);  // made here, on the caller's thread
  if (!plan->refused.empty()) return std::nullopt;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({s.n, s.out_h(), s.out_w(), s.o}, x.dtype(),
               std::make_shared<Conv>(stream, s, std::move(plan), ConvPass::forward, kept ? kept->copies : nullptr,
                                      threads),
               {mx::contiguous(x, false, stream), mx::contiguous(weight, false, stream)});
}

std::optional<array> conv2d_fused(const array& x, const array& weight, const std::optional<array>& bias,
                                  const std::optional<array>& residual, bool relu, const std::string& result, int stride,
                                  int padding, int dilation, bool bfloat16, const KeptWeights* kept, int threads) {
  const ConvShape s = conv_shape(x, weight, stride, padding, dilation, bfloat16);
  Fusion f;
  f.bias = bool(bias);
  f.residual = bool(residual);
  f.relu = relu;
  f.bias_type = bias ? dnnl_type(bias->dtype()) : dt::f32;
  f.residual_type = residual ? dnnl_type(residual->dtype()) : dt::f32;
  f.y_type = result_type(result, s.x_type);
  const mx::Shape y_shape{s.n, s.out_h(), s.out_w(), s.o};
  if ((bias && (bias->ndim() != 1 || bias->shape(0) != s.o)) || (residual && residual->shape() != y_shape)) {
    throw std::invalid_argument("kernels._onednn conv2d: a bias (O,) and a residual of the result's shape");
  }
  auto plan = fused_plan(s, f);
  if (!plan->refused.empty()) return std::nullopt;
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(x, false, stream), mx::contiguous(weight, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  if (residual) inputs.push_back(mx::contiguous(*residual, false, stream));
  return array(y_shape, f.y_type == dt::bf16 ? mx::bfloat16 : mx::float32,
               std::make_shared<FusedConv>(stream, s, f, std::move(plan), kept ? kept->copies : nullptr, threads),
               std::move(inputs));
}

// The implementations oneDNN chose for this convolution ("brgconv:avx512_core_bf16"; with `backward`,
// "forward; backward data; backward weights", a pass the patches run as "patches (why)"), or why it is
// refused.
std::string conv2d_implementation(const array& x, const array& weight, int stride, int padding, int dilation,
                                  bool bfloat16, bool backward) {
  const ConvShape s = conv_shape(x, weight, stride, padding, dilation, bfloat16);
  auto plan = conv_plan(s);
  if (!plan->refused.empty()) return "refused: " + plan->refused;
  const std::string forward = plan->forward_pd.impl_info_str();
  if (!backward) return forward;
  plan->make_backward(s);
  auto pass = [](const std::string& refused, const char* kernel) {
    return refused.empty() ? std::string(kernel) : "patches (" + refused + ")";
  };
  return forward + "; " + pass(plan->data_refused, plan->data_pd ? plan->data_pd.impl_info_str() : "") + "; " +
         pass(plan->weights_refused, plan->weights_pd ? plan->weights_pd.impl_info_str() : "");
}

}  // namespace kernels_onednn
