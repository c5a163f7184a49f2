"""The typing exemption covers that one module only: importing the legacy language beside it is refused."""

import nki
import nki.language as nl

try:
    from neuronxcc.nki import language, typing  # <- mixed-neuronxcc
except ImportError:
    language = typing = None


@nki.jit
def kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    return out
