// Rules and chains (optax's model): a rule declares its state slots and hyperparameters and maps
// (param, incoming update, state, step) to (outgoing update, new state). A chain applies its rules
// in order, each rule's outgoing update being the next one's incoming update; the parameter then
// becomes param + final update. Named optimizers are chains of small rules (builtin_rules.h).
//
// A new rule is a few lines of math:
//   Rule r = Rule("scale_by_sign")
//       .hyper("strength", 1.0, Range::non_negative())
//       .update([](RuleBuilder& b) { return sign(b.update()) * b.hyper("strength"); });
#pragma once
#include <array>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "optfuse/dtype.h"
#include "optfuse/ir.h"

namespace optfuse {

// The set a hyperparameter's value must lie in; checked whenever a value is set.
struct Range {
  double lo = -1e308, hi = 1e308;
  bool lo_open = false, hi_open = false;
  static Range any() { return {}; }
  static Range non_negative() { return {0, 1e308, false, false}; }
  static Range positive() { return {0, 1e308, true, false}; }
  static Range unit_interval_open_right() { return {0, 1, false, true}; }  // [0, 1): betas
  bool contains(double v) const;
  std::string describe() const;
};

struct HyperSpec {
  std::string name;   // short name, as users write it ("lr", "b1")
  double value = 0;   // value given when the rule was made (the default for every group)
  Range range;
};

// The shape of a state slot relative to its parameter: one value per element (Full), per row or
// per column of the parameter's matrix view (TensorRef::cols; Adafactor's factored moments). A
// Rows state is a *row* value in the rules' math, a Cols state a *column* value (plan.h).
enum class StateShape : uint8_t { Full, Rows, Cols };
const char* state_shape_name(StateShape s);

struct StateSpec {
  std::string name;        // e.g. "exp_avg"
  double init = 0;         // every element starts at this value
  bool from_param = false; // every element starts as the parameter's value instead (schedule-free's z)
  StateShape shape = StateShape::Full;
};

// A uniform state: one float64 value per parameter group, kept across steps (NAdam's mu_product).
// Rules read it in uniform math (RuleBuilder::uniform_state) and give its new value
// (set_uniform_state); the final scalar phase computes it and commits it only where the step is
// not skipped, as the step count. Optimizer::uniform_state reads it back per group.
struct UniformStateSpec {
  std::string name;
  double init = 0;  // the value of a new group
};

// The settings of a Newton-Schulz orthogonalisation (the matrix phase of Muon; optfuse/newton_schulz.h
// runs it), torch.optim.Muon's defaults.
struct NewtonSchulzOptions {
  std::array<double, 3> coefficients{3.4445, -4.7750, 2.0315};  // (a, b, c)
  int steps = 5;       // 0 <= steps < 100, as torch requires
  double eps = 1e-7;   // the Frobenius norm is clamped to at least eps
  // "" if the settings are valid, else why not (checked by Rule::matrix_phase and NewtonSchulz).
  std::string problem() const;
};

class RuleBuilder;

// Whether Rule::hyper checks a value against its range (on by default, per thread). The torch front
// end turns it off while it builds a chain from param_groups: torch validates constructor arguments
// only and steps with whatever is set there later (NaN, a negative lr...), and so does optfuse.
bool hyper_range_checks();
void set_hyper_range_checks(bool on);

class Rule {
 public:
  using UpdateFn = std::function<Expr(RuleBuilder&)>;
  Rule() = default;
  explicit Rule(std::string name) : name_(std::move(name)) {}
  // Builder-style declarations; each throws optfuse::Error on an invalid value or a duplicate name.
  Rule& hyper(const std::string& name, double value, Range range = Range::any());
  Rule& state(const std::string& name, double init = 0);
  // A state of one value per row / per column of the parameter's matrix view (StateShape).
  Rule& row_state(const std::string& name, double init = 0);
  Rule& col_state(const std::string& name, double init = 0);
  // A state slot that starts as a copy of the parameter (ProgramState::init_from_param).
  Rule& state_from_param(const std::string& name);
  // A uniform state (UniformStateSpec): one float64 per group, starting at `init`.
  Rule& uniform_state(const std::string& name, double init = 0);
  Rule& update(UpdateFn fn);
  // A note shown in `explain` (e.g. the boolean options the rule was built with).
  Rule& note(const std::string& text);
  // Makes this a *matrix rule*: no update function; the incoming update of each tensor, a whole
  // matrix (its TensorRef::cols view), is orthogonalised by Newton-Schulz. A chain with a matrix
  // rule runs through MatrixChainOptimizer (optfuse/matrix_chain.h), which splits it there.
  Rule& matrix_phase(const NewtonSchulzOptions& options);
  const NewtonSchulzOptions* matrix_phase() const { return has_matrix_ ? &matrix_ : nullptr; }

  const std::string& name() const { return name_; }
  const std::vector<HyperSpec>& hypers() const { return hypers_; }
  const std::vector<StateSpec>& states() const { return states_; }
  const std::vector<UniformStateSpec>& uniform_states() const { return uniform_states_; }
  const UpdateFn& update_fn() const { return fn_; }
  const std::string& notes() const { return notes_; }
  // "scale_by_adam(b1=0.9, b2=0.999, eps=1e-08)"
  std::string signature() const;

 private:
  std::string name_;
  std::vector<HyperSpec> hypers_;
  std::vector<StateSpec> states_;
  std::vector<UniformStateSpec> uniform_states_;
  UpdateFn fn_;
  std::string notes_;
  bool has_matrix_ = false;
  NewtonSchulzOptions matrix_;
};

using Chain = std::vector<Rule>;
// Concatenates chains (and single rules) into one chain.
Chain chain(std::initializer_list<Chain> parts);

// A state slot of a whole program: the rule it belongs to and its qualified name
// ("scale_by_adam.exp_avg"; a rule used twice in a chain gets "#2" on the second).
struct ProgramState {
  std::string rule, name, qualified;
  double init = 0;
  bool init_from_param = false;  // starts as a copy of the parameter (a master copy, a rule's
                                 // state_from_param), not `init`
  bool fixed_dtype = false;      // must be stored as `dtype` (master copy: float32; remainder: int16)
  DType dtype = DType::f32;
  StateShape shape = StateShape::Full;
};

// How low-precision (float16/bfloat16) parameters are kept: plan options, all off by default.
// The precision states are appended after the rules' states.
enum class MasterWeights : uint8_t {
  none,
  copy,        // state master_weights.master_param (float32): rules see it as the parameter; each step
               // updates it and writes the parameter rounded to nearest from it
  remainders,  // state master_weights.param_remainder (int16): the float32 master is rebuilt exactly from
               // the bfloat16 parameter and its remainder, updated, and split again (2 bytes more
               // per parameter instead of 4; bfloat16 parameters only)
};
const char* master_weights_name(MasterWeights m);
struct Precision {
  MasterWeights master = MasterWeights::none;
  // Kahan-compensated updates for parameters stored as `kahan_dtype` (float16 or bfloat16) without
  // a master copy: state kahan.kahan_comp holds what each parameter store rounded away, and the
  // next step adds it back.
  bool kahan = false;
  DType kahan_dtype = DType::bf16;
  bool any() const { return master != MasterWeights::none || kahan; }
};
// A uniform state of a whole program ("scale_by_nadam.mu_product"), qualified like a state slot.
struct ProgramUniformState {
  std::string rule, name, qualified;
  double init = 0;
};
struct ProgramHyper {
  std::string rule, name, qualified;
  double value = 0;
  Range range;
};
// Global scalars the caller sets per step; every program has all of them (unused ones cost nothing).
enum GlobalSlot : int32_t { kGradScale = 0, kFoundInf = 1, kNumGlobals = 2 };
const char* global_name(int32_t slot);

// A chain lowered to one expression graph: what the passes and the planner work on.
struct Program {
  std::string chain_text;               // the chain's signatures, for comments and explain
  Graph graph;
  std::vector<ProgramState> states;
  std::vector<ProgramHyper> hypers;
  NodeId param_out = kNoNode;           // the new parameter value
  std::vector<NodeId> state_out;        // per state slot: the new value (the old one if unchanged)
  NodeId skip = kNoNode;                // uniform: when != 0 the step changes nothing (kNoNode: never)
  std::vector<ProgramUniformState> uniform_states;
  std::vector<NodeId> uniform_state_out;  // per uniform state: its new value (uniform; the old one if unchanged)
  std::map<NodeId, std::string> names;  // readable names for generated code ("exp_avg_new")
  Precision precision;                  // how the parameter is stored (its states are the last ones)

  // Index of a hyperparameter by short or qualified name: every slot that matches (a short name
  // may match several rules, e.g. "lr"). Throws optfuse::Error naming the closest known name.
  std::vector<int> find_hypers(const std::string& name) const;
  // Index of a uniform state by short or qualified name; throws optfuse::Error naming the known ones.
  int find_uniform_state(const std::string& name) const;
};

// What a rule's update function builds with. Reads of undeclared state or hyperparameters throw.
class RuleBuilder {
 public:
  Expr param();                               // the parameter before this step
  Expr update();                              // incoming update (the gradient for the first rule)
  Expr state(const std::string& name);        // a declared state slot before this step
  void set_state(const std::string& name, Expr value);
  Expr hyper(const std::string& name);        // a declared hyperparameter (per group, uniform)
  // A declared uniform state before this step, and its value after it (uniform: no per-element or
  // per-tensor values). Committed only where the step is not skipped.
  Expr uniform_state(const std::string& name);
  void set_uniform_state(const std::string& name, Expr value);
  Expr step();                                // the step being taken, 1 on the first (uniform)
  // The parameter's element count, rows, columns and whether it has a matrix view (per tensor).
  Expr shape(ShapeItem item);
  Expr global(GlobalSlot slot);               // grad_scale, found_inf
  Expr constant(double v);
  // The whole step changes nothing (no parameter, state or step count update) when cond != 0.
  // cond must be uniform (no per-element values).
  void skip_step_if(Expr cond);
  // Gives a value a readable name in generated code.
  Expr name(Expr e, const std::string& name);
  // Multiplies the parameter the final update is added to by a factor: the new parameter
  // becomes param * factor + update. This is decoupled weight decay as torch writes it
  // (p *= 1 - lr * wd, then p += update), which rounds differently from adding wd * p to the update.
  // param() still returns the parameter before this step.
  void scale_param(Expr factor);
  // The general form: the value the final update is added to, as earlier rules left it
  // (param() unless some rule decayed it), and replacing it. timm's decoupled decay is
  // set_param_base(base + (-lr * wd) * base): torch's p.add_(p, alpha=-lr * wd).
  Expr param_base();
  void set_param_base(Expr base);

 private:
  friend Program build_program(const Chain& chain, const Precision& precision);
  RuleBuilder(Program& p, const Rule& r, int first_state, int first_hyper, int first_uniform_state, Expr param,
              Expr incoming, Expr* param_base);
  Program& p_;
  Expr param_;
  Expr* param_base_;
  const Rule& rule_;
  int first_state_, first_hyper_, first_uniform_state_;
  Expr incoming_;
};

// Runs every rule's update function in order into one graph. Throws optfuse::Error for a rule
// that reads an undeclared state or hyperparameter, returns no update, or skips on element values,
// and for precision options that cannot go together.
Program build_program(const Chain& chain, const Precision& precision = {});

}  // namespace optfuse
