// A CPU stand-in for one GPU launch, shared by the Metal and CUDA shims.
//
// Every thread of the launch runs the kernel function. Threads are grouped as on the GPU: blocks
// (threadgroups) of `group` threads, warps (SIMD groups) of 32 consecutive threads in a block. The
// lanes of a warp run as cooperative fibers (ucontext) on one OS thread: a cross-lane operation
// (a sum, a shuffle) suspends the lane until every lane of its warp has arrived, so each sees all
// values, as in lockstep hardware. A lane that returns while others wait at a cross-lane operation,
// or lanes that disagree on the operation, are errors (the kernel would be wrong on a GPU too).
// One OS thread means atomics are plain read-modify-writes.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

using std::fabs;
using std::floor;
using std::fmod;

namespace shim {

constexpr int kWarp = 32;
enum Op { kNone, kSum, kXor };

struct Launch {
  long index = 0;  // the running lane's index in the grid
  long group = 1;   // threads per block / threadgroup
  long groups = 1;  // blocks in the grid
};

inline Launch current;
inline const char* error = nullptr;

struct Warp {
  ucontext_t scheduler;
  ucontext_t lanes[kWarp];
  std::vector<char> stacks = std::vector<char>(kWarp * (256 << 10));
  long first = 0;
  int size = 0;
  int lane = 0;
  bool finished[kWarp];
  Op op[kWarp];
  int arg[kWarp];
  float slot[kWarp];
  float snapshot[kWarp];
  const std::function<void(long)>* body = nullptr;
};

inline Warp warp;

inline void trampoline() {
  const int lane = warp.lane;
  (*warp.body)(warp.first + lane);
  warp.finished[lane] = true;
}

// Called by a lane: publish `value`, wait for the warp, return the operation's result.
inline float collective(Op op, float value, int arg) {
  const int lane = warp.lane;
  warp.op[lane] = op;
  warp.arg[lane] = arg;
  warp.slot[lane] = value;
  swapcontext(&warp.lanes[lane], &warp.scheduler);
  if (op == kSum) {
    float sum = 0.0f;
    for (int i = 0; i < warp.size; ++i) {
      sum += warp.snapshot[i];
    }
    return sum;
  }
  const int source = lane ^ arg;
  return source < warp.size ? warp.snapshot[source] : value;
}

inline bool run_warp(long first, int size, const std::function<void(long)>& body) {
  warp.first = first;
  warp.size = size;
  warp.body = &body;
  for (int i = 0; i < size; ++i) {
    getcontext(&warp.lanes[i]);
    warp.lanes[i].uc_stack.ss_sp = warp.stacks.data() + i * (256 << 10);
    warp.lanes[i].uc_stack.ss_size = 256 << 10;
    warp.lanes[i].uc_link = &warp.scheduler;
    makecontext(&warp.lanes[i], trampoline, 0);
    warp.finished[i] = false;
  }
  for (;;) {
    int finished = 0;
    for (int i = 0; i < size; ++i) {
      if (!warp.finished[i]) {
        warp.lane = i;
        warp.op[i] = kNone;
        current.index = first + i;
        swapcontext(&warp.scheduler, &warp.lanes[i]);
      }
      finished += warp.finished[i];
    }
    if (finished == size) {
      return true;
    }
    if (finished > 0) {
      error = "a lane returned while others of its warp wait at a cross-lane operation";
      return false;
    }
    for (int i = 1; i < size; ++i) {
      if (warp.op[i] != warp.op[0] || warp.arg[i] != warp.arg[0]) {
        error = "the lanes of a warp disagree on a cross-lane operation";
        return false;
      }
    }
    std::memcpy(warp.snapshot, warp.slot, sizeof warp.slot);
  }
}

// Run `body(thread)` for threads [0, threads) in blocks of `group`, warp by warp.
inline int launch(long threads, long group, const std::function<void(long)>& body) {
  error = nullptr;
  current.group = group;
  current.groups = (threads + group - 1) / group;
  for (long start = 0; start < threads; start += group) {
    const long end = start + group < threads ? start + group : threads;
    for (long first = start; first < end; first += kWarp) {
      const int size = int(end - first < kWarp ? end - first : kWarp);
      if (!run_warp(first, size, body)) {
        return 1;
      }
    }
  }
  return 0;
}

template <typename To, typename From>
inline To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between sizes");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// bfloat16 with round-to-nearest-even from float, as the GPUs convert.
struct bfloat16 {
  uint16_t bits;
  bfloat16() = default;
  bfloat16(float x) {
    uint32_t u = bit_cast<uint32_t>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const { return bit_cast<float>(uint32_t(bits) << 16); }
};

}  // namespace shim

extern "C" const char* shim_error() { return shim::error; }
