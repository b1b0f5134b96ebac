#include "codegen/cpu_source.h"

#include <algorithm>
#include <sstream>

#include "codegen/abi.h"
#include "codegen/c_printer.h"

namespace optfuse {

namespace {

// Storage types and their loads/stores. bf16/f16 go through the prelude's conversions, written
// branch-free enough (a NaN test becomes a select) that GCC and Clang vectorise them.
const char* kCpuTables = R"(
struct of_half { unsigned short bits; };
struct of_bfloat { unsigned short bits; };
static inline float of_ld(const float* p, long long i) { return p[i]; }
static inline float of_ld(const of_half* p, long long i) { return of_f16_to_float(p[i].bits); }
static inline float of_ld(const of_bfloat* p, long long i) { return of_bf16_to_float(p[i].bits); }
static inline void of_st(float* p, long long i, float v) { p[i] = v; }
static inline void of_st(of_half* p, long long i, float v) { p[i].bits = of_float_to_f16(v); }
static inline void of_st(of_bfloat* p, long long i, float v) { p[i].bits = of_float_to_bf16(v); }
)";

struct PhaseRoles {
  std::vector<int> read, write, used;  // role indices (0 param, 1 grad, 2+s state s)
};

PhaseRoles phase_roles(const ElementPhase& ph) {
  PhaseRoles r;
  if (ph.reads_param) r.read.push_back(0);
  if (ph.reads_grad) r.read.push_back(1);
  for (int st : ph.reads_states) r.read.push_back(2 + st);
  if (ph.writes_param) r.write.push_back(0);
  for (int st : ph.writes_states) r.write.push_back(2 + st);
  r.used = r.read;
  for (int w : r.write)
    if (std::find(r.used.begin(), r.used.end(), w) == r.used.end()) r.used.push_back(w);
  return r;
}

// One element at index `idx`: load the roles the phase reads, run the element function with
// accumulators `acc`, store the roles it writes.
std::string element_body(size_t phase, const PhaseRoles& pr, const std::vector<std::string>& roles,
                         const std::string& idx, const std::string& acc, const std::string& indent) {
  std::ostringstream s;
  s << indent << "float v[OF_ROLES];\n";
  for (int r : pr.read)
    s << indent << "v[" << r << "] = of_ld(" << roles[static_cast<size_t>(r)] << "_p, " << idx << ");\n";
  s << indent << "of_phase" << phase << "_element(v, u, " << acc << ");\n";
  for (int r : pr.write)
    s << indent << "of_st(" << roles[static_cast<size_t>(r)] << "_p, " << idx << ", v[" << r << "]);\n";
  return s.str();
}

// Software prefetch. The hardware stream prefetchers stop at every 4 KiB page and must re-learn
// each of a phase's streams there; with only a few cores each core's misses in flight, not DRAM,
// limit a streaming pass. Each loop therefore runs in blocks of kPrefetchBlock bytes per role and,
// before a block, prefetches the lines of every role it touches a fixed distance ahead (prefetchw
// for roles it writes, so the later store needs no ownership upgrade). In a throwaway harness on
// a 2-core Xeon VM this sped AdamW's update up by about 5-15% and a read-only reduce phase by
// about 20-35% (docs/performance.md has the before/after of the whole generator).
// The distance keeps roughly 8 KiB per core in flight whatever the number of streams (the best
// distance measured was 2 KiB with 4 streams, 4 KiB with 1); prefetches past the end of a chunk
// are harmless (they never fault) and usually fetch the next chunk, which the same thread runs.
constexpr int kPrefetchBlock = 512;

int prefetch_distance(size_t streams) {
  int d = 8192 / static_cast<int>(std::max<size_t>(streams, 1));
  return std::clamp(d / 64 * 64, 1024, 4096);
}

std::string prefetch_block(const PhaseRoles& pr, const std::vector<std::string>& roles, const std::string& indent) {
  std::ostringstream s;
  s << indent << "for (int b = 0; b < OF_PREFETCH_BLOCK; b += 64) {\n";
  for (int r : pr.used) {
    bool written = std::find(pr.write.begin(), pr.write.end(), r) != pr.write.end();
    s << indent << "  __builtin_prefetch((const char*)(" << roles[static_cast<size_t>(r)]
      << "_p + i) + OF_PREFETCH_DISTANCE + b, " << (written ? 1 : 0) << ");\n";
  }
  s << indent << "}\n";
  return s.str();
}

}  // namespace

std::string generate_cpu_source(const Plan& plan) {
  CPrinter pr(plan, cpu_dialect());
  std::vector<std::string> roles = role_names(plan);
  // u = [derived values | this tensor's values] (c_printer.h)
  const size_t nvalues = std::max<size_t>(plan.derived.size() + plan.tensor_derived.size(), 1);
  std::ostringstream s;
  s << pr.header_comment() << "#define OF_ROLES " << pr.num_roles() << "\n#define OF_LANES " << kCpuReduceLanes
    << "\n#define OF_PREFETCH_BLOCK " << kPrefetchBlock << "\n" << pr.common_source() << abi_source() << kCpuTables;
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    const ElementPhase& ph = plan.phases[i];
    const PhaseRoles rr = phase_roles(ph);
    const size_t nred = ph.reductions.size();
    // The loops live in of_phase<i>_run, whose tensor pointers are restrict-qualified *parameters*:
    // GCC honours restrict reliably only there (on locals it still versions every loop with a
    // run-time overlap check). The derived scalars are a private float copy, which the compiler can
    // see never aliases tensor memory, so they stay in registers.
    s << "\n// Phase " << i << " over one chunk of one tensor; S is the storage type.\n"
      << "#undef OF_PREFETCH_DISTANCE\n#define OF_PREFETCH_DISTANCE " << prefetch_distance(rr.used.size()) << "\n"
      << "template <class S>\nstatic inline void of_phase" << i
      << "_run(int len, const float* __restrict u, double* __restrict acc";
    for (int r : rr.used) s << ", S* __restrict " << roles[static_cast<size_t>(r)] << "_p";
    s << ") {\n  const int block = OF_PREFETCH_BLOCK / (int)sizeof(S);  // elements per prefetch block\n"
      << "  int i = 0;\n";
    if (nred == 0) {
      s << "  double unused[1] = {0.0};\n"
        << "  while (i + block <= len) {\n" << prefetch_block(rr, roles, "    ")
        << "    for (const int e = i + block; i < e; ++i) {\n"
        << element_body(i, rr, roles, "i", "unused", "      ") << "    }\n  }\n"
        << "  for (; i < len; ++i) {\n" << element_body(i, rr, roles, "i", "unused", "    ") << "  }\n"
        << "  (void)acc; (void)unused;\n}\n";
    } else {
      // OF_LANES independent accumulators per reduction: element i of the chunk goes to lane
      // i % OF_LANES, lanes are summed in order 0..OF_LANES-1 at the end. A single running double
      // sum is a chain of dependent adds the compiler may not reorder (it would change rounding);
      // fixed lanes give it independent chains to vectorise while the result stays a function of
      // the chunk's data alone -- never of the thread count. Blocks are whole multiples of
      // OF_LANES, so blocking does not change which lane an element goes to.
      auto lanes_step = [&](const std::string& indent) {
        std::ostringstream l;
        l << indent << "for (int j = 0; j < OF_LANES; ++j) {\n" << indent << "  double a[" << nred << "];\n";
        for (size_t k = 0; k < nred; ++k) l << indent << "  a[" << k << "] = lane[" << k << "][j];\n";
        l << element_body(i, rr, roles, "i + j", "a", indent + "  ");
        for (size_t k = 0; k < nred; ++k) l << indent << "  lane[" << k << "][j] = a[" << k << "];\n";
        l << indent << "}\n";
        return l.str();
      };
      s << "  static_assert(OF_PREFETCH_BLOCK / sizeof(S) % OF_LANES == 0, \"blocks must hold whole lane rows\");\n"
        << "  double lane[" << nred << "][OF_LANES] = {};\n"
        << "  while (i + block <= len) {\n" << prefetch_block(rr, roles, "    ")
        << "    for (const int e = i + block; i < e; i += OF_LANES) {\n" << lanes_step("      ") << "    }\n  }\n"
        << "  for (; i + OF_LANES <= len; i += OF_LANES) {\n" << lanes_step("    ") << "  }\n"
        << "  for (int j = 0; i < len; ++i, ++j) {\n    double a[" << nred << "];\n";
      for (size_t k = 0; k < nred; ++k) s << "    a[" << k << "] = lane[" << k << "][j];\n";
      s << element_body(i, rr, roles, "i", "a", "    ");
      for (size_t k = 0; k < nred; ++k) s << "    lane[" << k << "][j] = a[" << k << "];\n";
      s << "  }\n";
      for (size_t k = 0; k < nred; ++k) {
        bool any = plan.program.graph.node(ph.reductions[k]).op == Op::AnyNonFinite;
        s << "  {\n    double total = 0.0;\n    for (int j = 0; j < OF_LANES; ++j) "
          << (any ? "if (lane[" + std::to_string(k) + "][j] != 0.0) total = 1.0;\n"
                  : "total += lane[" + std::to_string(k) + "][j];\n")
          << "    acc[" << k << "] = total;\n  }\n";
      }
      s << "}\n";
    }
    s << "\ntemplate <class S>\nstatic void of_phase" << i
      << "_chunk(const OfTensor& t, long long begin, int len, const double* derived_row, int nderived, "
         "const double* tensor_row, double* acc) {\n"
      << "  float u[" << nvalues << "] = {0.0f};\n"
      << "  for (int d = 0; d < " << plan.derived.size() << "; ++d) u[d] = (float)derived_row[d];\n";
    if (plan.layout.tensor_values > 0)
      s << "  of_phase" << i << "_tensor(derived_row, tensor_row, u + " << plan.derived.size() << ");  // this tensor's values\n";
    s << "  (void)nderived; (void)tensor_row;  // nderived is always " << plan.derived.size() << " (the plan's derived slots)\n"
      << "  of_phase" << i << "_run<S>(len, u, acc";
    for (int r : rr.used) s << ", (S*)t.ptr[" << r << "] + begin";
    s << ");\n}\n";
    s << "\nextern \"C\" void of_phase" << i
      << "(const OfTensor* tensors, const OfChunk* chunks, long long first, long long last, const double* derived,"
         " const double* skip, int derived_per_group, const double* tensor_reductions, int tensor_reductions_per_tensor,"
         " double* partials, long long num_chunks) {\n"
      << "  for (long long c = first; c < last; ++c) {\n"
      << "    const OfChunk ch = chunks[c];\n    const OfTensor& t = tensors[ch.tensor];\n";
    if (ph.kind == ElementPhase::Kind::Update) s << "    if (skip[t.group] != 0.0) continue;\n";
    s << "    const double* row = derived + (long long)t.group * derived_per_group;\n"
      << "    const double* trow = tensor_reductions + (long long)ch.tensor * tensor_reductions_per_tensor;\n"
      << "    double acc[" << (nred ? nred : 1) << "] = {0};\n"
      << "    switch (t.dtype) {\n"
      << "      case 0: of_phase" << i << "_chunk<float>(t, ch.begin, ch.length, row, derived_per_group, trow, acc); break;\n"
      << "      case 1: of_phase" << i << "_chunk<of_half>(t, ch.begin, ch.length, row, derived_per_group, trow, acc); break;\n"
      << "      default: of_phase" << i
      << "_chunk<of_bfloat>(t, ch.begin, ch.length, row, derived_per_group, trow, acc); break;\n"
      << "    }\n";
    for (size_t k = 0; k < nred; ++k) s << "    partials[" << k << " * num_chunks + c] = acc[" << k << "];\n";
    s << "  }\n  (void)partials; (void)num_chunks; (void)skip; (void)tensor_reductions;\n}\n";
  }
  return s.str();
}

}  // namespace optfuse
