#include "runtime/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

namespace optfuse {
namespace {

constexpr char kMagic[16] = {'o', 'p', 't', 'f', 'u', 's', 'e', '-', 'e', 'n', 't', 'r', 'y', '-', 'v', '1'};
// Entries larger than this are not artifacts of ours; refusing them bounds what load() reads.
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 30;
// Below this much free space a compile would likely fail part-way; compile outside the cache.
constexpr uint64_t kMinFreeBytes = uint64_t(64) << 20;
const char* const kExtensions[] = {".so", ".cubin"};

std::string errno_text(int e) { return std::strerror(e); }

bool read_full(int fd, void* buf, size_t n, off_t at) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = ::pread(fd, p, n, at);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= static_cast<size_t>(got), at += got;
  }
  return true;
}

bool write_full(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put, n -= static_cast<size_t>(put);
  }
  return true;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// "<prefix><pid>-..." or "...<infix><pid>.<n>" names a process; true if it no longer runs.
bool pid_is_dead(const std::string& digits) {
  if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return false;
  const pid_t pid = static_cast<pid_t>(std::atol(digits.c_str()));
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

// A directory, created (mode 0700, parents too) if missing, opened without following a symlink
// in its last component and checked. Returns the fd or sets *why.
UniqueFd open_trusted_dir(int at_fd, const std::string& path, std::string* why) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    UniqueFd fd(::openat(at_fd, path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd && errno == ENOENT && attempt == 0) {
      if (at_fd == AT_FDCWD) {
        for (size_t i = 1; i < path.size(); ++i)
          if (path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0700);
      }
      if (::mkdirat(at_fd, path.c_str(), 0700) != 0 && errno != EEXIST) {
        *why = "cannot create " + path + ": " + errno_text(errno);
        return UniqueFd();
      }
      continue;
    }
    if (!fd) {
      *why = "cannot open " + path + ": " + (errno == ELOOP || errno == ENOTDIR ? "not a directory (a symlink?)" : errno_text(errno));
      return UniqueFd();
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) {
      *why = path + ": " + errno_text(errno);
      return UniqueFd();
    }
    std::string r = untrusted_reason(st, true);
    if (!r.empty()) {
      *why = path + " " + r;
      return UniqueFd();
    }
    return fd;
  }
  *why = "cannot open " + path;
  return UniqueFd();
}

void remove_tree_at(int dir_fd, const std::string& name) {
  struct stat st;
  if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    int sub = ::openat(dir_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub >= 0) {
      if (DIR* d = ::fdopendir(sub)) {  // owns sub from here
        std::vector<std::string> names;
        while (dirent* e = ::readdir(d)) {
          std::string n = e->d_name;
          if (n != "." && n != "..") names.push_back(n);
        }
        for (const auto& n : names) remove_tree_at(::dirfd(d), n);
        ::closedir(d);
      } else {
        ::close(sub);
      }
    }
    ::unlinkat(dir_fd, name.c_str(), AT_REMOVEDIR);
  } else {
    ::unlinkat(dir_fd, name.c_str(), 0);
  }
}

std::vector<std::string> list_dir(int dir_fd) {
  std::vector<std::string> names;
  int dup = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dup < 0) return names;
  if (DIR* d = ::fdopendir(dup)) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  } else {
    ::close(dup);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string temp_base() {
  const char* t = std::getenv("TMPDIR");
  return t && *t == '/' ? t : "/tmp";
}

double lock_timeout_s() {
  const char* v = std::getenv("OPTFUSE_CACHE_LOCK_TIMEOUT");
  if (v && *v) {
    char* end = nullptr;
    double s = std::strtod(v, &end);
    if (end && *end == '\0' && s >= 0) return s;
  }
  return 600;
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

void warn_once(const std::string& topic, const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lk(mu);
  if (warned.insert(topic).second) std::fprintf(stderr, "optfuse: %s\n", message.c_str());
}

std::string cache_root() {
  if (const char* d = std::getenv("OPTFUSE_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/optfuse";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/optfuse";
  // No home: a directory of this user's own, never one shared by every user (which whoever
  // created it first would control).
  return temp_base() + "/optfuse-cache-" + std::to_string(::geteuid());
}

std::string untrusted_reason(const struct stat& st, bool directory) {
  if (directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))
    return directory ? "is not a directory" : "is not a regular file";
  if (st.st_uid != ::geteuid())
    return "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " + std::to_string(::geteuid()) + ")";
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string("is writable by group or others (mode ") + mode + ")";
  }
  return "";
}

void remove_tree(const std::string& path) { remove_tree_at(AT_FDCWD, path); }

std::string make_private_temp_dir() {
  const std::string base = temp_base();
  const std::string prefix = "optfuse-cc-";
  // Leftovers of this user's processes that were killed before they could clean up.
  if (int fd = ::open(base.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    for (const auto& n : list_dir(fd)) {
      if (n.rfind(prefix, 0) != 0) continue;
      size_t dash = n.find('-', prefix.size());
      struct stat st;
      if (dash != std::string::npos && pid_is_dead(n.substr(prefix.size(), dash - prefix.size())) &&
          ::fstatat(fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::geteuid())
        remove_tree_at(fd, n);
    }
    ::close(fd);
  }
  std::string templ = base + "/" + prefix + std::to_string(::getpid()) + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) return "";
  return buf.data();
}

namespace {

// The cache directories this process opened and checked, kept open: a DiskCache is made for
// every kernel looked up, and opening and checking two directories again each time cost 5-9 us
// of a process's first load of a kernel. Reused only while the paths still name the same
// directories and those are still trusted (one fstatat of each, without following a symlink in
// the last component, the same as opening them), so a directory removed, replaced or opened up
// (chmod) since is opened and checked again.
struct OpenedDir {
  std::shared_ptr<UniqueFd> fd;
  dev_t root_dev, dev;
  ino_t root_ino, ino;
};
std::mutex opened_dirs_mu;
std::map<std::string, OpenedDir>& opened_dirs() {
  static std::map<std::string, OpenedDir> dirs;  // by the directory's path
  return dirs;
}

bool still_trusted(const std::string& path, dev_t dev, ino_t ino) {
  struct stat st;
  return ::fstatat(AT_FDCWD, path.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev && st.st_ino == ino &&
         untrusted_reason(st, true).empty();
}

}  // namespace

DiskCache::DiskCache(const std::string& subdir) {
  const std::string root = cache_root();
  dir_ = root + "/" + subdir;
  {
    std::lock_guard<std::mutex> lk(opened_dirs_mu);
    auto it = opened_dirs().find(dir_);
    if (it != opened_dirs().end()) {
      const OpenedDir& d = it->second;
      if (still_trusted(root, d.root_dev, d.root_ino) && still_trusted(dir_, d.dev, d.ino)) {
        dir_fd_ = d.fd;
        return;
      }
      opened_dirs().erase(it);
    }
  }
  std::string why;
  UniqueFd root_fd = open_trusted_dir(AT_FDCWD, root, &why);
  if (root_fd) {
    UniqueFd sub = open_trusted_dir(root_fd.get(), subdir, &why);
    struct stat root_st, st;
    if (sub && ::fstat(root_fd.get(), &root_st) == 0 && ::fstat(sub.get(), &st) == 0) {
      dir_fd_ = std::make_shared<UniqueFd>(std::move(sub));
      std::lock_guard<std::mutex> lk(opened_dirs_mu);
      opened_dirs()[dir_] = OpenedDir{dir_fd_, root_st.st_dev, st.st_dev, root_st.st_ino, st.st_ino};
      return;
    }
    why = root + "/" + why;
  }
  refused_ = "the kernel cache " + why;
  warn_once("cache-refused", refused_ + "; not using it: kernels are compiled into a private temporary directory");
}

std::string DiskCache::path_for(const std::string& key, const std::string& ext) const {
  return dir_ + "/" + key + ext;
}

std::string DiskCache::check(const std::string& name, const std::string& key, Entry* out,
                             bool want_payload) const {
  if (!dir_fd_) return "the cache is not usable";
  // O_NONBLOCK: a planted FIFO must not hang the open.
  UniqueFd fd(::openat(dir_fd_->get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd) return errno == ELOOP ? "is a symlink" : errno == ENOENT ? "missing" : "cannot be opened: " + errno_text(errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return "cannot be read: " + errno_text(errno);
  std::string r = untrusted_reason(st, false);
  if (!r.empty()) return r;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kTrailerSize) return "is truncated (" + std::to_string(size) + " bytes)";
  if (size > kMaxEntryBytes) return "is too large (" + std::to_string(size) + " bytes)";
  unsigned char trailer[kTrailerSize];
  const uint64_t payload_size = size - kTrailerSize;
  if (!read_full(fd.get(), trailer, kTrailerSize, static_cast<off_t>(payload_size))) return "cannot be read";
  if (std::memcmp(trailer, kMagic, 16) != 0) return "has no optfuse checksum (not written by this version, or damaged)";
  const Sha256::Digest key_digest = sha256(key.data(), key.size());
  if (std::memcmp(trailer + 16, key_digest.data(), 32) != 0) return "was stored under another key";
  uint64_t recorded = 0;
  for (int i = 0; i < 8; ++i) recorded |= uint64_t(trailer[48 + i]) << (8 * i);
  if (recorded != payload_size) return "is truncated or extended (size does not match its record)";
  // Hash what a later load will map: all of the payload, read through the same descriptor.
  // Without the bytes, in 16 KB pieces through a buffer on the stack: memory the process has
  // touched already, where a buffer as large as the entry (heap, mmap or a deeper stack) costs a
  // page fault per 4 KB on a process's first load, about as much again as the hash (measured:
  // 77 KB entry, 53 us hash, 66 us in 16 KB pieces, 70 us through mmap, 99 us into a new vector).
  Sha256 h;
  std::string payload;
  if (want_payload) {
    payload.resize(payload_size);
    if (!read_full(fd.get(), &payload[0], payload_size, 0)) return "cannot be read";
    h.update(payload);
  } else {
    unsigned char buf[16 << 10];
    for (uint64_t at = 0; at < payload_size;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof buf, payload_size - at));
      if (!read_full(fd.get(), buf, n, static_cast<off_t>(at))) return "cannot be read";
      h.update(buf, n);
      at += n;
    }
  }
  const Sha256::Digest digest = h.finish();
  if (std::memcmp(trailer + 56, digest.data(), 32) != 0) return "does not match its recorded SHA-256 (damaged or replaced)";
  if (out) {
    out->fd = std::move(fd);
    out->payload_size = payload_size;
    out->digest = digest;
    out->payload = std::move(payload);
  }
  return "";
}

std::optional<DiskCache::Entry> DiskCache::load(const std::string& key, const std::string& ext,
                                                bool want_payload) const {
  if (!dir_fd_) return std::nullopt;
  Entry e;
  std::string why = check(key + ext, key, &e, want_payload);
  if (why.empty()) return e;
  if (why == "missing") return std::nullopt;
  // Never loaded; removed so that the rebuilt entry can take its place. (The directory is ours,
  // so even an entry planted with another owner can be removed.)
  remove_tree_at(dir_fd_->get(), key + ext);
  warn_once("bad-entry:" + path_for(key, ext),
            "kernel cache entry " + path_for(key, ext) + " " + why + "; removed, compiling it again");
  return std::nullopt;
}

bool DiskCache::store(const std::string& key, const std::string& ext, const std::string& payload,
                      const Sha256::Digest* payload_digest) const {
  if (!dir_fd_) return false;
  static std::atomic<unsigned long> counter{0};
  // Unique per process and call; the pid lets remove_stale() recognise a dead writer's leftovers.
  const std::string tmp = key + ext + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++counter);
  UniqueFd fd(::openat(dir_fd_->get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd) return false;
  unsigned char trailer[kTrailerSize];
  std::memcpy(trailer, kMagic, 16);
  const Sha256::Digest key_digest = sha256(key.data(), key.size());
  std::memcpy(trailer + 16, key_digest.data(), 32);
  for (int i = 0; i < 8; ++i) trailer[48 + i] = static_cast<unsigned char>(uint64_t(payload.size()) >> (8 * i));
  const Sha256::Digest digest = payload_digest ? *payload_digest : sha256(payload.data(), payload.size());
  std::memcpy(trailer + 56, digest.data(), 32);
  // fchmod: the umask must not leave a group-writable entry that load() would then refuse.
  bool ok = ::fchmod(fd.get(), 0644) == 0 && write_full(fd.get(), payload.data(), payload.size()) &&
            write_full(fd.get(), trailer, kTrailerSize);
  ok = ::close(fd.release()) == 0 && ok;  // close reports delayed write errors (full disk, NFS)
  if (ok && ::renameat(dir_fd_->get(), tmp.c_str(), dir_fd_->get(), (key + ext).c_str()) == 0) return true;
  ::unlinkat(dir_fd_->get(), tmp.c_str(), 0);
  return false;
}

DiskCache::Lock& DiskCache::Lock::operator=(Lock&& o) noexcept {
  if (this != &o) {
    unlock();
    fd_ = std::move(o.fd_);
    dir_fd_ = o.dir_fd_;
    name_ = std::move(o.name_);
  }
  return *this;
}

DiskCache::Lock::~Lock() { unlock(); }

void DiskCache::Lock::unlock() {
  if (!fd_) return;
  // Unlinked while still locked: a waiter that then locks the unlinked file notices (its inode
  // is no longer the one at the path) and starts over on a new file.
  ::unlinkat(dir_fd_, name_.c_str(), 0);
  fd_.reset();
}

DiskCache::Lock DiskCache::lock(const std::string& key) const {
  Lock l;
  if (!dir_fd_) return l;
  const std::string name = key + ".lock";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(lock_timeout_s());
  for (;;) {
    UniqueFd fd(::openat(dir_fd_->get(), name.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
    struct stat st;
    if (!fd || ::fstat(fd.get(), &st) != 0 || !untrusted_reason(st, false).empty()) {
      // Not ours (or a symlink): remove it once and try again; then give up locking.
      if (remove(name) && std::chrono::steady_clock::now() < deadline) continue;
      return l;
    }
    bool locked = false;
    for (int wait_ms = 1;; wait_ms = std::min(wait_ms * 2, 50)) {
      if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) {
        locked = true;
        break;
      }
      if (errno != EWOULDBLOCK && errno != EINTR) break;
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    }
    if (!locked) {
      warn_once("lock-timeout", "could not lock " + dir_ + "/" + name + " within " + std::to_string(lock_timeout_s()) +
                                    " s (OPTFUSE_CACHE_LOCK_TIMEOUT); compiling without it");
      return l;
    }
    struct stat now;
    if (::fstatat(dir_fd_->get(), name.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == st.st_dev &&
        now.st_ino == st.st_ino) {
      l.fd_ = std::move(fd);
      l.dir_fd_ = dir_fd_->get();
      l.name_ = name;
      return l;
    }
    // The holder before us unlinked the file we locked: take the current one.
  }
}

std::string DiskCache::make_work_dir() const {
  struct statvfs vfs;
  if (!dir_fd_ || ::fstatvfs(dir_fd_->get(), &vfs) != 0 || uint64_t(vfs.f_bavail) * vfs.f_frsize < kMinFreeBytes)
    return make_private_temp_dir();
  std::string templ = dir_ + "/tmp-" + std::to_string(::getpid()) + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) return make_private_temp_dir();
  return buf.data();
}

void DiskCache::remove_stale() const {
  if (!dir_fd_) return;
  for (const auto& n : list_dir(dir_fd_->get())) {
    std::string pid;
    if (n.rfind("tmp-", 0) == 0) {
      pid = n.substr(4, n.find('-', 4) - 4);
    } else if (size_t at = n.find(".tmp."); at != std::string::npos) {
      size_t from = at + 5;
      pid = n.substr(from, n.find('.', from) - from);
    } else {
      continue;
    }
    if (pid_is_dead(pid)) remove_tree_at(dir_fd_->get(), n);
  }
}

std::vector<std::string> DiskCache::entry_names() const {
  std::vector<std::string> out;
  if (!dir_fd_) return out;
  for (const auto& n : list_dir(dir_fd_->get()))
    for (const char* ext : kExtensions)
      if (ends_with(n, ext) && n.find(".tmp.") == std::string::npos) out.push_back(n);
  return out;
}

bool DiskCache::remove(const std::string& name) const {
  if (!dir_fd_ || name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") return false;
  struct stat st;
  if (::fstatat(dir_fd_->get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return false;
  remove_tree_at(dir_fd_->get(), name);
  return ::fstatat(dir_fd_->get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0;
}

namespace {
const char* const kKinds[] = {"cpu", "cuda"};

// The key an entry file name was stored under: its name without the extension.
std::string key_of(const std::string& name) {
  for (const char* ext : kExtensions)
    if (ends_with(name, ext)) return name.substr(0, name.size() - std::strlen(ext));
  return name;
}
}  // namespace

CacheReport inspect_cache(bool verify) {
  CacheReport r;
  r.root = cache_root();
  for (const char* kind : kKinds) {
    DiskCache c(kind);
    CacheReport::Kind k;
    k.name = kind;
    k.dir = c.dir();
    k.refused = c.refused_because();
    if (c.usable()) {
      for (const auto& n : list_dir(c.dir_fd_->get())) {
        struct stat st;
        if (::fstatat(c.dir_fd_->get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
          k.bytes += static_cast<uint64_t>(st.st_size);
      }
      for (const auto& n : c.entry_names()) {
        ++k.entries;
        if (!verify) continue;
        std::string why = c.check(n, key_of(n));
        if (!why.empty()) k.bad.emplace_back(c.dir() + "/" + n, why);
      }
    }
    r.kinds.push_back(std::move(k));
  }
  return r;
}

int clear_cache() {
  int removed = 0;
  for (const char* kind : kKinds) {
    DiskCache c(kind);
    if (!c.usable()) continue;
    for (const auto& n : list_dir(c.dir_fd_->get()))
      if (c.remove(n)) ++removed;
  }
  return removed;
}

}  // namespace optfuse
