"""Layering: bench/ (the top layer) imports nothing from tests/; shared kernels and input builders are library code."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _imports(path: Path) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.append(node.module)
    return mods


def test_bench_imports_nothing_from_tests():
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 10
    bad = {str(f.relative_to(BENCH.parent)): m for f in files for m in _imports(f)
           if m == "tests" or m.startswith("tests.")}
    assert not bad, f"bench/ must not import tests/ (move the shared code into library code): {bad}"
