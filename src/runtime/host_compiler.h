// Run-time compilation of generated C++ into shared objects for the CPU backend.
//
// Generated kernels must reproduce IEEE float arithmetic exactly (they are checked bit for bit
// against a reference evaluator), so the flags deliberately avoid -ffast-math and turn off
// floating-point contraction; -march=native makes the artifact CPU-specific, which is why the
// CPU's feature flags are part of the cache key.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace optfuse::host {

struct Compiler {
  std::string path;      // absolute path of the executable
  std::string identity;  // first line of `<path> --version`
  std::string version;   // all of `<path> --version` (part of the cache key), run once per process
};

// Finds a working C++ compiler: $OPTFUSE_CXX, else $CXX, else c++, g++, clang++ on PATH.
// $OPTFUSE_CXX is an explicit choice, so if it does not work there is no fallback; a broken $CXX
// falls through to the PATH candidates. OPTFUSE_CXX=none means "pretend there is no compiler".
// Each value names one program (a name looked up on PATH, or a path); it is never handed to a
// shell, so wrappers such as "ccache g++" are not supported. Results are memoised per value of
// ($OPTFUSE_CXX, $CXX, $PATH). Returns nullopt with the reason in *why (if why is non-null).
std::optional<Compiler> find_compiler(std::string* why);

// The flags every compile uses, before extra_flags (which can therefore override them).
const std::vector<std::string>& default_compile_flags();

struct CompileResult {
  // Loadable path, valid until process exit: /proc/self/fd/N of a descriptor, kept open for the
  // process, on a file whose bytes were checked (a cache entry against its recorded SHA-256, or
  // the compiler's fresh output), so dlopen maps exactly what was checked whatever happens to
  // the cache's files afterwards.
  std::string so_path;
  bool from_cache;
  double seconds;  // wall time of the whole call
  std::string cache_path;  // the cache entry read or written; empty if the cache was not used
};

// Compiles C++17 source into a shared object, cached in DiskCache("cpu") under the SHA-256 of the
// source, the compiler's path and full --version output, all flags, and the CPU feature flags
// (see disk_cache.h for what is checked before an entry is used). Concurrent calls for the same
// key compile once, within a process and across processes (a lock file beside the entry). The
// compiler runs in a work directory (its TMPDIR too) that is removed on every way out, and dies
// with the calling thread (PR_SET_PDEATHSIG); one left by a kill -9 is removed by the next
// compile. OPTFUSE_NO_CACHE=1 bypasses the cache: nothing is read from or written to it, and the
// private temporary directory is gone when this returns.
// Throws optfuse::BackendUnavailable if there is no compiler, optfuse::Error (with the compiler
// output and the first 40 numbered source lines) if compilation fails.
CompileResult compile_shared_object(const std::string& source,
                                    const std::vector<std::string>& extra_flags = {});

// compile_shared_object remembers, per process, the kernels it verified and loaded, and returns
// them again without reading the cache. Tests that damage the cache between two compiles of one
// source, and benchmarks of the first load in a process, call this to make it look again.
void forget_verified_kernels();

// A dlopen'ed shared object (RTLD_NOW | RTLD_LOCAL), closed on destruction.
class SharedLibrary {
 public:
  explicit SharedLibrary(const std::string& path);  // throws optfuse::Error with dlerror()
  ~SharedLibrary();
  SharedLibrary(SharedLibrary&& other) noexcept;
  SharedLibrary& operator=(SharedLibrary&& other) noexcept;
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;

  // Throws optfuse::Error naming the symbol and the library if it is missing.
  void* symbol(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  void* handle_ = nullptr;
  std::string path_;
};

}  // namespace optfuse::host
