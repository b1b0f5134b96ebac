#include "codegen/cpu_source.h"

#include <sstream>

#include "codegen/c_printer.h"

namespace optfuse {

namespace {

const char* kCpuTables = R"(
struct OfTensor { void* ptr[OF_ROLES]; long long numel; int group; int dtype; };
struct OfChunk { long long begin; int tensor; int length; };
struct of_half { unsigned short bits; };
struct of_bfloat { unsigned short bits; };
static inline float of_ld(const float* p, long long i) { return p[i]; }
static inline float of_ld(const of_half* p, long long i) { return of_f16_to_float(p[i].bits); }
static inline float of_ld(const of_bfloat* p, long long i) { return of_bf16_to_float(p[i].bits); }
static inline void of_st(float* p, long long i, float v) { p[i] = v; }
static inline void of_st(of_half* p, long long i, float v) { p[i].bits = of_float_to_f16(v); }
static inline void of_st(of_bfloat* p, long long i, float v) { p[i].bits = of_float_to_bf16(v); }
)";

}  // namespace

std::string generate_cpu_source(const Plan& plan) {
  CPrinter pr(plan, cpu_dialect());
  std::vector<std::string> roles = role_names(plan);
  std::ostringstream s;
  s << pr.header_comment() << "#define OF_ROLES " << pr.num_roles() << "\n" << pr.common_source() << kCpuTables;
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    const ElementPhase& ph = plan.phases[i];
    std::vector<int> read_roles, write_roles;
    if (ph.reads_param) read_roles.push_back(0);
    if (ph.reads_grad) read_roles.push_back(1);
    for (int st : ph.reads_states) read_roles.push_back(2 + st);
    if (ph.writes_param) write_roles.push_back(0);
    for (int st : ph.writes_states) write_roles.push_back(2 + st);
    std::vector<int> used = read_roles;
    for (int r : write_roles)
      if (std::find(used.begin(), used.end(), r) == used.end()) used.push_back(r);
    size_t nred = ph.reductions.size();
    s << "\ntemplate <class S>\nstatic void of_phase" << i
      << "_chunk(const OfTensor& t, long long begin, int len, const float* u, double* acc) {\n";
    for (int r : used)
      s << "  S* __restrict " << roles[static_cast<size_t>(r)] << "_p = (S*)t.ptr[" << r << "] + begin;\n";
    s << "  for (int i = 0; i < len; ++i) {\n    float v[OF_ROLES];\n";
    for (int r : read_roles) s << "    v[" << r << "] = of_ld(" << roles[static_cast<size_t>(r)] << "_p, i);\n";
    s << "    of_phase" << i << "_element(v, u, acc);\n";
    for (int r : write_roles) s << "    of_st(" << roles[static_cast<size_t>(r)] << "_p, i, v[" << r << "]);\n";
    s << "  }\n  (void)acc;\n}\n";
    s << "\nextern \"C\" void of_phase" << i
      << "(const OfTensor* tensors, const OfChunk* chunks, long long first, long long last, const double* derived,"
         " const double* skip, int derived_per_group, double* partials, long long num_chunks) {\n"
      << "  float u[" << (plan.derived.empty() ? 1 : plan.derived.size()) << "];\n"
      << "  for (long long c = first; c < last; ++c) {\n"
      << "    const OfChunk ch = chunks[c];\n    const OfTensor& t = tensors[ch.tensor];\n";
    if (ph.kind == ElementPhase::Kind::Update) s << "    if (skip[t.group] != 0.0) continue;\n";
    s << "    for (int d = 0; d < derived_per_group; ++d) u[d] = (float)derived[t.group * derived_per_group + d];\n"
      << "    double acc[" << (nred ? nred : 1) << "] = {0};\n"
      << "    switch (t.dtype) {\n"
      << "      case 0: of_phase" << i << "_chunk<float>(t, ch.begin, ch.length, u, acc); break;\n"
      << "      case 1: of_phase" << i << "_chunk<of_half>(t, ch.begin, ch.length, u, acc); break;\n"
      << "      default: of_phase" << i << "_chunk<of_bfloat>(t, ch.begin, ch.length, u, acc); break;\n"
      << "    }\n";
    for (size_t k = 0; k < nred; ++k) s << "    partials[" << k << " * num_chunks + c] = acc[" << k << "];\n";
    s << "  }\n  (void)partials; (void)num_chunks; (void)skip;\n}\n";
  }
  return s.str();
}

}  // namespace optfuse
