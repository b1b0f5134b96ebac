"""The mixed-precision options of every optfuse.torch optimizer (constructor keywords and
param_group keys): their defaults, validation and what they mean for a chain and its states."""
import functools
import inspect
import operator

import torch

from .. import _core

OptfuseError = _core.OptfuseError

# Mixed-precision options of every optfuse.torch optimizer (constructor keywords and param_group
# keys) and their defaults: the defaults step every role in the parameter's dtype, as torch does.
_PRECISION = {"master_weights": False, "state_dtype": None, "stochastic_rounding": False, "kahan": False}
_LOW = (torch.float16, torch.bfloat16)


def _precision_key(g):
    """A group's mixed-precision options as a plain tuple (what _precision_of normalises)."""
    mw = g.get("master_weights", False)
    return ("remainders" if mw == "remainders" else ("copy" if mw else "none"), g.get("state_dtype"),
            bool(g.get("stochastic_rounding", False)), bool(g.get("kahan", False)))


class _Precision(tuple):
    """A group's mixed-precision options, normalised: (master_weights, state_dtype, stochastic_rounding, kahan)."""
    master_weights = property(operator.itemgetter(0))
    state_dtype = property(operator.itemgetter(1))
    stochastic_rounding = property(operator.itemgetter(2))
    kahan = property(operator.itemgetter(3))


def _precision_of(g):
    mw = g.get("master_weights", False)
    master = "remainders" if mw == "remainders" else ("copy" if mw else "none")
    return _Precision((master, g.get("state_dtype"), bool(g.get("stochastic_rounding", False)),
                       bool(g.get("kahan", False))))


def _check_precision_options(cls_name, g):
    mw = g.get("master_weights", False)
    if not (mw is True or mw is False or mw == "remainders"):
        raise OptfuseError(f"{cls_name}: master_weights must be False, True or 'remainders', got {mw!r}")
    sd = g.get("state_dtype")
    if sd is not None and sd not in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        raise OptfuseError(f"{cls_name}: state_dtype must be None, torch.float32, torch.bfloat16, torch.float16 or "
                           f"torch.int8 (block-quantized 8-bit states), got {sd!r}")
    for k in ("stochastic_rounding", "kahan"):
        if not isinstance(g.get(k, False), bool):
            raise OptfuseError(f"{cls_name}: {k} must be True or False, got {g.get(k)!r}")
    if mw and g.get("kahan", False):
        raise OptfuseError(f"{cls_name}: kahan=True compensates the rounding of parameters stored without a master "
                           "copy; with master_weights nothing is rounded away: choose one")
    if g.get("kahan", False) and g.get("stochastic_rounding", False):
        raise OptfuseError(f"{cls_name}: kahan=True and stochastic_rounding=True are two answers to the same rounding "
                           "of the parameter: choose one")


def _chain_precision(cls_name, prec, p, tg):
    """(master weights, kahan dtype name or None) of the chain stepping parameter p (its engine key)."""
    if prec.master_weights != "none" or prec.kahan:
        what = "master_weights" if prec.master_weights != "none" else "kahan"
        if p.dtype not in _LOW:
            raise OptfuseError(f"{cls_name}: {what} is for float16/bfloat16 parameters, but group {tg} has a {p.dtype} "
                               f"parameter of shape {tuple(p.shape)}; put float32 parameters in a param group with "
                               f"{what}=False")
        if prec.master_weights == "remainders" and p.dtype != torch.bfloat16:
            raise OptfuseError(f"{cls_name}: master_weights='remainders' rebuilds a float32 master from a bfloat16 "
                               f"parameter; group {tg} has a {p.dtype} parameter of shape {tuple(p.shape)} "
                               "(use master_weights=True)")
    kahan = str(p.dtype).replace("torch.", "") if prec.kahan else None
    return (prec.master_weights, kahan)


def _state_dtype(prec, p, name):
    """The dtype of a rule state: state_dtype, else float32 beside a master copy, else the parameter's."""
    if name == "kahan_comp":
        return p.dtype
    if prec.state_dtype is not None:
        return prec.state_dtype
    return torch.float32 if prec.master_weights != "none" else p.dtype


# What each option means, for every optfuse.torch class's docstring (one definition).
PRECISION_DOC = """
    optfuse's options besides the replaced class's (keyword-only; also param_group keys):
      master_weights=False   True: a float32 master copy of each float16/bfloat16 parameter is
                             stepped and rounded into the parameter; "remainders": a bfloat16
                             parameter plus an int16 remainder (6 bytes per parameter). Refused
                             for parameters of other dtypes.
      state_dtype=None       dtype of the rule's states (torch.float32, torch.bfloat16,
                             torch.float16, or torch.int8: 8-bit codes with a float32 scale per
                             block of 256 elements, about 1.02 bytes per element); None: the
                             parameter's (float32 beside a master copy).
      stochastic_rounding=False  float16/bfloat16 stores round stochastically (deterministic
                             streams per tensor).
      kahan=False            Kahan-compensated parameter updates (a compensation state in the
                             parameter's dtype); exclusive with master_weights and stochastic_rounding.
"""


def _taking_precision_options(init):
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in _PRECISION}
        if given or "_precision_defaults" not in self.__dict__:
            self.__dict__["_precision_defaults"] = given
        init(self, *args, **kwargs)
    # help() and inspect show the options in the signature, keyword-only, with their defaults
    try:
        sig = inspect.signature(init)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD and p.name not in _PRECISION]
        extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in _PRECISION.items()]
        rest = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
        wrapper.__signature__ = sig.replace(parameters=params + extra + rest)
    except (TypeError, ValueError):
        pass
    return wrapper
