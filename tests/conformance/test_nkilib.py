"""Every case of every `cases_*.py` module: an nki-library kernel run unmodified under nkisim vs its reference."""

import importlib
import pkgutil
import traceback
from pathlib import Path

import pytest

from bench.peers import nkilib

from . import harness


def _all_cases() -> list[harness.Case]:
    cases = []
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]),
                       key=lambda m: m.name):
        if info.name.startswith("cases_"):
            cases.extend(importlib.import_module(f"{__package__}.{info.name}").CASES)
    return cases


CASES = _all_cases()


@pytest.mark.nkilib
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.timeout(c.timeout_s)] if c.timeout_s else [])
                                  for c in CASES], ids=[c.id for c in CASES])
def test_nkilib_kernel(case):
    nkilib.activate()
    try:
        result = harness.run_case(case)
    except Exception as exc:
        harness.RESULTS.append(harness.Result(case, False, error=f"{type(exc).__name__}: {exc}".replace("\n", " ")))
        traceback.print_exc()
        raise
    harness.RESULTS.append(result)
    assert result.passed, (f"{case.id}: max |kernel - golden| = {result.max_err:.4g} > tolerance {result.tol:.4g} "
                           f"(atol {case.atol}, rtol {case.rtol}, max mode)")
