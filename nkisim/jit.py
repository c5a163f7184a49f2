"""`nki.jit`, `Kernel[lnc]` and `nki.simulate`: run a kernel eagerly on NumPy, as the official simulator does.

A call wraps NumPy arrays / torch CPU tensors as HBM tensors (shared_hbm under LNC=2), lints the kernel source
once (nkisim.lint), runs the body as ordinary Python on one thread per core, checks that outputs live in
shared_hbm, returns the outputs as the caller's array type and writes back any input the kernel modified.
"""

import functools
import threading

import numpy as np

from . import dtypes as dt
from . import lint, mx
from .errors import NkiValidationError
from .memory import Allocation, hbm, shared_hbm
from .runtime import CoreContext, LncShared, current, set_current
from .target import resolve_target
from .tensor import NkiTensor, np_view
from .world import first_failure, one_rank_world


class Kernel:
    """A jit-decorated NKI kernel. `kernel(*args)` runs it on one core; `kernel[2](*args)` on an LNC=2 pair."""

    _is_nki_kernel = True

    def __init__(self, func, lnc=1, **options):
        self.func = func
        self.lnc = lnc
        self.options = options
        functools.update_wrapper(self, func)

    def __getitem__(self, grid):
        if isinstance(grid, tuple):
            if len(grid) != 1:
                raise NkiValidationError(f"kernel[{grid}]: the launch bracket takes exactly one number, the LNC "
                                         "degree (1 or 2) (C18)")
            grid = grid[0]
        if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or int(grid) not in (1, 2):
            raise NkiValidationError(f"kernel[{grid}]: LNC must be 1 or 2 (C18)")
        return Kernel(self.func, lnc=int(grid), **self.options)

    def __call__(self, *args, **kwargs):
        return run(self, args, kwargs).outputs

    def __repr__(self):
        return f"<nki.jit kernel {self.func.__qualname__} lnc={self.lnc}>"


def jit(fn=None, **kwargs):
    """Decorator: `@nki.jit` or `@nki.jit(...)` (options such as mode/platform_target are ignored, as in NKI 0.6)."""
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

def run(kernel, args, kwargs, target=None, record=True):
    outer = current()
    if outer.in_kernel and not lint.parser_frontend():
        # 0.7 tracing inlines a nested @nki.jit sub-kernel into the running kernel under its config
        return RunResult(kernel.func(*args, **kwargs), [outer], outer.target)
    if outer.in_kernel:
        raise lint.NkiLanguageError([lint.Violation(*_site(kernel.func), "nested-jit",
                                                    f"calls jit kernel '{kernel.func.__name__}' from inside a "
                                                    "kernel; sub-kernels must be plain functions")])
    lint.raise_if_violations(list(lint.check_kernel(kernel.func)) +
                             list(lint.check_call_args(kernel.func, args, kwargs)))
    tgt = resolve_target(target)
    binding = _Binding(shared_hbm if kernel.lnc == 2 else hbm)
    targs = binding.wrap(tuple(args), "args")
    tkwargs = {k: binding.wrap(v, k) for k, v in kwargs.items()}
    if kernel.lnc == 1:
        ctx = CoreContext(0, 1, tgt, record=record)
        outputs = _run_core(kernel.func, ctx, targs, tkwargs)
        contexts = [ctx]
    else:
        outputs, contexts = _run_lnc(kernel.func, kernel.lnc, tgt, targs, tkwargs, record)
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


def _run_lnc(func, n, tgt, args, kwargs, record):
    shared = LncShared(n)
    contexts = [CoreContext(i, n, tgt, shared=shared, record=record) for i in range(n)]
    world = one_rank_world(shared, contexts)     # nki.collectives in a plain launch: a world of one rank
    results, errors = [None] * n, [None] * n

    def body(i):
        try:
            results[i] = _run_core(func, contexts[i], args, kwargs)
            world.finish(0, i, contexts[i].cc_count)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
            errors[i] = e
            shared.abort()
            world.fail(0, i, e)

    threads = [threading.Thread(target=body, args=(i,), name=f"nkisim-core{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(e is not None for e in errors):
        raise first_failure({(0, i): e for i, e in enumerate(errors) if e is not None}, world)
    return results[0], contexts


def _site(fn):
    code = getattr(fn, "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code else ("<unknown>", 0)
