"""Functional entry of the blockwise CTE (prefill) MoE: argument checks, the host-side mapping, backend choice.

`moe_cte(...)` takes torch tensors (or NumPy arrays) and runs one of:
  - "nki":    the kernel compiled by AWS's real `nki`;
  - "nkisim": the kernel on the nkisim CPU interpreter (when nkisim serves `import nki`);
  - "torch":  the torch reference (moe_cte_torch.py, same rounding points);
  - "auto":   "nki" when the real package serves `import nki`, else "nkisim".
Every check runs before any work, whatever the backend.
"""

import numpy as np

from ..entry import BACKENDS, resolve_backend, to_torch
from .blockwise import BLOCK_MAX, blockwise_mapping, check_block_size
from .gate_up_layout import gate_up_layout, gate_up_layout_error, logical_gate_up
from .moe_torch import ACTIVATIONS

H_ALIGN = 128          # H lives on the 128 SBUF partitions in 128-row tiles (the gate/up contraction)
AUTO_BLOCK_SIZE = BLOCK_MAX   # the kernel works in 128-row tiles and skips empty ones, so the block size only sets
                              # the mapping's layout: the largest block means the fewest blocks (and mapping entries)


def _shape(t):
    return tuple(int(s) for s in t.shape)


def argument_error(x, expert_index, affinities, w_gate_up, w_down, b_gate_up=None, b_down=None,
                   activation="clamped_swiglu", block_size=None):
    """The first problem with the arguments as a message naming the argument and the limit, or None."""
    if len(_shape(x)) != 2 or x.shape[0] < 1:
        return f"moe_cte: x must be [T, H] with T >= 1, got shape {_shape(x)}"
    T, H = _shape(x)
    if H % H_ALIGN:
        return f"moe_cte: H={H} must be a multiple of {H_ALIGN} (pad the hidden size)"
    err = gate_up_layout_error("moe_cte", _shape(w_gate_up), H)
    if err:
        return err
    _, E, inter = gate_up_layout(_shape(w_gate_up), H)
    if _shape(w_down) != (E, inter, H):
        return f"moe_cte: w_down must be [E={E}, I={inter}, H={H}] to match w_gate_up, got shape {_shape(w_down)}"
    if b_gate_up is not None and _shape(b_gate_up) != (E, 2, inter):
        return f"moe_cte: b_gate_up must be [E={E}, 2, I={inter}], got shape {_shape(b_gate_up)}"
    if b_down is not None and _shape(b_down) != (E, H):
        return f"moe_cte: b_down must be [E={E}, H={H}], got shape {_shape(b_down)}"
    if len(_shape(expert_index)) != 2 or expert_index.shape[0] != T:
        return f"moe_cte: expert_index must be [T={T}, k], got shape {_shape(expert_index)}"
    k = _shape(expert_index)[1]
    if not 1 <= k <= E:
        return f"moe_cte: top_k={k} (expert_index columns) must be in [1, E={E}]"
    if _shape(affinities) != (T, k):
        return f"moe_cte: affinities must be [T={T}, k={k}] like expert_index, got shape {_shape(affinities)}"
    if activation not in ACTIVATIONS:
        return f"moe_cte: activation={activation!r} must be one of {ACTIVATIONS}"
    if block_size is not None:
        try:
            check_block_size(block_size, "moe_cte")
        except ValueError as e:
            return str(e)
    idx = np.asarray(expert_index.cpu() if hasattr(expert_index, "cpu") else expert_index)
    if not np.issubdtype(idx.dtype, np.integer):
        return f"moe_cte: expert_index must be an integer tensor, got {idx.dtype}"
    if idx.min() < 0 or idx.max() >= E:
        return f"moe_cte: expert_index values must be in [0, E={E}), got [{idx.min()}, {idx.max()}]"
    if k > 1 and (np.diff(np.sort(idx, axis=1), axis=1) == 0).any():
        return "moe_cte: a token lists the same expert twice in expert_index (top-k experts must be distinct)"
    return None


def moe_cte(x, expert_index, affinities, w_gate_up, w_down, *, b_gate_up=None, b_down=None,
            activation="clamped_swiglu", add_down_bias=True, block_size=None, backend="auto", lnc=1,
            w_gate_up_scale=None, w_down_scale=None):
    """Σ_k affinity · expert(x) over the blockwise mapping for one TP rank → out [T, H] (x's dtype), the partial sum
    for the reduce-scatter; the down bias is added iff add_down_bias (True on exactly one rank of the TP group).

    x [T, H]; expert_index [T, k] (local expert ids, distinct per token); affinities [T, k];
    w_gate_up [E, H, 2, I] (moe_torch.py's layout) or tiled [E, 128, H/128, 2I] (gate_up_layout.py, what MoELayer
    holds: one DMA run per partition); w_down [E, I, H]; b_gate_up [E, 2, I]; b_down [E, H].
    block_size: rows per block (a multiple of 128 in 128..512), None = auto.
    w_gate_up_scale / w_down_scale: given, the weights are MXFP4 in mx_weights.py's kernel layout (w_gate_up
    [E, 128, H/512, 2I] float4_e2m1fn_x4 words, w_down [E, 128, KDm, H], scales [E, 16, chunks, N] uint8): the
    kernel runs its trn3 MX path (x and the activations quantised to MXFP8 on chip); "torch" dequantises and models
    that quantisation (moe_cte_torch mx=True).
    """
    if backend not in BACKENDS:       # (resolve_backend says so too; this one comes before the other checks)
        raise ValueError(f"moe_cte: backend={backend!r} must be one of {BACKENDS}")
    if lnc not in (1, 2):
        raise ValueError(f"moe_cte: lnc={lnc} must be 1 or 2")
    if not isinstance(add_down_bias, bool):
        raise ValueError(f"moe_cte: add_down_bias={add_down_bias!r} must be a bool")
    mx = w_gate_up_scale is not None
    if mx:
        from .mx_weights import logical_weights, packed_weights_error
        err = packed_weights_error(_shape(x)[1], w_gate_up, w_down, w_gate_up_scale, w_down_scale, "moe_cte")
        if err is not None:
            raise ValueError(err)
        ref_gu, ref_d = logical_weights(w_gate_up, w_down, w_gate_up_scale, w_down_scale, backend)
        err = argument_error(x, expert_index, affinities, ref_gu, ref_d, b_gate_up, b_down, activation, block_size)
    else:
        err = argument_error(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down, activation,
                             block_size)
    if err is not None:
        raise ValueError(err)
    B = AUTO_BLOCK_SIZE if block_size is None else int(block_size)
    if backend == "torch":
        from .moe_cte_torch import moe_cte_torch
        tx = to_torch
        mapping = blockwise_mapping(expert_index, w_gate_up.shape[0], B)
        wg, wd = (ref_gu, ref_d) if mx else (logical_gate_up(tx(w_gate_up), x.shape[1]), tx(w_down))
        out = moe_cte_torch(tx(x), tx(expert_index), tx(affinities), wg, wd, tx(b_gate_up), tx(b_down), activation,
                            add_down_bias, B, mapping=mapping, mx=mx)
        return out.float().numpy().astype(x.dtype) if isinstance(x, np.ndarray) else out
    backend = resolve_backend("moe_cte", backend)
    from .moe_cte import run_kernel
    scales = dict(w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale) if mx else {}
    return run_kernel(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down, activation,
                      add_down_bias, B, lnc, **scales)
