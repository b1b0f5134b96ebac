"""pytest plugin: torch's own optimizer tests (test/test_optim.py, TestOptimRenewed) against optfuse.torch.

Load it with `-p optfuse_optim_db_plugin` (its folder on PYTHONPATH) when running the copy of torch's
test/test_optim.py in ../shared/torch/ (see ../shared/torch/README.md; third-party code: it is run
from there and never copied into this repository). tests/python/test_torch_suite.py does this.

At load time, before test_optim.py is imported (its decorators read optim_db when the module is
imported), it
  * replaces, in place, each OptimizerInfo.optim_cls of
    torch.testing._internal.common_optimizers.optim_db by the optfuse.torch class of the same name,
    so every test TestOptimRenewed generates from optim_db runs optfuse's class (test names stay
    torch's: OptimizerInfo.name is optim_cls.__name__);
  * removes from optim_db the entries without an optfuse drop-in (LEFT_OUT below, each with its
    reason; the pytest header lists them);
  * puts stub modules in sys.modules for optim.test_lrscheduler, optim.test_optim and
    optim.test_swa_utils: test_optim.py imports them from torch's sibling test/optim/ package, which
    TestOptimRenewed does not need.

OPTFUSE_SUITE_REFERENCE selects what the tests that compare an implementation flag against the
for-loop implementation compare with (REFERENCE_TESTS below):
  unset, "" or "self"  optim_db as patched: the reference (foreach=False / fused=False) is optfuse's
                       class too, which ignores the flags, so optfuse is compared with itself;
  "torch"              while such a test runs, its OptimizerInfo.optim_cls is a factory that builds
                       the reference from torch's own class (torch's for-loop implementation) and
                       the optimizer under test from optfuse's, with the same constructor kwargs.
"""
import os
import sys
import types

import pytest
import torch.testing._internal.common_optimizers as common_optimizers
from torch.testing._internal.common_utils import TestCase

import optfuse.torch as oft

REFERENCE_ENV = "OPTFUSE_SUITE_REFERENCE"
REFERENCE = os.environ.get(REFERENCE_ENV, "").strip().lower() or "self"
if REFERENCE not in ("self", "torch"):
    raise RuntimeError(f"{REFERENCE_ENV}={os.environ[REFERENCE_ENV]!r}: expected 'torch' or 'self' (or unset)")

# optim_db entries without an optfuse.torch drop-in: left out of the run, with the reason.
LEFT_OUT = {
    "LBFGS": "no optfuse drop-in: a closure-driven line search with history (not an element-wise "
             "update the engine fuses)",
    "SparseAdam": "no optfuse drop-in: takes only sparse gradients",
}

# Tests that build a reference optimizer and an optimizer under test from the same
# OptimizerInfo.optim_cls and compare them, with how the reference is recognised from the
# constructor's kwargs:
#   "flags"     the reference is the construction with neither foreach nor fused set true
#               (_test_derived_optimizers: foreach/fused False, then True; test_mixed_device_dtype:
#               impl False, then True; test_peak_memory_foreach: foreach False, then True);
#   "alternate" the first of each pair of constructions (test_fused_cpu_matches_device: fused=True
#               on the CPU, then on the accelerator).
REFERENCE_TESTS = {
    "test_foreach_matches_forloop": "flags",
    "test_fused_matches_forloop": "flags",
    "test_set_default_dtype_works_with_foreach": "flags",
    "test_mixed_device_dtype": "flags",
    "test_peak_memory_foreach": "flags",
    "test_fused_cpu_matches_device": "alternate",
}

optim_db = common_optimizers.optim_db

TORCH_CLASSES = {}    # name -> torch's class, as optim_db had it
OPTFUSE_CLASSES = {}  # name -> the optfuse.torch class that replaced it
INFOS = {}            # name -> the OptimizerInfo (patched)


def _patch_optim_db():
    kept = []
    for info in optim_db:
        name = info.optim_cls.__name__
        ours = getattr(oft, name, None)
        if name in LEFT_OUT:
            continue
        if not isinstance(ours, type):
            raise RuntimeError(f"optim_db lists {name}, which optfuse.torch does not provide and LEFT_OUT does "
                               f"not name: add it to LEFT_OUT with a reason, or provide the drop-in")
        TORCH_CLASSES[name] = info.optim_cls
        OPTFUSE_CLASSES[name] = ours
        info.optim_cls = ours
        INFOS[name] = info
        kept.append(info)
    optim_db[:] = kept  # in place: test_optim.py imports this very list


def _stub_sibling_modules():
    """test_optim.py's `from optim.test_lrscheduler import TestLRScheduler` and the like."""
    if "optim" not in sys.modules:
        pkg = types.ModuleType("optim")
        pkg.__path__ = []
        pkg.__doc__ = "stub for torch's test/optim package (optfuse_optim_db_plugin)"
        sys.modules["optim"] = pkg
    pkg = sys.modules["optim"]
    # TestSWAUtils is passed to instantiate_device_type_tests: a TestCase without tests.
    stubs = {"test_lrscheduler": "TestLRScheduler", "test_optim": "TestDifferentiableOptimizer",
             "test_swa_utils": "TestSWAUtils"}
    for mod_name, cls_name in stubs.items():
        full = f"optim.{mod_name}"
        mod = types.ModuleType(full)
        mod.__doc__ = "stub (optfuse_optim_db_plugin): not needed by TestOptimRenewed"
        setattr(mod, cls_name, type(cls_name, (TestCase,), {"__module__": full}))
        sys.modules[full] = mod
        setattr(pkg, mod_name, mod)


def _reference_factory(name, rule):
    torch_cls, ours = TORCH_CLASSES[name], OPTFUSE_CLASSES[name]
    calls = [0]

    def build(params, *args, **kwargs):
        if rule == "alternate":
            reference = calls[0] % 2 == 0
            calls[0] += 1
        else:
            reference = not (kwargs.get("foreach") or kwargs.get("fused"))
        return (torch_cls if reference else ours)(params, *args, **kwargs)

    build.__name__ = build.__qualname__ = name  # OptimizerInfo.name and skip messages read it
    build.torch_cls, build.optfuse_cls = torch_cls, ours
    return build


def _reference_target(test_name):
    """(optimizer name, rule) when test_name is a reference test of a patched class, else None."""
    for prefix, rule in REFERENCE_TESTS.items():
        if not test_name.startswith(prefix + "_"):
            continue
        # the optimizer's name is one "_"-separated part of the rest (test_mixed_device_dtype adds
        # its impl parametrisation beside it)
        rest = "_" + test_name[len(prefix) + 1:] + "_"
        for name in INFOS:
            if f"_{name}_" in rest:
                return name, rule
    return None


_patch_optim_db()
_stub_sibling_modules()


def pytest_report_header(config):
    lines = [f"optfuse_optim_db_plugin: optim_db patched to optfuse.torch ({oft.__file__}): "
             + ", ".join(sorted(OPTFUSE_CLASSES)),
             "optfuse_optim_db_plugin: reference of the foreach/fused-vs-forloop tests: "
             + ("torch's own classes" if REFERENCE == "torch" else "optfuse's classes (compared with themselves)")
             + f" ({REFERENCE_ENV}={REFERENCE})"]
    lines += [f"optfuse_optim_db_plugin: left out {n}: {why}" for n, why in LEFT_OUT.items()]
    return lines


if REFERENCE == "torch":
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        target = _reference_target(item.name)
        if target is None:
            return (yield)
        name, rule = target
        info = INFOS[name]
        info.optim_cls = _reference_factory(name, rule)
        try:
            return (yield)
        finally:
            info.optim_cls = OPTFUSE_CLASSES[name]
