// SHA-256 throughput of optfuse's own code (src/runtime/sha256.cpp), to compare with
// `openssl speed -bytes N sha256` on the same machine. `sha256_speed [bytes] [ms]`: hashes a
// buffer of `bytes` (default 65536, the size of a kernel and its source) repeatedly for about
// `ms` milliseconds (default 300) with the SHA extensions (if the CPU has them) and with the
// portable code, three rounds each, alternating; prints the best MB/s of each (1 MB = 1e6 bytes,
// as openssl) per second of this process's CPU time, as `openssl speed` counts by default (on a
// machine shared with other work, wall time counts the time other processes had the cores; that
// figure is printed too, and `openssl speed -elapsed` is its counterpart). Not built by CMake:
//   c++ -O2 -std=c++17 -Isrc bench/sha256_speed.cpp src/runtime/sha256.cpp -o /tmp/sha256_speed
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <ctime>

#include "runtime/sha256.h"

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 65536;
  const double ms = argc > 2 ? std::atof(argv[2]) : 300;
  std::string data(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  const bool accel = optfuse::sha256_accelerated();
  auto cpu_s = [] {
    timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  double best[2] = {0, 0}, best_wall[2] = {0, 0};
  unsigned sink = 0;
  for (int round = 0; round < 3; ++round)
    for (int mode = accel ? 0 : 1; mode < 2; ++mode) {
      optfuse::sha256_use_accelerated(mode == 0);
      const auto w0 = std::chrono::steady_clock::now();
      const double c0 = cpu_s();
      double s = 0;
      size_t n = 0;
      do {
        sink += optfuse::sha256(data.data(), data.size())[0];
        ++n;
        s = cpu_s() - c0;
      } while (s * 1e3 < ms);
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      best[mode] = std::max(best[mode], double(n) * double(bytes) / s / 1e6);
      best_wall[mode] = std::max(best_wall[mode], double(n) * double(bytes) / wall / 1e6);
    }
  if (accel) std::printf("SHA extensions: %8.1f MB/s per CPU second, %8.1f per wall second (%zu-byte messages)\n", best[0], best_wall[0], bytes);
  std::printf("portable:       %8.1f MB/s per CPU second, %8.1f per wall second (%zu-byte messages)\n", best[1], best_wall[1], bytes);
  return sink == 12345 ? 1 : 0;
}
