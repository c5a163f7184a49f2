"""MoE token generation (decode) for one tensor-parallel rank: optional fused RMSNorm, router and the experts.

This file holds the argument checks (shared by every backend), the expert-mode cost rule, the NKI kernel and the
functional entry `moe_tkg`. Semantics are `moe_torch.moe_torch`'s; see DESIGN.md beside this file.
"""

from .entry import resolve_backend, shape_of, to_torch
from .moe_torch import ACTIVATIONS, moe_torch
from .router import router_argument_error

MAX_TOKENS = 128       # T = B * S_tkg: tokens live on the partitions of one tile
EXPERT_MODES = ("auto", "selective", "all")


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
    if w_gate_up_shape is None or len(w_gate_up_shape) != 4 or w_gate_up_shape[:3] != (E, H, 2):
        return f"{op}: w_gate_up must be [E={E}, H={H}, 2, I], got shape {w_gate_up_shape}"
    inter = w_gate_up_shape[3]
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
            add_down_bias=True, expert_mode="auto", backend="auto", lnc=1):
    """Decode MoE block for one TP rank: (RMSNorm) → router → Σ_k affinity · expert(x) → partial out [T, H].

    x [T, H] (or [B, S, H], flattened to T = B·S ≤ 128), bf16. Weights in moe_torch's layout (w_gate_up [E, H, 2, I],
    w_down [E, I, H], b_gate_up [E, 2, I], b_down [E, H]); under TP the output is this rank's partial sum and
    add_down_bias must be True on exactly one rank. Returns (out [T, H] in x's dtype, expert_index [T, k],
    affinities [T, k] fp32). expert_mode "auto" | "selective" | "all" only schedules the kernel (same result).
    """
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
            x2, t["w_router"], t["w_gate_up"], t["w_down"], top_k=top_k,
            b_router=None if b_router is None else t["b_router"].reshape(-1), b_gate_up=t["b_gate_up"],
            b_down=t["b_down"], gamma=None if gamma is None else t["gamma"].reshape(-1), eps=eps,
            hidden_actual=hidden_actual, router_mode=router_mode, renormalize=renormalize, activation=activation,
            add_down_bias=add_down_bias)
        return out.to(x.dtype), index, aff
    raise NotImplementedError(f"moe_tkg: backend={backend!r}: the NKI kernel is not in this checkout yet; "
                              "use backend='torch'")
