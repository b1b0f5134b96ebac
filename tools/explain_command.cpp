// optfuse explain SPEC: the chain, its passes, the IR after them and the plan (phases, bytes per
// element, step schedule), so that people can read what their chain turns into; the generated
// source with --source, or the source alone with --source-only (to compile or diff it).
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
  // --no-source was the way to leave the source out before that became the default; still accepted.
  Options o = parse_options(args, {"backend", "arch"}, {"compile", "source", "source-only", "no-source"});
  if (o.positional.size() != 1) throw Error("explain takes one SPEC, e.g. optfuse explain \"adamw(lr=1e-3)\"");
  std::string backend = o.get("backend", "cpu");
  if (backend != "cpu" && backend != "cuda") throw Error("explain --backend must be cpu or cuda");
  const bool source = o.flag("source"), source_only = o.flag("source-only");
  if (o.flag("no-source") && (source || source_only)) throw Error("--no-source contradicts --source/--source-only");
  if (source_only && (source || o.flag("compile")))
    throw Error("--source-only prints the generated source alone: it takes neither --source nor --compile");
  const Chain chain = parse_chain(o.positional[0]);
  if (source_only) {
    std::cout << explain_source(chain, backend);
    return 0;
  }
  std::cout << explain_text(chain, backend, source);
  if (!source) std::cout << "\n(the generated " << backend << " source: add --source, or --source-only for it alone)\n";
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
