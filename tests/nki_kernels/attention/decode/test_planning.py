"""The pure planning functions of the decode kernel (nki_kernels/attention/decode/planning.py) on configurations
built directly (no kernel run): every position scanned once, in the order the ragged gates rely on."""

import pytest

import nkisim

nkisim.install()

from nki_kernels.attention.decode.config import FA_SUB, P_MAX, PSUM_F, _Config  # noqa: E402
from nki_kernels.attention.decode.planning import (  # noqa: E402
    _load_pieces,
    _oT_head_runs,
    _packs,
    _plan,
    _slot_bounds,
    _slot_split,
    _token_tiles,
)

# (B, S, H, d, nkv, nq, S_max, L, block size): GPT-OSS / Llama rank shards, a remainder, paged, odd sizes
CONFIGS = [
    (16, 1, 3072, 64, 1, 8, 4096, 4096, 0),
    (3, 2, 4096, 128, 1, 4, 600, 600, 0),
    (64, 1, 4096, 128, 1, 4, 16384, 16384, 0),
    (5, 4, 1024, 128, 2, 8, 2048, 2048, 0),
    (4, 1, 3072, 64, 1, 8, 32 * 64, 2048, 64),
    (2, 1, 4096, 128, 1, 4, 8 * 512, 4096, 512),
]


def _cfg(B, S, H, d, nkv, nq, s_max, L, bs):
    mb = s_max // bs if bs else 0
    return _Config(B, S, H, d, nkv, nq, s_max, L, d ** -0.5, H, 0, 2, bs, mb)


@pytest.mark.parametrize("c", CONFIGS)
def test_slots_and_steps_cover_the_scan_once_in_order(c):
    cfg = _cfg(*c)
    bounds = _slot_bounds(cfg, cfg.lo, cfg.hi)
    assert bounds[0] == 0 and bounds[-1] == cfg.scan and all(a < b for a, b in zip(bounds, bounds[1:]))
    slots, steps = _plan(cfg)
    assert [j0 for j0, _ in slots] == bounds[:-1]
    for k, (j0, w) in enumerate(slots):
        n, rem = w // P_MAX, w % P_MAX
        vblocks = sorted(vb for s in steps if s.slot == k for *_, vb in s.blocks)
        assert vblocks == list(range(n)) + ([n] if rem else [])      # every V block (so every position) once
        if cfg.paged:
            assert w % P_MAX == 0 and (w // P_MAX) & (w // P_MAX - 1) == 0 and j0 % w == 0 and w >= cfg.bs
            assert _slot_split(cfg, w) in (1, *range(2, P_MAX // 16 + 1))
    pos0 = [s.pos0 for s in steps]
    assert pos0 == sorted(pos0)           # skipped steps are a suffix (_step_gates)
    # row-major steps: two PSUM banks of scores; position-major ones: one bank of [128, tiles * rows]
    rows = min(cfg.pack, cfg.b_hi - cfg.b_lo) * cfg.R
    assert all(s.cols <= FA_SUB if not cfg.pmajor else len(s.blocks) * rows <= PSUM_F for s in steps)


@pytest.mark.parametrize("c", CONFIGS)
def test_load_pieces_partition_each_slot(c):
    cfg = _cfg(*c)
    for j0, w in _plan(cfg)[0]:
        pieces = _load_pieces(cfg, j0, w)
        # the scan's first piece as prefix alternatives (_first_prefixes): growing prefixes of the same start, one
        # of which a sequence loads; the longest is the piece that partitions the slot with the others
        alts = [pc for pc in pieces if pc[0] == pieces[0][0]]
        assert all(a == j0 and s < s2 for (a, s), (_, s2) in zip(alts, alts[1:]))
        assert len(alts) == 1 or j0 == 0
        pieces = [pc for k, pc in enumerate(pieces) if k + 1 == len(pieces) or pieces[k + 1][0] != pc[0]]
        assert pieces[0][0] == j0 and sum(size for _, size in pieces) == w
        assert all(a + s == b for (a, s), (b, _) in zip(pieces, pieces[1:]))
        n = w // P_MAX
        body = [(a, s) for a, s in pieces + alts if a < j0 + n * P_MAX]
        assert all(s % n == 0 and (a - j0) % n == 0 for a, s in body)    # whole V partitions


@pytest.mark.parametrize("B,lo,hi", [(16, 0, 16), (64, 0, 64), (9, 5, 9), (64, 32, 64)])
def test_packs_and_token_tiles(B, lo, hi):
    cfg = _cfg(B, 1, 3072, 64, 1, 8, 1024, 1024, 0)
    packs = _packs(cfg, lo, hi)
    assert packs[0].p0 == lo and sum(p.nb for p in packs) == hi - lo
    assert all(a.p0 + a.nb == b.p0 for a, b in zip(packs, packs[1:]))
    assert max(p.nb for p in packs) - min(p.nb for p in packs) <= 1 and max(p.nb for p in packs) <= cfg.pack
    tiles = _token_tiles(cfg, lo, hi)
    assert tiles[0].b0 == lo and sum(t.nb for t in tiles) == hi - lo
    assert all(t.nt == t.nb * cfg.S <= cfg.tile_tok and t.t0 == t.b0 * cfg.S for t in tiles)


@pytest.mark.parametrize("c,pmajor", [
    ((1, 1, 3072, 64, 1, 8, 4096, 4096, 0), True),        # GPT-OSS B=1: 8 query rows
    ((2, 1, 4096, 128, 1, 4, 4096, 4096, 0), True),       # Llama-8B B=2: 8 rows in one pack
    ((8, 1, 3072, 64, 1, 8, 4096, 4096, 0), False),       # 64 rows: the row-major steps
    ((1, 1, 4096, 128, 1, 4, 600, 600, 0), False),        # a remainder tile (S_max not a multiple of 128)
    ((1, 1, 4096, 128, 1, 4, 32 * 64, 2048, 64), False),  # paged: the i-major layout
])
def test_position_major_steps_for_few_rows(c, pmajor):
    cfg = _cfg(*c)
    assert cfg.pmajor is pmajor
    if pmajor:    # every step's position-major scores fit one PSUM bank of the score buffer
        rows = min(cfg.pack, cfg.b_hi - cfg.b_lo) * cfg.R
        assert all(len(s.blocks) * rows <= PSUM_F and s.cols % P_MAX == 0 for s in _plan(cfg)[1])


def test_config_is_frozen():
    """Every derived size is decided at construction: reassigning one afterwards raises."""
    cfg = _cfg(*CONFIGS[0])
    with pytest.raises(AttributeError, match="frozen"):
        cfg.pack = 1
    assert cfg.pack > 1


# LNC=2 batch splits at or beyond STRIDE_MIN_SCAN: (B, S, H, d, nkv, nq, S_max, L, block size)
STRIDE_CONFIGS = [
    (16, 1, 3072, 64, 1, 8, 16384, 16384, 0),      # GPT-OSS-20B TP8
    (8, 1, 4096, 128, 1, 4, 8192, 8192, 0),        # Llama-3.1-8B TP8
    (4, 2, 1024, 128, 2, 8, 9000, 9000, 0),        # 2 KV heads, S_tkg 2, a remainder slot
    (6, 1, 3072, 64, 1, 8, 64 * 160, 10240, 64),   # paged
]


@pytest.mark.parametrize("c", STRIDE_CONFIGS)
def test_stride_split_shares_every_length_between_the_cores(c):
    """Runtime-balanced batch split (config._split_stride): both cores plan every sequence, their slots partition
    the whole scan's, and for EVERY cache length the two cores' real positions differ by at most one slot (FA_SUB):
    the balance holds whatever the runtime lengths. Shorter scans keep whole sequences per core."""
    B, S, H, d, nkv, nq, s_max, L, bs = c
    mb = s_max // bs if bs else 0
    cfgs = [_Config(B, S, H, d, nkv, nq, s_max, L, d ** -0.5, H, 0, 2, bs, mb, n_prog=2, core=k) for k in (0, 1)]
    assert all(cf.stride and cf.split and cf.wsplit and (cf.b_lo, cf.b_hi) == (0, B) for cf in cfgs)
    assert cfgs[0].fa_tile <= FA_SUB
    plans = [_plan(cf)[0] for cf in cfgs]
    whole = _slot_bounds(cfgs[0], 0, cfgs[0].scan)
    assert sorted(j0 for p in plans for j0, _ in p) == whole[:-1]     # each slot on exactly one core
    assert plans[0][0].j0 == 0                                          # core 0: the first slot (and the new tokens)
    for length in range(0, cfgs[0].scan + 1, 64):
        share = [sum(max(0, min(length, j0 + w) - j0) for j0, w in p) for p in plans]
        assert abs(share[0] - share[1]) <= FA_SUB, (length, share)
    short = _Config(B, S, H, d, nkv, nq, 4096, 4096, d ** -0.5, H, 0, 2, bs, 4096 // bs if bs else 0, n_prog=2,
                    core=1)
    assert short.wsplit and not short.stride and (short.b_lo, short.b_hi) == (B // 2, B)


def test_stride_split_not_where_whole_sequences_take_position_major_steps():
    """Few query rows per core (Llama-8B B=2: 4 rows each; nki-library q1 B2 S5: 5): whole sequences per core keep
    the position-major steps, which the balanced split's doubled packs (8 / 10 rows) would lose."""
    for B, S, nq in ((2, 1, 4), (2, 5, 1)):
        cfg = _Config(B, S, 4096, 128, 1, nq, 16384, 16384, 128 ** -0.5, 4096, 0, 2, n_prog=2, core=0)
        assert cfg.wsplit and not cfg.stride and cfg.pmajor and (cfg.b_lo, cfg.b_hi) == (0, 1)


@pytest.mark.parametrize("c", CONFIGS)
def test_oT_head_runs_place_every_head_once(c):
    """Each (KV group, head, e) lands once on o^T's row (hg*d + e) % 128 of chunk (hg*d + e) // 128, through the
    run of its half u: partitions u*d.., chunk k0 + i for the run's i-th head h0 + i*dup."""
    cfg = _cfg(*c)
    d, G, dup = cfg.d, cfg.group, P_MAX // cfg.d
    placed = {}
    for g in range(cfg.nkv):
        for u, h0, cnt, k0 in _oT_head_runs(cfg, g):
            assert 0 <= h0 < G and cnt >= 1 and h0 + (cnt - 1) * dup < G
            for i in range(cnt):
                hg = g * G + h0 + i * dup
                assert hg * d // P_MAX == k0 + i and hg * d % P_MAX == u * d
                placed[hg] = placed.get(hg, 0) + 1
    assert placed == {hg: 1 for hg in range(cfg.nkv * G)}



@pytest.mark.parametrize("B,H,d,nq,ctx,lnc,width,pairs", [
    (9, 4096, 128, 4, 4096, 1, FA_SUB, True),     # Llama-8B 4K, 2 packs: one-step slots only, K^T pairs
    (7, 4096, 128, 4, 4096, 2, FA_SUB, True),     # ... LNC=2 weight split
    (8, 4096, 128, 4, 4096, 1, 2048, False),      # B=8 4K: the first slot whole (first_whole), the others narrower
    (16, 4096, 128, 4, 4096, 1, 2048, False),     # B=16 4K (k_packs: whole 2048-position slots, two pieces)
    (16, 3072, 64, 8, 4096, 1, FA_SUB, False),    # GPT-OSS B=16 4K: half pieces
    (16, 3072, 64, 8, 16384, 1, 2048, False),     # 16K: two-piece slots
    (1, 3072, 64, 8, 4096, 1, 2048, False),       # one sequence (position-major): no k_plain
    (64, 3072, 64, 8, 1024, 1, FA_SUB, False),    # nki-library q8 d64 B64 1K: a one-slot plan
])
def test_kt_width_and_pair_k_read_the_callers_plan(B, H, d, nq, ctx, lnc, width, pairs, monkeypatch):
    """planning._kt_width / _pair_k take the plan's slots from the caller that built it (flash, ragged) instead of
    rebuilding _plan(cfg) per call (per slot and batch); the answers are the plan's: the widest slot, and a pair load
    only for one-piece slots of that width in a plan of two slots or more."""
    from nki_kernels.attention.decode import planning
    from nki_kernels.attention.decode.planning import _kt_width, _pair_k, _whole_k

    cfgs = [_Config(B, 1, H, d, 1, nq, ctx, ctx, d ** -0.5, H, 0, 2, n_prog=lnc, core=k) for k in range(lnc)]
    plans = [_plan(cfg)[0] for cfg in cfgs]

    def no_plan(_cfg):
        raise AssertionError("_plan rebuilt: _kt_width / _pair_k must read the slots they are given")

    monkeypatch.setattr(planning, "_plan", no_plan)
    for cfg, slots in zip(cfgs, plans):
        assert _kt_width(cfg, slots) == max(sl.w for sl in slots) == width
        got = [_pair_k(cfg, slots, sl.j0, sl.w) for sl in slots]
        assert any(got) == pairs
        for sl, pk in zip(slots, got):
            one_piece = all(a == sl.j0 for a, _s in _load_pieces(cfg, sl.j0, sl.w))
            assert pk == (cfg.k_plain and one_piece and sl.w == width and _whole_k(cfg, sl.j0, sl.w) is None
                          and len(slots) >= 2)
