"""nkisim/isa/extended.py: each op against a NumPy reference (values and dtypes) and one negative test per
documented constraint (the message names the limit)."""

import numpy as np
import pytest

from nkisim.errors import NkiValidationError

from .._sim import f32, nisa, nl, rd, rng, sb, tile

E = NkiValidationError
RC = nisa.reduce_cmd
FP32_MIN = float(np.finfo(np.float32).min)


def col(v):
    return sb(np.asarray(v, np.float32).reshape(-1, 1))


# ---- tensor_tensor_scan ----------------------------------------------------------------------------------------

def test_tensor_tensor_scan_cumsum_and_reverse():
    a, b = rng(1).standard_normal((2, 8, 16)).astype(np.float32)
    d = tile((8, 16))
    nisa.tensor_tensor_scan(dst=d, data0=sb(np.ones_like(a)), data1=sb(b), initial=0.0, op0=nl.multiply, op1=nl.add)
    np.testing.assert_allclose(f32(d), np.cumsum(b, axis=1), rtol=1e-5, atol=1e-5)
    # r_i = b_i - (a_i * r_{i-1}) with a (P, 1) initial, reverse1 swaps op1's operands; bf16 output
    init = rng(2).standard_normal((8, 1)).astype(np.float32)
    d2 = tile((8, 16), nl.bfloat16)
    nisa.tensor_tensor_scan(dst=d2, data0=sb(a), data1=sb(b), initial=col(init), op0=nl.multiply, op1=nl.subtract,
                            reverse1=True)
    ref = np.empty_like(a)
    prev = init[:, 0]
    for i in range(16):
        prev = b[:, i] - a[:, i] * prev
        ref[:, i] = prev
    assert rd(d2).dtype == nl.bfloat16.np
    np.testing.assert_allclose(f32(d2), ref, rtol=2e-2, atol=2e-2)


def test_tensor_tensor_scan_constraints():
    x = sb(np.ones((4, 8), np.float32))
    with pytest.raises(E, match=r"both be in PSUM \(C9\)"):
        nisa.tensor_tensor_scan(dst=tile((4, 8)), data0=sb(np.ones((4, 8)), buffer=nl.psum),
                                data1=sb(np.ones((4, 8)), buffer=nl.psum), initial=0.0, op0=nl.add, op1=nl.add)
    with pytest.raises(E, match="bit-vector"):
        nisa.tensor_tensor_scan(dst=tile((4, 8)), data0=x, data1=x, initial=0.0, op0=nl.bitwise_and, op1=nl.add)
    with pytest.raises(E, match=r"\(C2\)"):
        nisa.tensor_tensor_scan(dst=tile((4, 4)), data0=x, data1=x, initial=0.0, op0=nl.add, op1=nl.add)


# ---- tensor_scalar_reduce ----------------------------------------------------------------------------------------

def test_tensor_scalar_reduce_chain_across_tiles():
    x = rng(3).standard_normal((16, 64)).astype(np.float32)
    d, r = tile((16, 32)), tile((16, 1))
    nisa.tensor_scalar_reduce(dst=d, data=sb(x[:, :32]), op0=nl.multiply, operand0=2.0, reduce_op=nl.add,
                              reduce_res=None)  # reset_reduce, result stays in the accumulators
    nisa.tensor_scalar_reduce(d, sb(x[:, 32:]), nl.multiply, 2.0, nl.add, r, reduce_cmd=RC.reduce)
    np.testing.assert_allclose(f32(d), 2 * x[:, 32:], rtol=1e-6)
    np.testing.assert_allclose(f32(r)[:, 0], (2 * x).sum(axis=1), rtol=1e-5, atol=1e-4)
    # max with load_reduce from a (P, 1) init, negated read-out
    init = np.full((16, 1), 1.5, np.float32)
    nisa.tensor_scalar_reduce(d, sb(x[:, :32]), nl.add, col(np.zeros(16)), nl.maximum, r,
                              reduce_cmd=RC.load_reduce, reduce_init=col(init), reduce_res_negate=True)
    np.testing.assert_allclose(f32(r)[:, 0], -np.maximum(x[:, :32].max(axis=1), 1.5), rtol=1e-6)
    # reset_reduce starts from the identity of reduce_op (not 0) for min
    nisa.tensor_scalar_reduce(d, sb(x[:, :32] + 10), nl.add, 0.0, nl.min, r)
    np.testing.assert_allclose(f32(r)[:, 0], (x[:, :32] + 10).min(axis=1), rtol=1e-6)


def test_tensor_scalar_reduce_constraints():
    x, d, r = sb(np.ones((4, 8), np.float32)), tile((4, 8)), tile((4, 1))
    with pytest.raises(E, match="reduce_op=nl.subtract is not supported"):
        nisa.tensor_scalar_reduce(d, x, nl.add, 1.0, nl.subtract, r)
    with pytest.raises(E, match="reverse0=True is not supported"):
        nisa.tensor_scalar_reduce(d, x, nl.subtract, 1.0, nl.add, r, reverse0=True)
    with pytest.raises(E, match="load_reduce needs reduce_init"):
        nisa.tensor_scalar_reduce(d, x, nl.add, 1.0, nl.add, r, reduce_cmd=RC.load_reduce)
    with pytest.raises(E, match="reduce_init may only be set with reduce_cmd=load_reduce"):
        nisa.tensor_scalar_reduce(d, x, nl.add, 1.0, nl.add, r, reduce_init=1.0)
    with pytest.raises(E, match="reduce_cmd=idle is not supported"):
        nisa.tensor_scalar_reduce(d, x, nl.add, 1.0, nl.add, r, reduce_cmd=RC.idle)
    with pytest.raises(E, match="bit-vector"):
        nisa.tensor_scalar_reduce(d, x, nl.bitwise_and, 1, nl.add, r)


# ---- tensor_scalar_cumulative -------------------------------------------------------------------------------------

def test_tensor_scalar_cumulative_ops_and_register_chaining():
    x = rng(4).standard_normal((8, 12)).astype(np.float32)
    d = tile((8, 12))
    nisa.tensor_scalar_cumulative(dst=d, src=sb(x), op0=nl.multiply, op1=nl.add, imm0=3.0)
    np.testing.assert_allclose(f32(d), np.cumsum(3 * x, axis=1), rtol=1e-5, atol=1e-5)
    # reduce: continue from the registers left by the previous instruction
    nisa.tensor_scalar_cumulative(d, sb(x), nl.multiply, nl.add, 3.0, reduce_cmd=RC.reduce)
    np.testing.assert_allclose(f32(d), np.cumsum(3 * x, axis=1) + (3 * x).sum(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-4)
    # running max from imm1 with a (P, 1) imm0
    imm0 = rng(5).standard_normal((8, 1)).astype(np.float32)
    nisa.tensor_scalar_cumulative(d, sb(x), nl.add, nl.maximum, col(imm0), imm1=0.5, reduce_cmd=RC.load_reduce)
    np.testing.assert_allclose(f32(d), np.maximum.accumulate(np.maximum(x + imm0, 0.5), axis=1), rtol=1e-6)
    # subtract follows the documented reg = op1(op0(x_i, imm0), reg)
    nisa.tensor_scalar_cumulative(d, sb(x), nl.add, nl.subtract, 0.0)
    ref, reg = np.empty_like(x), np.zeros(8, np.float32)
    for i in range(12):
        reg = x[:, i] - reg
        ref[:, i] = reg
    np.testing.assert_allclose(f32(d), ref, rtol=1e-5, atol=1e-5)


def test_tensor_scalar_cumulative_constraints():
    x = sb(np.ones((4, 8), np.float32))
    with pytest.raises(E, match="int32/uint32"):
        nisa.tensor_scalar_cumulative(tile((4, 8), nl.int32), x, nl.add, nl.add, 1.0)
    with pytest.raises(E, match="op1=nl.divide is not supported"):
        nisa.tensor_scalar_cumulative(tile((4, 8)), x, nl.add, nl.divide, 1.0)
    with pytest.raises(E, match="load_reduce needs imm1"):
        nisa.tensor_scalar_cumulative(tile((4, 8)), x, nl.add, nl.add, 1.0, reduce_cmd=RC.load_reduce)
    with pytest.raises(E, match=r"must be float32, got bfloat16 \(C11\)"):
        nisa.tensor_scalar_cumulative(tile((4, 8)), x, nl.add, nl.add, sb(np.ones((4, 1)), nl.bfloat16))


# ---- activate2 -------------------------------------------------------------------------------------------------

def test_activate2_trn3(on_target):
    on_target("trn3")
    x = rng(6).standard_normal((8, 32)).astype(np.float32)
    d, r = tile((8, 32)), tile((8, 1))
    bias = rng(7).standard_normal((8, 1)).astype(np.float32)
    nisa.activate2(dst=d, op=nl.exp, data=sb(x), imm0=0.5, imm1=col(bias), op0=nl.multiply, op1=nl.subtract,
                   reduce_op=nl.add, reduce_res=r, reduce_cmd=RC.reset_reduce)
    y = np.exp(0.5 * x - bias)
    np.testing.assert_allclose(f32(d), y, rtol=1e-5)
    np.testing.assert_allclose(f32(r)[:, 0], y.sum(axis=1), rtol=1e-5)
    nisa.activate2(d, nl.prelu, sb(x), 0.0, 0.0, nl.bypass, nl.bypass, relu_param=0.1, reduce_op=nl.maximum,
                   reduce_res=r, reduce_cmd=RC.reset_reduce)
    np.testing.assert_allclose(f32(d), np.where(x > 0, x, 0.1 * x), rtol=1e-6)
    np.testing.assert_allclose(f32(r)[:, 0], np.where(x > 0, x, 0.1 * x).max(axis=1), rtol=1e-6)


def test_activate2_constraints(on_target):
    x = sb(np.ones((4, 8), np.float32))
    with pytest.raises(E, match=r"NeuronCore-v4 \(trn3\).*\(C19\)"):
        nisa.activate2(tile((4, 8)), nl.exp, x, 1.0, 1.0, nl.multiply, nl.add)
    on_target("trn3")
    x = sb(np.ones((4, 8), np.float32))
    with pytest.raises(E, match=r"\(op0, op1\)=\(nl.add, nl.multiply\) is not supported"):
        nisa.activate2(tile((4, 8)), nl.exp, x, 1.0, 1.0, nl.add, nl.multiply)
    with pytest.raises(E, match="reverse1 requires op1"):
        nisa.activate2(tile((4, 8)), nl.exp, x, 1.0, 1.0, nl.add, nl.bypass, reverse1=True)
    with pytest.raises(E, match="reduce_op=nl.multiply is not supported"):
        nisa.activate2(tile((4, 8)), nl.exp, x, 1.0, 1.0, nl.add, nl.bypass, reduce_op=nl.multiply)
    with pytest.raises(E, match="same dtype"):
        nisa.activate2(tile((4, 8)), nl.exp, x, sb(np.ones((4, 1))), sb(np.ones((4, 1)), nl.bfloat16),
                       nl.multiply, nl.add)


# ---- range_select / select_reduce ------------------------------------------------------------------------------

def test_range_select_causal_window_and_max():
    x = rng(8).standard_normal((8, 40)).astype(np.float32)
    lo, hi = np.arange(8, dtype=np.float32) + 3, np.arange(8, dtype=np.float32) + 20
    d, r = tile((8, 40), nl.bfloat16), tile((8, 1))
    nisa.range_select(dst=d, on_true_tile=sb(x), comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=col(lo),
                      bound1=col(hi), reduce_res=r, range_start=2)
    idx = 2 + np.arange(40)[None, :]
    mask = (idx >= lo[:, None]) & (idx < hi[:, None])
    ref = np.where(mask, x, FP32_MIN)
    np.testing.assert_allclose(f32(d), ref.astype(nl.bfloat16.np).astype(np.float32))  # FP32_MIN -> -inf in bf16
    assert np.isneginf(f32(d)[~mask]).all()
    np.testing.assert_allclose(f32(r)[:, 0], ref.max(axis=1), rtol=1e-6)


def test_range_select_constraints(on_target):
    x, b = sb(np.ones((4, 8), np.float32)), col(np.zeros(4))
    with pytest.raises(E, match="must be FP32_MIN"):
        nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b, on_false_value=0.0)
    with pytest.raises(E, match="must be FP32_MIN"):
        nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b, on_false_value=-3.4e38)
    # the decimal literal of fp32 min (the nki-library's _FLOAT32_MIN) is the same fp32 immediate
    nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b, on_false_value=-3.4028235e38)
    with pytest.raises(E, match="comp_op0=nl.not_equal must be one of"):
        nisa.range_select(tile((4, 8)), x, nl.not_equal, nl.less, b, b)
    with pytest.raises(E, match="reduce_op=nl.add is not supported"):
        nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b, reduce_op=nl.add)
    with pytest.raises(E, match="floating-point"):
        nisa.range_select(tile((4, 8), nl.int32), sb(np.ones((4, 8)), nl.int32), nl.less, nl.less, b, b)
    with pytest.raises(E, match="2\\^24"):
        nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b, range_start=2 ** 24)
    on_target("trn1")
    x, b = sb(np.ones((4, 8), np.float32)), col(np.zeros(4))
    with pytest.raises(E, match=r"NeuronCore-v3 \(trn2\) or newer.*\(C19\)"):
        nisa.range_select(tile((4, 8)), x, nl.less, nl.less, b, b)


def test_select_reduce_values_and_accumulation():
    x = rng(9).standard_normal((8, 16)).astype(np.float32)
    pred = (rng(10).random((8, 16)) > 0.5).astype(np.uint8)
    off = rng(11).standard_normal((8, 1)).astype(np.float32)
    d, r = tile((8, 16)), tile((8, 1))
    nisa.select_reduce(dst=d, predicate=sb(pred, nl.uint8), on_true=sb(x), on_false=col(off), reduce_res=r,
                       reduce_cmd=RC.reset_reduce)
    ref = np.where(pred != 0, x, off)
    np.testing.assert_array_equal(f32(d), ref)
    np.testing.assert_array_equal(f32(r)[:, 0], ref.max(axis=1))
    nisa.select_reduce(d, sb(pred, nl.uint8), sb(x + 100), -1.0, reduce_res=r, reduce_cmd=RC.reduce,
                       reverse_pred=True)
    ref2 = np.where(pred == 0, x + 100, -1.0)
    np.testing.assert_allclose(f32(d), ref2)
    np.testing.assert_allclose(f32(r)[:, 0], np.maximum(ref.max(axis=1), ref2.max(axis=1)))


def test_select_reduce_constraints():
    x, p8, d, r = sb(np.ones((4, 8), np.float32)), sb(np.ones((4, 8)), nl.uint8), tile((4, 8)), tile((4, 1))
    with pytest.raises(E, match="predicate dtype must be one of int8, uint8, int16, uint16"):
        nisa.select_reduce(d, sb(np.ones((4, 8)), nl.float32), x, 0.0)
    with pytest.raises(E, match="tfloat32/int32/uint32"):
        nisa.select_reduce(d, p8, sb(np.ones((4, 8)), nl.int32), 0.0)
    with pytest.raises(E, match="reduce_op=nl.minimum is not supported"):
        nisa.select_reduce(d, p8, x, 0.0, reduce_op=nl.minimum)
    with pytest.raises(E, match="reduce_cmd=idle"):
        nisa.select_reduce(d, p8, x, 0.0, reduce_res=r)
    with pytest.raises(E, match=r"\(C9\)"):
        nisa.select_reduce(d, sb(np.ones((4, 8)), nl.uint8, buffer=nl.psum), sb(np.ones((4, 8)), buffer=nl.psum),
                           0.0)
    with pytest.raises(E, match=r"\(4, 1\) tensor.*\(C11\)"):
        nisa.select_reduce(d, p8, x, sb(np.ones((4, 2))))


# ---- max8 / nc_find_index8 / nc_match_replace8 ---------------------------------------------------------------------

def test_max8_find_index8_match_replace8():
    x = rng(12).permutation(np.arange(4 * 40, dtype=np.float32)).reshape(4, 2, 20) / 8
    x[:, 1, 5] = x[:, 0, 3]  # a duplicate of one value
    m = tile((4, 8))
    nisa.max8(dst=m, src=sb(x))
    ref = -np.sort(-x.reshape(4, -1), axis=1)[:, :8]
    np.testing.assert_array_equal(f32(m), ref)
    vals = x.reshape(4, -1)[:, [3, 3, 0, 1, 2, 7, 9, 10]]  # the duplicated value asked twice
    idx = tile((4, 8), nl.uint32)
    nisa.nc_find_index8(dst=idx, data=sb(x), vals=sb(vals))
    assert rd(idx).dtype == np.uint32
    np.testing.assert_array_equal(rd(idx), [[3, 25, 0, 1, 2, 7, 9, 10]] * 4)  # duplicates advance
    out, oidx = tile((4, 40), nl.bfloat16), tile((4, 8), nl.uint16)
    vals2 = vals.copy()
    vals2[:, 7] = -5.0  # not present
    nisa.nc_match_replace8(dst=out, data=sb(x), vals=sb(vals2), imm=-1.0, dst_idx=oidx)
    ref = x.reshape(4, -1).copy()
    ref[:, [3, 25, 0, 1, 2, 7, 9]] = -1.0
    np.testing.assert_array_equal(f32(out), ref.astype(nl.bfloat16.np).astype(np.float32))
    np.testing.assert_array_equal(rd(oidx), [[3, 25, 0, 1, 2, 7, 9, 65535]] * 4)


def test_top8_family_constraints():
    with pytest.raises(E, match="between 8 and 16384"):
        nisa.max8(tile((4, 8)), sb(np.ones((4, 7))))
    with pytest.raises(E, match="between 8 and 16384"):
        nisa.max8(tile((2, 8)), sb(np.ones((2, 16385))))
    with pytest.raises(E, match=r"2-D \(4, 8\)"):
        nisa.max8(tile((4, 2, 4)), sb(np.ones((4, 16))))
    with pytest.raises(E, match="exactly 8 elements"):
        nisa.nc_find_index8(tile((4, 8), nl.uint32), sb(np.ones((4, 16))), sb(np.ones((4, 4))))
    with pytest.raises(E, match="uint16 or uint32"):
        nisa.nc_find_index8(tile((4, 8), nl.int32), sb(np.ones((4, 16))), sb(np.ones((4, 8))))
    with pytest.raises(E, match="compile-time float"):
        nisa.nc_match_replace8(tile((4, 16)), sb(np.ones((4, 16))), sb(np.ones((4, 8))), imm=sb(np.ones((4, 1))))


# ---- topk ------------------------------------------------------------------------------------------------------

def test_topk_snake_groups():
    n, k = 100, 20
    x = rng(13).permutation(np.arange(32 * 7, dtype=np.float32)).reshape(32, 7) / 4
    vd, idd = tile((32, k), nl.bfloat16), tile((32, k), nl.uint32)
    nisa.topk(val_dst=vd, idx_dst=idd, src=sb(x, nl.bfloat16), n=n)
    for g in range(2):
        snake = x[16 * g:16 * g + 16].T.reshape(-1)[:n].astype(nl.bfloat16.np).astype(np.float32)
        order = np.argsort(-snake, kind="stable")[:k][::-1]
        j = np.arange(k)
        np.testing.assert_array_equal(f32(vd)[16 * g + j % 16, j // 16], snake[order])
        np.testing.assert_array_equal(rd(idd)[16 * g + j % 16, j // 16], order)


def test_topk_constraints():
    s = sb(np.ones((16, 8)), nl.bfloat16)
    with pytest.raises(E, match="must be bfloat16"):
        nisa.topk(tile((16, 4), nl.float32), tile((16, 4), nl.uint32), s, 64)
    with pytest.raises(E, match="multiple of 16"):
        nisa.topk(tile((8, 4), nl.bfloat16), tile((8, 4), nl.uint32), sb(np.ones((8, 8)), nl.bfloat16), 64)
    with pytest.raises(E, match="8 <= n < 65536"):
        nisa.topk(tile((16, 4), nl.bfloat16), tile((16, 4), nl.uint32), s, 4)
    with pytest.raises(E, match=r"ceil\(n/16\)=9"):
        nisa.topk(tile((16, 4), nl.bfloat16), tile((16, 4), nl.uint32), s, 129)
    with pytest.raises(E, match="k <= n"):
        nisa.topk(tile((16, 40), nl.bfloat16), tile((16, 40), nl.uint32), s, 32)


# ---- nonzero_with_count ----------------------------------------------------------------------------------------

def test_nonzero_with_count_only_core_partitions():
    x = (rng(14).random((32, 10)) > 0.6).astype(np.float32)
    d = sb(np.full((32, 11), 7, np.int32), nl.int32)
    nisa.nonzero_with_count(dst=d, src=sb(x), index_offset=16, padding_val=-1)
    out = rd(d)
    for p in range(32):
        if p % 16:
            assert (out[p] == 7).all()
            continue
        nz = np.flatnonzero(x[p])
        exp = np.full(11, -1)
        exp[:nz.size] = nz + 16
        exp[10] = nz.size
        np.testing.assert_array_equal(out[p], exp)


def test_nonzero_with_count_constraints(on_target):
    x = sb(np.ones((16, 4)))
    with pytest.raises(E, match="one more element"):
        nisa.nonzero_with_count(tile((16, 4), nl.int32), x)
    with pytest.raises(E, match="dst dtype must be int32"):
        nisa.nonzero_with_count(tile((16, 5)), x)
    with pytest.raises(E, match="src dtype must be float32 or int32"):
        nisa.nonzero_with_count(tile((16, 5), nl.int32), sb(np.ones((16, 4)), nl.bfloat16))
    with pytest.raises(E, match="allowed: sbuf"):
        nisa.nonzero_with_count(tile((16, 5), nl.int32, nl.psum), x)
    on_target("trn1")
    with pytest.raises(E, match=r"NeuronCore-v3.*\(C19\)"):
        nisa.nonzero_with_count(tile((16, 5), nl.int32), sb(np.ones((16, 4))))


# ---- nc_stream_shuffle / nc_n_gather / local_gather ----------------------------------------------------------------

def test_nc_stream_shuffle_quadrants_and_inplace():
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    mask = [31 - i for i in range(32)]
    mask[5] = 255
    t = sb(x, nl.bfloat16)
    keep = rd(t).copy()
    nisa.nc_stream_shuffle(dst=t, src=t, shuffle_mask=mask)  # in place
    out = rd(t)
    for d in range(64):
        q, i = divmod(d, 32)
        exp = keep[d] if mask[i] == 255 else keep[32 * q + mask[i]]
        np.testing.assert_array_equal(out[d], exp)


def test_nc_stream_shuffle_constraints():
    x = sb(np.ones((32, 4)))
    with pytest.raises(E, match="must equal src dtype"):
        nisa.nc_stream_shuffle(tile((32, 4), nl.bfloat16), x, list(range(32)))
    with pytest.raises(E, match="list of 32 ints"):
        nisa.nc_stream_shuffle(tile((32, 4)), x, list(range(16)))
    with pytest.raises(E, match=r"shuffle_mask\[0\]=40"):
        nisa.nc_stream_shuffle(tile((32, 4)), x, [40] + list(range(1, 32)))
    with pytest.raises(E, match="selects src partition 20 but src has 16"):
        nisa.nc_stream_shuffle(tile((32, 4)), sb(np.ones((16, 4))), [20] + list(range(1, 32)))


def test_nc_n_gather_and_gather_flattened():
    data = rng(15).standard_normal((8, 4, 5)).astype(np.float32)
    ind = rng(16).integers(0, 20, (8, 6)).astype(np.uint32)
    d = tile((8, 2, 3))
    nisa.nc_n_gather(dst=d, data=sb(data), indices=sb(ind, nl.uint32))
    np.testing.assert_array_equal(f32(d).reshape(8, 6), np.take_along_axis(data.reshape(8, -1), ind.astype(int), 1))
    g = nl.gather_flattened(sb(data), sb(ind, nl.uint32), dtype=nl.bfloat16)
    assert g.dtype == nl.bfloat16
    np.testing.assert_allclose(f32(g), np.take_along_axis(data.reshape(8, -1), ind.astype(int), 1), rtol=1e-2)


def test_nc_n_gather_constraints():
    data = sb(np.ones((8, 20)))
    with pytest.raises(E, match="indices dtype must be uint32"):
        nisa.nc_n_gather(tile((8, 4)), data, sb(np.zeros((8, 4)), nl.int32))
    with pytest.raises(E, match="must equal data dtype"):
        nisa.nc_n_gather(tile((8, 4), nl.bfloat16), data, sb(np.zeros((8, 4)), nl.uint32))
    with pytest.raises(E, match=r"outside \[0, 20\)"):
        nisa.nc_n_gather(tile((8, 4)), data, sb(np.full((8, 4), 20), nl.uint32))
    with pytest.raises(E, match="allowed: sbuf"):
        nisa.nc_n_gather(tile((8, 4), buffer=nl.psum), data, sb(np.zeros((8, 4)), nl.uint32))


def test_local_gather_matches_aws_numpy_semantics():
    ne, nvalid = 4, 50
    src = rng(17).standard_normal((32, 64, ne)).astype(np.float32)
    index = rng(18).integers(0, 64, (32, 4)).astype(np.uint16)
    d = tile((32, nvalid, ne))
    nisa.local_gather(dst=d, src_buffer=sb(src), index=sb(index * ne, nl.uint16), num_elem_per_idx=ne,
                      num_valid_indices=nvalid)
    ref = np.empty((32, nvalid, ne), np.float32)
    for c in range(2):
        ind = index[16 * c:16 * c + 16].flatten(order="F")[:nvalid]
        ref[16 * c:16 * c + 16] = np.take(src[16 * c:16 * c + 16], ind, axis=1)
    np.testing.assert_array_equal(f32(d), ref)


def test_local_gather_constraints():
    src, idx = sb(np.ones((32, 64))), sb(np.zeros((32, 4)), nl.uint16)
    with pytest.raises(E, match="multiple of 16"):
        nisa.local_gather(tile((8, 4)), sb(np.ones((8, 64))), sb(np.zeros((8, 4)), nl.uint16))
    with pytest.raises(E, match=r"num_elem_per_idx=3 must be one of \[1, 2, 4, 8, 16, 32\]"):
        nisa.local_gather(tile((32, 192)), src, idx, num_elem_per_idx=3)
    with pytest.raises(E, match="index dtype must be uint16"):
        nisa.local_gather(tile((32, 64)), src, sb(np.zeros((32, 4)), nl.uint32))
    with pytest.raises(E, match=r"must be in \[1, 64\]"):
        nisa.local_gather(tile((32, 65)), src, idx, num_valid_indices=65)
    with pytest.raises(E, match="exceed the maximum of 4096"):
        nisa.local_gather(tile((16, 4097)), sb(np.ones((16, 64))), sb(np.zeros((16, 257)), nl.uint16),
                          num_valid_indices=4097)
    with pytest.raises(E, match="num_valid_indices \\* num_elem_per_idx = 64"):
        nisa.local_gather(tile((32, 63)), src, idx)
    with pytest.raises(E, match="outside the 64 elements"):
        nisa.local_gather(tile((32, 128)), src, sb(np.full((32, 4), 63), nl.uint16), num_elem_per_idx=2)


# ---- tensor_partition_reduce / sequence_bounds -------------------------------------------------------------------

def test_tensor_partition_reduce():
    x = rng(19).standard_normal((64, 3, 4)).astype(np.float32)
    d = tile((1, 3, 4))
    nisa.tensor_partition_reduce(dst=d, op=nl.add, data=sb(x))
    np.testing.assert_allclose(f32(d)[0], x.sum(axis=0), rtol=1e-5, atol=1e-5)
    nisa.tensor_partition_reduce(d, nl.maximum, sb(x))
    np.testing.assert_array_equal(f32(d)[0], x.max(axis=0))
    bits = rng(20).integers(0, 256, (16, 8)).astype(np.int32)
    di = tile((1, 8), nl.int32)
    nisa.tensor_partition_reduce(di, nl.bitwise_or, sb(bits, nl.int32))
    np.testing.assert_array_equal(rd(di)[0], np.bitwise_or.reduce(bits, axis=0))


def test_tensor_partition_reduce_constraints():
    with pytest.raises(E, match="op=nl.multiply is not supported"):
        nisa.tensor_partition_reduce(tile((1, 4)), nl.multiply, sb(np.ones((8, 4))))
    with pytest.raises(E, match="1 partition and 4 elements"):
        nisa.tensor_partition_reduce(tile((2, 4)), nl.add, sb(np.ones((8, 4))))
    with pytest.raises(E, match="needs integer dtypes"):
        nisa.tensor_partition_reduce(tile((1, 4)), nl.bitwise_and, sb(np.ones((8, 4))))


def _seq_bounds_ref(s):
    n = len(s)
    lo, hi = np.zeros(n), np.zeros(n)
    lo[0] = 0 if s[0] != 0 else n
    for i in range(1, n):
        lo[i] = n if s[i] == 0 else (lo[i - 1] if s[i] == s[i - 1] else i)
    hi[-1] = n if s[-1] != 0 else -1
    for i in range(n - 2, -1, -1):
        hi[i] = -1 if s[i] == 0 else (hi[i + 1] if s[i] == s[i + 1] else i + 1)
    return np.vstack([lo, hi])


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_sequence_bounds(dtype):
    s = np.array([[0, 1, 1, 2, 2, 2, 0, 0, 3, 5, 5, 0, 4]], np.float32)
    d = tile((1, 2, s.shape[1]), getattr(nl, dtype))
    nisa.sequence_bounds(dst=d, segment_ids=sb(s, getattr(nl, dtype)))
    np.testing.assert_array_equal(f32(d)[0], _seq_bounds_ref(s[0]))


def test_sequence_bounds_constraints():
    with pytest.raises(E, match="partition dimension must be 1"):
        nisa.sequence_bounds(tile((2, 2, 4)), sb(np.ones((2, 4))))
    with pytest.raises(E, match="float32 or int32"):
        nisa.sequence_bounds(tile((1, 2, 4)), sb(np.ones((1, 4)), nl.bfloat16))
    with pytest.raises(E, match=r"\(1, 2, 4\)"):
        nisa.sequence_bounds(tile((1, 4)), sb(np.ones((1, 4))))


# ---- audit fixes elsewhere ---------------------------------------------------------------------------------------

def test_defaults_are_the_real_nl_operators():
    assert nisa.affine_select.__defaults__[0] is nl.equal
    assert nisa.range_select.__defaults__[2] is nl.maximum
    assert nisa.select_reduce.__defaults__[2] is nl.maximum
    assert nisa.exponential.__defaults__[2] is nisa.reduce_cmd.idle


def test_while_loop_body_receives_condition_by_value():
    seen = []

    def body(r):
        seen.append(r.value)
        nxt = nisa.register_alloc(r.value - 1)
        return nxt

    nl.while_loop(nisa.register_alloc(3), body)
    assert seen == [3, 2, 1]
    nl.while_loop(nisa.register_alloc(0), body)  # a true while: the body never runs for a zero init
    assert seen == [3, 2, 1]


def test_ndarray_buffer_none_is_sbuf():
    assert nl.ndarray((4, 4), nl.float32, buffer=None).buffer is nl.sbuf
    assert nl.zeros((4, 4), nl.float32, buffer=None).buffer is nl.sbuf


def test_each_op_records_exactly_one_instruction():
    from nkisim.runtime import current
    x, d, r = sb(np.ones((16, 16), np.float32)), tile((16, 16)), tile((16, 1))
    pred, m8, pr = sb(np.ones((16, 16)), nl.uint8), tile((16, 8)), tile((1, 16))
    calls = [
        lambda: nisa.tensor_tensor_scan(d, x, x, 0.0, nl.multiply, nl.add),
        lambda: nisa.tensor_scalar_reduce(d, x, nl.add, 1.0, nl.add, r),
        lambda: nisa.tensor_scalar_cumulative(d, x, nl.add, nl.add, 1.0),
        lambda: nisa.select_reduce(d, pred, x, 0.0),
        lambda: nisa.max8(m8, x),
        lambda: nisa.nc_stream_shuffle(d, x, list(range(32))),
        lambda: nisa.tensor_partition_reduce(pr, nl.add, x),
    ]
    for call in calls:
        before = len(current().trace)
        call()
        trace = current().trace
        assert len(trace) == before + 1 and trace[-1].engine in ("vector", "gpsimd"), trace[before:]
