"""Blockwise CTE (prefill) MoE experts for one tensor-parallel rank: the NKI kernel and its host-side launcher.

Every routed (token, expert) row of the blockwise mapping (blockwise.py) goes through its expert's MLP; experts are
served one after the other, each expert's weights loaded once, its rows in 128-row tiles (padding tiles skipped by
a data-dependent loop bound). See DESIGN.md beside this file ("CTE").
"""

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from ..common.tiles import evict, run_gated
from .blockwise import blockwise_mapping
from .gate_up_layout import gate_up_layout, gate_up_layout_error
from .moe_torch import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT
from .mx_ops import MX_CHUNK, MX_GROUPS, lane_columns, load_mx_scales

# ---- tile sizes -----------------------------------------------------------------------------------------------
P_MAX = nl.tile_size.pmax              # partitions = rows per token tile = matmul contraction / stationary tile
PSUM_F = nl.tile_size.psum_bank_fmax   # fp32 elements per PSUM bank: the widest matmul output (moving free size)
# bf16 TensorE transposes of [128, 128] gathered into one PSUM bank before one eviction
TRANSPOSE_GROUP = nl.tile_size.psum_bank_fmax_bytes // (P_MAX * 2)
DOWN_BANKS = 3         # PSUM banks the down projection rotates through (evictions overlap the next chunk's matmuls)
W_GU_DMAS = 4          # the gate/up weights of one expert arrive in this many DMAs (matmuls start on the first)
# rows of the narrow last tile: an expert whose last tile has at most this many rows serves it with the weights
# stationary and the tokens moving (gate/up in max(n, 64) TensorE cycles per I chunk instead of 2I per H tile) and
# gathers / scatters only these rows (64: the TensorE minimum of 64 cycles per matmul makes narrower ones no faster)
HALF_ROWS = 64
# Padding rows of an expert's last tile (a partial 128-row tile has 65..127 real rows, a narrow one 1..64) are not
# moved: the host puts the tile's real rows in q consecutive PAD_PIECE-row pieces starting at piece s (cyclically:
# a window that wraps is two DMAs), s continuing from the previous last tile's window (_last_tiles), so that the
# skipped bytes come off every DMA engine alike (DMA engine p // 8 serves partition p; padding always at the
# tile's end would come off the high engines only, not the busiest). The kernel has one gather / scatter-add per
# (s, q) variant, each runtime-gated: its fori_loop trip count is start_gate[s] * count_gate[q] (two one-hot 0/1
# schedule field groups: PAD_STARTS + PAD_COUNTS fields per last tile). One scatter-add per tile (two when
# wrapped): the scatter-adds into out are ordered one after the other.
PAD_PIECE = 16
PAD_STARTS = P_MAX // PAD_PIECE
PAD_COUNTS = HALF_ROWS // PAD_PIECE     # q: 65..128 rows (a partial tile) or 1..64 rows (a narrow one)
PAD_GATES = PAD_STARTS + PAD_COUNTS
# Rows per expert (T * k / E) below which the padding pieces are skipped. Modelled: up to 256 rows per expert the
# kernel is DMA bound and gains (GPT-OSS-20B TP8 T 2048 trn2 LNC 1 -3.4%, 120B TP16 T 2048 -5 to -6.5%); at 512
# (20B T 4096, 120B T 16384) TensorE is the bound, the padding is a smaller share and the windows' extra DMAs cost
# 0.3-2%: the last tile is moved whole there, as before
PAD_SKIP_MAX_ROWS = 384


def _pad_variants(n):
    """(first piece, pieces) windows of an n-row last tile: q pieces of real rows, the last one possibly part
    padding; n / PAD_PIECE pieces (no padding piece) as one variant starting at 0."""
    k = n // PAD_PIECE
    lo = _pad_count_min(n)
    return [(s, q) for q in range(lo, k) for s in range(k)] + [(0, k)]


def _pad_count_min(n):
    """Fewest real pieces of an n-row last tile (a partial tile has > 64 rows, a narrow one >= 1)."""
    return (n - HALF_ROWS) // PAD_PIECE + 1


# per scheduled expert: expert id, first row, pairs of complete 128-row tiles, odd complete tile (0/1),
# weights-needed flag (0/1), narrow last tile (0/1: the expert's last HALF_ROWS rows or fewer, see _half_tile),
# partial last 128-row tile (0/1: 65..127 rows), then the last tile's PAD_GATES window gates (0/1)
SCHED_BASE = 7          # the fields before the window gates
SCHED_FIELDS = SCHED_BASE + PAD_GATES
# LNC=1 schedule header: expert pairs, prologue flag (0/1: the first expert's weights load before out is zeroed, so
# that the first matmuls do not wait behind the zero-fill in the DMA queues; its own load flag is then 0)
SCHED_HEADER = 2
# LNC=2: the down projection split by H halves (see _hsplit). A core's schedule row: [step pairs, zero-first flag
# (1: the core has no tile of its own, it zeroes its half of out first)], then S2 (even) steps, then the tile-steps
HS_HEADER = 2
# per step: own expert, own load flag (gate/up + this core's H half of the down weights), peer expert, peer load
# flag (this core's H half of the peer's down weights), tile-step pairs, odd tile-step (0/1), index of its first
# tile-step in the row, then the own and the peer expert's last-tile PAD_GATES window gates
STEP_BASE = 7           # the fields before the window gates
STEP_FIELDS = STEP_BASE + 2 * PAD_GATES
# per tile-step: own complete tile (0/1), own partial tile (0/1), own narrow tile (0/1), own first row, the same
# four for the peer, zero-fill flag (1 on the core's first own tile: its half of out is zeroed after that tile's
# rows)
TILE_FIELDS = 9
# sendrecv pipes of the act^T swaps (any ids; the k-th sendrecv of each core on a pipe pair up): bf16 act^T, or the
# MXFP8 act^T words on PIPE_ACT and their scales on PIPE_ACT_SCALE (two dtypes: one sendrecv each)
PIPE_ACT = 7
PIPE_ACT_SCALE = 8
# shortest per-partition weight DMA run worth the natural H tiling of DMA transposes: run / (run + 256 B) >= 80%
# (AWS DMA bandwidth guide: < 256 B per descriptor severely overhead-bound, >= 2 KiB near peak; nkisim.cost rule 6)
WEIGHT_RUN_MIN = 1024
# Rows per expert from which DMA gather-transposes beat TensorE transposes (indirect transposes need NeuronCore-v3+).
# Per 128-row tile (GPT-OSS-20B TP8 shard) TensorE takes ~12.8 us with its transposes, ~11.5 us without; an expert's
# weights take 18 us of DMA on trn2 (0.36 TB/s per core; 21 us in natural tiles) and each tile ~4.2 us of gather and
# scatter (+10% as transposes): with n tiles per expert the DMA path wins on trn2 once 11.5 n >= 21 + 4.6 n, i.e.
# n >= 3 tiles. On trn3 (0.61 TB/s per core, the same TensorE rate) it wins from about one tile.
DMA_TRANSPOSE_MIN_ROWS = {"gen3": 3 * 128, "gen4": 0}
# Rows per expert from which trn3 takes DMA transposes even with weight runs < WEIGHT_RUN_MIN (GPT-OSS-120B TP16:
# I = 180, 720 B runs, ~74% DMA efficiency on the 425 MB of weights): TensorE transposes are 3072 of the ~18.1 k
# TensorE cycles of a 128-row tile there, which caps TensorE at ~72% of peak; once TensorE is the bound, moving them
# to the DMA queues pays for the slower weight runs. Modelled (120B, trn3 LNC 1): 256 rows per expert (T 8192)
# 2520 -> 2599 us (DMA bound: kept on TensorE), 384 rows (T 12288) 3436 -> 3230 us (LNC 2 1731 -> 1719), 512 rows
# (T 16384) 4446 -> 3902 us. trn2 stays DMA bound: none.
SHORT_RUN_DMA_TRANSPOSE_MIN_ROWS = {"gen3": None, "gen4": 3 * 128}
# PSUM bank (of the down banks) for the narrow tile's per-partition gate/up bias columns, built at each weight load;
# the broadcast bias tile uses the banks from 0 (banks 0-1 while 2I <= 1024), so the two builds do not wait on
# each other
BIAS_COL_BANK = 2
SBUF_RESERVE = 8 * 1024    # bytes per partition left for the small tiles (ids, affinities, schedule, constants)
DGE = nisa.dge_mode.swdge   # indirect (vector_offset) DMAs are software-DGE transfers
# columns of the kernel's per-row table `rows` [R, ROW_FIELDS] int32 (kernel_inputs): gather id, scatter id (-1:
# padding), affinity (fp32 bits). One table, so that a tile's row data is one DMA (LNC=2: the peer tile's scatter ids
# and affinities one more): a [128, 1] DMA moves 4-byte runs per partition at ~1.5% DMA efficiency in the model
# (run / (run + 256 B)), so three of them cost each DMA engine ~3x one of 12-byte runs (GPT-OSS-120B TP16 T 16384
# trn3: ~100 us per engine at LNC 1)
ROW_GATHER, ROW_SCATTER, ROW_AFF = 0, 1, 2
ROW_FIELDS = 3
# first partition of the last down contraction tile in the second weight slot when that tile has <= 64 rows
# (_Config.rem_high): a DMA is served by the engines of its SBUF partitions (8 partitions each), so the 53-row tile
# of GPT-OSS-120B TP16 on partitions 0..52 in every expert loaded engines 0-6 only (~50 us per engine more than
# engines 7-15 per core at T 16384 LNC 2); alternating halves spreads it over 14 engines. Only below
# REM_HIGH_MAX_ROWS rows per expert ([other, trn3 LNC 1]), where the kernel is DMA bound: modelled GPT-OSS-120B
# TP16 T 2048 (64 rows) -4 to -5%; not at 256 rows on trn3 LNC 1 (T 8192: 2493.9 -> 2510.1 us, TensorE and DMA
# balanced there) nor at 512 (T 16384 trn3 LNC 2: 1979.8 -> 2002.3 us); why the balanced engines do not shorten
# those runs is not analysed. LNC 2 from REM_CORE_MIN_ROWS rows per expert: _Config.rem_core instead.
REM_HIGH_BASE = 64
REM_HIGH_MAX_ROWS = (512, 256)
# LNC 2 (H split) with a <= 64-row last down contraction tile, from this many rows per expert: that tile sits on
# partitions 64 * core for the core's own expert and 64 * (1 - core) for the peer's (_Config.rem_core), so a step
# expert's tile is on the same partitions on both cores (the swapped act^T rows land where the receiver contracts
# them) and each core's two down-weight loads of a step use both halves of the DMA engines. Modelled GPT-OSS-120B
# TP16 trn3 LNC 2 (against rem_high): T 16384 (512 rows) 1979.8 -> 1961.8 us, T 8192 (256 rows) 1303.0 -> 1286.2
# (trn2 1835.8 -> 1817.2); T 4096 (128 rows) 870.0 -> 870.6, T 2048 (64 rows) 663.8 -> 667.8: rem_high there
REM_CORE_MIN_ROWS = 256


class _Config(nl.NKIObject):
    """Static shapes and options of one launch."""

    def __init__(self, T, H, E, inter, rows, sched_len, dtype, itemsize, activation, bias_gu, bias_d, n_cores,
                 routed_rows, mx=False, KDm=0, gu_tiled=False):
        self.T, self.H, self.E, self.I, self.rows, self.sched_len = T, H, E, inter, rows, sched_len
        self.dtype, self.activation, self.bias_gu, self.bias_d, self.n_cores = (dtype, activation, bias_gu, bias_d,
                                                                                n_cores)
        self.KT = H // P_MAX                   # gate/up contraction tiles
        # gate/up weights in the tiled layout [E, 128, KT, 2I] (gate_up_layout.py): natural H tiles (H row
        # kt * 128 + p on partition p) with one contiguous run per partition, for either x^T path
        self.gu_tiled = gu_tiled
        # x^T by DMA gather-transposes or by TensorE transposes of the gathered rows. The H order of a contraction
        # tile follows: DMA transposes read natural tiles (H index kt * 128 + p on partition p), so each partition
        # loads its gate/up weight rows as runs of 2I elements; TensorE transposes take strided column sets (H
        # index p * KT + kt), so each partition's weight rows are one contiguous run. DMA transposes move ~10% of
        # the TensorE work to the DMA queues, which also carry every expert's weights: worth it once an expert's
        # weights are shared by enough rows that TensorE is the bound (DMA_TRANSPOSE_MIN_ROWS per generation), and
        # only while the weight runs stay >= WEIGHT_RUN_MIN bytes, or (trn3) once an expert has so many rows that
        # TensorE is the bound even so (SHORT_RUN_DMA_TRANSPOSE_MIN_ROWS).
        v = nisa.get_nc_version()
        min_rows = (DMA_TRANSPOSE_MIN_ROWS["gen4"] if v >= nisa.nc_version.gen4
                    else DMA_TRANSPOSE_MIN_ROWS["gen3"] if v >= nisa.nc_version.gen3 else None)
        short_min = (SHORT_RUN_DMA_TRANSPOSE_MIN_ROWS["gen4"] if v >= nisa.nc_version.gen4
                     else SHORT_RUN_DMA_TRANSPOSE_MIN_ROWS["gen3"] if v >= nisa.nc_version.gen3 else None)
        rows_per_expert = (routed_rows or rows) / E
        self.dma_transpose = (min_rows is not None and rows_per_expert >= min_rows
                              and (2 * inter * itemsize >= WEIGHT_RUN_MIN
                                   or (short_min is not None and rows_per_expert >= short_min)))
        # MXFP4 weights (trn3): x^T and act^T are quantised to MXFP8 on chip in the MX element order, which the
        # TensorE transposes produce (column sets), so no DMA transposes; the down bias is a K=1 matmul (it is not
        # part of the MX contraction)
        self.mx, self.KC, self.KDm = mx, H // MX_CHUNK, KDm
        # padding pieces of an expert's last tile skipped (PAD_PIECE); not with MXFP4 at LNC 2 (modelled 20B T 2048
        # trn3: 302.9 -> 315.6 us with it)
        self.skip_padding = rows_per_expert < PAD_SKIP_MAX_ROWS and not (mx and n_cores == 2)
        if mx:
            self.dma_transpose = False
        # down contraction: I rows, plus one row of ones (activations) / b_down (weights) when the bias is added,
        # so the bias is a free extra contraction row instead of a separate matmul
        self.I_aug = inter + (1 if bias_d and not mx else 0)
        self.KD = (self.I_aug + P_MAX - 1) // P_MAX
        # rows of the last down contraction tile; when they fit 64 partitions (GPT-OSS-120B TP16: 180 + bias = 128 +
        # 53) the second weight slot keeps that tile on partitions 64.. (REM_HIGH_BASE), so that its weight DMAs
        # (served by the DMA engines of those partitions) alternate between the engines' halves
        self.rem_aug = self.I_aug - (self.KD - 1) * P_MAX
        self.rem_high = (not mx and self.KD >= 2 and self.rem_aug <= REM_HIGH_BASE
                         and rows_per_expert < REM_HIGH_MAX_ROWS[n_cores == 1 and v >= nisa.nc_version.gen4])
        # LNC 2 from REM_CORE_MIN_ROWS rows per expert: that tile by core instead (own expert at 64 * core, the
        # peer's at 64 * (1 - core), see _Weights)
        self.rem_core = (n_cores == 2 and not mx and self.KD >= 2 and self.rem_aug <= REM_HIGH_BASE
                         and rows_per_expert >= REM_CORE_MIN_ROWS)
        self.rem_high = self.rem_high and not self.rem_core
        self.I_CH = PSUM_F                     # gate (and up) columns per PSUM bank
        self.n_ich = (inter + self.I_CH - 1) // self.I_CH
        self.H_CH = PSUM_F                     # output columns per down-projection PSUM bank
        self.n_hch = (H + self.H_CH - 1) // self.H_CH
        self.n_ic = (inter + P_MAX - 1) // P_MAX   # 128-row I chunks of the narrow tile (gate in one PSUM bank)
        # gate and up of a tile in one PSUM bank (full tile: I columns each, narrow: n_ic x HALF_ROWS), see _Psum
        self.gu_one_bank = not mx and 2 * max(min(inter, self.I_CH), self.n_ic * HALF_ROWS) <= PSUM_F
        # LNC=2: each core owns one H half of out (see _hsplit)
        self.hsplit = n_cores == 2
        self.Hh = H // 2
        self.n_hch_half = (self.Hh + self.H_CH - 1) // self.H_CH

    def weight_bytes(self):
        """SBUF bytes per partition of one expert's resident weights (gate/up, down, gate/up bias)."""
        if self.mx:   # x4 words (2 B per 4 elements) + one scale byte per word, b_down row, gate/up bias
            return (3 * (self.KC * 2 * self.I + self.KDm * self.H) + 2 * self.H
                    + (2 * 2 * self.I + 4 * 2 * self.n_ic if self.bias_gu else 0))
        return 2 * (self.KT * 2 * self.I + self.KD * self.H + (2 * self.I if self.bias_gu else 0)) + (
            4 * 2 * self.n_ic if self.bias_gu else 0)

    def tile_bytes(self):
        """SBUF bytes per partition of one token tile's working set."""
        mx = (2 * self.H + 5 * self.KC * P_MAX + 4 * self.KDm * MX_CHUNK + 5 * self.KDm * P_MAX) if self.mx else 0
        # H split: the received act^T (bf16, or MXFP8 words and scales), the peer rows' ids, affinities and output
        recv = 5 * self.KDm * P_MAX if self.mx else 2 * self.KD * P_MAX
        hs = (recv + 2 * self.Hh + 4 * 2) if self.hsplit else 0
        return mx + hs + (2 * self.H * 3 + 2 * self.KD * P_MAX + 2 * self.I_aug + 4 * 4 * min(self.I, self.I_CH)
                + 4 * 3 + 2 * self.KD * HALF_ROWS + 4 * 3 * HALF_ROWS)


def moe_cte_kernel(x, w_gate_up, w_down, rows, schedule, b_gate_up=None,
                   b_down=None, activation="clamped_swiglu", routed_rows=0, w_gate_up_scale=None, w_down_scale=None):
    """Blockwise MoE experts (prefill): out[t] = Σ_rows of t  affinity · down(act(gate_up(x[t]))) for one TP rank.

    Dimensions:
        T: tokens, H: hidden size (multiple of 128, padded), E: local experts, I: this rank's intermediate shard,
        R: mapping rows (N blocks x block size; 128-row tiles of one expert each).

    Args:
        x ([T, H] @ HBM): hidden states (bf16).
        w_gate_up ([E, H, 2, I] @ HBM): gate (index 0) and up (index 1) projections.
        w_down ([E, I, H] @ HBM): down projection.
        rows ([R, 3] int32 @ HBM): per mapping row (ROW_* columns) its gather id (the token; padding rows name any
            valid token), scatter id (the token, -1 for padding: its output is dropped) and affinity (fp32 bits, 0
            for padding); one table so that a tile's row data arrives in one DMA (12-byte runs per partition, see
            ROW_FIELDS).
        schedule ([n_cores, W] int32 @ HBM): LNC=1: the number of expert pairs, the prologue flag (1: the first
            entry's weights are loaded before the loop, and its own load flag is 0), then S (even) entries (expert
            id, first row, pairs of 128-row tiles, odd last tile 0/1, load flag 0/1, narrow last tile 0/1); the
            entries past the experts have no tiles and flag 0. LNC=2: per core the H-split steps and tile-steps
            (see HS_HEADER). expert_schedule builds both.
        b_gate_up ([E, 2, I] @ HBM): optional gate/up bias.
        b_down ([E, H] @ HBM): optional down bias (pass None on the TP ranks that must not add it).
        activation (str): "clamped_swiglu" (GPT-OSS) or "swiglu".
        routed_rows (int): T * k, the real mapping rows (0: R, an upper bound); only sizes the x^T choice.
        w_gate_up_scale, w_down_scale: given, the weights are MXFP4 (trn3 only) in mx_weights.py's layout:
            w_gate_up [E, 128, H/512, 2I] float4_e2m1fn_x4 with scales [E, 16, H/512, 2I] uint8, w_down
            [E, 128, KDm, H] with scales [E, 16, KDm, H] (I zero-padded to KDm * 512); x^T and the activations are
            quantised to MXFP8 (e4m3) on chip and every projection is an nc_matmul_mx.

    Returns:
        out ([T, H] @ HBM, shared_hbm): the rank's partial output in x's dtype; each row's expert outputs are
            affinity-scaled, rounded to x's dtype and added to it in mapping order (DMA read-modify-write).

    Notes:
        - Experts are served in pairs (two weight slots): the second expert's weights load while the first
          computes. An expert with no rows is never scheduled; a tile past an expert's rows is never run (the tile
          loop's bound is data), so padding costs at most the rest of an expert's last 128-row tile.
        - Each expert's weights are read from HBM once per launch. LNC=2: each core computes gate/up for its own
          experts and the down projection of every expert for its half of H (the tile's act^T -- bf16, or with
          MXFP4 weights its MXFP8 words and scales -- swapped with the other core, sendrecv), so each core
          read-modify-writes only its half of out's columns (_hsplit).
        - Orientation: gate/up with the gathered tokens' x^T [128 (H), 128 (tokens)] stationary and the weights
          moving (the I columns stream, no I padding); the down projection with act^T stationary.
        - x^T: DMA gather-transposes or TensorE transposes, by generation and rows per expert (see _Config).

    Pseudocode:
        out = 0
        for each scheduled expert e (weights -> SBUF once):
            for each 128-row tile of e's rows (ids, affinities):
                xt = x[ids]  ;  xT = transpose(xt)
                g, u = xT^T @ Wg[e] (+ bg), xT^T @ Wu[e] (+ bu)  ;  a = act(g, u)  ;  aT = transpose([a | 1])
                y = aT^T @ [Wd[e] ; bd[e]]  ;  out[ids] += bf16(affinity * y)
    """
    cfg = _validate_inputs(x, w_gate_up, w_down, rows, schedule, b_gate_up,
                           b_down, activation, routed_rows, w_gate_up_scale, w_down_scale)
    out = nl.ndarray((cfg.T, cfg.H), dtype=x.dtype, buffer=nl.shared_hbm)
    core = nl.program_id(0) if cfg.n_cores > 1 else 0
    scales = (w_gate_up_scale, w_down_scale)
    sched = _load_schedule(cfg, schedule, core)
    weights = [_Weights(cfg, i, core) for i in range(2)]
    tiles = [_Tiles(cfg) for _ in range(2)]
    psum = _Psum(cfg)
    if cfg.hsplit:
        _hsplit(cfg, out, sched, core, weights, tiles, psum, x, w_gate_up, w_down, b_gate_up, b_down, rows, scales)
        return out
    # out is zeroed before the first scatter-add, but in program order (the DMA engines' priority) after the first
    # expert's weights and its first tile's rows, so that those do not wait behind the T x H zero-fill: the
    # weights in this prologue, the zero-fill inside the first expert's tile loop (_serve_expert); no expert at
    # all: zeroed here
    e0 = _field(cfg, sched, SCHED_HEADER, 0)
    prologue = nisa.scalar_load(sched[0:1, 1:2])
    nl.fori_loop(0, prologue, lambda _: _load_weights(cfg, weights[0], psum, e0, w_gate_up, w_down, b_gate_up,
                                                      b_down, scales))
    nl.fori_loop(0, 1 - prologue, lambda _: _zero_rows(cfg, out, 0, cfg.T))

    def pair(p):
        for s in range(2):
            base = p * (2 * SCHED_FIELDS) + s * SCHED_FIELDS + SCHED_HEADER
            slots = [_Slot(weights[s], t, psum, i) for i, t in enumerate(tiles)]
            _serve_expert(cfg, slots, psum, sched, base, x, w_gate_up, w_down, b_gate_up, b_down, rows, out, scales,
                          s == 1)

    n_pairs = nisa.scalar_load(sched[0:1, 0:1])
    nl.fori_loop(0, n_pairs, pair)
    return out


def _validate_mx(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale):
    """MXFP4 weights: shapes, dtypes and the target; returns (E, I, KDm)."""
    assert nisa.get_nc_version() >= nisa.nc_version.gen4, \
        ("w_gate_up_scale: MXFP4 weights need nisa.nc_matmul_mx, which only NeuronCore-v4 (trn3) has; on trn2 "
         "pass bf16 weights (dequantised; MoELayer(expert_format='bf16') dequantises at load)")
    assert w_down_scale is not None, "w_down_scale: MXFP4 needs both projections' scales"
    T, H = x.shape
    assert H % MX_CHUNK == 0, f"x: H={H} must be a multiple of {MX_CHUNK} with MXFP4 weights"
    KC = H // MX_CHUNK
    assert len(w_gate_up.shape) == 4 and tuple(w_gate_up.shape[1:3]) == (P_MAX, KC) and w_gate_up.shape[3] % 2 == 0, \
        f"w_gate_up (MXFP4) must be [E, {P_MAX}, H/512={KC}, 2I], got shape {tuple(w_gate_up.shape)}"
    E, inter = w_gate_up.shape[0], w_gate_up.shape[3] // 2
    assert len(w_down.shape) == 4 and w_down.shape[0] == E and w_down.shape[1] == P_MAX and w_down.shape[3] == H \
        and w_down.shape[2] * MX_CHUNK >= inter, \
        f"w_down (MXFP4) must be [E={E}, {P_MAX}, KDm >= I/512, H={H}], got shape {tuple(w_down.shape)}"
    for name, w, sc in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        assert w.dtype == nl.float4_e2m1fn_x4, f"{name} dtype {w.dtype} must be float4_e2m1fn_x4 (MXFP4)"
        want = (w.shape[0], MX_GROUPS, w.shape[2], w.shape[3])
        assert tuple(sc.shape) == want and sc.dtype == nl.uint8, \
            f"{name}_scale must be uint8 {want}, got {sc.dtype} {tuple(sc.shape)}"
    return E, inter, w_down.shape[2]


def _validate_inputs(x, w_gate_up, w_down, rows, schedule, b_gate_up, b_down,
                     activation, routed_rows, w_gate_up_scale=None, w_down_scale=None):
    """Every static limit, before any work; messages name the argument and the limit."""
    assert activation in ("clamped_swiglu", "swiglu"), \
        f"activation={activation!r} must be 'clamped_swiglu' or 'swiglu'"
    assert len(x.shape) == 2, f"x must be [T, H], got shape {tuple(x.shape)}"
    T, H = x.shape
    assert H % P_MAX == 0, f"x: H={H} must be a multiple of {P_MAX}"
    mx = w_gate_up_scale is not None
    KDm = 0
    gu_tiled = False
    if mx:
        E, inter, KDm = _validate_mx(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    else:
        err = gate_up_layout_error("moe_cte", tuple(w_gate_up.shape), H)
        assert err is None, err
        gu_tiled, E, inter = gate_up_layout(tuple(w_gate_up.shape), H)
        assert tuple(w_down.shape) == (E, inter, H), \
            f"w_down must be [E={E}, I={inter}, H={H}], got shape {tuple(w_down.shape)}"
    assert b_gate_up is None or tuple(b_gate_up.shape) == (E, 2, inter), \
        f"b_gate_up must be [E={E}, 2, I={inter}], got shape {tuple(b_gate_up.shape)}"
    assert b_down is None or tuple(b_down.shape) == (E, H), \
        f"b_down must be [E={E}, H={H}], got shape {tuple(b_down.shape)}"
    R = rows.shape[0]
    assert R % P_MAX == 0 and tuple(rows.shape) == (R, ROW_FIELDS) and rows.dtype == nl.int32, \
        (f"rows must be int32 [R, {ROW_FIELDS}] with R a multiple of {P_MAX} (kernel_inputs), got {rows.dtype} "
         f"{tuple(rows.shape)}")
    n_cores = nl.num_programs()
    if n_cores == 1:
        assert len(schedule.shape) == 2 and schedule.shape[0] == 1 and (schedule.shape[1] - SCHED_HEADER) % (
            2 * SCHED_FIELDS) == 0, \
            f"schedule must be [1, {SCHED_HEADER} + {2 * SCHED_FIELDS} p], got {tuple(schedule.shape)}"
    else:
        assert len(schedule.shape) == 2 and schedule.shape[0] == n_cores and schedule.shape[1] >= HS_HEADER, \
            f"schedule must be [n_cores={n_cores}, >= {HS_HEADER}] (expert_schedule), got {tuple(schedule.shape)}"
    weights = (("b_gate_up", b_gate_up), ("b_down", b_down)) + (() if mx else (("w_gate_up", w_gate_up),
                                                                               ("w_down", w_down)))
    for name, w in weights:
        assert w is None or w.dtype == x.dtype, f"{name} dtype {w.dtype} must equal x's ({x.dtype})"
    cfg = _Config(T, H, E, inter, R, schedule.shape[1], x.dtype, x.dtype.itemsize, activation,
                  b_gate_up is not None, b_down is not None, n_cores, routed_rows, mx, KDm, gu_tiled)
    assert cfg.KD * P_MAX * 2 <= nl.tile_size.psum_bank_fmax_bytes, \
        f"w_down: I={inter} too large: the transposed activations must fit one PSUM bank (I <= 1023)"
    need = 2 * (cfg.weight_bytes() + cfg.tile_bytes()) + SBUF_RESERVE
    have = nl.tile_size.sbuf_fmax_bytes
    assert need <= have, (f"w_gate_up: H={H}, I={inter}: two experts' weights and tiles need {need} B per partition, "
                          f"SBUF has {have}; shard I further (more TP ranks)")
    return cfg


class _Weights(nl.NKIObject):
    """One expert's resident weights (two of them: the next expert's load while this one computes)."""

    def __init__(self, cfg, index=0, core=0):
        # first partition of the last down contraction tile (weights, bias column chunk, act^T) of this slot; prb:
        # of the peer expert's down columns (H split)
        self.rb = REM_HIGH_BASE if index == 1 and cfg.rem_high else 0
        self.prb = self.rb
        if cfg.rem_core:
            self.rb, self.prb = REM_HIGH_BASE * core, REM_HIGH_BASE * (1 - core)
        dt, KT, KD, H, inter = cfg.dtype, cfg.KT, cfg.KD, cfg.H, cfg.I
        if cfg.mx:   # MXFP4 x4 words and their scale tiles (quadrant layout: group g at partition 32 (g//4) + g%4)
            self.wgu = nl.ndarray((P_MAX, cfg.KC, 2 * inter), dtype=nl.float4_e2m1fn_x4, buffer=nl.sbuf)
            self.sgu = nl.ndarray((P_MAX, cfg.KC, 2 * inter), dtype=nl.uint8, buffer=nl.sbuf)
            self.wd = nl.ndarray((P_MAX, cfg.KDm, H), dtype=nl.float4_e2m1fn_x4, buffer=nl.sbuf)
            self.sd = nl.ndarray((P_MAX, cfg.KDm, H), dtype=nl.uint8, buffer=nl.sbuf)
            self.bdrow = nl.ndarray((1, H), dtype=dt, buffer=nl.sbuf) if cfg.bias_d else None
        else:
            self.wgu = nl.ndarray((P_MAX, KT, 2 * inter), dtype=dt, buffer=nl.sbuf)
            self.wd = nl.ndarray((P_MAX, KD, H), dtype=dt, buffer=nl.sbuf)
            self.sgu = self.sd = self.bdrow = None
        self.bgu = nl.ndarray((P_MAX, 2 * inter), dtype=dt, buffer=nl.sbuf) if cfg.bias_gu and not cfg.mx else None
        self.brow = nl.ndarray((1, 2 * inter), dtype=dt, buffer=nl.sbuf) if cfg.bias_gu else None
        # the bias with I on the partitions (the narrow tile's layout): column j = gate chunk j, n_ic + j = up chunk j
        self.bcol = (nl.ndarray((P_MAX, 2 * cfg.n_ic), dtype=nl.float32, buffer=nl.sbuf)
                     if cfg.bias_gu and not cfg.mx else None)


def _scatter_ids_tiles(cfg):
    """(ids, sid, aff) for one tile's rows: bf16 paths load the rows table's scatter-id and affinity columns into one
    tile (one DMA; sid and aff are its column views); MX keeps separate tiles and DMAs (ids None), as before the rows
    table (one tile for both: 20B TP8 T 2048 trn3 LNC 1 577.1 -> 591.2 us, modelled; not analysed)."""
    if cfg.mx:
        return (None, nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf),
                nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf))
    ids = nl.ndarray((P_MAX, ROW_FIELDS - ROW_SCATTER), dtype=nl.int32, buffer=nl.sbuf)
    return ids, ids[:, 0:1], ids[:, ROW_AFF - ROW_SCATTER:ROW_AFF - ROW_SCATTER + 1].view(nl.float32)


def _load_scatter_ids(rows, row, n, pb, ids, sid, aff):
    """Rows [row, row + n) of the rows table's scatter ids and affinities into partitions pb.. of the tiles
    _scatter_ids_tiles made: one DMA into ids, or (MX: ids None) one into each of sid and aff."""
    if ids is None:
        nisa.dma_copy(dst=sid[pb:pb + n, :], src=rows[nl.ds(row, n), ROW_SCATTER:ROW_SCATTER + 1])
        nisa.dma_copy(dst=aff[pb:pb + n, :].view(nl.int32), src=rows[nl.ds(row, n), ROW_AFF:ROW_AFF + 1])
    else:
        nisa.dma_copy(dst=ids[pb:pb + n, :], src=rows[nl.ds(row, n), ROW_SCATTER:])


class _Tiles(nl.NKIObject):
    """One token tile's working buffers (two sets, alternating tile by tile: the next tile's rows arrive and its
    gate/up runs while this tile's activation and down projection finish)."""

    def __init__(self, cfg):
        dt, KT, KD, H, inter = cfg.dtype, cfg.KT, cfg.KD, cfg.H, cfg.I
        # the tile's gather ids (one DMA), and its scatter ids and affinities (one DMA of the rows table's last two
        # columns; views of one tile): the gather ids apart, so that the next tile's gather on this set waits only
        # for this tile's gather, not for its scatter-add (the end of its pipeline)
        self.gid = nl.ndarray((P_MAX, 1), dtype=nl.uint32, buffer=nl.sbuf)
        self.ids, self.sid, self.aff = _scatter_ids_tiles(cfg)
        self.xt = None if cfg.dma_transpose else nl.ndarray((P_MAX, H), dtype=dt, buffer=nl.sbuf)
        if self.xt is not None and not cfg.mx and cfg.skip_padding:
            # padding pieces are not gathered (PAD_PIECE): their rows keep earlier x rows, or these zeros, so that
            # the TensorE transposes (identity matmuls: 0 x NaN would spread) only ever read finite values
            nisa.memset(dst=self.xt, value=0.0, engine=nisa.engine.gpsimd)
        self.xT = nl.ndarray((P_MAX, KT, P_MAX), dtype=dt, buffer=nl.sbuf)
        # the narrow tile's x^T when a DMA gather-transpose writes it: [128, KT, HALF_ROWS] contiguous, so that each
        # partition's write is one KT x 64-column run (into xT[:, :, :64] it would be KT runs of 128 B, 1/3 of the
        # DMA efficiency); its SBUF fits in the gathered-rows tile xt this path does not allocate (tile_bytes)
        self.xTn = nl.ndarray((P_MAX, KT, HALF_ROWS), dtype=dt, buffer=nl.sbuf) if cfg.dma_transpose else self.xT
        cw = min(inter, cfg.I_CH)
        self.g = nl.ndarray((P_MAX, cw), dtype=nl.float32, buffer=nl.sbuf)
        self.u = nl.ndarray((P_MAX, cw), dtype=nl.float32, buffer=nl.sbuf)
        self.s = nl.ndarray((P_MAX, cw), dtype=nl.float32, buffer=nl.sbuf)
        if cfg.mx:   # activations zero-padded to the MX contraction chunks (the padding stays 0)
            self.a = nl.ndarray((P_MAX, cfg.KDm * MX_CHUNK), dtype=dt, buffer=nl.sbuf)
            nisa.memset(dst=self.a, value=0.0)
            # bf16 x^T / act^T in MX element order (partition, chunk, token, lane), their MXFP8 words and scales
            self.xTm = nl.ndarray((P_MAX, cfg.KC, P_MAX, 4), dtype=dt, buffer=nl.sbuf)
            self.xq = nl.ndarray((P_MAX, cfg.KC, P_MAX), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
            self.xs = nl.ndarray((P_MAX, cfg.KC, P_MAX), dtype=nl.uint8, buffer=nl.sbuf)
            self.aTm = nl.ndarray((P_MAX, cfg.KDm, P_MAX, 4), dtype=dt, buffer=nl.sbuf)
            self.aq = nl.ndarray((P_MAX, cfg.KDm, P_MAX), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
            self.as_ = nl.ndarray((P_MAX, cfg.KDm, P_MAX), dtype=nl.uint8, buffer=nl.sbuf)
        else:
            self.a = nl.ndarray((P_MAX, cfg.I_aug), dtype=dt, buffer=nl.sbuf)
            self.xTm = self.xq = self.xs = self.aTm = self.aq = self.as_ = None
        self.aT = nl.ndarray((P_MAX, KD, P_MAX), dtype=dt, buffer=nl.sbuf)
        self.y = nl.ndarray((P_MAX, H), dtype=dt, buffer=nl.sbuf)
        if cfg.bias_d and not cfg.mx:   # column I of the activations: the down-bias row's input, set once
            nisa.memset(dst=self.a[:, inter:inter + 1], value=1.0)
        # narrow tile: act^T straight from the gate/up layout (I on the partitions), fp32 activation scratch
        self.aTh = nl.ndarray((P_MAX, KD, HALF_ROWS), dtype=dt, buffer=nl.sbuf)
        self.gh = nl.ndarray((P_MAX, HALF_ROWS), dtype=nl.float32, buffer=nl.sbuf)
        self.uh = nl.ndarray((P_MAX, HALF_ROWS), dtype=nl.float32, buffer=nl.sbuf)
        self.sh = nl.ndarray((P_MAX, HALF_ROWS), dtype=nl.float32, buffer=nl.sbuf)
        if cfg.bias_d:   # row I of act^T is the down-bias row's input: the I chunks overwrite the rows above it
            nisa.memset(dst=self.aTh[:, inter // P_MAX, :], value=1.0)
        # H split (LNC=2): the peer's act^T of the same tile-step (sendrecv; MX: its MXFP8 words and scales), the
        # peer rows' ids, affinities, output
        self.aTr = self.aqr = self.asr = self.pids = self.psid = self.paff = self.py = None
        if cfg.hsplit:
            if cfg.mx:
                self.aqr = nl.ndarray((P_MAX, cfg.KDm, P_MAX), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
                self.asr = nl.ndarray((P_MAX, cfg.KDm, P_MAX), dtype=nl.uint8, buffer=nl.sbuf)
            else:
                self.aTr = nl.ndarray((P_MAX, KD, P_MAX), dtype=dt, buffer=nl.sbuf)
            # the peer rows' scatter ids and affinities
            self.pids, self.psid, self.paff = _scatter_ids_tiles(cfg)
            self.py = nl.ndarray((P_MAX, cfg.Hh), dtype=dt, buffer=nl.sbuf)
            # bf16: a narrow tile writes its act^T into aT (the swapped tile): the bias row as in aTh
            if cfg.bias_d and not cfg.mx:
                nisa.memset(dst=self.aT[:, inter // P_MAX, :], value=1.0)


class _Slot(nl.NKIObject):
    """The weights, the tile buffers and the gate/up PSUM pair one token tile uses (views, no memory of its own)."""

    def __init__(self, w, t, psum, i):
        self.wgu, self.wd, self.bgu, self.brow = w.wgu, w.wd, w.bgu, w.brow
        self.ids, self.gid, self.sid, self.aff = t.ids, t.gid, t.sid, t.aff
        self.xt, self.xT, self.xTn = t.xt, t.xT, t.xTn
        self.g, self.u, self.s, self.a, self.aT, self.y = t.g, t.u, t.s, t.a, t.aT, t.y
        self.bcol, self.aTh, self.gh, self.uh, self.sh = w.bcol, t.aTh, t.gh, t.uh, t.sh
        self.sgu, self.sd, self.bdrow, self.rb, self.prb = w.sgu, w.sd, w.bdrow, w.rb, w.prb
        self.xTm, self.xq, self.xs, self.aTm, self.aq, self.as_ = t.xTm, t.xq, t.xs, t.aTm, t.aq, t.as_
        self.pg, self.pu = psum.gs[i % len(psum.gs)], psum.us[i % len(psum.us)]
        self.aTr, self.aqr, self.asr, self.psid, self.paff, self.py = t.aTr, t.aqr, t.asr, t.psid, t.paff, t.py
        self.pids = t.pids


class _Psum(nl.NKIObject):
    """PSUM (8 banks): two banks for the x transposes, one for the activation transposes (its own, so that the next
    tile's x transposes never wait for this tile's activation), gate and up accumulators, DOWN_BANKS down-projection
    banks. With DMA transposes the two x-transpose banks hold a second gate/up pair instead: the tile sets
    alternate between the pairs, so the next tile's gate/up never waits for this tile's activation to read PSUM."""

    def __init__(self, cfg):
        self.t = None if cfg.dma_transpose else [nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=cfg.dtype,
                                                            buffer=nl.psum) for _ in range(2)]
        self.at = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=cfg.dtype, buffer=nl.psum)
        pairs = 2 if cfg.dma_transpose else 1
        banks = DOWN_BANKS
        if cfg.gu_one_bank:
            # gate and up of a tile fit one bank (I <= 256: columns 0.. and PSUM_F / 2..): the banks saved go to the
            # down projection, whose evictions (ScalarE / VectorE, as long as its matmuls per chunk) then lag further
            # behind before TensorE waits for a bank (GPT-OSS-120B TP16, I 180)
            gu = [nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in range(pairs)]
            self.gs = [b[:, :PSUM_F // 2] for b in gu]
            self.us = [b[:, PSUM_F // 2:] for b in gu]
            banks += pairs
        else:
            self.gs = [nl.ndarray((P_MAX, cfg.I_CH), dtype=nl.float32, buffer=nl.psum) for _ in range(pairs)]
            self.us = [nl.ndarray((P_MAX, cfg.I_CH), dtype=nl.float32, buffer=nl.psum) for _ in range(pairs)]
        self.d = [nl.ndarray((P_MAX, cfg.H_CH), dtype=nl.float32, buffer=nl.psum) for _ in range(banks)]
        # a row of ones: the stationary of the matmul that copies the gate/up bias row to all 128 partitions
        self.ones = nl.ndarray((1, P_MAX), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.ones, value=1.0)


def _zero_rows(cfg, dst, r0, r1, c0=0, width=None):
    """dst[r0:r1, c0:c0 + width] = 0 (default: all columns) from one zeroed SBUF tile, 128 rows per DMA."""
    width = cfg.H if width is None else width
    z = nl.ndarray((P_MAX, width), dtype=cfg.dtype, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    for t0 in range(r0, r1, P_MAX):
        n = min(P_MAX, r1 - t0)
        nisa.dma_copy(dst=dst[t0:t0 + n, c0:c0 + width], src=z[:n, :])


def _load_schedule(cfg, schedule, core):
    """This core's schedule row → SBUF [1, W] (scalar loads then cost an SBUF access, not a DMA each)."""
    sched = nl.ndarray((1, cfg.sched_len), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sched, src=schedule[core:core + 1, :])
    return sched


def _field(cfg, sched, base, k):
    """Schedule entry field k at dynamic position `base` (an NkiScalar) → NkiScalar."""
    return nisa.scalar_load(sched.ap([[cfg.sched_len, 1], [1, 1]], offset=k, scalar_offset=base, indirect_dim=1))


def _serve_expert(cfg, slots, psum, sched, base, x, w_gate_up, w_down, b_gate_up, b_down, rows, out, scales,
                  second):
    """One scheduled expert (LNC=1): its weights (if it has rows), then its 128-row tiles, two at a time (alternate
    tile buffers), and an odd last one. The first entry (load flag 0: its weights came in the prologue) zeroes out
    after its first tile's rows are in, before that tile's scatter-add: trip count 1 - load - (tiles before), 1
    once, else <= 0."""
    e = _field(cfg, sched, base, 0)
    row0 = _field(cfg, sched, base, 1)
    n_pairs = _field(cfg, sched, base, 2)
    odd = _field(cfg, sched, base, 3)
    load = _field(cfg, sched, base, 4)
    half = _field(cfg, sched, base, 5)
    part = _field(cfg, sched, base, 6)
    gates = tuple(_field(cfg, sched, base, SCHED_BASE + k) for k in range(PAD_GATES)) if cfg.skip_padding \
        else None
    nl.fori_loop(0, load, lambda _: _load_weights(cfg, slots[0], psum, e, w_gate_up, w_down, b_gate_up, b_down,
                                                  scales))

    def tile(slot, row, zero_trips=0, n=P_MAX, pb=0, g=None):
        _token_tile(cfg, slot, psum, row, x, rows, out,
                    lambda: nl.fori_loop(0, zero_trips, lambda _: _zero_rows(cfg, out, 0, cfg.T)), n, pb, g)

    # the second expert of a pair takes the tile buffer sets in the other order, so that experts with a single
    # (narrow) tile alternate sets; a narrow tile on set 1 puts its output rows on partitions 64..127, on set 0 on
    # 0..63, so the narrow scatters spread over both halves of the DMA engines
    order = slots[::-1] if second else slots
    nh = HALF_ROWS
    pb = [(P_MAX - nh) if order[k] is slots[1] else 0 for k in range(2)]

    def two(i):
        tile(order[0], row0 + i * (2 * P_MAX), 1 - load - i)
        tile(order[1], row0 + i * (2 * P_MAX) + P_MAX)

    nl.fori_loop(0, n_pairs, two)
    nl.fori_loop(0, odd, lambda _: tile(order[0], row0 + n_pairs * (2 * P_MAX), 1 - load - n_pairs))
    # the partial or narrow last tile on the buffer set the previous tile did not use, its padding pieces skipped
    row_h = row0 + (n_pairs * 2 + odd) * P_MAX
    zero_h = 1 - load - n_pairs - odd
    nl.fori_loop(0, part * odd, lambda _: tile(order[1], row_h, zero_h, P_MAX, 0, gates))
    nl.fori_loop(0, part * (1 - odd), lambda _: tile(order[0], row_h, zero_h, P_MAX, 0, gates))
    nl.fori_loop(0, half * odd, lambda _: tile(order[1], row_h, zero_h, nh, pb[1], gates))
    nl.fori_loop(0, half * (1 - odd), lambda _: tile(order[0], row_h, zero_h, nh, pb[0], gates))


def _load_mx_weights(cfg, slot, e, w_gate_up, w_down, b_down, scales, down_cols=None):
    """MXFP4 expert e → the slot: x4 words one contiguous run per partition; the 16 scale rows of each projection
    into the quadrant layout (4 DMAs: groups 4Q..4Q+3 → partitions 32Q..32Q+3); b_down as a row (a K=1 matmul).
    down_cols = (c0, width): only those H columns of the down projection (the H split's half)."""
    row = w_gate_up.shape[2] * w_gate_up.shape[3]
    nisa.dma_copy(dst=slot.wgu, src=w_gate_up.ap([[row, P_MAX], [1, row]], offset=0, scalar_offset=e, indirect_dim=0))
    load_mx_scales(slot.sgu, row, lambda pat, off: scales[0].ap(pat, offset=off, scalar_offset=e, indirect_dim=0))
    c0, width = down_cols if down_cols is not None else (0, cfg.H)
    _load_mx_down(cfg, slot, e, w_down, scales[1], b_down, c0, width)


def _load_mx_down(cfg, slot, e, w_down, w_down_scale, b_down, c0=0, width=None, d0=0):
    """MXFP4 down projection of expert e, H columns c0..c0+width (default all) into the slot's columns d0..: the
    words [128, KDm, H] and the 16 scale rows [16, KDm, H] are H-minor (mx_weights.pack), so an H range is one run
    of `width` per partition and contraction chunk; b_down's columns as a row."""
    H, KDm = cfg.H, cfg.KDm
    width = H if width is None else width
    row = KDm * H
    if width == H:     # whole rows: one contiguous run per partition
        nisa.dma_copy(dst=slot.wd, src=w_down.ap([[row, P_MAX], [1, row]], offset=0, scalar_offset=e,
                                                 indirect_dim=0))
        load_mx_scales(slot.sd, row, lambda pat, off: w_down_scale.ap(pat, offset=off, scalar_offset=e,
                                                                       indirect_dim=0))
    else:
        nisa.dma_copy(dst=slot.wd[:, :, d0:d0 + width],
                      src=w_down.ap([[row, P_MAX], [H, KDm], [1, width]], offset=c0, scalar_offset=e,
                                    indirect_dim=0))
        for k in range(KDm):
            load_mx_scales(slot.sd[:, k, d0:d0 + width], row,
                           lambda pat, off: w_down_scale.ap(pat, offset=off, scalar_offset=e, indirect_dim=0),
                           cols=(k * H + c0, width))
    if cfg.bias_d:
        nisa.dma_copy(dst=slot.bdrow[:, d0:d0 + width], src=b_down.ap([[H, 1], [1, width]], offset=c0,
                                                                      scalar_offset=e, indirect_dim=0))


def _load_bf16_weights(cfg, slot, e, w_gate_up, w_down, b_down, down_cols=None):
    """Gate/up and down (down_cols: (c0, width), only those H columns, e.g. the H split's half)."""
    _load_bf16_gate_up(cfg, slot, e, w_gate_up)
    c0, width = down_cols if down_cols is not None else (0, cfg.H)
    _load_bf16_down(cfg, slot, e, w_down, b_down, c0, width)


def _load_bf16_gate_up(cfg, slot, e, w_gate_up):
    """Gate/up in the contraction tiles' H order (_Config.dma_transpose; the tiled layout: natural tiles, one run
    per partition)."""
    KT, inter = cfg.KT, cfg.I
    row = 2 * inter
    step = (KT + W_GU_DMAS - 1) // W_GU_DMAS
    for k0 in range(0, KT, step):
        k1 = min(KT, k0 + step)
        if cfg.dma_transpose and not cfg.gu_tiled:      # natural tiles: H row kt * 128 + p
            src = w_gate_up.ap([[row, P_MAX], [P_MAX * row, k1 - k0], [1, row]], offset=k0 * P_MAX * row,
                               scalar_offset=e, indirect_dim=0)
        else:     # one contiguous run per partition: H row p * KT + kt, or (tiled layout) kt * 128 + p
            src = w_gate_up.ap([[KT * row, P_MAX], [1, (k1 - k0) * row]], offset=k0 * row, scalar_offset=e,
                               indirect_dim=0)
        nisa.dma_copy(dst=slot.wgu[:, k0:k1, :], src=src)


def _load_bf16_down(cfg, slot, e, w_down, b_down, c0=0, width=None, d0=0, rb=None):
    """Down: partition p of tile k holds I row k*128 + p; b_down is row I of the down weights. Columns
    c0..c0+width of H (default all) into the slot's columns d0..d0+width (the H split loads halves)."""
    inter, H = cfg.I, cfg.H
    width = H if width is None else width
    full = inter // P_MAX
    if full:
        nisa.dma_copy(dst=slot.wd[:, 0:full, d0:d0 + width],
                      src=w_down.ap([[H, P_MAX], [P_MAX * H, full], [1, width]], offset=c0, scalar_offset=e,
                                    indirect_dim=0))
    rem = inter - full * P_MAX
    rb = slot.rb if rb is None else rb     # the last contraction tile's first partition (rem_high / rem_core)
    if rem:
        nisa.dma_copy(dst=slot.wd[rb:rb + rem, full, d0:d0 + width],
                      src=w_down.ap([[H, rem], [1, width]], offset=full * P_MAX * H + c0, scalar_offset=e,
                                    indirect_dim=0))
    if cfg.bias_d:
        nisa.dma_copy(dst=slot.wd[rb + rem:rb + rem + 1, full, d0:d0 + width],
                      src=b_down.ap([[H, 1], [1, width]], offset=c0, scalar_offset=e, indirect_dim=0))


def _load_weights(cfg, slot, psum, e, w_gate_up, w_down, b_gate_up, b_down, scales=(None, None), down_cols=None):
    """Expert e's weights → the slot (bf16 or MXFP4), and its gate/up bias in the two layouts the tiles use
    (down_cols: down columns (c0, width) only, into the slot's first width columns)."""
    inter = cfg.I
    row = 2 * inter
    if cfg.mx:
        _load_mx_weights(cfg, slot, e, w_gate_up, w_down, b_down, scales, down_cols)
    else:
        _load_bf16_weights(cfg, slot, e, w_gate_up, w_down, b_down, down_cols)
    if cfg.bias_gu:
        # the bias row, read once: the MX path adds it in PSUM as a K=1 matmul (_gate_up_mx) and needs nothing else
        nisa.dma_copy(dst=slot.brow, src=b_gate_up.ap([[row, 1], [1, row]], offset=0, scalar_offset=e,
                                                      indirect_dim=0))
    if cfg.bias_gu and not cfg.mx:
        # the bias with I on the partitions for the narrow tile (column j: gate chunk j, n_ic + j: up chunk j), from
        # the bias row already in SBUF by K=1 matmuls (bias chunk stationary, a single 1 moving: out[i, 0] =
        # bias[i0 + i], exact in fp32); a DMA reads it with 2-byte runs per partition (~1% DMA efficiency, on
        # every DMA engine: ~10 us per engine per 16 experts on trn3)
        full = inter // P_MAX
        rem = inter - full * P_MAX
        ps = psum.d[BIAS_COL_BANK]
        rb = slot.rb if full == cfg.KD - 1 else 0     # the last I chunk is the last contraction tile's
        for gu in range(2):
            for j in range(cfg.n_ic):
                i0 = j * P_MAX
                w = min(P_MAX, inter - i0)
                col = gu * cfg.n_ic + j
                o = rb if j == full else 0
                nisa.nc_matmul(dst=ps[o:o + w, col:col + 1],
                               stationary=slot.brow[:, gu * inter + i0:gu * inter + i0 + w],
                               moving=psum.ones[:, 0:1], accumulate=False, **_col_tile(o))
        for gu in range(2):
            c = gu * cfg.n_ic
            if full:
                nisa.tensor_copy(dst=slot.bcol[:, c:c + full], src=ps[:, c:c + full])
            if rem:
                nisa.tensor_copy(dst=slot.bcol[rb:rb + rem, c + full:c + full + 1],
                                 src=ps[rb:rb + rem, c + full:c + full + 1])
        # the bias row goes to all 128 token partitions by a ones-matmul (a partition-stride-0 DMA would read it
        # from HBM 128 times): added to each token's gate/up row
        for c0 in range(0, row, PSUM_F):
            cw = min(PSUM_F, row - c0)
            ps = psum.d[(c0 // PSUM_F) % len(psum.d)]
            nisa.nc_matmul(dst=ps[:, :cw], stationary=psum.ones, moving=slot.brow[:, c0:c0 + cw], accumulate=False)
            nisa.tensor_copy(dst=slot.bgu[:, c0:c0 + cw], src=ps[:, :cw])


def _token_tile(cfg, slot, psum, row, x, rows, out, after_inputs, n=P_MAX, pb=0,
                gates=None):
    """One tile of an expert's rows (n = 128, or HALF_ROWS for a narrow last tile whose output rows sit on
    partitions pb..pb+n): gather, gate/up, activation, down, scale, scatter-add (after_inputs() runs in program
    order after the tile's input DMAs: the core's zero-fill, once). gates: an expert's last tile, its padding
    pieces' rows neither gathered nor scattered (_row_pieces)."""
    _load_tile_inputs(cfg, slot, row, x, rows, n, pb, gates)
    after_inputs()
    _gate_up_act(cfg, slot, psum, n, pb, slot.aTh)
    if cfg.mx:
        _down_mx(cfg, slot, psum, n, pb)
    else:
        _down_step(cfg, slot, psum, slot.aT if n == P_MAX else slot.aTh, n, pb)
    # scatter-add: out[ids] = out[ids] + y in the DMA engine (fp32 add, x's dtype stored); padding rows (-1) skipped
    _scatter_add(cfg, out, slot.y, slot.sid, n, pb, 0, cfg.H, gates)


def _row_pieces(n, gates):
    """(gate, [(first row, rows)]) DMA variants of an n-row tile: all n rows ungated (gates None), or, for an
    expert's last tile, one per _pad_variants window (one or, wrapped, two DMAs), run only when its one-hot gate
    (a 0/1 schedule field) is 1."""
    if gates is None:
        return [(None, [(0, n)])]
    k = n // PAD_PIECE
    lo = _pad_count_min(n)
    out = []
    for s, q in _pad_variants(n):
        parts = [(s * PAD_PIECE, min(q, k - s) * PAD_PIECE)]
        if s + q > k:
            parts.append((0, (s + q - k) * PAD_PIECE))
        out.append((gates[s] * gates[PAD_STARTS + q - lo], parts))
    return out


def _scatter_add(cfg, out, y, sid, n, pb, c0, width, gates):
    """out[ids, c0:c0 + width] += y[pb:pb + n, :width] by DMA read-modify-write (padding ids -1 skipped), in
    _row_pieces (an expert's last tile: its all-padding pieces not moved)."""
    for g, parts in _row_pieces(n, gates):
        def body(_, parts=parts):
            for s, m in parts:
                r = slice(pb + s, pb + s + m)
                view = out.ap([[cfg.H, m], [1, width]], offset=c0, vector_offset=sid[r, :])
                nisa.dma_compute(dst=view, srcs=[view, y[r, :width]], reduce_op=nl.add,
                                 oob_mode=nisa.oob_mode.skip)
        run_gated(g, body)


def _gate_up_act(cfg, slot, psum, n, pb, narrow_aT):
    """A tile's gate/up and activation, up to the down projection's operand: MX, the quantised act^T; bf16 full
    tile, x^T (TensorE path), gate/up, activation and act^T in slot.aT; bf16 narrow tile (n rows at pb), the
    weights-stationary gate/up writing act^T straight into narrow_aT."""
    if cfg.mx:
        _mx_act(cfg, slot, psum)
        return
    if not cfg.dma_transpose:
        _transpose_x(cfg, slot, psum, n, pb)
    if n < P_MAX:
        _half_gate_up_act(cfg, slot, narrow_aT)
        return
    for c in range(cfg.n_ich):
        _gate_up_step(cfg, slot, psum, c)
        _activation_step(cfg, slot, psum, c)
    _transpose_act(cfg, slot, psum)


def _gather_base(cfg, n, pb):
    """First partition of a tile's gathered rows (xt, gid): a narrow tile's rows go to the other half of the
    partitions than its output rows (pb..pb+n), so its gather and its scatter load different halves of the 16 DMA
    engines (each serves 8 partitions). DMA transposes fill all partitions whatever the rows."""
    if cfg.mx:     # MX tiles keep tokens on the partitions from the gather to the output rows
        return pb
    return P_MAX - n - pb if not cfg.dma_transpose else 0


def _load_tile_inputs(cfg, slot, row, x, rows, n, pb, gates=None):
    b = _gather_base(cfg, n, pb)
    nisa.dma_copy(dst=slot.gid[b:b + n, :].view(nl.int32), src=rows[nl.ds(row, n), ROW_GATHER:ROW_GATHER + 1])
    _load_scatter_ids(rows, row, n, pb, slot.ids, slot.sid, slot.aff)
    if cfg.dma_transpose:
        # xT[p, kt, j] = x[ids[j], kt * 128 + p]: one gather-transpose of the tile's rows
        xT = slot.xT if n == P_MAX else slot.xTn
        nisa.dma_transpose(dst=xT[:, :, :n], src=x.ap([[cfg.H, n], [P_MAX, cfg.KT], [1, P_MAX]], offset=0,
                                                            vector_offset=slot.gid[:n, :]), dge_mode=DGE)
    else:
        # TensorE path: an expert's last tile gathers its real pieces only (_row_pieces; MX tiles all rows: their
        # x^T is quantised in 32-element groups of whole columns, kept as it was)
        for g, parts in _row_pieces(n, None if cfg.mx else gates):
            def body(_, parts=parts):
                for s, m in parts:
                    r = slice(b + s, b + s + m)
                    nisa.dma_copy(dst=slot.xt[r, :], src=x.ap([[cfg.H, m], [1, cfg.H]], offset=0,
                                                              vector_offset=slot.gid[r, :]), dge_mode=DGE)
            run_gated(g, body)


def _mx_act(cfg, slot, psum):
    """MX tile (all 128 token rows): x^T quantised to MXFP8, gate/up (nc_matmul_mx), the activation, its act^T
    quantised to MXFP8 (slot.aq words, slot.as_ scales): the down projection's stationary."""
    _mx_operand(cfg, slot.xt, cfg.H, cfg.KC, slot.xTm, slot.xq, slot.xs, psum.t, 1)
    for c in range(cfg.n_ich):
        _gate_up_mx(cfg, slot, psum, c)
        _activation_step(cfg, slot, psum, c)
    _mx_operand(cfg, slot.a, cfg.KDm * MX_CHUNK, cfg.KDm, slot.aTm, slot.aq, slot.as_, [psum.at], 0)


def _mx_operand(cfg, src, width, chunks, dstT, q, scale, banks, engine):
    """src [128 tokens, width] (x's dtype, width = chunks x 512) → MXFP8 words q [128, chunks, 128 tokens] and
    scales in MX element order (mx_weights.py: element j of chunk c on partition 8 (j // 32) + j % 8, lane
    (j % 32) // 8): per chunk and lane one TensorE transpose of the column set {512 c + 8 lane + 32 g + r}, evicted
    into dstT [128, chunk, token, lane], then one nisa.quantize_mx per chunk (VectorE)."""
    for c in range(chunks):
        ps = banks[c % len(banks)]
        for ln in range(4):
            nisa.nc_transpose(dst=ps[:, ln, :], data=lane_columns(src, width, P_MAX, c * MX_CHUNK, ln))
        view = dstT.ap([[chunks * MX_CHUNK, P_MAX], [1, 4], [4, P_MAX]], offset=c * MX_CHUNK)
        evict(1, view, ps[:, :4, :])     # ScalarE: VectorE has quantize_mx and the activation
        nisa.quantize_mx(dst=q[:, c, :], src=dstT[:, c, :, :], dst_scale=scale[:, c, :])


def _gate_up_mx(cfg, slot, psum, c):
    """Gate and up columns of chunk c with MXFP4 weights: nc_matmul_mx over the H/512 contraction chunks (x^T
    MXFP8 stationary, the weights moving); the bias row closes the group as a K=1 matmul (ones x bias row), so the
    activation reads PSUM directly (VectorE, which quantises the operands, is this path's busiest engine)."""
    c0 = c * cfg.I_CH
    cw = min(cfg.I_CH, cfg.I - c0)
    for k in range(cfg.KC):
        for dst, off in ((slot.pg, c0), (slot.pu, cfg.I + c0)):
            nisa.nc_matmul_mx(dst=dst[:, :cw], stationary=slot.xq[:, k, :], moving=slot.wgu[:, k, off:off + cw],
                              stationary_scale=slot.xs[:, k, :], moving_scale=slot.sgu[:, k, off:off + cw],
                              accumulate=k > 0)
    if cfg.bias_gu:
        for dst, off in ((slot.pg, c0), (slot.pu, cfg.I + c0)):
            nisa.nc_matmul(dst=dst[:, :cw], stationary=psum.ones, moving=slot.brow[:, off:off + cw], accumulate=True)


def _down_mx(cfg, slot, psum, n=P_MAX, pb=0):
    """y = affinity * (a @ Wd + bd) with MXFP4 down weights: nc_matmul_mx over the I chunks (act^T MXFP8
    stationary), the bias a K=1 matmul (ones x b_down row) into the same PSUM bank; rows pb..pb+n scaled (a narrow
    tile's real rows)."""
    for h in range(cfg.n_hch):
        h0 = h * cfg.H_CH
        hw = min(cfg.H_CH, cfg.H - h0)
        ps = psum.d[h % len(psum.d)]
        for k in range(cfg.KDm):
            nisa.nc_matmul_mx(dst=ps[:, :hw], stationary=slot.aq[:, k, :], moving=slot.wd[:, k, h0:h0 + hw],
                              stationary_scale=slot.as_[:, k, :], moving_scale=slot.sd[:, k, h0:h0 + hw],
                              accumulate=k > 0)
        if cfg.bias_d:
            nisa.nc_matmul(dst=ps[:, :hw], stationary=psum.ones, moving=slot.bdrow[:, h0:h0 + hw], accumulate=True)
        _scale_rows(slot, ps, 0, h0, hw, n, pb)     # all on ScalarE: VectorE carries the quantize_mx work


def _half_gate_up_act(cfg, slot, aT=None):
    """Narrow tile (HALF_ROWS tokens): gate/up with the weights stationary ([128 H, <=128 I] per chunk) and the
    tokens moving, so each matmul takes max(HALF_ROWS, 64) cycles instead of the 2I-column stream of a full tile;
    the result has I on the partitions, so the activation writes act^T (the down projection's stationary) with no
    transposes; the bias is a per-partition operand."""
    n, KT, inter = HALF_ROWS, cfg.KT, cfg.I
    for j in range(cfg.n_ic):
        i0 = j * P_MAX
        w = min(P_MAX, inter - i0)
        o = slot.rb if j == cfg.KD - 1 else 0     # the last contraction tile's partitions (cfg.rem_high)
        r = slice(o, o + w)
        pg, pu = slot.pg[r, j * n:(j + 1) * n], slot.pu[r, j * n:(j + 1) * n]
        for kt in range(KT):
            nisa.nc_matmul(dst=pg, stationary=slot.wgu[:, kt, i0:i0 + w], moving=slot.xTn[:, kt, :n],
                           accumulate=kt > 0, **_col_tile(o))
            nisa.nc_matmul(dst=pu, stationary=slot.wgu[:, kt, inter + i0:inter + i0 + w], moving=slot.xTn[:, kt, :n],
                           accumulate=kt > 0, **_col_tile(o))
        g, u, sg = slot.gh[r, :], slot.uh[r, :], slot.sh[r, :]
        a = (slot.aTh if aT is None else aT)[r, j, :n]
        if cfg.bias_gu:
            nisa.tensor_scalar(dst=g, data=pg, op0=nl.add, operand0=slot.bcol[r, j:j + 1])
            nisa.tensor_scalar(dst=u, data=pu, op0=nl.add, operand0=slot.bcol[r, cfg.n_ic + j:cfg.n_ic + j + 1])
            pg, pu = g, u
        _act(cfg, pg, pu, g, u, sg, a)


def _act(cfg, g_in, u_in, g, u, sg, a):
    """a = act(g_in, u_in) in x's dtype (fp32 math; g, u, sg: fp32 scratch of the same shape)."""
    if cfg.activation == "swiglu":
        nisa.activation(dst=sg, op=nl.silu, data=g_in)
        nisa.tensor_tensor(dst=a, data1=sg, data2=u_in, op=nl.multiply)
        return
    # GPT-OSS: gate <= L, -L <= up <= L, out = (up + 1) * gate * sigmoid(alpha * gate)
    lim = GPT_OSS_SWIGLU_LIMIT
    nisa.tensor_scalar(dst=g, data=g_in, op0=nl.minimum, operand0=lim)
    nisa.tensor_scalar(dst=u, data=u_in, op0=nl.maximum, operand0=-lim, op1=nl.minimum, operand1=lim)
    nisa.activation(dst=sg, op=nl.sigmoid, data=g, scale=GPT_OSS_SWIGLU_ALPHA)
    nisa.tensor_tensor(dst=sg, data1=sg, data2=g, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=a, data=u, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=sg)


def _transpose_x(cfg, slot, psum, n, pb=0):
    """xT[:, kt, :n] = x tile columns {p * KT + kt} (tiled gate/up layout: {kt * 128 + p}) of the n rows transposed
    (TensorE), TRANSPOSE_GROUP per PSUM bank."""
    KT = cfg.KT
    b = _gather_base(cfg, n, pb)
    for gi, c0 in enumerate(range(0, KT, TRANSPOSE_GROUP)):
        nc = min(TRANSPOSE_GROUP, KT - c0)
        ps = psum.t[gi % 2]
        for c in range(nc):
            kt = c0 + c
            cols = (slice(kt * P_MAX, (kt + 1) * P_MAX) if cfg.gu_tiled
                    else slice(kt, kt + (P_MAX - 1) * KT + 1, KT))
            nisa.nc_transpose(dst=ps[:, c, :n], data=slot.xt[b:b + n, cols])
        evict(gi + 1, slot.xT[:, c0:c0 + nc, :n], ps[:, :nc, :n])    # ScalarE first: VectorE has the activation


def _gate_up_step(cfg, slot, psum, c):
    """Gate and up columns of chunk c: [128 tokens, cw] fp32 in PSUM, accumulated over the KT H tiles."""
    c0 = c * cfg.I_CH
    cw = min(cfg.I_CH, cfg.I - c0)
    for kt in range(cfg.KT):
        nisa.nc_matmul(dst=slot.pg[:, :cw], stationary=slot.xT[:, kt, :], moving=slot.wgu[:, kt, c0:c0 + cw],
                       accumulate=kt > 0)
        nisa.nc_matmul(dst=slot.pu[:, :cw], stationary=slot.xT[:, kt, :],
                       moving=slot.wgu[:, kt, cfg.I + c0:cfg.I + c0 + cw], accumulate=kt > 0)


def _activation_step(cfg, slot, psum, c):
    """a[:, chunk] = act(gate + bg, up + bu) in x's dtype (fp32 math)."""
    c0 = c * cfg.I_CH
    cw = min(cfg.I_CH, cfg.I - c0)
    g, u = slot.pg[:, :cw], slot.pu[:, :cw]
    if cfg.bias_gu and not cfg.mx:    # (the MX path adds the bias in PSUM: _gate_up_mx)
        nisa.tensor_tensor(dst=slot.g[:, :cw], data1=g, data2=slot.bgu[:, c0:c0 + cw], op=nl.add)
        nisa.tensor_tensor(dst=slot.u[:, :cw], data1=u, data2=slot.bgu[:, cfg.I + c0:cfg.I + c0 + cw], op=nl.add)
        g, u = slot.g[:, :cw], slot.u[:, :cw]
    _act(cfg, g, u, slot.g[:, :cw], slot.u[:, :cw], slot.s[:, :cw], slot.a[:, c0:c0 + cw])


def _transpose_act(cfg, slot, psum):
    """aT[:, k, :] = a[:, k*128 : k*128 + 128]^T (with the down bias, column I of a is 1: the bias row's input)."""
    ps = psum.at
    rb = slot.rb
    for k in range(cfg.KD):
        w = min(P_MAX, cfg.I_aug - k * P_MAX)
        # the last tile on partitions rb..: transpose rb more columns before it (they land on partitions 0..rb)
        o = rb if k == cfg.KD - 1 else 0
        nisa.nc_transpose(dst=ps[:o + w, k, :], data=slot.a[:, k * P_MAX - o:k * P_MAX + w])
    full = cfg.I_aug // P_MAX
    if full:
        evict(0, slot.aT[:, :full, :], ps[:, :full, :])
    rem = cfg.I_aug - full * P_MAX
    if rem:
        evict(1, slot.aT[rb:rb + rem, full, :], ps[rb:rb + rem, full, :])


def _down_step(cfg, slot, psum, aT, n, pb=0):
    """y[pb:pb+n, chunk] = affinity * (a @ Wd (+ bd)) rounded to x's dtype, chunk by chunk over DOWN_BANKS PSUM
    banks (aT: act^T [I_aug, n] in KD partition tiles, the stationary). A narrow tile (n < 128) is a column tile of
    the PE array at column pb (tile_position), so its output rows land on PSUM partitions pb..pb+n."""
    for h in range(cfg.n_hch):
        h0 = h * cfg.H_CH
        hw = min(cfg.H_CH, cfg.H - h0)
        ps = psum.d[h % len(psum.d)]
        for k in range(cfg.KD):
            w = min(P_MAX, cfg.I_aug - k * P_MAX)
            o = slot.rb if k == cfg.KD - 1 else 0
            nisa.nc_matmul(dst=ps[pb:pb + n, :hw], stationary=aT[o:o + w, k, :n],
                           moving=slot.wd[o:o + w, k, h0:h0 + hw], accumulate=k > 0, **_pe_tile(o, pb, n))
        _scale_rows(slot, ps, h, h0, hw, n, pb)


def _col_tile(o):
    """Matmul tiling that puts the output rows (stationary columns, <= 64) on PSUM partitions o.. (o = 0: none)."""
    return dict(tile_position=(0, o), tile_size=(P_MAX, P_MAX - o)) if o else {}


def _pe_tile(o, pb, n):
    """Matmul tiling of a contraction tile on partitions o.. (o > 0: a 64-row PE row tile) with n output rows at
    PSUM partition pb (n < 128: a 64-column PE column tile); {} when neither."""
    if not o and n == P_MAX:
        return {}
    return dict(tile_position=(o, pb), tile_size=(P_MAX - o, n))


def _scale_rows(slot, ps, h, h0, hw, n, pb=0):
    """y[pb:pb+n, h0:h0+hw] = affinity * PSUM chunk h, in x's dtype (ScalarE / VectorE alternating by chunk)."""
    r = slice(pb, pb + n)
    if h % 2 == 0:
        nisa.activation(dst=slot.y[r, h0:h0 + hw], op=nl.copy, data=ps[r, :hw], scale=slot.aff[r, :])
    else:
        nisa.tensor_scalar(dst=slot.y[r, h0:h0 + hw], data=ps[r, :hw], op0=nl.multiply, operand0=slot.aff[r, :])


def _hsplit(cfg, out, sched, core, weights, tiles, psum, x, w_gate_up, w_down, b_gate_up, b_down, rows, scales):
    """LNC=2: the down projection split by H halves. The host pairs the experts into steps (similar tile counts:
    one expert per core and step, each core's own gate/up weights only). A step runs in tile-steps: each core
    gathers its own tile's rows, computes gate/up and the activation, its down projection for its half of H
    (columns core * H/2 ...) and scatter-adds it into out; then the two cores swap the tile's down operand (bf16
    act^T, or with MXFP4 weights its MXFP8 words and scales; sendrecv, SBUF to SBUF) and each computes the peer
    tile's down projection for its own half of H. Each core reads its H half of both step experts' down weights (no
    weight is read twice) and read-modify-writes only its half of out's columns: no partial, no zero-fill of one,
    no combine after a barrier."""
    n_pairs = nisa.scalar_load(sched[0:1, 0:1])
    zero_first = nisa.scalar_load(sched[0:1, 1:2])
    c0 = core * cfg.Hh
    nl.fori_loop(0, zero_first, lambda _: _zero_rows(cfg, out, 0, cfg.T, c0, cfg.Hh))
    refs = (x, w_gate_up, w_down, b_gate_up, b_down, rows, out, scales)

    def pair(p):
        for s in range(2):
            base = HS_HEADER + p * (2 * STEP_FIELDS) + s * STEP_FIELDS
            slots = [_Slot(weights[s], t, psum, i) for i, t in enumerate(tiles)]
            _hsplit_step(cfg, slots, psum, sched, base, refs, core, s == 1)

    nl.fori_loop(0, n_pairs, pair)


def _hsplit_step(cfg, slots, psum, sched, base, refs, core, second):
    """One step of the H split: own expert e (gate/up + the H half of its down weights), the peer's expert pe (the
    H half of its down weights), then the tile-steps, two at a time on alternate tile buffer sets."""
    x, w_gate_up, w_down, b_gate_up, b_down = refs[:5]
    scales = refs[7]
    e, load, pe, pload, t_pairs, t_odd, t0 = (_field(cfg, sched, base, k) for k in range(STEP_BASE))
    og = pg = None
    if cfg.skip_padding:
        og = tuple(_field(cfg, sched, base, STEP_BASE + k) for k in range(PAD_GATES))
        pg = tuple(_field(cfg, sched, base, STEP_BASE + PAD_GATES + k) for k in range(PAD_GATES))
    c0 = core * cfg.Hh
    nl.fori_loop(0, load, lambda _: _load_weights(cfg, slots[0], psum, e, w_gate_up, w_down, b_gate_up, b_down,
                                                  scales, down_cols=(c0, cfg.Hh)))
    if cfg.mx:
        nl.fori_loop(0, pload, lambda _: _load_mx_down(cfg, slots[0], pe, w_down, scales[1], b_down, c0, cfg.Hh,
                                                       cfg.Hh))
    else:
        nl.fori_loop(0, pload, lambda _: _load_bf16_down(cfg, slots[0], pe, w_down, b_down, c0, cfg.Hh, cfg.Hh,
                                                         slots[0].prb))
    # as _serve_expert: the second step of a pair takes the tile sets in the other order; narrow tiles on set 1 put
    # their rows on partitions 64..127 (the DMA engines' other half)
    order = slots[::-1] if second else slots
    pb = [(P_MAX - HALF_ROWS) if order[k] is slots[1] else 0 for k in range(2)]

    def two(i):
        for k in range(2):
            _tile_step(cfg, order[k], psum, sched, t0 + (2 * i + k) * TILE_FIELDS, refs, core, pb[k], og, pg)

    nl.fori_loop(0, t_pairs, two)
    nl.fori_loop(0, t_odd, lambda _: _tile_step(cfg, order[0], psum, sched, t0 + 2 * t_pairs * TILE_FIELDS, refs,
                                                core, pb[0], og, pg))


def _tile_step(cfg, slot, psum, sched, tb, refs, core, pb, og, pg):
    """Own tile (full, narrow or none): rows, gate/up, activation, act^T (MX: quantised), down for this core's H
    half, scatter-add; the act^T swap with the other core; the peer's tile (full, narrow or none): its ids and
    affinities, down for this core's H half from the received act^T, scatter-add. A bf16 narrow tile's act^T sits
    in columns 0..63; an MX narrow tile is computed on all 128 token rows, its real rows pb..pb+64 (both cores use
    the same tile set for a tile-step, so the peer's rows sit on the same partitions)."""
    x, _, _, _, _, rows, out, _ = refs
    of, op, on, orow, pf, pp, pn, prow, zero = (_field(cfg, sched, tb, k) for k in range(TILE_FIELDS))
    c0, Hh = core * cfg.Hh, cfg.Hh
    own_op = (slot.aq, slot.as_) if cfg.mx else slot.aT
    peer_op = (slot.aqr, slot.asr) if cfg.mx else slot.aTr

    def own(n, p, g=None):
        _load_tile_inputs(cfg, slot, orow, x, rows, n, p, g)
        nl.fori_loop(0, zero, lambda _: _zero_rows(cfg, out, 0, cfg.T, c0, Hh))
        _gate_up_act(cfg, slot, psum, n, p, slot.aT)
        _down_half(cfg, psum, own_op, slot, 0, slot.y, slot.aff, slot.sid, n, p, out, c0, 0, g)

    def peer(n, p, g=None):
        _load_scatter_ids(rows, prow, n, p, slot.pids, slot.psid, slot.paff)
        _down_half(cfg, psum, peer_op, slot, Hh, slot.py, slot.paff, slot.psid, n, p, out, c0, cfg.n_hch_half, g)

    nl.fori_loop(0, of, lambda _: own(P_MAX, 0))
    nl.fori_loop(0, op, lambda _: own(P_MAX, 0, og))
    nl.fori_loop(0, on, lambda _: own(HALF_ROWS, pb, og))
    if cfg.mx:
        nisa.sendrecv(src=slot.aq, dst=slot.aqr, send_to_rank=1 - core, recv_from_rank=1 - core, pipe_id=PIPE_ACT)
        nisa.sendrecv(src=slot.as_, dst=slot.asr, send_to_rank=1 - core, recv_from_rank=1 - core,
                      pipe_id=PIPE_ACT_SCALE)
    else:
        nisa.sendrecv(src=slot.aT, dst=slot.aTr, send_to_rank=1 - core, recv_from_rank=1 - core, pipe_id=PIPE_ACT)
    nl.fori_loop(0, pf, lambda _: peer(P_MAX, 0))
    nl.fori_loop(0, pp, lambda _: peer(P_MAX, 0, pg))
    nl.fori_loop(0, pn, lambda _: peer(HALF_ROWS, pb, pg))


def _down_half(cfg, psum, op, w, w0, y, aff, sid, n, pb, out, c0, b0, gates=None):
    """y[pb:pb+n, :H/2] = affinity * (a @ Wd[:, c0:c0 + H/2] (+ bd)) (the weights' half in the slot's down columns
    w0..), rounded to x's dtype, then out[ids, c0:c0 + H/2] += y by one DMA read-modify-write (padding rows
    skipped). op: act^T [I_aug, tokens] (bf16), or the MXFP8 act^T (words, scales) with MXFP4 weights (nc_matmul_mx,
    the bias a K=1 matmul; computed on all 128 token rows, rows pb..pb+n kept). PSUM banks (and the bf16 path's
    ScalarE / VectorE evictions) rotate from b0 (the peer tile's chunks continue the own tile's rotation)."""
    r = slice(pb, pb + n)
    for h in range(cfg.n_hch_half):
        h0 = h * cfg.H_CH
        hw = min(cfg.H_CH, cfg.Hh - h0)
        ps = psum.d[(b0 + h) % len(psum.d)]
        cols = slice(w0 + h0, w0 + h0 + hw)
        if cfg.mx:
            aq, as_ = op
            for k in range(cfg.KDm):
                nisa.nc_matmul_mx(dst=ps[:, :hw], stationary=aq[:, k, :], moving=w.wd[:, k, cols],
                                  stationary_scale=as_[:, k, :], moving_scale=w.sd[:, k, cols], accumulate=k > 0)
            if cfg.bias_d:
                nisa.nc_matmul(dst=ps[:, :hw], stationary=psum.ones, moving=w.bdrow[:, cols], accumulate=True)
        else:
            for k in range(cfg.KD):
                kw = min(P_MAX, cfg.I_aug - k * P_MAX)
                o = (w.prb if w0 else w.rb) if k == cfg.KD - 1 else 0
                nisa.nc_matmul(dst=ps[r, :hw], stationary=op[o:o + kw, k, :n], moving=w.wd[o:o + kw, k, cols],
                               accumulate=k > 0, **_pe_tile(o, pb, n))
        if cfg.mx or (b0 + h) % 2 == 0:    # MX: all on ScalarE (VectorE carries the quantize_mx work)
            nisa.activation(dst=y[r, h0:h0 + hw], op=nl.copy, data=ps[r, :hw], scale=aff[r, :])
        else:
            nisa.tensor_scalar(dst=y[r, h0:h0 + hw], data=ps[r, :hw], op0=nl.multiply, operand0=aff[r, :])
    _scatter_add(cfg, out, y, sid, n, pb, c0, cfg.Hh, gates)


moe_cte_nki = nki.jit(moe_cte_kernel)


# ---- host side ----------------------------------------------------------------------------------------------------

def kernel_inputs(expert_index, affinities, num_experts, block_size, n_cores=1):
    """Mapping → the kernel's inputs (NumPy): (mapping, rows [R, ROW_FIELDS] int32, schedule); rows_table splits
    the rows table back into gather ids, scatter ids and affinities."""
    m = blockwise_mapping(expert_index, num_experts, block_size)
    ids = m.token_position_to_id
    aff = np.asarray(affinities.float().cpu() if hasattr(affinities, "cpu") else affinities, np.float32).reshape(-1)
    slot = m.token_position_to_slot
    row_aff = np.where(slot >= 0, aff[np.maximum(slot, 0)], 0.0).astype(np.float32)
    ids, row_aff = _place_last_tiles(m, ids, row_aff)
    gather = np.where(ids >= 0, ids, 0).astype(np.uint32)
    sched = expert_schedule(m, n_cores)
    rows = np.zeros((len(ids), ROW_FIELDS), np.int32)
    rows[:, ROW_GATHER] = gather.view(np.int32)
    rows[:, ROW_SCATTER] = ids
    rows[:, ROW_AFF] = row_aff.view(np.int32)
    return m, rows, sched


def rows_table(rows):
    """The kernel's rows table → (gather ids uint32, scatter ids int32, affinities fp32), each [R]."""
    rows = np.ascontiguousarray(rows, np.int32)
    return (rows[:, ROW_GATHER].copy().view(np.uint32), rows[:, ROW_SCATTER].copy(),
            rows[:, ROW_AFF].copy().view(np.float32))


def expert_schedule(m, n_cores=1):
    """[n_cores, W] int32. LNC=1: header (expert pairs, prologue flag) and the (expert, first row, tile pairs, odd
    tile, load, half) entries, experts in id order (the first entry's weights load in the prologue). LNC=2: per core
    its H-split block (_hsplit_block)."""
    n = m.num_active
    rows = m.tokens_per_expert[m.active_experts[:n]]
    tiles = -(-rows // P_MAX_HOST)
    firsts = m.expert_first_block[:n] * m.block_size
    if n_cores == 2:
        parts = _hsplit_block(m, rows, tiles, firsts)
        out = np.zeros((2, max(len(r) for r in parts)), np.int32)
        for c, r in enumerate(parts):
            out[c, :len(r)] = r
        return out
    assert n_cores == 1, f"n_cores={n_cores} must be 1 or 2"
    S = max(2, n + n % 2)
    H0 = SCHED_HEADER
    out = np.zeros((1, H0 + SCHED_FIELDS * S), np.int32)
    out[0, 0] = (n + 1) // 2
    out[0, 1] = 1 if n else 0
    last = _last_tiles(m)
    for j in range(n):
        # complete 128-row tiles, then the last tile: narrow (<= HALF_ROWS rows) or partial (65..127 rows), with
        # its pieces' gates
        full, half, part, gates, _ = last[j]
        out[0, H0 + SCHED_FIELDS * j:H0 + SCHED_FIELDS * (j + 1)] = (m.active_experts[j], firsts[j], full // 2,
                                                                    full % 2, int(j > 0), half, part, *gates)
    return out


def _last_tiles(m):
    """Per active expert (schedule order): (complete 128-row tiles, narrow last tile 0/1, partial last tile 0/1,
    PAD_GATES gates, real piece slots). The last tile's real rows go to ceil(rows / PAD_PIECE) of its pieces: the
    slots after the previous last tile's (cyclically; partial and narrow tiles each with their own counter), so
    that over the experts the skipped padding pieces spread over all DMA engines."""
    out = []
    nxt = {0: 0, 1: 0}
    for j in range(m.num_active):
        rows = int(m.tokens_per_expert[m.active_experts[j]])
        full, rem = divmod(rows, P_MAX_HOST)
        half, part = int(0 < rem <= HALF_ROWS), int(rem > HALF_ROWS)
        slots = []
        gates = [0] * PAD_GATES
        if half or part:
            n = HALF_ROWS if half else P_MAX_HOST
            k = n // PAD_PIECE
            q = -(-rem // PAD_PIECE)
            s = nxt[half] if q < k else 0
            slots = [(s + i) % k for i in range(q)]
            if q < k:
                nxt[half] = (s + q) % k
            gates[s] = gates[PAD_STARTS + q - _pad_count_min(n)] = 1
        out.append((full, half, part, gates, slots))
    return out


def _place_last_tiles(m, *arrays):
    """The per-row arrays ([R] each) with each expert's last-tile rows moved into its real pieces (_last_tiles,
    computed once for all of them; the other rows of those pieces and tile are padding: the array's value at the
    expert's padding rows). Rows of one expert are independent (a token appears once per expert), so their order
    inside the expert changes nothing."""
    out = tuple(a.copy() for a in arrays)
    firsts = m.expert_first_block[:m.num_active] * m.block_size
    for j, (full, _, _, _, slots) in enumerate(_last_tiles(m)):
        if not slots:
            continue
        rows = int(m.tokens_per_expert[m.active_experts[j]])
        t0 = int(firsts[j]) + full * P_MAX_HOST
        rem = rows - full * P_MAX_HOST
        n = (HALF_ROWS if rem <= HALF_ROWS else P_MAX_HOST)
        for a in out:
            real, pad = a[t0:t0 + rem].copy(), a[t0 + n - 1]
            a[t0:t0 + n] = pad
            i = 0
            for s in slots:
                k = min(PAD_PIECE, rem - i)
                a[t0 + s * PAD_PIECE:t0 + s * PAD_PIECE + k] = real[i:i + k]
                i += k
    return out


def _hsplit_block(m, rows, tiles, firsts):
    """The two cores' H-split schedule rows (LNC=2): experts sorted by tile count, paired into steps (core 0 the
    first of each pair, core 1 the second), each step's tile-steps: tile q of each core's own expert (full or narrow
    last tile, or none when its expert has fewer) beside the peer's tile q. Returns one int32 row per core."""
    n = len(rows)

    none = (0, 0, 0, 0)
    no_gates = [0] * PAD_GATES

    last = _last_tiles(m)

    def tile_list(j):
        # (complete, partial, narrow, first row) per tile
        full, half, part, _, _ = last[j]
        return [(1, 0, 0, int(firsts[j]) + P_MAX_HOST * i) for i in range(full)] + (
            [(0, part, half, int(firsts[j]) + P_MAX_HOST * full)] if half or part else [])

    order = sorted(range(n), key=lambda j: (-int(tiles[j]), -int(rows[j]), j))
    steps = [(order[i], order[i + 1] if i + 1 < n else None) for i in range(0, n, 2)]
    steps += [(None, None)] * (len(steps) % 2)      # whole step pairs
    lists = {j: tile_list(j) for j in range(n)}
    blocks = []
    for c in range(2):
        own_first = [True]
        head = [len(steps) // 2, 0]
        step_rows, tile_rows = [], []
        for a, b in steps:
            mine, theirs = (a, b) if c == 0 else (b, a)
            lm = lists[mine] if mine is not None else []
            lt = lists[theirs] if theirs is not None else []
            q_n = max(len(lm), len(lt))
            og = last[mine][3] if mine is not None else no_gates
            pg = last[theirs][3] if theirs is not None else no_gates
            step_rows.append([int(m.active_experts[mine]) if mine is not None else 0, int(mine is not None),
                              int(m.active_experts[theirs]) if theirs is not None else 0, int(theirs is not None),
                              q_n // 2, q_n % 2, len(tile_rows), *og, *pg])
            for q in range(q_n):
                ot = lm[q] if q < len(lm) else none
                pt = lt[q] if q < len(lt) else none
                zero = int(any(ot[:3]) and own_first[0])
                if zero:
                    own_first[0] = False
                tile_rows.append([*ot, *pt, zero])
        head[1] = int(own_first[0])      # no own tile at all: zero this core's half of out first
        t_base = HS_HEADER + STEP_FIELDS * len(step_rows)
        for r in step_rows:
            r[6] = t_base + TILE_FIELDS * r[6]
        blocks.append((np.array(head, np.int32), step_rows, tile_rows))
    return [np.concatenate([h, np.array(sr, np.int32).reshape(-1), np.array(tr, np.int32).reshape(-1)])
            for h, sr, tr in blocks]


P_MAX_HOST = 128       # the kernel's token tile (nl.tile_size.pmax on every target), for the host-side schedule


def run_kernel(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down, activation, add_down_bias,
               block_size, lnc, **scales):
    """Build the kernel's inputs from the routing and launch it (cte.moe_cte checked the arguments and the
    backend)."""
    _, rows, sched = kernel_inputs(expert_index, affinities, w_gate_up.shape[0], block_size, lnc)
    arrays = [rows, sched]
    if not isinstance(x, np.ndarray):
        import torch
        arrays = [torch.from_numpy(a) for a in arrays]
    kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
    return kernel(x, w_gate_up, w_down, *arrays, b_gate_up=b_gate_up, b_down=b_down if add_down_bias else None,
                  activation=activation, routed_rows=int(expert_index.shape[0] * expert_index.shape[1]), **scales)
