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
    plan_->make_backward(s_);
    const bool float32 = s_.x_type == dt::f32 && s_.w_type == dt::f32 && s_.product == dt::f32;
    for (int arg : argnums) {  // a pass neither oneDNN nor the patches run (bfloat16): MLX's, all of them
      if (!float32 && !(arg == 0 ? plan_->data_refused : plan_->weights_refused).empty()) {
        return mlx_vjp(primals, cotangents, argnums);
      }
    }
    const auto& x = primals[0];
    const auto& w = primals[1];
    auto cotangent = mx::contiguous(mx::astype(cotangents[0], x.dtype(), stream()), false, stream());
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0 && plan_->data_refused.empty()) {
        grads.push_back(array(x.shape(), x.dtype(),
                              std::make_shared<Conv>(stream(), s_, plan_, ConvPass::data, nullptr, threads_),
                              {cotangent, w}));
      } else if (arg == 1 && plan_->weights_refused.empty()) {
        grads.push_back(array(w.shape(), w.dtype(),
                              std::make_shared<Conv>(stream(), s_, plan_, ConvPass::weights, nullptr, threads_),
                              {x, cotangent}));
      } else {
        grads.push_back(patches_gradient(arg, x, w, cotangent));
      }
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnConv"; }

  // A gradient as deformable_detr/models/convolution.py's patches take it (float32), on every core: the
  // weight's (arg 1), the cotangent times the input's patches (im2col); the input's (arg 0), the transpose
  // of patches (col2im) of the cotangent times the weight. For a pass oneDNN has no fast or right kernel
  // for, or one the patches beat (ConvPlan).
  array patches_gradient(int arg, const array& x, const array& w, const array& cotangent) {
    const mx::Stream on = stream();
    const auto rows = mx::reshape(cotangent, {-1, s_.o}, on);
    if (arg == 0) {
      auto columns = mx::matmul(rows, mx::reshape(w, {s_.o, -1}, on), on);
      columns = mx::reshape(columns, {s_.n, s_.out_h(), s_.out_w(), -1}, on);
      return kernels::unpatches(columns, s_.h, s_.w, s_.kh, s_.kw, s_.stride, s_.padding, s_.dilation, threads_);
    }
    auto columns = kernels::patches(x, s_.kh, s_.kw, s_.stride, s_.padding, s_.dilation, threads_);
    columns = mx::reshape(columns, {-1, s_.kh * s_.kw * s_.c}, on);
    return mx::reshape(mx::matmul(mx::transpose(rows, on), columns, on), w.shape(), on);
  }

  // The gradients of mx::conv2d of the operands as the products used them (bfloat16 operands or products).
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
    return s_.key() == o.s_.key() && pass_ == o.pass_ && kept_ == o.kept_ && threads_ == o.threads_;
  }

 private:
  ConvShape s_;
  std::shared_ptr<ConvPlan> plan_;
  ConvPass pass_;
  std::shared_ptr<WeightCopies> kept_;
  int threads_;
};

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
