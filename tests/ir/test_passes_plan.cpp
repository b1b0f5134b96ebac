// The pass pipeline (constant folding, CSE, dead code) and the planner (phases, levels, bytes per
// element), on small user rules whose graphs are counted by hand below, and on the built-in chains
// whose memory traffic the README quotes. Passes must never change a value, so the rewritten
// programs are also stepped and compared with hand-computed results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"

namespace optfuse {
namespace {

int count_op(const Program& p, Op op) {
  int n = 0;
  for (const Node& x : p.graph.nodes()) n += x.op == op;
  return n;
}

Rule user_rule(const std::string& name, Rule::UpdateFn fn) { return Rule(name).update(std::move(fn)); }

// Steps one float32 tensor once with each host backend; returns the new parameters per backend.
std::vector<std::vector<float>> step_once(const Chain& c, std::vector<float> param, std::vector<float> grad) {
  std::vector<std::vector<float>> out;
  for (Backend b : {Backend::reference, Backend::cpu}) {
    Optimizer opt(c, b);
    std::vector<float> p = param, g = grad;
    std::vector<std::vector<float>> st(opt.plan().program.states.size(), std::vector<float>(p.size() + 1, 0.f));
    TensorRef t{{p.data(), static_cast<int64_t>(p.size()), DType::f32}, {g.data(), static_cast<int64_t>(g.size()), DType::f32}, {}, 0};
    for (auto& s : st) t.states.push_back({s.data(), static_cast<int64_t>(p.size()), DType::f32});
    opt.set_tensors({t});
    opt.step();
    out.push_back(p);
  }
  return out;
}

// update = u*(2*0.5)/(4-3) + (p*u + u*p), plus a named value nobody uses. Built graph, by id:
//   0 param, 1 grad, 2 const 2, 3 const 0.5, 4 mul(2,3), 5 mul(1,4), 6 const 4, 7 const 3,
//   8 sub(6,7), 9 div(5,8), 10 exp(1) [unused], 11 mul(0,1), 12 mul(1,0), 13 add(11,12),
//   14 add(9,13), 15 add(0,14) = param_new                                         -> 16 nodes
// fold_constants: 2*0.5 -> const 1 and u*1 -> u, 4-3 -> const 1 (the same node), u/1 -> u; the
//   nodes 4, 5, 8, 9 vanish and one const 1 appears                                -> 13 nodes
// CSE: mul(1,0) is mul(0,1) with inputs swapped, so one multiply                   -> 12 nodes
// dead code: the constants and exp go; param, grad, mul, add, add, add remain      -> 6 nodes
Chain pass_demo_chain() {
  return {user_rule("pass_demo", [](RuleBuilder& b) {
    Expr u = b.update(), p = b.param();
    Expr a = u * (b.constant(2.0) * b.constant(0.5)) / (b.constant(4.0) - b.constant(3.0));
    b.name(exp(u), "unused_value");
    return a + (p * u + u * p);
  })};
}

TEST(Passes, PassLogCountsEveryPass) {
  Plan plan = make_plan(pass_demo_chain());
  std::vector<std::string> want = {"built: 16 nodes", "fold_constants: 13 nodes",
                                   "eliminate_common_subexpressions: 12 nodes", "eliminate_dead_code: 6 nodes"};
  EXPECT_EQ(plan.pass_log, want);
  EXPECT_EQ(plan.program.graph.size(), 6u);
}

TEST(Passes, ConstantFoldingShrinksTheGraphAndKeepsTheValue) {
  Program built = build_program(pass_demo_chain());
  EXPECT_EQ(count_op(built, Op::Div), 1);
  EXPECT_EQ(count_op(built, Op::Sub), 1);
  Plan plan = make_plan(pass_demo_chain());
  // x*1 and x/1 are gone, 4-3 is folded, no constant is left at all.
  EXPECT_EQ(count_op(plan.program, Op::Div), 0);
  EXPECT_EQ(count_op(plan.program, Op::Sub), 0);
  EXPECT_EQ(count_op(plan.program, Op::Const), 0);
  EXPECT_EQ(count_op(plan.program, Op::Mul), 1);
  EXPECT_EQ(count_op(plan.program, Op::Add), 3);
  // p + (g + 2 p g)
  std::vector<float> p = {1.5f, -2.0f, 0.25f}, g = {0.5f, 3.0f, -1.0f};
  for (const auto& got : step_once(pass_demo_chain(), p, g))
    for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(got[i], p[i] + (g[i] + 2 * p[i] * g[i])) << i;
}

TEST(Passes, MultiplyByOneIsRemoved) {
  Chain c{user_rule("times_one", [](RuleBuilder& b) { return b.update() * 1.0; })};
  EXPECT_EQ(count_op(build_program(c), Op::Mul), 1);
  Plan plan = make_plan(c);
  EXPECT_EQ(count_op(plan.program, Op::Mul), 0);
  const Node& out = plan.program.graph.node(plan.program.param_out);
  ASSERT_EQ(out.op, Op::Add);  // param + grad directly
  EXPECT_EQ(plan.program.graph.node(out.in[0]).op, Op::Param);
  EXPECT_EQ(plan.program.graph.node(out.in[1]).op, Op::Grad);
}

// -0.0 and +0.0 are different constants, and x + 0 is not an identity (-0 + 0 = +0) while x - 0
// and x * 1 are. Checked on the graph and end to end with param = grad = -0.
TEST(Passes, NegativeZeroIsPreserved) {
  Chain neg{user_rule("neg_zero", [](RuleBuilder& b) { return b.update() * (-b.constant(0.0)) + b.update() * 0.0; })};
  Plan plan = make_plan(neg);
  int neg_zero = 0, pos_zero = 0;
  for (const Node& n : plan.program.graph.nodes())
    if (n.op == Op::Const && n.value == 0.0) (std::signbit(n.value) ? neg_zero : pos_zero)++;
  EXPECT_EQ(neg_zero, 1);  // -(0.0) folded to the constant -0.0, not merged with +0.0
  EXPECT_EQ(pos_zero, 1);

  Chain plus{user_rule("plus_zero", [](RuleBuilder& b) { return b.update() + 0.0; })};
  EXPECT_EQ(count_op(make_plan(plus).program, Op::Add), 2);  // u + 0 kept, then param + update
  for (const auto& got : step_once(plus, {-0.0f}, {-0.0f})) EXPECT_FALSE(std::signbit(got[0]));  // -0+(+0)

  Chain minus{user_rule("minus_zero", [](RuleBuilder& b) { return (b.update() - 0.0) * 1.0; })};
  EXPECT_EQ(count_op(make_plan(minus).program, Op::Sub), 0);
  for (const auto& got : step_once(minus, {-0.0f}, {-0.0f})) EXPECT_TRUE(std::signbit(got[0]));  // -0 + -0
}

TEST(Passes, CommonSubexpressionsAreShared) {
  Chain c{user_rule("cse", [](RuleBuilder& b) {
    Expr u = b.update(), p = b.param();
    return (u * p) / (p * u) + max(u, p) - max(p, u);
  })};
  Program built = build_program(c);
  EXPECT_EQ(count_op(built, Op::Mul), 2);
  EXPECT_EQ(count_op(built, Op::Max), 2);
  Plan plan = make_plan(c);
  EXPECT_EQ(count_op(plan.program, Op::Mul), 1);
  EXPECT_EQ(count_op(plan.program, Op::Max), 1);
  // The division now has one node as both inputs; the one max is both the added and the
  // subtracted term.
  const Graph& g = plan.program.graph;
  int divs = 0;
  for (const Node& n : g.nodes()) {
    if (n.op != Op::Div) continue;
    EXPECT_EQ(n.in[0], n.in[1]);
    ++divs;
  }
  EXPECT_EQ(divs, 1);
  for (const Node& n : g.nodes()) {
    if (n.op != Op::Sub) continue;
    const Node& added = g.node(n.in[0]);
    ASSERT_EQ(added.op, Op::Add);
    EXPECT_TRUE(added.in[0] == n.in[1] || added.in[1] == n.in[1]);
    EXPECT_EQ(g.node(n.in[1]).op, Op::Max);
  }
  for (const auto& got : step_once(c, {2.0f, -3.0f}, {0.5f, 4.0f})) {
    EXPECT_EQ(got[0], 2.0f + 1.0f);  // (u p)/(p u) = 1, max terms cancel
    EXPECT_EQ(got[1], -3.0f + 1.0f);
  }
}

TEST(Passes, DeadCodeIsRemoved) {
  Chain c{user_rule("dead", [](RuleBuilder& b) {
    b.name(exp(b.update()) * 3.0, "never_used");
    b.name(sqrt(b.param()), "also_unused");
    return b.update();
  })};
  Program built = build_program(c);
  EXPECT_EQ(count_op(built, Op::Exp), 1);
  EXPECT_EQ(count_op(built, Op::Sqrt), 1);
  Plan plan = make_plan(c);
  EXPECT_EQ(count_op(plan.program, Op::Exp), 0);
  EXPECT_EQ(count_op(plan.program, Op::Sqrt), 0);
  for (const auto& kv : plan.program.names) {
    EXPECT_NE(kv.second, "never_used");
    EXPECT_NE(kv.second, "also_unused");
  }
  EXPECT_EQ(plan.program.graph.size(), 3u);  // param, grad, param + grad
}

TEST(Plan, AdamwIsOnePassOf28BytesPerElement) {
  Plan plan = make_plan(adamw());
  ASSERT_EQ(plan.phases.size(), 1u);
  const ElementPhase& up = plan.phases[0];
  EXPECT_EQ(up.kind, ElementPhase::Kind::Update);
  EXPECT_EQ(up.level, 0);
  EXPECT_TRUE(up.reads_param);
  EXPECT_TRUE(up.reads_grad);
  EXPECT_EQ(up.reads_states, (std::vector<int>{0, 1}));
  EXPECT_TRUE(up.writes_param);
  EXPECT_EQ(up.writes_states, (std::vector<int>{0, 1}));
  EXPECT_EQ(up.reads(), 4);   // param grad exp_avg exp_avg_sq
  EXPECT_EQ(up.writes(), 3);  // param exp_avg exp_avg_sq
  std::string d = plan.describe();
  EXPECT_NE(d.find("1 pass(es) over memory"), std::string::npos) << d;
  EXPECT_NE(d.find("bytes per element: 16 read + 12 written = 28"), std::string::npos) << d;
  EXPECT_NE(d.find("total bytes per element: 28\n"), std::string::npos) << d;
  std::string h = plan.describe(DType::bf16);
  EXPECT_NE(h.find("bytes per element: 8 read + 6 written = 14"), std::string::npos) << h;
  EXPECT_NE(h.find("total bytes per element: 14\n"), std::string::npos) << h;
  EXPECT_EQ(plan.layout.hypers_per_group, 6);  // b1 b2 eps, lr weight_decay (decay), lr
  EXPECT_EQ(plan.layout.reductions, 0);
}

TEST(Plan, ClipPlusAdamwIsAGradientReadThenOneUpdate) {
  Plan plan = make_plan(chain({clip_by_global_norm(1.0), adamw()}));
  ASSERT_EQ(plan.phases.size(), 2u);
  const ElementPhase& red = plan.phases[0];
  EXPECT_EQ(red.kind, ElementPhase::Kind::Reduce);
  EXPECT_EQ(red.level, 1);
  EXPECT_FALSE(red.reads_param);
  EXPECT_TRUE(red.reads_grad);
  EXPECT_TRUE(red.reads_states.empty());
  EXPECT_EQ(red.reads(), 1);
  EXPECT_EQ(red.writes(), 0);
  ASSERT_EQ(red.reductions.size(), 1u);
  EXPECT_EQ(plan.program.graph.node(red.reductions[0]).op, Op::SumSquares);
  EXPECT_EQ(plan.phases[1].kind, ElementPhase::Kind::Update);
  EXPECT_EQ(plan.phases[1].level, 1);
  EXPECT_EQ(plan.phases[1].reads() + plan.phases[1].writes(), 7);
  std::string d = plan.describe();
  EXPECT_NE(d.find("2 pass(es) over memory"), std::string::npos) << d;
  EXPECT_NE(d.find("bytes per element: 4 read + 0 written = 4"), std::string::npos) << d;
  EXPECT_NE(d.find("total bytes per element: 32\n"), std::string::npos) << d;
  EXPECT_NE(plan.describe(DType::f16).find("total bytes per element: 16\n"), std::string::npos);
  // The clip coefficient is a uniform value of level 1 that the update pass reads.
  bool found = false;
  for (NodeId d_id : plan.derived) {
    auto it = plan.program.names.find(d_id);
    if (it == plan.program.names.end() || it->second != "clip_coef") continue;
    found = true;
    EXPECT_EQ(plan.kind[static_cast<size_t>(d_id)], ValueKind::Uniform);
    EXPECT_EQ(plan.level[static_cast<size_t>(d_id)], 1);
  }
  EXPECT_TRUE(found) << d;
}

TEST(Plan, SkipIfNonfiniteAddsAReducePhase) {
  Plan plain = make_plan(adam());
  Plan skip = make_plan(chain({make_builtin("skip_if_nonfinite"), adam()}));
  EXPECT_EQ(plain.phases.size(), 1u);
  ASSERT_EQ(skip.phases.size(), 2u);
  ASSERT_EQ(skip.phases[0].reductions.size(), 1u);
  EXPECT_EQ(skip.program.graph.node(skip.phases[0].reductions[0]).op, Op::AnyNonFinite);
  EXPECT_EQ(skip.phases[0].reads(), 1);
  ASSERT_NE(skip.program.skip, kNoNode);
  EXPECT_EQ(skip.kind[static_cast<size_t>(skip.program.skip)], ValueKind::Uniform);
}

// Two reductions of the same level share one pass; a reduction of a value that depends on another
// reduction needs the next pass: skip then clip is two passes, clip then skip or clip(1) then
// clip(0.5) is three.
TEST(Plan, OneReducePhasePerLevel) {
  // skip_if_nonfinite after a clip looks at the clipped update, a level-1 value: its reduction is
  // level 2 and needs its own pass.
  Plan after = make_plan(chain({clip_by_global_norm(1.0), make_builtin("skip_if_nonfinite"), sgd()}));
  ASSERT_EQ(after.phases.size(), 3u);
  EXPECT_EQ(after.max_level(), 2);
  EXPECT_EQ(after.program.graph.node(after.phases[0].reductions.at(0)).op, Op::SumSquares);
  EXPECT_EQ(after.program.graph.node(after.phases[1].reductions.at(0)).op, Op::AnyNonFinite);

  Plan both = make_plan(chain({make_builtin("skip_if_nonfinite"), clip_by_global_norm(1.0), sgd()}));
  ASSERT_EQ(both.phases.size(), 2u);
  EXPECT_EQ(both.phases[0].reductions.size(), 2u);  // any_nonfinite(g) and sum_squares(g): one pass
  EXPECT_EQ(both.phases[0].reads(), 1);

  Plan two = make_plan(chain({clip_by_global_norm(1.0), clip_by_global_norm(0.5), sgd({{"lr", 0.1}})}));
  ASSERT_EQ(two.phases.size(), 3u);
  EXPECT_EQ(two.phases[0].level, 1);
  EXPECT_EQ(two.phases[1].level, 2);
  EXPECT_EQ(two.phases[2].level, 2);
  EXPECT_EQ(two.phases[0].kind, ElementPhase::Kind::Reduce);
  EXPECT_EQ(two.phases[1].kind, ElementPhase::Kind::Reduce);
  EXPECT_EQ(two.phases[2].kind, ElementPhase::Kind::Update);
  EXPECT_EQ(two.reductions.size(), 2u);
  // grad (4) + grad (4) + param, grad read and param written (12)
  EXPECT_NE(two.describe().find("total bytes per element: 20\n"), std::string::npos) << two.describe();
}

// The two-clip plan computes what the formulas say: the second clip sees the first one's output.
TEST(Plan, TwoClipsStepCorrectly) {
  Chain c = chain({clip_by_global_norm(1.0), clip_by_global_norm(0.5), sgd({{"lr", 0.1}})});
  std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {3.0f, 4.0f, 12.0f};  // norm 13
  double c1 = std::min(1.0 / (13.0 + 1e-6), 1.0);
  double n2 = 13.0 * c1, c2 = std::min(0.5 / (n2 + 1e-6), 1.0);
  for (const auto& got : step_once(c, p, g))
    for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(got[i], p[i] - 0.1 * g[i] * c1 * c2, 1e-6) << i;
}

// Scalar table layout: globals | reductions | hypers | steps | skip | derived, for G groups.
TEST(Plan, ScalarLayoutDependsOnlyOnGroups) {
  Plan plan = make_plan(chain({clip_by_global_norm(1.0), adamw()}));
  const ScalarLayout& L = plan.layout;
  EXPECT_EQ(L.reductions, 1);
  EXPECT_EQ(L.hypers_per_group, 7);  // max_norm b1 b2 eps, lr weight_decay (decay), lr
  EXPECT_EQ(L.derived_per_group, static_cast<int>(plan.derived.size()));
  EXPECT_EQ(L.hypers_offset(), kNumGlobals + 1);
  EXPECT_EQ(L.size(3), kNumGlobals + 1 + 3 * 7 + 3 + 3 + 3 * L.derived_per_group);
}

TEST(Plan, DumpIrPrintsEveryPass) {
  ::setenv("OPTFUSE_DUMP_IR", "1", 1);
  ::testing::internal::CaptureStderr();
  make_plan(adamw());
  std::string err = ::testing::internal::GetCapturedStderr();
  ::unsetenv("OPTFUSE_DUMP_IR");
  size_t at = 0;
  for (const char* header : {"== IR as built\n", "== IR after fold_constants\n",
                             "== IR after eliminate_common_subexpressions\n", "== IR after eliminate_dead_code\n"}) {
    size_t next = err.find(header, at);
    ASSERT_NE(next, std::string::npos) << header << " missing or out of order in:\n" << err;
    at = next + 1;
  }
  EXPECT_NE(err.find("exp_avg_new"), std::string::npos);
  EXPECT_NE(err.find("-> param"), std::string::npos);

  ::setenv("OPTFUSE_DUMP_IR", "0", 1);
  ::testing::internal::CaptureStderr();
  make_plan(adamw());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ::unsetenv("OPTFUSE_DUMP_IR");
}

TEST(Plan, PrintIrNamesKindsAndOutputs) {
  Plan plan = make_plan(adamw());
  std::string ir = print_ir(plan.program, &plan.kind);
  EXPECT_NE(ir.find("= state scale_by_adam.exp_avg   ; element exp_avg"), std::string::npos) << ir;
  EXPECT_NE(ir.find("; uniform inv_bias_correction1"), std::string::npos) << ir;
  EXPECT_NE(ir.find("; element exp_avg_new -> scale_by_adam.exp_avg"), std::string::npos) << ir;
  EXPECT_NE(ir.find("; element param_new -> param"), std::string::npos) << ir;
  // One line per node.
  EXPECT_EQ(static_cast<size_t>(std::count(ir.begin(), ir.end(), '\n')), plan.program.graph.size());
}

}  // namespace
}  // namespace optfuse
