"""Tests for nkisim.lint, the static checker of the NKI language rules.

The legacy parser's Python-subset rules (``lint.PARSER_RULES``) apply only under ``NKI_COMPILER_FRONTEND=custom``: each
of them has a negative test under the ``parser`` fixture and a positive twin under the default (0.7 tracing) frontend.

These tests do not need the interpreter modules: a minimal fake ``nki`` / ``nki.language`` / ``nki.isa`` is registered
in ``sys.modules`` by a fixture (monkeypatch restores it), the small kernels live in ``lint_cases/`` and every
offending line there carries a unique ``# <- tag`` marker, so each negative test asserts the rule id and the exact
file and line of the construct.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types

import numpy as np
import pytest

from nkisim import lint
from nkisim.lint import NkiLanguageError, Violation, check_call_args, check_kernel, check_outputs

pytestmark = pytest.mark.usefixtures("tracing")   # every test starts under the 0.7 frontend (conftest)


CASES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lint_cases")
PKG = "_nkisim_lint_cases"

# Replaced by the fake modules for the tests that define kernels inline (see `inline_nl`).
nl = None
nisa = None


# ----------------------------------------------------------------------------------------------------------------------
# Fakes and helpers
# ----------------------------------------------------------------------------------------------------------------------


class _Buffer:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"nl.{self.name}"


class _Kernel:
    """Stand-in for the object nki.jit returns."""

    _is_nki_kernel = True

    def __init__(self, func):
        self.__wrapped__ = func
        self.__name__ = func.__name__

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __getitem__(self, grid):
        return self


def _op(name):
    def op(*args, **kwargs):
        raise AssertionError(f"fake {name} must never be called by the checker")

    op.__name__ = name
    return op


def make_fake_nki(prefix=""):
    """Fresh fake nki, nki.language and nki.isa modules (``prefix`` changes their __name__, e.g. 'vendor.')."""
    nki = types.ModuleType(prefix + "nki")
    language = types.ModuleType(prefix + "nki.language")
    isa = types.ModuleType(prefix + "nki.isa")

    class NKIObject:
        pass

    language.NKIObject = NKIObject
    for name in ("sbuf", "psum", "hbm", "private_hbm", "shared_hbm"):
        setattr(language, name, _Buffer(name))
    for name in ("float32", "bfloat16", "int32"):
        setattr(language, name, np.dtype("float32") if name == "float32" else name)
    for name in ("arange", "ndarray", "zeros", "ds", "affine_range", "exp", "relu", "gelu", "add", "multiply", "copy"):
        setattr(language, name, _op("nl." + name))
    language.mgrid = object()
    language.tile_size = types.SimpleNamespace(pmax=128, gemm_stationary_fmax=128, gemm_moving_fmax=512)
    for name in ("dma_copy", "tensor_copy", "nc_matmul", "memset", "iota", "activation", "tensor_tensor",
                 "tensor_scalar"):
        setattr(isa, name, _op("nisa." + name))
    nki.language = language
    nki.isa = isa
    nki.jit = _Kernel
    return nki, language, isa


@pytest.fixture
def fake_nki(monkeypatch):
    """Register the fake nki modules; drop every lint_cases module and the checker's cache afterwards."""
    nki, language, isa = make_fake_nki()
    monkeypatch.setitem(sys.modules, "nki", nki)
    monkeypatch.setitem(sys.modules, "nki.language", language)
    monkeypatch.setitem(sys.modules, "nki.isa", isa)
    lint.clear_cache()
    yield types.SimpleNamespace(nki=nki, nl=language, nisa=isa)
    for name in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
        del sys.modules[name]
    lint.clear_cache()


@pytest.fixture
def no_nki(monkeypatch):
    """Make sure no nki module is registered (the checker must then fall back on names)."""
    for name in ("nki", "nki.language", "nki.isa"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    lint.clear_cache()
    yield
    lint.clear_cache()


@pytest.fixture
def inline_nl(monkeypatch, fake_nki):
    """Expose the fake modules as this test module's `nl` / `nisa` globals, for kernels defined inside tests."""
    monkeypatch.setitem(globals(), "nl", fake_nki.nl)
    monkeypatch.setitem(globals(), "nisa", fake_nki.nisa)
    return fake_nki


def load_case(module):
    """Import tests/nkisim/lint_cases/<module>.py as part of a private package (relative imports work)."""
    if PKG not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            PKG, os.path.join(CASES_DIR, "__init__.py"), submodule_search_locations=[CASES_DIR])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[PKG] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"{PKG}.{module}")


def case_file(module):
    return os.path.join(CASES_DIR, module + ".py")


def marker_line(path, tag):
    """1-based line of the unique line that ends with '# <- tag'."""
    with open(path) as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# <- {tag}")]
    assert len(hits) == 1, (path, tag, hits)
    return hits[0]


def where(violations):
    return sorted((v.rule, v.file, v.line) for v in violations)


def expect(module, tag, rule):
    path = case_file(module)
    return (rule, path, marker_line(path, tag))


def line_of_def(fn):
    """Line of the `def` statement (after decorators)."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if text.lstrip().startswith("def "))


# ----------------------------------------------------------------------------------------------------------------------
# Negative tests: one per rule, each asserting rule id, file and line
# ----------------------------------------------------------------------------------------------------------------------


def test_kwonly_param(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.kwonly_kernel)) == [expect("bad_kernels", "kwonly", "kwonly-param")]


def test_is_compare(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.is_kernel)) == [expect("bad_kernels", "is", "is-compare")]


def test_is_not_compare_in_comprehension(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.is_not_kernel)) == [expect("bad_kernels", "is-not", "is-compare")]


def test_is_compare_in_helper_of_another_module(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.helper_is_kernel)) == [expect("bad_helpers", "helper-is", "is-compare")]


def test_list_arg_positional_and_keyword(fake_nki, parser):
    mod = load_case("bad_kernels")
    kernel = mod.helper_is_kernel
    def_line = line_of_def(kernel.__wrapped__)
    got = check_call_args(kernel, ([1, 2],), {})
    assert where(got) == [("list-arg", case_file("bad_kernels"), def_line)]
    assert "'a'" in got[0].message
    got = check_call_args(mod.is_kernel, (np.zeros(3),), {"b": [np.zeros(2)]})
    assert where(got) == [("list-arg", case_file("bad_kernels"), line_of_def(mod.is_kernel.__wrapped__))]
    assert "'b'" in got[0].message


def test_class_base_module_level_class(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.class_kernel)) == [expect("bad_kernels", "options-class", "class-base")]


def test_class_base_global_instance_of_plain_class(fake_nki, parser):
    """A module-level instance of a plain class is flagged at the class; a user exception class is fine."""
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.global_instance_kernel)) == [expect("bad_kernels", "settings-class", "class-base")]


def test_class_base_helper_class_and_its_methods(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.helper_class_kernel)) == sorted([
        expect("bad_helpers", "plain-class", "class-base"),
        expect("bad_helpers", "method-is", "is-compare"),
    ])


def test_class_base_nested_class(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.nested_class_kernel)) == [expect("bad_kernels", "nested-class", "class-base")]


def test_neuronxcc_import_at_module_level(fake_nki):
    mod = load_case("bad_neuronxcc")
    got = check_kernel(mod.kernel)
    assert where(got) == [expect("bad_neuronxcc", "module-neuronxcc", "neuronxcc-import")]
    assert "neuronxcc.nki.language" in got[0].message


def test_neuronxcc_typing_alone_is_not_flagged(fake_nki):
    # AWS's hardware-tested router_topk imports neuronxcc.nki.typing for signature annotations beside `import nki`
    assert check_kernel(load_case("valid_neuronxcc_typing").kernel) == []


def test_neuronxcc_typing_with_the_legacy_language_is_flagged(fake_nki):
    mod = load_case("bad_neuronxcc_mixed")
    assert where(check_kernel(mod.kernel)) == [expect("bad_neuronxcc_mixed", "mixed-neuronxcc", "neuronxcc-import")]


def test_neuronxcc_import_in_helper_body(fake_nki):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.neuronxcc_helper_kernel)) == [
        expect("bad_helpers", "helper-neuronxcc", "neuronxcc-import")]


def test_arange(fake_nki):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.arange_kernel)) == [expect("bad_kernels", "arange", "arange-mgrid")]


def test_mgrid_imported_by_name(fake_nki):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.mgrid_kernel)) == [expect("bad_kernels", "mgrid", "arange-mgrid")]


@pytest.mark.parametrize("kernel, tag, kwarg", [
    ("isa_dtype_kernel", "isa-dtype", "dtype"),           # nisa.op(..., dtype=) on a continuation line
    ("isa_mask_kernel", "isa-mask", "mask"),              # nki.isa.op(..., mask=)
    ("isa_alias_kernel", "isa-alias", "dtype"),           # from nki import isa as isa_ops
    ("isa_local_import_kernel", "isa-local", "mask"),     # import inside the kernel body
])
def test_isa_mask_dtype(fake_nki, parser, kernel, tag, kwarg):
    mod = load_case("bad_kernels")
    got = check_kernel(getattr(mod, kernel))
    assert where(got) == [expect("bad_kernels", tag, "isa-mask-dtype")]
    assert f"{kwarg}=" in got[0].message


def test_output_buffer_reports_alloc_site_or_def_line(fake_nki):
    mod = load_case("valid_kernels")
    kernel = mod.matmul_kernel
    hbm = types.SimpleNamespace(buffer=fake_nki.nl.hbm, name="out", alloc_site=("/src/k.py", 17))
    sbuf = types.SimpleNamespace(buffer="sbuf", name="", alloc_site=None)
    shared = types.SimpleNamespace(buffer=fake_nki.nl.shared_hbm, alloc_site=("/src/k.py", 3))
    got = check_outputs(kernel, (shared, {"y": hbm}, [sbuf]))
    assert where(got) == sorted([
        ("output-buffer", "/src/k.py", 17),
        ("output-buffer", case_file("valid_kernels"), line_of_def(kernel.__wrapped__)),
    ])
    assert any("'hbm'" in v.message and "output[1]['y']" in v.message for v in got)


@pytest.mark.parametrize("kernel, tag", [("nested_jit_call_kernel", "jit-call"), ("nested_jit_grid_kernel", "jit-grid"),
                                         ("nested_jit_def_kernel", "jit-def")])
def test_nested_jit(fake_nki, parser, kernel, tag):
    mod = load_case("bad_kernels")
    assert where(check_kernel(getattr(mod, kernel))) == [expect("bad_kernels", tag, "nested-jit")]


@pytest.mark.parametrize("kernel", ["nested_jit_call_kernel", "nested_jit_grid_kernel", "nested_jit_def_kernel"])
def test_nested_jit_is_inlined_by_07_tracing(fake_nki, kernel):
    """0.7 inlines nested @nki.jit sub-kernels (AWS SpecializationConfig.allow_nested_config_override)."""
    mod = load_case("bad_kernels")
    assert [v for v in check_kernel(getattr(mod, kernel)) if v.rule == "nested-jit"] == []


def test_nested_jit_called_from_helper(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.nested_jit_helper_kernel)) == [
        expect("bad_helpers", "helper-jit-call", "nested-jit")]


def test_dict_key(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.dict_key_kernel)) == [expect("bad_kernels", "dict-key", "dict-key")]


def test_dict_store_with_non_string_key(fake_nki, parser):
    """`d[0] = ...` on a dict: the parser wants string keys in stores as well as in displays."""
    mod = load_case("bad_kernels")
    got = check_kernel(mod.dict_store_kernel)
    assert where(got) == [expect("bad_kernels", "dict-store", "dict-key")]
    assert "tiles[0]" in got[0].message


def test_dict_comprehension_with_tuple_key(fake_nki, parser):
    mod = load_case("bad_kernels")
    assert where(check_kernel(mod.dict_comp_key_kernel)) == [expect("bad_kernels", "dict-comp", "dict-key")]


def test_generator_functions(fake_nki, parser):
    mod = load_case("bad_kernels")
    got = check_kernel(mod.generator_kernel)
    assert where(got) == sorted([expect("bad_kernels", "yield", "generator"),
                                 expect("bad_kernels", "yield-from", "generator")])
    assert any("'yield from'" in v.message for v in got)


@pytest.mark.parametrize("kernel, tag", [("extra_base_kernel", "extra-base"),
                                         ("nested_extra_base_kernel", "nested-extra-base")])
def test_class_base_extra_base_class(fake_nki, parser, kernel, tag):
    """Deriving from nl.NKIObject *and* something else is refused by the parser (module-level and nested classes)."""
    mod = load_case("bad_kernels")
    got = check_kernel(getattr(mod, kernel))
    assert where(got) == [expect("bad_kernels", tag, "class-base")]
    assert "does not derive only from nl.NKIObject" in got[0].message


def test_class_base_inherited_nkiobject_passes_parser(fake_nki, parser):
    mod = load_case("valid_kernels")
    assert check_kernel(mod.inherited_config_kernel) == []


PARSER_ONLY_KERNELS = ["kwonly_kernel", "is_kernel", "is_not_kernel", "helper_is_kernel", "class_kernel",
                       "global_instance_kernel", "helper_class_kernel", "nested_class_kernel", "dict_key_kernel",
                       "dict_store_kernel", "dict_comp_key_kernel", "generator_kernel", "extra_base_kernel",
                       "nested_extra_base_kernel"]


@pytest.mark.parametrize("kernel", PARSER_ONLY_KERNELS)
def test_parser_rules_do_not_apply_under_tracing(fake_nki, monkeypatch, kernel):
    """Positive twins: under the default 0.7 tracing frontend these kernels are plain Python and pass; the same
    kernels fail once NKI_COMPILER_FRONTEND=custom selects the parser (checked on the cached result too)."""
    mod = load_case("bad_kernels")
    k = getattr(mod, kernel)
    assert check_kernel(k) == []
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
    got = check_kernel(k)
    assert got and {v.rule for v in got} <= lint.PARSER_RULES
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "tracing")
    assert check_kernel(k) == []


def test_list_default_in_kernel_signature(fake_nki, parser):
    """The 0.3.0 migration guide's example: `def my_kernel(img, in_perm, stride=[1, 1])` -> use a tuple default."""
    mod = load_case("bad_kernels")
    got = check_call_args(mod.list_default_kernel, (np.zeros(2),), {})
    assert where(got) == [("list-arg", case_file("bad_kernels"), line_of_def(mod.list_default_kernel.__wrapped__))]
    assert "'stride (default)'" in got[0].message
    assert check_call_args(mod.list_default_kernel, (np.zeros(2),), {"stride": (1, 1)}) == []


def test_list_args_allowed_under_tracing(fake_nki):
    mod = load_case("bad_kernels")
    assert check_call_args(mod.helper_is_kernel, ([1, 2],), {}) == []
    assert check_call_args(mod.is_kernel, (np.zeros(3),), {"b": [np.zeros(2)]}) == []
    assert check_call_args(mod.list_default_kernel, (np.zeros(2),), {}) == []


@pytest.mark.parametrize("frontend", ["custom", "tracing"])
def test_inline_indented_kernel_line_numbers(inline_nl, monkeypatch, frontend):
    """A decorated kernel nested (indented) in a test function: lines are real file lines."""
    import nki

    @nki.jit
    def kernel(a, *, scale):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=a, dtype=nl.float32)
        if scale is None:
            idx = nl.arange(64)
            return a[idx]
        return t

    start = line_of_def(kernel.__wrapped__)
    always = [("arange-mgrid", __file__, start + 4)]
    if frontend == "custom":
        monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
        assert where(check_kernel(kernel)) == sorted(always + [
            ("isa-mask-dtype", __file__, start + 2),
            ("kwonly-param", __file__, start),
            ("is-compare", __file__, start + 3),
        ])
    else:
        assert where(check_kernel(kernel)) == sorted(always)


def test_unregistered_modules_recognised_by_name(no_nki, parser, monkeypatch):
    """nl / nisa stand-ins that are not in sys.modules are recognised by their __name__ (also '<pkg>.nki.isa')."""
    _, language, isa = make_fake_nki(prefix="vendor.")
    monkeypatch.setitem(globals(), "nl", language)
    monkeypatch.setitem(globals(), "nisa", isa)

    def kernel(a):
        i = nl.arange(4)
        nisa.memset(dst=a[i], value=0, mask=None)
        return a

    start = line_of_def(kernel)
    assert where(check_kernel(kernel)) == [("arange-mgrid", __file__, start + 1),
                                           ("isa-mask-dtype", __file__, start + 2)]


def test_unresolvable_conventional_aliases(no_nki, parser, tmp_path, monkeypatch):
    """With no module behind `nl` / `nisa` at all, the conventional aliases are still recognised syntactically."""
    src = tmp_path / "orphan_kernel.py"
    src.write_text("def kernel(a):\n"
                   "    t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)\n"
                   "    nisa.tensor_copy(dst=t, src=a, dtype=nl.float32)\n"
                   "    return a[nl.mgrid[0:4, 0:4]]\n")
    spec = importlib.util.spec_from_file_location("_nkisim_lint_orphan", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert where(check_kernel(mod.kernel)) == [("arange-mgrid", str(src), 4), ("isa-mask-dtype", str(src), 3)]


def test_error_lists_every_violation_with_file_and_line(fake_nki, parser):
    mod = load_case("bad_kernels")
    violations = check_kernel(mod.helper_class_kernel)
    err = NkiLanguageError(violations)
    assert err.violations == violations
    lines = str(err).splitlines()
    assert lines == [str(v) for v in violations] and len(lines) == 2
    path = case_file("bad_helpers")
    assert f"{path}:{marker_line(path, 'plain-class')}: [class-base]" in str(err)
    with pytest.raises(NkiLanguageError):
        lint.raise_if_violations(violations)
    lint.raise_if_violations([])


# ----------------------------------------------------------------------------------------------------------------------
# Positive tests: realistic valid kernels pass
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["matmul_kernel", "activation_kernel", "nested_helper_kernel"])
def test_valid_kernels_pass(fake_nki, kernel):
    mod = load_case("valid_kernels")
    assert check_kernel(getattr(mod, kernel)) == []
    assert check_kernel(getattr(mod, kernel).__wrapped__) == []


def test_valid_call_args_and_outputs(fake_nki):
    mod = load_case("valid_kernels")
    assert check_call_args(mod.activation_kernel, (np.zeros((4, 4)),), {"scales": (1.0, 3.0), "bias": None}) == []
    out = types.SimpleNamespace(buffer=fake_nki.nl.shared_hbm, name="out")
    assert check_outputs(mod.matmul_kernel, out) == []
    assert check_outputs(mod.matmul_kernel, (out, {"o": types.SimpleNamespace(buffer="shared_hbm")}, None, 3)) == []


def test_inline_valid_kernel(inline_nl):
    import nki

    def helper(t, value=None):
        if value == None:  # noqa: E711
            value = 0.0
        nisa.memset(dst=t, value=value)
        return {"t": t}

    @nki.jit
    def kernel(a, tiles=(1, 2)):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(len(tiles)):
            t = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
            helper(t)["t"]
            nisa.dma_copy(dst=out[nl.ds(i * 128, 128), 0:64:1], src=t)
        return out

    assert check_kernel(kernel) == []


def test_library_code_is_not_descended_into(inline_nl):
    """Helpers from the stdlib / numpy / nkisim itself are skipped even though they use `is` and plain classes."""
    import collections
    import functools

    def kernel(a):
        n = math.ceil(functools.reduce(lambda x, y: x * y, a.shape, 1) / 128)
        counts = collections.Counter(a.shape)
        lint.check_outputs(None, None)
        return np.zeros(n + len(counts))

    assert check_kernel(kernel) == []


def test_check_never_executes_and_is_cached(inline_nl):
    calls = []

    def kernel(a):
        calls.append(a)
        raise RuntimeError("the kernel must not run")

    first = check_kernel(kernel)
    assert first == [] and calls == []
    assert check_kernel(kernel) == first
    assert kernel.__code__ in {k[0] for k in lint._CACHE}


def test_violation_str():
    v = Violation("/x/k.py", 12, "is-compare", "boom")
    assert str(v) == "/x/k.py:12: [is-compare] boom"
    assert set(lint.RULES) >= {"kwonly-param", "is-compare", "list-arg", "class-base", "neuronxcc-import",
                               "arange-mgrid", "isa-mask-dtype", "output-buffer", "nested-jit", "generator"}
    assert lint.PARSER_RULES < set(lint.RULES)
