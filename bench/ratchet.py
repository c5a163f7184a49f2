"""Performance ratchet: modelled kernel latencies may not regress silently.

A committed baseline (``bench/ratchet_baseline.json``, small) holds, per kernel benchmark row (pytest-benchmark
``fullname``), nkisim's modelled latency and, where the row declares one, its target ratio (latency / roofline bound,
``modelled_target_ratio`` in ``extra_info``) and whether the baseline met it. After ``pytest bench/ --benchmark-only``
(bench/conftest.py) and with ``python -m bench.ratchet check JSON``:

* a row whose modelled latency exceeds its baseline by more than ``TOLERANCE`` (2%) FAILS the run;
* a row that met its target in the baseline and no longer does FAILS the run (targets are asserted where they are
  already met, e.g. issue 11's <= 1.3x for decode attention on trn3 at B >= 8). The verdict is the bench's own
  ``modelled_meets_target`` when it records one (any kind of target: a latency/bound ratio, an MFU floor, a speed-up
  over a peer), else ``modelled_latency_over_bound <= modelled_target_ratio``;
* rows absent from the baseline are reported as new, rows faster by more than 2% as improved, baseline rows the run
  did not produce as not run: none of these fails.

Only rows whose latency is *modelled* (``modelled_latency_s``) take part: device timings are noisy measurements and
interpreter / formula CPU time is not kernel time. Any bench file whose rows carry ``modelled_latency_s`` (and
optionally ``modelled_target_ratio`` and ``modelled_latency_over_bound``) is covered without registering anywhere.

Updating the baseline is a deliberate act committed with the change that moves the figures:

    pytest bench/ --benchmark-only --ratchet-update            # run and rewrite the baseline's rows from this run
    python -m bench.ratchet update reports/latest.json          # or from a saved run (--prune drops rows not run)
    python -m bench.ratchet update --only-new reports/latest.json   # a new bench file's rows join; others untouched
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

BASELINE = Path(__file__).with_name("ratchet_baseline.json")
TOLERANCE = 0.02
SCHEMA = 1


def _sig(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.6g}")


def rows(data: dict) -> dict[str, dict]:
    """{key: {latency_s, target_ratio, over_bound}} for every benchmark with a modelled kernel latency."""
    out = {}
    for b in data.get("benchmarks", []):
        x = b.get("extra_info") or {}
        lat = x.get("modelled_latency_s")
        if not isinstance(lat, (int, float)) or lat <= 0:
            continue
        key = b.get("fullname") or b.get("name")
        if not key:
            continue
        over = x.get("modelled_latency_over_bound")
        if over is None and x.get("modelled_bound_s"):
            over = lat / x["modelled_bound_s"]
        r = {"latency_s": _sig(float(lat)), "target_ratio": x.get("modelled_target_ratio"), "over_bound": _sig(over)}
        meets = x.get("modelled_meets_target")      # a bench's own verdict (any kind of target, e.g. an MFU floor)
        r["meets_target"] = meets if isinstance(meets, bool) else _meets(r)
        out[key] = r
    return out


def _meets(r: dict) -> bool | None:
    t, o = r.get("target_ratio"), r.get("over_bound")
    return None if t is None or o is None else o <= t


@dataclass
class Result:
    regressions: list[tuple[str, float, float]] = field(default_factory=list)     # key, baseline, now
    target_failures: list[tuple[str, float, float]] = field(default_factory=list)  # key, target, now ratio
    improvements: list[tuple[str, float, float]] = field(default_factory=list)
    newly_met: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    unchanged: int = 0
    baseline_path: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.target_failures)

    def lines(self, limit: int = 12) -> list[str]:
        out = [f"ratchet vs {self.baseline_path or 'baseline'}: {len(self.regressions)} regressed > "
               f"{TOLERANCE:.0%}, {len(self.target_failures)} target(s) lost, {len(self.improvements)} improved, "
               f"{len(self.new)} new, {len(self.not_run)} not run, {self.unchanged} unchanged (modelled latencies)"]

        def block(title, items, fmt):
            if items:
                out.append(f"  {title}:")
                out.extend(f"    {fmt(i)}" for i in items[:limit])
                if len(items) > limit:
                    out.append(f"    ... and {len(items) - limit} more")

        block("REGRESSED (fails)", self.regressions, lambda r: f"{r[0]}: {r[1] * 1e6:.4g} -> {r[2] * 1e6:.4g} us "
                                                          f"({r[2] / r[1] - 1:+.1%})")
        block("TARGET LOST (fails)", self.target_failures,
              lambda r: f"{r[0]}: latency/bound {r[2]:.3f} > target {r[1]:.3g}" if r[1] is not None and r[2] is not None
              else f"{r[0]}: the bench's modelled_meets_target is now False")
        block("improved (update the baseline to lock it in)", self.improvements,
              lambda r: f"{r[0]}: {r[1] * 1e6:.4g} -> {r[2] * 1e6:.4g} us ({r[2] / r[1] - 1:+.1%})")
        block("target newly met (update the baseline to assert it)", self.newly_met, str)
        block("new (not in the baseline)", self.new, str)
        if self.failed:
            out.append("  intended? rewrite the baseline in the same commit: pytest bench/ --benchmark-only "
                       "--ratchet-update (or python -m bench.ratchet update JSON)")
        return out


def load_baseline(path: str | Path = BASELINE) -> dict[str, dict]:
    p = Path(path)
    if not p.exists():
        return {}
    doc = json.loads(p.read_text())
    if doc.get("schema") != SCHEMA or not isinstance(doc.get("rows"), dict):
        raise ValueError(f"{p}: not a ratchet baseline (schema {SCHEMA} with a 'rows' object)")
    return doc["rows"]


def check(data: dict, baseline: dict[str, dict], tolerance: float = TOLERANCE, baseline_path: str = "") -> Result:
    res = Result(baseline_path=str(baseline_path))
    now = rows(data)
    for key, r in sorted(now.items()):
        base = baseline.get(key)
        if base is None:
            res.new.append(key)
            continue
        b, n = base["latency_s"], r["latency_s"]
        if n > b * (1 + tolerance):
            res.regressions.append((key, b, n))
        elif n < b * (1 - tolerance):
            res.improvements.append((key, b, n))
        else:
            res.unchanged += 1
        met_before, met_now = base.get("meets_target"), r["meets_target"]
        if met_before and met_now is False:
            res.target_failures.append((key, r["target_ratio"], r["over_bound"]))
        elif met_now and not met_before:
            res.newly_met.append(key)
    res.not_run = sorted(set(baseline) - set(now))
    return res


def update(data: dict, path: str | Path = BASELINE, prune: bool = False, only_new: bool = False) -> dict[str, dict]:
    """Rewrite the baseline's rows from this run (rows the run did not produce are kept unless ``prune``). With
    ``only_new`` the rows already in the baseline keep their figures: a new bench file's rows join the ratchet
    without accepting anyone else's change."""
    now = rows(data)
    if not now:
        raise ValueError("ratchet update: the run has no modelled kernel rows (modelled_latency_s); nothing written")
    if prune and only_new:
        raise ValueError("ratchet update: --prune and --only-new contradict each other")
    base = {} if prune else dict(load_baseline(path))
    for key, r in now.items():
        if only_new and key in base:
            continue
        entry = {"latency_s": r["latency_s"]}
        if r["target_ratio"] is not None:
            entry.update(target_ratio=r["target_ratio"], over_bound=r["over_bound"])
        if r["meets_target"] is not None:
            entry["meets_target"] = r["meets_target"]
        base[key] = entry
    doc = {"schema": SCHEMA, "tolerance": TOLERANCE,
           "note": "modelled (nkisim) kernel latencies; regenerate with the command in bench/ratchet.py, in the "
                   "commit that changes them", "rows": dict(sorted(base.items()))}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ratchet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("check", "update"):
        s = sub.add_parser(name)
        s.add_argument("json", help="pytest-benchmark JSON of a bench run (e.g. reports/latest.json)")
        s.add_argument("--baseline", default=str(BASELINE))
        if name == "update":
            s.add_argument("--prune", action="store_true", help="drop baseline rows this run did not produce")
            s.add_argument("--only-new", action="store_true",
                           help="add the rows absent from the baseline; leave the others' figures as they are")
    args = p.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    if args.cmd == "update":
        n = len(update(data, args.baseline, args.prune, args.only_new))
        print(f"wrote {args.baseline} ({n} rows)")
        return 0
    res = check(data, load_baseline(args.baseline), baseline_path=args.baseline)
    print("\n".join(res.lines()))
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
