// kernels._onednn's element-wise operations (onednn.cpp has the story: threads, scratchpads): binaries, max
// pooling and casts, each where oneDNN has a kernel for it (else None: the caller takes MLX's).
//
// Binaries: a + b and a * b, b of a's shape or broadcast to it along dimensions of 1, float32 or bfloat16 each
// (computing in float32), the result in a's dtype, as oneDNN's binary primitive: one pass on every core, where
// MLX's CPU binaries make one on one thread (an R50 encoder layer's query, src + pos, (17821, 256): 1.7 ms on one core). oneDNN's own primitive
// cache keeps the primitive of a shape (they are cheap to describe, and JIT-compiled once).

#include <omp.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "onednn_shared.h"

namespace kernels_onednn {

using mx::array;

namespace {

dims dims_of(const array& a) {
  dims d;
  for (int side : a.shape()) d.push_back(side);
  return d;
}

dnnl::memory::desc plain(const array& a) { return dnnl::memory::desc(dims_of(a), dnnl_type(a.dtype()), dnnl::memory::format_tag(
    a.ndim() == 1 ? tag::a : a.ndim() == 2 ? tag::ab : a.ndim() == 3 ? tag::abc : a.ndim() == 4 ? tag::abcd : tag::abcde)); }

class Binary : public mx::UnaryPrimitive {
 public:
  Binary(mx::Stream stream, dnnl::algorithm algorithm, int threads)
      : mx::UnaryPrimitive(stream), algorithm_(algorithm), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const auto a_desc = plain(inputs[0]), b_desc = plain(inputs[1]), out_desc = plain(out);
    encoder.dispatch([a_desc, b_desc, out_desc, algorithm = algorithm_, threads = threads_,
                      a = inputs[0].data<void>(), b = inputs[1].data<void>(), result = out.data<void>()]() {
      omp_set_num_threads(threads);
      const dnnl::binary::primitive_desc pd(engine(), algorithm, a_desc, b_desc, out_desc, attributes());
      execute(dnnl::binary(pd), pd.scratchpad_desc(),
              {{DNNL_ARG_SRC_0, dnnl::memory(a_desc, engine(), const_cast<void*>(a))},
               {DNNL_ARG_SRC_1, dnnl::memory(b_desc, engine(), const_cast<void*>(b))},
               {DNNL_ARG_DST, dnnl::memory(out_desc, engine(), result)}});
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }

  // a + b: g to a, and to b summed over its broadcast dimensions; a * b: g * b to a (this primitive), g * a to b
  // summed likewise (MLX's).
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    const mx::Stream on = stream();
    const auto& a = primals[0];
    const auto& b = primals[1];
    const array g = mx::contiguous(mx::astype(cotangents[0], a.dtype(), on), false, on);
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(algorithm_ == dnnl::algorithm::binary_add
                            ? g
                            : array(a.shape(), a.dtype(), std::make_shared<Binary>(on, algorithm_, threads_),
                                    {g, mx::contiguous(b, false, on)}));
        continue;
      }
      array to_b = algorithm_ == dnnl::algorithm::binary_add ? mx::astype(g, mx::float32, on)
                                                              : mx::multiply(mx::astype(g, mx::float32, on),
                                                                             mx::astype(a, mx::float32, on), on);
      std::vector<int> broadcast;
      for (int axis = 0; axis < a.ndim(); ++axis) {
        if (b.shape(axis) == 1 && a.shape(axis) != 1) broadcast.push_back(axis);
      }
      if (!broadcast.empty()) to_b = mx::sum(to_b, broadcast, true, on);
      grads.push_back(mx::astype(to_b, b.dtype(), on));
    }
    return grads;
  }

  const char* name() const override { return "KernelsOnednnBinary"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Binary&>(other);
    return algorithm_ == o.algorithm_ && threads_ == o.threads_;
  }

 private:
  dnnl::algorithm algorithm_;
  int threads_;
};

}  // namespace

std::optional<array> binary(const std::string& operation, const array& a, const array& b, int threads) {
  const auto algorithm = operation == "add"        ? dnnl::algorithm::binary_add
                         : operation == "multiply" ? dnnl::algorithm::binary_mul
                                                   : throw std::invalid_argument("kernels._onednn binary: " + operation);
  if (a.ndim() != b.ndim() || a.ndim() < 1 || a.ndim() > 5) return std::nullopt;
  for (int axis = 0; axis < a.ndim(); ++axis) {
    if (b.shape(axis) != a.shape(axis) && b.shape(axis) != 1) return std::nullopt;
  }
  // oneDNN's kernel for these shapes, or None where it has only its reference loops (b broadcast along a middle
  // dimension took 2.7x an R50 inference's time): asked once per call, cheaply (its primitive cache has the kernel)
  try {  // none at all: bfloat16 on AVX2 (oneDNN 3.2)
    const dnnl::binary::primitive_desc pd(engine(), algorithm, plain(a), plain(b), plain(a), attributes());
    if (!refusal(pd, "").empty()) return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array(a.shape(), a.dtype(), std::make_shared<Binary>(stream, algorithm, threads),
               {mx::contiguous(a, false, stream), mx::contiguous(b, false, stream)});
}

// ---------------------------------------------------------------------------------------------------
// Max pooling of x (N, H, W, C) channels-last, a k x k window at `stride`, `padding` on each side (never taken:
// -inf), float32 or bfloat16, as oneDNN's pooling: one pass on every core, where MLX's (nn.MaxPool2d: a padded
// copy, then a max over a strided view) made two on one thread (R50's stem at 800 x 1066, (400, 533, 64)). Its
// gradient is not this primitive's: kernels/onednn.py's max_pool2d takes MLX's.

namespace {

class MaxPool : public mx::UnaryPrimitive {
 public:
  MaxPool(mx::Stream stream, int kernel, int stride, int padding, int threads)
      : mx::UnaryPrimitive(stream), kernel_(kernel), stride_(stride), padding_(padding), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const auto& x = inputs[0];
    const dt type = dnnl_type(x.dtype());
    const dnnl::memory::desc src({x.shape(0), x.shape(3), x.shape(1), x.shape(2)}, type, tag::nhwc);
    const dnnl::memory::desc dst({out.shape(0), out.shape(3), out.shape(1), out.shape(2)}, type, tag::nhwc);
    encoder.dispatch([src, dst, k = kernel_, s = stride_, p = padding_, threads = threads_, in = x.data<void>(),
                      result = out.data<void>()]() {
      omp_set_num_threads(threads);
      const dnnl::pooling_forward::primitive_desc pd(engine(), dnnl::prop_kind::forward_inference,
                                                     dnnl::algorithm::pooling_max, src, dst, {s, s}, {k, k}, {0, 0},
                                                     {p, p}, {p, p}, attributes());
      execute(dnnl::pooling_forward(pd), pd.scratchpad_desc(),
              {{DNNL_ARG_SRC, dnnl::memory(src, engine(), const_cast<void*>(in))},
               {DNNL_ARG_DST, dnnl::memory(dst, engine(), result)}});
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }
  const char* name() const override { return "KernelsOnednnMaxPool"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MaxPool&>(other);
    return kernel_ == o.kernel_ && stride_ == o.stride_ && padding_ == o.padding_ && threads_ == o.threads_;
  }

 private:
  int kernel_, stride_, padding_, threads_;
};

}  // namespace

std::optional<array> max_pool2d(const array& x, int kernel, int stride, int padding, int threads) {
  if (x.ndim() != 4 || padding >= kernel) return std::nullopt;
  dnnl_type(x.dtype());
  const int out_h = (x.shape(1) + 2 * padding - kernel) / stride + 1, out_w = (x.shape(2) + 2 * padding - kernel) / stride + 1;
  if (out_h < 1 || out_w < 1) return std::nullopt;
  try {  // oneDNN's kernel for it, or None where it has only its reference loops or none (bfloat16 on AVX2)
    const dt type = dnnl_type(x.dtype());
    const dnnl::memory::desc src({x.shape(0), x.shape(3), x.shape(1), x.shape(2)}, type, tag::nhwc);
    const dnnl::memory::desc dst({x.shape(0), x.shape(3), out_h, out_w}, type, tag::nhwc);
    const dnnl::pooling_forward::primitive_desc pd(engine(), dnnl::prop_kind::forward_inference,
                                                   dnnl::algorithm::pooling_max, src, dst, {stride, stride},
                                                   {kernel, kernel}, {0, 0}, {padding, padding}, {padding, padding},
                                                   attributes());
    if (!refusal(pd, "").empty()) return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({x.shape(0), out_h, out_w, x.shape(3)}, x.dtype(),
               std::make_shared<MaxPool>(stream, kernel, stride, padding, threads), {mx::contiguous(x, false, stream)});
}

// ---------------------------------------------------------------------------------------------------
// A cast between float32 and bfloat16 (round to nearest even, as MLX's), as oneDNN's reorder: one pass on every
// core, where MLX's AsType is one on one thread (bfloat16 training casts the weights, the attention's value and
// weights and every gradient back: 14% of an R50 step's time, elsewhere one core idle). Its VJP: the cotangent
// cast back, the same way.

namespace {

class Cast : public mx::UnaryPrimitive {
 public:
  Cast(mx::Stream stream, int threads) : mx::UnaryPrimitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    const dnnl::memory::desc from({int64_t(out.size())}, dnnl_type(inputs[0].dtype()), tag::a);
    const dnnl::memory::desc to({int64_t(out.size())}, dnnl_type(out.dtype()), tag::a);
    encoder.dispatch([from, to, threads = threads_, in = inputs[0].data<void>(), result = out.data<void>()]() {
      omp_set_num_threads(threads);
      dnnl::memory source(from, engine(), const_cast<void*>(in)), target(to, engine(), result);
      dnnl::reorder(source, target).execute(stream_here(), source, target);
      stream_here().wait();
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels._onednn runs on the CPU only");
  }
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>&, const std::vector<array>&) override {
    const auto& g = cotangents[0];
    if (g.dtype() == primals[0].dtype()) return {g};
    return {array(primals[0].shape(), primals[0].dtype(), std::make_shared<Cast>(stream(), threads_),
                  {mx::contiguous(g, false, stream())})};
  }
  const char* name() const override { return "KernelsOnednnCast"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const Cast&>(other).threads_;
  }

 private:
  int threads_;
};

}  // namespace

std::optional<array> cast(const array& x, mx::Dtype dtype, int threads) {
  if (x.dtype() == dtype || x.size() == 0) return std::nullopt;
  try {  // oneDNN's reorder for it, or None where it has none (bfloat16 on AVX2)
    const dnnl::memory::desc from({int64_t(x.size())}, dnnl_type(x.dtype()), tag::a);
    const dnnl::memory::desc to({int64_t(x.size())}, dnnl_type(dtype), tag::a);
    const dnnl::reorder::primitive_desc pd(engine(), from, engine(), to);
    if (!refusal(pd, "").empty()) return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array(x.shape(), dtype, std::make_shared<Cast>(stream, threads), {mx::contiguous(x, false, stream)});
}

}  // namespace kernels_onednn
