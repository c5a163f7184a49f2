"""bench/report/data.py: the whole-model group tables (bench.model.sweep.run_table) expand back to rows."""

import json

from bench.model.analytical import Bucket, ParallelConfig
from bench.model.sweep import Case, case_groups, run_case, run_table
from bench.report.console import is_host_timed
from bench.report.data import model_rows, skipped, split


def _cases():
    inst = "trn2.48xlarge"
    return [Case("Llama-3.1-8B", inst, ParallelConfig(8), Bucket("decode", batch=1, ctx=2048)),
            Case("Llama-3.1-8B", inst, ParallelConfig(8, 2, 2, 1, 1, 2), Bucket("decode", batch=8, ctx=2048),
                 "a2-e1-m1-l2"),
            Case("Llama-3.1-8B", inst, ParallelConfig(5), Bucket("decode", batch=1, ctx=2048))]   # invalid: tp=5


def test_group_table_round_trips_rows_and_reasons():
    cases = _cases()
    (group, members), = case_groups(cases).items()
    table = run_table(members)
    assert table["configurations"] == 2 and table["invalid"] == 1
    ((reason, ids),) = table["skipped"].items()
    assert ids == [cases[2].id] and "does not divide" in reason
    b = {"group": group, "name": "test_model[x]", "extra_info": json.loads(json.dumps(table))}
    rows = model_rows(b)
    assert [r["case_id"] for r in rows] == [cases[0].id, cases[1].id]
    assert rows[0] == json.loads(json.dumps({**run_case(cases[0]), "case_id": cases[0].id}))
    data = {"benchmarks": [b], "bench_report": {"skipped": [{"id": "other", "reason": "r"}]}}
    assert len(split(data)["model"]) == 2 and not split(data)["kernel"]
    assert [s["id"] for s in skipped(data)] == ["other", cases[2].id]
    assert is_host_timed(b)      # the formula's CPU time is never shown as a latency


def test_rows_saved_with_full_lists_still_render():
    """A row from before the JSON was slimmed (full component / collective lists) gives the same totals."""
    from bench.model.analytical import evaluate
    from bench.model.hardware import get_instance
    from modules.model_specs import LLAMA_31_8B

    res = evaluate(LLAMA_31_8B, get_instance("trn2.48xlarge"), ParallelConfig(8, 2, 2, 2, 2, 2),
                   Bucket("decode", batch=8, ctx=2048))
    new = res.as_dict()
    old = {k: v for k, v in new.items() if k not in ("kernel_us", "coll_layer_us", "coll_other_us")}
    old.update(components=[c.as_dict() for c in res.components],
               collectives=[c.as_dict() for c in res.collectives if c.n > 1])
    (row,) = model_rows({"extra_info": old})
    assert row["kernel_us"] == new["kernel_us"]
    assert row["coll_layer_us"] == new["coll_layer_us"] and row["coll_other_us"] == new["coll_other_us"]
