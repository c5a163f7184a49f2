"""A module that (also) imports the legacy namespace at module level: every kernel in it is refused."""

import nki
import nki.language as nl

try:
    import neuronxcc.nki.language as legacy_nl  # <- module-neuronxcc
except ImportError:
    legacy_nl = None


@nki.jit
def kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    return out
