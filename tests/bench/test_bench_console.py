"""The terminal tables and latest-summary.json built from a fixture benchmark JSON (no bench run)."""

import copy
import json
from pathlib import Path

import pytest

from bench.report.console import (
    console_tables,
    format_console,
    is_host_timed,
    kernel_records,
    summary,
    withhold_host_timed,
)
from bench.report.data import load

FIXTURE = Path(__file__).parent / "fixtures" / "bench_fixture.json"


@pytest.fixture(scope="module")
def data():
    return load(FIXTURE)


def _device_bench():
    """A device-timed row as bench/test_decode_attention_device.py records it on a trn instance."""
    return {"group": None, "name": "test_decode_attention_device[8192-8-llama-3.1-8b-tp8]",
            "params": {"model": "llama-3.1-8b-tp8", "B": 8, "ctx": 8192}, "stats": {"median": 2e-4},
            "extra_info": {"measured": "device", "kernel": "decode_attention · llama-3.1-8b-tp8",
                           "bucket": "B=8, ctx=8192", "device_latency_s": 2e-4, "flops": 3.3e8,
                           "hbm_bytes": 5.4e7, "target": "trn2"}}


def _tables(data):
    return {t["title"]: t for t in console_tables(data)}


def test_kernel_table_shows_modelled_figures_not_cpu_time(data):
    t = _tables(data)["test_decode_attention_modelled — MODELLED by nkisim (not measured)"]
    assert t["header"][2] == "modelled latency" and "roofline bound" in t["header"]
    assert [r[0] for r in t["rows"]] == ["llama-3.1-8b-tp8 B=1, ctx=1024"] * 2 + ["llama-3.1-8b-tp8 B=8, ctx=4096"] * 2
    # fixture: modelled 54.453 us, roofline fraction 0.7 -> bound 38.1 us, 12.5 MiB read+written
    assert t["rows"][0][1:] == ["trn2", "54.5 µs", "38.1 µs", "memory", "70%", "12.5 MiB"]
    text = format_console(data)
    assert "500 ms" not in text      # the fixture's pytest-benchmark CPU median (0.5 s) is never shown


def test_declared_useful_flops_shown_beside_issued(data):
    d = copy.deepcopy(data)
    group = "test_decode_attention_modelled"
    rows = [b for b in d["benchmarks"] if (b.get("group") or b["name"].split("[")[0]) == group]
    assert "GFLOP useful / issued" not in _tables(d)[f"{group} — MODELLED by nkisim (not measured)"]["header"]
    rows[0]["extra_info"].update(modelled_flops=1.0e9, modelled_flops_issued=4.0e9)
    t = _tables(d)[f"{group} — MODELLED by nkisim (not measured)"]
    assert t["header"][-1] == "GFLOP useful / issued" and "useful FLOPs" in t["note"]
    assert "1.00 / 4.00" in [r[-1] for r in t["rows"]]


def test_model_and_published_tables(data):
    tables = _tables(data)
    model = tables["whole-model sweep — MODELLED (analytical model, per rank)"]
    assert "tok/s/chip" in model["header"]
    rows = {(r[0], r[2]): r for r in model["rows"]}
    r = rows[("GPT-OSS-120B:decode:trn2.48xlarge", "decode b1 ctx8192")]
    # calibrated step first, the uncalibrated one beside it; tok/s/chip from the calibrated step
    assert r[3:8] == ["7.16 ms", "1.82 ms", "993 µs", "memory", "14%"] and r[8] == "35"
    prefill = rows[("Llama-3.1-8B:prefill:trn2.48xlarge", "prefill 2048")]
    assert prefill[3] == "—" and prefill[4] == "42.8 ms"          # prefill is not calibrated: no figure invented
    pub = tables["modelled vs published decode latency (calibrated: bench/model/calibration.py)"]["rows"]
    assert ["GPT-OSS-120B trn2 LNC2 TP16 b1 ctx576", "7 ms", "1.77 ms", "7.03 ms", "+0%", "+2%", "leave-one-out"] in pub
    assert ["Llama-3.3-70B trn2 LNC2 TP64 b1 ctx10750", "19.6 ms", "5.9 ms", "20.1 ms", "+2%", "+2%", "held out"] in pub


def test_device_rows_are_measured_with_a_roofline(data):
    d = copy.deepcopy(data)
    d["benchmarks"].append(_device_bench())
    t = _tables(d)["test_decode_attention_device — measured on device"]
    assert t["header"][2] == "device latency (median)"
    (row,) = t["rows"]
    assert row[2] == "200 µs" and row[3] != "—" and row[5].endswith("%")
    assert not is_host_timed(_device_bench())


def test_only_host_timed_rows_are_withheld_from_pytest_benchmark_table(data):
    benches = data["benchmarks"] + [_device_bench()]
    groups = [("g", benches)]
    kept, dropped = withhold_host_timed(groups)
    names = [b["name"] for _, bs in kept for b in bs]
    assert dropped == 11 + 3 + 4          # model rows, published rows, nkisim-modelled kernels
    assert names == ["test_dispatch_per_instruction[tensor_copy]", _device_bench()["name"]]
    assert withhold_host_timed([("only-modelled", data["benchmarks"][:2])]) == ([], 2)


def test_summary_is_small_and_complete(data):
    s = summary(data, "reports/report-x.html", "reports/bench-x.json")
    assert s["report"] == "reports/report-x.html"
    names = {k["name"] for k in s["kernels"]}
    assert names == {k["name"] for k in kernel_records(data)} and len(names) == 4
    for k in s["kernels"]:
        assert k["source"] == "modelled" and k["latency_s"] > k["bound_s"] > 0 and k["bound"] == "memory"
    pub = {p["key"]: p for p in s["published_comparison"]}
    assert set(pub) == {"llama70b-tp64", "llama8b-tp8", "gptoss120b-tp16"}
    assert pub["gptoss120b-tp16"]["published_s"] == 0.007
    assert pub["gptoss120b-tp16"]["modelled_s"] == pytest.approx(1.7734e-3, rel=1e-4)
    assert pub["gptoss120b-tp16"]["calibrated_s"] == pytest.approx(7.034e-3, rel=1e-3)
    assert set(pub["llama8b-tp8"]) == {"name", "key", "published_s", "modelled_s", "calibrated_s",
                                       "residual_out_of_sample"}
    assert s["model_sweep"]["configurations"] == 11
    text = json.dumps(s)
    assert len(text) < 4000 and json.loads(text) == s
