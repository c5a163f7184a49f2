"""Indexing rules of nki-api.md §3.3, case by case, and the NkiTensor view methods (views share storage)."""

import ml_dtypes
import numpy as np
import pytest

from nkisim.errors import NkiValidationError

from ._sim import fresh_core, hbm, nisa, nl, rd, sb, tile  # noqa: F401

BASE = np.arange(64 * 8 * 32, dtype=np.float32).reshape(64, 8, 32)


@pytest.fixture
def t():
    return sb(BASE)


@pytest.fixture
def h():
    return hbm(np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6))


def test_fresh_tensor_attributes():
    a = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    assert a.strides == (64, 1) and a.offset == 0 and a.shape == (128, 64)
    assert a.ndim == 2 and a.size == 128 * 64 and a.dtype == nl.float32 and a.buffer is nl.sbuf
    assert a.itemsize == 4 and len(a) == 128


# ---- on-chip: partition dim kept, >= 2-D -------------------------------------------------------------------------

@pytest.mark.parametrize("key,shape,ref", [
    ((0, 0, 10), (1, 1), BASE[0:1, 0, 10:11]),
    ((slice(None), 0, 10), (64, 1), BASE[:, 0, 10:11]),
    ((0,), (1, 8, 32), BASE[0:1]),
    ((slice(None), 3), (64, 32), BASE[:, 3]),
    ((5, slice(None), 7), (1, 8), BASE[5:6, :, 7]),
    ((slice(2, 6), slice(1, 3), slice(None, None, 3)), (4, 2, 11), BASE[2:6, 1:3, ::3]),
])
def test_on_chip_integer_indexing(t, key, shape, ref):
    v = t[key]
    assert v.shape == shape
    np.testing.assert_array_equal(rd(v), ref.reshape(shape))


def test_on_chip_negative_indices_steps_ellipsis(t):
    np.testing.assert_array_equal(rd(t[-1]), BASE[-1:])
    np.testing.assert_array_equal(rd(t[:, -3:, -1]), BASE[:, -3:, -1])
    np.testing.assert_array_equal(rd(t[:, ::-1, 30:10:-5]), BASE[:, ::-1, 30:10:-5])
    np.testing.assert_array_equal(rd(t[..., 0]), BASE[..., 0])
    assert t[0, ...].shape == (1, 8, 32)
    assert t[..., 2, 4].shape == (64, 1)
    np.testing.assert_array_equal(rd(t[1:3, ..., 4]), BASE[1:3, :, 4])


def test_on_chip_ds(t):
    v = t[nl.ds(8, 4), nl.ds(2, 3), 5]
    assert v.shape == (4, 3)
    np.testing.assert_array_equal(rd(v), BASE[8:12, 2:5, 5])
    r = nisa.register_alloc(6)
    np.testing.assert_array_equal(rd(t[:, nl.ds(r, 2), 0]), BASE[:, 6:8, 0])
    idx = sb(np.array([[4]], np.int32))
    np.testing.assert_array_equal(rd(t[:, 1, nl.ds(idx, 3)]), BASE[:, 1, 4:7])
    np.testing.assert_array_equal(rd(t[:, r, 0]), BASE[:, 6, 0:1])  # register as an integer index


def test_index_bounds_are_checked(t):
    with pytest.raises(IndexError, match=r"out of range"):
        t[64]
    with pytest.raises(IndexError, match=r"out of range"):
        t[:, 0:9]  # NumPy would clamp; an out-of-range slice is a kernel bug
    with pytest.raises(IndexError, match=r"out of range"):
        t[:, nl.ds(6, 3)]
    with pytest.raises(IndexError, match=r"too many indices"):
        t[0, 0, 0, 0]
    with pytest.raises(IndexError, match=r"advanced indexing"):
        t[sb(np.zeros((2, 1), np.int32))]
    with pytest.raises(IndexError, match=r"nl.ds"):
        t[:, nisa.register_alloc(1):3]


# ---- HBM: integer dims dropped -------------------------------------------------------------------------------------

def test_hbm_drops_integer_dims(h):
    ref = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
    assert h[1].shape == (5, 6)
    assert h[1, 2].shape == (6,)
    assert h[1, 2, 3].shape == (1,)  # at least 1-D
    assert h[:, 2].shape == (4, 6)
    np.testing.assert_array_equal(rd(h[-1, :, 1::2]), ref[-1, :, 1::2])
    np.testing.assert_array_equal(rd(h[..., -1]), ref[..., -1])
    np.testing.assert_array_equal(rd(h[1, 2, 3]), [ref[1, 2, 3]])
    np.testing.assert_array_equal(rd(h[nl.ds(1, 2), 0]), ref[1:3, 0])


# ---- view methods -------------------------------------------------------------------------------------------------

def test_slice_select(t):
    np.testing.assert_array_equal(rd(t.slice(2, 4, 20, 4)), BASE[:, :, 4:20:4])
    np.testing.assert_array_equal(rd(t.select(1, 3)), BASE[:, 3])
    np.testing.assert_array_equal(rd(t.select(1, nisa.register_alloc(5))), BASE[:, 5])


def test_permute(t):
    v = t.permute((0, 2, 1))
    assert v.shape == (64, 32, 8)
    np.testing.assert_array_equal(rd(v), BASE.transpose(0, 2, 1))
    with pytest.raises(NkiValidationError, match=r"partition dim"):
        t.permute((1, 0, 2))
    with pytest.raises(ValueError, match=r"not a permutation"):
        t.permute((0, 1, 1))


def test_permute_hbm_can_move_dim0(h):
    ref = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
    np.testing.assert_array_equal(rd(h.permute((2, 0, 1))), ref.transpose(2, 0, 1))


def test_broadcast_expand_squeeze(t):
    col = t[:, 0, 0]  # (64, 1)
    b = col.broadcast(1, 7)
    assert b.shape == (64, 7) and b.strides[1] == 0
    np.testing.assert_array_equal(rd(b), np.repeat(BASE[:, 0, 0:1], 7, axis=1))
    with pytest.raises(ValueError, match=r"must be 1"):
        t.broadcast(1, 4)
    with pytest.raises(NkiValidationError, match=r"across partitions"):
        t[0:1, 0, :].broadcast(0, 4)
    e = t[:, 0, :].expand_dim(1)
    assert e.shape == (64, 1, 32)
    np.testing.assert_array_equal(rd(e.squeeze_dim(1)), BASE[:, 0, :])
    with pytest.raises(NkiValidationError, match=r">= 2-D"):
        t[:, 0, 0].squeeze_dim(1)
    with pytest.raises(NkiValidationError):
        t.expand_dim(0)


def test_reshape_dim_flatten_reshape(t):
    r = t.reshape_dim(2, (4, 8))
    assert r.shape == (64, 8, 4, 8)
    np.testing.assert_array_equal(rd(r), BASE.reshape(64, 8, 4, 8))
    f = t.flatten_dims(1, 2)
    assert f.shape == (64, 256)
    np.testing.assert_array_equal(rd(f), BASE.reshape(64, 256))
    np.testing.assert_array_equal(rd(t.reshape((64, 16, 16))), BASE.reshape(64, 16, 16))
    np.testing.assert_array_equal(rd(t.reshape((64, -1))), BASE.reshape(64, 256))
    with pytest.raises(NkiValidationError, match=r"keep the partition dim"):
        t.reshape((128, 128))
    with pytest.raises(ValueError, match=r"changes the element count"):
        t.reshape((64, 255))
    with pytest.raises(ValueError, match=r"non-contiguous"):
        t[:, :, ::2].reshape((64, 128))
    with pytest.raises(ValueError, match=r"not contiguous"):
        t[:, :, 0:16].flatten_dims(1, 2)
    s2 = t[:, :, ::2].flatten_dims(1, 2)  # a uniform stride of 2 flattens fine
    np.testing.assert_array_equal(rd(s2), BASE[:, :, ::2].reshape(64, 128))
    with pytest.raises(NkiValidationError, match=r"partition dim"):
        t.flatten_dims(0, 1)


def test_hbm_reshape_any_dims(h):
    ref = np.arange(120, dtype=np.float32)
    np.testing.assert_array_equal(rd(h.reshape((10, 12))), ref.reshape(10, 12))
    np.testing.assert_array_equal(rd(h.reshape(120)), ref)


def test_rearrange(t):
    v = t.rearrange("p a (b c)", "p c (a b)", {"b": 4})
    ref = BASE.reshape(64, 8, 4, 8).transpose(0, 3, 1, 2).reshape(64, 8, 32)
    assert v.shape == (64, 8, 32)
    np.testing.assert_array_equal(rd(v), ref)


def test_view_dtype_reinterprets_bytes():
    x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    a = sb(x)
    u = a.view(nl.uint32)
    assert u.shape == (1, 4) and u.dtype == nl.uint32
    np.testing.assert_array_equal(rd(u), x.view(np.uint32))
    b = a.view(nl.bfloat16)
    assert b.shape == (1, 8)
    np.testing.assert_array_equal(rd(b).view(np.uint16), x.view(np.uint16))
    i8 = a.reinterpret_cast(nl.int8)
    assert i8.shape == (1, 16)
    np.testing.assert_array_equal(rd(i8), x.view(np.int8))
    nisa.memset(dst=u[:, 0:1], value=0x3F800000)  # write through the view
    assert rd(a)[0, 0] == 1.0
    with pytest.raises(NkiValidationError, match=r"not a multiple"):
        sb(np.zeros((1, 3), np.float16)).view(nl.float32)
    with pytest.raises(NkiValidationError, match=r"contiguous"):
        a[:, ::2].view(nl.bfloat16)


def test_views_share_storage(t):
    v = t[32:34, 1, 0:4]
    nisa.memset(dst=v, value=-1.0)
    full = rd(t)
    assert (full[32:34, 1, 0:4] == -1).all()
    assert full[32, 1, 4] == BASE[32, 1, 4] and full[31, 1, 0] == BASE[31, 1, 0]
    w = t.permute((0, 2, 1))
    assert rd(w)[33, 2, 1] == -1


# ---- .ap(): access patterns over the base storage --------------------------------------------------------------------

def test_ap_addresses_base_not_view(t):
    v = t[10:20, 3, 5:9]  # with an explicit offset .ap ignores this view
    a = v.ap([[256, 2], [32, 3], [1, 4]], offset=256 * 4 + 2)
    assert a.shape == (2, 3, 4)
    flat = BASE.reshape(-1)
    ref = np.array([[[flat[256 * 4 + 2 + 256 * i + 32 * j + k] for k in range(4)] for j in range(3)]
                    for i in range(2)])
    np.testing.assert_array_equal(rd(a), ref)
    # offset alone selects a partition start: partition 4 onward
    np.testing.assert_array_equal(rd(t.ap([[256, 2], [1, 256]], offset=4 * 256)), BASE[4:6].reshape(2, 256))


def test_ap_offset_none_inherits_the_view_offset(t):
    """AWS (NkiTensor.ap docstring; language guide "Low-level raw access pattern"): "offset defaults to None, which
    means the new view inherits the current view's storage offset. Pass an explicit integer to override." The
    pattern still addresses the storage, not the view's shape/strides."""
    v = t[4:6, 2, 8:]                        # storage offset 4*256 + 2*32 + 8
    assert v.offset == 4 * 256 + 72
    a = v.ap([[256, 2], [1, 3]])             # inherits the offset: partitions 4..5, elements 72..74
    assert a.offset == v.offset
    np.testing.assert_array_equal(rd(a), BASE[4:6].reshape(2, 256)[:, 72:75])
    b = v.ap([[256, 2], [1, 3]], offset=0)   # an explicit offset overrides it: counted from the storage start
    np.testing.assert_array_equal(rd(b), BASE[0:2].reshape(2, 256)[:, 0:3])
    # with dtype= the inherited offset is converted to elements of the new dtype (fp32 -> bf16: twice as many)
    c = v.ap([[512, 2], [2, 3]], dtype=nl.bfloat16)
    assert c.offset == 2 * v.offset
    lo = BASE.view(np.uint32).reshape(64, 256)[4:6, 72:75] & 0xFFFF
    np.testing.assert_array_equal(rd(c).view(np.uint16), lo.astype(np.uint16))


def test_ap_on_a_column_slice_steps_over_storage_rows():
    """AWS's AP deep dive, "Composition and .ap on a view": .ap() interprets pattern and offset against the storage,
    ignoring the view's shape, strides and offset; "Restriction on SBUF/PSUM Tensors": the partition step must be
    the element count of the entire free dimension of the tensor. So on a column half of a (4, 16) buffer -- itself
    an .ap() view, as a fused gate/up buffer's halves are -- the partition step is the storage row 16, and an
    explicit offset counts from the storage start, not from the half."""
    data = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    s = sb(data)
    up = s.ap([[16, 4], [1, 8]], offset=8)                      # right half: storage columns 8..15
    np.testing.assert_array_equal(rd(up.ap([[16, 4], [1, 8]])), data[:, 8:16])          # offset inherited
    np.testing.assert_array_equal(rd(up.ap([[16, 4], [1, 4]], offset=2)), data[:, 2:6])  # explicit: from storage
    with pytest.raises(NkiValidationError, match=r"partition stride 8 must equal the tensor's free size 16 \(C14\); "
                                                 r"8 is the width of the view"):
        up.ap([[8, 4], [1, 8]], offset=0)


def test_ap_offset_none_keeps_the_register_of_a_dynamic_view(h):
    """A view addressed by a register (nl.ds(reg, n)) passes its offset -- and its register dependency -- on."""
    r = nisa.register_alloc(2)
    v = h[nl.ds(r, 1)]
    a = v.ap([[6, 5], [1, 6]])
    np.testing.assert_array_equal(rd(a), np.arange(120, dtype=np.float32).reshape(4, 5, 6)[2])
    assert a._regs and r in a._regs


def test_ap_get_pattern_roundtrip(t):
    v = t[:, 1:3, ::4]
    a = t.ap(v.get_pattern(), offset=v.offset)
    np.testing.assert_array_equal(rd(a), rd(v))


def test_ap_hbm_scalar_offset(h):
    ref = np.arange(120, dtype=np.float32).reshape(4, 30)
    r = nisa.register_alloc(2)
    a = h.ap([[30, 2], [1, 6]], scalar_offset=r, indirect_dim=0)  # + r * prod(shape[1:]) = + 60
    np.testing.assert_array_equal(rd(a), ref[2:4, 0:6])
    b = h.ap([[30, 1], [1, 6]], scalar_offset=r, indirect_dim=1)  # + r * 6 (strides from the base shape)
    np.testing.assert_array_equal(rd(b), ref[0:1, 12:18])
    one = sb(np.array([[1]], np.int32))
    c = h.ap([[30, 1], [1, 6]], scalar_offset=one, indirect_dim=0)
    np.testing.assert_array_equal(rd(c), ref[1:2, 0:6])


def test_ap_dtype_and_vector_offset_rules(h):
    a = sb(np.zeros((2, 4), np.float32))
    u = a.ap([[8, 2], [1, 8]], dtype=nl.bfloat16)  # strides count bf16 elements: 8 per fp32x4 partition
    assert u.dtype == nl.bfloat16 and rd(u).dtype == ml_dtypes.bfloat16
    idx = sb(np.array([[0], [1]], np.uint32))
    with pytest.raises(NkiValidationError, match=r"indirect_dim must be 0"):
        h.ap([[30, 2], [1, 6]], vector_offset=idx, indirect_dim=1)
    with pytest.raises(NkiValidationError, match=r"\(P, 1\)"):
        h.ap([[30, 2], [1, 6]], vector_offset=sb(np.zeros((2, 2), np.uint32)))
    g = h.ap([[30, 2], [1, 6]], vector_offset=idx)
    assert g.is_indirect() and not h.is_indirect()
    with pytest.raises(NkiValidationError, match=r"indexing of an indirect"):
        g[0]


def test_vector_select_gathers_rows(h):
    data = h.reshape((4, 30))
    idx = sb(np.array([[3], [0], [2]], np.uint32))
    dst = tile((3, 30))
    nisa.dma_copy(dst=dst, src=data.vector_select(0, idx))
    np.testing.assert_array_equal(rd(dst), np.arange(120, dtype=np.float32).reshape(4, 30)[[3, 0, 2]])


def test_is_contiguous(t, h):
    assert t.is_contiguous() and t[0:8].is_contiguous() and t[:, 2:4].is_contiguous()
    assert not t[:, :, ::2].is_contiguous()
    assert h.is_contiguous() and not h[:, 1:3].is_contiguous()


def test_ap_indirect_offsets_scale_by_the_stride_of_the_tensor_ap_is_called_on():
    # AWS: indirect_dim is the "dimension in self.shape whose stride scales the indirect scalar/vector offset";
    # AWS's TensorView reshapes the allocation to expose a stride it lacks and calls .ap() on that reshape.
    data = np.arange(256 * 8, dtype=np.float32).reshape(256, 8)
    x = hbm(data)
    pairs = x.reshape((128, 2, 8))  # dim 0 stride 16: rows 2i, 2i+1 of the allocation
    one = sb(np.array([[3]], np.int32))
    dst = tile((2, 8))
    nisa.dma_copy(dst=dst, src=pairs.ap([[8, 2], [1, 8]], offset=0, scalar_offset=one, indirect_dim=0))
    np.testing.assert_array_equal(rd(dst), data[6:8])
    rows = sb(np.array([[0], [127], [5]], np.int32))
    g = tile((3, 8))
    nisa.dma_copy(dst=g, src=pairs.ap([[16, 3], [1, 8]], offset=0, vector_offset=rows, indirect_dim=0))
    np.testing.assert_array_equal(rd(g), data[[0, 254, 10]])
    with pytest.raises(NkiValidationError, match=r"index 128 is out of bounds.*128 rows"):
        nisa.dma_copy(dst=g, src=pairs.ap([[16, 3], [1, 8]], vector_offset=sb(np.array([[128], [0], [0]], np.int32))))
