"""The MoE kernels the module calls, behind one backend switch.

The functional entries ``nki_kernels.moe.router / moe_tkg / moe_cte`` (each with a ``backend`` argument) are used
when the package provides them. Until they land, backend "torch" runs the shared torch references of
``nki_kernels.moe.moe_torch`` with the same signatures, and any other backend is refused by name.
"""

from __future__ import annotations

import nki_kernels.moe as _moe
from nki_kernels.moe.moe_torch import moe_experts_torch, moe_torch, router_torch


def _entry(name: str, backend: str):
    fn = getattr(_moe, name, None)
    if fn is not None:
        return fn
    if backend != "torch":
        raise ValueError(f"MoE {name}: backend={backend!r} needs nki_kernels.moe.{name}, which this checkout "
                         "does not provide; use backend='torch'")
    return None


def router(x, w_router, b_router=None, *, top_k, mode="gpt_oss", renormalize=False, backend="torch"):
    """→ (logits [T, E], expert_index [T, k], affinities [T, k])."""
    fn = _entry("router", backend)
    if fn is not None:
        return fn(x, w_router, b_router, top_k=top_k, mode=mode, renormalize=renormalize, backend=backend)
    return router_torch(x, w_router, b_router, top_k=top_k, mode=mode, renormalize=renormalize)


def moe_tkg(x, w_router, w_gate_up, w_down, *, top_k, b_router=None, b_gate_up=None, b_down=None, gamma=None,
            eps=1e-5, hidden_actual=None, router_mode="gpt_oss", renormalize=False, activation="clamped_swiglu",
            add_down_bias=True, expert_mode="auto", backend="torch"):
    """Decode: (fused RMSNorm) + router + experts → (partial out [T, H], expert_index, affinities)."""
    fn = _entry("moe_tkg", backend)
    if fn is not None:
        return fn(x, w_router, w_gate_up, w_down, top_k=top_k, b_router=b_router, b_gate_up=b_gate_up,
                  b_down=b_down, gamma=gamma, eps=eps, hidden_actual=hidden_actual, router_mode=router_mode,
                  renormalize=renormalize, activation=activation, add_down_bias=add_down_bias,
                  expert_mode=expert_mode, backend=backend)
    # expert_mode is a kernel scheduling choice (selective vs all-expert); the reference has one result for both.
    return moe_torch(x, w_router, w_gate_up, w_down, top_k=top_k, b_router=b_router, b_gate_up=b_gate_up,
                     b_down=b_down, gamma=gamma, eps=eps, hidden_actual=hidden_actual, router_mode=router_mode,
                     renormalize=renormalize, activation=activation, add_down_bias=add_down_bias)


def moe_cte(x, expert_index, affinities, w_gate_up, w_down, *, b_gate_up=None, b_down=None,
            activation="clamped_swiglu", add_down_bias=True, block_size=None, backend="torch"):
    """Prefill: experts on pre-routed tokens → partial out [T, H]."""
    fn = _entry("moe_cte", backend)
    if fn is not None:
        return fn(x, expert_index, affinities, w_gate_up, w_down, b_gate_up=b_gate_up, b_down=b_down,
                  activation=activation, add_down_bias=add_down_bias, block_size=block_size, backend=backend)
    # block_size only tiles the kernel's blockwise dispatch; the reference result does not depend on it.
    return moe_experts_torch(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down, activation,
                             add_down_bias)
