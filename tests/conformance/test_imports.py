"""Every kernel module of the nki-library's core/ and experimental/ imports under nkisim (issue 9 §2).

A module may only fail to import because its own source does not parse (a defect of the library checkout, not of
nkisim: e.g. release 2026-04-13's core/mlp/mlp.py closes its docstring early); any other exception -- a name nkisim
lacks, an import-time check -- fails the test. The modules that could not be imported are printed with the reason.
"""

import importlib
import traceback

import pytest

from bench.peers import nkilib

FAMILIES = ("core", "experimental")


def _modules():
    base = nkilib.root() / "src" / "nkilib_src" / "nkilib"
    for family in FAMILIES:
        for path in sorted((base / family).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts)


def _library_does_not_parse(exc):
    """The innermost frame of a SyntaxError names the file that failed to parse: one of the library's own."""
    return isinstance(exc, SyntaxError) and str(nkilib.root()) in str(exc.filename or "")


@pytest.mark.nkilib
def test_every_kernel_module_imports(capsys):
    nkilib.activate()
    imported, unparsable, errors = 0, {}, {}
    for name in _modules():
        try:
            importlib.import_module(f"{nkilib.PACKAGE}.{name}")
            imported += 1
        except Exception as exc:  # noqa: BLE001 - every failure is classified below
            if _library_does_not_parse(exc):
                unparsable[name] = f"{type(exc).__name__} in {exc.filename}:{exc.lineno}: {exc.msg}"
            else:
                errors[name] = "".join(traceback.format_exception_only(exc)).strip()
    with capsys.disabled():
        print(f"\nnki-library modules: {imported} imported, {len(unparsable)} do not parse in the checkout, "
              f"{len(errors)} fail under nkisim")
        for name, why in {**unparsable, **errors}.items():
            print(f"  {name}: {why}")
    assert imported > 100, f"only {imported} modules imported: is NKILIB_SRC the whole library?"
    assert not errors, f"modules failing to import under nkisim: {errors}"
