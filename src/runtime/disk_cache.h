// Content-hash disk cache for compiled artifacts (CUDA cubins, host shared objects).
// Key = hash of (source text, compiler identity, options). Files live under
// $OPTFUSE_CACHE_DIR, else $XDG_CACHE_HOME/optfuse, else ~/.cache/optfuse. Writes go to a temporary
// file renamed into place, so concurrent processes never read a half-written entry.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace optfuse {

// 64-bit FNV-1a, printed as 16 hex digits: stable across runs and machines.
std::string content_hash(const std::string& text);

class DiskCache {
 public:
  // `subdir` separates artifact kinds ("cuda", "cpu").
  explicit DiskCache(const std::string& subdir);
  const std::string& dir() const { return dir_; }
  // Path an entry with this key and file extension has (whether or not it exists).
  std::string path_for(const std::string& key, const std::string& ext) const;
  std::optional<std::string> load(const std::string& key, const std::string& ext) const;
  // Best effort: a read-only or missing cache directory is not an error (returns false).
  bool store(const std::string& key, const std::string& ext, const std::string& bytes) const;

 private:
  std::string dir_;
};

}  // namespace optfuse
