// The data layout shared by the runtime and generated code, printed once for every dialect, so the
// host side (runtime/tensor_table.h, runtime/chunks.h, runtime/executor.h) and the structs the
// generated code reads cannot drift apart: the static_asserts there pin the host side's sizes.
//   OfTensor   one tensor-table row: a pointer per role (param, grad, each state), the element
//              count, the group, the kernel variant (its roles' storage), the tensor's range in the
//              chunk list, and its stochastic-rounding stream (key, offset of its first element)
//   OfChunk    one chunk: first element within its tensor, the tensor, the element count
//   OfHyperSource  where a group's hyperparameter is read from (HyperSource)
//
// A *storage variant* is how each role of a tensor is stored: its dtype and whether stores to it
// round stochastically. Generated code has one specialised chunk loop per variant of the tensor
// set (the variant list is part of the source, so of the compile key); OfTensor::variant indexes
// that list.
#pragma once
#include <string>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse {

struct RoleStorage {
  DType dtype = DType::f32;
  bool stochastic = false;
  bool operator==(const RoleStorage& o) const { return dtype == o.dtype && stochastic == o.stochastic; }
};
// Per role: param, grad, then each state.
using StorageVariant = std::vector<RoleStorage>;

StorageVariant storage_variant(const TensorRef& t);
// The variants compiled before any tensor is seen: every role float32, float16 or bfloat16 (states
// of a fixed dtype keep theirs), where the plan's precision options allow it.
std::vector<StorageVariant> default_variants(const Plan& plan);
// Each tensor's index in `variants`, appending the variants missing; returns whether any was added.
bool assign_variants(const std::vector<TensorRef>& tensors, std::vector<StorageVariant>& variants,
                     std::vector<int>& index);
// "param bfloat16, grad float32, exp_avg bfloat16 (stochastic)..." for comments and messages.
std::string describe_variant(const StorageVariant& v, const std::vector<std::string>& role_names);
// Whether tensors of this variant run the plan's phases as they are or, where states written ahead
// are not float32, the recomputing forms (Plan::runs_states_ahead).
bool variant_runs_states_ahead(const Plan& plan, const StorageVariant& v);

// Whether tensors of this variant do their element math (and row, column and tensor values) in
// float64: where some role is float64, as torch computes in a float64 parameter's dtype. A pass
// mixing tensors of both kinds runs each tensor's chunks in its own variant's precision.
bool variant_computes_f64(const StorageVariant& v);
// Whether some role of the variant is q8 (block-quantized): its loops then run a block at a time.
bool variant_has_q8(const StorageVariant& v);
bool any_variant_computes_f64(const std::vector<StorageVariant>& variants);

// Needs OF_ROLES and OF_FN (the printer's common source) defined before it.
std::string abi_source();
// The plan's layout as every dialect reads it, printed from its ScalarLayout: the counts of each
// area's slots (OF_HYPERS, OF_DERIVED, OF_REDUCTIONS, OF_TENSOR_REDUCTIONS, OF_ROW_REDS, ...; each
// with an _ARRAY size of at least 1), where row and column values sit in element code's inputs, and
// the scalar table's offset functions (of_hypers_offset(), of_steps_offset(groups), ...). The one
// definition of the layout, for generated code too. Needs OF_FN defined before it.
std::string layout_source(const Plan& plan);

}  // namespace optfuse
