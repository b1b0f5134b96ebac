// A sharded step on the CUDA backend (Optimizer::set_exchange): ranks are threads on one GPU, each
// stepping its pieces (cut at chunk boundaries) with the pass kernels' own combine switched off;
// their partials cross through the host (testing::PartialsBus) and the combine kernels combine
// every rank's in global chunk order. The parameters and states equal the unsharded CUDA step bit
// for bit for every reduction scope, with 1, 2 and 3 ranks.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "cuda/require_cuda.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/optimizer.h"
#include "runtime/cuda_api.h"
#include "testing/device_tensor_set.h"
#include "testing/sharding.h"
#include "testing/tensor_set.h"

namespace cu = optfuse::cuda;

namespace optfuse {
namespace {

using testing::DeviceTensorSet;
using testing::HostTensorSet;

const std::vector<int64_t> kSizes = {40000, 5000, 70001, 16384};
constexpr int kSteps = 3;

std::vector<testing::TensorSpec> specs() {
  std::vector<testing::TensorSpec> s;
  for (int64_t n : kSizes) s.push_back({n});
  return s;
}

// A piece of a device tensor: its roles' pointers moved `begin` elements in (float32 roles).
TensorRef piece_of(const TensorRef& whole, const testing::ShardPiece& pc) {
  TensorRef r = whole;
  auto cut = [&](Buffer& b) {
    b.data = static_cast<char*>(b.data) + pc.begin * static_cast<int64_t>(sizeof(float));
    b.numel = pc.end - pc.begin;
  };
  cut(r.param);
  cut(r.grad);
  for (Buffer& b : r.states) cut(b);
  r.rng_offset = pc.begin;
  return r;
}

TEST(CudaExchange, ShardedStepEqualsUnshardedBitwise) {
  REQUIRE_GPU();
  for (const char* spec : {"chain(clip_by_global_norm(max_norm=0.5), adamw(lr=0.01))",
                           "chain(skip_if_nonfinite(), sgd(lr=0.1, momentum=0.9))", "lamb(lr=0.01, weight_decay=0.01)",
                           "lars(lr=0.1, momentum=0.9, weight_decay=0.0001)"}) {
    const Plan plan = make_plan(parse_chain(spec));
    HostTensorSet want(plan, specs(), DType::f32, 7);
    {
      DeviceTensorSet dev(want);
      Optimizer opt(parse_chain(spec), Backend::cuda);
      opt.set_tensors(dev.refs());
      for (int k = 0; k < kSteps; ++k) {
        want.randomize_grads(100 + static_cast<uint64_t>(k));
        dev.upload_role(want, 1);
        opt.step();
      }
      dev.download(want);
    }
    for (int ranks : {1, 2, 3}) {
      SCOPED_TRACE(std::string(spec) + ", ranks " + std::to_string(ranks));
      HostTensorSet got(plan, specs(), DType::f32, 7);
      DeviceTensorSet dev(got);
      std::vector<std::unique_ptr<Optimizer>> opts;
      for (int r = 0; r < ranks; ++r) opts.push_back(std::make_unique<Optimizer>(parse_chain(spec), Backend::cuda));
      const testing::ShardCut cut = testing::cut_into_ranks(kSizes, opts[0]->chunk_elements(), ranks);
      testing::PartialsBus bus(ranks, plan.reductions.size(), cut.global_chunks);
      for (int r = 0; r < ranks; ++r) {
        std::vector<TensorRef> refs;
        for (const testing::ShardPiece& pc : cut.pieces[static_cast<size_t>(r)])
          refs.push_back(piece_of(dev.refs()[pc.tensor], pc));
        opts[static_cast<size_t>(r)]->set_tensors(refs);
        opts[static_cast<size_t>(r)]->set_exchange(cut.map(r), bus.exchange(cut.rank_first_chunk[static_cast<size_t>(r)]));
      }
      for (int k = 0; k < kSteps; ++k) {
        got.randomize_grads(100 + static_cast<uint64_t>(k));
        dev.upload_role(got, 1);
        std::vector<std::thread> threads;
        for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { opts[static_cast<size_t>(r)]->step(); });
        for (auto& th : threads) th.join();
      }
      dev.download(got);
      for (size_t t = 0; t < got.size(); ++t)
        for (size_t role = 0; role < got.num_roles(); ++role)
          EXPECT_TRUE(got.bytes(t, role) == want.bytes(t, role)) << "tensor " << t << " role " << role;
    }
  }
}

}  // namespace
}  // namespace optfuse
