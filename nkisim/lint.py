"""Static checker for the NKI language rules (0.7 tracing frontend by default, 0.6 parser rules on request).

NKI 0.7 specializes kernels by Python *tracing* (the default frontend): kernel code is ordinary Python, so ``is``,
generators, inheritance, any class, keyword-only parameters and list arguments are all fine.  The legacy parser stays
selectable with ``NKI_COMPILER_FRONTEND=custom`` (AWS's switch; deprecated in Neuron 2.33, removed in 0.8) and only
then are its Python-subset rules (``PARSER_RULES``) enforced.  Rules that are errors under both frontends (the legacy
``neuronxcc`` namespace, the removed ``nl.arange`` / ``nl.mgrid``, outputs outside ``nl.shared_hbm``) always apply;
no 0.7 page reverses them (0.4.0, 0.2.0 and 0.3.0 release notes respectively).

The official NKI simulator runs a kernel as ordinary Python, so a kernel can pass simulation and still be refused by the
compiler.  This module closes that gap: at ``nki.jit`` time the interpreter calls :func:`check_kernel` (static, on the
source of the kernel and of the user helpers it references), :func:`check_call_args` (list-typed arguments) and
:func:`check_outputs` (returned tensors must live in ``nl.shared_hbm``).  Every finding is a :class:`Violation`
carrying the file and line of the offending construct; :class:`NkiLanguageError` bundles them.

Rule ids (see ``RULES``); the first group is ``PARSER_RULES`` (only under ``NKI_COMPILER_FRONTEND=custom``):

``kwonly-param``      keyword-only parameter in the kernel signature (``def k(a, *, b)``)
``is-compare``        ``is`` / ``is not`` (use ``==`` / ``!=``)
``list-arg``          a kernel argument is a Python list (use a tuple)
``class-base``        a user class that does not derive from ``nl.NKIObject`` alone (no other base class)
``dict-key``          a non-string constant key in a dict display, comprehension or ``d[0] = ...`` store
``generator``         a generator function (``yield`` / ``yield from``)
``nested-jit``        a sub-kernel decorated with ``nki.jit`` (0.7 tracing inlines it under the top-level kernel)
``isa-mask-dtype``    ``mask=`` or ``dtype=`` passed to an ``nki.isa`` op (under 0.7: a TypeError when the call runs)

Always checked:

``neuronxcc-import``  ``import neuronxcc...`` / ``from neuronxcc...`` (legacy namespace)
``arange-mgrid``      ``nl.arange`` / ``nl.mgrid`` (removed; use slices, ``nl.ds`` or ``.ap()``)
``output-buffer``     a returned tensor not allocated in ``nl.shared_hbm``

The checker never executes kernel code.  Names are resolved by object identity against the ``nki``, ``nki.language``
and ``nki.isa`` entries of ``sys.modules`` (so aliases such as ``nl``, ``nisa``, ``nki.isa.x`` or
``from nki import isa as nisa`` all work), with fallbacks on the module ``__name__`` and, for unresolvable names, on the
conventional aliases ``nl`` / ``nisa``.
"""

from __future__ import annotations

import ast
import builtins
import enum
import inspect
import linecache
import os
import site
import sys
import sysconfig
import textwrap
import types
from dataclasses import dataclass

from .frontend import FRONTEND_ENV, parser_frontend

__all__ = [
    "FRONTEND_ENV",
    "PARSER_RULES",
    "RULES",
    "NkiLanguageError",
    "Violation",
    "check_call_args",
    "check_kernel",
    "check_outputs",
    "clear_cache",
    "parser_frontend",
    "raise_if_violations",
]

RULES: dict[str, str] = {
    "kwonly-param": "keyword-only parameters are not allowed in the kernel signature",
    "is-compare": "'is' / 'is not' are not supported in NKI; use '==' / '!='",
    "list-arg": "list-typed kernel arguments are not allowed; pass a tuple",
    "class-base": "classes used in NKI code must derive from nl.NKIObject and nothing else",
    "neuronxcc-import": "the legacy neuronxcc namespace is a compilation error since NKI 0.4.0; use 'import nki'",
    "arange-mgrid": "nl.arange / nl.mgrid were removed; use integer slices, nl.ds(start, size) or .ap()",
    "isa-mask-dtype": "mask= and dtype= were removed from all nki.isa ops (output dtype is the dst dtype)",
    "output-buffer": "kernel outputs must be allocated with buffer=nl.shared_hbm",
    "nested-jit": "sub-kernels must not be decorated with nki.jit; call a plain helper function instead",
    "dict-key": "dict keys must be strings",
    "generator": "generator functions (yield) are not supported",
}

# The legacy parser's Python-subset rules: enforced only when the parser frontend is selected.
# `nested-jit` is among them: under 0.7 tracing a nested @nki.jit sub-kernel is inlined under the top-level kernel's
# config (AWS, nki.compiler.SpecializationConfig.allow_nested_config_override), and the nki-library relies on it
# (core/moe/moe_tkg calls its @nki.jit `_all_expert_moe_tkg_mx`).
# `isa-mask-dtype` too: 0.7 traces, so a removed keyword fails only when its call runs (TypeError from the op's
# signature, as the real nki.isa stubs have no mask=/dtype=); the nki-library keeps such calls on branches its
# tested configurations never take (core/moe/moe_cte/moe_cte_utils.py: scalar_tensor_tensor(..., dtype=)).
PARSER_RULES: frozenset[str] = frozenset({"kwonly-param", "is-compare", "list-arg", "class-base", "dict-key",
                                          "generator", "nested-jit", "isa-mask-dtype"})



def _for_frontend(violations) -> list:
    """Drop the parser-only findings unless the parser frontend is selected."""
    if parser_frontend():
        return list(violations)
    return [v for v in violations if v.rule not in PARSER_RULES]


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}"


class NkiLanguageError(Exception):
    """Raised when a kernel breaks the NKI language rules; ``.violations`` holds every finding."""

    def __init__(self, violations):
        self.violations = list(violations)
        super().__init__("\n".join(str(v) for v in self.violations))

    def __str__(self) -> str:
        return "\n".join(str(v) for v in self.violations)


def raise_if_violations(violations) -> None:
    """Raise :class:`NkiLanguageError` if ``violations`` is non-empty."""
    violations = list(violations)
    if violations:
        raise NkiLanguageError(violations)


# --------------------------------------------------------------------------------------------------------------------
# Recognising the NKI modules
# --------------------------------------------------------------------------------------------------------------------

_NKI_NAMES = ("nki", "nki.language", "nki.isa")
_MISSING = object()


def _canonical_module_name(mod) -> str | None:
    """'nki', 'nki.language' or 'nki.isa' if ``mod`` is (a stand-in for) one of those modules, else None."""
    if not isinstance(mod, types.ModuleType):
        return None
    for name in _NKI_NAMES:
        if sys.modules.get(name) is mod:
            return name
    name = getattr(mod, "__name__", "") or ""
    for canon in _NKI_NAMES:
        if name == canon or name.endswith("." + canon):
            return canon
    return None


def _canonical_path(path: str) -> str:
    """Map a dotted import path onto the canonical ``nki...`` path when it names something inside an nki package
    (``neuronxcc.nki.language.arange`` -> ``nki.language.arange``)."""
    if path == "nki" or path.startswith("nki."):
        return path
    parts = path.split(".")
    if "nki" in parts[1:]:
        return ".".join(parts[parts.index("nki", 1):])
    return path


def _is_nki_path(path: str | None) -> bool:
    return path is not None and (path == "nki" or path.startswith("nki."))


def _nki_module(name: str):
    mod = sys.modules.get(name)
    return mod if isinstance(mod, types.ModuleType) else None


def _nkiobject_class():
    nl = _nki_module("nki.language")
    obj = getattr(nl, "NKIObject", None) if nl is not None else None
    return obj if isinstance(obj, type) else None


def _is_jit_kernel(obj) -> bool:
    try:
        return bool(getattr(obj, "_is_nki_kernel", False)) is True
    except Exception:
        return False


def _atomic(obj) -> bool:
    return obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, tuple))


# --------------------------------------------------------------------------------------------------------------------
# "User code" (the checker only descends into the project's own helpers)
# --------------------------------------------------------------------------------------------------------------------

_SKIP_TOP_MODULES = {
    "nkisim", "numpy", "ml_dtypes", "nki", "neuronxcc", "builtins", "torch", "jax", "_pytest", "pytest",
}


def _excluded_dirs() -> tuple[str, ...]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(p)
    try:
        dirs.update(site.getsitepackages())
    except Exception:
        pass
    try:
        dirs.add(site.getusersitepackages())
    except Exception:
        pass
    dirs.add(os.path.dirname(os.path.abspath(__file__)))  # nkisim itself
    out = []
    for d in dirs:
        try:
            out.append(os.path.realpath(d).rstrip(os.sep) + os.sep)
        except Exception:
            pass
    return tuple(out)


_EXCLUDED_DIRS: tuple[str, ...] | None = None


def _is_user_file(filename: str | None, module_name: str | None) -> bool:
    global _EXCLUDED_DIRS
    if module_name:
        top = module_name.split(".")[0]
        if top in _SKIP_TOP_MODULES or top in getattr(sys, "stdlib_module_names", ()):
            return False
    if not filename:
        return False
    if filename.startswith("<"):
        # exec'd / dataclass-generated code: only source that linecache knows about (e.g. notebook cells) is checked
        return bool(linecache.getlines(filename))
    real = os.path.realpath(filename)
    parts = real.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    if _EXCLUDED_DIRS is None:
        _EXCLUDED_DIRS = _excluded_dirs()
    return not any(real.startswith(d) for d in _EXCLUDED_DIRS)


def _function_is_user_code(fn) -> bool:
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    return _is_user_file(code.co_filename, getattr(fn, "__module__", None))


def _class_file(cls) -> str | None:
    mod = sys.modules.get(getattr(cls, "__module__", "") or "")
    f = getattr(mod, "__file__", None)
    if f:
        return f
    for value in vars(cls).values():
        func = _unwrap_member(value)
        if isinstance(func, types.FunctionType):
            return func.__code__.co_filename
    return None


def _class_is_user_code(cls) -> bool:
    return _is_user_file(_class_file(cls), getattr(cls, "__module__", None))


def _unwrap_member(value):
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def _unwrap_kernel(fn):
    """Accept the plain function, a functools.wraps wrapper, or a kernel object exposing ``.func`` / ``.fn``."""
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, (types.FunctionType, types.LambdaType)) and not hasattr(fn, "__wrapped__"):
            return fn
        nxt = None
        for attr in ("__wrapped__", "func", "fn", "kernel", "__func__"):
            try:
                cand = getattr(fn, attr, None)
            except Exception:
                cand = None
            if cand is not None and cand is not fn and callable(cand):
                nxt = cand
                break
        if nxt is None:
            return fn
        fn = nxt
    return fn


# --------------------------------------------------------------------------------------------------------------------
# Source location
# --------------------------------------------------------------------------------------------------------------------

_AST_CACHE: dict[str, tuple[str, ast.Module | None]] = {}


def _module_ast(filename: str, module_globals=None) -> ast.Module | None:
    lines = linecache.getlines(filename, module_globals)
    if not lines:
        return None
    text = "".join(lines)
    cached = _AST_CACHE.get(filename)
    if cached is not None and cached[0] == text:
        return cached[1]
    try:
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError):
        tree = None
    _AST_CACHE[filename] = (text, tree)
    return tree


def _first_line(node) -> int:
    decos = getattr(node, "decorator_list", None) or []
    return min([node.lineno] + [d.lineno for d in decos])


def _find_function_node(fn):
    """The ast node (FunctionDef / AsyncFunctionDef / Lambda) of ``fn`` with real file line numbers, or None."""
    code = fn.__code__
    tree = _module_ast(code.co_filename, getattr(fn, "__globals__", None))
    if tree is not None:
        want = code.co_name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            elif isinstance(node, ast.Lambda):
                name = "<lambda>"
            else:
                continue
            if name == want and _first_line(node) == code.co_firstlineno:
                return node
    # Fallback: inspect's view of the source, dedented, shifted back to file lines.
    try:
        lines, start = inspect.getsourcelines(fn)
        sub = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError, ValueError):
        return None
    ast.increment_lineno(sub, max(start, 1) - 1)
    for node in ast.walk(sub):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            return node
        if isinstance(node, ast.Lambda) and code.co_name == "<lambda>":
            return node
    return None


def _find_class_node(cls, filename: str):
    tree = _module_ast(filename, getattr(sys.modules.get(cls.__module__), "__dict__", None))
    if tree is None:
        return None
    qualname = cls.__qualname__
    first = getattr(cls, "__firstlineno__", None)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                q = prefix + child.name
                if q == qualname:
                    found.append(child)
                visit(child, q + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix + child.name + ".<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    if not found:
        return None
    if first is not None:
        for node in found:
            if _first_line(node) == first:
                return node
    return found[-1]  # the last definition is the one bound at import time


def _def_line(fn) -> int:
    node = _find_function_node(fn) if isinstance(getattr(fn, "__code__", None), types.CodeType) else None
    if node is not None:
        return node.lineno
    code = getattr(fn, "__code__", None)
    return code.co_firstlineno if code is not None else 0


def _filename(fn) -> str:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else "<unknown>"


# --------------------------------------------------------------------------------------------------------------------
# Name resolution
# --------------------------------------------------------------------------------------------------------------------


class _Ref:
    """A resolved expression: the object (or _MISSING) and, when it lies inside an nki module, its canonical path."""

    __slots__ = ("obj", "path")

    def __init__(self, obj=_MISSING, path=None):
        self.obj = obj
        self.path = path


def _reverse_nki_map() -> dict[int, tuple[object, str]]:
    out: dict[int, tuple[object, str]] = {}
    for name in _NKI_NAMES:
        mod = _nki_module(name)
        if mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if attr.startswith("__") or _atomic(value) or isinstance(value, types.ModuleType):
                continue
            out.setdefault(id(value), (value, f"{name}.{attr}"))
    return out


def _bound_names(node) -> tuple[set[str], dict[str, ast.AST], set[str]]:
    """Names bound locally anywhere in ``node`` (params, assignments, nested defs, ...), local imports, and
    names declared global/nonlocal."""
    local: set[str] = set()
    imports: dict[str, ast.AST] = {}
    declared: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            local.add(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            local.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
            local.add(sub.name)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            local.add(sub.name)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            declared.update(sub.names)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            for alias in sub.names:
                if alias.name == "*":
                    continue
                bound = alias.asname or alias.name.split(".")[0]
                imports[bound] = (sub, alias)
        else:
            for attr in ("name", "rest"):  # match-statement captures
                if type(sub).__name__.startswith("Match") and isinstance(getattr(sub, attr, None), str):
                    local.add(getattr(sub, attr))
    local -= declared
    return local, imports, declared


def _module_import_map(tree: ast.Module | None) -> dict[str, str]:
    """name -> dotted path for module-level imports (used only when a global cannot be looked up)."""
    out: dict[str, str] = {}
    if tree is None:
        return out
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                for alias in sub.names:
                    if alias.asname:
                        out[alias.asname] = alias.name
                    else:
                        out[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                for alias in sub.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = f"{sub.module}.{alias.name}"
    return out


class _Resolver:
    def __init__(self, fn, node, reverse_map):
        self.globals = getattr(fn, "__globals__", {}) or {}
        self.closure: dict[str, object] = {}
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
            try:
                self.closure[name] = cell.cell_contents
            except ValueError:
                pass
        self.local, self.local_imports, _ = _bound_names(node)
        self.reverse_map = reverse_map
        self._module_imports: dict[str, str] | None = None
        self._filename = code.co_filename
        self.cache: dict[int, _Ref | None] = {}

    def ref_of(self, obj) -> _Ref:
        canon = _canonical_module_name(obj)
        if canon is not None:
            return _Ref(obj, canon)
        if not _atomic(obj):
            hit = self.reverse_map.get(id(obj))
            if hit is not None and hit[0] is obj:
                return _Ref(obj, hit[1])
        return _Ref(obj, None)

    def _ref_of_path(self, dotted: str) -> _Ref:
        """Resolve an import path without importing anything (only sys.modules is consulted)."""
        mod = sys.modules.get(dotted)
        if mod is not None:
            ref = self.ref_of(mod)
            if ref.path is None and _is_nki_path(_canonical_path(dotted)):
                ref.path = _canonical_path(dotted)
            return ref
        head, _, tail = dotted.rpartition(".")
        if head and sys.modules.get(head) is not None:
            parent = sys.modules[head]
            try:
                obj = getattr(parent, tail, _MISSING)
            except Exception:
                obj = _MISSING
            if obj is not _MISSING:
                ref = self.ref_of(obj)
                if ref.path is None and _is_nki_path(_canonical_path(dotted)):
                    ref.path = _canonical_path(dotted)
                return ref
        canon = _canonical_path(dotted)
        return _Ref(_MISSING, canon if _is_nki_path(canon) else None)

    def _local_import(self, name: str) -> _Ref | None:
        stmt, alias = self.local_imports[name]
        if isinstance(stmt, ast.Import):
            dotted = alias.name if alias.asname else alias.name.split(".")[0]
            return self._ref_of_path(dotted)
        if stmt.level or not stmt.module:
            return None
        return self._ref_of_path(f"{stmt.module}.{alias.name}")

    def resolve(self, expr) -> _Ref | None:
        key = id(expr)
        if key in self.cache:
            return self.cache[key]
        ref = self._resolve(expr)
        self.cache[key] = ref
        return ref

    def _resolve(self, expr) -> _Ref | None:
        if isinstance(expr, ast.Name):
            name = expr.id
            if name in self.local_imports:
                return self._local_import(name)
            if name in self.local:
                return None
            if name in self.closure:
                return self.ref_of(self.closure[name])
            if name in self.globals:
                return self.ref_of(self.globals[name])
            if hasattr(builtins, name):
                return _Ref(getattr(builtins, name), None)
            if self._module_imports is None:
                self._module_imports = _module_import_map(_module_ast(self._filename, self.globals))
            if name in self._module_imports:
                return self._ref_of_path(self._module_imports[name])
            if name == "nl":
                return _Ref(_MISSING, "nki.language")
            if name == "nisa":
                return _Ref(_MISSING, "nki.isa")
            return None
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value)
            if base is None:
                return None
            attr = expr.attr
            if base.path is not None:
                obj = _MISSING
                if isinstance(base.obj, types.ModuleType):
                    try:
                        obj = getattr(base.obj, attr, _MISSING)
                    except Exception:
                        obj = _MISSING
                canon = _canonical_module_name(obj)
                return _Ref(obj, canon or f"{base.path}.{attr}")
            if isinstance(base.obj, types.ModuleType):
                try:
                    obj = getattr(base.obj, attr, _MISSING)
                except Exception:
                    obj = _MISSING
                return None if obj is _MISSING else self.ref_of(obj)
            if isinstance(base.obj, type):
                try:
                    obj = inspect.getattr_static(base.obj, attr)
                except AttributeError:
                    return None
                return self.ref_of(_unwrap_member(obj))
            return None
        return None


# --------------------------------------------------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------------------------------------------------

_ISA_BANNED_KWARGS = ("mask", "dtype")
_REMOVED_NL = {"nki.language.arange": "nl.arange", "nki.language.mgrid": "nl.mgrid"}
_SKIP_FIELDS = {"annotation", "returns", "type_comment"}


# `neuronxcc.nki.typing` only supplies signature annotations (`x: nt.mutable_tensor`), which are never traced:
# AWS's hardware-tested nki-library imports it beside `import nki` (core/router_topk/router_topk.py). The namespace
# error concerns the legacy language/ISA, so that one module is exempt.
_NEURONXCC_ANNOTATION_ONLY = "neuronxcc.nki.typing"


def _legacy(name: str) -> bool:
    return (name == "neuronxcc" or name.startswith("neuronxcc.")) and name != _NEURONXCC_ANNOTATION_ONLY


def _dict_bound_names(node) -> set[str]:
    """Names assigned a dict display, dict comprehension or ``dict(...)`` call anywhere in ``node``: a later
    ``name[key] = ...`` on them is a dict store whose key the parser requires to be a string."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub.value is not None:
            value = sub.value
            is_dict = isinstance(value, (ast.Dict, ast.DictComp)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict")
            if not is_dict:
                continue
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _is_neuronxcc_import(node) -> bool:
    if isinstance(node, ast.Import):
        return any(_legacy(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        if mod == "neuronxcc.nki" and all(a.name == "typing" for a in node.names):
            return False
        return not node.level and _legacy(mod)
    return False


def _neuronxcc_violation(filename: str, node) -> Violation:
    if isinstance(node, ast.Import):
        what = ", ".join(a.name for a in node.names if a.name.split(".")[0] == "neuronxcc")
        text = f"import {what}"
    else:
        text = f"from {node.module} import ..."
    return Violation(filename, node.lineno, "neuronxcc-import", f"'{text}': {RULES['neuronxcc-import']}")


class _Checker:
    def __init__(self):
        self.violations: dict[tuple, Violation] = {}
        self.reverse_map = _reverse_nki_map()
        self.nkiobject = _nkiobject_class()
        self.seen: set[int] = set()
        self.queue: list = []

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    def add(self, file: str, line: int, rule: str, message: str) -> None:
        v = Violation(file, int(line), rule, message)
        self.violations.setdefault((v.file, v.line, v.rule, v.message), v)

    def enqueue(self, obj) -> None:
        if id(obj) in self.seen:
            return
        if _is_jit_kernel(obj):
            return
        if isinstance(obj, types.FunctionType):
            if _function_is_user_code(obj):
                self.seen.add(id(obj))
                self.queue.append(obj)
        elif isinstance(obj, type):
            if _class_is_user_code(obj):
                self.seen.add(id(obj))
                self.queue.append(obj)

    def run(self, kernel) -> list[Violation]:
        self.seen.add(id(kernel))
        self.check_module_imports(kernel)
        self.check_function(kernel, is_kernel=True)
        while self.queue:
            obj = self.queue.pop(0)
            if isinstance(obj, type):
                self.check_class(obj)
            else:
                self.check_function(obj, is_kernel=False)
        return sorted(self.violations.values(), key=lambda v: (v.file, v.line, v.rule, v.message))

    # -- module ------------------------------------------------------------------------------------------------------
    def check_module_imports(self, fn) -> None:
        filename = _filename(fn)
        tree = _module_ast(filename, getattr(fn, "__globals__", None))
        if tree is None:
            return
        for node in ast.walk(tree):
            if _is_neuronxcc_import(node):
                v = _neuronxcc_violation(filename, node)
                self.add(v.file, v.line, v.rule, v.message)

    # -- classes -----------------------------------------------------------------------------------------------------
    def _is_nkiobject(self, base) -> bool:
        if self.nkiobject is not None:
            return base is self.nkiobject
        return base.__name__ == "NKIObject"

    def _class_ok(self, cls) -> bool:
        """Every base is nl.NKIObject or itself such a class: the parser accepts no extra base classes."""
        if issubclass(cls, (enum.Enum, BaseException)):
            return True  # enums are NKI values in their own right; exceptions only abort compilation
        if self._is_nkiobject(cls):
            return True
        bases = [b for b in cls.__bases__ if b is not object]
        if not bases or len(bases) != len(cls.__bases__):
            return False
        return all(self._class_ok(b) for b in bases)

    def check_class(self, cls) -> None:
        filename = _class_file(cls) or "<unknown>"
        node = _find_class_node(cls, filename)
        line = node.lineno if node is not None else 0
        if not self._class_ok(cls):
            bases = ", ".join(b.__name__ for b in cls.__bases__)
            self.add(filename, line, "class-base",
                     f"class {cls.__qualname__}({bases}) does not derive only from nl.NKIObject: "
                     f"{RULES['class-base']}")
        for value in vars(cls).values():
            member = _unwrap_member(value)
            if isinstance(member, types.FunctionType):
                self.enqueue(member)

    def _static_class_base_ok(self, resolver: _Resolver, base_expr) -> bool:
        ref = resolver.resolve(base_expr)
        if ref is not None and ref.path == "nki.language.NKIObject":
            return True
        if ref is not None and isinstance(ref.obj, type):
            return self._class_ok(ref.obj)
        # unresolvable: accept on the spelling
        if isinstance(base_expr, ast.Attribute):
            return base_expr.attr == "NKIObject"
        if isinstance(base_expr, ast.Name):
            return base_expr.id == "NKIObject"
        return False

    # -- functions ---------------------------------------------------------------------------------------------------
    def check_function(self, fn, is_kernel: bool) -> None:
        node = _find_function_node(fn)
        if node is None:
            return
        filename = _filename(fn)
        resolver = _Resolver(fn, node, self.reverse_map)
        what = "kernel" if is_kernel else "helper"

        if is_kernel and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.kwonlyargs:
                self.add(filename, arg.lineno, "kwonly-param",
                         f"kernel '{fn.__name__}' has keyword-only parameter '{arg.arg}': {RULES['kwonly-param']}")

        dict_names = _dict_bound_names(node)
        for sub in self._walk(node, top=node):
            self._visit(sub, resolver, filename, what, top=node)
            if isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store) \
                    and isinstance(sub.value, ast.Name) and sub.value.id in dict_names:
                key = sub.slice
                if (isinstance(key, ast.Constant) and not isinstance(key.value, str)) or isinstance(key, ast.Tuple):
                    self.add(filename, sub.lineno, "dict-key",
                             f"{ast.unparse(sub)} = ...: dict key {ast.unparse(key)} is not a string: "
                             f"{RULES['dict-key']}")

    def _walk(self, node, top):
        """ast.walk, minus annotations and the decorators of the checked function itself."""
        stack = [node]
        while stack:
            cur = stack.pop()
            yield cur
            for field, value in ast.iter_fields(cur):
                if field in _SKIP_FIELDS or (cur is top and field == "decorator_list"):
                    continue
                if isinstance(value, ast.AST):
                    stack.append(value)
                elif isinstance(value, list):
                    stack.extend(v for v in reversed(value) if isinstance(v, ast.AST))

    def _visit(self, sub, resolver: _Resolver, filename: str, what: str, top) -> None:
        if isinstance(sub, ast.Compare):
            for op in sub.ops:
                if isinstance(op, (ast.Is, ast.IsNot)):
                    spelled = "is not" if isinstance(op, ast.IsNot) else "is"
                    self.add(filename, sub.lineno, "is-compare",
                             f"'{spelled}' comparison in {what}: {RULES['is-compare']}")
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            if _is_neuronxcc_import(sub):
                v = _neuronxcc_violation(filename, sub)
                self.add(v.file, v.line, v.rule, v.message)
        elif isinstance(sub, ast.ClassDef):
            if not sub.bases or not all(self._static_class_base_ok(resolver, b) for b in sub.bases):
                bases = ", ".join(ast.unparse(b) for b in sub.bases) or "object"
                self.add(filename, sub.lineno, "class-base",
                         f"class {sub.name}({bases}) does not derive only from nl.NKIObject: "
                         f"{RULES['class-base']}")
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub is not top:
            for deco in sub.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                ref = resolver.resolve(target)
                if ref is not None and (ref.path == "nki.jit" or _is_jit_kernel(ref.obj)):
                    self.add(filename, deco.lineno, "nested-jit",
                             f"nested function '{sub.name}' is decorated with nki.jit: {RULES['nested-jit']}")
        elif isinstance(sub, ast.Call):
            self._visit_call(sub, resolver, filename)
        elif isinstance(sub, (ast.Yield, ast.YieldFrom)):
            spelled = "yield from" if isinstance(sub, ast.YieldFrom) else "yield"
            self.add(filename, sub.lineno, "generator", f"'{spelled}' in {what}: {RULES['generator']}")
        elif isinstance(sub, (ast.Dict, ast.DictComp)):
            for key in (sub.keys if isinstance(sub, ast.Dict) else [sub.key]):
                if isinstance(key, ast.Constant) and not isinstance(key.value, str):
                    self.add(filename, key.lineno, "dict-key",
                             f"dict key {key.value!r} is not a string: {RULES['dict-key']}")
                elif isinstance(key, ast.Tuple):
                    self.add(filename, key.lineno, "dict-key",
                             f"dict key {ast.unparse(key)} is not a string: {RULES['dict-key']}")

        if isinstance(sub, (ast.Name, ast.Attribute)) and isinstance(sub.ctx, ast.Load):
            ref = resolver.resolve(sub)
            if ref is None:
                return
            if ref.path in _REMOVED_NL:
                self.add(filename, sub.lineno, "arange-mgrid",
                         f"{_REMOVED_NL[ref.path]} was removed in NKI 0.2.0 (absent from 0.6 and 0.7): "
                         f"{RULES['arange-mgrid']}")
            if ref.path is None and ref.obj is not _MISSING:
                self.enqueue(ref.obj)
                if not (_atomic(ref.obj) or isinstance(ref.obj, (type, types.ModuleType, types.FunctionType))
                        or _is_jit_kernel(ref.obj)):
                    self.enqueue(type(ref.obj))  # a global instance of a user class

    def _visit_call(self, call: ast.Call, resolver: _Resolver, filename: str) -> None:
        func = call.func
        ref = resolver.resolve(func)
        if ref is not None:
            path = ref.path
            is_isa_op = path is not None and path.startswith("nki.isa.") and path.count(".") == 2
            if is_isa_op and not isinstance(ref.obj, type):
                op = path.split(".")[-1]
                for kw in call.keywords:
                    if kw.arg in _ISA_BANNED_KWARGS:
                        self.add(filename, getattr(kw, "lineno", call.lineno), "isa-mask-dtype",
                                 f"nisa.{op}(..., {kw.arg}=...): {RULES['isa-mask-dtype']}")
            if _is_jit_kernel(ref.obj):
                name = getattr(ref.obj, "__name__", None) or ast.unparse(func)
                self.add(filename, call.lineno, "nested-jit",
                         f"call to nki.jit kernel '{name}' from NKI code: {RULES['nested-jit']}")
        elif isinstance(func, ast.Subscript):  # kernel[lnc](...)
            base = resolver.resolve(func.value)
            if base is not None and _is_jit_kernel(base.obj):
                name = getattr(base.obj, "__name__", None) or ast.unparse(func.value)
                self.add(filename, call.lineno, "nested-jit",
                         f"call to nki.jit kernel '{name}' from NKI code: {RULES['nested-jit']}")


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------

_CACHE: dict = {}


def clear_cache() -> None:
    _CACHE.clear()
    _AST_CACHE.clear()


def check_kernel(fn) -> list[Violation]:
    """Static check of a kernel function and, transitively, the plain-Python helper functions/classes it references
    (resolved through ``fn.__globals__`` / closures; anything defined in nkisim, numpy, ml_dtypes, the stdlib or an
    installed third-party package is skipped).  Cached per code object.  Never executes the kernel."""
    fn = _unwrap_kernel(fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return []
    key = (code, tuple(id(sys.modules.get(n)) for n in _NKI_NAMES))
    cached = _CACHE.get(key)
    if cached is None:
        cached = tuple(_Checker().run(fn))
        _CACHE[key] = cached
    return _for_frontend(cached)


def check_call_args(fn, args, kwargs) -> list[Violation]:
    """Runtime part: list-typed kernel arguments (under the parser frontend lists are not allowed, tuples are).
    Reports the parameter name and the kernel's def line."""
    if not parser_frontend():
        return []
    fn = _unwrap_kernel(fn)
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    filename, line = _filename(fn), _def_line(fn)
    named: list[tuple[str, object]] = []
    try:
        sig = inspect.signature(fn)
        bound = sig.bind_partial(*args, **kwargs)
        for pname, value in bound.arguments.items():
            kind = sig.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named.extend((f"{pname}[{i}]", v) for i, v in enumerate(value))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.extend((f"{pname}[{k!r}]", v) for k, v in value.items())
            else:
                named.append((pname, value))
        # a list default counts too: the 0.3.0 migration guide's example is `def my_kernel(..., stride=[1, 1])`
        for pname, param in sig.parameters.items():
            if pname not in bound.arguments and isinstance(param.default, list):
                named.append((f"{pname} (default)", param.default))
    except (TypeError, ValueError):
        names = list(getattr(getattr(fn, "__code__", None), "co_varnames", ()))
        named.extend(((names[i] if i < len(names) else f"arg{i}"), v) for i, v in enumerate(args))
        named.extend(kwargs.items())
    out = []
    for pname, value in named:
        if isinstance(value, list):
            out.append(Violation(filename, line, "list-arg",
                                 f"kernel '{getattr(fn, '__name__', '?')}' argument '{pname}' is a list "
                                 f"(len {len(value)}): {RULES['list-arg']}"))
    return out


def _buffer_name(buffer) -> str:
    name = getattr(buffer, "name", buffer)
    return name if isinstance(name, str) else repr(name)


def check_outputs(fn, outputs, arguments=()) -> list[Violation]:
    """Runtime part: every tensor the kernel returns (a tensor, or a tuple/list/dict of them) must be in
    ``nl.shared_hbm``, unless it is (a view of) one of the kernel's own HBM arguments, whose allocations are
    ``arguments``: AWS documents only that top-level inputs and outputs live in HBM (NKI Known Issues, "Top-level
    tensors must be on HBM"), and the nki-library returns arguments it wrote in place (rope_hf's q_out/k_out,
    tested at LNC=1).  Reports the tensor's ``alloc_site`` if known, else the kernel's def line."""
    fn = _unwrap_kernel(fn)
    filename = _filename(fn)
    def_line: list[int] = []
    out: list[Violation] = []

    def visit(value, where: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{where}[{k!r}]")
            return
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                visit(v, f"{where}[{i}]")
            return
        try:
            buffer = getattr(value, "buffer", _MISSING)
        except Exception:
            buffer = _MISSING
        if buffer is _MISSING:
            return
        name = _buffer_name(buffer)
        if name == "shared_hbm" or any(getattr(value, "alloc", None) is a for a in arguments):
            return
        try:
            site_ = getattr(value, "alloc_site", None)
        except Exception:
            site_ = None
        if isinstance(site_, (tuple, list)) and len(site_) == 2 and site_[0]:
            file, line = str(site_[0]), int(site_[1])
        else:
            if not def_line:
                def_line.append(_def_line(fn))
            file, line = filename, def_line[0]
        tname = getattr(value, "name", "") or ""
        label = f" '{tname}'" if isinstance(tname, str) and tname else ""
        out.append(Violation(file, line, "output-buffer",
                             f"returned tensor {where}{label} is in buffer '{name}': {RULES['output-buffer']}"))

    visit(outputs, "output")
    return out
