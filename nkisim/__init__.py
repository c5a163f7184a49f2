"""nkisim: a CPU interpreter of the NKI 0.6 API (`nki`, `nki.language`, `nki.isa`) with hardware-constraint
checks, a kernel-source linter and a per-engine cost model.

`nkisim.install()` is the one place that registers the interpreter under the names `nki`, `nki.language`,
`nki.isa` and `nki.typing`: when the real `nki` package is not importable, or when `NKISIM=1` forces it.
"""

import importlib.util
import os
import sys

from .cost import profile  # noqa: F401,E402
from .errors import NkiCapacityError, NkiValidationError  # noqa: F401
from .jit import Kernel, RunResult, jit, run, simulate  # noqa: F401
from .target import resolve_target  # noqa: F401

_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.typing")


def _real_nki_available() -> bool:
    if importlib.util.find_spec("nki") is None:
        return False
    try:
        import nki as real  # noqa: F401 - probing the installed package
    except Exception:  # noqa: BLE001 - PyPI's placeholder wheel and broken installs count as absent
        return False
    return hasattr(real, "jit") and hasattr(real, "isa")


def install(force: bool | None = None) -> bool:
    """Register nkisim as `nki` unless the real package is importable (or NKISIM=1 forces it).

    Returns True when nkisim serves `import nki`, False when the real package does.
    """
    from . import isa, language, nki_typing
    from . import nki as api
    from .isa import constants
    if sys.modules.get("nki") is api:
        return True
    if force is None:
        force = os.environ.get("NKISIM", "") == "1"
    if not force and _real_nki_available():
        return False
    for name, mod in zip(_NAMES, (api, language, isa, constants, nki_typing)):
        sys.modules[name] = mod
    _install_legacy_typing(nki_typing)
    return True


def _install_legacy_typing(nki_typing) -> None:
    """`neuronxcc.nki.typing` for kernels that import annotation types from the legacy package (AWS's nki-library
    does) when neuronx-cc itself is absent. Only the typing module is provided: `neuronxcc.nki.language` and the rest
    stay unimportable, and the linter still flags them (rule neuronxcc-import)."""
    import types
    if "neuronxcc" in sys.modules or importlib.util.find_spec("neuronxcc") is not None:
        return
    root = types.ModuleType("neuronxcc", "nkisim stand-in: only neuronxcc.nki.typing exists")
    sub = types.ModuleType("neuronxcc.nki", "nkisim stand-in: only neuronxcc.nki.typing exists")
    root.__path__, sub.__path__ = [], []  # packages with nothing else to import
    root.nki, sub.typing = sub, nki_typing
    sys.modules.update({"neuronxcc": root, "neuronxcc.nki": sub, "neuronxcc.nki.typing": nki_typing})


def active() -> bool:
    """True when `import nki` resolves to this interpreter."""
    from . import nki as api
    return sys.modules.get("nki") is api
