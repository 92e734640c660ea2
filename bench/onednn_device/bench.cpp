// oneDNN 3.2 timings of the R50 backbone's convolutions. OMP_NUM_THREADS sets threads.
// Usage: bench train [f32|bf16p|bf16 ...]  the training step's convs (batch 2, 512 x 683), as onednn.cpp
//        bench infer [f32|bf16p ...]       inference forward (batch 1, 800 x 1066), as onednn.cpp
//        bench version                     oneDNN's version and the ISA it uses
//        (older scouting modes: conv | bwd | mm | wplain | all, plain oneDNN descriptors)
// Env: REPEATS (timed calls after one warm-up, default 5), MAX_S (stop repeating a call after this many
// seconds, at least 2 calls; default 1), SIZE / INFER_SIZE=n,h,w (override train's / infer's input), CPUTIME (time by process CPU).
#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;

static engine eng(engine::kind::cpu, 0);
static stream strm(eng);

#include <ctime>
static double cpu_now() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static bool g_cpu = getenv("CPUTIME") != nullptr;  // time by process CPU time (run under taskset -c N, 1 thread)
static double now() {
  if (g_cpu) return cpu_now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void fill(memory& m) {
  // fill with f32 randoms through a reorder from a plain f32 buffer of the same logical dims
  auto md = m.get_desc();
  auto dims = md.get_dims();
  memory::desc plain;
  // dense row-major strides
  std::vector<int64_t> strides(dims.size());
  int64_t s = 1;
  for (int i = int(dims.size()) - 1; i >= 0; --i) { strides[i] = s; s *= dims[i]; }
  plain = memory::desc(dims, dt::f32, strides);
  memory src(plain, eng);
  float* p = (float*)src.get_data_handle();
  uint32_t g = 1;  // a plain LCG: no <random> (its library objects need a newer glibc)
  for (int64_t i = 0; i < s; ++i) g = g * 1664525u + 1013904223u, p[i] = (g >> 8) * (2.0f / 16777216.0f) - 1.0f;
  reorder(src, m).execute(strm, src, m);
  strm.wait();
}

// run `f` repeatedly: one warm-up, then reps until ~0.25 s or 20 reps (at least 3); -> best seconds
template <class F>
static double timeit(F f) {
  f();
  strm.wait();
  std::vector<double> t;
  double start = now();
  while (t.size() < 3 || (now() - start < 0.25 && t.size() < 20)) {
    double a = now();
    f();
    strm.wait();
    t.push_back(now() - a);
  }
  return *std::min_element(t.begin(), t.end());
}

struct Conv {
  const char* name;
  int count, ic, ih, iw, oc, k, stride;
};

static const char* dtname(dt d) { return d == dt::f32 ? "f32" : "bf16"; }

static bool g_wplain = false;
static double conv_fwd(const Conv& c, dt d, bool nhwc, double* wreorder_ms, std::string* impl) {
  int pad = c.k / 2;
  int oh = (c.ih + 2 * pad - c.k) / c.stride + 1, ow = (c.iw + 2 * pad - c.k) / c.stride + 1;
  memory::dims src{1, c.ic, c.ih, c.iw}, wei{c.oc, c.ic, c.k, c.k}, dst{1, c.oc, oh, ow};
  auto act = nhwc ? tag::nhwc : tag::any;
  memory::desc s_md(src, d, act), w_md(wei, d, g_wplain ? tag::hwio : tag::any), d_md(dst, d, act);
  auto pd = convolution_forward::primitive_desc(eng, prop_kind::forward_inference, algorithm::convolution_direct,
                                                s_md, w_md, d_md, {c.stride, c.stride}, {pad, pad}, {pad, pad});
  *impl = pd.impl_info_str();
  memory sm(pd.src_desc(), eng), dm(pd.dst_desc(), eng), wm(pd.weights_desc(), eng);
  fill(sm);
  // weights arrive as MLX's OHWI f32 (or bf16): reorder once into the primitive's layout
  memory w_user({wei, d, tag::ohwi}, eng);
  fill(w_user);
  *wreorder_ms = 1e3 * timeit([&] { reorder(w_user, wm).execute(strm, w_user, wm); });
  auto prim = convolution_forward(pd);
  return timeit([&] { prim.execute(strm, {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, dm}}); });
}

static double conv_flops(const Conv& c) {
  int pad = c.k / 2;
  int oh = (c.ih + 2 * pad - c.k) / c.stride + 1, ow = (c.iw + 2 * pad - c.k) / c.stride + 1;
  return 2.0 * oh * ow * c.oc * c.ic * c.k * c.k;
}

static void conv_bwd(const Conv& c, bool nhwc) {
  int pad = c.k / 2;
  int oh = (c.ih + 2 * pad - c.k) / c.stride + 1, ow = (c.iw + 2 * pad - c.k) / c.stride + 1;
  memory::dims src{1, c.ic, c.ih, c.iw}, wei{c.oc, c.ic, c.k, c.k}, dst{1, c.oc, oh, ow};
  auto act = nhwc ? tag::nhwc : tag::any;
  memory::desc s_md(src, dt::f32, act), w_md(wei, dt::f32, tag::any), d_md(dst, dt::f32, act);
  auto fwd = convolution_forward::primitive_desc(eng, prop_kind::forward_training, algorithm::convolution_direct, s_md,
                                                 w_md, d_md, {c.stride, c.stride}, {pad, pad}, {pad, pad});
  auto bd = convolution_backward_data::primitive_desc(eng, algorithm::convolution_direct, s_md, w_md, d_md,
                                                      {c.stride, c.stride}, {pad, pad}, {pad, pad}, fwd);
  auto bw = convolution_backward_weights::primitive_desc(eng, algorithm::convolution_direct, s_md, w_md, d_md,
                                                         {c.stride, c.stride}, {pad, pad}, {pad, pad}, fwd);
  double fl = conv_flops(c);
  {
    memory gs(bd.diff_src_desc(), eng), wm(bd.weights_desc(), eng), gd(bd.diff_dst_desc(), eng);
    fill(wm);
    fill(gd);
    auto p = convolution_backward_data(bd);
    double t = timeit([&] { p.execute(strm, {{DNNL_ARG_DIFF_SRC, gs}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DIFF_DST, gd}}); });
    printf("bwd_data    %-22s %s %-5s %8.2f ms %7.0f GFLOP/s  %s\n", c.name, nhwc ? "nhwc" : "any ", "f32", t * 1e3,
           fl / t / 1e9, bd.impl_info_str());
  }
  {
    memory sm(bw.src_desc(), eng), gw(bw.diff_weights_desc(), eng), gd(bw.diff_dst_desc(), eng);
    fill(sm);
    fill(gd);
    auto p = convolution_backward_weights(bw);
    double t = timeit([&] { p.execute(strm, {{DNNL_ARG_SRC, sm}, {DNNL_ARG_DIFF_WEIGHTS, gw}, {DNNL_ARG_DIFF_DST, gd}}); });
    printf("bwd_weights %-22s %s %-5s %8.2f ms %7.0f GFLOP/s  %s\n", c.name, nhwc ? "nhwc" : "any ", "f32", t * 1e3,
           fl / t / 1e9, bw.impl_info_str());
  }
  fflush(stdout);
}

static void mm(int M, int K, int N, dt d, bool wany) {
  memory::desc s_md({M, K}, d, tag::ab), w_md({K, N}, d, wany ? tag::any : tag::ba), d_md({M, N}, d, tag::ab);
  auto pd = matmul::primitive_desc(eng, s_md, w_md, d_md);
  memory sm(pd.src_desc(), eng), wm(pd.weights_desc(), eng), dm(pd.dst_desc(), eng);
  fill(sm);
  fill(wm);
  auto p = matmul(pd);
  double t = timeit([&] { p.execute(strm, {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, dm}}); });
  printf("matmul %6d x %4d x %4d %-4s w=%s %8.2f ms %7.0f GFLOP/s  %s\n", M, K, N, dtname(d), wany ? "any" : "ba ",
         t * 1e3, 2.0 * M * K * N / t / 1e9, pd.impl_info_str());
  fflush(stdout);
}

// ResNet-50 at 800 x 1066, batch 1: every distinct convolution, with how many times it runs; plus
// the detector's input projections.
static const std::vector<Conv> R50 = {
    {"stem7x7 3-64 s2", 1, 3, 800, 1066, 64, 7, 2},
    {"L1 1x1 64-64", 1, 64, 200, 267, 64, 1, 1},
    {"L1 3x3 64-64", 3, 64, 200, 267, 64, 3, 1},
    {"L1 1x1 64-256", 4, 64, 200, 267, 256, 1, 1},  // 3 conv3 + downsample
    {"L1 1x1 256-64", 2, 256, 200, 267, 64, 1, 1},
    {"L2 1x1 256-128", 1, 256, 200, 267, 128, 1, 1},
    {"L2 3x3 128 s2", 1, 128, 200, 267, 128, 3, 2},
    {"L2 ds 1x1 256-512 s2", 1, 256, 200, 267, 512, 1, 2},
    {"L2 1x1 128-512", 4, 128, 100, 134, 512, 1, 1},
    {"L2 1x1 512-128", 3, 512, 100, 134, 128, 1, 1},
    {"L2 3x3 128-128", 3, 128, 100, 134, 128, 3, 1},
    {"L3 1x1 512-256", 1, 512, 100, 134, 256, 1, 1},
    {"L3 3x3 256 s2", 1, 256, 100, 134, 256, 3, 2},
    {"L3 ds 1x1 512-1024 s2", 1, 512, 100, 134, 1024, 1, 2},
    {"L3 1x1 256-1024", 6, 256, 50, 67, 1024, 1, 1},
    {"L3 1x1 1024-256", 5, 1024, 50, 67, 256, 1, 1},
    {"L3 3x3 256-256", 5, 256, 50, 67, 256, 3, 1},
    {"L4 1x1 1024-512", 1, 1024, 50, 67, 512, 1, 1},
    {"L4 3x3 512 s2", 1, 512, 50, 67, 512, 3, 2},
    {"L4 ds 1x1 1024-2048 s2", 1, 1024, 50, 67, 2048, 1, 2},
    {"L4 1x1 512-2048", 3, 512, 25, 34, 2048, 1, 1},
    {"L4 1x1 2048-512", 2, 2048, 25, 34, 512, 1, 1},
    {"L4 3x3 512-512", 2, 512, 25, 34, 512, 3, 1},
    {"proj 1x1 512-256", 1, 512, 100, 134, 256, 1, 1},
    {"proj 1x1 1024-256", 1, 1024, 50, 67, 256, 1, 1},
    {"proj 1x1 2048-256", 1, 2048, 25, 34, 256, 1, 1},
    {"proj 3x3 2048-256 s2", 1, 2048, 25, 34, 256, 3, 2},
};

// ===================================================================================================
// The R50 backbone's convolutions as kernels/native/onednn.cpp runs them (modes `train`, `infer`):
// its descriptors (forward_training with `format_tag::any` weights; backward data and backward weights
// hinted by the forward pd; bf16 products with f32 operands converted by a reorder; diff_weights f32
// for an f32 weight), and its per-call work (`as_wanted`: a reorder into a freshly allocated buffer of
// the weight and, where the dtypes differ, of src / diff_dst; the blocked diff_weights reordered into
// the user's OHWI buffer), timed per call as MLX's stream would run it.
namespace ours {

using dims = memory::dims;

engine& engine_() { return eng; }

// --- copied from kernels/native/onednn.cpp (ConvShape, require_fast, as_wanted, conv_plan, make_backward)
template <typename Desc>
bool fast(const Desc& pd, bool convolution = true) {  // onednn.cpp's require_fast, answering instead of throwing
  const std::string impl = pd.impl_info_str();
  return !(impl.find("ref") != std::string::npos || (convolution && impl.find("gemm") != std::string::npos));
}

memory as_wanted(const memory::desc& user_desc, const void* data, const memory::desc& wanted) {
  memory user(user_desc, engine_(), const_cast<void*>(data));
  if (user_desc == wanted) return user;
  memory converted(wanted, engine_());
  reorder(user, converted).execute(strm, user, converted);
  return converted;
}

struct ConvShape {
  int n, h, w, c, o, kh, kw, stride, padding, dilation;
  dt x_type, w_type, product;
  int out_h() const { return (h + 2 * padding - dilation * (kh - 1) - 1) / stride + 1; }
  int out_w() const { return (w + 2 * padding - dilation * (kw - 1) - 1) / stride + 1; }
  memory::desc x_plain(dt type) const { return {{n, c, h, w}, type, tag::nhwc}; }
  memory::desc y_plain(dt type) const { return {{n, o, out_h(), out_w()}, type, tag::nhwc}; }
  memory::desc w_plain(dt type) const { return {{o, c, kh, kw}, type, tag::ohwi}; }
  memory::desc w_any() const { return {{o, c, kh, kw}, product, tag::any}; }
  dims strides() const { return {stride, stride}; }
  dims dilates() const { return {dilation - 1, dilation - 1}; }
  dims pads() const { return {padding, padding}; }
  double flops() const { return 2.0 * n * out_h() * out_w() * o * c * kh * kw; }
};

struct ConvPlan {
  convolution_forward::primitive_desc forward_pd;
  convolution_forward forward;
  convolution_backward_data::primitive_desc data_pd;
  convolution_backward_data data;
  convolution_backward_weights::primitive_desc weights_pd;
  convolution_backward_weights weights;
  bool forward_fast = false, data_fast = false, weights_fast = false;
};

ConvPlan make_plan(const ConvShape& s, bool backward) {
  ConvPlan plan;
  plan.forward_pd = convolution_forward::primitive_desc(
      engine_(), prop_kind::forward_training, algorithm::convolution_direct, s.x_plain(s.product), s.w_any(),
      s.y_plain(s.x_type), s.strides(), s.dilates(), s.pads(), s.pads());
  plan.forward_fast = fast(plan.forward_pd);
  plan.forward = convolution_forward(plan.forward_pd);
  if (backward) {
    plan.data_pd = convolution_backward_data::primitive_desc(
        engine_(), algorithm::convolution_direct, s.x_plain(s.x_type), s.w_any(), s.y_plain(s.product), s.strides(),
        s.dilates(), s.pads(), s.pads(), plan.forward_pd);
    plan.data_fast = fast(plan.data_pd);
    plan.data = convolution_backward_data(plan.data_pd);
    plan.weights_pd = convolution_backward_weights::primitive_desc(
        engine_(), algorithm::convolution_direct, s.x_plain(s.product),
        memory::desc({s.o, s.c, s.kh, s.kw}, s.w_type == dt::f32 ? dt::f32 : s.product, tag::any),
        s.y_plain(s.product), s.strides(), s.dilates(), s.pads(), s.pads(), plan.forward_pd);
    plan.weights_fast = fast(plan.weights_pd);
    plan.weights = convolution_backward_weights(plan.weights_pd);
  }
  return plan;
}

// --- the network: every conv of torchvision's ResNet-50 (v1.5: stride on the 3x3), distinct shapes with counts
struct Layer {
  std::string name;
  int count, c, o, k, stride, pad, h, w;  // input h, w
  bool train;       // layer2..4: forward + backward data + backward weights; stem, layer1: forward only
  bool data_needed; // false for layer2.0's conv1 and downsample (their input, layer1's output, needs no gradient)
};

std::vector<Layer> resnet50(int H, int W) {
  std::vector<Layer> layers;
  auto add = [&](const std::string& name, int c, int o, int k, int stride, int h, int w, bool train, bool needed) {
    for (auto& l : layers) {
      if (l.c == c && l.o == o && l.k == k && l.stride == stride && l.h == h && l.w == w && l.train == train &&
          l.data_needed == needed) {
        ++l.count;
        return;
      }
    }
    layers.push_back({name, 1, c, o, k, stride, k / 2, h, w, train, needed});
  };
  auto out = [](int x, int k, int s, int p) { return (x + 2 * p - k) / s + 1; };
  add("stem 7x7 3-64 s2", 3, 64, 7, 2, H, W, false, false);
  int h = out(out(H, 7, 2, 3), 3, 2, 1), w = out(out(W, 7, 2, 3), 3, 2, 1);  // conv1, maxpool 3/2/1
  const int widths[4] = {64, 128, 256, 512}, depths[4] = {3, 4, 6, 3};
  int in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int c = widths[stage], stride = stage == 0 ? 1 : 2;
    const bool train = stage > 0;
    const std::string L = "L" + std::to_string(stage + 1) + " ";
    for (int b = 0; b < depths[stage]; ++b) {
      const int s = b == 0 ? stride : 1;
      const bool needed = train && !(stage == 1 && b == 0);  // layer2.0 reads layer1's output
      const int h2 = out(h, 3, s, 1), w2 = out(w, 3, s, 1);
      auto sz = [](int a, int b) { return " @" + std::to_string(a) + "x" + std::to_string(b); };
      add(L + "1x1 " + std::to_string(in) + "-" + std::to_string(c) + sz(h, w), in, c, 1, 1, h, w, train, needed);
      add(L + "3x3 " + std::to_string(c) + "-" + std::to_string(c) + (s > 1 ? " s2" : "") + sz(h, w), c, c, 3, s, h,
          w, train, true);
      add(L + "1x1 " + std::to_string(c) + "-" + std::to_string(4 * c) + sz(h2, w2), c, 4 * c, 1, 1, h2, w2, train,
          true);
      if (b == 0)
        add(L + "ds 1x1 " + std::to_string(in) + "-" + std::to_string(4 * c) + (s > 1 ? " s2" : "") + sz(h, w), in,
            4 * c, 1, s, h, w, train, needed);
      h = h2, w = w2, in = 4 * c;
    }
  }
  return layers;
}

// `reorders`: the calls' as_wanted conversions (x / cotangent to bf16, the weight to the kernel's layout) and
// the blocked diff_weights' reorder into the OHWI result.
// --- timing: one warm-up call, then REPEATS calls (at least 2; fewer than REPEATS once MAX_S seconds are spent)
static int g_repeats = getenv("REPEATS") ? std::max(1, atoi(getenv("REPEATS"))) : 5;
static double g_max_s = getenv("MAX_S") ? atof(getenv("MAX_S")) : 1.0;

struct Timing {
  double median = 0, best = 0, convert = 0;  // seconds; convert: the median of the calls' conversion reorders
};

template <class F>  // f(double* convert_seconds)
Timing time_calls(F f) {
  double c;
  f(&c);
  std::vector<double> t, conv;
  const double start = now();
  while ((int)t.size() < std::max(2, g_repeats) &&
         ((int)t.size() < 2 || ((int)t.size() < g_repeats && now() - start < g_max_s))) {
    double a = now();
    f(&c);
    t.push_back(now() - a);
    conv.push_back(c);
  }
  if (g_repeats == 1) t.resize(1), conv.resize(1);
  std::sort(t.begin(), t.end());
  std::sort(conv.begin(), conv.end());
  return {t[t.size() / 2], t[0], conv[conv.size() / 2]};
}

void network(const char* mode, int n, int H, int W, dt x_type, dt w_type, dt product, bool training) {
  const auto layers = resnet50(H, W);
  const char* pass_name[3] = {"fwd", "bwd_data", "bwd_weights"};
  double total[3] = {0, 0, 0}, best[3] = {0, 0, 0}, convert[3] = {0, 0, 0}, flops[3] = {0, 0, 0};
  double unneeded_data = 0;  // bwd_data of layer2.0's conv1 and downsample (not needed: their input is frozen)
  int refused = 0;
  double made = 0;
  printf("== %s: batch %d, %d x %d; x %s, w %s, products %s; %s; ms per call (median of calls; count in the sum)\n",
         mode, n, H, W, dtname(x_type), dtname(w_type), dtname(product),
         training ? "stem+layer1 fwd, layer2-4 fwd+bwd_data+bwd_weights" : "forward only");
  printf("   %-30s %3s %9s %9s %9s   %s\n", "conv", "n", "fwd", "bwd_data", "bwd_w", "impl fwd | bwd_data | bwd_weights");
  for (const auto& l : layers) {
    ConvShape s{n, l.h, l.w, l.c, l.o, l.k, l.k, l.stride, l.pad, 1, x_type, w_type, product};
    const bool backward = training && l.train;
    double t0 = now();
    ConvPlan plan = make_plan(s, backward);
    made += now() - t0;
    // the user's buffers, as MLX holds them: x, y, cotangent, grad x channels-last in x's dtype; w, grad w OHWI
    memory x(s.x_plain(x_type), eng), wu(s.w_plain(w_type), eng), y(s.y_plain(x_type), eng),
        g(s.y_plain(x_type), eng), gx(s.x_plain(x_type), eng), gw(s.w_plain(w_type), eng);
    fill(x), fill(wu), fill(g);
    const void* first = x.get_data_handle();
    const void* second = wu.get_data_handle();
    double ms[3] = {-1, -1, -1};
    std::string impl[3] = {plan.forward_pd.impl_info_str(), "-", "-"};
    bool ok[3] = {plan.forward_fast, plan.data_fast, plan.weights_fast};
    for (int pass = 0; pass < (backward ? 3 : 1); ++pass) {
      if (pass == 1) impl[1] = plan.data_pd.impl_info_str();
      if (pass == 2) impl[2] = plan.weights_pd.impl_info_str();
      if (!ok[pass]) {  // onednn.cpp refuses it: MLX's own path runs instead
        ++refused;
        impl[pass] = "REFUSED(" + impl[pass] + ")";
        continue;
      }
      Timing t;
      if (pass == 0) {
        t = time_calls([&](double* conv_s) {
          double a = now();
          auto& pd = plan.forward_pd;
          auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
          auto wei = as_wanted(s.w_plain(s.w_type), second, pd.weights_desc());
          *conv_s = now() - a;
          memory dst(pd.dst_desc(), eng, y.get_data_handle());
          plan.forward.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
          strm.wait();
        });
      } else if (pass == 1) {
        t = time_calls([&](double* conv_s) {
          double a = now();
          auto& pd = plan.data_pd;
          auto diff_dst = as_wanted(s.y_plain(s.x_type), g.get_data_handle(), pd.diff_dst_desc());
          auto wei = as_wanted(s.w_plain(s.w_type), second, pd.weights_desc());
          *conv_s = now() - a;
          memory diff_src(pd.diff_src_desc(), eng, gx.get_data_handle());
          plan.data.execute(strm, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DIFF_SRC, diff_src}});
          strm.wait();
        });
      } else {
        t = time_calls([&](double* conv_s) {
          double a = now();
          auto& pd = plan.weights_pd;
          auto src = as_wanted(s.x_plain(s.x_type), first, pd.src_desc());
          auto diff_dst = as_wanted(s.y_plain(s.x_type), g.get_data_handle(), pd.diff_dst_desc());
          *conv_s = now() - a;
          memory user(s.w_plain(s.w_type), eng, gw.get_data_handle());
          if (pd.diff_weights_desc() == user.get_desc()) {
            plan.weights.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, user}});
          } else {
            memory blocked(pd.diff_weights_desc(), eng);
            plan.weights.execute(strm,
                                 {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, blocked}});
            strm.wait();
            double b = now();
            reorder(blocked, user).execute(strm, blocked, user);
            strm.wait();
            *conv_s += now() - b;
          }
          strm.wait();
        });
      }
      ms[pass] = t.median * 1e3;
      total[pass] += t.median * l.count;
      best[pass] += t.best * l.count;
      convert[pass] += t.convert * l.count;
      flops[pass] += s.flops() * l.count;
      if (pass == 1 && !l.data_needed) unneeded_data += t.median * l.count;
    }
    auto cell = [](double v) {
      static char buf[4][32];
      static int i = 0;
      i = (i + 1) % 4;
      if (v < 0) snprintf(buf[i], 32, "%9s", "-");
      else snprintf(buf[i], 32, "%9.2f", v);
      return buf[i];
    };
    printf("   %-30s x%-2d %s %s %s   %s | %s | %s%s\n", l.name.c_str(), l.count, cell(ms[0]), cell(ms[1]), cell(ms[2]),
           impl[0].c_str(), impl[1].c_str(), impl[2].c_str(), backward && !l.data_needed ? "  (bwd_data not needed)" : "");
    fflush(stdout);
  }
  double all = 0, all_best = 0;
  for (int p = 0; p < (training ? 3 : 1); ++p) {
    all += total[p], all_best += best[p];
    printf("-- %s %-11s %8.1f ms (best %8.1f; of which reorders %6.1f ms) %6.1f GFLOP %5.0f GFLOP/s\n",
           mode, pass_name[p], total[p] * 1e3, best[p] * 1e3, convert[p] * 1e3, flops[p] / 1e9,
           total[p] > 0 ? flops[p] / total[p] / 1e9 : 0.0);
  }
  if (training)
    printf("-- %s bwd_data not needed (layer2.0 conv1 + downsample): %.1f ms; total needed %.1f ms\n", mode,
           unneeded_data * 1e3, (all - unneeded_data) * 1e3);
  printf("== %s TOTAL %.1f ms (best %.1f)  [primitive creation %.2f s, once; %d refused passes]\n\n", mode, all * 1e3,
         all_best * 1e3, made, refused);
  fflush(stdout);
}

}  // namespace ours

#ifdef BENCH_SHARED  // libbench.so for bench.py (ctypes): no C runtime start-up, so an older glibc will do
extern "C" int bench_main(int argc, char** argv) {
#else
int main(int argc, char** argv) {
#endif
  std::string what = argc > 1 ? argv[1] : "all";
  if (what == "version" || what == "train" || what == "infer") {
    const auto* v = dnnl::version();
    using I = dnnl::cpu_isa;
    const I e = dnnl::get_effective_cpu_isa();
    const char* isa = e == I::avx512_core_amx_fp16 ? "avx512_core_amx_fp16" : e == I::avx512_core_amx ? "avx512_core_amx"
                      : e == I::avx512_core_fp16 ? "avx512_core_fp16" : e == I::avx512_core_bf16 ? "avx512_core_bf16"
                      : e == I::avx512_core_vnni ? "avx512_core_vnni" : e == I::avx512_core ? "avx512_core"
                      : e == I::avx2_vnni_2 ? "avx2_vnni_2" : e == I::avx2_vnni ? "avx2_vnni" : e == I::avx2 ? "avx2" : "other";
    printf("oneDNN %d.%d.%d (%s), effective ISA %s, OMP_NUM_THREADS=%s, REPEATS=%d, MAX_S=%g\n", v->major, v->minor,
           v->patch, v->hash, isa, getenv("OMP_NUM_THREADS") ? getenv("OMP_NUM_THREADS") : "-",
           ours::g_repeats, ours::g_max_s);
    fflush(stdout);
  }
  if (what == "train" || what == "infer") {
    const bool training = what == "train";
    int n = training ? 2 : 1, h = training ? 512 : 800, w = training ? 683 : 1066;
    const char* size = getenv(training ? "SIZE" : "INFER_SIZE");
    if (size) sscanf(size, "%d,%d,%d", &n, &h, &w);
    std::vector<std::string> modes;
    for (int i = 2; i < argc; ++i) modes.push_back(argv[i]);
    if (modes.empty()) modes = training ? std::vector<std::string>{"f32", "bf16p", "bf16"} : std::vector<std::string>{"f32", "bf16p"};
    for (const auto& m : modes) {
      // f32: f32 operands and products; bf16p: f32 operands and results, bf16 products (products_in(bfloat16));
      // bf16: bf16 activations and weights (train.precision bfloat16: the weights' bf16 copies)
      dt x = m == "bf16" ? dt::bf16 : dt::f32, wt = x, p = m == "f32" ? dt::f32 : dt::bf16;
      if (m != "f32" && m != "bf16p" && m != "bf16") { fprintf(stderr, "unknown mode %s\n", m.c_str()); return 2; }
      ours::network((what + " " + m).c_str(), n, h, w, x, wt, p, training);
    }
    return 0;
  }
  if (what == "version") return 0;
  if (what == "wplain") {
    g_wplain = true;
    for (dt d : {dt::f32})
      for (int i : {2, 10, 14, 16}) for (int pass = 0; pass < 2; ++pass) {
        g_wplain = pass == 0;
        double wr; std::string impl; const auto& c = R50[i];
        double t = conv_fwd(c, d, true, &wr, &impl);
        printf("fwd %-24s nhwc w=%s %-4s %8.2f ms %7.0f GFLOP/s  %s\n", c.name, g_wplain ? "hwio" : "any ", dtname(d), t * 1e3, conv_flops(c) / t / 1e9, impl.c_str());
        fflush(stdout);
      }
  }
  if (what == "conv" || what == "all") {
    for (dt d : {dt::f32, dt::bf16}) {
      for (bool nhwc : {true, false}) {
        double total = 0, flops = 0;
        for (const auto& c : R50) {
          double wr;
          std::string impl;
          double t = conv_fwd(c, d, nhwc, &wr, &impl);
          bool backbone = std::string(c.name).rfind("proj", 0) != 0;
          if (backbone) {
            total += t * c.count;
            flops += conv_flops(c) * c.count;
          }
          printf("fwd %-24s x%d %s %-4s %8.2f ms %7.0f GFLOP/s  wreorder %6.2f ms  %s\n", c.name, c.count,
                 nhwc ? "nhwc" : "any ", dtname(d), t * 1e3, conv_flops(c) / t / 1e9, wr, impl.c_str());
          fflush(stdout);
        }
        printf("== backbone convs %s %s: %.1f ms, %.1f GFLOP, %.0f GFLOP/s\n", dtname(d), nhwc ? "nhwc" : "any",
               total * 1e3, flops / 1e9, flops / total / 1e9);
      }
    }
  }
  if (what == "bwd" || what == "all") {
    conv_bwd({"L3 3x3 256-256", 1, 256, 50, 67, 256, 3, 1}, true);
    conv_bwd({"L2 3x3 128-128", 1, 128, 100, 134, 128, 3, 1}, true);
    conv_bwd({"L3 1x1 1024-256", 1, 1024, 50, 67, 256, 1, 1}, true);
    conv_bwd({"L2 3x3 128 s2", 1, 128, 200, 267, 128, 3, 2}, true);
    conv_bwd({"L3 3x3 256-256", 1, 256, 50, 67, 256, 3, 1}, false);
  }
  if (what == "mm" || what == "all") {
    for (dt d : {dt::f32, dt::bf16}) {
      for (bool wany : {false, true}) {
        mm(17821, 256, 256, d, wany);
        mm(17821, 256, 1024, d, wany);
        mm(17821, 1024, 256, d, wany);
        mm(17821, 256, 384, d, wany);  // sampling offsets + attention weights (8*4*4*2 + 8*4*4)
      }
    }
  }
  return 0;
}
