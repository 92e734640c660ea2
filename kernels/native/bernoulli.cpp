// bernoulli16: a bool array whose elements are true with probability threshold / 65536, from a key
// (two uint32), as an MLX Primitive on every core. Each 64-bit word of splitmix64 (Steele, Lea and
// Flood's mixer) of the key plus a counter gives four elements, 16 bits each. MLX's generator
// (threefry, 20 rounds, one thread) made dropout most of a transformer layer's non-product time on
// the CPU.

#include <cstdint>
#include <utility>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// out[i] for i in [4 * begin, min(4 * end, size)): word w gives elements 4w .. 4w + 3.
void keep_words(uint64_t seed, uint32_t threshold, bool* out, int64_t size, int64_t begin, int64_t end) {
  for (int64_t w = begin; w < end; ++w) {
    const uint64_t word = splitmix64(seed + uint64_t(w + 1) * GOLDEN);
    for (int64_t j = 0; j < 4 && 4 * w + j < size; ++j) {
      out[4 * w + j] = uint32_t((word >> (16 * j)) & 0xFFFF) < threshold;
    }
  }
}

class Bernoulli16 : public mx::UnaryPrimitive {
 public:
  Bernoulli16(mx::Stream stream, mx::Shape shape, uint32_t threshold, int threads)
      : mx::UnaryPrimitive(stream), shape_(std::move(shape)), threshold_(threshold), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([key = inputs[0].data<uint32_t>(), out_ptr = out.data<bool>(), size = int64_t(out.size()),
                      threshold = threshold_, threads = threads_]() {
      const uint64_t seed = (uint64_t(key[0]) << 32) | key[1];
      const int64_t words = (size + 3) / 4;
      const int used = kernels_native::threads_for(words, threads, 1 << 16);
      kernels_native::parallel_rows(words, used, [&](int, int64_t begin, int64_t end) {
        keep_words(seed, threshold, out_ptr, size, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels bernoulli16 runs on the CPU only");
  }
  const char* name() const override { return "KernelsBernoulli16"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Bernoulli16&>(other);
    return shape_ == o.shape_ && threshold_ == o.threshold_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>&) override { return {shape_}; }

 private:
  mx::Shape shape_;
  uint32_t threshold_;
  int threads_;
};

}  // namespace

array bernoulli16(const array& key, const std::vector<int>& shape, int threshold, int threads) {
  if (key.dtype() != mx::uint32 || key.size() != 2) {
    throw std::invalid_argument("bernoulli16: key must be two uint32");
  }
  if (threshold < 0 || threshold > 65536) {
    throw std::invalid_argument("bernoulli16: threshold must be in [0, 65536]");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  const mx::Shape out_shape(shape.begin(), shape.end());
  return array(out_shape, mx::bool_, std::make_shared<Bernoulli16>(stream, out_shape, uint32_t(threshold), threads),
               {mx::contiguous(mx::flatten(key, stream), false, stream)});
}

}  // namespace kernels
