#include "codegen/abi.h"

#include <algorithm>
#include <sstream>

#include "optfuse/error.h"

namespace optfuse {

std::string layout_source(const Plan& plan) {
  const ScalarLayout& L = plan.layout;
  std::ostringstream s;
  // Each count, and (_ARRAY) the size of an array holding one entry's slots: at least 1, as C++
  // has no empty arrays.
  auto count = [&](const char* name, int n) {
    s << "#define OF_" << name << " " << n << "\n#define OF_" << name << "_ARRAY " << std::max(n, 1) << "\n";
  };
  s << "\n// The plan's layout (ScalarLayout in plan.h, printed from it): every count of slots the host\n"
    << "// tables and the generated code share\n";
  count("HYPERS", L.hypers_per_group);          // per group, in the scalar table
  count("DERIVED", L.derived_per_group);        // per group: uniform values element code reads
  s << "#define OF_REDUCTIONS " << L.reductions << "\n";              // global scope, in the scalar table
  s << "#define OF_USTATES " << L.uniform_states_per_group << "\n";   // per group, in the scalar table
  count("TENSOR_REDUCTIONS", L.tensor_reductions);  // per tensor, in the tensor-reductions table
  count("ROW_REDS", L.row_reductions);          // per row of a matrix view, in the row table
  count("COL_REDS", L.col_reductions);          // per column (and per chunk: its partials)
  count("ROW_VALUES", L.row_values);
  count("COL_VALUES", L.col_values);
  // The uniform inputs of element code, u[]: derived values, tensor values, row values, column values.
  s << "#define OF_VALUES_ARRAY " << std::max(L.derived_per_group + L.tensor_values + L.row_values + L.col_values, 1) << "\n"
    << "#define OF_ROW_U (OF_DERIVED + " << L.tensor_values << ")  // u[OF_ROW_U + k]: row value k\n"
    << "#define OF_COL_U (OF_ROW_U + OF_ROW_VALUES)  // u[OF_COL_U + k]: column value k\n";
  // Each area's offset in the scalar table as a + b * groups, read from the layout itself (its
  // offsets are affine in G).
  auto area = [&](const char* name, int (ScalarLayout::*offset)(int) const) {
    const long long a = (L.*offset)(0), b = (L.*offset)(1) - a;
    s << "OF_FN long long of_" << name << "_offset(int groups) { return " << a << "LL + (long long)groups * " << b << "LL; }\n";
  };
  s << "// The scalar table: globals[" << kNumGlobals << "] | reductions[R] | hypers[G x H] | steps[G] | skip[G] | "
    << "ustate[G x S] | derived[G x D]\n"
    << "OF_FN long long of_reductions_offset() { return " << L.reductions_offset() << "LL; }\n"
    << "OF_FN long long of_hypers_offset() { return " << L.hypers_offset() << "LL; }\n";
  area("steps", &ScalarLayout::steps_offset);
  area("skip", &ScalarLayout::skip_offset);
  area("ustate", &ScalarLayout::uniform_states_offset);
  area("derived", &ScalarLayout::derived_offset);
  return s.str();
}

std::string abi_source() {
  // q8 storage (optfuse/dtype.h): the block size and where a buffer's scales start.
  const std::string q8 = "\n#define OF_Q8_BLOCK " + std::to_string(kQ8Block) + "\n#define OF_Q8_ALIGN " +
                         std::to_string(kQ8ScalesAlign) +
                         "\nOF_FN long long of_q8_scales_offset(long long n) { return (n + OF_Q8_ALIGN - 1) / OF_Q8_ALIGN * OF_Q8_ALIGN; }\n";
  return q8 + R"(
// Shared with the runtime (codegen/abi.h): tensor-table rows are plain 64-bit words.
struct OfTensor {
  void* ptr[OF_ROLES]; long long numel; int group; int variant; int first_chunk; int num_chunks;
  unsigned long long rng_key; long long rng_offset;
};
struct OfChunk { long long begin; int tensor; int length; };
// A matrix plan's tensor: its matrix view (a batch of matrices of matrix_rows rows; whole_matrices:
// small ones, whole in each chunk) and where its rows, columns, column partials and matrices are in
// the row, column and matrix-sum tables (DeviceMatrix in runtime/matrix_tables.h). Column b * cols + c
// is column c of matrix b.
struct OfMatrix {
  long long cols, is_matrix, row_offset, col_offset, colpart_offset, matrix_rows, chunks_per_matrix, matrix_offset;
  long long whole_matrices;
};
// A matrix plan's tensor values read its shape (Op::Shape, in ShapeItem order; the interpreter's
// shape_values): numel, rows of a matrix, columns, whether it has a matrix view.
OF_FN void of_shape(const OfTensor& t, const OfMatrix& m, double* shape) {
  shape[0] = (double)t.numel; shape[1] = (double)m.matrix_rows; shape[2] = (double)m.cols; shape[3] = (double)m.is_matrix;
}
// Where a group's hyperparameter is read from: ptr == 0: the table; else a float32 (type 0) or
// float64 (type 1) scalar (HyperSource in runtime/executor.h).
struct OfHyperSource { unsigned long long ptr; int type; int pad; };
)";
}

StorageVariant storage_variant(const TensorRef& t) {
  StorageVariant v{{t.param.dtype, t.param.stochastic_rounding}, {t.grad.dtype, t.grad.stochastic_rounding}};
  for (const Buffer& b : t.states) v.push_back({b.dtype, b.stochastic_rounding});
  return v;
}

std::vector<StorageVariant> default_variants(const Plan& plan) {
  const Precision& prec = plan.program.precision;
  std::vector<StorageVariant> out;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    if (prec.master == MasterWeights::copy && d == DType::f32) continue;
    if (prec.master == MasterWeights::remainders && d != DType::bf16) continue;
    if (prec.kahan && d != prec.kahan_dtype) continue;
    StorageVariant v{{d, false}, {d, false}};
    for (const ProgramState& s : plan.program.states) v.push_back({s.fixed_dtype ? s.dtype : d, false});
    out.push_back(v);
  }
  return out;
}

bool assign_variants(const std::vector<TensorRef>& tensors, std::vector<StorageVariant>& variants,
                     std::vector<int>& index) {
  bool added = false;
  index.resize(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    StorageVariant v = storage_variant(tensors[t]);
    auto it = std::find(variants.begin(), variants.end(), v);
    if (it == variants.end()) {
      variants.push_back(v);
      added = true;
      it = variants.end() - 1;
    }
    index[t] = static_cast<int>(it - variants.begin());
  }
  return added;
}

std::string describe_variant(const StorageVariant& v, const std::vector<std::string>& role_names) {
  std::string s;
  for (size_t r = 0; r < v.size(); ++r) {
    s += (r ? ", " : "") + (r < role_names.size() ? role_names[r] : "role" + std::to_string(r)) + " " +
         dtype_name(v[r].dtype);
    if (v[r].stochastic) s += " (stochastic)";
  }
  return s;
}

bool variant_has_q8(const StorageVariant& v) {
  for (const RoleStorage& r : v)
    if (r.dtype == DType::q8) return true;
  return false;
}

bool variant_computes_f64(const StorageVariant& v) {
  for (const RoleStorage& r : v)
    if (r.dtype == DType::f64) return true;
  return false;
}

bool any_variant_computes_f64(const std::vector<StorageVariant>& variants) {
  for (const StorageVariant& v : variants)
    if (variant_computes_f64(v)) return true;
  return false;
}

bool variant_runs_states_ahead(const Plan& plan, const StorageVariant& v) {
  std::vector<DType> states;
  for (size_t r = 2; r < v.size(); ++r) states.push_back(v[r].dtype);
  return plan.runs_states_ahead(states);
}

}  // namespace optfuse
