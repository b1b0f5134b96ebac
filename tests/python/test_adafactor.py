"""optfuse.torch.Adafactor against torch.optim.Adafactor (torch's optim_db grid runs in
test_optim_db.py): the training loop with new gradients every step and a scheduler, state dicts
both ways, matrices, batches of matrices (more than 2 dimensions) and vectors in one chain,
bitwise-repeatable steps, the refused inputs, and
explain's schedule (3 passes, 24 bytes per element)."""
import copy

import pytest
import torch

import optfuse
import optfuse.torch as oft
from conftest import HAS_CUDA, make_model, rel_diff, train

CPU = torch.device("cpu")


def model_with_all_shapes(seed=0):
    """Matrices (Linear weights, an embedding), vectors (biases) and a 0-dim scale."""
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(11, 12), "lin": torch.nn.Linear(12, 24),
                             "out": torch.nn.Linear(24, 5, bias=False)})
    m.scale = torch.nn.Parameter(torch.tensor(0.5))
    return m


def loss(m, step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 11, (16,), generator=g)
    y = torch.randn(16, 5, generator=g)
    h = torch.tanh(m["lin"](m["emb"](idx))) * m.scale
    return torch.nn.functional.mse_loss(m["out"](h), y)


def run(m, opt, steps, start=0, sched=None):
    for s in range(start, start + steps):
        opt.zero_grad()  # set_to_none: new gradient tensors every step
        loss(m, s).backward()
        opt.step()
        if sched is not None:
            sched.step()


def max_rel(a, b):
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item()
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kw", [{}, {"lr": 0.05, "weight_decay": 0.1}, {"maximize": True, "eps": (1e-6, 1e-2), "d": 2.0},
                                {"beta2_decay": -0.5, "lr": torch.tensor(0.02)}], ids=str)
def test_training_loop_matches_torch(kw):
    ours_m, ref_m = model_with_all_shapes(), model_with_all_shapes()
    ours = oft.Adafactor(ours_m.parameters(), **copy.deepcopy(kw))
    ref = torch.optim.Adafactor(ref_m.parameters(), foreach=False, **copy.deepcopy(kw))
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=7, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=7, gamma=0.5)
    run(ours_m, ours, 30, sched=s1)
    run(ref_m, ref, 30, sched=s2)
    assert max_rel(ours_m, ref_m) <= 1e-6
    assert max_rel(ref_m, model_with_all_shapes()) > 1e-3  # it moved
    a, b = ours.state_dict()["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in b:
        assert a[i].keys() == b[i].keys(), (i, sorted(a[i]), sorted(b[i]))  # row_var/col_var or variance
        for k in b[i]:
            assert a[i][k].shape == b[i][k].shape, (i, k)
            scale = b[i][k].abs().max().clamp_min(1e-30)
            assert ((a[i][k] - b[i][k]).abs().max() / scale).item() <= 1e-5, (i, k)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_loads_both_ways(direction):
    first_m, second_m, ref_m = model_with_all_shapes(), model_with_all_shapes(), model_with_all_shapes()
    make_first = (lambda p: torch.optim.Adafactor(p, lr=0.03)) if direction == "torch_to_ours" else (
        lambda p: oft.Adafactor(p, lr=0.03))
    make_second = (lambda p: oft.Adafactor(p, lr=0.03)) if direction == "torch_to_ours" else (
        lambda p: torch.optim.Adafactor(p, lr=0.03))
    first, ref = make_first(first_m.parameters()), torch.optim.Adafactor(ref_m.parameters(), lr=0.03)
    run(first_m, first, 6)
    run(ref_m, ref, 6)
    second_m.load_state_dict(first_m.state_dict())
    second = make_second(second_m.parameters())
    second.load_state_dict(first.state_dict())
    run(second_m, second, 6, start=6)
    run(ref_m, ref, 6, start=6)
    assert max_rel(second_m, ref_m) <= 1e-6


def test_fuse_takes_over_torch_mid_training():
    ours_m, ref_m = model_with_all_shapes(), model_with_all_shapes()
    opt, ref = torch.optim.Adafactor(ours_m.parameters(), lr=0.03), torch.optim.Adafactor(ref_m.parameters(), lr=0.03)
    run(ours_m, opt, 4)
    run(ref_m, ref, 4)
    fused = oft.fuse(opt)
    assert isinstance(fused, oft.Adafactor)
    run(ours_m, fused, 6, start=4)
    run(ref_m, ref, 6, start=4)
    assert max_rel(ours_m, ref_m) <= 1e-6


def test_two_runs_are_bitwise_equal():
    results = []
    for _ in range(2):
        m = model_with_all_shapes()
        opt = oft.Adafactor(m.parameters(), lr=0.05, weight_decay=0.1)
        run(m, opt, 5)
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def batched_params(device, seed=0):
    """Parameters of 3 and 4 dimensions (torch factors each matrix of the last two dimensions on its
    own): a conv weight of 3 x 3 matrices, a batch of matrices longer than a chunk, one-row matrices,
    next to a matrix and a vector."""
    torch.manual_seed(seed)
    shapes = [(4, 3, 3, 3), (2, 300, 301), (5, 1, 7), (6, 10), (6,)]
    return [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]


def step_both(ours_p, ref_p, ours, ref, steps, device, start=0):
    for s in range(start, start + steps):
        g = torch.Generator(device=device).manual_seed(s)
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, device=device, generator=g)  # a new gradient tensor every step
            b.grad = a.grad.clone()
        ours.step()
        ref.step()


def assert_params_and_states_match(ours_p, ref_p, ours, ref, tol):
    for a, b in zip(ours_p, ref_p):
        assert ((a - b).abs().max() / b.abs().max()).item() <= tol, a.shape
    sa, sb = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in sb:
        assert sa[i].keys() == sb[i].keys()
        for k in sb[i]:
            assert sa[i][k].shape == sb[i][k].shape, (i, k)
            if k != "step":
                scale = sb[i][k].abs().max().clamp_min(1e-30)
                assert ((sa[i][k] - sb[i][k]).abs().max() / scale).item() <= 1e-5, (i, k)


@pytest.mark.parametrize("kw", [{}, {"lr": 0.05, "weight_decay": 0.1, "maximize": True}], ids=str)
def test_parameters_of_more_than_two_dimensions_are_factored_matrix_by_matrix_as_in_torch(kw):
    ours_p = batched_params(CPU)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours, ref = oft.Adafactor(ours_p, **kw), torch.optim.Adafactor(ref_p, foreach=False, **kw)
    step_both(ours_p, ref_p, ours, ref, 12, CPU)
    assert_params_and_states_match(ours_p, ref_p, ours, ref, 1e-6)
    assert ours.state_dict()["state"][1]["col_var"].shape == (2, 1, 301)
    assert max(((p - q).abs().max()).item() for p, q in zip(ref_p, batched_params(CPU))) > 1e-3  # it moved


def test_state_dicts_of_batched_matrices_load_both_ways():
    for make_first, make_second in [(torch.optim.Adafactor, oft.Adafactor), (oft.Adafactor, torch.optim.Adafactor)]:
        first_p, ref_p = batched_params(CPU), batched_params(CPU)
        first, ref = make_first(first_p, lr=0.03), torch.optim.Adafactor(ref_p, lr=0.03)
        step_both(first_p, ref_p, first, ref, 4, CPU)
        second_p = [torch.nn.Parameter(p.detach().clone()) for p in first_p]
        second = make_second(second_p, lr=0.03)
        second.load_state_dict(first.state_dict())
        step_both(second_p, ref_p, second, ref, 4, CPU, start=4)
        assert_params_and_states_match(second_p, ref_p, second, ref, 1e-6)


def test_empty_parameters_of_any_shape_step_without_error():
    """torch's Adafactor divides by zero on an empty parameter; ours steps the others and keeps torch's
    state shapes for the empty ones."""
    empty = [torch.nn.Parameter(torch.zeros(s)) for s in [(2, 0, 4), (0, 3, 4), (3, 4, 0), (0, 4)]]
    w = torch.nn.Parameter(torch.ones(3, 4))
    opt = oft.Adafactor(empty + [w], lr=0.1)
    for p in empty + [w]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert (w < 1).all()
    assert opt.state[empty[0]]["col_var"].shape == (2, 1, 4)
    assert opt.state[empty[2]]["row_var"].shape == (3, 4, 1)


def test_complex_parameters_fail_at_step_as_in_torch():
    p = torch.randn(3, 4, dtype=torch.complex64, requires_grad=True)
    opt = oft.Adafactor([p])
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match="Adafactor does not support complex parameters"):
        opt.step()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU: CUDA Adafactor against torch's")
@pytest.mark.parametrize("kw", [{}, {"lr": 0.05, "weight_decay": 0.1, "maximize": True}], ids=str)
def test_cuda_matches_torch(kw):
    """The CUDA driver's row and column loops (codegen/cuda_matrix_source.cpp) against torch on the GPU:
    a big matrix of many chunks, a wide one, a narrow one, vectors, and batches of matrices (3-D and a
    conv weight's 4-D: several chunks and row items per matrix, 3 x 3 matrices)."""
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [(700, 2048), (3, 70000), (4096, 5), (2048,), (1,), (3, 300, 301), (16, 8, 3, 3), (4, 3000, 8)]
    ours_p = [torch.nn.Parameter(torch.randn(s, device=cuda)) for s in shapes]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = oft.Adafactor(ours_p, **kw)
    ref = torch.optim.Adafactor(ref_p, foreach=False, **kw)
    for s in range(10):
        g = torch.Generator(device=cuda).manual_seed(s)
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, device=cuda, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 2e-6, a.shape
    sa, sb = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in sb:
        for k in sb[i]:
            if k != "step":
                scale = sb[i][k].abs().max().clamp_min(1e-30)
                assert ((sa[i][k] - sb[i][k]).abs().max() / scale).item() <= 1e-5, (i, k)


def test_matches_the_mlp_of_the_other_drop_in_tests():
    ours_m, ref_m = make_model(CPU), make_model(CPU)
    train(ours_m, oft.Adafactor(ours_m.parameters(), lr=0.02), 20, CPU)
    train(ref_m, torch.optim.Adafactor(ref_m.parameters(), lr=0.02, foreach=False), 20, CPU)
    assert rel_diff(ours_m, ref_m) <= 1e-6


def test_explain_shows_the_row_and_column_schedule():
    text = optfuse.explain("adafactor(weight_decay=0.01)")
    assert "3 pass(es) over memory" in text
    assert "total bytes per element: 24" in text
    assert "sum_squares/row sum_squares/column" in text
    assert "values 0:" in text and "commit 2:" in text
    assert "of_phase0_v0_mchunk" in text  # the CPU backend's generated matrix loop
