"""Fused decode attention block (token generation) for one tensor-parallel rank.

RMSNorm + QKV projection (+bias) + RoPE + flash-decoding attention over the KV cache (GQA, several KV heads per rank,
sinks, sliding window, in-kernel masks from positions) + partial O-projection + KV-cache update, everything kept in
SBUF between the hidden-state input and the O-projection output.
See DESIGN.md beside this file.
"""

import nki
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
V_RUN_BYTES = 4096     # target contiguous bytes per partition of a V load (DMA efficiency: >= 4 KiB runs)
KV_BUFS = 2            # K/V load slots (ring) for d <= 64 (3 for larger d, whose 4 KiB V runs need shorter slots)
PACK_MIN = 4           # smallest batch pack the K/V ring sizing may shrink to (for longer, more efficient DMAs)
KV_SBUF_MAX = 128 * 1024   # bytes per partition for the K/V ring (less when the resident weights are large)
KV_SBUF_MIN = 32 * 1024    # ... but never less than this (the weights then stream through a smaller ring)
SBUF_RESERVE = 24 * 1024   # bytes per partition kept for everything else (q, masks, P tiles, accumulators)
W_QKV_DMAS = 4         # W_qkv is loaded in this many DMAs (>= 2 KiB contiguous per partition each)
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


def decode_attention_kernel(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma=None, bias_qkv=None,
                            sinks=None, bias_o=None, context_len=0, softmax_scale=0.0, eps=1e-5, hidden_actual=0,
                            sliding_window=0, block_table=None, add_bias_o=True, k_scale=None, v_scale=None):
    """Fused decode attention block: out = O_proj(Attn(RoPE(QKV(RMSNorm(X)))), with in-place KV-cache update.

    Dimensions:
        B: batch (1..64), S: new tokens per sequence S_tkg (1..8), H: hidden size (multiple of 128, padded),
        d: head dim (even, <= 128), nkv: KV heads on this rank, nq: query heads on this rank (nq = g * nkv,
        g = 1..16 query heads per KV head, g * S <= 128), S_max: cache length, L: scanned context length.

    Args:
        X ([B, S, H] @ HBM): hidden states (bf16).
        W_qkv ([H, (nq + 2*nkv) * d] @ HBM): fused QKV weight; columns [q heads | k heads | v heads].
        K_cache, V_cache ([B, nkv, S_max, d] @ HBM): caches, updated in place at the new positions. Paged layout
            (block_table given): [num_blocks, nkv, block_size, d]; position j of sequence b lives in block
            block_table[b, j // block_size] at row j % block_size (block_size a power of two in 16..512).
        position_ids ([B, S] int32 @ HBM): position of each new token; consecutive within a sequence.
        cos, sin ([B, S, d/2] @ HBM): RoPE tables of the new positions, half-split layout (None: no RoPE).
        W_o ([nq * d, H] @ HBM): O-projection shard.
        gamma ([1, H] @ HBM): RMSNorm weight (None: no fused RMSNorm).
        bias_qkv ([1, (nq + 2*nkv) * d] @ HBM), bias_o ([1, H] @ HBM): optional biases.
        add_bias_o (bool): whether THIS rank adds bias_o. The output is a partial sum over the tensor-parallel
            ranks, so under TP pass True on exactly one rank of the group (e.g. rank 0) and False on the others
            (or bias_o=None and add the bias after the all-reduce); True for a single rank.
        k_scale, v_scale ([1] or [nkv] fp32 @ HBM): fp8 KV cache (K_cache / V_cache float8_e4m3 or float8_e4m3fn,
            contiguous layout): per-tensor or per-KV-head scales; a cached value means value * scale. Dequantised
            on load (the K/V loads cast to bf16; k_scale folds into q, v_scale into the final 1/l); the new
            tokens' K/V are quantised (value / scale, rounded to fp8) before use, as the cache stores them.
        sinks ([nq] @ HBM): optional per-head sink logits (scaled-logit units); join the softmax denominator only.
        context_len (int): static number of cache positions scanned (L); 0 = S_max. Every position must be < L.
        softmax_scale (float): 0.0 = 1/sqrt(d). eps (float): RMSNorm epsilon.
        hidden_actual (int): real hidden size for the RMSNorm mean (e.g. 2880 of 3072); 0 = H.
        sliding_window (int): 0 = full attention, else keys j with p - W < j <= p.
        block_table ([B, max_blocks] int32 @ HBM): paged KV cache (vLLM style); None = contiguous cache. S_max is
            then max_blocks * block_size; every entry the scan touches (the first ceil(context_len / u) * u / block_size
            blocks, u = max(128, block_size)) must be a valid block id (pad unused entries with any valid id).

    Returns:
        out ([B * S, H] @ HBM, shared_hbm): partial O-projection (sum over ranks = full output; + bias_o iff
            add_bias_o), input dtype.

    Notes:
        - LNC=2 splits the batch between the two cores (each core owns whole sequences). With B = 1 the cores
          split the cache scan instead (and the QKV contraction over H, and the O-projection's H columns); the
          partial softmax states and QKV sums are exchanged with nisa.sendrecv.
        - Sliding window: only the W - 1 keys before each sequence's first new position are read (dynamic start).
        - Paged cache: blocks are gathered with indirect DMAs (.ap(vector_offset=...)), see DESIGN.md.
        - Masks are generated in-kernel from position_ids; no mask tensor in HBM.
        - The new tokens' K/V are used from SBUF (the "active" step); cache positions >= the first new position are
          masked, so the cache reads never wait for the cache update, which is written last.
        - Scores, softmax statistics and all accumulations are fp32; P is rounded to bf16 for the PV matmul.

    Pseudocode:
        xn = rmsnorm(X) ; qkv = xn @ W_qkv + b ; q, k = rope(q), rope(k)
        for kv head g, batch pack (batches whose g*S query rows share 128 partitions):
            active step: s = q k_new^T (causal among the new tokens) ; m = rowmax s ; p = exp(scale (s - m))
                         l = sum p ; acc = p v_new
            for context tile t (keys j < pos[b, 0]): s = q K_t^T + mask ; m' = max(m, rowmax s)
                         p = exp(scale (s - m')) ; l = l e^{scale(m - m')} + sum p ; acc = acc e^{scale(m - m')} + p V_t
            o = acc / (l + exp(sink - scale m))
        out = o @ W_o + b_o ; K_cache[b, :, pos[b]] = k ; V_cache[b, :, pos[b]] = v
    """
    cfg = _validate_inputs(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv, sinks, bias_o,
                           context_len, softmax_scale, hidden_actual, sliding_window, block_table, add_bias_o,
                           k_scale, v_scale)
    if not add_bias_o:
        bias_o = None       # another rank of the TP group adds it
    out = nl.ndarray((cfg.B * cfg.S, cfg.H), dtype=X.dtype, buffer=nl.shared_hbm)

    n_prog = nl.num_programs()
    per_core = (cfg.B + n_prog - 1) // n_prog
    b_lo = nl.program_id(0) * per_core
    b_hi = min(cfg.B, b_lo + per_core)
    if n_prog > 1 and cfg.B < n_prog and cfg.scan >= 2 * cfg.unit:
        # Fewer sequences than cores: both cores run every sequence and split the cache scan; the partial softmax
        # states are exchanged with sendrecv and combined (same bits on both cores), then each core computes half
        # of the O-projection's H columns. Core 0 alone writes the cache.
        b_lo, b_hi = 0, cfg.B
        _split_context(cfg, nl.program_id(0))
    elif n_prog > 1 and _can_split_weights(cfg):
        # Batch split without reading a weight twice: each core loads half of W_qkv's rows and half of W_o's
        # columns; QKV partial sums (all tokens) and the attention outputs o^T (each core's sequences) are
        # exchanged with sendrecv. Core 0 alone writes the cache.
        _split_weights(cfg, nl.program_id(0))
    if b_lo < b_hi:
        # DMA instructions issue in program order: small inputs first, then W_qkv, every K/V load of the attention,
        # W_o (its arrival paces the O-projection), and the stores last, so no load waits behind a store.
        # With split weights every phase but the attention covers all tokens (one token tile).
        tiles = _token_tiles(cfg, 0, cfg.B) if cfg.wsplit else _token_tiles(cfg, b_lo, b_hi)
        ins = _load_small_inputs(cfg, X, gamma, bias_qkv, bias_o, cos, sin, tiles, k_scale, v_scale)
        rows = _paged_rows(cfg, position_ids, block_table, tiles)
        starts = _window_starts(cfg, position_ids, b_lo, b_hi)
        block_ids = _load_block_ids(cfg, block_table, b_lo, b_hi, starts)
        consts = _Constants(cfg, X.dtype)
        _transpose_bias_o(cfg, ins)
        xT = _rmsnorm(cfg, consts, ins, tiles, eps)
        qkv = _qkv_projection(cfg, consts, xT, W_qkv, ins.bias_qkv, tiles)
        qkv = _rope(cfg, qkv, ins, tiles)
        if cfg.fp8:
            _quantize_kv(cfg, qkv, ins, tiles, K_cache.dtype)
            consts.vs = ins.vs
        qkT = _transpose_qk(cfg, qkv, tiles)
        oT, wo = _attention_flash_decode(cfg, consts, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles,
                                         b_lo, b_hi, W_o, block_ids, starts)
        if cfg.wsplit and not cfg.split:
            _exchange_oT(cfg, oT[0], b_lo, b_hi, per_core)
        if cfg.core == 0:
            _update_cache(cfg, qkv, K_cache, V_cache, position_ids, tiles, rows)
        _output_projection(cfg, consts, oT, wo, ins.bias_o, out, tiles)
    return out


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


def _can_split_weights(cfg):
    """Batch split with B even (the cores' o^T column blocks have one shape, as sendrecv needs), o^T one PSUM bank
    of one token tile (the attention's direct o^T path, exchanged in one sendrecv) and a QKV contraction of two
    halves; other shapes keep whole weights per core."""
    n_k = (cfg.nq * cfg.d + P_MAX - 1) // P_MAX
    return (cfg.B >= 2 and cfg.B % 2 == 0 and cfg.B * cfg.S <= cfg.tile_tok and cfg.d in (32, 64, 128)
            and n_k * cfg.B * cfg.S <= PSUM_F and cfg.KT >= 2)


def _exchange_oT(cfg, oT, b_lo, b_hi, per_core):
    """Split weights: o^T [128, K chunk, tokens] holds this core's sequences' columns; send them and receive the
    other core's (token ranges are static: core 0 has sequences [0, per_core), core 1 the rest)."""
    S = cfg.S
    mine = (b_lo * S, b_hi * S)
    theirs = (per_core * S, cfg.B * S) if cfg.core == 0 else (0, per_core * S)
    nisa.sendrecv(src=oT[:, :, mine[0]:mine[1]], dst=oT[:, :, theirs[0]:theirs[1]], send_to_rank=1 - cfg.core,
                  recv_from_rank=1 - cfg.core, pipe_id=cfg.nkv + 1)


class _Config(nl.NKIObject):
    """Static shapes and options of one launch (compile-time values only)."""

    def __init__(self, B, S, H, d, nkv, nq, s_max, L, scale, h_actual, window, itemsize, bs=0, mb=0, fp8=False):
        self.B, self.S, self.H, self.d, self.nkv, self.nq = B, S, H, d, nkv, nq
        self.paged, self.bs, self.mb = bs > 0, bs, mb    # paged cache: block size, block-table columns
        # fp8 KV cache: K rows are cast on load into a staging slot and DMA-transposed from SBUF, which gives the
        # i-major K^T layout of the paged path (column i*128 + q <-> position q*n + i)
        self.fp8 = fp8
        self.imajor = self.paged or fp8
        self.s_max, self.L, self.scale, self.h_actual, self.window = s_max, L, scale, h_actual, window
        self.group = nq // nkv                 # query heads per KV head
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
        self.kpp = P_MAX // d if (2 * d <= P_MAX and P_MAX % d == 0) else 1
        self.pad = P_MAX - d if self.kpp > 1 else 0      # qkv tile column padding for the stacked transposes
        self.pack = max(1, min(B, P_MAX // self.R, PV_COLS // d))   # batches sharing one score tile
        # K/V ring: KV_BUFS slots of pack x FT positions (K^T stacks [128, FT] + V [128, FT/128, d] per batch).
        n_k = (nq * d + P_MAX - 1) // P_MAX
        resident = self.KT * self.C * itemsize + n_k * H * itemsize     # W_qkv and W_o, bytes per partition
        sbuf = nl.tile_size.sbuf_fmax_bytes    # usable SBUF bytes per partition of this target
        budget = min(KV_SBUF_MAX, max(KV_SBUF_MIN, sbuf - SBUF_RESERVE - resident))
        # FT target: V runs of >= 4 KiB per partition (DMA efficiency), i.e. FT * d * itemsize / 128 >= 4 KiB.
        self.kv_bufs = KV_BUFS if d <= 64 else KV_BUFS + 1
        ft_target = min(FA_TILE_MAX, max(2 * FA_SUB, V_RUN_BYTES * P_MAX // (d * itemsize) // FA_SUB * FA_SUB))
        while self.pack > PACK_MIN and self.kv_bufs * _slot_bytes(self.pack, ft_target, self.kpp, d, itemsize,
                                                                   fp8) > budget:
            self.pack -= 1
        ft = FA_TILE_MAX
        while ft > FA_SUB and self.kv_bufs * _slot_bytes(self.pack, ft, self.kpp, d, itemsize, fp8) > budget:
            ft -= FA_SUB
        if self.kv_bufs == KV_BUFS and ft >= 2 * FA_SUB:
            # Same SBUF as KV_BUFS slots of ft positions, as up to twice as many half-size slots: the first steps
            # start on half the data and the ring runs further ahead of the compute (no queue stalls).
            half = ft // 2 // FA_SUB * FA_SUB
            self.kv_bufs = min(2 * KV_BUFS, KV_BUFS * ft // half)
            ft = half
        self.nst = (self.pack + self.kpp - 1) // self.kpp          # K^T / query stacks per pack
        self.fa_tile = max(P_MAX, min(ft, (self.scan + P_MAX - 1) // P_MAX * P_MAX))
        # Context split between the two cores of an LNC=2 launch (B < 2; see _split_context): defaults = no split.
        self.split, self.core, self.lo, self.hi, self.hc = False, 0, 0, self.scan, (0, H // P_MAX)
        self.wsplit = False    # LNC=2: W_qkv rows / W_o columns split between the cores (_split_weights)
        if self.paged:     # paged slots are 128 * 2^m positions (block-aligned gathers)
            ft = P_MAX
            while 2 * ft <= self.fa_tile:
                ft *= 2
            self.fa_tile = ft


def _slot_bytes(pack, ft, kpp, d, itemsize, fp8=False):
    """Bytes per partition of one K/V load slot: K^T stacks [128, ft] and V [128, ft / 128, d] per batch (fp8
    cache: and the K rows' staging, the size of V)."""
    return ((pack + kpp - 1) // kpp * ft + (2 if fp8 else 1) * pack * ft * d // P_MAX) * itemsize


def argument_error(X, W_qkv, K_cache, V_cache, cos, sin, block_table=None):
    """The argument at fault when a wrong layout would otherwise be blamed on another one, as a message (None: no
    such error). Shared by the kernel's validation and the host-side checks of `decode_attention`."""
    if (cos is None) != (sin is None):
        given, missing = ("cos", "sin") if sin is None else ("sin", "cos")
        return f"{given} is given but {missing} is None: the RoPE tables come as a pair (both or neither)"
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
                     k_scale=None, v_scale=None):
    """Check every static limit before any work; messages name the argument and the limit."""
    assert nl.tile_size.gemm_moving_fmax >= PSUM_F, \
        f"target: matmul moving free size {nl.tile_size.gemm_moving_fmax} < one PSUM bank ({PSUM_F}); unsupported"
    assert nl.tile_size.psum_num_banks >= ATTN_PSUM_BANKS, \
        (f"target: the attention needs {ATTN_PSUM_BANKS} PSUM banks, {nl.tile_size.psum_num_banks} are usable "
         "(NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true reserves one)")
    assert len(X.shape) == 3, f"X must be [B, S_tkg, H], got shape {X.shape}"
    B, S, H = X.shape
    assert len(W_qkv.shape) == 2 and W_qkv.shape[0] == H, f"W_qkv must be [H={H}, (nq+2*nkv)*d], got {W_qkv.shape}"
    err = argument_error(X, W_qkv, K_cache, V_cache, cos, sin, block_table)   # cache rank, V_cache shape, d | W_qkv
    assert err is None, err
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
        assert not paged, "K_cache: an fp8 cache is supported in the contiguous layout only (no block_table)"
        assert s_max % P_MAX == 0, f"K_cache: an fp8 cache needs S_max={s_max} to be a multiple of {P_MAX}"
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
    return _Config(B, S, H, d, nkv, nq, s_max, L, scale, h_act, sliding_window, X.dtype.itemsize, bs, mb, fp8)


def _token_tiles(cfg, b_lo, b_hi):
    """Token tiles of this core: tuples (first token, token count, first batch, batch count); whole sequences."""
    tiles = []
    per_tile = cfg.tile_tok // cfg.S
    b = b_lo
    while b < b_hi:
        nb = min(per_tile, b_hi - b)
        tiles.append((b * cfg.S, nb * cfg.S, b, nb))
        b += nb
    return tuple(tiles)


class _Inputs(nl.NKIObject):
    """Small per-launch inputs in SBUF (loaded before the weights so they never queue behind them)."""

    def __init__(self):
        self.x, self.cos, self.sin = (), (), ()
        self.gamma, self.bias_qkv, self.bias_o, self.bias_o_rows = None, None, None, None
        self.ks, self.vs, self.ks_inv, self.vs_inv = None, None, None, None   # fp8 cache scales [128, nkv] fp32


def _load_small_inputs(cfg, X, gamma, bias_qkv, bias_o, cos, sin, tiles, k_scale=None, v_scale=None):
    ins = _Inputs()
    if cfg.fp8:     # scales of the KV heads on every partition (per tensor: one value repeated), and 1 / scale
        for name, t in (("ks", k_scale), ("vs", v_scale)):
            sc = nl.ndarray((P_MAX, cfg.nkv), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sc, src=t.ap([[0, P_MAX], [1 if t.shape[0] == cfg.nkv else 0, cfg.nkv]]))
            inv = nl.ndarray((P_MAX, cfg.nkv), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv, data=sc)
            setattr(ins, name, sc)
            setattr(ins, name + "_inv", inv)
    X2 = X.reshape((cfg.B * cfg.S, cfg.H))
    xs = []
    for t0, nt, _, _ in tiles:
        x = nl.ndarray((P_MAX, cfg.H), dtype=X.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x[:nt], src=X2[t0:t0 + nt, :])
        xs.append(x)
    ins.x = tuple(xs)
    if gamma is not None:
        # gamma[p * KT + kt] on partition p, column kt: the H layout of the transposed activations and of W_qkv.
        ins.gamma = nl.ndarray((P_MAX, cfg.KT), dtype=gamma.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ins.gamma, src=gamma.reshape((P_MAX, cfg.KT)))
    if bias_qkv is not None:
        ins.bias_qkv = nl.ndarray((1, cfg.C), dtype=bias_qkv.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ins.bias_qkv, src=bias_qkv)
    if bias_o is not None:
        # bias_o[c * 128 + p] on partition p, column c (a per-partition scalar of the transposed O-projection):
        # a contiguous [H/128, 128] load and one TensorE transpose.
        n_c = cfg.H // P_MAX
        b_rows = nl.ndarray((P_MAX, P_MAX), dtype=bias_o.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_rows[:n_c, :], src=bias_o.reshape((n_c, P_MAX)))
        ins.bias_o_rows = b_rows
    if cos is not None:
        h2 = cfg.d // 2
        cos2 = cos.reshape((cfg.B * cfg.S, h2))
        sin2 = sin.reshape((cfg.B * cfg.S, h2))
        cs, sn = [], []
        for t0, nt, _, _ in tiles:
            c = nl.ndarray((P_MAX, h2), dtype=cos.dtype, buffer=nl.sbuf)
            s = nl.ndarray((P_MAX, h2), dtype=sin.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=c[:nt], src=cos2[t0:t0 + nt, :])
            nisa.dma_copy(dst=s[:nt], src=sin2[t0:t0 + nt, :])
            cs.append(c)
            sn.append(s)
        ins.cos, ins.sin = tuple(cs), tuple(sn)
    return ins


def _quantize_kv(cfg, qkv, ins, tiles, cache_dtype):
    """fp8 cache: the new tokens' k and v columns become value / scale rounded to the cache dtype (held in bf16:
    exactly what the cache stores, so the active step, the cached keys and the cache update agree), and q is
    multiplied by its KV head's k_scale (scores = q k). v_scale is applied to the final 1 / l."""
    d, nq, nkv, G = cfg.d, cfg.nq, cfg.nkv, cfg.group
    for ti, (_t0, nt, _, _) in enumerate(tiles):
        t = qkv[ti]
        q = t[:nt, cfg.pad:cfg.pad + nq * d].reshape((nt, nkv, G * d))
        nisa.tensor_tensor(dst=q, data1=q, data2=ins.ks[:nt, :].expand_dim(2).broadcast(2, G * d), op=nl.multiply)
        for c0, inv in ((nq * d, ins.ks_inv), ((nq + nkv) * d, ins.vs_inv)):
            kv = t[:nt, cfg.pad + c0:cfg.pad + c0 + nkv * d].reshape((nt, nkv, d))
            q8 = nl.ndarray((P_MAX, nkv, d), dtype=cache_dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=q8[:nt], data1=kv, data2=inv[:nt, :].expand_dim(2).broadcast(2, d),
                               op=nl.multiply)
            nisa.tensor_copy(dst=kv, src=q8[:nt])


def _transpose_bias_o(cfg, ins):
    """ins.bias_o = [128, H/128] fp32 from the [H/128, 128] rows (H/128 <= 128 chunks per transpose)."""
    if ins.bias_o_rows is None:
        return
    n_c = cfg.H // P_MAX
    ins.bias_o = nl.ndarray((P_MAX, n_c), dtype=nl.float32, buffer=nl.sbuf)
    for c0 in range(0, n_c, P_MAX):
        nc = min(P_MAX, n_c - c0)
        ps = nl.ndarray((P_MAX, P_MAX), dtype=ins.bias_o_rows.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps[:, :nc], data=ins.bias_o_rows[c0:c0 + nc, :])
        nisa.tensor_copy(dst=ins.bias_o[:, c0:c0 + nc], src=ps[:, :nc])


class _Constants(nl.NKIObject):
    """SBUF constants: identity (selection matmuls), MASK_NEG * identity (mask folding), ones."""

    def __init__(self, cfg, dtype):
        self.vs = None     # fp8 cache: v_scale per KV head on every partition (set after the inputs are loaded)
        ones = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        self.ones = ones
        self.ident = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.affine_select(dst=self.ident, pattern=[[-1, P_MAX]], channel_multiplier=1, on_true_tile=ones,
                           on_false_value=0.0, cmp_op=nl.equal)
        fill = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=fill, value=MASK_NEG)
        self.neg_eye = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.affine_select(dst=self.neg_eye, pattern=[[-1, P_MAX]], channel_multiplier=1, on_true_tile=fill,
                           on_false_value=0.0, cmp_op=nl.equal)
        self.ones_f32 = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.ones_f32, value=1.0)
        # Masked stationaries of the attention (double-buffered over packs): stack jj of qm holds the queries of
        # the pack's batch j = jj*kpp + u on partitions u*d..(u+1)*d, columns j*R..(j+1)*R, zeros elsewhere;
        # accumulating qm_jj^T K_jj over the stacks yields a packed score tile where row block j only saw batch
        # j's keys. Zeroed once (early, while VectorE is idle); every pack rewrites the same blocks.
        self.qm = tuple(nl.ndarray((P_MAX, cfg.nst, cfg.pack * cfg.R), dtype=dtype, buffer=nl.sbuf)
                        for _ in range(2))
        for q in self.qm:
            nisa.memset(dst=q[:cfg.kpp * cfg.d], value=0.0)


def _ones_row(consts, dtype, n):
    """[1, n] ones of `dtype` (stationary of a K=1 bias matmul)."""
    if dtype == nl.bfloat16:
        return consts.ones[:1, :n]
    t = nl.ndarray((1, P_MAX), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    return t[:1, :n]


def _evict(i, dst, src):
    """PSUM -> SBUF copy, alternating VectorE and ScalarE so that evictions of independent banks overlap."""
    if i % 2 == 0:
        nisa.tensor_copy(dst=dst, src=src)
    else:
        nisa.activation(dst=dst, op=nl.copy, data=src)


def _rmsnorm(cfg, consts, ins, tiles, eps):
    """xT[tile] = [128 (H), KT, tokens] bf16 with H index p * KT + kt: rmsnorm(x) transposed.

    x^T comes from TensorE transposes of strided column sets of x; the sum of squares is a ones-matmul over the
    partitions (broadcast to all 128), so every elementwise step runs on KT * tokens elements instead of H.
    """
    KT = cfg.KT
    xTs = []
    for ti, (_t0, nt, _, _) in enumerate(tiles):
        x = ins.x[ti]
        xT = nl.ndarray((P_MAX, KT, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
        for c0 in range(0, KT, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, KT - c0)
            ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=x.dtype, buffer=nl.psum)
            for c in range(nc):
                kt = c0 + c
                nisa.nc_transpose(dst=ps[:, c, :nt], data=x[:nt, kt:kt + (P_MAX - 1) * KT + 1:KT])
            nisa.tensor_copy(dst=xT[:, c0:c0 + nc, :nt], src=ps[:, :nc, :nt])
        if ins.gamma is None:
            xTs.append(xT)
            continue
        sq = nl.ndarray((P_MAX, KT, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[:, :, :nt], op=nl.square, data=xT[:, :, :nt])
        ss = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
        first = True
        for kt in range(KT):
            n_p = min(P_MAX, max(0, (cfg.h_actual - kt + KT - 1) // KT))   # partitions p with p*KT + kt < H_actual
            if n_p > 0:
                nisa.nc_matmul(dst=ss[:, :nt], stationary=consts.ones_f32[:n_p, :], moving=sq[:n_p, kt, :nt],
                               accumulate=not first)
                first = False
        ms = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ms[:, :nt], data=ss[:, :nt], op0=nl.multiply, operand0=1.0 / cfg.h_actual,
                           op1=nl.add, operand1=eps)
        rstd = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd[:, :nt], op=nl.rsqrt, data=ms[:, :nt])
        xr = nl.ndarray((P_MAX, KT, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xr[:, :, :nt], data1=xT[:, :, :nt], data2=rstd[:, :nt].expand_dim(1).broadcast(1, KT),
                           op=nl.multiply)
        xn = nl.ndarray((P_MAX, KT, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xn[:, :, :nt], data1=xr[:, :, :nt], data2=ins.gamma.expand_dim(2).broadcast(2, nt),
                           op=nl.multiply)
        xTs.append(xn)
    return tuple(xTs)


def _qkv_projection(cfg, consts, xT, W_qkv, bias, tiles):
    """qkv[tile] = [tokens, C] bf16 = xn @ W_qkv (+ bias), fp32 accumulation in PSUM over H/128 tiles.

    W_qkv is resident in SBUF as [128, KT, C] (row p * KT + kt on partition p: KT * C contiguous elements per
    partition), loaded in W_QKV_DMAS large DMAs so the first accumulation group starts on the first part. The bias
    is one more K=1 matmul (ones x bias) into the same accumulator.
    Context split (LNC=2, B < 2): each core contracts half of the KT tiles (and loads only those rows of W_qkv);
    the fp32 partial sums are exchanged with sendrecv and added (same bits on both cores; bias on core 0's part).
    """
    KT, C = cfg.KT, cfg.C
    qsplit = cfg.wsplit and KT >= 2
    kt0, kt1 = (0, KT) if not qsplit else ((0, KT // 2) if cfg.core == 0 else (KT // 2, KT))
    if qsplit and cfg.core == 1:
        bias = None
    wq = nl.ndarray((P_MAX, KT, C), dtype=W_qkv.dtype, buffer=nl.sbuf)
    w3 = W_qkv.reshape((P_MAX, KT, C))
    n_dma = min(W_QKV_DMAS, kt1 - kt0)
    for i in range(n_dma):
        k0, k1 = kt0 + i * (kt1 - kt0) // n_dma, kt0 + (i + 1) * (kt1 - kt0) // n_dma
        nisa.dma_copy(dst=wq[:, k0:k1, :], src=w3[:, k0:k1, :])
    qkv = tuple(_qkv_tile(cfg, W_qkv.dtype, tiles[ti][1]) for ti in range(len(tiles)))
    part = ()
    if qsplit:
        part = tuple(nl.ndarray((P_MAX, C), dtype=nl.float32, buffer=nl.sbuf) for _ in tiles)
    n_chunks = (C + PSUM_F - 1) // PSUM_F
    pairs = [(ti, ch) for ch in range(n_chunks) for ti in range(len(tiles))]
    n_ev = 0
    for g0 in range(0, len(pairs), QKV_BANKS):
        group = pairs[g0:g0 + QKV_BANKS]
        accs = [nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in group]
        if bias is not None:
            for i, (ti, ch) in enumerate(group):
                nt, c0, cw = tiles[ti][1], ch * PSUM_F, min(PSUM_F, C - ch * PSUM_F)
                nisa.nc_matmul(dst=accs[i][:nt, :cw], stationary=_ones_row(consts, bias.dtype, nt),
                               moving=bias[:1, c0:c0 + cw], accumulate=False)
        for kt in range(kt0, kt1):
            for i, (ti, ch) in enumerate(group):
                nt, c0, cw = tiles[ti][1], ch * PSUM_F, min(PSUM_F, C - ch * PSUM_F)
                nisa.nc_matmul(dst=accs[i][:nt, :cw], stationary=xT[ti][:, kt, :nt], moving=wq[:, kt, c0:c0 + cw],
                               accumulate=(kt > kt0 or bias is not None))
        for i, (ti, ch) in enumerate(group):
            nt, c0, cw = tiles[ti][1], ch * PSUM_F, min(PSUM_F, C - ch * PSUM_F)
            if qsplit:
                _evict(n_ev, part[ti][:nt, c0:c0 + cw], accs[i][:nt, :cw])
            else:
                _evict(n_ev, qkv[ti][:nt, cfg.pad + c0:cfg.pad + c0 + cw], accs[i][:nt, :cw])
            n_ev += 1
        accs = None    # release the banks before the next group allocates
    for ti in range(len(part)):
        nt = tiles[ti][1]
        other = nl.ndarray((P_MAX, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=part[ti][:nt, :], dst=other[:nt, :], send_to_rank=1 - cfg.core, recv_from_rank=1 - cfg.core,
                      pipe_id=cfg.nkv + ti)
        nisa.tensor_tensor(dst=qkv[ti][:nt, cfg.pad:cfg.pad + C], data1=part[ti][:nt, :], data2=other[:nt, :],
                           op=nl.add)
    return qkv


def _qkv_tile(cfg, dtype, nt):
    """[128, pad | C | pad] token-layout q/k/v tile; the zeroed pads let every head be transposed from a 128-column
    window that puts it on partitions u*d (the stacked layout, see _transpose_qk)."""
    t = nl.ndarray((P_MAX, cfg.C + 2 * cfg.pad), dtype=dtype, buffer=nl.sbuf)
    if cfg.pad > 0:
        nisa.memset(dst=t[:nt, :cfg.pad], value=0.0, engine=nisa.engine.gpsimd)
        nisa.memset(dst=t[:nt, cfg.pad + cfg.C:], value=0.0, engine=nisa.engine.gpsimd)
    return t


def _rope(cfg, qkv, ins, tiles):
    """Half-split RoPE on the q and k heads of each token tile (fp32 math, bf16 result); v columns copied."""
    if len(ins.cos) == 0:
        return qkv
    d, h2 = cfg.d, cfg.d // 2
    nh = cfg.nq + cfg.nkv
    out = []
    for ti, (_t0, nt, _, _) in enumerate(tiles):
        src = qkv[ti]
        cb = ins.cos[ti][:nt].expand_dim(1).broadcast(1, nh)
        sb = ins.sin[ti][:nt].expand_dim(1).broadcast(1, nh)
        pad = cfg.pad
        heads = src[:nt, pad:pad + nh * d].reshape((nt, nh, d))
        x1, x2 = heads[:, :, :h2], heads[:, :, h2:]
        dst = _qkv_tile(cfg, src.dtype, nt)
        rot = dst[:nt, pad:pad + nh * d].reshape((nt, nh, d))
        ta = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        tb = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        tc = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        td = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        # The four products are independent: two on VectorE, two on GpSimd.
        nisa.tensor_tensor(dst=ta[:nt], data1=x1, data2=cb, op=nl.multiply)
        nisa.tensor_tensor(dst=tb[:nt], data1=x2, data2=sb, op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=tc[:nt], data1=x2, data2=cb, op=nl.multiply)
        nisa.tensor_tensor(dst=td[:nt], data1=x1, data2=sb, op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=rot[:, :, :h2], data1=ta[:nt], data2=tb[:nt], op=nl.subtract)
        nisa.tensor_tensor(dst=rot[:, :, h2:], data1=tc[:nt], data2=td[:nt], op=nl.add)
        nisa.tensor_copy(dst=dst[:nt, pad + nh * d:pad + cfg.C], src=src[:nt, pad + nh * d:pad + cfg.C],
                         engine=nisa.engine.gpsimd)
        out.append(dst)
    return tuple(out)


def _transpose_qk(cfg, qkv, tiles):
    """qkT[:, u, token, head] = head^T on partitions u*d..(u+1)*d (u < kpp; d on partitions for QK^T), for the q
    heads 0..nq-1 and k heads nq..nq+nkv-1: TensorE transposes of 128-column windows (d columns when kpp = 1)."""
    d, kpp = cfg.d, cfg.kpp
    n_tok = tiles[-1][0] + tiles[-1][1] - tiles[0][0]
    nh = cfg.nq + cfg.nkv
    width = d if kpp == 1 else P_MAX
    qkT = nl.ndarray((P_MAX, kpp, n_tok, nh), dtype=qkv[0].dtype, buffer=nl.sbuf)
    base = tiles[0][0]
    for ti, (t0, nt, _, _) in enumerate(tiles):
        for u in range(kpp):
            for h0 in range(0, nh, TRANSPOSE_GROUP):
                n = min(TRANSPOSE_GROUP, nh - h0)
                ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=qkv[ti].dtype, buffer=nl.psum)
                for h in range(n):
                    c0 = cfg.pad + (h0 + h - u) * d
                    nisa.nc_transpose(dst=ps[:width, h, :nt], data=qkv[ti][:nt, c0:c0 + width])
                nisa.tensor_copy(dst=qkT[u * d:(u + 1) * d, u, t0 - base:t0 - base + nt, h0:h0 + n].permute((0, 2, 1)),
                                 src=ps[u * d:(u + 1) * d, :n, :nt])
    return qkT


# ---- attention --------------------------------------------------------------------------------------------------

class _AttnState(nl.NKIObject):
    """Buffers shared by every pack and step of the attention, multi-buffered explicitly (the cost model and the
    hardware both serialise on reuse): 2 score tiles of FA_SUB fp32 (4 PSUM banks), the PV output (2 banks), one
    transpose bank, one selection bank; KV_BUFS K/V load slots; 2 masked-query stationaries."""

    def __init__(self, cfg, dtype, qm):
        d, pack = cfg.d, cfg.pack
        self.ps_sc = tuple(nl.ndarray((P_MAX, FA_SUB), dtype=nl.float32, buffer=nl.psum) for _ in range(2))
        self.ps_o = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.psum)
        self.ps_t = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=dtype, buffer=nl.psum)
        self.ps_sel = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
        self.kT = tuple(nl.ndarray((P_MAX, cfg.nst, cfg.fa_tile), dtype=dtype, buffer=nl.sbuf)
                        for _ in range(cfg.kv_bufs))
        self.v = tuple(nl.ndarray((P_MAX, pack, cfg.fa_tile // P_MAX + 1, d), dtype=dtype, buffer=nl.sbuf)
                       for _ in range(cfg.kv_bufs))
        # fp8 cache: K rows cast to bf16 (V's layout), DMA-transposed from SBUF into K^T
        self.stage = tuple(nl.ndarray((P_MAX, pack, cfg.fa_tile // P_MAX, d), dtype=dtype, buffer=nl.sbuf)
                           for _ in range(cfg.kv_bufs)) if cfg.fp8 else ()
        self.qm = qm
        self.n_scores, self.n_slots, self.n_packs = 0, 0, 0
        self.block_ids, self.starts = None, None
        self.iotas = {}
        self.valid, self.cur_valid = {}, None     # per pack: _ValidRange of its sequences
        self.ramps, self.k_ramp = {}, (None, None)  # scrub position tables (see _scrub_slot)
        self.pos0, self.slot0 = None, None          # fp32 [1, steps / slots]: their starts (_step_gates)

    def scores(self):
        buf = self.ps_sc[self.n_scores % 2]
        self.n_scores += 1
        return buf

    def iota(self, key, pattern, cols):
        """Constant fp32 [128, cols] key offsets (same on every partition), built once per layout."""
        if key not in self.iotas:
            t = nl.ndarray((P_MAX, FA_SUB), dtype=nl.float32, buffer=nl.sbuf)
            nisa.iota(dst=t[:, :cols], pattern=pattern, offset=0, channel_multiplier=0)
            self.iotas[key] = t
        return self.iotas[key]


class _Softmax(nl.NKIObject):
    """Running statistics of one pack: max m, sum l (fp32 [rows, 1]) and the PV accumulator (fp32 [rows, nb*d])."""

    def __init__(self):
        self.m, self.l, self.acc, self.pending = None, None, None, None


def _attention_flash_decode(cfg, consts, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, b_lo, b_hi, W_o,
                            block_ids=None, starts=None):
    """Flash-decoding for every (KV head, batch pack); returns (oT[tile] = [128 (head, dim), K chunk, tokens] bf16,
    the O-projection's stationaries, and the resident W_o).

    Packs are balanced (ceil(batches / packs) each). W_o's load is issued after every K/V load (the K/V ring has
    enough slots that it does not stall the DMA queue on compute, so W_o only has to arrive before the O-projection).
    """
    st = _AttnState(cfg, qkT.dtype, consts.qm)
    st.block_ids, st.starts = block_ids, starts
    # bmask[r, j] = 1.0 iff row r belongs to the pack's batch j (j*R <= r < (j+1)*R).
    lo = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    ones = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    nisa.affine_select(dst=lo, pattern=[[-cfg.R, cfg.pack]], channel_multiplier=1, on_true_tile=ones,
                       on_false_value=0.0, cmp_op=nl.greater_equal)
    bmask = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=bmask, pattern=[[-cfg.R, cfg.pack]], channel_multiplier=1, on_true_tile=lo,
                       on_false_value=0.0, cmp_op=nl.less, offset=-cfg.R)
    n_k = (cfg.nq * cfg.d + P_MAX - 1) // P_MAX
    # Direct o^T (one token tile, heads on legal partition starts, all of o^T in one PSUM bank): the selection
    # matmuls write o^T straight into the selection bank (every element exactly once), one eviction at the end.
    direct = len(tiles) == 1 and cfg.d in (32, 64, 128) and n_k * tiles[0][1] <= PSUM_F
    o_acc = ()
    if not direct:
        o_acc = tuple(nl.ndarray((P_MAX, cfg.nq * cfg.d), dtype=nl.float32, buffer=nl.sbuf) for _ in tiles)
    packs = _packs(cfg, b_lo, b_hi)
    n_packs = len(packs)
    for g in range(cfg.nkv):
        for pi, (p0, nb) in enumerate(packs):
            # last pack: the selection matmuls also pick each row's own batch block (TensorE is idle by then)
            last = direct and g == cfg.nkv - 1 and pi == n_packs - 1
            o_rows = _attend_pack(cfg, consts, st, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, g, p0,
                                  nb, bmask, full=last)
            if direct:
                _rows_to_oT(cfg, consts, st, o_rows, tiles[0], g, p0, nb, full=last)
            else:
                _rows_to_tokens(cfg, consts, st, o_rows, o_acc, tiles, g, p0, nb)
    wo = _load_w_o(cfg, W_o)
    if direct:
        nt, K = tiles[0][1], cfg.nq * cfg.d
        oT = nl.ndarray((P_MAX, n_k, P_MAX), dtype=qkT.dtype, buffer=nl.sbuf)
        ps = st.ps_sel[:, :n_k * nt].reshape((P_MAX, n_k, nt))
        if K % P_MAX == 0:
            nisa.tensor_copy(dst=oT[:, :, :nt], src=ps)
        else:
            if n_k > 1:
                nisa.tensor_copy(dst=oT[:, :n_k - 1, :nt], src=ps[:, :n_k - 1, :])
            kl = K - (n_k - 1) * P_MAX
            nisa.tensor_copy(dst=oT[:kl, n_k - 1, :nt], src=ps[:kl, n_k - 1, :])
        return (oT,), wo
    o_tok = []
    for ti, (_t0, nt, _, _) in enumerate(tiles):
        o = nl.ndarray((P_MAX, cfg.nq * cfg.d), dtype=qkT.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o[:nt], src=o_acc[ti][:nt])
        o_tok.append(o)
    st = None      # release the attention's PSUM banks before the transposes allocate theirs
    return _transpose_o(cfg, tuple(o_tok), tiles), wo


def _packs(cfg, b_lo, b_hi):
    """Balanced batch packs of this core: (first batch, batch count), ceil(batches / packs) each."""
    n_packs = (b_hi - b_lo + cfg.pack - 1) // cfg.pack
    per = (b_hi - b_lo + n_packs - 1) // n_packs
    return tuple((b_lo + pi * per, min(per, b_hi - b_lo - pi * per)) for pi in range(n_packs))


def _attend_pack(cfg, consts, st, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, g, p0, nb, bmask,
                 full=False):
    """One batch pack of KV head g: rows (batch j, token s, head h). Returns o_rows [rows, d] bf16 (normalised),
    or with full=True the normalised accumulator [rows, nb*d] bf16 (every batch block; see _rows_to_oT)."""
    d, S, R, G = cfg.d, cfg.S, cfg.R, cfg.group
    rows = nb * R
    base = tiles[0][0]
    qm = st.qm[st.n_packs % 2]
    st.n_packs += 1
    kact = nl.ndarray((P_MAX, cfg.nst, MAX_S_TKG), dtype=qkT.dtype, buffer=nl.sbuf)   # new keys, stacked
    for j in range(nb):
        t = (p0 + j) * S - base
        jj, u0 = j // cfg.kpp, (j % cfg.kpp) * d
        u = j % cfg.kpp
        nisa.tensor_copy(dst=qm[u0:u0 + d, jj, j * R:(j + 1) * R].reshape((d, S, G)),
                         src=qkT[u0:u0 + d, u, t:t + S, g * G:(g + 1) * G], engine=nisa.engine.gpsimd)
        nisa.tensor_copy(dst=kact[u0:u0 + d, jj, :S], src=qkT[u0:u0 + d, u, t:t + S, cfg.nq + g],
                         engine=nisa.engine.gpsimd)
    # First new position of each row's sequence, and each row's own position (fp32, [rows, 1]).
    p_first = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=p_first[:rows], src=position_ids.ap([[S, nb], [0, S], [0, G]], offset=p0 * S))
    q_pos = p_first
    if S > 1 or cfg.window > 0:
        q_pos = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_pos[:rows], src=position_ids.ap([[S, nb], [1, S], [0, G]], offset=p0 * S))
    sm = _Softmax()
    if cfg.core == 0 or not cfg.split:
        _active_step(cfg, consts, st, sm, qm, kact, qkv, tiles, g, p0, nb, p_first, q_pos)
    else:            # second core of a context split: empty state (m = MASK_NEG, l = 0, no accumulator yet)
        sm.m = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sm.m[:rows], value=MASK_NEG)
        sm.l = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sm.l[:rows], value=0.0)
    if cfg.dyn:      # windowed scan: key offsets are relative to each sequence's start
        start = _start_rows(cfg, p_first, rows)
        pf_rel = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=pf_rel[:rows], data1=p_first[:rows], data2=start[:rows], op=nl.subtract)
        qp_rel = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=qp_rel[:rows], data1=q_pos[:rows], data2=start[:rows], op=nl.subtract)
        p_first, q_pos = pf_rel, qp_rel
    if p0 not in st.valid:      # per pack, shared by the KV heads
        st.valid[p0] = _valid_ranges(cfg, position_ids, p0, nb)
    st.cur_valid = st.valid[p0]
    _prior_steps(cfg, consts, st, sm, qm, K_cache, V_cache, g, p0, nb, p_first, q_pos)
    if cfg.split:
        _flush_acc(cfg, st, sm, rows, nb)
        _combine_cores(cfg, sm, rows, nb, g)
    # Final normalisation; sinks join the denominator only.
    l_fin = sm.l
    if sinks is not None:
        sk = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sk[:rows], src=sinks.ap([[0, nb], [0, S], [1, G]], offset=g * G))
        nb_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=nb_f[:rows], data=sm.m[:rows], op0=nl.multiply, operand0=-cfg.scale)
        e_sk = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e_sk[:rows], op=nl.exp, data=sk[:rows], bias=nb_f[:rows], scale=1.0)
        l_fin = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=l_fin[:rows], data1=sm.l[:rows], data2=e_sk[:rows], op=nl.add)
    rinv = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rinv[:rows], data=l_fin[:rows])
    if cfg.fp8:      # PV summed V in cache units: o = acc * v_scale / l
        nisa.tensor_scalar(dst=rinv[:rows], data=rinv[:rows], op0=nl.multiply, operand0=consts.vs[:rows, g:g + 1])
    if full:
        return _normalise_full(cfg, st, sm, rows, nb, rinv, qkT.dtype)
    # The last step's PV is flushed only now: the denominator chain above needs only m and l, so VectorE runs it
    # while TensorE finishes the last PV.
    _flush_acc(cfg, st, sm, rows, nb)
    # o = acc / l on the diagonal blocks only (others zeroed by bmask), then summed over the batch blocks:
    # o_rows[r, :] = the row's own batch block, rounded to bf16 (the reference's rounding point).
    o_m = nl.ndarray((P_MAX, cfg.pack, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=o_m[:rows, :nb, :], data=sm.acc[:rows, :nb * d].reshape((rows, nb, d)),
                              op0=nl.multiply, operand0=rinv[:rows], op1=nl.multiply,
                              operand1=bmask[:rows, :nb].expand_dim(2).broadcast(2, d))
    o_rows = nl.ndarray((P_MAX, d), dtype=qkT.dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=o_rows[:rows], op=nl.add, data=o_m[:rows, :nb, :].permute((0, 2, 1)), axis=(2,))
    return o_rows


def _normalise_full(cfg, st, sm, rows, nb, rinv, dtype):
    """o = (acc * alpha + PV) / l for every batch block (bf16), folding the pending flush into the normalisation:
    acc * alpha / l is formed while TensorE finishes the last PV, then one pass PV / l + that."""
    n = nb * cfg.d
    o_n = nl.ndarray((P_MAX, PV_COLS), dtype=dtype, buffer=nl.sbuf)
    if sm.pending is None:  # already flushed (context split)
        nisa.tensor_scalar(dst=o_n[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply, operand0=rinv[:rows])
        return o_n
    if sm.acc is None:  # only the active step
        nisa.activation(dst=o_n[:rows, :n], op=nl.copy, data=st.ps_o[:rows, :n], scale=rinv[:rows])
        return o_n
    a2 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a2[:rows], data1=sm.pending[:rows], data2=rinv[:rows], op=nl.multiply)
    acc_s = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)      # while TensorE finishes the PV
    nisa.tensor_scalar(dst=acc_s[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply, operand0=a2[:rows])
    nisa.scalar_tensor_tensor(dst=o_n[:rows, :n], data=st.ps_o[:rows, :n], op0=nl.multiply, operand0=rinv[:rows],
                              op1=nl.add, operand1=acc_s[:rows, :n])
    sm.pending = None
    return o_n


def _combine_cores(cfg, sm, rows, nb, g):
    """Context split (LNC=2): exchange (m, l, acc) with the other core and merge the two partial softmax states:
    m = max(m0, m1), l = sum_c l_c e^{scale (m_c - m)}, acc likewise. Each core adds its own term and the other's
    (fp32 addition commutes), so both cores hold the same bits. A core whose half saw only masked keys has
    m_c <= MASK_NEG: its weight e^{scale (m_c - m)} is exactly 0."""
    n = nb * cfg.d
    mine = nl.ndarray((P_MAX, 2 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=mine[:rows, 0:1], src=sm.m[:rows])
    nisa.tensor_copy(dst=mine[:rows, 1:2], src=sm.l[:rows])
    nisa.tensor_copy(dst=mine[:rows, 2:2 + n], src=sm.acc[:rows, :n])
    other = nl.ndarray((P_MAX, 2 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    peer = 1 - cfg.core
    nisa.sendrecv(src=mine[:rows, :2 + n], dst=other[:rows, :2 + n], send_to_rank=peer, recv_from_rank=peer,
                  pipe_id=g)
    m = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m[:rows], data1=mine[:rows, 0:1], data2=other[:rows, 0:1], op=nl.maximum)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m[:rows], op0=nl.multiply, operand0=-cfg.scale)
    a_mine = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a_mine[:rows], op=nl.exp, data=mine[:rows, 0:1], bias=nbias[:rows], scale=cfg.scale)
    a_other = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a_other[:rows], op=nl.exp, data=other[:rows, 0:1], bias=nbias[:rows], scale=cfg.scale)
    # [l | acc] of each core scaled by its weight, then summed: (mine * a_mine) + (other * a_other)
    t_other = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t_other[:rows, :1 + n], data=other[:rows, 1:2 + n], op0=nl.multiply,
                       operand0=a_other[:rows])
    t_mine = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t_mine[:rows, :1 + n], data=mine[:rows, 1:2 + n], op0=nl.multiply, operand0=a_mine[:rows])
    la = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=la[:rows, :1 + n], data1=t_mine[:rows, :1 + n], data2=t_other[:rows, :1 + n], op=nl.add)
    sm.m, sm.l, sm.acc = m, la[:, 0:1], la[:, 1:1 + PV_COLS]


def _active_step(cfg, consts, st, sm, qm, kact, qkv, tiles, g, p0, nb, p_first, q_pos):
    """Scores of the S new tokens of each sequence, K^T/V straight from SBUF; causal among the new tokens.

    Initialises the running statistics: every row sees at least its own key, so m is finite from here on.
    """
    d, S, R = cfg.d, cfg.S, cfg.R
    rows = nb * R
    base = tiles[0][0]
    sc = st.scores()
    for jj in range((nb + cfg.kpp - 1) // cfg.kpp):
        kp = min(cfg.kpp, nb - jj * cfg.kpp) * d
        nisa.nc_matmul(dst=sc[:rows, :S], stationary=qm[:kp, jj, :rows], moving=kact[:kp, jj, :S],
                       accumulate=(jj > 0))
    if S > 1:
        # key s' is invalid for the row of token s if s' > s, or (sliding window) s' <= s - W
        s_row = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=s_row[:rows], data1=q_pos[:rows], data2=p_first[:rows], op=nl.subtract)
        key = st.iota(f"a{S}", [[1, S]], S)
        _fold_mask(cfg, consts, sc, rows, ((0, S, 0),), key, s_row, nl.greater, 0.0)
        if 0 < cfg.window < S:
            _fold_mask(cfg, consts, sc, rows, ((0, S, 0),), key, s_row, nl.less_equal, -float(cfg.window))
    m0 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m0[:rows], op=nl.maximum, data=sc[:rows, :S], axis=(1,))
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m0[:rows], op0=nl.multiply, operand0=-cfg.scale)
    p = nl.ndarray((P_MAX, MAX_S_TKG), dtype=kact.dtype, buffer=nl.sbuf)
    l0 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :S], op=nl.exp, data=sc[:rows, :S], bias=nbias[:rows], scale=cfg.scale,
                    reduce_op=nl.add, reduce_res=l0[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.nc_transpose(dst=st.ps_t[:S, 0, :rows], data=p[:rows, :S])
    pT = nl.ndarray((P_MAX, P_MAX), dtype=kact.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pT[:S, :rows], src=st.ps_t[:S, 0, :rows])
    # V of the new tokens as [token s', batch j * d]: selection matmuls (identity columns) out of the token layout.
    va = st.scores()
    vcol = cfg.pad + (cfg.nq + cfg.nkv + g) * d
    for j in range(nb):
        t = (p0 + j) * S
        ti = (t - base) // cfg.tile_tok
        r, nt = t - tiles[ti][0], tiles[ti][1]
        nisa.nc_matmul(dst=va[:S, j * d:(j + 1) * d], stationary=consts.ident[:nt, r:r + S],
                       moving=qkv[ti][:nt, vcol:vcol + d], accumulate=False)
    v_new = nl.ndarray((P_MAX, PV_COLS), dtype=kact.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=v_new[:S, :nb * d], src=va[:S, :nb * d])
    half = max(1, PSUM_F // d)
    for h0 in range(0, nb, half):
        hn = min(half, nb - h0)
        nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=pT[:S, :rows],
                       moving=v_new[:S, h0 * d:(h0 + hn) * d], accumulate=False)
    sm.m, sm.l, sm.pending = m0, l0, l0    # acc = PV, flushed after the next step's statistics


def _cols(t, rows, c0, c1, inner):
    """t[:rows, c0:c1], viewed [rows, (c1 - c0) / inner, inner] when inner > 0 (the score matmuls' dst shape; the
    mask matmuls must use the same view to continue the same PSUM accumulation group)."""
    if inner <= 0:
        return t[:rows, c0:c1]
    return t[:rows, c0:c1].reshape((rows, (c1 - c0) // inner, inner))


def _fold_mask(cfg, consts, sc, rows, chunks, key, thr_base, cmp, shift):
    """sc[:rows, chunks] += MASK_NEG where cmp(key offset, thr_base + shift) (key offsets per column, thresholds
    per row): the 0/1 mask is built on GpSimd and folded into the score PSUM by a matmul with MASK_NEG * I, one per
    score accumulation chunk (c0, c1, inner)."""
    m = _build_mask(cfg, rows, chunks[-1][1], key, thr_base, cmp, shift)
    for chunk in chunks:
        _fold_chunk(consts, sc, rows, m, chunk)


def _build_mask(cfg, rows, cols, key, thr_base, cmp, shift):
    """0/1 bf16 mask [rows, cols] = cmp(key offset, threshold + shift) on GpSimd (threshold a per-row scalar)."""
    thr = thr_base
    if shift != 0.0:
        thr = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=thr[:rows], data=thr_base[:rows], op0=nl.add, operand0=shift)
    m = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m[:rows, :cols], data1=key[:rows, :cols], data2=thr[:rows].broadcast(1, cols), op=cmp,
                       engine=nisa.engine.gpsimd)
    return m


def _fold_chunk(consts, sc, rows, m, chunk):
    """sc[:rows, chunk] += MASK_NEG * m (a matmul with MASK_NEG * I, continuing the chunk's accumulation group)."""
    c0, c1, inner = chunk
    nisa.nc_matmul(dst=_cols(sc, rows, c0, c1, inner), stationary=consts.neg_eye[:rows, :rows],
                   moving=_cols(m, rows, c0, c1, inner), accumulate=True)


class _Step(nl.NKIObject):
    """One online-softmax step over the cache: slot index, score chunks, key layout and P^T / V blocks."""

    def __init__(self, slot, pos0, chunks, key_id, key_pattern, blocks):
        self.slot, self.pos0, self.chunks = slot, pos0, chunks
        self.key_id, self.key_pattern, self.blocks = key_id, key_pattern, blocks
        self.cols = chunks[-1][1]
        self.sc, self.thr_hi, self.thr_lo = None, None, None


def _slot_bounds(cfg, lo, hi):
    """Slot boundaries over scan positions [lo, hi).

    Contiguous: slots of fa_tile positions, the last one split so that only FA_SUB positions arrive last (the
    compute left after the last K/V byte is then one step). Paged: slots of 128 * 2^m positions, each starting at a
    multiple of its own size, largest first. A paged slot is whole blocks: the scan's bounds are multiples of
    u = max(128, block size) and fa_tile >= FA_SUB >= MAX_BLOCK, so the halving stops at w >= block size.
    """
    if not cfg.paged:
        bounds = list(range(lo, hi, cfg.fa_tile)) + [hi]
        if len(bounds) >= 2 and bounds[-1] - bounds[-2] > FA_SUB:
            bounds.insert(len(bounds) - 1, bounds[-1] - FA_SUB)
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


def _plan(cfg):
    """Slots (j0, w) of this core's cache scan [cfg.lo, cfg.hi) and the steps over them (static).

    Slot layout: K^T [d, w] by DMA transpose; V so that partition q holds positions q*n + i (n = w // 128, one
    contiguous run of n*d elements per partition), the last w % 128 positions as one more block. A step covers
    i in [i0, i0 + ni) for all q (ni a power of two, so 512-column score chunks align with the PSUM banks):
    score column q*ni + il <-> position q*n + i0 + il, so the P^T block of V block i0 + il is the stride-ni column
    set il::ni of P. Keys beyond L - S are read only up to the next multiple of 128 (and S_max): they are masked.
    """
    bounds = _slot_bounds(cfg, cfg.lo, cfg.hi)
    slots, steps = [], []
    for si in range(len(bounds) - 1):
        j0, w = bounds[si], bounds[si + 1] - bounds[si]
        n, rem = w // P_MAX, w % P_MAX
        k = len(slots)
        slots.append((j0, w))
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
            ni = FA_SUB // P_MAX
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


def _prior_steps(cfg, consts, st, sm, qm, K_cache, V_cache, g, p0, nb, p_first, q_pos):
    """Cache keys j < pos[b, 0] (and > pos - W): K/V slots in a KV_BUFS ring, software-pipelined steps.

    Program order per step k: loads of the next slot when step k+1 starts one, scores + masks of step k+1, then the
    softmax / P^T / PV of step k, so TensorE computes the next scores while Vector/Scalar work on this step.
    """
    rows = nb * cfg.R
    slots, steps = _plan(cfg)
    if len(steps) == 0:
        return
    # Per-step mask thresholds (tiny, all issued up front so the GpSimd masks never wait for VectorE).
    for step in steps:
        step.thr_hi = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)   # invalid if j > pos[b, 0] - 1
        nisa.tensor_scalar(dst=step.thr_hi[:rows], data=p_first[:rows], op0=nl.add, operand0=-1.0 - step.pos0)
        if cfg.window > 0:                                                       # invalid if j <= pos - W
            step.thr_lo = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=step.thr_lo[:rows], data=q_pos[:rows], op0=nl.add,
                               operand0=-float(cfg.window) - step.pos0)
    gates = _step_gates(cfg, st, steps) if cfg.ragged else (None,) * len(steps)
    st.load_gates = _load_gates(cfg, st, slots, nb) if cfg.ragged else None
    views = []
    _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, steps[0], views, gates[0])
    for k in range(len(steps)):
        if k + 1 < len(steps):
            _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, steps[k + 1], views,
                          gates[k + 1])
        step = steps[k]
        _online_step(cfg, st, sm, step.sc, rows, nb, step.cols, views[step.slot][1], step.blocks, gates[k])
        step.sc = None
        if k == 0 and cfg.ragged and sm.acc is None:
            # no accumulator yet (second core of a context split): a zero one, so every later flush is the same
            # in-place acc * alpha + PV whichever steps run
            sm.acc = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=sm.acc[:rows, :nb * cfg.d], value=0.0)


def _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, step, views, gate=None):
    """Loads of the step's slot (when first needed), then its scores and masks into the next score buffer (inside
    the step's runtime gate when ragged contexts skip it)."""
    d, rows = cfg.d, nb * cfg.R
    fresh = []
    while len(views) <= step.slot:
        j0, w = slots[len(views)]
        kT = st.kT[st.n_slots % cfg.kv_bufs]
        v = st.v[st.n_slots % cfg.kv_bufs]
        stage = st.stage[st.n_slots % cfg.kv_bufs] if cfg.fp8 else None
        st.n_slots += 1
        if cfg.paged:
            lg = st.load_gates[j0] if cfg.ragged else (None,) * nb
            _load_slot_paged(cfg, st, K_cache, V_cache, kT, v, g, p0, nb, j0, w, lg)
        else:
            for j in range(nb):
                b = p0 + j
                u0 = (j % cfg.kpp) * d
                if cfg.dyn:     # windowed scan: positions start[b] + j0 .. (register-addressed)
                    _load_slot_window(cfg, st.starts[b], K_cache, V_cache, kT[u0:u0 + d, j // cfg.kpp, :w],
                                      v[:, j], b, g, j0, w)
                    continue

                if cfg.fp8:
                    _run(st.load_gates[j0][j] if cfg.ragged else None,
                         lambda _i, b=b, j=j, j0=j0, w=w, kT=kT, v=v, stage=stage:
                         _load_fp8(cfg, K_cache, V_cache, kT, v, stage, b, g, j, j0, w))
                    continue
                if not cfg.ragged:
                    _load_piece(cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, j0, w)
                    continue
                for a, size in _load_pieces(cfg, j0, w):    # a sequence's loads stop at its length
                    _run(st.load_gates[a][j], lambda _i, b=b, j=j, a=a, size=size, j0=j0, w=w, kT=kT, v=v:
                         _load_piece(cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, a, size))
        _scrub_slot(cfg, st, kT, j0, w, nb)
        views.append((kT, v))
        fresh.append((v, j0, w, st.gates[1]))
    kT = views[step.slot][0]
    j0, w = slots[step.slot]
    sc = st.scores()
    key = st.iota(step.key_id, step.key_pattern, step.cols)
    _run(gate, lambda _i: _step_scores(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w))
    for v, j0, w, gates in fresh:      # V is needed by the PV, one step later
        _scrub_v(cfg, st, v, j0, w, nb, gates)
    step.sc = sc


def _step_scores(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w):
    """Scores of one step (every K^T stack of the pack) with its masks folded in, chunk by chunk."""
    d, n = cfg.d, w // P_MAX
    masks = [_build_mask(cfg, rows, step.cols, key, step.thr_hi, nl.greater, 0.0)]
    if step.thr_lo is not None:
        masks.append(_build_mask(cfg, rows, step.cols, key, step.thr_lo, nl.less_equal, 0.0))
    for c0, c1, inner in step.chunks:
        for jj in range((nb + cfg.kpp - 1) // cfg.kpp):
            kp = min(cfg.kpp, nb - jj * cfg.kpp) * d
            if inner < 0:                   # paged, i-major: columns (il, q') of K^T, q' = r*T + t
                i0, K = step.pos0 - j0, _slot_split(cfg, w)
                il0, il1 = i0 + c0 // P_MAX, i0 + c1 // P_MAX
                if K == 1:
                    mov = kT[:kp, jj, il0 * P_MAX:il1 * P_MAX]
                else:
                    mov = kT[:kp, jj, :w].reshape((kp, K, n, P_MAX // K))[:, :, il0:il1, :].permute((0, 2, 1, 3))
            elif inner > 0:
                i0 = step.pos0 - j0
                mov = kT[:kp, jj, :n * P_MAX].reshape((kp, P_MAX, n))[:, c0 // inner:c1 // inner, i0:i0 + inner]
            else:
                mov = kT[:kp, jj, n * P_MAX:w]
            nisa.nc_matmul(dst=_cols(sc, rows, c0, c1, inner), stationary=qm[:kp, jj, :rows], moving=mov,
                           accumulate=(jj > 0))
        for m in masks:          # each chunk's masks right after its scores: its row max can start early
            _fold_chunk(consts, sc, rows, m, (c0, c1, inner))


def _load_fp8(cfg, K_cache, V_cache, kT, v, stage, b, g, j, j0, w):
    """fp8 cache, slot [j0, j0 + w) of batch j: dequantised on load -- K rows and V cast to bf16 by the DMAs
    (partition q holds positions q*n .. q*n + n - 1), then K^T by a DMA transpose from SBUF in the i-major order
    (column i*128 + q <-> position q*n + i, the paged layout's K = 1 case). w is a multiple of 128 (S_max is)."""
    d, n = cfg.d, w // P_MAX
    u0, jj = (j % cfg.kpp) * d, j // cfg.kpp
    nisa.dma_copy(dst=stage[:, j, :n, :], src=K_cache[b, g, j0:j0 + w, :].reshape((P_MAX, n * d)))
    nisa.dma_transpose(dst=kT[u0:u0 + d, jj, :w].reshape((d, n, P_MAX)), src=stage[:, j, :n, :])
    nisa.dma_copy(dst=v[:, j, :n, :], src=V_cache[b, g, j0:j0 + w, :].reshape((P_MAX, n * d)))


def _load_piece(cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, a, size):
    """Contiguous cache: K^T / V of positions [a, a + size) of the slot [j0, j0 + w) for batch j of the pack (the
    whole slot, or a piece of it: whole V partitions of the slot layout, or its remainder block)."""
    d, n = cfg.d, w // P_MAX
    u0, jj = (j % cfg.kpp) * d, j // cfg.kpp
    off = a - j0
    nisa.dma_transpose(dst=kT[u0:u0 + d, jj, off:off + size], src=K_cache[b, g, a:a + size, :])
    body = max(0, min(size, n * P_MAX - off))        # positions of the piece in the n-per-partition layout
    if body:
        nisa.dma_copy(dst=v[off // n:(off + body) // n, j, :n, :],
                      src=V_cache[b, g, a:a + body, :].reshape((body // n, n * d)))
    rem = size - body
    if rem:
        nisa.dma_copy(dst=v[:rem, j, n, :], src=V_cache[b, g, a + body:a + size, :])


def _load_slot_window(cfg, start, K_cache, V_cache, kT, v, b, g, j0, w):
    """Contiguous cache, windowed scan: K^T / V of positions start + j0 .. start + j0 + w (start: a register).
    The windowed scan is whole 128-position tiles (scan_w, see _Config), so w = 128 * n."""
    d, s_max = cfg.d, cfg.s_max
    n = w // P_MAX
    base = ((b * cfg.nkv + g) * s_max + j0) * d
    nisa.dma_transpose(dst=kT, src=K_cache.ap([[d, w], [1, d]], offset=base, scalar_offset=start, indirect_dim=2))
    nisa.dma_copy(dst=v[:, :n, :], src=V_cache.ap([[n * d, P_MAX], [1, n * d]], offset=base, scalar_offset=start,
                                                 indirect_dim=2))


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


def _start_rows(cfg, p_first, rows, cols=1):
    """fp32 [rows, cols]: first scanned position of each sequence (windowed scan; see _Config), elementwise from
    its first new position p_first [rows, cols]."""
    x = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=x[:rows], data=p_first[:rows, :cols], op0=nl.add, operand0=1.0 - cfg.window,
                       op1=nl.maximum, operand1=0.0)
    if cfg.paged:
        m = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=m[:rows], data=x[:rows], op0=nl.mod, operand0=float(cfg.unit))
        x2 = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=x2[:rows], data1=x[:rows], data2=m[:rows], op=nl.subtract)
        x = x2
    out = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out[:rows], data=x[:rows], op0=nl.minimum, operand0=float(cfg.cap - cfg.scan))
    return out


def _window_starts(cfg, position_ids, b_lo, b_hi):
    """Windowed scan: a register per sequence b with its first scanned position (paged: block), keyed b."""
    regs = {}
    if not cfg.dyn:
        return regs
    nbat = b_hi - b_lo
    p_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=p_i[:nbat], src=position_ids.ap([[cfg.S, nbat], [1, 1]], offset=b_lo * cfg.S))
    p_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=p_f[:nbat], src=p_i[:nbat])
    st = _start_rows(cfg, p_f, nbat)
    s_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s_i[:nbat], data=st[:nbat], op0=nl.multiply, operand0=1.0 / cfg.bs if cfg.paged else 1.0)
    for j in range(nbat):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=s_i[j:j + 1, 0:1])
        regs[b_lo + j] = r
    return regs


def _load_block_ids(cfg, block_table, b_lo, b_hi, starts=None):
    """Paged cache: SBUF tiles of block ids (uint32, one per partition: the gathers' vector offsets) for every
    (pack, slot) of the scan, keyed (first batch, slot start). Issued at the start of the kernel: the partition
    dim of these tiles walks block_table with 4-byte runs (slow DMAs), which then hide under the weight loads."""
    ids = {}
    if not cfg.paged:
        return ids
    slots, _steps = _plan(cfg)
    subs = {}
    for p0, nb in _packs(cfg, b_lo, b_hi):
        for j0, w in slots:
            b0, n, K = j0 // cfg.bs, w // P_MAX, _slot_split(cfg, w)
            # [t, batch, gather]: block b0 + t*ns + i (K = 1) or gathered row t = block b0 + t // sub, part t % sub
            ns = n // cfg.bs if K == 1 else 1
            t_n = P_MAX if K == 1 else P_MAX // K
            sub = 1 if K == 1 else cfg.bs // (K * n)      # gathered rows per block (> 1: sub-blocks)
            pat = [[ns, t_n]] if sub == 1 else [[1, t_n // sub], [0, sub]]    # each block id repeated sub times
            idx = nl.ndarray((P_MAX, cfg.pack, ns), dtype=nl.uint32, buffer=nl.sbuf)
            if cfg.dyn:
                for j in range(nb):
                    nisa.dma_copy(dst=idx[:t_n, j, :], src=block_table.ap(
                        pat + [[1, ns]], offset=(p0 + j) * cfg.mb + b0, scalar_offset=starts[p0 + j],
                        indirect_dim=1, dtype=nl.uint32))
            else:
                nisa.dma_copy(dst=idx[:t_n, :nb, :], src=block_table.ap(pat + [[cfg.mb, nb], [1, ns]],
                                                                        offset=p0 * cfg.mb + b0, dtype=nl.uint32))
            if sub > 1:
                # sub-block row id (rows of m = K * n positions of the cache): block * nkv * sub + part; the head's
                # part g * sub is the gathers' static offset. fp32 arithmetic is exact (< MAX_CACHE_ROWS).
                if sub not in subs:
                    q = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.iota(dst=q, pattern=[[0, 1]], offset=0, channel_multiplier=1)
                    part = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=part, data=q, op0=nl.mod, operand0=float(sub))
                    subs[sub] = part
                nisa.tensor_scalar(dst=idx[:t_n, :nb, 0], data=idx[:t_n, :nb, 0], op0=nl.multiply,
                                   operand0=float(cfg.nkv * sub), op1=nl.add, operand1=subs[sub][:t_n])
            ids[(p0, j0)] = idx
    return ids


def _load_slot_paged(cfg, st, K_cache, V_cache, kT, v, g, p0, nb, j0, w, gates):
    """K^T / V of scan positions [j0, j0 + w) for every batch of the pack from a paged cache (indirect DMAs).

    K^T lands in the natural order of a DMA transpose (one contiguous range per partition), "i-major":
      K = 1: column i*128 + q holds position q*n + i;  K > 1: column r*n*T + i*T + t holds row r*n + i of block t.
    V: partition q' (q' = q, or r*T + t) holds the same positions, block i of the slot. The steps use the matching
    i-major score layout (see _plan), so score chunks read contiguous K^T columns and P^T blocks are contiguous.
      n >= bs: n/bs indirect gathers of 128 blocks each (block q*(n/bs) + i' on partition q);
      n < bs <= w: R = 128 / K gathered rows of m = K*n positions (whole blocks, or sub-blocks so that R >= 16, see
      _slot_split): K^T by one 3-D transpose [R, K*n, d] -> [d, K*n, R]; V by K gathers of R partitions.
    (w >= bs always: see _slot_bounds.)
    """
    n = w // P_MAX
    row = cfg.nkv * cfg.bs * cfg.d               # elements per block of the cache (the indexed rows)
    idx = st.block_ids[(p0, j0)]
    K = _slot_split(cfg, w)
    off = g * cfg.bs * cfg.d
    for j in range(nb):     # a sequence's gathers stop at its length (ragged contexts)
        _run(gates[j], lambda _i, j=j: _gather_batch(cfg, K_cache, V_cache, kT, v, idx, K, off, row, j, n, w))


def _gather_batch(cfg, K_cache, V_cache, kT, v, idx, K, off, row, j, n, w):
    """The paged gathers of batch j of the pack for one slot (see _load_slot_paged)."""
    d, bs = cfg.d, cfg.bs
    swdge = nisa.dge_mode.swdge
    u0, jj = (j % cfg.kpp) * d, j // cfg.kpp
    if K == 1:
        for i in range(n // bs):
            vo = idx[:, j, i]
            nisa.dma_transpose(dst=kT[u0:u0 + d, jj, i * bs * P_MAX:(i + 1) * bs * P_MAX].reshape((d, bs, P_MAX)),
                               src=K_cache.ap([[row, P_MAX], [d, bs], [1, d]], offset=off, vector_offset=vo),
                               dge_mode=swdge)
            nisa.dma_copy(dst=v[:, j, i * bs:(i + 1) * bs, :],
                          src=V_cache.ap([[row, P_MAX], [1, bs * d]], offset=off, vector_offset=vo),
                          dge_mode=swdge)
    else:
        T, m = P_MAX // K, K * n                 # gathered rows of m positions (see _slot_split)
        kc, vc, rm = K_cache, V_cache, row
        if m < bs:      # sub-blocks: the indexed rows are m positions of one head (ids from _load_block_ids)
            nsub = K_cache.shape[0] * cfg.nkv * (bs // m)
            kc, vc, rm = K_cache.reshape((nsub, m * d)), V_cache.reshape((nsub, m * d)), m * d
        vo = idx[:T, j, 0]
        # (K, n) merged into one level (stride d): a 4-D indirect transpose needs src.shape[1] or [2] == 1
        nisa.dma_transpose(dst=kT[u0:u0 + d, jj, :w].reshape((d, K * n, T)),
                           src=kc.ap([[rm, T], [d, K * n], [1, d]], offset=off, vector_offset=vo),
                           dge_mode=swdge)
        for r in range(K):
            nisa.dma_copy(dst=v[r * T:(r + 1) * T, j, :n, :],
                          src=vc.ap([[rm, T], [1, n * d]], offset=off + r * n * d, vector_offset=vo),
                          dge_mode=swdge)


class _ValidRange(nl.NKIObject):
    """Scan positions holding data of each sequence of a pack: key k (scan coordinates: relative to the sequence's
    window start when the scan is windowed) is valid iff lo <= k < hi, hi = the first new position, lo = hi - W + 1
    (sliding window; None = no lower bound). fp32 per-partition tables in the two slot layouts: _k [128, stacks]
    (partition u*d + e of stack jj <-> batch jj*kpp + u of the K^T slot) and _v [128, batches] (same on every
    partition)."""

    def __init__(self):
        self.hi_k, self.lo_k, self.hi_v, self.lo_v = None, None, None, None
        self.max_hi = None                  # fp32 [1, 1]: the pack's largest hi (its longest sequence)
        self.step_regs, self.load_regs = None, {}   # runtime trip counts, shared by the KV heads
        self.slot_run = {}                  # per slot start: fp32 [1, 1], 1 iff the pack's steps reach it


def _valid_ranges(cfg, position_ids, p0, nb):
    S, d, kpp = cfg.S, cfg.d, cfg.kpp
    nst, npk = (nb + kpp - 1) // kpp, min(kpp, nb) * d
    pv = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=pv[:, :nb], src=position_ids.ap([[0, P_MAX], [S, nb]], offset=p0 * S))
    pk = nl.ndarray((P_MAX, cfg.nst), dtype=nl.float32, buffer=nl.sbuf)
    if nb % kpp:       # the last stack's missing batches: any finite value (their partitions are never read)
        nisa.memset(dst=pk[:npk, nst - 1:nst], value=0.0)
    for u in range(min(kpp, nb)):
        cnt = (nb - u + kpp - 1) // kpp
        nisa.dma_copy(dst=pk[u * d:(u + 1) * d, :cnt], src=position_ids.ap([[0, d], [kpp * S, cnt]],
                                                                           offset=(p0 + u) * S))
    vr = _ValidRange()
    vr.hi_v, vr.lo_v = _range_bounds(cfg, pv, P_MAX, nb)
    vr.hi_k, vr.lo_k = _range_bounds(cfg, pk, npk, nst)
    vr.max_hi = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=vr.max_hi, op=nl.maximum, data=vr.hi_v[0:1, :nb], axis=(1,))
    return vr


def _registers(t, n):
    """One register per element of the int32 row t[0:1, :n] (runtime trip counts)."""
    regs = []
    for i in range(n):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=t[0:1, i:i + 1])
        regs.append(r)
    return tuple(regs)


def _step_gates(cfg, st, steps):
    """Ragged contexts: per step of the plan, a runtime trip count 1 iff the step starts before the pack's longest
    sequence ends (max hi > step.pos0), else 0: its scores, softmax and PV are skipped. Skipped steps are a suffix
    (pos0 grows), so the state's last update is the last step run. Step 0 always runs (None): it gives the state
    its persistent buffers (see _online_step)."""
    vr = st.cur_valid
    if vr.step_regs is None:
        ns = len(steps)
        if st.pos0 is None:       # the plan's step starts, built once (the plan is the same for every pack)
            st.pos0 = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
            for k, step in enumerate(steps):
                nisa.memset(dst=st.pos0[:, k:k + 1], value=float(step.pos0), engine=nisa.engine.gpsimd)
        f = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f, data1=vr.max_hi.broadcast(1, ns), data2=st.pos0, op=nl.greater)
        fi = nl.ndarray((1, ns), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi, src=f)
        vr.step_regs = (None,) + _registers(fi[:, 1:], ns - 1)
    return vr.step_regs


def _load_pieces(cfg, j0, w):
    """(start, size) of the loads of a slot: contiguous caches load each sequence's slot in pieces of about FA_SUB
    positions (one step's keys, rounded down to whole V partitions of n positions, so the runs stay n * d long) and
    the remainder, so a sequence's loads stop within one step of its length; paged slots are gathered whole."""
    if cfg.imajor or cfg.pack == 1:     # one sequence per pack: its steps' gates already stop it (fewer DMAs)
        return ((j0, w),)
    n = w // P_MAX
    body = n * P_MAX
    step = max(n, FA_SUB // n * n) if n else FA_SUB     # whole V partitions of n positions each
    pieces = tuple((j0 + a, min(step, body - a)) for a in range(0, body, step))
    return pieces + (((j0 + body, w - body),) if w > body else ())


def _load_gates(cfg, st, slots, nb):
    """Ragged contexts: per load piece (_load_pieces) and batch of the pack, a runtime trip count 1 iff its
    sequence has a valid row in the piece (hi > its start): loads past a sequence's length are skipped, so the HBM
    traffic follows the real lengths. What the skipped loads leave in the ring (another slot's rows, or
    uninitialised SBUF) is excluded like any other invalid row (_scrub_slot: the gate is 1 for such a batch). All
    computed at the pack's start: a load must never wait for a gate computed behind the attention's VectorE work.
    Also vr.slot_run[j0] = 1 iff the pack's steps reach the slot at j0."""
    vr = st.cur_valid
    if not vr.load_regs:
        starts = [a for j0, w in slots for a, _ in _load_pieces(cfg, j0, w)]
        ns, npc = len(slots), len(starts)
        if st.slot0 is None:      # the plan's slot and piece starts, built once (the same plan for every pack)
            st.slot0 = nl.ndarray((1, ns + npc), dtype=nl.float32, buffer=nl.sbuf)
            for k, a in enumerate([j0 for j0, _ in slots] + starts):
                nisa.memset(dst=st.slot0[:, k:k + 1], value=float(a), engine=nisa.engine.gpsimd)
        f = nl.ndarray((1, npc, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f[:, :, :nb], data1=vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, npc),
                           data2=st.slot0[:, ns:].expand_dim(2).broadcast(2, nb), op=nl.greater)
        fi = nl.ndarray((1, npc, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi[:, :, :nb], src=f[:, :, :nb])
        run = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)     # 1 iff a sequence reaches the slot
        nisa.tensor_tensor(dst=run, data1=vr.max_hi.broadcast(1, ns), data2=st.slot0[:, :ns], op=nl.greater)
        for k, a in enumerate(starts):
            vr.load_regs[a] = _registers(fi[:, k, :], nb)
        for k, (j0, _w) in enumerate(slots):
            vr.slot_run[j0] = run[:, k:k + 1]
    return vr.load_regs


def _run(gate, body):
    """body(0) at trace time when gate is None, else inside a runtime loop of gate (0 or 1) iterations."""
    if gate is None:
        body(0)
    else:
        nl.fori_loop(0, gate, body)


def _range_bounds(cfg, p, rows, cols):
    """(hi, lo) of _ValidRange from the first new positions p [rows, cols] (fp32)."""
    hi = p
    if cfg.dyn:
        start = _start_rows(cfg, p, rows, cols)
        hi = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=hi[:rows], data1=p[:rows, :cols], data2=start[:rows], op=nl.subtract)
    lo = None
    if cfg.window > 0:
        lo = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lo[:rows], data=hi[:rows, :cols], op0=nl.add, operand0=1.0 - cfg.window)
    return hi, lo


def _slot_rel(t, rows, cols, j0, sign=1.0, add=0.0):
    """sign * (t[:rows, :cols] - j0) + add (fp32): a _ValidRange bound in the key offsets of the slot at j0."""
    if t is None:
        return None
    r = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=r[:rows], data=t[:rows, :cols], op0=nl.add, operand0=-float(j0), op1=nl.multiply,
                       operand1=sign)
    if add != 0.0:
        nisa.tensor_scalar(dst=r[:rows], data=r[:rows], op0=nl.add, operand0=add)
    return r


def _k_ramp(cfg, st, w):
    """fp32 [128, w]: key offset (position - slot start) of every K^T slot column (same on every partition):
    contiguous: the column; paged (i-major, see _load_slot_paged): K = 1 column i*128 + q <-> q*n + i, K > 1
    column r*n*T + i*T + t <-> t*m + r*n + i (T = 128 / K gathered rows of m = K*n positions, see _slot_split).
    One table at a time (the contiguous one serves every slot)."""
    n, K = w // P_MAX, _slot_split(cfg, w)
    if not cfg.imajor:
        key, width, pattern = "c", cfg.fa_tile, [[1, cfg.fa_tile]]
    elif K == 1:
        key, width, pattern = f"p{n}", w, [[1, n], [n, P_MAX]]
    else:
        key, width, pattern = f"p{n}_{K}", w, [[n, K], [1, n], [K * n, P_MAX // K]]
    if st.k_ramp[0] != key:
        t = nl.ndarray((P_MAX, cfg.fa_tile), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=t[:, :width], pattern=pattern, offset=0, channel_multiplier=0)
        st.k_ramp = (key, t)
    return st.k_ramp[1]


def _v_positions(cfg, st, w):
    """fp32 [128, blocks]: key offset of V slot block i on partition q (see _issue_scores / _load_slot_paged):
    q*n + i (i < n), the remainder block n*128 + q; paged K > 1: partition r*T + t holds t*m + r*n + i
    (T = 128 / K gathered rows of m = K*n positions, see _slot_split)."""
    n, rem, K = w // P_MAX, w % P_MAX, _slot_split(cfg, w)
    key = (n, rem, K)
    if key in st.ramps:
        return st.ramps[key]
    t = nl.ndarray((P_MAX, n + 1), dtype=nl.float32, buffer=nl.sbuf)
    if K == 1:
        if n > 0:
            nisa.iota(dst=t[:, :n], pattern=[[1, n]], offset=0, channel_multiplier=n)
        if rem:
            nisa.iota(dst=t[:, n:n + 1], pattern=[[0, 1]], offset=n * P_MAX, channel_multiplier=1)
    else:
        T, m = P_MAX // K, K * n
        q = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=q, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        tt = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)            # t = q mod T
        nisa.tensor_scalar(dst=tt, data=q, op0=nl.mod, operand0=float(T))
        rn = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)            # r * n = (q - t) * n / T
        nisa.tensor_scalar(dst=rn, data=q, op0=nl.subtract, operand0=tt, op1=nl.multiply, operand1=float(n) / T)
        base = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)          # t * m + r * n
        nisa.scalar_tensor_tensor(dst=base, data=tt, op0=nl.multiply, operand0=float(m), op1=nl.add,
                                  operand1=rn)
        i = nl.ndarray((P_MAX, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=i, pattern=[[1, n]], offset=0, channel_multiplier=0)
        nisa.tensor_scalar(dst=t[:, :n], data=i, op0=nl.add, operand0=base)
    st.ramps[key] = t
    return t


def _scrub_slot(cfg, st, kT, j0, w, nb):
    """Exclude, by selection, every K^T element of the slot [j0, j0 + w) whose position is outside its own
    sequence's valid range (st.cur_valid): rows past a sequence's length (a reused paged block's stale tail, which
    may hold NaN) and rows before a sliding window. Batch packing contracts other sequences' keys against zero
    queries and the PV matmul multiplies invalid values by zero probabilities; 0 * NaN = NaN, so invalid data must
    never reach a matmul. A bitwise AND of the bf16 bits with an int16 mask keeps a valid key exactly and leaves
    an invalid one finite (its score is masked anyway); never a multiply. Masks per stack on ScalarE, ANDs on
    GpSimd; V in _scrub_v. Each stack's / batch's scrub runs only when the slot holds one of its invalid rows (a
    runtime trip count, see _slot_gates)."""
    vr = st.cur_valid
    d, kpp = cfg.d, cfg.kpp
    nst, npk = (nb + kpp - 1) // kpp, min(kpp, nb) * d
    # K^T mask = sign(key - hi + 1/2) as int16: 0xFFFF (-1) keeps a valid key's bits, 0x0001 (+1) leaves at most
    # the lowest mantissa bit of an invalid one (0 or a subnormal: finite, and masked anyway). On ScalarE (idle
    # here); windowed scans AND a second mask sign(lo - 1/2 - key).
    b_hi = _slot_rel(vr.hi_k, npk, nst, j0, -1.0, 0.5)
    b_lo = _slot_rel(vr.lo_k, npk, nst, j0, 1.0, -0.5)
    ramp = _k_ramp(cfg, st, w)
    st.gates = _slot_gates(cfg, vr, j0, w, nb)
    for jj in range(nst):
        kp = min(kpp, nb - jj * kpp) * d

        def stack(_i, jj=jj, kp=kp):
            for bias, sc in ((b_hi, 1.0), (b_lo, -1.0)):
                if bias is None:
                    continue
                m = nl.ndarray((P_MAX, cfg.fa_tile), dtype=nl.int16, buffer=nl.sbuf)
                nisa.activation(dst=m[:kp, :w], op=nl.sign, data=ramp[:kp, :w], bias=bias[:kp, jj:jj + 1],
                                scale=sc)
                _and_bits(kT[:kp, jj, :w], m[:kp, :w], vector=jj % 2 == 1)
        nl.fori_loop(0, st.gates[0][jj], stack)    # runs only when a sequence of the stack has invalid rows here


def _slot_gates(cfg, vr, j0, w, nb):
    """Runtime trip counts (registers, 0 or 1) of the slot's scrub: per K^T stack and per batch, 1 iff one of its
    sequences has an invalid row in [j0, j0 + w): hi < j0 + w, or (window) lo > j0. A slot whose rows are all
    valid for its sequences (most of a long sequence's slots) is not touched."""
    kpp, nst = cfg.kpp, (nb + cfg.kpp - 1) // cfg.kpp
    f = nl.ndarray((1, cfg.nst * kpp), dtype=nl.float32, buffer=nl.sbuf)
    if nb < nst * kpp:
        nisa.memset(dst=f[:, nb:nst * kpp], value=0.0)
    if cfg.ragged and j0 > cfg.lo:   # a slot past every sequence of the pack is skipped whole (_step_gates):
        # nothing to exclude (vr.slot_run = 0). The first slot holds step 0, which always runs: always scrubbed.
        nisa.tensor_scalar(dst=f[:, :nb], data=vr.hi_v[0:1, :nb], op0=nl.less, operand0=float(j0 + w),
                           op1=nl.multiply, operand1=vr.slot_run[j0])
    else:
        nisa.tensor_scalar(dst=f[:, :nb], data=vr.hi_v[0:1, :nb], op0=nl.less, operand0=float(j0 + w))
    if vr.lo_v is not None:
        g = nl.ndarray((1, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=g[:, :nb], data=vr.lo_v[0:1, :nb], op0=nl.greater, operand0=float(j0))
        nisa.tensor_tensor(dst=f[:, :nb], data1=f[:, :nb], data2=g[:, :nb], op=nl.maximum)
    fv = nl.ndarray((1, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=fv[:, :nb], src=f[:, :nb])
    fk = nl.ndarray((1, cfg.nst), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=fk[:, :nst], op=nl.maximum, data=f[:, :nst * kpp].reshape((1, nst, kpp)), axis=(2,))
    regs = []
    for t, n in ((fk, nst), (fv, nb)):
        rs = []
        for i in range(n):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=t[0:1, i:i + 1])
            rs.append(r)
        regs.append(tuple(rs))
    return tuple(regs)


def _scrub_v(cfg, st, v, j0, w, nb, gates):
    """V half of _scrub_slot (issued after the first step's scores: PV needs it one step later): an int16 mask
    [128, batches, blocks] (-1 valid, 0 invalid; small, VectorE), ANDed on GpSimd."""
    vr = st.cur_valid
    d = cfg.d
    n, rem = w // P_MAX, w % P_MAX
    nblk = n + (1 if rem else 0)
    th_v, tl_v = _slot_rel(vr.hi_v, P_MAX, nb, j0), _slot_rel(vr.lo_v, P_MAX, nb, j0)
    vpos = _v_positions(cfg, st, w)[:, :nblk].expand_dim(1).broadcast(1, nb)
    mf = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=mf[:, :nb, :], data1=vpos, data2=th_v[:, :nb].expand_dim(2).broadcast(2, nblk),
                       op=nl.less)
    mv = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.int16, buffer=nl.sbuf)
    if tl_v is None:
        nisa.tensor_scalar(dst=mv[:, :nb, :], data=mf[:, :nb, :], op0=nl.multiply, operand0=-1.0)
    else:
        m2 = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m2[:, :nb, :], data1=vpos, data2=tl_v[:, :nb].expand_dim(2).broadcast(2, nblk),
                           op=nl.greater_equal)
        nisa.scalar_tensor_tensor(dst=mv[:, :nb, :], data=mf[:, :nb, :], op0=nl.multiply, operand0=-1.0,
                                  op1=nl.multiply, operand1=m2[:, :nb, :])
    v4 = nisa.get_nc_version() >= nisa.nc_version.gen4
    if v4:      # see _and_bits: VectorE on int32 pairs
        mv32 = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=mv32[:, :nb, :], src=mv[:, :nb, :])
    for j in range(nb):

        def batch(_i, j=j):
            if v4:
                v32 = v.view(nl.int32)
                nisa.tensor_tensor(dst=v32[:, j, :nblk, :], data1=v32[:, j, :nblk, :],
                                   data2=mv32[:, j, :].expand_dim(2).broadcast(2, d // 2), op=nl.bitwise_and,
                                   engine=nisa.engine.vector)
            else:
                _and_bits(v[:, j, :nblk, :], mv[:, j, :].expand_dim(2).broadcast(2, d))
        nl.fori_loop(0, gates[j], batch)     # only a batch with invalid rows in this slot


def _and_bits(data, mask, vector=False):
    """data (bf16) &= mask (int16, same shape, contiguous): keeps data's bits where the mask is -1. GpSimd (int16
    lanes at twice its fp32 rate on NeuronCore-v3); vector=True on v4 (where GpSimd runs every dtype at the fp32
    rate): VectorE on int32 pairs (two adjacent values with their two mask halves: half the elements)."""
    if vector and nisa.get_nc_version() >= nisa.nc_version.gen4:
        d32, m32 = data.view(nl.int32), mask.view(nl.int32)
        nisa.tensor_tensor(dst=d32, data1=d32, data2=m32, op=nl.bitwise_and, engine=nisa.engine.vector)
    else:
        d16 = data.view(nl.int16)
        nisa.tensor_tensor(dst=d16, data1=d16, data2=mask, op=nl.bitwise_and, engine=nisa.engine.gpsimd)


def _online_step(cfg, st, sm, sc, rows, nb, cols, v, blocks, gate=None):
    """One online-softmax update over the masked scores sc[:rows, :cols] + PV.

    blocks: (first column, column stride, positions K, V block index) of each P^T block.
    With a runtime gate (ragged contexts) the step runs inside a loop of 0 or 1 iterations, so it updates the
    state (m, l, the pending alpha, acc) in place: tensors allocated in a runtime loop do not outlive it.
    """
    if gate is not None:
        nl.fori_loop(0, gate, lambda _i: _online_step_inplace(cfg, st, sm, sc, rows, nb, cols, v, blocks))
        return
    d, scale = cfg.d, cfg.scale
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m_t[:rows], op=nl.maximum, data=sc[:rows, :cols], axis=(1,))
    m_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m_new[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m_new[:rows], op0=nl.multiply, operand0=-scale)
    alpha = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)
    p = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    l_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :cols], op=nl.exp, data=sc[:rows, :cols], bias=nbias[:rows], scale=scale,
                    reduce_op=nl.add, reduce_res=l_t[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    l_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=l_new[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=alpha[:rows],
                              op1=nl.add, operand1=l_t[:rows])
    # P^T blocks [positions, rows] via TensorE transposes (one PSUM bank), then PV with every batch's V side by
    # side (only the diagonal blocks are used).
    nblk = len(blocks)
    pT = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
    for i, (c0, stride, k, _vb) in enumerate(blocks):
        nisa.nc_transpose(dst=st.ps_t[:k, i, :rows], data=p[:rows, c0:c0 + (k - 1) * stride + 1:stride])
    kmax = blocks[0][2]
    nisa.activation(dst=pT[:kmax, :nblk, :rows], op=nl.copy, data=st.ps_t[:kmax, :nblk, :rows])   # ScalarE
    _flush_acc(cfg, st, sm, rows, nb)     # previous step's PV, placed after this step's statistics on VectorE
    half = max(1, PSUM_F // d)
    for h0 in range(0, nb, half):
        hn = min(half, nb - h0)
        for i, (_c0, _s, k, vb) in enumerate(blocks):
            nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=pT[:k, i, :rows],
                           moving=v[:k, h0:h0 + hn, vb, :], accumulate=(i > 0))
    sm.m, sm.l, sm.pending = m_new, l_new, alpha


def _online_step_inplace(cfg, st, sm, sc, rows, nb, cols, v, blocks):
    """_online_step writing the state in place (after a first step gave it its buffers), with the same VectorE /
    ScalarE instruction counts: nbias = -scale * max(m, rowmax) in one op; the previous step's PV is flushed before
    alpha overwrites the pending one; then l and m are updated in place."""
    d, scale = cfg.d, cfg.scale
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m_t[:rows], op=nl.maximum, data=sc[:rows, :cols], axis=(1,))
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=sm.m[:rows], op0=nl.maximum, operand0=m_t[:rows], op1=nl.multiply,
                       operand1=-scale)
    p = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    l_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :cols], op=nl.exp, data=sc[:rows, :cols], bias=nbias[:rows], scale=scale,
                    reduce_op=nl.add, reduce_res=l_t[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nblk = len(blocks)
    pT = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
    for i, (c0, stride, k, _vb) in enumerate(blocks):
        nisa.nc_transpose(dst=st.ps_t[:k, i, :rows], data=p[:rows, c0:c0 + (k - 1) * stride + 1:stride])
    kmax = blocks[0][2]
    nisa.activation(dst=pT[:kmax, :nblk, :rows], op=nl.copy, data=st.ps_t[:kmax, :nblk, :rows])   # ScalarE
    n = nb * d      # previous step's PV, in place: acc = acc * alpha_prev + PV
    nisa.scalar_tensor_tensor(dst=sm.acc[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply,
                              operand0=sm.pending[:rows], op1=nl.add, operand1=st.ps_o[:rows, :n])
    nisa.activation(dst=sm.pending[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)  # alpha
    nisa.scalar_tensor_tensor(dst=sm.l[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=sm.pending[:rows],
                              op1=nl.add, operand1=l_t[:rows])
    nisa.tensor_tensor(dst=sm.m[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum)
    half = max(1, PSUM_F // d)
    for h0 in range(0, nb, half):
        hn = min(half, nb - h0)
        for i, (_c0, _s, k, vb) in enumerate(blocks):
            nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=pT[:k, i, :rows],
                           moving=v[:k, h0:h0 + hn, vb, :], accumulate=(i > 0))


def _flush_acc(cfg, st, sm, rows, nb):
    """acc = acc * alpha + PV of the pending step (ps_o), or acc = PV for the first step."""
    if sm.pending is None:
        return
    acc = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    n = nb * cfg.d
    if sm.acc is None:
        nisa.tensor_copy(dst=acc[:rows, :n], src=st.ps_o[:rows, :n])
    else:
        nisa.scalar_tensor_tensor(dst=acc[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply,
                                  operand0=sm.pending[:rows], op1=nl.add, operand1=st.ps_o[:rows, :n])
    sm.acc, sm.pending = acc, None


def _rows_to_tokens(cfg, consts, st, o_rows, o_acc, tiles, g, p0, nb):
    """o_acc[tile][token, (g*G + h)*d + e] = o_rows[row(token, h), e] by selection matmuls: Sel_h[r, t] = 1 iff
    r = G*(t - base) + h (rows are (batch, token, head) = G*token + head), one matmul per head."""
    d, S, G = cfg.d, cfg.S, cfg.group
    rows = nb * cfg.R
    hg = max(1, PSUM_F // d)
    for ti, (_t0, nt, tb0, tnb) in enumerate(tiles):
        if max(p0, tb0) >= min(p0 + nb, tb0 + tnb):
            continue
        base_t = (p0 - tb0) * S
        sel = nl.ndarray((P_MAX, G, P_MAX), dtype=o_rows.dtype, buffer=nl.sbuf)
        nisa.affine_select(dst=sel[:rows, :, :nt], pattern=[[-1, G], [-G, nt]], channel_multiplier=1,
                           on_true_tile=consts.ones[:rows, :nt].expand_dim(1).broadcast(1, G), on_false_value=0.0,
                           cmp_op=nl.equal, offset=G * base_t)
        for h0 in range(0, G, hg):
            hn = min(hg, G - h0)
            for h in range(h0, h0 + hn):
                nisa.nc_matmul(dst=st.ps_sel[:nt, (h - h0) * d:(h - h0 + 1) * d], stationary=sel[:rows, h, :nt],
                               moving=o_rows[:rows, :d], accumulate=False)
            c0 = (g * G + h0) * d
            if p0 <= tb0:      # first pack of this tile: plain copy, later packs add (disjoint non-zero rows)
                nisa.tensor_copy(dst=o_acc[ti][:nt, c0:c0 + hn * d], src=st.ps_sel[:nt, :hn * d])
            else:
                nisa.tensor_tensor(dst=o_acc[ti][:nt, c0:c0 + hn * d], data1=o_acc[ti][:nt, c0:c0 + hn * d],
                                   data2=st.ps_sel[:nt, :hn * d], op=nl.add)


def _rows_to_oT(cfg, consts, st, o_rows, tile, g, p0, nb, full=False):
    """o^T[(hg*d + e) % 128, (hg*d + e) // 128, token] = o_rows[row(token, h), e] (hg = g*G + h) by selection
    matmuls written straight into the selection PSUM bank ([128, n_k, tokens] fp32): stationary o_rows [rows, d],
    moving Sel_h [rows, this pack's tokens] (Sel_h[r, t] = 1 iff r = G*(t - base) + h). Every (head, token) block
    is written once (by its pack), so the bank holds all of o^T after the last pack. full=True: o_rows is the
    normalised accumulator [rows, nb*d] with every batch block; one matmul per (batch j, head h) with stationary =
    block j and moving = Sel_h on batch j's tokens keeps only the row's own block (no block mask / reduction)."""
    d, S, G = cfg.d, cfg.S, cfg.group
    rows = nb * cfg.R
    _t0, nt, tb0, _tnb = tile
    n_k = (cfg.nq * d + P_MAX - 1) // P_MAX
    ps = st.ps_sel[:, :n_k * nt].reshape((P_MAX, n_k, nt))
    c0, c1 = (p0 - tb0) * S, (p0 - tb0 + nb) * S      # this pack's token columns
    sel = nl.ndarray((P_MAX, G, P_MAX), dtype=o_rows.dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=sel[:rows, :, :c1 - c0], pattern=[[-1, G], [-G, c1 - c0]], channel_multiplier=1,
                       on_true_tile=consts.ones[:rows, :c1 - c0].expand_dim(1).broadcast(1, G), on_false_value=0.0,
                       cmp_op=nl.equal, offset=0)
    # Heads h with (g*G + h) % dup == u land on partitions u*d.. of consecutive chunks: one matmul covers them all
    # (moving = their selection columns, stride dup heads).
    dup = P_MAX // d
    for u in range(dup):
        h0 = (u - g * G) % dup
        if h0 >= G:
            continue
        cnt = (G - h0 + dup - 1) // dup
        k0 = (g * G + h0) // dup
        if full:
            for j in range(nb):
                nisa.nc_matmul(dst=ps[u * d:(u + 1) * d, k0:k0 + cnt, c0 + j * S:c0 + (j + 1) * S],
                               stationary=o_rows[:rows, j * d:(j + 1) * d],
                               moving=sel[:rows, h0:h0 + (cnt - 1) * dup + 1:dup, j * S:(j + 1) * S], accumulate=False)
            continue
        per = max(1, PSUM_F // (c1 - c0))
        for i0 in range(0, cnt, per):
            i1 = min(cnt, i0 + per)
            nisa.nc_matmul(dst=ps[u * d:(u + 1) * d, k0 + i0:k0 + i1, c0:c1], stationary=o_rows[:rows, :d],
                           moving=sel[:rows, h0 + i0 * dup:h0 + (i1 - 1) * dup + 1:dup, :c1 - c0], accumulate=False)


# ---- O-projection and cache update ----------------------------------------------------------------------------

def _load_w_o(cfg, W_o):
    """W_o resident in SBUF as [128 (head, dim) rows, K chunk, H]; one DMA per K chunk (issued after the K/V loads,
    its arrival paces the O-projection, which therefore streams instead of running after the last load)."""
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    wo = nl.ndarray((P_MAX, n_k, cfg.H), dtype=W_o.dtype, buffer=nl.sbuf)
    h0, h1 = cfg.hc[0] * P_MAX, cfg.hc[1] * P_MAX      # this core's output columns (all of H unless split)
    for k in range(n_k):
        kn = min(P_MAX, K - k * P_MAX)
        nisa.dma_copy(dst=wo[:kn, k, h0:h1], src=W_o[k * P_MAX:k * P_MAX + kn, h0:h1])
    return wo


def _paged_rows(cfg, position_ids, block_table, tiles):
    """Paged cache: per new token, a register with its cache row block_table[b, p // bs] * nkv * bs + p % bs
    (rows of [num_blocks * nkv * block_size, d]; + g * bs for KV head g). Issued early (tiny DMAs, off the
    critical path); the stores that use the registers come last. Returns per token tile a tuple of registers."""
    if not cfg.paged:
        return ()
    bs, S = cfg.bs, cfg.S
    pos2 = position_ids.reshape((cfg.B * cfg.S, 1))
    out = []
    for t0, nt, _tb0, _nb in tiles:
        p_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=p_i[:nt], src=pos2[t0:t0 + nt, :])
        p_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=p_f[:nt], src=p_i[:nt])
        off = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)          # p % bs
        nisa.tensor_scalar(dst=off[:nt], data=p_f[:nt], op0=nl.mod, operand0=float(bs))
        col = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)            # p // bs (exact: bs = 2^k)
        nisa.tensor_scalar(dst=col[:nt], data=p_f[:nt], op0=nl.subtract, operand0=off[:nt], op1=nl.multiply,
                           operand1=1.0 / bs)
        blk = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
        for t in range(nt):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=col[t:t + 1, 0:1])
            nisa.dma_copy(dst=blk[t:t + 1, 0:1], src=block_table[(t0 + t) // S:(t0 + t) // S + 1, nl.ds(r, 1)])
        blk_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=blk_f[:nt], src=blk[:nt])
        lin = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)            # blk * nkv * bs + p % bs
        nisa.scalar_tensor_tensor(dst=lin[:nt], data=blk_f[:nt], op0=nl.multiply, operand0=float(cfg.nkv * bs),
                                  op1=nl.add, operand1=off[:nt])
        regs = []
        for t in range(nt):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=lin[t:t + 1, 0:1])
            regs.append(r)
        out.append(tuple(regs))
    return tuple(out)


def _update_cache(cfg, qkv, K_cache, V_cache, position_ids, tiles, rows=()):
    """K/V rows of the new tokens -> cache[b, g, pos[b, 0] : pos[b, 0] + S] (dynamic start from a register); paged:
    one row per token, K_cache[rows[t] + g * bs] of the [num_blocks * nkv * bs, d] row view (see _paged_rows).

    Issued after every cache read in program order (the attention used the new tokens from SBUF)."""
    d, nq, nkv, S = cfg.d, cfg.nq, cfg.nkv, cfg.S
    if cfg.paged:
        for ti, (_t0, nt, _tb0, _nb) in enumerate(tiles):
            for t in range(nt):
                for g in range(nkv):
                    kc, vc = cfg.pad + (nq + g) * d, cfg.pad + (nq + nkv + g) * d
                    for cache, c in ((K_cache, kc), (V_cache, vc)):
                        nisa.dma_copy(dst=cache.ap([[d, 1], [1, d]], offset=g * cfg.bs * d, scalar_offset=rows[ti][t],
                                                   indirect_dim=2), src=qkv[ti][t:t + 1, c:c + d])
        return
    for ti, (_t0, _nt, tb0, nb) in enumerate(tiles):
        for bl in range(nb):
            b = tb0 + bl
            start = nisa.register_alloc()
            nisa.register_load(dst=start, src=position_ids[b, 0])
            r0 = bl * S
            for g in range(nkv):
                kc, vc = cfg.pad + (nq + g) * d, cfg.pad + (nq + nkv + g) * d
                nisa.dma_copy(dst=K_cache[b, g, nl.ds(start, S), :], src=qkv[ti][r0:r0 + S, kc:kc + d])
                nisa.dma_copy(dst=V_cache[b, g, nl.ds(start, S), :], src=qkv[ti][r0:r0 + S, vc:vc + d])


def _transpose_o(cfg, o_tok, tiles):
    """oT[tile] = [128 (head, dim) rows, K chunk, tokens]: the stationaries of the O-projection."""
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    oTs = []
    for ti, (_t0, nt, _, _) in enumerate(tiles):
        oT = nl.ndarray((P_MAX, n_k, P_MAX), dtype=o_tok[ti].dtype, buffer=nl.sbuf)
        for c0 in range(0, n_k, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, n_k - c0)
            ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=o_tok[ti].dtype, buffer=nl.psum)
            kn_max = min(P_MAX, K - c0 * P_MAX)
            for c in range(nc):
                k0 = (c0 + c) * P_MAX
                kn = min(P_MAX, K - k0)
                nisa.nc_transpose(dst=ps[:kn, c, :nt], data=o_tok[ti][:nt, k0:k0 + kn])
            if K % P_MAX == 0 or c0 + nc < n_k:
                nisa.tensor_copy(dst=oT[:kn_max, c0:c0 + nc, :nt], src=ps[:kn_max, :nc, :nt])
            else:   # the last chunk is partial: copy it separately
                if nc > 1:
                    nisa.tensor_copy(dst=oT[:, c0:c0 + nc - 1, :nt], src=ps[:, :nc - 1, :nt])
                kl = K - (n_k - 1) * P_MAX
                nisa.tensor_copy(dst=oT[:kl, n_k - 1, :nt], src=ps[:kl, nc - 1, :nt])
        oTs.append(oT)
    return tuple(oTs)


def _output_projection(cfg, consts, oTs, wo, bias_T, out, tiles):
    """out[tokens, H] = o @ W_o (+ bias), computed transposed: out^T chunk c [128 (H), tokens] = sum over K chunks
    of matmul(stationary = W_o rows [K chunk, 128 H columns], moving = o^T [K chunk, tokens]) -- max(tokens, 64)
    cycles per matmul instead of 512 with W_o moving. The bias is a per-partition scalar of out^T (added by the
    eviction), then TensorE transposes bring [tokens, H] back for one contiguous store per token tile (few tokens:
    several chunks per transpose, see _store_packed).
    """
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    n_c = (cfg.H + P_MAX - 1) // P_MAX
    hc0, hc1 = cfg.hc                                        # this core's 128-column chunks of H
    for ti, (t0, nt, _, _) in enumerate(tiles):
        per_bank = max(1, PSUM_F // P_MAX)                  # out^T chunks of [128, nt <= 128] fp32 per bank
        outT = nl.ndarray((P_MAX, n_c, P_MAX), dtype=out.dtype, buffer=nl.sbuf)
        cpt = P_MAX // nt // per_bank * per_bank       # chunks per packed group: whole banks, dividing the range
        while cpt > 0 and ((hc1 - hc0) % cpt != 0 or hc0 % cpt != 0):
            cpt -= per_bank
        packed = cpt > 0
        if packed:        # [128, group, token, chunk of the group]: see _store_packed
            outP = nl.ndarray((P_MAX, n_c // cpt, nt, cpt), dtype=out.dtype, buffer=nl.sbuf)
        for c0 in range(hc0, hc1, per_bank):
            ncb = min(per_bank, hc1 - c0)
            ps = nl.ndarray((P_MAX, per_bank, P_MAX), dtype=nl.float32, buffer=nl.psum)
            for c in range(c0, c0 + ncb):                   # one accumulation group at a time per bank
                for k in range(n_k):
                    kn = min(P_MAX, K - k * P_MAX)
                    nisa.nc_matmul(dst=ps[:, c - c0, :nt], stationary=wo[:kn, k, c * P_MAX:(c + 1) * P_MAX],
                                   moving=oTs[ti][:kn, k, :nt], accumulate=(k > 0))
            dst = outT[:, c0:c0 + ncb, :nt]
            if packed:
                dst = outP[:, c0 // cpt, :, c0 % cpt:c0 % cpt + ncb].permute((0, 2, 1))
            if bias_T is not None:
                nisa.tensor_tensor(dst=dst, data1=ps[:, :ncb, :nt],
                                   data2=bias_T[:, c0:c0 + ncb].expand_dim(2).broadcast(2, nt), op=nl.add)
            else:
                _evict(c0 // per_bank, dst, ps[:, :ncb, :nt])
            ps = None
        if packed:
            _store_packed(cfg, outP, out, t0, nt, cpt)
            continue
        res = nl.ndarray((P_MAX, cfg.H), dtype=out.dtype, buffer=nl.sbuf)
        for c0 in range(hc0, hc1, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, hc1 - c0)
            pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
            for c in range(nc):
                nisa.nc_transpose(dst=pt[:nt, c, :], data=outT[:, c0 + c, :nt])
            _evict((c0 - hc0) // TRANSPOSE_GROUP, res[:nt, c0 * P_MAX:(c0 + nc) * P_MAX].reshape((nt, nc, P_MAX)),
                   pt[:nt, :nc, :])
            pt = None
        nisa.dma_copy(dst=out[t0:t0 + nt, hc0 * P_MAX:hc1 * P_MAX], src=res[:nt, hc0 * P_MAX:hc1 * P_MAX])


def _store_packed(cfg, outP, out, t0, nt, cpt):
    """Few tokens (nt <= 32): out^T held as outP [128 (H), group q, token t, chunk c of the group] (cpt <= 128 / nt
    chunks per group) goes back to [tokens, H] with ONE TensorE transpose per group: partition t * cpt + c of group
    q holds out[t, (q * cpt + c) * 128 + p]. The transposes and evictions handle 128 rows instead of nt; one store
    per token (disjoint rows, 256 B runs)."""
    hc0, hc1 = cfg.hc
    H = cfg.H
    q_lo, n_g, rows = hc0 // cpt, (hc1 - hc0) // cpt, cpt * nt
    res = nl.ndarray((P_MAX, n_g, P_MAX), dtype=out.dtype, buffer=nl.sbuf)
    for q0 in range(0, n_g, TRANSPOSE_GROUP):
        qn = min(TRANSPOSE_GROUP, n_g - q0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
        for qi in range(qn):
            nisa.nc_transpose(dst=pt[:rows, qi, :], data=outP[:, q_lo + q0 + qi, :, :].reshape((P_MAX, rows)))
        _evict(q0 // TRANSPOSE_GROUP, res[:rows, q0:q0 + qn, :], pt[:rows, :qn, :])
        pt = None
    for t in range(nt):
        nisa.dma_copy(dst=out.ap([[P_MAX, cpt], [cpt * P_MAX, n_g], [1, P_MAX]], offset=(t0 + t) * H + hc0 * P_MAX),
                      src=res[t * cpt:(t + 1) * cpt, :, :])


decode_attention_nki = nki.jit(decode_attention_kernel)
