"""Locating and importing AWS's nki-library from a checkout named by NKILIB_SRC (never vendored into the project).

NKILIB_SRC is the root of a checkout of github.com/aws-neuron/nki-library; its kernels are importable as
`nkilib_src.nkilib.<family>...` once `<root>/src` is on sys.path. nkisim is installed as `nki` first (forced), so
the library's `import nki` resolves to the interpreter even where a real `nki` happens to be importable.
"""

import importlib
import os
import sys
from pathlib import Path

ENV = "NKILIB_SRC"
PACKAGE = "nkilib_src.nkilib"


def root() -> Path | None:
    """The checkout named by NKILIB_SRC, or None when unset."""
    raw = os.environ.get(ENV)
    return Path(raw).expanduser().resolve() if raw else None


def skip_reason() -> str | None:
    """Why the library cannot be run here, or None when it can."""
    src = root()
    if src is None:
        return (f"{ENV} is unset: point it at a checkout of aws-neuron/nki-library to run its kernels "
                "(conformance suite, side-by-side benchmarks)")
    if not (src / "src" / "nkilib_src" / "nkilib").is_dir():
        return f"{ENV}={src} has no src/nkilib_src/nkilib: not a checkout of aws-neuron/nki-library"
    return None


def activate() -> None:
    """Put the library on sys.path behind the interpreter (idempotent). The checkout's root goes on the path too:
    some of the library's torch references import helpers from its test tree (`test.integration.nkilib.utils`,
    e.g. qkv_tkg_torch), so its `test` package must shadow the standard library's."""
    import nkisim
    nkisim.install(force=True)
    for path in (str(root()), str(root() / "src")):
        if path not in sys.path:
            sys.path.insert(0, path)
    test = sys.modules.get("test")
    if test is not None and not str(getattr(test, "__file__", "")).startswith(str(root())):
        for name in [m for m in sys.modules if m == "test" or m.startswith("test.")]:
            del sys.modules[name]


def load(ref: str):
    """`"core.cumsum.cumsum:cumsum"` → the object, imported from the library package (a callable passes through)."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    mod = importlib.import_module(f"{PACKAGE}.{module}")
    return getattr(mod, attr) if attr else mod
