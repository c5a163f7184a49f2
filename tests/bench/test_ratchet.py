"""bench/ratchet.py: a modelled-latency regression fails, an improvement or an update passes, new rows are reported."""

import json

import pytest

from bench import ratchet


def _bench(key, latency, bound=None, target=None, **extra):
    x = {"modelled_latency_s": latency, **extra}
    if bound is not None:
        x.update(modelled_bound_s=bound, modelled_latency_over_bound=latency / bound)
    if target is not None:
        x["modelled_target_ratio"] = target
    return {"fullname": key, "name": key.split("::")[-1], "extra_info": x}


def _run(*benches):
    return {"benchmarks": [*benches, {"fullname": "bench/test_model_sweep.py::test_model[x]", "extra_info":
                                      {"kind": "model-table", "rows": []}},            # not a kernel row
                           {"fullname": "d::device", "extra_info": {"measured": "device", "device_latency_s": 1.0}}]}


BASE = _run(_bench("k::a", 100e-6, bound=90e-6, target=1.3), _bench("k::b", 50e-6), _bench("k::c", 10e-6))


@pytest.fixture
def baseline(tmp_path):
    path = tmp_path / "baseline.json"
    ratchet.update(BASE, path)
    return path


def test_only_modelled_kernel_rows_are_ratcheted(baseline):
    rows = ratchet.load_baseline(baseline)
    assert set(rows) == {"k::a", "k::b", "k::c"}
    assert rows["k::a"] == {"latency_s": 1e-4, "target_ratio": 1.3, "over_bound": pytest.approx(1.11111),
                            "meets_target": True}
    assert ratchet.check(BASE, rows).failed is False


def test_regression_over_two_percent_fails(baseline):
    run = _run(_bench("k::a", 100e-6, bound=90e-6, target=1.3), _bench("k::b", 51.5e-6), _bench("k::c", 10.1e-6))
    res = ratchet.check(run, ratchet.load_baseline(baseline))
    assert res.failed and [r[0] for r in res.regressions] == ["k::b"]        # +3% fails, +1% (k::c) does not
    assert res.unchanged == 2
    assert any("REGRESSED" in line for line in res.lines())


def test_improvement_and_new_rows_pass(baseline):
    run = _run(_bench("k::a", 80e-6, bound=79e-6, target=1.3), _bench("k::b", 50e-6),
               _bench("k::new", 5e-6))                       # k::c not run
    res = ratchet.check(run, ratchet.load_baseline(baseline))
    assert not res.failed
    assert [r[0] for r in res.improvements] == ["k::a"] and res.new == ["k::new"] and res.not_run == ["k::c"]


def test_target_met_in_baseline_is_asserted(baseline):
    # latency within 2% but the bound dropped: latency / bound 1.44 > 1.3, which the baseline met
    run = _run(_bench("k::a", 101e-6, bound=70e-6, target=1.3), _bench("k::b", 50e-6), _bench("k::c", 10e-6))
    res = ratchet.check(run, ratchet.load_baseline(baseline))
    assert res.failed and not res.regressions and [r[0] for r in res.target_failures] == ["k::a"]


def test_a_benchs_own_target_verdict_is_ratcheted(tmp_path):
    """Targets that are not a latency/bound ratio (e.g. an MFU floor) ratchet through modelled_meets_target."""
    path = tmp_path / "b.json"
    ratchet.update(_run(_bench("k::mfu", 1e-3, modelled_meets_target=True), _bench("k::no", 1e-3,
                                                                                   modelled_meets_target=False)), path)
    rows = ratchet.load_baseline(path)
    assert rows["k::mfu"]["meets_target"] is True and rows["k::no"]["meets_target"] is False
    lost = ratchet.check(_run(_bench("k::mfu", 1e-3, modelled_meets_target=False),
                              _bench("k::no", 1e-3, modelled_meets_target=False)), rows)
    assert lost.failed and [r[0] for r in lost.target_failures] == ["k::mfu"]
    assert any("modelled_meets_target is now False" in line for line in lost.lines())


def test_update_in_the_same_commit_passes(baseline):
    slower = _run(_bench("k::a", 100e-6, bound=90e-6, target=1.3), _bench("k::b", 60e-6), _bench("k::c", 10e-6))
    assert ratchet.check(slower, ratchet.load_baseline(baseline)).failed
    ratchet.update(slower, baseline)
    assert not ratchet.check(slower, ratchet.load_baseline(baseline)).failed
    assert ratchet.load_baseline(baseline)["k::b"]["latency_s"] == 60e-6


def test_partial_update_keeps_other_rows_unless_pruned(baseline):
    part = _run(_bench("k::b", 40e-6))
    assert set(ratchet.update(part, baseline)) == {"k::a", "k::b", "k::c"}
    assert set(ratchet.update(part, baseline, prune=True)) == {"k::b"}
    with pytest.raises(ValueError, match="no modelled kernel rows"):
        ratchet.update({"benchmarks": []}, baseline)


def test_only_new_adds_rows_without_accepting_changes(baseline):
    run = _run(_bench("k::a", 100e-6, bound=90e-6, target=1.3), _bench("k::b", 99e-6), _bench("k::new", 5e-6))
    rows = ratchet.update(run, baseline, only_new=True)
    assert rows["k::b"]["latency_s"] == 50e-6 and rows["k::new"]["latency_s"] == 5e-6
    assert ratchet.check(run, ratchet.load_baseline(baseline)).failed          # k::b's regression still fails
    with pytest.raises(ValueError, match="contradict"):
        ratchet.update(run, baseline, prune=True, only_new=True)


def test_cli_check_exit_status(baseline, tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run(_bench("k::a", 100e-6, bound=90e-6, target=1.3), _bench("k::b", 70e-6))))
    assert ratchet.main(["check", str(run), "--baseline", str(baseline)]) == 1
    assert "k::b" in capsys.readouterr().out
    assert ratchet.main(["update", str(run), "--baseline", str(baseline)]) == 0
    assert ratchet.main(["check", str(run), "--baseline", str(baseline)]) == 0


def test_committed_baseline_is_small_and_well_formed():
    rows = ratchet.load_baseline()
    assert rows and ratchet.BASELINE.stat().st_size < 64_000
    assert all(k.startswith("bench/") and "::" in k and r["latency_s"] > 0 for k, r in rows.items())


def test_bench_session_fails_on_a_regression(tmp_path):
    """End to end through bench/conftest.py with one real modelled kernel row: a baseline far below its latency fails
    the pytest session (exit 1); a baseline without the row reports it as new and passes. (Independent of the
    committed figures, so a cost-model change does not break this test; the bench run itself enforces those.)"""
    import os
    import subprocess
    import sys

    root = ratchet.BASELINE.parents[1]
    key = "bench/test_cost_model.py::test_profile_cost_model[stream_copy_512x1024_fp32-trn2]"
    low, absent = tmp_path / "low.json", tmp_path / "absent.json"
    low.write_text(json.dumps({"schema": ratchet.SCHEMA, "rows": {key: {"latency_s": 1e-9}}}))
    absent.write_text(json.dumps({"schema": ratchet.SCHEMA, "rows": {"bench/x.py::other": {"latency_s": 1.0}}}))

    def run(baseline):
        return subprocess.run([sys.executable, "-m", "pytest", key, "--benchmark-only", "-q", "-p", "no:cacheprovider",
                               "--no-bench-report", "--benchmark-min-rounds=1", "--benchmark-max-time=0.000001",
                               "--ratchet-baseline", str(baseline)], cwd=root, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(root)})

    bad = run(low)
    assert bad.returncode == 1, bad.stdout[-2000:]
    assert "REGRESSED (fails)" in bad.stdout and key in bad.stdout
    new = run(absent)
    assert new.returncode == 0, new.stdout[-2000:]
    assert "1 new" in new.stdout and "1 not run" in new.stdout
