#include "codegen/cuda_matrix_source.h"

#include <algorithm>
#include <sstream>

#include "codegen/c_printer.h"
#include "codegen/cuda_source.h"
#include "optfuse/error.h"

namespace optfuse {

namespace {

// OF_MROWS: a chunk's row sums live in shared memory, [reduction][row][warp] and [reduction][row].
constexpr int32_t kMatrixChunkRows = 64;
// A chunk of 32 rows of 2048 columns: large enough that a column's partials (one per chunk) cost
// 1/16 of a float32 role's traffic, small enough that a big matrix gives every SM many chunks.
constexpr int32_t kMatrixChunkElements = 65536;
// A Values-step block takes 32 columns (a warp's lanes; its 8 warps split the column's chunk
// partials) or 2048 rows (8 per thread): enough blocks that the column partials, the step's one
// large read, are read by the whole GPU.
constexpr int32_t kValueItemCols = 32;
constexpr int32_t kValueItemRows = 2048;

// The reductions of a phase in its acc[] order, with the scope and the slot in their table.
struct PhaseReduction {
  size_t k;       // index in the phase's acc[]
  Scope scope;
  int slot;       // in the global area, the tensor table, the row or the column table
  bool any;       // AnyNonFinite: a sum of 0/1 flags, turned into 0/1
  bool max;       // MaxAbs: folded by of_max
};
std::vector<PhaseReduction> phase_reductions(const Plan& plan, const ElementPhase& ph) {
  std::vector<PhaseReduction> out;
  for (size_t k = 0; k < ph.reductions.size(); ++k) {
    const size_t r = plan.reduction_index(ph.reductions[k]);
    const Op op = plan.program.graph.node(ph.reductions[k]).op;
    out.push_back({k, plan.scope_of(r), plan.reduction_area_slot[r], op == Op::AnyNonFinite, op == Op::MaxAbs});
  }
  return out;
}

std::string flag(const std::string& x, bool any) { return any ? "(" + x + " != 0.0 ? 1.0 : 0.0)" : x; }

// `acc` takes in `x`: a max of abs folds by of_max (NaN-propagating), every other kind adds (sums
// of 0/1 flags for any-non-finite, turned into 0/1 by flag()). Every fold starts from 0.
std::string fold(bool max, const std::string& acc, const std::string& x) {
  return max ? acc + " = of_max(" + acc + ", " + x + ")" : acc + " += " + x;
}
std::string block_fold(bool max) { return max ? "of_block_max" : "of_block_sum"; }

// A reduction combined by a Values kernel: its slot in the column table or the tensor table.
struct LineFold {
  int slot;
  bool any, max;
  bool operator==(const LineFold& o) const { return slot == o.slot && any == o.any && max == o.max; }
};
LineFold line_fold(const Plan& plan, size_t r) {
  const Op op = plan.program.graph.node(plan.reductions[r]).op;
  return {plan.reduction_area_slot[r], op == Op::AnyNonFinite, op == Op::MaxAbs};
}

// Loads of the Rows (cols false) or Cols states of element x of variant `var` into st[s].
std::string line_state_loads(const Plan& plan, const StorageVariant& var, bool cols, const std::string& x,
                             const std::string& indent) {
  std::ostringstream s;
  const StateShape want = cols ? StateShape::Cols : StateShape::Rows;
  for (size_t st = 0; st < plan.program.states.size(); ++st) {
    if (plan.program.states[st].shape != want) continue;
    const int dt = static_cast<int>(var[2 + st].dtype);
    s << indent << "st[" << st << "] = of_load1<" << dt << ">((const OfStorage<" << dt << ">::E*)t.ptr[" << 2 + st
      << "] + " << x << ");\n";
  }
  return s.str();
}

}  // namespace

bool CudaPhaseRoles::read_only(int r) const { return std::find(writes.begin(), writes.end(), r) == writes.end(); }

CudaPhaseRoles cuda_phase_roles(const ElementPhase& ph) {
  CudaPhaseRoles pr;
  if (ph.reads_param) pr.reads.push_back(0);
  if (ph.reads_grad) pr.reads.push_back(1);
  for (int st : ph.reads_states) pr.reads.push_back(2 + st);
  if (ph.writes_param) pr.writes.push_back(0);
  for (int st : ph.writes_states) pr.writes.push_back(2 + st);  // (a reduce pass too: make_plan's write_states_ahead)
  pr.used = pr.reads;
  for (int r : pr.writes)
    if (std::find(pr.used.begin(), pr.used.end(), r) == pr.used.end()) pr.used.push_back(r);
  std::sort(pr.used.begin(), pr.used.end());
  return pr;
}

int32_t cuda_matrix_chunk_rows() { return kMatrixChunkRows; }
int32_t cuda_matrix_chunk_elements() { return kMatrixChunkElements; }
int32_t cuda_value_item_cols() { return kValueItemCols; }
int32_t cuda_value_item_rows() { return kValueItemRows; }

std::string cuda_matrix_prelude() {
  std::ostringstream s;
  s << "\n// Matrix plans (codegen/cuda_matrix_source.h)\n"
    << "#define OF_MROWS " << kMatrixChunkRows << "\n"
    << "// Rows whose loads a matrix chunk loop issues together, with 1 and 4 columns per thread (4W: a\n"
    << "// pass that also stores, 4R1: a reduce pass reading one role; H200 choices: docs/performance.md)\n"
    << "#ifndef OF_MUNROLL1\n#define OF_MUNROLL1 8\n#endif\n#ifndef OF_MUNROLL4\n#define OF_MUNROLL4 4\n#endif\n#ifndef OF_MUNROLL4W\n#define OF_MUNROLL4W 2\n#endif\n"
    << "#ifndef OF_MUNROLL4R1\n#define OF_MUNROLL4R1 8\n#endif\n"
    << R"(// The matrix tables, [row or column][slot] row-major (the CUDA executor's DeviceMatrixTables).
struct OfMatrixTables {
  const OfMatrix* m; double* row_red; double* col_part; double* col_red; float* row_val; float* col_val;
  double* item_sums;    // [item][OF_TENSOR_REDUCTIONS]: a row item's sums of row values
  unsigned* finished;   // per matrix of a view: its row items done this step (the last one resets it)
  double* matrix_sums;  // [matrix][OF_TENSOR_REDUCTIONS]: each matrix's sums of row values
};
struct OfValueItem { int tensor, begin, count, rows, first, items; };  // ValueItem
// Four consecutive elements (16 bytes of float32, 8 of a 16-bit dtype; the address aligned to that).
template <int DT> __device__ __forceinline__ void of_load4(const typename OfStorage<DT>::E* p, float* out) {
  if constexpr (DT == 0) {
    const float4 x = *(const float4*)p;
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
  } else {
    const uint2 x = *(const uint2*)p;
    out[0] = of_widen<DT>((unsigned short)(x.x & 0xffffu)); out[1] = of_widen<DT>((unsigned short)(x.x >> 16));
    out[2] = of_widen<DT>((unsigned short)(x.y & 0xffffu)); out[3] = of_widen<DT>((unsigned short)(x.y >> 16));
  }
}
template <int DT> __device__ __forceinline__ void of_store4(typename OfStorage<DT>::E* p, const float* v) {
  if constexpr (DT == 0) {
    *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint2 x;
    x.x = (unsigned)of_narrow<DT>(v[0]) | ((unsigned)of_narrow<DT>(v[1]) << 16);
    x.y = (unsigned)of_narrow<DT>(v[2]) | ((unsigned)of_narrow<DT>(v[3]) << 16);
    *(uint2*)p = x;
  }
}
)";
  return s.str();
}

std::string cuda_matrix_chunk_function(const Plan& plan, size_t i, size_t k, const StorageVariant& var) {
  const ElementPhase& ph = plan.phases[i];
  const CudaPhaseRoles pr = cuda_phase_roles(ph);
  const std::vector<std::string> roles = role_names(plan);
  const std::vector<PhaseReduction> reds = phase_reductions(plan, ph);
  const size_t nred = std::max<size_t>(ph.reductions.size(), 1);
  bool row_reds = false, col_reds = false;
  unsigned row_max_mask = 0;  // bit slot: that row reduction is a max of abs
  for (const PhaseReduction& r : reds)
    if (r.scope == Scope::Row && r.max) {
      if (r.slot >= 32) throw Error("a CUDA matrix loop folds at most 32 row reductions");
      row_max_mask |= 1u << r.slot;
    }
  for (const PhaseReduction& r : reds) {
    row_reds = row_reds || r.scope == Scope::Row;
    col_reds = col_reds || r.scope == Scope::Col;
  }
  auto nm = [&](int r) { return roles[static_cast<size_t>(r)]; };
  auto dt = [&](int r) { return static_cast<int>(var[static_cast<size_t>(r)].dtype); };
  auto type = [&](int r) { return "OfStorage<" + std::to_string(dt(r)) + ">::E"; };
  std::ostringstream s;
  s << "\n// phase " << i << ", variant " << k << " of a matrix plan: " << describe_variant(var, roles) << "\n"
    << "__device__ __forceinline__ void of_phase" << i << "_v" << k
    << "_mchunk(const OfTensor& t, const OfMatrix& m, void* grad, long long begin, int len, float* u, double* acc, "
       "unsigned long long rng, long long chunk_in_tensor, const OfMatrixTables& mt, double* srow, double* racc, "
       "double* scratch, const double* uni, const double* trow, const double* shape) {\n"
    << "  const long long C = m.cols, r0 = begin / C;  // the chunk: rows [r0, r0 + rows) of the view\n"
    << "  const long long col0 = m.col_offset + r0 / m.matrix_rows * C;  // its matrix's first column\n"
    << "  const int rows = (int)(len / C);\n"
    << "  const unsigned long long rng_first = (unsigned long long)(t.rng_offset + begin);\n"
    << "  (void)rng; (void)rng_first; (void)col0; (void)grad; (void)srow; (void)racc; (void)scratch; (void)chunk_in_tensor;\n"
    << "  (void)uni; (void)trow; (void)shape;\n";
  for (int r : pr.used)
    s << "  " << type(r) << "* __restrict__ " << nm(r) << "_p = (" << type(r) << "*)"
      << (r == 1 ? std::string("grad") : "t.ptr[" + std::to_string(r) + "]") << " + begin;\n";
  // One element at index `idx` of the chunk: loads, the element function into a[], stores.
  auto body = [&](const std::string& idx, const std::string& ind) {
    std::ostringstream b;
    b << ind << "float v[OF_ROLES];\n";
    for (int r : pr.reads)
      b << ind << "v[" << r << "] = of_load1" << (pr.read_only(r) ? "_ro" : "") << "<" << dt(r) << ">(" << nm(r) << "_p + " << idx
        << ");\n";
    b << ind << "of_phase" << i << "_element(v, u, a);\n";
    for (int r : pr.writes) {
      if (var[static_cast<size_t>(r)].stochastic)
        b << ind << "of_store1_sr<" << dt(r) << ">(" << nm(r) << "_p + " << idx << ", v[" << r
          << "], of_rng_bits(rng, rng_first + (unsigned long long)(" << idx << "), " << r << "));\n";
      else
        b << ind << "of_store1<" << dt(r) << ">(" << nm(r) << "_p + " << idx << ", v[" << r << "]);\n";
    }
    return b.str();
  };
  auto row_values = [&](const std::string& row, const std::string& ind) {
    return plan.layout.row_values == 0 ? std::string()
           : ind + "for (int q = 0; q < OF_ROW_VALUES; ++q) u[OF_ROW_U + q] = mt.row_val[(m.row_offset + " + row +
                 ") * OF_ROW_VALUES + q];\n";
  };
  auto col_values = [&](const std::string& col, const std::string& ind) {
    return plan.layout.col_values == 0 ? std::string()
           : ind + "for (int q = 0; q < OF_COL_VALUES; ++q) u[OF_COL_U + q] = mt.col_val[(col0 + " + col +
                 ") * OF_COL_VALUES + q];\n";
  };
  // Tensor and global reductions: each thread's own accumulators, as in every other loop.
  auto others = [&](const std::string& ind) {
    std::ostringstream o;
    for (const PhaseReduction& r : reds)
      if (r.scope == Scope::Global || r.scope == Scope::Tensor)
        o << ind << "acc[" << r.k << "] = " << (r.max ? "of_max(acc[" + std::to_string(r.k) + "], a[" + std::to_string(r.k) + "])"
                                                        : "acc[" + std::to_string(r.k) + "] + a[" + std::to_string(r.k) + "]")
          << ";\n";
    return o.str();
  };
  // Whole small matrices (a batch of them, MatrixView::small_matrices): a thread per matrix, its rows
  // and their columns in order; its tensor values (they may read its sums of row values) its own; its
  // column sums in its partial row (one per matrix: no other chunk has a part of it).
  s << "  if (m.whole_matrices) {  // (uniform over the block)\n"
    << "    const long long R = m.matrix_rows, mb0 = r0 / R;\n"
    << "    for (int j = threadIdx.x; j < (int)(rows / R); j += OF_THREADS) {\n"
    << "      const long long mb = mb0 + j, col0 = m.col_offset + mb * C;\n      (void)col0;\n";
  if (plan.layout.tensor_values > 0)
    s << "      of_phase" << i << "_tensor(uni, trow, mt.matrix_sums + (m.matrix_offset + mb) * OF_TENSOR_REDUCTIONS, shape, u + OF_DERIVED);\n";
  if (col_reds) s << "      double* const part = mt.col_part + (m.colpart_offset + mb * C) * OF_COL_REDS;\n";
  s << "      for (long long rr = 0; rr < R; ++rr) {\n"
    << "        const long long row = mb * R + rr;  // of the view\n"
    << row_values("row", "        ");
  if (row_reds) s << "        double rowpart[OF_ROW_REDS_ARRAY] = {};\n";
  s << "        for (long long c = 0; c < C; ++c) {\n" << col_values("c", "          ")
    << "          const long long e = (row - r0) * C + c;  // of the chunk\n"
    << "          double a[" << nred << "];\n";
  auto whole_running = [&](const PhaseReduction& r) {
    const std::string slot = std::to_string(r.slot);
    return r.scope == Scope::Row ? "rowpart[" + slot + "]" : r.scope == Scope::Col ? "part[c * OF_COL_REDS + " + slot + "]"
                                                                                 : "acc[" + std::to_string(r.k) + "]";
  };
  for (const PhaseReduction& r : reds)
    s << "          a[" << r.k << "] = " << (r.scope == Scope::Col ? "rr == 0 ? 0.0 : " : "") << whole_running(r) << ";\n";
  if (reds.empty()) s << "          a[0] = 0.0;\n";
  s << body("e", "          ");
  for (const PhaseReduction& r : reds) s << "          " << whole_running(r) << " = a[" << r.k << "];\n";
  s << "        }\n";
  for (const PhaseReduction& r : reds)
    if (r.scope == Scope::Row)
      s << "        mt.row_red[(m.row_offset + row) * OF_ROW_REDS + " << r.slot << "] = " << flag("rowpart[" + std::to_string(r.slot) + "]", r.any)
        << ";\n";
  s << "      }\n    }\n    return;\n  }\n";
  // A one-column view (a vector): a thread per row; a row's sum is its element's; the column's
  // partial is a block sum.
  s << "  if (C == 1) {\n" << col_values("0", "    ");
  if (col_reds) s << "    double cacc[OF_COL_REDS_ARRAY] = {0.0};\n";
  s << "    for (int j = threadIdx.x; j < rows; j += OF_THREADS) {\n" << row_values("r0 + j", "      ")
    << "      double a[" << nred << "] = {0.0};\n" << body("j", "      ");
  for (const PhaseReduction& r : reds) {
    if (r.scope == Scope::Row)
      s << "      mt.row_red[(m.row_offset + r0 + j) * OF_ROW_REDS + " << r.slot << "] = " << flag("a[" + std::to_string(r.k) + "]", r.any)
        << ";\n";
    if (r.scope == Scope::Col) s << "      " << fold(r.max, "cacc[" + std::to_string(r.slot) + "]", "a[" + std::to_string(r.k) + "]") << ";\n";
  }
  s << others("      ") << "    }\n";
  for (const PhaseReduction& r : reds)
    if (r.scope == Scope::Col)
      s << "    {\n      const double total = " << block_fold(r.max) << "(cacc[" << r.slot << "], scratch);\n"
        << "      if (threadIdx.x == 0) mt.col_part[(m.colpart_offset + chunk_in_tensor) * OF_COL_REDS + " << r.slot
        << "] = " << flag("total", r.any) << ";\n    }\n";
  s << "  } else {\n";
  // Wider views: threads take columns, W consecutive ones each (tiles of W * OF_THREADS), and walk
  // the chunk's rows, OF_MUNROLL<W> rows' loads at a time; W = 4 (16-byte float32 or 8-byte 16-bit
  // loads and stores) where the view's width and every role's address allow it, else 1. A row's sum
  // is per warp (shuffle tree) into srow[slot][row][warp], then the warps in order into racc.
  if (row_reds)
    s << "    for (int x = threadIdx.x; x < OF_ROW_REDS * OF_MROWS; x += OF_THREADS) racc[x] = 0.0;\n"
      << "    __syncthreads();\n";
  std::string aligned = "C % 4 == 0";
  for (int r : pr.used)
    aligned += " && ((unsigned long long)" + nm(r) + "_p % " + std::to_string(4 * dtype_size(var[static_cast<size_t>(r)].dtype)) + "u) == 0";
  auto tile_loop = [&](int W, const std::string& ind) {
    std::ostringstream o;
    // rows whose loads are issued together (fewer where the loop also stores: registers; more where
    // it reads one role only, for as many bytes in flight)
    const std::string U = W == 1 ? "OF_MUNROLL1" : !pr.writes.empty() ? "OF_MUNROLL4W" : pr.reads.size() == 1 ? "OF_MUNROLL4R1" : "OF_MUNROLL4";
    // A reduce pass without row sums runs branch-free row groups: Full, a group of whole rows'
    // loads and math with no branch between them (a load behind a branch is issued where its value
    // is used: a latency per row); Tail, the chunk's last group of fewer rows, which loads its last
    // row again in their place and stops at the chunk's end. Its threads past the view's last
    // column leave the tile (no row sums to take part in). Other passes run Guarded groups: they
    // load only their own rows and columns and branch around the math of threads past the last
    // column, which take part in the row sums' shuffles. On the H200 branch-free groups took
    // Adafactor's 4-byte pass on llama-1b from 89.0% to 99.5% of its floor, but made its passes
    // with row sums or stores 3-5% slower (docs/performance.md).
    const bool branch_free = pr.writes.empty() && !row_reds;
    o << ind << "for (long long tile = 0; tile < C; tile += " << W << "LL * OF_THREADS) {\n"
      << ind << "  const long long c0 = tile + " << W << "LL * threadIdx.x;\n";
    if (branch_free) o << ind << "  if (c0 >= C) continue;  // past the view's last column\n";
    else o << ind << "  const bool active = c0 < C;\n";
    if (plan.layout.col_values > 0)
    {
      const std::string ci = branch_free ? ind : ind + "  ";  // the loads' indentation
      o << ind << "  float colv[" << W << "][OF_COL_VALUES_ARRAY];\n";
      if (!branch_free) o << ind << "  if (active)\n";
      o << ci << "  for (int w = 0; w < " << W << "; ++w)\n"
        << ci << "    for (int q = 0; q < OF_COL_VALUES; ++q) colv[w][q] = mt.col_val[(col0 + c0 + w) * OF_COL_VALUES + q];\n";
    }
    if (col_reds) o << ind << "  double cacc[" << W << "][OF_COL_REDS_ARRAY] = {};\n";
    o << ind << "  for (int rg = 0; rg < rows; rg += " + U + ") {\n";
    enum class Group { Full, Tail, Guarded };
    auto rows_group = [&](Group mode, const std::string& gi) {
      const bool full = mode == Group::Full, guarded = mode == Group::Guarded;
      std::ostringstream g;
      for (int r : pr.reads) g << gi << "    float in" << r << "[" + U + "][" << W << "];\n";
      // The rows' values are loaded with the rows' elements, not before each row's math (a load
      // latency per row made the 4-byte reduce pass of Adafactor latency-bound).
      if (plan.layout.row_values > 0) g << gi << "    float rowv[" + U + "][OF_ROW_VALUES_ARRAY];\n";
      g << gi << "    #pragma unroll\n" << gi << "    for (int k = 0; k < " + U + "; ++k)" << (guarded ? "\n" : " {\n");
      const std::string li = guarded ? gi + "  " : gi;  // the loads' indentation
      if (guarded)
        g << gi << "      if (active && rg + k < rows) {\n" << li << "      const int lr = rg + k;\n"
          << li << "      const long long e = (long long)lr * C + c0;\n";
      else
        g << gi << (full ? "      const int lr = rg + k;\n" : "      const int lr = min(rg + k, rows - 1);  // the row loads read\n")
          << gi << "      const long long e = (long long)lr * C + c0;\n";
      for (int r : pr.reads) {
        if (W == 4)
          g << li << "      of_load4<" << dt(r) << ">(" << nm(r) << "_p + e, in" << r << "[k]);\n";
        else
          g << li << "      in" << r << "[k][0] = of_load1" << (pr.read_only(r) ? "_ro" : "") << "<" << dt(r) << ">(" << nm(r)
            << "_p + e);\n";
      }
      if (plan.layout.row_values > 0)
        g << li << "      for (int q = 0; q < OF_ROW_VALUES; ++q) rowv[k][q] = mt.row_val[(m.row_offset + r0 + lr) * OF_ROW_VALUES + q];\n";
      g << gi << (guarded ? "      }\n" : "    }\n")
        << gi << "    #pragma unroll\n" << gi << "    for (int k = 0; k < " + U + "; ++k) {\n"
        << gi << "      const int r = rg + k;\n";
      if (!full) g << gi << "      if (r >= rows) break;  // (uniform over the block)\n";
      g << gi << "      const long long e = (long long)r * C + c0;\n" << gi << "      (void)e;\n";
      if (row_reds) g << gi << "      double rowpart[OF_ROW_REDS_ARRAY] = {};\n";
      // Guarded: threads past the view's last column do nothing but take part in the row sums' shuffles.
      g << gi << (guarded ? "      if (active) {\n" : "      {\n");
      if (plan.layout.row_values > 0) g << gi << "        for (int q = 0; q < OF_ROW_VALUES; ++q) u[OF_ROW_U + q] = rowv[k][q];\n";
      for (int r : pr.writes) g << gi << "        float out" << r << "[" << W << "];\n";
      g << gi << "        #pragma unroll\n" << gi << "        for (int w = 0; w < " << W << "; ++w) {\n"
        << gi << "          double a[" << nred << "];\n";
      // Each reduction's running accumulator goes into the element function, which adds to it
      // directly (no zeroed partial per element and a second add: the same sums, one add fewer).
      auto running = [&](const PhaseReduction& r) {
        const std::string slot = std::to_string(r.slot);
        return r.scope == Scope::Row ? "rowpart[" + slot + "]" : r.scope == Scope::Col ? "cacc[w][" + slot + "]" : "acc[" + std::to_string(r.k) + "]";
      };
      for (const PhaseReduction& r : reds) g << gi << "          a[" << r.k << "] = " << running(r) << ";\n";
      if (reds.empty()) g << gi << "          a[0] = 0.0;\n";
      if (plan.layout.col_values > 0)
        g << gi << "          for (int q = 0; q < OF_COL_VALUES; ++q) u[OF_COL_U + q] = colv[w][q];\n";
      g << gi << "          float v[OF_ROLES];\n";
      for (int r : pr.reads) g << gi << "          v[" << r << "] = in" << r << "[k][w];\n";
      g << gi << "          of_phase" << i << "_element(v, u, a);\n";
      for (int r : pr.writes) g << gi << "          out" << r << "[w] = v[" << r << "];\n";
      for (const PhaseReduction& r : reds)
        g << gi << "          " << running(r) << " = a[" << r.k << "];\n";
      g << gi << "        }\n";
      for (int r : pr.writes) {
        if (var[static_cast<size_t>(r)].stochastic)
          g << gi << "        for (int w = 0; w < " << W << "; ++w) of_store1_sr<" << dt(r) << ">(" << nm(r) << "_p + e + w, out" << r
            << "[w], of_rng_bits(rng, rng_first + (unsigned long long)(e + w), " << r << "));\n";
        else if (W == 4)
          g << gi << "        of_store4<" << dt(r) << ">(" << nm(r) << "_p + e, out" << r << ");\n";
        else
          g << gi << "        of_store1<" << dt(r) << ">(" << nm(r) << "_p + e, out" << r << "[0]);\n";
      }
      g << gi << "      }\n";
      for (const PhaseReduction& r : reds)
        if (r.scope == Scope::Row)
          g << gi << "      {\n" << gi << "        double x = rowpart[" << r.slot << "];\n"
            << gi << "        for (int o = 16; o > 0; o >>= 1) " << fold(r.max, "x", "__shfl_down_sync(0xffffffffu, x, o)") << ";\n"
            << gi << "        if ((threadIdx.x & 31) == 0) srow[(" << r.slot
            << " * OF_MROWS + r) * (OF_THREADS / 32) + (threadIdx.x >> 5)] = x;\n" << gi << "      }\n";
      g << gi << "    }\n";  // the rows
      return g.str();
    };
    if (branch_free)
      o << ind << "    if (rg + " + U + " <= rows) {\n" << rows_group(Group::Full, ind + "  ") << ind << "    } else {\n"
        << rows_group(Group::Tail, ind + "  ") << ind << "    }\n";
    else
      o << rows_group(Group::Guarded, ind);
    o << ind << "  }\n";
    for (const PhaseReduction& r : reds)
      if (r.scope == Scope::Col) {
        const std::string ci = branch_free ? ind : ind + "  ";  // (branch-free: every thread here is active)
        if (!branch_free) o << ind << "  if (active)\n";
        o << ci << "  for (int w = 0; w < " << W << "; ++w)\n"
          << ci << "    mt.col_part[(m.colpart_offset + chunk_in_tensor * C + c0 + w) * OF_COL_REDS + " << r.slot << "] = "
          << flag("cacc[w][" + std::to_string(r.slot) + "]", r.any) << ";\n";
      }
    if (row_reds)
      o << ind << "  __syncthreads();\n"
        << ind << "  for (int x = threadIdx.x; x < OF_ROW_REDS * rows; x += OF_THREADS) {\n"
        << ind << "    const int q = x / rows, r = x % rows;\n"
        << ind << "    const bool mx = (" << row_max_mask << "u >> q) & 1u;  // row reduction q is a max of abs\n"
        << ind << "    double sum = 0.0;\n"
        << ind << "    for (int w = 0; w < OF_THREADS / 32; ++w) {\n"
        << ind << "      const double y = srow[(q * OF_MROWS + r) * (OF_THREADS / 32) + w];\n"
        << ind << "      sum = mx ? of_max(sum, y) : sum + y;\n" << ind << "    }\n"
        << ind << "    racc[q * OF_MROWS + r] = mx ? of_max(racc[q * OF_MROWS + r], sum) : racc[q * OF_MROWS + r] + sum;\n"
        << ind << "  }\n"
        << ind << "  __syncthreads();\n";
    o << ind << "}\n";
    return o.str();
  };
  s << "    if (" << aligned << ") {\n" << tile_loop(4, "      ") << "    } else {\n" << tile_loop(1, "      ") << "    }\n";
  for (const PhaseReduction& r : reds)
    if (r.scope == Scope::Row)
      s << "    for (int r = threadIdx.x; r < rows; r += OF_THREADS)\n"
        << "      mt.row_red[(m.row_offset + r0 + r) * OF_ROW_REDS + " << r.slot << "] = "
        << flag("racc[" + std::to_string(r.slot) + " * OF_MROWS + r]", r.any) << ";\n";
  s << "  }\n";
  s << "}\n";
  return s.str();
}

std::string cuda_matrix_commit_function(const Plan& plan, size_t i, size_t k, const StorageVariant& var) {
  const Program& p = plan.program;
  std::ostringstream s;
  s << "\n// The Commit step of the update pass for one chunk (variant " << k << "): its rows' Rows states and, the\n"
    << "// first chunk of a matrix, the matrix's Cols states, from the value tables (a skipped group's chunks never get here)\n"
    << "__device__ __forceinline__ void of_phase" << i << "_v" << k
    << "_commit(const OfTensor& t, const OfMatrix& m, long long begin, int len, long long chunk_in_tensor, "
       "const OfMatrixTables& mt) {\n"
    << "  const long long C = m.cols, r0 = begin / C, c0 = r0 / m.matrix_rows * C;  // c0: its matrix's first column\n"
    << "  const int rows = (int)(len / C);\n"
    << "  (void)t; (void)rows; (void)r0; (void)c0; (void)chunk_in_tensor; (void)mt;\n";
  for (size_t st = 0; st < p.states.size(); ++st) {
    const StateShape shape = p.states[st].shape;
    if (shape == StateShape::Full) continue;
    const bool cols = shape == StateShape::Cols;
    const NodeId out = p.state_out[st];
    const int sdt = static_cast<int>(var[2 + st].dtype);
    std::string value;
    if (p.graph.node(out).op == Op::Const) {
      value = c_literal(p.graph.node(out).value, true);
    } else {
      const size_t q = plan.line_value_index(out);
      value = cols ? "mt.col_val[(m.col_offset + c0 + x) * OF_COL_VALUES + " + std::to_string(q) + "]"
                   : "mt.row_val[(m.row_offset + r0 + x) * OF_ROW_VALUES + " + std::to_string(q) + "]";
    }
    s << "  // " << p.states[st].qualified << "\n";
    if (cols)  // the columns of every matrix the chunk starts (whole small ones: all of its matrices)
      s << "  if (m.whole_matrices || chunk_in_tensor % m.chunks_per_matrix == 0)\n"
        << "    for (long long x = threadIdx.x; x < (m.whole_matrices ? rows / m.matrix_rows * C : C); x += OF_THREADS)\n";
    else s << "  for (int x = threadIdx.x; x < rows; x += OF_THREADS)\n";
    s << "      of_store1<" << sdt << ">((OfStorage<" << sdt << ">::E*)t.ptr[" << 2 + st << "] + " << (cols ? "c0 + x" : "r0 + x")
      << ", " << value << ");\n";
  }
  s << "}\n";
  return s.str();
}

std::string cuda_values_kernel(const Plan& plan, size_t i, const std::vector<StorageVariant>& variants) {
  const Graph& g = plan.program.graph;
  const int limit = plan.value_level_limit(plan.phases[i]);
  const ScalarLayout& L = plan.layout;
  std::ostringstream s;
  // Per variant: the Rows or Cols states of element x, loaded as float.
  for (size_t k = 0; k < variants.size(); ++k)
    s << "\n__device__ __forceinline__ void of_values" << i << "_states_v" << k
      << "(const OfTensor& t, long long x, bool cols, float* st) {\n"
      << "  if (cols) {\n" << line_state_loads(plan, variants[k], true, "x", "    ") << "  } else {\n"
      << line_state_loads(plan, variants[k], false, "x", "    ") << "  }\n  (void)t; (void)x; (void)st;\n}\n";
  auto load_states = [&](const std::string& x, bool cols, const std::string& ind) {
    std::ostringstream o;
    o << ind << "switch (t.variant) {\n";
    for (size_t k = 0; k < variants.size(); ++k)
      o << ind << "  case " << k << ": of_values" << i << "_states_v" << k << "(t, " << x << ", " << (cols ? "true" : "false")
        << ", st); break;\n";
    o << ind << "  default: break;\n" << ind << "}\n";
    return o.str();
  };
  // Row r's (column c's) values from its states and reductions (red), written to the value table.
  auto line = [&](bool cols, const std::string& ind) {
    const std::vector<NodeId>& outs = cols ? plan.col_derived : plan.row_derived;
    std::ostringstream o;
    o << load_states(cols ? "c" : "r", cols, ind) << ind << "of_phase" << i
      << (cols ? "_cols(u, st, red, out, sums);\n" : "_rows(u, st, mt.row_red + (m.row_offset + r) * OF_ROW_REDS, out, sums);\n");
    for (size_t q = 0; q < outs.size(); ++q)
      if (plan.level[static_cast<size_t>(outs[q])] <= limit)
        o << ind << (cols ? "mt.col_val[(m.col_offset + c) * OF_COL_VALUES + " : "mt.row_val[(m.row_offset + r) * OF_ROW_VALUES + ")
          << q << "] = out[" << q << "];\n";
    return o.str();
  };
  auto row_line = [&](const std::string& ind) { return line(false, ind); };
  auto column_line = [&](const std::string& ind) { return line(true, ind); };
  // The per-tensor (per matrix) sums of row and of column values this step takes (levels <= limit).
  std::vector<LineFold> row_sums, col_sums;  // (tensor_reductions slot)
  for (size_t r = 0; r < plan.reductions.size(); ++r) {
    const NodeId node = plan.reductions[r];
    if (!plan.is_value_reduction(node) || plan.level[static_cast<size_t>(node)] > limit) continue;
    (plan.kind[static_cast<size_t>(g.node(node).in[0])] == ValueKind::Row ? row_sums : col_sums).push_back(line_fold(plan, r));
  }
  std::vector<LineFold> combined;  // column reductions produced by the pass just run
  for (size_t r = 0; r < plan.reductions.size(); ++r) {
    if (plan.scope_of(r) != Scope::Col) continue;
    if (plan.level[static_cast<size_t>(plan.reductions[r])] == limit && i > 0) combined.push_back(line_fold(plan, r));
  }
  s << "\n// The Values step before pass " << i << ": row and column values (levels <= " << limit << ")\n"
    << "extern \"C\" __global__ void __launch_bounds__(OF_THREADS) of_values" << i
    << "(const OfTensor* __restrict__ tensors, const OfValueItem* __restrict__ items, int num_items, const double* table, "
       "int groups, double* __restrict__ tensor_reductions, const OfHyperSource* __restrict__ sources, "
       "const float* grad_scale, const float* found_inf, OfMatrixTables mt) {\n"
    << "  extern __shared__ double of_uniform[];  // [groups][OF_UNIFORM]\n"
    << "  __shared__ double globals[2];\n  __shared__ double scratch[OF_THREADS / 32];\n"
    << "  __shared__ double colsum[OF_COL_REDS_ARRAY][OF_THREADS / 32][32];\n  __shared__ int last_item;\n"
    << (col_sums.empty() ? "" : "  __shared__ double lanesum[OF_TENSOR_REDUCTIONS_ARRAY][32];  // a column item's lanes' sums of column values\n")
    << cuda_uniform_prologue(plan, i)
    << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n  (void)lane; (void)warp; (void)colsum; (void)last_item;\n"
    << "  for (int it = blockIdx.x; it < num_items; it += gridDim.x) {  // (uniform over the block)\n"
    << "    const OfValueItem item = items[it];\n"
    << "    const OfTensor& t = tensors[item.tensor];\n    const OfMatrix m = mt.m[item.tensor];\n"
    << "    const double* uni = of_uniform + (long long)t.group * OF_UNIFORM;\n"
    << "    float u[OF_VALUES_ARRAY];\n"
    << "    for (int d = 0; d < OF_DERIVED; ++d) u[d] = (float)uni[d];\n"
    << "    double shape[4];\n    of_shape(t, m, shape);\n"
    << "    const long long C = m.cols;\n"
    << "    // the item's matrix (items of whole small matrices: its first)\n"
    << "    const long long mb = item.rows == 2 ? item.begin : item.rows ? item.begin / m.matrix_rows : item.begin / C;\n"
    << "    double* const msums = mt.matrix_sums + (m.matrix_offset + mb) * OF_TENSOR_REDUCTIONS;\n";
  if (L.tensor_values > 0)
    s << "    of_phase" << i << "_tensor(uni, tensor_reductions + (long long)item.tensor * OF_TENSOR_REDUCTIONS, msums, shape, u + OF_DERIVED);\n";
  s << "    (void)msums;\n"
    << "    float st[OF_ROLES];\n    float out[OF_ROW_VALUES_ARRAY > OF_COL_VALUES_ARRAY ? OF_ROW_VALUES_ARRAY : OF_COL_VALUES_ARRAY];\n"
    << "    double sums[OF_TENSOR_REDUCTIONS_ARRAY] = {0.0};\n"
    << "    if (item.rows == 2) {\n"
    << "      // Whole small matrices: thread j takes matrix begin + j: its tensor values, its rows (values\n"
    << "      // and their sums, in row order), then its columns (one partial each: its chunk held all of it).\n"
    << "      if ((int)threadIdx.x < item.count) {\n"
    << "        const long long wb = item.begin + threadIdx.x;\n"
    << "        double* const ws = mt.matrix_sums + (m.matrix_offset + wb) * OF_TENSOR_REDUCTIONS;\n        (void)ws;\n";
  if (L.tensor_values > 0)
    s << "        of_phase" << i << "_tensor(uni, tensor_reductions + (long long)item.tensor * OF_TENSOR_REDUCTIONS, ws, shape, u + OF_DERIVED);\n";
  s << "        for (long long r = wb * m.matrix_rows; r < (wb + 1) * m.matrix_rows; ++r) {\n" << row_line("          ") << "        }\n";
  for (const LineFold& f : row_sums) s << "        ws[" << f.slot << "] = " << flag("sums[" + std::to_string(f.slot) + "]", f.any) << ";\n";
  s << "        for (long long c = wb * C; c < (wb + 1) * C; ++c) {\n          double red[OF_COL_REDS_ARRAY];\n";
  const std::string small_col_sums = [&] {
    std::string o;
    for (const LineFold& f : col_sums) o += "        ws[" + std::to_string(f.slot) + "] = " + flag("sums[" + std::to_string(f.slot) + "]", f.any) + ";\n";
    return o;
  }();
  for (size_t r = 0; r < plan.reductions.size(); ++r) {
    if (plan.scope_of(r) != Scope::Col) continue;
    const LineFold f = line_fold(plan, r);
    const std::string at = "mt.col_red[(m.col_offset + c) * OF_COL_REDS + " + std::to_string(f.slot) + "]";
    if (std::find(combined.begin(), combined.end(), f) != combined.end())
      s << "          red[" << f.slot << "] = " << flag("mt.col_part[(m.colpart_offset + c) * OF_COL_REDS + " + std::to_string(f.slot) + "]", f.any)
        << ";\n          " << at << " = red[" << f.slot << "];\n";
    else
      s << "          red[" << f.slot << "] = " << at << ";\n";
  }
  s << column_line("          ") << "        }\n" << small_col_sums << "      }\n"
    << "    } else if (!item.rows) {\n"
    << "      // Columns: lane l takes column begin + l (of the view's matrices x C); warp w the partials of\n"
    << "      // the matrix's chunks w, w + 8, ... (in order), then warp 0 the warps' sums in order: a fixed\n"
    << "      // order, whatever the grid.\n"
    << "      const long long c = item.begin + lane, cm = c - mb * C;  // cm: the column within its matrix\n"
    << "      const bool on = lane < item.count;\n      (void)cm;\n";
  for (const LineFold& f : combined)
    s << "      {\n        double sum = 0.0;\n"
      << "        if (on)\n          for (long long q = warp; q < m.chunks_per_matrix; q += OF_THREADS / 32)\n"
      << "            " << fold(f.max, "sum", "mt.col_part[(m.colpart_offset + (mb * m.chunks_per_matrix + q) * C + cm) * OF_COL_REDS + " + std::to_string(f.slot) + "]")
      << ";\n        colsum[" << f.slot << "][warp][lane] = sum;\n      }\n";
  if (!combined.empty()) s << "      __syncthreads();\n";
  s << "      if (warp == 0 && on) {\n        double red[OF_COL_REDS_ARRAY];\n";
  for (size_t r = 0; r < plan.reductions.size(); ++r) {
    if (plan.scope_of(r) != Scope::Col) continue;
    const LineFold f = line_fold(plan, r);
    const int slot = f.slot;
    const std::string at = "mt.col_red[(m.col_offset + c) * OF_COL_REDS + " + std::to_string(slot) + "]";
    const bool fresh = std::find(combined.begin(), combined.end(), f) != combined.end();
    if (fresh)
      s << "        {\n          double sum = 0.0;\n          for (int w = 0; w < OF_THREADS / 32; ++w) "
        << fold(f.max, "sum", "colsum[" + std::to_string(slot) + "][w][lane]") << ";\n          red[" << slot
        << "] = " << flag("sum", f.any) << ";\n          " << at << " = red[" << slot << "];\n        }\n";
    else
      s << "        red[" << slot << "] = " << at << ";\n";
  }
  s << column_line("        ") << "      }\n";
  // The matrix's last item to finish adds its items' sums in item order (items [first, first +
  // count)): deterministic whichever block is last.
  auto last_item_sums = [&](const std::string& ind, const std::string& first, const std::string& count) {
    std::ostringstream o;
    o << ind << "if (threadIdx.x == 0) {\n" << ind << "  __threadfence();\n"
      << ind << "  last_item = atomicAdd(mt.finished + m.matrix_offset + mb, 1u) == (unsigned)" << count << " - 1u;\n"
      << ind << "}\n" << ind << "__syncthreads();\n"
      << ind << "if (last_item && threadIdx.x == 0) {\n" << ind << "  __threadfence();\n";
    for (const std::vector<LineFold>* sums : {&row_sums, &col_sums})
      for (const LineFold& f : *sums)
        o << ind << "  {\n" << ind << "    double sum = 0.0;\n"
          << ind << "    for (int j = 0; j < " << count << "; ++j) "
          << fold(f.max, "sum", "mt.item_sums[(long long)(" + first + " + j) * OF_TENSOR_REDUCTIONS + " + std::to_string(f.slot) + "]")
          << ";\n" << ind << "    msums[" << f.slot << "] = " << flag("sum", f.any) << ";\n" << ind << "  }\n";
    o << ind << "  mt.finished[m.matrix_offset + mb] = 0u;  // ready for the next launch (or graph replay)\n" << ind << "}\n";
    return o.str();
  };
  // Where the step sums column values, a matrix's column items take part (its sums gather over all
  // its items; ValueItem::first/items of a column item span them); else only its row items do,
  // with their own first/items.
  const bool columns_sum = !col_sums.empty();
  if (columns_sum) {  // a column item's sums: its lanes' (columns') in lane order; its row-sum slots 0
    s << "      __syncthreads();\n      if (warp == 0) {\n";
    for (const LineFold& f : col_sums) s << "        lanesum[" << f.slot << "][lane] = on ? sums[" << f.slot << "] : 0.0;\n";
    s << "      }\n      __syncthreads();\n      if (threadIdx.x == 0) {\n";
    for (const LineFold& f : row_sums) s << "        mt.item_sums[(long long)it * OF_TENSOR_REDUCTIONS + " << f.slot << "] = 0.0;\n";
    for (const LineFold& f : col_sums)
      s << "        {\n          double sum = 0.0;\n          for (int l = 0; l < 32; ++l) " << fold(f.max, "sum", "lanesum[" + std::to_string(f.slot) + "][l]")
        << ";\n          mt.item_sums[(long long)it * OF_TENSOR_REDUCTIONS + " << f.slot << "] = sum;\n        }\n";
    s << "      }\n";
  }
  s << "    } else {\n"
    << "      // Rows: thread x takes rows begin + x, + 256, ... of the item\n"
    << "      for (long long r = item.begin + threadIdx.x; r < item.begin + item.count; r += OF_THREADS) {\n"
    << row_line("        ") << "      }\n";
  // A row item's sums of row values (a fixed block tree); its column-sum slots 0.
  for (const LineFold& f : row_sums)
    s << "      {\n        const double total = " << block_fold(f.max) << "(sums[" << f.slot << "], scratch);\n"
      << "        if (threadIdx.x == 0) mt.item_sums[(long long)it * OF_TENSOR_REDUCTIONS + " << f.slot << "] = total;\n      }\n";
  if (columns_sum) {
    s << "      if (threadIdx.x == 0) {\n";
    for (const LineFold& f : col_sums) s << "        mt.item_sums[(long long)it * OF_TENSOR_REDUCTIONS + " << f.slot << "] = 0.0;\n";
    s << "      }\n    }\n";
    // A row item's first/items span the matrix's row items: its column items come just before them.
    const std::string col_items = "(int)((C + " + std::to_string(kValueItemCols) + " - 1) / " + std::to_string(kValueItemCols) + ")";
    s << "    if (item.rows != 2) {\n"
      << "      const int mfirst = item.rows ? item.first - " << col_items << " : item.first;\n"
      << "      const int mitems = item.rows ? item.items + " << col_items << " : item.items;\n"
      << last_item_sums("      ", "mfirst", "mitems") << "    }\n"
      << "    __syncthreads();  // colsum, lanesum, scratch and last_item are reused by the next item\n  }\n";
  } else {
    if (!row_sums.empty()) s << last_item_sums("      ", "item.first", "item.items");
    s << "    }\n    __syncthreads();  // colsum, scratch and last_item are reused by the next item\n  }\n";
  }
  s << "  (void)tensor_reductions; (void)scratch;\n}\n";
  return s.str();
}

}  // namespace optfuse
