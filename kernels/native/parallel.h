// The one way the C++ operations use several cores: the work cut into runs, which the threads (the
// calling thread one of them) take one after another from a shared counter, joined before returning.
// Several runs a thread, not one equal share each: a core slowed by another process (a shared
// machine), or an efficiency core beside performance ones (Apple's chips), then takes fewer runs
// instead of holding the others up at the end. Which thread takes a run never changes a result:
// every run writes its own rows.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace kernels_native {

// How many threads `work` units are worth: at most `threads`, at least one, each given at least
// `per_thread` units (a thread's start costs about what a small block of work does).
inline int threads_for(int64_t work, int threads, int64_t per_thread) {
  return int(std::max<int64_t>(1, std::min<int64_t>(threads, work / per_thread)));
}

// Runs 0 .. count - 1, handed out in order, each once.
class Runs {
 public:
  explicit Runs(int64_t count) : count_(count) {}
  // the next run, or -1 when all are taken
  int64_t next() {
    const int64_t run = taken_.fetch_add(1, std::memory_order_relaxed);
    return run < count_ ? run : -1;
  }

 private:
  const int64_t count_;
  std::atomic<int64_t> taken_{0};
};

// work(thread, runs) once on each of `threads` threads (thread 0 the caller's), each taking runs from
// `runs` until none are left: for work that keeps something of its own across its runs.
template <typename Work>
void parallel_runs(int64_t count, int threads, Work work) {
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  Runs runs(count);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&work, &runs, t] { work(t, runs); });
  }
  work(0, runs);
  for (auto& thread : pool) {
    thread.join();
  }
}

// How many runs a thread takes on average: enough that the others make up for a slow core's
// last run, few enough that each run stays a long stretch of consecutive rows.
constexpr int RUNS_PER_THREAD = 4;

// work(thread, begin, end) for the rows [begin, end) of each run; rows cut into equal runs,
// RUNS_PER_THREAD a thread (one run a row at most).
template <typename Work>
void parallel_rows(int64_t rows, int threads, Work work) {
  threads = threads < 1 ? 1 : threads;
  const int64_t count = threads == 1 ? 1 : std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(threads) * RUNS_PER_THREAD));
  parallel_runs(count, threads, [&](int thread, Runs& runs) {
    for (int64_t run = runs.next(); run >= 0; run = runs.next()) {
      work(thread, rows * run / count, rows * (run + 1) / count);
    }
  });
}

}  // namespace kernels_native
