"""Core nki.isa ops and the nl convenience API against NumPy semantics (values AND dtypes)."""

import ml_dtypes
import nki
import numpy as np
import pytest

from nkisim.errors import NkiValidationError

from ._sim import f32, fresh_core, hbm, nisa, nl, on_target, rd, ref_cast, rng, sb, tile  # noqa: F401

BF16 = ml_dtypes.bfloat16


def rand(shape, seed=0, lo=-2.0, hi=2.0):
    return rng(seed).uniform(lo, hi, size=shape).astype(np.float32)


def assert_bits(t, expected, dtype):
    got = np.ascontiguousarray(rd(t))
    assert got.dtype == np.dtype(dtype)
    want = np.ascontiguousarray(np.asarray(expected, dtype=dtype))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ---- dma_copy -----------------------------------------------------------------------------------------------------

def test_dma_copy_roundtrip_same_dtype_bit_exact():
    x = rand((8, 16))
    x[0, 0] = np.nan
    x[0, 1] = -0.0
    t = sb(x)
    out = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    assert_bits(out, x, np.float32)


@pytest.mark.parametrize("dst_dtype", [nl.bfloat16, nl.float16, nl.int8, nl.uint8, nl.int32, nl.float8_e4m3])
def test_dma_copy_converts_via_fp32(dst_dtype):
    x = np.array([[0.5, 1.5, 2.5, -2.5, 300.0, -300.0, np.nan, 1.00390625]], np.float32)
    t = tile(x.shape, dst_dtype)
    nisa.dma_copy(dst=t, src=hbm(x))
    assert_bits(t, ref_cast(x, dst_dtype), dst_dtype.np)


def test_dma_copy_int32_through_fp32_loses_precision():
    x = np.array([[2 ** 24 + 1, 7]], np.int32)
    t = tile((1, 2), nl.float32)
    nisa.dma_copy(dst=t, src=hbm(x))
    np.testing.assert_array_equal(rd(t), [[2.0 ** 24, 7.0]])
    back = tile((1, 2), nl.int32)
    nisa.dma_copy(dst=back, src=t)
    np.testing.assert_array_equal(rd(back), [[2 ** 24, 7]])


def test_dma_copy_shapes_differ_same_count():
    x = np.arange(48, dtype=np.float32).reshape(4, 12)
    t = tile((4, 3, 4))
    nisa.dma_copy(dst=t, src=hbm(x))
    np.testing.assert_array_equal(rd(t), x.reshape(4, 3, 4))
    flat = nl.ndarray((48,), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=flat, src=t)
    np.testing.assert_array_equal(rd(flat), x.reshape(-1))


def test_dma_copy_strided_views():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = tile((4, 4))
    nisa.dma_copy(dst=t, src=hbm(x)[::2, 1::2])
    np.testing.assert_array_equal(rd(t), x[::2, 1::2])


def _indices(idx):
    return sb(np.asarray(idx, np.uint32).reshape(-1, 1))


def test_dma_copy_gather_vector_offset():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    data = hbm(table)
    idx = _indices([7, 2, 9, 2])
    dst = tile((4, 4))
    nisa.dma_copy(dst=dst, src=data.ap([[4, 4], [1, 4]], vector_offset=idx, indirect_dim=0))
    np.testing.assert_array_equal(rd(dst), table[[7, 2, 9, 2]])


def test_dma_copy_gather_index_column_from_ap():
    """An index column cut from a wider index tile with .ap() is (P, 1, 1): one index per partition."""
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    idx_tile = sb(np.array([[7, 1], [2, 3], [9, 5]], np.uint32))
    column = idx_tile.ap([[2, 3], [1, 1], [1, 1]], offset=0)
    dst = tile((3, 4))
    nisa.dma_copy(dst=dst, src=hbm(table).ap([[4, 3], [1, 4]], vector_offset=column, indirect_dim=0))
    np.testing.assert_array_equal(rd(dst), table[[7, 2, 9]])
    with pytest.raises(NkiValidationError, match=r"one index per partition"):
        hbm(table).ap([[4, 3], [1, 4]], vector_offset=idx_tile, indirect_dim=0)


def test_dma_copy_gather_with_dtype_conversion_and_offset():
    table = rand((10, 8))
    idx = _indices([1, 3])
    dst = tile((2, 4), nl.bfloat16)
    nisa.dma_copy(dst=dst, src=hbm(table).ap([[8, 2], [1, 4]], offset=4, vector_offset=idx, indirect_dim=0))
    assert_bits(dst, table[[1, 3], 4:8].astype(BF16), BF16)


def test_dma_copy_scatter_vector_offset():
    out = nl.ndarray((6, 3), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=hbm(np.zeros((6, 3), np.float32)))
    src = sb(np.arange(9, dtype=np.float32).reshape(3, 3) + 1)
    nisa.dma_copy(dst=out.ap([[3, 3], [1, 3]], vector_offset=_indices([4, 0, 2]), indirect_dim=0), src=src)
    ref = np.zeros((6, 3), np.float32)
    ref[[4, 0, 2]] = np.arange(9).reshape(3, 3) + 1
    np.testing.assert_array_equal(rd(out), ref)


def test_dma_copy_gather_oob_error_and_skip():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    data = hbm(table)
    idx = _indices([1, 4, 3])
    dst = tile((3, 3))
    nisa.memset(dst=dst, value=-1.0)
    with pytest.raises(NkiValidationError, match=r"index 4 is out of bounds.*4 rows \(oob_mode=error\)"):
        nisa.dma_copy(dst=dst, src=data.ap([[3, 3], [1, 3]], vector_offset=idx, indirect_dim=0))
    nisa.dma_copy(dst=dst, src=data.ap([[3, 3], [1, 3]], vector_offset=idx, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(rd(dst), [table[1], [-1, -1, -1], table[3]])


def test_dma_copy_scatter_oob_skip():
    out = nl.ndarray((3, 2), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=hbm(np.zeros((3, 2), np.float32)))
    src = sb(np.ones((2, 2), np.float32))
    ap = out.ap([[2, 2], [1, 2]], vector_offset=_indices([5, 1]), indirect_dim=0)
    with pytest.raises(NkiValidationError, match=r"out of bounds"):
        nisa.dma_copy(dst=ap, src=src)
    nisa.dma_copy(dst=ap, src=src, oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(rd(out), [[0, 0], [1, 1], [0, 0]])


def test_dma_copy_dynamic_offset_register():
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    r = nisa.register_alloc(5)
    t = tile((2, 4))
    nisa.dma_copy(dst=t, src=hbm(x)[nl.ds(r, 2), :])
    np.testing.assert_array_equal(rd(t), x[5:7])


# ---- dma_transpose / dma_compute -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,axes", [((4, 8), (1, 0)), ((2, 3, 4), (2, 1, 0)), ((2, 3, 4, 5), (3, 1, 2, 0))])
def test_dma_transpose(shape, axes):
    x = rand(shape)
    dst = tile(tuple(shape[a] for a in axes))
    nisa.dma_transpose(dst=dst, src=hbm(x))
    assert_bits(dst, np.transpose(x, axes), np.float32)


def test_dma_transpose_rejects_other_axes_and_dtypes():
    with pytest.raises(NkiValidationError, match=r"axes=\(0, 1\) is not supported"):
        nisa.dma_transpose(dst=tile((4, 8)), src=hbm(rand((4, 8))), axes=(0, 1))
    with pytest.raises(NkiValidationError, match=r"must match"):
        nisa.dma_transpose(dst=tile((8, 4), nl.bfloat16), src=hbm(rand((4, 8))))


def test_dma_compute_dense_sums_sources_without_reading_dst():
    # AWS doc: dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...); dst itself is not an input.
    a, b, d0 = rand((4, 8), 1), rand((4, 8), 2), rand((4, 8), 3)
    dst = sb(d0)
    nisa.dma_compute(dst=dst, srcs=[hbm(a), sb(b)], reduce_op=nl.add, scales=[1.0, 1.0])
    np.testing.assert_allclose(rd(dst), a + b, rtol=1e-6)
    # accumulating means passing the destination as a source
    nisa.dma_compute(dst=dst, srcs=[dst, sb(b)], reduce_op=nl.add)
    np.testing.assert_allclose(rd(dst), a + 2 * b, rtol=1e-6)


def test_dma_compute_scales_other_than_one_rejected():
    with pytest.raises(NkiValidationError, match=r"all scales must be 1\.0"):
        nisa.dma_compute(dst=tile((2, 2)), srcs=[sb(np.ones((2, 2), np.float32))], reduce_op=nl.add, scales=[2.0])


def test_dma_compute_scatter_add_unique_indices():
    # AWS doc: scatter read-modify-write dst(HBM)[indices] += src(SB), unique indices only (C25)
    out = nl.ndarray((5, 2), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=hbm(np.ones((5, 2), np.float32)))
    src = sb(np.arange(8, dtype=np.float32).reshape(4, 2))
    ap = out.ap([[2, 4], [1, 2]], vector_offset=_indices([3, 0, 4, 1]), indirect_dim=0)
    nisa.dma_compute(dst=ap, srcs=[ap, src], reduce_op=nl.add)
    ref = np.ones((5, 2), np.float32)
    ref[[3, 0, 4, 1]] += np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(rd(out), ref)
    rep = out.ap([[2, 4], [1, 2]], vector_offset=_indices([3, 0, 3, 1]), indirect_dim=0)
    with pytest.raises(NkiValidationError, match=r"unique_indices=True but the scatter indices repeat.*\(C25\)"):
        nisa.dma_compute(dst=rep, srcs=[rep, src], reduce_op=nl.add)


def test_dma_compute_rejects_non_reduce_op():
    with pytest.raises(NkiValidationError, match=r"reduce_op=nl\.divide is not supported"):
        nisa.dma_compute(dst=tile((2, 2)), srcs=[sb(np.ones((2, 2), np.float32))], reduce_op=nl.divide)


# ---- tensor_copy / predicated / memset / iota / affine_select --------------------------------------------------------

def test_tensor_copy_same_dtype_is_bit_exact_for_int32():
    x = np.array([[2 ** 31 - 1, -(2 ** 31), 2 ** 24 + 1, 3]], np.int32)
    dst = tile((1, 4), nl.int32)
    nisa.tensor_copy(dst=dst, src=sb(x))
    assert_bits(dst, x, np.int32)


def test_tensor_copy_nan_payload_preserved_same_dtype():
    x = np.array([[0x7FC00001, 0xFFC00000]], np.uint32).view(np.float32)
    dst = tile((1, 2))
    nisa.tensor_copy(dst=dst, src=sb(x))
    assert_bits(dst, x, np.float32)


@pytest.mark.parametrize("engine", ["vector", "scalar", "gpsimd"])
def test_tensor_copy_cast_via_fp32(engine):
    x = rand((4, 8)) * 100
    dst = tile((4, 8), nl.bfloat16)
    nisa.tensor_copy(dst=dst, src=sb(x), engine=getattr(nisa.engine, engine))
    assert_bits(dst, x.astype(BF16), BF16)
    idst = tile((4, 8), nl.int8)
    nisa.tensor_copy(dst=idst, src=sb(x))
    assert_bits(idst, ref_cast(x, nl.int8), np.int8)


def test_tensor_copy_psum_to_sbuf_and_scalar_on_trn1(on_target):  # noqa: F811
    p = sb(rand((4, 4)), buffer=nl.psum)
    d = tile((4, 4))
    nisa.tensor_copy(dst=d, src=p)
    np.testing.assert_array_equal(rd(d), rd(p))
    on_target("trn1")
    with pytest.raises(NkiValidationError, match=r"not supported on ScalarE on NeuronCore-v2"):
        nisa.tensor_copy(dst=tile((4, 4)), src=sb(rand((4, 4))), engine=nisa.engine.scalar)


@pytest.mark.parametrize("reverse", [False, True])
def test_tensor_copy_predicated(reverse):
    x, d0 = rand((4, 6), 1), rand((4, 6), 2)
    mask = (rng(3).random((4, 6)) > 0.5).astype(np.uint8)
    dst = sb(d0)
    nisa.tensor_copy_predicated(dst=dst, src=sb(x), predicate=sb(mask), reverse_pred=reverse)
    sel = (mask == 0) if reverse else (mask != 0)
    np.testing.assert_array_equal(rd(dst), np.where(sel, x, d0))


def test_tensor_copy_predicated_scalar_src_and_dtype_checks():
    dst = sb(np.zeros((2, 3), np.float32))
    nisa.tensor_copy_predicated(dst=dst, src=7.5, predicate=sb(np.array([[1, 0, 1], [0, 0, 1]], np.uint16)))
    np.testing.assert_array_equal(rd(dst), [[7.5, 0, 7.5], [0, 0, 7.5]])
    with pytest.raises(NkiValidationError, match=r"predicate dtype must be uint8, uint16 or uint32"):
        nisa.tensor_copy_predicated(dst=dst, src=7.5, predicate=sb(np.ones((2, 3), np.float32)))
    with pytest.raises(NkiValidationError, match=r"must match"):
        nisa.tensor_copy_predicated(dst=dst, src=sb(np.ones((2, 3)), nl.bfloat16),
                                    predicate=sb(np.ones((2, 3), np.uint8)))


@pytest.mark.parametrize("dtype,value", [(nl.float32, 1.5), (nl.bfloat16, 3.140625), (nl.int32, -7), (nl.uint8, 200),
                                         (nl.float8_e4m3, 0.0)])
def test_memset(dtype, value):
    t = tile((4, 5), dtype)
    nisa.memset(dst=t, value=value)
    assert_bits(t, np.full((4, 5), value).astype(dtype.np), dtype.np)


def test_memset_integral_float_fills_int_dst():
    t = tile((2, 2), nl.uint8)
    nisa.memset(dst=t, value=0.0)
    assert_bits(t, np.zeros((2, 2), np.uint8), np.uint8)


def test_memset_value_type_must_match_int_dst():
    with pytest.raises(NkiValidationError, match=r"value type must match"):
        nisa.memset(dst=tile((2, 2), nl.int32), value=1.5)
    with pytest.raises(NkiValidationError, match=r"only supports value=0"):
        nisa.memset(dst=tile((2, 2), nl.float8_e4m3fn_x4), value=1)


def test_iota():
    t = tile((4, 2, 3), nl.int32)
    nisa.iota(dst=t, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
    c, a, b = np.meshgrid(np.arange(4), np.arange(2), np.arange(3), indexing="ij")
    assert_bits(t, 5 + 100 * c + 10 * a + b, np.int32)
    f = tile((2, 4), nl.float32)
    nisa.iota(dst=f, pattern=[[-1, 4]], channel_multiplier=1)
    np.testing.assert_array_equal(rd(f), np.arange(2)[:, None] - np.arange(4)[None, :])


def test_iota_wraps_int32_and_count_check():
    t = tile((1, 2), nl.int32)
    nisa.iota(dst=t, pattern=[[1, 2]], offset=2 ** 31 - 1)
    np.testing.assert_array_equal(rd(t), [[2 ** 31 - 1, -(2 ** 31)]])
    with pytest.raises(NkiValidationError, match=r"multiply to 3 but dst has 4"):
        nisa.iota(dst=tile((1, 4), nl.int32), pattern=[[1, 3]])


def test_affine_select_causal_mask():
    x = rand((4, 6))
    dst = tile((4, 6))
    nisa.affine_select(dst=dst, pattern=[[-1, 6]], channel_multiplier=1, on_true_tile=sb(x), on_false_value=-1e9,
                       cmp_op=nl.greater_equal)
    q, k = np.meshgrid(np.arange(4), np.arange(6), indexing="ij")
    np.testing.assert_array_equal(rd(dst), np.where(q - k >= 0, x, np.float32(-1e9)))


def test_affine_select_default_equal_and_cast():
    x = rand((3, 3))
    dst = tile((3, 3), nl.bfloat16)
    nisa.affine_select(dst=dst, pattern=[[-1, 3]], channel_multiplier=1, on_true_tile=sb(x), on_false_value=0.0)
    assert_bits(dst, np.where(np.eye(3, dtype=bool), x, 0).astype(BF16), BF16)


# ---- nc_matmul -------------------------------------------------------------------------------------------------------

def test_nc_matmul_basic_fp32():
    a, b = rand((64, 32), 1), rand((64, 100), 2)
    d = tile((32, 100), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b))
    assert rd(d).dtype == np.float32
    np.testing.assert_allclose(rd(d), a.T @ b, rtol=1e-5, atol=1e-5)


def test_nc_matmul_bf16_inputs_accumulate_in_fp32():
    a, b = rand((128, 16), 1), rand((128, 8), 2)
    ab, bb = a.astype(BF16), b.astype(BF16)
    d = tile((16, 8), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a, nl.bfloat16), moving=sb(b, nl.bfloat16))
    np.testing.assert_allclose(rd(d), ab.astype(np.float32).T @ bb.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_nc_matmul_accumulate_modes_per_element():
    a, b = np.ones((4, 2), np.float32), np.ones((4, 3), np.float32)
    s, m = sb(a), sb(b)
    d = tile((2, 6), buffer=nl.psum)
    nisa.nc_matmul(dst=d[:, 0:3], stationary=s, moving=m)            # None, first write: overwrite (NaN sentinel gone)
    nisa.nc_matmul(dst=d[:, 0:3], stationary=s, moving=m)            # None, written: accumulate
    np.testing.assert_array_equal(rd(d)[:, 0:3], 8.0)
    assert np.isnan(rd(d)[:, 3:]).all()
    nisa.nc_matmul(dst=d[:, 1:5], stationary=s, moving=sb(np.ones((4, 4), np.float32)))  # mixed: 1..2 add, 3..4 new
    np.testing.assert_array_equal(rd(d)[:, 0:5], [[8, 12, 12, 4, 4]] * 2)
    nisa.nc_matmul(dst=d[:, 0:3], stationary=s, moving=m, accumulate=False)
    np.testing.assert_array_equal(rd(d)[:, 0:3], 4.0)
    nisa.nc_matmul(dst=d[:, 0:3], stationary=s, moving=m, accumulate=True)
    np.testing.assert_array_equal(rd(d)[:, 0:3], 8.0)


def test_nc_matmul_accumulate_true_on_unwritten_treats_as_zero():
    d = tile((2, 3), buffer=nl.psum)
    with pytest.warns(UserWarning):
        nisa.nc_matmul(dst=d, stationary=sb(np.ones((4, 2), np.float32)), moving=sb(np.ones((4, 3), np.float32)),
                       accumulate=True)
    np.testing.assert_array_equal(rd(d), 4.0)


def test_nc_matmul_multi_dim_moving_free_dims():
    a, b = rand((8, 4), 1), rand((8, 3, 5), 2)
    d = tile((4, 3, 5), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b))
    np.testing.assert_allclose(rd(d), np.einsum("km,kab->mab", a, b), rtol=1e-5, atol=1e-5)


def test_nc_matmul_multi_dim_stationary_free_dims():
    a, b = rand((8, 2, 3), 1), rand((8, 5), 2)
    d = tile((6, 5), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b))
    np.testing.assert_allclose(rd(d), a.reshape(8, 6).T @ b, rtol=1e-5, atol=1e-5)


def test_nc_matmul_tiling_mode():
    a, b = rand((32, 32), 1), rand((32, 8), 2)
    d = tile((32, 8), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), tile_position=(32, 64), tile_size=(32, 32))
    np.testing.assert_allclose(rd(d), a.T @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(NkiValidationError, match=r"must both be set"):
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), tile_position=(0, 0))
    with pytest.raises(NkiValidationError, match=r"multiples of tile_size"):
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), tile_position=(16, 0), tile_size=(32, 32))
    with pytest.raises(NkiValidationError, match=r"must be one of \(32, 64, 128\)"):
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), tile_position=(0, 0), tile_size=(48, 32))


def test_nc_matmul_is_transpose_bit_exact():
    x = rand((8, 5)).astype(BF16)
    x[0, 0] = np.nan
    x[1, 1] = np.inf
    d = tile((5, 8), nl.bfloat16, nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(x.astype(np.float32), nl.bfloat16), moving=sb(np.eye(8, dtype=np.float32),
                                                                                      nl.bfloat16), is_transpose=True)
    assert_bits(d, x.T, BF16)
    with pytest.raises(NkiValidationError, match=r"identity"):
        nisa.nc_matmul(dst=d, stationary=sb(x.astype(np.float32), nl.bfloat16),
                       moving=sb(np.ones((8, 8), np.float32), nl.bfloat16), is_transpose=True)


def test_nc_matmul_fp8_double_row():
    a = rng(1).integers(-3, 4, size=(16, 2, 4)).astype(np.float32)
    b = rng(2).integers(-3, 4, size=(16, 2, 6)).astype(np.float32)
    d = tile((4, 6), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a, nl.float8_e4m3), moving=sb(b, nl.float8_e5m2),
                   perf_mode=nisa.matmul_perf_mode.double_row)
    np.testing.assert_array_equal(rd(d), a.reshape(32, 4).T @ b.reshape(32, 6))


# ---- nc_transpose ----------------------------------------------------------------------------------------------------

def test_nc_transpose_tensor_engine():
    x = rand((16, 40))
    d = tile((40, 16), buffer=nl.psum)
    nisa.nc_transpose(dst=d, data=sb(x))
    assert_bits(d, x.T, np.float32)
    assert nisa.nc_transpose.__name__ == "nc_transpose"


@pytest.mark.parametrize("dst_buf", ["sbuf", "psum"])
def test_nc_transpose_vector_engine(dst_buf):
    x = rand((8, 32)).astype(BF16)
    d = tile((32, 8), nl.bfloat16, getattr(nl, dst_buf))
    nisa.nc_transpose(dst=d, data=sb(x.astype(np.float32), nl.bfloat16), engine=nisa.engine.vector)
    assert_bits(d, x.T, BF16)


def test_nc_transpose_multi_free_dims_flattened():
    x = rand((4, 2, 3))
    d = tile((6, 4), buffer=nl.psum)
    nisa.nc_transpose(dst=d, data=sb(x))
    np.testing.assert_array_equal(rd(d), x.reshape(4, 6).T)


# ---- tensor_tensor / tensor_scalar / scalar_tensor_tensor ------------------------------------------------------------

_TT = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide, "maximum": np.maximum,
       "minimum": np.minimum, "power": np.power, "greater": np.greater, "less_equal": np.less_equal,
       "equal": np.equal, "not_equal": np.not_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
       "logical_xor": np.logical_xor}


@pytest.mark.parametrize("op", sorted(_TT))
@pytest.mark.parametrize("dst_dtype", [nl.float32, nl.bfloat16])
def test_tensor_tensor_arith(op, dst_dtype):
    a, b = rand((4, 8), 1, 0.1, 3.0), rand((4, 8), 2, 0.1, 3.0)
    b[0, :4] = a[0, :4]  # equal elements for the comparisons
    if op.startswith("logical"):
        a[1] = 0.0
    d = tile((4, 8), dst_dtype)
    nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=getattr(nl, op))
    with np.errstate(all="ignore"):
        ref = _TT[op](a, b).astype(np.float32)
    assert_bits(d, ref.astype(dst_dtype.np), dst_dtype.np)


def test_tensor_tensor_mixed_input_dtypes_and_shapes():
    a, b = rand((4, 6), 1), rand((4, 2, 3), 2)
    d = tile((4, 3, 2), nl.float16)
    nisa.tensor_tensor(dst=d, data1=sb(a, nl.bfloat16), data2=sb(b), op=nl.multiply)
    ref = a.astype(BF16).astype(np.float32) * b.reshape(4, 6)
    assert_bits(d, ref.reshape(4, 3, 2).astype(np.float16), np.float16)


@pytest.mark.parametrize("op,fn", [("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
                                   ("bitwise_xor", np.bitwise_xor)])
def test_tensor_tensor_bitvec_ints(op, fn):
    a = rng(1).integers(0, 2 ** 16, size=(4, 8)).astype(np.int32)
    b = rng(2).integers(0, 2 ** 16, size=(4, 8)).astype(np.int32)
    d = tile((4, 8), nl.int32)
    nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=getattr(nl, op))
    assert_bits(d, fn(a, b), np.int32)
    with pytest.raises(NkiValidationError, match=r"needs integer dtypes"):
        nisa.tensor_tensor(dst=tile((4, 8)), data1=sb(a), data2=sb(b), op=getattr(nl, op))


def test_tensor_tensor_int32_gpsimd_is_exact_and_wraps():
    a = np.array([[2 ** 24 + 1, 2 ** 31 - 1]], np.int32)
    b = np.array([[1, 1]], np.int32)
    d = tile((1, 2), nl.int32)
    nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=nl.add)  # all-int32 defaults to GpSimd
    np.testing.assert_array_equal(rd(d), [[2 ** 24 + 2, -(2 ** 31)]])
    d2 = tile((1, 2), nl.int32)
    nisa.tensor_tensor(dst=d2, data1=sb(a), data2=sb(b), op=nl.add, engine=nisa.engine.vector)
    # VectorE: fp32 math (2**24 + 1 rounds to 2**24) and a saturating cast back (2**31 -> 2**31 - 1)
    np.testing.assert_array_equal(rd(d2), [[2 ** 24, 2 ** 31 - 1]])


@pytest.mark.parametrize("reverse0", [False, True])
@pytest.mark.parametrize("reverse1", [False, True])
def test_tensor_scalar_two_ops_reverse(reverse0, reverse1):
    x = rand((4, 8), 1, 0.5, 2.0)
    d = tile((4, 8))
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.subtract, operand0=3.0, reverse0=reverse0, op1=nl.divide,
                       operand1=2.0, reverse1=reverse1)
    r = (np.float32(3.0) - x) if reverse0 else (x - np.float32(3.0))
    r = (np.float32(2.0) / r) if reverse1 else (r / np.float32(2.0))
    np.testing.assert_array_equal(rd(d), r)


def test_tensor_scalar_p1_operands():
    x, s, t = rand((4, 8), 1), rand((4, 1), 2), rand((4, 1), 3)
    d = tile((4, 8), nl.bfloat16)
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.multiply, operand0=sb(s), op1=nl.add, operand1=sb(t))
    assert_bits(d, (x * s + t).astype(BF16), BF16)
    pd = tile((4, 8))
    nisa.tensor_scalar(dst=pd, data=sb(x), op0=nl.maximum, operand0=sb(s, buffer=nl.psum))
    np.testing.assert_array_equal(rd(pd), np.maximum(x, s))


def test_tensor_scalar_unary_op0():
    x = rand((2, 8), 1, 0.25, 4.0)
    x[0, 0] = -x[0, 0]
    d = tile((2, 8))
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.abs, operand0=None)
    np.testing.assert_array_equal(rd(d), np.abs(x))
    nisa.tensor_scalar(dst=d, data=sb(np.abs(x)), op0=nl.rsqrt, operand0=0)
    np.testing.assert_allclose(rd(d), 1 / np.sqrt(np.abs(x)), rtol=1e-6)


@pytest.mark.parametrize("op,operand,fn", [
    ("bitwise_and", 0x0F0F, lambda a, v: a & v), ("bitwise_or", 0x100, lambda a, v: a | v),
    ("bitwise_xor", -1, lambda a, v: a ^ v), ("left_shift", 3, lambda a, v: a << v),
    ("right_shift", 2, lambda a, v: a >> v)])
def test_tensor_scalar_bitvec_ints(op, operand, fn):
    a = rng(1).integers(0, 2 ** 12, size=(4, 8)).astype(np.int32)
    d = tile((4, 8), nl.int32)
    nisa.tensor_scalar(dst=d, data=sb(a), op0=getattr(nl, op), operand0=operand)
    assert_bits(d, fn(a.astype(np.int64), operand), np.int32)


def test_tensor_scalar_bitvec_rules():
    a = sb(np.ones((2, 2), np.int32))
    with pytest.raises(NkiValidationError, match=r"both be arithmetic or both bit-vector"):
        nisa.tensor_scalar(dst=tile((2, 2), nl.int32), data=a, op0=nl.bitwise_and, operand0=1, op1=nl.add,
                           operand1=1.0)
    with pytest.raises(NkiValidationError, match=r"need integer data/dst"):
        nisa.tensor_scalar(dst=tile((2, 2)), data=a, op0=nl.bitwise_and, operand0=1)


def test_tensor_scalar_scalar_engine_pairs_on_trn2():
    x = rand((2, 4))
    d = tile((2, 4))
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0,
                       engine=nisa.engine.scalar)
    np.testing.assert_array_equal(rd(d), x * 2 + 1)
    with pytest.raises(NkiValidationError, match=r"ScalarE on trn2 supports"):
        nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.maximum, operand0=2.0, engine=nisa.engine.scalar)


@pytest.mark.parametrize("reverse0,reverse1", [(False, False), (True, True)])
def test_scalar_tensor_tensor(reverse0, reverse1):
    x, y, s = rand((4, 8), 1, 0.5, 2), rand((4, 8), 2, 0.5, 2), rand((4, 1), 3, 0.5, 2)
    d = tile((4, 8))
    nisa.scalar_tensor_tensor(dst=d, data=sb(x), op0=nl.subtract, operand0=sb(s), op1=nl.divide, operand1=sb(y),
                              reverse0=reverse0, reverse1=reverse1)
    r = (s - x) if reverse0 else (x - s)
    r = (y / r) if reverse1 else (r / y)
    np.testing.assert_array_equal(rd(d), r)


def test_scalar_tensor_tensor_bf16_tensor_operand0():
    """operand0 as a bf16 (P, 1) tensor is accepted (no dtype is documented for it; moe_cte passes bf16)."""
    x, s = rand((4, 8), 1, 0.5, 2), rand((4, 1), 3, 0.5, 2).astype(BF16)
    d = tile((4, 8))
    nisa.scalar_tensor_tensor(dst=d, data=sb(x), op0=nl.multiply, operand0=sb(s, nl.bfloat16), op1=nl.add,
                              operand1=sb(x))
    np.testing.assert_array_equal(rd(d), x * s.astype(np.float32) + x)


# ---- tensor_reduce / reciprocal --------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,fn", [("add", np.sum), ("maximum", np.max), ("minimum", np.min), ("multiply", np.prod)])
def test_tensor_reduce_last_axis(op, fn):
    x = rand((4, 8), 1, 0.5, 1.5)
    d = tile((4, 1))
    nisa.tensor_reduce(dst=d, op=getattr(nl, op), data=sb(x), axis=1)
    np.testing.assert_allclose(rd(d), fn(x, axis=1, keepdims=True), rtol=1e-6)


def test_tensor_reduce_multiple_axes_negate_keepdims():
    x = rand((4, 3, 5, 2))
    d = tile((4, 3, 1, 1))
    nisa.tensor_reduce(dst=d, op=nl.maximum, data=sb(x), axis=(2, 3), negate=True, keepdims=True)
    np.testing.assert_array_equal(rd(d), -x.max(axis=(2, 3), keepdims=True))
    d2 = tile((4, 3))
    nisa.tensor_reduce(dst=d2, op=nl.add, data=sb(x), axis=(-2, -1))
    np.testing.assert_allclose(rd(d2), x.sum(axis=(2, 3)), rtol=1e-5, atol=1e-6)
    d3 = tile((4, 1), nl.bfloat16)
    nisa.tensor_reduce(dst=d3, op=nl.add, data=sb(x), axis=(1, 2, 3))
    assert rd(d3).dtype == BF16


def test_tensor_reduce_bitvec_and_illegal_op():
    a = rng(1).integers(0, 256, size=(2, 5)).astype(np.int32)
    d = tile((2, 1), nl.int32)
    nisa.tensor_reduce(dst=d, op=nl.bitwise_or, data=sb(a), axis=1)
    np.testing.assert_array_equal(rd(d), np.bitwise_or.reduce(a, axis=1, keepdims=True))
    with pytest.raises(NkiValidationError, match=r"not a legal reduction"):
        nisa.tensor_reduce(dst=tile((2, 1)), op=nl.divide, data=sb(rand((2, 5))), axis=1)


def test_reciprocal():
    x = rand((4, 8), 1, 0.1, 4)
    x[0, 0] = 0.0
    d = tile((4, 8))
    nisa.reciprocal(dst=d, data=sb(x))
    with np.errstate(divide="ignore"):
        np.testing.assert_array_equal(rd(d), np.float32(1) / x)


# ---- activation ------------------------------------------------------------------------------------------------------

_ACT = {"exp": np.exp, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0), "square": np.square,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)), "abs": np.abs,
        "copy": lambda x: x, "sin": np.sin, "arctan": np.arctan, "log": np.log,
        "softplus": lambda x: np.log1p(np.exp(x)),
        "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))}


@pytest.mark.parametrize("op", sorted(_ACT))
def test_activation_ops(op):
    x = rand((4, 16), 1, -1.5, 1.5)  # inside every function's valid ScalarE range (C20)
    if op == "log":
        x = np.abs(x) + 0.01
    d = tile((4, 16))
    nisa.activation(dst=d, op=getattr(nl, op), data=sb(x))
    np.testing.assert_allclose(rd(d), _ACT[op](x.astype(np.float64)), rtol=2e-6, atol=1e-6)


def test_activation_scale_bias_and_cast():
    x, s, b = rand((4, 8), 1), rand((4, 1), 2), rand((4, 1), 3)
    d = tile((4, 8), nl.bfloat16)
    nisa.activation(dst=d, op=nl.exp, data=sb(x), bias=sb(b), scale=sb(s))
    ref = np.exp((x * s + b).astype(np.float64)).astype(np.float32).astype(BF16)
    assert_bits(d, ref, BF16)
    d2 = tile((4, 8))
    nisa.activation(dst=d2, op=nl.copy, data=sb(x), bias=0.5, scale=2.0)  # scalar bias: v3+
    np.testing.assert_array_equal(rd(d2), x * 2 + 0.5)


def test_activation_bias_shape_and_dtype_rules(on_target):  # noqa: F811
    x = sb(rand((4, 8)))
    with pytest.raises(NkiValidationError, match=r"bias must be a \(4, 1\) tensor"):
        nisa.activation(dst=tile((4, 8)), op=nl.exp, data=x, bias=sb(rand((4, 2))))
    with pytest.raises(NkiValidationError, match=r"bias cannot be tfloat32"):
        nisa.activation(dst=tile((4, 8)), op=nl.exp, data=x, bias=tile((4, 1), nl.tfloat32))
    with pytest.raises(NkiValidationError, match=r"not an activation function"):
        nisa.activation(dst=tile((4, 8)), op=nl.add, data=x)
    on_target("trn1")
    with pytest.raises(NkiValidationError, match=r"scalar bias requires NeuronCore-v3"):
        nisa.activation(dst=tile((4, 8)), op=nl.exp, data=sb(rand((4, 8))), bias=1.0)


def test_activation_reduce_res_accumulation():
    x1, x2 = rand((4, 8), 1), rand((4, 8), 2)
    res = tile((4, 1))
    d = tile((4, 8))
    nisa.activation(dst=d, op=nl.exp, data=sb(x1), reduce_op=nl.add, reduce_res=res,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    e1 = np.exp(x1.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(rd(res), e1.sum(1, keepdims=True), rtol=1e-6)
    nisa.activation(dst=d, op=nl.exp, data=sb(x2), reduce_op=nl.add, reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce)
    e2 = np.exp(x2.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(rd(res), (e1.sum(1) + e2.sum(1))[:, None], rtol=1e-6)
    nisa.activation(dst=d, op=nl.copy, data=sb(x1), reduce_op=nl.add, reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset)
    np.testing.assert_array_equal(rd(res), 0.0)
    nisa.activation_reduce(dst=d, op=nl.square, data=sb(x1), reduce_op=nl.add, reduce_res=res)
    np.testing.assert_allclose(rd(res), (x1 * x1).sum(1, keepdims=True), rtol=1e-6)
    with pytest.raises(NkiValidationError, match=r"reduce_op must be nl\.add"):
        nisa.activation(dst=d, op=nl.exp, data=sb(x1), reduce_op=nl.maximum, reduce_res=res)


# ---- exponential (trn3) / bn_stats / bn_aggr -------------------------------------------------------------------------

def test_exponential_trn3(on_target):  # noqa: F811
    on_target("trn3")
    x, m = rand((4, 8), 1), rand((4, 1), 2)
    d, res = tile((4, 8)), tile((4, 1))
    nisa.exponential(dst=d, src=sb(x), max_value=sb(m), reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    e = np.exp((x - m).astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(rd(d), e, rtol=1e-6)
    np.testing.assert_allclose(rd(res), e.sum(1, keepdims=True), rtol=1e-6)
    nisa.exponential(dst=d, src=sb(x), max_value=1.0, reduce_res=res, reduce_cmd=nisa.reduce_cmd.load_reduce,
                     reduce_init=10.0)
    np.testing.assert_allclose(rd(res), 10 + np.exp(x.astype(np.float64) - 1).sum(1, keepdims=True), rtol=1e-6)


def test_bn_stats_bn_aggr_mean_var():
    x = rand((4, 300), 1)
    x2 = rand((4, 200), 2)
    st = tile((4, 2, 6))
    nisa.bn_stats(dst=st[:, 0, :], data=sb(x))
    nisa.bn_stats(dst=st[:, 1, :], data=sb(x2))
    s0 = rd(st)[:, 0]
    np.testing.assert_allclose(s0[:, 0], 150)
    np.testing.assert_allclose(s0[:, 1], x[:, 0::2].mean(1), rtol=1e-5)
    np.testing.assert_allclose(s0[:, 2], x[:, 0::2].var(1) * 150, rtol=1e-4)
    agg = tile((4, 2))
    nisa.bn_aggr(dst=agg, data=st)
    allx = np.concatenate([x, x2], axis=1).astype(np.float64)
    np.testing.assert_allclose(rd(agg)[:, 0], allx.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rd(agg)[:, 1], allx.var(1), rtol=1e-5)


# ---- registers and runtime loops -------------------------------------------------------------------------------------

def test_registers_alloc_move_load_store():
    r = nisa.register_alloc(3)
    assert r.value == 3
    nisa.register_move(r, 11)
    assert r.value == 11
    r2 = nisa.register_alloc()
    nisa.register_move(r2, r)
    assert r2.value == 11
    nisa.register_load(r, sb(np.array([[42]], np.int32)))
    assert r.value == 42
    nisa.register_load(r, sb(np.array([[7.9]], np.float32)))
    assert r.value == 7
    out = tile((1, 1), nl.int32)
    nisa.register_store(out, r2)
    np.testing.assert_array_equal(rd(out), [[11]])
    with pytest.raises(NkiValidationError, match=r"1-element tensor"):
        nisa.register_load(r, sb(np.ones((1, 2), np.int32)))


def test_fori_loop_and_frozen_register():
    acc = sb(np.zeros((2, 4), np.float32))
    x = hbm(np.arange(40, dtype=np.float32).reshape(10, 4))
    seen = []

    def body(i):
        seen.append(i.value)
        row = tile((1, 4))
        nisa.dma_copy(dst=row, src=x[nl.ds(i, 1), :])
        nisa.tensor_tensor(dst=acc[0:1, :], data1=acc[0:1, :], data2=row, op=nl.add)
        with pytest.raises(NkiValidationError, match=r"frozen"):
            nisa.register_move(i, 0)

    nl.fori_loop(2, 9, body, step=3)
    assert seen == [2, 5, 8]
    np.testing.assert_array_equal(rd(acc)[0], np.arange(40).reshape(10, 4)[[2, 5, 8]].sum(0))
    with pytest.raises(NkiValidationError, match=r"positive"):
        nl.fori_loop(0, 3, body, step=0)


def test_while_loop_counts_down_register():
    r = nisa.register_alloc(4)
    count = []

    def body(cond):
        count.append(cond.value)
        nisa.register_move(cond, cond.value - 1)
        return cond

    nl.while_loop(r, body)
    assert count == [4, 3, 2, 1]
    assert r.value == 4  # the body gets the condition by value
    with pytest.raises(NkiValidationError, match=r"not allowed inside nl.no_reorder"):
        with nl.no_reorder():
            nl.while_loop(nisa.register_alloc(1), body)


def test_dynamic_range_with_register_bound_under_parser(monkeypatch):
    """0.6 semantics, kept under NKI_COMPILER_FRONTEND=custom; the 0.7 tracer rejects it (test_frontend.py)."""
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
    assert list(nl.dynamic_range(nisa.register_alloc(3))) == [0, 1, 2]


# ---- nl convenience API ----------------------------------------------------------------------------------------------

def test_nl_creation():
    z = nl.zeros((4, 8), nl.bfloat16)
    assert z.buffer is nl.sbuf and rd(z).dtype == BF16 and (rd(z) == 0).all()
    o = nl.ones((2, 3), nl.int32)
    assert_bits(o, np.ones((2, 3)), np.int32)
    f = nl.full((2, 3), 2.5, nl.float16, buffer=nl.psum)
    assert f.buffer is nl.psum and (rd(f) == 2.5).all() and rd(f).dtype == np.float16
    zl = nl.zeros_like(f, dtype=nl.float32)
    assert zl.shape == (2, 3) and zl.buffer is nl.psum and rd(zl).dtype == np.float32
    ol = nl.ones_like(o)
    assert_bits(ol, np.ones((2, 3)), np.int32)
    fl = nl.full_like(o, 9)
    assert_bits(fl, np.full((2, 3), 9), np.int32)
    e = nl.empty_like(o, buffer=nl.sbuf)
    assert (rd(e) == 4).all()
    h = nl.zeros((5,), nl.float32, buffer=nl.shared_hbm)
    assert h.shape == (5,) and (rd(h) == 0).all()
    with pytest.raises(NkiValidationError, match=r">= 2 dims"):
        nl.ndarray((5,), nl.float32, buffer=nl.sbuf)


def test_nl_load_store_copy():
    x = rand((4, 8))
    t = nl.load(hbm(x))
    assert t.buffer is nl.sbuf and t.shape == (4, 8)
    tb = nl.load(hbm(x), dtype=nl.bfloat16)
    assert_bits(tb, x.astype(BF16), BF16)
    c = nl.copy(tb, dtype=nl.float32)
    np.testing.assert_array_equal(rd(c), x.astype(BF16).astype(np.float32))
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nl.store(out, c)
    np.testing.assert_array_equal(rd(out), rd(c))
    with pytest.raises(NkiValidationError, match=r"PSUM"):
        nl.store(out, sb(x, buffer=nl.psum))
    v = nl.load(hbm(np.arange(5, dtype=np.float32)))  # 1-D HBM -> (1, 5) tile
    assert v.shape == (1, 5)


def test_nl_matmul_and_transpose():
    a, b = rand((16, 8), 1), rand((16, 12), 2)
    p = nl.matmul(sb(a), sb(b), transpose_x=True)
    assert p.buffer is nl.psum and rd(p).dtype == np.float32
    np.testing.assert_allclose(rd(p), a.T @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(NkiValidationError, match=r"transpose_x=True"):
        nl.matmul(sb(a), sb(b))
    t = nl.transpose(sb(a))
    assert t.buffer is nl.psum
    np.testing.assert_array_equal(rd(t), a.T)
    tb = nl.transpose(sb(a), dtype=nl.bfloat16)  # dtype= is honoured, not dropped
    assert tb.dtype is nl.bfloat16
    np.testing.assert_allclose(rd(tb).astype(np.float32), a.T, rtol=1e-2, atol=1e-2)
    lt = nl.load_transpose2d(hbm(a))
    np.testing.assert_array_equal(rd(lt), a.T)


@pytest.mark.parametrize("name,fn", [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
                                     ("maximum", np.maximum), ("minimum", np.minimum), ("divide", np.divide)])
def test_nl_binary(name, fn):
    a, b = rand((4, 8), 1, 0.5, 2), rand((4, 8), 2, 0.5, 2)
    op = getattr(nl, name)
    np.testing.assert_array_equal(rd(op(sb(a), sb(b))), fn(a, b))
    np.testing.assert_array_equal(rd(op(sb(a), 1.5)), fn(a, np.float32(1.5)))
    np.testing.assert_array_equal(rd(op(1.5, sb(a))), fn(np.float32(1.5), a))
    col = rand((4, 1), 3, 0.5, 2)
    np.testing.assert_array_equal(rd(op(sb(a), sb(col))), fn(a, col))
    out = op(sb(a, nl.bfloat16), sb(b, nl.bfloat16))
    assert rd(out).dtype == BF16  # result dtype defaults to the input dtype
    out32 = op(sb(a, nl.bfloat16), sb(b, nl.bfloat16), dtype=nl.float32)
    assert rd(out32).dtype == np.float32
    with pytest.raises(NkiValidationError, match=r"do not broadcast"):
        op(sb(a), sb(rand((4, 4))))


def test_nl_comparisons_return_one_zero_in_input_dtype():
    a, b = np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[2.0, 2.0, 2.0]], np.float32)
    r = nl.greater(sb(a), sb(b))
    np.testing.assert_array_equal(rd(r), [[0, 0, 1]])
    assert rd(r).dtype == np.float32


@pytest.mark.parametrize("name,fn", [("exp", np.exp), ("tanh", np.tanh), ("sqrt", np.sqrt), ("log", np.log),
                                     ("rsqrt", lambda x: 1 / np.sqrt(x)), ("negative", np.negative),
                                     ("square", np.square), ("sign", np.sign), ("floor", np.floor)])
def test_nl_unary(name, fn):
    x = rand((4, 8), 1, 0.1, 3)
    r = getattr(nl, name)(sb(x))
    np.testing.assert_allclose(rd(r), fn(x.astype(np.float64)), rtol=2e-6)
    rb = getattr(nl, name)(sb(x), dtype=nl.bfloat16)
    assert rd(rb).dtype == BF16


@pytest.mark.parametrize("name,fn", [("sum", np.sum), ("max", np.max), ("min", np.min), ("mean", np.mean),
                                     ("prod", np.prod), ("var", np.var)])
def test_nl_reductions(name, fn):
    x = rand((4, 3, 5), 1, 0.5, 1.5)
    keep = name == "var"  # AWS: var ignores keepdims and always returns the keepdims=True shape
    r = getattr(nl, name)(sb(x), axis=(1, 2))
    assert r.shape == ((4, 1, 1) if keep else (4, 1))
    np.testing.assert_allclose(rd(r).reshape(4), fn(x.astype(np.float64), axis=(1, 2)), rtol=2e-5)
    r1 = getattr(nl, name)(sb(x), axis=2)
    assert r1.shape == ((4, 3, 1) if keep else (4, 3))
    np.testing.assert_allclose(rd(r1).reshape(4, 3), fn(x.astype(np.float64), axis=2), rtol=2e-5)
    if name != "var":
        rk = getattr(nl, name)(sb(x), axis=2, keepdims=True)
        assert rk.shape == (4, 3, 1)


def test_nl_softmax_rms_norm_where():
    x = rand((4, 16), 1) * 4
    s = nl.softmax(sb(x), axis=-1)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(rd(s), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    w = rand((4, 16), 2)
    r = nl.rms_norm(sb(x), sb(w), axis=1, n=16, epsilon=1e-6)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rd(r), ref, rtol=1e-5, atol=1e-6)
    cond = (rand((4, 16), 3) > 0).astype(np.float32)
    y = rand((4, 16), 4)
    wh = nl.where(sb(cond), sb(x), sb(y))
    np.testing.assert_array_equal(rd(wh), np.where(cond != 0, x, y))
    wh2 = nl.where(sb(cond), sb(x), 0.0)
    np.testing.assert_array_equal(rd(wh2), np.where(cond != 0, x, 0))


def test_nl_shared_constant_identity_and_device_print(capsys, tmp_path):
    c = nl.shared_constant(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert c.buffer is nl.shared_hbm and c.dtype == nl.int32
    np.save(tmp_path / "c.npy", np.ones((2, 2), np.float32))
    c2 = nl.shared_constant(str(tmp_path / "c.npy"), dtype=nl.bfloat16)
    assert rd(c2).dtype == BF16
    eye = nl.shared_identity_matrix(4)
    assert eye.dtype == nl.uint8 and eye.buffer is nl.sbuf
    np.testing.assert_array_equal(rd(eye), np.eye(4))
    eye_sb = nl.shared_identity_matrix(4, dtype=nl.bfloat16, dst=tile((4, 4), nl.bfloat16))
    np.testing.assert_array_equal(rd(eye_sb).astype(np.float32), np.eye(4))
    nl.device_print("dbg", c)
    assert "dbg" in capsys.readouterr().out
    with pytest.raises(NkiValidationError, match=r"constant string"):
        nl.device_print(3, c)
    with pytest.raises(NkiValidationError, match=r"SBUF or HBM"):
        nl.device_print("p", tile((2, 2), buffer=nl.psum))


def test_nl_program_id_num_programs_outside_and_inside_kernel():
    assert nl.program_id(0) == 0 and nl.num_programs() == 1

    @nki.jit
    def k(x):
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t[:, 0:1], value=nl.program_id(0))
        nisa.memset(dst=t[:, 1:2], value=nl.num_programs())
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(k(np.zeros(1, np.float32)), [[0, 1]])
    with pytest.raises(NkiValidationError, match=r"only axis 0"):
        nl.program_id(1)


def test_no_reorder_context():
    with nl.no_reorder():
        t = nl.zeros((2, 2), nl.float32)
        with pytest.raises(NkiValidationError, match=r"not allowed inside nl.no_reorder"):
            nl.fori_loop(0, 2, lambda i: None)
    assert (rd(t) == 0).all()
