// States written ahead (make_plan's write_states_ahead): LAMB's last reduce pass writes m and v and
// its update pass reads them back instead of the gradient. Checked against the same math planned
// without the move (a trailing skip_if_nonfinite() needs the update before deciding the skip, which
// keeps m and v in the update pass): bitwise in float32 on the CPU backend (compiled and
// interpreted) and in the float32 interpreter; in 16-bit storage the tensor runs the recomputing
// forms, bitwise too; a skipped step (GradScaler's found_inf) leaves every role as it was.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "testing/tensor_set.h"
#include "testing/workloads.h"

namespace optfuse {
namespace {

using testing::HostTensorSet;
using testing::TensorSpec;

const std::vector<TensorSpec> kSpecs = {{0, 0}, {1, 0}, {3, 1}, {1023, 0}, {65537, 1}};

// Bytes per element with float32 states (written ahead), and in float32 units with 16-bit ones
// (the recomputing forms): the benchmarks' count, testing::plan_bytes_per_element.
int64_t bytes_per_element(const Plan& plan, bool states_ahead) {
  return states_ahead ? testing::plan_bytes_per_element(plan, DType::f32) : 2 * testing::plan_bytes_per_element(plan, DType::bf16);
}

TEST(StatesAhead, LambWritesMAndVInItsLastReducePass) {
  for (const char* spec : {"lamb()", "chain(unscale_by_grad_scale(), lamb())"}) {
    SCOPED_TRACE(spec);
    const Plan plan = make_plan(parse_chain(spec));
    ASSERT_EQ(plan.phases.size(), 3u);
    const ElementPhase &reduce = plan.phases[1], &update = plan.phases[2];
    EXPECT_EQ(reduce.writes_states, (std::vector<int>{0, 1}));
    EXPECT_FALSE(update.reads_grad);
    EXPECT_TRUE(update.reads_param);
    EXPECT_EQ(update.reads_states, (std::vector<int>{0, 1}));
    EXPECT_TRUE(update.writes_states.empty());
    EXPECT_EQ(bytes_per_element(plan, true), 44);  // 4 (clip) + 24 + 16
    EXPECT_EQ(bytes_per_element(plan, false), 48);  // 16-bit states: 4 + 16 + 28 (in float32 units)
    EXPECT_TRUE(plan.runs_states_ahead({DType::f32, DType::f32}));
    EXPECT_FALSE(plan.runs_states_ahead({DType::f32, DType::bf16}));
  }
  // Without the clip: 24 + 16 = 40 bytes per element.
  const Plan noclip = make_plan(make_builtin("lamb", {{"max_grad_norm", 0.0}}));
  ASSERT_EQ(noclip.phases.size(), 2u);
  EXPECT_EQ(bytes_per_element(noclip, true), 40);
  // The same math with the skip decided after the update: nothing moves.
  const Plan late = make_plan(parse_chain("chain(lamb(), skip_if_nonfinite())"));
  EXPECT_TRUE(late.recomputing.empty());
  for (const ElementPhase& ph : late.phases) EXPECT_TRUE(ph.loads.empty());
  // Chains whose update pass would read no fewer roles keep their plan: clip + AdamW (the clip's
  // pass precedes every state's new value), Lars (momentum reads the trust ratio).
  for (const char* spec : {"chain(clip_by_global_norm(1.0), adamw())", "lars()", "adamw()"})
    EXPECT_TRUE(make_plan(parse_chain(spec)).recomputing.empty()) << spec;
}

// Runs `spec` for `steps` steps on `backend` over tensors of `storage` (every role), with step
// `skipped` (1-based) reported by GradScaler as inf; returns every role's bytes.
std::vector<std::vector<std::vector<uint8_t>>> run(const std::string& spec, Backend backend, DType storage, int steps,
                                                   int skipped = 0) {
  Optimizer opt(parse_chain(spec), backend, 2);  // (kSpecs use groups 0 and 1)
  HostTensorSet set(opt.plan(), kSpecs, storage, 11);
  opt.set_tensors(set.refs());
  static float one = 1.0f, zero = 0.0f, scale = 1.0f;
  for (int s = 1; s <= steps; ++s) {
    set.randomize_grads(500 + static_cast<uint64_t>(s));
    StepInputs in;
    in.grad_scale = &scale;
    in.found_inf = s == skipped ? &one : &zero;
    opt.step(in);
    EXPECT_EQ(opt.step_count(1), s - (skipped && s >= skipped ? 1 : 0));
  }
  std::vector<std::vector<std::vector<uint8_t>>> out;
  for (size_t t = 0; t < set.size(); ++t) {
    out.emplace_back();
    for (size_t r = 0; r < set.num_roles(); ++r)
      if (r != 1) out.back().push_back(set.bytes(t, r));
  }
  return out;
}

TEST(StatesAhead, SameBitsAsTheUpdatePassComputingThem) {
  // lamb(lr=0.1) and the same chain with the skip decided last (states not written ahead).
  const std::string ahead = "chain(unscale_by_grad_scale(), lamb(lr=0.1))";
  const std::string plain = "chain(unscale_by_grad_scale(), lamb(lr=0.1), skip_if_nonfinite())";
  ASSERT_FALSE(make_plan(parse_chain(ahead)).recomputing.empty());
  ASSERT_TRUE(make_plan(parse_chain(plain)).recomputing.empty());
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(d));
    const auto want = run(plain, Backend::cpu, d, 6);
    EXPECT_EQ(run(ahead, Backend::cpu, d, 6), want);
    // The moved parameters: a run that did nothing would equal a run that did nothing.
    Optimizer probe(parse_chain(plain), Backend::cpu);
    HostTensorSet fresh(probe.plan(), kSpecs, d, 11);
    EXPECT_NE(want.back()[0], fresh.bytes(kSpecs.size() - 1, 0));
  }
}

TEST(StatesAhead, ASkippedStepLeavesEveryRoleAsItWas) {
  const std::string spec = "chain(unscale_by_grad_scale(), lamb(lr=0.1))";
  for (Backend b : {Backend::cpu, Backend::reference}) {
    SCOPED_TRACE(backend_name(b));
    // Steps 1-3, then a skipped step 4: the roles are those after step 3 (fresh gradients at step 4
    // differ, but no role but the gradient may change).
    const auto three = run(spec, b, DType::f32, 3);
    const auto skipped = run(spec, b, DType::f32, 4, 4);
    EXPECT_EQ(skipped, three);
  }
}

}  // namespace
}  // namespace optfuse
