// patches (im2col) of a channels-last image batch as an MLX Primitive, on every core: the matrix
// whose product with a (O, kh * kw * C) weight is the convolution. MLX's CPU convolution builds
// the same matrix in two general copies on one thread (the zero-padded input, then the strided
// view); here each output row's taps are copied once, C floats at a time, or zero-filled.

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ops.h"
#include "parallel.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

struct Geometry {
  int batch, height, width, channels, kernel_h, kernel_w, stride, padding, dilation, out_h, out_w;

  bool operator==(const Geometry&) const = default;
};

// out (N, out_h, out_w, kernel_h, kernel_w, C) from x (N, H, W, C), rows (n, oy) [begin, end).
void patch_rows(const Geometry& g, const float* x, float* out, int64_t begin, int64_t end) {
  const size_t row_bytes = size_t(g.channels) * sizeof(float);
  for (int64_t row = begin; row < end; ++row) {
    const int n = int(row / g.out_h), oy = int(row % g.out_h);
    float* dst = out + row * int64_t(g.out_w) * g.kernel_h * g.kernel_w * g.channels;
    for (int ox = 0; ox < g.out_w; ++ox) {
      for (int ky = 0; ky < g.kernel_h; ++ky) {
        const int y = oy * g.stride - g.padding + ky * g.dilation;
        for (int kx = 0; kx < g.kernel_w; ++kx, dst += g.channels) {
          const int xx = ox * g.stride - g.padding + kx * g.dilation;
          if (y < 0 || y >= g.height || xx < 0 || xx >= g.width) {
            std::memset(dst, 0, row_bytes);
          } else {
            std::memcpy(dst, x + ((int64_t(n) * g.height + y) * g.width + xx) * g.channels, row_bytes);
          }
        }
      }
    }
  }
}

class Patches : public mx::UnaryPrimitive {
 public:
  Patches(mx::Stream stream, Geometry geometry, int threads)
      : mx::UnaryPrimitive(stream), geometry_(geometry), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([x = inputs[0].data<float>(), out_ptr = out.data<float>(), g = geometry_, threads = threads_]() {
      const int64_t rows = int64_t(g.batch) * g.out_h;
      const int64_t bytes = rows * g.out_w * g.kernel_h * g.kernel_w * g.channels * int64_t(sizeof(float));
      const int used = kernels_native::threads_for(bytes, threads, 1 << 18);
      kernels_native::parallel_rows(rows, used, [&](int, int64_t begin, int64_t end) {
        patch_rows(g, x, out_ptr, begin, end);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels patches runs on the CPU only");
  }
  const char* name() const override { return "KernelsPatches"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Patches&>(other);
    return geometry_ == o.geometry_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>&) override {
    const auto& g = geometry_;
    return {{g.batch, g.out_h, g.out_w, g.kernel_h * g.kernel_w * g.channels}};
  }

 private:
  Geometry geometry_;
  int threads_;
};

}  // namespace

array patches(const array& x, int kernel_h, int kernel_w, int stride, int padding, int dilation, int threads) {
  if (x.ndim() != 4 || x.dtype() != mx::float32) {
    throw std::invalid_argument("patches: x must be float32 (N, H, W, C)");
  }
  if (kernel_h < 1 || kernel_w < 1 || stride < 1 || padding < 0 || dilation < 1) {
    throw std::invalid_argument("patches: kernel, stride and dilation must be positive, padding not negative");
  }
  Geometry g{x.shape(0), x.shape(1), x.shape(2), x.shape(3), kernel_h, kernel_w, stride, padding, dilation, 0, 0};
  g.out_h = (g.height + 2 * padding - dilation * (kernel_h - 1) - 1) / stride + 1;
  g.out_w = (g.width + 2 * padding - dilation * (kernel_w - 1) - 1) / stride + 1;
  if (g.out_h < 1 || g.out_w < 1) {
    throw std::invalid_argument("patches: the kernel does not fit the padded input");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({g.batch, g.out_h, g.out_w, kernel_h * kernel_w * g.channels}, mx::float32,
               std::make_shared<Patches>(stream, g, threads), {mx::contiguous(x, false, stream)});
}

}  // namespace kernels
