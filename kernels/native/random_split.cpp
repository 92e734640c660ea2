// random_split as an MLX Primitive: the words of mx.random.split(key, num), bit for bit. MLX's CPU
// back-end hashes them one pair after another (threefry 2x32, 20 rounds, a function call per pair):
// for the dropout masks of an R50 encoder layer at 512 x 683 that was about 60 ms of its 0.5 s
// forward. Here the hash is inlined into a loop that the compiler turns into vector code (AVX2 where
// the CPU has it, chosen at run time), on MLX's CPU thread: a second thread halved the time again
// (3.9 against 7 ms for 3.7 M pairs) but moved the peak memory of the test suite's 4-image probe
// step from 977 to 1,158 MiB (tests/test_memory.py, in the full suite only; not understood).

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "ops.h"
#include "wide_target.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

inline __attribute__((always_inline)) uint32_t rotate(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// MLX's threefry2x32_hash (mlx/backend/cpu/threefry.cpp), the same operations in the same order.
inline __attribute__((always_inline)) void threefry(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDA};
  constexpr int rotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 += ks[0];
  x1 += ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : rotations[i % 2]) {
      x0 += x1;
      x1 = rotate(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + i + 1;
  }
}

// For a single key, MLX's RandomBits of shape (num, 2) hashes the counters (j, num + j) and writes
// the pair to words j and num + j of the output. The two halves as two restrict pointers: with one
// pointer GCC assumed they might overlap and kept the loop scalar (33 ms for 3.7 M pairs on one
// thread here, 7 ms as vector code).
inline __attribute__((always_inline)) void split(uint32_t k0, uint32_t k1, uint32_t num, uint32_t* out) {
  uint32_t* __restrict__ first = out;
  uint32_t* __restrict__ second = out + num;
  for (uint32_t j = 0; j < num; ++j) {
    uint32_t x0 = j, x1 = num + j;
    threefry(k0, k1, x0, x1);
    first[j] = x0;
    second[j] = x1;
  }
}

WIDE_TARGET void split_wide(uint32_t k0, uint32_t k1, uint32_t num, uint32_t* out) { split(k0, k1, num, out); }
void split_plain(uint32_t k0, uint32_t k1, uint32_t num, uint32_t* out) { split(k0, k1, num, out); }

class RandomSplit : public mx::UnaryPrimitive {
 public:
  RandomSplit(mx::Stream stream, uint32_t num) : mx::UnaryPrimitive(stream), num_(num) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([key = inputs[0], out_ptr = out.data<uint32_t>(), num = num_]() {
      const uint32_t* k = key.data<uint32_t>();
      static const bool wide = wide_supported();
      (wide ? split_wide : split_plain)(k[0], k[1], num, out_ptr);
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("RandomSplit runs on the CPU only");
  }
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>&, const std::vector<int>&,
                         const std::vector<array>&) override {
    return {mx::zeros_like(primals[0], stream())};  // integer words of an integer key
  }
  const char* name() const override { return "RandomSplit"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return num_ == static_cast<const RandomSplit&>(other).num_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>&) override { return {{int(num_), 2}}; }

 private:
  uint32_t num_;
};

}  // namespace

array random_split(const array& key, int64_t num) {
  if (key.dtype() != mx::uint32 || key.ndim() != 1 || key.shape(0) != 2) {
    throw std::invalid_argument("random_split: the key must be a uint32 array of shape (2,)");
  }
  if (num < 0 || num > int64_t(INT32_MAX)) {
    throw std::invalid_argument("random_split: num must be in [0, 2**31)");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({int(num), 2}, mx::uint32, std::make_shared<RandomSplit>(stream, uint32_t(num)),
               {mx::contiguous(key, false, stream)});
}

}  // namespace kernels
