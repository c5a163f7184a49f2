"""The launch configuration of the decode kernel (nki_kernels/attention/decode/config.py) built directly: the fp8
cache's half-dim K^T stacks and the SBUF its K/V ring takes."""

import pytest

import nkisim

nkisim.install()

import nki.language as nl  # noqa: E402

from nki_kernels.attention.decode import config  # noqa: E402
from nki_kernels.attention.decode.config import (  # noqa: E402
    KV_SBUF_MAX,
    KV_SBUF_MIN,
    P_MAX,
    SBUF_RESERVE,
    W_STREAM_BUFS,
    W_STREAM_CHUNK,
    _Config,
    _ring_bytes,
    _weight_plan,
)


def _cfg(B, H, d, nq, fp8=False, fp8_mm=False):
    return _Config(B, 1, H, d, 1, nq, 16384, 16384, d ** -0.5, H, 0, 2, fp8=fp8, fp8_mm=fp8_mm)


@pytest.mark.parametrize("B,H,d,nq", [(16, 3072, 64, 8), (16, 4096, 128, 4), (3, 4096, 128, 4)])
def test_fp8_stacks_hold_half_the_dims_of_twice_the_batches(B, H, d, nq):
    bf16, fp8 = _cfg(B, H, d, nq), _cfg(B, H, d, nq, fp8=True)
    assert (fp8.halves, fp8.kd) == (2, d // 2) and (bf16.halves, bf16.kd) == (1, d)
    assert fp8.kpp == 2 * bf16.kpp and fp8.kpp * fp8.kd == P_MAX
    assert fp8.nst == 2 * fp8.ngroups
    # as many score matmuls per step as bf16 (stacks of the pack), with the pack bf16 would use; one more when
    # a load group is half full (an odd count of bf16 stacks)
    assert fp8.pack == bf16.pack
    stacks = lambda c: (c.pack + c.kpp - 1) // c.kpp * c.halves   # noqa: E731
    assert stacks(fp8) == stacks(bf16) + stacks(bf16) % 2


@pytest.mark.parametrize("fp8_mm", [False, True])
def test_fp8_ring_fits_the_kv_budget(fp8_mm):
    c = _cfg(16, 3072, 64, 8, fp8=True, fp8_mm=fp8_mm)
    kt = 1 if fp8_mm else 2
    assert _ring_bytes(c.kv_bufs, c.pack, c.fa_tile, c.kpp, c.d, 2, kt) <= KV_SBUF_MAX
    # reading the pairs in the matmul needs no bf16 stacks: the same pack gets slots at least as long
    assert c.fa_tile >= _cfg(16, 3072, 64, 8, fp8=True).fa_tile


def test_kv_dtype_is_kept_for_the_matmul_views():
    c = _Config(4, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, fp8=True, fp8_mm=True,
                kv_dtype=nl.float8_e4m3)
    assert c.fp8_mm and c.kv_dtype == nl.float8_e4m3
    assert not _Config(4, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, fp8_mm=True).fp8_mm   # bf16 cache


# ---- weights resident or streamed (_weight_plan) ------------------------------------------------------------------

# (B, S, H, d, nkv, nq): nki-library's envelope rows (bench/test_decode_attention_nkilib.py) and model rank shards
RESIDENT_SHAPES = [
    (1, 1, 8192, 128, 1, 1), (2, 5, 5120, 128, 1, 1), (8, 1, 5376, 128, 1, 2), (16, 1, 4096, 128, 1, 4),
    (8, 1, 8192, 128, 1, 4), (4, 1, 3072, 64, 1, 8), (64, 1, 3072, 64, 1, 8), (16, 1, 4096, 128, 1, 4),
    (64, 4, 8192, 128, 1, 8), (16, 1, 3072, 64, 1, 8), (8, 1, 1024, 128, 2, 8),
]


def _cfg_lnc(B, S, H, d, nkv, nq, lnc, core, ctx=4096):
    return _Config(B, S, H, d, nkv, nq, ctx, ctx, d ** -0.5, H, 0, 2, n_prog=lnc, core=core)


@pytest.mark.parametrize("shape", RESIDENT_SHAPES)
@pytest.mark.parametrize("lnc", [1, 2])
def test_weights_that_fit_stay_resident(shape, lnc):
    """Every shape that ran before streaming existed keeps both weights resident (its figures do not move)."""
    for core in range(lnc):
        c = _cfg_lnc(*shape, lnc, core)
        assert (c.wq_chunk, c.wq_bufs, c.wo_chunk, c.wo_bufs) == (0, 0, 0, 0)


def test_q16_h7168_streams_at_lnc1_and_is_resident_per_core_at_lnc2():
    """nki-library's q16 d128 H7168 B8 shape: W_qkv (56 tiles of 4608 B = 252 KiB per partition) and W_o (16 K chunks
    of 14 KiB = 224 KiB) exceed the usable SBUF (trn2: 208 KiB) at LNC=1 and stream; an LNC=2 weight split leaves each
    core half of each (126 / 112 KiB), resident. The streaming rings fit beside the K/V ring's floor."""
    sbuf = nl.tile_size.sbuf_fmax_bytes
    c1 = _cfg_lnc(8, 1, 7168, 128, 1, 16, 1, 0, ctx=10240)
    assert c1.wq_chunk and c1.wo_chunk
    assert c1.wq_bufs == c1.wo_bufs == W_STREAM_BUFS
    assert c1.wq_bufs * c1.wq_chunk * c1.C * 2 <= sbuf - SBUF_RESERVE
    assert c1.wo_bufs * c1.wo_chunk * 7168 * 2 <= sbuf - SBUF_RESERVE - KV_SBUF_MIN
    assert -(-56 // c1.wq_chunk) > c1.wq_bufs and -(-16 // c1.wo_chunk) > c1.wo_bufs     # buffers are reused
    for core in (0, 1):
        c2 = _cfg_lnc(8, 1, 7168, 128, 1, 16, 2, core, ctx=10240)
        assert c2.wsplit and (c2.wq_chunk, c2.wo_chunk) == (0, 0)


@pytest.mark.parametrize("row,n", [(4608, 56), (14336, 16), (3072, 8), (2048, 8), (1024, 16), (40000, 7), (512, 3)])
@pytest.mark.parametrize("room", [None, 8 * 1024, 14000, 64 * 1024])
@pytest.mark.parametrize("which", [0, 1])
def test_weight_plan_rings_fit_their_room(row, n, room, which, monkeypatch):
    """Resident iff the share fits its room; a streamed weight's ring (whole tiles, two or more buffers, no more
    buffers than chunks) fits the room, with chunks of about W_STREAM_CHUNK bytes; a weight of which even
    W_STREAM_BUFS single tiles do not fit is refused, named."""
    monkeypatch.setattr(config, "WEIGHT_ROOM", room)
    sbuf = nl.tile_size.sbuf_fmax_bytes
    rm = (sbuf - SBUF_RESERVE - which * KV_SBUF_MIN) if room is None else room
    args = (row, n, 2, 1) if which == 0 else (2, 1, row, n)        # the other weight: one tiny tile, resident
    if n * row > rm and W_STREAM_BUFS * row > rm:
        with pytest.raises(AssertionError, match=("W_qkv", "W_o")[which]):
            _weight_plan(*args, sbuf)
        return
    plan = _weight_plan(*args, sbuf)
    chunk, bufs = plan[2 * which:2 * which + 2]
    assert plan[2 - 2 * which:4 - 2 * which] == (0, 0)
    if n * row <= rm:
        assert (chunk, bufs) == (0, 0)
        return
    n_chunks = -(-n // chunk)
    assert 1 <= chunk and 2 <= bufs <= min(W_STREAM_BUFS, n_chunks)
    assert bufs * chunk * row <= rm and (chunk == 1 or chunk * row <= W_STREAM_CHUNK)


def test_weight_plan_names_a_weight_too_wide_to_stream(monkeypatch):
    monkeypatch.setattr(config, "WEIGHT_ROOM", 8 * 1024)
    with pytest.raises(AssertionError, match="W_o: 3 buffers of one 4096-byte"):
        _weight_plan(1024, 100, 4096, 8, nl.tile_size.sbuf_fmax_bytes)


class _W:      # a weight's dtype, as _wo_pieces reads it
    class dtype:
        itemsize = 2


@pytest.mark.parametrize("B,H,lnc,groups,pieces,d", [
    (16, 4096, 1, (True, 8, 8), ((0, 28), (28, 32)), 128),     # Llama-3.1-8B TP8 B=16: one group per eviction
    (8, 4096, 1, (True, 16, 16), ((0, 24), (24, 32)), 128),    # B=8: groups of 16 chunks
    (16, 5376, 1, (True, 8, 8), ((0, 38), (38, 42)), 128),     # a partial last group (42 chunks)
    (1, 4096, 1, (True, 32, 32), ((0, 16), (16, 32)), 128),    # one eviction: W_o's pieces as before
    (8, 4096, 2, (True, 16, 16), ((16, 32),), 128),           # LNC=2 core 1: one eviction of its 16 chunks
    (8, 3072, 1, (True, 12, 12), ((0, 18), (18, 24)), 64),     # GPT-OSS-20B TP8 (d = 64) B=8: groups of 12 chunks
    (16, 3072, 1, (True, 8, 8), ((0, 20), (20, 24)), 64),     # B=16: one group of 8 per eviction
    (8, 3072, 2, (True, 12, 12), ((12, 24),), 64),            # LNC=2 core 1
])
def test_wo_last_piece_is_half_the_last_eviction(B, H, lnc, groups, pieces, d):
    """d = 128 / 64 token tiles stored eviction by eviction (oproj._early_store): one packed group per eviction, and
    W_o in two column pieces, the last one half of the last eviction's columns (oproj._wo_pieces); other tiles keep
    the pieces of >= 3 KiB runs. The pieces always partition this core's columns."""
    from nki_kernels.attention.decode.oproj import _out_groups, _wo_pieces
    from nki_kernels.attention.decode.planning import _token_tiles

    cfg = _Config(B, 1, H, d, 1, 512 // d, 4096, 4096, d ** -0.5, H, 0, 2, n_prog=lnc, core=lnc - 1)
    tiles = _token_tiles(cfg, 0, B)
    assert len(tiles) == 1 and _out_groups(cfg, tiles[0].nt) == groups
    got = _wo_pieces(cfg, _W, tiles)
    assert got == pieces
    hc0, hc1 = cfg.hc
    assert got[0][0] == hc0 and got[-1][1] == hc1 and all(a[1] == b[0] for a, b in zip(got, got[1:]))


# ---- the last pack's K^T ANDs in column pieces (_Config.last_and_pieces) ------------------------------------------

@pytest.mark.parametrize("B,H,d,nq,ctx,lnc,pieces", [
    (8, 3072, 64, 8, 16384, 1, config.LAST_K_AND_PIECES),    # GPT-OSS B=8 16K: tail_cuts
    (64, 3072, 64, 8, 16384, 1, config.LAST_K_AND_PIECES),   # GPT-OSS B=64 16K: pack_tables, tail_cuts
    (8, 3072, 64, 8, 4096, 2, config.LAST_K_AND_PIECES),     # LNC=2 batch split, one pack per core: tail_cuts
    (8, 3072, 64, 8, 4096, 1, 1),                            # GPT-OSS B=8 4K: neither
    (8, 4096, 128, 4, 4096, 1, config.LAST_AND_SPLIT),       # Llama-8B B=8 4K: k_first, last_and_split
    (16, 4096, 128, 4, 16384, 2, config.LAST_AND_SPLIT),     # Llama-8B B=16 16K LNC=2
    (1, 3072, 64, 8, 4096, 1, 1),                            # B=1: position-major, neither
])
def test_last_and_pieces_is_the_one_field_of_both_flags(B, H, d, nq, ctx, lnc, pieces):
    """The kernel's last pack ANDs each K^T stack in cfg.last_and_pieces column pieces (isolation._scrub_slot):
    LAST_K_AND_PIECES under tail_cuts, LAST_AND_SPLIT under last_and_split, 1 otherwise (trn2; every core)."""
    for core in range(lnc):
        c = _cfg_lnc(B, 1, H, d, 1, nq, lnc, core, ctx)
        assert c.last_and_pieces == pieces
        assert c.last_and_pieces == (config.LAST_K_AND_PIECES if c.tail_cuts
                                     else config.LAST_AND_SPLIT if c.last_and_split else 1)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_tail_cuts_and_last_and_split_never_both_hold(target, monkeypatch):
    """The two flags of the last pack's K^T pieces hold on disjoint shapes (tail_cuts: two-batch stacks; last_and_split:
    d = 128), so last_and_pieces never has to choose between them; trn3 takes neither (both follow v_rot)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    seen = set()
    for B in (1, 2, 4, 8, 16, 32, 64):
        for H, d, nq in ((3072, 64, 8), (4096, 128, 4), (5120, 128, 1)):
            for ctx in (1024, 4096, 8192, 16384):
                for lnc in (1, 2):
                    for core in range(lnc):
                        c = _cfg_lnc(B, 1, H, d, 1, nq, lnc, core, ctx)
                        assert not (c.tail_cuts and c.last_and_split), (B, H, d, nq, ctx, lnc, core)
                        seen.add(c.last_and_pieces)
    assert seen == ({1, config.LAST_K_AND_PIECES, config.LAST_AND_SPLIT} if target == "trn2" else {1})


# ---- RoPE on the transposed QKV sums (_Config.rope_t) ----------------------------------------------------------------

class _T:      # an argument's shape and dtype, as the validation reads them
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _validated(B, H, d, nq, lnc, core, cos_dtype, ctx=4096):
    """_validate_inputs on GPT-OSS-like bf16 arguments (one KV head); cos_dtype None: no RoPE tables."""
    bf16 = nl.bfloat16
    cache = _T((B, 1, ctx, d), bf16)
    tables = None if cos_dtype is None else _T((B, 1, d // 2), cos_dtype)
    return config._validate_inputs(_T((B, 1, H), bf16), _T((H, (nq + 2) * d), bf16), cache, cache,
                                   _T((B, 1), nl.int32), tables, tables, _T((nq * d, H), bf16), None, None, None, None,
                                   0, 0.0, 0, 0, n_prog=lnc, core=core)


@pytest.mark.parametrize("B,H,d,nq,lnc,cos_dtype,rope_t", [
    (8, 3072, 64, 8, 2, nl.bfloat16, True),      # GPT-OSS B=8 LNC=2: batch split with split weights
    (1, 3072, 64, 8, 2, nl.bfloat16, True),      # B=1 LNC=2: context split (weights split too)
    (8, 4096, 128, 4, 2, nl.bfloat16, True),     # Llama-8B B=8 LNC=2 (kpp = 1)
    (8, 3072, 64, 8, 2, None, False),            # no RoPE tables
    (8, 3072, 64, 8, 2, nl.float32, False),      # tables in another dtype than W_qkv: the token-layout RoPE
    (8, 3072, 64, 8, 1, nl.bfloat16, False),     # LNC=1: no exchanged sums
    (1, 128, 64, 8, 2, nl.bfloat16, False),      # context split of one H tile: the contraction is not split
])
def test_rope_t_carries_the_tables_eligibility(B, H, d, nq, lnc, cos_dtype, rope_t):
    """_Config.rope_t is the whole decision of qkv._qkv_projection's transposed RoPE: the split weights with a split
    contraction (KT >= 2) and RoPE tables given in W_qkv's dtype (the kernel no longer checks the tables at run
    time); every core decides alike."""
    for core in range(lnc):
        c = _validated(B, H, d, nq, lnc, core, cos_dtype)
        assert c.rope_t == rope_t
        assert not c.rope_t or (c.wsplit and c.KT >= 2)
    # built directly, without tables (the attention-DP gathered config's way), it is off
    assert not _Config(8, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, n_prog=2, core=0).rope_t
    assert _Config(8, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, n_prog=2, core=0, rope_tables=True).rope_t
