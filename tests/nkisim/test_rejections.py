"""Documented rejections (issue 9 §4): for every rule AWS documents on an op page and nkisim checks, a negative test
(the message names the op, the operand, the limit and the constraint id of nkisim/CONSTRAINTS.md) and a positive
twin (the nearest legal call runs and computes the right values)."""

import nki
import numpy as np
import pytest

from nkisim.errors import NkiValidationError

from ._sim import fresh_core, hbm, nisa, nl, on_target, rd, sb, tile  # noqa: F401

E = NkiValidationError


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def idx_tile(rows):
    return sb(np.asarray(rows, np.uint32).reshape(-1, 1))



# ---- C21 / C22 / C23: dma_transpose DGE modes, indirect constraints, oob_mode=skip -----------------------------------

def test_c21_direct_dma_transpose_rejects_swdge():
    with pytest.raises(E, match=r"dma_transpose: dge_mode=swdge is not valid for a direct transpose .*allowed: "
                                r"unknown, hwdge \(or none\) \(C21\)"):
        nisa.dma_transpose(dst=tile((8, 16), nl.bfloat16), src=hbm(rand((16, 8)), nl.bfloat16),
                           dge_mode=nisa.dge_mode.swdge)


@pytest.mark.parametrize("mode", ["unknown", "hwdge", "none"])  # none: as AWS's nki-library's mlp_tkg passes it
def test_c21_direct_dma_transpose_unknown_and_hwdge_run(mode):
    x = rand((16, 8))
    dst = tile((8, 16), nl.bfloat16)
    nisa.dma_transpose(dst=dst, src=hbm(x, nl.bfloat16), dge_mode=getattr(nisa.dge_mode, mode))
    np.testing.assert_allclose(rd(dst), x.T, rtol=1e-2, atol=1e-2)


def test_c21_hwdge_shape_rules_cite_the_id():
    with pytest.raises(E, match=r"dma_transpose: dge_mode=hwdge: 2-D src.shape\[0\] must be 16, got 8 \(C21\)"):
        nisa.dma_transpose(dst=tile((4, 8), nl.bfloat16), src=hbm(rand((8, 4)), nl.bfloat16),
                           dge_mode=nisa.dge_mode.hwdge)
    with pytest.raises(E, match=r"hwdge needs a 2-byte src dtype, got float32 \(C21\)"):
        nisa.dma_transpose(dst=tile((4, 16)), src=hbm(rand((16, 4))), dge_mode=nisa.dge_mode.hwdge)


def _gather_src(data, rows, dtype=nl.bfloat16, idx_dtype=np.uint32):
    p, f = len(rows), data.shape[1]
    idx = sb(np.asarray(rows, idx_dtype).reshape(-1, 1))
    return hbm(data, dtype).ap(pattern=[[f, p], [1, f]], vector_offset=idx, indirect_dim=0)


def test_c22_indirect_dma_transpose_gathers_rows_then_transposes():
    data = rand((40, 8))
    rows = list(np.random.default_rng(1).permutation(40)[:16])
    dst = tile((8, 16), nl.bfloat16)
    nisa.dma_transpose(dst=dst, src=_gather_src(data, rows), dge_mode=nisa.dge_mode.swdge)
    np.testing.assert_allclose(rd(dst), data[rows].T, rtol=1e-2, atol=1e-2)


def test_c22_indirect_dma_transpose_rejects_hwdge():
    with pytest.raises(E, match=r"dge_mode=hwdge is not valid for an indirect transpose.*unknown, swdge \(C22\)"):
        nisa.dma_transpose(dst=tile((8, 16), nl.bfloat16), src=_gather_src(rand((40, 8)), list(range(16))),
                           dge_mode=nisa.dge_mode.hwdge)


@pytest.mark.parametrize("case,match", [
    ("fp32", r"src dtype must be 2 bytes, got float32 \(C22\)"),
    ("int32_idx", r"the indices must be uint32, got int32 \(C22\)"),
])
def test_c22_indirect_dma_transpose_constraints(case, match):
    data, rows, dtype, idt = rand((40, 8)), list(range(16)), nl.bfloat16, np.uint32
    if case == "fp32":
        dtype = nl.float32
    elif case == "int32_idx":
        idt = np.int32
    src = _gather_src(data, rows, dtype, idt)
    with pytest.raises(E, match=match):
        nisa.dma_transpose(dst=tile((data.shape[1], len(rows)), dtype), src=src)


@pytest.mark.parametrize("n_rows,match", [
    (8, r"indirect transpose: src.shape\[0\] must be divisible by 16, got 8 \(C22\)"),
    (24, r"indirect transpose: src.shape\[0\] must be divisible by 16, got 24 \(C22\)"),
])
def test_c22_indirect_dma_transpose_rejects_row_counts(n_rows, match):
    data = rand((200, 8))
    with pytest.raises(E, match=match):
        nisa.dma_transpose(dst=tile((8, n_rows), nl.bfloat16), src=_gather_src(data, list(range(n_rows))))


def test_c22_indirect_dma_transpose_rejects_fewer_than_16_index_rows():
    """16 src rows but an 8-row index tile: the index rule names the indices (an SBUF index tile cannot have more
    than 128 rows: that half of the rule is C1's partition limit)."""
    idx = sb(np.arange(8, dtype=np.uint32).reshape(-1, 1))
    src = hbm(rand((40, 8)), nl.bfloat16).ap(pattern=[[8, 16], [1, 8]], vector_offset=idx, indirect_dim=0)
    with pytest.raises(E, match=r"indirect transpose: the indices need 16..128 rows, a multiple of 16, got 8 "
                                r"\(C22\)"):
        nisa.dma_transpose(dst=tile((8, 16), nl.bfloat16), src=src)


@pytest.mark.parametrize("n_rows", [16, 48, 128])
def test_c22_indirect_dma_transpose_accepts_16_to_128_rows(n_rows):
    data = rand((200, 8))
    rows = list(np.random.default_rng(n_rows).permutation(200)[:n_rows])
    dst = tile((8, n_rows), nl.bfloat16)
    nisa.dma_transpose(dst=dst, src=_gather_src(data, rows))
    np.testing.assert_allclose(rd(dst), data[rows].T, rtol=1e-2, atol=1e-2)


def test_c22_indirect_3d_transpose_row_rule():
    """The paged-attention form: 3-D src [rows, m, d] gathered by block id; 8 rows refused, 16 accepted."""
    data = rand((32, 4 * 8))

    def src(rows):
        return hbm(data, nl.bfloat16).ap(pattern=[[32, len(rows)], [8, 4], [1, 8]], vector_offset=idx_tile(rows),
                                         indirect_dim=0)
    with pytest.raises(E, match=r"src.shape\[0\] must be divisible by 16, got 8 \(C22\)"):
        nisa.dma_transpose(dst=tile((8, 4, 8), nl.bfloat16), src=src(list(range(8))))
    rows = list(range(31, 15, -1))
    dst = tile((8, 4, 16), nl.bfloat16)
    nisa.dma_transpose(dst=dst, src=src(rows))
    np.testing.assert_allclose(rd(dst), data[rows].reshape(16, 4, 8).transpose(2, 1, 0), rtol=1e-2, atol=1e-2)


def test_c22_indirect_dma_transpose_needs_trn2(on_target):  # noqa: F811
    on_target("trn1")
    with pytest.raises(E, match=r"indirect transpose requires NeuronCore-v3 \(trn2\) or newer \(C22\)"):
        nisa.dma_transpose(dst=tile((8, 16), nl.bfloat16), src=_gather_src(rand((40, 8)), list(range(16))))


def test_c23_oob_skip_rejected_on_a_direct_transpose():
    with pytest.raises(E, match=r"dma_transpose: oob_mode=skip is only valid when src uses indirect indexing.*\(C23\)"):
        nisa.dma_transpose(dst=tile((8, 16), nl.bfloat16), src=hbm(rand((16, 8)), nl.bfloat16),
                           oob_mode=nisa.oob_mode.skip)


def test_c23_oob_skip_on_an_indirect_transpose_skips_out_of_bounds_rows():
    data = rand((40, 8))
    rows = list(range(16))
    rows[3] = 1000  # out of bounds: skipped, its dst column keeps its old value
    dst = tile((8, 16), nl.bfloat16)
    nisa.memset(dst=dst, value=7.0)
    nisa.dma_transpose(dst=dst, src=_gather_src(data, rows), oob_mode=nisa.oob_mode.skip)
    got = rd(dst)
    ok = [r for r in range(16) if r != 3]
    np.testing.assert_allclose(got[:, ok], data[ok].T, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(got[:, 3], 7.0)
    with pytest.raises(E, match=r"out of bounds"):  # oob_mode=error (default) refuses the same index
        nisa.dma_transpose(dst=dst, src=_gather_src(data, rows))


# ---- C24: .ap() vector_offset and scalar_offset are mutually exclusive -----------------------------------------------

def test_c24_ap_rejects_both_offsets():
    t = hbm(rand((8, 4)))
    with pytest.raises(E, match=r"\.ap\(\): vector_offset and scalar_offset are mutually exclusive.*\(C24\)"):
        t.ap([[4, 2], [1, 4]], vector_offset=idx_tile([1, 2]), scalar_offset=nisa.register_alloc(1), indirect_dim=0)


def test_c24_ap_with_either_offset_alone():
    x = rand((8, 4))
    t = hbm(x)
    a, b = tile((2, 4)), tile((2, 4))
    nisa.dma_copy(dst=a, src=t.ap([[4, 2], [1, 4]], vector_offset=idx_tile([5, 1]), indirect_dim=0))
    nisa.dma_copy(dst=b, src=t.ap([[4, 2], [1, 4]], scalar_offset=nisa.register_alloc(3), indirect_dim=0))
    np.testing.assert_array_equal(rd(a), x[[5, 1]])
    np.testing.assert_array_equal(rd(b), x[3:5])


# ---- C25: dma_compute ------------------------------------------------------------------------------------------------

def _scatter_target(rows):
    out = nl.ndarray((6, 2), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=hbm(np.ones((6, 2), np.float32)))
    return out, out.ap([[2, len(rows)], [1, 2]], vector_offset=idx_tile(rows), indirect_dim=0)


def test_c25_dma_compute_read_modify_write_requires_unique_indices():
    _, ap = _scatter_target([4, 0, 2])
    src = sb(np.ones((3, 2), np.float32))
    with pytest.raises(E, match=r"dma_compute: unique_indices=False: read-modify-write with vector_offset requires "
                                r"unique_indices=True.*\(C25\)"):
        nisa.dma_compute(dst=ap, srcs=[ap, src], reduce_op=nl.add, unique_indices=False)


def test_c25_unique_indices_false_is_fine_without_vector_offset():
    a, b = rand((4, 8), 1), rand((4, 8), 2)
    dst = tile((4, 8))
    nisa.dma_compute(dst=dst, srcs=[hbm(a), sb(b)], reduce_op=nl.add, unique_indices=False)
    np.testing.assert_allclose(rd(dst), a + b, rtol=1e-6)


def test_c25_read_modify_write_needs_exactly_two_srcs():
    out, ap = _scatter_target([4, 0, 2])
    src = sb(np.full((3, 2), 2.0, np.float32))
    with pytest.raises(E, match=r"needs exactly 2 srcs .* got 3 \(C25\)"):
        nisa.dma_compute(dst=ap, srcs=[ap, src, src], reduce_op=nl.add)
    nisa.dma_compute(dst=ap, srcs=[ap, src], reduce_op=nl.add)
    ref = np.ones((6, 2), np.float32)
    ref[[4, 0, 2]] += 2.0
    np.testing.assert_array_equal(rd(out), ref)


def test_c25_at_most_16_srcs():
    srcs = [sb(np.full((2, 2), float(i), np.float32)) for i in range(17)]
    dst = tile((2, 2))
    with pytest.raises(E, match=r"dma_compute: srcs has 17 tensors; at most 16 \(C25\)"):
        nisa.dma_compute(dst=dst, srcs=srcs, reduce_op=nl.add)
    nisa.dma_compute(dst=dst, srcs=srcs[:16], reduce_op=nl.add)
    np.testing.assert_array_equal(rd(dst), np.full((2, 2), sum(range(16)), np.float32))


# ---- C8: GpSimd cannot access PSUM (nl.rsqrt since 0.5, nl.power) ----------------------------------------------------

def test_c8_nl_rsqrt_rejects_psum_input():
    p = sb(np.full((4, 8), 4.0, np.float32), buffer=nl.psum)
    with pytest.raises(E, match=r"nl\.rsqrt: x .* is in PSUM; nl\.rsqrt runs on GpSimd.*"
                                r"nisa\.activation\(op=nl\.rsqrt\).*\(C8\)"):
        nl.rsqrt(p)
    out = tile((4, 8))  # the documented alternative for a PSUM input
    nisa.activation(dst=out, op=nl.rsqrt, data=p)
    np.testing.assert_allclose(rd(out), 0.5, rtol=1e-6)


def test_c8_nl_rsqrt_runs_on_gpsimd_for_sbuf_input():
    x = np.abs(rand((4, 8))) + 0.5
    y = nl.rsqrt(sb(x))
    np.testing.assert_allclose(rd(y), 1.0 / np.sqrt(x), rtol=1e-6)


def test_c8_tensor_tensor_power_rejects_psum():
    a, b = sb(np.full((4, 8), 3.0, np.float32)), sb(np.full((4, 8), 2.0, np.float32))
    with pytest.raises(E, match=r"tensor_tensor: op=nl\.power runs on GpSimd, which cannot access PSUM; dst is in "
                                r"PSUM \(C8\)"):
        nisa.tensor_tensor(dst=tile((4, 8), buffer=nl.psum), data1=a, data2=b, op=nl.power)
    with pytest.raises(E, match=r"op=nl\.power runs on GpSimd only; engine=vector is not allowed \(C29\)"):
        nisa.tensor_tensor(dst=tile((4, 8)), data1=a, data2=b, op=nl.power, engine=nisa.engine.vector)
    d = tile((4, 8))
    nisa.tensor_tensor(dst=d, data1=a, data2=b, op=nl.power)
    np.testing.assert_allclose(rd(d), 9.0)


# ---- C26 / C28: exponential (trn3) dtypes, reduce_cmd and reduce_init ------------------------------------------------

def test_c26_exponential_operand_dtypes(on_target):  # noqa: F811
    on_target("trn3")
    x = sb(rand((4, 8)))
    with pytest.raises(E, match=r"exponential: dst dtype uint32 is not supported; allowed: .* \(C26\)"):
        nisa.exponential(dst=tile((4, 8), nl.uint32), src=x)
    with pytest.raises(E, match=r"exponential: reduce_res dtype int32 is not supported.*\(C26\)"):
        nisa.exponential(dst=tile((4, 8)), src=x, reduce_res=tile((4, 1), nl.int32),
                         reduce_cmd=nisa.reduce_cmd.reset_reduce)
    d = tile((4, 8), nl.bfloat16)
    nisa.exponential(dst=d, src=x)
    np.testing.assert_allclose(rd(d), np.exp(rd(x)), rtol=1e-2)


def test_c28_exponential_reduce_cmd_and_reduce_init(on_target):  # noqa: F811
    on_target("trn3")
    xv = rand((4, 8)) * 0.1
    x = sb(xv)
    with pytest.raises(E, match=r"exponential: reduce_cmd=reset is not supported; allowed: idle, reset_reduce, "
                                r"reduce, load_reduce \(C28\)"):
        nisa.exponential(dst=tile((4, 8)), src=x, reduce_cmd=nisa.reduce_cmd.reset)
    with pytest.raises(E, match=r"reduce_init=1\.5 must be unset or 0\.0 unless reduce_cmd=load_reduce.*\(C28\)"):
        nisa.exponential(dst=tile((4, 8)), src=x, reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_init=1.5)
    res = tile((4, 1))
    nisa.exponential(dst=tile((4, 8)), src=x, reduce_res=res, reduce_cmd=nisa.reduce_cmd.load_reduce,
                     reduce_init=1.5)
    np.testing.assert_allclose(rd(res)[:, 0], 1.5 + np.exp(xv).sum(axis=1), rtol=1e-5)


# ---- C26: tensor_scalar_cumulative dtypes ----------------------------------------------------------------------------

def test_c26_tensor_scalar_cumulative_dtypes():
    x = sb(rand((2, 8)))
    with pytest.raises(E, match=r"tensor_scalar_cumulative: dst dtype tfloat32 is not supported; allowed: .*\(C26\)"):
        nisa.tensor_scalar_cumulative(dst=tile((2, 8), nl.tfloat32), src=x, op0=nl.multiply, op1=nl.add, imm0=1.0)
    d = tile((2, 8), nl.bfloat16)
    nisa.tensor_scalar_cumulative(dst=d, src=x, op0=nl.multiply, op1=nl.add, imm0=1.0)
    np.testing.assert_allclose(rd(d), np.cumsum(rd(x), axis=1), rtol=2e-2, atol=2e-2)


# ---- C27: sendrecv operands ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,match", [
    ("hbm", r"sendrecv: src .* is in shared_hbm; src and dst must both be in SBUF \(C27\)"),
    ("dtype", r"sendrecv: src dtype float32 and dst dtype bfloat16 must be the same \(C27\)"),
    ("layout", r"sendrecv: src \(4, 8\) and dst \(8, 4\) must have the same partitions.*\(C27\)"),
    ("gpsimd", r"dma_engine=gpsimd_dma moves at most 1024 B per partition for 32-bit types; src has 1028 B \(C27\)"),
])
def test_c27_sendrecv_operand_rules(case, match):
    src, dst, eng = tile((4, 8)), tile((4, 8)), nisa.dma_engine.dma
    if case == "hbm":
        src = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    elif case == "dtype":
        dst = tile((4, 8), nl.bfloat16)
    elif case == "layout":
        dst = tile((8, 4))
    else:
        src, dst, eng = tile((4, 257)), tile((4, 257)), nisa.dma_engine.gpsimd_dma
    with pytest.raises(E, match=match):
        nisa.sendrecv(src=src, dst=dst, send_to_rank=1, recv_from_rank=1, pipe_id=0, dma_engine=eng)


def test_c27_sendrecv_gpsimd_dma_at_the_limit_swaps_between_cores():
    @nki.jit
    def swap(x):
        pid = nl.program_id(0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        mine = nl.ndarray((4, x.shape[1]), x.dtype, buffer=nl.sbuf)
        theirs = nl.ndarray((4, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[nl.ds(4 * pid, 4), :])
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0,
                      dma_engine=nisa.dma_engine.gpsimd_dma)
        nisa.dma_copy(dst=out[nl.ds(4 * pid, 4), :], src=theirs)
        return out

    x = rand((8, 256))  # 256 fp32 = 1024 B per partition: the documented maximum
    np.testing.assert_array_equal(swap[2](x), np.concatenate([x[4:], x[:4]]))


# ---- C18: core_barrier data in shared HBM ----------------------------------------------------------------------------

def test_c18_core_barrier_data_must_be_shared_hbm():
    for bad in (tile((1, 1)), nl.ndarray((1, 1), nl.float32, buffer=nl.private_hbm)):
        with pytest.raises(E, match=r"core_barrier: data .* is in (sbuf|private_hbm); it must be HBM shared by both "
                                    r"cores.*\(C18\)"):
            nisa.core_barrier(data=bad, cores=(0, 1))
    nisa.core_barrier(data=nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm), cores=(0, 1))
    nisa.core_barrier(data=nl.ndarray((1, 1), nl.float32, buffer=nl.hbm), cores=[0, 1])  # as router_topk does


# ---- C13: nc_stream_shuffle start partitions follow the number of active partitions ----------------------------------

def test_c13_stream_shuffle_start_partitions_follow_active_partitions():
    big = sb(rand((128, 4)))
    dst = tile((64, 4))
    mask = list(range(32))
    # 32-partition src at partition 32 is legal alone, but 64 active partitions need starts 0 or 64
    with pytest.raises(E, match=r"nc_stream_shuffle: src starts at partition 32; with 64 active partitions .* must be "
                                r"one of \(0, 64\) \(C13\)"):
        nisa.nc_stream_shuffle(dst=dst, src=big[32:64, :], shuffle_mask=mask)
    nisa.nc_stream_shuffle(dst=dst, src=big[64:128, :], shuffle_mask=mask)
    np.testing.assert_array_equal(rd(dst), rd(big)[64:128])


# ---- C29: activation(op=nl.reciprocal) bias on NeuronCore-v2 ---------------------------------------------------------

def test_c29_reciprocal_activation_bias_not_on_trn1(on_target):  # noqa: F811
    on_target("trn1")
    x = sb(np.full((4, 8), 2.0, np.float32))
    bias = sb(np.ones((4, 1), np.float32))
    with pytest.raises(E, match=r"activation: op=nl\.reciprocal does not support a bias on NeuronCore-v2.*\(C29\)"):
        nisa.activation(dst=tile((4, 8)), op=nl.reciprocal, data=x, bias=bias)
    on_target("trn2")
    x = sb(np.full((4, 8), 2.0, np.float32))
    bias = sb(np.ones((4, 1), np.float32))
    d = tile((4, 8))
    nisa.activation(dst=d, op=nl.reciprocal, data=x, bias=bias)
    np.testing.assert_allclose(rd(d), 1.0 / 3.0, rtol=1e-6)


# ---- float32-only operand checks the docs do not state (removed) -----------------------------------------------------

def test_scalar_tensor_tensor_operand0_may_be_any_dtype():
    # AWS nki.isa.scalar_tensor_tensor: "All input tiles can be any supported NKI data type"
    x, y = rand((4, 8), 1), rand((4, 8), 2)
    s = np.array([[0.5], [1.0], [2.0], [4.0]], np.float32)
    d = tile((4, 8))
    nisa.scalar_tensor_tensor(dst=d, data=sb(x), op0=nl.multiply, operand0=sb(s, nl.bfloat16), op1=nl.add,
                              operand1=sb(y))
    np.testing.assert_allclose(rd(d), x * s + y, rtol=1e-6)
    with pytest.raises(E, match=r"scalar_tensor_tensor: operand0 must be a scalar or a \(4, 1\) tensor.*\(C11\)"):
        nisa.scalar_tensor_tensor(dst=d, data=sb(x), op0=nl.multiply, operand0=sb(rand((4, 2))), op1=nl.add,
                                  operand1=sb(y))


def test_tensor_scalar_operand_still_float32_as_documented():
    # AWS nki.isa.tensor_scalar: "the operand0 and operand1 (if used) must be float32"
    x = sb(rand((4, 8)))
    with pytest.raises(E, match=r"tensor_scalar: operand for op0 tensor must be float32, got bfloat16 \(C11\)"):
        nisa.tensor_scalar(dst=tile((4, 8)), data=x, op0=nl.add, operand0=sb(np.ones((4, 1)), nl.bfloat16))


# ---- C29: operand / operator rules of tensor_scalar and tensor_reduce ------------------------------------------------

def test_c29_unary_tensor_scalar_operand_must_be_none_or_zero():
    x = np.abs(rand((4, 8))) + 0.5
    with pytest.raises(E, match=r"tensor_scalar: op0=nl\.rsqrt is a unary operator; its operand must be None or 0, "
                                r"got 2\.0 \(C29\)"):
        nisa.tensor_scalar(dst=tile((4, 8)), data=sb(x), op0=nl.rsqrt, operand0=2.0)
    d = tile((4, 8))
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.rsqrt, operand0=0.0, engine=nisa.engine.gpsimd)
    np.testing.assert_allclose(rd(d), 1.0 / np.sqrt(x), rtol=1e-6)


def test_c29_tensor_scalar_operand1_without_op1():
    x = rand((4, 8))
    with pytest.raises(E, match=r"operand1=3\.0 is set but op1 is None.*\(C29\)"):
        nisa.tensor_scalar(dst=tile((4, 8)), data=sb(x), op0=nl.add, operand0=1.0, operand1=3.0)
    d = tile((4, 8))
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=3.0)
    np.testing.assert_allclose(rd(d), (x + 1.0) * 3.0, rtol=1e-6)


def test_c29_tensor_reduce_negate_only_for_arithmetic_ops():
    xi = np.arange(16, dtype=np.int32).reshape(2, 8)
    with pytest.raises(E, match=r"tensor_reduce: negate=True applies to arithmetic reductions only; "
                                r"op=nl\.bitwise_or is a bit-vector op \(C29\)"):
        nisa.tensor_reduce(dst=tile((2, 1), nl.int32), op=nl.bitwise_or, data=sb(xi, nl.int32), axis=1, negate=True)
    d = tile((2, 1))
    nisa.tensor_reduce(dst=d, op=nl.add, data=sb(xi.astype(np.float32)), axis=1, negate=True)
    np.testing.assert_array_equal(rd(d)[:, 0], -xi.sum(axis=1))


def test_tensor_partition_reduce_average_is_documented_and_supported():
    x = rand((16, 8))
    d = tile((1, 8))
    nisa.tensor_partition_reduce(dst=d, op=nl.average, data=sb(x))
    np.testing.assert_allclose(rd(d)[0], x.mean(axis=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(E, match=r"op=nl\.minimum is not supported; allowed: nl\.add, nl\.average"):
        nisa.tensor_partition_reduce(dst=d, op=nl.minimum, data=sb(x))


# ---- nl math accepts what its pages document -------------------------------------------------------------------------

@pytest.mark.parametrize("axis,red", [((1, 2), (1, 2)), (2, (2,)), (-1, (2,))])
def test_nl_softmax_over_trailing_contiguous_axes(axis, red):
    x = rand((4, 3, 5))
    ref = np.exp(x - x.max(axis=red, keepdims=True))
    ref /= ref.sum(axis=red, keepdims=True)
    np.testing.assert_allclose(rd(nl.softmax(sb(x), axis=axis)), ref, rtol=1e-5, atol=1e-7)


def test_nl_softmax_rejects_the_partition_axis_and_non_trailing_axes():
    with pytest.raises(E, match=r"axis 0 \(the partition dim\) cannot be reduced.*\(C12\)"):
        nl.softmax(sb(rand((4, 8))), axis=0)
    with pytest.raises(E, match=r"must be trailing contiguous free axes.*\(C12\)"):
        nl.softmax(sb(rand((4, 3, 5))), axis=1)


def test_nl_var_always_has_the_keepdims_shape():
    x = rand((4, 3, 5))
    v = nl.var(sb(x), axis=2)
    assert v.shape == (4, 3, 1)
    np.testing.assert_allclose(rd(v)[..., 0], x.var(axis=2), rtol=1e-4, atol=1e-6)


def test_nl_dropout_takes_a_per_partition_rate_tile():
    rate = sb(np.array([[0.0], [1.0], [0.5], [0.25]], np.float32))
    d = rd(nl.dropout(sb(np.ones((4, 2000), np.float32)), rate))
    assert (d[0] == 1.0).all() and (d[1] == 0.0).all()          # rate 0 keeps all, rate 1 drops all
    assert set(np.unique(d[2])) <= {0.0, 2.0} and abs((d[2] == 0).mean() - 0.5) < 0.05
    assert set(np.unique(d[3])) <= {0.0, np.float32(4.0 / 3.0)} and abs((d[3] == 0).mean() - 0.25) < 0.05
    with pytest.raises(E, match=r"nl\.dropout: rate must be a scalar or a \(4, 1\) tile, got shape \(4, 2\) \(C11\)"):
        nl.dropout(sb(np.ones((4, 8), np.float32)), sb(np.zeros((4, 2), np.float32)))


def test_nl_sin_range_reduces_while_the_isa_activation_does_not():
    # AWS "Supported Activation Functions": nl.sin range-reduces before the ScalarE sine; activation(op=nl.sin) does
    # not and is refused outside [-pi, pi] (C20)
    x = np.concatenate([np.linspace(-1000, 1000, 508), [np.pi, -np.pi, 9.0, 0.0]]).astype(np.float32).reshape(4, 128)
    np.testing.assert_allclose(rd(nl.sin(sb(x))), np.sin(x.astype(np.float64)), atol=1e-4)
    with pytest.raises(E, match=r"nl\.sin input .* outside the ScalarE valid range.*\(C20\)"):
        nisa.activation(dst=tile((4, 128)), op=nl.sin, data=sb(x))


def test_nl_mod_takes_the_sign_of_the_divisor_and_fmod_of_the_dividend():
    x = sb(np.array([[-7.0, 7.0, -1.5, 4.5]], np.float32))
    np.testing.assert_array_equal(rd(nl.mod(x, 3.0)), np.mod([[-7.0, 7.0, -1.5, 4.5]], 3.0))
    np.testing.assert_array_equal(rd(nl.fmod(x, 3.0)), np.fmod([[-7.0, 7.0, -1.5, 4.5]], 3.0))


# ---- C31: NkiTensor view-method constraints --------------------------------------------------------------------------

def test_c31_slice_bounds():
    x = rand((4, 8))
    t = sb(x)
    for start, end, step in ((3, 3, 1), (5, 2, 1), (0, 9, 1), (0, 8, 0)):
        with pytest.raises(E, match=rf"slice\(dim=1, start={start}, end={end}, step={step}\): needs 0 <= start < end "
                                    r"<= 8 and step >= 1 \(C31\)"):
            t.slice(1, start, end, step)
    np.testing.assert_array_equal(rd(t.slice(1, 2, 8, 3)), x[:, 2:8:3])


def test_c31_vector_select_only_once_and_only_on_hbm():
    x = rand((16, 4))
    h = hbm(x)
    idx = idx_tile([3, 0, 7, 7])
    with pytest.raises(E, match=r"vector_select: only HBM tensors can be vector-selected; .* is in sbuf \(C31\)"):
        sb(x).vector_select(0, idx)
    g = h.vector_select(0, idx)
    with pytest.raises(E, match=r"vector_select: the view is already indirect; only one dynamic select.*\(C31\)"):
        g.vector_select(0, idx)
    with pytest.raises(E, match=r"view\(bfloat16\): not supported on an indirect \(vector-selected\) view \(C31\)"):
        g.view(nl.bfloat16)
    d = tile((4, 4))
    nisa.dma_copy(dst=d, src=g)
    np.testing.assert_array_equal(rd(d), x[[3, 0, 7, 7]])


# ---- C32: DGE modes of dma_copy ----------------------------------------------------------------------------------

def test_c32_dge_none_cannot_address_dynamic_or_indirect_locations():
    x = rand((8, 4))
    h = hbm(x)
    none = nisa.dge_mode.none
    with pytest.raises(E, match=r"dma_copy: dge_mode=none .* cannot address a dynamic \(register / scalar_offset\) "
                                r"location.*\(C32\)"):
        nisa.dma_copy(dst=tile((2, 4)), src=h[nl.ds(nisa.register_alloc(3), 2), :], dge_mode=none)
    with pytest.raises(E, match=r"dge_mode=none .* cannot address an indirect \(vector_offset\) location.*\(C32\)"):
        nisa.dma_copy(dst=tile((2, 4)), src=h.ap([[4, 2], [1, 4]], vector_offset=idx_tile([1, 5]), indirect_dim=0),
                      dge_mode=none)
    a, b = tile((2, 4)), tile((2, 4))
    nisa.dma_copy(dst=a, src=h[3:5, :], dge_mode=none)  # static addresses: fine
    nisa.dma_copy(dst=b, src=h[nl.ds(nisa.register_alloc(3), 2), :], dge_mode=nisa.dge_mode.swdge)
    np.testing.assert_array_equal(rd(a), x[3:5])
    np.testing.assert_array_equal(rd(b), x[3:5])


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_c32_hwdge_has_no_indirect_gather(on_target, target):  # noqa: F811
    on_target(target)
    x = rand((8, 4))
    src = hbm(x).ap([[4, 2], [1, 4]], vector_offset=idx_tile([6, 2]), indirect_dim=0)
    with pytest.raises(E, match=r"dge_mode=hwdge does not support indirect \(vector_offset\) gather/scatter.*\(C32\)"):
        nisa.dma_copy(dst=tile((2, 4)), src=src, dge_mode=nisa.dge_mode.hwdge)
    d = tile((2, 4))
    nisa.dma_copy(dst=d, src=src, dge_mode=nisa.dge_mode.swdge)
    np.testing.assert_array_equal(rd(d), x[[6, 2]])
    r = tile((2, 4))  # hwdge with a dynamic (register) start address is fine
    nisa.dma_copy(dst=r, src=hbm(x)[nl.ds(nisa.register_alloc(4), 2), :], dge_mode=nisa.dge_mode.hwdge)
    np.testing.assert_array_equal(rd(r), x[4:6])


def test_c10_no_dma_cast_for_mx_packed_dtypes():
    words = np.arange(8, dtype=np.uint32).reshape(2, 4)
    src = nl.ndarray((2, 4), nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=src.view(nl.uint32), src=hbm(words, nl.uint32))
    with pytest.raises(E, match=r"dma_copy: casting float8_e4m3fn_x4 -> float32: DMA casting is not supported for the "
                                r"MXFP8/MXFP4 \(x4 packed\) dtypes.*\(C10\)"):
        nisa.dma_copy(dst=tile((2, 4)), src=src)
    same = tile((2, 4), nl.float8_e4m3fn_x4)
    nisa.dma_copy(dst=same, src=src)  # equal dtypes: a plain copy of the packed words
    np.testing.assert_array_equal(rd(same.view(nl.uint32)), words)


# ---- C34: memset of an integer tile with a fractional float (nkisim's own rule) -----------------------------------

def test_c34_memset_integer_tile_with_fractional_float():
    t = tile((2, 4), nl.uint8)
    with pytest.raises(E, match=r"memset: value=0\.5 is a fractional float but dst dtype is uint8.*\(C34\)"):
        nisa.memset(dst=t, value=0.5)
    nisa.memset(dst=t, value=0.0)  # an integral float, as AWS's nki-library writes for uint8 scale tiles
    nisa.memset(dst=tile((2, 4), nl.int32), value=7)
    np.testing.assert_array_equal(rd(t), 0)
