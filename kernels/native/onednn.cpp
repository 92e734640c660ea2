// kernels._onednn: convolutions and matrix products on oneDNN (Intel's deep learning kernels: JIT code
// for AVX2, AVX-512, AVX512-BF16 and AMX, in blocked layouts) as MLX Primitives on MLX's CPU stream,
// with their gradients (convolution backward data and backward weights; products of the cotangent).
//
// Precision: the products run in bfloat16 (accumulating in float32) where asked (`bfloat16`) or where
// either operand is bfloat16, in float32 otherwise; an operand of the other dtype is converted on the
// way in (a oneDNN reorder on every core, into a scratch buffer; a convolution's weight is reordered
// anyway). The result has the first operand's dtype (x's, a's): float32 operands with bfloat16 products
// give a float32 result, and no bfloat16 copy of a weight is kept (but in a KeptWeights, below).
//
// Plans: each shape's primitives (a convolution's forward, and backward data and weights where asked;
// a product's) are made once, on the caller's thread while the graph is built, and kept in a
// least-recently-used cache of `plan_capacity()` plans (DEFORMABLE_DETR_ONEDNN_PLANS, default 32);
// oneDNN's own primitive cache, which holds the same JIT code, gets the same capacity. A shape oneDNN
// has no fast implementation for is remembered in the same cache as refused, with why: the caller
// gets None and computes it its own way, without oneDNN being asked again. Every primitive gets its
// scratchpad for the call only (`scratchpad_mode::user`; 11 MB at most in R50's step): oneDNN's default gives
// each primitive its own for its lifetime (tens of MB for a backward-weights pass on AVX2), which made
// the process grow by each shape's plans (issue 61: 46 MiB a shape in R50 training).
//
// Weights: a convolution's (O, kh, kw, C) weight is reordered into the layout oneDNN's kernel chose
// (`format_tag::any`; a plain one makes oneDNN 3.2 take its reference loops, 100x slower) at every
// evaluation (about 2% of an R50 forward), always right whatever the weight's version; or, given a model's
// KeptWeights (onednn.h: a Detector's, whose weights do not change), once, the copy kept there (and a
// product's bfloat16 copy of a float32 weight).
//
// Threads: oneDNN's OpenMP team, `threads` wide, set on MLX's stream thread before each call.

#include <omp.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <list>
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
#include "onednn.h"
#include "ops.h"  // patches, unpatches: the backward where oneDNN has no fast one

namespace kernels_onednn {

namespace mx = mlx::core;
using mx::array;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

// The product's VJP makes products (never refused: the forward's plan was made for these dtypes); a
// weight's gradient on AVX2 is MLX's (OpenBLAS's), faster there.
array gradient_product(const array& a, const array& b, bool transpose_a, bool transpose_b, bool bfloat16, int threads);

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

// Every primitive's attributes: the scratchpad is the caller's, for one call (see the top).
const dnnl::primitive_attr& attributes() {
  static const dnnl::primitive_attr attr = [] {
    dnnl::primitive_attr a;
    a.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return a;
  }();
  return attr;
}

// Why oneDNN's choice for a primitive is refused, or "" where it is fast: its reference loops (`ref:any`,
// `gemm:ref`) are all it has for a shape and dtype (bfloat16 on a CPU without AVX-512); a convolution
// also refuses oneDNN's im2col + GEMM (`gemm:jit`, taken for narrow images: a 7 x 7 stem on a 1 or 2
// pixel wide input), which crashed there (oneDNN 3.2) and is what the caller's own path does anyway.
template <typename Desc>
std::string refusal(const Desc& pd, const std::string& what, bool convolution = false) {
  const std::string impl = pd.impl_info_str();
  if (impl.find("ref") != std::string::npos || (convolution && impl.find("gemm") != std::string::npos)) {
    return what + " has no fast oneDNN kernel here (only " + impl + ")";
  }
  return "";
}

// A primitive's scratchpad, for one call: from malloc, as oneDNN's own, not MLX's allocator, so that MLX's
// peak stays its arrays' (training/memory_plan.py extrapolates it over images, which a scratchpad of a
// thread count's reduction buffers is not); freed, glibc's heap keeps it for the next call (runtime.py).
class Scratchpad {
 public:
  Scratchpad(const dnnl::memory::desc& desc, std::unordered_map<int, dnnl::memory>& args) {
    const size_t size = desc.get_size();
    if (size == 0) return;
    data_.reset(static_cast<char*>(std::aligned_alloc(64, (size + 63) / 64 * 64)));
    if (!data_) throw std::bad_alloc();
    args.insert({DNNL_ARG_SCRATCHPAD, dnnl::memory(desc, engine(), data_.get())});
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
};

std::atomic<size_t> largest_scratchpad{0};  // caches()' "largest_scratchpad": the most a call has needed

void execute(const dnnl::primitive& primitive, const dnnl::memory::desc& scratchpad,
             std::unordered_map<int, dnnl::memory> args) {
  for (size_t seen = largest_scratchpad.load(); scratchpad.get_size() > seen;) {
    if (largest_scratchpad.compare_exchange_weak(seen, scratchpad.get_size())) break;
  }
  Scratchpad held(scratchpad, args);
  primitive.execute(stream_here(), args);
  stream_here().wait();
}

// `user` (a plain buffer of `user_desc`) as `wanted`: the same memory where the descriptions agree, else
// a reorder (layout and dtype) on every core into `into`, or into a new buffer of oneDNN's where none is given.
dnnl::memory as_wanted(const dnnl::memory::desc& user_desc, const void* data, const dnnl::memory::desc& wanted,
                       void* into = nullptr) {
  dnnl::memory user(user_desc, engine(), const_cast<void*>(data));
  if (user_desc == wanted) return user;
  dnnl::memory converted = into ? dnnl::memory(wanted, engine(), into) : dnnl::memory(wanted, engine());
  dnnl::reorder(user, converted).execute(stream_here(), user, converted);
  return converted;
}

// ---------------------------------------------------------------------------------------------------
// The caches: plans by shape (count), kept weights by buffer (bytes); least recently used out first.

size_t& plan_capacity_value() {
  static size_t capacity = 32;  // kernels/onednn.py sets DEFORMABLE_DETR_ONEDNN_PLANS' value
  return capacity;
}

template <typename Plan>
class Plans {
 public:
  // The plan of `key`, made by `make` where it is not kept (then the least recently used goes where
  // there are more than the capacity).
  std::shared_ptr<Plan> get(const std::string& key, const std::function<std::shared_ptr<Plan>()>& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto found = index_.find(key); found != index_.end()) {
      order_.splice(order_.begin(), order_, found->second);
      return found->second->second;
    }
    auto plan = make();
    order_.emplace_front(key, plan);
    index_[key] = order_.begin();
    trim();
    return plan;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return order_.size();
  }
  void shrink() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim();
  }

 private:
  void trim() {
    while (order_.size() > plan_capacity_value()) {
      index_.erase(order_.back().first);
      order_.pop_back();  // a Primitive still in a graph holds its plan until it is done
    }
  }
  std::list<std::pair<std::string, std::shared_ptr<Plan>>> order_;
  std::unordered_map<std::string, typename decltype(order_)::iterator> index_;
  std::mutex mutex_;
};

}  // namespace

// A weight as a primitive reads it: `memory`, and `pages`, which hold a kept copy's buffer while it is used
// (none for the weight itself or a copy oneDNN made and owns).
struct Weight {
  dnnl::memory memory;
  std::shared_ptr<void> pages;
};

namespace {

// `bytes` of pages of their own, from mmap rather than glibc's heap, unmapped when the last holder lets go.
// A kept copy lives as long as its model, and is replaced when a new size wants another layout: in the
// heap (which runtime.py tells to keep what is freed) such buffers would leave holes of their sizes
// among MLX's arrays, and the process's memory would grow with the sizes met (measured as AVX2 over 300
// sizes: +14.5 MiB of free heap after the tenth, +4.7 without oneDNN).
std::shared_ptr<void> own_pages(size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  return std::shared_ptr<void>(data, [bytes](void* p) { munmap(p, bytes); });
}

}  // namespace

// Weights in the layout and dtype a primitive wants, by the weight's buffer: a model's store
// (KeptWeights), one copy of each weight, at most `capacity` bytes of copies, the least recently used
// out first. One copy, not one for each layout asked: on AVX2 oneDNN's brgconv blocks a weight's output
// channels by 16, 24 or 32 as the image's width suits, so a model meeting many sizes would keep up to
// three copies of each weight (measured as AVX2 over 300 sizes: 40 -> 46 copies, 24 -> 32 MiB, after
// the tenth size); a weight wanted in another layout is reordered once more (a weight's bytes, against
// its convolution's work on a whole image) and that copy replaces the other.
class WeightCopies {
 public:
  explicit WeightCopies(size_t capacity) : capacity_(capacity) {}

  Weight get(const std::shared_ptr<mx::array::Data>& source, const void* data, const dnnl::memory::desc& plain,
             const dnnl::memory::desc& wanted) {
    if (plain == wanted) return {dnnl::memory(plain, engine(), const_cast<void*>(data)), nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto entry = order_.begin(); entry != order_.end(); ++entry) {
        if (entry->source == source && entry->data == data && entry->copy.memory.get_desc() == wanted) {
          order_.splice(order_.begin(), order_, entry);
          return order_.front().copy;
        }
      }
    }
    const size_t bytes = wanted.get_size();
    std::shared_ptr<void> pages = own_pages(bytes);
    const Weight copy{as_wanted(plain, data, wanted, pages.get()), pages};
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto entry = order_.begin(); entry != order_.end();) {  // its copy in another layout: replaced
      if (entry->source == source && entry->data == data) {
        bytes_ -= entry->bytes;
        entry = order_.erase(entry);  // a Primitive evaluating with it holds its pages
      } else {
        ++entry;
      }
    }
    if (bytes <= capacity_) {
      order_.push_front(Entry{source, data, copy, bytes});
      bytes_ += bytes;
      while (bytes_ > capacity_) {
        bytes_ -= order_.back().bytes;
        order_.pop_back();
      }
    }
    return copy;
  }
  std::pair<size_t, size_t> size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {order_.size(), bytes_};
  }
  size_t capacity() const { return capacity_; }

 private:
  struct Entry {
    std::shared_ptr<mx::array::Data> source;  // held: MLX neither frees nor donates the weight's buffer
    const void* data;
    Weight copy;
    size_t bytes;
  };
  const size_t capacity_;
  std::list<Entry> order_;  // a model's few dozen weights: a list is fast enough to search
  size_t bytes_ = 0;
  std::mutex mutex_;
};

KeptWeights::KeptWeights(size_t capacity_bytes) : copies(std::make_shared<WeightCopies>(capacity_bytes)) {}
size_t KeptWeights::count() const { return copies->size().first; }
size_t KeptWeights::bytes() const { return copies->size().second; }
size_t KeptWeights::capacity() const { return copies->capacity(); }

namespace {

// A weight as `wanted`: from `kept` where given (then `source` is its buffer), else converted for this call.
Weight weight_as_wanted(const std::shared_ptr<WeightCopies>& kept, const std::shared_ptr<mx::array::Data>& source,
                        const void* data, const dnnl::memory::desc& plain, const dnnl::memory::desc& wanted) {
  return kept ? kept->get(source, data, plain, wanted) : Weight{as_wanted(plain, data, wanted), nullptr};
}

// ---------------------------------------------------------------------------------------------------
// Convolutions: x (N, H, W, C) and the result channels-last, the weight (O, kh, kw, C) as MLX keeps it.

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
// models/backbone.py's own convolution) rather than oneDNN's `kernel` for it, or "": oneDNN 3.2's older
// direct JIT kernels lose to them on AVX2 for both passes (weights 1.3-6.7x, a strided convolution's data
// up to 8x, R50's shapes) and on any ISA for a strided 1 x 1 (1.2-1.6x); its brgemm kernels do not
// (bench/conv_backward.py; bench/results/cpu/*/conv_backward_cpu.txt). Float32 only: the patches have no
// bfloat16.
// DEFORMABLE_DETR_ONEDNN_SLOWER_PASSES=1 keeps every pass and product on oneDNN's own kernel for it: for
// bench/conv_backward.py to time both ways.
bool keep_slower_passes() {
  static const bool keep = [] {
    const char* value = std::getenv("DEFORMABLE_DETR_ONEDNN_SLOWER_PASSES");
    return value != nullptr && std::string(value) == "1";
  }();
  return keep;
}

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

// The primitives of one shape. `refused`: why oneDNN has no fast forward for it ("" where it has one).
// The backward passes are made by the first VJP, once: each oneDNN's, or, where `data_refused` or
// `weights_refused` says why not (no fast kernel, a wrong one, or one the patches beat), the patches'.
struct ConvPlan {
  std::string refused;
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

  // A gradient as models/backbone.py's patches convolution takes it (float32), on every core: the
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

// ---------------------------------------------------------------------------------------------------
// Matrix products: op(a) (M, K) @ op(b) (K, N) (+ bias (N,)), op a transpose where asked (a strided
// view: no copy).

struct ProductShape {
  int m, k, n;
  bool transpose_a, transpose_b, bias;
  dt a_type, b_type, bias_type, product;
  bool weights_kept = false;  // b is a weight whose copies in oneDNN's layouts a Detector keeps (inference)
  std::string key() const {
    std::string key;
    for (int v : {m, k, n, int(transpose_a), int(transpose_b), int(bias), int(a_type), int(b_type), int(bias_type),
                  int(product), int(weights_kept)}) {
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
  dnnl::memory::desc bias_desc() const { return {{1, n}, bias_type, dims{n, 1}}; }
  dnnl::memory::desc out_desc() const { return {{m, n}, a_type, dims{n, 1}}; }
};

struct ProductPlan {
  std::string refused;  // as ConvPlan's
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul product;
  // Where set, the product runs as a 1 x 1 convolution of one image of 1 x m pixels of k channels (see below).
  std::optional<dnnl::convolution_forward::primitive_desc> convolution_pd;
  dnnl::convolution_forward convolution;
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
  if (keep_slower_passes() || !float32 || s.weights_kept || s.transpose_a ||
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

Plans<ProductPlan>& product_plans() {
  static Plans<ProductPlan> plans;
  return plans;
}

std::shared_ptr<ProductPlan> product_plan(const ProductShape& s) {
  return product_plans().get(s.key(), [&s] {
    auto plan = std::make_shared<ProductPlan>();
    try {
      plan->pd = s.bias ? dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), s.b_desc(s.product),
                                                       s.bias_desc(), s.out_desc(), attributes())
                        : dnnl::matmul::primitive_desc(engine(), s.a_desc(s.product), s.b_desc(s.product),
                                                       s.out_desc(), attributes());
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
                      bias = s_.bias ? inputs[2].data<void>() : nullptr,
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
      auto wei = weight_as_wanted(kept, source, b, s.b_desc(s.b_type), plan->pd.weights_desc());
      dnnl::memory dst(plan->pd.dst_desc(), engine(), result);
      std::unordered_map<int, dnnl::memory> args{
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei.memory}, {DNNL_ARG_DST, dst}};
      if (s.bias) args.insert({DNNL_ARG_BIAS, dnnl::memory(s.bias_desc(), engine(), const_cast<void*>(bias))});
      execute(plan->product, plan->pd.scratchpad_desc(), std::move(args));
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
        grads.push_back(ta ? gradient_product(b, g, tb, true, bf16, threads_)
                           : gradient_product(g, b, false, !tb, bf16, threads_));
      } else if (arg == 1) {
        auto grad = tb ? gradient_product(g, a, true, ta, bf16, threads_)
                       : gradient_product(a, g, !ta, false, bf16, threads_);
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
    return s_.key() == o.s_.key() && kept_ == o.kept_ && threads_ == o.threads_;
  }

 private:
  ProductShape s_;
  std::shared_ptr<ProductPlan> plan_;
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

ProductShape product_shape(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                           bool transpose_b, bool bfloat16, bool weights_kept = false) {
  if (a.ndim() != 2 || b.ndim() != 2) throw std::invalid_argument("kernels._onednn product: two matrices");
  const int m = transpose_a ? a.shape(1) : a.shape(0), k = transpose_a ? a.shape(0) : a.shape(1);
  const int kb = transpose_b ? b.shape(1) : b.shape(0), n = transpose_b ? b.shape(0) : b.shape(1);
  if (k != kb || (bias && (bias->ndim() != 1 || bias->shape(0) != n))) {
    throw std::invalid_argument("kernels._onednn product: the shapes do not multiply");
  }
  const dt a_type = dnnl_type(a.dtype()), b_type = dnnl_type(b.dtype());
  const dt product_type = (bfloat16 || a_type == dt::bf16 || b_type == dt::bf16) ? dt::bf16 : dt::f32;
  return {m, k, n, transpose_a, transpose_b, bool(bias), a_type, b_type, bias ? dnnl_type(bias->dtype()) : dt::f32,
          product_type, weights_kept};
}

array product_array(const ProductShape& s, std::shared_ptr<ProductPlan> plan, const array& a, const array& b,
                    const std::optional<array>& bias, std::shared_ptr<WeightCopies> kept, int threads) {
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(a, false, stream), mx::contiguous(b, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  return array({s.m, s.n}, a.dtype(), std::make_shared<Product>(stream, s, std::move(plan), std::move(kept), threads),
               std::move(inputs));
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

std::optional<array> product(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                             bool transpose_b, bool bfloat16, const KeptWeights* kept, int threads) {
  const ProductShape s = product_shape(a, b, bias, transpose_a, transpose_b, bfloat16, kept != nullptr);
  auto plan = product_plan(s);
  if (!plan->refused.empty()) return std::nullopt;
  return product_array(s, std::move(plan), a, b, bias, kept ? kept->copies : nullptr, threads);
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

std::string describe() {
  const auto* version = dnnl::version();
  return "oneDNN " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
         std::to_string(version->patch);
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

std::string product_implementation(const array& a, const array& b, const std::optional<array>& bias, bool transpose_a,
                                   bool transpose_b, bool bfloat16, bool weights_kept) {
  auto plan = product_plan(product_shape(a, b, bias, transpose_a, transpose_b, bfloat16, weights_kept));
  if (!plan->refused.empty()) return "refused: " + plan->refused;
  const std::string product = plan->pd.impl_info_str();
  if (!plan->convolution_pd) return product;
  return std::string(plan->convolution_pd->impl_info_str()) + ", as a 1 x 1 convolution (" + product + ")";
}

// {"convolutions", "products": plans kept; "capacity" of each; "onednn_capacity": of oneDNN's primitive
// cache; "largest_scratchpad": the most a call has needed}.
std::unordered_map<std::string, size_t> caches() {
  return {{"convolutions", conv_plans().size()},
          {"products", product_plans().size()},
          {"capacity", plan_capacity_value()},
          {"onednn_capacity", size_t(dnnl::get_primitive_cache_capacity())},
          {"largest_scratchpad", largest_scratchpad.load()}};
}

// At most `plans` plans of each kind (and as many primitives in oneDNN's own cache); the least recently
// used go at once.
void set_capacity(size_t plans) {
  plan_capacity_value() = plans;
  dnnl::set_primitive_cache_capacity(int(plans));
  conv_plans().shrink();
  product_plans().shrink();
}

}  // namespace kernels_onednn
