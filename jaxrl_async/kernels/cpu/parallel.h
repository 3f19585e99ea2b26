// The CPU kernels' one work-sharing loop: item(i) for i in [0, n), on the calling thread and XLA's intra-op thread
// pool. Items are handed out by an atomic counter and the caller works too, so the call never waits on a task that
// has not started; it returns once every item is done. A helper that starts after the return finds no item and
// touches only the counters, which it co-owns: `item` must capture by value.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxrl_cpu {

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F item) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, n, item]() {
    for (;;) {
      const int64_t i = progress->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) break;
      item(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxrl_cpu
