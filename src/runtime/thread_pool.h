// Fixed pool of worker threads for the CPU backend.
//
// Work items must be independent. Determinism of results is the caller's job: callers split work
// into fixed chunks whose boundaries do not depend on the thread count, so any schedule produces
// the same bits.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace optfuse {

class ThreadPool {
 public:
  // `threads` counts the calling thread, so threads - 1 workers are started (now, once).
  // Throws optfuse::Error if threads < 1.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }

  // Calls fn on contiguous ranges that together cover [0, n) exactly once, and returns when all
  // are done. Ranges are handed out dynamically in blocks, so unequal item costs balance; the
  // calling thread works too. Runs inline (no wake-up) when size() == 1 or n <= 1, when called
  // from inside a parallel_for of this pool (nesting would otherwise deadlock), and in a child
  // process after fork() (the workers do not exist there). Calls from different threads are
  // serialised. If fn throws, no further ranges are started, and the first exception is rethrown
  // here once every thread has left fn.
  void parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn);

 private:
  struct Job;
  void worker_loop();
  static void run_job(Job& job);

  int size_;
  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  Job* job_ = nullptr;
  int tickets_ = 0;  // workers still invited to join job_
  int active_ = 0;   // workers that joined job_ and have not finished
  bool stop_ = false;
};

// $OPTFUSE_NUM_THREADS if set (a positive integer; anything else throws optfuse::Error), else the
// number of CPUs this process may run on (std::thread::hardware_concurrency(), lowered to the
// sched_getaffinity mask so a pinned or containerised process does not oversubscribe).
int default_thread_count();

// Created on first use with default_thread_count() threads and never destroyed (so it stays
// usable from static destructors).
ThreadPool& default_thread_pool();

}  // namespace optfuse
