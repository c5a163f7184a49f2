"""MoE router: fp32 logits = x·W_r + b_r, top-k expert selection and affinities.

This file holds the argument checks (shared by every backend), the NKI kernel and the functional entry `router`.
Semantics are `moe_torch.router_torch`'s: mode "gpt_oss" = top-k on the logits, softmax over the k selected;
mode "softmax_topk" = softmax over all E, then top-k (optionally renormalised); ties lowest index first.
"""

from .entry import dtype_name, resolve_backend, shape_of, to_torch
from .moe_torch import ROUTER_MODES, router_torch

MAX_TOP_K = 8          # one nisa.max8 pass: the 8 largest per token
MAX_EXPERTS = 128      # logits of one token fit one PSUM bank row and one max8 input (E <= 128 here)
H_TILE = 128           # H is contracted in partition tiles of 128


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
    raise NotImplementedError(f"router: backend={backend!r}: the NKI kernel is not in this checkout yet; "
                              f"use backend='torch' ({dtype_name(x)} inputs)")
