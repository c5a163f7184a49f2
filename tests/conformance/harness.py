"""One conformance case = one nki-library kernel on one shape of the library's own tests, run unmodified under
nkisim and compared with the library's torch reference using the library's tolerance rule.

The tolerance rule is nki-library's `maxAllClose(mode="max")`: both sides cast to fp32, the case passes when every
element satisfies |kernel - golden| <= atol + rtol * max|golden| (a global range, not per element); integer
outputs (indices) compare exactly. The reference is called as the library's `torch_ref_wrapper` calls it: NumPy
inputs become torch tensors with bf16/fp8 widened to fp32 and uint32 narrowed to int32.
"""

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.peers import nkilib

TARGETS = ("trn2", "trn3")


@dataclass(frozen=True)
class Case:
    """A kernel, a shape of its library test, and how to compare it.

    kernel / ref: `"module:attr"` paths inside `nkilib_src.nkilib` (the jit kernel and its torch reference), or a
        callable: a thin kernel of ours that drives a library kernel or ISA op the way the library's test does (SBUF
        operands, in-place outputs), or our own reference where the library ships none in its source tree.
    inputs: seeded builder of the kernel's keyword arguments (NumPy arrays and Python values), shapes taken from
        the library test named by `source`.
    ref_inputs: builds the reference's keyword arguments from the kernel's (default: the same dict).
    outputs: names the kernel's returned tensors after the reference's output keys (default: in order).
    tols: per-output (atol, rtol) where the library's test uses different tolerances per output.
    out_args: kernel arguments the kernel writes in place (the library's `name.must_alias_input` inputs); when set,
        they (after the run) are the kernel's outputs, in the order of the reference's output keys.
    ref_lower_precision: the library's `torch_ref_wrapper(..., preserve_lower_precision=True)`: bf16 inputs stay
        bf16 tensors in the reference and its outputs are rounded to the first low-precision input dtype.
    compare: (named kernel outputs, golden, kernel kwargs) -> (kernel side, golden side) actually compared, for
        tests whose library validator compares derived views (sorted values, input values at the kernel's indices).
    env: environment of the kernel run beyond the target, e.g. {"NKISIM_UNINIT": "zero"} for kernels that compute on
        padding partitions they never wrote and cancel them with zero weights (say why in `source`).
    """

    kernel: str | Callable
    ref: str | Callable
    shape_id: str
    inputs: Callable[[], dict]
    atol: float
    rtol: float
    source: str
    target: str = "trn2"
    lnc: int = 1
    ref_inputs: Callable[[dict], dict] | None = None
    outputs: Callable[[object, dict], dict] | None = None
    exact: tuple[str, ...] = field(default=())
    ref_lower_precision: bool = False
    out_args: tuple[str, ...] = field(default=())
    tols: dict = field(default_factory=dict)
    pass_rates: dict = field(default_factory=dict)   # output key -> maxAllClose min_pass_rate (default 1.0)
    compare: Callable[[dict, dict, dict], tuple[dict, dict]] | None = None
    # Multi-rank launches (nki.collectives kernels): with ranks > 1, `inputs(rank)` builds each rank's kwargs and
    # `ref(rank)` returns that rank's NumPy golden dict (the library's PerRankLazyInputGenerator /
    # PerRankLazyGoldenGenerator); `rank0_only`: the library validates only rank 0 when one golden serves all ranks.
    ranks: int = 1
    rank0_only: bool = False
    timeout_s: float | None = None     # pytest timeout for a case far slower than the suite's default
    env: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        if callable(self.kernel):
            return self.kernel.__name__
        return self.kernel.partition(":")[2]

    @property
    def id(self) -> str:
        return f"{self.name}-{self.shape_id}-{self.target}-lnc{self.lnc}"


@dataclass
class Result:
    case: Case
    passed: bool
    max_err: float = float("nan")
    tol: float = float("nan")
    wall_s: float = 0.0
    error: str = ""

    def row(self) -> tuple:
        verdict = "pass" if self.passed else ("FAIL" if not self.error else "ERROR")
        return (self.case.name, self.case.shape_id, self.case.target, f"lnc{self.case.lnc}", verdict,
                f"{self.max_err:.3g}", f"{self.tol:.3g}", f"{self.wall_s:.2f}s", self.error[:90])


RESULTS: list[Result] = []


def max_mode_error(actual: np.ndarray, golden: np.ndarray, atol: float, rtol: float,
                   pass_rate: float = 1.0) -> tuple[float, float]:
    """(max |actual - golden|, atol + rtol * max|golden|) after casting both to fp32; NaN anywhere → inf error.
    With `pass_rate` < 1 (maxAllClose's min_pass_rate) the error is the pass_rate-quantile of |actual - golden|:
    it is within the tolerance exactly when that fraction of the elements is."""
    a = np.asarray(actual, dtype=np.float32)
    b = np.asarray(golden, dtype=np.float32)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != golden shape {b.shape}")
    tol = float(atol + rtol * (np.max(np.abs(b)) if b.size else 0.0))
    if not np.all(np.isfinite(a[np.isfinite(b)])) or np.isnan(a).sum() != np.isnan(b).sum():
        return float("inf"), tol
    diff = np.abs(a - b)
    diff = diff[np.isfinite(diff)]
    if not diff.size:
        return 0.0, tol
    if pass_rate < 1.0:
        need = max(1, int(np.ceil(pass_rate * diff.size)))   # elements that must be within the tolerance
        return float(np.partition(diff, need - 1)[need - 1]), tol
    return float(diff.max()), tol


def torch_inputs(kwargs: dict, lower_precision: bool = False) -> dict:
    """NumPy → torch as the library's torch_ref_wrapper does (bf16/fp8 widened to fp32, uint32 → int32; with
    `lower_precision`, bf16 stays a torch bf16 tensor)."""
    import torch
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, np.ndarray):
            name = str(value.dtype)
            if "x4" in name:
                out[key] = value
                continue
            if value.dtype == np.uint32:
                value = value.astype(np.int32)
            elif "bfloat16" in name or "float8" in name:
                value = value.astype(np.float32)
            t = torch.from_numpy(np.ascontiguousarray(value))
            if t.dtype == torch.float16:
                t = t.float()
            elif lower_precision and "bfloat16" in name:
                t = t.to(torch.bfloat16)
            out[key] = t
        else:
            out[key] = value
    return out


def _to_numpy(value) -> np.ndarray:
    from nkisim import mx
    if mx.packed_dtype_of(value) is not None:
        return mx.unpack(value)  # x4 MX words compare as their fp32 elements
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def golden(case: Case, kernel_kwargs: dict) -> dict:
    ref = case.ref if callable(case.ref) else nkilib.load(case.ref)
    kwargs = case.ref_inputs(kernel_kwargs) if case.ref_inputs else kernel_kwargs
    out = ref(**torch_inputs(kwargs, case.ref_lower_precision))
    if not isinstance(out, dict):
        out = {"output_0": out} if not isinstance(out, (tuple, list)) else {f"output_{i}": o for i, o in enumerate(out)}
    gold = {k: _to_numpy(v) for k, v in out.items()}
    if case.ref_lower_precision:
        low = next((v.dtype for v in kwargs.values() if isinstance(v, np.ndarray)
                    and any(s in str(v.dtype) for s in ("bfloat16", "float8", "float16"))), None)
        if low is not None:
            gold = {k: v.astype(low) for k, v in gold.items()}
    return gold


def _name_outputs(case: Case, outs, gold: dict) -> dict:
    if case.outputs:
        return case.outputs(outs, gold)
    seq = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if len(seq) != len(gold):
        raise AssertionError(f"kernel returned {len(seq)} outputs, reference {len(gold)} ({list(gold)})")
    return dict(zip(gold, seq))


@contextlib.contextmanager
def _environment(env: dict):
    """Set `env` for the duration of a launch, restoring what was there before."""
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(case: Case):
    """The case's kernel (plain sub-kernels wrapped in nki.jit) at its LNC degree."""
    import nki

    kernel = nkilib.load(case.kernel)
    if not getattr(kernel, "_is_nki_kernel", False):
        kernel = nki.jit(kernel)
    return kernel[case.lnc] if case.lnc != 1 else kernel


def _worst(case: Case, named: dict, gold: dict, worst: tuple[bool, float, float]) -> tuple[bool, float, float]:
    """Fold one golden dict into (passed, worst error, its tolerance); the first output is shown unless another
    is further over (or less under) its tolerance."""
    passed, worst_err, worst_tol = worst
    for key, ref in gold.items():
        atol, rtol = (0.0, 0.0) if key in case.exact else case.tols.get(key, (case.atol, case.rtol))
        err, tol = max_mode_error(_to_numpy(named[key]), ref, atol, rtol, case.pass_rates.get(key, 1.0))
        passed &= err <= tol
        if worst_err is None or err - tol > worst_err - worst_tol:
            worst_err, worst_tol = err, tol
    return passed, worst_err, worst_tol


def run_case(case: Case) -> Result:
    """Run the kernel under nkisim on `case.target` and compare it with the reference."""
    import nki

    if case.ranks > 1:
        return run_ranks_case(case)
    launch = _launch(case)
    kwargs = case.inputs()
    copies = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    gold = golden(case, kwargs)
    start = time.perf_counter()
    with _environment({"NEURON_PLATFORM_TARGET_OVERRIDE": case.target, **case.env}):
        outs = nki.simulate(launch)(**copies)
    wall = time.perf_counter() - start
    if case.out_args:
        outs = tuple(copies[k] for k in case.out_args)
    named = _name_outputs(case, outs, gold)
    if case.compare:
        named, gold = case.compare({k: _to_numpy(v) for k, v in named.items()}, gold, kwargs)
    passed, err, tol = _worst(case, named, gold, (True, None, None))
    return Result(case, passed, err, tol, wall)


def run_ranks_case(case: Case) -> Result:
    """`case.ranks` instances of the kernel in one collective launch (nkisim.run_ranks), each rank compared with its
    own golden (rank 0 only with `rank0_only`); the worst rank's error is reported."""
    import nkisim

    launch = _launch(case)
    per_rank = [case.inputs(r) for r in range(case.ranks)]
    start = time.perf_counter()
    with _environment({"NEURON_PLATFORM_TARGET_OVERRIDE": case.target, **case.env}):
        outs = nkisim.run_ranks(launch, case.ranks, per_rank).outputs
    wall = time.perf_counter() - start
    worst = (True, None, None)
    for r in range(1 if case.rank0_only else case.ranks):
        gold = {k: np.asarray(v) for k, v in case.ref(r).items()}
        worst = _worst(case, _name_outputs(case, outs[r], gold), gold, worst)
    return Result(case, *worst, wall)


def table(results: list[Result]) -> str:
    """The conformance table: kernel, shape, target, lnc, result, max error vs tolerance, wall time."""
    head = ("kernel", "shape", "target", "lnc", "result", "max_err", "tol", "wall", "error")
    rows = [head] + [r.row() for r in results]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    kernels = {r.case.name for r in results}
    ok_kernels = {r.case.name for r in results} - {r.case.name for r in results if not r.passed}
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} cases pass; {len(ok_kernels)}/{len(kernels)} kernels pass every case")
    return "\n".join(lines)
