"""Benchmark-session plumbing: record skipped configurations and write the HTML report when the session ends.

At the end of ``pytest bench/ --benchmark-only`` this writes, under ``reports/`` (or ``--bench-report-dir``):
``bench-<timestamp>.json`` (pytest-benchmark JSON + our ``bench_report`` block), ``report-<timestamp>.html``,
``latest.html``, ``latest.json`` (a link to that JSON, not a second copy) and ``latest-summary.json`` (small summary,
bench/report/console.py). ``--no-bench-report`` turns it off. The ratchet (bench/ratchet.py) then checks the modelled
kernel latencies against ``bench/ratchet_baseline.json`` and fails the session on a regression (``--ratchet-update``
rewrites the baseline, ``--no-ratchet`` skips the check). ``--benchmark-json PATH`` output also carries the
``bench_report`` block, so ``python -m bench.cli report PATH`` re-renders the same report; with it the JSON is
generated and written once, at PATH, and ``latest.json`` links there.

The terminal shows, per group, the modelled (or device) figures instead of pytest-benchmark's CPU-time table for
benchmarks whose timing is host time of the interpreter or of a formula (see bench/report/console.py).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path

import pytest

import nkisim

nkisim.install()

_SKIPPED: list[dict] = []
_INVALID_PREFIX = "invalid configuration: "


def pytest_addoption(parser):
    group = parser.getgroup("bench report")
    group.addoption("--no-bench-report", action="store_true", default=False,
                    help="do not write the HTML report at the end of the benchmark session")
    group.addoption("--bench-report-dir", default=None, help="directory for reports (default: <rootdir>/reports)")
    group.addoption("--bench-mem-limit-gib", type=float, default=None,
                    help="memory limit per rank for the report's best-configuration table (default: HBM per rank)")
    group.addoption("--ratchet-update", action="store_true", default=False,
                    help="rewrite bench/ratchet_baseline.json from this run's modelled kernel latencies (commit it)")
    group.addoption("--no-ratchet", action="store_true", default=False,
                    help="do not check modelled kernel latencies against the ratchet baseline")
    group.addoption("--ratchet-baseline", default=None, help="baseline file (default: bench/ratchet_baseline.json)")


def pytest_sessionstart(session):
    """``--benchmark-json PATH`` without pytest-benchmark's ``indent=4``: same JSON, no whitespace. Indented, the
    whole-model tables (thousands of rows x ~55 columns, one value per line) grow from ~2 MB to ~7 MB."""
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None or not getattr(bs, "json", None) or not callable(getattr(bs, "save_json", None)):
        return
    from pytest_benchmark.utils import safe_dumps

    def save_json(output_json, _bs=bs):
        with open(_bs.json, mode="wb") as fh:
            fh.write(safe_dumps(output_json, ensure_ascii=True, separators=(",", ":")).encode())
        _bs.logger.info(f"Wrote benchmark data in: {_bs.json}", purple=True)

    bs.save_json = save_json


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(_INVALID_PREFIX):
            case_id = report.nodeid.split("[", 1)[-1].rstrip("]")
            _SKIPPED.append({"id": case_id, "nodeid": report.nodeid, "reason": reason[len(_INVALID_PREFIX):]})


def _bench_report_block() -> dict:
    from bench.model._hw_source import hardware_rows

    return {"skipped": list(_SKIPPED), "hardware": hardware_rows()}


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["bench_report"] = _bench_report_block()
    if getattr(config.option, "benchmark_json", None) is not None:
        config._bench_written_json = output_json     # reuse at session end rather than generate it a second time


@pytest.hookimpl(wrapper=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """Withhold host-timed benchmarks (nkisim-interpreted kernels, model formulas) from pytest-benchmark's Min/Max/Mean
    table: those timings are CPU time, not kernel time. They stay in the JSON (and in --benchmark-compare); the
    terminal summary below shows their modelled figures instead."""
    from bench.report.console import withhold_host_timed

    groups, _ = withhold_host_timed((yield))
    return groups


@pytest.hookimpl(trylast=True)   # after pytest-benchmark's own table, so the figures that matter end the output
def pytest_terminal_summary(terminalreporter, config):
    bs = getattr(config, "_benchmarksession", None)
    data = getattr(config, "_bench_data", None)
    if data is not None:
        _write_console(terminalreporter, data, bs)
    lines = getattr(config, "_ratchet_lines", None)
    if lines:
        terminalreporter.write_sep("=", "ratchet (modelled kernel latencies vs bench/ratchet_baseline.json)",
                                   red=getattr(config, "_ratchet_failed", False))
        for line in lines:
            terminalreporter.write_line(line)
    if bs is not None and not bs.groups and bs.benchmarks:
        # every row was withheld, so pytest-benchmark's display() returned before its --benchmark-compare-fail check
        bs.check_regressions()


def _write_console(terminalreporter, data: dict, bs) -> None:
    from bench.report.console import format_console, is_host_timed

    tr = terminalreporter
    tr.write_sep("=", "benchmark figures (modelled unless marked measured)")
    tr.write_line(format_console(data))
    n = sum(is_host_timed({"extra_info": b.extra_info}) for b in bs.benchmarks) if bs is not None else 0
    if n:
        tr.write_line(f"({n} benchmarks timed only on the host CPU (nkisim interpreter or model formula) are left out "
                      "of pytest-benchmark's Min/Max/Mean table: that is not kernel time; their timings stay in "
                      "the JSON)")
    for line in getattr(tr.config, "_bench_paths", ()):
        tr.write_line(line)


def _session_json(config) -> dict | None:
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not bs.benchmarks:
        return None
    written = getattr(config, "_bench_written_json", None)
    if written is not None:
        return written
    machine_info = {"node": "", "machine": "", "python_version": ""}
    try:
        import platform

        machine_info = {"node": platform.node(), "machine": platform.machine(),
                        "python_version": platform.python_version()}
    except Exception:
        pass
    data = config.hook.pytest_benchmark_generate_json(config=config, benchmarks=bs.benchmarks, include_data=False,
                                                      machine_info=machine_info, commit_info={})
    data["bench_report"] = _bench_report_block()
    return data


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if getattr(config.option, "collectonly", False):
        return
    data = _session_json(config)
    if data is None:
        return
    _ratchet(session, data)
    if config.getoption("--no-bench-report"):
        return
    from bench.report import write_report
    from bench.report.console import summary

    out_dir = Path(config.getoption("--bench-report-dir") or (config.rootpath / "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    if getattr(config, "_bench_written_json", None) is not None:      # already at --benchmark-json PATH
        json_path = Path(config.option.benchmark_json).resolve()
    else:
        json_path = out_dir / f"bench-{stamp}.json"
        json_path.write_text(json.dumps(data, default=repr, separators=(",", ":")))
    html_path = write_report(data, out_dir / f"report-{stamp}.html", config.getoption("--bench-mem-limit-gib"))
    (out_dir / "latest.html").write_text(html_path.read_text(encoding="utf-8"), encoding="utf-8")
    _link(out_dir / "latest.json", json_path)
    summary_path = out_dir / "latest-summary.json"
    summary_path.write_text(json.dumps(summary(data, str(html_path), str(json_path)), separators=(",", ":")) + "\n")
    config._bench_data = data
    config._bench_paths = (f"bench report: {html_path} (+ latest.html) rendered in {time.perf_counter() - t0:.1f}s",
                           f"benchmark JSON: {json_path} (latest.json); summary: {summary_path}")


def _ratchet(session, data: dict) -> None:
    """Modelled kernel latencies against the committed baseline (bench/ratchet.py): a regression > 2% or a target
    ratio lost fails the session; --ratchet-update rewrites the baseline instead."""
    from bench import ratchet

    config = session.config
    if config.getoption("--no-ratchet"):
        return
    path = config.getoption("--ratchet-baseline") or ratchet.BASELINE
    if config.getoption("--ratchet-update"):
        try:
            n = len(ratchet.update(data, path))
            config._ratchet_lines = [f"ratchet: baseline {path} rewritten from this run ({n} rows); commit it"]
        except ValueError as e:
            config._ratchet_lines = [f"ratchet: {e}"]
        return
    res = ratchet.check(data, ratchet.load_baseline(path), baseline_path=str(path))
    if not res.regressions and not res.target_failures and not res.improvements and not res.new \
            and not res.unchanged and not res.newly_met:
        return                                              # no modelled kernel rows in this run
    config._ratchet_lines = res.lines()
    config._ratchet_failed = res.failed
    if res.failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _link(link: Path, target: Path) -> None:
    """latest.json points at the run's JSON instead of being a second copy of it (a copy where links fail)."""
    link.unlink(missing_ok=True)
    try:
        link.symlink_to(target if target.parent != link.parent else target.name)
    except OSError:
        link.write_bytes(target.read_bytes())
