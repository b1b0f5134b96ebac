// The kernel cache loads only what this user compiled (issue 31). Each test has a fresh cache
// directory; planted entries (another owner, a group- or world-writable directory, a symlink,
// other contents, truncated, another kernel's entry under this key) are never loaded (a planted
// object's constructor would create a marker file) and the step's results equal the reference
// evaluator's. Cases that need another user run as `nobody` (fork + setuid) when the tests run as
// root, and skip otherwise. Also: four processes compile once, kill -9 mid-compile leaves nothing
// that disturbs the next run, read-only and full cache directories still work.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <set>
#include <cmath>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "runtime/disk_cache.h"
#include "runtime/host_compiler.h"
#include "testing/scoped_env.h"
#include "testing/tensor_set.h"

namespace optfuse {
namespace {

using host::compile_shared_object;
using host::SharedLibrary;
using testing::HostTensorSet;
using testing::ScopedEnv;

constexpr uid_t kNobody = 65534;
const char* kSpec = "adamw(lr=0.1, weight_decay=0.1)";
const char* kOtherSpec = "sgd(lr=0.1, momentum=0.9)";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& bytes, mode_t mode = 0644) {
  ::unlink(path.c_str());
  std::ofstream(path, std::ios::binary) << bytes;
  ::chmod(path.c_str(), mode);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> list(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " ";
  return s;
}

// Runs `fn` in a forked child (as `uid` unless -1) and returns what it reported: "" on success.
std::string in_child(const std::function<std::string()>& fn, uid_t uid = static_cast<uid_t>(-1)) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string err;
    if (uid != static_cast<uid_t>(-1) && (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0))
      err = "setuid failed";
    if (err.empty()) {
      try {
        err = fn();
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
    }
    if (!err.empty()) {
      ssize_t n = ::write(fds[1], err.data(), err.size());
      (void)n;
    }
    ::_exit(err.empty() ? 0 : 1);
  }
  ::close(fds[1]);
  std::string out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status)) return "child died: status " + std::to_string(status) + " " + out;
  if (WEXITSTATUS(status) != 0 && out.empty()) return "child failed";
  return out;
}

// Three steps of kSpec on the CPU backend and the reference; returns (status, max difference
// relative to the scale of each role).
std::pair<std::string, double> step_vs_reference(const char* spec = kSpec) {
  Chain chain = parse_chain(spec);
  Optimizer ref(chain, Backend::reference), cpu(chain, Backend::cpu);
  const std::vector<testing::TensorSpec> sizes = {{1000, 0}, {37, 0}};
  HostTensorSet rs(ref.plan(), sizes, DType::f32, 3), cs(cpu.plan(), sizes, DType::f32, 3);
  ref.set_tensors(rs.refs());
  cpu.set_tensors(cs.refs());
  for (int s = 1; s <= 3; ++s) {
    rs.randomize_grads(100 + s);
    cs.randomize_grads(100 + s);
    ref.step();
    cpu.step();
  }
  double worst = 0;
  for (size_t r = 0; r < rs.num_roles(); ++r) {
    double scale = 1e-30, diff = 0;
    for (size_t t = 0; t < rs.size(); ++t)
      for (int64_t i = 0; i < rs.specs()[t].numel; ++i) {
        scale = std::max(scale, std::fabs(rs.value(t, r, i)));
        double d = std::fabs(cs.value(t, r, i) - rs.value(t, r, i));
        diff = std::max(diff, std::isnan(d) ? INFINITY : d);
      }
    worst = std::max(worst, diff / scale);
  }
  return {cpu.backend_status(), worst};
}

class DiskCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!host::find_compiler(&why)) GTEST_SKIP() << "no host compiler: " << why;
    char templ[] = "/tmp/optfuse-cache-test-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    base_ = templ;
    ::chmod(base_.c_str(), 0755);  // `nobody` must reach the files below
    cache_ = base_ + "/cache";
    tmp_ = base_ + "/tmp";
    ASSERT_EQ(::mkdir(tmp_.c_str(), 01777), 0);
    ::chmod(tmp_.c_str(), 01777);
    env_.emplace_back(std::make_unique<ScopedEnv>("OPTFUSE_CACHE_DIR", cache_.c_str()));
    env_.emplace_back(std::make_unique<ScopedEnv>("OPTFUSE_NO_CACHE", nullptr));
    env_.emplace_back(std::make_unique<ScopedEnv>("TMPDIR", tmp_.c_str()));
    host::forget_verified_kernels();
  }
  void TearDown() override {
    env_.clear();
    host::forget_verified_kernels();
    if (!base_.empty()) remove_tree(base_);
  }

  // Fills the cache with kSpec's kernel and returns the entry's path.
  std::string make_entry(const char* spec = kSpec) {
    auto [status, diff] = step_vs_reference(spec);
    EXPECT_NE(status.find("compiled now"), std::string::npos) << status;
    host::forget_verified_kernels();
    std::vector<std::string> names = list(cache_ + "/cpu");
    std::string entry;
    for (const auto& n : names)  // the entry this run added
      if (n.size() > 3 && n.compare(n.size() - 3, 3, ".so") == 0 && seen_.insert(n).second) entry = cache_ + "/cpu/" + n;
    EXPECT_FALSE(entry.empty()) << joined(names);
    return entry;
  }

  // A shared object whose constructor creates marker_, i.e. that shows whether it was loaded.
  std::string planted_binary() {
    ScopedEnv no_cache("OPTFUSE_NO_CACHE", "1");
    const std::string src = "#include <fcntl.h>\n#include <unistd.h>\n"
                            "__attribute__((constructor)) static void planted() { int fd = ::open(\"" + marker_() +
                            "\", O_CREAT | O_WRONLY, 0666); if (fd >= 0) ::close(fd); }\n"
                            "extern \"C\" int of_phase0() { return 0; }\n";
    return read_file(compile_shared_object(src).so_path);
  }
  std::string marker_() const { return base_ + "/planted-code-ran"; }

  // A second run: the kernel is looked up again, the planted entry refused, the results right.
  void expect_refused_and_correct() {
    auto [status, diff] = step_vs_reference();
    EXPECT_NE(status.find("compiled now"), std::string::npos) << status;
    EXPECT_LE(diff, 1e-5);
    EXPECT_FALSE(exists(marker_())) << "planted code was loaded";
  }

  std::string base_, cache_, tmp_;
  std::set<std::string> seen_;
  std::vector<std::unique_ptr<ScopedEnv>> env_;
};

TEST_F(DiskCacheTest, WarmCacheIsUsedAndVerifies) {
  std::string entry = make_entry();
  auto [status, diff] = step_vs_reference();
  EXPECT_NE(status.find("cached"), std::string::npos) << status;
  EXPECT_LE(diff, 1e-5);
  CacheReport r = inspect_cache(true);
  ASSERT_EQ(r.kinds[0].name, "cpu");
  EXPECT_EQ(r.kinds[0].entries, 1);
  EXPECT_TRUE(r.kinds[0].bad.empty());
  struct stat st;
  ASSERT_EQ(::stat(cache_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "a created cache directory is private";
}

TEST_F(DiskCacheTest, OtherContentsAreNotLoaded) {
  std::string entry = make_entry();
  write_file(entry, planted_binary());  // a valid shared object, without the recorded checksum
  EXPECT_EQ(inspect_cache(true).kinds[0].bad.size(), 1u);
  expect_refused_and_correct();
  EXPECT_TRUE(inspect_cache(true).kinds[0].bad.empty()) << "the bad entry was replaced";
}

TEST_F(DiskCacheTest, FlippedBitIsNotLoaded) {
  std::string entry = make_entry();
  std::string bytes = read_file(entry);
  bytes[bytes.size() / 2] ^= 0x10;  // in .text or data: the checksum must catch any bit
  write_file(entry, bytes);
  expect_refused_and_correct();
}

TEST_F(DiskCacheTest, TruncatedEntryIsRebuilt) {
  const std::string entry = make_entry();
  const std::string good = read_file(entry);
  for (size_t keep : {size_t(0), size_t(10), size_t(4096), good.size() - 1}) {
    SCOPED_TRACE(keep);
    write_file(entry, good.substr(0, keep));  // SIGBUS if mapped and used
    expect_refused_and_correct();
    host::forget_verified_kernels();
  }
}

TEST_F(DiskCacheTest, AnotherKernelsEntryUnderThisKeyIsNotLoaded) {
  std::string entry = make_entry();
  std::string other = make_entry(kOtherSpec);  // SGD's complete entry, checksum and all
  ASSERT_NE(entry, other);
  write_file(entry, read_file(other));
  expect_refused_and_correct();
}

TEST_F(DiskCacheTest, SymlinkIsNotFollowed) {
  std::string entry = make_entry();
  const std::string copy = base_ + "/elsewhere.so";
  write_file(copy, read_file(entry));  // a perfect entry: only the symlink itself is wrong
  ::unlink(entry.c_str());
  ASSERT_EQ(::symlink(copy.c_str(), entry.c_str()), 0);
  expect_refused_and_correct();
  struct stat st;
  ASSERT_EQ(::lstat(entry.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the symlink was replaced by a rebuilt entry";
  host::forget_verified_kernels();
  ::unlink(entry.c_str());
  ASSERT_EQ(::symlink("/etc/passwd", entry.c_str()), 0);
  expect_refused_and_correct();
}

TEST_F(DiskCacheTest, GroupWritableEntryIsNotLoaded) {
  std::string entry = make_entry();
  ASSERT_EQ(::chmod(entry.c_str(), 0664), 0);
  expect_refused_and_correct();
}

TEST_F(DiskCacheTest, WorldWritableDirectoryIsNotUsed) {
  std::string entry = make_entry();
  const std::string good = read_file(entry);
  write_file(entry, planted_binary());
  ASSERT_EQ(::chmod((cache_ + "/cpu").c_str(), 0777), 0);
  expect_refused_and_correct();
  EXPECT_NE(read_file(entry), good) << "a refused directory is not written to";
  EXPECT_TRUE(list(tmp_).empty()) << joined(list(tmp_));  // the private temporary directory is gone
  ASSERT_EQ(::chmod((cache_ + "/cpu").c_str(), 0700), 0);
  ASSERT_EQ(::chmod(cache_.c_str(), 0770), 0);  // group-writable root
  host::forget_verified_kernels();
  expect_refused_and_correct();
}

// The process keeps the cache directory it checked open (disk_cache.cpp): one removed and made
// again under the same path while the process runs is the one used from then on.
TEST_F(DiskCacheTest, CacheDirectoryRemovedWhileRunningIsCreatedAgain) {
  make_entry();
  remove_tree(cache_);
  seen_.clear();
  const std::string entry = make_entry();  // compiled again: the entry is gone with the directory
  EXPECT_EQ(entry.rfind(cache_ + "/cpu/", 0), 0u) << entry;
  EXPECT_TRUE(exists(entry));
  auto [status, diff] = step_vs_reference();
  EXPECT_NE(status.find("cached"), std::string::npos) << status;
  EXPECT_LE(diff, 1e-5);
}

TEST_F(DiskCacheTest, EntryOwnedByAnotherUserIsNotLoaded) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  std::string entry = make_entry();  // a perfect entry, only its owner is wrong
  ASSERT_EQ(::chown(entry.c_str(), kNobody, kNobody), 0);
  expect_refused_and_correct();
  struct stat st;
  ASSERT_EQ(::stat(entry.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, ::geteuid()) << "rebuilt by this user";
}

TEST_F(DiskCacheTest, DirectoryOwnedByAnotherUserIsNotUsed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another user";
  make_entry();
  ASSERT_EQ(::chown(cache_.c_str(), kNobody, kNobody), 0);
  expect_refused_and_correct();
}

// The attack: no HOME, another user creates the per-user fallback directory first and
// plants a complete, well-formed entry (made with optfuse's own store) for the victim's kernel.
TEST_F(DiskCacheTest, NoHomeFallbackPlantedByNobodyIsNotUsedByRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: the attacker runs as nobody (fork + setuid)";
  const std::string entry = make_entry();
  const std::string name = entry.substr(entry.rfind('/') + 1);
  const std::string key = name.substr(0, name.size() - 3);
  const std::string planted = planted_binary();
  ScopedEnv home("HOME", nullptr), xdg("XDG_CACHE_HOME", nullptr), dir("OPTFUSE_CACHE_DIR", nullptr);
  const std::string fallback = tmp_ + "/optfuse-cache-0";
  ASSERT_EQ(cache_root(), fallback);
  std::string err = in_child(
      [&]() -> std::string {
        ScopedEnv attacker_dir("OPTFUSE_CACHE_DIR", fallback.c_str());
        if (::mkdir(fallback.c_str(), 0755) != 0) return "mkdir failed";
        DiskCache c("cpu");
        if (!c.usable()) return "attacker's cache unusable: " + c.refused_because();
        return c.store(key, ".so", planted) ? "" : "store failed";
      },
      kNobody);
  ASSERT_EQ(err, "");
  ASSERT_TRUE(exists(fallback + "/cpu/" + name));
  expect_refused_and_correct();
  EXPECT_EQ(read_file(fallback + "/cpu/" + name).substr(0, planted.size()), planted) << "left alone";
}

// The other way round: root pre-created nobody's fallback directory; nobody compiles privately.
TEST_F(DiskCacheTest, NoHomeFallbackOwnedByRootIsNotUsedByNobody) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run as nobody (fork + setuid)";
  ScopedEnv home("HOME", nullptr), xdg("XDG_CACHE_HOME", nullptr), dir("OPTFUSE_CACHE_DIR", nullptr);
  const std::string fallback = tmp_ + "/optfuse-cache-" + std::to_string(kNobody);
  ASSERT_EQ(::mkdir(fallback.c_str(), 0755), 0);
  std::string err = in_child(
      [&]() -> std::string {
        if (cache_root() != fallback) return "fallback is " + cache_root();
        auto r = compile_shared_object("extern \"C\" int add(int a, int b) { return a + b; }\n");
        if (!r.cache_path.empty()) return "stored in " + r.cache_path;
        SharedLibrary lib(r.so_path);
        if (reinterpret_cast<int (*)(int, int)>(lib.symbol("add"))(2, 3) != 5) return "wrong result";
        for (const auto& n : list(tmp_))
          if (n.rfind("optfuse-cc-", 0) == 0) return "left behind: " + n;
        return "";
      },
      kNobody);
  EXPECT_EQ(err, "");
  EXPECT_TRUE(list(fallback).empty()) << joined(list(fallback));
}

// A compiler wrapper: counts compiles in base_/compiles; with base_/hang present it records its
// pid and sleeps instead (a compile to kill).
std::string write_wrapper(const std::string& base) {
  const std::string path = base + "/cc-wrapper.sh";
  write_file(path,
             "#!/bin/sh\ncase \" $* \" in *\" --version \"*) ;; *)\n"
             "  if [ -e " + base + "/hang ]; then echo $$ > " + base + "/hung.tmp; mv " + base + "/hung.tmp " + base +
                 "/hung; exec sleep 60; fi\n"
             "  echo $$ >> " + base + "/compiles;;\nesac\nexec " + host::find_compiler(nullptr)->path + " \"$@\"\n",
             0755);
  return path;
}

int count_lines(const std::string& path) {
  std::string s = read_file(path);
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

TEST_F(DiskCacheTest, FourProcessesCompileOnce) {
  ScopedEnv cxx("OPTFUSE_CXX", write_wrapper(base_).c_str());
  ASSERT_TRUE(host::find_compiler(nullptr));  // memoised before the fork
  const std::string src = "extern \"C\" int times7(int x) { return 7 * x; }\n";
  int gate[2];
  ASSERT_EQ(::pipe(gate), 0);
  std::vector<pid_t> kids;
  for (int i = 0; i < 4; ++i) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(gate[1]);
      char c;
      while (::read(gate[0], &c, 1) > 0) {
      }  // all four start when the parent closes the gate
      try {
        SharedLibrary lib(compile_shared_object(src).so_path);
        ::_exit(reinterpret_cast<int (*)(int)>(lib.symbol("times7"))(6) == 42 ? 0 : 1);
      } catch (...) {
        ::_exit(2);
      }
    }
    kids.push_back(pid);
  }
  ::close(gate[0]);
  ::close(gate[1]);
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  EXPECT_EQ(count_lines(base_ + "/compiles"), 1);
  EXPECT_EQ(inspect_cache(true).kinds[0].entries, 1);
}

TEST_F(DiskCacheTest, KillDuringCompileLeavesNothingBehind) {
  ScopedEnv cxx("OPTFUSE_CXX", write_wrapper(base_).c_str());
  ASSERT_TRUE(host::find_compiler(nullptr));
  const std::string src = "extern \"C\" int plus1(int x) { return x + 1; }\n";
  write_file(base_ + "/hang", "");
  pid_t pid = ::fork();
  if (pid == 0) {
    try {
      compile_shared_object(src);
    } catch (...) {
    }
    ::_exit(0);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!exists(base_ + "/hung") && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(exists(base_ + "/hung"));
  const pid_t compiler = std::stoi(read_file(base_ + "/hung"));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  // The compiler dies with it (PR_SET_PDEATHSIG): gone, or a zombie waiting for init.
  bool compiler_gone = false;
  for (int i = 0; i < 250 && !compiler_gone; ++i) {
    std::string stat = read_file("/proc/" + std::to_string(compiler) + "/stat");
    size_t paren = stat.rfind(')');
    compiler_gone = stat.empty() || (paren != std::string::npos && stat.substr(paren + 2, 1) == "Z");
    if (!compiler_gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(compiler_gone) << "the compiler of a killed process still runs";
  bool had_work_dir = false;
  for (const auto& n : list(cache_ + "/cpu")) had_work_dir = had_work_dir || n.rfind("tmp-", 0) == 0;
  EXPECT_TRUE(had_work_dir) << "expected the killed compile's work directory: " << joined(list(cache_ + "/cpu"));
  ::unlink((base_ + "/hang").c_str());
  // A new process compiles the same key at once (the dead one's lock is no obstacle) and cleans up.
  std::string err = in_child([&]() -> std::string {
    auto t0 = std::chrono::steady_clock::now();
    auto r = compile_shared_object(src);
    if (r.from_cache) return "unexpected cache hit";
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) return "waited for a dead lock";
    SharedLibrary lib(r.so_path);
    return reinterpret_cast<int (*)(int)>(lib.symbol("plus1"))(41) == 42 ? "" : "wrong result";
  });
  EXPECT_EQ(err, "");
  std::vector<std::string> left = list(cache_ + "/cpu");
  ASSERT_EQ(left.size(), 1u) << joined(left);
  EXPECT_NE(left[0].find(".so"), std::string::npos);
  EXPECT_TRUE(list(tmp_).empty()) << joined(list(tmp_));
}

TEST_F(DiskCacheTest, LockHeldByAStuckProcessTimesOut) {
  std::string entry = make_entry();
  ::unlink(entry.c_str());
  const std::string lock_path = entry.substr(0, entry.size() - 3) + ".lock";
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // its own open file: conflicts with the compile's lock
  ScopedEnv timeout("OPTFUSE_CACHE_LOCK_TIMEOUT", "1");
  auto t0 = std::chrono::steady_clock::now();
  auto [status, diff] = step_vs_reference();
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(status.find("compiled now"), std::string::npos) << status;
  EXPECT_LE(diff, 1e-5);
  EXPECT_GE(waited, 1.0);
  ::close(fd);
}

TEST_F(DiskCacheTest, CompilerFailureAndNoCacheLeaveNoTemporaryFiles) {
  EXPECT_THROW(compile_shared_object("this is not C++;\n"), Error);
  EXPECT_TRUE(list(cache_ + "/cpu").empty()) << joined(list(cache_ + "/cpu"));
  ScopedEnv no_cache("OPTFUSE_NO_CACHE", "1");
  auto r = compile_shared_object("extern \"C\" int one() { return 1; }\n");
  EXPECT_TRUE(list(tmp_).empty()) << "the private directory outlived the compile: " << joined(list(tmp_));
  SharedLibrary lib(r.so_path);  // loadable all the same: the descriptor keeps the file
  EXPECT_EQ(reinterpret_cast<int (*)()>(lib.symbol("one"))(), 1);
  EXPECT_THROW(compile_shared_object("this is not C++ either;\n"), Error);
  EXPECT_TRUE(list(tmp_).empty()) << joined(list(tmp_));
}

// Root ignores permission bits, so as root a read-only bind mount (in a private mount namespace
// of a child) makes the directory read-only; other users chmod it.
std::string make_read_only(const std::string& dir) {
  if (::geteuid() != 0) return ::chmod(dir.c_str(), 0500) == 0 ? "" : "chmod failed";
  if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
      ::mount(dir.c_str(), dir.c_str(), nullptr, MS_BIND, nullptr) != 0 ||
      ::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) != 0)
    return "skip: cannot make a read-only mount (" + std::string(std::strerror(errno)) + ")";
  return "";
}

TEST_F(DiskCacheTest, ReadOnlyCacheDirectoryStillWorks) {
  ASSERT_EQ(::mkdir(cache_.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((cache_ + "/cpu").c_str(), 0700), 0);
  std::string err = in_child([&]() -> std::string {
    std::string why = make_read_only(cache_ + "/cpu");
    if (!why.empty()) return why;
    auto [status, diff] = step_vs_reference();
    if (status.find("compiled now") == std::string::npos) return "status: " + status;
    if (!(diff <= 1e-5)) return "results differ: " + std::to_string(diff);
    return "";
  });
  if (err.rfind("skip:", 0) == 0) GTEST_SKIP() << err;
  EXPECT_EQ(err, "");
  ::chmod((cache_ + "/cpu").c_str(), 0700);
  EXPECT_TRUE(list(cache_ + "/cpu").empty()) << joined(list(cache_ + "/cpu"));
  EXPECT_TRUE(list(tmp_).empty()) << joined(list(tmp_));
}

TEST_F(DiskCacheTest, FullCacheDirectoryStillWorks) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for a small tmpfs (a full file system) in a mount namespace";
  ASSERT_EQ(::mkdir(cache_.c_str(), 0700), 0);
  std::string err = in_child([&]() -> std::string {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", cache_.c_str(), "tmpfs", 0, "size=64k,mode=0700") != 0)
      return "skip: cannot mount a tmpfs (" + std::string(std::strerror(errno)) + ")";
    if (::mkdir((cache_ + "/cpu").c_str(), 0700) != 0) return "mkdir failed";
    int fd = ::open((cache_ + "/cpu/filler").c_str(), O_WRONLY | O_CREAT, 0600);
    std::string block(4096, 'x');
    while (::write(fd, block.data(), block.size()) > 0) {
    }
    ::close(fd);
    auto [status, diff] = step_vs_reference();
    if (status.find("compiled now") == std::string::npos) return "status: " + status;
    if (!(diff <= 1e-5)) return "results differ: " + std::to_string(diff);
    std::vector<std::string> left = list(cache_ + "/cpu");
    if (left.size() != 1) return "left in the full cache: " + joined(left);
    return "";
  });
  if (err.rfind("skip:", 0) == 0) GTEST_SKIP() << err;
  EXPECT_EQ(err, "");
  EXPECT_TRUE(list(tmp_).empty()) << joined(list(tmp_));
}

}  // namespace
}  // namespace optfuse
