#include "runtime/disk_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace optfuse {

std::string content_hash(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

static void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0755);
  }
}

static std::string cache_root() {
  if (const char* d = std::getenv("OPTFUSE_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/optfuse";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/optfuse";
  return "/tmp/optfuse-cache";
}

DiskCache::DiskCache(const std::string& subdir) : dir_(cache_root() + "/" + subdir) {}

std::string DiskCache::path_for(const std::string& key, const std::string& ext) const {
  return dir_ + "/" + key + ext;
}

std::optional<std::string> DiskCache::load(const std::string& key, const std::string& ext) const {
  std::ifstream in(path_for(key, ext), std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool DiskCache::store(const std::string& key, const std::string& ext,
                      const std::string& bytes) const {
  make_dirs(dir_);
  // Unique per process and per call, so concurrent writers (threads or processes) never share a
  // temporary file; the rename makes the finished entry appear atomically.
  static std::atomic<unsigned long> counter{0};
  std::string tmp = path_for(key, ext) + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++counter);
  {
    std::ofstream out(tmp, std::ios::binary);
    if (!out) return false;
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path_for(key, ext).c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace optfuse
