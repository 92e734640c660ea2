// The one way the C++ operations use several cores: rows split into equal consecutive runs, one
// thread each (the calling thread takes the first), joined before returning.

#pragma once

#include <cstdint>
#include <thread>
#include <vector>

namespace kernels_native {

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
