// patches (im2col) of a channels-last image batch as an MLX Primitive, on every core: the matrix
// whose product with a (O, kh * kw * C) weight is the convolution. MLX's CPU convolution builds
// the same matrix in two general copies on one thread (the zero-padded input, then the strided
// view); here each output row's taps are copied once, or zero-filled. Its transpose (unpatches,
// col2im) is patches' gradient, the input gradient of a convolution taken as patches times a weight.

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

// out (N, out_h, out_w, kernel_h, kernel_w, C) from x (N, H, W, C), rows (n, oy) [begin, end). At
// dilation 1 a row of taps inside the image is one run of memory, copied at once (a 7 x 7 kernel on 3
// channels: 7 copies of 21 floats, not 49 of 3).
void patch_rows(const Geometry& g, const float* x, float* out, int64_t begin, int64_t end) {
  const int64_t c = g.channels;
  for (int64_t row = begin; row < end; ++row) {
    const int n = int(row / g.out_h), oy = int(row % g.out_h);
    float* dst = out + row * int64_t(g.out_w) * g.kernel_h * g.kernel_w * c;
    for (int ox = 0; ox < g.out_w; ++ox) {
      const int x0 = ox * g.stride - g.padding;
      for (int ky = 0; ky < g.kernel_h; ++ky, dst += g.kernel_w * c) {
        const int y = oy * g.stride - g.padding + ky * g.dilation;
        if (y < 0 || y >= g.height) {
          std::memset(dst, 0, sizeof(float) * g.kernel_w * c);
          continue;
        }
        const float* src = x + (int64_t(n) * g.height + y) * g.width * c;
        if (g.dilation == 1) {  // taps [first, last) inside the row
          const int first = std::clamp(-x0, 0, g.kernel_w), last = std::clamp(g.width - x0, first, g.kernel_w);
          std::memset(dst, 0, sizeof(float) * first * c);
          std::memcpy(dst + first * c, src + (x0 + first) * c, sizeof(float) * (last - first) * c);
          std::memset(dst + last * c, 0, sizeof(float) * (g.kernel_w - last) * c);
          continue;
        }
        for (int kx = 0; kx < g.kernel_w; ++kx) {
          const int xx = x0 + kx * g.dilation;
          if (xx < 0 || xx >= g.width) {
            std::memset(dst + kx * c, 0, sizeof(float) * c);
          } else {
            std::memcpy(dst + kx * c, src + int64_t(xx) * c, sizeof(float) * c);
          }
        }
      }
    }
  }
}

// The transpose of patch_rows (col2im): grad (N, H, W, C) from columns (N, out_h, out_w, kernel_h,
// kernel_w, C), rows (n, y) [begin, end). Each pixel gathers the taps that read it, in (ky, kx) order,
// so that threads write their own rows only.
void unpatch_rows(const Geometry& g, const float* columns, float* grad, int64_t begin, int64_t end) {
  const int64_t c = g.channels, taps = int64_t(g.kernel_h) * g.kernel_w;
  for (int64_t row = begin; row < end; ++row) {
    const int n = int(row / g.height), y = int(row % g.height);
    float* dst = grad + row * g.width * c;
    std::fill(dst, dst + g.width * c, 0.0f);
    for (int ky = 0; ky < g.kernel_h; ++ky) {
      const int ty = y + g.padding - ky * g.dilation;  // oy * stride
      if (ty < 0 || ty % g.stride != 0 || ty / g.stride >= g.out_h) {
        continue;
      }
      const float* line = columns + (int64_t(n) * g.out_h + ty / g.stride) * g.out_w * taps * c;
      for (int xx = 0; xx < g.width; ++xx) {
        float* __restrict__ to = dst + int64_t(xx) * c;
        for (int kx = 0; kx < g.kernel_w; ++kx) {
          const int tx = xx + g.padding - kx * g.dilation;  // ox * stride
          if (tx < 0 || tx % g.stride != 0 || tx / g.stride >= g.out_w) {
            continue;
          }
          const float* __restrict__ from = line + ((int64_t(tx / g.stride) * g.kernel_h + ky) * g.kernel_w + kx) * c;
          for (int64_t i = 0; i < c; ++i) {
            to[i] += from[i];
          }
        }
      }
    }
  }
}

// patches (forward) or their transpose (the gradient of patches, from its columns) of one geometry.
class Patches : public mx::UnaryPrimitive {
 public:
  Patches(mx::Stream stream, Geometry geometry, bool transposed, int threads)
      : mx::UnaryPrimitive(stream), geometry_(geometry), transposed_(transposed), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([in = inputs[0].data<float>(), out_ptr = out.data<float>(), g = geometry_,
                      transposed = transposed_, threads = threads_]() {
      const int64_t columns_bytes =
          int64_t(g.batch) * g.out_h * g.out_w * g.kernel_h * g.kernel_w * g.channels * int64_t(sizeof(float));
      const int64_t rows = int64_t(g.batch) * (transposed ? g.height : g.out_h);
      const int used = kernels_native::threads_for(columns_bytes, threads, 1 << 18);
      kernels_native::parallel_rows(rows, used, [&](int, int64_t begin, int64_t end) {
        if (transposed) {
          unpatch_rows(g, in, out_ptr, begin, end);
        } else {
          patch_rows(g, in, out_ptr, begin, end);
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("kernels patches runs on the CPU only");
  }
  const char* name() const override { return transposed_ ? "KernelsUnpatches" : "KernelsPatches"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Patches&>(other);
    return geometry_ == o.geometry_ && transposed_ == o.transposed_ && threads_ == o.threads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>&) override {
    const auto& g = geometry_;
    if (transposed_) {
      return {{g.batch, g.height, g.width, g.channels}};
    }
    return {{g.batch, g.out_h, g.out_w, g.kernel_h * g.kernel_w * g.channels}};
  }

 private:
  Geometry geometry_;
  bool transposed_;
  int threads_;
};

Geometry geometry(int batch, int height, int width, int channels, int kernel_h, int kernel_w, int stride, int padding,
                  int dilation) {
  if (kernel_h < 1 || kernel_w < 1 || stride < 1 || padding < 0 || dilation < 1) {
    throw std::invalid_argument("patches: kernel, stride and dilation must be positive, padding not negative");
  }
  Geometry g{batch, height, width, channels, kernel_h, kernel_w, stride, padding, dilation, 0, 0};
  g.out_h = (height + 2 * padding - dilation * (kernel_h - 1) - 1) / stride + 1;
  g.out_w = (width + 2 * padding - dilation * (kernel_w - 1) - 1) / stride + 1;
  if (g.out_h < 1 || g.out_w < 1) {
    throw std::invalid_argument("patches: the kernel does not fit the padded input");
  }
  return g;
}

}  // namespace

array patches(const array& x, int kernel_h, int kernel_w, int stride, int padding, int dilation, int threads) {
  if (x.ndim() != 4 || x.dtype() != mx::float32) {
    throw std::invalid_argument("patches: x must be float32 (N, H, W, C)");
  }
  const Geometry g =
      geometry(x.shape(0), x.shape(1), x.shape(2), x.shape(3), kernel_h, kernel_w, stride, padding, dilation);
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({g.batch, g.out_h, g.out_w, kernel_h * kernel_w * g.channels}, mx::float32,
               std::make_shared<Patches>(stream, g, false, threads), {mx::contiguous(x, false, stream)});
}

array unpatches(const array& columns, int height, int width, int kernel_h, int kernel_w, int stride, int padding,
                int dilation, int threads) {
  if (columns.ndim() != 4 || columns.dtype() != mx::float32 || columns.shape(3) % (kernel_h * kernel_w) != 0) {
    throw std::invalid_argument("unpatches: columns must be float32 (N, Ho, Wo, kernel_h * kernel_w * C)");
  }
  const int channels = columns.shape(3) / (kernel_h * kernel_w);
  const Geometry g = geometry(columns.shape(0), height, width, channels, kernel_h, kernel_w, stride, padding, dilation);
  if (g.out_h != columns.shape(1) || g.out_w != columns.shape(2)) {
    throw std::invalid_argument("unpatches: columns are not the patches of a (height, width) image");
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return array({g.batch, height, width, channels}, mx::float32, std::make_shared<Patches>(stream, g, true, threads),
               {mx::contiguous(columns, false, stream)});
}

}  // namespace kernels
