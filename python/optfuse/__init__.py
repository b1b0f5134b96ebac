"""optfuse: optimizer update rules written as math, fused into one generated kernel over all
parameters (CPU: generated C++ compiled at run time; CUDA: NVRTC).

    import optfuse
    chain = optfuse.make_builtin("adamw", lr=1e-3)          # or optfuse.parse_chain("adamw(lr=1e-3)")
    opt = optfuse.Optimizer(chain, "cpu")
    opt.set_tensors([(param, grad, [exp_avg, exp_avg_sq], 0)])   # NumPy arrays or torch tensors
    opt.step()

New rules are written in Python with the same builder as in C++:

    sign_rule = optfuse.Rule("scale_by_sign").hyper("strength", 1.0).update(
        lambda b: optfuse.sign(b.update()) * b.hyper("strength"))

A chain with a matrix phase (Muon: "muon(lr=0.02)") runs through optfuse.MatrixChainOptimizer
(2-D parameters; its state_names say which state arrays to pass).

The PyTorch front end lives in optfuse.torch (imported on demand; torch is optional).
"""
from ._core import (  # noqa: F401
    BackendUnavailable,
    Expr,
    MatrixChainOptimizer,
    OptfuseError,
    Optimizer,
    Plan,
    Range,
    Rule,
    RuleBuilder,
    abs,
    any_nonfinite,
    builtin_names,
    builtin_parameter_names,
    chain_text,
    exp,
    explain,
    fma,
    global_max_abs,
    global_sum_of_squares,
    tensor_max_abs,
    tensor_sum_of_squares,
    is_finite,
    lerp,
    log,
    logical_and,
    logical_not,
    logical_or,
    make_builtin,
    make_plan,
    max,
    min,
    parse_chain,
    pow,
    round_to_bf16,
    round_to_f16,
    rsqrt,
    select,
    sign,
    sqrt,
)
from ._chain import chain, init_states  # noqa: F401

__version__ = "0.1.0"

for _cls in (OptfuseError, BackendUnavailable, Expr, Optimizer, Plan, Range, Rule, RuleBuilder):
    try:
        _cls.__module__ = "optfuse"
    except (AttributeError, TypeError):  # some extension types do not allow it; only cosmetic
        pass
del _cls
