// Rules written in Python (Expr, RuleBuilder), Range, Rule, chains and built-ins, plans and explain.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <optional>
#include <sstream>

#include "codegen/cpu_source.h"
#include "codegen/explain.h"
#include "codegen/cuda_source.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/ir.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "optfuse/rule.h"

#include "bindings/common.h"

using namespace nb::literals;

namespace optfuse::py {

namespace {

// ---------------------------------------------------------------------------------------------
// Expr. A C++ Expr points into the graph of the program being built, which only exists while the
// chain's update functions run. Python code can keep an Expr past that (in a global, a closure),
// so every Python Expr carries a shared "live" flag that the builder clears when the update
// function returns; using a dead Expr raises instead of touching freed memory.

struct Live {
  bool alive = true;
};

struct PyExpr {
  Expr e;
  std::shared_ptr<Live> live;
};

const PyExpr& checked(const PyExpr& x) {
  if (!x.live || !x.live->alive || !x.e.valid())
    throw Error("this optfuse.Expr belongs to a rule update function that has already returned; "
                "expressions only live while the update function runs");
  return x;
}

// An Expr or a number (made a constant of `like`'s graph).
PyExpr lift(nb::handle h, const PyExpr& like, const char* what) {
  if (nb::isinstance<PyExpr>(h)) {
    const PyExpr& x = checked(nb::cast<const PyExpr&>(h));
    if (x.e.graph != like.e.graph) throw Error(std::string(what) + ": expressions from different rule graphs were mixed");
    return x;
  }
  if (is_number(h)) return PyExpr{constant(*like.e.graph, nb::cast<double>(h)), like.live};
  throw nb::type_error((std::string(what) + ": expected an optfuse.Expr or a number, got " + type_name_of(h)).c_str());
}

// The first Expr among the arguments of a math function: it names the graph numbers join.
const PyExpr& first_expr(const char* what, std::initializer_list<nb::handle> args) {
  for (nb::handle h : args)
    if (nb::isinstance<PyExpr>(h)) return checked(nb::cast<const PyExpr&>(h));
  throw nb::type_error((std::string(what) + ": at least one argument must be an optfuse.Expr (numbers alone have no "
                        "rule graph; use builder.constant(x))").c_str());
}

PyExpr wrap(Expr e, const PyExpr& like) { return PyExpr{e, like.live}; }

template <class F>
auto unary(const char* name, F f) {
  return [name, f](nb::handle x) {
    const PyExpr& a = first_expr(name, {x});
    return wrap(f(a.e), a);
  };
}

template <class F>
auto binary(const char* name, F f) {
  return [name, f](nb::handle x, nb::handle y) {
    const PyExpr& like = first_expr(name, {x, y});
    return wrap(f(lift(x, like, name).e, lift(y, like, name).e), like);
  };
}

template <class F>
auto ternary(const char* name, F f) {
  return [name, f](nb::handle x, nb::handle y, nb::handle z) {
    const PyExpr& like = first_expr(name, {x, y, z});
    return wrap(f(lift(x, like, name).e, lift(y, like, name).e, lift(z, like, name).e), like);
  };
}

// The builder handed to a Python update function; dead (like its Exprs) once the function returns.
struct PyBuilder {
  RuleBuilder* b;
  std::shared_ptr<Live> live;
  RuleBuilder& get() const {
    if (!live->alive) throw Error("this optfuse.RuleBuilder is only usable inside the update function it was passed to");
    return *b;
  }
  PyExpr out(Expr e) const { return PyExpr{e, live}; }
};

GlobalSlot parse_global(const std::string& name) {
  if (name == "grad_scale") return kGradScale;
  if (name == "found_inf") return kFoundInf;
  throw Error("unknown global '" + name + "' (globals: grad_scale, found_inf)");
}

// Python callables live in std::function objects that the C++ side copies freely, possibly without
// the GIL (the Optimizer constructor releases it): hold the callable through a shared_ptr whose
// deleter takes the GIL, and take the GIL to call it.
struct GilObjectDeleter {
  void operator()(nb::object* o) const {
    nb::gil_scoped_acquire gil;
    delete o;
  }
};

Rule::UpdateFn python_update_fn(const std::string& rule_name, nb::object fn) {
  if (!PyCallable_Check(fn.ptr())) throw nb::type_error("Rule.update expects a callable taking an optfuse.RuleBuilder");
  std::shared_ptr<nb::object> f(new nb::object(std::move(fn)), GilObjectDeleter{});
  return [f, rule_name](RuleBuilder& b) -> Expr {
    nb::gil_scoped_acquire gil;
    auto live = std::make_shared<Live>();
    struct Kill {  // the builder and every Expr made in the call die when it returns or raises
      std::shared_ptr<Live> l;
      ~Kill() { l->alive = false; }
    } kill{live};
    nb::object res = (*f)(PyBuilder{&b, live});
    if (!nb::isinstance<PyExpr>(res))
      throw Error("rule " + rule_name + ": the update function must return an optfuse.Expr, got " + type_name_of(res));
    const PyExpr& out = checked(nb::cast<const PyExpr&>(res));
    if (out.live != live) throw Error("rule " + rule_name + ": the update function returned an expression of another rule");
    return out.e;
  };
}

// ---------------------------------------------------------------------------------------------
// Chains: a Python list of Rules (nested lists are flattened), a single Rule, or SPEC text.

void append_chain(nb::handle h, Chain& out) {
  if (nb::isinstance<nb::str>(h)) {
    Chain c = parse_chain(nb::cast<std::string>(h));
    out.insert(out.end(), c.begin(), c.end());
  } else if (nb::isinstance<Rule>(h)) {
    out.push_back(nb::cast<const Rule&>(h));
  } else if (nb::isinstance<nb::list>(h) || nb::isinstance<nb::tuple>(h)) {
    for (nb::handle item : h) append_chain(item, out);
  } else {
    throw nb::type_error(("a chain is a list of optfuse.Rule (or SPEC text), got " + type_name_of(h)).c_str());
  }
}


}  // namespace

Chain to_chain(nb::handle h) {
  Chain c;
  append_chain(h, c);
  if (c.empty()) throw Error("a chain needs at least one rule");
  return c;
}

namespace {

Args to_args(const nb::kwargs& kw) {
  Args args;
  for (auto [k, v] : kw) {
    std::string key = nb::cast<std::string>(k);
    if (PyBool_Check(v.ptr())) {
      args[key] = ArgValue(v.ptr() == Py_True);
    } else if (is_number(v)) {
      args[key] = ArgValue(nb::cast<double>(v));
    } else if (nb::isinstance<nb::tuple>(v) || nb::isinstance<nb::list>(v)) {
      std::vector<double> xs;
      for (nb::handle x : v) {
        if (!is_number(x) || PyBool_Check(x.ptr())) throw Error(key + " must be a tuple of numbers");
        xs.push_back(nb::cast<double>(x));
      }
      args[key] = ArgValue(xs);
    } else {
      throw Error(key + " must be a number, a bool or a tuple of numbers, got " + type_name_of(v));
    }
  }
  return args;
}

// ---------------------------------------------------------------------------------------------
// Plans and explain.

std::string generate_source(const Plan& plan, const std::string& backend) {
  if (backend == "cpu") return generate_cpu_source(plan);
  if (backend == "cuda") return generate_cuda_source(plan);
  throw Error("backend must be 'cpu' or 'cuda' for generated source, got '" + backend + "'");
}

}  // namespace

void bind_rules(nb::module_& m) {
  // --- Expr
  nb::class_<PyExpr> expr(m, "Expr", "A value in a rule's math (element or uniform); made by a RuleBuilder.");
  auto bin = [&](const char* name, const char* rname, Expr (*f)(Expr, Expr)) {
    expr.def(name, [f](const PyExpr& a, nb::handle b) {
      const PyExpr& x = checked(a);
      return wrap(f(x.e, lift(b, x, "Expr").e), x);
    }, nb::is_operator());
    if (rname)
      expr.def(rname, [f](const PyExpr& a, nb::handle b) {
        const PyExpr& x = checked(a);
        return wrap(f(lift(b, x, "Expr").e, x.e), x);
      }, nb::is_operator());
  };
  bin("__add__", "__radd__", [](Expr a, Expr b) { return a + b; });
  bin("__sub__", "__rsub__", [](Expr a, Expr b) { return a - b; });
  bin("__mul__", "__rmul__", [](Expr a, Expr b) { return a * b; });
  bin("__truediv__", "__rtruediv__", [](Expr a, Expr b) { return a / b; });
  bin("__pow__", "__rpow__", [](Expr a, Expr b) { return pow(a, b); });
  bin("__lt__", nullptr, [](Expr a, Expr b) { return a < b; });
  bin("__le__", nullptr, [](Expr a, Expr b) { return a <= b; });
  bin("__gt__", nullptr, [](Expr a, Expr b) { return a > b; });
  bin("__ge__", nullptr, [](Expr a, Expr b) { return a >= b; });
  bin("__eq__", nullptr, [](Expr a, Expr b) { return a == b; });
  bin("__ne__", nullptr, [](Expr a, Expr b) { return a != b; });
  bin("__and__", "__rand__", [](Expr a, Expr b) { return a && b; });
  bin("__or__", "__ror__", [](Expr a, Expr b) { return a || b; });
  expr.def("__neg__", [](const PyExpr& a) { return wrap(-checked(a).e, a); })
      .def("__pos__", [](const PyExpr& a) { return checked(a); })
      .def("__abs__", [](const PyExpr& a) { return wrap(abs(checked(a).e), a); })
      .def("__invert__", [](const PyExpr& a) { return wrap(!checked(a).e, a); })
      .def("__bool__", [](const PyExpr&) -> bool {
        throw nb::type_error("an optfuse.Expr has no truth value while the rule is built; use optfuse.select(cond, a, b) "
                             "instead of if/else, and & | ~ instead of and/or/not");
      })
      .def("__repr__", [](const PyExpr& a) {
        if (!a.live || !a.live->alive) return std::string("<optfuse.Expr (dead)>");
        const Node& n = a.e.graph->node(a.e.id);
        return "<optfuse.Expr %" + std::to_string(a.e.id) + " " + op_name(n.op) + ">";
      });
  expr.attr("__hash__") = nb::none();  // == builds an Expr, so Exprs are not hashable

  m.def("sqrt", unary("sqrt", [](Expr x) { return sqrt(x); }), "x"_a);
  m.def("rsqrt", unary("rsqrt", [](Expr x) { return rsqrt(x); }), "x"_a);
  m.def("exp", unary("exp", [](Expr x) { return exp(x); }), "x"_a);
  m.def("log", unary("log", [](Expr x) { return log(x); }), "x"_a);
  m.def("sign", unary("sign", [](Expr x) { return sign(x); }), "x"_a);
  m.def("abs", unary("abs", [](Expr x) { return abs(x); }), "x"_a);
  m.def("is_finite", unary("is_finite", [](Expr x) { return is_finite(x); }), "x"_a);
  m.def("logical_not", unary("logical_not", [](Expr x) { return !x; }), "x"_a);
  m.def("round_to_bf16", unary("round_to_bf16", [](Expr x) { return round_to_bf16(x); }), "x"_a);
  m.def("round_to_f16", unary("round_to_f16", [](Expr x) { return round_to_f16(x); }), "x"_a);
  m.def("global_sum_of_squares", unary("global_sum_of_squares", [](Expr x) { return global_sum_of_squares(x); }), "x"_a,
        "Sum over every element of every tensor of x*x (float64, deterministic order): a global reduction.");
  m.def("tensor_sum_of_squares", unary("tensor_sum_of_squares", [](Expr x) { return tensor_sum_of_squares(x); }),
        "x"_a, "Sum of x*x over each tensor's own elements (one value per tensor; LAMB's norms).");
  m.def("any_nonfinite", unary("any_nonfinite", [](Expr x) { return any_nonfinite(x); }), "x"_a,
        "1 if any element of x over all tensors is inf or NaN, else 0: a global reduction.");
  m.def("global_max_abs", unary("global_max_abs", [](Expr x) { return global_max_abs(x); }), "x"_a,
        "The largest |x| over every element of every tensor (NaN if any is NaN): a global reduction.");
  m.def("tensor_max_abs", unary("tensor_max_abs", [](Expr x) { return tensor_max_abs(x); }), "x"_a,
        "The largest |x| over each tensor's own elements (one value per tensor; NaN if any is NaN).");
  m.def("reduce", [](nb::handle x, const std::string& op, const std::string& scope) {
    const PyExpr& a = first_expr("reduce", {x});
    static const std::map<std::string, Op> ops = {
        {"sum", Op::Sum}, {"sum_of_squares", Op::SumSquares}, {"max_abs", Op::MaxAbs}, {"any_nonfinite", Op::AnyNonFinite}};
    static const std::map<std::string, Scope> scopes = {
        {"global", Scope::Global}, {"tensor", Scope::Tensor}, {"row", Scope::Row}, {"column", Scope::Col}};
    auto o = ops.find(op);
    auto s = scopes.find(scope);
    if (o == ops.end()) throw Error("reduce: op must be sum, sum_of_squares, max_abs or any_nonfinite, got '" + op + "'");
    if (s == scopes.end()) throw Error("reduce: scope must be global, tensor, row or column, got '" + scope + "'");
    return wrap(reduce(o->second, a.e, s->second), a);
  }, "x"_a, "op"_a, "scope"_a,
        "A reduction of x (op: sum, sum_of_squares, max_abs, any_nonfinite) over a scope: global, tensor, or row / "
        "column of the tensor's matrix view (a sum of row or column values over a tensor needs no pass).");
  m.def("pow", binary("pow", [](Expr x, Expr y) { return pow(x, y); }), "x"_a, "y"_a);
  m.def("min", binary("min", [](Expr x, Expr y) { return min(x, y); }), "x"_a, "y"_a, "NaN if either is NaN (torch.minimum).");
  m.def("max", binary("max", [](Expr x, Expr y) { return max(x, y); }), "x"_a, "y"_a, "NaN if either is NaN (torch.maximum).");
  m.def("logical_and", binary("logical_and", [](Expr x, Expr y) { return x && y; }), "x"_a, "y"_a);
  m.def("logical_or", binary("logical_or", [](Expr x, Expr y) { return x || y; }), "x"_a, "y"_a);
  m.def("select", ternary("select", [](Expr c, Expr t, Expr f) { return select(c, t, f); }), "cond"_a, "if_true"_a,
        "if_false"_a, "if_true where cond != 0, else if_false.");
  m.def("lerp", ternary("lerp", [](Expr s, Expr e, Expr w) { return lerp(s, e, w); }), "start"_a, "end"_a, "weight"_a,
        "start + weight*(end - start), computed as torch.lerp.");
  m.def("fma", ternary("fma", [](Expr x, Expr y, Expr z) { return fma(x, y, z); }), "x"_a, "y"_a, "z"_a,
        "x*y + z with one rounding.");

  // --- RuleBuilder
  nb::class_<PyBuilder>(m, "RuleBuilder", "What a rule's update function builds its math with.")
      .def("param", [](const PyBuilder& b) { return b.out(b.get().param()); }, "The parameter before this step.")
      .def("update", [](const PyBuilder& b) { return b.out(b.get().update()); },
           "The incoming update (the gradient for the first rule of a chain).")
      .def("state", [](const PyBuilder& b, const std::string& n) { return b.out(b.get().state(n)); }, "name"_a)
      .def("set_state", [](const PyBuilder& b, const std::string& n, nb::handle v) {
        RuleBuilder& rb = b.get();
        PyExpr like = b.out(rb.param());
        rb.set_state(n, lift(v, like, "set_state").e);
      }, "name"_a, "value"_a)
      .def("hyper", [](const PyBuilder& b, const std::string& n) { return b.out(b.get().hyper(n)); }, "name"_a)
      .def("uniform_state", [](const PyBuilder& b, const std::string& n) { return b.out(b.get().uniform_state(n)); },
           "name"_a, "A declared uniform state (one value per group) before this step.")
      .def("set_uniform_state", [](const PyBuilder& b, const std::string& n, nb::handle v) {
        RuleBuilder& rb = b.get();
        PyExpr like = b.out(rb.step());
        rb.set_uniform_state(n, lift(v, like, "set_uniform_state").e);
      }, "name"_a, "value"_a, "Its value after this step (uniform), committed where the step is not skipped.")
      .def("step", [](const PyBuilder& b) { return b.out(b.get().step()); }, "The step being taken, 1 on the first.")
      .def("shape", [](const PyBuilder& b, const std::string& item) {
        static const std::map<std::string, ShapeItem> items = {
            {"numel", ShapeItem::Numel}, {"rows", ShapeItem::Rows}, {"cols", ShapeItem::Cols}, {"is_matrix", ShapeItem::IsMatrix}};
        auto it = items.find(item);
        if (it == items.end()) throw Error("shape: item must be numel, rows, cols or is_matrix, got '" + item + "'");
        return b.out(b.get().shape(it->second));
      }, "item"_a, "The parameter's element count, rows, columns of its matrix view, or whether it has one (per tensor).")
      .def("global_value", [](const PyBuilder& b, const std::string& n) { return b.out(b.get().global(parse_global(n))); },
           "name"_a, "A per-step global scalar: 'grad_scale' or 'found_inf'.")
      .def("grad_scale", [](const PyBuilder& b) { return b.out(b.get().global(kGradScale)); })
      .def("found_inf", [](const PyBuilder& b) { return b.out(b.get().global(kFoundInf)); })
      .def("constant", [](const PyBuilder& b, double v) { return b.out(b.get().constant(v)); }, "value"_a)
      .def("skip_step_if", [](const PyBuilder& b, nb::handle cond) {
        RuleBuilder& rb = b.get();
        rb.skip_step_if(lift(cond, b.out(rb.param()), "skip_step_if").e);
      }, "cond"_a, "The whole step changes nothing when cond != 0 (cond must be uniform).")
      .def("param_base", [](const PyBuilder& b) { return b.out(b.get().param_base()); },
           "The value the final update is added to (param() unless a rule decayed it).")
      .def("set_param_base", [](const PyBuilder& b, nb::handle v) {
        RuleBuilder& rb = b.get();
        rb.set_param_base(lift(v, b.out(rb.param()), "set_param_base").e);
      }, "value"_a, "Replaces the value the final update is added to (decoupled decay, or a whole new parameter).")
      .def("name", [](const PyBuilder& b, const PyExpr& e, const std::string& n) {
        return b.out(b.get().name(checked(e).e, n));
      }, "expr"_a, "name"_a, "Names a value in generated code; returns it.");

  // --- Range, Rule
  nb::class_<Range>(m, "Range", "The set a hyperparameter's value must lie in.")
      .def("__init__", [](Range* r, double lo, double hi, bool lo_open, bool hi_open) {
        new (r) Range{lo, hi, lo_open, hi_open};
      }, "lo"_a = -1e308, "hi"_a = 1e308, "lo_open"_a = false, "hi_open"_a = false)
      .def_static("any", &Range::any)
      .def_static("non_negative", &Range::non_negative)
      .def_static("positive", &Range::positive)
      .def_static("unit_interval_open_right", &Range::unit_interval_open_right)
      .def("contains", &Range::contains)
      .def("describe", &Range::describe)
      .def("__repr__", [](const Range& r) { return "optfuse.Range(" + r.describe() + ")"; });

  nb::class_<Rule>(m, "Rule", "A rule: declared hyperparameters and state, and an update function.")
      .def(nb::init<std::string>(), "name"_a)
      .def("hyper", [](Rule& r, const std::string& n, double v, const Range& range) -> Rule& { return r.hyper(n, v, range); },
           "name"_a, "value"_a, "range"_a = Range::any(), nb::rv_policy::reference)
      .def("state", [](Rule& r, const std::string& n, double init) -> Rule& { return r.state(n, init); }, "name"_a,
           "init"_a = 0.0, nb::rv_policy::reference)
      .def("uniform_state", [](Rule& r, const std::string& n, double init) -> Rule& { return r.uniform_state(n, init); },
           "name"_a, "init"_a = 0.0, nb::rv_policy::reference,
           "Declares a uniform state: one float64 per parameter group, kept across steps.")
      .def("update", [](Rule& r, nb::object fn) -> Rule& { return r.update(python_update_fn(r.name(), std::move(fn))); },
           "fn"_a, nb::rv_policy::reference, "fn(builder) -> Expr: the outgoing update.")
      .def("note", [](Rule& r, const std::string& t) -> Rule& { return r.note(t); }, "text"_a, nb::rv_policy::reference)
      .def_prop_ro("name", &Rule::name)
      .def_prop_ro("hypers", [](const Rule& r) {
        std::vector<std::pair<std::string, double>> out;
        for (auto& h : r.hypers()) out.emplace_back(h.name, h.value);
        return out;
      })
      .def_prop_ro("states", [](const Rule& r) {
        std::vector<std::pair<std::string, double>> out;
        for (auto& s : r.states()) out.emplace_back(s.name, s.init);
        return out;
      })
      .def_prop_ro("has_update", [](const Rule& r) { return static_cast<bool>(r.update_fn()); })
      .def("signature", &Rule::signature)
      .def("__repr__", [](const Rule& r) { return "<optfuse.Rule " + r.signature() + ">"; });

  m.def("_set_hyper_range_checks", [](bool on) {
    const bool was = hyper_range_checks();
    set_hyper_range_checks(on);
    return was;
  }, "on"_a, "Turns Rule.hyper's range checks on or off for this thread; returns the previous setting.");
  m.def("make_builtin", [](const std::string& name, const nb::kwargs& kw) { return make_builtin(name, to_args(kw)); },
        "name"_a, "kwargs"_a, "A built-in rule or named optimizer as a chain (list of Rule).");
  m.def("parse_chain", &parse_chain, "spec"_a, "SPEC text, e.g. 'chain(clip_by_global_norm(1.0), adamw())', as a chain.");
  m.def("builtin_names", &builtin_names);
  m.def("builtin_parameter_names", &builtin_parameter_names, "name"_a);
  m.def("chain_text", [](nb::handle c) { return build_program(to_chain(c)).chain_text; }, "chain"_a);

  // --- Plan, explain
  nb::class_<Plan>(m, "Plan", "A chain after passes, cut into passes over memory.")
      .def_prop_ro("chain_text", [](const Plan& p) { return p.program.chain_text; })
      .def_prop_ro("pass_log", [](const Plan& p) { return p.pass_log; })
      .def_prop_ro("num_phases", [](const Plan& p) { return p.phases.size(); })
      .def_prop_ro("matrix", &Plan::matrix,
                   "Whether the plan has row or column values (or reads tensor shapes): it then needs each "
                   "parameter's matrix view (TensorRef.cols); the CPU backend interprets it.")
      .def_prop_ro("reduction_scopes", [](const Plan& p) {
        std::vector<std::string> out;
        for (size_t r = 0; r < p.reductions.size(); ++r) out.push_back(scope_name(p.scope_of(r)));
        return out;
      }, "The scope of each reduction (\"global\", \"tensor\", \"row\" or \"column\").")
      .def_prop_ro("schedule", [](const Plan& p) {
        std::vector<std::pair<std::string, int>> out;
        static const char* names[] = {"scalar", "values", "pass", "exchange", "combine", "commit"};  // ScheduleStep::Kind
        for (const ScheduleStep& st : p.schedule) out.emplace_back(names[static_cast<int>(st.kind)], st.phase);
        return out;
      }, "The step schedule: (kind, phase) per step; kinds scalar, values, pass, exchange, combine, commit.")
      .def_prop_ro("state_names", [](const Plan& p) {
        std::vector<std::string> out;
        for (auto& s : p.program.states) out.push_back(s.qualified);
        return out;
      })
      .def_prop_ro("hyper_names", [](const Plan& p) {
        std::vector<std::string> out;
        for (auto& h : p.program.hypers) out.push_back(h.qualified);
        return out;
      })
      .def("ir", [](const Plan& p) { return print_ir(p.program, &p.kind); })
      .def("describe", [](const Plan& p, const std::string& dtype) { return p.describe(parse_dtype(dtype)); },
           "dtype"_a = "float32")
      .def("source", [](const Plan& p, const std::string& backend) { return generate_source(p, backend); },
           "backend"_a = "cpu")
      .def("__repr__", [](const Plan& p) { return "<optfuse.Plan " + p.program.chain_text + ">"; });
  m.def("make_plan", [](nb::handle c) { return make_plan(to_chain(c)); }, "chain"_a);
  m.def("explain", [](nb::handle c, const std::string& backend, bool source) {
    return explain_text(to_chain(c), backend, source);
  }, "chain"_a, "backend"_a = "cpu", "source"_a = true,
        "The text `optfuse explain` prints: the chain, passes, IR, plan and generated source.");
}

}  // namespace optfuse::py
