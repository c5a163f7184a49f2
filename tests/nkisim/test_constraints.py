"""A negative test for every hardware/API constraint C1-C20 of nki-api.md §6.

Each test asserts that the NkiValidationError (or capacity error / warning) names the violated limit, so a kernel
author reading the message knows which rule and which number they broke.
"""

import re
import warnings
from pathlib import Path

import nki
import numpy as np
import pytest

import nkisim
from nkisim.errors import NkiCapacityError, NkiUninitializedReadWarning, NkiValidationError
from nkisim.lint import NkiLanguageError

from ._sim import fresh_core, nisa, nl, on_target, rd, sb, tile  # noqa: F401

E = NkiValidationError


def ones(shape, dtype=nl.float32):
    return sb(np.ones(shape, np.float32), dtype)


# ---- C1: partition dim <= 128 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("buf", ["sbuf", "psum"])
def test_c1_partition_dim_over_128(buf):
    with pytest.raises(E, match=r"129.*128.*\(C1\)"):
        nl.ndarray((129, 4), nl.float32, buffer=getattr(nl, buf))


def test_c1_nl_creation_helpers():
    with pytest.raises(E, match=r"200 exceeds maximum 128 \(C1\)"):
        nl.zeros((200, 2), nl.float32, buffer=nl.sbuf)
    nl.ndarray((200, 2), nl.float32, buffer=nl.shared_hbm)  # HBM has no partition limit


# ---- C2: same partitions and elements per partition --------------------------------------------------------------

def test_c2_partition_count_mismatch():
    a, b, d = ones((64, 8)), ones((32, 16)), tile((64, 8))
    with pytest.raises(E, match=r"32 partitions.*64.*\(C2"):
        nisa.tensor_tensor(dst=d, data1=a, data2=b, op=nl.add)


def test_c2_free_size_mismatch():
    a, b, d = ones((64, 8)), ones((64, 9)), tile((64, 8))
    with pytest.raises(E, match=r"9 elements per partition.*8.*\(C2\)"):
        nisa.tensor_tensor(dst=d, data1=a, data2=b, op=nl.add)


def test_c2_shapes_may_differ_with_same_count():
    a = sb(np.arange(24, dtype=np.float32).reshape(2, 12))
    d = tile((2, 3, 4))
    nisa.tensor_copy(dst=d, src=a)
    np.testing.assert_array_equal(rd(d), np.arange(24, dtype=np.float32).reshape(2, 3, 4))


@pytest.mark.parametrize("call", ["activation", "tensor_scalar", "tensor_copy", "reciprocal"])
def test_c2_other_ops(call):
    a, d = ones((4, 8)), tile((4, 7))
    kw = {"activation": dict(op=nl.exp, data=a), "tensor_scalar": dict(data=a, op0=nl.add, operand0=1.0),
          "tensor_copy": dict(src=a), "reciprocal": dict(data=a)}[call]
    with pytest.raises(E, match=r"\(C2\)"):
        getattr(nisa, call)(dst=d, **kw)


# ---- C3: matmul shapes / memories --------------------------------------------------------------------------------

def test_c3_contraction_mismatch():
    s, m, d = ones((64, 32)), ones((32, 16)), tile((32, 16), buffer=nl.psum)
    with pytest.raises(E, match=r"K=64.*K=32.*\(C3\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


def test_c3_stationary_free_over_128():
    s, m, d = ones((8, 129)), ones((8, 4)), tile((128, 4), buffer=nl.psum)
    with pytest.raises(E, match=r"129 exceeds 128.*C3\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


def test_c3_moving_free_over_512_on_trn2():
    s, m = ones((8, 4)), ones((8, 513))
    d = tile((4, 513), buffer=nl.psum)
    with pytest.raises(E, match=r"513 exceeds 512.*trn2.*\(C3\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


def test_c3_moving_free_limits_on_trn3(on_target):  # noqa: F811
    on_target("trn3")
    s = ones((8, 4))
    d = tile((4, 4096), buffer=nl.psum)  # all 8 banks
    nisa.nc_matmul(dst=d, stationary=s, moving=ones((8, 4096)))
    assert (rd(d) == 8).all()
    with pytest.raises(E, match=r"4097 exceeds 4096 for a float32 dst on trn3 \(C3\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=ones((8, 4097)))


def test_c3_k_over_row_tile():
    s, m, d = ones((128, 32)), ones((128, 8)), tile((32, 8), buffer=nl.psum)
    with pytest.raises(E, match=r"K\) 128 exceeds 64.*C3"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m, tile_position=(0, 0), tile_size=(64, 128))


def test_c3_dst_shape():
    s, m, d = ones((8, 4)), ones((8, 6)), tile((4, 5), buffer=nl.psum)
    with pytest.raises(E, match=r"\(M=4, N=6\).*\(C3\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


@pytest.mark.parametrize("which", ["stationary", "moving", "dst"])
def test_c3_memories(which):
    ops = dict(stationary=ones((8, 4)), moving=ones((8, 6)), dst=tile((4, 6), buffer=nl.psum))
    ops[which] = tile(ops[which].shape, buffer=nl.sbuf if which == "dst" else nl.psum)
    with pytest.raises(E, match=rf"{which} .* allowed: {'psum' if which == 'dst' else 'sbuf'}"):
        nisa.nc_matmul(**ops)


# ---- C4: matmul dtypes -------------------------------------------------------------------------------------------

def test_c4_fp32_with_bf16():
    s, m, d = ones((8, 4)), ones((8, 6), nl.bfloat16), tile((4, 6), buffer=nl.psum)
    with pytest.raises(E, match=r"float32/tfloat32 can only pair.*\(C4\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


def test_c4_int_input():
    s, m, d = ones((8, 4), nl.int8), ones((8, 6), nl.int8), tile((4, 6), buffer=nl.psum)
    with pytest.raises(E, match=r"int8 is not a matmul input dtype.*\(C4\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m)


def test_c4_bf16_dst_only_on_trn3(on_target):  # noqa: F811
    s, m = ones((8, 4), nl.bfloat16), ones((8, 6), nl.bfloat16)
    with pytest.raises(E, match=r"dst dtype bfloat16 must be float32 on NeuronCore-v3 \(C4\)"):
        nisa.nc_matmul(dst=tile((4, 6), nl.bfloat16, nl.psum), stationary=s, moving=m)
    on_target("trn3")
    s, m = ones((8, 4), nl.bfloat16), ones((8, 6), nl.bfloat16)
    d = tile((4, 6), nl.bfloat16, nl.psum)
    nisa.nc_matmul(dst=d, stationary=s, moving=m)
    np.testing.assert_array_equal(rd(d).astype(np.float32), np.full((4, 6), 8.0, np.float32))


def test_c4_e4m3_with_e4m3fn(on_target):  # noqa: F811
    on_target("trn3")
    s, m = ones((8, 4), nl.float8_e4m3), ones((8, 6), nl.float8_e4m3fn)
    with pytest.raises(E, match=r"float8_e4m3 and float8_e4m3fn cannot be mixed.*\(C4\)"):
        nisa.nc_matmul(dst=tile((4, 6), buffer=nl.psum), stationary=s, moving=m)


def test_c4_e4m3fn_not_on_trn2():
    s, m = ones((8, 4), nl.float8_e4m3fn), ones((8, 6), nl.float8_e4m3fn)
    with pytest.raises(E, match=r"float8_e4m3fn is not a matmul input dtype on NeuronCore-v3.*\(C4\)"):
        nisa.nc_matmul(dst=tile((4, 6), buffer=nl.psum), stationary=s, moving=m)


def test_c4_double_row_needs_fp8_and_size2_dim():
    d = tile((4, 6), buffer=nl.psum)
    with pytest.raises(E, match=r"double_row needs fp8.*\(C4\)"):
        nisa.nc_matmul(dst=d, stationary=ones((8, 2, 4), nl.bfloat16), moving=ones((8, 2, 6), nl.bfloat16),
                       perf_mode=nisa.matmul_perf_mode.double_row)
    with pytest.raises(E, match=r"\[K, 2, M\].*\(C4\)"):
        nisa.nc_matmul(dst=tile((8, 6), buffer=nl.psum), stationary=ones((8, 8), nl.float8_e4m3),
                       moving=ones((8, 6), nl.float8_e4m3), perf_mode=nisa.matmul_perf_mode.double_row)


# ---- C5: nc_transpose -------------------------------------------------------------------------------------------

def test_c5_dtype_mismatch():
    with pytest.raises(E, match=r"dst dtype bfloat16 must equal data dtype float32 \(C5\)"):
        nisa.nc_transpose(dst=tile((8, 4), nl.bfloat16, nl.psum), data=ones((4, 8)))


def test_c5_vector_engine_32x32():
    with pytest.raises(E, match=r"\[32, 32\].*\[33, 8\] \(C5\)"):
        nisa.nc_transpose(dst=tile((8, 33)), data=ones((33, 8)), engine=nisa.engine.vector)


def test_c5_tensor_engine_sbuf_to_psum():
    with pytest.raises(E, match=r"reads SBUF and writes PSUM \(C5\)"):
        nisa.nc_transpose(dst=tile((8, 4)), data=ones((4, 8)), engine=nisa.engine.tensor)


def test_c5_dst_shape():
    with pytest.raises(E, match=r"must be \(8, 4\).*\(C5\)"):
        nisa.nc_transpose(dst=tile((4, 8), buffer=nl.psum), data=ones((4, 8)), engine=nisa.engine.tensor)


# ---- C6: PSUM banks ---------------------------------------------------------------------------------------------

def test_c6_ninth_psum_bank_tile():
    live = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
    with pytest.raises(NkiCapacityError, match=r"all 8 banks of 2048 B.*\(C6\)"):
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    del live[0]
    nl.ndarray((128, 512), nl.float32, buffer=nl.psum)  # a freed bank is reusable


def test_c6_small_psum_tiles_share_a_bank():
    live = [nl.ndarray((128, 128), nl.float32, buffer=nl.psum) for _ in range(32)]  # 4 per bank
    with pytest.raises(NkiCapacityError, match=r"\(C6\)"):
        nl.ndarray((128, 1), nl.float32, buffer=nl.psum)
    assert len(live) == 32


def test_c6_psum_tensor_over_16k():
    with pytest.raises(NkiCapacityError, match=r"16388 B/partition > PSUM size 16384 B \(C6\)"):
        nl.ndarray((128, 4097), nl.float32, buffer=nl.psum)


def test_c6_matmul_output_spanning_two_banks():
    d = nl.ndarray((4, 1024), nl.float32, buffer=nl.psum)  # banks 0 and 1
    s, m = ones((8, 4)), ones((8, 512))
    nisa.nc_matmul(dst=d[:, 512:1024], stationary=s, moving=m)  # exactly bank 1: fine
    with pytest.raises(E, match=r"spans PSUM banks 0\.\.1.*one 2 KiB bank.*\(C6\)"):
        nisa.nc_matmul(dst=d[:, 256:768], stationary=s, moving=m)


def test_c6_psum_address_bank_aligned():
    with pytest.raises(E, match=r"multiple of the bank size 2048 B \(C6\)"):
        nl.ndarray((128, 16), nl.float32, buffer=nl.psum, address=(0, 1024))
    nl.ndarray((128, 16), nl.float32, buffer=nl.psum, address=(0, 4096))


# ---- C7: SBUF capacity --------------------------------------------------------------------------------------------

def test_c7_sbuf_capacity_trn2():
    per_part = 212984
    a = nl.ndarray((128, per_part // 4 - 1), nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)  # exactly full
    with pytest.raises(NkiCapacityError, match=r"212984 B per partition on trn2 \(C7\)"):
        nl.ndarray((2, 1), nl.int8, buffer=nl.sbuf)
    del b
    nl.ndarray((128, 2), nl.int16, buffer=nl.sbuf)  # freed space is reusable
    assert a.shape[1] == per_part // 4 - 1


def test_c7_sbuf_capacity_is_per_partition_not_total():
    # (1, N) and (128, N) cost the same per partition
    keep = nl.ndarray((1, 200000), nl.uint8, buffer=nl.sbuf)
    with pytest.raises(NkiCapacityError, match=r"\(C7\)"):
        nl.ndarray((128, 20000), nl.uint8, buffer=nl.sbuf)
    assert keep.shape == (1, 200000)


def test_c7_sbuf_capacity_trn3(on_target):  # noqa: F811
    on_target("trn3")
    keep = nl.ndarray((128, 240000), nl.uint8, buffer=nl.sbuf)  # > trn2's 212984
    with pytest.raises(NkiCapacityError, match=r"245752 B per partition on trn3 \(C7\)"):
        nl.ndarray((128, 6000), nl.uint8, buffer=nl.sbuf)
    assert keep.size == 128 * 240000


def test_c7_capacity_checked_inside_kernel_by_last_use():
    """In a kernel a tile is live until its last use in the program: five 48000 B tiles all read at the end
    overflow trn2's SBUF, and the error (raised after the trace) names the allocation site."""
    @nki.jit
    def k(x):
        tiles = []
        for _ in range(5):
            t = nl.ndarray((128, 12000), nl.float32, buffer=nl.sbuf)  # 48000 B each
            nisa.memset(dst=t, value=1.0)
            tiles.append(t)
        for t in tiles:
            nisa.tensor_copy(dst=t, src=t)
        return x

    with pytest.raises(NkiCapacityError, match=r"allocating 'sbuf_\d+' \(48000 B/partition at .*test_constraints.py:"
                                               r"\d+\): 240000 B/partition live .*212984 B .*trn2 \(C7\)"):
        k(np.zeros((2, 2), np.float32))


def test_c7_dead_tiles_do_not_count_while_python_references_them():
    """The positive twin: the same five tiles, each used only before the next one is allocated, fit, although
    the Python list keeps every one of them referenced."""
    @nki.jit
    def k(x):
        tiles = []
        for _ in range(5):
            t = nl.ndarray((128, 12000), nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=1.0)
            nisa.tensor_copy(dst=t, src=t)
            tiles.append(t)
        return x

    k(np.zeros((2, 2), np.float32))


def _live_together(shapes, addresses=None):
    """uint8 SBUF tiles of the given shapes (at the given explicit (0, byte) addresses, if any) all live at once."""
    placed = [{}] * len(shapes) if addresses is None else [{"address": (0, a)} for a in addresses]

    @nki.jit
    def k(x):
        tiles = []
        for shape, where in zip(shapes, placed):
            t = nl.ndarray(shape, nl.uint8, buffer=nl.sbuf, **where)
            nisa.memset(dst=t, value=0)
            tiles.append(t)
        for t in tiles:
            nisa.tensor_copy(dst=t, src=t)
        return x
    return k(np.zeros((2, 2), np.float32))


def test_c7_tiles_on_fewer_partitions_pack_by_quadrant():
    """Two 64-partition tiles of 120000 B fit side by side (partitions 0-63 and 64-127); four 32-partition ones too."""
    _live_together([(64, 120000), (64, 120000)])
    _live_together([(32, 200000)] * 4)


def test_c7_full_width_or_third_half_tile_does_not_fit():
    with pytest.raises(NkiCapacityError, match=r"240000 B/partition live .*\(C7\)"):
        _live_together([(128, 120000), (64, 120000)])
    with pytest.raises(NkiCapacityError, match=r"240000 B/partition live .*\(C7\); largest live: .* on 64 partitions"):
        _live_together([(64, 120000)] * 3)


def _sbuf_at(addresses):
    return _live_together([(128, 150000)] * len(addresses), addresses)


def test_c7_sbuf_tiles_at_one_explicit_address_count_once():
    """Explicitly placed SBUF tiles occupy their byte ranges: two live tiles at one address are the same bytes
    (the nki-library's SbufManager re-uses addresses), at disjoint addresses they add up."""
    _sbuf_at([0, 0])
    with pytest.raises(NkiCapacityError, match=r"300000 B/partition live .*\(C7\)"):
        _sbuf_at([0, 150000])


def test_c6_psum_explicit_address_reuse_aliases_storage():
    """Re-using a PSUM address is legal, even while the Python object of the earlier tile is alive; both tiles
    are the same memory (a write through one is read through the other)."""
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        keep = []
        for i in range(12):   # 12 x 2 KiB tiles at 8 bank addresses: 4 banks reused
            p = nl.ndarray((4, 512), nl.float32, buffer=nl.psum, address=(0, (i % 8) * 2048))
            nisa.memset(dst=p, value=float(i))
            keep.append(p)
        again = nl.ndarray((4, 8), nl.float32, buffer=nl.psum, address=(0, 0))  # other layout: own storage
        nisa.memset(dst=again, value=-1.0)
        first = nl.ndarray((4, 512), nl.float32, buffer=nl.psum, address=(0, 2048))  # bank 1 as tile 9 left it
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=first[:, 0:8])
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(k(np.zeros((2, 2), np.float32)), np.full((4, 8), 9.0, np.float32))


def test_c6_psum_explicit_address_past_the_end():
    with pytest.raises(NkiCapacityError, match=r"free_byte_offset=14336 needs 4096 B/partition: ends at 18432 B "
                                               r"> PSUM size 16384 B \(C6\)"):
        nl.ndarray((128, 1024), nl.float32, buffer=nl.psum, address=(0, 14336))


def test_c6_psum_overflow_by_last_use_reported_after_the_trace():
    """Nine full-bank PSUM tiles all read at the end cannot fit 8 banks: reported after the trace with the site;
    the twin that uses each tile before allocating the next runs although Python keeps all nine referenced."""
    def body(read_all_at_end):
        @nki.jit
        def k(x):
            keep = []
            for _ in range(9):
                p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
                nisa.memset(dst=p, value=0.0)
                keep.append(p)
                if not read_all_at_end:
                    nisa.tensor_copy(dst=p, src=p)
            if read_all_at_end:
                for p in keep:
                    nisa.tensor_copy(dst=p, src=p)
            return x
        return k

    with pytest.raises(NkiCapacityError, match=r"PSUM capacity exceeded allocating 'psum_\d+' \(2048 B/partition "
                                               r"at .*test_constraints.py:\d+\): 18432 B/partition live .*\(C6\)"):
        body(True)(np.zeros((2, 2), np.float32))
    body(False)(np.zeros((2, 2), np.float32))


# ---- C8: GpSimd and PSUM ---------------------------------------------------------------------------------------------

def test_c8_gpsimd_tensor_copy_psum():
    p = sb(np.ones((4, 4), np.float32), buffer=nl.psum)
    with pytest.raises(E, match=r"GpSimd cannot access PSUM \(C8\)"):
        nisa.tensor_copy(dst=tile((4, 4)), src=p, engine=nisa.engine.gpsimd)


def test_c8_gpsimd_memset_and_tensor_tensor_psum():
    p = tile((4, 4), buffer=nl.psum)
    with pytest.raises(E, match=r"\(C8\)"):
        nisa.memset(dst=p, value=0.0, engine=nisa.engine.gpsimd)
    a = ones((4, 4))
    with pytest.raises(E, match=r"\(C8\)"):
        nisa.tensor_tensor(dst=p, data1=a, data2=a, op=nl.power, engine=nisa.engine.gpsimd)


def test_c8_iota_and_affine_select_need_sbuf():
    with pytest.raises(E, match=r"psum; allowed: sbuf"):
        nisa.iota(dst=tile((4, 4), nl.int32, nl.psum), pattern=[[1, 4]])
    with pytest.raises(E, match=r"psum; allowed: sbuf"):
        nisa.affine_select(dst=tile((4, 4)), pattern=[[1, 4]], channel_multiplier=0,
                           on_true_tile=sb(np.ones((4, 4), np.float32), buffer=nl.psum), on_false_value=0.0)


# ---- C9: two PSUM inputs -----------------------------------------------------------------------------------------

def test_c9_tensor_tensor_both_psum():
    a = sb(np.ones((4, 4), np.float32), buffer=nl.psum)
    b = sb(np.ones((4, 4), np.float32), buffer=nl.psum)
    with pytest.raises(E, match=r"data1 and data2 cannot both be in PSUM \(C9\)"):
        nisa.tensor_tensor(dst=tile((4, 4)), data1=a, data2=b, op=nl.add)


def test_c9_scalar_tensor_tensor_and_predicated():
    a = sb(np.ones((4, 4), np.float32), buffer=nl.psum)
    b = sb(np.ones((4, 4), np.float32), buffer=nl.psum)
    with pytest.raises(E, match=r"\(C9\)"):
        nisa.scalar_tensor_tensor(dst=tile((4, 4)), data=a, op0=nl.add, operand0=1.0, op1=nl.add, operand1=b)
    pred = sb(np.ones((4, 4), np.uint8), buffer=nl.psum)
    with pytest.raises(E, match=r"\(C9\)"):
        nisa.tensor_copy_predicated(dst=tile((4, 4)), src=a, predicate=pred)


# ---- C10: DMA --------------------------------------------------------------------------------------------------------

def test_c10_dma_psum():
    p = tile((4, 4), buffer=nl.psum)
    h = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(E, match=r"DMA cannot access PSUM.*\(C10\)"):
        nisa.dma_copy(dst=h, src=p)
    with pytest.raises(E, match=r"\(C10\)"):
        nisa.dma_copy(dst=p, src=h)


def test_c10_element_count():
    with pytest.raises(E, match=r"dst \(4, 4\) has 16, src \(4, 5\) has 20 \(C10\)"):
        nisa.dma_copy(dst=tile((4, 4)), src=nl.ndarray((4, 5), nl.float32, buffer=nl.shared_hbm))


def test_c10_hwdge_requires_equal_dtypes():
    src = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(E, match=r"hwdge requires equal dtypes.*\(C10\)"):
        nisa.dma_copy(dst=tile((4, 4), nl.bfloat16), src=src, dge_mode=nisa.dge_mode.hwdge)


def test_c10_dma_transpose_dst_in_sbuf():
    src = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(E, match=r"dst must be in SBUF.*\(C10\)"):
        nisa.dma_transpose(dst=nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm), src=src)


# ---- C11: scalar operands --------------------------------------------------------------------------------------------

def test_c11_tensor_operand_must_be_fp32():
    a = ones((4, 8))
    with pytest.raises(E, match=r"must be float32, got bfloat16 \(C11\)"):
        nisa.tensor_scalar(dst=tile((4, 8)), data=a, op0=nl.add, operand0=ones((4, 1), nl.bfloat16))


def test_c11_tensor_operand_must_be_p_by_1():
    a = ones((4, 8))
    with pytest.raises(E, match=r"\(4, 1\) tensor, got shape \(4, 2\) \(C11\)"):
        nisa.tensor_scalar(dst=tile((4, 8)), data=a, op0=nl.add, operand0=ones((4, 2)))
    with pytest.raises(E, match=r"\(C11\)"):
        nisa.activation(dst=tile((4, 8)), op=nl.exp, data=a, scale=ones((4, 2)))


def test_c11_affine_select_on_false_scalar():
    a = ones((4, 8))
    with pytest.raises(E, match=r"on_false_value must be an fp32 scalar.*\(C11\)"):
        nisa.affine_select(dst=tile((4, 8)), pattern=[[1, 8]], channel_multiplier=0, on_true_tile=a,
                           on_false_value=ones((4, 1)))


# ---- C12: reductions -------------------------------------------------------------------------------------------------

def test_c12_reduce_partition_axis():
    with pytest.raises(E, match=r"axis 0 .*\(C12\)"):
        nisa.tensor_reduce(dst=tile((1, 8)), op=nl.add, data=ones((4, 8)), axis=0)


def test_c12_reduce_non_trailing_axes():
    with pytest.raises(E, match=r"trailing contiguous free axes.*\(C12\)"):
        nisa.tensor_reduce(dst=tile((4, 3)), op=nl.add, data=ones((4, 2, 3)), axis=1)


def test_c12_nl_reduction_axis0():
    with pytest.raises(E, match=r"\(C12\)"):
        nl.sum(ones((4, 8)), axis=0)


def test_c12_bn_stats_fmax():
    with pytest.raises(E, match=r"513 elements.*at most 512.*C12\)"):
        nisa.bn_stats(dst=tile((4, 6)), data=ones((4, 513)))


# ---- C13: partition start / contiguity -------------------------------------------------------------------------------

def test_c13_partition_start():
    a = ones((128, 4))
    with pytest.raises(E, match=r"starts at partition 16 with 16 partitions.*\(C13\)"):
        nisa.tensor_copy(dst=tile((16, 4)), src=a[16:32, :])
    with pytest.raises(E, match=r"starts at partition 32 with 64.*\(C13\)"):
        nisa.tensor_copy(dst=tile((64, 4)), src=a[32:96, :])
    nisa.tensor_copy(dst=tile((32, 4)), src=a[96:128, :])  # quadrant start
    nisa.tensor_copy(dst=tile((64, 4)), src=a[64:128, :])  # half start


def test_c13_non_contiguous_partitions():
    a = ones((128, 4))
    with pytest.raises(E, match=r"contiguous partitions.*\(C13\)"):
        nisa.tensor_copy(dst=tile((64, 4)), src=a[0:128:2, :])


# ---- C14: access patterns --------------------------------------------------------------------------------------------

def test_c14_ap_partition_stride():
    t = ones((4, 8))
    with pytest.raises(E, match=r"partition stride 4 must equal the tensor's free size 8 \(C14\)"):
        t.ap([[4, 4], [1, 4]])


def test_c14_ap_at_most_4_free_levels():
    t = ones((4, 32))
    with pytest.raises(E, match=r"5 free-dim levels exceed the hardware's 4 \(C14\)"):
        t.ap([[32, 4], [16, 2], [8, 2], [4, 2], [2, 2], [1, 2]])


def test_c14_iota_pattern_levels():
    with pytest.raises(E, match=r"at most 4 \(C14\)"):
        nisa.iota(dst=tile((1, 32), nl.int32), pattern=[[16, 2], [8, 2], [4, 2], [2, 2], [1, 2]])


# ---- C15: language rules ---------------------------------------------------------------------------------------------

def test_c15_output_not_in_shared_hbm():
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        return t

    with pytest.raises(NkiLanguageError, match=r"output-buffer"):
        k(np.zeros((2, 2), np.float32))


def test_c15_output_may_be_an_argument_written_in_place():
    """Returning a kernel argument (HBM, written in place) is legal at LNC=1 as at LNC=2; a fresh hbm one is not."""
    @nki.jit
    def k(x, out):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(k(x, np.zeros_like(x)), x)

    @nki.jit
    def fresh(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    with pytest.raises(NkiLanguageError, match=r"output-buffer"):
        fresh(x)


def test_c15_unknown_kwargs_raise_type_error():
    a = ones((4, 4))
    with pytest.raises(TypeError):
        nisa.tensor_copy(dst=tile((4, 4)), src=a, mask=None)
    with pytest.raises(TypeError):
        nisa.activation(dst=tile((4, 4)), op=nl.exp, data=a, dtype=nl.float32)
    with pytest.raises(TypeError):
        nisa.nc_matmul(dst=tile((4, 4), buffer=nl.psum), stationary=a, moving=a, transpose_x=True)
    with pytest.raises(TypeError):
        nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, bogus=1)


@pytest.mark.parametrize("case", ["engine", "dge_mode", "oob_mode", "reduce_cmd", "perf_mode", "nc_transpose_engine"])
def test_c15_raw_int_enums_rejected(case):
    a = ones((4, 4))
    h = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    calls = {
        "engine": lambda: nisa.tensor_copy(dst=tile((4, 4)), src=a, engine=5),
        "dge_mode": lambda: nisa.dma_copy(dst=h, src=a, dge_mode=7),  # the valid ints 0..3 are accepted
        "oob_mode": lambda: nisa.dma_copy(dst=h, src=a, oob_mode=0),
        "reduce_cmd": lambda: nisa.activation(dst=tile((4, 4)), op=nl.exp, data=a, reduce_op=nl.add,
                                              reduce_res=tile((4, 1)), reduce_cmd=3),
        "perf_mode": lambda: nisa.nc_matmul(dst=tile((4, 4), buffer=nl.psum), stationary=a, moving=a, perf_mode=1),
        "nc_transpose_engine": lambda: nisa.nc_transpose(dst=tile((4, 4), buffer=nl.psum), data=a, engine=1),
    }
    with pytest.raises(E, match=r"must be an nki\.isa\.\w+ value"):
        calls[case]()


def test_c15_string_buffers_rejected():
    with pytest.raises(E, match=r"string buffer names are rejected"):
        nl.ndarray((4, 4), nl.float32, buffer="sbuf")
    with pytest.raises(E, match=r"not a buffer object"):
        nl.zeros((4, 4), nl.float32, buffer="psum")


def test_c15_list_argument_rejected_under_parser(monkeypatch):
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")

    @nki.jit
    def k(xs):
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        return out

    with pytest.raises(NkiLanguageError, match=r"list-arg"):
        k([np.zeros((2, 2), np.float32)])


def test_c15_list_argument_accepted_under_tracing(monkeypatch):
    monkeypatch.delenv("NKI_COMPILER_FRONTEND", raising=False)

    @nki.jit
    def k(xs):
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=xs[1])
        return out

    got = k([np.zeros((2, 2), np.float32), np.full((2, 2), 3.0, np.float32)])
    np.testing.assert_array_equal(got, np.full((2, 2), 3.0, np.float32))


def test_c15_tensor_arithmetic_operators_rejected():
    a = ones((4, 4))
    with pytest.raises(TypeError, match=r"binary operators on tensors not supported"):
        a + a  # noqa: B018
    with pytest.raises(TypeError):
        a[0, 0] = 1.0


# ---- C16: PSUM accumulation ------------------------------------------------------------------------------------------

def test_c16_accumulate_true_onto_never_written_psum_warns():
    s, m = ones((8, 4)), ones((8, 6))
    d = tile((4, 6), buffer=nl.psum)
    with pytest.warns(NkiUninitializedReadWarning, match=r"never\s+written.*\(C16\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m, accumulate=True)


def test_c16_accumulate_onto_memset_psum_warns_on_trn2():
    s, m = ones((8, 4)), ones((8, 6))
    d = tile((4, 6), buffer=nl.psum)
    nisa.memset(dst=d, value=0.0)
    with pytest.warns(NkiUninitializedReadWarning, match=r"non-matmul.*NeuronCore-v2/v3 \(C16\)"):
        nisa.nc_matmul(dst=d, stationary=s, moving=m, accumulate=True)
    np.testing.assert_array_equal(rd(d), np.full((4, 6), 8.0, np.float32))


def test_c16_no_warning_for_proper_accumulation():
    s, m = ones((8, 4)), ones((8, 6))
    d = tile((4, 6), buffer=nl.psum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(3):
            nisa.nc_matmul(dst=d, stationary=s, moving=m, accumulate=k > 0)
    np.testing.assert_array_equal(rd(d), np.full((4, 6), 24.0, np.float32))


def test_c6_interleaved_accumulation_groups_in_one_bank_accumulate_correctly_without_warning():
    """AWS's docs do not forbid several accumulation groups in one bank (nki-library interleaves them)."""
    s, m = ones((8, 4)), ones((8, 1))
    d = tile((4, 4), buffer=nl.psum)  # 4 accumulation groups, one per column, all in one bank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(2):
            for j in range(4):
                nisa.nc_matmul(dst=d[:, j:j + 1], stationary=s, moving=m, accumulate=k > 0)
    np.testing.assert_array_equal(rd(d), np.full((4, 4), 16.0, np.float32))


def test_c6_groups_on_disjoint_partitions_of_a_bank_do_not_warn():
    """PE-array row tiles (tile_position) accumulate side by side in one bank on different partitions."""
    s, m = ones((32, 32)), ones((32, 8))
    d = tile((128, 8), buffer=nl.psum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(2):
            for j in range(4):
                nisa.nc_matmul(dst=d[32 * j:32 * j + 32, :], stationary=s, moving=m, accumulate=k > 0,
                               tile_position=(32 * j, 32 * j), tile_size=(32, 32))
    np.testing.assert_array_equal(rd(d), np.full((128, 8), 64.0, np.float32))


def test_c6_groups_in_separate_banks_do_not_warn():
    s, m = ones((8, 4)), ones((8, 1))
    tiles = [nl.ndarray((4, 512), nl.float32, buffer=nl.psum) for _ in range(2)]  # one bank each
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(2):
            for t in tiles:
                nisa.nc_matmul(dst=t[:, 0:1], stationary=s, moving=m, accumulate=k > 0)
    for t in tiles:  # both groups accumulated correctly: 2 steps x K=8 ones
        np.testing.assert_array_equal(rd(t[:, 0:1]), np.full((4, 1), 16.0, np.float32))


# ---- C17: sentinel fill ----------------------------------------------------------------------------------------------

def test_c17_uninitialised_reads_show_sentinels():
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        i = nl.ndarray(x.shape, nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:1], src=x[:, 0:1])
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray(x.shape, nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        nisa.dma_copy(dst=out_i, src=i)
        return out, out_i

    out, out_i = k(np.ones((2, 3), np.float32))
    assert (out[:, 0] == 1).all() and np.isnan(out[:, 1:]).all()
    assert (out_i == 4).all()


# ---- C18: LNC --------------------------------------------------------------------------------------------------------

def _lnc_kernel(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    return out


@pytest.mark.parametrize("grid", [0, 3, 4, (1, 2), True, "2"])
def test_c18_launch_degree(grid):
    k = nki.jit(_lnc_kernel)
    with pytest.raises(E, match=r"\(C18\)"):
        k[grid]


def test_c18_sendrecv_outside_lnc():
    a = ones((4, 4))
    with pytest.raises(E, match=r"LNC=2 launch.*\(C18\)"):
        nisa.sendrecv(src=a, dst=tile((4, 4)), send_to_rank=1, recv_from_rank=1, pipe_id=0)


def test_c18_core_barrier_cores():
    with pytest.raises(E, match=r"only cores=\(0, 1\).*\(C18\)"):
        nisa.core_barrier(data=nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm), cores=(0, 2))


def test_c18_sendrecv_to_self():
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        me = nl.program_id(0)
        nisa.sendrecv(src=t, dst=r, send_to_rank=me, recv_from_rank=me, pipe_id=0)
        return out

    with pytest.raises(E, match=r"must be the other core.*"):
        k[2](np.zeros((2, 2), np.float32))


# ---- C19: version-gated features -------------------------------------------------------------------------------------

def test_c19_exponential_trn3_only():
    with pytest.raises(E, match=r"exponential requires NeuronCore-v4 \(trn3\).*target is trn2 \(C19\)"):
        nisa.exponential(dst=tile((4, 4)), src=ones((4, 4)))


def test_c19_abs_max_and_unary_square_trn3_only():
    a = ones((4, 4))
    with pytest.raises(E, match=r"nl\.abs_max requires NeuronCore-v4.*\(C19\)"):
        nisa.tensor_tensor(dst=tile((4, 4)), data1=a, data2=a, op=nl.abs_max)
    with pytest.raises(E, match=r"op0=nl\.square requires NeuronCore-v4.*\(C19\)"):
        nisa.tensor_scalar(dst=tile((4, 4)), data=a, op0=nl.square, operand0=None)


@pytest.mark.parametrize("feature", ["double_row", "is_transpose", "hwdge", "core_barrier"])
def test_c19_v3_features_rejected_on_trn1(on_target, feature):  # noqa: F811
    on_target("trn1")
    with pytest.raises(E, match=r"\(C19\)"):
        if feature == "double_row":
            nisa.nc_matmul(dst=tile((4, 6), buffer=nl.psum), stationary=ones((8, 2, 4), nl.float8_e4m3),
                           moving=ones((8, 2, 6), nl.float8_e4m3), perf_mode=nisa.matmul_perf_mode.double_row)
        elif feature == "is_transpose":
            nisa.nc_matmul(dst=tile((4, 4), buffer=nl.psum), stationary=ones((4, 4)),
                           moving=sb(np.eye(4, dtype=np.float32)), is_transpose=True)
        elif feature == "hwdge":
            nisa.dma_copy(dst=tile((4, 4)), src=nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm),
                          dge_mode=nisa.dge_mode.hwdge)
        else:
            nisa.core_barrier(data=nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm), cores=(0, 1))


# ---- C20: activation input ranges ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,value", [("sin", 9.0), ("log", 2.0 ** -70), ("sqrt", 2.0 ** 120),
                                      ("rsqrt", 2.0 ** -100), ("reciprocal", 2.0 ** 50), ("reciprocal", 0.0),
                                      ("arctan", 3.0)])
def test_c20_activation_input_range(op, value):
    a = sb(np.full((4, 4), value, np.float32))
    with pytest.raises(E, match=rf"nl\.{op} input .* outside the ScalarE valid range.*\(C20\)"):
        nisa.activation(dst=tile((4, 4)), op=getattr(nl, op), data=a)


def test_c20_range_applies_to_scaled_input_and_nan_passes():
    a = sb(np.full((4, 4), 2.0, np.float32))
    nisa.activation(dst=tile((4, 4)), op=nl.sin, data=a)
    with pytest.raises(E, match=r"\(C20\)"):
        nisa.activation(dst=tile((4, 4)), op=nl.sin, data=a, scale=2.0)
    d = tile((4, 4))
    nisa.activation(dst=d, op=nl.log, data=sb(np.full((4, 4), np.nan, np.float32)))
    assert np.isnan(rd(d)).all()


def test_c6_one_accumulation_group_per_bank_of_a_multibank_tile_is_clean():
    # A [128, 2048] fp32 PSUM tile spans 4 banks; one accumulation group per bank is the safe pattern: no warning.
    s, m = tile((128, 128), nl.bfloat16), tile((128, 512), nl.bfloat16)
    nisa.memset(s, 1.0)
    nisa.memset(m, 1.0)
    acc = nl.ndarray((128, 2048), nl.float32, buffer=nl.psum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no warning of any kind (NkiPsumAccumulationWarning is no longer raised)
        for k in range(3):
            for b in range(4):
                nisa.nc_matmul(dst=acc[:, b * 512:(b + 1) * 512], stationary=s, moving=m, accumulate=(k > 0))
    assert np.all(rd(acc) == 3 * 128)


# ---- the constraint table (nkisim/CONSTRAINTS.md) and the ids cited in nkisim's source ---------------------------

_NKISIM = Path(nkisim.__file__).parent
_ID = re.compile(r"\bC(\d{1,3})\b")


def _table_ids():
    rows = [ln for ln in (_NKISIM / "CONSTRAINTS.md").read_text().splitlines() if re.match(r"\|\s*C\d+\s*\|", ln)]
    ids = [int(re.match(r"\|\s*C(\d+)", ln).group(1)) for ln in rows]
    for ln in rows:  # every row states a rule, the ops and an AWS source
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == 4 and all(cells), f"incomplete row: {ln}"
    return ids


def _source_ids():
    found = {}
    for f in sorted(_NKISIM.rglob("*.py")):
        for m in _ID.finditer(f.read_text()):
            found.setdefault(int(m.group(1)), f"{f.relative_to(_NKISIM.parent)}")
    return found


def test_constraint_table_has_unique_consecutive_ids():
    ids = _table_ids()
    assert len(ids) == len(set(ids)), "duplicate constraint ids in CONSTRAINTS.md"
    assert sorted(ids) == list(range(1, max(ids) + 1))


def test_every_id_cited_in_nkisim_is_in_the_table_and_vice_versa():
    table, cited = set(_table_ids()), _source_ids()
    missing = {f"C{i} (first cited in {where})" for i, where in cited.items() if i not in table}
    assert not missing, f"ids cited in nkisim/ but absent from nkisim/CONSTRAINTS.md: {sorted(missing)}"
    unused = {f"C{i}" for i in table if i not in cited}
    assert not unused, f"rows of nkisim/CONSTRAINTS.md that no check in nkisim/ cites: {sorted(unused)}"
