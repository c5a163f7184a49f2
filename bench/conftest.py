"""Benchmark-session plumbing: record skipped configurations and write the HTML report when the session ends.

At the end of ``pytest bench/ --benchmark-only`` this writes, under ``reports/`` (or ``--bench-report-dir``):
``bench-<timestamp>.json`` (pytest-benchmark JSON + our ``bench_report`` block), ``report-<timestamp>.html`` and
``latest.html`` / ``latest.json``. ``--no-bench-report`` turns it off. ``--benchmark-json PATH`` output also carries
the ``bench_report`` block, so ``python -m bench.cli report PATH`` re-renders the same report.
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


def _session_json(config) -> dict | None:
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not bs.benchmarks:
        return None
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
    if config.getoption("--no-bench-report") or getattr(config.option, "collectonly", False):
        return
    data = _session_json(config)
    if data is None:
        return
    from bench.report import write_report

    out_dir = Path(config.getoption("--bench-report-dir") or (config.rootpath / "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    json_path = out_dir / f"bench-{stamp}.json"
    json_path.write_text(json.dumps(data, default=repr))
    html_path = write_report(data, out_dir / f"report-{stamp}.html", config.getoption("--bench-mem-limit-gib"))
    (out_dir / "latest.html").write_text(html_path.read_text(encoding="utf-8"), encoding="utf-8")
    (out_dir / "latest.json").write_text(json_path.read_text())
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"bench report: {html_path} (+ latest.html, {json_path.name}) "
                      f"rendered in {time.perf_counter() - t0:.1f}s")
