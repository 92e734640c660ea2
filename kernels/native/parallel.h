// The one way the C++ operations use several cores: rows split into equal consecutive runs, one
// thread each (the calling thread takes the first), joined before returning.

#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace kernels_native {

// How many threads `work` units are worth: at most `threads`, at least one, each given at least
// `per_thread` units (a thread's start costs about what a small block of work does).
inline int threads_for(int64_t work, int threads, int64_t per_thread) {
  return int(std::max<int64_t>(1, std::min<int64_t>(threads, work / per_thread)));
}

// work(thread, begin, end) for the rows [begin, end) of each of `threads` runs.
template <typename Work>
void parallel_rows(int64_t rows, int threads, Work work) {
  threads = threads < 1 ? 1 : (threads > rows ? (rows > 0 ? int(rows) : 1) : threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back(work, t, rows * t / threads, rows * (t + 1) / threads);
  }
  work(0, 0, rows / threads);
  for (auto& thread : pool) {
    thread.join();
  }
}

}  // namespace kernels_native
