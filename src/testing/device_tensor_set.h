// A device-memory mirror of a HostTensorSet, for the CUDA backend's tests, the CLI's check and
// benchmarks: one allocation per role of each tensor, copies both ways on a chosen stream.
//
// `role_offsets` (optional, one per role) places a role's data that many elements into its
// allocation: offsetting every role by one element gives the misaligned views a slice of a larger
// tensor has; offsetting only some gives roles of different alignment.
#pragma once
#include <vector>

#include "runtime/cuda_api.h"
#include "testing/tensor_set.h"

namespace optfuse::testing {

class DeviceTensorSet {
 public:
  DeviceTensorSet(HostTensorSet& host, CUstream stream = nullptr, const std::vector<int>& role_offsets = {});
  // References to the device copies, for Optimizer::set_tensors with Backend::cuda.
  const std::vector<TensorRef>& refs() const { return refs_; }
  // Host -> device for one role of every tensor (e.g. role 1, new gradients), or every role.
  void upload_role(HostTensorSet& host, size_t role);
  void upload(HostTensorSet& host);
  // Device -> host for every role; synchronises the stream.
  void download(HostTensorSet& host);
  // Device address of a role's first element.
  void* data(size_t tensor, size_t role) const;

 private:
  CUstream stream_;
  std::vector<int> offsets_;
  std::vector<std::vector<cuda::DeviceBuffer>> bufs_;  // [tensor][role]
  std::vector<TensorRef> refs_;
  std::vector<size_t> elem_size_;  // per role
};

}  // namespace optfuse::testing
