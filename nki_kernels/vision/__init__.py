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

import nkisim

from .block_attention_torch import vision_block_attention_torch
from .limits import argument_error, bounds_error

__all__ = ["vision_block_attention", "vision_block_attention_torch", "argument_error", "BACKENDS"]

BACKENDS = ("auto", "nki", "nkisim", "torch")


def _int32(name, t):
    """int32 / int64 bound tensors (torch or NumPy) as int32; any other dtype is an error naming the argument."""
    dtype = str(t.dtype).replace("torch.", "")
    if dtype == "int32":
        return t
    if dtype != "int64":
        raise ValueError(f"{name} must be int32 or int64, got {dtype}")
    if isinstance(t, np.ndarray):
        return t.astype(np.int32)
    import torch
    return t.to(torch.int32)


def _numpy(t):
    return np.asarray(t.cpu() if hasattr(t, "cpu") else t).astype(np.int64)


def _to_torch(a):
    import torch
    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a)


def vision_block_attention(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, *, num_heads, head_dim,
                           backend="auto", lnc=1):
    """Fused block vision attention for one TP rank; see `vision_block_attention_torch` for the semantics and
    nki_kernels/vision/DESIGN.md for the kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if lnc not in (1, 2):
        raise ValueError(f"lnc={lnc!r} must be 1 or 2")
    bound_min, bound_max = _int32("bound_min", bound_min), _int32("bound_max", bound_max)
    err = argument_error(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads, head_dim)
    if err is None:
        err = bounds_error(_numpy(bound_min), _numpy(bound_max), x.shape[0])
    if err is not None:
        raise ValueError(err)
    args = (x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o)
    if backend == "auto":
        backend = "nkisim" if nkisim.active() else "nki"
    if backend == "torch":
        out = vision_block_attention_torch(*(_to_torch(a) for a in args), num_heads=num_heads, head_dim=head_dim)
        if isinstance(x, np.ndarray):
            return out.float().numpy().astype(x.dtype)
        return out
    if backend == "nkisim" and not nkisim.active():
        raise RuntimeError("backend='nkisim' needs nkisim to serve `import nki` (set NKISIM=1 before importing)")
    if backend == "nki" and nkisim.active():
        raise RuntimeError("backend='nki' needs AWS's real nki package; `import nki` is served by nkisim here")
    from .block_attention import vision_block_attention_nki
    kernel = vision_block_attention_nki if lnc == 1 else vision_block_attention_nki[lnc]
    return kernel(*args, num_heads=num_heads, head_dim=head_dim)
