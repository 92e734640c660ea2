// What kernels._onednn's three files share (internal; its face is onednn.h): oneDNN's engine and stream,
// the primitives' attributes, a refusal's rule, a call's execution, a buffer in the layout a primitive
// wants, the plan caches and the kept weights (onednn.cpp, with the top's story); each kind's shape,
// plans and Primitive are its own file's (onednn_conv.cpp, onednn_product.cpp).

#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "mlx/array.h"
#include "oneapi/dnnl/dnnl.hpp"

#include "onednn.h"

namespace kernels_onednn {

namespace mx = mlx::core;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

dnnl::engine& engine();
// This thread's stream (MLX's stream thread runs the calls, the caller's thread a kept weight's reorder).
dnnl::stream& stream_here();
dt dnnl_type(mx::Dtype type);
// A result's dtype as the Python side names it ("float32", "bfloat16"), or `otherwise` for "".
dt result_type(const std::string& result, dt otherwise);
// Every primitive's attributes: the scratchpad is the caller's, for one call (onednn.cpp's top).
const dnnl::primitive_attr& attributes();

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

// Runs `primitive` on this thread's stream with a scratchpad of `scratchpad`'s size for this call only.
void execute(const dnnl::primitive& primitive, const dnnl::memory::desc& scratchpad,
             std::unordered_map<int, dnnl::memory> args);

// `user` (a plain buffer of `user_desc`) as `wanted`: the same memory where the descriptions agree, else
// a reorder (layout and dtype) on every core into `into`, or into a new buffer of oneDNN's where none is given.
dnnl::memory as_wanted(const dnnl::memory::desc& user_desc, const void* data, const dnnl::memory::desc& wanted,
                       void* into = nullptr);

// KERNELS_ONEDNN_SLOWER_PASSES=1 (onednn.h's set_slower_passes, when the module loads) keeps every pass and
// product on oneDNN's own kernel for it, where the patches (a convolution's backward) or a 1 x 1 convolution (a
// product) would be taken for speed: for bench/conv_backward.py to time both ways.
bool keep_slower_passes();

// A weight as a primitive reads it: `memory`, and `pages`, which hold a kept copy's buffer while it is used
// (none for the weight itself or a copy oneDNN made and owns).
struct Weight {
  dnnl::memory memory;
  std::shared_ptr<void> pages;
};

// A weight as `wanted`: from `kept` (a KeptWeights' store) where given (then `source` is its buffer), else
// converted for this call.
Weight weight_as_wanted(const std::shared_ptr<WeightCopies>& kept, const std::shared_ptr<mx::array::Data>& source,
                        const void* data, const dnnl::memory::desc& plain, const dnnl::memory::desc& wanted);

// ---------------------------------------------------------------------------------------------------
// The plan caches: plans by shape (count), least recently used out first.

// Plans of each kind at most (set_capacity; read by threads that make plans while the GIL is let go).
std::atomic<size_t>& plan_capacity_value();

// The gradient of a ReLU that was fused into the product making `y` (its output): `g` where y > 0, else 0, in
// y's dtype (float32 or bfloat16), one pass on `threads` cores (kernels::scale_where_positive, MLX's bits).
mx::array relu_gradient(const mx::array& g, const mx::array& y, int threads);

// A cache's plans kept now, and its lookups since the process began: found (hits) or made (misses).
struct PlanCounts {
  size_t kept, hits, misses, lasting;
};

template <typename Plan>
class Plans {
 public:
  // The plan of `key`, made by `make` where it is not kept (then the least recently used goes where
  // there are more than the capacity). Made outside the lock: making a plan JIT-compiles its primitives
  // (a millisecond to tens of them), and the lookups of other threads, for other shapes, go on meanwhile.
  // Two threads missing the same key may then both make it (two misses): the first inserted is kept and
  // given to both, the other dropped, so that every caller of a shape holds one plan, whose backward passes
  // (ConvPlan::make_backward) are then made once.
  std::shared_ptr<Plan> get(const std::string& key, const std::function<std::shared_ptr<Plan>()>& make) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto kept = find(key)) {
        ++hits_;
        return kept;
      }
      ++misses_;
    }
    auto made = make();
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto kept = find(key)) return kept;  // another thread's, inserted while this one was made
    order_.push_front({key, made, made->lasting});
    index_[key] = order_.begin();
    lasting_ += made->lasting;
    trim();
    return made;
  }
  PlanCounts counts() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {order_.size(), hits_, misses_, lasting_};
  }
  void shrink() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim();
  }

 private:
  // The plan of `key` (now the most recently used), or none; under the lock.
  std::shared_ptr<Plan> find(const std::string& key) {
    auto found = index_.find(key);
    if (found == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, found->second);
    return found->second->plan;
  }
  // The least recently used plans out until at most the capacity are left, not counting the lasting ones
  // (a plan's `lasting`: oneDNN cannot free what making it again would add, onednn_conv.cpp), which stay.
  void trim() {
    auto entry = order_.end();
    while (order_.size() - lasting_ > plan_capacity_value() && entry != order_.begin()) {
      if ((--entry)->lasting) continue;
      index_.erase(entry->key);
      entry = order_.erase(entry);  // a Primitive still in a graph holds its plan until it is done
    }
  }
  struct Entry {
    std::string key;
    std::shared_ptr<Plan> plan;
    bool lasting;  // the plan's, read where it is made (the Plan type is complete there, not in onednn.cpp)
  };
  std::list<Entry> order_;
  std::unordered_map<std::string, typename decltype(order_)::iterator> index_;
  size_t hits_ = 0, misses_ = 0, lasting_ = 0;
  std::mutex mutex_;
};

// Each kind's cache, in its own file; caches() and set_capacity() (onednn.cpp) reach both.
struct ConvPlan;
struct ProductPlan;
Plans<ConvPlan>& conv_plans();
Plans<ProductPlan>& product_plans();

}  // namespace kernels_onednn
