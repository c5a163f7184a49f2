"""Tile sizes and limits, the launch configuration (_Config: every derived size), argument validation and the LNC=2
splits.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

# ---- tile sizes -----------------------------------------------------------------------------------------------
# Hardware limits come from nl.tile_size (the same on trn2 and trn3 unless noted); the rest are tuning choices
# expressed in them. Target-dependent capacities (usable SBUF per partition, usable PSUM banks) are read at trace
# time in _Config, so one file serves trn2 and trn3.
# SBUF/PSUM partitions = matmul contraction tile (K) = TensorE transpose size = gemm_stationary_fmax (a score
# tile's rows are a stationary's columns)
P_MAX = nl.tile_size.pmax
# fp32 elements per PSUM bank; also every matmul's moving free size here (<= gemm_moving_fmax, see _validate_inputs)
PSUM_F = nl.tile_size.psum_bank_fmax
QKV_BANKS = 4          # PSUM banks open at once in the QKV projection (one accumulation group per bank)
# TensorE transposes [<=128, 128] (bf16) batched into one PSUM bank before one eviction
TRANSPOSE_GROUP = nl.tile_size.psum_bank_fmax_bytes // (P_MAX * 2)
FA_SUB = 2 * PSUM_F    # context positions per online-softmax step: 2 PSUM banks of scores, double-buffered
PV_COLS = 2 * PSUM_F   # PV output columns (pack batches x d): 2 PSUM banks
# PSUM banks the attention holds at once: 2 score buffers of FA_SUB, the PV output, one transpose bank (P^T) and
# one selection bank (o^T); every other phase uses fewer.
ATTN_PSUM_BANKS = 2 * (FA_SUB // PSUM_F) + PV_COLS // PSUM_F + 2
FA_TILE_MAX = 4096     # context positions per K/V load (one DMA per batch and K/V): >= 4 KiB per partition
# Contiguous scans (row-major steps) of at most this many positions per core also split their FIRST slot to
# FA_SUB positions (see _slot_bounds). Tuning, modelled trn2: nki-library q1 B2 S5 10K 64.6 -> 57.9 us, GPT-OSS
# B=16 4K 70.3 -> 64.5, LNC=2 B=8 4K -4..-8 %; longer scans lose 1..5 % (GPT-OSS B=8 / B=16 16K; LNC=2 with split
# weights beyond 8K: q1 B2 S5 10K +7 %), position-major (B = 1) ones 0.4 %.
FIRST_SPLIT = 12288
FIRST_SPLIT_WSPLIT = 8192
# LNC=2 batch split with split weights: scans of at least this many positions are balanced at run time (both cores
# on every sequence, alternating slots: _split_stride); shorter ones keep whole sequences per core. Tuning, modelled
# trn2 (bench positions, stride vs whole / LNC=1): 8K and 16K win in 12 of 14 cells (GPT-OSS B=16 16K 88.0 vs
# 96.6 us), 4K loses in all four (GPT-OSS B=16 4K 50.1 vs 41.8); see DESIGN.md.
STRIDE_MIN_SCAN = 8192
# Ragged loads (planning._first_prefixes): the scan's first piece is loaded as one of FIRST_PIECE_SPLITS + 1 prefixes,
# each half the next (at least FIRST_PIECE_MIN positions: one K^T tile), so a sequence shorter than a quarter of the
# piece reads a quarter of it, not all. Each prefix is one more runtime gate per batch and pack, and a K^T transpose
# of s positions moves 2s-byte runs (DMA efficiency s / (s + 128)); modelled trn2 Llama-8B ragged B=8 / B=16 with
# 1 / 2 / 3 splits: 91.04 / 152.73, 90.64 / 152.13, 90.54 / 155.12 us (92.75 / 154.27 without; with _whole_k).
# fp8 caches: one split (fp8 Llama-8B B=16 16K 232.59 us with one, 233.93 with two, 233.40 without).
FIRST_PIECE_MIN = 128
FIRST_PIECE_SPLITS = 2
FIRST_PIECE_SPLITS_FP8 = 1
BIAS_ROWS = (64, 96)   # partitions of bias_o's even / odd 128-column chunks (_Config.bias_psum)
# d < 128 (GPT-OSS's two-batch K^T stacks): the unrotated batches' whole-slot K^T loads (planning._whole_k: SBUF
# runs of 2w bytes, DMA efficiency 0.85 instead of 0.80 at w = 2048) only when the core scans at least this many
# packs, i.e. where the K/V stream paces the row (modelled trn2 GPT-OSS B=64 16K 516.67 -> 510.44 us); with one or
# two packs the TensorE steps after the last K/V byte pace it and the coarser transfers cost (B=8 16K +0.4 %,
# B=16 16K +1.0 %).
KW_PACKS = 4
# The pack tables loaded once for all packs (_Config.pack_tables) from this scan length: shorter scans (nki-library's
# q8 d64 B64 1K rows) are not paced by the K/V stream's start, and the on-chip selections cost there (+1.4 .. +1.9 %).
PACK_TABLES_MIN_SCAN = 4096
# _Config.tail_cuts: the kernel's last pack ANDs each K^T stack's scrub in this many column pieces
# (_Config.last_and_pieces), so a score chunk's matmuls wait for its own columns' ANDs only (GpSimd, 0.43 us per
# 512-column piece), not the whole slot's 1.7 us.
LAST_K_AND_PIECES = 4
# _Config.last_and_split (d = 128, k_first): the kernel's last pack ANDs each K^T stack in this many column pieces
# (_Config.last_and_pieces), one per 512-column score chunk (rows q < 64 / q >= 64 of the slot's K^T layout at 8
# blocks a step), and its V per step's blocks, so the last slot's first step waits for its own half of each 1.7 us
# GpSimd AND only.
LAST_AND_SPLIT = 2
# _Config.k1_prefixes (d = 128, k_first): a two-piece slot's first-piece-alone K^T load (planning._whole_k: the
# sequence ends inside that piece, so it is its last slot) as prefix alternatives of this many positions each, the
# shortest holding the sequence's rows (flash._load_k_alts): its K^T stops within K1_PREFIX positions of the length,
# not at the piece's end (1024 positions). Short transposes move short SBUF runs (128 positions: 256 B, DMA efficiency
# 0.45 vs 0.80 at 1024), still a net gain: modelled trn2 ragged Llama-8B B=16 141.30 / 141.60 / 142.00 us with 128 /
# 256 / 512 (142.47 without). The one-hot gates are 2 GpSimd instructions per pack (on VectorE: 147.74).
K1_PREFIX = 128
# _Config.k_mask_pieces: a one-pack kernel's K^T scrub masks (ScalarE sign, [kp, w]: 1.7 us at w = 2048) are issued
# in this many column pieces, so the QKV eviction that becomes ready while one runs (the list schedule does not
# preempt) waits for a piece, not the whole mask: q, and the first scores, ~0.8 us earlier (modelled trn2 ragged
# GPT-OSS B=8; 3 pieces gave 61.57 us, 4 the same as 2).
K_MASK_PIECES = 2
# _Config.tail_cuts also on the 16K scans of one or two packs of two-batch stacks (GPT-OSS B=8 / B=16 16K, trn2): the
# last pack's steps run after the K/V stream (a TensorE backlog of the sparse late slots), the same tail as B=64's.
# Not below 16K: modelled GPT-OSS B=16 4K 52.61 -> 52.94 us with them (see DESIGN.md, helper-92).
TAIL_CUTS_MIN_SCAN = 16384
# ... and from this scan length where the core scans one pack (GPT-OSS B <= 8: its steps are the whole scan), so that
# _Config.tail_halves holds on every one-pack scan of two-piece slots (modelled GPT-OSS B=8 8K, bench positions /
# ragged lengths: 65.86 / 52.67 us without, 65.48 / 52.30 with helper-93's row halves, 63.96 / 51.24 with these).
TAIL_CUTS_ONE_PACK_MIN_SCAN = 8192
# _Config.mask_dve: the cache steps' masks compare fp16 key offsets on VectorE; fp16 holds every integer up to 2048
# exactly, so only slots of at most this many positions (key offsets 0 .. w - 1).
MASK_DVE_MAX_SLOT = 2048
V_RUN_BYTES = 4096     # target contiguous bytes per partition of a V load (DMA efficiency: >= 4 KiB runs)
PAIR_BUFS = 2          # fp8 cache: tiles of K pairs as loaded (each cast into its K^T slot right after its loads)
KV_BUFS = 2            # K/V load slots (ring) for d <= 64 (3 for larger d, whose 4 KiB V runs need shorter slots)
PACK_MIN = 4           # smallest batch pack the K/V ring sizing may shrink to (for longer, more efficient DMAs)
KV_SBUF_MAX = 128 * 1024   # bytes per partition for the K/V ring (less when the resident weights are large)
KV_SBUF_MIN = 32 * 1024    # ... but never less than this (the weights then stream through a smaller ring)
SBUF_RESERVE = 24 * 1024   # bytes per partition kept for everything else (q, masks, P tiles, accumulators)
# Weights resident or streamed (_weight_plan). Decode uses each weight byte once, so holding a weight whole in SBUF
# buys nothing but an early, queue-free load; a weight whose share does not fit (nki-library's q16 d128 H7168 shape
# at LNC=1: W_qkv 252 KiB and W_o 224 KiB per partition, 208 KiB usable on trn2) streams through a ring of buffers
# in contraction chunks instead (W_qkv: H/128 tiles accumulating in PSUM; W_o: 128-row K chunks, partial sums in
# fp32 SBUF), its loads overlapping the matmuls of the previous chunks.
W_STREAM_BUFS = 3          # ring buffers of a streamed weight: TensorE reads one while the next two load
W_STREAM_CHUNK = 32 * 1024  # target bytes per partition of one streamed chunk (whole contraction tiles: the DMA
                            # runs are whole rows, >= 4 KiB at the shapes that stream)
WEIGHT_ROOM = None         # bytes per partition a weight may take (None: from the target's SBUF, see _weight_plan);
                           # tests lower it to stream small shapes
# X of at most this many tokens (a token tile) is DMA'd straight into the transposed layout [128, tokens, H/128]
# (partition p: H rows p * KT .. p * KT + KT - 1 of each token, runs of KT elements) instead of [tokens, H] rows
# on `tokens` partitions: a DMA engine serves 8 SBUF partitions, so the row layout put all of X on one or two
# engines, ahead of that engine's share of W_qkv (modelled, nki-library q2 B8 H5376: engine 0 busy 44.4 us vs
# 39.7 us for the others). Spread over 16 engines the short runs cost less than that queue; it also saves the x^T
# TensorE transposes. More tokens keep the rows (enough engines; the 2-byte-per-KT runs would cost more).
XT_DIRECT_TOKENS = 16
# ... except (_Config.x_row_parts: trn2, d = 128, bf16 cache, where the DMA rings pace the K/V stream) for
# 9 .. XT_DIRECT_TOKENS tokens: the transposed load moves 64-byte runs (DMA efficiency 0.20: Llama-8B
# B=16 1.9 us on every engine), so the rows load instead, in groups (first partition, at most this many rows; 0.37 us
# of one engine per row) on engines 12, 4, 0 and 8 (a group starts on a quadrant, as TensorE transposes it; engine 0
# carries the small per-token tables, engine 4 the RoPE tables, engine 8 the rotated batches' first-slot prefixes),
# transposed on TensorE (tiles.transpose_token_groups). Modelled trn2 Llama-8B B=16 4K 112.04 -> 110.93 us (DESIGN.md;
# fp8 caches keep the transposed load: fp8 B=16 16K 232.07 -> 232.09 with the rows, 234.04 with other groupings;
# so do caches of more than X_ROW_S_MAX positions: B=16 16K would gain (265.85 -> 264.75) but ragged B=16 lose 0.05).
X_ROW_PARTS = ((96, 6), (32, 5), (0, 4), (64, 1))
X_ROW_S_MAX = 4096
# 8 tokens (Llama-8B B=8) loaded in four groups of two rows (rings 12 / 4 / 0 / 8, 0.74 us each) until the
# helper-95 round; they spread since (_Config.x_spread, X_SPREAD_D128_SCAN), so the groups start at 9 tokens.
X_ROW_PARTS_MIN = 9
# ... and (_Config.x_spread: trn2, d < 128, no LNC=2 weight split) X of 2..X_SPREAD_TOKENS tokens loads as rows on
# partitions X_SPREAD_STRIDE * t (+ 64 for caches of <= X_ROW_S_MAX positions: engines 8..15, where W_o's last bytes
# land first; modelled GPT-OSS B=8 4K 48.61 -> 48.47 us, but B=8 16K +0.3 %, nki-library q8 B4 11K +1.1 %), one per
# DMA engine (6 KiB runs at H = 3072: 0.27 us of one engine each), the
# partitions between zeroed (a memset split between GpSimd and VectorE), and one TensorE transpose of the
# 32 / 64-partition block per kt whose eviction picks the token columns (tiles.transpose_spread_rows): the
# transposed load's 48-byte runs (DMA efficiency 0.16) cost every engine 0.86 us at GPT-OSS B=8, ahead of W_qkv
# and the K/V stream (modelled trn2 GPT-OSS B=8 4K 49.27 -> 48.69 us, 16K 85.55 -> 84.69). Not kept elsewhere
# (modelled): 9..16 tokens on every engine (GPT-OSS B=16 4K 54.09 -> 56.83: the compute-paced middle of that row
# moves), d = 128 on LNC=1 only (Llama-8B B=8 4K 70.95 -> 70.42 but its asserted LNC=2 B=8 4K <= 0.6x LNC=1 was
# lost: 0.602; nki-library q2 H5376 B8 1K +7 %; see below), d = 64 with LNC=2 split weights (GPT-OSS B=8 4K 33.74
# -> 37.08), trn3 (B=8 4K +6 %), B=1 (+5 %), stride 16 (ragged GPT-OSS B=8 +0.9 %), the whole memset on VectorE
# (ragged B=8 +3.3 %).
# d = 128 (helper-95 round): 8 tokens where X_ROW_PARTS_MIN's groups of two rows loaded them (bf16 caches of <=
# X_ROW_S_MAX positions, scans of >= X_SPREAD_D128_SCAN), the LNC=2 weight split included (each core loads the
# whole tile): 8 KiB rows, one on each of engines 8..15 (0.37 us each), instead of two on each of 12 / 4 / 0 / 8
# (0.74 us) next to the RoPE tables (4) and the per-token tables (0). Modelled trn2 Llama-8B B=8 4K 69.89 -> 69.25
# us, K_cache_transposed 68.90 -> 68.25 (x1.143), LNC=2 B=8 4K 41.89 -> 41.45 (0.5986 of LNC=1). Not longer caches
# (ragged Llama-8B B=8 +3.0 %; B=8 16K would gain 0.35 %) nor scans below X_SPREAD_D128_SCAN (nki-library q2 d128
# H5376 B8 1K, its QKV chain pacing it: +4.5 / +6.3 % at LNC 1 / 2), as the groups before.
X_SPREAD_D128_SCAN = 2048
X_SPREAD_TOKENS = 8
X_SPREAD_STRIDE = 8     # partitions per DMA engine
# First partition of a token tile's RoPE tables (cos / sin rows, _Config.small_p0) when the tile has at most 32 rows:
# a DMA is served by the DMA engines owning its SBUF partitions (8 each), and partitions 0..7 (engine 0) also carry
# the token rows' other small transfers (positions, pack tables, cache-update stores) and a ragged pack's first V
# pieces, while engines 4..7 (partitions 32..63) carry the least K/V (modelled, DESIGN.md "ring 0's small
# transfers"). A compute operand of at most 32 partitions may start at partition 0 / 32 / 64 / 96 (C13).
SMALL_P0 = 32
SMALL_ROWS_MAX = P_MAX // 4   # ... for tiles of at most a quadrant's rows (C13: <= 32 partitions may start at 32)
W_QKV_DMAS = 4         # W_qkv is loaded in this many DMAs (>= 2 KiB contiguous per partition each)
W_O_DMAS = 4           # ... and W_o in up to this many column pieces per 128-row chunk (>= 3 KiB runs)
# NeuronCore-v4 (trn3): at most this many out^T chunks per packed group of the O-projection's few-token layout
# (oproj._out_groups; the packing allows 128 / tokens). W_o has landed before o^T there, so what follows the last
# attention step is the whole O-projection; smaller groups leave less after its last matmul (modelled trn3
# GPT-OSS B=8 4K 40.48 -> 40.32 us, B=8 16K 81.27 -> 81.11; DESIGN.md "trn3 GPT-OSS B=8 4K: the profile").
OUT_GROUP_V4 = 8
# _Config.last_half (trn3, PV with V stationary, one pack of one-piece slots: GPT-OSS B <= 8, 4K): the scan's last
# this many positions are a slot of their own, so the step left after the last K/V byte is half a step (its scores,
# row max, exp and PV) and a sequence ending in the last slot's first half skips the second (modelled trn3 GPT-OSS
# B=8 4K 36.36 -> 35.44 us; DESIGN.md "trn3 GPT-OSS B=8 4K: a false dependency, then half a step ...").
LAST_HALF_V4 = FA_SUB // 2
# Position-major steps (scores^T: cache positions on the partitions, query rows on the free axis) for packs of at
# most this many rows (a tuning choice, modelled: B = 1 GPT-OSS / Llama-8B -3..-5 %, but 10..64 rows slower, e.g.
# GPT-OSS B=8 4K +19 %: the per-128-position matmul floor and the per-step chain outweigh the saved row work).
# A step's [128, FA_SUB / 128 tiles, rows] scores then fill at most one PSUM bank.
PMAJOR_ROWS = 8
assert PMAJOR_ROWS * (FA_SUB // P_MAX) <= PSUM_F
# ... whose steps cover up to this many 128-position tiles (as many as one PSUM bank of [128, tiles * rows] scores
# holds): the per-step chain is fixed work (modelled trn2, 8 -> 32 tiles: GPT-OSS B=1 4K 32.0 -> 31.0 us, 16K 49.3
# -> 46.1, nki-library q1 B1 LNC2 36.0 -> 33.4, q1 B2 S5 LNC2 42.0 -> 38.4).
PMAJOR_TILES = 32
MASK_NEG = -1.0e30     # additive mask value: exp underflows to 0; two of them still sum to a finite fp32
MAX_S_TKG = 8          # new tokens per sequence
MAX_BATCH = 64
MAX_GROUP = 16         # query heads per KV head
MAX_HEAD_DIM = P_MAX   # head dim lives on the partitions for QK^T
MAX_TOKENS = 4 * P_MAX  # B * S_tkg handled per launch (4 token tiles of 128 partitions)
MIN_BLOCK, MAX_BLOCK = 16, 512   # paged KV cache: block sizes (powers of two) in this range
MAX_CACHE_ROWS = 1 << 24   # paged cache rows num_blocks * kv_heads * block_size: exact in fp32 (row ids on-chip)
# AWS nki.isa.dma_transpose, "DMA Indirect Transpose Constraints": a gather-transpose takes 16..128 index rows (a
# multiple of 16), so a paged slot is gathered in at least this many rows (sub-blocks when blocks are large).
GATHER_ROWS_MIN = 16


def _split_context(cfg, core):
    """LNC=2 with B < 2: this core scans [lo, hi) of the cache (halves in units of cfg.unit) and owns the
    O-projection columns [hc0 * 128, hc1 * 128)."""
    mid = cfg.scan // cfg.unit // 2 * cfg.unit
    n_c = cfg.H // P_MAX
    half = (n_c + 1) // 2
    cfg.split, cfg.wsplit, cfg.core = True, True, core
    cfg.lo, cfg.hi = (0, mid) if core == 0 else (mid, cfg.scan)
    cfg.hc = (0, half) if core == 0 else (half, n_c)


def _split_weights(cfg, core):
    """LNC=2 batch split with the weights split between the cores: this core loads W_qkv rows of half of the
    H/128 tiles (QKV partial sums exchanged) and W_o columns [hc0 * 128, hc1 * 128) (o^T exchanged)."""
    n_c = cfg.H // P_MAX
    half = (n_c + 1) // 2
    cfg.wsplit, cfg.core = True, core
    cfg.hc = (0, half) if core == 0 else (half, n_c)


def _split_stride(cfg, core):
    """LNC=2 batch split balanced at run time (see _use_stride): both cores attend every sequence, each the K/V
    slots of the whole scan that planning._stride_slots gives it (alternating, a static interleaving), so each core
    gets about half of every sequence's real positions whatever the runtime lengths; core 0 adds the new tokens
    (active step), core 1 starts from an empty state. Each row's (m, l, own batch block of acc) are merged across
    the cores as in the context split (flash._own_blocks, _combine_cores), after which both cores hold o^T of every
    token (no o^T exchange). The weights stay split (_split_weights: W_qkv rows, W_o columns)."""
    _split_weights(cfg, core)
    cfg.split, cfg.stride = True, True
    cfg.b_lo, cfg.b_hi = 0, cfg.B
    # slots of one step (FA_SUB positions): the finest interleaving the plan has, so each core's share of every
    # sequence is within one step of half; and the ring's first uses (which scrub every invalid lane, see
    # flash._ring_mode) cost a step's width, not a whole slot's
    cfg.fa_tile = min(cfg.fa_tile, FA_SUB)


def _can_split_weights(cfg):
    """Batch split with B even (the cores' o^T column blocks have one shape, as sendrecv needs), o^T one PSUM bank
    of one token tile (the attention's direct o^T path, exchanged in one sendrecv) and a QKV contraction of two
    halves; other shapes keep whole weights per core."""
    n_k = (cfg.nq * cfg.d + P_MAX - 1) // P_MAX
    return (cfg.B >= 2 and cfg.B % 2 == 0 and cfg.B * cfg.S <= cfg.tile_tok and cfg.d in (32, 64, 128)
            and n_k * cfg.B * cfg.S <= PSUM_F and cfg.KT >= 2)


class _Config(nl.NKIObject):
    """Static shapes and options of one launch (compile-time values only). Frozen: every derived size, this core's
    LNC share included, is decided in __init__; assigning an attribute afterwards raises."""

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"_Config is frozen: {name} is decided at construction and cannot be reassigned")
        object.__setattr__(self, name, value)

    def __init__(self, B, S, H, d, nkv, nq, s_max, L, scale, h_actual, window, itemsize, bs=0, mb=0, fp8=False,
                 n_prog=1, core=0, fp8_mm=False, kv_dtype=None, k_t=False, rope_tables=False):
        """rope_tables: cos / sin are given, in W_qkv's dtype (what _Config.rope_t's transposed RoPE reads)."""
        self.B, self.S, self.H, self.d, self.nkv, self.nq = B, S, H, d, nkv, nq
        # K_cache_transposed: K stored [B, nkv, d, S_max] (contiguous bf16 cache only). The K^T loads are plain DMA
        # copies of d partitions x w contiguous positions (kv_io._load_kT) into the same SBUF layout the DMA
        # transposes of the row-major cache produce, so every later phase is the same; the cache update writes K
        # transposed.
        self.k_t = k_t
        self.paged, self.bs, self.mb = bs > 0, bs, mb    # paged cache: block size, block-table columns
        # fp8 KV cache: K^T comes from a DMA transpose of the fp8 rows read as 2-byte pairs (dims 2i, 2i + 1 of a
        # position in one element; the DMA transpose moves 2-byte elements only), cast to bf16 on an engine as two
        # half-dim stacks (even dims, odd dims): see _load_piece / _cast_pairs. V is cast by its DMA.
        self.fp8 = fp8
        # fp8 cache whose dtype TensorE takes (float8_e4m3 on trn2; float8_e4m3 / float8_e4m3fn from trn3): the
        # score matmuls read the pairs' even / odd bytes directly (moving or stationary fp8, the queries bf16: AWS's
        # nc_matmul allows mixed input dtypes), no cast and no bf16 K^T stacks
        self.fp8_mm, self.kv_dtype = fp8 and fp8_mm, kv_dtype
        self.imajor = self.paged      # i-major K^T / score layout (column i*128 + q <-> position q*n + i)
        self.s_max, self.L, self.scale, self.h_actual, self.window = s_max, L, scale, h_actual, window
        # query heads per KV head (>= 1: the attention-DP config of the gathered tokens may hold fewer query heads
        # than KV heads; it never attends, see decode/exchange.py)
        self.group = max(1, nq // nkv)
        self.R = self.group * S                # query rows of one (batch, KV head): (s, h) order
        self.C = (nq + 2 * nkv) * d            # fused QKV columns
        self.KT = H // P_MAX                   # contraction tiles over H (H index p * KT + kt on partition p)
        self.tile_tok = (P_MAX // S) * S       # tokens per token tile: whole sequences only
        self.L_prior = L - S                   # cache keys read: j < pos[b, 0] <= L - S
        # Scan of the cache: whole 128-position tiles (paged: whole u-position units, u = max(128, block size)).
        self.unit = max(P_MAX, bs)
        self.scan = (self.L_prior + self.unit - 1) // self.unit * self.unit
        if not self.paged:
            self.scan = min(s_max, self.scan)
        # Sliding window: scan only the W - 1 cache keys before each sequence's first new position, from a dynamic
        # start (a register per sequence): start = clamp(pos[b, 0] - W + 1, 0, cap - scan_w) (paged: rounded down
        # to a multiple of u, and u more positions scanned). The cost no longer grows with the context.
        self.dyn = False
        self.cap = s_max if not self.paged else s_max // self.unit * self.unit
        if window > 0:
            scan_w = 0
            if window > 1 and self.paged:
                scan_w = (window - 1 + self.unit - 1) // self.unit * self.unit + self.unit
            elif window > 1:
                scan_w = (window - 1 + P_MAX - 1) // P_MAX * P_MAX
            if scan_w < self.scan and scan_w <= self.cap:
                self.scan, self.dyn = scan_w, scan_w > 0
        # Ragged contexts: each sequence's K/V loads stop at its own length, and a pack's steps past all of its
        # sequences' lengths are skipped (runtime trip counts; see _step_gates). Not for the windowed scan, whose
        # short range already follows each sequence.
        self.ragged = not self.dyn
        # d <= 64: kpp = 128 // d batches share the partitions of one K^T / query stack (batch j on partitions
        # (j % kpp) * d ..), so one score matmul contracts over 128 partitions and covers kpp batches.
        kpp_d = P_MAX // d if (2 * d <= P_MAX and P_MAX % d == 0) else 1
        self.pad = P_MAX - d if kpp_d > 1 else 0      # qkv tile column padding for the stacked transposes
        # fp8 cache: a stack holds one half of the head dims (kd = d / 2 partitions per batch: the even dims in
        # one stack, the odd dims in the next), so twice as many batches share a stack's partitions (the same
        # number of score matmuls as bf16). Several batches per stack only when their partition starts are legal
        # for the engines that copy them (multiples of 32: kd in {32, 64}).
        self.halves = 2 if fp8 else 1
        self.kd = d // self.halves             # partitions of one batch in a K^T / query stack
        self.kpp = kpp_d if not fp8 else (P_MAX // self.kd if self.kd in (32, 64) else 1)
        self.pack = max(1, min(B, P_MAX // self.R, PV_COLS // d))   # batches sharing one score tile
        # K/V ring: KV_BUFS slots of pack x FT positions (K^T stacks [128, FT] + V [128, FT/128, d] per batch).
        n_k = (nq * d + P_MAX - 1) // P_MAX
        sbuf = nl.tile_size.sbuf_fmax_bytes    # usable SBUF bytes per partition of this target
        # W_qkv / W_o resident or streamed, from this core's share (the larger one of an LNC=2 weight split, decided
        # below by _split_context / _split_weights, so both cores take the same plan)
        n_c = H // P_MAX
        wsplit = n_prog > 1 and ((B < n_prog and self.scan >= 2 * self.unit) or _can_split_weights(self))
        kt_share = self.KT - self.KT // 2 if wsplit and self.KT >= 2 else self.KT
        hc_share = (n_c + 1) // 2 if wsplit else n_c
        self.wq_chunk, self.wq_bufs, self.wo_chunk, self.wo_bufs = _weight_plan(
            self.C * itemsize, kt_share, hc_share * P_MAX * itemsize, n_k, sbuf)
        resident = self.KT * self.C * itemsize + n_k * H * itemsize     # W_qkv and W_o, bytes per partition
        if self.wq_chunk or self.wo_chunk:      # streamed: what the attention's K/V ring lives beside
            resident = _weight_bytes(self.C * itemsize, kt_share, self.wq_chunk, self.wq_bufs) + \
                _weight_bytes(hc_share * P_MAX * itemsize, n_k, self.wo_chunk, self.wo_bufs)
        budget = min(KV_SBUF_MAX, max(KV_SBUF_MIN, sbuf - SBUF_RESERVE - resident))
        # FT target: V runs of >= 4 KiB per partition (DMA efficiency), i.e. FT * d * itemsize / 128 >= 4 KiB.
        self.kv_bufs = KV_BUFS if d <= 64 else KV_BUFS + 1
        ft_target = min(FA_TILE_MAX, max(2 * FA_SUB, V_RUN_BYTES * P_MAX // (d * itemsize) // FA_SUB * FA_SUB))
        kt = 1 if self.fp8_mm else self.halves    # bf16 K^T stacks per load group (fp8_mm: the pairs, 2 B each)
        while self.pack > PACK_MIN and self.kv_bufs * _slot_bytes(self.pack, ft_target, self.kpp, d, itemsize,
                                                                   kt) > budget:
            self.pack -= 1
        ft = FA_TILE_MAX
        while ft > FA_SUB and _ring_bytes(self.kv_bufs, self.pack, ft, self.kpp, d, itemsize, kt) > budget:
            ft -= FA_SUB
        if self.kv_bufs == KV_BUFS and ft >= 2 * FA_SUB:
            # Same SBUF as KV_BUFS slots of ft positions, as up to twice as many half-size slots: the first steps
            # start on half the data and the ring runs further ahead of the compute (no queue stalls).
            half = ft // 2 // FA_SUB * FA_SUB
            self.kv_bufs = min(2 * KV_BUFS, KV_BUFS * ft // half)
            ft = half
        self.ngroups = (self.pack + self.kpp - 1) // self.kpp      # K^T load groups per pack (kpp batches each)
        self.nst = self.halves * self.ngroups                       # K^T / query stacks: (group, half) pairs
        self.fa_tile = max(P_MAX, min(ft, (self.scan + P_MAX - 1) // P_MAX * P_MAX))
        # Context split between the two cores of an LNC=2 launch (B < 2; see _split_context): defaults = no split.
        self.split, self.core, self.lo, self.hi, self.hc = False, 0, 0, self.scan, (0, H // P_MAX)
        self.wsplit = False    # LNC=2: W_qkv rows / W_o columns split between the cores (_split_weights)
        self.stride = False    # LNC=2 batch split, both cores on every sequence, slots alternating (_split_stride)
        if self.paged:     # paged slots are 128 * 2^m positions (block-aligned gathers)
            ft = P_MAX
            while 2 * ft <= self.fa_tile:
                ft *= 2
            self.fa_tile = ft
        # This core's share of an LNC launch, decided here so that nothing changes the config afterwards:
        # sequences [b_lo, b_hi) (per_core each), or both cores on every sequence with the scan split (B < cores),
        # or a batch split with the weights split too (_can_split_weights).
        self.per_core = (B + n_prog - 1) // n_prog
        self.b_lo, self.b_hi = core * self.per_core, min(B, (core + 1) * self.per_core)
        if n_prog > 1 and B < n_prog and self.scan >= 2 * self.unit:
            self.b_lo, self.b_hi = 0, B
            _split_context(self, core)
        elif n_prog > 1 and _can_split_weights(self):
            if _use_stride(self):
                _split_stride(self, core)
            else:
                _split_weights(self, core)
        assert self.wsplit == wsplit, "the weight plan assumed another LNC split"
        # Position-major steps (few query rows in this core's packs, contiguous bf16 cache, full attention, whole
        # 128-position tiles): the score matmul puts 128 cache positions on the partitions (stationary = K^T
        # columns, moving = the queries), so the softmax's elementwise work is tiles x rows per partition instead
        # of the step's 1024 positions on `rows` partitions, and exp(scores^T) is P^T for the PV matmul.
        self.pmajor = (not self.imajor and window == 0 and self.scan % P_MAX == 0
                       and min(self.pack, self.b_hi - self.b_lo) * self.R <= PMAJOR_ROWS)
        # One sequence per pack on a 2-batch stack (d = 64, bf16, position-major): a K^T slot fills only half the
        # partitions of its stack, so its dma_transpose used only the 8 DMA rings serving partitions 0..63 (a DMA
        # engine serves 8 consecutive partitions) while V and the weights use all 16: the rings of partitions
        # 0..63 carried 1.5x the bytes of the others (GPT-OSS B=1 16K: busy 42.4 vs 27.9 us). The ring buffers
        # of odd index put the K^T slot on partitions kd..2kd instead (the query copied there too, and the
        # scrub's valid-range table), so both halves of the rings share the K stream (_kt_lanes).
        # Paged caches (row-major steps, i-major K^T) do the same (GPT-OSS B=1 4K paged: engines 27.0 / 22.4 us busy).
        self.kt_alt = ((self.pmajor or (self.paged and not self.dyn)) and self.kpp == 2 and self.halves == 1
                       and self.kv_bufs % 2 == 0 and min(self.pack, self.b_hi - self.b_lo) == 1)
        # A ragged pack's slot is loaded per sequence in pieces of one step (_load_pieces), V's a block of
        # consecutive partitions (partition q holds positions q*n ..), and a sequence loads the pieces up to its
        # length: the early pieces, on the low partitions, are loaded by more sequences than the late ones, so the
        # 8 DMA rings of partitions 0..63 carried more V bytes than the others (Llama-8B ragged B=16: V 91.8 vs
        # 74.9 us of each ring). The odd batches of a pack hold such slots rotated by half (their V partition q
        # holds the plain layout's partition (q + 64) % 128, their K^T columns likewise), so a sequence's first
        # piece lands on the low or the high rings by its parity (planning._v_rotated). The score and PV matmuls
        # are unchanged (score column block q <-> V partition q for every batch); the rotated rows' mask thresholds
        # (+-64n on each half of the columns) and the scrubs' position tables follow.
        # NeuronCore-v3 (trn2) only, where the K/V stream paces B >= 8; on v4 (trn3: faster HBM, TensorE / VectorE
        # pace those rows) it only adds work (modelled GPT-OSS B=16 16K +2 %).
        v3 = nisa.get_nc_version() < nisa.nc_version.gen4
        self.v_rot = (v3 and self.ragged and not self.imajor and not self.pmajor
                      and min(self.pack, self.b_hi - self.b_lo) >= 2)
        # Where the K/V stream paces the ragged rows, trn2 (with the rotation) and d = 128 (Llama-8B; GPT-OSS's d = 64
        # packs are TensorE / VectorE-paced, where the extra gates cost more than the skipped bytes save: modelled
        # ragged B=8 / B=16 +2.1 / +1.3 %, fp8 B=16 16K +1.6 %): the scan's first piece loaded as prefix
        # alternatives (planning._first_prefixes, this many splits; 0: off) and the unrotated batches' K^T of
        # two-piece slots as the first piece or the whole slot (planning._whole_k); the latter for d < 128 too when
        # this core scans KW_PACKS packs or more.
        n_packs = (self.b_hi - self.b_lo + self.pack - 1) // self.pack
        # Ragged scans of d < 128 whose every slot is one load piece of FA_SUB positions (the 4K rows: first and
        # last slots split, planning._slot_bounds) load each slot in two half pieces (planning._load_pieces): V as
        # two blocks of 64 partitions (the same 1 KiB runs), K^T as the first half alone or the whole slot
        # (k_whole below: one transpose, 2 KiB SBUF runs), so a sequence ending in the first half of its last slot
        # reads half of it; the two-piece slots then take the rotation by stack (v_rot, k_plain), which balances the
        # half pieces' V between the two halves of the DMA rings. Modelled trn2 GPT-OSS B=8 4K 48.38 -> 46.22 us
        # (DESIGN.md). Not d = 128 (Llama-8B B=8 4K gains 5.5 %, LNC=2 B=8 4K 3.2 %: the asserted LNC=2 <= 0.6x
        # LNC=1 is lost), not fp8, not trn3 (v_rot is trn2-only).
        self.k_packs = False     # read by _one_piece_plan (planning._slot_bounds); decided below
        self.first_whole = False     # the same (planning._slot_bounds); decided below
        self.last_half = False   # likewise (decided with pv_t below)
        self.half_pieces = (self.v_rot and self.d < P_MAX and not fp8 and not self.stride
                            and _one_piece_plan(self))
        self.k_whole = self.v_rot and (self.d == P_MAX or n_packs >= KW_PACKS or self.half_pieces)
        # ... and where this core scans KW_PACKS packs or more (DMA-paced: GPT-OSS B=64 4K), ring buffers as wide as
        # those slots (fa_tile = FA_SUB: the same slot plan), so a slot's K^T of batches j, j + 2 (adjacent stacks)
        # is contiguous per partition and two partners both needing the whole slot load it in one transpose
        # (flash._load_k_pair: 4 KiB SBUF runs, DMA efficiency 0.85 vs 0.80). Modelled trn2 GPT-OSS B=64 4K 178.42 ->
        # 172.66 us; with fewer packs the longer transfers cost (B=16 4K 52.61 -> 52.89, LNC=2 B=8 4K 32.70 ->
        # 33.03; B=8 4K gains 46.22 -> 45.92).
        if self.half_pieces and n_packs >= KW_PACKS:
            self.fa_tile = FA_SUB
        splits = FIRST_PIECE_SPLITS_FP8 if fp8 else FIRST_PIECE_SPLITS
        self.first_prefixes = splits if self.k_whole and self.d == P_MAX else 0
        # One batch per K^T stack (bf16, d = 128): the rotated batches' K^T is loaded in the plain layout too (the
        # first piece alone or the whole slot, planning._whole_k), and their score matmuls read it rotated instead
        # (flash._step_scores: a score chunk's column blocks q of one half read the K^T columns of (q + 64) % 128, a
        # moving-operand offset; each stack is its own matmul). The rotated layout cost two dma_transposes of 64n
        # columns per slot (2 KiB SBUF runs: DMA efficiency 0.80) where the plain one moves the slot in one (4 KiB
        # runs: 0.85); the K^T stream of the Llama-8B 16K rows is ~40 % of each DMA ring's busy time. The V layout,
        # the masks and the V scrub stay rotated; the K^T scrub uses the plain key ramp.
        # Two batches per stack (d = 64, bf16): both batches of a stack share its score matmul, so the rotation is
        # by stack (batches 2, 3 of every 4 rotated: rot_unit = 2, planning._rot_batch) and the rotated stacks read
        # their plain K^T rotated as the d = 128 ones do (GPT-OSS B=64 16K: the odd batches' K^T was two transposes
        # of 1024-position halves, 2 KiB SBUF runs at 0.80, ~27 % of each DMA ring's busy time).
        self.k_plain = self.k_whole and self.kpp in (1, 2) and self.halves == 1
        # d = 128 with k_whole (Llama-8B-like ragged scans, trn2): each batch's K^T loads of a slot are issued ahead of
        # its V pieces (flash._issue_scores), so the K^T of the kernel's last slot is not the last byte in the DMA
        # rings' FIFO: its scrub AND and score matmuls run while V still lands (modelled trn2 Llama-8B ragged B=16
        # 144.45 -> 143.00 us: the last K^T landed after the last V, then ~13.5 us of AND / steps / O-projection).
        # Not d = 64 (GPT-OSS B=64 4K +1.9 %, LNC=2 B=8 4K +1.3 %: their half pieces' V feeds PV sooner).
        self.k_first = self.k_whole and self.d == P_MAX
        # ... and the kernel's last pack's scrub ANDs split (isolation._scrub_slot / _scrub_v): K^T in LAST_AND_SPLIT
        # column pieces (a score chunk waits for its own columns' AND), V per step's blocks (a step's PV for its own),
        # so the last slot's first step no longer waits for two 1.7 us GpSimd ANDs over the whole slot (modelled trn2
        # ragged Llama-8B B=16 143.00 -> 142.47 us, B=8 88.61 -> 88.46; either alone: 143.07 / 143.00).
        self.last_and_split = self.k_first
        # ... and the first-piece-alone K^T loads (a sequence's last slot) as prefix alternatives of K1_PREFIX
        # positions (flash._load_k_alts, ragged._k1_prefix_gates): ~2900 of the ~6300 positions the ragged Llama-8B
        # B=16 row's K^T read past the lengths (modelled trn2 142.47 -> 141.29 us, Llama-8B B=64 4K 314.23 -> 308.52;
        # DESIGN.md)
        self.k1_prefixes = self.k_first
        self.rot_unit = self.kpp if self.k_plain else 1     # batches per rotation unit (planning._rot_batch)
        # Two-batch stacks of k_plain (GPT-OSS B >= 32 on trn2: every DMA ring busy to the end, modelled): the packs'
        # position and sink tables without a DMA per pack (flash._prefetch_packs): each batch's position on every
        # partition in one load for all packs (flash._PackTables), each row's first position selected out of it on
        # chip (flash._own_position), the sink rows loaded once. Their 4- and 32-byte-run DMAs cost each DMA engine
        # ~0.1 us per pack, ahead of the K/V stream. Not elsewhere: with d = 128 (Llama-8B ragged B=16 +0.6 %) or on
        # trn3 (GPT-OSS B=16 16K +1.8 %) the shifted list schedule costs more than the DMA time saves.
        # Not with half_pieces (their k_plain): modelled GPT-OSS B=64 4K 178.42 -> 179.43 us with the tables, DP 2
        # groups 54.40 -> 55.01 (B=16 4K 52.61 -> 52.52).
        self.pack_tables = (self.k_plain and self.kpp == 2 and self.scan >= PACK_TABLES_MIN_SCAN
                            and not self.half_pieces)
        # Where pack_tables holds, the end is the last pack's final steps after its last K/V bytes (GPT-OSS B=64
        # 16K, modelled: VectorE busy ~100 % from the last slot's K^T ANDs to o^T): (1) that pack's K^T scrub ANDs
        # in LAST_K_AND_PIECES column pieces (isolation._scrub_slot), (2) its l updates on GpSimd (two fp32 ops, the
        # same rounding as one scalar_tensor_tensor; flash._online_step_inplace), (3) o^T's PSUM -> SBUF copy of the
        # other packs' token columns issued before the last pack, only its own columns after it
        # (flash._attention_flash_decode), (4) its sink term added to l before its steps (rescaled with l by every
        # alpha; flash._add_sink), (5) its pending PV groups' flush folded into the normalisation
        # (flash._normalise_full). Modelled trn2 GPT-OSS B=64 16K 492.25 -> 491.59 (1-3) -> 491.40 us (DESIGN.md).
        # Also (helper-92) the 16K scans of d = 64 bf16 packs where pack_tables does not hold (fewer than KW_PACKS
        # packs): modelled GPT-OSS B=8 16K 83.91 -> 82.65 us (mostly (1): the last pack's K^T ANDs by column piece),
        # ragged B=8 / B=16 61.61 / 88.90 -> 60.06 / 87.19 (DESIGN.md).
        # Also (helper-98) the LNC=2 batch split with one pack per core (whole sequences, any scan): each core's pack
        # ends with its last slot's ANDs and steps after its K/V stream (modelled GPT-OSS B=8 4K LNC=2 30.63 -> 30.00
        # us; not with several packs per core: nki-library q8 d64 B64 1K LNC=2 +1.7 %).
        # And (helper-97) one-pack LNC=1 scans of <= 64 rows from TAIL_CUTS_ONE_PACK_MIN_SCAN, for tail_halves below.
        halves_ok = n_packs == 1 and n_prog == 1 and self.pack * self.R <= P_MAX // 2
        self.tail_cuts = self.pack_tables or (self.v_rot and self.kpp == 2 and not fp8
                                              and (self.scan >= (TAIL_CUTS_ONE_PACK_MIN_SCAN if halves_ok
                                                                 else TAIL_CUTS_MIN_SCAN)
                                                   or (self.wsplit and not self.split and n_packs == 1)))
        # The kernel's last pack ANDs each K^T stack's scrub in this many column pieces (isolation._scrub_slot; 1:
        # whole): LAST_K_AND_PIECES under tail_cuts (d = 64 stacks), LAST_AND_SPLIT under last_and_split (d = 128,
        # k_first; its V ANDs go per step's blocks, isolation._scrub_v). The two flags hold on disjoint shapes (kpp 2
        # / 1); tail_cuts is read first, as the kernel did before this field.
        self.last_and_pieces = (LAST_K_AND_PIECES if self.tail_cuts else LAST_AND_SPLIT if self.last_and_split
                                else 1)
        # Where pack_tables holds, the last pack's steps are a chain over TensorE / ScalarE / VectorE and after it the
        # O-projection waits for o^T and for W_o's last bytes (modelled GPT-OSS B=64 16K: o^T at 486.1, W_o's last
        # byte 488.05 us); tail_halves: (1) that pack's alpha and m in two buffers alternating by step
        # (flash._alpha_bufs: an alpha no longer waits (WAR) for the flush reading the previous one, nor the next
        # step's nbias for m's update behind l's on GpSimd), (2) its in-place steps with the two halves of the P^T
        # blocks on the two partition halves (flash._p128_steps: row max, exp and transposes over [128, 512]
        # instead of [64, 1024]), (3) its o^T selection one matmul per batch (oproj._sel_pairs) and (4) W_o's
        # last column piece the last eviction group's (oproj._wo_pieces). Modelled trn2 GPT-OSS B=64 16K 491.40
        # -> 490.51 us (x1.1512 -> x1.1491; DESIGN.md). Also (helper-97) the tail_cuts scans of one pack (GPT-OSS
        # B=8 16K, ragged B=8; the masks there follow mask_dve): modelled 81.53 -> 79.95 us, ragged 58.65 -> 56.73
        # (vs helper-93's row halves, deleted; one pack from 8K: TAIL_CUTS_ONE_PACK_MIN_SCAN). Not two packs:
        # ragged B=16 86.64 -> 88.65 (+2.3 %), and B=16 16K's gain (142.77 -> 139.64 us) fails the LNC=2 (0.6x) and
        # fp8 (1.05x) bench asserts that compare with it.
        # Not where the cores' states are merged (LNC=2 context / strided batch split: _combine_cores reads one m),
        # nor packs of more than 64 rows (S_tkg 2, packs of 9: m is kept on both partition halves, _alpha_bufs).
        self.tail_halves = self.pack_tables or (self.tail_cuts and n_packs == 1 and not self.split
                                                and self.pack * self.R <= P_MAX // 2)
        # One batch per stack (d = 128), where this core scans at least KW_PACKS packs with whole weights (LNC=1: the
        # K/V stream paces those rows): the scan's first and last slots are not split to one step
        # (planning._slot_bounds), so every slot is two pieces or more: its K^T moves as whole slots and pairs (4 / 8
        # KiB SBUF runs, DMA efficiency 0.85 / 0.87) and its V in 4 KiB runs (0.94) instead of one-piece slots' 2 KiB
        # runs (K^T 0.80, V 0.89);
        # the first step waits for a whole slot and the last one's chain follows a whole slot, which a pack's steps
        # hide when the other packs' loads stream behind them (modelled trn2 Llama-8B B=16 4K 117.42 -> 112.67 us,
        # B=64 4K 330.45 -> 319.23). With fewer packs the one pack's step chain paces the end (B=8 4K: first split
        # off 69.55 us, both off 71.84, vs 71.48 split; DESIGN.md), and the LNC=2 split-weight cores keep the split
        # (42.38 -> 43.03 us without the first one).
        self.k_packs = self.k_plain and self.kpp == 1 and not self.wsplit and n_packs >= KW_PACKS
        # The RoPE tables of token tiles of <= 32 rows land on partitions SMALL_P0.. (DMA engines 4..7) instead of
        # 0.. (engine 0, the busiest ring of the DMA-paced rows: Llama-8B ragged B=8 -0.25 %). trn2 only: on trn3
        # the earlier start only reorders the list schedule (modelled trn3 Llama B=16 4K +0.6 %). d = 64 too since
        # the GPT-OSS rows' rings pace them (modelled GPT-OSS B=8 / B=16 4K 48.69 / 53.64 -> 48.61 / 53.56 us, paged
        # B=16 -0.35 %, every GPT-OSS row within +0.09 %; it cost ragged B=16 +2.4 % when that row was compute-paced).
        self.small_p0 = SMALL_P0 if v3 else 0
        self.x_row_parts = v3 and self.d == P_MAX and not fp8 and s_max <= X_ROW_S_MAX
        spread_d128 = (self.x_row_parts and B * S == X_SPREAD_TOKENS and self.scan >= X_SPREAD_D128_SCAN
                       and (n_prog == 1 or self.wsplit))
        self.x_spread = X_SPREAD_STRIDE if (v3 and 2 <= B * S <= X_SPREAD_TOKENS
                                            and (self.d < P_MAX and not self.wsplit or spread_d128)) else 0
        # The same shapes (Llama-8B B=8 4K, LNC=1 and the LNC=2 weight split) keep the scan's first slot whole
        # (planning._slot_bounds; the last one stays split), as k_packs does at >= KW_PACKS packs: its K^T moves as a
        # whole slot and pairs, its V in 4 KiB runs (DMA efficiency 0.94 vs 0.89). Modelled trn2 (helper-95 round,
        # main at c9abf37): Llama-8B B=8 4K 69.25 -> 68.22 us (x1.1597 -> x1.1425), K_cache_transposed 68.25 ->
        # 66.81, LNC=2 B=8 4K 41.07 -> 40.77 (0.5976 of LNC=1; before helper-99's k_first it lost there: 41.45 ->
        # 41.53). Not trn3 (x_spread is trn2-only; trn3 B=8 4K was +13 %), not other d = 128 shapes (nki-library q1
        # B2 S5 10K +6.3 %: its few query rows' first step waits for the whole slot).
        self.first_whole = spread_d128
        # Several sequences per pack on 2-batch stacks (d = 64, bf16, row-major steps): batch j's K^T lands on the
        # stack half j % 2, so the 8 DMA rings of partitions 0..63 carried the even batches' K bytes and the other
        # 8 the odd ones': with ragged lengths the halves differed by up to 2.4x (GPT-OSS B=8 16K, bench
        # positions: K^T 37.1 vs 15.4 us of each ring). The ring buffers of odd index swap the halves (batch j on
        # (j + 1) % 2; the score matmuls contract against a copy of the queries with the halves swapped, the
        # scrub against a swapped valid-range table), so every sequence's K bytes alternate between both halves
        # slot by slot, whatever the lengths (_kt_lanes). Only where that imbalance is real, as v_rot: trn2
        # (on trn3 TensorE / VectorE pace these rows: modelled +1..5 %), contiguous caches (paged gathers are paced
        # by their fixed costs: +1..2 %), and scans with slots loaded in more than one piece (_kt_swap_pays).
        self.kt_swap = (v3 and not self.pmajor and not self.dyn and not self.paged and self.kpp == 2
                        and self.halves == 1 and self.kv_bufs % 2 == 0 and min(self.pack, self.b_hi - self.b_lo) >= 2
                        and _kt_swap_pays(self))
        # bias_o added in PSUM (oproj._accumulate_out_chunks: a K = 1 matmul opening each out^T chunk's accumulation
        # group, issued long before W_o arrives) where W_o is resident, so the O-projection's evictions are plain
        # copies alternating VectorE / ScalarE instead of VectorE adds of the broadcast bias (modelled trn2 GPT-OSS
        # B=64 16K: 3 x 1.07 us serial VectorE evictions after W_o's last byte -> 0.5 / 0.4 / 0.5 us alternating).
        # NeuronCore-v3 only: on trn3 the packed few-token layouts gain nothing and B=16 4K lost 0.8 %.
        self.bias_psum = not self.wo_chunk and v3
        # trn3, d < 128: the O-projection's packed groups capped at OUT_GROUP_V4 chunks (oproj._out_groups; 0: no
        # cap). Not d = 128 (modelled trn3 Llama-8B B=8 4K 52.79 -> 52.96 us, 16K 118.30 -> 118.53).
        self.out_group_max = OUT_GROUP_V4 if not v3 and self.d < P_MAX else 0
        # NeuronCore-v4, caches of <= X_ROW_S_MAX positions: the QKV projection in the transposed form of the LNC=2
        # split (qkv._qkv_split_transposed without the exchange: W_qkv stationary, x^T moving, max(tokens, 64)
        # cycles per matmul instead of W_qkv's 512 / 128 columns streaming, then TensorE transposes back to the
        # token layout). On trn3 the QKV matmuls are TensorE-paced (6.4 us at B=8, starting when x^T is ready) and
        # on the critical path to q: modelled trn3 GPT-OSS B=8 / B=16 4K 39.77 / 51.96 -> 39.38 / 50.89 us,
        # Llama-8B 52.79 / 86.37 -> 52.37 / 85.02. Not 16K (GPT-OSS B=16 16K +0.2 %, the others unchanged) nor
        # trn2 (its K/V stream paces the rows).
        self.qkv_t = not v3 and s_max <= X_ROW_S_MAX
        # LNC=2 with split weights: RoPE applied to the exchanged QKV sums in their transposed layout
        # (qkv._rope_transposed: [128 rows of a C chunk, chunk, tokens], the rotate-half partner rows by one
        # permutation matmul) and q^T / k^T taken from it (a second permutation matmul puts each head on the other
        # half of the partitions, kpp = 2), instead of back to the token layout, RoPE on `tokens` partitions and
        # the q / k transposes: that chain (~5.5 us, VectorE on 8 partitions) ran between the QKV exchange and the
        # first score on both cores (modelled trn2 GPT-OSS B=8 4K LNC=2, whose attention is compute-paced).
        # Only where the QKV partial sums are exchanged (the contraction split: KT >= 2) and the RoPE tables are given
        # in W_qkv's dtype (rope_tables; other tables take the token-layout RoPE).
        self.rope_t = (wsplit and self.KT >= 2 and rope_tables and not fp8 and self.halves == 1 and P_MAX % d == 0
                       and self.kpp in (1, 2))
        # Row-major steps of the kernel's last pack (flash._row_max): the row max as one VectorE reduce per score
        # chunk (each starts when its chunk's score matmuls are done, the second while TensorE computes the other)
        # and a max of the partial maxima, instead of one reduce after the whole step's scores: the last steps run
        # as a VectorE -> ScalarE -> TensorE chain after the last K/V bytes (modelled trn2 GPT-OSS B=64 16K 495.23 ->
        # 494.69 us, B=8 16K 86.65 -> 85.90, ragged B=8 66.43 -> 64.94). Other packs keep one reduce (the extra
        # instruction on VectorE, which paces GPT-OSS B=64 4K's bound). The flag also puts half of the tail's
        # normalisation on ScalarE (flash._normalise_full). trn3: for scans of one-piece slots (4K; GPT-OSS B=8 4K:
        # modelled 40.32 -> 39.77 us, the split row max 0.13 of it, the normalisation 0.43; with qkv_t below also
        # several packs: GPT-OSS B=16 4K 50.89 -> 50.42, Llama-8B B=8 / B=16 4K 52.37 / 85.02 -> 51.98 / 84.18,
        # before qkv_t B=16 4K was +1.1 %); not two-piece slots (16K: GPT-OSS B=8 16K +0.3 %).
        self.rmax_split = v3 or not _kt_swap_pays(self)
        # With rmax_split, a kernel of one pack scanning slots of more than one piece (ragged GPT-OSS B=8, B=8 16K:
        # the last pack's steps are the whole 16K scan) continues the first chunk's max in the second chunk's
        # reduce (tensor_scalar_reduce, load_reduce) instead of a separate max of the partial maxima
        # (flash._row_max): one small VectorE instruction less per step on the VectorE-paced chain (modelled ragged
        # GPT-OSS B=8 63.58 -> 62.58 us, B=8 16K 85.74 -> 85.63). Not with several packs (GPT-OSS B=16 16K,
        # TensorE-paced: +0.4 %, a list-schedule shift before the last pack) nor one-piece slots (4K: paged B=1
        # 32.98 -> 33.40, LNC=2 B=8 4K 33.64 -> 33.95, attention DP 2 groups 55.90 -> 56.45).
        # The cache steps' causal masks (key offset > the row's threshold, 0 / 1 bf16) on VectorE as a tensor_scalar
        # of fp16 key offsets against the row's fp32 threshold (perf mode: 0.13 us per 512 columns) instead of
        # GpSimd's int16 tensor_tensor against the broadcast threshold (0.43 us), where GpSimd paces the start of the
        # steps (K^T / V scrub ANDs, ramps, these masks: 100 % busy to ~39 us at GPT-OSS B=8 16K, modelled): the
        # 16K scans of one or two packs of tail_cuts (d = 64 bf16). Modelled trn2 GPT-OSS B=8 16K 82.65 -> 82.24 us,
        # B=16 16K 143.61 -> 142.77. Not where VectorE is the roof engine (GPT-OSS B=64 4K +1.7 %, Llama-8B ragged
        # B=16 +6.1 %, B=64 4K +0.6 %, nki-library q8 d64 B64 1K +0.6 %).
        self.mask_dve = self.tail_cuts and not self.pack_tables and self.fa_tile <= MASK_DVE_MAX_SLOT
        # Not the LNC=2 batch split's one-pack cores (helper-98: modelled GPT-OSS B=8 4K LNC=2 30.00 -> 29.40 us, the
        # last slot's chain after its K^T ANDs shorter with the row max's separate max of the partial maxima).
        self.rmax_chain = (v3 and n_packs == 1 and nkv == 1 and not self.paged and _kt_swap_pays(self)
                           and not (self.wsplit and not self.split))
        # The same one-pack kernels issue each K^T scrub mask in K_MASK_PIECES column pieces (isolation._scrub_slot):
        # modelled ragged GPT-OSS B=8 61.74 -> 61.61 us; every other row of bench/test_decode_attention.py unchanged
        # (GPT-OSS B=8 16K's masks do not block its QKV eviction).
        self.k_mask_pieces = K_MASK_PIECES if self.rmax_chain else 1
        # NeuronCore-v4, d = 64 (two batches' V fill the PE array's 128 columns): PV with V stationary (flash._pv_t)
        # and the accumulator transposed, acc^T [(batch of the pair, dim), row]: per 128-position block one matmul
        # per batch pair, moving = the pair's P^T columns (2R <= 64: the 64-cycle floor), instead of P^T stationary
        # and the batches' V moving (128 columns per pair). Halves the PV's TensorE cycles on trn3, where TensorE
        # runs the steps without a gap (see DESIGN.md). alpha / (1 / l) act along the free axis: broadcast to every
        # partition by a ones x diag matmul. Row-major one-token steps of unsplit contiguous bf16 caches only.
        self.pv_t = (not v3 and 2 * self.d == P_MAX and S == 1 and not self.split and not self.stride
                     and not self.pmajor and not self.fp8 and not self.paged and not self.dyn)
        # With pv_t and one pack (trn3 GPT-OSS B <= 8), the steps after the last K/V byte are VectorE-paced: the
        # chained row max there too (one small VectorE instruction less per step; modelled B=8 4K 37.71 -> 37.61 us;
        # not several packs: B=16 4K 50.27 -> 50.69). Its K^T mask pieces stay trn2's (k_mask_pieces above).
        if self.pv_t and n_packs == 1:
            self.rmax_chain = True
        # With pv_t and one pack of one-piece slots (GPT-OSS B <= 8, 4K on trn3): the last LAST_HALF_V4 positions a
        # slot of their own (planning._slot_bounds). Not several packs (GPT-OSS B=16 4K 50.27 -> 51.20 us: another
        # pack's loads stream behind the last pack's steps), not two-piece slots (B=8 16K 75.18 -> 75.35), not
        # d = 128 (no pv_t; Llama-8B B=8 4K 51.12 -> 51.80).
        self.last_half = self.pv_t and n_packs == 1 and _one_piece_plan(self)
        # NeuronCore-v4, one stack per load group (halves == 1): a pack's queries and new keys copied into their stacks
        # per stack half (batch parity; flash._stack_queries), one GpSimd copy each instead of one per batch: on trn3
        # GpSimd runs the first slots' K^T ANDs then, and the 2 x B small copies (0.09 us each) preceded the first
        # scores (modelled trn3 GPT-OSS B=8 / B=16 4K 34.66 / 50.27 -> 34.31 / 48.45 us, every trn3 row equal or
        # faster). Not trn2: GPT-OSS LNC=2 B=8 4K +1.7 %, ragged Llama-8B B=16 +2.1 % (the list schedule shifts).
        self.q_par = not v3 and self.halves == 1
        self._frozen = True     # last: nothing changes the configuration from here on


def _one_piece_plan(cfg):
    """Whether this core's contiguous scan is two slots or more, every one at most FA_SUB positions wide (one load
    piece; the 4K rows: first and last slots split) and one FA_SUB wide (_Config.half_pieces). A one-slot scan (1K)
    keeps whole pieces: modelled nki-library q8 d64 B64 1K 96.95 -> 99.10 us with the halves."""
    from .planning import _slot_bounds  # planning imports this module
    if cfg.paged or cfg.dyn:
        return False
    b = _slot_bounds(cfg, cfg.lo, cfg.hi)
    widths = [e - a for a, e in zip(b, b[1:])]
    return len(widths) >= 2 and max(widths) == FA_SUB


def _kt_swap_pays(cfg):
    """Whether this core's scan has a slot loaded in more than one piece (planning._load_pieces, as _v_rotated):
    only such scans (2048-position slots: the 16K rows) leave a sequence's K on one half of the DMA rings for
    long enough to pay for the swap's extra query copies and scrub table; with one-piece slots (the 4K rows,
    LNC=2 stride) the K^T halves are balanced already and alternating them per slot only moved the imbalance
    (modelled GPT-OSS B=16 4K +1.6 %)."""
    from .planning import _load_pieces, _plan  # planning imports this module
    return any(len({a for a, _ in _load_pieces(cfg, sl.j0, sl.w)}) > 1 for sl in _plan(cfg)[0])


def _use_stride(cfg):
    """Batch split with split weights: balance the cores at run time (_split_stride) on ragged (not windowed) scans
    of at least STRIDE_MIN_SCAN positions; shorter scans keep whole sequences per core (_split_weights), where the
    per-pack work both cores then repeat (every pack's active step, merge, normalisation) outweighs the balance; and
    not where whole sequences per core would take the position-major steps (few query rows per core: the balanced
    split's packs hold twice the rows, too many for them; modelled nki-library q1 B2 S5 10K 37.7 vs 40.7 us)."""
    per_core_rows = min(cfg.pack, (cfg.B + 1) // 2) * cfg.R
    pmajor_whole = (not cfg.imajor and cfg.window == 0 and cfg.scan % P_MAX == 0 and per_core_rows <= PMAJOR_ROWS)
    return cfg.ragged and cfg.scan >= STRIDE_MIN_SCAN and not pmajor_whole


def _weight_plan(wq_row, n_kt, wo_row, n_k, sbuf):
    """How W_qkv and W_o sit in SBUF: (wq_chunk, wq_bufs, wo_chunk, wo_bufs); chunk = contraction tiles per streamed
    chunk (W_qkv: 128-row H tiles, wq_row bytes per partition each, n_kt of them in this core's share; W_o: 128-row
    K chunks of wo_row bytes, n_k of them), bufs = its ring buffers; (0, 0) = resident.
    A weight is resident when its share fits its room: W_qkv beside SBUF_RESERVE (its last matmul precedes the first
    K/V load, so it never lives beside the K/V ring), W_o beside SBUF_RESERVE and the smallest K/V ring (KV_SBUF_MIN:
    W_o loads under the attention). Otherwise it streams through min(W_STREAM_BUFS, chunks) buffers of about
    W_STREAM_CHUNK bytes (whole tiles, at most a W_STREAM_BUFS-th of the share each), within the same room.
    WEIGHT_ROOM (tests) replaces both rooms."""
    wq_room = sbuf - SBUF_RESERVE if WEIGHT_ROOM is None else WEIGHT_ROOM
    wo_room = sbuf - SBUF_RESERVE - KV_SBUF_MIN if WEIGHT_ROOM is None else WEIGHT_ROOM
    plan = ()
    for row, n, room, name in ((wq_row, n_kt, wq_room, "W_qkv"), (wo_row, n_k, wo_room, "W_o")):
        if n * row <= room:
            plan += (0, 0)
            continue
        chunk = max(1, min(W_STREAM_CHUNK // row, room // (W_STREAM_BUFS * row),
                           (n + W_STREAM_BUFS - 1) // W_STREAM_BUFS))
        bufs = min(W_STREAM_BUFS, (n + chunk - 1) // chunk)
        assert bufs * chunk * row <= room, \
            (f"{name}: {bufs} buffers of one {row}-byte contraction tile per partition exceed the {room} bytes "
             "left for it in SBUF (too many columns to stream)")
        plan += (chunk, bufs)
    return plan


def _weight_bytes(row, n, chunk, bufs):
    """SBUF bytes per partition of a weight of n contraction tiles of row bytes: whole, or its streaming ring."""
    return n * row if chunk == 0 else bufs * chunk * row


def _slot_bytes(pack, ft, kpp, d, itemsize, halves=1):
    """Bytes per partition of one K/V load slot: K^T stacks [128, ft] (halves per load group) and V
    [128, ft / 128, d] per batch."""
    return (halves * ((pack + kpp - 1) // kpp) * ft + pack * ft * d // P_MAX) * itemsize


def _ring_bytes(bufs, pack, ft, kpp, d, itemsize, halves=1):
    """Bytes per partition of the K/V ring: bufs slots, and with an fp8 cache (halves = 2) PAIR_BUFS tiles of the
    fp8 pairs as loaded (one 2-byte element per position of each load group; cast into a slot right after)."""
    pairs = PAIR_BUFS * ((pack + kpp - 1) // kpp) * ft * 2 if halves == 2 else 0
    return bufs * _slot_bytes(pack, ft, kpp, d, itemsize, halves) + pairs


def x_row_groups(cfg, nt):
    """(first partition, at most this many rows) of X's row groups for a token tile of nt tokens
    (_Config.x_row_parts; see X_ROW_PARTS), or () when the tile loads X otherwise."""
    if not cfg.x_row_parts or not X_ROW_PARTS_MIN <= nt <= XT_DIRECT_TOKENS:
        return ()
    assert sum(cap for _p0, cap in X_ROW_PARTS) >= nt, "X's row groups hold fewer rows than XT_DIRECT_TOKENS"
    return X_ROW_PARTS


class _CacheShape(nl.NKIObject):
    """Shape and dtype of K_cache in the row-major layout [B, nkv, S_max, d] (K_cache_transposed: the validation
    reads the transposed cache through it), never read as data."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def transposed_k_error(K_cache, V_cache, block_table=None):
    """K_cache_transposed=True: the message of a layout it does not take (None: K_cache is V_cache's [B, nkv, S_max,
    d] with the last two dims swapped, contiguous cache)."""
    if block_table is not None:
        return ("K_cache_transposed=True supports a contiguous cache only (K_cache [B, kv_heads, d, S_max]); a paged "
                "cache (block_table given) takes the row-major K_cache [num_blocks, kv_heads, block_size, d]")
    if K_cache.dtype.itemsize == 1:
        return (f"K_cache_transposed=True supports a bf16 cache only (K_cache dtype {K_cache.dtype}): an fp8 K^T load "
                "would interleave two rows byte by byte into the kernel's 2-byte pairs (1-byte DMA runs, modelled "
                "~100x slower); pass the row-major fp8 K_cache")
    ks, vs = tuple(K_cache.shape), tuple(V_cache.shape)
    if len(vs) != 4 or ks != vs[:2] + (vs[3], vs[2]):
        return (f"K_cache: shape {ks} with K_cache_transposed=True must be [B, kv_heads, d, S_max] = V_cache's "
                f"{vs} with the last two dims swapped")
    return None


def argument_error(X, W_qkv, K_cache, V_cache, cos, sin, block_table=None, K_cache_transposed=False):
    """The argument at fault when a wrong layout would otherwise be blamed on another one, as a message (None: no
    such error). Shared by the kernel's validation and the host-side checks of `decode_attention`."""
    if (cos is None) != (sin is None):
        given, missing = ("cos", "sin") if sin is None else ("sin", "cos")
        return f"{given} is given but {missing} is None: the RoPE tables come as a pair (both or neither)"
    if K_cache_transposed:
        err = transposed_k_error(K_cache, V_cache, block_table)
        if err is not None:
            return err
        K_cache = _CacheShape(V_cache.shape, K_cache.dtype)
    paged = block_table is not None
    layout = "[num_blocks, kv_heads, block_size, d]" if paged else "[B, kv_heads, S_max, d]"
    if len(K_cache.shape) != 4:
        return f"K_cache must be {layout}, got shape {tuple(K_cache.shape)}"
    if tuple(V_cache.shape) != tuple(K_cache.shape):
        return f"V_cache shape {tuple(V_cache.shape)} must equal K_cache shape {tuple(K_cache.shape)}"
    nkv, d = K_cache.shape[1], K_cache.shape[3]
    if len(W_qkv.shape) == 2 and (d < 1 or W_qkv.shape[1] % d or W_qkv.shape[1] // d < 3 * nkv):
        return (f"K_cache: shape {tuple(K_cache.shape)} read as {layout} gives kv_heads={nkv}, d={d}, which W_qkv's "
                f"{W_qkv.shape[1]} = (nq + 2*kv_heads) * d columns (nq >= kv_heads) cannot hold: is the cache in "
                f"another layout (e.g. [B, S_max, kv_heads, d])?")
    return None


def _validate_inputs(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv, sinks, bias_o,
                     context_len, softmax_scale, hidden_actual, sliding_window, block_table=None, add_bias_o=True,
                     k_scale=None, v_scale=None, n_prog=1, core=0, k_transposed=False):
    """Check every static limit before any work; messages name the argument and the limit. k_transposed: K_cache
    is [B, nkv, d, S_max] (K_cache_transposed)."""
    assert nl.tile_size.gemm_moving_fmax >= PSUM_F, \
        f"target: matmul moving free size {nl.tile_size.gemm_moving_fmax} < one PSUM bank ({PSUM_F}); unsupported"
    assert nl.tile_size.psum_num_banks >= ATTN_PSUM_BANKS, \
        (f"target: the attention needs {ATTN_PSUM_BANKS} PSUM banks, {nl.tile_size.psum_num_banks} are usable "
         "(NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true reserves one)")
    assert len(X.shape) == 3, f"X must be [B, S_tkg, H], got shape {X.shape}"
    B, S, H = X.shape
    assert len(W_qkv.shape) == 2 and W_qkv.shape[0] == H, f"W_qkv must be [H={H}, (nq+2*nkv)*d], got {W_qkv.shape}"
    err = argument_error(X, W_qkv, K_cache, V_cache, cos, sin, block_table,   # cache rank, V_cache shape, d | W_qkv
                         k_transposed)
    assert err is None, err
    if k_transposed:
        K_cache = _CacheShape(V_cache.shape, K_cache.dtype)     # the row-major shape from here on
    assert isinstance(add_bias_o, bool), f"add_bias_o={add_bias_o!r} must be a bool"
    paged = block_table is not None
    if paged:
        n_blocks, nkv, bs, d = K_cache.shape
        assert len(block_table.shape) == 2 and block_table.shape[0] == B, \
            f"block_table must be [B={B}, max_blocks_per_seq], got shape {block_table.shape}"
        assert block_table.dtype == nl.int32, f"block_table must be int32, got {block_table.dtype}"
        assert MIN_BLOCK <= bs <= MAX_BLOCK and (bs & (bs - 1)) == 0, \
            f"K_cache: block_size={bs} must be a power of two in {MIN_BLOCK}..{MAX_BLOCK}"
        assert n_blocks * nkv * bs <= MAX_CACHE_ROWS, \
            f"K_cache: num_blocks * kv_heads * block_size = {n_blocks * nkv * bs} rows exceeds {MAX_CACHE_ROWS}"
        mb = block_table.shape[1]
        Bc, s_max = B, mb * bs
    else:
        Bc, nkv, s_max, d = K_cache.shape
        bs, mb = 0, 0
    assert 1 <= B <= MAX_BATCH, f"X: batch {B} must be in 1..{MAX_BATCH}"
    assert 1 <= S <= MAX_S_TKG, f"X: S_tkg {S} must be in 1..{MAX_S_TKG}"
    assert H % P_MAX == 0, f"X: hidden size H={H} must be a multiple of {P_MAX} (pad it; see hidden_actual)"
    assert B * S <= MAX_TOKENS, f"X: B*S_tkg = {B * S} must be <= {MAX_TOKENS}"
    assert d <= MAX_HEAD_DIM and d % 2 == 0, f"K_cache: head dim d={d} must be even and <= {MAX_HEAD_DIM}"
    assert Bc == B, f"K_cache: batch {Bc} must equal X batch {B}"
    nq = W_qkv.shape[1] // d - 2 * nkv
    assert nq >= nkv and nq % nkv == 0, f"W_qkv: {nq} query heads is not a positive multiple of kv_heads={nkv}"
    assert nq // nkv <= MAX_GROUP, f"W_qkv: {nq // nkv} query heads per KV head exceeds {MAX_GROUP}"
    assert (nq // nkv) * S <= P_MAX, f"(q heads per KV head) * S_tkg = {(nq // nkv) * S} must be <= {P_MAX}"
    assert tuple(W_o.shape) == (nq * d, H), f"W_o must be [nq*d={nq * d}, H={H}], got {W_o.shape}"
    assert tuple(position_ids.shape) == (B, S), f"position_ids must be [B={B}, S_tkg={S}], got {position_ids.shape}"
    assert position_ids.dtype == nl.int32, f"position_ids must be int32, got {position_ids.dtype}"
    fp8 = K_cache.dtype in (nl.float8_e4m3, nl.float8_e4m3fn)
    caches = () if fp8 else (("K_cache", K_cache), ("V_cache", V_cache))
    for name, t in (("W_qkv", W_qkv), ("W_o", W_o)) + caches:
        assert t.dtype == X.dtype, f"{name} dtype {t.dtype} must match X dtype {X.dtype}"
    if fp8:
        assert V_cache.dtype == K_cache.dtype, f"V_cache dtype {V_cache.dtype} must match K_cache dtype {K_cache.dtype}"
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert t is not None, f"{name} is required with an fp8 cache ({K_cache.dtype})"
            assert tuple(t.shape) in ((1,), (nkv,)) and t.dtype == nl.float32, \
                f"{name} must be float32 [1] (per tensor) or [kv_heads={nkv}] (per head), got {t.dtype} {t.shape}"
    else:
        assert k_scale is None and v_scale is None, "k_scale / v_scale apply to an fp8 KV cache only"
    if cos is not None:
        assert tuple(cos.shape) == (B, S, d // 2) and tuple(sin.shape) == (B, S, d // 2), \
            f"cos/sin must be [B={B}, S_tkg={S}, d/2={d // 2}], got {cos.shape} / {sin.shape}"
    if gamma is not None:
        assert tuple(gamma.shape) == (1, H), f"gamma must be [1, H={H}], got {gamma.shape}"
    if bias_qkv is not None:
        assert tuple(bias_qkv.shape) == (1, W_qkv.shape[1]), f"bias_qkv must be [1, {W_qkv.shape[1]}]"
    if bias_o is not None:
        assert tuple(bias_o.shape) == (1, H), f"bias_o must be [1, H={H}], got {bias_o.shape}"
    if sinks is not None:
        assert tuple(sinks.shape) == (nq,), f"sinks must be [nq={nq}], got {sinks.shape}"
    L = s_max if context_len == 0 else context_len
    assert 1 <= L <= s_max, f"context_len={L} must be in 1..S_max={s_max} (cache too short)"
    assert L >= S, f"context_len={L} is shorter than S_tkg={S}"
    if paged:
        unit = max(P_MAX, bs)
        need = (L - S + unit - 1) // unit * unit
        assert need <= s_max, (f"block_table: {mb} blocks of {bs} = {s_max} positions; the scan of context_len={L} "
                               f"reads {need} positions ({need // bs} blocks; whole units of {unit}): cache too short "
                               "(pad the block table with any valid block id)")
    h_act = H if hidden_actual == 0 else hidden_actual
    assert 1 <= h_act <= H, f"hidden_actual={h_act} must be in 1..H={H}"
    assert sliding_window >= 0, f"sliding_window={sliding_window} must be >= 0"
    scale = softmax_scale if softmax_scale != 0.0 else 1.0 / (d ** 0.5)
    fp8_mm = fp8 and (K_cache.dtype == nl.float8_e4m3 or nisa.get_nc_version() >= nisa.nc_version.gen4)
    return _Config(B, S, H, d, nkv, nq, s_max, L, scale, h_act, sliding_window, X.dtype.itemsize, bs, mb, fp8,
                   n_prog, core, fp8_mm, K_cache.dtype, k_transposed,
                   rope_tables=cos is not None and cos.dtype == W_qkv.dtype)
