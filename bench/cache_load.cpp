// Optimizer construction with a warm kernel cache: what the cache's checks cost (issue 31).
// `cache_load N`: for each chain, one construction to fill the cache, then N timed constructions
// (each generates the source and looks the kernel up); prints the median and the mean in us.
// `cache_load first`: the first construction of each chain in this process, the disk cache warm
// (run it once before to fill the cache): the kernel is read from the cache, verified and
// dlopen'ed; one untimed construction of another chain first takes the one-time costs (finding
// the compiler, the thread pool). Prints one line of microseconds, one number per chain; run it
// in a loop of processes for a distribution. Not built by CMake: it links whichever liboptfuse.a it is given, so the
// same file measures the library before and after a change. Build and run (docs/performance.md):
//   c++ -O2 -std=c++17 -Iinclude bench/cache_load.cpp build-cache/liboptfuse.a -ldl -pthread -o /tmp/cache_load
//   export OPTFUSE_CACHE_DIR=$(mktemp -d); /tmp/cache_load 200; for i in $(seq 30); do /tmp/cache_load first; done
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/optimizer.h"

int main(int argc, char** argv) {
  const char* specs[] = {"sgd(lr=0.1)", "adamw(lr=1e-3, weight_decay=0.01)",
                         "chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))", "lamb(lr=0.1)",
                         "adafactor(lr=0.1)"};
  if (argc > 1 && std::string(argv[1]) == "first") {
    { optfuse::Optimizer warm(optfuse::parse_chain("sgd(lr=0.5, momentum=0.5)"), optfuse::Backend::cpu, 2); }
    for (const char* spec : specs) {
      optfuse::Chain chain = optfuse::parse_chain(spec);
      auto t0 = std::chrono::steady_clock::now();
      optfuse::Optimizer o(chain, optfuse::Backend::cpu, 2);
      std::printf("%.1f ", std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      if (o.backend_status().find("cached") == std::string::npos) return 1;
    }
    std::printf("\n");
    return 0;
  }
  const int n = argc > 1 ? std::atoi(argv[1]) : 200;
  for (const char* spec : specs) {
    optfuse::Chain chain = optfuse::parse_chain(spec);
    { optfuse::Optimizer warm(chain, optfuse::Backend::cpu, 2); }  // fills the cache
    std::vector<double> us;
    for (int i = 0; i < n; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      optfuse::Optimizer o(chain, optfuse::Backend::cpu, 2);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      if (i == 0 && o.backend_status().find("cached") == std::string::npos) {
        std::fprintf(stderr, "not a cache hit: %s\n", o.backend_status().c_str());
        return 1;
      }
    }
    std::sort(us.begin(), us.end());
    double mean = 0;
    for (double u : us) mean += u / n;
    std::printf("%-70s median %8.1f us  mean %8.1f us\n", spec, us[n / 2], mean);
  }
  return 0;
}
