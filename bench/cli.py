"""Command line: re-render a report from saved benchmark JSON, or run the model sweep without pytest.

    python -m bench.cli report reports/latest.json -o out.html [--mem-limit-gib 16]
    python -m bench.cli sweep -o sweep.json [--report out.html]      # analytical sweep with a progress bar
    python -m bench.cli screenshot out.html -o out.png               # headless Chromium, if installed
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


def find_chromium() -> str | None:
    for cand in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(cand).exists():
            return cand
    return shutil.which("chromium")


def screenshot(html_path: str | Path, png_path: str | Path, width: int = 1500, height: int = 2400,
               chromium: str | None = None, timeout: float = 120.0) -> Path:
    """Headless Chromium screenshot of a local HTML file (no network)."""
    exe = chromium or find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    png_path = Path(png_path).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={png_path}", Path(html_path).resolve().as_uri()]
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
    if not png_path.exists():
        raise RuntimeError(f"chromium did not write {png_path}")
    return png_path


def _cmd_report(args) -> int:
    from bench.report import write_report
    from bench.report.data import load

    data = load(args.json)
    out = write_report(data, args.output, args.mem_limit_gib, args.title or "")
    print(f"wrote {out}")
    return 0


def _cmd_sweep(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench.model._hw_source import hardware_rows
    from bench.model.sweep import case_groups, cases, published_cases, run_table

    groups = case_groups(cases() + published_cases())
    lookup = None
    if args.kernels:
        from bench.model.kernel_table import KernelTable
        from bench.report.data import load

        lookup = KernelTable.from_benchmarks(load(args.kernels)["benchmarks"])
        if not len(lookup):  # asked for kernel latencies but none usable: say so rather than sweep without them
            raise ValueError(f"--kernels {args.kernels}: no LNC=1 decode-attention rows with modelled_latency_s in "
                             "extra_info (write one with pytest bench/test_decode_attention.py --benchmark-json=PATH)")
    benchmarks, n_rows, n_skipped = [], 0, 0
    with Progress(TextColumn("[bold]model sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:
        task = bar.add_task("sweep", total=sum(len(v) for v in groups.values()))
        for group, members in groups.items():   # the same one-table-per-group records as bench/test_model_sweep.py
            table = run_table(members, lookup)
            n_rows += table["configurations"]
            n_skipped += table["invalid"]
            benchmarks.append({"group": group, "name": group, "fullname": group, "params": {}, "param": group,
                               "extra_info": table, "stats": {}})
            bar.advance(task, len(members))
    data = {"machine_info": {"node": platform.node(), "machine": platform.machine(),
                             "python_version": platform.python_version()},
            "commit_info": {}, "benchmarks": benchmarks, "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "version": "bench.cli sweep", "bench_report": {"skipped": [], "hardware": hardware_rows()}}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(data))
    print(f"{n_rows} configurations, {n_skipped} skipped with reasons -> {args.output}")
    if lookup is not None:
        print(f"decode attention at its nkisim-modelled latency in {lookup.hits} of {lookup.lookups} lookups "
              "(the rest at roofline time: shard or bucket not benchmarked)")
    if args.report:
        from bench.report import write_report

        print(f"wrote {write_report(data, args.report, args.mem_limit_gib)}")
    return 0


def _cmd_screenshot(args) -> int:
    print(f"wrote {screenshot(args.html, args.output, args.width, args.height)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="render an HTML report from a pytest-benchmark JSON (--benchmark-json)")
    r.add_argument("json")
    r.add_argument("-o", "--output", default="reports/report.html")
    r.add_argument("--mem-limit-gib", type=float, default=None)
    r.add_argument("--title", default="")
    r.set_defaults(fn=_cmd_report)
    s = sub.add_parser("sweep", help="run the analytical model sweep (no pytest) with a progress bar")
    s.add_argument("-o", "--output", default="reports/sweep.json")
    s.add_argument("--report", default=None, help="also write an HTML report here")
    s.add_argument("--kernels", default=None,
                   help="benchmark JSON with decode-attention kernel results: use their nkisim latencies")
    s.add_argument("--mem-limit-gib", type=float, default=None)
    s.set_defaults(fn=_cmd_sweep)
    sc = sub.add_parser("screenshot", help="headless Chromium screenshot of a report")
    sc.add_argument("html")
    sc.add_argument("-o", "--output", default="reports/report.png")
    sc.add_argument("--width", type=int, default=1500)
    sc.add_argument("--height", type=int, default=2400)
    sc.set_defaults(fn=_cmd_screenshot)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
