"""state_dtype=torch.int8: block-quantized 8-bit states (issue 34) through optfuse.torch.

Each q8 state is one 1-D int8 tensor of _core.q8_storage_bytes(numel) bytes (codes, then one float32
scale per block of 256). Checked here: training tracks torch's AdamW with float32 moments, the state
dict / deepcopy round trips continue bit for bit, float states (torch's state dict) are quantized on
load, a non-zero initial value is encoded, the torch-op conversions of _q8 agree with the kernels'
codec, the memory per parameter, and the refusals (a wrong-sized int8 state, ZeRO).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
import optfuse  # noqa: E402
import optfuse.torch as oft  # noqa: E402
from optfuse import _core  # noqa: E402
from optfuse.torch import _q8  # noqa: E402


def mlp(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10)).to(device)


def batches(device, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(99))  # labels to learn
    xs = [torch.randn(64, 32, generator=g) for _ in range(n)]
    return [(x.to(device), (x @ teacher).argmax(1).to(device)) for x in xs]


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_adamw_with_int8_states_tracks_float32_states(device):
    data = batches(device, 150)
    a, b = mlp(device), mlp(device)
    ours = oft.AdamW(a.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=torch.int8)
    ref = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.01)
    la, lb = train(a, ours, data), train(b, ref, data)
    assert lb[-1] < 0.5 * lb[0]  # it learns
    tail_a, tail_b = sum(la[-20:]) / 20, sum(lb[-20:]) / 20
    assert abs(tail_a - tail_b) <= 0.05 * tail_b, (tail_a, tail_b)
    p = next(a.parameters())
    st = ours.state[p]
    for k in ("exp_avg", "exp_avg_sq"):
        assert st[k].dtype == torch.int8 and st[k].shape == (_core.q8_storage_bytes(p.numel()),)
    # The moments themselves: within a few percent of float32 Adam's at the largest values.
    v = _q8.dequantize(st["exp_avg_sq"], p.shape)
    v_ref = ref.state[next(b.parameters())]["exp_avg_sq"]
    assert (v - v_ref).abs().max() <= 0.5 * v_ref.abs().max()
    assert torch.isfinite(v).all() and (v >= 0).all()


def test_state_dict_and_deepcopy_continue_bit_for_bit(device):
    data = batches(device, 12)
    model = mlp(device)
    opt = oft.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.int8)
    train(model, opt, data[:6])
    saved_model, saved = copy.deepcopy(model), copy.deepcopy(opt.state_dict())
    twin_model = copy.deepcopy(model)
    twin = oft.AdamW(twin_model.parameters(), lr=1e-2, state_dtype=torch.int8)
    twin.load_state_dict(saved)
    train(model, opt, data[6:])
    train(twin_model, twin, data[6:])
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], twin.state[q][k])
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), saved_model.parameters()))


def test_torch_float_state_dict_is_quantized_on_load(device):
    data = batches(device, 8)
    a, b = mlp(device), mlp(device)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    train(b, ref, data[:4])
    a.load_state_dict(b.state_dict())
    ours = oft.AdamW(a.parameters(), lr=1e-2, state_dtype=torch.int8)
    ours.load_state_dict(ref.state_dict())
    train(a, ours, data[4:])
    train(b, ref, data[4:])
    p, q = next(a.parameters()), next(b.parameters())
    assert ours.state[p]["exp_avg"].dtype == torch.int8
    assert float(ours.state[p]["step"]) == 8.0
    scale = (q.detach() - mlp(device)[0].weight.detach()).abs().max()
    assert (p - q).abs().max() <= 0.05 * scale  # quantized moments, not zeroed ones


def test_nonzero_initial_state_is_encoded(device):
    data = batches(device, 30)
    a, b = mlp(device), mlp(device)
    ours = oft.Adagrad(a.parameters(), lr=1e-2, initial_accumulator_value=0.1, state_dtype=torch.int8)
    ref = torch.optim.Adagrad(b.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    la, lb = train(a, ours, data), train(b, ref, data)
    assert abs(la[-1] - lb[-1]) <= 0.05 * lb[-1]


def test_conversions_agree_with_the_kernels_codec():
    # SGD with momentum, lr 0: the kernel rewrites the momentum buffer (quantized) from a float one
    # loaded through _q8.quantize; both must be the same codes and scales.
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(1000))
    values = torch.randn(1000) * torch.logspace(-6, 0, 1000)
    values[7] = float("nan")
    buf = _q8.quantize(values)
    back = _q8.dequantize(buf, (1000,))
    assert torch.isnan(back[7]) and torch.isfinite(back[:7]).all()
    ok = torch.isfinite(values)
    rel = ((back - values).abs() / values.abs().clamp_min(1e-30))[ok]
    blockmax = values.abs().nan_to_num(0).reshape(-1, 250).amax(1)  # (blocks of 256: a bound per 250 is looser)
    assert rel[values[ok].abs() > 1e-2 * blockmax.max()].max() < 0.06
    opt = oft.SGD([p], lr=0.0, momentum=1.0, dampening=0.0, state_dtype=torch.int8)
    p.grad = torch.zeros(1000)
    opt.step()  # creates the buffer from the gradient (zero)
    opt.state[p]["momentum_buffer"] = buf.clone()
    opt.step()  # buf <- 1.0 * buf + 0: decoded, then re-encoded by the kernel
    assert torch.equal(opt.state[p]["momentum_buffer"], buf)


def test_bytes_per_parameter_on_the_cpu():
    """What the issue counts, by the bytes of the tensors: bf16 parameters with remainders (int16) and
    int8 moments: 2 + 2 + 2 (gradient) + 2 x (1 + 4/256) = 8.03 bytes per parameter."""
    model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)
    opt = oft.AdamW(model.parameters(), lr=1e-3, master_weights="remainders", state_dtype=torch.int8)
    model(torch.randn(4, 1024, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    p = model.weight
    state_bytes = sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim() > 0)
    per = (p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() + state_bytes) / p.numel()
    assert abs(per - (6 + 2 * (1 + 4 / 256))) < 0.01, per


def test_wrong_sized_int8_state_is_refused():
    model = mlp("cpu")
    opt = oft.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.int8)
    train(model, opt, batches("cpu", 1))
    p = next(model.parameters())
    before = p.detach().clone()
    opt.state[p]["exp_avg"] = torch.zeros(10, dtype=torch.int8)
    with pytest.raises(optfuse.OptfuseError, match="q8 state"):
        train(model, opt, batches("cpu", 1, seed=5))
    assert torch.equal(p.detach(), before)


def test_adafactor_refuses_int8_states_clearly():
    w = torch.nn.Parameter(torch.randn(64, 48))
    opt = oft.Adafactor([w], lr=1e-2, state_dtype=torch.int8)
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(optfuse.OptfuseError, match="not supported yet for rules with per-row"):
        opt.step()
    assert torch.equal(w.detach(), before)
