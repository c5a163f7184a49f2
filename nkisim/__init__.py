"""nkisim: a CPU interpreter of the NKI API (`nki`, `nki.language`, `nki.isa`; NKI 0.7 by default, the 0.6 parser's
rules under NKI_COMPILER_FRONTEND=custom) with hardware-constraint checks, a kernel-source linter and a per-engine
cost model.

`nkisim.install()` is the one place that registers the interpreter under the names `nki`, `nki.language`,
`nki.isa`, `nki.isa.constants`, `nki.typing` and `nki.collectives`: when the real `nki` package is not importable,
or when `NKISIM=1` forces it. An installed but unusable `nki` is reported, never silently replaced (see
`install`). `nkisim.simulate_collective` / `nkisim.run_ranks` launch N ranks of a kernel that uses collectives
(threads); `nkisim.process_world` makes each process's launches one rank of a world spread over processes.
"""

import importlib.machinery
import importlib.util
import os
import sys
import warnings

from .cost import profile  # noqa: F401,E402
from .errors import NkiCapacityError, NkiValidationError  # noqa: F401
from .jit import Kernel, RunResult, jit, run, simulate  # noqa: F401
from .target import resolve_target  # noqa: F401
from .world import (  # noqa: F401
    NkiCollectiveError,
    WorldResult,
    per_rank,
    process_world,
    run_ranks,
    simulate_collective,
)

_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.typing", "nki.collectives", "nki.compiler")
_PLACEHOLDER_MARK = "WRONG PACKAGE"   # PyPI's `nki` 0.0.1 is a placeholder whose import raises this ImportError


class RealNkiPlaceholderWarning(UserWarning):
    """PyPI's placeholder `nki` wheel is installed (not AWS's package); nkisim serves `import nki` instead."""


def _probe_real_nki():
    """('absent' | 'ok' | 'placeholder' | 'broken', description) of the `nki` that `import nki` would load."""
    try:
        spec = importlib.util.find_spec("nki")
    except ValueError:            # an `nki` module without a spec is already in sys.modules
        spec = getattr(sys.modules.get("nki"), "__spec__", None) or importlib.machinery.ModuleSpec("nki", None)
    if spec is None:
        return "absent", ""
    where = spec.origin or ", ".join(spec.submodule_search_locations or ()) or "?"
    try:
        import nki as real
    except Exception as exc:  # noqa: BLE001 - every failure is reported below, with its type and message
        _drop_real_modules()
        if isinstance(exc, ImportError) and _PLACEHOLDER_MARK in str(exc):
            return "placeholder", f"the installed `nki` ({where}) is PyPI's placeholder wheel: {exc}"
        return "broken", f"importing the installed `nki` ({where}) raised {type(exc).__name__}: {exc}"
    missing = [] if hasattr(real, "jit") else ["jit"]
    if not hasattr(real, "isa") and importlib.util.find_spec("nki.isa") is None:
        missing.append("isa")
    if missing:
        _drop_real_modules()
        return "broken", (f"the importable `nki` ({where}) is not AWS's NKI package: it has no "
                          f"{' / '.join('nki.' + m for m in missing)}")
    return "ok", where


def _drop_real_modules():
    """Forget the modules a failed probe left behind (`nki.*` submodules that imported before the failure)."""
    for name in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
        del sys.modules[name]


def install(force: bool | None = None) -> bool:
    """Register nkisim as `nki` unless the real package is importable (or NKISIM=1 forces it).

    Returns True when nkisim serves `import nki`, False when the real package does.

    When an `nki` is installed but unusable, nkisim never falls back silently:
    - PyPI's placeholder wheel (`pip install nki` gives a 1 kB package whose import raises "WRONG PACKAGE ...";
      AWS's package comes from the Neuron repository): nothing real could run, so nkisim serves `import nki` and
      emits a `RealNkiPlaceholderWarning` saying so.
    - any other failure (the import raises, or the module has no `nki.jit` / `nki.isa`, e.g. a local `nki/`
      directory shadowing it): a Neuron install meant for the device is broken, and simulating would silently
      turn device runs into CPU runs, so this raises ImportError naming the exception. Fix the installation, or
      set NKISIM=1 (or call install(force=True)) to use the interpreter deliberately; forcing skips the probe.
    """
    from . import collectives, isa, language, nki_typing
    from . import nki as api
    from .isa import constants
    if sys.modules.get("nki") is api:
        return True
    if force is None:
        force = os.environ.get("NKISIM", "") == "1"
    if not force:
        status, detail = _probe_real_nki()
        if status == "ok":
            return False
        if status == "placeholder":
            warnings.warn(f"nkisim.install(): {detail} -- the real `nki` comes from AWS's Neuron package repository. "
                          "Using the nkisim CPU interpreter for `import nki` (set NKISIM=1 to choose it explicitly, "
                          "or `pip uninstall nki`).", RealNkiPlaceholderWarning, stacklevel=2)
        elif status == "broken":
            raise ImportError(f"nkisim.install(): {detail}. Not falling back to the CPU interpreter silently: fix "
                              "the `nki` installation, or set NKISIM=1 to use nkisim deliberately.")
    _drop_real_modules()
    from . import nki_compiler
    for name, mod in zip(_NAMES, (api, language, isa, constants, nki_typing, collectives, nki_compiler)):
        sys.modules[name] = mod
    _install_legacy_typing(nki_typing)
    _install_neuron_dtypes()
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
    for mod in (root, sub):
        mod.__path__ = []  # a package with nothing else to import
        # a spec, so importlib.util.find_spec("neuronxcc") still answers (it raises on a module without one)
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, is_package=True)
    root.nki, sub.typing = sub, nki_typing
    sys.modules.update({"neuronxcc": root, "neuronxcc.nki": sub, "neuronxcc.nki.typing": nki_typing})


def _install_neuron_dtypes() -> None:
    """AWS's `neuron_dtypes` (Neuron SDK, not on PyPI) is what reference code casts with; serve ours if absent."""
    if "neuron_dtypes" in sys.modules or importlib.util.find_spec("neuron_dtypes") is not None:
        return
    from . import neuron_dtypes
    sys.modules["neuron_dtypes"] = neuron_dtypes


def active() -> bool:
    """True when `import nki` resolves to this interpreter."""
    from . import nki as api
    return sys.modules.get("nki") is api
