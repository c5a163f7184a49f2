"""Whole-model sweep: the analytical model over tp × dp × component-DP mix × bucket × instance (all figures modelled).

pytest-benchmark times the model evaluation itself (cheap); the modelled step — memory per rank and whether it fits,
FLOPs, HBM bytes, every collective with its alpha-beta time, the three roofs, the bound and tokens/s per chip — goes
into ``extra_info``. Invalid combinations are skipped with the model's reason. Parameters are plain values, so
``--benchmark-group-by=param:model,param:phase`` (or ``param:tp,param:dp``) works.

Where a kernel benchmark of this session modelled the same per-rank shape with nkisim (the decode-attention kernel
for the GPT-OSS and Llama-3.1-8B TP8 shards), that modelled kernel latency replaces the attention roofline time
(``extra_info["kernel_sources"]`` says so). The kernel files sort before this one, so their results exist by then.
"""

import pytest

from bench.model.analytical import InvalidConfig
from bench.model.kernel_table import KernelTable
from bench.model.sweep import cases, published_cases, run_case

ARGNAMES = "model,instance,phase,tp,dp,mix,bucket"
_BY_ID = {c.id: c for c in cases() + published_cases()}
_TABLE: dict[str, KernelTable] = {}


def _params(case_list):
    return [pytest.param(*c.params().values(), id=c.id) for c in case_list]


def _kernel_table(config) -> KernelTable:
    if "t" not in _TABLE:
        bs = getattr(config, "_benchmarksession", None)
        _TABLE["t"] = KernelTable.from_benchmarks(bs.benchmarks if bs is not None else [])
    return _TABLE["t"]


def _run(benchmark, request):
    case = _BY_ID[request.node.callspec.id]
    benchmark.group = case.group
    table = _kernel_table(request.config)
    lookup = table if len(table) else None
    try:
        run_case(case, lookup)
    except InvalidConfig as e:
        pytest.skip(f"invalid configuration: {e}")
    row = benchmark.pedantic(run_case, args=(case, lookup), rounds=3, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(row)
    benchmark.extra_info["case_id"] = case.id


@pytest.mark.parametrize(ARGNAMES, _params(cases()))
def test_model(benchmark, request, model, instance, phase, tp, dp, mix, bucket):
    _run(benchmark, request)


@pytest.mark.parametrize(ARGNAMES, _params(published_cases()))
def test_published_comparison(benchmark, request, model, instance, phase, tp, dp, mix, bucket):
    _run(benchmark, request)
