// The optfuse command-line program: explain a chain, check a backend against the reference
// evaluator, benchmark a chain on a workload.
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"
#include "optfuse/error.h"

namespace {

const char* kUsage =
    "usage: optfuse <command> [arguments]\n"
    "  explain SPEC [--backend cpu|cuda] [--source | --source-only] [--compile] [--arch 90]\n"
    "      print the chain, its passes, the IR after them and the plan (phases, bytes per element, schedule);\n"
    "      --source: also the generated C++ (cpu) or CUDA source; --source-only: that source alone;\n"
    "      --compile (cuda): compile it with NVRTC for sm_<arch> and print each kernel's registers and spills\n"
    "  check [SPEC] [--backend cpu|cuda|reference] [--dtype float32|float64|bfloat16|float16] [--steps 10]\n"
    "      run SPEC (default: adamw) on a small default set of tensors and compare with the reference evaluator\n"
    "  bench [--chain SPEC] [--workload gpt2-small|llama-1b|many-small|one-big|cpu-default] [--backend cpu|cuda]\n"
    "        [--scale F] [--dtype float32|float64|bfloat16|float16] [--steps N] [--warmup N] [--threads N] [--json FILE]\n"
    "      time a step and report it as a fraction of the measured copy-bandwidth floor\n"
    "  cache [--verify] [--clear]\n"
    "      where the kernel cache is, its size and entries; --verify checks every entry; --clear removes them\n"
    "SPEC example: \"chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))\"\n";

// `optfuse CMD --help`: CMD's lines of kUsage (its "  CMD ..." line and the indented ones after it).
bool print_command_usage(const std::string& cmd) {
  const std::string text = kUsage;
  size_t at = text.find("\n  " + cmd + " ");
  if (at == std::string::npos) at = text.find("\n  " + cmd + "\n");
  if (at == std::string::npos) return false;
  size_t end = at + 1;
  do end = text.find('\n', end) + 1;
  while (end < text.size() && text.compare(end, 3, "   ") == 0);
  std::fputs(("usage: optfuse " + text.substr(at + 3, end - at - 3)).c_str(), stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  optfuse::cli::Argv args(argv + 2, argv + argc);
  for (const std::string& a : args)
    if ((a == "-h" || a == "--help") && print_command_usage(cmd)) return 0;
  try {
    if (cmd == "explain") return optfuse::cli::explain_command(args);
    if (cmd == "check") return optfuse::cli::check_command(args);
    if (cmd == "bench") return optfuse::cli::bench_command(args);
    if (cmd == "cache") return optfuse::cli::cache_command(args);
    std::fprintf(stderr, "optfuse: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optfuse %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
