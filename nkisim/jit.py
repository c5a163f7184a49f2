"""`nki.jit`, `Kernel[lnc]` and `nki.simulate`: run a kernel eagerly on NumPy, as the official simulator does.

A call wraps NumPy arrays / torch CPU tensors as HBM tensors (shared_hbm under LNC=2), lints the kernel source
once (nkisim.lint), runs the body as ordinary Python on one thread per core, checks that outputs live in
shared_hbm, returns the outputs as the caller's array type and writes back any input the kernel modified.
"""

import functools
import os
import threading
import warnings

import numpy as np

from . import dtypes as dt
from . import lint, mx
from .errors import NkiValidationError
from .memory import Allocation, hbm, shared_hbm
from .runtime import CoreContext, LncShared, current, set_current
from .target import resolve_target
from .tensor import NkiTensor, np_view
from .world import ambient_world, first_failure, one_rank_world

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"

# @nki.jit options. 0.7's documented keywords are compile_config / specialization_config (nki.jit page, v2.33.1);
# other keywords are accepted as the real **kwargs are (AWS's nki-library passes debug_kernel=, show_compiler_tb=,
# experimental_flags=, compiler diagnostics with nothing to do on a CPU).
_REMOVED_OPTIONS = {
    # NKI migration guide, "nki.jit(platform_target=...)": "Passing platform_target to @nki.jit raises an error".
    "platform_target": "the platform_target parameter is deprecated and passing it to @nki.jit raises an error since "
                       "NKI 0.3.0: set the target platform with the NEURON_PLATFORM_TARGET_OVERRIDE environment "
                       "variable instead (trn1|inf2|gen2, trn2|gen3, trn3|gen4)",
}
_IGNORED_OPTIONS = {
    # Migration guide, "nki.jit(mode=...)": "deprecated and ignored ... Code that passes mode= to @nki.jit should
    # remove the parameter". Warned, not rejected: AWS's hardware-tested nki-library still passes mode="trace".
    "mode": "the mode parameter is deprecated and ignored: the framework is detected from the kernel arguments "
            "(torch -> PyTorch/XLA, jax -> JAX, NumPy -> standalone); remove the parameter (use nki.simulate or "
            "NKI_SIMULATOR=1 for the CPU simulator)",
}


def _check_options(options):
    for key, why in _REMOVED_OPTIONS.items():
        if key in options:
            raise TypeError(f"nki.jit({key}=...): {why}")
    for key, why in _IGNORED_OPTIONS.items():
        if key in options:
            warnings.warn(f"nki.jit({key}=...): {why}", DeprecationWarning, stacklevel=3)


def _lnc_value(v, what):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) not in (1, 2):
        raise NkiValidationError(f"{what}: LNC must be 1 or 2 (C18)")
    return int(v)


def launch_lnc(bracket=None):
    """The LNC degree of a launch: `NEURON_LOGICAL_NC_CONFIG` (NKI 0.7's way, nki.jit page) or `kernel[n]` (being
    deprecated), default 1. Both given and different is the mismatch the compiler rejects (NCC_EVRF066)."""
    env = os.environ.get(LNC_ENV, "").strip()
    if not env:
        return 1 if bracket is None else bracket
    try:
        lnc = _lnc_value(int(env), f"{LNC_ENV}={env!r}")
    except ValueError:
        raise NkiValidationError(f"{LNC_ENV}={env!r}: LNC must be 1 or 2 (C18)") from None
    if bracket is not None and bracket != lnc:
        raise NkiValidationError(
            f"kernel[{bracket}] launches with LNC={bracket} but {LNC_ENV}={lnc}: the kernel's LNC must match the "
            f"logical core configuration it is compiled and run with (NCC_EVRF066); drop the bracket and set "
            f"{LNC_ENV}, or make the two agree")
    return lnc


class Kernel:
    """A jit-decorated NKI kernel. `kernel(*args)` runs it with the LNC degree of `NEURON_LOGICAL_NC_CONFIG` (default
    1); `kernel[2](*args)` on an LNC=2 pair."""

    _is_nki_kernel = True

    def __init__(self, func, lnc=None, **options):
        self.func = func
        self._bracket = lnc      # LNC given by kernel[n]; None: from the environment (see launch_lnc)
        self.options = options
        functools.update_wrapper(self, func)

    @property
    def lnc(self):
        return launch_lnc(self._bracket)

    def __getitem__(self, grid):
        if isinstance(grid, tuple):
            if len(grid) != 1:
                raise NkiValidationError(f"kernel[{grid}]: the launch bracket takes exactly one number, the LNC "
                                         "degree (1 or 2) (C18)")
            grid = grid[0]
        return Kernel(self.func, lnc=_lnc_value(grid, f"kernel[{grid}]"), **self.options)

    def __call__(self, *args, **kwargs):
        return run(self, args, kwargs).outputs

    def __repr__(self):
        lnc = self._bracket if self._bracket is not None else f"${LNC_ENV}"
        return f"<nki.jit kernel {self.func.__qualname__} lnc={lnc}>"


def jit(fn=None, **kwargs):
    """Decorator: `@nki.jit` or `@nki.jit(compile_config=..., specialization_config=..., ...)`.

    `platform_target=` is rejected and `mode=` warned as ignored, with the migration guide's wording."""
    _check_options(kwargs)
    if fn is None:
        return lambda f: Kernel(f, **kwargs)
    return Kernel(fn, **kwargs)


def simulate(kernel):
    """`nki.simulate(kernel)(*arrays)`: run on the CPU interpreter; returns outputs of the inputs' array type."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return lambda *args, **kwargs: run(k, args, kwargs).outputs


class RunResult:
    """Outputs of one kernel run plus what the cost model needs: per-core traces, peak SBUF, target."""

    def __init__(self, outputs, contexts, target):
        self.outputs = outputs
        self.contexts = contexts
        self.target = target

    @property
    def traces(self):
        return [c.trace for c in self.contexts]


# ---- argument conversion ------------------------------------------------------------------------------------

class _Binding:
    """Converts caller arrays to HBM tensors and back, remembering the originals for in-place write-back."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.inputs = []   # (original, NkiTensor, is_torch)
        self.torch = False

    def wrap(self, x, path):
        if isinstance(x, np.ndarray) or _is_torch(x):
            return self._tensor(x, path)
        if isinstance(x, list):
            if lint.parser_frontend():
                raise NkiValidationError(f"kernel argument {path} is a list; NKI kernels take tuples under "
                                         "NKI_COMPILER_FRONTEND=custom (C15)")
            return [self.wrap(v, f"{path}[{i}]") for i, v in enumerate(x)]  # plain Python under tracing (0.7)
        if isinstance(x, tuple):
            return tuple(self.wrap(v, f"{path}[{i}]") for i, v in enumerate(x))
        if isinstance(x, dict):
            return {k: self.wrap(v, f"{path}[{k!r}]") for k, v in x.items()}
        return x

    def _tensor(self, x, path):
        is_torch = _is_torch(x)
        if is_torch:
            self.torch = True
            arr = _torch_to_numpy(x)
        else:
            arr = x
        try:
            d = dt.as_dtype(arr.dtype)
        except TypeError as e:
            raise NkiValidationError(f"kernel argument {path}: {e}") from None
        storage = np.ascontiguousarray(arr).reshape(-1).astype(dt.storage_dtype(d), copy=True)
        shape = arr.shape if arr.ndim else (1,)
        alloc = Allocation(shape, d, self.buffer, name=path, storage=storage)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        t = NkiTensor(alloc, shape, strides, 0, d)
        self.inputs.append((x, t, is_torch))
        return t

    def unwrap(self, out):
        if isinstance(out, NkiTensor):
            arr = np.array(np_view(out))
            if out.dtype.kind == "packed":
                return mx.PackedArray(arr, out.dtype)  # x4 words keep their NKI dtype outside the kernel
            if arr.dtype != out.dtype.np and out.dtype.kind == "float":
                arr = arr.astype(out.dtype.np)  # NKI_PRECISE_FP=0 storage back to the declared dtype
            return _numpy_to_torch(arr) if self.torch else arr
        if isinstance(out, tuple):
            return tuple(self.unwrap(o) for o in out)
        if isinstance(out, list):
            return [self.unwrap(o) for o in out]
        if isinstance(out, dict):
            return {k: self.unwrap(v) for k, v in out.items()}
        return out

    def write_back(self):
        """Inputs the kernel wrote are updated in place, as the official simulator does."""
        for orig, t, is_torch in self.inputs:
            if not t.alloc.written:
                continue
            data = t.alloc.storage.reshape(t.shape)
            if is_torch:
                orig.copy_(_numpy_to_torch(np.asarray(data).astype(t.dtype.np)).reshape(orig.shape))
            else:
                words = orig.view(np.ndarray)  # a PackedArray's .dtype is the NKI packed dtype, not its words'
                words[...] = np.asarray(data).astype(words.dtype).reshape(orig.shape)


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _torch_to_numpy(t):
    import torch
    t = t.detach().cpu()
    d = dt.as_dtype(t.dtype)
    if d.np.kind == "V" or d.name in ("bfloat16",) or d.name.startswith("float8"):
        width = {1: torch.uint8, 2: torch.int16}[d.itemsize]
        return t.contiguous().view(width).numpy().view(d.np)
    return t.numpy()


def _numpy_to_torch(a):
    import torch
    d = dt.as_dtype(a.dtype)
    if d.name == "bfloat16" or d.name.startswith("float8"):
        width = {1: np.uint8, 2: np.int16}[d.itemsize]
        tdt = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
               "float8_e8m0fnu": torch.float8_e8m0fnu}.get(d.name)
        if tdt is None:
            return torch.from_numpy(a.astype(np.float32))
        return torch.from_numpy(np.ascontiguousarray(a).view(width)).view(tdt)
    return torch.from_numpy(np.ascontiguousarray(a))


# ---- running ---------------------------------------------------------------------------------------------------

def run(kernel, args, kwargs, target=None, record=True, numerics=True):
    """Run `kernel` on the interpreter. numerics=False records the trace without computing TensorE products
    (outputs are not valid); refused by the cores for kernels whose addresses / control flow read tensor data."""
    outer = current()
    if outer.in_kernel and not lint.parser_frontend():
        # 0.7 tracing inlines a nested @nki.jit sub-kernel into the running kernel under its config
        _check_nested_config(kernel, outer)
        return RunResult(kernel.func(*args, **kwargs), [outer], outer.target)
    if outer.in_kernel:
        raise lint.NkiLanguageError([lint.Violation(*_site(kernel.func), "nested-jit",
                                                    f"calls jit kernel '{kernel.func.__name__}' from inside a "
                                                    "kernel; sub-kernels must be plain functions")])
    lint.raise_if_violations(list(lint.check_kernel(kernel.func)) +
                             list(lint.check_call_args(kernel.func, args, kwargs)))
    tgt = resolve_target(target)
    lnc = kernel.lnc
    binding = _Binding(shared_hbm if lnc == 2 else hbm)
    targs = binding.wrap(tuple(args), "args")
    tkwargs = {k: binding.wrap(v, k) for k, v in kwargs.items()}
    pw = ambient_world()      # a rank of a multi-process world (nkisim.process_world)
    if pw is not None and lnc != 1:
        raise NkiValidationError(f"process_world: a kernel[{lnc}] launch; ranks spread over processes run at LNC=1")
    if lnc == 1:
        ctx = CoreContext(0, 1, tgt, record=record)
        if pw is not None:
            ctx.world, ctx.rank = pw, pw.rank
        ctx.jit_options = kernel.options
        ctx.numerics = numerics
        outputs = _run_core(kernel.func, ctx, targs, tkwargs)
        contexts = [ctx]
    else:
        outputs, contexts = _run_lnc(kernel.func, lnc, tgt, targs, tkwargs, record, kernel.options, numerics)
    lint.raise_if_violations(lint.check_outputs(kernel.func, outputs, [t.alloc for _, t, _ in binding.inputs]))
    binding.write_back()
    return RunResult(binding.unwrap(outputs), contexts, tgt)


def _run_core(func, ctx, args, kwargs):
    prev = set_current(ctx)
    ctx.in_kernel = True
    ctx.defer_liveness()
    try:
        out = func(*args, **kwargs)
        ctx.pool.check_liveness()
        return out
    finally:
        ctx.in_kernel = False
        set_current(prev)


def _run_lnc(func, n, tgt, args, kwargs, record, options=None, numerics=True):
    shared = LncShared(n)
    contexts = [CoreContext(i, n, tgt, shared=shared, record=record) for i in range(n)]
    for c in contexts:
        c.jit_options = options
        c.numerics = numerics
    world = one_rank_world(shared, contexts)     # nki.collectives in a plain launch: a world of one rank
    results, errors = [None] * n, [None] * n

    def body(i):
        try:
            results[i] = _run_core(func, contexts[i], args, kwargs)
            world.finish(0, i, contexts[i].cc_count)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
            errors[i] = e
            world.fail(0, i, e)      # also aborts `shared` (one_rank_world registered it with the world)

    threads = [threading.Thread(target=body, args=(i,), name=f"nkisim-core{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(e is not None for e in errors):
        raise first_failure({(0, i): e for i, e in enumerate(errors) if e is not None}, world)
    return results[0], contexts


_CONFIG_KEYS = ("compile_config", "specialization_config")


def _check_nested_config(kernel, ctx):
    """A nested @nki.jit sub-kernel inlines under the top-level kernel's config; a different config is an error
    unless the top-level kernel's SpecializationConfig.allow_nested_config_override is set (then a warning)."""
    top = getattr(ctx, "jit_options", None)
    if top is None:
        return
    differ = [k for k in _CONFIG_KEYS if kernel.options.get(k) != top.get(k)]
    if not differ:
        return
    what = (f"nested @nki.jit kernel '{kernel.func.__name__}' has a different {' and '.join(differ)} than the "
            "top-level kernel")
    if getattr(top.get("specialization_config"), "allow_nested_config_override", False) is True:
        warnings.warn(f"{what}; inlined under the top-level kernel's config (allow_nested_config_override)",
                      UserWarning, stacklevel=4)
        return
    raise NkiValidationError(f"{what}: configs must agree, or set SpecializationConfig("
                             "allow_nested_config_override=True) on the top-level kernel to inline it under that "
                             "kernel's config")


def _site(fn):
    code = getattr(fn, "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code else ("<unknown>", 0)
