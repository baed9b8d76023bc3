// WorkPool: a persistent thread pool for the CPU kernels' parallel loops that does not stall
// when another process holds a core (quant_linear.cpp). Header-only; each kernel
// library that includes it has its own pool (its own threads, created on first use).
//
//   pool_for(begin, end, grain, fn)   fn(i0, i1) over [begin, end) in chunks of >= grain,
//                                     on at most at::get_num_threads() threads (the caller one)

#pragma once

#include <ATen/Parallel.h>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// ------------------------------------------------------------------ the work pool
// Why not at::parallel_for: OpenMP splits the range statically and joins every thread, so on a
// machine whose cores other processes share, one worker waiting for a core holds the whole
// matmul (measured: demo decode at 2 threads fell to ~1 tok/s at load average 7-9, 27 tok/s
// at 1 thread). Here the caller and n - 1 workers take chunks from one atomic ticket and the
// caller waits only for chunks taken, not for workers to check in: a worker that does not get
// a core in time simply takes none. Workers spin kSpinUs after a job (decode's matmuls come
// tens of microseconds apart), then sleep on a condition variable.
class WorkPool {
 public:
  static WorkPool& get() {
    static WorkPool* pool = nullptr;
    static pid_t owner = 0;
    static std::mutex make;
    std::lock_guard<std::mutex> lock(make);
    if (pool == nullptr || owner != getpid()) {   // a forked child has none of the threads
      pool = new WorkPool();                      // (the parent's, if any, is left alone)
      owner = getpid();
    }
    return *pool;
  }

  // fn(chunk) for every chunk in [0, n), on up to `threads` threads (the caller one of them).
  void run(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (n <= 1 || threads <= 1 || !busy.owns_lock()) {   // nested / concurrent: inline
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    grow(threads - 1);
    // Closed first (a worker still holding the last job's ticket cannot take from this one
    // while n_ and fn_ change), then opened at chunk 0.
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store((gen << 32) | kClosed, std::memory_order_seq_cst);
    fn_.store(&fn, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      cv_.notify_all();
    }
    take(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) _mm_pause_or_nothing();
      else sched_yield();          // a worker holding a chunk may need this core
    }
  }

 private:
  static constexpr int64_t kSpinUs = 60;
  static constexpr uint64_t kClosed = 0xffffffffu;

  static inline void _mm_pause_or_nothing() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Chunks of job `gen` until none is left (or a newer job replaced it).
  void take(uint64_t gen) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != gen) return;
      if ((t & kClosed) == kClosed) continue;    // being opened
      const int64_t i = static_cast<int64_t>(t & kClosed);
      if (i >= n_.load(std::memory_order_relaxed)) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*fn_.load(std::memory_order_relaxed))(i);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers)
      threads_.emplace_back([this] { loop(); });
  }

  void loop() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      uint64_t gen = seen;
      for (int spins = 0;; ++spins) {
        gen = ticket_.load(std::memory_order_acquire) >> 32;
        if (gen != seen) break;
        _mm_pause_or_nothing();
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start >
                                        std::chrono::microseconds(kSpinUs)) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
          start = std::chrono::steady_clock::now();
        }
      }
      seen = gen;
      take(gen);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{0};     // (job generation << 32) | next chunk
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_{0};
};

// [begin, end) in chunks of `grain` (about 4 per thread at least), fn(c0, c1) on the pool.
template <typename F>
void pool_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int threads = at::get_num_threads();
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunk = std::max<int64_t>(grain, (n + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (n + chunk - 1) / chunk;
  const std::function<void(int64_t)> body = [&](int64_t c) {
    fn(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
  };
  WorkPool::get().run(chunks, threads, body);
}

}  // namespace
