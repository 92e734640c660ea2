// The loops of ms_deform_attn_kernel.h for one instruction set: included once per build (AVX-512,
// AVX2, the baseline), each time inside its own namespace and under its own `#pragma GCC target`,
// with ROWS_W the floats of a vector (16 or 8). Not a header to include anywhere else.
//
// The vector helpers are defined here, inside the target region, and not shared across builds: GCC
// lowers a function's generic vector code for the function's own target before inlining, so helpers
// built for the baseline ran lane by lane inside the AVX-512 loops.
//
// A sample (batch, query, head) has n = levels x points points and 4 taps a point. Its taps are
// located W points at a time, and kept tap by tap in k-major arrays: tap k of point i at k * padded + i.

constexpr int W = ROWS_W;
typedef float F __attribute__((vector_size(4 * W)));
typedef int32_t I __attribute__((vector_size(4 * W)));
typedef float F8 __attribute__((vector_size(32)));

INLINE F load(const float* from) {
  F v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
INLINE I load_int(const int32_t* from) {
  I v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
INLINE F8 load8(const float* from) {
  F8 v;
  std::memcpy(&v, from, sizeof v);
  return v;
}
INLINE void store(float* to, F v) { std::memcpy(to, &v, sizeof v); }
INLINE void store_int(int32_t* to, I v) { std::memcpy(to, &v, sizeof v); }
// floor() of values within [-8, 2^23): truncated, one less where that rounded up. It gives +0 for
// -0, whose fraction then is -0 instead of +0: a zero whose sign reaches only sums that start at +0.
INLINE F floored(F x) {
  const F truncated = __builtin_convertvector(__builtin_convertvector(x, I), F);
  return truncated > x ? truncated - 1.0f : truncated;
}
// sampling.h's sanitize(): far outside for NaN, bounded for infinities
INLINE F sanitized(F x, F size) {
  x = x != x ? -8.0f : x;
  return x < -8.0f ? -8.0f : (x > size + 8.0f ? size + 8.0f : x);
}

// The taps of one sample. Fixed by the problem: each point's level (sizes, where its rows start).
struct Taps {
  int n, padded;  // points, and points rounded up to whole vectors
  std::vector<float> scale_x, scale_y, width_f, height_f;
  std::vector<int32_t> width, start;
  // per point of the current sample
  std::vector<float> attention, chain_x, chain_y;
  // per tap, k-major. row: the tap's row in the head's block (its first element: row index x channels);
  // scaled: attention x bilinear weight
  std::vector<int32_t> row;
  std::vector<float> scaled, weight, dx, dy;
  int64_t first_point = 0;  // where the sample's inputs are
  int64_t location_x = 0, location_y = 0, location_stride = 2;
  // the points past n of the last vector: read from here, NaN (no taps) and attention 0
  std::vector<float> tail_x, tail_y, tail_attention;

  explicit Taps(const Problem& p)
      : n(p.levels * p.points), padded((n + W - 1) / W * W), scale_x(padded, 1.0f), scale_y(padded, 1.0f), width_f(padded, 1.0f), height_f(padded, 1.0f),
        width(padded, 1), start(padded, 0), attention(padded), chain_x(padded), chain_y(padded), row(4 * padded),
        scaled(4 * padded), weight(4 * padded), dx(4 * padded), dy(4 * padded), tail_x(W), tail_y(W),
        tail_attention(W) {
    for (int i = 0; i < n; ++i) {
      const int level = i / p.points;
      const int height = p.spatial_shapes[2 * level];
      width[i] = p.spatial_shapes[2 * level + 1];
      height_f[i] = float(height);
      width_f[i] = float(width[i]);
      scale_x[i] = p.align_corners ? float(width[i] - 1) : float(width[i]);
      scale_y[i] = p.align_corners ? float(height - 1) : float(height);
      start[i] = p.level_start_index[level];
    }
  }

  int tap(int i, int k) const { return k * padded + i; }
  int64_t point(int i) const { return first_point + i; }
  int64_t at_x(int i) const { return location_x + i * location_stride; }
  int64_t at_y(int i) const { return location_y + i * location_stride; }

  void find(const Problem& p, int64_t sample, int b) {
    first_point = sample * n;
    if (p.locations_b2qhlp) {
      location_x = 2 * b * p.batch_points() + (first_point - b * p.batch_points());
      location_y = location_x + p.batch_points();
      location_stride = 1;
    } else {
      location_x = 2 * first_point;
      location_y = location_x + 1;
      location_stride = 2;
    }
  }

  // The sample's inputs and the lines its results go to, asked for ahead of their use: in head order
  // consecutive samples are H samples apart in memory, a stride the hardware does not follow across
  // pages. Without it the forward waited on its locations and its output's lines, the backward on the
  // lines of the location and weight gradients (written a float at a time).
  void prefetch(const Problem& p, int64_t sample, int b, const float* out, int64_t out_size,
                const float* grad_locations = nullptr, const float* grad_weights = nullptr) {
    find(p, sample, b);
    // x and y: 2n floats interleaved, or (B2QHLP) n floats each, apart
    for (int64_t at = 0; at < location_stride * n; at += 16) {  // 16 floats: a cache line
      __builtin_prefetch(p.locations + location_x + at);
      if (grad_locations != nullptr) {
        __builtin_prefetch(grad_locations + location_x + at, 1);
      }
      if (location_stride == 1) {
        __builtin_prefetch(p.locations + location_y + at);
        if (grad_locations != nullptr) {
          __builtin_prefetch(grad_locations + location_y + at, 1);
        }
      }
    }
    for (int at = 0; at < n; at += 16) {
      __builtin_prefetch(p.weights + first_point + at);
      if (grad_weights != nullptr) {
        __builtin_prefetch(grad_weights + first_point + at, 1);
      }
    }
    for (int64_t at = 0; at < out_size; at += 16) {  // the output row (forward), the output's gradient (backward)
      if (grad_locations == nullptr) {
        __builtin_prefetch(out + sample * out_size + at, 1);
      } else {
        __builtin_prefetch(out + sample * out_size + at);
      }
    }
  }

  // x, y and attention weights of points i to i + W - 1 (W at most 16: a vector, or two for x, y interleaved)
  void inputs(const Problem& p, int i, F& x, F& y, F& a) {
    if (i + W <= n) {
      a = load(p.weights + first_point + i);
      if (location_stride == 1) {
        x = load(p.locations + at_x(i));
        y = load(p.locations + at_y(i));
        return;
      }
      const F low = load(p.locations + at_x(i)), high = load(p.locations + at_x(i) + W);
#if ROWS_W == 16
      x = __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      y = __builtin_shufflevector(low, high, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
      x = __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14);
      y = __builtin_shufflevector(low, high, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
      return;
    }
    for (int j = 0; j < W; ++j) {
      const bool real = i + j < n;
      tail_x[j] = real ? p.locations[at_x(i + j)] : NAN;
      tail_y[j] = real ? p.locations[at_y(i + j)] : NAN;
      tail_attention[j] = real ? p.weights[first_point + i + j] : 0.0f;
    }
    x = load(tail_x.data());
    y = load(tail_y.data());
    a = load(tail_attention.data());
  }

  // Every point's taps, W points at a time: sampling.h's pad_coordinate (zeros, border), sanitize and
  // bilinear_taps lane by lane, so that outputs and gradients are those of the one-by-one arithmetic
  // bit for bit (tests/test_cpu_kernel.py). FORWARD: a tap whose scaled weight is 0 reads the zero row
  // after the head's rows (adding w x 0 to a sum that is never -0 leaves it as skipping the tap did).
  // BACKWARD: also the taps' derivatives, and an outside tap reads its level's first row, as before.
  template <int PADDING, bool BACKWARD>
  void locate(const Problem& p) {
    static_assert(PADDING == 0 || PADDING == 1, "zeros or border");
    const float offset = p.align_corners ? 0.0f : 0.5f;
    const I row_size = I{} + p.channels;
    const I zero_row = I{} + p.length * p.channels;
    for (int i = 0; i < padded; i += W) {
      F u, v, a;
      inputs(p, i, u, v, a);
      store(&attention[i], a);
      const F size_x = load(&width_f[i]), size_y = load(&height_f[i]);
      F x = u * load(&scale_x[i]) - offset;
      F y = v * load(&scale_y[i]) - offset;
      F slope_x = F{} + 1.0f, slope_y = F{} + 1.0f;
      if constexpr (PADDING == 1) {  // clip_coordinate
        slope_x = (x > 0.0f) & (x < size_x - 1.0f) ? slope_x : 0.0f;
        slope_y = (y > 0.0f) & (y < size_y - 1.0f) ? slope_y : 0.0f;
        x = x < 0.0f ? 0.0f : (x > size_x - 1.0f ? size_x - 1.0f : x);
        y = y < 0.0f ? 0.0f : (y > size_y - 1.0f ? size_y - 1.0f : y);
      }
      x = sanitized(x, size_x);
      y = sanitized(y, size_y);
      const F x0 = floored(x), y0 = floored(y);
      const F fx = x - x0, fy = y - y0;
      const F last_x = size_x - 1.0f, last_y = size_y - 1.0f;  // float(width - 1), exactly
      const I width_w = load_int(&width[i]), start_w = load_int(&start[i]);
      for (int k = 0; k < 4; ++k) {
        const int up = k / 2, right = k % 2;
        const F xi = x0 + float(right), yi = y0 + float(up);
        const I inside = (xi >= 0.0f) & (xi <= last_x) & (yi >= 0.0f) & (yi <= last_y);
        const F wx = right ? fx : 1.0f - fx;
        const F wy = up ? fy : 1.0f - fy;
        const I flat = __builtin_convertvector(yi, I) * width_w + __builtin_convertvector(xi, I);
        const F w = inside ? wx * wy : 0.0f;
        const F s = a * w;
        const I at = (start_w + (inside ? flat : 0)) * row_size;
        store(&scaled[tap(i, k)], s);
        if constexpr (BACKWARD) {
          store_int(&row[tap(i, k)], at);
          store(&weight[tap(i, k)], w);
          store(&dx[tap(i, k)], inside ? (right ? wy : -wy) : 0.0f);
          store(&dy[tap(i, k)], inside ? (up ? wx : -wx) : 0.0f);
        } else {
          store_int(&row[tap(i, k)], s == 0.0f ? zero_row : at);
        }
      }
      if constexpr (BACKWARD) {
        store(&chain_x[i], slope_x * load(&scale_x[i]));
        store(&chain_y[i], slope_y * load(&scale_y[i]));
      }
    }
  }

  template <bool BACKWARD>
  void locate_sample(const Problem& p, int64_t sample, int b) {
    find(p, sample, b);
    if (p.padding == 1) {
      locate<1, BACKWARD>(p);
    } else {
      locate<0, BACKWARD>(p);
    }
  }
};

// A row of CHANNELS floats (a multiple of W) in vector registers.
template <int CHANNELS>
struct Row {
  static_assert(CHANNELS % W == 0, "a row is whole vectors");
  static constexpr int parts = CHANNELS / W;
  F part[parts];

  INLINE Row zero() {
    Row r;
    for (auto& v : r.part) {
      v = F{};
    }
    return r;
  }
  INLINE Row load_row(const float* from) {
    Row r;
    for (int i = 0; i < parts; ++i) {
      r.part[i] = load(from + W * i);
    }
    return r;
  }
  __attribute__((always_inline)) void store_row(float* to) const {
    for (int i = 0; i < parts; ++i) {
      store(to + W * i, part[i]);
    }
  }
  // this += w * from
  __attribute__((always_inline)) void add_scaled(float w, const float* from) {
    for (int i = 0; i < parts; ++i) {
      part[i] += w * load(from + W * i);  // w broadcast: one vbroadcastss
    }
  }
  // to += w * this
  __attribute__((always_inline)) void add_scaled_to(float w, float* to) const {
    for (int i = 0; i < parts; ++i) {
      store(to + W * i, load(to + W * i) + w * part[i]);
    }
  }
};

// A row of c floats, inline: GCC turned the loop into a call of memmove per 128-byte row, which
// `no-tree-loop-distribute-patterns` on the callers keeps it from.
#if defined(__GNUC__) && !defined(__clang__)
#define NO_MEMCPY_CALLS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_MEMCPY_CALLS
#endif
INLINE void copy_row(const float* __restrict__ from, float* __restrict__ to, int64_t c) {
  int64_t i = 0;
  for (; i + W <= c; i += W) {
    store(to + i, load(from + i));
  }
  for (; i < c; ++i) {
    to[i] = from[i];
  }
}

// Where a head's rows are read and its value gradient summed: the head's (L, C) rows in a buffer of
// the thread's own, and a zero row after them, whatever value's layout. In a (B, L, H, C) value (the
// model's) a head's rows are H x C floats apart, and MLX's arrays are 8 bytes past a 64-byte line:
// summing the backward's value gradient there in place took 1.75x as long as in a block copied out
// (bench/README.md); copying the whole value to (B, H, L, C) first, as before, was a fifth of the forward.
struct HeadBlock {
  int64_t pair = -1;  // (batch, head) held
  std::unique_ptr<float[], AlignedDelete> rows;

  explicit HeadBlock(const Problem& p) : rows(aligned_floats((int64_t(p.length) + 1) * p.channels)) {}
  float* block() const { return rows.get(); }

  // value's rows of pair = b * heads + head, and the zero row after them
  NO_MEMCPY_CALLS const float* hold(const Problem& p, int64_t wanted) {
    if (wanted != pair) {
      pair = wanted;
      const float* from = p.value + p.value_base(int(wanted / p.heads), int(wanted % p.heads));
      const int64_t stride = p.row_stride(), c = p.channels;
      for (int64_t l = 0; l < p.length; ++l) {
        copy_row(from + l * stride, block() + l * c, c);
      }
      std::fill(block() + p.length * c, block() + (p.length + 1) * c, 0.0f);
    }
    return block();
  }
  // the block's rows out to pair's rows in `to` (laid out as value)
  NO_MEMCPY_CALLS void write(const Problem& p, float* to, int64_t pair_out) const {
    to += p.value_base(int(pair_out / p.heads), int(pair_out % p.heads));
    const int64_t stride = p.row_stride(), c = p.channels;
    for (int64_t l = 0; l < p.length; ++l) {
      copy_row(block() + l * c, to + l * stride, c);
    }
  }
};

// How many samples ahead (of one head: H samples apart in memory) the inputs are asked for.
constexpr int PREFETCH_AHEAD = 4;

// The forward's samples head by head: task = (b * heads + head) * queries + q; sample = (b * queries
// + q) * heads + head.
INLINE int64_t forward_sample(const Problem& p, int64_t task) {
  const int64_t pair = task / p.queries, q = task % p.queries;
  return ((pair / p.heads) * p.queries + q) * p.heads + pair % p.heads;
}

// Two samples' sums side by side: each is a chain of dependent adds (the taps' order is the output's
// rounding), so one sample alone waits on the adder's latency; two keep it busy.
template <int CHANNELS>
void forward_pair(const float* block, const Taps& one, const Taps& two, float* out_one, float* out_two) {
  auto sum_one = Row<CHANNELS>::zero(), sum_two = Row<CHANNELS>::zero();
  for (int i = 0; i < one.n; ++i) {
    for (int k = 0; k < 4; ++k) {
      const int t = one.tap(i, k);
      sum_one.add_scaled(one.scaled[t], block + one.row[t]);
      sum_two.add_scaled(two.scaled[t], block + two.row[t]);
    }
  }
  sum_one.store_row(out_one);
  sum_two.store_row(out_two);
}

// Any channel count: one sample, the sum in the output row.
INLINE void forward_any(const float* block, const Taps& taps, int channels, float* __restrict__ out) {
  std::fill(out, out + channels, 0.0f);
  for (int i = 0; i < taps.n; ++i) {
    for (int k = 0; k < 4; ++k) {
      const int t = taps.tap(i, k);
      const float w = taps.scaled[t];
      const float* __restrict__ v = block + taps.row[t];
      for (int c = 0; c < channels; ++c) {
        out[c] += w * v[c];
      }
    }
  }
}

// CHANNELS > 0 fixes the channel count at compile time (the model's 32); 0 reads it from the problem.
// A run: a `split`-th of one (batch, head) pair's queries (ms_deform_attn_kernel.h: forward).
template <int CHANNELS>
void forward_rows(const Problem& p, float* output, kernels_native::Runs& runs, int64_t split) {
  Taps one(p), two(p), ahead(p);
  HeadBlock block(p);
  for (int64_t run = runs.next(); run >= 0; run = runs.next()) {
    const int64_t pair = run / split, part = run % split;
    const int64_t first = pair * p.queries + p.queries * part / split, last = pair * p.queries + p.queries * (part + 1) / split;
    const float* rows = block.hold(p, pair);
    const int b = int(pair / p.heads);
    for (int64_t task = first; task < last;) {
      const int64_t sample = forward_sample(p, task);
      if (task + PREFETCH_AHEAD + 1 < last) {
        ahead.prefetch(p, sample + PREFETCH_AHEAD * p.heads, b, output, p.channels);
        ahead.prefetch(p, sample + (PREFETCH_AHEAD + 1) * p.heads, b, output, p.channels);
      }
      one.locate_sample<false>(p, sample, b);
      if (CHANNELS == 0 || task + 1 == last) {
        forward_any(rows, one, p.channels, output + sample * p.channels);
        task += 1;
        continue;
      }
      two.locate_sample<false>(p, sample + p.heads, b);  // the next query's
      if constexpr (CHANNELS > 0) {
        forward_pair<CHANNELS>(rows, one, two, output + sample * CHANNELS, output + (sample + p.heads) * CHANNELS);
      }
      task += 2;
    }
  }
}

// dots() reduces the tap in slot j + (W / 4) s into lane 4j + s: slot `slot` takes lane_of(slot)'s tap
constexpr int lane_of(int slot) { return 4 * (slot % (W / 4)) + slot / (W / 4); }

// <value row, g> of the W taps in `rows`, for CHANNELS a multiple of 8, each summed in dot()'s order:
// 8 partial sums over the channels 8 apart, then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)).
// The partial sums of 8 vectors (two taps in each for W = 16) are reduced together by shuffles;
// row: the W taps' rows; they are taken in the order that leaves dot j in lane j (lane_of).
template <int CHANNELS>
INLINE F dots(const float* values, const int32_t* row, const float* g) {
  static_assert(CHANNELS % 8 == 0, "whole vectors of 8");
  F partial[8];
  for (int v = 0; v < 8; ++v) {
#if ROWS_W == 16
    const float *one = values + row[lane_of(2 * v)], *two = values + row[lane_of(2 * v + 1)];
    F sum;
    for (int c = 0; c < CHANNELS; c += 8) {
      const F8 g8 = load8(g + c);
      const F taps = __builtin_shufflevector(load8(one + c), load8(two + c), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                             12, 13, 14, 15);
      const F product = taps * __builtin_shufflevector(g8, g8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
      sum = c == 0 ? product : sum + product;  // 0 + the first product: the same but for a zero's sign
    }
#else
    F sum;
    for (int c = 0; c < CHANNELS; c += 8) {
      const F product = load(values + row[lane_of(v)] + c) * load(g + c);
      sum = c == 0 ? product : sum + product;
    }
#endif
    partial[v] = sum;
  }
  // l_j + l_(j+4): a tap's 4-lane blocks, low and high halves apart
  F halves[4];
  for (int v = 0; v < 4; ++v) {
#if ROWS_W == 16
    const F low = __builtin_shufflevector(partial[2 * v], partial[2 * v + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                          19, 24, 25, 26, 27);
    const F high = __builtin_shufflevector(partial[2 * v], partial[2 * v + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                           22, 23, 28, 29, 30, 31);
#else
    const F low = __builtin_shufflevector(partial[2 * v], partial[2 * v + 1], 0, 1, 2, 3, 8, 9, 10, 11);
    const F high = __builtin_shufflevector(partial[2 * v], partial[2 * v + 1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
    halves[v] = low + high;
  }
  // then m0 + m1, m2 + m3 of each tap, two vectors' blocks at a time, and again
  const auto pairs = [](F x, F y) {
#if ROWS_W == 16
    return __builtin_shufflevector(x, y, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           __builtin_shufflevector(x, y, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
#else
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
#endif
  };
  return pairs(pairs(halves[0], halves[1]), pairs(halves[2], halves[3]));
}

template <int CHANNELS>
void backward_sample(const Problem& p, const Taps& taps, const float* values, float* grads,
                     const float* __restrict__ g, float* __restrict__ grad_locations, float* __restrict__ grad_weights) {
  for (int i = 0; i < taps.padded; i += W) {
    F slope_weight{}, slope_x{}, slope_y{};
    for (int k = 0; k < 4; ++k) {
      F dot_vg;
      if constexpr (CHANNELS > 0) {
        dot_vg = dots<CHANNELS>(values, &taps.row[taps.tap(i, k)], g);
      } else {
        for (int lane = 0; lane < W; ++lane) {
          dot_vg[lane] = dot(values + taps.row[taps.tap(i + lane, k)], g, p.channels);
        }
      }
      const int t = taps.tap(i, k);
      slope_weight += load(&taps.weight[t]) * dot_vg;
      slope_x += load(&taps.dx[t]) * dot_vg;
      slope_y += load(&taps.dy[t]) * dot_vg;
    }
    const F a = load(&taps.attention[i]);
    const F gx = a * slope_x * load(&taps.chain_x[i]), gy = a * slope_y * load(&taps.chain_y[i]);
    if (i + W <= taps.n) {  // whole vectors
      store(grad_weights + taps.point(i), slope_weight);
      if (taps.location_stride == 1) {
        store(grad_locations + taps.at_x(i), gx);
        store(grad_locations + taps.at_y(i), gy);
      } else {
#if ROWS_W == 16
        store(grad_locations + taps.at_x(i), __builtin_shufflevector(gx, gy, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
        store(grad_locations + taps.at_x(i) + W, __builtin_shufflevector(gx, gy, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
#else
        store(grad_locations + taps.at_x(i), __builtin_shufflevector(gx, gy, 0, 8, 1, 9, 2, 10, 3, 11));
        store(grad_locations + taps.at_x(i) + W, __builtin_shufflevector(gx, gy, 4, 12, 5, 13, 6, 14, 7, 15));
#endif
      }
      continue;
    }
    for (int lane = 0; i + lane < taps.n; ++lane) {
      grad_weights[taps.point(i + lane)] = slope_weight[lane];
      grad_locations[taps.at_x(i + lane)] = gx[lane];
      grad_locations[taps.at_y(i + lane)] = gy[lane];
    }
  }
  // the value gradient in the taps' order (the order of its sums)
  Row<(CHANNELS > 0 ? CHANNELS : W)> g_row;
  if constexpr (CHANNELS > 0) {
    g_row = Row<CHANNELS>::load_row(g);
  }
  for (int i = 0; i < taps.n; ++i) {
    for (int k = 0; k < 4; ++k) {
      const int t = taps.tap(i, k);
      float* __restrict__ gv = grads + taps.row[t];
      if constexpr (CHANNELS > 0) {
        g_row.add_scaled_to(taps.scaled[t], gv);
      } else {
        for (int c = 0; c < p.channels; ++c) {
          gv[c] += taps.scaled[t] * g[c];
        }
      }
    }
  }
}

// pair = b * heads + head: one head's queries in order, its value rows and their gradient in blocks
// of the thread's own (HeadBlock), the gradient copied out when the head is done.
template <int CHANNELS>
void backward_rows(const Problem& p, const float* grad_output, float* grad_value, float* grad_locations,
                   float* grad_weights, kernels_native::Runs& runs) {
  const int c_count = p.channels;
  Taps taps(p), ahead(p);
  HeadBlock values(p), grads(p);
  for (int64_t pair = runs.next(); pair >= 0; pair = runs.next()) {
    const int b = int(pair / p.heads), head = int(pair % p.heads);
    const float* rows = values.hold(p, pair);
    std::fill(grads.block(), grads.block() + int64_t(p.length) * c_count, 0.0f);
    for (int64_t q = 0; q < p.queries; ++q) {
      const int64_t sample = (int64_t(b) * p.queries + q) * p.heads + head;
      if (q + PREFETCH_AHEAD < p.queries) {
        ahead.prefetch(p, sample + PREFETCH_AHEAD * p.heads, b, grad_output, c_count,
                       grad_locations, grad_weights);
      }
      taps.locate_sample<true>(p, sample, b);
      backward_sample<CHANNELS>(p, taps, rows, grads.block(), grad_output + sample * c_count, grad_locations,
                                grad_weights);
    }
    grads.write(p, grad_value, pair);
  }
}
