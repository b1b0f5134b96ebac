#include "codegen/cpu_source.h"

#include <algorithm>
#include <sstream>

#include "codegen/abi.h"
#include "optfuse/error.h"
#include "codegen/c_printer.h"
#include "codegen/cpu_loop_parts.h"
#include "codegen/cpu_matrix_source.h"

namespace optfuse {

namespace cpu_loops {

const char* storage_type(DType d) {
  switch (d) {
    case DType::f32: return "float";
    case DType::f16: return "of_half";
    case DType::bf16: return "of_bfloat";
    case DType::i16: return "of_i16";
    case DType::f64: return "double";
    case DType::q8: return "signed char";  // the codes; the block scales are a float pointer beside them
  }
  return "?";
}

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

bool phase_rounds_stochastically(const PhaseRoles& pr, const StorageVariant& v) {
  for (int r : pr.write)
    if (v[static_cast<size_t>(r)].stochastic) return true;
  return false;
}

std::string element_body(const std::string& fn, const PhaseRoles& pr, const StorageVariant& var,
                         const std::vector<std::string>& roles, const std::string& idx, const std::string& acc,
                         const std::string& indent) {
  std::ostringstream s;
  s << indent << compute_type(var) << " v[OF_ROLES];\n";
  for (int r : pr.read)
    s << indent << "v[" << r << "] = of_ld(" << roles[static_cast<size_t>(r)] << "_p, " << idx << ");\n";
  s << indent << fn << "(v, u, " << acc << ");\n";
  for (int r : pr.write) {
    const std::string& nm = roles[static_cast<size_t>(r)];
    if (var[static_cast<size_t>(r)].stochastic)
      s << indent << "of_st_sr(" << nm << "_p, " << idx << ", v[" << r << "], of_rng_bits(rng, (unsigned long long)(first_elem + "
        << idx << "), " << r << "));\n";
    else
      s << indent << "of_st(" << nm << "_p, " << idx << ", v[" << r << "]);\n";
  }
  return s.str();
}

}  // namespace cpu_loops

using namespace cpu_loops;

namespace {

// Storage types and their loads/stores. bf16/f16 go through the prelude's conversions, written
// branch-free enough (a NaN test becomes a select) that GCC and Clang vectorise them. int16 holds
// master-weight remainders (integers, stored exactly). of_st_sr: stochastic rounding with random
// bits r (low_precision_code.h).
const char* kCpuTables = R"(
struct of_half { unsigned short bits; };
struct of_bfloat { unsigned short bits; };
struct of_i16 { short bits; };
static inline float of_ld(const float* p, long long i) { return p[i]; }
static inline float of_ld(const of_half* p, long long i) { return of_f16_to_float(p[i].bits); }
static inline float of_ld(const of_bfloat* p, long long i) { return of_bf16_to_float(p[i].bits); }
static inline float of_ld(const of_i16* p, long long i) { return (float)p[i].bits; }
static inline void of_st(float* p, long long i, float v) { p[i] = v; }
static inline void of_st(of_half* p, long long i, float v) { p[i].bits = of_float_to_f16(v); }
static inline void of_st(of_bfloat* p, long long i, float v) { p[i].bits = of_float_to_bf16(v); }
static inline void of_st(of_i16* p, long long i, float v) { p[i].bits = (short)(int)v; }
static inline void of_st_sr(of_half* p, long long i, float v, unsigned r) { p[i].bits = of_float_to_f16_sr(v, r); }
static inline void of_st_sr(of_bfloat* p, long long i, float v, unsigned r) { p[i].bits = of_float_to_bf16_sr(v, r); }
)";

// float64 roles (only in sources with a variant that computes in float64: the others, and their
// compile keys, stay as they were). Such a variant's values are double: a narrower role widens
// exactly on load and rounds through float on store.
const char* kCpuFloat64Tables = R"(
static inline double of_ld(const double* p, long long i) { return p[i]; }
static inline void of_st(double* p, long long i, double v) { p[i] = v; }
)";

// Software prefetch. The hardware stream prefetchers stop at every 4 KiB page and must re-learn
// each of a phase's streams there; with only a few cores each core's misses in flight, not DRAM,
// limit a streaming pass. Each loop therefore runs in blocks of kPrefetchBlock bytes of its widest
// role and, before a block, prefetches the lines of every role it touches a fixed distance ahead
// (prefetchw for roles it writes, so the later store needs no ownership upgrade). In a throwaway
// harness on a 2-core Xeon VM this sped AdamW's update up by about 5-15% and a read-only reduce
// phase by about 20-35% (docs/performance.md has the before/after of the whole generator).
// The distance keeps roughly 8 KiB per core in flight whatever the number of streams (the best
// distance measured was 2 KiB with 4 streams, 4 KiB with 1); prefetches past the end of a chunk
// are harmless (they never fault) and usually fetch the next chunk, which the same thread runs.
constexpr int kPrefetchBlock = 512;

int prefetch_distance(size_t streams) {
  int d = 8192 / static_cast<int>(std::max<size_t>(streams, 1));
  return std::clamp(d / 64 * 64, 1024, 4096);
}

std::string prefetch_block(const PhaseRoles& pr, const StorageVariant& var, const std::vector<std::string>& roles,
                           const std::string& indent) {
  std::ostringstream s;
  for (int r : pr.used) {
    bool written = std::find(pr.write.begin(), pr.write.end(), r) != pr.write.end();
    const size_t bytes = dtype_size(var[static_cast<size_t>(r)].dtype);
    s << indent << "for (int b = 0; b < block * " << bytes << "; b += 64) __builtin_prefetch((const char*)("
      << roles[static_cast<size_t>(r)] << "_p + i) + OF_PREFETCH_DISTANCE + b, " << (written ? 1 : 0) << ");\n";
  }
  return s.str();
}

// The end of a loop with reductions: each reduction's OF_LANES lanes folded in lane order into acc.
std::string lane_totals(const Plan& plan, const ElementPhase& ph) {
  std::ostringstream s;
  for (size_t q = 0; q < ph.reductions.size(); ++q) {
    const Op op = plan.program.graph.node(ph.reductions[q]).op;
    const std::string lane = "lane[" + std::to_string(q) + "][j]";
    s << "  {\n    double total = 0.0;\n    for (int j = 0; j < OF_LANES; ++j) "
      << (op == Op::AnyNonFinite ? "if (" + lane + " != 0.0) total = 1.0;\n"
          : op == Op::MaxAbs     ? "total = of_max(total, " + lane + ");\n"
                                 : "total += " + lane + ";\n")
      << "    acc[" << q << "] = total;\n  }\n";
  }
  return s.str();
}

// The loop of a variant with q8 roles (optfuse/dtype.h): a block of OF_Q8_BLOCK elements at a time
// (chunks start at multiples of it). A q8 role is read as its code times the block's scale from
// before the step, and written by keeping the block's new values, then folding their scale and
// encoding them once the block is done. Reductions go to lane i % OF_LANES, as in the other loop,
// so a pass's sums do not depend on how its tensors are stored.
std::string q8_run_body(const Plan& plan, const ElementPhase& ph, const PhaseRoles& rr, const StorageVariant& var,
                        const std::vector<std::string>& roles, const std::string& element_fn, const std::string& T) {
  const size_t nred = ph.reductions.size();
  auto q8 = [&](int r) { return var[static_cast<size_t>(r)].dtype == DType::q8; };
  auto nm = [&](int r) { return roles[static_cast<size_t>(r)]; };
  std::ostringstream s;
  s << "  (void)block; (void)i;\n";
  if (nred) s << "  double lane[" << nred << "][OF_LANES] = {};\n";
  s << "  for (int b0 = 0; b0 < len; b0 += OF_Q8_BLOCK) {\n"
    << "    const int bn = len - b0 < OF_Q8_BLOCK ? len - b0 : OF_Q8_BLOCK;\n";
  for (int r : rr.read)
    if (q8(r)) s << "    const float " << nm(r) << "_os = " << nm(r) << "_s[b0 / OF_Q8_BLOCK];  // the block's scale before the step\n";
  for (int r : rr.write)
    if (q8(r)) s << "    " << T << " " << nm(r) << "_nv[OF_Q8_BLOCK];  // the block's new values\n";
  s << "    for (int j = 0; j < bn; ++j) {\n      const int e = b0 + j;\n      " << T << " v[OF_ROLES];\n";
  for (int r : rr.read) {
    if (q8(r))
      s << "      v[" << r << "] = (" << T << ")of_q8_decode(" << nm(r) << "_p[e], " << nm(r) << "_os);\n";
    else
      s << "      v[" << r << "] = of_ld(" << nm(r) << "_p, e);\n";
  }
  if (nred) {
    s << "      double a[" << nred << "];\n";
    for (size_t q = 0; q < nred; ++q) s << "      a[" << q << "] = lane[" << q << "][e % OF_LANES];\n";
    s << "      " << element_fn << "(v, u, a);\n";
    for (size_t q = 0; q < nred; ++q) s << "      lane[" << q << "][e % OF_LANES] = a[" << q << "];\n";
  } else {
    s << "      double unused[1] = {0.0};\n      " << element_fn << "(v, u, unused);\n";
  }
  for (int r : rr.write) {
    if (q8(r))
      s << "      " << nm(r) << "_nv[j] = v[" << r << "];\n";
    else if (var[static_cast<size_t>(r)].stochastic)
      s << "      of_st_sr(" << nm(r) << "_p, e, v[" << r << "], of_rng_bits(rng, (unsigned long long)(first_elem + e), " << r << "));\n";
    else
      s << "      of_st(" << nm(r) << "_p, e, v[" << r << "]);\n";
  }
  s << "    }\n";
  for (int r : rr.write) {
    if (!q8(r)) continue;
    const std::string n = nm(r);
    s << "    {\n      float scale = 0.0f;\n"
      << "      for (int j = 0; j < bn; ++j) scale = of_q8_fold_scale(scale, (float)" << n << "_nv[j]);\n"
      << "      " << n << "_s[b0 / OF_Q8_BLOCK] = scale;\n"
      << "      for (int j = 0; j < bn; ++j) " << n << "_p[b0 + j] = (signed char)of_q8_encode((float)" << n << "_nv[j], scale);\n"
      << "    }\n";
  }
  s << "  }\n";
  s << lane_totals(plan, ph);
  if (!nred) s << "  (void)acc;\n";
  s << "}\n";
  return s.str();
}

// Phase i's loops for storage variant k: of_phase<i>_v<k>_run (restrict-qualified pointer
// parameters) and of_phase<i>_v<k>_chunk (one chunk of one tensor).
std::string phase_variant_functions(const Plan& plan, size_t i, size_t k, const StorageVariant& var,
                                    const std::vector<std::string>& roles) {
  const bool ahead = variant_runs_states_ahead(plan, var);
  const ElementPhase& ph = plan.phase_for(i, ahead);
  const bool f64 = variant_computes_f64(var);
  const std::string T = compute_type(var);
  const std::string element_fn = element_function_name(plan, i, ahead, f64);
  const PhaseRoles rr = phase_roles(ph);
  const size_t nred = ph.reductions.size();
  const size_t nvalues = std::max<size_t>(plan.derived.size() + plan.tensor_derived.size(), 1);
  size_t widest = 1;
  for (int r : rr.used) widest = std::max(widest, dtype_size(var[static_cast<size_t>(r)].dtype));
  const std::string fn = "of_phase" + std::to_string(i) + "_v" + std::to_string(k);
  std::ostringstream s;
  // The loops live in <fn>_run, whose tensor pointers are restrict-qualified *parameters*:
  // GCC honours restrict reliably only there (on locals it still versions every loop with a
  // run-time overlap check). The derived scalars are a private float copy, which the compiler can
  // see never aliases tensor memory, so they stay in registers.
  s << "\n// Phase " << i << ", variant " << k << ": " << describe_variant(var, roles) << "\n"
    << "static inline void " << fn << "_run(int len, const " << T << "* __restrict u, double* __restrict acc, "
    << "unsigned long long rng, long long first_elem";
  const bool q8 = variant_has_q8(var);
  for (int r : rr.used) {
    s << ", " << storage_type(var[static_cast<size_t>(r)].dtype) << "* __restrict " << roles[static_cast<size_t>(r)] << "_p";
    if (var[static_cast<size_t>(r)].dtype == DType::q8) s << ", float* __restrict " << roles[static_cast<size_t>(r)] << "_s";
  }
  s << ") {\n  const int block = " << kPrefetchBlock / widest << ";  // elements per prefetch block\n"
    << "  int i = 0;\n  (void)rng; (void)first_elem;\n";
  if (q8) {
    s << q8_run_body(plan, ph, rr, var, roles, element_fn, T);
  } else if (nred == 0) {
    s << "  double unused[1] = {0.0};\n"
      << "  while (i + block <= len) {\n" << prefetch_block(rr, var, roles, "    ")
      << "    for (const int e = i + block; i < e; ++i) {\n"
      << element_body(element_fn, rr, var, roles, "i", "unused", "      ") << "    }\n  }\n"
      << "  for (; i < len; ++i) {\n" << element_body(element_fn, rr, var, roles, "i", "unused", "    ") << "  }\n"
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
      for (size_t q = 0; q < nred; ++q) l << indent << "  a[" << q << "] = lane[" << q << "][j];\n";
      l << element_body(element_fn, rr, var, roles, "i + j", "a", indent + "  ");
      for (size_t q = 0; q < nred; ++q) l << indent << "  lane[" << q << "][j] = a[" << q << "];\n";
      l << indent << "}\n";
      return l.str();
    };
    s << "  static_assert(" << kPrefetchBlock / widest << " % OF_LANES == 0, \"blocks must hold whole lane rows\");\n"
      << "  double lane[" << nred << "][OF_LANES] = {};\n"
      << "  while (i + block <= len) {\n" << prefetch_block(rr, var, roles, "    ")
      << "    for (const int e = i + block; i < e; i += OF_LANES) {\n" << lanes_step("      ") << "    }\n  }\n"
      << "  for (; i + OF_LANES <= len; i += OF_LANES) {\n" << lanes_step("    ") << "  }\n"
      << "  for (int j = 0; i < len; ++i, ++j) {\n    double a[" << nred << "];\n";
    for (size_t q = 0; q < nred; ++q) s << "    a[" << q << "] = lane[" << q << "][j];\n";
    s << element_body(element_fn, rr, var, roles, "i", "a", "    ");
    for (size_t q = 0; q < nred; ++q) s << "    lane[" << q << "][j] = a[" << q << "];\n";
    s << "  }\n";
    s << lane_totals(plan, ph);
    s << "}\n";
  }
  s << "\nstatic void " << fn
    << "_chunk(const OfTensor& t, long long begin, int len, const double* derived_row, const double* tensor_row, "
       "double step, double* acc) {\n"
    << "  " << T << " u[" << nvalues << "] = {" << (f64 ? "0.0" : "0.0f") << "};\n"
    << "  for (int d = 0; d < " << plan.derived.size() << "; ++d) u[d] = (" << T << ")derived_row[d];\n";
  if (plan.layout.tensor_values > 0)
    s << "  of_phase" << i << "_tensor" << f64_suffix(f64) << "(derived_row, tensor_row, u + " << plan.derived.size()
      << ");  // this tensor's values\n";
  s << "  (void)tensor_row; (void)step;\n";
  if (phase_rounds_stochastically(rr, var))  // (an update pass: states written ahead are float32)
    s << "  const unsigned long long rng = of_rng_base(t.rng_key, (unsigned long long)step);\n";
  else
    s << "  const unsigned long long rng = 0;\n";
  s << "  " << fn << "_run(len, u, acc, rng, t.rng_offset + begin";
  for (int r : rr.used) {
    s << ", (" << storage_type(var[static_cast<size_t>(r)].dtype) << "*)t.ptr[" << r << "] + begin";
    if (var[static_cast<size_t>(r)].dtype == DType::q8)  // (chunks start at multiples of OF_Q8_BLOCK)
      s << ", (float*)((char*)t.ptr[" << r << "] + of_q8_scales_offset(t.numel)) + begin / OF_Q8_BLOCK";
  }
  s << ");\n}\n";
  return s.str();
}

}  // namespace

std::string generate_cpu_source(const Plan& plan) { return generate_cpu_source(plan, default_variants(plan)); }

std::string generate_cpu_source(const Plan& plan, const std::vector<StorageVariant>& variants) {
  CPrinter pr(plan, cpu_dialect());
  std::vector<std::string> roles = role_names(plan);
  std::ostringstream s;
  s << pr.header_comment() << "#define OF_ROLES " << pr.num_roles() << "\n#define OF_LANES " << kCpuReduceLanes
    << "\n" << pr.common_source(any_variant_computes_f64(variants)) << abi_source() << layout_source(plan) << kCpuTables
    << (any_variant_computes_f64(variants) ? kCpuFloat64Tables : "");
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    if (plan.matrix()) {  // row by row over whole-row chunks (cpu_matrix_source.h)
      s << cpu_matrix_phase_source(plan, i, variants);
      continue;
    }
    const ElementPhase& ph = plan.phases[i];
    const size_t nred = ph.reductions.size();
    s << "\n#undef OF_PREFETCH_DISTANCE\n#define OF_PREFETCH_DISTANCE " << prefetch_distance(phase_roles(ph).used.size()) << "\n";
    for (size_t k = 0; k < variants.size(); ++k) s << phase_variant_functions(plan, i, k, variants[k], roles);
    // steps: each group's step count, already advanced for this step by the scalar phase.
    s << "\nextern \"C\" void of_phase" << i
      << "(const OfTensor* tensors, const OfChunk* chunks, long long first, long long last, const double* derived,"
         " const double* skip, const double* steps, int derived_per_group, const double* tensor_reductions,"
         " int tensor_reductions_per_tensor, double* partials, long long num_chunks) {\n"
      << "  for (long long c = first; c < last; ++c) {\n"
      << "    const OfChunk ch = chunks[c];\n    const OfTensor& t = tensors[ch.tensor];\n";
    if (ph.kind == ElementPhase::Kind::Update) s << "    if (skip[t.group] != 0.0) continue;\n";
    s << "    const double* row = derived + (long long)t.group * derived_per_group;\n"
      << "    const double* trow = tensor_reductions + (long long)ch.tensor * tensor_reductions_per_tensor;\n"
      << "    double acc[" << (nred ? nred : 1) << "] = {0};\n"
      << "    switch (t.variant) {\n";
    for (size_t k = 0; k < variants.size(); ++k)
      s << "      case " << k << ": of_phase" << i << "_v" << k
        << "_chunk(t, ch.begin, ch.length, row, trow, steps[t.group], acc); break;\n";
    s << "      default: break;  // every tensor's variant is compiled (the executor guarantees it)\n    }\n";
    for (size_t k = 0; k < nred; ++k) s << "    partials[" << k << " * num_chunks + c] = acc[" << k << "];\n";
    s << "  }\n  (void)partials; (void)num_chunks; (void)skip; (void)steps; (void)tensor_reductions; (void)derived;\n}\n";
  }
  return s.str();
}

}  // namespace optfuse
