// Subcommands of the optfuse program. Each takes the arguments after its name.
#pragma once
#include <string>
#include <vector>

namespace optfuse::cli {

using Argv = std::vector<std::string>;

int explain_command(const Argv& args);  // optfuse explain SPEC [--backend cpu|cuda] [--source|--source-only] [--compile] [--arch N]
int check_command(const Argv& args);    // optfuse check [SPEC] [--backend B] [--dtype D] [--steps N]
int bench_command(const Argv& args);    // optfuse bench [--chain SPEC] [--workload W] [--backend B] ...
int cache_command(const Argv& args);    // optfuse cache [--verify] [--clear]

// Small shared helpers for option parsing: "--name value" pairs and flags.
struct Options {
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> named;  // in order; flags have value "1"
  std::string get(const std::string& name, const std::string& fallback) const;
  bool flag(const std::string& name) const;
};
// `flags` lists options that take no value; any other --option takes the next argument. Unknown
// options (not in `known`) are an error.
Options parse_options(const Argv& args, const std::vector<std::string>& known, const std::vector<std::string>& flags);

}  // namespace optfuse::cli
