#include "runtime/host_compiler.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "optfuse/error.h"
#include "runtime/disk_cache.h"
#include "runtime/sha256.h"

extern char** environ;

namespace optfuse::host {
namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

struct ProcessResult {
  int exit_code = -1;  // -1 with signal != 0 if killed by a signal
  int signal = 0;
  std::string output;  // stdout and stderr interleaved
};

// fork+execve rather than system()/popen(): arguments go to the program verbatim, never through a
// shell, so nothing in a path, flag or environment variable can be interpreted as a command. Not
// posix_spawn: the child sets PR_SET_PDEATHSIG first, so a compiler whose caller is killed (kill -9)
// dies too instead of writing into a directory nobody will clean. `env_extra` ("NAME=value")
// entries replace the inherited ones of the same name.
ProcessResult run_process(const std::vector<std::string>& args, const std::vector<std::string>& env_extra = {}) {
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : env_extra) envp.push_back(const_cast<char*>(e.c_str()));
  for (char** e = environ; e && *e; ++e) {
    bool replaced = false;
    for (const std::string& x : env_extra) {
      size_t n = x.find('=') + 1;
      replaced = replaced || std::strncmp(*e, x.c_str(), n) == 0;
    }
    if (!replaced) envp.push_back(*e);
  }
  envp.push_back(nullptr);
  int fds[2];
  // O_CLOEXEC: another thread spawning at the same time must not inherit our write end, or our
  // read below would not see EOF until that unrelated child exits.
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw Error(std::string("optfuse: pipe() failed: ") + std::strerror(errno));
  int err_pipe[2];  // reports a failed execve (errno) to the parent; closed by a successful one
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(fds[0]), ::close(fds[1]);
    throw Error(std::string("optfuse: pipe() failed: ") + std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl took effect
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull < 0 || ::dup2(devnull, 0) < 0 || ::dup2(fds[1], 1) < 0 || ::dup2(fds[1], 2) < 0) ::_exit(127);
    ::execve(argv[0], argv.data(), envp.data());
    int e = errno;
    ssize_t ignored = ::write(err_pipe[1], &e, sizeof e);
    (void)ignored;
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(fds[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    ::close(fds[0]), ::close(err_pipe[0]);
    throw Error("optfuse: cannot run " + args[0] + ": fork: " + std::strerror(fork_errno));
  }
  int exec_errno = 0;
  ssize_t got_err;
  do got_err = ::read(err_pipe[0], &exec_errno, sizeof exec_errno);
  while (got_err < 0 && errno == EINTR);
  ::close(err_pipe[0]);
  if (got_err == static_cast<ssize_t>(sizeof exec_errno)) {
    ::close(fds[0]);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    throw Error("optfuse: cannot run " + args[0] + ": " + std::strerror(exec_errno));
  }
  ProcessResult r;
  char buf[4096];
  for (;;) {
    ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got > 0) {
      r.output.append(buf, static_cast<size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  pid_t w;
  do {
    w = ::waitpid(pid, &status, 0);
  } while (w < 0 && errno == EINTR);
  if (w < 0) {
    // ECHILD: the host application ignores SIGCHLD, so the status is gone. Callers validate the
    // output (a --version line, an existing .so) rather than trust the exit code alone.
    r.exit_code = 0;
  } else if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  return r;
}

std::optional<std::string> resolve_executable(const std::string& name,
                                              const std::string& path_env) {
  auto ok = [](const std::string& p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!ok(name)) return std::nullopt;
    if (name[0] == '/') return name;
    // Relative paths are made absolute so a later chdir by the application does not break them.
    char cwd[4096];
    if (!::getcwd(cwd, sizeof cwd)) return std::nullopt;
    return std::string(cwd) + "/" + name;
  }
  std::stringstream ss(path_env);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) dir = ".";
    std::string p = dir + "/" + name;
    if (ok(p)) return p[0] == '/' ? p : resolve_executable(p, "");
  }
  return std::nullopt;
}

std::optional<Compiler> try_compiler(const std::string& name, const std::string& path_env,
                                     std::string* why) {
  auto path = resolve_executable(name, path_env);
  if (!path) {
    *why = "'" + name + "' is not an executable file" +
           (name.find('/') == std::string::npos ? " on PATH" : "");
    return std::nullopt;
  }
  ProcessResult r;
  try {
    r = run_process({*path, "--version"});
  } catch (const Error& e) {
    *why = e.what();
    return std::nullopt;
  }
  std::string first = r.output.substr(0, r.output.find('\n'));
  if (r.exit_code != 0 || r.signal != 0 || first.empty()) {
    *why = "'" + *path + " --version' failed (exit " + std::to_string(r.exit_code) +
           "): " + r.output.substr(0, 500);
    return std::nullopt;
  }
  return Compiler{*path, first, r.output};
}

std::optional<Compiler> find_compiler_uncached(const std::string& optfuse_cxx,
                                               const std::string& cxx,
                                               const std::string& path_env, std::string* why) {
  if (optfuse_cxx == "none") {
    *why = "OPTFUSE_CXX=none disables the host compiler";
    return std::nullopt;
  }
  if (!optfuse_cxx.empty()) {
    std::string reason;
    auto c = try_compiler(optfuse_cxx, path_env, &reason);
    if (!c) *why = "OPTFUSE_CXX: " + reason;
    return c;
  }
  std::vector<std::pair<std::string, std::string>> candidates;  // (origin, name)
  if (!cxx.empty()) candidates.emplace_back("CXX", cxx);
  for (const char* n : {"c++", "g++", "clang++"}) candidates.emplace_back("PATH", n);
  std::string reasons;
  for (const auto& [origin, name] : candidates) {
    std::string reason;
    if (auto c = try_compiler(name, path_env, &reason)) return c;
    reasons += (reasons.empty() ? "" : "; ") + origin + ": " + reason;
  }
  *why = "no working C++ compiler found (" + reasons + "); set OPTFUSE_CXX to one";
  return std::nullopt;
}

// Part of the cache key: -march=native output is only valid on CPUs with the same features.
const std::string& cpu_features() {
  static const std::string features = [] {
    std::string out;
    struct utsname u;
    if (::uname(&u) == 0) out = u.machine;
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
      // "flags" on x86, "Features" on ARM.
      if (line.rfind("flags", 0) == 0 || line.rfind("Features", 0) == 0) {
        out += "\n" + line;
        break;
      }
    }
    return out;
  }();
  return features;
}

bool env_flag(const char* name) {
  std::string v = env_or_empty(name);
  return !v.empty() && v != "0";
}

// In-process serialisation per key (the cache's lock file serialises processes): the second
// thread then finds the first one's entry.
std::shared_ptr<std::mutex> key_lock(const std::string& key) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<std::mutex>> locks;
  std::lock_guard<std::mutex> lk(mu);
  auto& m = locks[key];
  if (!m) m = std::make_shared<std::mutex>();
  return m;
}

// Removes a work directory on every way out of a compile.
struct WorkDir {
  std::string path;
  ~WorkDir() {
    if (!path.empty()) remove_tree(path);
  }
};

// The path dlopen is given for a checked file: /proc/self/fd/N of a descriptor kept open for the
// rest of the process, one per distinct content. Kept open because glibc's dlopen first matches
// the name against loaded objects: a closed and reused descriptor number would hand back the
// object loaded earlier under that name.
std::string loadable_path(UniqueFd fd, const Sha256::Digest& digest) {
  static std::mutex mu;
  static std::map<Sha256::Digest, int> fds;
  std::lock_guard<std::mutex> lk(mu);
  auto it = fds.find(digest);
  if (it == fds.end()) it = fds.emplace(digest, fd.release()).first;
  return "/proc/self/fd/" + std::to_string(it->second);
}

// A size-only linker flag of default_compile_flags() that not every linker knows (GNU ld and lld
// do, gold does not): a compile whose linker rejects it is run again without it, and later
// compiles with the same compiler and flags (`command`: the compiler's path and the flags, the
// linker being chosen by them) leave it out from the start.
const char* const kLayoutFlag = "-Wl,-z,noseparate-code";

bool linker_rejects_layout_flag(const std::string& command, bool set = false) {
  static std::mutex mu;
  static std::set<std::string> rejects;
  std::lock_guard<std::mutex> lk(mu);
  if (set) rejects.insert(command);
  return rejects.count(command) > 0;
}

std::string numbered_head(const std::string& source, int max_lines) {
  std::stringstream in(source);
  std::string line, out;
  int n = 0;
  while (n < max_lines && std::getline(in, line)) {
    char num[16];
    std::snprintf(num, sizeof num, "%4d | ", ++n);
    out += num + line + "\n";
  }
  if (std::getline(in, line)) out += "     ... (truncated)\n";
  return out;
}

// (cache root, key) -> what compile_shared_object returned for it in this process. Found by the
// key itself (the SHA-256 of compiler, flags and source), so nothing of the source is kept: an
// earlier version kept each kernel's source (20-60 KB) to confirm a hit by comparing it, which
// spared a repeated lookup the key's hash but left every later construction in the process to
// allocate fresh pages instead of reusing freed ones (a page fault costs ~2.4 us on the machine
// of docs/performance.md): 10-40 us per construction, more than the hash it spared.
class VerifiedKernels {
 public:
  std::optional<CompileResult> find(const std::string& root, const std::string& key) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = map_.find(root + '\0' + key);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }
  void add(const std::string& root, const std::string& key, const CompileResult& r) {
    std::lock_guard<std::mutex> lk(mu_);
    map_.emplace(root + '\0' + key, r);
  }
  void clear() {
    std::lock_guard<std::mutex> lk(mu_);
    map_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, CompileResult> map_;
};

// What compiles with these extra flags use under the current environment ($OPTFUSE_CXX, $CXX,
// $PATH: find_compiler's): the compiler, all flags, and the key's length-prefixed text before the
// source (compiler path and --version, CPU features, flags). Built once per process per
// environment and extra flags: the head is 2-3 KB, and building it cost 5-6 us per call.
struct CompileSetup {
  Compiler cc;
  std::vector<std::string> flags;
  std::string head;
};

std::shared_ptr<const CompileSetup> compile_setup(const std::vector<std::string>& extra_flags) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const CompileSetup>> setups;
  std::string id;
  auto add = [&](const std::string& s) { id += std::to_string(s.size()) + ":" + s; };
  for (const char* v : {"OPTFUSE_CXX", "CXX", "PATH"}) add(env_or_empty(v));
  for (const std::string& f : extra_flags) add(f);
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = setups.find(id);
    if (it != setups.end()) return it->second;
  }
  std::string why;
  auto cc = find_compiler(&why);
  if (!cc) throw BackendUnavailable("optfuse: CPU backend needs a host C++ compiler: " + why);
  auto setup = std::make_shared<CompileSetup>();
  setup->flags = default_compile_flags();
  setup->flags.insert(setup->flags.end(), extra_flags.begin(), extra_flags.end());
  // Every part is length-prefixed, so no two different lists of parts make the same text.
  auto part = [&](const std::string& s) { setup->head += std::to_string(s.size()) + ":" + s; };
  part("optfuse-host-so-v2");
  part(cc->path);
  part(cc->version);
  part(cpu_features());
  for (const auto& f : setup->flags) part(f);
  setup->cc = std::move(*cc);
  std::lock_guard<std::mutex> lk(mu);
  return setups.emplace(id, std::move(setup)).first->second;
}

VerifiedKernels& verified_kernels() {
  static VerifiedKernels v;
  return v;
}

}  // namespace

std::optional<Compiler> find_compiler(std::string* why) {
  static std::mutex mu;
  static std::map<std::string, std::pair<std::optional<Compiler>, std::string>> memo;
  std::string ox = env_or_empty("OPTFUSE_CXX"), cx = env_or_empty("CXX"), pe = env_or_empty("PATH");
  std::string key = ox + '\0' + cx + '\0' + pe;
  std::lock_guard<std::mutex> lk(mu);
  auto it = memo.find(key);
  if (it == memo.end()) {
    std::string reason;
    auto c = find_compiler_uncached(ox, cx, pe, &reason);
    it = memo.emplace(key, std::make_pair(std::move(c), std::move(reason))).first;
  }
  if (!it->second.first && why) *why = it->second.second;
  return it->second.first;
}

const std::vector<std::string>& default_compile_flags() {
  // -ffp-contract=off: GCC contracts a*b+c into fma by default once -march=native offers FMA,
  // which changes rounding; -fno-math-errno/-fno-trapping-math keep IEEE results but let sqrt and
  // friends be inlined and vectorised.
  // -s, -z noseparate-code and -z norelro make the shared object smaller and quicker to dlopen,
  // not its code different: a cached entry is hashed in full (and mapped) on every first load in
  // a process. GNU ld's default layout (-z separate-code) gives the code pages of its own, about
  // 8 KB of padding per kernel (a 23 KB sgd kernel becomes 14 KB, two mappings instead of four);
  // -s drops the static symbol table, about 1 KB (the entry points stay in the dynamic one);
  // without RELRO the loader has no page to make read-only after relocating (an mprotect and a
  // split mapping: dlopen of a 26 KB kernel 25 -> 19 us) and the file loses another ~1 KB of
  // padding. The costs: the ELF headers and read-only data share the code's executable mapping,
  // and the kernel's few GOT entries (the loader's own: __cxa_finalize and the like) stay
  // writable; neither is something the cache's checks rely on. A linker that does not know
  // -z noseparate-code (gold) links without it (kLayoutFlag below). Like every flag, these are
  // part of the cache key.
  static const std::vector<std::string> flags = {
      "-O3", "-march=native", "-std=c++17", "-fPIC", "-shared",
      "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
      "-s", "-Wl,-z,noseparate-code", "-Wl,-z,norelro"};
  return flags;
}

CompileResult compile_shared_object(const std::string& source,
                                    const std::vector<std::string>& extra_flags) {
  auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const std::shared_ptr<const CompileSetup> setup = compile_setup(extra_flags);
  const Compiler* cc = &setup->cc;
  const std::vector<std::string>& flags = setup->flags;
  // The key is the SHA-256 of head + "<size>:" + source, hashed in updates (the same digest as the
  // concatenation, without copying the source).
  Sha256 key_hash;
  key_hash.update(setup->head);
  key_hash.update(std::to_string(source.size()) + ":");
  key_hash.update(source);
  const std::string key = to_hex(key_hash.finish());

  const bool use_cache = !env_flag("OPTFUSE_NO_CACHE");
  // A kernel this process already verified and loaded is not read from disk again: its bytes are
  // held by an open descriptor (loadable_path), and dlopen would return the mapped object anyway.
  const std::string root = use_cache ? cache_root() : std::string();
  if (use_cache) {
    if (auto hit = verified_kernels().find(root, key)) return {hit->so_path, true, elapsed(), hit->cache_path};
  }
  auto remember = [&](CompileResult r) {
    if (use_cache) verified_kernels().add(root, key, r);
    return r;
  };

  std::optional<DiskCache> cache;
  std::shared_ptr<std::mutex> lock_holder;
  std::unique_lock<std::mutex> key_guard;
  DiskCache::Lock file_lock;
  if (use_cache) {
    cache.emplace("cpu");  // warns once and is unusable if the directory cannot be trusted
    lock_holder = key_lock(key);
    key_guard = std::unique_lock<std::mutex>(*lock_holder);
    if (cache->usable()) {
      // Checked without the lock first: a warm cache never waits for another process.
      if (auto e = cache->load(key, ".so", false))
        return remember({loadable_path(std::move(e->fd), e->digest), true, elapsed(), cache->path_for(key, ".so")});
      file_lock = cache->lock(key);
      if (auto e = cache->load(key, ".so", false))  // another process compiled it while we waited
        return remember({loadable_path(std::move(e->fd), e->digest), true, elapsed(), cache->path_for(key, ".so")});
      cache->remove_stale();
    }
  }

  const bool cached = cache && cache->usable();
  WorkDir work{cached ? cache->make_work_dir() : make_private_temp_dir()};
  if (work.path.empty()) throw Error("optfuse: cannot create a temporary directory for the host compiler: " + std::string(std::strerror(errno)));
  const std::string src_path = work.path + "/kernel.cpp";
  const std::string so_path = work.path + "/kernel.so";
  {
    std::ofstream out(src_path, std::ios::binary);
    out << source;
    out.close();
    if (!out) throw Error("optfuse: cannot write " + src_path);
  }
  // The key names the flags as asked for; the command leaves out the layout flag where this
  // compiler's linker rejected it (the same choice every time for the same compiler, so the key
  // still names one artifact).
  auto command = [&](bool layout_flag) {
    std::vector<std::string> args{cc->path};
    for (const std::string& f : flags)
      if (layout_flag || f != kLayoutFlag) args.push_back(f);
    args.insert(args.end(), {"-o", so_path, src_path});
    return args;
  };
  std::string compiler_and_flags = cc->path;
  for (const std::string& f : flags) compiler_and_flags += '\0' + f;
  bool layout_flag = !linker_rejects_layout_flag(compiler_and_flags);
  std::vector<std::string> args = command(layout_flag);
  // TMPDIR: the compiler's own temporary files live (and die) with the work directory.
  ProcessResult r = run_process(args, {"TMPDIR=" + work.path});
  if (layout_flag && (r.exit_code != 0 || r.signal != 0) && r.output.find("noseparate-code") != std::string::npos &&
      std::find(flags.begin(), flags.end(), kLayoutFlag) != flags.end()) {
    linker_rejects_layout_flag(compiler_and_flags, true);
    args = command(false);
    r = run_process(args, {"TMPDIR=" + work.path});
  }
  UniqueFd so_fd(::open(so_path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  const bool produced = so_fd && ::fstat(so_fd.get(), &st) == 0 && untrusted_reason(st, false).empty() && st.st_size > 0;
  if (r.exit_code != 0 || r.signal != 0 || !produced) {
    std::string cmd;
    for (const auto& a : args) cmd += (cmd.empty() ? "" : " ") + a;
    std::string status = r.signal ? "killed by signal " + std::to_string(r.signal)
                                  : "exit status " + std::to_string(r.exit_code);
    if (r.exit_code == 0 && r.signal == 0) status += ", but no usable " + so_path;
    std::string output = r.output;
    const size_t cap = 16000;  // template errors can run to megabytes
    if (output.size() > cap) output = output.substr(0, cap) + "\n... (compiler output truncated)\n";
    throw Error("optfuse: host compilation failed (" + status + ")\ncommand: " + cmd +
                "\n--- compiler output ---\n" + output + "--- source (first 40 lines) ---\n" +
                numbered_head(source, 40));
  }
  // The bytes stored and the bytes loaded are the ones hashed here, read through the descriptor
  // that dlopen will use (the work directory is private, and removed before returning).
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  for (size_t at = 0; at < bytes.size();) {
    ssize_t got = ::pread(so_fd.get(), &bytes[at], bytes.size() - at, static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw Error("optfuse: cannot read " + so_path + ": " + std::strerror(errno));
    at += static_cast<size_t>(got);
  }
  const Sha256::Digest digest = sha256(bytes.data(), bytes.size());
  std::string cache_path;
  if (cached && cache->store(key, ".so", bytes, &digest)) cache_path = cache->path_for(key, ".so");
  // A read-only or full cache: the compiled object is still loadable, just not kept.
  return remember({loadable_path(std::move(so_fd), digest), false, elapsed(), cache_path});
}

void forget_verified_kernels() { verified_kernels().clear(); }

SharedLibrary::SharedLibrary(const std::string& path) : path_(path) {
  handle_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char* err = ::dlerror();
    throw Error("optfuse: cannot load shared object " + path + ": " +
                (err ? err : "unknown error"));
  }
}

SharedLibrary::~SharedLibrary() {
  if (handle_) ::dlclose(handle_);
}

SharedLibrary::SharedLibrary(SharedLibrary&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)), path_(std::move(other.path_)) {}

SharedLibrary& SharedLibrary::operator=(SharedLibrary&& other) noexcept {
  if (this != &other) {
    if (handle_) ::dlclose(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

void* SharedLibrary::symbol(const std::string& name) const {
  if (!handle_) throw Error("optfuse: symbol '" + name + "' requested from an empty SharedLibrary");
  ::dlerror();
  void* p = ::dlsym(handle_, name.c_str());
  if (!p) {
    const char* err = ::dlerror();
    throw Error("optfuse: symbol '" + name + "' not found in " + path_ +
                (err ? std::string(": ") + err : std::string()));
  }
  return p;
}

}  // namespace optfuse::host
