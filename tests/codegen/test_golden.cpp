// Golden generated sources: what optfuse generates for a few chains, compared exactly with files
// in tests/golden/, so that any change to generated code is seen in review as a diff of those
// files. OPTFUSE_UPDATE_GOLDEN=1 rewrites them (see tests/golden/README.md).
//
// Two dialects per chain: the complete CPU source (generate_cpu_source) and, for CUDA, only the
// part CPrinter shares between dialects (prelude, scalar and element functions); the CUDA driver
// kernels are still being written and are not pinned here yet.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/c_printer.h"
#include "codegen/cpu_source.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/plan.h"

namespace optfuse {
namespace {

const std::string kGoldenDir = std::string(OPTFUSE_SOURCE_DIR) + "/tests/golden/";

bool updating() {
  const char* v = std::getenv("OPTFUSE_UPDATE_GOLDEN");
  return v && std::string(v) == "1";
}

std::string read_file(const std::string& path, bool* ok) {
  std::ifstream in(path, std::ios::binary);
  *ok = in.good();
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// First differing line, so a failure says where without dumping two whole sources.
std::string first_difference(const std::string& want, const std::string& got) {
  std::istringstream a(want), b(got);
  std::string la, lb;
  for (int line = 1;; ++line) {
    bool ea = !std::getline(a, la), eb = !std::getline(b, lb);
    if (ea && eb) return "no line differs (line endings?)";
    if (ea || eb || la != lb)
      return "line " + std::to_string(line) + ":\n  golden:    " + (ea ? "<end of file>" : la) +
             "\n  generated: " + (eb ? "<end of file>" : lb);
  }
}

void check_golden(const std::string& file, const std::string& generated) {
  std::string path = kGoldenDir + file;
  if (updating()) {
    std::ofstream out(path, std::ios::binary);
    out << generated;
    ASSERT_TRUE(out.good()) << "cannot write " << path;
    std::printf("  rewrote %s\n", path.c_str());
    return;
  }
  bool ok = false;
  std::string want = read_file(path, &ok);
  ASSERT_TRUE(ok) << path << " is missing; run with OPTFUSE_UPDATE_GOLDEN=1 to create it";
  EXPECT_TRUE(want == generated) << path << " differs from the generated source at "
                                 << first_difference(want, generated)
                                 << "\nIf the change is intended, rerun with OPTFUSE_UPDATE_GOLDEN=1 and review the diff.";
}

struct GoldenChain {
  const char* file;  // base name in tests/golden/
  Chain (*make)();
  std::vector<const char*> names;  // values the generated code must call by the rule's names
};

const std::vector<GoldenChain>& golden_chains() {
  static const std::vector<GoldenChain> g = {
      {"adamw", [] { return adamw(); },
       {"exp_avg_new", "exp_avg_sq_new", "denom", "inv_bias_correction1", "bias_correction2_sqrt", "weight_decay",
        "param_new"}},
      {"clip_adamw", [] { return chain({clip_by_global_norm(1.0), adamw()}); },
       {"global_norm", "clip_coef", "max_norm", "exp_avg_new", "denom"}},
      {"sgd_nesterov", [] { return sgd({{"momentum", 0.9}, {"nesterov", true}}); },
       {"momentum_buffer_new", "momentum", "lr", "param_new"}},
      {"lion", [] { return lion(); }, {"lion_direction", "exp_avg_new", "b1", "b2", "lr"}},
  };
  return g;
}

TEST(Golden, CpuSources) {
  for (const GoldenChain& g : golden_chains()) {
    SCOPED_TRACE(g.file);
    check_golden(std::string(g.file) + ".cpu.cpp.txt", generate_cpu_source(make_plan(g.make())));
  }
}

TEST(Golden, CudaCommonSources) {
  for (const GoldenChain& g : golden_chains()) {
    SCOPED_TRACE(g.file);
    Plan plan = make_plan(g.make());
    check_golden(std::string(g.file) + ".cuda_common.cpp.txt", CPrinter(plan, cuda_dialect()).common_source());
  }
}

// Generation is a pure function of the plan: twice the same text.
TEST(Golden, GenerationIsDeterministic) {
  for (const GoldenChain& g : golden_chains()) {
    EXPECT_EQ(generate_cpu_source(make_plan(g.make())), generate_cpu_source(make_plan(g.make()))) << g.file;
  }
}

// Hyperparameter values are run-time data: chains that differ only in values generate the same
// source (and so share one compiled object); options that change the math do not.
TEST(Golden, HyperparameterValuesAreNotCode) {
  auto cpu = [](const char* spec) { return generate_cpu_source(make_plan(parse_chain(spec))); };
  EXPECT_EQ(cpu("adamw(lr=1e-3)"), cpu("adamw(lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.5)"));
  EXPECT_EQ(cpu("chain(clip_by_global_norm(1.0), sgd(lr=0.1, momentum=0.9))"),
            cpu("chain(clip_by_global_norm(5.0), sgd(lr=-0.0, momentum=0.5))"));
  EXPECT_NE(cpu("adamw()"), cpu("adamw(amsgrad=true)"));
  EXPECT_NE(cpu("adamw()"), cpu("adamw(weight_decay=0)"));  // no decay rule at all
  std::string src = cpu("adam(lr=0.123, amsgrad=true)");
  EXPECT_NE(src.find("// chain: chain(scale_by_adam(b1, b2, eps, amsgrad=true), scale_by_learning_rate(lr))\n"),
            std::string::npos)
      << src.substr(0, 300);
  EXPECT_EQ(src.find("0.123"), std::string::npos);
}

// Generated code reads like the rules: every value a rule named is declared under that name, in the
// dialect-independent part (so CUDA gets the same names).
TEST(Golden, NamesReadLikeTheRules) {
  for (const GoldenChain& g : golden_chains()) {
    SCOPED_TRACE(g.file);
    Plan plan = make_plan(g.make());
    std::string cpu = generate_cpu_source(plan), cuda = CPrinter(plan, cuda_dialect()).common_source();
    for (const char* n : g.names) {
      std::regex decl("const (float|double) " + std::string(n) + " = ");
      EXPECT_TRUE(std::regex_search(cpu, decl)) << n << " is not declared in the CPU source";
      EXPECT_TRUE(std::regex_search(cuda, decl)) << n << " is not declared in the CUDA common source";
    }
  }
}

// The dialects differ only in the small Dialect table: qualifiers, finiteness test, extra prelude.
TEST(Golden, DialectsShareTheMath) {
  Plan plan = make_plan(chain({clip_by_global_norm(1.0), adamw()}));
  CPrinter cpu(plan, cpu_dialect()), cuda(plan, cuda_dialect());
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    EXPECT_EQ(cpu.element_function(i), cuda.element_function(i)) << "phase " << i;
    EXPECT_EQ(cpu.scalar_function(i), cuda.scalar_function(i)) << "phase " << i;
  }
  EXPECT_NE(cuda.prelude().find("#define OF_FN __device__ __forceinline__"), std::string::npos);
  EXPECT_NE(cpu.prelude().find("#define OF_FN static inline"), std::string::npos);
  std::string cpu_src = generate_cpu_source(plan);
  EXPECT_NE(cpu_src.find(cpu.common_source()), std::string::npos) << "the CPU source embeds the common part";
}

}  // namespace
}  // namespace optfuse
