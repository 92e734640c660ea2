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
// Plans: a shape's primitives (a convolution's forward, and its backward data and weights, made by its
// first VJP; a product's) are a plan, made on the caller's thread while the graph is built, where the
// shape's plan is not kept (outside the cache's lock: onednn_shared.h's Plans), and kept in a
// least-recently-used cache of `plan_capacity_value()` plans of each kind, convolutions and products
// (KERNELS_ONEDNN_PLANS, default 32; caches() counts the lookups that found one and those that made
// one). A Primitive in a graph holds its plan until it is done, kept or not. A shape oneDNN has no fast
// implementation for is kept in the same cache as refused, with why: the caller gets None and computes it
// its own way, without oneDNN being asked again while that is kept. oneDNN's own primitive cache (every
// primitive it makes, reorders too, by description: a plan made again finds its primitives there while
// they last) gets the same capacity, counted in primitives.
// What that keeps and remakes (bench/onednn_plans.py; bench/results/onednn_plans_cpu.txt, a Xeon with
// AMX): an R50 training step at one size (512 x 683, batch 2) looks up 25 convolution and 33 product plans
// (a process makes more: the Trainer probes other sizes). With 32 of each its convolutions' stay and 27
// of its products' are made again every step, with 52-56 reorders oneDNN's cache no longer holds: 79-83
// primitives JIT-compiled a step, 7 ms in float32, 31 in bfloat16, under 1% of the step. Inference at one
// size (800 x 1066) looks up 25 + 11 and makes none again. A plan holds 0.04-0.25 MiB (float32), up to 2.2 MiB for a
// 3 x 3 bfloat16 convolution on AMX with its backward passes (10.7 ms to make): 64 would keep a training
// step's plans, saving under 1%, for up to twice the memory in a process meeting many sizes, where each
// new size makes its plans anyway.
// Every primitive gets its scratchpad for the call only (`scratchpad_mode::user`; 11 MB at most in R50's
// float32 training, 23 in its bfloat16): oneDNN's default gives each primitive its own for its lifetime
// (tens of MB for a backward-weights pass on AVX2), which made the process grow by each shape's plans
// (issue 61: 46 MiB a shape in R50 training).
//
// Weights: a convolution's (O, kh, kw, C) weight is reordered into the layout oneDNN's kernel chose
// (`format_tag::any`; a plain one makes oneDNN 3.2 take its reference loops, 100x slower) at every
// evaluation (about 2% of an R50 forward), always right whatever the weight's version; or, given a model's
// KeptWeights (onednn.h: a Detector's, whose weights do not change), once, the copy kept there (and a
// product's bfloat16 copy of a float32 weight).
//
// Threads: oneDNN's OpenMP team, `threads` wide, set on MLX's stream thread before each call.
//
// This file: what the kinds share (onednn_shared.h), the caches and the module's answers about them;
// convolutions in onednn_conv.cpp, products in onednn_product.cpp.

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "mlx/ops.h"

#include "onednn_shared.h"
#include "ops.h"  // scale_where_positive

namespace kernels_onednn {

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

dt result_type(const std::string& result, dt otherwise) {
  if (result.empty()) return otherwise;
  if (result == "float32") return dt::f32;
  if (result == "bfloat16") return dt::bf16;
  throw std::invalid_argument("kernels._onednn: a result in float32 or bfloat16, not " + result);
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

namespace {

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

}  // namespace

void execute(const dnnl::primitive& primitive, const dnnl::memory::desc& scratchpad,
             std::unordered_map<int, dnnl::memory> args) {
  for (size_t seen = largest_scratchpad.load(); scratchpad.get_size() > seen;) {
    if (largest_scratchpad.compare_exchange_weak(seen, scratchpad.get_size())) break;
  }
  Scratchpad held(scratchpad, args);
  primitive.execute(stream_here(), args);
  stream_here().wait();
}

dnnl::memory as_wanted(const dnnl::memory::desc& user_desc, const void* data, const dnnl::memory::desc& wanted,
                       void* into) {
  dnnl::memory user(user_desc, engine(), const_cast<void*>(data));
  if (user_desc == wanted) return user;
  dnnl::memory converted = into ? dnnl::memory(wanted, engine(), into) : dnnl::memory(wanted, engine());
  dnnl::reorder(user, converted).execute(stream_here(), user, converted);
  return converted;
}

namespace {
std::atomic<bool> slower_passes = false;  // KERNELS_ONEDNN_SLOWER_PASSES, set when kernels/onednn.py loads the module
}  // namespace

bool keep_slower_passes() { return slower_passes.load(std::memory_order_relaxed); }

void set_slower_passes(bool keep) { slower_passes = keep; }

// ---------------------------------------------------------------------------------------------------
// The caches: plans by shape (count; the class in onednn_shared.h), kept weights by buffer (bytes); least
// recently used out first.

std::atomic<size_t>& plan_capacity_value() {
  static std::atomic<size_t> capacity = 32;  // kernels/onednn.py sets KERNELS_ONEDNN_PLANS' value
  return capacity;
}

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

// Weights in the layout and dtype a primitive wants, by the weight's buffer (where in it, and how it lies there:
// a slice of a larger weight, as MultiheadAttention's thirds of in_proj_weight, is a weight of its own): a
// model's store (KeptWeights), one copy of each weight in each dtype asked, at most `capacity` bytes of copies,
// the least recently used out first, and a copy whose weight is gone (held by nothing but the store) out at the
// next copy made. One copy a dtype, not one for each layout asked: on AVX2 oneDNN's brgconv blocks a weight's
// output channels by 16, 24 or 32 as the image's width suits, so a model meeting many sizes would keep up to
// three copies of each weight (measured as AVX2 over 300 sizes: 40 -> 46 copies, 24 -> 32 MiB, after the tenth
// size); a weight wanted in another layout is reordered once more (a weight's bytes, against its convolution's
// work on a whole image) and that copy replaces the other.
class WeightCopies {
 public:
  explicit WeightCopies(size_t capacity) : capacity_(capacity) {}

  Weight get(const std::shared_ptr<mx::array::Data>& source, const void* data, const dnnl::memory::desc& plain,
             const dnnl::memory::desc& wanted) {
    if (plain == wanted) return {dnnl::memory(plain, engine(), const_cast<void*>(data)), nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto entry = order_.begin(); entry != order_.end(); ++entry) {
        if (entry->is(source, data, plain) && entry->copy.memory.get_desc() == wanted) {
          order_.splice(order_.begin(), order_, entry);
          return order_.front().copy;
        }
      }
    }
    const size_t bytes = wanted.get_size();
    std::shared_ptr<void> pages = own_pages(bytes);
    const Weight copy{as_wanted(plain, data, wanted, pages.get()), pages};
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto entry = order_.begin(); entry != order_.end();) {
      // Its copy in another layout of the same dtype: replaced (a float32 and a bfloat16 copy both stay: at
      // `auto` a weight's products may run in either as the image's size asks, kernels/precision.py, and
      // replacing would reorder the weight at every change). A copy whose weight is held by nothing but this
      // store (the array is gone: a temporary, a model's weight replaced): no call can ask for it again, so it
      // goes now, with the buffer it held, rather than when the capacity pushes it out.
      const bool same_dtype = entry->copy.memory.get_desc().get_data_type() == wanted.get_data_type();
      if ((entry->is(source, data, plain) && same_dtype) || entry->source.use_count() == 1) {
        bytes_ -= entry->bytes;
        entry = order_.erase(entry);  // a Primitive evaluating with it holds its pages
      } else {
        ++entry;
      }
    }
    if (bytes <= capacity_) {
      order_.push_front(Entry{source, data, plain, copy, bytes});
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
    dnnl::memory::desc plain;  // the weight as it lies there: two views of one buffer are two weights
    Weight copy;
    size_t bytes;
    bool is(const std::shared_ptr<mx::array::Data>& s, const void* d, const dnnl::memory::desc& p) const {
      return source == s && data == d && plain == p;
    }
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

// A weight as `wanted`: from `kept` where given (then `source` is its buffer), else converted for this call.
Weight weight_as_wanted(const std::shared_ptr<WeightCopies>& kept, const std::shared_ptr<mx::array::Data>& source,
                        const void* data, const dnnl::memory::desc& plain, const dnnl::memory::desc& wanted) {
  return kept ? kept->get(source, data, plain, wanted) : Weight{as_wanted(plain, data, wanted), nullptr};
}

// relu_gradient (onednn_shared.h): for the VJPs of products and convolutions with a fused ReLU, the same
// operation as a ReLU's gradient everywhere else (native/masked_scale.cpp's, compiled into this module too).
mx::array relu_gradient(const mx::array& g, const mx::array& y, int threads) {
  return kernels::scale_where_positive(mx::astype(g, y.dtype(), mx::default_stream(mx::Device::cpu)), y, 1.0f,
                                       threads);
}

std::string describe() {
  const auto* version = dnnl::version();
  return "oneDNN " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
         std::to_string(version->patch);
}

// {"convolutions", "products": plans kept; "convolution_hits", "convolution_misses", "product_hits",
// "product_misses": lookups that found a kept plan or made one, since the process began; "capacity" of each
// kind; "lasting": plans kept beyond it (onednn_conv.cpp's ConvPlan::lasting); "onednn_capacity": of oneDNN's
// primitive cache; "largest_scratchpad": the most a call has needed}.
std::unordered_map<std::string, size_t> caches() {
  const PlanCounts convolutions = conv_plans().counts(), products = product_plans().counts();
  return {{"convolutions", convolutions.kept},
          {"convolution_hits", convolutions.hits},
          {"convolution_misses", convolutions.misses},
          {"products", products.kept},
          {"product_hits", products.hits},
          {"product_misses", products.misses},
          {"capacity", plan_capacity_value().load()},
          {"lasting", convolutions.lasting + products.lasting},
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
