// Error cases. The bad SPECs and hyperparameters are data files in this directory (format in
// README.md), one GoogleTest case each; the cases that need C++ (tensor sets, user rules, groups)
// are below. Every case checks the message, and where the API promises that a failed call changes
// nothing, that too.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "testing/error_of.h"

namespace optfuse {
namespace {

namespace fs = std::filesystem;

const fs::path kDir = fs::path(OPTFUSE_SOURCE_DIR) / "tests" / "errors";

// ---------------------------------------------------------------------------------------------
// The data-file cases.

struct ErrorCase {
  std::string spec;
  bool has_spec = false;
  bool has_set_hyper = false;
  int group = 0, groups = 1;
  std::string hyper_name;
  double hyper_value = 0;
  std::vector<std::string> expect, reject;
};

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    char c = s[++i];
    out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
  }
  return out;
}

// Parses one file; a malformed file is a test failure naming the line, not a silent pass.
ErrorCase read_case(const fs::path& file) {
  ErrorCase c;
  std::ifstream in(file);
  EXPECT_TRUE(in.good()) << "cannot read " << file;
  std::string line;
  for (int no = 1; std::getline(in, line); ++no) {
    if (line.empty() || line[0] == '#') continue;
    size_t colon = line.find(':');
    if (colon == std::string::npos) {
      ADD_FAILURE() << file.filename() << ":" << no << ": expected 'key: value'";
      continue;
    }
    std::string key = line.substr(0, colon), value = line.substr(colon + 1);
    if (!value.empty() && value[0] == ' ') value.erase(0, 1);
    value = unescape(value);
    if (key == "spec") {
      EXPECT_FALSE(c.has_spec) << file.filename() << ":" << no << ": a second spec";
      c.spec = value;
      c.has_spec = true;
    } else if (key == "expect") {
      c.expect.push_back(value);
    } else if (key == "reject") {
      c.reject.push_back(value);
    } else if (key == "groups") {
      c.groups = std::atoi(value.c_str());
    } else if (key == "set_hyper") {
      std::istringstream v(value);
      std::string number;
      v >> c.group >> c.hyper_name >> number;
      EXPECT_FALSE(v.fail()) << file.filename() << ":" << no << ": set_hyper: GROUP NAME VALUE";
      c.hyper_value = std::strtod(number.c_str(), nullptr);
      c.has_set_hyper = true;
    } else {
      ADD_FAILURE() << file.filename() << ":" << no << ": unknown key '" << key << "'";
    }
  }
  EXPECT_TRUE(c.has_spec) << file.filename() << ": no spec";
  EXPECT_FALSE(c.expect.empty()) << file.filename() << ": no expect";
  return c;
}

std::vector<std::string> case_files() {
  std::vector<std::string> names;
  if (fs::is_directory(kDir))
    for (const auto& e : fs::directory_iterator(kDir))
      if (e.path().extension() == ".txt") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The message of the error the case's input produces ("" with a failure when there is none).
std::string run_case(const ErrorCase& c) {
  if (!c.has_set_hyper) {
    try {
      Plan plan = make_plan(parse_chain(c.spec));
      ADD_FAILURE() << "no error; the spec was accepted as " << plan.program.chain_text;
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  Optimizer opt(parse_chain(c.spec), Backend::reference, c.groups);
  auto values = [&] {
    std::vector<double> v;
    for (int g = 0; g < opt.num_groups(); ++g) {
      try {
        v.push_back(opt.hyper(g, c.hyper_name));
      } catch (const Error&) {
        v.push_back(-12345);  // unknown name: there is nothing to change
      }
    }
    return v;
  };
  std::vector<double> before = values();
  std::string msg;
  try {
    opt.set_hyper(c.group, c.hyper_name, c.hyper_value);
    ADD_FAILURE() << "no error from set_hyper(" << c.group << ", " << c.hyper_name << ", " << c.hyper_value << ")";
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(values(), before) << "a failed set_hyper changed a value";
  return msg;
}

class ErrorFile : public ::testing::TestWithParam<std::string> {};

TEST_P(ErrorFile, GivesTheExpectedMessage) {
  ErrorCase c = read_case(kDir / (GetParam() + ".txt"));
  if (HasFailure()) return;
  std::string msg = run_case(c);
  for (const auto& e : c.expect) EXPECT_NE(msg.find(e), std::string::npos) << "missing: " << e << "\nin:\n" << msg;
  for (const auto& r : c.reject) EXPECT_EQ(msg.find(r), std::string::npos) << "unwanted: " << r << "\nin:\n" << msg;
}

INSTANTIATE_TEST_SUITE_P(Files, ErrorFile, ::testing::ValuesIn(case_files()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The directory must really be there and hold the cases (a wrong path would otherwise run none).
TEST(ErrorFiles, AreFound) { EXPECT_GE(case_files().size(), 30u) << kDir; }

// The harness can fail: a valid SPEC is reported as "no error".
TEST(ErrorFiles, AValidSpecIsNotAnError) {
  ErrorCase c;
  c.spec = "adamw(lr=1e-3)";
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter catcher(&failures);
    EXPECT_EQ(run_case(c), "");
  }
  ASSERT_EQ(failures.size(), 1);
  EXPECT_NE(std::string(failures.GetTestPartResult(0).message()).find("no error"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Tensor sets: a bad set is rejected with a message naming the tensor and the buffer, and the
// optimizer keeps stepping the tensors it had, exactly as if the bad call had not happened.

struct Host {
  std::vector<std::vector<float>> bufs;  // param, grad, states
  TensorRef ref(int group = 0) {
    TensorRef r;
    int64_t n = static_cast<int64_t>(bufs[0].size());
    r.param = {bufs[0].data(), n, DType::f32};
    r.grad = {bufs[1].data(), n, DType::f32};
    for (size_t s = 2; s < bufs.size(); ++s) r.states.push_back({bufs[s].data(), n, DType::f32});
    r.group = group;
    return r;
  }
};

Host make_host(size_t n, size_t states, float seed) {
  Host h;
  h.bufs.assign(2 + states, std::vector<float>(n, 0.0f));
  for (size_t i = 0; i < n; ++i) {
    h.bufs[0][i] = std::sin(seed + static_cast<float>(i));
    h.bufs[1][i] = std::cos(seed * 3 + static_cast<float>(i));
  }
  return h;
}

std::string set_tensors_error(Optimizer& opt, const std::vector<TensorRef>& t) {
  return testing::error_of([&] { opt.set_tensors(t); });
}

void bad_sets_change_nothing(Backend backend) {
  SCOPED_TRACE(backend_name(backend));
  Chain c = adamw({{"lr", 0.1}});
  Optimizer opt(c, backend, 2), twin(c, backend, 2);
  Host a = make_host(37, 2, 1.0f), b = make_host(5, 2, 2.0f), a2 = a, b2 = b;
  opt.set_tensors({a.ref(0), b.ref(1)});
  twin.set_tensors({a2.ref(0), b2.ref(1)});
  opt.step();
  twin.step();

  Host bad = make_host(9, 2, 3.0f);
  std::vector<float> short_grad(8, 1.0f);
  std::vector<uint16_t> half_state(9, 0);
  auto with = [&](auto&& edit) {
    TensorRef r = bad.ref(0);
    edit(r);
    return std::vector<TensorRef>{a.ref(0), r};
  };
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.grad = {short_grad.data(), 8, DType::f32}; })),
            "tensor 1: gradient has 8 elements but the parameter has 9");
  // Roles may have different float dtypes; int16 is only for master-weight remainders, and
  // stochastic rounding only for low-precision buffers the step writes.
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.grad.dtype = DType::i16; })),
            "tensor 1: gradient is int16; only a master-weight remainder state is stored as int16 (float32, float16 "
            "or bfloat16 expected)");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states[1] = {half_state.data(), 9, DType::f16, false}; r.grad.stochastic_rounding = true; })),
            "tensor 1: gradient: stochastic rounding applies to float16/bfloat16 buffers the step writes (the "
            "parameter and states), not to a float32 gradient");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states[1].stochastic_rounding = true; })),
            "tensor 1: state scale_by_adam.exp_avg_sq: stochastic rounding applies to float16/bfloat16 buffers the "
            "step writes (the parameter and states), not to a float32 buffer");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states[0].numel = 10; })),
            "tensor 1: state scale_by_adam.exp_avg has 10 elements but the parameter has 9");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states.pop_back(); })),
            "tensor 1: 1 state buffers given but the chain has 2");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states.push_back(r.states[0]); })),
            "tensor 1: 3 state buffers given but the chain has 2");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.group = 2; })),
            "tensor 1: parameter group 2 does not exist (there are 2)");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.group = -1; })),
            "tensor 1: parameter group -1 does not exist (there are 2)");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.param.data = nullptr; })),
            "tensor 1: parameter has no data pointer");
  EXPECT_EQ(set_tensors_error(opt, with([&](TensorRef& r) { r.states[0].data = nullptr; })),
            "tensor 1: state scale_by_adam.exp_avg has no data pointer");

  // Still the first set: same tensors, and the next steps match the twin bit for bit.
  ASSERT_EQ(opt.tensors().size(), 2u);
  EXPECT_EQ(opt.tensors()[0].param.data, a.bufs[0].data());
  EXPECT_EQ(opt.tensors()[1].param.data, b.bufs[0].data());
  Host untouched = make_host(9, 2, 3.0f);
  for (int s = 0; s < 3; ++s) {
    opt.step();
    twin.step();
  }
  EXPECT_EQ(a.bufs, a2.bufs);
  EXPECT_EQ(b.bufs, b2.bufs);
  EXPECT_NE(a.bufs[0], make_host(37, 2, 1.0f).bufs[0]);  // and they did step
  EXPECT_EQ(bad.bufs, untouched.bufs);                    // the rejected buffers were never touched
  EXPECT_EQ(opt.step_count(0), 4);
  EXPECT_EQ(opt.step_count(1), 4);
}

TEST(TensorErrors, BadSetsChangeNothingReference) { bad_sets_change_nothing(Backend::reference); }
TEST(TensorErrors, BadSetsChangeNothingCpu) { bad_sets_change_nothing(Backend::cpu); }

// ---------------------------------------------------------------------------------------------
// Groups.

using testing::error_of;

TEST(GroupErrors, AGroupThatDoesNotExist) {
  Optimizer opt(sgd(), Backend::reference, 2);
  const std::string three = "parameter group 3 does not exist (there are 2)";
  EXPECT_EQ(error_of([&] { opt.set_hyper(3, "lr", 0.1); }), three);
  EXPECT_EQ(error_of([&] { opt.hyper(3, "lr"); }), three);
  EXPECT_EQ(error_of([&] { opt.step_count(3); }), three);
  EXPECT_EQ(error_of([&] { opt.set_step_count(3, 1); }), three);
  EXPECT_EQ(error_of([&] { opt.hyper(-1, "lr"); }), "parameter group -1 does not exist (there are 2)");
  EXPECT_EQ(error_of([&] { opt.set_step_count(0, -1); }), "a step count cannot be negative");
  EXPECT_EQ(opt.step_count(0), 0);
  // Once added, the group exists, with the chain's defaults.
  EXPECT_EQ(opt.add_group(), 2);
  EXPECT_EQ(opt.hyper(2, "lr"), 1e-3);
  EXPECT_EQ(error_of([] { Optimizer(sgd(), Backend::reference, 0); }), "an optimizer needs at least one parameter group");
}

// A name that matches a hyperparameter of two rules is set in both or, if either rejects the
// value, in neither.
TEST(GroupErrors, FailedSetHyperOnASharedNameChangesNeither) {
  Optimizer opt(chain({make_builtin("scale_by_lion"), make_builtin("scale_by_adam")}), Backend::reference);
  EXPECT_EQ(opt.plan().program.find_hypers("b1").size(), 2u);
  opt.set_hyper(0, "b1", 0.5);
  EXPECT_EQ(opt.hyper(0, "scale_by_lion.b1"), 0.5);
  EXPECT_EQ(opt.hyper(0, "scale_by_adam.b1"), 0.5);
  EXPECT_EQ(error_of([&] { opt.set_hyper(0, "b1", 1.0); }), "invalid b1=1 for scale_by_lion: must be in [0, 1)");
  EXPECT_EQ(opt.hyper(0, "scale_by_lion.b1"), 0.5);
  EXPECT_EQ(opt.hyper(0, "scale_by_adam.b1"), 0.5);
}

TEST(GroupErrors, UnknownBackendAndDtype) {
  EXPECT_EQ(error_of([] { parse_backend("gpu"); }), "unknown backend 'gpu' (expected reference, cpu or cuda)");
  EXPECT_EQ(error_of([] { parse_dtype("fp8"); }), "unknown dtype 'fp8' (expected float32, float64, float16, bfloat16, int16 or q8)");
}

// ---------------------------------------------------------------------------------------------
// User rules that break their own declarations.

Chain one(Rule r) { return Chain{std::move(r)}; }

TEST(RuleErrors, ReadsAStateItDidNotDeclare) {
  Rule r = Rule("my_momentum").state("velocity").update([](RuleBuilder& b) {
    b.set_state("velocity", b.update());
    return b.state("velocty");
  });
  EXPECT_EQ(error_of([&] { build_program(one(r)); }),
            "rule my_momentum reads state 'velocty' that it did not declare (did you mean 'velocity'?) "
            "(declared: velocity)");
  Rule w = Rule("writer").update([](RuleBuilder& b) {
    b.set_state("m", b.update());
    return b.update();
  });
  EXPECT_EQ(error_of([&] { build_program(one(w)); }),
            "rule writer reads state 'm' that it did not declare (it declares none)");
  // Through the Optimizer as well: nothing is built.
  EXPECT_NE(error_of([&] { Optimizer(one(r), Backend::cpu); }).find("did not declare"), std::string::npos);
}

TEST(RuleErrors, ReadsAHyperparameterItDidNotDeclare) {
  Rule r = Rule("my_scale").hyper("strength", 2.0).update([](RuleBuilder& b) { return b.update() * b.hyper("strenght"); });
  EXPECT_EQ(error_of([&] { make_plan(one(r)); }),
            "rule my_scale reads hyperparameter 'strenght' that it did not declare (did you mean 'strength'?) "
            "(declared: strength)");
  // Another rule's hyperparameter is not this rule's: lr belongs to scale_by_learning_rate.
  Rule s = Rule("borrower").update([](RuleBuilder& b) { return b.update() * b.hyper("lr"); });
  EXPECT_EQ(error_of([&] { make_plan(chain({one(s), sgd()})); }),
            "rule borrower reads hyperparameter 'lr' that it did not declare (it declares none)");
}

TEST(RuleErrors, SkipStepIfOnAPerElementCondition) {
  Rule r = Rule("skip_negative").update([](RuleBuilder& b) {
    b.skip_step_if(b.update() < b.constant(0.0));  // one value per element: not a step decision
    return b.update();
  });
  const std::string want =
      "rule skip_negative: skip_step_if needs a uniform condition (one value for the whole step), not a "
      "per-element one; reduce it first, e.g. with any_nonfinite()";
  EXPECT_EQ(error_of([&] { build_program(one(r)); }), want);
  EXPECT_EQ(error_of([&] { Optimizer(one(r), Backend::reference); }), want);
  // A reduced condition is fine: it is one value per step.
  Rule ok = Rule("skip_any_negative").update([](RuleBuilder& b) {
    b.skip_step_if(any_nonfinite(b.update()) || b.step() > 100.0);
    return b.update();
  });
  EXPECT_NO_THROW(make_plan(one(ok)));
}

TEST(RuleErrors, BrokenDeclarationsAndBodies) {
  EXPECT_EQ(error_of([] { Rule("r").hyper("a", -1, Range::non_negative()); }), "rule r: a=-1 is invalid: must be >= 0");
  EXPECT_EQ(error_of([] { Rule("r").state("m").state("m"); }), "rule r: state 'm' declared twice");
  EXPECT_EQ(error_of([] { Rule("r").hyper("lr", 1).hyper("lr", 2); }), "rule r: hyperparameter 'lr' declared twice");
  EXPECT_EQ(error_of([] { Rule("r").hyper("1x", 1); }), "hyperparameter name '1x' must be an identifier (letters, digits, _)");
  EXPECT_EQ(error_of([] { make_plan(one(Rule("no_body"))); }), "rule no_body has no update function");
  EXPECT_EQ(error_of([] { make_plan(one(Rule("empty").update([](RuleBuilder&) { return Expr{}; }))); }),
            "rule empty returned no update expression");
  EXPECT_EQ(error_of([] { make_plan(Chain{}); }), "a chain needs at least one rule");
  Rule uniform_sum = Rule("sum_of_constant").update([](RuleBuilder& b) {
    return b.update() + global_sum_of_squares(b.constant(1.0));
  });
  EXPECT_EQ(error_of([&] { make_plan(one(uniform_sum)); }), "IR: sum_squares of a uniform value (it must reduce element values)");
  // Expressions of another rule's graph cannot be mixed in.
  Graph other;
  Expr foreign = constant(other, 1.0);
  Rule mixer = Rule("mixer").update([foreign](RuleBuilder& b) { return b.update() * foreign; });
  EXPECT_EQ(error_of([&] { make_plan(one(mixer)); }), "IR: expressions from different rule graphs were mixed");
}

}  // namespace
}  // namespace optfuse
