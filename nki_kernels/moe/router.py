"""MoE router: fp32 logits = x·W_r + b_r, top-k expert selection and affinities.

This file holds the argument checks (shared by every backend), the NKI kernel and the functional entry `router`.
Semantics are `moe_torch.router_torch`'s: mode "gpt_oss" = top-k on the logits, softmax over the k selected;
mode "softmax_topk" = softmax over all E, then top-k (optionally renormalised); ties lowest index first.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ..common.tiles import transpose_tokens
from ..entry import resolve_backend, shape_of, to_torch
from .moe_torch import ROUTER_MODES, router_torch

# ---- sizes ------------------------------------------------------------------------------------------------------
P_MAX = nl.tile_size.pmax            # partitions: tokens per tile, contraction (H) tile
H_TILE = P_MAX                       # H is contracted in partition tiles (128 on every target)
MAX_TOP_K = 8                        # one nisa.max8 / nc_find_index8 pass: the 8 largest per token
MAX8_WIDTH = 8                       # max8 reads at least 8 values per partition: narrower logits are padded
MAX_EXPERTS = 128                    # E <= 128: the dense affinities' transpose puts E on the partitions
# TensorE transposes of [tokens, 128] bf16 column sets batched into one PSUM bank before one eviction
TRANSPOSE_GROUP = nl.tile_size.psum_bank_fmax_bytes // (P_MAX * 2)
RESET = nisa.reduce_cmd.reset_reduce   # accumulate-reduce into a fresh register (not onto its old value)
ROUTER_W_PIECES = 4                  # W_r loads in at most this many DMAs ...
ROUTER_W_MIN_RUN = 2048              # ... of at least this many contiguous bytes per partition (DMA efficiency ~89%)
NEG_PAD = -3.0e38                    # logits of padding columns (E < 8): below every real fp32 logit


def router_argument_error(x_shape, w_shape, b_shape=None, *, top_k, mode="gpt_oss", op="router"):
    """None when the shapes/options are in the router's envelope, else the message naming the argument and limit."""
    if mode not in ROUTER_MODES:
        return f"{op}: router mode={mode!r} must be one of {ROUTER_MODES}"
    if x_shape is None or len(x_shape) < 2:
        return f"{op}: x must be [T, H] (or [..., H]), got shape {x_shape}"
    if w_shape is None or len(w_shape) != 2:
        return f"{op}: w_router must be [H, E], got shape {w_shape}"
    H, E = w_shape
    if x_shape[-1] != H:
        return f"{op}: x hidden size {x_shape[-1]} != w_router rows {H}"
    if H % H_TILE:
        return f"{op}: hidden size H={H} must be a multiple of {H_TILE} (pad it; see hidden_actual)"
    if not 1 <= E <= MAX_EXPERTS:
        return f"{op}: number of experts E={E} must be in [1, {MAX_EXPERTS}]"
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= min(MAX_TOP_K, E):
        return f"{op}: top_k={top_k!r} must be an int in [1, min({MAX_TOP_K}, E={E})]"
    if b_shape is not None and tuple(b_shape) not in ((E,), (1, E)):
        return f"{op}: b_router must be [E={E}] or [1, E], got shape {tuple(b_shape)}"
    return None


def router(x, w_router, b_router=None, *, top_k, mode="gpt_oss", renormalize=False, backend="auto"):
    """Top-k routing of tokens x [T, H] (leading dims flattened) over E experts, w_router [H, E], b_router [E].

    Returns (logits [T, E] fp32, expert_index [T, k] (int64 from "torch", int32 from the kernel), affinities [T, k]
    fp32), each token's experts in descending order. backend: "auto" | "nki" | "nkisim" | "torch".
    """
    err = router_argument_error(shape_of(x), shape_of(w_router), shape_of(b_router), top_k=top_k, mode=mode)
    if err:
        raise ValueError(err)
    backend = resolve_backend("router", backend)
    x, w_router, b_router = to_torch(x), to_torch(w_router), to_torch(b_router)
    x2 = x.reshape(-1, x.shape[-1])
    b1 = None if b_router is None else b_router.reshape(-1)
    if backend == "torch":
        return router_torch(x2, w_router, b1, top_k=top_k, mode=mode, renormalize=renormalize)
    b2 = None if b1 is None else b1.reshape(1, -1)
    return router_nki(x2, w_router, b2, top_k=top_k, mode=mode, renormalize=renormalize)


# ---- kernel -----------------------------------------------------------------------------------------------------

class RouterConsts(nl.NKIObject):
    """SBUF constants of the routing steps: fp32 ones (K=1 bias matmuls, partition sums), column index 0..E-1."""

    def __init__(self, E):
        self.ones_f32 = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.ones_f32, value=1.0)
        self.col_idx = nl.ndarray((P_MAX, max(E, MAX8_WIDTH)), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=self.col_idx, pattern=[[1, max(E, MAX8_WIDTH)]], offset=0, channel_multiplier=0)
        self.ones_bf = nl.ndarray((1, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=self.ones_bf, value=1.0)


def router_w_pieces(n, row_bytes):
    """kt counts of the W_r DMAs over a range of n kt tiles (row_bytes: one kt tile's contiguous bytes per partition).
    When one tile's run is at least the per-run DMA overhead (256 B: E >= 128 in bf16) its transfer is slower than
    its logits matmul, so the pieces DECREASE (sizes ~3 : 1 from first to last, at most ROUTER_W_PIECES): the
    matmuls of each piece run while the next, smaller one streams, and only the last piece's few matmuls follow the
    last W_r byte. Narrower W_r (its whole load is short): at most ROUTER_W_PIECES equal pieces of >= ROUTER_W_MIN_RUN
    bytes per partition."""
    if row_bytes >= 256 and n >= 4:
        p = min(ROUTER_W_PIECES, n // 4)
        w = [3.0 - 2.0 * i / (p - 1) for i in range(p)] if p > 1 else [1.0]
        sizes = [max(1, round(n * v / sum(w))) for v in w]
        sizes[0] += n - sum(sizes)
        return sizes
    p = max(1, min(ROUTER_W_PIECES, n, n * row_bytes // ROUTER_W_MIN_RUN))
    return [(i + 1) * n // p - i * n // p for i in range(p)]


def load_router_bias(b_router, E):
    """b_r [E] -> SBUF [1, E] for the logits' K=1 bias matmul: bf16 as given, any other dtype as fp32 (None stays
    None)."""
    if b_router is None:
        return None
    raw = nl.ndarray((1, E), dtype=b_router.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw, src=b_router.reshape((1, E)))
    if b_router.dtype == nl.bfloat16:
        return raw
    br = nl.ndarray((1, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=br, src=raw)
    return br


def load_router_weights(w_router, b_router, KT, k0=0, k1=None, decreasing=False, pieces=None):
    """W_r as [128, KT, E] bf16 (H row p * KT + kt on partition p: KT * E contiguous elements per partition, the H
    order of the transposed activations); rows of the kt range [k0, k1) only (LNC=2 splits them), in pieces of
    >= ROUTER_W_MIN_RUN bytes per partition (up to ROUTER_W_PIECES) so the logits matmuls start on the first piece
    (GPT-OSS-120B: E = 128, 786 KB, the longest load of the routing); decreasing: router_w_pieces' decreasing
    pieces (the fused TKG kernel, where the routing is the critical path to the first expert DMA); pieces: these kt
    counts instead (summing to k1 - k0). b_r as fp32
    [1, E] (None stays None), loaded first: its K=1 matmul opens the logits. A bf16 b_r stays bf16 (its products with
    1.0 are exact in the fp32 PSUM: no conversion on the routing's critical path, and the matmul takes 1/4 of an
    fp32 one's cycles)."""
    E = w_router.shape[1]
    k1 = KT if k1 is None else k1
    br = load_router_bias(b_router, E)
    wr = nl.ndarray((P_MAX, KT, E), dtype=w_router.dtype, buffer=nl.sbuf)
    src = w_router.reshape((P_MAX, KT, E))
    if decreasing or pieces:
        a = k0
        for sz in pieces or router_w_pieces(k1 - k0, E * w_router.dtype.itemsize):
            nisa.dma_copy(dst=wr[:, a:a + sz, :], src=src[:, a:a + sz, :])
            a += sz
        return wr, br
    n = max(1, min(ROUTER_W_PIECES, k1 - k0, (k1 - k0) * E * w_router.dtype.itemsize // ROUTER_W_MIN_RUN))
    for i in range(n):
        a, b = k0 + i * (k1 - k0) // n, k0 + (i + 1) * (k1 - k0) // n
        nisa.dma_copy(dst=wr[:, a:b, :], src=src[:, a:b, :])
    return wr, br


def logits_step(consts, xT, wr, br, nt, E, k0, k1):
    """Partial logits [nt, E] fp32 in PSUM = sum over kt in [k0, k1) of xT[:, kt]^T W_r[:, kt] (+ b_r via a K=1
    ones matmul when br is given): fp32 accumulation of the bf16 products, as the reference's fp32 matmul."""
    ps = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.psum)
    first = True
    if br is not None:
        ones = consts.ones_bf if br.dtype == nl.bfloat16 else consts.ones_f32
        nisa.nc_matmul(dst=ps[:nt, :], stationary=ones[0:1, :nt], moving=br[0:1, :], accumulate=False)
        first = False
    for kt in range(k0, k1):
        nisa.nc_matmul(dst=ps[:nt, :], stationary=xT[:, kt, :nt], moving=wr[:, kt, :], accumulate=not first)
        first = False
    return ps


def topk_step(consts, logits, nt, E, top_k, mode, renormalize):
    """logits [nt, E] fp32 (SBUF) -> (idx [P, 8] uint32, aff [P, 8] fp32): the first top_k columns are each token's
    experts in descending order (ties: lowest index first, nc_find_index8's first-occurrence rule) and their
    affinities. gpt_oss: softmax over the k selected logits; softmax_topk: softmax over all E, top-k of the
    probabilities (optionally renormalised to sum 1)."""
    W = max(E, MAX8_WIDTH)
    src = logits
    if W > E:      # max8 reads >= 8 values: pad with NEG_PAD, which no real logit (or probability) loses to
        src = nl.ndarray((P_MAX, W), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=src[:nt, :], value=NEG_PAD)
        nisa.tensor_copy(dst=src[:nt, :E], src=logits[:nt, :E])
    top = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top[:nt, :], src=src[:nt, :])
    idx = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.uint32, buffer=nl.sbuf)
    if mode == "gpt_oss":     # the indices first: the expert weight DMAs wait for them, the affinities come later
        nisa.nc_find_index8(dst=idx[:nt, :], data=src[:nt, :], vals=top[:nt, :])
    neg_max = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_max[:nt, :], data=top[:nt, 0:1], op0=nl.multiply, operand0=-1.0)
    total = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    rinv = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    aff = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
    if mode == "gpt_oss":
        ex = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=ex[:nt, :top_k], op=nl.exp, data=top[:nt, :top_k], bias=neg_max[:nt, :],
                        reduce_op=nl.add, reduce_res=total[:nt, :], reduce_cmd=RESET)
        nisa.reciprocal(dst=rinv[:nt, :], data=total[:nt, :])
        nisa.tensor_scalar(dst=aff[:nt, :top_k], data=ex[:nt, :top_k], op0=nl.multiply, operand0=rinv[:nt, :])
        return idx, aff
    # softmax over all E (the padding columns stay NEG_PAD: exp underflows to 0), then top-k of the probabilities
    ex = nl.ndarray((P_MAX, W), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=ex[:nt, :], op=nl.exp, data=src[:nt, :], bias=neg_max[:nt, :], reduce_op=nl.add,
                    reduce_res=total[:nt, :], reduce_cmd=RESET)
    nisa.reciprocal(dst=rinv[:nt, :], data=total[:nt, :])
    prob = nl.ndarray((P_MAX, W), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=prob[:nt, :], data=ex[:nt, :], op0=nl.multiply, operand0=rinv[:nt, :])
    if W > E:      # padding probabilities are 0; keep them below every real probability (which may also be 0)
        nisa.memset(dst=prob[:nt, E:], value=-1.0)
    ptop = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=ptop[:nt, :], src=prob[:nt, :])
    nisa.nc_find_index8(dst=idx[:nt, :], data=prob[:nt, :], vals=ptop[:nt, :])
    if not renormalize:
        nisa.tensor_copy(dst=aff[:nt, :top_k], src=ptop[:nt, :top_k])
        return idx, aff
    psum_k = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=psum_k[:nt, :], op=nl.add, data=ptop[:nt, :top_k], axis=1)
    rk = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rk[:nt, :], data=psum_k[:nt, :])
    nisa.tensor_scalar(dst=aff[:nt, :top_k], data=ptop[:nt, :top_k], op0=nl.multiply, operand0=rk[:nt, :])
    return idx, aff


def store_routing_step(idx, aff, nt, top_k, index_out, aff_out, t0=0):
    """expert_index [T, k] int32 and affinities [T, k] fp32 rows t0 .. t0 + nt from the top-k tiles."""
    idx32 = nl.ndarray((P_MAX, MAX_TOP_K), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx32[:nt, :top_k], src=idx[:nt, :top_k])
    nisa.dma_copy(dst=index_out[t0:t0 + nt, :], src=idx32[:nt, :top_k])
    nisa.dma_copy(dst=aff_out[t0:t0 + nt, :], src=aff[:nt, :top_k])


def router_kernel(x, w_router, b_router=None, top_k=1, mode="gpt_oss", renormalize=False):
    """MoE router: logits, top-k experts and their affinities for every token.

    Dimensions:
        T: tokens (any; tiles of 128), H: hidden size (multiple of 128), E: experts (<= 128), k: top_k (<= 8).

    Args:
        x ([T, H] @ HBM): hidden states (bf16).
        w_router ([H, E] @ HBM): router weight (bf16). b_router ([1, E] @ HBM): optional bias.
        top_k (int), mode ("gpt_oss" | "softmax_topk"), renormalize (bool): see moe_torch.router_torch.

    Returns:
        logits ([T, E] fp32 @ shared_hbm), expert_index ([T, k] int32 @ shared_hbm), affinities ([T, k] fp32
        @ shared_hbm); each token's experts in descending order, ties lowest index first.

    Notes:
        - W_r is loaded once, [128, H/128, E] with H row p * H/128 + kt on partition p (contiguous per partition);
          x is transposed on TensorE with the same H order, so the logits contract over partitions.
        - Logits accumulate in fp32 PSUM; the bias is one K=1 ones matmul into the same accumulator.
        - Top-k is one max8 + nc_find_index8 per token tile (k <= 8).

    Pseudocode:
        for each tile of 128 tokens: xT = transpose(x_tile) ; logits = xT^T W_r + b_r
            top8 = max8(logits) ; idx = find_index8(logits, top8)
            gpt_oss: aff = softmax(top8[:k]) ; softmax_topk: p = softmax(logits) ; aff, idx = top-k of p
    """
    err = router_argument_error(tuple(x.shape), tuple(w_router.shape),
                                None if b_router is None else tuple(b_router.shape), top_k=top_k, mode=mode)
    if err:
        raise ValueError(err)
    T, H = x.shape
    E = w_router.shape[1]
    KT = H // H_TILE
    logits_out = nl.ndarray((T, E), dtype=nl.float32, buffer=nl.shared_hbm)
    index_out = nl.ndarray((T, top_k), dtype=nl.int32, buffer=nl.shared_hbm)
    aff_out = nl.ndarray((T, top_k), dtype=nl.float32, buffer=nl.shared_hbm)
    consts = RouterConsts(E)
    wr, br = load_router_weights(w_router, b_router, KT)
    for t0 in range(0, T, P_MAX):
        nt = min(P_MAX, T - t0)
        x_sb = nl.ndarray((P_MAX, H), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb[:nt, :], src=x[t0:t0 + nt, :])
        xT = transpose_tokens(x_sb, nt, KT)
        ps = logits_step(consts, xT, wr, br, nt, E, 0, KT)
        logits = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=logits[:nt, :], src=ps[:nt, :])
        nisa.dma_copy(dst=logits_out[t0:t0 + nt, :], src=logits[:nt, :])
        idx, aff = topk_step(consts, logits, nt, E, top_k, mode, renormalize)
        store_routing_step(idx, aff, nt, top_k, index_out, aff_out, t0)
    return logits_out, index_out, aff_out


router_nki = nki.jit(router_kernel)
