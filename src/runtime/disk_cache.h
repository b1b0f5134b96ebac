// The on-disk cache of compiled artifacts (host shared objects, CUDA cubins): only what this user
// compiled is ever loaded from it.
//
// Where: $OPTFUSE_CACHE_DIR, else $XDG_CACHE_HOME/optfuse, else $HOME/.cache/optfuse, else
// ${TMPDIR:-/tmp}/optfuse-cache-<uid>; one subdirectory per artifact kind ("cpu", "cuda"). Missing
// directories are created with mode 0700.
//
// Trust: the cache directory and its subdirectory must be owned by the effective user and not
// writable by group or others, else the cache is refused (usable() is false; callers compile into
// a private temporary directory) with one warning per process. Entries are opened relative to the
// checked directory with O_NOFOLLOW and must be regular files owned by the user, not writable by
// group or others.
//
// Integrity: an entry is the artifact followed by a trailer (kTrailerSize bytes: a magic, the
// SHA-256 of the key it was stored under, the payload size and the payload's SHA-256). load()
// checks all of it; a bad entry (wrong owner or mode, symlink, truncated, other contents, stored
// under another key) is removed with a warning and reported as missing, so the caller rebuilds it.
//
// Writers write a temporary file inside the directory and rename it into place, so readers never
// see half an entry; lock() serialises compiles of one key across processes.
#pragma once
#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/sha256.h"

namespace optfuse {

struct CacheReport;

// An owned file descriptor (closed on destruction).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Prints "optfuse: <message>" to stderr the first time `topic` is warned about in this process.
void warn_once(const std::string& topic, const std::string& message);

// The cache's root directory as configured by the environment (see above); nothing is created.
std::string cache_root();

// Empty if a file or directory with this status may be trusted: owned by the effective user, not
// writable by group or others (and of the expected type); else why not.
std::string untrusted_reason(const struct stat& st, bool directory);

// Removes a directory tree without following symlinks (best effort).
void remove_tree(const std::string& path);

// A private temporary directory ${TMPDIR:-/tmp}/optfuse-cc-<pid>-XXXXXX (mode 0700). Leftovers of
// processes that died (kill -9) are removed by the next call in any process of this user.
std::string make_private_temp_dir();

class DiskCache {
 public:
  static constexpr size_t kTrailerSize = 16 + 32 + 8 + 32;

  struct Entry {
    UniqueFd fd;             // open on the verified entry (the trailer follows the payload)
    uint64_t payload_size = 0;
    Sha256::Digest digest{};  // of the payload
    std::string payload;     // only if load() was asked for the bytes
  };

  // `subdir` separates artifact kinds ("cuda", "cpu"). Creates the directories if needed and
  // checks them; never throws.
  explicit DiskCache(const std::string& subdir);
  bool usable() const { return bool(dir_fd_); }
  const std::string& dir() const { return dir_; }
  const std::string& refused_because() const { return refused_; }  // empty when usable
  // Path an entry with this key and file extension has (whether or not it exists).
  std::string path_for(const std::string& key, const std::string& ext) const;

  // The verified entry, or nullopt if there is none; a bad one is removed (with a warning).
  std::optional<Entry> load(const std::string& key, const std::string& ext, bool want_payload) const;
  // Best effort: a read-only or full cache directory is not an error (returns false, leaves nothing).
  // `payload_digest`: the payload's SHA-256 if the caller has it already (not hashed twice).
  bool store(const std::string& key, const std::string& ext, const std::string& payload,
             const Sha256::Digest* payload_digest = nullptr) const;

  // Why the file `name` of this directory is not a good entry for `key`; empty if it is. With
  // `out`, fills it (fd, sizes, digest and, if `want_payload`, the bytes).
  std::string check(const std::string& name, const std::string& key, Entry* out = nullptr,
                    bool want_payload = false) const;

  // Holds an exclusive flock on "<key>.lock" beside the entry until destroyed. A lock file whose
  // holder died is not stale (the kernel drops a dead process's flock), so only a holder that is
  // alive but stuck is a problem: after `timeout_s` (OPTFUSE_CACHE_LOCK_TIMEOUT, default 600 s)
  // the caller goes on without the lock (the compile is then done twice, the result is the same).
  class Lock {
   public:
    Lock() = default;
    Lock(Lock&&) noexcept = default;
    Lock& operator=(Lock&&) noexcept;
    ~Lock();
    bool held() const { return bool(fd_); }

   private:
    friend class DiskCache;
    void unlock();
    UniqueFd fd_;
    int dir_fd_ = -1;
    std::string name_;
  };
  Lock lock(const std::string& key) const;

  // A work directory inside the cache, "tmp-<pid>-XXXXXX", for a compile whose outputs may be
  // left behind by a kill -9: remove_stale() of a later process removes it. Falls back to a
  // private temporary directory if the cache is unusable or has little free space left.
  std::string make_work_dir() const;
  // Removes work directories and temporary entry files of processes that no longer run.
  void remove_stale() const;

  // The entries (files named <key><ext> for the known extensions), sorted, and removal.
  std::vector<std::string> entry_names() const;
  bool remove(const std::string& name) const;

 private:
  friend CacheReport inspect_cache(bool);
  friend int clear_cache();
  std::string dir_, refused_;
  std::shared_ptr<UniqueFd> dir_fd_;  // shared with later DiskCaches of this process (disk_cache.cpp)
};

// What `optfuse cache` shows: per artifact kind ("cpu", "cuda"), where, how big, which entries
// fail their checks (only with `verify`: that reads and hashes every entry).
struct CacheReport {
  struct Kind {
    std::string name, dir, refused;  // refused: why the directory is not used (empty if it is)
    uint64_t bytes = 0;               // entries and anything else in the directory
    int entries = 0;
    std::vector<std::pair<std::string, std::string>> bad;  // (entry path, why)
  };
  std::string root;
  std::vector<Kind> kinds;
};
CacheReport inspect_cache(bool verify);
// Removes every entry, lock and leftover temporary file of the cache (not the directories);
// returns how many were removed. A refused directory is left alone.
int clear_cache();

}  // namespace optfuse
