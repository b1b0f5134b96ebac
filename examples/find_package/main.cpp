// The smallest use of an installed optfuse: a SPEC, float32 tensors the caller owns, a few steps on
// the CPU backend, and a check against the reference evaluator. Exit status 0 when they agree.
#include <cmath>
#include <cstdio>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"

int main() {
  using namespace optfuse;
  try {
    Chain c = parse_chain("chain(clip_by_global_norm(1.0), adamw(lr=1e-2, weight_decay=0.1))");
    const int n = 4097;
    double worst = 0;
    std::vector<float> results[2];
    int k = 0;
    for (Backend b : {Backend::cpu, Backend::reference}) {
      Optimizer opt(c, b);
      std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
      for (int i = 0; i < n; ++i) p[i] = std::sin(0.01f * static_cast<float>(i));
      opt.set_tensors({TensorRef{{p.data(), n, DType::f32}, {g.data(), n, DType::f32},
                                 {{m.data(), n, DType::f32}, {v.data(), n, DType::f32}}, 0}});
      for (int step = 1; step <= 5; ++step) {
        for (int i = 0; i < n; ++i) g[i] = std::cos(0.3f * static_cast<float>(i) + static_cast<float>(step));
        opt.step();
      }
      std::printf("%-9s %s: param[1] = %.8f after %lld steps\n", backend_name(b), opt.backend_status().c_str(),
                  p[1], static_cast<long long>(opt.step_count(0)));
      results[k++] = p;
    }
    for (int i = 0; i < n; ++i) worst = std::fmax(worst, std::fabs(results[0][i] - results[1][i]));
    bool ok = worst <= 1e-6;
    std::printf("%s: largest difference %.3g\n", ok ? "OK" : "MISMATCH", worst);
    return ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "optfuse error: %s\n", e.what());
    return 1;
  }
}
