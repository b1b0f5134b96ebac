// optfuse cache [--verify] [--clear]: where the kernel cache is, its size and entry count;
// --verify checks every entry as a load would (exit status 1 if any is bad); --clear removes them.
#include <cstdio>

#include "commands.h"
#include "optfuse/error.h"
#include "runtime/disk_cache.h"

namespace optfuse::cli {

int cache_command(const Argv& args) {
  Options o = parse_options(args, {}, {"verify", "clear"});
  if (!o.positional.empty()) throw Error("cache takes no arguments, only --verify and --clear");
  if (o.flag("clear")) std::printf("removed %d file(s)\n", clear_cache());
  const bool verify = o.flag("verify");
  CacheReport r = inspect_cache(verify);
  std::printf("cache: %s\n", r.root.c_str());
  int bad = 0;
  for (const auto& k : r.kinds) {
    if (!k.refused.empty()) {
      std::printf("  %-5s %s: not used: %s\n", k.name.c_str(), k.dir.c_str(), k.refused.c_str());
      continue;
    }
    std::printf("  %-5s %s: %d entr%s, %.1f KiB\n", k.name.c_str(), k.dir.c_str(), k.entries,
                k.entries == 1 ? "y" : "ies", static_cast<double>(k.bytes) / 1024);
    for (const auto& [path, why] : k.bad) std::printf("    bad: %s %s\n", path.c_str(), why.c_str());
    bad += static_cast<int>(k.bad.size());
  }
  if (verify) std::printf("%s\n", bad ? (std::to_string(bad) + " bad entr" + (bad == 1 ? "y" : "ies") + " (a run removes and rebuilds them)").c_str() : "all entries verified");
  return bad ? 1 : 0;
}

}  // namespace optfuse::cli
