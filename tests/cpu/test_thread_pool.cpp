#include "runtime/thread_pool.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "optfuse/error.h"

namespace optfuse {
namespace {

// Runs parallel_for and checks every index in [0, n) was visited exactly once, by ranges that
// are non-empty and in bounds.
void expect_exact_cover(ThreadPool& pool, int64_t n) {
  std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[n > 0 ? n : 1]);
  for (int64_t i = 0; i < n; ++i) hits[i] = 0;
  std::atomic<int> bad_ranges{0};
  pool.parallel_for(n, [&](int64_t begin, int64_t end) {
    if (begin < 0 || end > n || begin >= end) bad_ranges.fetch_add(1);
    for (int64_t i = begin; i < end && i < n; ++i) hits[i].fetch_add(1);
  });
  EXPECT_EQ(bad_ranges.load(), 0) << "n=" << n << " threads=" << pool.size();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += hits[i].load() != 1;
  EXPECT_EQ(wrong, 0) << "n=" << n << " threads=" << pool.size();
}

class ThreadPoolSizes : public ::testing::TestWithParam<int> {};

TEST_P(ThreadPoolSizes, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(GetParam());
  EXPECT_EQ(pool.size(), GetParam());
  for (int64_t n : {0, 1, 7, 100000}) expect_exact_cover(pool, n);
  // Reuse: the same pool must serve many jobs back to back.
  for (int rep = 0; rep < 200; ++rep) expect_exact_cover(pool, rep % 13);
}

TEST_P(ThreadPoolSizes, ExceptionPropagatesAndPoolStaysUsable) {
  ThreadPool pool(GetParam());
  EXPECT_THROW(pool.parallel_for(1000,
                                 [](int64_t begin, int64_t end) {
                                   if (begin <= 500 && 500 < end) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  EXPECT_THROW(pool.parallel_for(1, [](int64_t, int64_t) { throw Error("inline"); }), Error);
  expect_exact_cover(pool, 100000);
}

INSTANTIATE_TEST_SUITE_P(Threads, ThreadPoolSizes, ::testing::Values(1, 2, 5));

TEST(ThreadPool, SmallNRunsInlineOnCaller) {
  ThreadPool pool(4);
  std::thread::id seen;
  pool.parallel_for(1, [&](int64_t b, int64_t e) {
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 1);
    seen = std::this_thread::get_id();
  });
  EXPECT_EQ(seen, std::this_thread::get_id());
}

TEST(ThreadPool, SingleThreadRunsWholeRangeInline) {
  ThreadPool pool(1);
  int calls = 0;
  pool.parallel_for(1000, [&](int64_t b, int64_t e) {
    ++calls;
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 1000);
  });
  EXPECT_EQ(calls, 1);
}

TEST(ThreadPool, UsesSeveralThreadsForUnequalItems) {
  ThreadPool pool(4);
  std::mutex mu;
  std::vector<std::thread::id> ids;
  // One slow item first: dynamic scheduling must let other threads take the rest.
  pool.parallel_for(64, [&](int64_t b, int64_t e) {
    if (b == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (int64_t i = b; i < e; ++i) std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::lock_guard<std::mutex> lk(mu);
    ids.push_back(std::this_thread::get_id());
  });
  std::sort(ids.begin(), ids.end());
  EXPECT_GT(std::unique(ids.begin(), ids.end()) - ids.begin(), 1);
}

TEST(ThreadPool, NestedCallRunsInlineWithoutDeadlock) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  pool.parallel_for(10, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(100, [&](int64_t ib, int64_t ie) { total += ie - ib; });
  });
  EXPECT_EQ(total.load(), 1000);
}

TEST(ThreadPool, ConcurrentCallersAreSerialisedCorrectly) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) expect_exact_cover(pool, 1000 + rep);
    });
  for (auto& t : callers) t.join();
}

TEST(ThreadPool, RejectsNonPositiveSize) {
  EXPECT_THROW(ThreadPool(0), Error);
  EXPECT_THROW(ThreadPool(-3), Error);
}

TEST(ThreadPool, ForkedChildRunsInline) {
  ThreadPool pool(3);
  expect_exact_cover(pool, 100);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int64_t sum = 0;
    pool.parallel_for(1000, [&](int64_t b, int64_t e) { sum += e - b; });
    ::_exit(sum == 1000 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(DefaultThreadPool, CountFromEnv) {
  const char* old = std::getenv("OPTFUSE_NUM_THREADS");
  std::string saved = old ? old : "";
  ::setenv("OPTFUSE_NUM_THREADS", "3", 1);
  EXPECT_EQ(default_thread_count(), 3);
  ::setenv("OPTFUSE_NUM_THREADS", "zero", 1);
  EXPECT_THROW(default_thread_count(), Error);
  ::setenv("OPTFUSE_NUM_THREADS", "0", 1);
  EXPECT_THROW(default_thread_count(), Error);
  ::unsetenv("OPTFUSE_NUM_THREADS");
  EXPECT_GE(default_thread_count(), 1);
  if (old) ::setenv("OPTFUSE_NUM_THREADS", saved.c_str(), 1);
}

TEST(DefaultThreadPool, IsASingleUsablePool) {
  ThreadPool& a = default_thread_pool();
  EXPECT_EQ(&a, &default_thread_pool());
  EXPECT_GE(a.size(), 1);
  expect_exact_cover(a, 12345);
}

}  // namespace
}  // namespace optfuse
