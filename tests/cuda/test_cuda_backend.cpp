// Tests of the CUDA backend (generated source + executor).
//   CudaSource.*   need only NVRTC: every built-in's generated source compiles for sm_90 (CI).
//   CudaBackend.*  need a GPU (skip with the reason otherwise): results against the reference
//                  evaluator, graph capture, determinism, misaligned views, a > 2^31-element tensor,
//                  set_hyper between replays, the GradScaler contract.
//   CudaBench.*    disabled by default (--gtest_also_run_disabled_tests): bandwidth numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cuda_source.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/matrix_chain.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "runtime/cuda_api.h"
#include "cuda/require_cuda.h"
#include "testing/device_tensor_set.h"
#include "testing/matrix_rules.h"
#include "testing/tensor_set.h"
#include "testing/workloads.h"

namespace {

using namespace optfuse;
namespace cu = optfuse::cuda;
using optfuse::testing::DeviceTensorSet;
using optfuse::testing::HostTensorSet;
using optfuse::testing::TensorSpec;

struct Case {
  std::string name;
  Chain chain;
};

bool has_hyper(const Chain& c, const std::string& name) {
  for (const Rule& r : c)
    for (const HyperSpec& h : r.hypers())
      if (h.name == name) return true;
  return false;
}

// Every built-in by name, options that change the program's structure, and the two chains of the
// brief. Bare rules get a learning rate so that updates are small against the parameters (a bare
// scale_by_lion adds +-1 per step, and sign() of a value float32 and float64 round to opposite
// sides of zero would then dominate any comparison).
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, Chain c) {
    if (!has_hyper(c, "lr")) c = chain({c, make_builtin("scale_by_learning_rate", {{"lr", 1e-3}})});
    cases.push_back({name, c});
  };
  // Trust-ratio rules alone move each tensor by its own norm (lr 1): a tensor can land on 0, where
  // the ratio's w_norm > 0 test flips on one rounding; they are checked scaled by a learning rate.
  auto trust_scaled = [](const std::string& n) {
    return n == "scale_by_lamb" || n == "scale_by_lars";
  };
  for (const std::string& n : builtin_names()) {
    if (n != "scale" && has_matrix_phase(make_builtin(n))) {  // its element-wise parts (optfuse/matrix_chain.h)
      if (n == "newton_schulz") continue;     // the matrix rule alone has none
      MatrixChainParts parts = split_matrix_chain(make_builtin(n));
      add(n + " part 1", parts.before);
      add(n + " part 2", parts.after);
      continue;
    }
    add(n, n == "scale"           ? make_builtin(n, {{"factor", 0.5}})
           : trust_scaled(n) ? chain({make_builtin(n), make_builtin("scale_by_learning_rate", {{"lr", 0.01}})})
                             : make_builtin(n));
  }
  add("adam(amsgrad, maximize, weight_decay)", adam({{"amsgrad", true}, {"maximize", true}, {"weight_decay", 0.1}}));
  add("adamw(amsgrad)", adamw({{"amsgrad", true}}));
  {  // a max of abs per tensor and over all (the driver's of_block_max, OF_MAX combines)
    Rule r("scale_by_max_abs");
    r.update([](RuleBuilder& b) {
      Expr g = b.update();
      return g * ((tensor_max_abs(g) + 1.0) / global_max_abs(g));
    });
    add("scale_by_max_abs", Chain{r});
  }
  add("row_and_column_max", Chain{optfuse::testing::row_and_column_max()});
  add("sgd(momentum, nesterov, weight_decay, maximize)",
      sgd({{"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}, {"maximize", true}}));
  add("sgd(momentum, dampening)", sgd({{"momentum", 0.9}, {"dampening", 0.1}}));
  add("rmsprop(centered, momentum, weight_decay, maximize)",
      rmsprop({{"centered", true}, {"momentum", 0.9}, {"weight_decay", 0.01}, {"maximize", true}}));
  add("adagrad(lr_decay, weight_decay, maximize)",
      adagrad({{"lr_decay", 0.01}, {"weight_decay", 0.01}, {"initial_accumulator_value", 0.1}, {"maximize", true}}));
  add("lion(weight_decay)", lion({{"weight_decay", 0.1}}));
  add("trace(nesterov)", make_builtin("trace", {{"nesterov", true}}));
  add("scale_by_rms(centered)", make_builtin("scale_by_rms", {{"centered", true}}));
  add("chain(clip_by_global_norm(1.0), adamw())", chain({clip_by_global_norm(1.0), adamw()}));
  add("ademamix(warm-ups, weight_decay)",
      make_builtin("ademamix", {{"t_alpha", 3.0}, {"t_beta3", 5.0}, {"weight_decay", 0.1}, {"alpha", 5.0}}));
  add("adamw_schedule_free(warmup, weight_decay)",
      make_builtin("adamw_schedule_free", {{"lr", 0.01}, {"warmup_steps", 3.0}, {"weight_decay", 0.1}}));
  add("lamb(decoupled_decay, trust_clip, max_lr)",
      make_builtin("lamb", {{"decoupled_decay", true}, {"trust_clip", true}, {"max_lr", 2e-3}, {"weight_decay", 0.1}}));
  add("lamb(no clip, always_adapt, no bias correction)",
      make_builtin("lamb", {{"max_grad_norm", 0.0}, {"weight_decay", 0.0}, {"always_adapt", true}, {"bias_correction", false}}));
  add("lars(momentum, nesterov, weight_decay, trust_clip)",
      make_builtin("lars", {{"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}, {"trust_clip", true}}));
  add("nadam(decoupled_weight_decay, maximize)",
      make_builtin("nadam", {{"weight_decay", 0.1}, {"decoupled_weight_decay", true}, {"maximize", true}}));
  add("nadam(weight_decay, momentum_decay)", make_builtin("nadam", {{"weight_decay", 0.1}, {"momentum_decay", 0.01}}));
  // A uniform state in a plan with a reduce pass: read by both kernels' prologues, committed once.
  add("chain(clip_by_global_norm(1.0), skip_if_nonfinite(), nadam())",
      chain({clip_by_global_norm(1.0), make_builtin("skip_if_nonfinite"), make_builtin("nadam")}));
  add("chain(unscale_by_grad_scale(), skip_if_nonfinite(), adam())",
      chain({make_builtin("unscale_by_grad_scale"), make_builtin("skip_if_nonfinite"), adam()}));
  return cases;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Tolerance relative to each tensor's scale: float32 1e-5; 16-bit storage 4 ulps at the scale.
double tolerance(DType t) {
  switch (t) {
    case DType::f32: return 1e-5;
    case DType::bf16: return 4 * std::ldexp(1.0, -8);
    case DType::f16: return 4 * std::ldexp(1.0, -11);
  }
  return 0;
}

// Two groups with different learning rates, sizes that hit every path: empty, shorter than one
// vector, one vector short of 1024, several chunks with a one-element tail.
const std::vector<TensorSpec> kSpecs = {{0, 0}, {1, 1}, {3, 0}, {1023, 1}, {65537, 0}};

void halve_lr_of_group_1(Optimizer& o) {
  for (const ProgramHyper& h : o.plan().program.hypers)
    if (h.name == "lr") return o.set_hyper(1, "lr", 0.5 * o.hyper(0, "lr"));
}

bool same_bytes(HostTensorSet& a, HostTensorSet& b) {
  for (size_t t = 0; t < a.size(); ++t)
    for (size_t r = 0; r < a.num_roles(); ++r)
      if (a.bytes(t, r) != b.bytes(t, r)) return false;
  return true;
}

// Steps a chain on the CUDA backend and the reference evaluator with the same gradients; returns
// the worst difference over the steps (NaN on a NaN mismatch or a step-count mismatch).
double worst_vs_reference(const Chain& c, DType dtype, int steps, const std::vector<int>& role_offsets = {},
                          const std::vector<TensorSpec>& specs = kSpecs) {
  Optimizer ref(c, Backend::reference, 2), opt(c, Backend::cuda, 2);
  halve_lr_of_group_1(ref);
  halve_lr_of_group_1(opt);
  HostTensorSet want(ref.plan(), specs, dtype, 7), got(ref.plan(), specs, dtype, 7);
  ref.set_tensors(want.refs());
  DeviceTensorSet dev(got, nullptr, role_offsets);
  opt.set_tensors(dev.refs());
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    want.randomize_grads(100 + static_cast<uint64_t>(s));
    got.randomize_grads(100 + static_cast<uint64_t>(s));
    dev.upload_role(got, 1);
    ref.step();
    opt.step();
    dev.download(got);
    double d = optfuse::testing::max_relative_difference(got, want);
    worst = std::isnan(d) || d > worst ? d : worst;
  }
  for (int g = 0; g < 2; ++g) {
    if (opt.step_count(g) != ref.step_count(g)) return NAN;
    for (const ProgramUniformState& u : ref.plan().program.uniform_states)  // committed by the last block
      if (!(std::fabs(opt.uniform_state(g, u.qualified) - ref.uniform_state(g, u.qualified)) <=
            1e-12 * std::fabs(ref.uniform_state(g, u.qualified))))
        return NAN;
  }
  return worst;
}

// ---- NVRTC only ------------------------------------------------------------------------------

TEST(CudaSource, EveryBuiltinCompilesForSm90WithOneElementKernelPerPhase) {
  REQUIRE_NVRTC();
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    Plan plan = make_plan(c.chain);
    std::string src = generate_cuda_source(plan);
    int phases = static_cast<int>(plan.phases.size());
    EXPECT_EQ(count(src, "__global__ void __launch_bounds__(OF_THREADS, OF_MIN_BLOCKS) of_phase"), phases);
    int reduce_phases = 0;
    for (const ElementPhase& ph : plan.phases) reduce_phases += ph.kind == ElementPhase::Kind::Reduce ? 1 : 0;
    // One launch per pass: no separate scalar kernel. A reduce pass also has a combine kernel, which
    // only a sharded step (an exchange) launches; a matrix plan a Values-step kernel per pass.
    const int values = plan.matrix() ? phases : 0;
    EXPECT_EQ(count(src, "__global__"), phases + reduce_phases + values);
    EXPECT_EQ(count(src, "__global__ void __launch_bounds__(OF_THREADS) of_combine"), reduce_phases);
    ASSERT_EQ(cuda_kernel_names(plan).size(), static_cast<size_t>(phases + values));
    cu::CompileResult r;
    ASSERT_NO_THROW(r = cu::compile(src, "optfuse", 90, {"--fmad=false"}));
    for (const std::string& k : cuda_kernel_names(plan)) {
      auto res = cu::resources_from_cubin(r.cubin, k);
      ASSERT_TRUE(res.has_value()) << k;
      EXPECT_GT(res->registers, 0) << k;
      std::printf("  %-60s %-18s %3d registers, %3d bytes local\n", c.name.c_str(), k.c_str(), res->registers,
                  res->local_bytes);
    }
  }
}

TEST(CudaSource, TestRulesOfRowAndColumnScopesCompile) {
  // The matrix rules the GPU tests run, sums of column values among them (their Values kernels
  // gather them per matrix): compiled here too, where CI has no GPU.
  REQUIRE_NVRTC();
  for (const Rule& rule : {optfuse::testing::row_and_column_max(), optfuse::testing::sum_of_columns(),
                           optfuse::testing::row_and_column_value_sums()}) {
    SCOPED_TRACE(rule.name());
    const Plan plan = make_plan(Chain{rule});
    const std::string src = generate_cuda_source(plan);
    const bool column_sums = rule.name() != "row_and_column_max";  // (it takes a max of row values only)
    EXPECT_EQ(src.find("double lanesum[") != std::string::npos, column_sums);
    cu::CompileResult r;
    ASSERT_NO_THROW(r = cu::compile(src, "optfuse", 90, {"--fmad=false"}));
    for (const std::string& k : cuda_kernel_names(plan)) EXPECT_TRUE(cu::resources_from_cubin(r.cubin, k).has_value()) << k;
  }
}

TEST(CudaSource, HyperparameterValuesDoNotChangeTheSource) {
  // The compile cache is keyed on the source: values are run-time data, never code.
  std::string a = generate_cuda_source(make_plan(adamw({{"lr", 1e-3}, {"weight_decay", 0.01}})));
  std::string b = generate_cuda_source(make_plan(adamw({{"lr", 3e-4}, {"weight_decay", 0.2}, {"betas", {0.8, 0.9}}})));
  EXPECT_EQ(a, b);
}

TEST(CudaSource, MissingGpuIsBackendUnavailable) {
  std::string why;
  if (cu::driver_available(&why)) GTEST_SKIP() << "a GPU is present";
  EXPECT_THROW(Optimizer(adamw(), Backend::cuda), BackendUnavailable);
}

// ---- GPU -----------------------------------------------------------------------------------------

TEST(CudaBackend, MatchesReferenceForEveryRuleAndDtype) {
  REQUIRE_GPU();
  for (const Case& c : all_cases())
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      double w = worst_vs_reference(c.chain, dt, 10);
      EXPECT_TRUE(w <= tolerance(dt)) << c.name << " " << dtype_name(dt) << ": worst " << w;
    }
}

TEST(CudaBackend, MisalignedViewsMatchReference) {
  REQUIRE_GPU();
  Chain c = chain({clip_by_global_norm(1.0), adamw({{"lr", 1e-2}})});
  int roles = 2 + make_plan(c).num_states();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    // Every role one element in (vector path after a scalar head), then only the parameter
    // (roles disagree: all-scalar path).
    std::vector<int> all(static_cast<size_t>(roles), 1), param_only(static_cast<size_t>(roles), 0);
    param_only[0] = 1;
    EXPECT_LE(worst_vs_reference(c, dt, 3, all), tolerance(dt)) << dtype_name(dt);
    EXPECT_LE(worst_vs_reference(c, dt, 3, param_only), tolerance(dt)) << dtype_name(dt);
  }
}

// A stream, two identical tensor sets on it and two optimizers of one chain.
struct Twin {
  cu::Stream stream;
  std::unique_ptr<Optimizer> a, b;
  std::unique_ptr<HostTensorSet> ha, hb;
  std::unique_ptr<DeviceTensorSet> da, db;
  Twin(const Chain& c, DType dt, const std::vector<TensorSpec>& specs) {
    a = std::make_unique<Optimizer>(c, Backend::cuda, 2);
    b = std::make_unique<Optimizer>(c, Backend::cuda, 2);
    halve_lr_of_group_1(*a);
    halve_lr_of_group_1(*b);
    ha = std::make_unique<HostTensorSet>(a->plan(), specs, dt, 11);
    hb = std::make_unique<HostTensorSet>(a->plan(), specs, dt, 11);
    da = std::make_unique<DeviceTensorSet>(*ha, stream.get());
    db = std::make_unique<DeviceTensorSet>(*hb, stream.get());
    a->set_tensors(da->refs());
    b->set_tensors(db->refs());
  }
  StepInputs in() { StepInputs s; s.stream = stream.get(); return s; }
  void new_grads(uint64_t seed) {
    ha->randomize_grads(seed);
    hb->randomize_grads(seed);
    da->upload_role(*ha, 1);
    db->upload_role(*hb, 1);
  }
  void download() {
    da->download(*ha);
    db->download(*hb);
  }
};

const std::vector<TensorSpec> kBigSpecs = {{(1 << 20) + 3, 0}, {65537, 1}, {4096, 0}, {4096, 1}, {5, 0}};

TEST(CudaBackend, GraphReplayEqualsEagerBitwise) {
  REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    Twin t(chain({clip_by_global_norm(1.0), adamw()}), dt, kBigSpecs);
    cu::begin_capture(t.stream.get());
    t.b->step(t.in());
    cu::Graph graph = cu::end_capture(t.stream.get());
    for (int s = 0; s < 4; ++s) {
      t.new_grads(200 + static_cast<uint64_t>(s));
      t.a->step(t.in());
      graph.launch(t.stream.get());
    }
    t.download();
    EXPECT_TRUE(same_bytes(*t.ha, *t.hb)) << dtype_name(dt);
    EXPECT_EQ(t.a->step_count(0), 4);
    EXPECT_EQ(t.b->step_count(0), 4);
    EXPECT_EQ(t.b->step_count(1), 4);
  }
}

TEST(CudaBackend, TwoRunsAreBitwiseEqual) {
  REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    Twin t(chain({clip_by_global_norm(0.5), adamw()}), dt, kBigSpecs);
    for (int s = 0; s < 3; ++s) {
      t.new_grads(300 + static_cast<uint64_t>(s));
      t.a->step(t.in());
      t.b->step(t.in());
    }
    t.download();
    EXPECT_TRUE(same_bytes(*t.ha, *t.hb)) << dtype_name(dt);
  }
  // And the clipped result is right (the reduction sums about a million squares).
  EXPECT_LE(worst_vs_reference(chain({clip_by_global_norm(0.5), adamw()}), DType::f32, 3, {}, kBigSpecs), 1e-5);
}

TEST(CudaBackend, SetHyperBetweenGraphReplaysTakesEffectWithoutRecompiling) {
  REQUIRE_GPU();
  Twin t(adamw({{"lr", 1e-3}}), DType::f32, kSpecs);
  Optimizer& eager = *t.a;
  Optimizer& graphed = *t.b;
  std::string status = graphed.backend_status();
  cu::begin_capture(t.stream.get());
  graphed.step(t.in());
  cu::Graph graph = cu::end_capture(t.stream.get());
  t.new_grads(1);
  eager.step(t.in());
  graph.launch(t.stream.get());
  eager.set_hyper(0, "lr", 0.1);
  graphed.set_hyper(0, "lr", 0.1);
  t.new_grads(2);
  eager.step(t.in());
  graph.launch(t.stream.get());
  t.download();
  EXPECT_TRUE(same_bytes(*t.ha, *t.hb));
  EXPECT_EQ(graphed.backend_status(), status);
  // The replay did use the new rate: a third run that keeps lr=1e-3 ends elsewhere.
  Twin keep(adamw({{"lr", 1e-3}}), DType::f32, kSpecs);
  keep.new_grads(1);
  keep.a->step(keep.in());
  keep.new_grads(2);
  keep.a->step(keep.in());
  keep.download();
  EXPECT_FALSE(same_bytes(*keep.ha, *t.hb));
}

TEST(CudaBackend, CapturedStepKeepsTheGradientsItWasCapturedWith) {
  REQUIRE_GPU();
  // A graph replays the pointers it was captured with, whatever eager steps pointed the table at
  // in between (CUDA graph semantics; the captured step carries its own tensor-table upload).
  Twin t(adamw({{"lr", 1e-2}}), DType::f32, kSpecs);
  HostTensorSet original = *t.hb;
  HostTensorSet other_grads = *t.hb;
  other_grads.randomize_grads(77);
  DeviceTensorSet other(other_grads, t.stream.get());
  cu::begin_capture(t.stream.get());
  t.b->step(t.in());
  cu::Graph graph = cu::end_capture(t.stream.get());
  std::vector<const void*> grads;
  for (const TensorRef& r : other.refs()) grads.push_back(r.grad.data);
  t.b->set_grad_pointers(grads);
  t.b->step(t.in());            // eager: the other gradients
  graph.launch(t.stream.get());  // replay: the captured ones again
  t.da->upload_role(other_grads, 1);
  t.a->step(t.in());
  t.da->upload_role(original, 1);
  t.a->step(t.in());
  t.download();
  EXPECT_TRUE(same_bytes(*t.ha, *t.hb));
}

// Every pointer of a set (the torch.compile path: set_pointers with copies of the parameters and
// states), as set_pointers takes them.
void point_at(Optimizer& o, const DeviceTensorSet& d) {
  std::vector<const void*> params, grads, states;
  for (const TensorRef& r : d.refs()) {
    params.push_back(r.param.data);
    grads.push_back(r.grad.data);
    for (const Buffer& b : r.states) states.push_back(b.data);
  }
  o.set_pointers(params, grads, states);
}

TEST(CudaBackend, CapturedStepKeepsTheTensorsItWasCapturedWith) {
  REQUIRE_GPU();
  // Eager steps that move every pointer (not only gradients) after a capture: the graph still
  // steps the tensors it was captured with (its table rows stay; eager steps get a new table).
  Twin t(adamw({{"lr", 1e-2}}), DType::f32, kSpecs);
  HostTensorSet moved = *t.hb;
  moved.randomize_grads(78);
  DeviceTensorSet other_a(moved, t.stream.get()), other_b(moved, t.stream.get());
  cu::begin_capture(t.stream.get());
  t.b->step(t.in());
  cu::Graph graph = cu::end_capture(t.stream.get());
  point_at(*t.b, other_b);
  t.b->step(t.in());             // eager: the other tensors (step 1)
  graph.launch(t.stream.get());  // replay: the captured tensors (step 2)
  point_at(*t.a, other_a);
  t.a->step(t.in());
  point_at(*t.a, *t.da);
  t.a->step(t.in());
  t.download();
  EXPECT_TRUE(same_bytes(*t.ha, *t.hb));
  HostTensorSet got_a = moved, got_b = moved;
  other_a.download(got_a);
  other_b.download(got_b);
  EXPECT_TRUE(same_bytes(got_a, got_b));
  EXPECT_FALSE(same_bytes(got_b, moved));  // the eager step moved them
}

TEST(CudaBackend, BoundHyperparameterIsReadAtEveryGraphReplay) {
  REQUIRE_GPU();
  // A scheduler's lr.fill_() on the stream between replays: the kernel reads the bound scalar.
  Twin t(adamw({{"lr", 1e-3}}), DType::f32, kSpecs);
  cu::DeviceBuffer lr(sizeof(float));
  float v = 1e-3f;
  cu::copy_to_device(lr.ptr(), &v, sizeof v, t.stream.get());
  t.b->bind_hyper(0, "lr", reinterpret_cast<const void*>(lr.ptr()), Optimizer::ScalarType::f32);
  t.a->set_hyper(0, "lr", static_cast<double>(v));
  cu::begin_capture(t.stream.get());
  t.b->step(t.in());
  cu::Graph graph = cu::end_capture(t.stream.get());
  for (int s = 0; s < 3; ++s) {
    t.new_grads(300 + static_cast<uint64_t>(s));
    v = 1e-3f * static_cast<float>(s + 2);
    cu::copy_to_device(lr.ptr(), &v, sizeof v, t.stream.get());
    t.a->set_hyper(0, "lr", static_cast<double>(v));
    t.a->step(t.in());
    graph.launch(t.stream.get());
  }
  t.download();
  EXPECT_TRUE(same_bytes(*t.ha, *t.hb));
  EXPECT_EQ(t.b->step_count(0), 3);
}

TEST(CudaBackend, GradScalerContract) {
  REQUIRE_GPU();
  Chain c = chain({make_builtin("unscale_by_grad_scale"), make_builtin("skip_if_nonfinite"), adam({{"lr", 1e-2}})});
  Optimizer ref(c, Backend::reference, 2), opt(c, Backend::cuda, 2);
  HostTensorSet want(ref.plan(), kSpecs, DType::f32, 5), got(ref.plan(), kSpecs, DType::f32, 5);
  HostTensorSet before = got;
  ref.set_tensors(want.refs());
  DeviceTensorSet dev(got);
  opt.set_tensors(dev.refs());
  cu::DeviceBuffer scalars(2 * sizeof(float));
  const float* dev_scale = reinterpret_cast<const float*>(scalars.ptr());
  auto set_scalars = [&](float scale, float found_inf) {
    float h[2] = {scale, found_inf};
    cu::copy_to_device(scalars.ptr(), h, sizeof h, nullptr);
    StepInputs in;
    in.grad_scale = dev_scale;
    in.found_inf = dev_scale + 1;
    return in;
  };
  // found_inf: nothing changes, the step count stays.
  opt.step(set_scalars(1024.0f, 1.0f));
  dev.download(got);
  EXPECT_TRUE(same_bytes(got, before));
  EXPECT_EQ(opt.step_count(0), 0);
  EXPECT_EQ(opt.step_count(1), 0);
  // Scaled gradients, no inf: the same step as the reference with the same scale.
  for (HostTensorSet* s : {&want, &got})
    for (size_t t = 0; t < s->size(); ++t)
      for (int64_t i = 0; i < s->specs()[t].numel; ++i)
        store_element(s->bytes(t, 1).data(), DType::f32, i, 1024.0 * s->value(t, 1, i));
  dev.upload_role(got, 1);
  float host_scale = 1024.0f, host_inf = 0.0f;
  StepInputs host_in;
  host_in.grad_scale = &host_scale;
  host_in.found_inf = &host_inf;
  ref.step(host_in);
  opt.step(set_scalars(1024.0f, 0.0f));
  dev.download(got);
  EXPECT_LE(optfuse::testing::max_relative_difference(got, want), 1e-5);
  EXPECT_EQ(opt.step_count(0), 1);
  // A non-finite gradient (skip_if_nonfinite): skipped on the device, step count unchanged.
  HostTensorSet after_one = got;
  store_element(got.bytes(4, 1).data(), DType::f32, 777, INFINITY);
  dev.upload_role(got, 1);
  opt.step(set_scalars(1024.0f, 0.0f));
  dev.download(got);
  store_element(got.bytes(4, 1).data(), DType::f32, 777, after_one.value(4, 1, 777));  // the input we changed
  EXPECT_TRUE(same_bytes(got, after_one));
  EXPECT_EQ(opt.step_count(0), 1);
}

TEST(CudaBackend, UniformStateCommittedOnceAndNotOnSkippedSteps) {
  REQUIRE_GPU();
  // NAdam's mu_product: read by every block's prologue, committed by the last block only.
  Chain c = chain({make_builtin("unscale_by_grad_scale"), make_builtin("nadam", {{"lr", 1e-2}})});
  Optimizer ref(c, Backend::reference, 2), opt(c, Backend::cuda, 2);
  HostTensorSet want(ref.plan(), kSpecs, DType::f32, 5), got(ref.plan(), kSpecs, DType::f32, 5);
  ref.set_tensors(want.refs());
  DeviceTensorSet dev(got);
  opt.set_tensors(dev.refs());
  cu::DeviceBuffer scalars(2 * sizeof(float));
  auto step_with = [&](float found_inf) {
    float h[2] = {1.0f, found_inf};
    cu::copy_to_device(scalars.ptr(), h, sizeof h, nullptr);
    StepInputs in;
    in.grad_scale = reinterpret_cast<const float*>(scalars.ptr());
    in.found_inf = in.grad_scale + 1;
    opt.step(in);
    if (found_inf == 0.0f) ref.step();
  };
  for (float inf : {0.0f, 1.0f, 0.0f, 0.0f, 1.0f}) step_with(inf);
  EXPECT_EQ(opt.step_count(0), 3);
  for (int g = 0; g < 2; ++g)
    EXPECT_NEAR(opt.uniform_state(g, "mu_product"), ref.uniform_state(g, "mu_product"), 1e-15);
  const double kept = opt.uniform_state(0, "mu_product");
  EXPECT_LT(kept, 1.0);
  opt.add_group();  // keeps existing values, the new group starts at the init value
  EXPECT_EQ(opt.uniform_state(0, "mu_product"), kept);
  EXPECT_EQ(opt.uniform_state(2, "mu_product"), 1.0);
  dev.download(got);
  EXPECT_LE(optfuse::testing::max_relative_difference(got, want), 1e-5);
}

TEST(CudaBackend, EmptyTensorSetStillCountsSteps) {
  REQUIRE_GPU();
  Optimizer opt(adamw(), Backend::cuda, 2);
  opt.set_tensors({});
  opt.step();
  opt.step();
  EXPECT_EQ(opt.step_count(0), 2);
  opt.add_group();  // keeps existing counts
  EXPECT_EQ(opt.step_count(1), 2);
  EXPECT_EQ(opt.step_count(2), 0);
}

// bfloat16 pattern both the device and the host compute: ((i * mult) % 509 - 256) / 128, exact.
float pattern(uint64_t i, unsigned mult) { return static_cast<float>(static_cast<int>((i * mult) % 509) - 256) / 128.0f; }
const char* kPatternSource = R"(
extern "C" __global__ void pattern_bf16(unsigned short* p, unsigned long long n, unsigned mult) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float v = (float)((int)((i * mult) % 509ull) - 256) / 128.0f;
    p[i] = (unsigned short)(__float_as_uint(v) >> 16);
  }
}
)";

TEST(CudaBackend, Bfloat16TensorBeyond2To31Elements) {
  REQUIRE_GPU();
  const int64_t n = (int64_t(1) << 31) + 5;
  if (cu::current_device().total_mem < size_t(16) << 30) GTEST_SKIP() << "needs 16 GiB of device memory";
  cu::Module mod(cu::compile(kPatternSource, "pattern", cu::current_device().arch()).cubin);
  cu::DeviceBuffer param(size_t(n) * 2), grad(size_t(n) * 2);
  for (auto [buf, m] : {std::pair<cu::DeviceBuffer*, unsigned>{&param, 3u}, {&grad, 7u}}) {
    CUdeviceptr p = buf->ptr();
    unsigned long long nn = static_cast<unsigned long long>(n);
    unsigned mult = m;
    void* args[] = {&p, &nn, &mult};
    cu::launch(mod.function("pattern_bf16"), 4096, 256, 0, nullptr, args);
  }
  Chain c = sgd({{"lr", 0.1}});
  Optimizer opt(c, Backend::cuda, 1);
  ASSERT_EQ(opt.plan().num_states(), 0);
  opt.set_tensors({TensorRef{{reinterpret_cast<void*>(param.ptr()), n, DType::bf16},
                             {reinterpret_cast<void*>(grad.ptr()), n, DType::bf16}, {}, 0}});
  opt.step();
  // Both ends; the last window also covers element 2^31 (the first past 32-bit indexing).
  const int64_t w = 48;
  for (int64_t first : {int64_t(0), n - w}) {
    std::vector<uint16_t> got(w), p0(w), g0(w);
    cu::copy_to_host(got.data(), param.ptr() + CUdeviceptr(first) * 2, size_t(w) * 2, nullptr);
    for (int64_t i = 0; i < w; ++i) {
      p0[size_t(i)] = float_to_bf16_bits(pattern(uint64_t(first + i), 3));
      g0[size_t(i)] = float_to_bf16_bits(pattern(uint64_t(first + i), 7));
    }
    std::vector<uint16_t> want = p0;
    Optimizer ref(c, Backend::reference, 1);
    ref.set_tensors({TensorRef{{want.data(), w, DType::bf16}, {g0.data(), w, DType::bf16}, {}, 0}});
    ref.step();
    int changed = 0;
    for (int64_t i = 0; i < w; ++i) {
      float a = bf16_bits_to_float(got[size_t(i)]), b = bf16_bits_to_float(want[size_t(i)]);
      float ulp = b == 0 ? 1e-30f : std::ldexp(1.0f, std::ilogb(b) - 7);
      EXPECT_LE(std::fabs(a - b), ulp) << "element " << first + i << ": " << a << " vs " << b;
      changed += got[size_t(i)] != p0[size_t(i)];
    }
    EXPECT_GT(changed, w / 2) << "window at " << first;
  }
}

// ---- Benchmarks (disabled by default) -------------------------------------------------------------

const char* kBenchSource = R"(
extern "C" __global__ void copy16(const uint4* __restrict__ in, uint4* __restrict__ out, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = in[i];
}
extern "C" __global__ void fill_words(unsigned* p, long long n) {  // 0x3c003c00: finite in every dtype
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    p[i] = 0x3c003c00u;
}
)";

struct Bench {
  cu::Module mod{cu::compile(kBenchSource, "bench", cu::current_device().arch()).cubin};
  cu::Stream stream;
  // Average milliseconds of `reps` calls of f after 3 warm-up calls.
  template <class F>
  double time_ms(F f, int reps = 20) {
    for (int i = 0; i < 3; ++i) f();
    cu::EventTimer t;
    t.start(stream.get());
    for (int i = 0; i < reps; ++i) f();
    t.stop(stream.get());
    return t.elapsed_ms() / reps;
  }
  void fill(CUdeviceptr p, size_t bytes) {
    long long n = static_cast<long long>(bytes / 4);
    void* args[] = {&p, &n};
    if (n) cu::launch(mod.function("fill_words"), 1024, 256, 0, stream.get(), args);
  }
};

TEST(CudaBench, DISABLED_Bandwidth) {
  REQUIRE_GPU();
  Bench b;
  const size_t copy_bytes = size_t(1) << 31;
  cu::DeviceBuffer src(copy_bytes), dst(copy_bytes);
  CUdeviceptr s = src.ptr(), d = dst.ptr();
  long long nvec = static_cast<long long>(copy_bytes / 16);
  void* args[] = {&s, &d, &nvec};
  double copy_ms = b.time_ms([&] { cu::launch(b.mod.function("copy16"), 132 * 8, 256, 0, b.stream.get(), args); });
  double copy_gbs = 2.0 * copy_bytes / copy_ms / 1e6;
  std::printf("BENCH copy 2 GiB: %.3f ms, %.0f GB/s (read + write)\n", copy_ms, copy_gbs);
  // Shapes: one big tensor, 2000 small ones, GPT-2 small's 148 tensors, and two that show the
  // fixed cost of a step (no tensors: scalar kernels only; one 4096-element tensor).
  std::vector<int64_t> gpt2;
  const optfuse::testing::Workload gpt2_small = optfuse::testing::make_workload("gpt2-small");
  for (const auto& t : gpt2_small.tensors) gpt2.push_back(t.numel);
  const std::vector<int64_t> big(1, int64_t(1) << 28), small(2000, 4096), none, one(1, 4096);
  struct Work { std::string chain; DType dt; std::string shape; const std::vector<int64_t>* sizes; };
  const std::string clip_adamw = "chain(clip_by_global_norm(1.0), adamw())";
  const std::vector<Work> works = {
      {"adamw", DType::f32, "1 x 2^28", &big},        {"adamw", DType::f32, "2000 x 4096", &small},
      {"adamw", DType::f32, "gpt2-small", &gpt2},     {"adamw", DType::bf16, "1 x 2^28", &big},
      {"adamw", DType::bf16, "2000 x 4096", &small},  {"adamw", DType::bf16, "gpt2-small", &gpt2},
      {clip_adamw, DType::f32, "1 x 2^28", &big},     {clip_adamw, DType::f32, "2000 x 4096", &small},
      {"sgd(momentum=0.9)", DType::bf16, "1 x 2^28", &big}, {"adamw", DType::f32, "no tensors", &none},
      {"adamw", DType::f32, "1 x 4096", &one},        {clip_adamw, DType::f32, "1 x 4096", &one}};
  for (const Work& w : works) {
    Optimizer opt(parse_chain(w.chain), Backend::cuda, 1);
    const Plan& plan = opt.plan();
    size_t roles = 2 + static_cast<size_t>(plan.num_states()), es = dtype_size(w.dt);
    std::vector<size_t> offsets;  // tensors 256-byte aligned inside one allocation per role
    size_t total = 0;
    double elements = 0;
    for (int64_t n : *w.sizes) {
      offsets.push_back(total);
      total += (size_t(n) * es + 255) / 256 * 256;
      elements += double(n);
    }
    std::vector<cu::DeviceBuffer> arenas;
    for (size_t r = 0; r < roles; ++r) {
      arenas.emplace_back(total);
      b.fill(arenas.back().ptr(), arenas.back().size());
    }
    std::vector<TensorRef> refs;
    for (size_t t = 0; t < w.sizes->size(); ++t) {
      auto buf = [&](size_t r) {
        return Buffer{reinterpret_cast<void*>(arenas[r].ptr() + offsets[t]), (*w.sizes)[t], w.dt};
      };
      TensorRef ref{buf(0), buf(1), {}, 0};
      for (size_t r = 2; r < roles; ++r) ref.states.push_back(buf(r));
      refs.push_back(ref);
    }
    opt.set_tensors(refs);
    StepInputs in;
    in.stream = b.stream.get();
    double bytes = 0;
    for (const ElementPhase& ph : plan.phases) bytes += double(ph.reads() + ph.writes()) * double(es);
    bytes *= elements;
    double eager_ms = b.time_ms([&] { opt.step(in); });
    cu::begin_capture(b.stream.get());
    opt.step(in);
    cu::Graph g = cu::end_capture(b.stream.get());
    double graph_ms = b.time_ms([&] { g.launch(b.stream.get()); });
    std::printf("BENCH %-42s %-8s %-11s graph %8.1f us  %6.0f GB/s  %5.1f%% of copy | eager %8.1f us\n",
                w.chain.c_str(), dtype_name(w.dt), w.shape.c_str(), graph_ms * 1e3,
                bytes / graph_ms / 1e6, 100.0 * bytes / graph_ms / 1e6 / copy_gbs, eager_ms * 1e3);
    std::fflush(stdout);
  }
}

// Row and column scopes (Adafactor) on matrix views: one and several chunks per matrix, rows longer
// than a chunk, narrow views (a thread per column, most idle), vectors (a thread per row), two groups;
// batches of matrices (TensorRef::matrix_rows): several chunks and two row items per matrix, one-row
// matrices, and small ones, whole in a chunk (3 x 3 as a conv's, 1 x 1, 16 x 16: several chunks each).
// Per-tensor (per matrix) sums of row values and of column values, and a max of column values.
TEST(CudaBackend, MatrixViewsMatchReferenceAndRepeatBitwise) {
  REQUIRE_GPU();
  const std::vector<TensorSpec> specs = {{300 * 1001, 0, 1001},      {65537, 1, 0},           {3, 0, 3},
                                         {2 * 70000, 1, 70000},      {17 * 5, 1, 5},          {1, 0, 0},
                                         {4096 * 64, 0, 64},         {3 * 300 * 301, 0, 301, 300},
                                         {4 * 3000 * 8, 1, 8, 3000}, {6 * 4 * 5, 1, 5, 4},    {5 * 7, 0, 7, 1},
                                         {1000 * 3 * 3, 0, 3, 3},    {5000, 1, 1, 1},         {70 * 16 * 16, 0, 16, 16}};
  for (const Chain& c : {adafactor({{"lr", 0.05}, {"weight_decay", 0.1}}), adafactor({{"maximize", true}, {"d", 1.5}}),
                         Chain{optfuse::testing::row_and_column_max()}, Chain{optfuse::testing::row_and_column_value_sums()}})
    for (DType dt : {DType::f32, DType::bf16}) {
      double w = worst_vs_reference(c, dt, 8, {}, specs);
      EXPECT_TRUE(w <= tolerance(dt)) << build_program(c).chain_text << " " << dtype_name(dt) << ": worst " << w;
    }
  for (const Chain& c : {adafactor({{"lr", 0.05}}), Chain{optfuse::testing::row_and_column_value_sums()}}) {
    Twin twin(c, DType::f32, specs);
    for (int s = 0; s < 3; ++s) {
      twin.new_grads(500 + static_cast<uint64_t>(s));
      twin.a->step(twin.in());
      twin.b->step(twin.in());
    }
    twin.download();
    EXPECT_TRUE(same_bytes(*twin.ha, *twin.hb)) << build_program(c).chain_text << ": two runs of the same steps differ";
  }
}

}  // namespace
