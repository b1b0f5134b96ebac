#include "codegen/cpu_matrix_source.h"

#include <algorithm>
#include <sstream>

#include "codegen/c_printer.h"
#include "codegen/cpu_loop_parts.h"

namespace optfuse {

using namespace cpu_loops;

namespace {

// A reduction of the phase: its index in acc[] / a[], its scope and its slot in its table.
struct MatrixReduction {
  size_t k;
  Scope scope;
  int slot;
};

// The running accumulator the element function adds into (cuda_matrix_source.cpp does the same).
std::string running(const MatrixReduction& r) {
  const std::string slot = std::to_string(r.slot);
  if (r.scope == Scope::Row) return "rowacc[" + std::to_string(r.k) + "]";
  if (r.scope == Scope::Col) return "part[c * OF_COL_REDS + " + slot + "]";
  return "acc[" + std::to_string(r.k) + "]";
}

// per_matrix_values: phase i has tensor values that read a matrix's sums (of_phase<i>_tensor_matrix).
std::string chunk_function(const Plan& plan, size_t i, size_t k, const StorageVariant& var,
                           const std::vector<MatrixReduction>& reds, bool per_matrix_values) {
  const ElementPhase& ph = plan.phases[i];
  const ScalarLayout& L = plan.layout;
  const PhaseRoles rr = phase_roles(ph);
  const std::vector<std::string> roles = role_names(plan);
  const size_t nred = std::max<size_t>(ph.reductions.size(), 1);
  const bool f64 = variant_computes_f64(var);
  const std::string T = compute_type(var), cast = f64 ? "" : "(float)";
  const size_t nvalues = std::max<size_t>(plan.derived.size() + static_cast<size_t>(L.tensor_values + L.row_values + L.col_values), 1);
  std::ostringstream s;
  s << "\n// Phase " << i << ", variant " << k << " of a matrix plan: " << describe_variant(var, roles) << "\n"
    << "static void of_phase" << i << "_v" << k
    << "_mchunk(const OfTensor& t, const OfMatrix& m, long long chunk_in_tensor, long long begin, int len, "
       "const double* derived_row, const double* tensor_row, const double* matrix_sums, int sums_per_matrix, double step, "
       "double* acc, double* row_red, double* col_part, const double* row_val, const double* col_val) {\n"
    << "  " << T << " u[" << nvalues << "] = {" << (f64 ? "0.0" : "0.0f") << "};\n"
    << "  for (int d = 0; d < " << plan.derived.size() << "; ++d) u[d] = (" << T << ")derived_row[d];\n"
    << "  double shape[4];\n  of_shape(t, m, shape);\n"
    << "  const long long C = m.cols, r0 = begin / C;  // the chunk: rows [r0, r0 + rows) of the view\n"
    << "  const int rows = (int)(len / C);\n"
    << "  const long long first_elem = t.rng_offset + begin;\n"
    << "  const unsigned long long rng = "
    << (phase_rounds_stochastically(rr, var) ? "of_rng_base(t.rng_key, (unsigned long long)step)" : "0") << ";\n"
    << "  (void)tensor_row; (void)matrix_sums; (void)sums_per_matrix; (void)shape; (void)step; (void)rng; (void)first_elem;"
       " (void)row_red; (void)col_part; (void)row_val; (void)col_val;\n";
  for (int r : rr.used) {
    const std::string type = storage_type(var[static_cast<size_t>(r)].dtype);
    s << "  " << type << "* __restrict " << roles[static_cast<size_t>(r)] << "_p = (" << type << "*)t.ptr[" << r << "] + begin;\n";
  }
  bool col_reds = false;
  for (const MatrixReduction& r : reds) col_reds = col_reds || r.scope == Scope::Col;
  // The chunk holds rows of one matrix of the view, or several whole small matrices
  // (matrix_tables.h): entering a matrix sets its first column, its tensor values (they may read its
  // sums of row values: all of them for the chunk's first matrix, then only those) and its column
  // partials (the chunk's own where a matrix has several chunks, else the matrix's; every slot
  // zeroed: an earlier pass's were combined before this one).
  s << "  long long mb = -1, col0 = 0;\n  double* part = col_part;\n  (void)col0; (void)part;\n";
  s << "  for (int r = 0; r < rows; ++r) {\n"
    << "    if ((r0 + r) / m.matrix_rows != mb) {\n"
    << "      const bool first = mb < 0;\n      (void)first;\n"
    << "      mb = (r0 + r) / m.matrix_rows;\n      col0 = m.col_offset + mb * C;\n";
  if (L.tensor_values > 0) {
    const std::string args = "(derived_row, tensor_row, matrix_sums + (m.matrix_offset + mb) * sums_per_matrix, shape, u + " +
                             std::to_string(plan.derived.size()) + ");\n";
    s << "      if (first) of_phase" << i << "_tensor" << f64_suffix(f64) << args;
    if (per_matrix_values) s << "      else of_phase" << i << "_tensor_matrix" << f64_suffix(f64) << args;
  }
  if (col_reds)
    s << "      part = col_part + (m.colpart_offset + (m.chunks_per_matrix > 1 ? chunk_in_tensor : mb) * C) * OF_COL_REDS;\n"
      << "      for (long long x = 0; x < C * OF_COL_REDS; ++x) part[x] = 0.0;\n";
  s << "    }\n";
  for (size_t q = 0; q < plan.row_derived.size(); ++q)
    s << "    u[" << plan.derived_slot.at(plan.row_derived[q]) << "] = " << cast << "row_val[(m.row_offset + r0 + r) * OF_ROW_VALUES + " << q
      << "];\n";
  s << "    double rowacc[" << nred << "] = {0.0};\n"
    << "    const long long e0 = (long long)r * C;\n"
    << "    for (long long c = 0; c < C; ++c) {\n";
  for (size_t q = 0; q < plan.col_derived.size(); ++q)
    s << "      u[" << plan.derived_slot.at(plan.col_derived[q]) << "] = " << cast << "col_val[(col0 + c) * OF_COL_VALUES + " << q
      << "];\n";
  s << "      double a[" << nred << "];\n";
  if (reds.empty()) s << "      a[0] = 0.0;\n";
  for (const MatrixReduction& r : reds) s << "      a[" << r.k << "] = " << running(r) << ";\n";
  s << element_body(element_function_name(plan, i, true, f64), rr, var, roles, "e0 + c", "a", "      ");
  for (const MatrixReduction& r : reds) s << "      " << running(r) << " = a[" << r.k << "];\n";
  s << "    }\n";
  for (const MatrixReduction& r : reds)
    if (r.scope == Scope::Row)
      s << "    row_red[(m.row_offset + r0 + r) * OF_ROW_REDS + " << r.slot << "] = rowacc[" << r.k << "];\n";
  s << "    (void)rowacc;\n  }\n}\n";
  return s.str();
}

// Phase i's Values step over matrices [k0, k1) of the tensor list (the host thread pool splits
// them): per matrix, its tensor values (they may read its sums), then its rows in order (values and
// their sums), then its columns in order. The interpreter's run_values_step<float> does the same
// math in the same order (bitwise equal: test_matrix_scope.cpp).
std::string values_function(const Plan& plan, size_t i, const std::vector<StorageVariant>& variants, bool per_matrix_values) {
  const ScalarLayout& L = plan.layout;
  const int limit = plan.value_level_limit(plan.phases[i]);
  const size_t D = plan.derived.size();
  const size_t nvalues = std::max<size_t>(D + static_cast<size_t>(L.tensor_values + L.row_values + L.col_values), 1);
  std::ostringstream s;
  for (size_t k = 0; k < variants.size(); ++k) {  // the Rows or Cols states of element x, as float (double: float64 math)
    s << "\nstatic inline void of_values" << i << "_states_v" << k << "(const OfTensor& t, long long x, bool cols, "
      << compute_type(variants[k]) << "* st) {\n";
    for (int side = 0; side < 2; ++side) {
      s << (side == 0 ? "  if (cols) {\n" : "  } else {\n");
      const StateShape want = side == 0 ? StateShape::Cols : StateShape::Rows;
      for (size_t st = 0; st < plan.program.states.size(); ++st)
        if (plan.program.states[st].shape == want)
          s << "    st[" << st << "] = of_ld((const " << storage_type(variants[k][2 + st].dtype) << "*)t.ptr[" << 2 + st << "], x);\n";
    }
    s << "  }\n  (void)t; (void)x; (void)st;\n}\n";
  }
  // Row (column) x of matrix b: its states, its values from them and its reductions, its share of sums.
  // f64: the loop of tensors whose variant computes in float64 (its variants' state loads only).
  auto line = [&](bool cols, bool f64) {
    const std::string x = cols ? "m.col_offset + b * C + x" : "m.row_offset + b * R + x";
    const std::vector<NodeId>& outs = cols ? plan.col_derived : plan.row_derived;
    std::ostringstream o;
    o << "      for (long long x = 0; x < " << (cols ? "C" : "R") << "; ++x) {\n        switch (t.variant) {\n";
    for (size_t k = 0; k < variants.size(); ++k)
      if (variant_computes_f64(variants[k]) == f64)
        o << "          case " << k << ": of_values" << i << "_states_v" << k << "(t, b * " << (cols ? "C" : "R")
          << " + x, " << (cols ? "true" : "false") << ", st); break;\n";
    o << "          default: break;\n        }\n"
      << "        of_phase" << i << (cols ? "_cols" : "_rows") << f64_suffix(f64) << (cols ? "(u, st, col_red + (" : "(u, st, row_red + (")
      << x << ") * " << (cols ? "OF_COL_REDS" : "OF_ROW_REDS") << ", out, sums);\n";
    for (size_t q = 0; q < outs.size(); ++q)
      if (plan.level[static_cast<size_t>(outs[q])] <= limit)
        o << "        " << (cols ? "col_val[(" : "row_val[(") << x << ") * " << (cols ? "OF_COL_VALUES + " : "OF_ROW_VALUES + ")
          << q << "] = out[" << q << "];\n";
    o << "      }\n";
    return o.str();
  };
  // One tensor's matrices [b0, b1) in float32 (f64: float64) math.
  auto body = [&](bool f64, const std::string& indent) {
    const std::string T = f64 ? "double" : "float";
    std::ostringstream o;
    o << "    " << T << " u[" << nvalues << "] = {" << (f64 ? "0.0" : "0.0f") << "};\n"
      << "    for (int d = 0; d < " << D << "; ++d) u[d] = (" << T << ")row[d];\n"
      << "    double shape[4];\n    of_shape(t, m, shape);\n"
      << "    " << T << " st[OF_ROLES];\n    " << T << " out[" << std::max({L.row_values, L.col_values, 1}) << "];\n"
      << "    (void)shape; (void)st; (void)out; (void)tensor_reductions; (void)tensor_reductions_per_tensor;\n"
      << "    for (long long b = b0; b < b1; ++b) {\n"
      << "      double* const ws = matrix_sums + (m.matrix_offset + b) * tensor_reductions_per_tensor;\n      (void)ws;\n";
    if (L.tensor_values > 0) {  // all of them for the first matrix, then those that read its sums
      const std::string args = "(row, tensor_reductions + ti * tensor_reductions_per_tensor, ws, shape, u + " + std::to_string(D) + ");\n";
      o << "      if (b == b0) of_phase" << i << "_tensor" << f64_suffix(f64) << args;
      if (per_matrix_values) o << "      else of_phase" << i << "_tensor_matrix" << f64_suffix(f64) << args;
    }
    o << "      double sums[" << std::max(L.tensor_reductions, 1) << "] = {0.0};\n" << line(false, f64) << line(true, f64);
    for (size_t r = 0; r < plan.reductions.size(); ++r) {  // this matrix's sums of row and column values
      const NodeId node = plan.reductions[r];
      if (plan.is_value_reduction(node) && plan.level[static_cast<size_t>(node)] <= limit)
        o << "      ws[" << plan.reduction_area_slot[r] << "] = sums[" << plan.reduction_area_slot[r] << "];\n";
    }
    o << "      (void)sums;\n    }\n";
    if (indent.empty()) return o.str();
    // Indented one level more (inside the float64 branch).
    std::string text = o.str(), out;
    size_t at = 0;
    while (at < text.size()) {
      const size_t nl = text.find('\n', at);
      out += indent + text.substr(at, nl - at + 1);
      at = nl + 1;
    }
    return out;
  };
  const bool any_f64 = any_variant_computes_f64(variants);
  s << "\n// The Values step before pass " << i << " (levels <= " << limit << ")\n"
    << "extern \"C\" void of_values" << i
    << "(const OfTensor* tensors, const OfMatrix* mats, long long num_tensors, long long total_matrices, long long k0, "
       "long long k1, const double* derived, int derived_per_group, const double* tensor_reductions, "
       "int tensor_reductions_per_tensor, const double* row_red, const double* col_red, double* row_val, double* col_val, "
       "double* matrix_sums) {\n"
    << "  long long lo = 0, hi = num_tensors - 1;  // the last tensor whose first matrix is <= k0\n"
    << "  while (lo < hi) {\n    const long long mid = (lo + hi + 1) / 2;\n"
    << "    if (mats[mid].matrix_offset <= k0) lo = mid; else hi = mid - 1;\n  }\n"
    << "  for (long long ti = lo; ti < num_tensors && mats[ti].matrix_offset < k1; ++ti) {\n"
    << "    const OfTensor& t = tensors[ti];\n    const OfMatrix& m = mats[ti];\n"
    << "    if (t.numel == 0) continue;  // no rows: its column (if any) has no values either\n"
    << "    const long long end = ti + 1 < num_tensors ? mats[ti + 1].matrix_offset : total_matrices;\n"
    << "    const long long b0 = (k0 > m.matrix_offset ? k0 : m.matrix_offset) - m.matrix_offset;\n"
    << "    const long long b1 = (k1 < end ? k1 : end) - m.matrix_offset;\n"
    << "    const long long C = m.cols, R = m.matrix_rows;\n"
    << "    const double* row = derived + (long long)t.group * derived_per_group;\n";
  if (any_f64) {  // tensors whose variant computes in float64: their own loop
    s << "    bool f64 = false;\n    switch (t.variant) {\n";
    for (size_t k = 0; k < variants.size(); ++k)
      if (variant_computes_f64(variants[k])) s << "      case " << k << ":\n";
    s << "        f64 = true;\n        break;\n      default: break;\n    }\n"
      << "    if (f64) {\n" << body(true, "  ") << "      continue;\n    }\n";
  }
  s << body(false, "") << "  }\n  (void)row_red; (void)col_red; (void)row_val; (void)col_val;\n}\n";
  return s.str();
}

}  // namespace

std::string cpu_matrix_phase_source(const Plan& plan, size_t i, const std::vector<StorageVariant>& variants) {
  const ElementPhase& ph = plan.phases[i];
  std::vector<MatrixReduction> reds;
  for (size_t k = 0; k < ph.reductions.size(); ++k) {
    const size_t r = plan.reduction_index(ph.reductions[k]);
    reds.push_back({k, plan.scope_of(r), plan.reduction_area_slot[r]});
  }
  const size_t nred = ph.reductions.size();
  std::ostringstream s;
  const CPrinter printer(plan, cpu_dialect());
  const std::string per_matrix = printer.per_matrix_tensor_function(i);
  s << per_matrix;
  if (any_variant_computes_f64(variants)) s << printer.per_matrix_tensor_function(i, true);
  for (size_t k = 0; k < variants.size(); ++k) s << chunk_function(plan, i, k, variants[k], reds, !per_matrix.empty());
  s << "\nextern \"C\" void of_phase" << i
    << "(const OfTensor* tensors, const OfChunk* chunks, long long first, long long last, const double* derived,"
       " const double* skip, const double* steps, int derived_per_group, const double* tensor_reductions,"
       " int tensor_reductions_per_tensor, double* partials, long long num_chunks, const OfMatrix* mats,"
       " double* row_red, double* col_part, const double* row_val, const double* col_val, const double* matrix_sums) {\n"
    << "  for (long long c = first; c < last; ++c) {\n"
    << "    const OfChunk ch = chunks[c];\n    const OfTensor& t = tensors[ch.tensor];\n";
  if (ph.kind == ElementPhase::Kind::Update) s << "    if (skip[t.group] != 0.0) continue;\n";
  s << "    const double* row = derived + (long long)t.group * derived_per_group;\n"
    << "    const double* trow = tensor_reductions + (long long)ch.tensor * tensor_reductions_per_tensor;\n"
    << "    const OfMatrix& m = mats[ch.tensor];\n"

    << "    double acc[" << std::max<size_t>(nred, 1) << "] = {0};\n"
    << "    switch (t.variant) {\n";
  for (size_t k = 0; k < variants.size(); ++k)
    s << "      case " << k << ": of_phase" << i << "_v" << k << "_mchunk(t, m, c - t.first_chunk, ch.begin, ch.length, row, trow, matrix_sums, tensor_reductions_per_tensor, "
      << "steps[t.group], acc, row_red, col_part, row_val, col_val); break;\n";
  s << "      default: break;  // every tensor's variant is compiled (the executor guarantees it)\n    }\n";
  for (size_t k = 0; k < nred; ++k) s << "    partials[" << k << " * num_chunks + c] = acc[" << k << "];\n";
  s << "  }\n  (void)partials; (void)num_chunks; (void)skip; (void)steps; (void)tensor_reductions; (void)derived;\n}\n";
  s << values_function(plan, i, variants, !per_matrix.empty());
  return s.str();
}

}  // namespace optfuse
