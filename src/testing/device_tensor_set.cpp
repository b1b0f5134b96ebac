#include "testing/device_tensor_set.h"

#include "optfuse/error.h"

namespace optfuse::testing {

DeviceTensorSet::DeviceTensorSet(HostTensorSet& host, CUstream stream, const std::vector<int>& role_offsets)
    : stream_(stream), offsets_(role_offsets) {
  offsets_.resize(host.num_roles(), 0);
  for (size_t r = 0; r < host.num_roles(); ++r) elem_size_.push_back(dtype_size(host.dtype(r)));
  std::vector<TensorRef> h = host.refs();
  for (size_t t = 0; t < h.size(); ++t) {
    std::vector<cuda::DeviceBuffer> b;
    for (size_t r = 0; r < host.num_roles(); ++r) {
      if (offsets_[r] < 0) throw Error("DeviceTensorSet: negative role offset");
      b.emplace_back(host.bytes(t, r).size() + static_cast<size_t>(offsets_[r]) * elem_size_[r]);
    }
    bufs_.push_back(std::move(b));
    TensorRef ref = h[t];
    ref.param.data = data(t, 0);
    ref.grad.data = data(t, 1);
    for (size_t s = 0; s < ref.states.size(); ++s) ref.states[s].data = data(t, 2 + s);
    refs_.push_back(ref);
  }
  upload(host);
}

void* DeviceTensorSet::data(size_t tensor, size_t role) const {
  const cuda::DeviceBuffer& b = bufs_.at(tensor).at(role);
  if (b.ptr() == 0) return nullptr;  // an empty tensor: no allocation
  return reinterpret_cast<void*>(b.ptr() + static_cast<CUdeviceptr>(offsets_[role]) * elem_size_[role]);
}

void DeviceTensorSet::upload_role(HostTensorSet& host, size_t role) {
  for (size_t t = 0; t < bufs_.size(); ++t) {
    std::vector<uint8_t>& bytes = host.bytes(t, role);
    if (!bytes.empty())
      cuda::copy_to_device(reinterpret_cast<CUdeviceptr>(data(t, role)), bytes.data(), bytes.size(), stream_);
  }
}

void DeviceTensorSet::upload(HostTensorSet& host) {
  for (size_t r = 0; r < offsets_.size(); ++r) upload_role(host, r);
}

void DeviceTensorSet::download(HostTensorSet& host) {
  for (size_t t = 0; t < bufs_.size(); ++t)
    for (size_t r = 0; r < bufs_[t].size(); ++r) {
      std::vector<uint8_t>& bytes = host.bytes(t, r);
      if (!bytes.empty())
        cuda::copy_to_host(bytes.data(), reinterpret_cast<CUdeviceptr>(data(t, r)), bytes.size(), stream_);
    }
}

}  // namespace optfuse::testing
