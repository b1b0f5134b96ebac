#include "runtime/host_compiler.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "optfuse/error.h"
#include "runtime/disk_cache.h"

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

// posix_spawn rather than system()/popen(): arguments go to the program verbatim, never through a
// shell, so nothing in a path, flag or environment variable can be interpreted as a command.
ProcessResult run_process(const std::vector<std::string>& args) {
  int fds[2];
  // O_CLOEXEC: another thread spawning at the same time must not inherit our write end, or our
  // read below would not see EOF until that unrelated child exits.
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw Error(std::string("optfuse: pipe() failed: ") + std::strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    throw Error("optfuse: cannot run " + args[0] + ": " + std::strerror(rc));
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
  return Compiler{*path, first};
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

std::string make_temp_dir() {
  std::string base = env_or_empty("TMPDIR");
  if (base.empty()) base = "/tmp";
  std::string templ = base + "/optfuse-cc-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data()))
    throw Error("optfuse: cannot create a temp dir under " + base + ": " + std::strerror(errno));
  return buf.data();
}

// Only flat directories are ever created here, so no recursion is needed.
void remove_dir(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") ::unlink((dir + "/" + n).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

// Uncached objects must outlive the call (the caller loads them later), so they are removed at
// exit instead; unlinking a file that is still dlopen'ed is harmless on POSIX.
class LeftoverDirs {
 public:
  void add(const std::string& dir) {
    std::lock_guard<std::mutex> lk(mu_);
    dirs_.push_back(dir);
  }
  ~LeftoverDirs() {
    for (const auto& d : dirs_) remove_dir(d);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

LeftoverDirs& leftover_dirs() {
  static LeftoverDirs dirs;
  return dirs;
}

// DiskCache::store names its temp file by pid only, so two threads storing the same key would
// write the same temp file; one lock per key also makes the second thread a cache hit.
std::shared_ptr<std::mutex> key_lock(const std::string& key) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<std::mutex>> locks;
  std::lock_guard<std::mutex> lk(mu);
  auto& m = locks[key];
  if (!m) m = std::make_shared<std::mutex>();
  return m;
}

long file_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
  return static_cast<long>(st.st_size);
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
  static const std::vector<std::string> flags = {
      "-O3", "-march=native", "-std=c++17", "-fPIC", "-shared",
      "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"};
  return flags;
}

CompileResult compile_shared_object(const std::string& source,
                                    const std::vector<std::string>& extra_flags) {
  auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::string why;
  auto cc = find_compiler(&why);
  if (!cc) throw BackendUnavailable("optfuse: CPU backend needs a host C++ compiler: " + why);

  std::vector<std::string> flags = default_compile_flags();
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  std::string material = "optfuse-host-so-v1";
  for (const std::string& part : {cc->path, cc->identity, cpu_features()}) material += '\0' + part;
  for (const auto& f : flags) material += '\0' + f;
  material += '\0' + source;
  const std::string key = content_hash(material);

  const bool use_cache = !env_flag("OPTFUSE_NO_CACHE");
  DiskCache cache("cpu");
  std::shared_ptr<std::mutex> lock_holder;
  std::unique_lock<std::mutex> key_guard;
  if (use_cache) {
    lock_holder = key_lock(key);
    key_guard = std::unique_lock<std::mutex>(*lock_holder);
    std::string cached = cache.path_for(key, ".so");
    if (file_size(cached) > 0) return {cached, true, elapsed()};
  }

  std::string dir = make_temp_dir();
  const std::string src_path = dir + "/kernel_" + key + ".cpp";
  const std::string so_path = dir + "/kernel_" + key + ".so";
  {
    std::ofstream out(src_path, std::ios::binary);
    out << source;
    out.close();
    if (!out) {
      remove_dir(dir);
      throw Error("optfuse: cannot write " + src_path);
    }
  }
  std::vector<std::string> args{cc->path};
  args.insert(args.end(), flags.begin(), flags.end());
  args.insert(args.end(), {"-o", so_path, src_path});
  ProcessResult r;
  try {
    r = run_process(args);
  } catch (...) {
    remove_dir(dir);
    throw;
  }
  if (r.exit_code != 0 || r.signal != 0 || file_size(so_path) <= 0) {
    remove_dir(dir);
    std::string cmd;
    for (const auto& a : args) cmd += (cmd.empty() ? "" : " ") + a;
    std::string status = r.signal ? "killed by signal " + std::to_string(r.signal)
                                  : "exit status " + std::to_string(r.exit_code);
    std::string output = r.output;
    const size_t cap = 16000;  // template errors can run to megabytes
    if (output.size() > cap) output = output.substr(0, cap) + "\n... (compiler output truncated)\n";
    throw Error("optfuse: host compilation failed (" + status + ")\ncommand: " + cmd +
                "\n--- compiler output ---\n" + output + "--- source (first 40 lines) ---\n" +
                numbered_head(source, 40));
  }

  if (use_cache) {
    std::ifstream in(so_path, std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    const std::string b = bytes.str();
    const std::string cached = cache.path_for(key, ".so");
    // The size check catches a short write that store() did not notice (it does not check close).
    if (!b.empty() && cache.store(key, ".so", b)) {
      if (file_size(cached) == static_cast<long>(b.size())) {
        remove_dir(dir);
        return {cached, false, elapsed()};
      }
      ::unlink(cached.c_str());
    }
    // Unwritable cache: the object in the temp dir is still usable, just not persistent.
  }
  ::unlink(src_path.c_str());
  leftover_dirs().add(dir);
  return {so_path, false, elapsed()};
}

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
