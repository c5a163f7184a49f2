"""MoE token generation (decode) for one tensor-parallel rank: optional fused RMSNorm, router and the experts.

This file holds the argument checks (shared by every backend), the expert-mode cost rule, the NKI kernel and the
functional entry `moe_tkg`. Semantics are `moe_torch.moe_torch`'s; see DESIGN.md beside this file.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ..common.tiles import TRANSPOSE_GROUP, evict, transpose_tokens
from ..entry import resolve_backend, shape_of, to_torch
from . import tkg_mx
from .gate_up_layout import gate_up_layout, gate_up_layout_error, is_tiled, logical_gate_up
from .moe_torch import ACTIVATIONS, GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT, moe_torch
from .router import (
    H_TILE,
    MAX_TOP_K,
    P_MAX,
    RESET,
    RouterConsts,
    load_router_bias,
    load_router_weights,
    logits_step,
    router_argument_error,
    store_routing_step,
    topk_step,
)
from .tkg_cost import choose_expert_mode
from .tkg_mx import expert_src as _expert_src
from .tkg_mx import h_cols as _h_cols
from .tkg_mx import hb_cols as _hb_cols

# ---- sizes ------------------------------------------------------------------------------------------------------
MAX_TOKENS = 128       # T = B * S_tkg: tokens live on the partitions of one tile
EXPERT_MODES = ("auto", "selective", "all")
PSUM_F = nl.tile_size.psum_bank_fmax     # fp32 per PSUM bank: the down projection's output columns per matmul
I_TILE = P_MAX         # the expert intermediate dimension is tiled on partitions (gate/up output rows, down K)
MAX_I_TILES = 6        # gate/up accumulators of one expert (2 * I tiles of <= 512 B) in <= 3 PSUM banks
OUTT_MAX_TOKENS = 64   # up to this T the output accumulates transposed (H on partitions): see _Acc
HALF_P = P_MAX // 2    # a partial I tile of <= 64 rows may sit at partition 0 or 64 (engine start rule, C13)
XT_DMA_MAX_TOKENS = 8  # up to this T, x is loaded straight into the transposed layout (see _load_x_step)
W_BUFS = 3             # expert weight slots (ring): the next experts' DMAs run while one is computed ...
W_BUFS_MIN = 2         # ... at least double-buffered, or the expert is refused as too large for SBUF
SBUF_RESERVE = 48 * 1024   # bytes per partition kept for everything but the weight ring
TOPK_PSUM_MAX_TOKENS = 8   # LNC 1: up to this T, max8 / nc_find_index8 read the logits in PSUM (see _route_step)
BGU_Q0, BGU_ROW = 96, 120     # gate/up bias rows: partition 120 in a K = 32 block [96, 128) (see _Ring)
GU_PIECES_LAST = 2     # T = 1: the last expert's gate/up in this many kt pieces (its matmuls start on the first)
WR_SWAP_MAX_TOKENS = 8     # LNC 2: up to this T the cores swap their W_r halves instead of partial logits (_wr_swap)
WR_SWAP_MAX_ROW = 256      # ... when W_r's bytes per kt row are below this (E < 128 in bf16: the load is short)
HSPLIT_GU_ONE_PIECE_BYTES = 2 << 20   # H split: the last own gate/up in one DMA when k-1 down halves are this long
HSPLIT_ACT_ROWS = True     # ... its activation swaps as rows on one DMA engine (_ActSwap)
HSPLIT_SPREAD = True       # LNC 2, T = 1: the H split's partial down tiles over the 16 DMA engines (_Spread)
WR_SWAP_PIECES = 3         # ... in this many pieces at T = 1 (each sent as soon as it lands), one above


def tkg_argument_error(x_shape, w_router_shape, w_gate_up_shape, w_down_shape, *, top_k, b_router_shape=None,
                       b_gate_up_shape=None, b_down_shape=None, gamma_shape=None, hidden_actual=None,
                       router_mode="gpt_oss", activation="clamped_swiglu", expert_mode="auto"):
    """None when the arguments are in the TKG envelope, else the message naming the argument and the limit."""
    op = "moe_tkg"
    err = router_argument_error(x_shape, w_router_shape, b_router_shape, top_k=top_k, mode=router_mode, op=op)
    if err:
        return err
    T = 1
    for d in x_shape[:-1]:
        T *= d
    H, E = w_router_shape
    if not 1 <= T <= MAX_TOKENS:
        return f"{op}: tokens T={T} (B * S_tkg) must be in [1, {MAX_TOKENS}]"
    if activation not in ACTIVATIONS:
        return f"{op}: activation={activation!r} must be one of {ACTIVATIONS}"
    if expert_mode not in EXPERT_MODES:
        return f"{op}: expert_mode={expert_mode!r} must be one of {EXPERT_MODES}"
    err = gate_up_layout_error(op, () if w_gate_up_shape is None else w_gate_up_shape, H, E)
    if err:
        return err
    _, _, inter = gate_up_layout(w_gate_up_shape, H)
    if w_down_shape != (E, inter, H):
        return f"{op}: w_down must be [E={E}, I={inter}, H={H}] to match w_gate_up, got shape {w_down_shape}"
    if b_gate_up_shape is not None and b_gate_up_shape != (E, 2, inter):
        return f"{op}: b_gate_up must be [E={E}, 2, I={inter}], got shape {b_gate_up_shape}"
    if b_down_shape is not None and b_down_shape != (E, H):
        return f"{op}: b_down must be [E={E}, H={H}], got shape {b_down_shape}"
    if gamma_shape is not None and tuple(gamma_shape) not in ((H,), (1, H)):
        return f"{op}: gamma must be [H={H}] or [1, H], got shape {gamma_shape}"
    if hidden_actual is not None and not (isinstance(hidden_actual, int) and 0 < hidden_actual <= H):
        return f"{op}: hidden_actual={hidden_actual!r} must be an int in [1, H={H}] (or None = H)"
    return None


def moe_tkg(x, w_router, w_gate_up, w_down, *, top_k, b_router=None, b_gate_up=None, b_down=None, gamma=None,
            eps=1e-5, hidden_actual=None, router_mode="gpt_oss", renormalize=False, activation="clamped_swiglu",
            add_down_bias=True, expert_mode="auto", backend="auto", lnc=1, w_gate_up_scale=None, w_down_scale=None):
    """Decode MoE block for one TP rank: (RMSNorm) → router → Σ_k affinity · expert(x) → partial out [T, H].

    x [T, H] (or [B, S, H], flattened to T = B·S ≤ 128), bf16. Weights in moe_torch's layout (w_gate_up [E, H, 2, I]
    or tiled [E, 128, H/128, 2I] (gate_up_layout.py, what MoELayer holds), w_down [E, I, H], b_gate_up [E, 2, I],
    b_down [E, H]); under TP the output is this rank's partial sum and
    add_down_bias must be True on exactly one rank. Returns (out [T, H] in x's dtype, expert_index [T, k],
    affinities [T, k] fp32). expert_mode "auto" | "selective" | "all" only schedules the kernel (same result).
    w_gate_up_scale / w_down_scale: given, the experts are MXFP4 in mx_weights.py's kernel layout (w_gate_up
    [E, 128, H/512, 2I] float4_e2m1fn_x4 words, w_down [E, 128, KDm, H], scales [E, 16, chunks, N] uint8, as
    moe_cte takes them): trn3 only (nc_matmul_mx), T <= 64, lnc 1; "torch" dequantises and runs the MX reference
    (tokens and activations quantised to MXFP8, moe_torch(mx=True)).
    """
    mx = w_gate_up_scale is not None
    if mx:
        from .mx_weights import logical_weights, packed_weights_error
        err = packed_weights_error(shape_of(x)[-1], w_gate_up, w_down, w_gate_up_scale, w_down_scale, "moe_tkg")
        T = 1
        for d in shape_of(x)[:-1]:
            T *= d
        err = err or tkg_mx_error(T, lnc)
        if err:
            raise ValueError(err)
        mx_words = (w_gate_up, w_down)
        w_gate_up, w_down = logical_weights(w_gate_up, w_down, w_gate_up_scale, w_down_scale, backend)
    err = tkg_argument_error(shape_of(x), shape_of(w_router), shape_of(w_gate_up), shape_of(w_down), top_k=top_k,
                             b_router_shape=shape_of(b_router), b_gate_up_shape=shape_of(b_gate_up),
                             b_down_shape=shape_of(b_down), gamma_shape=shape_of(gamma), hidden_actual=hidden_actual,
                             router_mode=router_mode, activation=activation, expert_mode=expert_mode)
    if err:
        raise ValueError(err)
    if lnc not in (1, 2):
        raise ValueError(f"moe_tkg: lnc={lnc} must be 1 or 2")
    backend = resolve_backend("moe_tkg", backend)
    x = to_torch(x)
    x2 = x.reshape(-1, x.shape[-1])
    t = {k: to_torch(v) for k, v in dict(w_router=w_router, w_gate_up=w_gate_up, w_down=w_down, b_router=b_router,
                                          b_gate_up=b_gate_up, b_down=b_down, gamma=gamma).items()}
    if backend == "torch":
        out, index, aff = moe_torch(
            x2, t["w_router"], logical_gate_up(t["w_gate_up"], x2.shape[1]), t["w_down"], top_k=top_k,
            b_router=None if b_router is None else t["b_router"].reshape(-1), b_gate_up=t["b_gate_up"],
            b_down=t["b_down"], gamma=None if gamma is None else t["gamma"].reshape(-1), eps=eps,
            hidden_actual=hidden_actual, router_mode=router_mode, renormalize=renormalize, activation=activation,
            add_down_bias=add_down_bias, mx=mx)
        return out.to(x.dtype), index, aff
    T, H = x2.shape
    _, E, inter = gate_up_layout(t["w_gate_up"].shape, H)
    if expert_mode == "auto":
        expert_mode = choose_expert_mode(T, E, top_k, H, inter, mx=mx)
    kernel = moe_tkg_nki if lnc == 1 else moe_tkg_nki[lnc]
    vec = {k: (None if t[k] is None else t[k].reshape(1, -1)) for k in ("b_router", "gamma")}
    wgu, wd, scales = (t["w_gate_up"], t["w_down"], {})
    if mx:
        wgu, wd = mx_words
        scales = dict(w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
    return kernel(x2, t["w_router"], wgu, wd, **scales, b_router=vec["b_router"], b_gate_up=t["b_gate_up"],
                  b_down=t["b_down"], gamma=vec["gamma"], top_k=top_k, eps=float(eps),
                  hidden_actual=int(hidden_actual or 0), router_mode=router_mode, renormalize=bool(renormalize),
                  activation=activation, add_down_bias=bool(add_down_bias),
                  expert_mode="all" if expert_mode == "all" else "selective")


# ---- kernel -----------------------------------------------------------------------------------------------------

def _pow2_at_least(n):
    p = 1
    while p < n:
        p *= 2
    return p


class _Part(nl.NKIObject):
    """A range of an expert's I columns [col0, col0 + inter) as this core processes it: I tiles of <= 128 rows."""

    def __init__(self, col0, inter):
        self.col0, self.inter = col0, inter
        self.MT = (inter + I_TILE - 1) // I_TILE
        self.rows = tuple(min(I_TILE, inter - m * I_TILE) for m in range(self.MT))


class _Cfg(nl.NKIObject):
    """Trace-time sizes of one launch (every loop bound below is one of these Python ints)."""

    def __init__(self, x, w_gate_up, w_router, top_k, hidden_actual, activation, expert_mode, w_down=None,
                 mx=False):
        self.T, self.H = x.shape
        self.E = w_router.shape[1]
        self.mx = mx
        # MXFP4 (trn3): w_gate_up is [E, 128, H/512, 2I] words (mx_weights.py's layout), the rest in x's dtype
        # bf16: [E, H, 2, I] or the tiled layout [E, 128, H/128, 2I] (gate_up_layout.py: the experts' x^T then in
        # natural H tiles, _Natural)
        self.gu_tiled = not mx and is_tiled(tuple(w_gate_up.shape), x.shape[1])
        self.inter = w_gate_up.shape[3] // 2 if mx or self.gu_tiled else w_gate_up.shape[3]
        self.k = top_k
        self.KT = self.H // H_TILE
        self.MT = (self.inter + I_TILE - 1) // I_TILE
        self.rows = tuple(min(I_TILE, self.inter - m * I_TILE) for m in range(self.MT))
        self.part = _Part(0, self.inter)
        # accumulator stride: a power of two >= T, so no accumulator [rows, T] straddles a 2 KiB PSUM bank
        self.GS = _pow2_at_least(self.T)
        self.n_acc = 2 * self.MT                       # gate tiles 0..MT-1, up tiles MT..2MT-1
        self.h_actual = hidden_actual or self.H
        self.activation = activation
        self.mode = expert_mode
        self.dtype = x.dtype if mx else w_gate_up.dtype
        self.chunks = tuple((c0, min(PSUM_F, self.H - c0)) for c0 in range(0, self.H, PSUM_F))
        self.core = nl.program_id(0)
        self.ncores = nl.num_programs()
        # PSUM: the output accumulates across experts in one bank per 512 columns when those banks fit beside
        # the gate/up accumulators (+ the broadcast affinities); the gate/up set is double-buffered if room is left
        banks = nl.tile_size.psum_num_banks
        gu_banks = -(-(self.n_acc + 1) * self.GS * 4 // nl.tile_size.psum_bank_fmax_bytes)
        # small T: out^T [128, KT, T] (H row p * KT + kt on partition p, as hT): GS-strided kt groups, kt_bank per
        # bank; the LNC=2 exchange splits the kt range in halves, so KT must then be even
        self.kt_bank = PSUM_F // self.GS
        self.t_banks = -(-self.KT // self.kt_bank)
        self.outT = self.T <= OUTT_MAX_TOKENS and (self.ncores == 1 or self.KT % 2 == 0) and \
            self.t_banks + gu_banks <= banks
        # large T: gate/up with the tokens stationary (M = T) and the weights moving (N = 2I, one bank: gate at
        # [0, I), up at [I, 2I)) when that is fewer TensorE cycles than 2 * MT groups of max(T, 64) columns, then
        # act [T, I] transposed on TensorE (one bank) into act^T for the down projection
        if mx:
            self.mxs = tkg_mx.MxShape(self.H, self.inter, w_down.shape[2], self.T)
            self.n_acc = self.mxs.n_acc
            gu_banks = -(-(self.n_acc + 1) * self.GS * 4 // nl.tile_size.psum_bank_fmax_bytes)
        cyc_t = 2 * self.MT * max(self.T, 64) * (self.KT + 1)
        cyc_f = 2 * self.inter * (self.KT + 1) + self.MT * max(self.T, 64)
        self.flip = (not self.outT) and not mx and 2 * self.inter <= PSUM_F and cyc_f < cyc_t and \
            len(self.chunks) + 2 <= banks
        if self.flip:
            gu_banks = 2
        self.psum_acc = self.outT or len(self.chunks) + gu_banks <= banks
        out_banks = self.t_banks if self.outT else len(self.chunks) if self.psum_acc else 2
        self.n_gu = 2 if out_banks + 2 * gu_banks <= banks else 1
        self.psum_ok = out_banks + gu_banks <= banks
        slot = (self.KT * 2 * self.inter + self.MT * self.H + 2 * self.inter) * self.dtype.itemsize
        if mx:
            # the MX path's per-expert down output has its own PSUM set(s) beside the accumulator's banks
            self.down_sets = 2 if 2 * self.t_banks + 2 * gu_banks <= banks else 1
            self.n_gu = 2 if self.down_sets * self.t_banks + 2 * gu_banks <= banks else 1
            self.psum_ok = self.t_banks + gu_banks <= banks
            slot = self.mxs.slot_bytes
        fit = (nl.tile_size.sbuf_fmax_bytes - SBUF_RESERVE - self.H * 4) // slot
        self.nbuf = min(W_BUFS, fit)
        self.slot_bytes = slot


def tkg_mx_error(T, lnc, mx_isa=True):
    """Limits of MXFP4 weights in the TKG kernel (None when in the envelope). mx_isa: the target has nc_matmul_mx."""
    if not mx_isa:
        return ("moe_tkg: w_gate_up_scale: MXFP4 weights need nisa.nc_matmul_mx, which only NeuronCore-v4 (trn3) "
                "has; on trn2 pass bf16 weights (MoELayer(expert_format='bf16') dequantises MXFP4 at load time)")
    if T > OUTT_MAX_TOKENS:
        return (f"moe_tkg: tokens T={T} must be <= {OUTT_MAX_TOKENS} with MXFP4 weights (the MX path keeps the "
                "output transposed; larger T is not implemented)")
    return None


def tkg_kernel_error(cfg):
    """Limits of the kernel beyond the entry's argument checks (None when in the envelope)."""
    if cfg.mx:
        err = tkg_mx_error(cfg.T, cfg.ncores, nisa.get_nc_version() >= nisa.nc_version.gen4)
        if err:
            return err
        if not cfg.outT:
            return f"moe_tkg: MXFP4 weights need the transposed output (H/128={cfg.KT} even under LNC 2)"
        if not cfg.psum_ok:
            return (f"moe_tkg: MXFP4 gate/up accumulators of I={cfg.inter} at T={cfg.T} do not fit PSUM beside the "
                    "output; shard I further across ranks")
    if cfg.gu_tiled and cfg.KT > P_MAX:
        return (f"moe_tkg: w_gate_up in the tiled layout needs H <= {P_MAX * P_MAX} (its x^T is transposed from "
                f"[H/128, 128] rows), got H={cfg.H}; pass [E, H, 2, I]")
    if cfg.MT > MAX_I_TILES or not cfg.psum_ok:
        return (f"moe_tkg: expert intermediate size I={cfg.inter} exceeds {MAX_I_TILES * I_TILE} (its gate/up "
                "accumulators must fit 3 PSUM banks); shard I further across ranks")
    if cfg.nbuf < W_BUFS_MIN:
        return (f"moe_tkg: one expert's weights take {cfg.slot_bytes} B per partition; {W_BUFS_MIN} slots do not "
                f"fit the {nl.tile_size.sbuf_fmax_bytes} B of SBUF per partition (H={cfg.H}, I={cfg.inter})")
    if cfg.mode not in ("selective", "all"):
        return f"moe_tkg: the kernel's expert_mode must be 'selective' or 'all', got {cfg.mode!r}"
    return None


class _Consts(RouterConsts):
    """Routing constants plus bf16 ones (K=1 bias matmuls), the partition index, an fp32 identity and the RMSNorm
    epsilon as a [128, 1] bias."""

    def __init__(self, E, T, eps):
        super().__init__(E)
        self.eps = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.eps, value=eps)
        self.part_idx = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=self.part_idx, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        cols = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=cols, pattern=[[1, P_MAX]], offset=0, channel_multiplier=0)
        self.ident = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=self.ident, data=cols, op0=nl.equal, operand0=self.part_idx)
        self.zeros_bf = nl.ndarray((1, PSUM_F), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=self.zeros_bf, value=0.0)


def _load_x_step(cfg, x):
    """x^T [128, KT, T] (a view), H index p * KT + kt. Small T (<= XT_DMA_MAX_TOKENS): one DMA straight into
    [128, T, KT] (partition p reads KT contiguous elements per token: short runs, but T * KT * 2 bytes per
    partition is little), viewed permuted -- no x row load, TensorE transposes and PSUM eviction on the routing's
    critical path. Else the rows and TensorE transposes (transpose_tokens). Returns (x^T, the x rows [T, H] or None
    at small T: the tiled gate/up layout's natural x^T transposes them too, _Natural)."""
    T, KT = cfg.T, cfg.KT
    if T <= XT_DMA_MAX_TOKENS:
        xs = nl.ndarray((P_MAX, cfg.GS, KT), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs[:, :T, :], src=x.ap([[KT, P_MAX], [cfg.H, T], [1, KT]], offset=0))
        return xs[:, :T, :].permute((0, 2, 1)), None
    x_sb = nl.ndarray((P_MAX, cfg.H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb[:T, :], src=x)
    return transpose_tokens(x_sb, T, KT)[:, :, :T], x_sb


def _load_natural_step(cfg, x, gamma):
    """Tiled gate/up layout (gate_up_layout.py): the DMAs of the experts' natural-tile x^T (_Natural). x rows as
    [KT, T, 128] (T <= XT_DMA_MAX_TOKENS: row kt holds H columns [128 kt, 128 (kt + 1)) of every token, 256 B runs;
    larger T transposes the rows _load_x_step loaded) and gamma as [KT, 128], at partitions _natural_rows_at. Issued
    after the routing in program order (the priority of the DMA queues and engines): issued before the router's
    loads they delayed the W_r rows (GPT-OSS-120B T = 1 trn3 LNC 2 +1.2 %, modelled). Returns (x rows or None,
    gamma rows or None)."""
    T, KT = cfg.T, cfg.KT
    q = _natural_rows_at(KT)
    xk = None
    if T <= XT_DMA_MAX_TOKENS:
        xk = nl.ndarray((P_MAX, T, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xk[q:q + KT], src=x.ap([[P_MAX, KT], [cfg.H, T], [1, P_MAX]], offset=0))
        xk = xk[q:q + KT]
    gk = None
    if gamma is not None:
        gk = nl.ndarray((P_MAX, P_MAX), dtype=gamma.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=gk[q:q + KT], src=gamma.reshape((KT, P_MAX)))
        gk = gk[q:q + KT]
    return xk, gk


def _natural_rows_at(KT):
    """First partition of _load_natural_step's x and gamma rows: the top quadrant(s) holding KT (96 at H 3072), so
    their DMA runs on the engines of the high partitions, not on engines 0-2 ahead of the W_r halves' swap
    (sendrecv) at LNC 2: GPT-OSS-20B T = 4 trn3 88.171 -> 87.551 us modelled (= the [E, H, 2, I] run)."""
    return max(0, P_MAX - -(-KT // 32) * 32)


class _Natural(nl.NKIObject):
    """Tiled gate/up layout: the experts' hT in natural H tiles, hg [128, KT, T] with H row kt * 128 + p on
    partition p (the weights' order at (p, kt), gate_up_layout.py); the router keeps hT's order p * KT + kt, whose
    W_r rows are one DMA run per partition. Every DMA of the gate/up weights is the same access pattern as for
    [E, H, 2, I] (gate_up_layout.py: the same flat offsets), so every kt piece / block split of the loads holds.

    Scheduling (modelled; the list scheduler starts any ready instruction on a free engine and never preempts, so
    work of low priority that is ready early still takes an engine from the routing): selective mode (the routing
    paces the first weight DMA) builds hg at its first use (`get`, from the first gate/up step in program order,
    never inside a runtime loop: _selective_slots asks before its slot loops), after the routing and the compaction,
    and issues its loads there too (T = 1) or right after the compaction's instructions (T > 1; at first use
    GPT-OSS-120B T = 4 trn3 LNC 1 was +0.43 %, here 120B T = 4 trn2 LNC 1 is +0.11 %). The scaling runs on ScalarE
    (the PSUM eviction) and GpSimd, not on VectorE (the top-k and the compaction), and at T > 8 the ScalarE
    instructions wait for rstd (a zero bias computed from it) instead of running before the RMSNorm's. All-expert
    mode (the weights stream from the start) loads x and gamma at once and builds hg as early as it is ready.
    Without these: +0.03 .. +1.4 % on the bench cells.

    Numerics: hg = x * rstd * gamma in fp32, rounded once to x's dtype: T <= 8 _rmsnorm_step's instructions (the
    same bits per element as hT); T > 8 (x * gamma) * rstd."""

    def __init__(self, cfg, x, x_rows, gamma, rstd):
        self.cfg, self.x, self.x_rows, self.gamma, self.rstd = cfg, x, x_rows, gamma, rstd
        self.hg = self.xk = self.gk = None
        self.loaded = cfg.mode == "all"
        if self.loaded:     # all-expert mode: the weights stream from the start, hg is wanted early
            self.xk, self.gk = _load_natural_step(cfg, x, gamma)

    def load(self):
        """Issue the x / gamma row loads now (program order: their priority) unless done."""
        if not self.loaded:
            self.xk, self.gk = _load_natural_step(self.cfg, self.x, self.gamma)
            self.loaded = True

    def get(self):
        if self.hg is None:
            self.load()
            self.hg = self._build()
        return self.hg

    def _gamma(self, dtype):
        """gamma in natural tiles [128, KT] (TensorE transpose of the [KT, 128] rows, exact), in `dtype`."""
        KT = self.cfg.KT
        ps_g = nl.ndarray((P_MAX, KT), dtype=self.gk.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps_g, data=self.gk)
        gn = nl.ndarray((P_MAX, KT), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=gn, src=ps_g)
        return gn

    def _build(self):
        cfg, T, KT = self.cfg, self.cfg.T, self.cfg.KT
        if self.xk is not None:     # T <= 8: the [KT, T, 128] rows, one transpose per token
            dtype = self.xk.dtype
            hg = nl.ndarray((P_MAX, KT, cfg.GS), dtype=dtype, buffer=nl.sbuf)
            gn = None if self.gk is None else self._gamma(dtype)
            ps = nl.ndarray((P_MAX, T, KT), dtype=dtype, buffer=nl.psum)
            for t in range(T):
                nisa.nc_transpose(dst=ps[:, t, :], data=self.xk[:, t, :])
            if gn is None:
                nisa.activation(dst=hg[:, :, :T], op=nl.copy, data=ps.permute((0, 2, 1)))
            elif T == 1:            # _rmsnorm_step's T = 1 instruction
                nisa.scalar_tensor_tensor(dst=hg[:, :, 0], data=ps[:, 0, :], op0=nl.multiply,
                                          operand0=self.rstd[:, 0:1], op1=nl.multiply, operand1=gn)
            else:                   # its T > 1 pair (x * rstd, then * gamma) on GpSimd, after a ScalarE eviction
                xs = nl.ndarray((P_MAX, KT, T), dtype=dtype, buffer=nl.sbuf)
                nisa.activation(dst=xs, op=nl.copy, data=ps.permute((0, 2, 1)))
                self._scale(hg, xs, 0, KT, T, gn)
            return hg
        x_sb = self.x_rows      # T > 8: the rows _load_x_step loaded, natural column tiles transposed
        hg = nl.ndarray((P_MAX, KT, cfg.GS), dtype=x_sb.dtype, buffer=nl.sbuf)
        gn = None if self.gk is None else self._gamma(nl.float32)
        zero = None
        if gn is not None and cfg.mode == "selective":
            # selective: a zero bias computed from rstd (finite: eps > 0), so the ScalarE instructions below wait for
            # the RMSNorm instead of taking ScalarE ahead of it (x * gamma + 0: -0 becomes +0, the sums are the same)
            zero = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=zero, op=nl.copy, data=self.rstd[:, 0:1], scale=0.0)
        for c0 in range(0, KT, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, KT - c0)
            ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=x_sb.dtype, buffer=nl.psum)
            for c in range(nc):
                kt = c0 + c
                nisa.nc_transpose(dst=ps[:, c, :T], data=x_sb[:T, kt * P_MAX:(kt + 1) * P_MAX])
            if gn is None:
                evict(c0 // TRANSPOSE_GROUP, hg[:, c0:c0 + nc, :T], ps[:, :nc, :T])
                continue
            xg = nl.ndarray((P_MAX, TRANSPOSE_GROUP, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
            for c in range(nc):     # x * gamma, fp32, on ScalarE: gamma is a per-partition scale of tile kt
                nisa.activation(dst=xg[:, c, :T], op=nl.copy, data=ps[:, c, :T], scale=gn[:, c0 + c:c0 + c + 1],
                                bias=zero)
            nisa.tensor_tensor(dst=hg[:, c0:c0 + nc, :T], data1=xg[:, :nc, :T],
                               data2=self.rstd[:, :T].expand_dim(1).broadcast(1, nc), op=nl.multiply,
                               engine=nisa.engine.gpsimd)
        return hg

    def _scale(self, hg, xs, a, b, T, gn):
        """hg[:, a:b, :T] = (xs * rstd) * gamma on GpSimd (fp32, rounded once), as _rmsnorm_step's T > 1 pair."""
        xr = nl.ndarray((P_MAX, b - a, T), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xr, data1=xs, data2=self.rstd[:, :T].expand_dim(1).broadcast(1, b - a),
                           op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=hg[:, a:b, :T], data1=xr, data2=gn[:, a:b].expand_dim(2).broadcast(2, T),
                           op=nl.multiply, engine=nisa.engine.gpsimd)


def _hT_of(hT):
    """The experts' x^T: hT itself, or the natural-tile copy of the tiled gate/up layout (_Natural)."""
    return hT.get() if isinstance(hT, _Natural) else hT


def _rmsnorm_step(cfg, consts, xT, gamma):
    """hT = rmsnorm(x)^T [128, KT, T] bf16 in the transposed layout (H index p * KT + kt) from the view xT
    [128, KT, T]: the sum of squares over the first h_actual columns is a ones-matmul over the partitions (fp32,
    broadcast to all 128), so every elementwise step runs on KT * T elements; rstd = rsqrt(ss / n + eps) in one
    ScalarE pass from PSUM; at T = 1 the squares are summed by the same instruction and x * rstd * gamma is one.
    Returns (hT, rstd [128, T] fp32: each token's factor, the same on every partition)."""
    T, KT = cfg.T, cfg.KT
    g_sb = nl.ndarray((P_MAX, KT), dtype=gamma.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g_sb, src=gamma.reshape((P_MAX, KT)))
    ss = nl.ndarray((P_MAX, cfg.GS), dtype=nl.float32, buffer=nl.psum)
    if cfg.h_actual % KT == 0:
        # the real columns are exactly partitions p < h_actual / KT (e.g. 2880 = 120 x 24): squares summed over kt,
        # then ONE fp32 ones-matmul over those partitions
        n_p = cfg.h_actual // KT
        sq = nl.ndarray((P_MAX, cfg.GS, KT), dtype=nl.float32, buffer=nl.sbuf)
        part = nl.ndarray((P_MAX, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
        if T == 1:
            nisa.activation(dst=sq[:n_p, 0, :], op=nl.square, data=xT[:n_p, :, 0], reduce_op=nl.add,
                            reduce_res=part[:n_p, 0:1], reduce_cmd=RESET)
        else:
            nisa.activation(dst=sq[:n_p, :T, :].permute((0, 2, 1)), op=nl.square, data=xT[:n_p])
            nisa.tensor_reduce(dst=part[:n_p, :T], op=nl.add, data=sq[:n_p, :T, :], axis=2)
        nisa.nc_matmul(dst=ss[:, :T], stationary=consts.ones_f32[:n_p, :], moving=part[:n_p, :T], accumulate=False)
    else:
        sq = nl.ndarray((P_MAX, KT, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[:, :, :T], op=nl.square, data=xT)
        first = True
        for kt in range(KT):
            n_p = min(P_MAX, max(0, (cfg.h_actual - kt + KT - 1) // KT))   # partitions p: p * KT + kt < h_actual
            if n_p > 0:
                nisa.nc_matmul(dst=ss[:, :T], stationary=consts.ones_f32[:n_p, :], moving=sq[:n_p, kt, :T],
                               accumulate=not first)
                first = False
    rstd = nl.ndarray((P_MAX, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd[:, :T], op=nl.rsqrt, data=ss[:, :T], scale=1.0 / cfg.h_actual, bias=consts.eps)
    hT = nl.ndarray((P_MAX, KT, P_MAX), dtype=xT.dtype, buffer=nl.sbuf)
    if T == 1:
        # LNC 2 with the partial-logits exchange: this core's kt range first (_route_step's k0, k1: its logits
        # matmuls wait for it), then the other
        KH = KT // 2
        halves = [(0, KT)]
        if cfg.ncores > 1 and KT >= 2 and not _wr_swap(cfg):
            halves = [(0, KH), (KH, KT)] if cfg.core == 0 else [(KH, KT), (0, KH)]
        for a, b in halves:
            nisa.scalar_tensor_tensor(dst=hT[:, a:b, 0], data=xT[:, a:b, 0], op0=nl.multiply, operand0=rstd[:, 0:1],
                                      op1=nl.multiply, operand1=g_sb[:, a:b])
        return hT, rstd
    xr = nl.ndarray((P_MAX, KT, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=xr[:, :, :T], data1=xT, data2=rstd[:, :T].expand_dim(1).broadcast(1, KT),
                       op=nl.multiply)
    nisa.tensor_tensor(dst=hT[:, :, :T], data1=xr[:, :, :T], data2=g_sb.expand_dim(2).broadcast(2, T),
                       op=nl.multiply)
    return hT, rstd


def _wr_swap(cfg):
    """LNC=2, small T: each core loads its half of W_r and SENDS it to the other (sendrecv, piece by piece as they
    land) instead of exchanging partial logits: the exchange's start latency then runs from the W_r landing, in
    parallel with the x load and the RMSNorm, not after the logits. HBM still reads every W_r byte once. E >= 128
    (W_r 786 KB at GPT-OSS-120B: its swap is longer than the logits' path) and MXFP4 at T > 1 keep the logits
    exchange (modelled slower with the swap: 120B LNC 2 T = 1 trn3 +0.1 us, MXFP4 20B T = 4 / 8 +0.26 / +0.17 us)."""
    return cfg.ncores > 1 and cfg.KT >= 2 and cfg.KT % 2 == 0 and cfg.T <= WR_SWAP_MAX_TOKENS and \
        cfg.E * 2 < WR_SWAP_MAX_ROW and (not cfg.mx or cfg.T == 1)


def _swap_pieces(n, T):
    """kt counts of the swapped W_r pieces. T = 1 (the routing paces the first weight DMA): equal pieces, each one's
    matmuls follow its arrival (3 of 4 kt at GPT-OSS-20B: 0.03-0.2 us faster, modelled, than 1, 2, 4, 6 or
    decreasing pieces). T > 1: one piece (T = 4 trn2: 3 pieces were 0.1 % slower than the logits exchange)."""
    p = max(1, min(WR_SWAP_PIECES if T == 1 else 1, n))
    return [(i + 1) * n // p - i * n // p for i in range(p)]


def _load_router_swap_step(cfg, w_router, b_router):
    """_wr_swap: this core's W_r half [128, KH, E] (H row p * KT + kt, kt in [c KH, (c + 1) KH)) in pieces, issued
    before x (the swap waits for them); b_r on both cores (E elements: the logits of both halves need it in the
    same PSUM group on both cores). Returns (wr [128, KT, E], br)."""
    KT, E = cfg.KT, cfg.E
    KH = KT // 2
    wr = nl.ndarray((P_MAX, KT, E), dtype=w_router.dtype, buffer=nl.sbuf)
    src = w_router.reshape((P_MAX, KT, E))
    a = cfg.core * KH
    for sz in _swap_pieces(KH, cfg.T):
        nisa.dma_copy(dst=wr[:, a:a + sz, :], src=src[:, a:a + sz, :])
        a += sz
    return wr, load_router_bias(b_router, E)


def _route_swap_step(cfg, consts, hT, wr, br, router_mode, renormalize):
    """_wr_swap's logits: the W_r pieces swapped (sendrecv), then two PSUM groups, A = b_r + kt [0, KH) and B = kt
    [KH, KT), each accumulated in ascending kt on both cores (this core's own group first: its rows are here);
    the own group is copied to SBUF and the logits are own + other (fp32 a + b == b + a: the same bits, so the same
    experts, on both cores; the same sums as the partial-logits exchange)."""
    T, E, KT, c = cfg.T, cfg.E, cfg.KT, cfg.core
    KH = KT // 2
    a = 0
    for sz in _swap_pieces(KH, cfg.T):
        nisa.sendrecv(src=wr[:, c * KH + a:c * KH + a + sz, :], dst=wr[:, (1 - c) * KH + a:(1 - c) * KH + a + sz, :],
                      send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=0)
        a += sz
    groups = [(0, KH, br), (KH, KT, None)]
    own, oth = groups[c], groups[1 - c]
    ps_own = logits_step(consts, hT, wr, own[2], T, E, own[0], own[1])
    mine = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=mine[:T, :], src=ps_own[:T, :])
    ps_oth = logits_step(consts, hT, wr, oth[2], T, E, oth[0], oth[1])
    if T == 1 and not cfg.mx:
        # other + own accumulated in PSUM (an exact fp32 ones matmul, 0.03 us shorter than the add) and read there by
        # the top-k. Not MXFP4: its VectorE quantisations then take the engine just before max8 (+0.03 us, modelled)
        nisa.nc_matmul(dst=ps_oth[0:1, :], stationary=consts.ones_f32[0:1, 0:1], moving=mine[0:1, :E],
                       accumulate=True)
        return topk_step(consts, ps_oth, T, E, cfg.k, router_mode, renormalize)
    logits = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=logits[:T, :], data1=mine[:T, :], data2=ps_oth[:T, :], op=nl.add)
    return topk_step(consts, logits, T, E, cfg.k, router_mode, renormalize)


def _route_step(cfg, consts, hT, w_router, b_router, router_mode, renormalize, wr=None):
    """Logits [T, E] fp32 -> top-k (idx, aff tiles). LNC=2: each core contracts half of the H tiles (and loads
    only those W_r rows); the fp32 partial logits are exchanged and added (a + b == b + a: the same bits, so the
    same experts, on both cores); the bias is in core 0's part. (Small T: _wr_swap instead.)"""
    T, E, KT = cfg.T, cfg.E, cfg.KT
    if wr is not None:      # (wr [128, KT, E], b_r) from _load_router_swap_step
        return _route_swap_step(cfg, consts, hT, wr[0], wr[1], router_mode, renormalize)
    split = cfg.ncores > 1 and KT >= 2
    k0, k1 = (0, KT) if not split else ((0, KT // 2) if cfg.core == 0 else (KT // 2, KT))
    # T = 1: the routing is the critical path to the first weight DMA (its decreasing W_r pieces; at LNC 2 two,
    # ~3 : 1, as the transposed logits' matmuls take 27 ns per kt: _logits_t_exchange); larger T keeps the equal
    # pieces (at T = 128 the decreasing ones are 0.03 % slower, modelled)
    pcs = _exchange_w_pieces(k1 - k0) if split and T == 1 else None
    wr, br = load_router_weights(w_router, b_router if cfg.core == 0 else None, KT, k0, k1, decreasing=T == 1,
                                 pieces=pcs)
    if split and T == 1:
        return topk_step(consts, _logits_t_exchange(cfg, consts, hT, wr, br, k0, k1), T, E, cfg.k, router_mode,
                         renormalize)
    ps = logits_step(consts, hT, wr, br, T, E, k0, k1)
    if not split and T <= TOPK_PSUM_MAX_TOKENS:     # top-k reads the logits in PSUM: no eviction on the path
        return topk_step(consts, ps, T, E, cfg.k, router_mode, renormalize)
    logits = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=logits[:T, :], src=ps[:T, :])
    if split:
        other = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=logits[:T, :], dst=other[:T, :], send_to_rank=1 - cfg.core, recv_from_rank=1 - cfg.core,
                      pipe_id=0)
        total = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=total[:T, :], data1=logits[:T, :], data2=other[:T, :], op=nl.add)
        logits = total
    return topk_step(consts, logits, T, E, cfg.k, router_mode, renormalize)


def _exchange_w_pieces(n):
    """kt counts of this core's W_r rows at T = 1, LNC 2 (partial-logits exchange): two pieces, n - n/4 and n/4 (9 / 3
    at GPT-OSS-120B TP16: the first piece's transposed-logits matmuls run while the second streams; modelled 0.02 us
    better than 6 / 4 / 2, 8 / 4, 8 / 3 / 1 equal)."""
    return [n - n // 4, n // 4] if n >= 4 else [n]


def _logits_t_exchange(cfg, consts, hT, wr, br, k0, k1):
    """T = 1, LNC=2, partial-logits exchange: this core's partial logits TRANSPOSED, [E, 1] fp32 in PSUM, with W_r
    stationary and the token moving (a matmul takes max(N, 64) cycles: N = 1 instead of E, 27 instead of 53 ns per
    kt at E = 128), evicted ([E, 1]) and exchanged; then the logits row [1, E] = I^T own + I^T other, two fp32
    identity matmuls accumulating in PSUM (exact: x * 1 + 0s; the own one runs while the exchange is in flight),
    read there by the top-k. Own then other on both cores: a + b == b + a in fp32, so both cores get the same bits
    (the bias is in core 0's part)."""
    E, c = cfg.E, cfg.core
    psT = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.psum)
    first = True
    if br is not None:
        ones = consts.ones_bf if br.dtype == nl.bfloat16 else consts.ones_f32
        nisa.nc_matmul(dst=psT[:E, :], stationary=br[0:1, :E], moving=ones[0:1, 0:1], accumulate=False)
        first = False
    for kt in range(k0, k1):
        nisa.nc_matmul(dst=psT[:E, :], stationary=wr[:, kt, :E], moving=hT[:, kt, 0:1], accumulate=not first)
        first = False
    mine = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=mine[:E, :], src=psT[:E, :])
    other = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.sendrecv(src=mine[:E, :], dst=other[:E, :], send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=0)
    ps = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps[0:1, :], stationary=mine[:E, 0:1], moving=consts.ident[:E, :E], accumulate=False)
    nisa.nc_matmul(dst=ps[0:1, :], stationary=other[:E, 0:1], moving=consts.ident[:E, :E], accumulate=True)
    return ps


def _dense_step(cfg, consts, idx, aff):
    """dense [T, E] fp32: token t's affinity for expert e (0 if not chosen), and its transpose denseT [E, T] (an
    fp32 identity matmul: exact)."""
    T, E = cfg.T, cfg.E
    idx_f = nl.ndarray((P_MAX, cfg.k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx_f[:T, :], src=idx[:T, :cfg.k])
    dense = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(cfg.k):
        dst = dense
        if j > 0:
            dst = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dst[:T, :], data=consts.col_idx[:T, :E], op0=nl.equal, operand0=idx_f[:T, j:j + 1],
                           op1=nl.multiply, operand1=aff[:T, j:j + 1])
        if j > 0:
            nisa.tensor_tensor(dst=dense[:T, :], data1=dense[:T, :], data2=dst[:T, :], op=nl.add)
    ps = nl.ndarray((P_MAX, cfg.GS), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps[:E, :T], stationary=dense[:T, :], moving=consts.ident[:T, :T], accumulate=False)
    denseT = nl.ndarray((P_MAX, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=denseT[:E, :T], src=ps[:E, :T])
    return dense, denseT


def _touched_step(cfg, consts, idx):
    """touched [1, E] fp32: 1.0 for every expert some token chose, from the top-k indices alone (before the
    affinities: the weight DMAs wait for this list, the affinities are needed only at the first activation). With
    the experts on the partitions the work is T * k elements per partition: the index rows of the T tokens are
    placed block-diagonally (x identity) and broadcast to E partitions by a ones matmul (fp32: exact integers),
    compared with the partition index, reduced over (t, j), and the [E, 1] column turned into a row by an fp32
    identity matmul."""
    T, E, k = cfg.T, cfg.E, cfg.k
    idx_f = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx_f[:T, :k], src=idx[:T, :k])
    blk = nl.ndarray((P_MAX, T, k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=blk[:T], data1=consts.ident[:T, :T].expand_dim(2).broadcast(2, k),
                       data2=idx_f[:T, :k].expand_dim(1).broadcast(1, T), op=nl.multiply)
    bc = nl.ndarray((P_MAX, T, k), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=bc[:E], stationary=consts.ones_f32[:T, :E], moving=blk[:T], accumulate=False)
    eq = nl.ndarray((P_MAX, T, k), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=eq[:E], data=bc[:E], op0=nl.equal, operand0=consts.part_idx[:E, :])
    col = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=col[:E, :], op=nl.maximum, data=eq[:E], axis=(1, 2))
    row = nl.ndarray((1, P_MAX), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=row[:, :E], stationary=col[:E, 0:1], moving=consts.ident[:E, :E], accumulate=False)
    touched = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=touched, src=row[:, :E])
    return touched


def _schedule_step(cfg, consts, dense, denseT, split_odd=True, touched=None, dense_fn=None):
    """Selective mode: the touched experts as a compact list and per-slot registers.

    touched = column sums of dense (> 0 iff some token chose the expert with a nonzero affinity; a zero-affinity
    choice contributes nothing and is skipped); nonzero_with_count compacts them into list[0..n) and n. Slot s
    (static, s < min(E, T·k)) gets a register with list[s] and a gate register (1 iff s < n): the slot's loop runs
    once or not at all. affc [T, S] = dense gathered by the list (a one-hot fp32 matmul: exact), so slot s scales
    by a static column. LNC=2 also returns `half` = (expert register, gate register, affinities [T, 1]) of an odd
    count's last expert, which both cores serve by halves of I (else None); split_odd False: no such split, the
    cores take alternate slots of the whole list (the MXFP4 path).

    touched given (_touched_step: from the indices, every chosen expert): the list, count and gates come first
    in program order and dense_fn() -> (dense, denseT) is called after them (the affinity gathers need it); the
    dense pair is returned last."""
    T, E = cfg.T, cfg.E
    S = min(E, T * cfg.k)
    if touched is None:
        cnt = nl.ndarray((1, P_MAX), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=cnt[:, :E], stationary=consts.ones_f32[:T, 0:1], moving=dense[:T, :], accumulate=False)
        touched = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=touched, src=cnt[:, :E])
    lst = nl.ndarray((1, E + 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.nonzero_with_count(dst=lst, src=touched, index_offset=0, padding_val=-1)
    lst_f = nl.ndarray((1, E + 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=lst_f, src=lst)
    n_run = lst_f[0:1, E:E + 1]
    half = None
    if cfg.ncores > 1 and split_odd:
        # LNC=2: the cores take slot pairs; an odd count's last expert (list[n - 1] = the largest id listed, the
        # list being ascending with -1 padding) is split by I columns between the cores instead of loading on one
        odd = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=odd, data=n_run, op0=nl.mod, operand0=2.0)
        n_even = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=n_even, data1=n_run, data2=odd, op=nl.subtract)
        n_run = n_even
        last_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=last_f, op=nl.maximum, data=lst_f[0:1, :E], axis=1)
        hx = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hx[0:1, 0:1], src=last_f)
        nisa.tensor_copy(dst=hx[0:1, 1:2], src=odd)
    gate = nl.ndarray((1, S), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=gate, data=consts.col_idx[0:1, :S], op0=nl.less, operand0=n_run)
    if dense_fn is not None:
        dense, denseT = dense_fn()
    if half is None and cfg.ncores > 1 and split_odd:
        # its affinities dense[:, last]: a one-hot of `last` over E (broadcast by a ones matmul), gathered by an
        # fp32 matmul (exact)
        bl = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=bl[:E, :], stationary=consts.ones_f32[0:1, :E], moving=last_f, accumulate=False)
        oh = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=oh[:E, :], data=bl[:E, :], op0=nl.equal, operand0=consts.part_idx[:E, :])
        pa = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=pa[:T, :], stationary=denseT[:E, :T], moving=oh[:E, :], accumulate=False)
        affh = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=affh[:T, :], src=pa[:T, :])
        half = (hx, affh)
    bc = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=bc[:E, :S], stationary=consts.ones_f32[0:1, :E], moving=lst_f[0:1, :S], accumulate=False)
    onehot = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=onehot[:E, :S], data=bc[:E, :S], op0=nl.equal, operand0=consts.part_idx[:E, :])
    ps = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps[:T, :S], stationary=denseT[:E, :T], moving=onehot[:E, :S], accumulate=False)
    affc = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=affc[:T, :S], src=ps[:T, :S])
    # slot s's registers are loaded just before its loop (_slot_registers), not all here: register loads run in
    # order on one sequencer, so S of them up front would delay the first weight DMA by S SBUF reads
    if dense_fn is not None:
        return affc, (lst, gate), half, dense, denseT
    return affc, (lst, gate), half


def _slot_registers(sched, s):
    """(expert id, gate) registers of slot s from the schedule tiles."""
    lst, gate = sched
    r = nisa.register_alloc()
    nisa.register_load(dst=r, src=lst[0:1, s:s + 1])
    g = nisa.register_alloc()
    nisa.register_load(dst=g, src=gate[0:1, s:s + 1])
    return r, g


class _Acc(nl.NKIObject):
    """The output accumulator [T, H] fp32 across experts, one of three layouts:
    - cfg.outT (T <= OUTT_MAX_TOKENS): out^T [128, KT, T] in PSUM, H row p * KT + kt on partition p (hT's order).
      The down projection runs with the weights stationary (128 H columns) and act^T moving (T columns): at small
      T that is fewer TensorE cycles than 512-column moving chunks, the eviction and the LNC=2 exchange move
      KT * T elements per partition instead of H per token row, and the store writes KT-element runs per token.
    - cfg.psum_acc: out [T, H] in one PSUM bank per 512 columns (no per-expert eviction at all).
    - else SBUF with one add per chunk and expert (a PSUM bank ring)."""

    def __init__(self, cfg):
        self.T = cfg.outT
        self.psum = cfg.psum_acc
        if self.T:
            self.banks = tuple(nl.ndarray((P_MAX, cfg.kt_bank, cfg.GS), dtype=nl.float32, buffer=nl.psum)
                               for _ in range(cfg.t_banks))
            self.hblocks = ((0, cfg.KT),)   # out^T's H order (hb_cols): one block, h = p * KT + kt
        elif self.psum:
            self.banks = tuple(nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in cfg.chunks)
        else:
            self.sb = nl.ndarray((P_MAX, cfg.H), dtype=nl.float32, buffer=nl.sbuf)
            self.ring = tuple(nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in range(2))
            self.nd = 0

    def col(self, cfg, kt):
        """out^T [128, T] of H tile kt (outT layout)."""
        return self.banks[kt // cfg.kt_bank][:, kt % cfg.kt_bank, :cfg.T]


def _init_acc_step(cfg, consts, denseT, b_down, add_bias):
    """acc = Σ_e dense[t, e] · b_down[e] (the down biases, scaled by the affinities as the expert outputs they
    belong to) on the core that adds them, else 0. bf16 matmuls over E on the partitions with the affinities split
    into hi + lo bf16 parts (a = hi + lo to 2^-18 relative; b_down is used as given, no conversion); they run while
    the first expert's weights load."""
    T, E, H = cfg.T, cfg.E, cfg.H
    acc = _Acc(cfg)
    parts = ()
    if b_down is not None and add_bias and cfg.core == 0:
        bd = nl.ndarray((P_MAX, H), dtype=b_down.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=bd[:E, :], src=b_down)
        hi = nl.ndarray((P_MAX, cfg.GS), dtype=b_down.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hi[:E, :T], src=denseT[:E, :T])
        lo = nl.ndarray((P_MAX, cfg.GS), dtype=b_down.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lo[:E, :T], data1=denseT[:E, :T], data2=hi[:E, :T], op=nl.subtract)
        parts = (hi, lo)
    if acc.T:
        for kt in range(cfg.KT):
            for j, part in enumerate(parts):
                nisa.nc_matmul(dst=acc.col(cfg, kt), stationary=_h_cols(bd[:E, :], kt, cfg.KT),
                               moving=part[:E, :T], accumulate=j > 0)
        if not parts:       # open the accumulation groups with zeros (a K=1 matmul per bank)
            for i in range(cfg.t_banks):
                n = min(cfg.kt_bank, cfg.KT - i * cfg.kt_bank)
                nisa.nc_matmul(dst=acc.banks[i][:, :n, :T], stationary=consts.ones_bf[0:1, :],
                               moving=consts.zeros_bf[0:1, :n * T], accumulate=False)
        return acc
    for i, (c0, cw) in enumerate(cfg.chunks):
        ps = acc.banks[i] if acc.psum else acc.ring[i % 2]
        for j, part in enumerate(parts):
            nisa.nc_matmul(dst=ps[:T, :cw], stationary=part[:E, :T], moving=bd[:E, c0:c0 + cw], accumulate=j > 0)
        if not parts and acc.psum:      # open the accumulation group with zeros (a K=1 matmul)
            nisa.nc_matmul(dst=ps[:T, :cw], stationary=consts.ones_bf[0:1, :T], moving=consts.zeros_bf[0:1, :cw],
                           accumulate=False)
        if not acc.psum:
            if parts:
                nisa.tensor_copy(dst=acc.sb[:T, c0:c0 + cw], src=ps[:T, :cw])
            else:
                nisa.memset(dst=acc.sb[:T, c0:c0 + cw], value=0.0)
    return acc


class _Ring(nl.NKIObject):
    """Buffers of the expert loop, allocated once: nbuf weight slots (the DMA of slot j + nbuf waits for slot j's
    matmuls: the modelled prefetch depth is what is allocated), n_gu PSUM sets of gate/up accumulators (plus the
    slot's broadcast affinities), two activation tiles and the activation temporaries."""

    def __init__(self, cfg, consts=None):
        KT, I2, MT, H, GS = cfg.KT, 2 * cfg.inter, cfg.MT, cfg.H, cfg.GS
        self.wgu = tuple(nl.ndarray((P_MAX, KT, I2), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        self.wd = tuple(nl.ndarray((P_MAX, MT, H), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        # the gate/up bias row of a slot: on partition BGU_ROW (its DMA on the engine of partitions 120-127, which the
        # down rows' partial tiles leave the least loaded, not on engine 0 with the router bias and the stores), used
        # as a K = 32 contraction block [BGU_Q0, 128) of zeros but that row, against a column of zeros but a 1 there
        self.brow = 0 if cfg.flip or consts is None else BGU_ROW
        self.bgu = tuple(nl.ndarray((self.brow + 1, I2) if self.brow == 0 else (P_MAX, I2), dtype=cfg.dtype,
                                    buffer=nl.sbuf) for _ in range(cfg.nbuf))
        if self.brow:
            for t in self.bgu:
                nisa.memset(dst=t[BGU_Q0:P_MAX, :], value=0.0, engine=nisa.engine.gpsimd)
            self.e1 = nl.ndarray((P_MAX, GS), dtype=cfg.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=self.e1[BGU_Q0:P_MAX, :], data=consts.ones_f32[BGU_Q0:P_MAX, :GS], op0=nl.multiply,
                               operand0=consts.ident[BGU_Q0:P_MAX, BGU_ROW:BGU_ROW + 1])
        if cfg.flip:
            self.ps_f = tuple(nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in range(cfg.n_gu))
            self.ps_t = nl.ndarray((P_MAX, MT, GS), dtype=cfg.dtype, buffer=nl.psum)
            self.act_tok = tuple(nl.ndarray((P_MAX, cfg.inter), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(2))
            self.tmp_tok = tuple(tuple(nl.ndarray((P_MAX, cfg.inter), dtype=nl.float32, buffer=nl.sbuf)
                                       for _ in range(4)) for _ in range(2))
        else:
            self.ps_gu = tuple(nl.ndarray((P_MAX, cfg.n_acc + 1, GS), dtype=nl.float32, buffer=nl.psum)
                               for _ in range(cfg.n_gu))
        self.act = tuple(nl.ndarray((P_MAX, MT, GS), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(2))
        self.tmp = tuple(tuple(nl.ndarray((P_MAX, max(GS, MT)), dtype=nl.float32, buffer=nl.sbuf) for _ in range(5))
                         for _ in range(2))
        self.n = 0      # experts issued so far (ring position)
        self.par = None     # tile_off's parity when set (the LNC=2 T=1 H split: the slot's, both cores agree)
        self.spread = None  # _Spread: the partial I tile's down rows spread over the DMA engines (T = 1, LNC 1)

    def bias_row(self, b):
        """Slot b's gate/up bias row [1, 2I] (the DMA destination)."""
        return self.bgu[b][self.brow:self.brow + 1, :]

    def tile_off(self, pt, m):
        """First partition of I tile m for the expert now issued. A partial tile of <= 64 rows sits at partition 64
        on every other expert: a DMA engine serves 8 partitions, so a tile at partition 0 always loads through the
        low engines (GPT-OSS-120B TP16: 52 rows, engines 0-6); alternating spreads the down rows over the 16."""
        if self.spread is not None:     # _Spread: a partial tile ends at partition 127 (all 128 rows written)
            return P_MAX - pt.rows[m]
        par = self.n % 2 if self.par is None else self.par
        if m > 0 and pt.rows[m] <= HALF_P and par == 1:
            return HALF_P
        return 0


def _load_expert_step(cfg, pt, ring, b, e, w_gate_up, w_down, b_gate_up, last=False):
    """Expert e's weights (I columns pt.col0 .. + pt.inter: all of them, or this core's half of a split expert)
    into slot b: gate/up [128, KT, 2 * pt.inter] in ONE DMA (H row p * KT + kt on partition p: KT * 2I contiguous
    elements per partition for a whole expert, the longest run the layout has: DMA efficiency run / (run + 256 B)),
    down [rows, MT, H] per I tile m (I row m * 128 + p at partition tile_off + p: rows of H contiguous elements), the
    gate/up bias row. The last expert of a static schedule (`last`) loads gate/up in two kt halves instead: nothing
    streams behind it, so its gate/up matmuls on the first half overlap the second half's load (the tail)."""
    KT, inter, n, c0 = cfg.KT, cfg.inter, pt.inter, pt.col0
    I2 = 2 * inter
    if b_gate_up is not None:
        if n == inter:
            nisa.dma_copy(dst=ring.bias_row(b), src=_expert_src(b_gate_up, e, [[I2, 1], [1, I2]], 0, I2))
        else:
            nisa.dma_copy(dst=ring.bgu[b].ap([[I2, 1], [n, 2], [1, n]], offset=ring.brow * I2),
                          src=_expert_src(b_gate_up, e, [[I2, 1], [inter, 2], [1, n]], c0, I2))
    _load_gate_up_step(cfg, pt, ring, b, e, w_gate_up, halves=2 if last and KT >= 2 else 1)
    _load_down_step(cfg, pt, ring, b, e, w_down)


def _load_gate_up_step(cfg, pt, ring, b, e, w_gate_up, halves=1):
    """Expert e's gate/up rows into slot b (see _load_expert_step), in `halves` kt pieces."""
    KT, inter, H, n, c0 = cfg.KT, cfg.inter, cfg.H, pt.inter, pt.col0
    I2 = 2 * inter
    for i in range(halves):
        k0, k1 = i * KT // halves, (i + 1) * KT // halves
        if n == inter:
            src = _expert_src(w_gate_up, e, [[KT * I2, P_MAX], [1, (k1 - k0) * I2]], k0 * I2, H * I2)
            nisa.dma_copy(dst=ring.wgu[b][:, k0:k1, :], src=src)
        else:       # this core's columns of gate and of up: two runs of n elements per H row
            src = _expert_src(w_gate_up, e, [[KT * I2, P_MAX], [I2, k1 - k0], [inter, 2], [1, n]], k0 * I2 + c0, H * I2)
            dst = ring.wgu[b].ap([[KT * I2, P_MAX], [I2, k1 - k0], [n, 2], [1, n]], offset=k0 * I2)
            nisa.dma_copy(dst=dst, src=src)


def _tail_tiles(pt):
    """I tiles in the order the last expert loads and contracts them: partial tiles first, so that the tile whose
    rows arrive last is a full one over all 16 DMA engines and only its KT matmuls follow the last weight byte."""
    return [m for m in range(pt.MT) if pt.rows[m] < I_TILE] + [m for m in range(pt.MT) if pt.rows[m] == I_TILE]


def _load_down_step(cfg, pt, ring, b, e, w_down, h0=0, hw=None, dst=None, tiles=None, last_cols=None):
    """Expert e's down rows (I columns of pt) per I tile into slot b: H columns [h0, h0 + hw) of each row (default
    all) into dst [128, MT, hw] (default the slot's [128, MT, H]); tiles: their order (default 0 .. MT-1);
    last_cols: the last tile's rows in these column ranges, one DMA each (default one DMA)."""
    inter, H, c0 = cfg.inter, cfg.H, pt.col0
    hw = H if hw is None else hw
    dst = ring.wd[b] if dst is None else dst
    if ring.spread is not None and ring.spread.pair(ring.n) and dst is ring.wd[b]:     # every row at once
        ring.spread.load(cfg, pt, ring, b, e, w_down, last_cols or ((0, hw),), h0)
        return
    order = list(range(pt.MT) if tiles is None else tiles)
    for m in order:
        rows, o = pt.rows[m], ring.tile_off(pt, m)
        cols = last_cols if m == order[-1] and last_cols is not None else ((0, hw),)
        if ring.spread is not None and m == ring.spread.m and dst is ring.wd[b]:
            ring.spread.load(cfg, pt, ring, b, e, w_down, cols, h0)
            continue
        for a, z in cols:
            src = _expert_src(w_down, e, [[H, rows], [1, z - a]], (c0 + m * I_TILE) * H + h0 + a, inter * H)
            nisa.dma_copy(dst=dst[o:o + rows, m, a:z], src=src)


def _gate_up_step(cfg, pt, consts, ring, b, hT, aff_col, has_bias):
    """gate^T / up^T [rows, T] per I tile, fp32 in PSUM: weights stationary (128 H x rows of I), the tokens moving
    (T columns), contracted over the KT H tiles; the bias is a K=1 matmul (bias row x ones) opening each group.
    A tile placed at partition o = tile_off (> 0) takes the o columns before it too (recomputed, unused): the
    matmul's output partition is the stationary column, so its rows land on partitions o .. o + rows.
    Group n_acc gets the slot's affinities broadcast to all partitions, aff[p, t] = aff_col[t] (a ones matmul
    over diag(aff_col): exact in fp32)."""
    hT = _hT_of(hT)
    T, inter = cfg.T, pt.inter
    ps = ring.ps_gu[ring.n % cfg.n_gu]
    diag = ring.tmp[ring.n % 2][4]
    nisa.tensor_scalar(dst=diag[:T, :T], data=consts.ident[:T, :T], op0=nl.multiply, operand0=aff_col)
    nisa.nc_matmul(dst=ps[:, cfg.n_acc, :T], stationary=consts.ones_f32[:T, :], moving=diag[:T, :T],
                   accumulate=False)
    groups = []
    for c in range(2):
        for m in range(pt.MT):
            o = ring.tile_off(pt, m)
            groups.append((c * inter + m * I_TILE - o, o + pt.rows[m]))
    if has_bias:
        for g, (c0, n) in enumerate(groups):
            if ring.brow:
                nisa.nc_matmul(dst=ps[:n, g, :T], stationary=ring.bgu[b][BGU_Q0:P_MAX, c0:c0 + n],
                               moving=ring.e1[BGU_Q0:P_MAX, :T], accumulate=False)
            else:
                nisa.nc_matmul(dst=ps[:n, g, :T], stationary=ring.bgu[b][0:1, c0:c0 + n],
                               moving=consts.ones_bf[0:1, :T], accumulate=False)
    for kt in range(cfg.KT):
        for g, (c0, n) in enumerate(groups):
            nisa.nc_matmul(dst=ps[:n, g, :T], stationary=ring.wgu[b][:, kt, c0:c0 + n],
                           moving=hT[:, kt, :T], accumulate=(kt > 0 or has_bias))
    return ps


def _gate_up_tok_step(cfg, pt, consts, ring, b, hT, has_bias):
    """cfg.flip: gate | up [T, 2I] fp32 in one PSUM bank, the tokens stationary (hT tile kt, M = T) and the expert's
    gate/up rows moving (N = 2I), contracted over KT; the bias a K=1 matmul (ones x bias row) opening the group."""
    hT = _hT_of(hT)
    T, n2 = cfg.T, 2 * pt.inter
    ps = ring.ps_f[ring.n % cfg.n_gu]
    if has_bias:
        nisa.nc_matmul(dst=ps[:T, :n2], stationary=consts.ones_bf[0:1, :T], moving=ring.bgu[b][0:1, :n2],
                       accumulate=False)
    for kt in range(cfg.KT):
        nisa.nc_matmul(dst=ps[:T, :n2], stationary=hT[:, kt, :T], moving=ring.wgu[b][:, kt, :n2],
                       accumulate=(kt > 0 or has_bias))
    return ps


def _activation_tok_step(cfg, pt, ring, ps, aff_col):
    """cfg.flip: act [T, I] = aff · act(gate, up) with the tokens on the partitions (aff_col [T, 1] a per-partition
    scalar; the same operations and rounding order as _activation_step), then act^T per I tile by TensorE
    transposes (one PSUM bank, exact for bf16) into the [rows, MT, T] tile the down projection takes."""
    T, n = cfg.T, pt.inter
    act_tok = ring.act_tok[ring.n % 2]
    g, sg, glu, u = ring.tmp_tok[ring.n % 2]
    gate, up = ps[:T, 0:n], ps[:T, n:2 * n]
    if cfg.activation == "clamped_swiglu":
        nisa.tensor_scalar(dst=g[:T, :n], data=gate, op0=nl.minimum, operand0=GPT_OSS_SWIGLU_LIMIT)
        nisa.activation(dst=sg[:T, :n], op=nl.sigmoid, data=g[:T, :n], scale=GPT_OSS_SWIGLU_ALPHA)
        nisa.tensor_tensor(dst=glu[:T, :n], data1=g[:T, :n], data2=sg[:T, :n], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_scalar(dst=u[:T, :n], data=up, op0=nl.maximum, operand0=-GPT_OSS_SWIGLU_LIMIT,
                           op1=nl.minimum, operand1=GPT_OSS_SWIGLU_LIMIT)
        nisa.tensor_scalar(dst=u[:T, :n], data=u[:T, :n], op0=nl.add, operand0=1.0, op1=nl.multiply,
                           operand1=aff_col)
        nisa.tensor_tensor(dst=act_tok[:T, :n], data1=u[:T, :n], data2=glu[:T, :n], op=nl.multiply)
    else:
        nisa.activation(dst=sg[:T, :n], op=nl.silu, data=gate)
        nisa.tensor_tensor(dst=u[:T, :n], data1=sg[:T, :n], data2=up, op=nl.multiply)
        nisa.tensor_scalar(dst=act_tok[:T, :n], data=u[:T, :n], op0=nl.multiply, operand0=aff_col)
    act = ring.act[ring.n % 2]
    for m in range(pt.MT):
        o = ring.tile_off(pt, m)
        c0, w = m * I_TILE - o, o + pt.rows[m]      # a tile at partition o takes the o columns before it too
        nisa.nc_transpose(dst=ring.ps_t[:w, m, :T], data=act_tok[:T, c0:c0 + w])
        evict(m, act[o:w, m, :T], ring.ps_t[o:w, m, :T])
    return act


def _activation_step(cfg, pt, ring, ps, act=None):
    """act^T [rows, T] = aff · act(gate, up) (I on partitions: the down projection's contraction), the weights'
    dtype; fp32 until that rounding.

    clamped_swiglu (GPT-OSS): g = min(gate, L); act = (clip(up, −L, L) + 1) · aff · g · sigmoid(α g).
    swiglu: act = silu(gate) · up · aff."""
    T, MT = cfg.T, pt.MT
    act = ring.act[ring.n % 2] if act is None else act
    g, sg, glu, u, _ = ring.tmp[ring.n % 2]
    if ring.spread is not None:
        # T = 1 with every I tile on all 128 partitions (_Spread): one pass over the MT tiles (the tiles' columns)
        aff = ps[:, cfg.n_acc, 0:1]
        gate, up = ps[:, 0:MT, 0], ps[:, MT:2 * MT, 0]
        gs, sgs, glus, us = (x[:, 0:MT] for x in (g, sg, glu, u))
        if cfg.activation == "clamped_swiglu":
            nisa.tensor_scalar(dst=gs, data=gate, op0=nl.minimum, operand0=GPT_OSS_SWIGLU_LIMIT)
            nisa.activation(dst=sgs, op=nl.sigmoid, data=gs, scale=GPT_OSS_SWIGLU_ALPHA)
            nisa.tensor_tensor(dst=glus, data1=gs, data2=sgs, op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.tensor_scalar(dst=us, data=up, op0=nl.maximum, operand0=-GPT_OSS_SWIGLU_LIMIT,
                               op1=nl.minimum, operand1=GPT_OSS_SWIGLU_LIMIT)
            nisa.tensor_scalar(dst=us, data=us, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=aff)
            nisa.tensor_tensor(dst=act[:, 0:MT, 0], data1=us, data2=glus, op=nl.multiply)
        else:
            nisa.activation(dst=sgs, op=nl.silu, data=gate)
            nisa.tensor_tensor(dst=us, data1=sgs, data2=up, op=nl.multiply)
            nisa.tensor_scalar(dst=act[:, 0:MT, 0], data=us, op0=nl.multiply, operand0=aff)
        return act
    for m in range(MT):
        o = ring.tile_off(pt, m)
        r = slice(o, o + pt.rows[m])
        aff = ps[r, cfg.n_acc, :T]
        gate, up = ps[r, m, :T], ps[r, MT + m, :T]
        if cfg.activation == "clamped_swiglu":
            nisa.tensor_scalar(dst=g[r, :T], data=gate, op0=nl.minimum, operand0=GPT_OSS_SWIGLU_LIMIT)
            nisa.activation(dst=sg[r, :T], op=nl.sigmoid, data=g[r, :T], scale=GPT_OSS_SWIGLU_ALPHA)
            nisa.tensor_tensor(dst=glu[r, :T], data1=g[r, :T], data2=sg[r, :T], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_scalar(dst=u[r, :T], data=up, op0=nl.maximum, operand0=-GPT_OSS_SWIGLU_LIMIT,
                               op1=nl.minimum, operand1=GPT_OSS_SWIGLU_LIMIT)
            nisa.scalar_tensor_tensor(dst=u[r, :T], data=u[r, :T], op0=nl.add, operand0=1.0,
                                      op1=nl.multiply, operand1=aff)
            nisa.tensor_tensor(dst=act[r, m, :T], data1=u[r, :T], data2=glu[r, :T], op=nl.multiply)
        else:
            nisa.activation(dst=sg[r, :T], op=nl.silu, data=gate)
            nisa.tensor_tensor(dst=u[r, :T], data1=sg[r, :T], data2=up, op=nl.multiply)
            nisa.tensor_tensor(dst=act[r, m, :T], data1=u[r, :T], data2=aff, op=nl.multiply)
    return act


def _down_step(cfg, pt, ring, b, act, acc, tiles=None):
    """acc += act @ W_down (the affinity is already in act), contracted over the I tiles (tile m as soon as its rows
    arrived). outT: the down rows stationary (128 H columns h = p * KT + kt), act^T moving (T columns) into
    out^T tile kt. Else the tokens' activations stationary (M = T), the down rows moving (512 H columns per PSUM
    bank): PSUM accumulator straight into the bank; SBUF accumulator via a ring bank, then one add."""
    T = cfg.T
    if acc.T:
        kts = list(range(cfg.KT))
        if cfg.ncores > 1:      # the other core's kt half first: its eviction and send start before our half ends
            half = cfg.KT // 2
            kts = kts[half:] + kts[:half] if cfg.core == 0 else kts
        sp = ring.spread
        for m in ([None] if sp is not None and sp.pair(ring.n) and tiles is None else range(pt.MT) if tiles is None
                  else tiles):
            for w, mv in _down_operands(cfg, pt, ring, b, act, m):
                for kt in kts:
                    nisa.nc_matmul(dst=acc.col(cfg, kt), stationary=_hb_cols(w, kt, acc.hblocks), moving=mv,
                                   accumulate=True)
        return
    if acc.psum:
        for m in range(pt.MT):
            o = ring.tile_off(pt, m)
            r = slice(o, o + pt.rows[m])
            for i, (c0, cw) in enumerate(cfg.chunks):
                nisa.nc_matmul(dst=acc.banks[i][:T, :cw], stationary=act[r, m, :T],
                               moving=ring.wd[b][r, m, c0:c0 + cw], accumulate=True)
        return
    for c0, cw in cfg.chunks:
        pd = acc.ring[acc.nd % 2]
        acc.nd += 1
        for m in range(pt.MT):
            o = ring.tile_off(pt, m)
            r = slice(o, o + pt.rows[m])
            nisa.nc_matmul(dst=pd[:T, :cw], stationary=act[r, m, :T], moving=ring.wd[b][r, m, c0:c0 + cw],
                           accumulate=m > 0)
        nisa.tensor_tensor(dst=acc.sb[:T, c0:c0 + cw], data1=pd[:T, :cw], data2=acc.sb[:T, c0:c0 + cw], op=nl.add)


def _down_operands(cfg, pt, ring, b, act, m):
    """(down rows [K, H], act^T [K, T]) pairs contracting I tile m of slot b (outT layout); with a _Spread: its
    partial tile over all 128 partitions against the permuted act^T, or (pair mode, m = None: all tiles) the two
    rows of every partition against the two permuted act^T columns."""
    sp, T = ring.spread, cfg.T
    if sp is not None and sp.pair(ring.n):
        return [(ring.wd[b][:, h, :], sp.act[ring.n % 2][:, h:h + 1]) for h in range(2)]
    if sp is not None and m == sp.m:
        return [(ring.wd[b][:, m, :], sp.act[ring.n % 2][:, 0:T])]
    o = ring.tile_off(pt, m)
    r = slice(o, o + pt.rows[m])
    return [(ring.wd[b][r, m, :], act[r, m, :T])]


def _expert_step(cfg, consts, ring, e, aff_col, hT, acc, w_gate_up, w_down, b_gate_up, last=False, pt=None):
    """One expert on all T tokens: load (slot n % nbuf), gate/up, activation (× affinity), down into acc. pt: the
    part of the expert's I columns (default: all, cfg.part)."""
    pt = cfg.part if pt is None else pt
    _load_expert_step(cfg, pt, ring, ring.n % cfg.nbuf, e, w_gate_up, w_down, b_gate_up, last)
    return _expert_compute_step(cfg, consts, ring, aff_col, hT, acc, b_gate_up, pt)


def _expert_compute_step(cfg, consts, ring, aff_col, hT, acc, b_gate_up, pt=None, tiles=None):
    """The compute of the expert at ring position ring.n (its weights loaded into slot n % nbuf): gate/up,
    activation (x affinity), down into acc; advances the ring."""
    pt = cfg.part if pt is None else pt
    act = _expert_front_step(cfg, consts, ring, aff_col, hT, b_gate_up, pt)
    _down_step(cfg, pt, ring, ring.n % cfg.nbuf, act, acc, tiles)
    ring.n += 1


def _expert_front_step(cfg, consts, ring, aff_col, hT, b_gate_up, pt=None):
    """Gate/up and the activation (x affinity) of the expert at ring position ring.n: its act^T tile."""
    pt = cfg.part if pt is None else pt
    b = ring.n % cfg.nbuf
    if cfg.flip:
        ps = _gate_up_tok_step(cfg, pt, consts, ring, b, hT, b_gate_up is not None)
        return _activation_tok_step(cfg, pt, ring, ps, aff_col)
    ps = _gate_up_step(cfg, pt, consts, ring, b, hT, aff_col, b_gate_up is not None)
    act = _activation_step(cfg, pt, ring, ps)
    if ring.spread is not None:
        ring.spread.permute(ring, act)
    return act


def _one_token_experts(cfg, consts, ring, idx, aff, hT, w_gate_up, w_down, b_gate_up, b_down, out):
    """T = 1, selective: the token's k experts are distinct (max8 picks k positions), so slot s IS idx[0, s] --
    the DMAs are addressed by the top-k tile's elements, no dense affinities, compaction or gate on the critical path
    to the first weight DMA; every slot runs (LNC=2: the cores take alternate slots).

    Down biases: the k rows as one contraction block (_BiasBlock) when every slot is here (k >= 2), else slot s's
    row b_down[e] is loaded in the out^T layout ([128, KT], h = p * KT + kt) and bsum += aff_s * row in fp32 (aff_s
    broadcast to the partitions by a ones matmul: exact); bsum is added to this core's partial at the eviction.
    LNC 1, k >= 2: the last two experts' down rows and compute go through _last_two_tail (out^T in kt blocks, each
    stored as soon as it is complete)."""
    slots = [s for s in range(cfg.k) if s % cfg.ncores == cfg.core]
    # the expert ids address the weight DMAs straight from the top-k tile (scalar_offset = a 1x1 SBUF tensor): no
    # register load between nc_find_index8 and the first weight DMA
    regs = [idx[0:1, s:s + 1] for s in slots]
    n = len(slots)
    has_blk = b_down is not None and n >= 2 and n == cfg.k and _BiasBlock.fits(n)
    tail = cfg.ncores == 1 and n >= 2 and (has_blk or b_down is None)
    pt = cfg.part
    if tail and pt.MT >= 2 and pt.rows[pt.MT - 1] < I_TILE:
        ring.par = 0
        # engine 15 (partitions 120-127) also carries the bias block's 2n rows and the n gate/up bias rows (in
        # down-row units: their bytes over a row's)
        extra = (2 * n if has_blk else 0) + (n * 2 * cfg.inter / cfg.H if b_gate_up is not None else 0)
        ring.spread = _Spread(cfg, consts, ring, pt, n, extra)
    blk = _BiasBlock(cfg, consts, aff, n, cfg.H, cfg.KT) if has_blk else None
    acc = _init_acc_step(cfg, consts, None, None, False)
    if tail:    # out^T in kt blocks: the last tile's rows load per block, each block is stored when complete
        acc.hblocks = _tail_blocks(cfg.KT)
        if blk is not None:
            blk.blocks = acc.hblocks
    # with a tail and experts before the last two, the bias rows load after the first expert's weights (their DMA
    # engine, partitions 120-127, is then ahead of the others) and are contracted while TensorE waits for the next
    # expert: their KT matmuls no longer sit in the last expert's chain
    early_blk = tail and blk is not None and n > 2
    for j, s in enumerate(slots[:n - 2] if n >= 2 else slots):
        _expert_step(cfg, consts, ring, regs[j], aff[0:1, s:s + 1], hT, acc, w_gate_up, w_down, b_gate_up,
                     last=j == n - 1)
        if early_blk and j == 0:
            blk.load(cfg, regs, b_down, 0)
            blk.add(lambda kt: acc.col(cfg, kt))
    if n >= 2:
        # the last two: both gate/up loads before both down loads, so the last expert's gate/up and activation
        # run under the down rows' stream and only its down matmuls follow the last weight byte
        base, pt, I2 = ring.n, cfg.part, 2 * cfg.inter
        for j in (n - 2, n - 1):
            ring.n = base + j - (n - 2)
            b = ring.n % cfg.nbuf
            if b_gate_up is not None:
                nisa.dma_copy(dst=ring.bias_row(b), src=_expert_src(b_gate_up, regs[j], [[I2, 1], [1, I2]], 0, I2))
            _load_gate_up_step(cfg, pt, ring, b, regs[j], w_gate_up, halves=GU_PIECES_LAST if j == n - 1 else 1)
        if tail:
            if blk is not None and not early_blk:
                blk.load(cfg, regs, b_down, 0)
            _last_two_tail(cfg, consts, ring, base, regs[n - 2:], [aff[0:1, s:s + 1] for s in slots[n - 2:]], hT,
                           acc, w_down, b_gate_up, out, None if early_blk else blk)
            ring.spread, ring.par = None, None
            return
        if blk is not None:
            blk.load(cfg, regs, b_down, 0)
        for j in (n - 2, n - 1):
            ring.n = base + j - (n - 2)
            _load_down_step(cfg, pt, ring, ring.n % cfg.nbuf, regs[j], w_down, tiles=_tail_tiles(pt))
        if blk is not None:
            blk.add(lambda kt: acc.col(cfg, kt))
        ring.n = base
        for j in (n - 2, n - 1):
            _expert_compute_step(cfg, consts, ring, aff[0:1, slots[j]:slots[j] + 1], hT, acc, b_gate_up,
                                 tiles=_tail_tiles(pt))
    bsum = None if blk is not None else _slot_bias_step(cfg, consts, slots, regs, aff, b_down)
    _store_out_step(cfg, acc, out, bsum)


def _tail_blocks(KT, last=2):
    """kt blocks of out^T for the T = 1 tail (_hb_cols), decreasing: KT - KT/4 - last, KT/4, last. The last tile's
    rows load per block, so while block j's rows stream, TensorE contracts block j - 1 and only the last (small)
    block's matmuls, its eviction and its store follow the last weight byte. LNC 1: last = 2 (the LNC=2 H split
    has its own, _hsplit_blocks). One block when the sizes would not decrease."""
    mid = max(1, KT // 4)
    sizes = [KT - mid - last, mid, last] if KT - mid - last >= mid >= last else [KT]
    out, k0 = [], 0
    for g in sizes:
        out.append((k0, g))
        k0 += g
    return tuple(out)


def _hsplit_blocks(KH):
    """kt blocks of the H split's out^T half (_one_token_hsplit): two, KH - KH/4 and KH/4 (9 / 3 at KH = 12). After
    the activation swaps became rows (_ActSwap) and the routing shorter, modelled 0.02 us better at GPT-OSS-20B TP8
    T = 1 trn3 than _tail_blocks' 8 / 3 / 1 (which paid a 256 B-run DMA for its last kt and an eviction waiting for
    the middle block's), and than 8 / 4, 7 / 3 / 2, 7 / 4 / 1, 10 / 2, 9 / 2 / 1 (0.03-0.09 us slower)."""
    return ((0, KH - KH // 4), (KH - KH // 4, KH // 4)) if KH >= 4 else ((0, KH),)


def _last_two_tail(cfg, consts, ring, base, regs, aff_cols, hT, acc, w_down, b_gate_up, out, blk):
    """T = 1, LNC 1: the down rows of the last two experts (ring positions base, base + 1; their gate/up already
    loading) and their compute with out^T in acc.hblocks. Rows load and contract in one order: both experts'
    partial I tiles (the two halves' DMA engines), then their full tiles, the very last tile in column blocks
    (one DMA each); the down matmuls follow that order (they accumulate into the same PSUM banks, so program order
    is their order), so TensorE is never held behind rows that land later. Each kt block is evicted (rounded to
    the output dtype) and stored as soon as the last tile's block is contracted (out[0, 128 k0 + p g + i] =
    o[p, k0 + i]: g-element runs per partition); only the last block's matmuls, eviction and store follow the
    last weight byte."""
    pt, KT = cfg.part, cfg.KT
    tiles = _tail_tiles(pt)
    order = [(j, m) for m in tiles if pt.rows[m] < I_TILE for j in (0, 1)] + \
        [(j, m) for m in tiles if pt.rows[m] == I_TILE for j in (0, 1)]
    last_cols = tuple((P_MAX * k0, P_MAX * (k0 + g)) for k0, g in acc.hblocks)
    for i, (j, m) in enumerate(order):
        ring.n = base + j
        _load_down_step(cfg, pt, ring, ring.n % cfg.nbuf, regs[j], w_down, tiles=[m],
                        last_cols=last_cols if i == len(order) - 1 else None)
    if blk is not None:
        blk.add(lambda kt: acc.col(cfg, kt))
    acts = []
    for j in (0, 1):
        ring.n = base + j
        acts.append(_expert_front_step(cfg, consts, ring, aff_cols[j], hT, b_gate_up, pt))
    for j, m in order[:-1]:
        ring.n = base + j
        _down_step(cfg, pt, ring, ring.n % cfg.nbuf, acts[j], acc, [m])
    j, m = order[-1]
    ring.n = base + j
    b = ring.n % cfg.nbuf
    ops = _down_operands(cfg, pt, ring, b, acts[j], m)
    o_sb = nl.ndarray((P_MAX, KT), dtype=out.dtype, buffer=nl.sbuf)
    for k0, g in acc.hblocks:
        for kt in range(k0, k0 + g):
            for w, mv in ops:
                nisa.nc_matmul(dst=acc.col(cfg, kt), stationary=_hb_cols(w, kt, acc.hblocks), moving=mv,
                               accumulate=True)
        i, c = k0 // cfg.kt_bank, k0 % cfg.kt_bank
        nisa.tensor_copy(dst=o_sb[:, k0:k0 + g], src=acc.banks[i][:, c:c + g, 0])
        nisa.dma_copy(dst=out.ap([[g, P_MAX], [1, g]], offset=P_MAX * k0), src=o_sb[:, k0:k0 + g])
    ring.n = base + 2


def _spread_counts(R, g0, G, rot):
    """Rows per DMA engine of a _Spread layout (g0, G, rot): row r on engine g0 + (r + rot) % G."""
    c = [0] * (P_MAX // 8)
    for q in range(rot, rot + R):
        c[g0 + q % G] += 1
    return c


class _Spread(nl.NKIObject):
    """T = 1, LNC 1 (and LNC 2's H split: pairs=False, positions = the k down loads, dcol = the half's columns):
    an expert's down rows spread over the 16 DMA engines (a DMA engine serves 8 partitions: the
    52-row partial I tile of GPT-OSS-120B TP16 at partition 0 loads through engines 0-6 only). Per ring position j:
    - pair mode (2 I tiles, I even, I / 2 <= 128; the experts before the last two): every partition holds two
      consecutive I rows (one 2H-element run in HBM: 12 KiB at H 3072, DMA efficiency ~0.98 instead of ~0.96 for
      6 KiB rows), R = I / 2 units. Not for the last two: their down matmuls could then only start once all rows
      of an expert landed (TensorE, not the stream, would end the kernel);
    - else the partial tile m = MT - 1 (R < 128 rows), one row per partition (the full tiles as they are).
    Layout (g0, G, rot): unit u (q = u + rot) on partition 8 (g0 + q % G) + q // G, one DMA per engine (its units
    are every G-th: G units apart in HBM), chosen at trace time, expert by expert, to even the rows per engine (the
    bias block's and the gate/up bias rows on engine 15 counted). Gate/up and the activation are unchanged but for
    the partial tile's place (partitions 128 - rows .. 127: every group writes all 128 partitions, one activation
    pass over the tiles); act^T is moved to the layout's partitions by matmuls against 0/1 matrices (exact: bf16
    values x 1 into fp32, rounded back to bf16 unchanged) and the down matmuls contract all 128 partitions (pair
    mode: rows h = 0, 1 of every partition against permuted column h): act^T is 0 on the partitions outside the
    layout, whose weight rows are zero (the slots' tiles are memset once) or an earlier expert's (finite)."""

    def __init__(self, cfg, consts, ring, pt, n, extra15, pairs=True):
        self.m = pt.MT - 1
        pairs_ok = pairs and pt.MT == 2 and pt.inter % 2 == 0
        self.pairs = tuple(pairs_ok and j < n - 2 for j in range(n))
        self.tile_rows = pt.rows
        ne = P_MAX // 8
        loads = [0] * ne
        loads[ne - 1] += extra15
        self.lay = []
        for j in range(n):
            R = self.units(pt, j)
            best = None
            for g0, G in ((0, ne), (0, ne - 1), (1, ne - 1)):
                for rot in range(G):
                    if rot + R > 8 * G:
                        continue
                    c = _spread_counts(R, g0, G, rot)
                    new = [a + (2 * x if self.pairs[j] else x) for a, x in zip(loads, c)]
                    key = (max(new), sorted(new, reverse=True))
                    if best is None or key < best[0]:
                        best = (key, (g0, G, rot), new)
            self.lay.append(best[1])
            loads = best[2]
        gp = nisa.engine.gpsimd
        # zeros (as fp32 words: half the elements to write) on every partition a layout may leave out
        for b in range(cfg.nbuf):
            js = [j for j in range(n) if j % cfg.nbuf == b]
            if js:
                zt = ring.wd[b] if any(self.pairs[j] for j in js) else ring.wd[b][:, self.m, :]
                nisa.memset(dst=zt.view(nl.float32), value=0.0, engine=gp)
        # I tile t sits on partitions [o_t, 128) (o_t = 128 - rows: every tile's gate/up group writes all 128
        # partitions, ring.tile_off), partition r holding I row 128 t - o_t + r. pm[j, i, h][r, 8 (g0 + gg) + i'] = 1
        # iff r >= o_t and that row is 2 (G i' + gg - rot) + h (pair mode, tile t = i; else row G i' + gg - rot of
        # tile m): built from z_o = [0 | 0 | identity masked to partitions >= o | 0], one strided copy per (j, i)
        zs = {}
        for t in (range(2) if pairs_ok else (self.m,)):
            o = P_MAX - pt.rows[t]
            if o in zs:
                continue
            z = nl.ndarray((P_MAX, 4 * P_MAX), dtype=cfg.dtype, buffer=nl.sbuf)
            nisa.memset(dst=z.view(nl.float32), value=0.0, engine=gp)
            if o == 0:
                nisa.tensor_copy(dst=z[:, 2 * P_MAX:3 * P_MAX], src=consts.ident, engine=gp)
            else:
                keep = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=keep, data=consts.part_idx, op0=nl.greater_equal, operand0=float(o))
                nisa.tensor_scalar(dst=z[:, 2 * P_MAX:3 * P_MAX], data=consts.ident, op0=nl.multiply,
                                   operand0=keep)
            zs[o] = z
        nt = 2 if pairs_ok else 1
        self.pm = nl.ndarray((P_MAX, n, nt, nt, P_MAX), dtype=cfg.dtype, buffer=nl.sbuf)
        row = n * nt * nt * P_MAX
        for j, (g0, G, rot) in enumerate(self.lay):
            for i, t in enumerate(range(2) if self.pairs[j] else (self.m,)):
                o = P_MAX - pt.rows[t]
                if self.pairs[j]:
                    dst = self.pm.ap([[row, P_MAX], [P_MAX, 2], [1, 8], [8, G]],
                                     offset=(j * nt + i) * nt * P_MAX + 8 * g0)
                    src = zs[o].ap([[4 * P_MAX, P_MAX], [1, 2], [2 * G, 8], [2, G]],
                                   offset=2 * P_MAX - 2 * rot - P_MAX * t + o)
                else:
                    dst = self.pm.ap([[row, P_MAX], [1, 8], [8, G]], offset=j * nt * nt * P_MAX + 8 * g0)
                    src = zs[o].ap([[4 * P_MAX, P_MAX], [G, 8], [1, G]], offset=2 * P_MAX - rot + o)
                nisa.tensor_copy(dst=dst, src=src, engine=gp)
            sets = nt * nt if self.pairs[j] else 1
            for g in [g for g in range(ne) if not g0 <= g < g0 + G]:
                nisa.memset(dst=self.pm.ap([[row, P_MAX], [P_MAX, sets], [1, 8]], offset=j * nt * nt * P_MAX + 8 * g),
                            value=0.0, engine=gp)
        self.ps = nl.ndarray((P_MAX, 2, 2), dtype=nl.float32, buffer=nl.psum)
        self.act = tuple(nl.ndarray((P_MAX, 2), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(2))

    def pair(self, j):
        return self.pairs[j]

    def units(self, pt, j):
        return pt.inter // 2 if self.pairs[j] else pt.rows[self.m]

    def load(self, cfg, pt, ring, b, e, w_down, cols, h0, dcol=0):
        """Expert e's rows (pair mode: all; else tile m) into slot b in the layout of ring position ring.n: one
        DMA per engine, column range and (pair mode, not whole rows) row h."""
        j = ring.n
        g0, G, rot = self.lay[j]
        H, R, pm = cfg.H, self.units(pt, j), self.pairs[j]
        k = 2 if pm else 1
        row0 = pt.col0 + (0 if pm else self.m * I_TILE)
        m0 = 0 if pm else self.m
        for gg in range(G):
            r0 = (gg - rot) % G
            if r0 >= R:
                continue
            c = (R - 1 - r0) // G + 1
            p0 = 8 * (g0 + gg) + (r0 + rot) // G
            for a, z in cols:
                # a column range of both rows of a partition in one DMA only when whole (two disjoint ranges would
                # order it after every DMA writing the columns between them)
                groups = [(0, 1)] if not pm else [(0, 2)] if z - a == H else [(0, 1), (1, 1)]
                for h, kk in groups:
                    src = _expert_src(w_down, e, [[G * k * H, c], [H, kk], [1, z - a]],
                                      (row0 + k * r0 + h) * H + h0 + a, cfg.inter * H)
                    nisa.dma_copy(dst=ring.wd[b][p0:p0 + c, m0 + h:m0 + h + kk, dcol + a:dcol + z], src=src)

    def permute(self, ring, act):
        """act^T onto the layout's partitions (zeros elsewhere): pair mode column h = rows 2 u + h."""
        j, q = ring.n % 2, ring.n
        nt = 2 if self.pairs[q] else 1
        tiles = range(2) if self.pairs[q] else (self.m,)
        for h in range(nt):
            for i, t in enumerate(tiles):
                nisa.nc_matmul(dst=self.ps[:, j, h:h + 1], stationary=self.pm[:, q, i, h, :],
                               moving=act[:, t, 0:1], accumulate=i > 0)
        nisa.tensor_copy(dst=self.act[j][:, 0:nt], src=self.ps[:, j, 0:nt])


class _BiasBlock(nl.NKIObject):
    """T = 1: the k routed experts' down biases as one more contraction block of the out^T accumulation, on the
    quadrant [96, 128): weight rows b_down[idx_s] (H columns h0 + p * KT + kt) at partitions q_s = 128 - 2k + s (hi)
    and q_s + k (lo), a moving column holding bf16 hi / lo parts of slot s's affinity there (a = hi + lo to 2^-18:
    exact bf16 products, fp32 sums in PSUM) and zeros on the other rows of the quadrant (whose weight rows are zeroed
    once: never-written memory must not meet a 0). KT matmuls of K = 32 add Σ_s a_s b_down[idx_s] into out^T.
    The rows are 2k KT*128-element runs through the DMA engine of partitions 120-127 (and 112-119 at k > 4), which
    the weight stream leaves the least loaded at I = 360 (104-row last tile) and I = 180 (52-row tiles at 0 / 64);
    the per-slot rows of _slot_bias_step were 2k-byte runs over all 16 engines (0.27-0.3 us on each per token)."""

    Q0 = 96

    @staticmethod
    def fits(k):
        return 2 * k <= P_MAX - _BiasBlock.Q0

    def __init__(self, cfg, consts, aff, k, W, KT):
        self.k, self.W, self.KT = k, W, KT
        self.blocks = ((0, KT),)        # out^T's H order (_hb_cols)
        Q0, r0 = self.Q0, P_MAX - 2 * k
        self.rows = nl.ndarray((P_MAX, W), dtype=cfg.dtype, buffer=nl.sbuf)
        if r0 > Q0:
            nisa.memset(dst=self.rows[Q0:r0, :], value=0.0, engine=nisa.engine.gpsimd)
        hl = nl.ndarray((1, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=hl, value=0.0)
        hi = nl.ndarray((1, MAX_TOP_K), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hi[0:1, :k], src=aff[0:1, :k])
        nisa.tensor_copy(dst=hl[0:1, r0:r0 + k], src=hi[0:1, :k])
        lo = nl.ndarray((1, MAX_TOP_K), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lo[0:1, :k], data1=aff[0:1, :k], data2=hl[0:1, r0:r0 + k], op=nl.subtract)
        nisa.tensor_copy(dst=hl[0:1, r0 + k:P_MAX], src=lo[0:1, :k])
        ps = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=hl, moving=consts.ones_f32[0:1, 0:1], accumulate=False)
        self.mv = nl.ndarray((P_MAX, 1), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=self.mv[Q0:P_MAX, :], src=ps[Q0:P_MAX, :])

    def load(self, cfg, regs, b_down, h0):
        """The k slots' rows (regs[s]: expert id registers or 1x1 SBUF tensors), hi and lo copies."""
        r0 = P_MAX - 2 * self.k
        for s in range(self.k):
            for q in (r0 + s, r0 + self.k + s):
                nisa.dma_copy(dst=self.rows[q:q + 1, :],
                              src=_expert_src(b_down, regs[s], [[self.W, 1], [1, self.W]], h0, cfg.H))

    def add(self, col):
        """acc += the block: col(kt) is out^T column tile kt of the accumulator."""
        Q0 = self.Q0
        for kt in range(self.KT):
            nisa.nc_matmul(dst=col(kt), stationary=_hb_cols(self.rows[Q0:P_MAX, :], kt, self.blocks),
                           moving=self.mv[Q0:P_MAX, 0:1], accumulate=True)


class _ActSwap(nl.NKIObject):
    """LNC=2 H split: an activation act^T [128, MT] (bf16, I on the partitions) sent to the other core as MT ROWS of
    128 elements on partitions Q .. Q + MT - 1 (the DMA engine of partitions 120-127) instead of 128 partitions of
    MT elements: a DMA costs every engine it touches ~256 B of overhead per partition (8 partitions each), so the
    column swap took ~0.063 us of ALL 16 engines' weight stream per activation, the rows ~0.016 us of one engine.
    Transposes by TensorE, exact (bf16 values x 1 into fp32 PSUM, zeros elsewhere): the sender copies act^T into
    columns Q - 96 .. of a [128, 32] zero tile and multiplies it (stationary) by a bf16 identity, the rows land on
    PSUM partitions Q ..; the receiver contracts the received rows' quadrant [96, 128) (zero but those rows) with
    the identity's columns Q .. (moving), which gives act^T [128, MT] back."""

    Q0 = 96
    Q = 120
    MAX_TILES = P_MAX - Q

    def __init__(self, cfg, consts, MT, n):
        gp = nisa.engine.gpsimd
        self.MT, self.c = MT, cfg.core
        self.z = nl.ndarray((P_MAX, P_MAX - self.Q0), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.z, value=0.0, engine=gp)
        self.ident = nl.ndarray((P_MAX, P_MAX), dtype=cfg.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=self.ident, src=consts.ident, engine=gp)
        self.ps = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
        self.psb = nl.ndarray((P_MAX, MT), dtype=nl.float32, buffer=nl.psum)
        self.rows = tuple(nl.ndarray((P_MAX, P_MAX), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(n))
        self.recv = tuple(nl.ndarray((P_MAX, P_MAX), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(n))
        for t in self.recv:
            nisa.memset(dst=t[self.Q0:P_MAX, :], value=0.0, engine=gp)

    def send(self, j, act, theirs, tiles=None):
        """Swap this core's activation act [128, MT, >= 1] (the j-th) for the other core's, into theirs. tiles: the
        (first partition, rows) of each I tile when act holds them only (no _Spread: the other partitions were never
        written, and one NaN there would spread over the whole transposed row through its 0 products); None: all 128
        partitions of every tile. Rows outside the tiles get zeros or an earlier activation's values (finite, never
        contracted by the receiver)."""
        Q0, Q, MT = self.Q0, self.Q, self.MT
        if tiles is None:
            nisa.tensor_copy(dst=self.z[:, Q - Q0:Q - Q0 + MT], src=act[:, 0:MT, 0])
        else:
            for m, (o, rows) in enumerate(tiles):
                nisa.tensor_copy(dst=self.z[o:o + rows, Q - Q0 + m:Q - Q0 + m + 1], src=act[o:o + rows, m, 0:1])
        nisa.nc_matmul(dst=self.ps[Q0:P_MAX, :], stationary=self.z, moving=self.ident, accumulate=False)
        row, recv = self.rows[j], self.recv[j]
        nisa.tensor_copy(dst=row[Q0:P_MAX, :], src=self.ps[Q0:P_MAX, :])
        nisa.sendrecv(src=row[Q:Q + MT, :], dst=recv[Q:Q + MT, :], send_to_rank=1 - self.c,
                      recv_from_rank=1 - self.c, pipe_id=1)
        nisa.nc_matmul(dst=self.psb[:, 0:MT], stationary=recv[Q0:P_MAX, :], moving=self.ident[Q0:P_MAX, Q:Q + MT],
                       accumulate=False)
        nisa.tensor_copy(dst=theirs[:, 0:MT, 0], src=self.psb[:, 0:MT])


def _one_token_hsplit(cfg, consts, ring, idx, aff, hT, w_gate_up, w_down, b_gate_up, b_down, out):
    """T = 1, LNC=2, k even: the cores split the DOWN projection by H halves instead of exchanging partial outputs.
    Core c computes gate/up and the activation of its slots (s % 2 == c, whole experts: each gate/up weight read by
    one core) and swaps each activation ([rows, MT] bf16, already x affinity) with the other core's (sendrecv);
    then it loads the H half [c * H/2, (c + 1) * H/2) of EVERY slot's down rows (each down weight byte read by one
    core; 3 KiB runs at H 3072) and accumulates out^T of its half, h = c * H/2 + p * KH + j (KH = KT/2), in PSUM,
    plus the k down biases of its half (_BiasBlock); it stores its half. The tail after the last weight byte is that
    tile's KH matmuls, the eviction and the store: no exchange of partial outputs after the stream.
    Program order: gate/up loads, their compute and the swaps, then the down loads: a swap is issued as soon as its
    activation is ready and is served by the DMA engines ahead of the (later in program order) down loads. A
    partial I tile sits at the offset of its SLOT's parity (ring.par) on both cores, so a swapped activation's rows
    are where the receiving core contracts them."""
    k, c, T, KT, H, MT = cfg.k, cfg.core, cfg.T, cfg.KT, cfg.H, cfg.MT
    H2, KH = H // 2, KT // 2
    pt = cfg.part
    blk = None
    if b_down is not None and _BiasBlock.fits(k):
        blk = _BiasBlock(cfg, consts, aff, k, H2, KH)
    regs = [idx[0:1, s:s + 1] for s in range(k)]     # expert ids as 1x1 SBUF scalar offsets (no register loads)
    mine = [s for s in range(k) if s % 2 == c]
    acts = {}
    spread = None
    if HSPLIT_SPREAD and pt.MT >= 2 and pt.rows[pt.MT - 1] < I_TILE:
        # the k down positions' partial tiles over the 16 DMA engines (_Spread, one layout per position, local to
        # this core: the swapped activations travel in the contiguous layout and are permuted here); engine 15
        # also carries the bias block's 2k rows and this core's gate/up bias rows (in half-row units)
        extra = (2 * k if blk is not None else 0) + \
            (len(mine) * 2 * cfg.inter / H2 if b_gate_up is not None else 0)
        ring.spread = spread = _Spread(cfg, consts, ring, pt, k, extra, pairs=False)
    # the last own gate/up in two kt pieces (its matmuls start on the first) unless the other down halves' stream is
    # long enough to hide its compute and swap anyway: one DMA is then fewer per-run overheads (20B: 0.06 us)
    gu_whole = (k - 1) * cfg.inter * H2 * 2 >= HSPLIT_GU_ONE_PIECE_BYTES
    swap = _ActSwap(cfg, consts, MT, len(mine)) if HSPLIT_ACT_ROWS and MT <= _ActSwap.MAX_TILES else None
    for j, s in enumerate(mine):     # this core's gate/up weights, then its activations (swapped as they come)
        b = j % cfg.nbuf
        if b_gate_up is not None:
            I2 = 2 * cfg.inter
            nisa.dma_copy(dst=ring.bias_row(b), src=_expert_src(b_gate_up, regs[s], [[I2, 1], [1, I2]], 0, I2))
        ring.par = s % 2
        _load_gate_up_step(cfg, pt, ring, b, regs[s], w_gate_up,
                           halves=GU_PIECES_LAST if j == len(mine) - 1 and KT >= 2 and not gu_whole else 1)
    for j, s in enumerate(mine):
        b = j % cfg.nbuf
        ring.par = s % 2
        ps = _gate_up_step(cfg, pt, consts, ring, b, hT, aff[0:1, s:s + 1], b_gate_up is not None)
        act = nl.ndarray((P_MAX, MT, cfg.GS), dtype=cfg.dtype, buffer=nl.sbuf)
        _activation_step(cfg, pt, ring, ps, act)
        theirs = nl.ndarray((P_MAX, MT, cfg.GS), dtype=cfg.dtype, buffer=nl.sbuf)
        if swap is not None:
            swap.send(j, act, theirs, None if spread is not None else
                      [(ring.tile_off(pt, m), pt.rows[m]) for m in range(MT)])
        else:
            nisa.sendrecv(src=act[:, :, :T], dst=theirs[:, :, :T], send_to_rank=1 - c, recv_from_rank=1 - c,
                          pipe_id=1)
        acts[s] = act
        acts[s + (1 if c == 0 else -1)] = theirs
        ring.n += 1
    # the out^T half in PSUM, opened with zeros; in kt blocks (_hb_cols: h = c H/2 + 128 k0 + p g + j - k0) when
    # the biases are a contraction block or absent: the last tile's rows then load per block and each block is
    # evicted and stored as soon as it is complete (as LNC 1's _last_two_tail)
    blocks = _hsplit_blocks(KH) if blk is not None or b_down is None else ((0, KH),)
    if blk is not None:
        blk.blocks = blocks
    acc = nl.ndarray((P_MAX, KH, cfg.GS), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc[:, :, :T], stationary=consts.ones_bf[0:1, :], moving=consts.zeros_bf[0:1, :KH * T],
                   accumulate=False)
    order = []
    for j in range(len(mine)):          # pairs: ours, then the other core's (its activation comes by the swap)
        order += [mine[j], mine[j] + (1 if c == 0 else -1)]
    last_cols = tuple((P_MAX * k0, P_MAX * (k0 + g)) for k0, g in blocks) if len(blocks) > 1 else None
    for i, s in enumerate(order):
        b = (i // 2) % cfg.nbuf
        half = ring.wd[b][:, :, (i % 2) * H2:(i % 2) * H2 + H2]
        ring.par = s % 2
        last = i == len(order) - 1
        tiles = _tail_tiles(pt) if last else list(range(MT))
        mv = {}
        if spread is not None:
            ring.n = i
            spread.permute(ring, acts[s])
            mv[spread.m] = spread.act[i % 2][:, 0:1]
        for m in tiles:
            if m in mv:
                spread.load(cfg, pt, ring, b, regs[s], w_down, ((0, H2),), c * H2, dcol=(i % 2) * H2)
            else:
                _load_down_step(cfg, pt, ring, b, regs[s], w_down, h0=c * H2, hw=H2, dst=half, tiles=[m],
                                last_cols=last_cols if last and m == tiles[-1] else None)
        for m in (tiles[:-1] if last else tiles):
            o = ring.tile_off(pt, m)
            r = slice(o, o + pt.rows[m]) if m not in mv else slice(0, P_MAX)
            for jj in range(KH):
                nisa.nc_matmul(dst=acc[:, jj, :T], stationary=_hb_cols(half[r, m, :], jj, blocks),
                               moving=mv[m] if m in mv else acts[s][r, m, :T], accumulate=True)
        if blk is not None and i == min(1, len(order) - 1):
            blk.load(cfg, regs, b_down, c * H2)
            blk.add(lambda kt: acc[:, kt, :T])
    bsum = None
    if blk is None:
        bsum = _slot_bias_step(cfg, consts, list(range(k)), regs, aff, b_down, KT=KH, h0=c * H2)
    # the last tile, block by block: its matmuls, the block's eviction (+ bsum) and store
    m = tiles[-1]
    o = ring.tile_off(pt, m)
    r = slice(o, o + pt.rows[m])
    o_sb = nl.ndarray((P_MAX, KH), dtype=out.dtype, buffer=nl.sbuf)
    for k0, g in blocks:
        for jj in range(k0, k0 + g):
            nisa.nc_matmul(dst=acc[:, jj, :T], stationary=_hb_cols(half[r, m, :], jj, blocks),
                           moving=acts[s][r, m, :T], accumulate=True)
        if bsum is None:
            nisa.tensor_copy(dst=o_sb[:, k0:k0 + g], src=acc[:, k0:k0 + g, 0])
        else:
            nisa.tensor_tensor(dst=o_sb[:, k0:k0 + g], data1=acc[:, k0:k0 + g, 0], data2=bsum[:, k0:k0 + g],
                               op=nl.add)
        nisa.dma_copy(dst=out.ap([[g, P_MAX], [1, g]], offset=c * H2 + P_MAX * k0), src=o_sb[:, k0:k0 + g])
    ring.par = None
    ring.spread = None


def _slot_bias_step(cfg, consts, slots, regs, aff, b_down, KT=None, h0=0):
    """T = 1: this core's down biases Σ_s aff_s * b_down[idx_s] as bsum [128, KT] fp32 in the out^T layout (None
    without b_down); slot s's row loaded through its expert register. KT / h0: the H columns h0 + p * KT + kt
    (default all H, h0 = 0: the LNC=2 H split passes its half)."""
    KT = cfg.KT if KT is None else KT
    if b_down is None:
        return None
    # after every weight DMA in program order: the DMA engines serve these last, off the weight stream, and
    # the bias arithmetic hides under the last expert's down projection
    affb_ps = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=affb_ps[:, :cfg.k], stationary=consts.ones_f32[0:1, :], moving=aff[0:1, :cfg.k],
                   accumulate=False)
    affb = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=affb[:, :cfg.k], src=affb_ps[:, :cfg.k])
    rows = nl.ndarray((P_MAX, len(slots), KT), dtype=b_down.dtype, buffer=nl.sbuf)
    bsum = nl.ndarray((P_MAX, KT), dtype=nl.float32, buffer=nl.sbuf)
    for j, s in enumerate(slots):
        nisa.dma_copy(dst=rows[:, j, :], src=_expert_src(b_down, regs[j], [[KT, P_MAX], [1, KT]], h0, cfg.H))
        if j == 0:
            nisa.tensor_scalar(dst=bsum, data=rows[:, j, :], op0=nl.multiply, operand0=affb[:, s:s + 1])
        else:
            nisa.scalar_tensor_tensor(dst=bsum, data=rows[:, j, :], op0=nl.multiply, operand0=affb[:, s:s + 1],
                                      op1=nl.add, operand1=bsum)
    return bsum


def _store_outT_step(cfg, acc, out, bsum=None):
    """outT layout: out[t, p * KT + kt] = acc^T[p, kt, t]; each partition writes KT-element runs per token. LNC=2:
    core c owns kt in [c * KT/2, (c + 1) * KT/2): it evicts the other half first and sends it, adds the half it
    receives to its own (rounding straight to the output dtype) and stores its half. bsum [128, KT] fp32 (T = 1
    only): this core's down biases, added at the eviction."""
    T, KT, H = cfg.T, cfg.KT, cfg.H
    if cfg.ncores == 1:
        o = nl.ndarray((P_MAX, cfg.GS, KT), dtype=out.dtype, buffer=nl.sbuf)
        for i in range(cfg.t_banks):
            k0 = i * cfg.kt_bank
            n = min(cfg.kt_bank, KT - k0)
            if bsum is None:
                evict(i, o[:, :T, k0:k0 + n].permute((0, 2, 1)), acc.banks[i][:, :n, :T])
            else:
                nisa.tensor_tensor(dst=o[:, 0, k0:k0 + n], data1=acc.banks[i][:, :n, 0], data2=bsum[:, k0:k0 + n],
                                   op=nl.add)
        nisa.dma_copy(dst=out.ap([[KT, P_MAX], [H, T], [1, KT]], offset=0), src=o[:, :T, :])
        return
    half = KT // 2
    lo, olo = cfg.core * half, (1 - cfg.core) * half
    full = nl.ndarray((P_MAX, KT, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    for j, k0 in enumerate((olo, lo)):
        for kt in range(k0, k0 + half):
            i = kt // cfg.kt_bank
            if kt == k0 or kt % cfg.kt_bank == 0:       # one eviction per (half, bank) run of kt
                n = min(k0 + half, (i + 1) * cfg.kt_bank) - kt
                src = acc.banks[i][:, kt % cfg.kt_bank:kt % cfg.kt_bank + n, :T]
                if bsum is None:
                    evict(j, full[:, kt:kt + n, :T], src)
                else:
                    nisa.tensor_tensor(dst=full[:, kt:kt + n, 0], data1=src[:, :, 0], data2=bsum[:, kt:kt + n],
                                       op=nl.add)
    other = nl.ndarray((P_MAX, half, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.sendrecv(src=full[:, olo:olo + half, :T], dst=other[:, :, :T], send_to_rank=1 - cfg.core,
                  recv_from_rank=1 - cfg.core, pipe_id=1)
    o = nl.ndarray((P_MAX, cfg.GS, half), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=o[:, :T, :].permute((0, 2, 1)), data1=full[:, lo:lo + half, :T], data2=other[:, :, :T],
                       op=nl.add)
    nisa.dma_copy(dst=out.ap([[KT, P_MAX], [H, T], [1, half]], offset=lo), src=o[:, :T, :])


def _store_out_step(cfg, acc, out, bsum=None):
    """out [T, H] (input dtype) = acc; LNC=2: each core sends the other core's H half of its partial sum, adds the
    half it receives to its own and stores that half. bsum: see _store_outT_step."""
    T, H = cfg.T, cfg.H
    if acc.T:
        _store_outT_step(cfg, acc, out, bsum)
        return
    if cfg.ncores == 1 and acc.psum:
        o = nl.ndarray((P_MAX, H), dtype=out.dtype, buffer=nl.sbuf)
        for i, (c0, cw) in enumerate(cfg.chunks):
            evict(i, o[:T, c0:c0 + cw], acc.banks[i][:T, :cw])
        nisa.dma_copy(dst=out, src=o[:T, :])
        return
    if acc.psum:
        full = nl.ndarray((P_MAX, H), dtype=nl.float32, buffer=nl.sbuf)
        for i, (c0, cw) in enumerate(cfg.chunks):
            evict(i, full[:T, c0:c0 + cw], acc.banks[i][:T, :cw])
    else:
        full = acc.sb
    if cfg.ncores > 1:
        half = H // 2
        lo, hi = cfg.core * half, (cfg.core + 1) * half
        olo = (1 - cfg.core) * half
        other = nl.ndarray((P_MAX, half), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=full[:T, olo:olo + half], dst=other[:T, :], send_to_rank=1 - cfg.core,
                      recv_from_rank=1 - cfg.core, pipe_id=1)
        # the sum rounds straight to the output dtype, split between VectorE and GpSimd (both SBUF operands)
        o = nl.ndarray((P_MAX, H), dtype=out.dtype, buffer=nl.sbuf)
        mid = lo + half // 2
        nisa.tensor_tensor(dst=o[:T, lo:mid], data1=full[:T, lo:mid], data2=other[:T, :mid - lo], op=nl.add)
        nisa.tensor_tensor(dst=o[:T, mid:hi], data1=full[:T, mid:hi], data2=other[:T, mid - lo:], op=nl.add,
                           engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=out[:, lo:hi], src=o[:T, lo:hi])
        return
    o = nl.ndarray((P_MAX, H), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o[:T, :], src=full[:T, :])
    nisa.dma_copy(dst=out, src=o[:T, :])


def moe_tkg_kernel(x, w_router, w_gate_up, w_down, b_router=None, b_gate_up=None, b_down=None, gamma=None,
                   top_k=1, eps=1e-5, hidden_actual=0, router_mode="gpt_oss", renormalize=False,
                   activation="clamped_swiglu", add_down_bias=True, expert_mode="selective", w_gate_up_scale=None,
                   w_down_scale=None):
    """Decode MoE block for one TP rank: RMSNorm (optional) + router + top-k experts, partial output for the
    all-reduce.

    Dimensions:
        T: tokens B·S_tkg (<= 128), H: hidden size (multiple of 128, padded), E: experts on this rank (<= 128),
        k: top_k (<= 8), I: this rank's slice of the expert intermediate size (<= 768).

    Args:
        x ([T, H] @ HBM): hidden states (bf16); columns >= hidden_actual are padding (zero).
        w_router ([H, E] @ HBM), b_router ([1, E] @ HBM, optional): router.
        w_gate_up ([E, H, 2, I] @ HBM): gate (index 0) and up (1) projections; b_gate_up ([E, 2, I], optional).
        w_down ([E, I, H] @ HBM), b_down ([E, H] @ HBM, optional): down projection.
        gamma ([1, H] @ HBM, optional): RMSNorm weight (None: x goes to the router and experts as is).
        top_k, router_mode ("gpt_oss" | "softmax_topk"), renormalize: see moe_torch.router_torch.
        eps, hidden_actual (0 = H): RMSNorm epsilon and the number of real hidden columns.
        activation ("clamped_swiglu" | "swiglu"), add_down_bias (bool: this rank adds the down biases).
        expert_mode ("selective" | "all"): serve the touched experts only (data-dependent loop) or stream all E.
        w_gate_up_scale, w_down_scale: given, the experts are MXFP4 (trn3, T <= 64, LNC 1) in mx_weights.py's layout:
            w_gate_up [E, 128, H/512, 2I] float4_e2m1fn_x4 with scales [E, 16, H/512, 2I] uint8, w_down
            [E, 128, KDm, H] with scales [E, 16, KDm, H] (I zero-padded to KDm * 512); the tokens and activations are
            quantised to MXFP8 on chip, every projection is an nc_matmul_mx (tkg_mx.py).

    Returns:
        out ([T, H] @ shared_hbm, x's dtype): Σ_k affinity · expert(x) (this rank's partial sum),
        expert_index ([T, k] int32 @ shared_hbm), affinities ([T, k] fp32 @ shared_hbm).

    Notes:
        - Each expert's weights are loaded once and serve all T tokens in one pass (tokens that did not choose it
          have affinity 0): weights are the stationary operand of gate/up (tokens moving, T columns) and the
          moving operand of down (tokens stationary), so no per-token GEMV loop and no transposes between them.
        - Selective mode: the touched experts are compacted on-chip (nonzero_with_count) and slot s loads expert
          list[s] through register-addressed DMAs; a slot beyond the count is skipped by a runtime trip count.
        - Weight slots form a ring of nbuf (<= 3) so the next experts' DMAs overlap the current expert's compute.
        - Affinity scaling is POST_SCALE (it multiplies the expert's whole output, down bias included), applied
          through linearity: a · (act @ W_down) = (a · act) @ W_down, so the fp32 activation columns are scaled
          before their bf16 rounding and every expert's down projection accumulates in the same PSUM banks (no
          per-expert eviction); the down biases are Σ_e a[t, e] b_down[e], matmuls over E (affinities as
          hi + lo bf16 parts) that open those banks. (The nonlinearity sees unscaled gate/up: this is not PRE_SCALE.)
        - LNC=2: the cores take alternate experts (slots), each expert's weights are read by one core only; the
          router's H tiles are split (partial logits exchanged); the partial outputs are exchanged by H halves.
          x and gamma are read by both cores.

    Pseudocode:
        hT = transpose(x) ; if gamma: hT = rmsnorm(hT)
        logits = hT^T W_r + b_r ; idx, aff = topk(logits) ; dense[t, e] = aff of e for t (0 if not chosen)
        acc (PSUM) = dense @ b_down
        for e in (touched experts | all experts):
            gu^T = W_gu[e]^T hT (+ b_gu[e]) ; act^T = dense[:, e]^T * act(gate^T, up^T)
            acc += act @ W_down[e]
        out = acc
    """
    mx = w_gate_up_scale is not None
    cfg = _Cfg(x, w_gate_up, w_router, top_k, hidden_actual, activation, expert_mode, w_down, mx)
    cfg.eps = float(eps)
    gu_shape, d_shape = tuple(w_gate_up.shape), tuple(w_down.shape)
    if mx:
        from .mx_weights import packed_weights_error
        err = packed_weights_error(cfg.H, w_gate_up, w_down, w_gate_up_scale, w_down_scale, "moe_tkg")
        if err:
            raise ValueError(err)
        gu_shape, d_shape = (cfg.E, cfg.H, 2, cfg.inter), (cfg.E, cfg.inter, cfg.H)     # the logical shapes
    err = tkg_argument_error(tuple(x.shape), tuple(w_router.shape), gu_shape, d_shape,
                             top_k=top_k, b_router_shape=None if b_router is None else tuple(b_router.shape),
                             b_gate_up_shape=None if b_gate_up is None else tuple(b_gate_up.shape),
                             b_down_shape=None if b_down is None else tuple(b_down.shape),
                             gamma_shape=None if gamma is None else tuple(gamma.shape),
                             hidden_actual=hidden_actual or None, router_mode=router_mode, activation=activation)
    err = err or tkg_kernel_error(cfg)
    if err:
        raise ValueError(err)
    T, H = cfg.T, cfg.H
    out = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    index_out = nl.ndarray((T, top_k), dtype=nl.int32, buffer=nl.shared_hbm)
    aff_out = nl.ndarray((T, top_k), dtype=nl.float32, buffer=nl.shared_hbm)

    consts = _Consts(cfg.E, T, cfg.eps)
    wr = _load_router_swap_step(cfg, w_router, b_router) if _wr_swap(cfg) else None
    xT, x_rows = _load_x_step(cfg, x)
    ring = tkg_mx.MxRing(cfg) if mx else _Ring(cfg, consts)
    rstd = None
    if gamma is not None:
        hT, rstd = _rmsnorm_step(cfg, consts, xT, gamma)
    else:
        hT = nl.ndarray((P_MAX, cfg.KT, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hT[:, :, :T], src=xT)
    idx, aff = _route_step(cfg, consts, hT, w_router, b_router, router_mode, renormalize, wr)
    if cfg.gu_tiled:    # the experts' x^T in the weights' natural H tiles, built at its first use (the router keeps hT)
        hT = _Natural(cfg, x, x_rows, gamma, rstd)
    if mx:
        _mx_experts(cfg, consts, ring, idx, aff, x, gamma, rstd, (w_gate_up, w_down, w_gate_up_scale, w_down_scale),
                    b_gate_up, b_down if add_down_bias else None, out)
        if cfg.core == 0:
            store_routing_step(idx, aff, T, top_k, index_out, aff_out)
        return out, index_out, aff_out
    if cfg.mode == "selective" and T == 1 and cfg.outT and cfg.ncores == 2 and top_k % 2 == 0:
        _one_token_hsplit(cfg, consts, ring, idx, aff, hT, w_gate_up, w_down, b_gate_up,
                          b_down if add_down_bias else None, out)
        if cfg.core == 0:
            store_routing_step(idx, aff, T, top_k, index_out, aff_out)
        return out, index_out, aff_out
    if cfg.mode == "selective" and T == 1 and cfg.outT:
        _one_token_experts(cfg, consts, ring, idx, aff, hT, w_gate_up, w_down, b_gate_up,
                           b_down if add_down_bias else None, out)
        if cfg.core == 0:
            store_routing_step(idx, aff, T, top_k, index_out, aff_out)
        return out, index_out, aff_out
    if cfg.mode == "all":
        dense, denseT = _dense_step(cfg, consts, idx, aff)
        acc = _init_acc_step(cfg, consts, denseT, b_down, add_down_bias)
        mine = list(range(cfg.core, cfg.E, cfg.ncores))
        for e in mine:
            _expert_step(cfg, consts, ring, e, dense[:T, e:e + 1], hT, acc, w_gate_up, w_down, b_gate_up,
                         last=e == mine[-1])
    else:
        touched = _touched_step(cfg, consts, idx)
        affc, sched, half, dense, denseT = _schedule_step(
            cfg, consts, None, None, touched=touched, dense_fn=lambda: _dense_step(cfg, consts, idx, aff))
        if isinstance(hT, _Natural):     # its loads after the compaction's instructions (see _Natural)
            hT.load()
        acc = _init_acc_step(cfg, consts, denseT, b_down, add_down_bias)
        _selective_slots(cfg, consts, ring, sched, affc, hT, acc, w_gate_up, w_down, b_gate_up)
        if half is not None:
            hx, affh = half
            he, hg = _slot_registers((hx[0:1, 0:1], hx[0:1, 1:2]), 0)
            n0 = cfg.inter // 2
            pt = _Part(0, n0) if cfg.core == 0 else _Part(n0, cfg.inter - n0)

            def hbody(_i):
                _expert_step(cfg, consts, ring, he, affh[:T, 0:1], hT, acc, w_gate_up, w_down, b_gate_up, pt=pt)

            nl.fori_loop(0, hg, hbody)
    _store_out_step(cfg, acc, out)
    if cfg.core == 0:
        store_routing_step(idx, aff, T, top_k, index_out, aff_out)
    return out, index_out, aff_out


def _selective_slots(cfg, consts, ring, sched, affc, hT, acc, w_gate_up, w_down, b_gate_up):
    """Selective mode: this core's static slots s (s < min(E, T k), every ncores-th), each a loop of 0 or 1 trips
    (its gate register). Loads are software-pipelined by one slot: slot j's loop loads slot j+1's gate/up (a nested
    loop on slot j+1's gate) BEFORE its own down rows, so the DMA stream runs gu0, gu1, d0, gu2, d1, ... and the
    last slot's gate/up and activation run under the previous slot's and its own down rows: only its down
    matmuls (partial I tiles loaded first, _tail_tiles) follow the last weight byte. Slot j always takes ring
    position base + j (weights slot (base + j) % nbuf), whether or not earlier slots ran."""
    T, pt, I2 = cfg.T, cfg.part, 2 * cfg.inter
    hT = _hT_of(hT)     # (the tiled layout's natural x^T: built here, not inside a slot's runtime loop)
    slots = list(range(cfg.core, min(cfg.E, T * cfg.k), cfg.ncores))
    base = ring.n
    tiles = _tail_tiles(pt)

    def load_gu(j, r):
        ring.n = base + j
        b = ring.n % cfg.nbuf
        if b_gate_up is not None:
            nisa.dma_copy(dst=ring.bias_row(b), src=_expert_src(b_gate_up, r, [[I2, 1], [1, I2]], 0, I2))
        _load_gate_up_step(cfg, pt, ring, b, r, w_gate_up)

    acts = {}

    def front(j, r):
        load_gu(j, r)
        ring.n = base + j
        acts[j] = _expert_front_step(cfg, consts, ring, affc[:T, slots[j]:slots[j] + 1], hT, b_gate_up)

    regs = [_slot_registers(sched, slots[0])] if slots else []
    if slots:
        r0, g0 = regs[0]
        nl.fori_loop(0, g0, lambda _i: front(0, r0))
    for j in range(len(slots)):
        r, g = regs[j]
        nxt = None
        if j + 1 < len(slots):
            regs.append(_slot_registers(sched, slots[j + 1]))
            nxt = regs[j + 1]

        def body(_i, j=j, r=r, nxt=nxt):
            if nxt is not None:       # the next slot's gate/up load and compute come first in program order
                nl.fori_loop(0, nxt[1], lambda _k: front(j + 1, nxt[0]))
            ring.n = base + j
            b = ring.n % cfg.nbuf
            _load_down_step(cfg, pt, ring, b, r, w_down, tiles=tiles)
            _down_step(cfg, pt, ring, b, acts[j], acc, tiles)

        nl.fori_loop(0, g, body)
    ring.n = base + len(slots)


def _mx_experts(cfg, consts, ring, idx, aff, x, gamma, rstd, weights, b_gate_up, b_down, out):
    """The expert phase with MXFP4 weights (tkg_mx.py's steps): the tokens quantised once, then the experts as in
    the bf16 path (T = 1: slots straight from the top-k; selective: the compacted list; all: every expert),
    accumulating affinity * expert output into acc [128, KT, T] fp32 (SBUF, out^T layout). The down biases: at T = 1
    per slot (_slot_bias_step), else Σ_e dense · b_down matmuls (_init_acc_step, core 0) copied into acc. LNC 2: the
    cores take alternate slots / experts (each weight read by one core; an odd count leaves one core one expert
    more: the bf16 path's split of that expert by I columns is not done here) and exchange kt halves of acc."""
    T = cfg.T
    w_gate_up, w_down, s_gu, s_d = weights
    xq, xs = tkg_mx.x_operand_step(cfg, x, gamma, rstd)
    ring.make_valid(cfg)
    acc = nl.ndarray((P_MAX, cfg.KT, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
    one = cfg.mode == "selective" and T == 1
    dense = denseT = None
    if not one:
        dense, denseT = _dense_step(cfg, consts, idx, aff)
    has_bias = b_down is not None and not one
    first = _init_acc_step(cfg, consts, denseT, b_down if has_bias else None, has_bias)
    if has_bias:
        for i in range(cfg.t_banks):
            k0 = i * cfg.kt_bank
            n = min(cfg.kt_bank, cfg.KT - k0)
            nisa.tensor_copy(dst=acc[:, k0:k0 + n, :T], src=first.banks[i][:, :n, :T])
    else:
        nisa.memset(dst=acc[:, :, :T], value=0.0)
    sets = (first.banks,)
    if cfg.down_sets > 1:
        sets += (tuple(nl.ndarray((P_MAX, cfg.kt_bank, cfg.GS), dtype=nl.float32, buffer=nl.psum)
                       for _ in range(cfg.t_banks)),)
    wts = (w_gate_up, w_down, (s_gu, s_d), b_gate_up)

    def expert(e, aff_col):
        tkg_mx.expert_step(cfg, consts, ring, e, aff_col, xq, xs, sets, acc, wts[0], wts[1], wts[2], wts[3])

    bsum = None
    if one:
        slots = [s for s in range(cfg.k) if s % cfg.ncores == cfg.core]
        regs = []
        for s in slots:
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=idx[0:1, s:s + 1])
            regs.append(r)
        for j, s in enumerate(slots):
            expert(regs[j], aff[0:1, s:s + 1])
        bsum = _slot_bias_step(cfg, consts, slots, regs, aff, b_down)
    elif cfg.mode == "all":
        for e in range(cfg.core, cfg.E, cfg.ncores):
            expert(e, dense[:T, e:e + 1])
    else:
        affc, sched, _ = _schedule_step(cfg, consts, dense, denseT, split_odd=False)
        for s in range(cfg.core, min(cfg.E, T * cfg.k), cfg.ncores):
            r, g = _slot_registers(sched, s)

            def body(_i, s=s, r=r):
                expert(r, affc[:T, s:s + 1])

            nl.fori_loop(0, g, body)
    tkg_mx.store_step(cfg, acc, out, bsum)


moe_tkg_nki = nki.jit(moe_tkg_kernel)
