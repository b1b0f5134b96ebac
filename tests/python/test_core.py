"""The core bindings without torch: rules and expressions in Python, built-ins and SPEC text,
explain, and optfuse.Optimizer stepping NumPy arrays (CPU backend against the reference)."""
import os
import subprocess

import numpy as np
import pytest

import optfuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_set(chain, shapes, dtype=np.float32, seed=0):
    """Arrays (param, grad, states) per tensor, with the chain's state initial values."""
    rng = np.random.default_rng(seed)
    opt = optfuse.Optimizer(chain, "reference")
    out = []
    for shape in shapes:
        p = rng.standard_normal(shape).astype(dtype)
        g = rng.standard_normal(shape).astype(dtype)
        out.append((p, g, optfuse.init_states(opt, p)))
    return out


def copy_set(s):
    return [(p.copy(), g.copy(), [x.copy() for x in st]) for p, g, st in s]


def rel(a, b):
    return max(np.abs(x[0].astype(np.float64) - y[0]).max() for x, y in zip(a, b)) / max(
        np.abs(y[0].astype(np.float64)).max() for y in b)


def test_builtins_and_errors():
    names = optfuse.builtin_names()
    for n in ("sgd", "adam", "adamw", "lion", "rmsprop", "adagrad", "clip_by_global_norm", "unscale_by_grad_scale"):
        assert n in names
    chain = optfuse.make_builtin("adamw", lr=1e-3, betas=(0.8, 0.9))
    assert [r.name for r in chain] == ["scale_by_adam", "decoupled_weight_decay", "scale_by_learning_rate"]
    assert dict(chain[0].hypers)["b1"] == 0.8
    with pytest.raises(optfuse.OptfuseError, match="adamw"):
        optfuse.make_builtin("adamww")
    with pytest.raises(ValueError, match="unknown argument 'lrr'"):
        optfuse.make_builtin("adam", lrr=1.0)
    with pytest.raises(optfuse.OptfuseError, match="position|column|\\^"):
        optfuse.parse_chain("chain(adam(lr=), sgd())")


def test_explain_is_the_cli_text():
    spec = "chain(clip_by_global_norm(1.0), adamw(lr=1e-3))"
    text = optfuse.explain(spec)
    for section in ("== chain", "== passes", "== IR after passes", "== plan", "== generated cpu source"):
        assert section in text
    assert optfuse.explain(optfuse.parse_chain(spec)) == text
    assert "== generated" not in optfuse.explain(spec, source=False)
    assert "== generated cuda source" in optfuse.explain(spec, backend="cuda")
    cli = os.path.join(ROOT, "build", "optfuse")
    if not os.access(cli, os.X_OK):
        pytest.skip("build/optfuse is not built (scripts/build.sh): cannot compare with the CLI")
    newest = max(os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ROOT, "src")) for f in fs)
    if os.path.getmtime(cli) < newest:
        pytest.skip("build/optfuse is older than src/ (scripts/build.sh rebuilds it): cannot compare with the CLI")
    for backend in ("cpu", "cuda"):
        # The CLI prints the plan alone unless --source; explain() includes the source unless source=False.
        out = subprocess.run([cli, "explain", spec, "--backend", backend, "--source"], capture_output=True, text=True, check=True)
        assert out.stdout == optfuse.explain(spec, backend=backend)
        out = subprocess.run([cli, "explain", spec, "--backend", backend], capture_output=True, text=True, check=True)
        hint = f"\n(the generated {backend} source: add --source, or --source-only for it alone)\n"
        assert out.stdout == optfuse.explain(spec, backend=backend, source=False) + hint


def sign_rule():
    return optfuse.Rule("scale_by_sign").hyper("strength", 2.0, optfuse.Range.non_negative()).update(
        lambda b: optfuse.sign(b.update()) * b.hyper("strength"))


def test_rule_in_python_with_every_operator():
    def update(b):
        u, p, t = b.update(), b.param(), b.step()
        m = b.state("m")
        m_new = optfuse.lerp(m, u, 0.1)
        b.set_state("m", m_new)
        x = (u + 1.0) * 2.0 - u / 4.0 + (-u) + abs(u) ** 2 + 2.0 ** optfuse.min(u, 0.5)
        x = x + optfuse.sqrt(abs(u) + 1) + optfuse.rsqrt(abs(u) + 1) + optfuse.exp(-abs(u)) + optfuse.log(abs(u) + 1)
        x = x + optfuse.max(u, -0.5) + optfuse.fma(u, p, 1.0) + optfuse.select(u > 0, 1.0, -1.0)
        x = x + optfuse.select((u >= 0) & (p < 0), 1.0, 0.0) + optfuse.select((u <= 0) | (p != 0), 0.5, 0.0)
        x = x + optfuse.is_finite(u) + (u == p) + 1.0 / t
        return b.name(x * b.hyper("lr") * -1.0 + 0 * m_new, "weird")

    rule = optfuse.Rule("weird").hyper("lr", 1e-3).state("m").update(update)
    assert rule.signature() == "weird(lr=0.001)" and rule.states == [("m", 0.0)]
    s = make_set([rule], [(7, 5), (33,)])
    ref, cpu = copy_set(s), copy_set(s)
    o_ref, o_cpu = optfuse.Optimizer([rule], "reference"), optfuse.Optimizer([rule], "cpu")
    o_ref.set_tensors([(p, g, st, 0) for p, g, st in ref])
    o_cpu.set_tensors([(p, g, st, 0) for p, g, st in cpu])
    for _ in range(3):
        o_ref.step()
        o_cpu.step()
    assert rel(cpu, ref) <= 1e-6
    assert o_cpu.step_count(0) == 3
    assert "weird" in o_cpu.source()


def test_expressions_die_with_their_update_function():
    kept = []

    def update(b):
        kept.append(b.update())
        return b.update()

    optfuse.make_plan([optfuse.Rule("keep").update(update)])
    with pytest.raises(optfuse.OptfuseError, match="already returned"):
        kept[0] + 1.0
    with pytest.raises(TypeError, match="truth value"):
        optfuse.make_plan([optfuse.Rule("bad").update(lambda b: b.update() if b.update() else b.update())])
    with pytest.raises(optfuse.OptfuseError, match="must return an optfuse.Expr"):
        optfuse.make_plan([optfuse.Rule("bad").update(lambda b: 1.0)])
    with pytest.raises(optfuse.OptfuseError, match="did not declare"):
        optfuse.make_plan([optfuse.Rule("bad").update(lambda b: b.state("nope"))])
    with pytest.raises(ZeroDivisionError):  # a Python error in the update function comes through as is
        optfuse.make_plan([optfuse.Rule("bad").update(lambda b: 1 / 0)])


@pytest.mark.parametrize("spec", ["chain(clip_by_global_norm(0.5), adamw(lr=1e-2))", "adam(amsgrad=true)",
                                  "sgd(lr=0.1, momentum=0.9, nesterov=true)", "lion(lr=1e-3, weight_decay=0.1)",
                                  "rmsprop(centered=true, momentum=0.5)", "adagrad(lr_decay=0.01)"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_cpu_matches_reference(spec, dtype):
    s = make_set(spec, [(3, 7), (100,), (1,), (2, 2, 5)], dtype=dtype)
    ref, cpu = copy_set(s), copy_set(s)
    o_ref, o_cpu = optfuse.Optimizer(spec, "reference", groups=2), optfuse.Optimizer(spec, "cpu", groups=2)
    for o, arrays in ((o_ref, ref), (o_cpu, cpu)):
        o.set_tensors([(p, g, st, i % 2) for i, (p, g, st) in enumerate(arrays)])
        o.set_hyper(1, "lr", 0.5 * o.hyper(0, "lr"))
        for _ in range(4):
            o.step()
    # float16 storage: the reference computes in float64, the CPU backend in float32; both round the
    # result to float16, so they may differ by one float16 ulp (2^-10 relative)
    assert rel(cpu, ref) <= (1e-6 if dtype == np.float32 else 2e-3)
    assert o_cpu.step_count(1) == 4 and o_cpu.backend == "cpu" and o_ref.backend == "reference"


def test_init_states_copies_the_parameter_for_a_from_param_state():
    """Schedule-free's z starts as the parameter; exp_avg_sq at 0. One step with ckp1 = 1 (its
    default 1/t at t = 1) leaves y = z."""
    opt = optfuse.Optimizer("adamw_schedule_free(lr=0.1)", "cpu")
    p = np.linspace(-1, 1, 9, dtype=np.float32)
    g = np.ones(9, dtype=np.float32)
    z, v = optfuse.init_states(opt, p)
    assert np.array_equal(z, p) and z is not p and not v.any()
    assert [s for s, _ in opt.state_storage] == [True, False]
    opt.set_tensors([(p, g, [z, v], 0)])
    opt.step()
    assert np.array_equal(p, z) and not np.array_equal(z, np.linspace(-1, 1, 9, dtype=np.float32))


def test_grad_scale_and_found_inf_on_the_host():
    spec = "chain(unscale_by_grad_scale(), sgd(lr=0.1))"
    base = make_set(spec, [(10,)])
    a, b = copy_set(base), copy_set(base)
    b[0][1][:] *= 4  # b's gradients arrive scaled by 4
    oa, ob = optfuse.Optimizer(spec, "cpu"), optfuse.Optimizer(spec, "cpu")
    oa.set_tensors(a)
    ob.set_tensors(b)
    oa.step()
    ob.step(grad_scale=np.array([4.0], dtype=np.float32), found_inf=0.0)
    assert np.array_equal(a[0][0], b[0][0])
    before = b[0][0].copy()
    ob.step(grad_scale=4.0, found_inf=np.ones(1, np.float32))
    assert np.array_equal(before, b[0][0]) and ob.step_count(0) == 1


def test_set_tensors_errors():
    o = optfuse.Optimizer("adam()", "cpu")
    p = np.zeros((4, 6), np.float32)
    st = [np.zeros_like(p), np.zeros_like(p)]
    with pytest.raises(optfuse.OptfuseError, match="not contiguous"):
        o.set_tensors([(p, np.zeros((6, 4), np.float32).T, st)])
    with pytest.raises(optfuse.OptfuseError, match="float64"):
        o.set_tensors([(p, np.zeros((4, 6)), st)])
    with pytest.raises(optfuse.OptfuseError, match="shape"):
        o.set_tensors([(p, np.zeros(5, np.float32), st)])
    with pytest.raises(optfuse.OptfuseError, match="state arrays"):
        o.set_tensors([(p, np.zeros_like(p), st[:1])])
    with pytest.raises(optfuse.OptfuseError, match="group"):
        o.set_tensors([(p, np.zeros_like(p), st, 3)])
    ro = np.zeros_like(p)
    ro.flags.writeable = False
    with pytest.raises(optfuse.OptfuseError, match="read-only"):
        o.set_tensors([(ro, np.zeros_like(p), st)])
    with pytest.raises(optfuse.OptfuseError, match="gradient is int16; only a master-weight remainder"):
        o.set_tensors([(p, np.zeros_like(p, dtype=np.int16), st)])
    o.set_tensors([(p, np.zeros_like(p, dtype=np.float16), st)])  # a float16 gradient for a float32 parameter
    with pytest.raises(optfuse.OptfuseError, match="expected an array"):
        o.set_tensors([(p, [1, 2], st)])
    g = np.zeros_like(p)
    g.flags.writeable = False  # gradients are only read
    o.set_tensors([(p, g, st)])
    with pytest.raises(optfuse.OptfuseError, match="lr"):
        o.set_hyper(0, "lr", -1.0)
    with pytest.raises(optfuse.OptfuseError, match="unknown hyperparameter"):
        o.set_hyper(0, "lrr", 1.0)


class DLPackOnly:
    """An array seen only through DLPack (no .flags, no buffer protocol): the export decides."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def read_only(a):
    a.flags.writeable = False
    return a


def test_read_only_params_and_states_are_refused():
    spec = "adam(lr=0.1)"
    o = optfuse.Optimizer(spec, "cpu")
    p, g, st = make_set(spec, [(4, 6)])[0]
    before = [x.copy() for x in (p, g, *st)]

    def untouched():
        return all(np.array_equal(x, y) for x, y in zip((p, g, *st), before))

    # A read-only NumPy parameter.
    with pytest.raises(optfuse.OptfuseError, match=r"tensor 0: param is read-only \(its flags.writeable is False\); "
                                                   r"the optimizer writes parameters and states in place"):
        o.set_tensors([(read_only(p.copy()), g, st)])
    # A read-only state (the second one), in a later tensor.
    with pytest.raises(optfuse.OptfuseError, match=r"tensor 1: state .* is read-only.*writes parameters and states in place"):
        o.set_tensors([(p, g, st), (p.copy(), g.copy(), [st[0].copy(), read_only(st[1].copy())])])
    # A DLPack export flagged read-only (DLPack >= 1.0, DLPACK_FLAG_BITMASK_READ_ONLY): NumPy flags
    # the export of a read-only array; the wrapper hides .flags, so only the flag can tell.
    with pytest.raises(optfuse.OptfuseError, match=r"param is read-only \(its DLPack export is flagged read-only"):
        o.set_tensors([(DLPackOnly(read_only(p.copy())), g, st)])
    with pytest.raises(optfuse.OptfuseError, match=r"state .* is read-only \(its DLPack export"):
        o.set_tensors([(p, g, [DLPackOnly(read_only(st[0].copy())), st[1]])])
    # Nothing was kept: stepping the optimizer (which has no tensors) leaves the arrays as they were.
    o.step()
    assert untouched()

    # The same arrays through the same wrapper but writable are accepted and updated in place.
    wp = p.copy()
    o.set_tensors([(DLPackOnly(wp), g, [DLPackOnly(s) for s in st])])
    o.step()
    assert not np.array_equal(wp, p)
    assert all(not np.array_equal(s, b) for s, b in zip(st, before[2:]))


def test_read_only_grad_is_accepted_and_stepped():
    spec = "sgd(lr=0.5)"
    p, g, st = make_set(spec, [(3, 5)])[0]
    p0, g0 = p.copy(), g.copy()
    o = optfuse.Optimizer(spec, "cpu")
    o.set_tensors([(p, read_only(g), st)])  # gradients are only read
    o.step()
    o.step()
    np.testing.assert_allclose(p, p0 - 2 * 0.5 * g0, rtol=1e-6, atol=1e-6)
    assert np.array_equal(g, g0) and not g.flags.writeable and o.step_count(0) == 2
    # A gradient whose DLPack export is flagged read-only is fine too.
    o.set_tensors([(p, DLPackOnly(g), st)])
    o.step()
    np.testing.assert_allclose(p, p0 - 3 * 0.5 * g0, rtol=1e-6, atol=1e-6)


def test_jax_like_arrays_are_refused_by_type():
    """JAX arrays are immutable, but their DLPack export is not flagged read-only: the type's module
    (jax... or jaxlib...) is what tells. A stand-in class with that module over a writable NumPy
    array shows the check without JAX installed."""
    spec = "adam(lr=0.1)"
    o = optfuse.Optimizer(spec, "cpu")
    p, g, st = make_set(spec, [(8,)])[0]
    p0 = p.copy()
    for module in ("jaxlib._jax", "jaxlib.xla_extension", "jax", "jax._src.array"):
        fake = type("ArrayImpl", (DLPackOnly,), {"__module__": module})
        with pytest.raises(optfuse.OptfuseError, match=r"param is a JAX array \(.*ArrayImpl\); JAX arrays are immutable"):
            o.set_tensors([(fake(p), g, st)])
        with pytest.raises(optfuse.OptfuseError, match=r"state .* is a JAX array.*writes parameters and states in place"):
            o.set_tensors([(p, g, [st[0], fake(st[1])])])
        o.set_tensors([(p, fake(g), st)])  # a JAX gradient is only read
    # A module that merely starts with the letters "jax" is not JAX.
    other = type("Array", (DLPackOnly,), {"__module__": "jaxtyping_like"})
    o.set_tensors([(other(p), g, st)])
    o.step()
    assert not np.array_equal(p, p0)


def test_jax_arrays_are_refused():
    jax = pytest.importorskip("jax", reason="jax is not installed: real JAX arrays untested (the stand-in test covers the check)")
    jnp = jax.numpy
    spec = "adam(lr=0.1)"
    o = optfuse.Optimizer(spec, "cpu")
    cpu = jax.devices("cpu")[0]  # host arrays for the cpu backend (JAX puts arrays on a GPU when it has one)
    p = jax.device_put(jnp.ones((4,), jnp.float32), cpu)
    g = jax.device_put(jnp.full((4,), 0.5, jnp.float32), cpu)
    st = [jax.device_put(jnp.zeros((4,), jnp.float32), cpu) for _ in range(2)]
    with pytest.raises(optfuse.OptfuseError, match="param is a JAX array.*immutable"):
        o.set_tensors([(p, g, st)])
    with pytest.raises(optfuse.OptfuseError, match="state .* is a JAX array.*immutable"):
        o.set_tensors([(np.ones(4, np.float32), g, st)])
    # A JAX gradient is only read: accepted, and the JAX arrays are unchanged after the step.
    pn = np.ones(4, np.float32)
    o.set_tensors([(pn, g, [np.zeros(4, np.float32), np.zeros(4, np.float32)])])
    o.step()
    assert np.all(pn < 1) and np.all(np.asarray(g) == 0.5) and np.all(np.asarray(p) == 1)


def test_cuda_backend_unavailable_is_reported():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA backend is exercised by the torch tests instead")
    with pytest.raises(optfuse.BackendUnavailable):
        optfuse.Optimizer("adam()", "cuda")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_max_of_abs_reductions_in_a_python_rule(backend):
    """update = -0.5 * g / max|g| of the tensor, then / max|g| over all tensors (both NaN-propagating)."""
    r = optfuse.Rule("scale_by_max_abs").update(
        lambda b: b.update() * (-0.5) / optfuse.tensor_max_abs(b.update()) / optfuse.global_max_abs(b.update()))
    opt = optfuse.Optimizer(optfuse.chain(r), backend)
    p0, p1 = np.ones(4, np.float32), np.ones(2, np.float32)
    g0, g1 = np.array([1, -4, 2, 0.5], np.float32), np.array([-8, 3], np.float32)
    opt.set_tensors([(p0, g0, [], 0), (p1, g1, [], 0)])
    opt.step()
    np.testing.assert_allclose(p0, 1 - 0.5 * g0 / 4 / 8, rtol=1e-6)
    np.testing.assert_allclose(p1, 1 - 0.5 * g1 / 8 / 8, rtol=1e-6)
    g1[0] = np.nan
    opt.step()
    assert np.isnan(p0).all()
