"""nkisim.install(): which `nki` serves `import nki`, and loud reports of an installed but unusable `nki`.

Each test puts a fake `nki` package on sys.path (tmp_path) with the interpreter's registration removed from
sys.modules, and restores the session's modules afterwards.
"""

import importlib
import sys
import warnings

import pytest

import nkisim
from nkisim import nki as nkisim_api

PLACEHOLDER = ('raise ImportError("WRONG PACKAGE. Please install the package from Neuron Repository - '
               'pip.repos.neuron.amazonaws.com")\n')   # PyPI nki 0.0.1's whole nki/__init__.py


@pytest.fixture
def fake_nki(tmp_path, monkeypatch):
    """fake_nki(source, files={}): an `nki` package with __init__.py = source (+ submodules) first on sys.path."""
    saved = {n: m for n, m in sys.modules.items() if n == "nki" or n.startswith("nki.")}
    for n in saved:
        del sys.modules[n]
    monkeypatch.delenv("NKISIM", raising=False)

    def make(source, files=None):
        pkg = tmp_path / "nki"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(source)
        for name, text in (files or {}).items():
            (pkg / name).write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        return pkg

    yield make
    for n in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
        del sys.modules[n]
    sys.modules.update(saved)


def test_placeholder_wheel_is_recognised_and_simulated_with_a_warning(fake_nki):
    pkg = fake_nki(PLACEHOLDER)
    with pytest.warns(nkisim.RealNkiPlaceholderWarning, match="PyPI's placeholder wheel.*WRONG PACKAGE") as rec:
        assert nkisim.install() is True
    assert str(pkg) in str(rec[0].message) and "Neuron package repository" in str(rec[0].message)
    assert sys.modules["nki"] is nkisim_api
    import nki.isa
    assert nki.isa is sys.modules["nki.isa"] and hasattr(nki.isa, "nc_matmul")


def test_broken_install_raises_naming_the_exception(fake_nki):
    fake_nki("from . import _native\n", {"_native.py": "raise OSError('libnrt.so.1: cannot open shared object')\n"})
    with pytest.raises(ImportError, match=r"raised OSError: libnrt\.so\.1: cannot open shared object.*NKISIM=1"):
        nkisim.install()
    assert "nki" not in sys.modules   # nothing half-registered


def test_other_import_error_is_not_mistaken_for_the_placeholder(fake_nki):
    fake_nki("import neuronxcc_missing_dependency\n")
    with pytest.raises(ImportError, match="raised ModuleNotFoundError: No module named 'neuronxcc_missing"):
        nkisim.install()


def test_module_without_jit_or_isa_is_reported(fake_nki):
    fake_nki("language = None\n")     # e.g. a local nki/ directory shadowing the real package
    with pytest.raises(ImportError, match=r"is not AWS's NKI package: it has no nki\.jit / nki\.isa"):
        nkisim.install()
    assert "nki" not in sys.modules


def test_nkisim_1_uses_the_interpreter_without_probing(fake_nki, monkeypatch):
    fake_nki("raise RuntimeError('must not be imported when NKISIM=1')\n")
    monkeypatch.setenv("NKISIM", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nkisim.install() is True
    assert sys.modules["nki"] is nkisim_api


def test_working_real_package_is_left_alone(fake_nki):
    fake_nki("def jit(f=None, **kw):\n    return f\n", {"isa.py": "", "language.py": ""})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nkisim.install() is False
    import nki
    import nki.isa
    assert nki is not nkisim_api and not nkisim.active() and nki.isa is not nkisim.isa


def test_absent_package_is_simulated_silently(fake_nki, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nkisim.install() is True
    assert nkisim.active()
