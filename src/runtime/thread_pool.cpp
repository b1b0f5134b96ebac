#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <string>

#include "optfuse/error.h"

namespace optfuse {
namespace {

// The pool whose parallel_for the current thread is executing, to run nested calls inline.
thread_local const ThreadPool* tls_current_pool = nullptr;

// After fork() the child has only the forking thread, so waking workers would hang forever.
std::atomic<bool> g_in_forked_child{false};

void register_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork(nullptr, nullptr, [] { g_in_forked_child.store(true); });
  });
}

class CurrentPoolScope {
 public:
  explicit CurrentPoolScope(const ThreadPool* p) : prev_(tls_current_pool) { tls_current_pool = p; }
  ~CurrentPoolScope() { tls_current_pool = prev_; }

 private:
  const ThreadPool* prev_;
};

}  // namespace

struct ThreadPool::Job {
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t n;
  int64_t block;
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;
};

ThreadPool::ThreadPool(int threads) : size_(threads) {
  if (threads < 1)
    throw Error("optfuse: ThreadPool needs at least 1 thread, got " + std::to_string(threads));
  register_fork_handler();
  workers_.reserve(static_cast<size_t>(threads - 1));
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) {
    // In a forked child the workers do not exist; joining would hang.
    if (g_in_forked_child.load()) {
      t.detach();
    } else {
      t.join();
    }
  }
}

void ThreadPool::run_job(Job& job) {
  for (;;) {
    int64_t begin = job.next.fetch_add(job.block, std::memory_order_relaxed);
    if (begin >= job.n) return;
    int64_t end = std::min(job.n, begin + job.block);
    try {
      (*job.fn)(begin, end);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(job.error_mu);
        if (!job.error) job.error = std::current_exception();
      }
      // Stop handing out ranges: the caller gets the exception, finishing the rest is wasted work.
      job.next.store(job.n, std::memory_order_relaxed);
      return;
    }
  }
}

void ThreadPool::worker_loop() {
  tls_current_pool = this;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [this] { return stop_ || tickets_ > 0; });
    if (stop_) return;
    --tickets_;
    ++active_;
    Job* job = job_;
    lk.unlock();
    run_job(*job);
    lk.lock();
    if (--active_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (size_ == 1 || n == 1 || tls_current_pool == this || g_in_forked_child.load()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  Job job;
  job.fn = &fn;
  job.n = n;
  // About 8 blocks per thread: enough to balance unequal items, few enough that the atomic
  // counter is not contended when items are tiny.
  job.block = std::max<int64_t>(1, n / (static_cast<int64_t>(size_) * 8));
  const int64_t blocks = (n + job.block - 1) / job.block;
  // Never wake more workers than there are blocks beyond the caller's first.
  const int invite = static_cast<int>(std::min<int64_t>(size_ - 1, blocks - 1));
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &job;
    tickets_ = invite;
  }
  if (invite == size_ - 1) {
    work_cv_.notify_all();
  } else {
    for (int i = 0; i < invite; ++i) work_cv_.notify_one();
  }
  {
    CurrentPoolScope scope(this);
    run_job(job);
  }
  {
    std::unique_lock<std::mutex> lk(mu_);
    // The caller only gets here once every range is handed out, so late workers have nothing to
    // do: withdraw their invitations instead of waiting for them to wake up.
    tickets_ = 0;
    done_cv_.wait(lk, [this] { return active_ == 0; });
    job_ = nullptr;
  }
  if (job.error) std::rethrow_exception(job.error);
}

int default_thread_count() {
  if (const char* v = std::getenv("OPTFUSE_NUM_THREADS"); v && *v) {
    char* end = nullptr;
    errno = 0;
    long t = std::strtol(v, &end, 10);
    if (errno != 0 || *end != '\0' || t < 1 || t > 4096)
      throw Error(std::string("optfuse: OPTFUSE_NUM_THREADS must be an integer in 1..4096, got '") +
                  v + "'");
    return static_cast<int>(t);
  }
  unsigned n = std::thread::hardware_concurrency();
  if (n == 0) n = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    int allowed = CPU_COUNT(&set);
    if (allowed > 0 && static_cast<unsigned>(allowed) < n) n = static_cast<unsigned>(allowed);
  }
  return static_cast<int>(n);
}

ThreadPool& default_thread_pool() {
  // Leaked on purpose: joining workers during static destruction races with other static
  // destructors that may still submit work.
  static ThreadPool* pool = new ThreadPool(default_thread_count());
  return *pool;
}

}  // namespace optfuse
