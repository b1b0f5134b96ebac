// Optimizer construction with a warm kernel cache: what the cache's checks cost (issue 31).
// `cache_load N`: for each chain, one construction to fill the cache, then N timed constructions
// (each generates the source and looks the kernel up); prints the median and the mean in us of
// wall time, and the median of the thread's CPU time.
// `cache_load first`: the first construction of each chain in this process, the disk cache warm
// (run it once before to fill the cache): the kernel is read from the cache, verified and
// dlopen'ed; one untimed construction of another chain first takes the one-time costs (finding
// the compiler, the thread pool). Prints one line "wall: <us per chain> cpu: <us per chain>":
// wall-clock time and the constructing thread's CPU time (CLOCK_THREAD_CPUTIME_ID, which on a
// machine shared with other work leaves out the time other processes had the core); run it in a
// loop of processes for a distribution (bench/cache_load_compare.py does, alternating libraries).
// Not built by CMake: it links whichever liboptfuse.a it is given, so the same file measures the
// library before and after a change. Build and run (docs/performance.md):
//   c++ -O2 -std=c++17 -Iinclude bench/cache_load.cpp build-cache2/liboptfuse.a -ldl -pthread -o /tmp/cache_load
//   export OPTFUSE_CACHE_DIR=$(mktemp -d); /tmp/cache_load 200; for i in $(seq 30); do /tmp/cache_load first; done
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <ctime>

#include "optfuse/builtin_rules.h"
#include "optfuse/optimizer.h"

static double thread_cpu_us() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e6 * double(t.tv_sec) + 1e-3 * double(t.tv_nsec);
}

int main(int argc, char** argv) {
  const char* specs[] = {"sgd(lr=0.1)", "adamw(lr=1e-3, weight_decay=0.01)",
                         "chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))", "lamb(lr=0.1)",
                         "adafactor(lr=0.1)"};
  if (argc > 1 && std::string(argv[1]) == "first") {
    { optfuse::Optimizer warm(optfuse::parse_chain("sgd(lr=0.5, momentum=0.5)"), optfuse::Backend::cpu, 2); }
    std::string wall = "wall:", cpu = " cpu:";
    for (const char* spec : specs) {
      optfuse::Chain chain = optfuse::parse_chain(spec);
      const double c0 = thread_cpu_us();
      auto t0 = std::chrono::steady_clock::now();
      optfuse::Optimizer o(chain, optfuse::Backend::cpu, 2);
      const double w = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      const double c = thread_cpu_us() - c0;
      char buf[64];
      std::snprintf(buf, sizeof buf, " %.1f", w);
      wall += buf;
      std::snprintf(buf, sizeof buf, " %.1f", c);
      cpu += buf;
      if (o.backend_status().find("cached") == std::string::npos) return 1;
    }
    std::printf("%s%s\n", wall.c_str(), cpu.c_str());
    return 0;
  }
  const int n = argc > 1 ? std::atoi(argv[1]) : 200;
  for (const char* spec : specs) {
    optfuse::Chain chain = optfuse::parse_chain(spec);
    { optfuse::Optimizer warm(chain, optfuse::Backend::cpu, 2); }  // fills the cache
    std::vector<double> us, cpu_us;
    for (int i = 0; i < n; ++i) {
      const double c0 = thread_cpu_us();
      auto t0 = std::chrono::steady_clock::now();
      optfuse::Optimizer o(chain, optfuse::Backend::cpu, 2);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      cpu_us.push_back(thread_cpu_us() - c0);
      if (i == 0 && o.backend_status().find("cached") == std::string::npos) {
        std::fprintf(stderr, "not a cache hit: %s\n", o.backend_status().c_str());
        return 1;
      }
    }
    std::sort(us.begin(), us.end());
    std::sort(cpu_us.begin(), cpu_us.end());
    double mean = 0;
    for (double u : us) mean += u / n;
    std::printf("%-70s median %8.1f us  mean %8.1f us  cpu median %8.1f us\n", spec, us[n / 2], mean, cpu_us[n / 2]);
  }
  return 0;
}
