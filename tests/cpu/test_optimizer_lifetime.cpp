// Lifetime of optfuse::Optimizer: it holds its plan by shared ownership (the executor keeps the plan
// alive and refers to nothing inside the Optimizer), moves leave the source empty, and every call on
// a moved-from Optimizer throws optfuse::Error until a live Optimizer is assigned to it.
//
// Checked for the cpu backend (compiled code) and the reference backend:
//   - optimizers in a std::vector that reallocates several times (every element moved each time)
//     step their own tensors bit for bit like never-moved twins, and each plan keeps its address;
//   - move assignment into a live optimizer: the target then runs the source's chain on the
//     source's tensors, never touches the old target's tensors again, and (cpu) the old target's
//     compiled shared object is unloaded at the assignment;
//   - a moved-from optimizer throws "this optfuse::Optimizer was moved from; ..." from step(),
//     set_tensors(), set_hyper(), plan(), source() (and the other calls) without touching memory;
//   - assigning a live optimizer to a moved-from one makes it usable again.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "testing/tensor_set.h"

namespace optfuse {

// Test names and failure messages say "cpu" / "reference" rather than the enum's bytes.
static void PrintTo(Backend b, std::ostream* os) { *os << backend_name(b); }

namespace {

using testing::HostTensorSet;
using testing::TensorSpec;

const char kMovedFrom[] = "this optfuse::Optimizer was moved from; ";

// Distinct chains (distinct states, phases and generated sources), so that an optimizer running
// another's plan or tensors cannot produce the twin's bits by accident.
const char* kSpecs[] = {
    "adamw(lr=0.1, weight_decay=0.2)",
    "sgd(lr=0.1, momentum=0.9)",
    "chain(clip_by_global_norm(1.0), adam(lr=0.05))",
    "lion(lr=0.1, weight_decay=0.1)",
    "rmsprop(lr=0.01, momentum=0.5, centered=true)",
};
constexpr size_t kNumSpecs = sizeof(kSpecs) / sizeof(kSpecs[0]);

// Sizes differ per optimizer too (two groups; one tensor spans several 16384-element chunks).
std::vector<TensorSpec> sizes_for(size_t i) {
  return {{static_cast<int64_t>(5 + i), 0}, {static_cast<int64_t>(1000 + 37 * i), 1}, {40000, 0}};
}

// Bitwise equality of every role (param, grad, states) of every tensor.
::testing::AssertionResult same_bytes(HostTensorSet& a, HostTensorSet& b) {
  if (a.size() != b.size() || a.num_roles() != b.num_roles()) return ::testing::AssertionFailure() << "shapes differ";
  for (size_t t = 0; t < a.size(); ++t)
    for (size_t r = 0; r < a.num_roles(); ++r)
      if (a.bytes(t, r) != b.bytes(t, r))
        return ::testing::AssertionFailure() << "tensor " << t << " role " << r << " differs";
  return ::testing::AssertionSuccess();
}

// Number of parameter elements (role 0) that differ between two sets.
int64_t params_changed(HostTensorSet& a, HostTensorSet& b) {
  int64_t n = 0;
  for (size_t t = 0; t < a.size(); ++t)
    for (int64_t i = 0; i < a.specs()[t].numel; ++i) n += a.value(t, 0, i) != b.value(t, 0, i);
  return n;
}

int64_t total_elements(const HostTensorSet& s) {
  int64_t n = 0;
  for (const TensorSpec& sp : s.specs()) n += sp.numel;
  return n;
}

// Group 1 gets a different learning rate than group 0, so that groups really differ.
void configure(Optimizer& o, size_t i) { o.set_hyper(1, "lr", 0.01 * static_cast<double>(i + 1)); }

// New gradients for step `step` of optimizer `i` (the same in an optimizer's set and its twin's).
void new_grads(HostTensorSet& s, size_t i, int step) { s.randomize_grads(1000 * (i + 1) + static_cast<uint64_t>(step)); }

// Shared objects mapped into this process (the paths of /proc/self/maps that end in ".so").
std::set<std::string> mapped_shared_objects() {
  std::set<std::string> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.size() > 3 && path.compare(path.size() - 3, 3, ".so") == 0) out.insert(path);
  }
  return out;
}

std::set<std::string> minus(const std::set<std::string>& a, const std::set<std::string>& b) {
  std::set<std::string> out;
  for (const std::string& s : a)
    if (!b.count(s)) out.insert(s);
  return out;
}

// Expects `call` to throw optfuse::Error whose message starts with kMovedFrom.
template <class F>
void expect_moved_from_error(const char* what, F&& call) {
  SCOPED_TRACE(what);
  try {
    call();
    ADD_FAILURE() << what << " on a moved-from optimizer did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(kMovedFrom, 0), 0u) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << " threw something other than optfuse::Error: " << e.what();
  }
}

class OptimizerLifetime : public ::testing::TestWithParam<Backend> {};

TEST_P(OptimizerLifetime, VectorGrowthMovesEveryOptimizerAndEachStillStepsItsOwnTensors) {
  const Backend backend = GetParam();
  std::vector<std::unique_ptr<Optimizer>> twins;  // never moved
  std::vector<std::unique_ptr<HostTensorSet>> mine, theirs, fresh;
  std::vector<Optimizer> moved;
  moved.reserve(1);
  std::vector<const Plan*> plan_addresses;
  int reallocations = 0;
  for (size_t i = 0; i < kNumSpecs; ++i) {
    Chain chain = parse_chain(kSpecs[i]);
    twins.push_back(std::make_unique<Optimizer>(chain, backend, 2));
    configure(*twins.back(), i);
    // A temporary moved into the vector; every reallocation below moves it again.
    size_t capacity = moved.capacity();
    moved.push_back(Optimizer(chain, backend, 2));
    reallocations += moved.capacity() != capacity;
    Optimizer& o = moved.back();
    configure(o, i);
    mine.push_back(std::make_unique<HostTensorSet>(o.plan(), sizes_for(i), DType::f32, 17 + i));
    theirs.push_back(std::make_unique<HostTensorSet>(o.plan(), sizes_for(i), DType::f32, 17 + i));
    fresh.push_back(std::make_unique<HostTensorSet>(o.plan(), sizes_for(i), DType::f32, 17 + i));
    // Tensors are set before the moves, so the tensor table travels with the optimizer.
    o.set_tensors(mine.back()->refs());
    twins.back()->set_tensors(theirs.back()->refs());
    plan_addresses.push_back(&o.plan());
    // One step before any further growth: later steps run on state written before the moves.
    new_grads(*mine.back(), i, 1);
    new_grads(*theirs.back(), i, 1);
    o.step();
    twins.back()->step();
  }
  // The vector really reallocated, moving the optimizers already in it (capacities 1, 2, 4, 8 for
  // 5 elements: the first one was moved three times more).
  ASSERT_GE(reallocations, 3);
  ASSERT_EQ(moved.size(), kNumSpecs);

  for (size_t i = 0; i < kNumSpecs; ++i) {
    SCOPED_TRACE(kSpecs[i]);
    Optimizer& o = moved[i];
    EXPECT_EQ(&o.plan(), plan_addresses[i]) << "the plan moved with the optimizer";
    EXPECT_EQ(o.backend(), backend);
    EXPECT_EQ(o.num_groups(), 2);
    EXPECT_DOUBLE_EQ(o.hyper(1, "lr"), 0.01 * static_cast<double>(i + 1));
    EXPECT_EQ(o.step_count(0), 1);
    ASSERT_EQ(o.tensors().size(), 3u);
    EXPECT_EQ(o.tensors()[1].param.data, mine[i]->bytes(1, 0).data());
    EXPECT_EQ(o.source(), twins[i]->source());
    if (backend == Backend::cpu) EXPECT_NE(o.source().find("of_phase0"), std::string::npos);
    // A hyperparameter changed after the moves reaches the executor (the twin gets the same).
    o.set_hyper(0, "lr", 0.03);
    twins[i]->set_hyper(0, "lr", 0.03);
  }

  for (int step = 2; step <= 5; ++step)
    for (size_t i = 0; i < kNumSpecs; ++i) {
      new_grads(*mine[i], i, step);
      new_grads(*theirs[i], i, step);
      moved[i].step();
      twins[i]->step();
    }

  for (size_t i = 0; i < kNumSpecs; ++i) {
    SCOPED_TRACE(kSpecs[i]);
    EXPECT_EQ(moved[i].step_count(0), 5);
    EXPECT_EQ(moved[i].step_count(1), 5);
    EXPECT_TRUE(same_bytes(*mine[i], *theirs[i]));
    // Real updates happened: (nearly) every parameter element moved away from its start.
    int64_t n = total_elements(*mine[i]);
    EXPECT_GE(params_changed(*mine[i], *fresh[i]), n - n / 100);
  }
}

TEST_P(OptimizerLifetime, MoveAssignmentReplacesTheTargetAndReleasesItsResources) {
  const Backend backend = GetParam();
  // A chain no other optimizer in this test uses, so that its compiled object is its own.
  const char* old_spec = "chain(trace(momentum=0.7, dampening=0.3), scale_by_learning_rate(0.2))";
  const std::set<std::string> before = mapped_shared_objects();

  auto target = std::make_unique<Optimizer>(parse_chain(old_spec), backend, 1);
  HostTensorSet old_set(target->plan(), {{3000, 0}}, DType::f32, 3);
  target->set_tensors(old_set.refs());
  old_set.randomize_grads(4);
  target->step();
  HostTensorSet old_after_step = old_set;
  HostTensorSet old_fresh(target->plan(), {{3000, 0}}, DType::f32, 3);
  EXPECT_GT(params_changed(old_set, old_fresh), 2900);
  const std::set<std::string> old_objects = minus(mapped_shared_objects(), before);
  if (backend == Backend::cpu) {
    ASSERT_NE(target->backend_status().find("compiled"), std::string::npos) << target->backend_status();
    ASSERT_FALSE(old_objects.empty()) << "the compiled optimizer mapped no new shared object";
  }

  const size_t i = 2;
  Chain chain = parse_chain(kSpecs[i]);
  Optimizer source(chain, backend, 2), twin(chain, backend, 2);
  configure(source, i);
  configure(twin, i);
  HostTensorSet mine(source.plan(), sizes_for(i), DType::f32, 9), theirs(twin.plan(), sizes_for(i), DType::f32, 9);
  source.set_tensors(mine.refs());
  twin.set_tensors(theirs.refs());
  const Plan* source_plan = &source.plan();

  *target = std::move(source);

  // The old target's compiled code is gone with its executor (nothing else shares it).
  if (backend == Backend::cpu) {
    std::set<std::string> still = mapped_shared_objects();
    for (const std::string& so : old_objects) EXPECT_EQ(still.count(so), 0u) << so << " is still mapped";
  }
  // The target is now the source: its plan (same address), groups, hyperparameters and tensors.
  EXPECT_EQ(&target->plan(), source_plan);
  EXPECT_EQ(target->num_groups(), 2);
  EXPECT_EQ(target->plan().program.states.size(), twin.plan().program.states.size());
  EXPECT_DOUBLE_EQ(target->hyper(1, "lr"), 0.01 * static_cast<double>(i + 1));
  ASSERT_EQ(target->tensors().size(), 3u);
  EXPECT_EQ(target->tensors()[2].param.data, mine.bytes(2, 0).data());
  expect_moved_from_error("step() on the assigned-from optimizer", [&] { source.step(); });

  for (int step = 1; step <= 4; ++step) {
    new_grads(mine, i, step);
    new_grads(theirs, i, step);
    target->step();
    twin.step();
  }
  EXPECT_EQ(target->step_count(0), 4);
  EXPECT_TRUE(same_bytes(mine, theirs));
  HostTensorSet fresh(twin.plan(), sizes_for(i), DType::f32, 9);
  EXPECT_GE(params_changed(mine, fresh), total_elements(mine) - total_elements(mine) / 100);
  // The old target's tensors were never touched again.
  EXPECT_TRUE(same_bytes(old_set, old_after_step));

  // Destroying the target releases what it took over; the twin is unaffected.
  target.reset();
  new_grads(theirs, i, 5);
  twin.step();
  EXPECT_EQ(twin.step_count(0), 5);
}

TEST_P(OptimizerLifetime, MovedFromOptimizerThrowsOnEveryCall) {
  const Backend backend = GetParam();
  Chain chain = parse_chain(kSpecs[0]);
  Optimizer a(chain, backend, 2);
  HostTensorSet set(a.plan(), sizes_for(0), DType::f32, 21);
  a.set_tensors(set.refs());
  a.set_hyper(0, "lr", 0.2);
  Optimizer b(std::move(a));

  // Nothing the source still answers suggests it is usable.
  EXPECT_EQ(a.num_groups(), 0);
  EXPECT_TRUE(a.tensors().empty());
  HostTensorSet before = set;
  StepInputs none;
  expect_moved_from_error("step()", [&] { a.step(); });
  expect_moved_from_error("step(inputs)", [&] { a.step(none); });
  expect_moved_from_error("set_tensors()", [&] { a.set_tensors(set.refs()); });
  expect_moved_from_error("set_tensors({})", [&] { a.set_tensors({}); });
  expect_moved_from_error("set_hyper()", [&] { a.set_hyper(0, "lr", 0.1); });
  expect_moved_from_error("plan()", [&] { (void)a.plan(); });
  expect_moved_from_error("source()", [&] { (void)a.source(); });
  expect_moved_from_error("backend_status()", [&] { (void)a.backend_status(); });
  expect_moved_from_error("hyper()", [&] { (void)a.hyper(0, "lr"); });
  expect_moved_from_error("step_count()", [&] { (void)a.step_count(0); });
  expect_moved_from_error("set_step_count()", [&] { a.set_step_count(0, 3); });
  expect_moved_from_error("add_group()", [&] { a.add_group(); });
  expect_moved_from_error("set_grad_pointers()", [&] { a.set_grad_pointers({}); });
  // The calls that threw touched nothing, and left it moved-from.
  EXPECT_TRUE(same_bytes(set, before));
  EXPECT_EQ(a.num_groups(), 0);
  EXPECT_TRUE(a.tensors().empty());

  // Moving a moved-from optimizer gives another moved-from one.
  Optimizer c(std::move(a));
  expect_moved_from_error("step() after moving a moved-from optimizer", [&] { c.step(); });
  expect_moved_from_error("plan() after moving a moved-from optimizer", [&] { (void)c.plan(); });

  // The optimizer moved to kept everything: group count, hyperparameters, tensors, and it steps.
  EXPECT_EQ(b.num_groups(), 2);
  EXPECT_DOUBLE_EQ(b.hyper(0, "lr"), 0.2);
  ASSERT_EQ(b.tensors().size(), 3u);
  set.randomize_grads(5);
  b.step();
  EXPECT_EQ(b.step_count(0), 1);
  EXPECT_GT(params_changed(set, before), total_elements(set) / 2);

  // Moved-from through move assignment throws the same way.
  Optimizer d(chain, backend, 1);
  d = std::move(b);
  expect_moved_from_error("step() after move assignment", [&] { b.step(); });
  expect_moved_from_error("set_tensors() after move assignment", [&] { b.set_tensors(set.refs()); });
  expect_moved_from_error("set_hyper() after move assignment", [&] { b.set_hyper(0, "lr", 0.1); });
  expect_moved_from_error("plan() after move assignment", [&] { (void)b.plan(); });
  expect_moved_from_error("source() after move assignment", [&] { (void)b.source(); });
  EXPECT_EQ(d.num_groups(), 2);
  EXPECT_EQ(d.step_count(0), 1);

  // Self move assignment (through a reference, as generic code would do it) keeps it live.
  Optimizer& alias = d;
  d = std::move(alias);
  EXPECT_EQ(d.num_groups(), 2);
  EXPECT_EQ(d.step_count(0), 1);
  set.randomize_grads(6);
  d.step();
  EXPECT_EQ(d.step_count(0), 2);
}

TEST_P(OptimizerLifetime, AssigningALiveOptimizerRevivesAMovedFromOne) {
  const Backend backend = GetParam();
  const size_t i = 1;
  Chain chain = parse_chain(kSpecs[i]);
  Optimizer a(parse_chain(kSpecs[3]), backend, 1);
  Optimizer elsewhere(std::move(a));
  expect_moved_from_error("step()", [&] { a.step(); });

  // From a temporary.
  a = Optimizer(chain, backend, 2);
  Optimizer twin(chain, backend, 2);
  configure(a, i);
  configure(twin, i);
  EXPECT_EQ(a.num_groups(), 2);
  EXPECT_EQ(a.source(), twin.source());
  HostTensorSet mine(a.plan(), sizes_for(i), DType::f32, 33), theirs(twin.plan(), sizes_for(i), DType::f32, 33);
  a.set_tensors(mine.refs());
  twin.set_tensors(theirs.refs());
  for (int step = 1; step <= 3; ++step) {
    new_grads(mine, i, step);
    new_grads(theirs, i, step);
    a.step();
    twin.step();
  }
  EXPECT_EQ(a.step_count(1), 3);
  EXPECT_TRUE(same_bytes(mine, theirs));
  HostTensorSet fresh(a.plan(), sizes_for(i), DType::f32, 33);
  EXPECT_GE(params_changed(mine, fresh), total_elements(mine) - total_elements(mine) / 100);

  // From a named live optimizer, which then is moved-from in turn: the revived one continues the
  // state (step counts, tensors) of the one it took over.
  Optimizer b(std::move(a));
  expect_moved_from_error("step() after moving again", [&] { a.step(); });
  a = std::move(b);
  expect_moved_from_error("step() on the new source", [&] { b.step(); });
  for (int step = 4; step <= 5; ++step) {
    new_grads(mine, i, step);
    new_grads(theirs, i, step);
    a.step();
    twin.step();
  }
  EXPECT_EQ(a.step_count(0), 5);
  EXPECT_TRUE(same_bytes(mine, theirs));

  // The optimizer moved away at the start is still live and independent.
  EXPECT_EQ(elsewhere.num_groups(), 1);
  EXPECT_EQ(elsewhere.step_count(0), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, OptimizerLifetime, ::testing::Values(Backend::cpu, Backend::reference),
                         [](const ::testing::TestParamInfo<Backend>& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace optfuse
