"""Modelled vs published for every calibration case: ``python -m bench.calibration.run [--json PATH] [KEY ...]``.

Each kernel runs once on the interpreter — trace-only (no TensorE products) for the large matmuls, with numerics
for Mamba (checked against a NumPy reference on the small case) — and the trace is scheduled under both issue
orders of the cost model (nkisim.cost.bounds): "ready" (the compiler reorders) and "program" (it does not). The
ratio is modelled kernel body ("ready") / published; "with launch" adds the assumed launch overhead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import nkisim

from .cases import CASES, TARGET_BAND


def _inputs(case, rng):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if case.dtype == "bfloat16" else np.float32
    if case.kernel == "mamba_v1":
        b, c, s, st = case.shape
        return (rng.uniform(0.01, 0.1, (b, c, s)).astype(np.float32), rng.standard_normal((b, c, s)).astype(np.float32),
                -rng.uniform(0.5, 2, (c, st)).astype(np.float32), rng.standard_normal((b, st, s)).astype(np.float32),
                rng.standard_normal((b, st, s)).astype(np.float32))
    m, k, n = case.shape
    return np.zeros((k, m), dt), np.zeros((k, n), dt)


def kernel_of(case):
    if case.kernel == "mamba_v1":
        from .mamba import mamba_v1
        return mamba_v1
    from . import matmul_tutorial
    return getattr(matmul_tutorial, case.kernel)


def useful_flops(case):
    if case.kernel == "mamba_v1":
        return None
    m, k, n = case.shape
    return 2.0 * m * k * n


def model_case(case, seed=0):
    """Run and schedule one case; returns a dict row of the calibration table (all times in seconds)."""
    nkisim.install()
    rng = np.random.default_rng(seed)
    args = _inputs(case, rng)
    numerics = case.kernel == "mamba_v1"
    t0 = time.time()
    res = nkisim.run(kernel_of(case), args, dict(case.kwargs), target=case.target, numerics=numerics)
    if numerics and case.shape[1] <= 256:
        from .mamba import mamba_reference
        ref = mamba_reference(*args)
        err = float(np.abs(res.outputs - ref).max())
        if err > 1e-3 * max(1.0, float(np.abs(ref).max())):
            raise AssertionError(f"{case.key}: kernel output differs from the reference by {err}")
    b = nkisim.cost.bounds(res, kernel_name=case.kernel, useful_flops=useful_flops(case))
    ready, prog = b.ready, b.program
    return {
        "case": case.key, "what": case.what, "target": case.target, "published_s": case.published_s,
        "modelled_s": ready.latency_s, "modelled_program_s": prog.latency_s,
        "modelled_with_launch_s": ready.latency_with_launch_s, "launch_s": ready.launch_s,
        "ratio": ready.latency_s / case.published_s, "ratio_program": prog.latency_s / case.published_s,
        "within_band": abs(ready.latency_s / case.published_s - 1) <= TARGET_BAND,
        "bound": f"{ready.bound} ({ready.bound_engine})", "limiter": ready.limiter,
        "held_out": case.held_out, "source": case.source, "note": case.note,
        "instructions": len(res.traces[0]), "wall_s": time.time() - t0, "modelled": True,
    }


def format_table(rows):
    head = (f"{'case':16s} {'target':6s} {'published':>11s} {'modelled':>11s} {'ratio':>6s} {'program':>11s} "
            f"{'ratio':>6s} {'w/ launch':>11s} {'held out':>8s}  bound / source")
    lines = ["calibration (modelled = nkisim cost model, kernel body, issue order 'ready'; "
             "'program' = no compiler reordering; published = AWS hardware measurement)", head]
    for r in rows:
        lines.append(f"{r['case']:16s} {r['target']:6s} {_t(r['published_s']):>11s} {_t(r['modelled_s']):>11s} "
                     f"{r['ratio']:6.3f} {_t(r['modelled_program_s']):>11s} {r['ratio_program']:6.3f} "
                     f"{_t(r['modelled_with_launch_s']):>11s} {'yes' if r['held_out'] else 'no':>8s}  "
                     f"{r['bound']}; {r['source']}")
    inside = sum(r["within_band"] for r in rows)
    lines.append(f"{inside}/{len(rows)} cases within +-{TARGET_BAND:.0%} of the published figure")
    return "\n".join(lines)


def _t(s):
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("keys", nargs="*", help="case keys (default: all)")
    ap.add_argument("--json", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    cases = [c for c in CASES if not a.keys or c.key in a.keys]
    rows = []
    for c in cases:
        rows.append(model_case(c))
        print(f"  {c.key}: modelled {_t(rows[-1]['modelled_s'])} vs published {_t(c.published_s)} "
              f"({rows[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    print(format_table(rows))
    if a.json:
        import datetime
        doc = {"rows": rows, "band": TARGET_BAND, "modelled": True,
               "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
