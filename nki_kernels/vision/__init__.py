"""Block vision attention (Qwen3-VL-style packed image patches): the fused NKI kernel, its torch reference and a
functional entry that checks the arguments once and picks a backend.

    from nki_kernels.vision import vision_block_attention
    out = vision_block_attention(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads=4, head_dim=72)

Backends (as nki_kernels.attention): "nki" (AWS's real nki; device tensors), "nkisim" (the kernel on the CPU
interpreter), "torch" (the reference), "auto" ("nki" when the real package serves `import nki`, else "nkisim").
`lnc=2` runs the kernel on a two-core logical NeuronCore (query tiles split between the cores).

Returns out [S, H] in x's dtype (bf16): the partial O-projection of this rank's heads, WITHOUT the O bias -- the
encoder adds the bias once, after the tensor-parallel all-reduce (adding it on every rank would count it tp times).
bound_min / bound_max may be int64 (torch's default): they are checked on the host and passed on as int32.
"""

import numpy as np

from ..entry import BACKENDS, as_int32, resolve_backend, to_torch
from .block_attention_torch import vision_block_attention_torch
from .limits import argument_error, bounds_error

__all__ = ["vision_block_attention", "vision_block_attention_torch", "argument_error", "BACKENDS"]


def _numpy(t):
    return np.asarray(t.cpu() if hasattr(t, "cpu") else t).astype(np.int64)


def vision_block_attention(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, *, num_heads, head_dim,
                           backend="auto", lnc=1):
    """Fused block vision attention for one TP rank; see `vision_block_attention_torch` for the semantics and
    nki_kernels/vision/DESIGN.md for the kernel."""
    backend = resolve_backend("vision_block_attention", backend)
    if lnc not in (1, 2):
        raise ValueError(f"lnc={lnc!r} must be 1 or 2")
    bound_min, bound_max = as_int32("bound_min", bound_min), as_int32("bound_max", bound_max)
    err = argument_error(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads, head_dim)
    if err is None:
        err = bounds_error(_numpy(bound_min), _numpy(bound_max), x.shape[0])
    if err is not None:
        raise ValueError(err)
    args = (x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o)
    if backend == "torch":
        out = vision_block_attention_torch(*(to_torch(a) for a in args), num_heads=num_heads, head_dim=head_dim)
        if isinstance(x, np.ndarray):
            return out.float().numpy().astype(x.dtype)
        return out
    from .block_attention import vision_block_attention_nki
    kernel = vision_block_attention_nki if lnc == 1 else vision_block_attention_nki[lnc]
    return kernel(*args, num_heads=num_heads, head_dim=head_dim)
