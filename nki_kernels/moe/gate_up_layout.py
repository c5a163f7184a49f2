"""The bf16 experts' gate/up weight layouts, one definition for the CTE and TKG kernels, their entries and MoELayer.

Two layouts are accepted, recognised by shape:
  - "hidden" [E, H, 2, I] (moe_torch's, the references' layout): element [e, h, g, i], g = 0 gate, 1 up;
  - "tiled"  [E, 128, H/128, 2I] (`tile_gate_up`): element [e, p, kt, g * I + i] = w[e, kt * 128 + p, g, i].

Why the tiled layout exists: a kernel's gate/up contraction puts 128 H rows of an expert on the partitions per
contraction tile kt. With natural H tiles (H row kt * 128 + p on partition p, what a DMA transpose of x or a TensorE
transpose of a natural x column tile gives), the [E, H, 2, I] layout makes every (partition, kt) a DMA run of its own
2I elements (720 B at GPT-OSS-120B TP16: ~74 % DMA efficiency in the cost model), while in the tiled layout each
partition's rows of an expert are ONE contiguous run of KT * 2I elements (~94 % with the CTE's 4 DMAs per expert).
It is a load-time permutation (as MXFP4's packing), so MoELayer holds it once and passes it to both kernels: holding
both layouts would double the expert weights in HBM. (The [E, H, 2, I] layout read in the order H row p * KT + kt on
partition p is also one run per partition: the TKG kernel's router-side hT order; with tiled weights the TKG kernel
transposes x into natural tiles for the experts instead, see moe_tkg._natural_hT_step.)

A partition p / kt block of the tiled layout has the same flat offset, e * H * 2I + (p * KT + kt) * 2I, as the
[E, H, 2, I] element of H row p * KT + kt: the kernels' DMA access patterns of an expert's rows are the same for both
layouts; only WHICH H row sits at (p, kt) differs, i.e. the order of the x^T operand they are contracted with.

Host functions take numpy arrays or torch tensors; the shape functions take shape tuples (usable inside kernels).
"""

import numpy as np

P = 128     # SBUF partitions: the H tile of the contraction

LAYOUTS = "[E, H, 2, I] or tiled [E, 128, H/128, 2I] (gate_up_layout.tile_gate_up)"


def tile_gate_up(w_gate_up):
    """[E, H, 2, I] → the tiled layout [E, 128, H/128, 2I]: element [e, p, kt, g * I + i] = w[e, kt * 128 + p, g, i]
    (module docstring). numpy or torch (contiguous result)."""
    E, H, two, inter = w_gate_up.shape
    w = w_gate_up.reshape(E, H // P, P, two * inter)
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w.transpose(0, 2, 1, 3))
    return w.transpose(1, 2).contiguous()


def untile_gate_up(w_tiled):
    """tile_gate_up's inverse: [E, 128, H/128, 2I] → [E, H, 2, I] (references, tests). numpy or torch."""
    E, p, KT, i2 = w_tiled.shape
    if isinstance(w_tiled, np.ndarray):
        return np.ascontiguousarray(w_tiled.transpose(0, 2, 1, 3)).reshape(E, KT * p, 2, i2 // 2)
    return w_tiled.transpose(1, 2).contiguous().reshape(E, KT * p, 2, i2 // 2)


def gate_up_layout(shape, H):
    """(tiled, E, I) for a gate/up shape of hidden size H in either layout, or None when it is neither."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4 or H % P:
        return None
    if shape[1:3] == (H, 2):
        return False, shape[0], shape[3]
    if shape[1:3] == (P, H // P) and shape[3] % 2 == 0 and shape[3] > 0:
        return True, shape[0], shape[3] // 2
    return None


def is_tiled(shape, H):
    """The shape is the tiled layout's (gate_up_layout)."""
    lay = gate_up_layout(shape, H)
    return lay is not None and lay[0]


def gate_up_layout_error(op, shape, H, E=None):
    """None when `shape` is one of the two layouts (with E experts when given), else the message naming w_gate_up
    and both accepted layouts."""
    lay = gate_up_layout(shape, H)
    if lay is None or (E is not None and lay[1] != E):
        e = "E" if E is None else f"E={E}"
        return (f"{op}: w_gate_up must be [{e}, H={H}, 2, I] or tiled [{e}, {P}, H/{P}={H // P}, 2I] "
                f"(gate_up_layout.tile_gate_up), got shape {tuple(int(s) for s in shape)}")
    return None


def logical_gate_up(w_gate_up, H):
    """The weights in the [E, H, 2, I] layout (the references'): untiled when tiled, else as given."""
    return untile_gate_up(w_gate_up) if is_tiled(w_gate_up.shape, H) else w_gate_up
