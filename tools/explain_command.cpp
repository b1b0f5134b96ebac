// optfuse explain SPEC: the IR after passes, the plan and the generated source, so that people
// can read what their chain turns into.
#include <cstdio>
#include <iostream>

#include "codegen/abi.h"
#include "codegen/cpu_source.h"
#include "codegen/cuda_source.h"
#include "codegen/explain.h"
#include "commands.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "runtime/cuda_api.h"

namespace optfuse::cli {

int explain_command(const Argv& args) {
  Options o = parse_options(args, {"backend", "arch"}, {"compile", "no-source"});
  if (o.positional.size() != 1) throw Error("explain takes one SPEC, e.g. optfuse explain \"adamw(lr=1e-3)\"");
  std::string backend = o.get("backend", "cpu");
  if (backend != "cpu" && backend != "cuda") throw Error("explain --backend must be cpu or cuda");
  const Chain chain = parse_chain(o.positional[0]);
  std::cout << explain_text(chain, backend, !o.flag("no-source"));
  if (o.flag("compile")) {
    if (backend != "cuda") throw Error("--compile is for --backend cuda (the CPU source is compiled on first use)");
    int arch = std::stoi(o.get("arch", "90"));
    for (const Plan& plan : explain_plans(chain)) {  // a matrix chain's two parts
      cuda::CompileResult r = cuda::compile(generate_cuda_source(plan), "optfuse_explain", arch, {"--fmad=false"});
      std::cout << "\n== NVRTC compile of " << plan.program.chain_text << " for sm_" << arch << ": " << r.cubin.size()
                << " bytes of cubin in " << r.seconds << " s" << (r.from_cache ? " (from cache)" : "") << "\n";
      for (const std::string& k : cuda_kernel_names(plan)) {
        auto res = cuda::resources_from_cubin(r.cubin, k);
        if (res)
          std::cout << "  " << k << ": " << res->registers << " registers, " << res->local_bytes
                    << " bytes local memory (spills), " << res->shared_bytes << " bytes shared\n";
        else
          std::cout << "  " << k << ": resource use not readable from the cubin\n";
      }
    }
  }
  return 0;
}

}  // namespace optfuse::cli
