// A sharded step (Optimizer::set_exchange, the schedule's Exchange step) equals the unsharded step
// bit for bit: ranks are threads, each stepping its pieces of the tensors (cut at chunk boundaries,
// so one cut runs across a tensor), and the exchange gathers every rank's per-chunk partials into
// the global chunk order through a shared bus, as an all-gather would. Every reduction scope
// (global sum of squares, any-non-finite, per-tensor norms) on the reference and CPU backends, with
// 1, 2 and 3 ranks; also the schedule itself and set_exchange's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "testing/error_of.h"
#include "testing/sharding.h"

namespace optfuse {
namespace {

const std::vector<int64_t> kSizes = {40000, 5000, 70001, 16384};

struct Model {  // every tensor's param, grad and states as flat float32 vectors
  std::vector<std::vector<float>> p, g;
  std::vector<std::vector<std::vector<float>>> s;  // [tensor][state]
};

Model make_model(const Plan& plan) {
  Model m;
  for (size_t t = 0; t < kSizes.size(); ++t) {
    std::vector<float> p(static_cast<size_t>(kSizes[t]));
    for (size_t i = 0; i < p.size(); ++i) p[i] = 0.5f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(t));
    m.p.push_back(p);
    m.g.emplace_back(p.size(), 0.0f);
    std::vector<std::vector<float>> st;
    for (const ProgramState& ps : plan.program.states) st.emplace_back(p.size(), static_cast<float>(ps.init));
    m.s.push_back(st);
  }
  return m;
}

// Gradients of step k (the same on every rank, as after DDP's all-reduce); a NaN at `nan_step`.
void fill_grads(Model& m, int k, int nan_step) {
  for (size_t t = 0; t < m.g.size(); ++t)
    for (size_t i = 0; i < m.g[t].size(); ++i)
      m.g[t][i] = 0.3f * std::cos(0.011f * static_cast<float>(i * (t + 1)) + 0.7f * static_cast<float>(k));
  if (k == nan_step) m.g[2][60000] = std::nanf("");
}

TensorRef ref_of(Model& m, const testing::ShardPiece& pc) {
  TensorRef r;
  const int64_t n = pc.end - pc.begin;
  r.param = {m.p[pc.tensor].data() + pc.begin, n, DType::f32};
  r.grad = {m.g[pc.tensor].data() + pc.begin, n, DType::f32};
  for (auto& st : m.s[pc.tensor]) r.states.push_back({st.data() + pc.begin, n, DType::f32});
  r.rng_key = pc.tensor + 1;
  r.rng_offset = pc.begin;
  return r;
}

// Runs `steps` steps of `spec` sharded over `ranks` threads; returns the model they share.
Model run_sharded(const std::string& spec, Backend backend, int ranks, int steps, int nan_step) {
  Plan plan = make_plan(parse_chain(spec));
  Model m = make_model(plan);
  std::vector<std::unique_ptr<Optimizer>> opts;
  for (int r = 0; r < ranks; ++r) opts.push_back(std::make_unique<Optimizer>(parse_chain(spec), backend));
  const testing::ShardCut cut = testing::cut_into_ranks(kSizes, opts[0]->chunk_elements(), ranks);
  testing::PartialsBus bus(ranks, plan.reductions.size(), cut.global_chunks);
  for (int r = 0; r < ranks; ++r) {
    std::vector<TensorRef> refs;
    for (const testing::ShardPiece& pc : cut.pieces[static_cast<size_t>(r)]) refs.push_back(ref_of(m, pc));
    opts[static_cast<size_t>(r)]->set_tensors(refs);
    opts[static_cast<size_t>(r)]->set_exchange(cut.map(r), bus.exchange(cut.rank_first_chunk[static_cast<size_t>(r)]));
  }
  for (int k = 0; k < steps; ++k) {
    fill_grads(m, k, nan_step);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        Optimizer& o = *opts[static_cast<size_t>(r)];
        std::vector<const void*> grads;  // the per-step pointer patch of a training loop keeps the exchange
        for (const TensorRef& t : o.tensors()) grads.push_back(t.grad.data);
        o.set_grad_pointers(grads);
        o.step();
      });
    for (auto& th : threads) th.join();
  }
  return m;
}

Model run_unsharded(const std::string& spec, Backend backend, int steps, int nan_step) {
  Plan plan = make_plan(parse_chain(spec));
  Model m = make_model(plan);
  Optimizer opt(parse_chain(spec), backend);
  std::vector<TensorRef> refs;
  for (size_t t = 0; t < kSizes.size(); ++t) refs.push_back(ref_of(m, {t, 0, kSizes[t]}));
  opt.set_tensors(refs);
  for (int k = 0; k < steps; ++k) {
    fill_grads(m, k, nan_step);
    opt.step();
  }
  return m;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  const char* spec;
  int nan_step;  // -1: none
};

const Case kCases[] = {
    {"chain(clip_by_global_norm(max_norm=0.5), adamw(lr=0.01))", -1},  // global sum of squares
    {"chain(skip_if_nonfinite(), sgd(lr=0.1, momentum=0.9))", 1},        // any-non-finite: step 1 skipped everywhere
    {"lamb(lr=0.01, weight_decay=0.01)", -1},                            // global clip + per-tensor trust ratios
    {"lars(lr=0.1, momentum=0.9, weight_decay=0.0001)", -1},             // per-tensor norms
    {"adamw(lr=0.01)", -1},                                               // no reductions: no exchange step
};

TEST(Exchange, ShardedStepEqualsUnshardedBitwise) {
  for (Backend backend : {Backend::reference, Backend::cpu})
    for (const Case& c : kCases) {
      const Model want = run_unsharded(c.spec, backend, 4, c.nan_step);
      for (int ranks : {1, 2, 3}) {
        SCOPED_TRACE(std::string(c.spec) + " on " + backend_name(backend) + ", ranks " + std::to_string(ranks));
        const Model got = run_sharded(c.spec, backend, ranks, 4, c.nan_step);
        for (size_t t = 0; t < kSizes.size(); ++t) {
          EXPECT_TRUE(bitwise_equal(got.p[t], want.p[t])) << "param of tensor " << t;
          for (size_t s = 0; s < got.s[t].size(); ++s) EXPECT_TRUE(bitwise_equal(got.s[t][s], want.s[t][s])) << "state " << s;
        }
        // The step really moved the parameters (a sharded step that did nothing would not match
        // either, but say it directly).
        EXPECT_FALSE(bitwise_equal(got.p[0], make_model(make_plan(parse_chain(c.spec))).p[0]));
      }
    }
}

TEST(Exchange, WithoutTheExchangeAShardedClipDiffers) {
  // The exchange is what makes the clip coefficient global: each rank's own norm gives another result.
  const std::string spec = "chain(clip_by_global_norm(max_norm=0.5), adamw(lr=0.01))";
  const Model want = run_unsharded(spec, Backend::cpu, 2, -1);
  Plan plan = make_plan(parse_chain(spec));
  Model m = make_model(plan);
  Optimizer half(parse_chain(spec), Backend::cpu);
  half.set_tensors({ref_of(m, {0, 0, kSizes[0]}), ref_of(m, {1, 0, kSizes[1]})});  // rank 0's tensors alone
  for (int k = 0; k < 2; ++k) {
    fill_grads(m, k, -1);
    half.step();
  }
  EXPECT_FALSE(bitwise_equal(m.p[0], want.p[0]));
}

TEST(Exchange, ScheduleListsTheExchangeBetweenAReducePassAndItsCombine) {
  using K = ScheduleStep::Kind;
  Plan lamb = make_plan(parse_chain("lamb()"));
  std::vector<K> kinds;
  for (const ScheduleStep& st : lamb.schedule) kinds.push_back(st.kind);
  const std::vector<K> want = {K::Scalar, K::Pass, K::Exchange, K::Combine, K::Scalar, K::Pass, K::Exchange,
                               K::Combine, K::Scalar, K::Pass};
  EXPECT_EQ(kinds, want);
  Plan adamw = make_plan(parse_chain("adamw()"));
  ASSERT_EQ(adamw.schedule.size(), 2u);
  EXPECT_EQ(adamw.schedule[0].kind, K::Scalar);
  EXPECT_EQ(adamw.schedule[1].kind, K::Pass);
  const std::string d = lamb.describe();
  EXPECT_NE(d.find("exchange 0: hook point"), std::string::npos) << d;
  EXPECT_NE(d.find("combine 1:"), std::string::npos) << d;
}

TEST(Exchange, BadMapsAreClearErrors) {
  Plan plan = make_plan(parse_chain("lamb()"));
  Model m = make_model(plan);
  Optimizer opt(parse_chain("lamb()"), Backend::cpu);
  opt.set_tensors({ref_of(m, {0, 0, kSizes[0]})});  // 3 chunks of 16384
  auto noop = [](const PartialSums&) {};
  EXPECT_NE(testing::error_of([&] { opt.set_exchange({5, {}}, noop); }).find("0 chunk spans given for 1 tensors"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { opt.set_exchange({5, {{0, 2}}}, noop); }).find("covers the whole tensor"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { opt.set_exchange({5, {{3, 3}}}, noop); }).find("[3, 6) of 5 global chunks"),
            std::string::npos);
  EXPECT_NO_THROW(opt.set_exchange({5, {{2, 3}}}, noop));
  EXPECT_NO_THROW(opt.set_exchange({}, nullptr));  // cleared: steps unsharded again
  EXPECT_NO_THROW(opt.step());
}

}  // namespace
}  // namespace optfuse
