// Arithmetic shared by every fused kernel and every backend (Metal, CUDA, and the CPU shim the
// tests compile it under), written in the subset of C++ all three accept. The backend's prologue,
// placed before this file, defines INLINE, LANES, float_bits, lane_sum and ATOMIC_ADD.
//
// Conventions are those of kernels/sampling.py (PyTorch's CPU grid_sample): bilinear taps at
// floor(x) and floor(x) + 1; clipping has gradient 1 strictly inside (0, size - 1); NaN samples
// nothing. Keep the two in step: the tests compare them on edge points.

// NaN by its bits, so that a fast-math compiler cannot assume it away.
INLINE bool is_nan(float x) {
  return (float_bits(x) & 0x7fffffffu) > 0x7f800000u;
}

// A pixel coordinate after padding, and its derivative w.r.t. the coordinate before padding.
struct Padded {
  float x;
  float dx;
};

// Border padding. NaN stays NaN (both comparisons are false), as in MLX's minimum / maximum.
INLINE Padded clip_coordinate(float x, float size) {
  Padded p;
  p.dx = (x > 0.0f && x < size - 1.0f) ? 1.0f : 0.0f;
  p.x = x < 0.0f ? 0.0f : (x > size - 1.0f ? size - 1.0f : x);
  return p;
}

// Reflection padding about the edge pixels' centres (align_corners) or their outer edges.
INLINE Padded reflect_coordinate(float x, float size, bool align_corners) {
  const float twice_low = align_corners ? 0.0f : -1.0f;
  const float twice_high = align_corners ? 2.0f * (size - 1.0f) : 2.0f * size - 1.0f;
  if (twice_low == twice_high) {
    Padded p;
    p.x = 0.0f;
    p.dx = 0.0f;
    return p;
  }
  const float low = twice_low / 2.0f;
  const float span = (twice_high - twice_low) / 2.0f;
  float shifted = x - low;
  const float sign = shifted < 0.0f ? -1.0f : 1.0f;
  shifted = fabs(shifted);
  const float extra = fmod(shifted, span);
  const float flips = floor(shifted / span);
  const bool even = fmod(flips, 2.0f) == 0.0f;
  Padded p = clip_coordinate(even ? extra + low : span - extra + low, size);
  p.dx *= even ? sign : -sign;
  return p;
}

// PADDING: 0 zeros, 1 border, 2 reflection.
INLINE Padded pad_coordinate(float x, float size, int padding, bool align_corners) {
  if (padding == 1) {
    return clip_coordinate(x, size);
  }
  if (padding == 2) {
    return reflect_coordinate(x, size, align_corners);
  }
  Padded p;
  p.x = x;
  p.dx = 1.0f;
  return p;
}

// Far outside for NaN, bounded for infinities, so that floor() and int casts stay defined.
INLINE float sanitize(float x, float size) {
  if (is_nan(x)) {
    return -8.0f;
  }
  return x < -8.0f ? -8.0f : (x > size + 8.0f ? size + 8.0f : x);
}

// The four bilinear taps of a point: flat index y * width + x (0 where outside), interpolation
// weight and its derivatives w.r.t. the pixel coordinates (all 0 where outside).
struct Taps {
  int index[4];
  float weight[4];
  float dx[4];
  float dy[4];
};

INLINE Taps bilinear_taps(float x, float y, int width, int height) {
  x = sanitize(x, float(width));
  y = sanitize(y, float(height));
  const float x0 = floor(x);
  const float y0 = floor(y);
  const float fx = x - x0;
  const float fy = y - y0;
  Taps t;
  for (int k = 0; k < 4; ++k) {
    const int up = k / 2;
    const int right = k % 2;
    const float xi = x0 + float(right);
    const float yi = y0 + float(up);
    const bool inside = xi >= 0.0f && xi <= float(width - 1) && yi >= 0.0f && yi <= float(height - 1);
    const float wx = right ? fx : 1.0f - fx;
    const float wy = up ? fy : 1.0f - fy;
    t.index[k] = inside ? int(yi) * width + int(xi) : 0;
    t.weight[k] = inside ? wx * wy : 0.0f;
    t.dx[k] = inside ? (right ? wy : -wy) : 0.0f;
    t.dy[k] = inside ? (up ? wx : -wx) : 0.0f;
  }
  return t;
}
