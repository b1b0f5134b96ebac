"""optfuse._torch_reader (python/bindings/torch_reader.cpp): the per-step check's reader of torch
tensors' layouts, built against the installed torch's headers. Every answer it gives must be torch's
(pointer, dtype, device, shape, strides), and every tensor it does not fully understand must be left
to torch's exchange API (None here)."""
import os

import pytest
import torch

import optfuse.torch  # noqa: F401 (installs the readers)
from optfuse import _core
from optfuse.torch import _reader

needs_reader = pytest.mark.skipif(not _reader.HAS_TORCH_READER, reason=_reader.why_not())


def test_reader_is_in_use_where_the_build_promises_it():
    # scripts/test.sh installs with torch importable, so the reader must be there and in use
    if os.environ.get("OPTFUSE_EXPECT_TORCH_READER") != "1":
        pytest.skip("OPTFUSE_EXPECT_TORCH_READER=1 is not set (scripts/test.sh sets it): the build may lack the reader")
    assert _reader.HAS_TORCH_READER, _reader.why_not()


def kinds(device):
    base = torch.arange(24, dtype=torch.float32, device=device).reshape(4, 6)
    out = {"dense": base, "offset view": base[1:, 2:], "transposed": base.t(), "gaps": base[:, ::2],
           "row": base[2], "0-dim": base[1, 3], "empty": torch.empty(0, device=device),
           "expanded": base.unsqueeze(1).expand(4, 3, 6), "channels_last": torch.ones(2, 3, 4, 5, device=device)
           .to(memory_format=torch.channels_last), "parameter": torch.nn.Parameter(torch.ones(5, device=device)),
           "grad of a parameter": None}
    p = torch.nn.Parameter(torch.ones(3, device=device))
    (p * 2).sum().backward()
    out["grad of a parameter"] = p.grad
    for d in (torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.bool, torch.int16):
        out[str(d)] = torch.ones(3, 2, dtype=d, device=device)
    out["real view of complex"] = torch.view_as_real(torch.ones(3, dtype=torch.complex64, device=device))
    return out


def torch_says(t):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size() * 8,
            1 if t.device.type == "cpu" else 2, t.device.index or 0)


def as_read(layout):
    ptr, code, bits, lanes, dev_type, dev_id, shape, strides = layout
    assert lanes == 1
    return (ptr, shape, strides, bits, dev_type, dev_id)


@needs_reader
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available here (torch.cuda.is_available() is False)"))])
def test_reader_reads_what_torch_says(device):
    for name, t in kinds(device).items():
        got = _core._read_layout(t, "reader")
        assert got is not None, name
        want = torch_says(t)
        if t.numel() == 0:  # (an empty tensor's pointer is null in both)
            assert got[0] == 0 and want[0] == 0
        assert as_read(got) == want, name
        exchange = _core._read_layout(t, "exchange")
        if exchange is not None:  # torch's own DLPack answer, dtype code included
            assert got == exchange, name


@needs_reader
def test_reader_leaves_what_it_does_not_understand():
    c = torch.ones(4, dtype=torch.complex64)

    class Sub(torch.Tensor):
        pass

    left = {"conjugate view": c.conj(), "negative view": torch.ones(3)._neg_view(),
            "meta": torch.ones(3, device="meta"), "sparse": torch.ones(3, 3).to_sparse(),
            "subclass": torch.ones(3).as_subclass(Sub), "not a tensor": [1.0],
            "float8": torch.ones(3).to(torch.float8_e4m3fn), "uint16": torch.ones(3, dtype=torch.uint16)}
    for name, t in left.items():
        assert _core._read_layout(t, "reader") is None, name
    # what the check then uses (the exchange API) still answers for the dense ones it can describe
    assert _core._read_layout(torch.ones(3).as_subclass(Sub), "current") is not None


@needs_reader
def test_reader_sees_every_change_the_check_must_see():
    p = torch.nn.Parameter(torch.ones(8))
    before = _core._read_layout(p, "reader")
    p.data = p.data.clone()  # new storage behind the same object
    after = _core._read_layout(p, "reader")
    assert after[0] != before[0] and after[0] == p.data_ptr()
    g = torch.ones(10)
    g.set_(torch.ones(4))  # re-pointed and resized in place
    assert as_read(_core._read_layout(g, "reader")) == torch_says(g)
    s = torch.ones(16)
    s.untyped_storage().resize_(0)  # FSDP-style storage release keeps the object and the shape
    assert _core._read_layout(s, "reader")[0] == 0 == s.data_ptr()
