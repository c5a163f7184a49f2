"""Whole-model calibration: the terms the roofline step lacks, each sourced, assumed or fitted on published rows.

The analytical step (``bench.model.analytical``) charges each kernel its roofline time at 100% of datasheet HBM
bandwidth and each collective its alpha-beta time. Against every published decode latency (``published.py``) that is
2.2-6.4x optimistic. The calibrated step adds what real decode pays (issue 12), with every figure *modelled*:

    t_cal = sum_k max(t_compute_k, t_memory_k / hbm_efficiency, launches_k * kernel floor)    kernels at achieved BW
          + sum_c max(t_c, collective_floor) * repeats_c                                       collectives, floored
          + layers * layer_fixed[stack]                                       kernel boundaries, semaphores, DMA latency
          + host_step                                                           host/runtime time per decode step

* ``hbm_efficiency`` (FIT): achieved HBM bandwidth of small-batch decode. Checked against the 36-42% issue 12 reads
  off published decode profiles and the 13-46% "HBM-roofline efficiency" derived in parallel-and-perf-model.md §2.7.
* ``layer_fixed[stack]`` (FIT): per decoder layer, what neither roof carries. Two software stacks: ``graph`` (vLLM
  Neuron / NxDI / nkipy: each layer is several compiled kernels with graph boundaries between them) and
  ``megakernel`` (all layers in one ``nki.jit``). kernel-anchors.md §2.7: the Qwen3-30B-A3B trn3 profile shows the sync
  engine at 53.5 us per layer under XLA and 19.1 us in the megakernel ("~98 graph boundaries per decoder block
  eliminated"), hence one value per stack.
* ``collective_floor`` (sourced): vllm-neuron docs/kernel_ledger.md models a collective as 17.5 us + bytes/100 GB/s
  (kernel-anchors.md §1); issue 12 reports >= 17.5 us per decode all-reduce traced on trn2.
* ``host_step`` (ASSUMPTION): issue 12's ~0.45 ms NxDI host-vs-device gap per token; not re-found at an AWS source
  in this session, so an assumption, applied to every stack.
  The megakernel's fitted value is 0: its per-layer sync and in-kernel all-reduces (19.1 us sync + 27.8 us CC per
  layer in the Qwen3 megakernel profile) are then carried by the two floored collectives per layer (2 x 17.5 us).
* sampling: on-device greedy sampling is already in the step (the LM head writes and re-reads the logits and
  all-gathers the per-shard argmax); a host-side sampler sits inside ``host_step``. No separate term.

Fitting: the two fitted kinds are chosen to minimise the squared *relative* error over the declared subset
``FIT_KEYS`` (a grid over the efficiency; the per-stack layer cost in closed form, >= 0). Validation: every published
row is predicted out of sample, by leave-one-out for rows in ``FIT_KEYS`` and by the ``FIT_KEYS`` fit for the held-out
rows; ``validation()`` returns the table and tests hold every out-of-sample residual to +-25% (``BAND``).
The calibrated step is computed from the analytical roofline terms only (never from nkisim kernel latencies), so it
does not depend on which kernel benchmarks ran. It applies to decode; prefill and vision stay uncalibrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bench.model.published import PUBLISHED, Published

BAND = 0.25
STACKS = ("graph", "megakernel")
DEFAULT_STACK = "graph"            # the sweep models vLLM Neuron (per-layer kernels in one compiled graph)

COLLECTIVE_FLOOR_S = 17.5e-6
COLLECTIVE_FLOOR_SOURCE = ("vllm-neuron docs/kernel_ledger.md collective model '17.5 us + bytes/100 GB/s' "
                           "(kernel-anchors.md §1); issue 12: >= 17.5 us per decode all-reduce traced on trn2")
HOST_STEP_S = 0.45e-3
HOST_STEP_SOURCE = ("ASSUMPTION: issue 12, ~0.45 ms NxDI host-vs-device gap per token (vLLM scheduler, input "
                    "prep, host sampler); the figure was not re-found at an AWS source. vllm-neuron's design note "
                    "docs/design/vllm/async-scheduling-and-async-execution.md confirms the term exists (synchronous "
                    "mode: 'the device idles while the CPU prepares the next step'). host_sensitivity(): every "
                    "published row stays within the band for 0-1 ms")
EFFICIENCY_SOURCE = ("FIT on the published rows (FIT_KEYS); cross-check: 36-42% achieved HBM BW in published decode "
                     "profiles (issue 12), 13-46% derived HBM-roofline efficiency (parallel-and-perf-model.md §2.7)")
LAYER_FIXED_SOURCE = ("FIT per stack on the published rows (FIT_KEYS); context: sync engine 53.5 us/layer (XLA) vs "
                      "19.1 us/layer (megakernel) in the Qwen3-30B-A3B trn3 profile (kernel-anchors.md §2.7)")
SAMPLING_SOURCE = ("modelled inside the step: LM-head logits write + read and the distributed argmax all-gather; a "
                   "host-side sampler is inside the host term")

# The declared fitting subset. Held out (validated only): the largest-TP row (Llama-3.3-70B TP64, 80 layers, the
# most collectives) and the longest-context row, so the check covers the two directions the sweep extrapolates in.
HELD_OUT = ("llama70b-tp64", "gptoss20b-trn3-ctx8192")
FIT_KEYS = tuple(p.key for p in PUBLISHED if p.key not in HELD_OUT)
_ETA_GRID = tuple(round(0.15 + 0.0025 * i, 4) for i in range(341))      # 0.15 .. 1.0


def stack_of(p: Published) -> str:
    return "megakernel" if p.runtime == "megakernel" else "graph"


@dataclass(frozen=True)
class CalParams:
    hbm_efficiency: float
    layer_fixed_s: tuple[tuple[str, float], ...]     # ((stack, seconds per layer), ...)
    collective_floor_s: float = COLLECTIVE_FLOOR_S
    host_step_s: float = HOST_STEP_S
    fitted_on: tuple[str, ...] = ()

    def layer_fixed(self, stack: str) -> float:
        if stack not in STACKS:
            raise ValueError(f"calibration: unknown stack {stack!r}; expected one of {STACKS}")
        return dict(self.layer_fixed_s).get(stack, 0.0)


def step_terms(res, params: CalParams, stack: str = DEFAULT_STACK) -> dict:
    """Calibrated decode step of one analytical ``StepResult``, term by term (seconds; all modelled)."""
    eta = params.hbm_efficiency
    kernels = sum(max(c.t_compute, c.t_memory / eta, c.count * _kernel_floor(res)) for c in res.components)
    colls = sum(max(c.time_s, params.collective_floor_s) * res.collective_multiplier(c)
                for c in res.collectives if c.n > 1)
    layer = res.layers * params.layer_fixed(stack)
    host = params.host_step_s
    return {"kernels_s": kernels, "collectives_s": colls, "layer_fixed_s": layer, "host_s": host,
            "total_s": kernels + colls + layer + host, "stack": stack}


def _kernel_floor(res) -> float:
    from bench.model.hardware import get_instance

    return get_instance(res.instance, res.lnc).kernel_min_s


def _features(res, floor_s: float) -> tuple[list[tuple[float, float, float]], float]:
    """The efficiency-independent parts of ``step_terms``: per component (t_compute, t_memory, launch floor) and the
    floored collective time (computed once per row, so a fit over the efficiency grid stays cheap)."""
    kfloor = _kernel_floor(res)
    comps = [(c.t_compute, c.t_memory, c.count * kfloor) for c in res.components]
    colls = sum(max(c.time_s, floor_s) * res.collective_multiplier(c) for c in res.collectives if c.n > 1)
    return comps, colls


def _fit(steps: list[tuple[Published, object]], host_step_s: float = HOST_STEP_S) -> CalParams:
    """Minimise sum((pred - published) / published)^2 over the efficiency grid; layer costs in closed form (>= 0).
    The host time per step is an input (an assumption), not fitted. Same terms as ``step_terms``."""
    if not steps:
        raise ValueError("calibration: nothing to fit (empty subset of published rows)")
    rows = [(stack_of(p), p.tpot_ms * 1e-3, res.layers, *_features(res, COLLECTIVE_FLOOR_S)) for p, res in steps]
    best = None
    for eta in _ETA_GRID:
        per_stack: dict[str, list[tuple[float, float]]] = {s: [] for s in STACKS}
        for stack, t, layers, comps, colls in rows:
            f = sum(max(tc, tm / eta, fl) for tc, tm, fl in comps) + colls + host_step_s   # layer_fixed 0 here
            per_stack[stack].append((layers / t, (f - t) / t))
        layer, err = [], 0.0
        for s, pts in per_stack.items():
            den = sum(a * a for a, _ in pts)
            c = max(0.0, -sum(a * r for a, r in pts) / den) if den else 0.0
            layer.append((s, c))
            err += sum((a * c + r) ** 2 for a, r in pts)
        if best is None or err < best[0]:
            best = (err, eta, tuple(layer))
    return CalParams(best[1], best[2], host_step_s=host_step_s, fitted_on=tuple(p.key for p, _ in steps))


def host_sensitivity(hosts=(0.0, 0.25e-3, 0.45e-3, 0.7e-3, 1.0e-3)) -> list[dict]:
    """How the fit and the worst out-of-sample residual move with the assumed host time per step."""
    fit_steps = [s for s in published_steps() if s[0].key in FIT_KEYS]
    out = []
    for h in hosts:
        full = _fit(fit_steps, h)
        worst = 0.0
        for p, res in published_steps():
            q = _fit([s for s in fit_steps if s[0].key != p.key], h) if p.key in FIT_KEYS else full
            worst = max(worst, abs(step_terms(res, q, stack_of(p))["total_s"] / (p.tpot_ms * 1e-3) - 1.0))
        out.append({"host_step_s": h, "hbm_efficiency": full.hbm_efficiency,
                    "layer_fixed_graph_s": full.layer_fixed("graph"), "worst_residual_oos": worst})
    return out


@lru_cache(maxsize=1)
def published_steps() -> tuple[tuple[Published, object], ...]:
    """(published row, analytical StepResult without nkisim kernel latencies) for every published row."""
    from bench.model.analytical import Bucket, ParallelConfig, evaluate
    from bench.model.hardware import get_instance
    from modules.model_specs import ALL_MODELS

    out = []
    for p in PUBLISHED:
        res = evaluate(ALL_MODELS[p.model], get_instance(p.instance, p.lnc), ParallelConfig(p.tp),
                       Bucket("decode", batch=p.batch, ctx=p.ctx))
        out.append((p, res))
    return tuple(out)


@lru_cache(maxsize=1)
def params() -> CalParams:
    """The calibration used everywhere: fitted on ``FIT_KEYS``."""
    return _fit([s for s in published_steps() if s[0].key in FIT_KEYS])


def validation() -> list[dict]:
    """Per published row: published, uncalibrated, calibrated (in-sample fit) and out-of-sample prediction."""
    return [dict(r) for r in _validation()]


@lru_cache(maxsize=1)
def _validation() -> tuple[dict, ...]:
    full = params()
    rows = []
    for p, res in published_steps():
        t = p.tpot_ms * 1e-3
        stack = stack_of(p)
        in_sample = p.key in FIT_KEYS
        oos_params = _fit([s for s in published_steps() if s[0].key in FIT_KEYS and s[0].key != p.key]) \
            if in_sample else full
        cal = step_terms(res, full, stack)["total_s"]
        oos = step_terms(res, oos_params, stack)["total_s"]
        rows.append({"key": p.key, "model": p.model, "instance": p.instance, "lnc": p.lnc, "tp": p.tp,
                     "batch": p.batch, "ctx": p.ctx, "stack": stack, "published_s": t, "uncalibrated_s": res.t_step,
                     "calibrated_s": cal, "out_of_sample_s": oos, "residual": cal / t - 1.0,
                     "residual_oos": oos / t - 1.0, "in_sample": in_sample,
                     "validation": "leave-one-out" if in_sample else "held out"})
    return tuple(rows)


def decode_fields(res, stack: str = DEFAULT_STACK) -> dict:
    """Calibrated figures for a decode ``StepResult`` (flat keys for ``extra_info``; all modelled)."""
    terms = step_terms(res, params(), stack)
    t = terms["total_s"]
    shares = {"kernels": terms["kernels_s"], "collectives": terms["collectives_s"],
              "layer fixed": terms["layer_fixed_s"], "host": terms["host_s"]}
    return {"calibrated": True, "cal_stack": stack, "t_step_cal_us": t * 1e6,
            "cal_dominant": max(shares, key=shares.get),
            "cal_kernels_us": terms["kernels_s"] * 1e6, "cal_collectives_us": terms["collectives_s"] * 1e6,
            "cal_layer_fixed_us": terms["layer_fixed_s"] * 1e6, "cal_host_us": terms["host_s"] * 1e6,
            "tokens_per_s_per_chip_cal": res.tokens_per_step / t / res.chips if t > 0 and res.chips else 0.0}


def terms_rows() -> list[dict]:
    """Rows (item, trn2, trn3, source) for the report's one constants table; status in brackets."""
    p = params()
    fit = f"fitted on {len(p.fitted_on)} published rows ({', '.join(p.fitted_on)})"
    return [
        {"item": "calibration: achieved HBM BW fraction (decode)", "trn2": p.hbm_efficiency,
         "trn3": p.hbm_efficiency, "source": f"[FIT] {EFFICIENCY_SOURCE}; {fit}"},
        {"item": "calibration: per-layer fixed cost s (graph stack)", "trn2": p.layer_fixed("graph"),
         "trn3": p.layer_fixed("graph"), "source": f"[FIT] {LAYER_FIXED_SOURCE}"},
        {"item": "calibration: per-layer fixed cost s (megakernel)", "trn2": p.layer_fixed("megakernel"),
         "trn3": p.layer_fixed("megakernel"), "source": f"[FIT] {LAYER_FIXED_SOURCE}"},
        {"item": "calibration: collective latency floor s", "trn2": p.collective_floor_s,
         "trn3": p.collective_floor_s, "source": f"[sourced] {COLLECTIVE_FLOOR_SOURCE}"},
        {"item": "calibration: host/runtime time per decode step s", "trn2": p.host_step_s, "trn3": p.host_step_s,
         "source": f"[ASSUMPTION] {HOST_STEP_SOURCE}"},
        {"item": "calibration: sampling", "trn2": "in step", "trn3": "in step",
         "source": f"[modelled] {SAMPLING_SOURCE}"},
    ]
