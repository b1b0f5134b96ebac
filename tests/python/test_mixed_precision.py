"""Mixed precision in the torch front end: master_weights (True / "remainders"), state_dtype,
stochastic_rounding and kahan on every optfuse.torch optimizer, grad_dtype=float32 gradients, state
dicts, and the errors for combinations that cannot work. The kernels' own precision is checked
against the reference evaluator in tests/cpu/test_low_precision.cpp and the CUDA tier."""
import copy

import pytest
import torch

import optfuse.torch as oft
from optfuse.torch import OptfuseError

SHAPES = [(64, 33), (33,), (7, 5, 3), (1,)]


def make_params(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16).to(device=device, dtype=dtype))
            for s in SHAPES]


def set_grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        # bfloat16 values: the same gradient in every dtype
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).to(device=p.device, dtype=dtype or p.dtype)


def master_from_remainders(p, rem):
    """The float32 master rebuilt from a bfloat16 parameter and its int16 remainder (bit for bit)."""
    upper = p.view(torch.int16).to(torch.int32) & 0xFFFF
    upper = upper - (rem < 0).to(torch.int32)
    bits = (upper << 16) | (rem.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def test_master_weights_follow_the_float32_run(device):
    fp32, bf16, copy, rem = (make_params(device, d) for d in (torch.float32, torch.bfloat16, torch.bfloat16,
                                                              torch.bfloat16))
    opts = [oft.AdamW(fp32, lr=1e-5), oft.AdamW(bf16, lr=1e-5), oft.AdamW(copy, lr=1e-5, master_weights=True),
            oft.AdamW(rem, lr=1e-5, master_weights="remainders")]
    start = [p.detach().clone() for p in bf16]
    for step in range(10):
        for ps in (fp32, bf16, copy, rem):
            set_grads(ps, step)
        for o in opts:
            o.step()
    moved_bf16 = sum(int((p != s).sum()) for p, s in zip(bf16, start))
    total = sum(p.numel() for p in bf16)
    assert moved_bf16 < total // 10, "plain bfloat16 rounds updates of 1e-5 away"
    for f, c, r, s in zip(fp32, copy, rem, start):
        master = opts[2].state[c]["master_param"]
        assert master.dtype == torch.float32 and opts[2].state[c]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, f.detach(), rtol=1e-6, atol=0)
        assert torch.equal(c.detach(), master.to(torch.bfloat16)), "the parameter is the master rounded to nearest"
        assert (master != s.float()).float().mean() > 0.9
        rebuilt = master_from_remainders(r.detach(), opts[3].state[r]["param_remainder"])
        assert torch.equal(rebuilt, master), "remainders hold the master copy's value bit for bit"
        assert opts[3].state[r]["param_remainder"].dtype == torch.int16


def test_grad_dtype_float32_gradients(device):
    a = make_params(device, torch.bfloat16)
    b = make_params(device, torch.bfloat16)
    if not hasattr(b[0], "grad_dtype"):
        pytest.skip(f"torch {torch.__version__} has no Tensor.grad_dtype (torch >= 2.10)")
    for p in b:
        p.grad_dtype = torch.float32
    oa = oft.AdamW(a, lr=1e-3, master_weights=True)
    ob = oft.AdamW(b, lr=1e-3, master_weights=True)
    for step in range(3):
        set_grads(a, step)                        # bfloat16 gradients
        set_grads(b, step, dtype=torch.float32)   # the same values as float32 (param.grad_dtype = float32)
        assert b[0].grad.dtype == torch.float32
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert torch.equal(oa.state[x]["master_param"], ob.state[y]["master_param"])


def test_fp16_parameters_under_grad_scaler(device):
    """float16 parameters with a float32 master under torch.amp.GradScaler: the scaled float16
    gradients are unscaled in the kernel, an overflow skips the step (and halves the scale), and
    the master follows a float32 run fed the unscaled gradients."""
    half, ref = make_params(device, torch.float16), make_params(device, torch.float32)
    opt = oft.AdamW(half, lr=1e-3, master_weights=True)
    ref_opt = oft.AdamW(ref, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in half]
        scaler.scale(torch.zeros((), device=device))  # what scaler.scale(loss) does to its state
        scale = scaler.get_scale()
        for p, gr in zip(half, grads):
            p.grad = (gr * scale).to(device=device, dtype=torch.float16)
        if step == 2:
            half[0].grad.view(-1)[0] = float("inf")  # an overflow: the whole step is skipped
        before = [opt.state[p]["master_param"].clone() for p in half] if step else None
        scaler.step(opt)
        scaler.update()
        if step == 2:
            assert all(torch.equal(b, opt.state[p]["master_param"]) for b, p in zip(before, half)), "skipped"
            assert scaler.get_scale() == scale / 2
            continue
        for p, gr in zip(ref, grads):
            p.grad = ((gr * scale).to(torch.float16).float() / scale).to(p.device)  # the same (rounded) values, unscaled
        ref_opt.step()
    for p, r in zip(half, ref):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.float16))
    assert int(opt.state_dict()["state"][0]["step"]) == 4


ALL = [
    (oft.SGD, dict(lr=0.05, momentum=0.9)), (oft.Adam, dict(lr=1e-2)), (oft.AdamW, dict(lr=1e-2)),
    (oft.Adagrad, dict(lr=0.05)), (oft.RMSprop, dict(lr=1e-3)), (oft.Lion, dict(lr=1e-3)), (oft.RAdam, dict(lr=1e-2)),
    (oft.Adamax, dict(lr=1e-2)), (oft.Adadelta, dict(lr=0.5)), (oft.Rprop, dict(lr=1e-2)), (oft.ASGD, dict(lr=1e-2)),
    (oft.Lamb, dict(lr=1e-2)), (oft.Lars, dict(lr=0.05)),
]


@pytest.mark.parametrize("cls,kw", ALL, ids=[c.__name__ for c, _ in ALL])
def test_every_optimizer_takes_the_options(cls, kw):
    """bfloat16 parameters with a float32 master follow the float32 run of the same class; the
    other options step and keep their states in the asked dtypes."""
    fp32, copy = make_params("cpu", torch.float32), make_params("cpu", torch.bfloat16)
    sr, kahan = make_params("cpu", torch.bfloat16), make_params("cpu", torch.bfloat16)
    opts = [cls(fp32, **kw), cls(copy, master_weights=True, **kw),
            cls(sr, stochastic_rounding=True, state_dtype=torch.bfloat16, **kw), cls(kahan, kahan=True, **kw)]
    for step in range(3):
        for ps in (fp32, copy, sr, kahan):
            set_grads(ps, step)
        for o in opts:
            o.step()
    for f, c, s, k in zip(fp32, copy, sr, kahan):
        torch.testing.assert_close(opts[1].state[c]["master_param"], f.detach(), rtol=1e-5, atol=1e-6)
        for name, t in opts[2].state[s].items():
            if torch.is_tensor(t) and t.shape == s.shape:
                assert t.dtype == torch.bfloat16, name
        assert opts[3].state[k]["kahan_comp"].dtype == torch.bfloat16
        # within a few bfloat16 ulps of the float32 run
        for x in (s, k):
            torch.testing.assert_close(x.detach().float(), f.detach(), rtol=0.05, atol=0.05)


def test_stochastic_rounding_is_unbiased_and_reproducible(device):
    def run(seed_grad):
        p = torch.nn.Parameter(torch.ones(200_000, dtype=torch.bfloat16, device=device))
        o = oft.SGD([p], lr=1e-3, stochastic_rounding=True)
        p.grad = torch.full_like(p, 0.5)
        o.step()  # the update, 5e-4, is 1/16 of a bfloat16 ulp at 1 (2^-7 = 7.8e-3)
        return p.detach().float()
    a, b = run(0), run(0)
    assert torch.equal(a, b), "bitwise reproducible"
    mean_change = float((a - 1.0).mean())
    moved = float((a != 1.0).float().mean())
    assert 0.02 < moved < 0.2
    # each element moves by -2^-8 (one ulp below 1) with probability p = 5e-4 / 2^-8
    se = 2 ** -8 * (moved * (1 - moved) / a.numel()) ** 0.5
    assert abs(mean_change - (-5e-4)) < 3 * se + 1e-9, (mean_change, se)
    p = torch.nn.Parameter(torch.ones(200_000, dtype=torch.bfloat16, device=device))
    o = oft.SGD([p], lr=1e-3)
    p.grad = torch.full_like(p, 0.5)
    o.step()
    assert torch.equal(p.detach(), torch.ones_like(p)), "nearest rounding loses the update"


@pytest.mark.parametrize("options", [dict(master_weights=True), dict(master_weights="remainders"),
                                     dict(kahan=True), dict(stochastic_rounding=True, state_dtype=torch.bfloat16)],
                         ids=["master", "remainders", "kahan", "stochastic"])
def test_state_dict_round_trip(device, options):
    a, b = make_params(device, torch.bfloat16), make_params(device, torch.bfloat16)
    oa = oft.AdamW(a, lr=1e-2, **options)
    for step in range(3):
        set_grads(a, step)
        oa.step()
    sd = copy.deepcopy(oa.state_dict())  # (torch's load_state_dict may alias the tensors it is given)
    extra = {"master_weights": "master_param", "kahan": "kahan_comp"}
    for key, name in extra.items():
        if options.get(key) is True:
            assert name in sd["state"][0]
    if options.get("master_weights") == "remainders":
        assert sd["state"][0]["param_remainder"].dtype == torch.int16
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    ob = oft.AdamW(b, lr=1e-2, **options)
    ob.load_state_dict(sd)
    for step in range(3, 6):
        set_grads(a, step)
        set_grads(b, step)
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k, v in oa.state[x].items():
            assert torch.equal(v, ob.state[y][k]), k


def test_options_are_group_keys_and_float32_groups_mix():
    """A bfloat16 group with master weights beside a float32 group without: one optimizer."""
    w = make_params("cpu", torch.bfloat16)
    norms = [torch.nn.Parameter(torch.ones(8))]
    o = oft.AdamW([{"params": w, "master_weights": True}, {"params": norms}], lr=1e-2)
    for step in range(2):
        set_grads(w, step)
        norms[0].grad = torch.full_like(norms[0], 0.1)
        o.step()
    assert "master_param" in o.state[w[0]] and "master_param" not in o.state[norms[0]]
    assert o.param_groups[0]["master_weights"] is True and "master_weights" not in o.param_groups[1]
    # Without the options the state dict is exactly torch's format.
    plain = oft.AdamW(make_params("cpu", torch.float32), lr=1e-3)
    assert set(plain.state_dict()["param_groups"][0]) == set(torch.optim.AdamW(make_params("cpu", torch.float32)).state_dict()["param_groups"][0])


def test_bad_combinations_are_clear_errors():
    # options that cannot apply to the parameters given: refused in the constructor
    fp32 = make_params("cpu", torch.float32)
    with pytest.raises(OptfuseError, match="master_weights is for float16/bfloat16 parameters.*param group with "
                                           "master_weights=False"):
        oft.AdamW(fp32, master_weights=True)
    f16 = make_params("cpu", torch.float16)
    with pytest.raises(OptfuseError, match="rebuilds a float32 master from a bfloat16"):
        oft.AdamW(f16, master_weights="remainders")
    # ... and at the step when a parameter's dtype changed since (p.data = ...)
    bf16 = make_params("cpu", torch.bfloat16)
    o = oft.AdamW(bf16, master_weights=True)
    for p in bf16:
        p.data = p.data.float()
    set_grads(bf16, 0)
    with pytest.raises(OptfuseError, match="master_weights is for float16/bfloat16 parameters"):
        o.step()
    bf = make_params("cpu", torch.bfloat16)
    with pytest.raises(OptfuseError, match="kahan=True compensates .* choose one"):
        oft.AdamW(bf, master_weights=True, kahan=True)
    with pytest.raises(OptfuseError, match="kahan=True and stochastic_rounding=True"):
        oft.AdamW(bf, kahan=True, stochastic_rounding=True)
    with pytest.raises(OptfuseError, match="state_dtype must be None"):
        oft.AdamW(bf, state_dtype=torch.float64)
    with pytest.raises(OptfuseError, match="master_weights must be False, True or 'remainders'"):
        oft.AdamW(bf, master_weights="yes")
