"""A kernel module importing only the legacy annotation types, as AWS's core/router_topk/router_topk.py does: fine."""

import nki
import nki.language as nl

try:
    import neuronxcc.nki.typing as nt  # noqa: F401 - annotations only
    from neuronxcc.nki import typing as legacy_typing  # noqa: F401
except ImportError:
    nt = legacy_typing = None


@nki.jit
def kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    return out
