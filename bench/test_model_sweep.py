"""Whole-model sweep: the analytical model over tp × dp × component-DP mix × bucket × instance (all figures modelled).

One benchmark per report group (model × phase × instance, plus the published comparison): it evaluates every
configuration of the group and stores them as one columnar table in ``extra_info`` (``bench.model.sweep.run_table``):
memory per rank and whether it fits, FLOPs, HBM bytes, collective time, the three roofs, the bound, tokens/s per chip,
and for decode the calibrated step (``bench.model.calibration``). Invalid combinations are listed in the table's
``skipped`` with the model's reason (shown in the report), so nothing disappears silently. pytest-benchmark's timing
here is the CPU time of evaluating the formula for the whole group: host time, withheld from its terminal table.

Where a kernel benchmark of this session modelled the same per-rank shape with nkisim (the decode-attention kernel
for the GPT-OSS and Llama-3.1-8B TP8 shards), that modelled kernel latency replaces the attention roofline time in
the uncalibrated step (``kernel_sources`` says so). The kernel files sort before this one, so their results exist.
"""

import pytest

from bench.model.kernel_table import KernelTable
from bench.model.sweep import case_groups, cases, published_cases, run_table

_GROUPS = case_groups(cases())
_PUBLISHED = case_groups(published_cases())
_TABLE: dict[str, KernelTable] = {}


def _params(groups):
    out = []
    for g, cs in groups.items():
        c = cs[0]
        model, phase = ("published", "decode") if c.published is not None else (c.model, c.bucket.phase)
        out.append(pytest.param(g, model, c.instance if c.published is None else "various", phase,
                                id=g.removeprefix("model:").replace(":", "-")))
    return out


def _kernel_table(config) -> KernelTable:
    if "t" not in _TABLE:
        bs = getattr(config, "_benchmarksession", None)
        _TABLE["t"] = KernelTable.from_benchmarks(bs.benchmarks if bs is not None else [])
    return _TABLE["t"]


def _run(benchmark, request, group: str, group_cases):
    benchmark.group = group
    table = _kernel_table(request.config)
    lookup = table if len(table) else None
    result = benchmark.pedantic(run_table, args=(group_cases, lookup), rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(result)
    assert result["configurations"] + result["invalid"] == len(group_cases)
    assert result["configurations"] > 0, f"{group}: every configuration invalid: {list(result['skipped'])[:3]}"


@pytest.mark.parametrize("group,model,instance,phase", _params(_GROUPS))
def test_model(benchmark, request, group, model, instance, phase):
    _run(benchmark, request, group, _GROUPS[group])


@pytest.mark.parametrize("group,model,instance,phase", _params(_PUBLISHED))
def test_published_comparison(benchmark, request, group, model, instance, phase):
    _run(benchmark, request, group, _PUBLISHED[group])
