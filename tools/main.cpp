// The optfuse command-line program: explain a chain, check a backend against the reference
// evaluator, benchmark a chain on a workload.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "optfuse/error.h"

namespace {

const char* kUsage =
    "usage: optfuse <command> [arguments]\n"
    "  explain SPEC [--backend cpu|cuda] [--compile] [--arch 90]\n"
    "      print the IR after passes, the plan (phases, bytes per element) and the generated source\n"
    "  check [SPEC] [--backend cpu|cuda|reference] [--steps 10]\n"
    "      run SPEC (default: adamw) on a small default set of tensors and compare with the reference evaluator\n"
    "  bench [--chain SPEC] [--workload gpt2-small|llama-1b|many-small|one-big|cpu-default] [--backend cpu|cuda]\n"
    "        [--scale F] [--dtype float32|bfloat16|float16] [--steps N] [--warmup N] [--threads N] [--json FILE]\n"
    "      time a step and report it as a fraction of the measured copy-bandwidth floor\n"
    "SPEC example: \"chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))\"\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  optfuse::cli::Argv args(argv + 2, argv + argc);
  try {
    if (cmd == "explain") return optfuse::cli::explain_command(args);
    if (cmd == "check") return optfuse::cli::check_command(args);
    if (cmd == "bench") return optfuse::cli::bench_command(args);
    std::fprintf(stderr, "optfuse: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optfuse %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
