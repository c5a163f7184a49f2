"""Pure planning of a launch: token tiles, batch packs, K/V slots, online-softmax steps and load pieces.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.language as nl

from .config import (
    FA_SUB,
    FIRST_PIECE_MIN,
    FIRST_SPLIT,
    FIRST_SPLIT_WSPLIT,
    GATHER_ROWS_MIN,
    LAST_HALF_V4,
    P_MAX,
    PMAJOR_TILES,
    PSUM_F,
)


class _TokenTile(nl.NKIObject):
    """A token tile: tokens [t0, t0 + nt) on the partitions, the whole sequences [b0, b0 + nb)."""

    def __init__(self, t0, nt, b0, nb):
        self.t0, self.nt, self.b0, self.nb = t0, nt, b0, nb


def _token_tiles(cfg, b_lo, b_hi):
    """Token tiles (_TokenTile) of sequences [b_lo, b_hi): whole sequences, at most cfg.tile_tok tokens each."""
    tiles = []
    per_tile = cfg.tile_tok // cfg.S
    b = b_lo
    while b < b_hi:
        nb = min(per_tile, b_hi - b)
        tiles.append(_TokenTile(b * cfg.S, nb * cfg.S, b, nb))
        b += nb
    return tuple(tiles)


class _Pack(nl.NKIObject):
    """A batch pack: sequences [p0, p0 + nb) sharing the partitions of one score tile. Unpacks as (p0, nb)."""

    def __init__(self, p0, nb):
        self.p0, self.nb = p0, nb

    def __iter__(self):
        return iter((self.p0, self.nb))


class _Slot(nl.NKIObject):
    """A K/V load slot: scan positions [j0, j0 + w) in one ring buffer. Unpacks as (j0, w)."""

    def __init__(self, j0, w):
        self.j0, self.w = j0, w

    def __iter__(self):
        return iter((self.j0, self.w))


def _packs(cfg, b_lo, b_hi):
    """Balanced batch packs (_Pack) of this core, ceil(batches / packs) sequences each."""
    n_packs = (b_hi - b_lo + cfg.pack - 1) // cfg.pack
    per = (b_hi - b_lo + n_packs - 1) // n_packs
    return tuple(_Pack(b_lo + pi * per, min(per, b_hi - b_lo - pi * per)) for pi in range(n_packs))


class _Step(nl.NKIObject):
    """One online-softmax step over the cache: slot index, score chunks, key layout and P^T / V blocks."""

    def __init__(self, slot, pos0, chunks, key_id, key_pattern, blocks):
        self.slot, self.pos0, self.chunks = slot, pos0, chunks
        self.key_id, self.key_pattern, self.blocks = key_id, key_pattern, blocks
        self.cols = chunks[-1][1]
        self.sc, self.thr_hi, self.thr_lo = None, None, None
        self.thr_rot = None     # a step over a rotated slot (_v_rotated): thresholds of each half of the columns
        self.halves = None      # _Config.p128: the thresholds of the two partition halves (flash._p128_steps)
        self.stack_gates = None     # ragged: per K^T load group, a runtime trip count (ragged._stack_gates)


def _slot_bounds(cfg, lo, hi):
    """Slot boundaries over scan positions [lo, hi).

    Contiguous: slots of fa_tile positions, the last one split so that only FA_SUB positions arrive last (the
    compute left after the last K/V byte is then one step; _Config.last_half: LAST_HALF_V4, half a step); row-major
    steps on scans up to FIRST_SPLIT positions (FIRST_SPLIT_WSPLIT with LNC=2 split weights), and position-major
    ones with split weights (a context split's core: below FIRST_SPLIT_WSPLIT), split the first one too, so the
    first step starts on FA_SUB positions instead of a whole slot (its transfers no longer hold every DMA engine for
    ~10 us while the weights' dependants wait).
    Paged: slots of 128 * 2^m positions, each starting at a multiple of its own size, largest first. A paged slot
    is whole blocks: the scan's bounds are multiples of u = max(128, block size) and fa_tile >= FA_SUB >= MAX_BLOCK,
    so the halving stops at w >= block size.
    _Config.k_packs (Llama-8B-like ragged scans of >= KW_PACKS packs on trn2) splits neither: whole slots' K^T / V
    transfers are longer runs, and the other packs' loads stream behind a pack's first and last steps.
    _Config.first_whole (Llama-8B B=8 4K on trn2, LNC=1 and the LNC=2 weight split) keeps the first one whole.
    """
    if not cfg.paged:
        bounds = list(range(lo, hi, cfg.fa_tile)) + [hi]
        if not cfg.k_packs and len(bounds) >= 2 and bounds[-1] - bounds[-2] > FA_SUB:
            bounds.insert(len(bounds) - 1, bounds[-1] - FA_SUB)
        # position-major with split weights: the QKV partial-sum exchange queues behind the first slot's transfers
        # otherwise (modelled nki-library q1 B2 S5 10K LNC=2 39.8 -> 37.7 us); a context split's core scanning
        # FIRST_SPLIT_WSPLIT positions or more keeps its first slot whole (split: GPT-OSS / Llama-8B B=1 16K LNC=2
        # 33.2 -> 34.2 / 35.9 -> 38.2 us)
        first = (cfg.wsplit and (not cfg.split or hi - lo < FIRST_SPLIT_WSPLIT)) if cfg.pmajor else \
            hi - lo <= (FIRST_SPLIT_WSPLIT if cfg.wsplit else FIRST_SPLIT) and not cfg.k_packs and not cfg.first_whole
        if first and len(bounds) >= 2 and bounds[1] - bounds[0] > FA_SUB:
            bounds.insert(1, bounds[0] + FA_SUB)
        if cfg.last_half and bounds[-1] - bounds[-2] > LAST_HALF_V4:    # half a step after the last K/V byte
            bounds.insert(len(bounds) - 1, bounds[-1] - LAST_HALF_V4)
        return bounds
    bounds = [lo]
    j = lo
    while j < hi:
        w = cfg.fa_tile
        while w > P_MAX and (j % w != 0 or j + w > hi):
            w //= 2
        if w > FA_SUB and j + w == hi:     # last slot: halve down to FA_SUB positions arriving last
            w //= 2
        assert w >= cfg.bs, f"paged slot of {w} positions < block size {cfg.bs}: the plan's invariant is broken"
        j += w
        bounds.append(j)
    return bounds


def _stride_slots(bounds, core):
    """Indices of the slots (of bounds) core `core` scans in a runtime-balanced batch split (config._split_stride):
    slot si goes to core ((si + 1) // 2) % 2, i.e. 0, 1, 1, 0, 0, 1, 1, 0, ... Equal-width slots in that order give
    every sequence, whatever its length, shares that differ by at most one slot (a prefix of the pattern never
    leads by more than one), and pairing the slots ABBA cancels a linear decrease of the work with the position
    (fewer sequences reach the later slots), which alternating ABAB would leave to core 0 in every pair. Core 0 also
    runs the new tokens' step; it gets the first slot, as many slots as core 1 or one more."""
    return [si for si in range(len(bounds) - 1) if (si + 1) // 2 % 2 == core]


def _plan(cfg):
    """Slots (_Slot: j0, w) of this core's cache scan [cfg.lo, cfg.hi) and the steps over them (static).

    Slot layout: K^T [d, w] by DMA transpose; V so that partition q holds positions q*n + i (n = w // 128, one
    contiguous run of n*d elements per partition), the last w % 128 positions as one more block. A step covers
    i in [i0, i0 + ni) for all q (ni a power of two, so 512-column score chunks align with the PSUM banks):
    score column q*ni + il <-> position q*n + i0 + il, so the P^T block of V block i0 + il is the stride-ni column
    set il::ni of P. Keys beyond L - S are read only up to the next multiple of 128 (and S_max): they are masked.
    """
    bounds = _slot_bounds(cfg, cfg.lo, cfg.hi)
    slots, steps = [], []
    own = range(len(bounds) - 1) if not cfg.stride else _stride_slots(bounds, cfg.core)
    # tiles of 128 positions per step: FA_SUB / 128 (two PSUM banks of row-major scores); position-major steps take
    # as many as one bank of [128, tiles * rows] scores holds (fewer steps: the per-step chain is fixed work)
    ni_max = FA_SUB // P_MAX
    if cfg.pmajor:
        rows = min(cfg.pack, cfg.b_hi - cfg.b_lo) * cfg.R
        while 2 * ni_max * rows <= PSUM_F and 2 * ni_max <= PMAJOR_TILES:
            ni_max *= 2
    for si in own:
        j0, w = bounds[si], bounds[si + 1] - bounds[si]
        n, rem = w // P_MAX, w % P_MAX
        k = len(slots)
        slots.append(_Slot(j0, w))
        i0 = 0
        while cfg.imajor and i0 < n:     # i-major score layout: column il*128 + q' (see _load_slot_paged)
            ni = FA_SUB // P_MAX
            while ni > n - i0:
                ni //= 2
            K = _slot_split(cfg, w)
            per = PSUM_F // P_MAX
            chunks = tuple((il0 * P_MAX, min(ni, il0 + per) * P_MAX, -1) for il0 in range(0, ni, per))
            blocks = tuple((il * P_MAX, 1, P_MAX, i0 + il) for il in range(ni))
            key = [[1, ni], [n, P_MAX]] if K == 1 else [[1, ni], [n, K], [K * n, P_MAX // K]]
            steps.append(_Step(k, j0 + i0, chunks, f"p{n}_{ni}_{K}", key, blocks))
            i0 += ni
        while i0 < n:
            ni = ni_max
            while ni > n - i0:
                ni //= 2
            qc = min(P_MAX, PSUM_F // ni)
            chunks = tuple((q0 * ni, min(P_MAX, q0 + qc) * ni, ni) for q0 in range(0, P_MAX, qc))
            blocks = tuple((il, ni, P_MAX, i0 + il) for il in range(ni))
            steps.append(_Step(k, j0 + i0, chunks, f"s{n}_{ni}", [[n, P_MAX], [1, ni]], blocks))
            i0 += ni
        if rem:
            steps.append(_Step(k, j0 + n * P_MAX, ((0, rem, 0),), f"r{rem}", [[1, rem]], ((0, 1, rem, n),)))
    return tuple(slots), tuple(steps)


def _slot_split(cfg, w):
    """Paged slot of w = 128 * n positions: K = 1 when n >= bs (partition q holds positions q*n .. q*n + n - 1:
    whole blocks per partition). When n < bs <= w the slot is gathered as R = 128 / K rows of m = K * n positions
    (gathered row t holds positions t*m ..; partition q = r*R + t holds rows r*n .. r*n + n - 1 of gathered row t):
    a gathered row is a whole block (m = bs, K = bs / n) unless that gives fewer than GATHER_ROWS_MIN rows (AWS's
    indirect dma_transpose needs 16..128 index rows), then a sub-block of m = w / 16 positions (K = 128 / 16).
    w >= bs always (see _slot_bounds)."""
    n = w // P_MAX
    if not cfg.paged or n >= cfg.bs:
        return 1
    return min(cfg.bs // n, P_MAX // GATHER_ROWS_MIN)


def _load_pieces(cfg, j0, w):
    """(start, size) of the loads of a slot: contiguous caches load each sequence's slot in pieces of about FA_SUB
    positions (one step's keys, rounded down to whole V partitions of n positions, so the runs stay n * d long) and
    the remainder, so a sequence's loads stop within one step of its length; paged slots are gathered whole."""
    if cfg.imajor or cfg.pack == 1:     # one sequence per pack: its steps' gates already stop it (fewer DMAs)
        return ((j0, w),)
    n = w // P_MAX
    body = n * P_MAX
    step = max(n, FA_SUB // n * n) if n else FA_SUB     # whole V partitions of n positions each
    if cfg.half_pieces and w == FA_SUB:     # two half pieces (config._Config.half_pieces)
        step = FA_SUB // 2
    pieces = tuple((j0 + a, min(step, body - a)) for a in range(0, body, step))
    if j0 == 0 and pieces and cfg.first_prefixes:      # the scan's first piece as prefix alternatives (_first_prefixes)
        pieces = _first_prefixes(pieces[0][1], n, cfg.first_prefixes) + pieces[1:]
    return pieces + (((j0 + body, w - body),) if w > body else ())


def _first_prefixes(size, n, splits):
    """The scan's first piece [0, size) as alternatives (config._Config.first_prefixes): prefixes [0, size / 2^k)
    for k = splits .. 0 (whole V partitions of n positions, at least FIRST_PIECE_MIN positions),
    smallest first. A sequence loads exactly one of them, the shortest holding its rows (ragged._load_gates: a
    prefix runs iff the previous one is too short and it is not, the last one iff the previous one is too short):
    the short sequences of a ragged batch end in the first piece, and each loaded all of it (Llama-8B ragged B=8:
    4096 positions for 1920 rows; 2048 with two splits). One DMA per sequence and cache either way, so a long
    sequence's first piece keeps its DMA efficiency (a K^T transpose of s positions moves 2s-byte runs: splitting
    the piece into consecutive parts, tried first, cost the long sequences what it saved the short ones)."""
    sizes = [size]
    while len(sizes) <= splits and sizes[-1] // 2 >= max(n, FIRST_PIECE_MIN) and sizes[-1] // 2 % n == 0:
        sizes.append(sizes[-1] // 2)
    return tuple((0, s) for s in sizes[::-1])


def _whole_k(cfg, j0, w):
    """Index in _load_pieces(cfg, j0, w) of the slot's first piece (its longest prefix alternative) when an unrotated
    batch loads the slot's K^T as alternatives too (config._Config.k_whole): the first piece alone iff the
    sequence ends inside it, else the whole slot in one transpose (SBUF runs of 2w bytes instead of two of w: DMA
    efficiency 0.85 instead of 0.80 at w = 2048); V stays in pieces (its runs are n * d whatever the DMA). None
    when the slot is not two pieces without a remainder block."""
    pieces = _load_pieces(cfg, j0, w)
    starts = sorted({a for a, _ in pieces})
    if not cfg.k_whole or len(starts) != 2 or w % P_MAX or pieces[-1][0] + pieces[-1][1] != j0 + w:
        return None
    return max(k for k, (a, _s) in enumerate(pieces) if a == j0)


def _kt_width(cfg, slots):
    """Columns per stack of a K^T ring buffer: the widest of the plan's slots (_plan(cfg)[0], passed by the caller
    that built the plan; contiguous caches; paged: fa_tile). A plan of one-step slots only (a 4K scan of
    2048-position slots with its first and last split: four of FA_SUB) then packs the stacks FA_SUB columns apart, so
    the K^T of two batches of adjacent stacks is one contiguous 2w-column run per partition (_pair_k)."""
    if cfg.paged:
        return cfg.fa_tile
    return max(sl.w for sl in slots)


def _pair_k(cfg, slots, j0, w):
    """Whether the slot [j0, j0 + w) is one load piece (or the scan's first piece as prefix alternatives, the longest
    the whole slot: _first_prefixes) whose K^T of batches j and j + kpp both loading the whole piece may move in one
    dma_transpose (flash._load_k_pair, as the whole slots of planning._whole_k): _Config.k_plain, the slot as wide as
    the ring's stacks (_kt_width: the pair is one run of 2w columns per partition, 4 KiB at w = 1024 bf16: DMA
    efficiency 0.85 instead of 0.80), no remainder block, in a plan of two slots or more (a one-slot scan,
    nki-library q8 d64 B64 1K, lost 1.9 %: modelled). slots: the plan's (_plan(cfg)[0], built by the caller)."""
    pieces = _load_pieces(cfg, j0, w)
    return (cfg.k_plain and not cfg.paged and pieces[-1] == (j0, w) and all(a == j0 for a, _s in pieces)
            and w == _kt_width(cfg, slots) and _whole_k(cfg, j0, w) is None and len(slots) >= 2)


def _piece_thresholds(pieces):
    """Per load piece (_load_pieces) the gate's threshold (it runs iff its sequence's hi > threshold) and whether it
    is a prefix alternative with a longer one after it (then it runs only iff hi <= its end, see _first_prefixes)."""
    out = []
    for i, (a, _size) in enumerate(pieces):
        alt_prev = i > 0 and pieces[i - 1][0] == a
        alt_next = i + 1 < len(pieces) and pieces[i + 1][0] == a
        out.append((a + pieces[i - 1][1] if alt_prev else a, alt_next))
    return tuple(out)



def _v_rotated(cfg, j0, w):
    """Whether the odd batches of a pack hold the slot [j0, j0 + w) rotated by half (config._Config.v_rot: K^T
    column c and V partition q hold the positions of column (c + 64n) mod 128n / partition (q + 64) % 128 of the
    plain layout, n = w // 128; the remainder block is not rotated): slots loaded in more than one piece (a
    one-piece slot covers every partition whatever the layout)."""
    return cfg.v_rot and len({a for a, _ in _load_pieces(cfg, j0, w)}) > 1


def _rot_batch(cfg, j):
    """Batch j of a pack is rotated in the slots _v_rotated selects iff j is odd, or with _Config.k_plain on 2-batch
    stacks iff its stack is odd (cfg.rot_unit batches per unit: a stack's batches share its score matmuls, which
    read a rotated stack's plain K^T rotated)."""
    return (j // cfg.rot_unit) % 2 == 1


def _v_parts(pa, pb, rot):
    """(first plain partition, end, first partition in the slot) of the V partitions [pa, pb) of a load piece:
    one run, or rotated (_v_rotated) its parts in each half of the partitions, each moved by half."""
    if not rot:
        return ((pa, pb, pa),)
    half = P_MAX // 2
    return tuple((s, e, (s + half) % P_MAX) for s, e in ((pa, min(pb, half)), (max(pa, half), pb)) if s < e)


def _oT_head_runs(cfg, g):
    """The o^T partition halves of KV group g's heads (hg = g*G + h, o^T row (hg*d + e) % 128 of chunk
    (hg*d + e) // 128, dup = 128 // d heads per chunk): per half u its heads h0, h0 + dup, ... (cnt of them) land on
    partitions u*d.. of consecutive chunks from k0, so one matmul (moving = those heads' columns, stride dup) covers
    them all. Returns (u, h0, cnt, k0) per half that holds any of the group's heads."""
    G, dup = cfg.group, P_MAX // cfg.d
    runs = []
    for u in range(dup):
        h0 = (u - g * G) % dup
        if h0 < G:
            runs.append((u, h0, (G - h0 + dup - 1) // dup, (g * G + h0) // dup))
    return tuple(runs)
