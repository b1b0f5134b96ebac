#include "runtime/host_compiler.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "testing/scoped_env.h"
#include "optfuse/error.h"

namespace optfuse::host {
namespace {

const char* kAddSource = R"(extern "C" int add(int a, int b) { return a + b; }
)";

using testing::ScopedEnv;

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") remove_tree(path + "/" + n);
      }
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

// Each test gets a fresh cache dir, so hits and misses are predictable.
class HostCompilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!find_compiler(&why)) GTEST_SKIP() << "no host compiler: " << why;
    char templ[] = "/tmp/optfuse-test-cache-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    dir_ = templ;
    cache_env_.emplace("OPTFUSE_CACHE_DIR", dir_.c_str());
    no_cache_env_.emplace("OPTFUSE_NO_CACHE", nullptr);
  }
  void TearDown() override {
    no_cache_env_.reset();
    cache_env_.reset();
    if (!dir_.empty()) remove_tree(dir_);
  }

  std::string dir_;
  std::optional<ScopedEnv> cache_env_, no_cache_env_;
};

TEST_F(HostCompilerTest, FindsCompilerWithIdentity) {
  std::string why;
  auto c = find_compiler(&why);
  ASSERT_TRUE(c.has_value()) << why;
  EXPECT_EQ(c->path.front(), '/');
  EXPECT_FALSE(c->identity.empty());
  EXPECT_EQ(c->identity.find('\n'), std::string::npos);
}

TEST_F(HostCompilerTest, CompilesLoadsAndCallsAdd) {
  CompileResult r = compile_shared_object(kAddSource);
  EXPECT_FALSE(r.from_cache);
  EXPECT_EQ(r.cache_path.rfind(dir_ + "/cpu/", 0), 0u) << r.cache_path;
  EXPECT_GE(r.seconds, 0.0);
  SharedLibrary lib(r.so_path);
  auto add = reinterpret_cast<int (*)(int, int)>(lib.symbol("add"));
  EXPECT_EQ(add(2, 3), 5);
  EXPECT_EQ(add(-7, 4), -3);
}

TEST_F(HostCompilerTest, SecondCompileIsCacheHit) {
  CompileResult first = compile_shared_object(kAddSource);
  CompileResult second = compile_shared_object(kAddSource);
  EXPECT_FALSE(first.from_cache);
  EXPECT_TRUE(second.from_cache);
  EXPECT_EQ(first.so_path, second.so_path);
  SharedLibrary lib(second.so_path);
  EXPECT_EQ(reinterpret_cast<int (*)(int, int)>(lib.symbol("add"))(20, 22), 42);
}

TEST_F(HostCompilerTest, FlagsAndSourceArePartOfTheKey) {
  CompileResult a = compile_shared_object(kAddSource);
  CompileResult b = compile_shared_object(kAddSource, {"-DOPTFUSE_TEST_FLAG=1"});
  CompileResult c = compile_shared_object(std::string(kAddSource) + "// different\n");
  EXPECT_FALSE(b.from_cache);
  EXPECT_FALSE(c.from_cache);
  EXPECT_NE(a.cache_path, b.cache_path);  // (a.so_path may equal c.so_path: the same bytes)
  EXPECT_NE(a.cache_path, c.cache_path);
}

// default_compile_flags() asks the linker for -z noseparate-code, which gold does not know: a
// compile linked by gold goes on without it, the first time and from then on.
TEST_F(HostCompilerTest, LinkerWithoutTheLayoutFlagStillLinks) {
  struct stat st;
  if (::stat("/usr/bin/ld.gold", &st) != 0) GTEST_SKIP() << "no /usr/bin/ld.gold to link with";
  for (const char* extra : {"", "// again\n"}) {
    CompileResult r = compile_shared_object(std::string(kAddSource) + extra, {"-fuse-ld=gold"});
    EXPECT_FALSE(r.from_cache);
    SharedLibrary lib(r.so_path);
    EXPECT_EQ(reinterpret_cast<int (*)(int, int)>(lib.symbol("add"))(2, 3), 5);
  }
  EXPECT_TRUE(compile_shared_object(kAddSource, {"-fuse-ld=gold"}).from_cache);
}

TEST_F(HostCompilerTest, NoCacheEnvBypassesCache) {
  ScopedEnv no_cache("OPTFUSE_NO_CACHE", "1");
  CompileResult a = compile_shared_object(kAddSource);
  CompileResult b = compile_shared_object(kAddSource);
  EXPECT_FALSE(a.from_cache);
  EXPECT_FALSE(b.from_cache);
  EXPECT_EQ(a.cache_path, "");
  EXPECT_NE(a.so_path.rfind(dir_, 0), 0u) << a.so_path;
  struct stat st;
  EXPECT_NE(::stat((dir_ + "/cpu").c_str(), &st), 0) << "nothing may be written to the cache";
  SharedLibrary lib(b.so_path);
  EXPECT_EQ(reinterpret_cast<int (*)(int, int)>(lib.symbol("add"))(1, 1), 2);
}

TEST_F(HostCompilerTest, SyntaxErrorThrowsWithCompilerMessageAndSource) {
  const std::string bad = "extern \"C\" int add(int a, int b) {\n  return a + ;\n}\n";
  try {
    compile_shared_object(bad);
    FAIL() << "expected optfuse::Error";
  } catch (const BackendUnavailable& e) {
    FAIL() << "wrong type: " << e.what();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("error"), std::string::npos) << msg;  // the compiler's own diagnostic
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("   2 |   return a + ;"), std::string::npos) << msg;
  }
  // A failed compile must not leave anything in the cache.
  EXPECT_FALSE(compile_shared_object(kAddSource).from_cache);
}

TEST_F(HostCompilerTest, SourceListingStopsAtFortyLines) {
  std::string bad;
  for (int i = 1; i <= 60; ++i) bad += "// line " + std::to_string(i) + "\n";
  bad += "this is not C++;\n";
  try {
    compile_shared_object(bad);
    FAIL() << "expected optfuse::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("  40 | // line 40"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("  41 | // line 41"), std::string::npos) << msg;
  }
}

// -march=native offers FMA on most machines, and GCC then fuses a*b+c unless told not to.
TEST_F(HostCompilerTest, NoFloatingPointContraction) {
  const char* src = R"(extern "C" float mad(float a, float b, float c) { return a * b + c; }
)";
  SharedLibrary lib(compile_shared_object(src).so_path);
  auto mad = reinterpret_cast<float (*)(float, float, float)>(lib.symbol("mad"));
  const float a = 1.0f + 0x1p-12f;  // a*a = 1 + 2^-11 + 2^-24, which rounds to 1 + 2^-11
  // Unfused: round(a*a) + c == 0 exactly; an fma would give 2^-24.
  EXPECT_EQ(mad(a, a, -(1.0f + 0x1p-11f)), 0.0f);
}

TEST_F(HostCompilerTest, MissingSymbolNamesIt) {
  SharedLibrary lib(compile_shared_object(kAddSource).so_path);
  try {
    lib.symbol("no_such_function");
    FAIL() << "expected optfuse::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no_such_function"), std::string::npos) << e.what();
  }
}

TEST_F(HostCompilerTest, SharedLibraryIsMovable) {
  SharedLibrary a(compile_shared_object(kAddSource).so_path);
  SharedLibrary b(std::move(a));
  EXPECT_EQ(reinterpret_cast<int (*)(int, int)>(b.symbol("add"))(3, 4), 7);
  EXPECT_THROW(a.symbol("add"), Error);  // NOLINT(bugprone-use-after-move): documented state
  SharedLibrary c(compile_shared_object(kAddSource).so_path);
  c = std::move(b);
  EXPECT_EQ(reinterpret_cast<int (*)(int, int)>(c.symbol("add"))(5, 6), 11);
}

TEST_F(HostCompilerTest, LoadingMissingFileThrows) {
  EXPECT_THROW(SharedLibrary(dir_ + "/does-not-exist.so"), Error);
}

TEST_F(HostCompilerTest, ConcurrentCompilesOfSameSourceAgree) {
  const std::string src = "extern \"C\" int triple(int x) { return 3 * x; }\n";
  constexpr int kThreads = 4;
  std::vector<CompileResult> results(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      try {
        results[i] = compile_shared_object(src);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  int compiled = 0;
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(errors[i], "");
    EXPECT_EQ(results[i].so_path, results[0].so_path);
    compiled += results[i].from_cache ? 0 : 1;
  }
  EXPECT_EQ(compiled, 1);
  SharedLibrary lib(results[0].so_path);
  EXPECT_EQ(reinterpret_cast<int (*)(int)>(lib.symbol("triple"))(14), 42);
}

TEST(HostCompilerEnv, NoneMeansNoCompiler) {
  ScopedEnv cxx("OPTFUSE_CXX", "none");
  std::string why;
  EXPECT_FALSE(find_compiler(&why).has_value());
  EXPECT_NE(why.find("OPTFUSE_CXX"), std::string::npos) << why;
  EXPECT_FALSE(find_compiler(nullptr).has_value());
  EXPECT_THROW(compile_shared_object(kAddSource), BackendUnavailable);
}

TEST(HostCompilerEnv, BrokenExplicitCompilerDoesNotFallBack) {
  ScopedEnv cxx("OPTFUSE_CXX", "/nonexistent/optfuse-no-such-compiler");
  std::string why;
  EXPECT_FALSE(find_compiler(&why).has_value());
  EXPECT_NE(why.find("optfuse-no-such-compiler"), std::string::npos) << why;
}

TEST(HostCompilerEnv, BrokenCxxFallsBackToPath) {
  ScopedEnv opt("OPTFUSE_CXX", nullptr);
  ScopedEnv cxx("CXX", "optfuse-no-such-compiler");
  std::string why;
  auto c = find_compiler(&why);
  // Only meaningful where some compiler is on PATH, which the other tests need anyway.
  if (c) {
    EXPECT_EQ(c->path.find("optfuse-no-such-compiler"), std::string::npos);
  } else {
    EXPECT_NE(why.find("CXX"), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace optfuse::host
