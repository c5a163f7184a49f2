"""nki.jit / nki.simulate: NumPy and torch inputs, in-place inputs, LNC=2 launches (program_id, sendrecv,
core_barrier), kernel[3] rejection, and failure of one core not hanging the other."""

import ml_dtypes
import nki
import numpy as np
import pytest

import nkisim
from nkisim import lint
from nkisim.errors import NkiValidationError

from ._sim import fresh_core, nisa, nl  # noqa: F401

torch = pytest.importorskip("torch")


def add_one(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_simulate_numpy_in_numpy_out():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = nki.simulate(add_one)(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, x + 1)
    np.testing.assert_array_equal(x, np.arange(12).reshape(3, 4))  # input untouched


def test_jit_decorator_forms():
    k1 = nki.jit(add_one)
    k2 = nki.jit(compile_config=nki.compiler.CompileConfig())(add_one)
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(k1(x), k2(x))
    np.testing.assert_array_equal(nki.simulate(k1)(x), x + 1)
    assert isinstance(k1, nki.Kernel)


def test_simulate_torch_in_torch_out():
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    out = nki.simulate(add_one)(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.equal(out, x + 1)


def test_torch_bf16_roundtrip():
    x = torch.tensor([[1.0, 2.5, -3.0078125, 1e-3]], dtype=torch.bfloat16)
    out = nki.simulate(add_one)(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() + 1).to(torch.bfloat16))


def test_numpy_bf16_roundtrip():
    x = np.array([[1.0, 2.5]], ml_dtypes.bfloat16)
    out = nki.simulate(add_one)(x)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), [[2.0, 3.5]])


def inplace(x, y):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=x, src=t)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=y)
    return out


def test_inputs_written_by_the_kernel_are_updated_in_place_numpy():
    x = np.array([[1.0, 2.0]], np.float32)
    y = np.array([[5.0, 6.0]], np.float32)
    y0 = y.copy()
    out = nki.simulate(inplace)(x, y)
    np.testing.assert_array_equal(x, [[2.0, 4.0]])
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(out, y0)


def test_inputs_written_by_the_kernel_are_updated_in_place_torch():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    y = torch.zeros((1, 2), dtype=torch.bfloat16)
    nki.simulate(inplace)(x, y)
    assert torch.equal(x, torch.tensor([[2.0, 4.0]], dtype=torch.bfloat16))


def test_tuple_and_kwarg_arguments_and_multiple_outputs():
    @nki.jit
    def k(pair, scale=2.0):
        a, b = pair
        outs = []
        for src in (a, b):
            t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=src)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=scale)
            o = nl.ndarray(src.shape, src.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            outs.append(o)
        return outs[0], outs[1]

    a, b = np.ones((2, 2), np.float32), np.full((1, 3), 3.0, np.float32)
    oa, ob = k((a, b), scale=3.0)
    np.testing.assert_array_equal(oa, a * 3)
    np.testing.assert_array_equal(ob, b * 3)


def test_run_result_exposes_traces_and_target():
    res = nkisim.run(nki.jit(add_one), (np.ones((2, 2), np.float32),), {}, target="trn3")
    assert res.target.name == "trn3"
    ops = [i.op for i in res.traces[0]]
    assert ops == ["dma_copy", "tensor_scalar", "dma_copy"]


def test_kernel_state_is_isolated_per_call():
    @nki.jit
    def big(x):
        t = nl.ndarray((128, 40000), nl.float32, buffer=nl.sbuf)  # 160000 B/partition
        nisa.memset(dst=t, value=0.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    x = np.full((1, 1), 7.0, np.float32)
    for _ in range(3):  # each call gets a fresh core: SBUF does not leak (a leak fails the 2nd call on capacity)
        np.testing.assert_array_equal(big(x), x)


# ---- LNC=2 ----------------------------------------------------------------------------------------------------------

def lnc_halves(x):
    n = nl.num_programs()
    pid = nl.program_id(0)
    rows = x.shape[0] // n
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[nl.ds(pid * rows, rows), :])
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(pid * 100))
    nisa.dma_copy(dst=out[nl.ds(pid * rows, rows), :], src=t)
    return out


def test_lnc2_program_id_splits_work():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = nki.jit(lnc_halves)[2](x)
    ref = x.copy()
    ref[2:] += 100
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(nki.jit(lnc_halves)[1](x), x)
    np.testing.assert_array_equal(nki.simulate(nki.jit(lnc_halves)[2])(x), ref)


def test_lnc2_sendrecv_and_core_barrier():
    @nki.jit
    def swap(x):
        pid = nl.program_id(0)
        other = 1 - pid
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        mine = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
        theirs = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[nl.ds(pid, 1), :])
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=other, recv_from_rank=other, pipe_id=0)
        nisa.dma_copy(dst=out[nl.ds(pid, 1), :], src=theirs)
        nisa.core_barrier(data=out, cores=(0, 1))
        check = nl.ndarray((2, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=check, src=out)  # after the barrier both halves are visible
        out2 = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out2, src=check)
        return out, out2

    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    out, out2 = swap[2](x)
    np.testing.assert_array_equal(out, x[::-1])
    np.testing.assert_array_equal(out2, x[::-1])


def test_lnc2_traces_per_core():
    res = nkisim.run(nki.jit(lnc_halves)[2], (np.zeros((4, 4), np.float32),), {})
    assert len(res.contexts) == 2
    assert [c.program_id for c in res.contexts] == [0, 1]
    assert all(ins.core == c.program_id for c in res.contexts for ins in c.trace)


def test_kernel3_rejected():
    with pytest.raises(NkiValidationError, match=r"LNC must be 1 or 2 \(C18\)"):
        nki.jit(lnc_halves)[3]


def test_error_in_one_core_does_not_hang_the_other():
    @nki.jit
    def k(x):
        pid = nl.program_id(0)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        if pid == 1:
            raise RuntimeError("boom on core 1")
        nisa.sendrecv(src=t, dst=r, send_to_rank=1, recv_from_rank=1, pipe_id=0)  # core 0 would wait forever
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        return out

    with pytest.raises(RuntimeError, match=r"boom on core 1"):
        k[2](np.zeros((2, 2), np.float32))


def test_error_in_one_core_does_not_hang_barrier():
    @nki.jit
    def k(x):
        pid = nl.program_id(0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        if pid == 0:
            nl.ndarray((129, 2), nl.float32, buffer=nl.sbuf)  # C1 violation on core 0 only
        nisa.core_barrier(data=out, cores=(0, 1))
        return out

    with pytest.raises(NkiValidationError, match=r"\(C1\)"):
        k[2](np.zeros((2, 2), np.float32))


def test_outputs_are_shared_hbm_under_lnc2_inputs():
    @nki.jit
    def k(x):
        assert x.buffer == nl.shared_hbm
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    np.testing.assert_array_equal(k[2](np.ones((2, 2), np.float32)), np.ones((2, 2)))


@nki.jit
def _nested_double(x_sb):
    out = nl.ndarray(x_sb.shape, dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out, data=x_sb, op0=nl.multiply, operand0=2.0)
    return out


@nki.jit
def _calls_nested_jit(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    doubled = _nested_double(t)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=doubled)
    return out


def test_nested_jit_kernel_runs_inline_under_07(monkeypatch):
    monkeypatch.delenv("NKI_COMPILER_FRONTEND", raising=False)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.array_equal(_calls_nested_jit(x), 2 * x)


def test_nested_jit_kernel_is_rejected_by_the_parser_frontend(monkeypatch):
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
    with pytest.raises(lint.NkiLanguageError, match="nested-jit"):
        _calls_nested_jit(np.zeros((2, 4), np.float32))


def test_base_tensor_is_the_whole_allocation():
    t = nl.ndarray((4, 3, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
    view = t[:, 1, 2:6].view(nl.int16)
    base = view.base_tensor
    assert base.shape == (4, 3, 8) and base.dtype == nl.bfloat16 and base.offset == 0
    assert base.strides == (24, 8, 1) and base.alloc is t.alloc


def test_fresh_memory_is_nan_by_default_and_zero_on_request(monkeypatch):
    monkeypatch.delenv("NKISIM_UNINIT", raising=False)
    assert np.isnan(nkisim.tensor.read(nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf))).all()
    monkeypatch.setenv("NKISIM_UNINIT", "zero")
    assert not nkisim.tensor.read(nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)).any()
    assert not nkisim.tensor.read(nl.ndarray((2, 2), dtype=nl.int32, buffer=nl.sbuf)).any()
