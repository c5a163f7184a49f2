"""The `nki` top-level module as nkisim provides it (registered by `nkisim.install()`)."""

from .. import collectives, isa, language  # noqa: F401
from .. import nki_compiler as compiler  # noqa: F401 - `nki.compiler.CompileConfig` / `SpecializationConfig`
from .. import nki_typing as typing  # noqa: F401
from ..dtypes import DType as dtype  # noqa: F401 - `nki.dtype`, the type of nl.bfloat16 & co. (annotations)
from ..jit import Kernel, jit, simulate  # noqa: F401

__version__ = "0.7.0+nkisim"


def _not_available(name):
    def fn(*_a, **_k):
        raise NotImplementedError(f"nki.{name} does not exist in the nki.* namespace (removed in NKI 0.2.0); "
                                  "use nki.simulate, or nkisim.profile for a modelled timeline")
    fn.__name__ = name
    return fn


baremetal = _not_available("baremetal")
benchmark = _not_available("benchmark")
profile = _not_available("profile")
simulate_kernel = _not_available("simulate_kernel")
