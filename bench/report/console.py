"""What the terminal shows after ``pytest bench/ --benchmark-only``, and ``reports/latest-summary.json``.

pytest-benchmark's own table reports the CPU time of each benchmarked call. Under nkisim that is the time the
interpreter (or a formula) took on the host, not kernel time, so those rows are withheld from its table
(:func:`is_host_timed`) and shown here instead with the figures a Neuron engineer reads: modelled or device latency,
roofline bound, fraction of roofline, tokens/s/chip, HBM bytes. Every modelled figure is labelled "modelled".
Device-timed rows (trn instances) and the interpreter's own overhead benchmarks keep pytest-benchmark's table,
because there its timings are what they claim to be.
"""

from __future__ import annotations

import re
from collections import defaultdict

from bench.report.analysis import cfg_label, published_comparison, step_us, tokens_per_s_per_chip
from bench.report.data import TABLE_KIND, kernel_row, model_rows, skipped, split

MODEL_ROWS_PER_GROUP = 2        # per model group: the best tokens/s/chip and the lowest step latency that fit
SUMMARY_SCHEMA = 1


def is_host_timed(b: dict) -> bool:
    """True when the benchmark's pytest-benchmark timings are host CPU time standing in for a modelled figure
    (a kernel interpreted by nkisim, or a whole-model formula): its Min/Max/Mean are not kernel time."""
    x = b.get("extra_info") or {}
    if x.get("measured") == "device" or x.get("kind") == "kernel-device":
        return False
    return "modelled_latency_s" in x or x.get("kind") in ("model", "published", TABLE_KIND) or \
        bool(x.get("modelled"))


def withhold_host_timed(groups: list[tuple[str, list[dict]]]) -> tuple[list[tuple[str, list[dict]]], int]:
    """pytest-benchmark's grouped rows without the host-timed ones (empty groups dropped), and how many were dropped."""
    kept, dropped = [], 0
    for name, bs in groups:
        real = [b for b in bs if not is_host_timed(b)]
        dropped += len(bs) - len(real)
        if real:
            kept.append((name, real))
    return kept, dropped


def _group(b: dict) -> str:
    return b.get("group") or b.get("name", "").split("[")[0]


def _param(b: dict) -> str:
    name = b.get("name", "")
    return name.split("[", 1)[1].rstrip("]") if "[" in name else name


def _natural(s: str) -> list:
    """Sort key with numbers compared as numbers (B=8 before B=16, ctx 4096 before 16384)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p]


def _t(s: float | None) -> str:
    if s is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _b(n: float | None) -> str:
    if not n:
        return "—"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(f: float | None) -> str:
    return "—" if f is None else f"{100 * f:.0f}%"


def _device_bound(k: dict) -> float | None:
    """Roofline time of a device-timed kernel from its analytic FLOPs and bytes and the target's datasheet peaks."""
    from nkisim.hardware import HARDWARE

    hw = HARDWARE.get(k["target"])
    if hw is None or not (k["flops"] or k["hbm_bytes"]):
        return None
    return max(k["flops"] / hw.core.tensor_bf16_flops, k["hbm_bytes"] / hw.core.memory_bytes_per_s)


def kernel_records(data: dict) -> list[dict]:
    """One flat record per kernel benchmark (modelled or device-timed), keyed by the benchmark name."""
    out = []
    for b in data.get("benchmarks", []):
        k = kernel_row(b)
        if k is None:
            continue
        x = b.get("extra_info") or {}
        device = k["source"].startswith("measured")
        if device:
            bound_s = _device_bound(k)
        else:
            bound_s = x.get("modelled_bound_s")
            if bound_s is None and x.get("modelled_roofline_fraction") is not None:
                bound_s = k["latency_s"] * x["modelled_roofline_fraction"]
        model = (b.get("params") or {}).get("model")
        case = " ".join(str(p) for p in (model, k["bucket"]) if p) or _param(b)
        out.append({"name": b.get("name", ""), "group": _group(b), "case": case, "target": k["target"],
                    "source": "device" if device else "modelled", "latency_s": k["latency_s"], "bound_s": bound_s,
                    "bound": k["bound"] or "", "roofline_fraction": (bound_s / k["latency_s"]
                                                                     if bound_s and k["latency_s"] else None),
                    "hbm_bytes": k["hbm_bytes"], "flops": k["flops"],
                    "flops_issued": None if device else x.get("modelled_flops_issued"),
                    "speedup_vs_peer": x.get("modelled_speedup_vs_peer")})
    return out


def _flops_pair(k: dict) -> list[str]:
    if not k["flops_issued"]:
        return ["—"]
    return [f"{k['flops'] / 1e9:.2f} / {k['flops_issued'] / 1e9:.2f}"]


def _model_picks(rows: list[dict]) -> list[dict]:
    fit = [r for r in rows if r.get("fits")] or rows
    picks = [max(fit, key=tokens_per_s_per_chip), min(fit, key=step_us)]
    seen, out = set(), []
    for r in picks[:MODEL_ROWS_PER_GROUP]:
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
    return out


def console_tables(data: dict) -> list[dict]:
    """Tables (title, header, rows of strings, note) for the terminal; pure, so it is tested on a fixture JSON."""
    tables: list[dict] = []
    by_group: dict[str, list[dict]] = defaultdict(list)
    for k in kernel_records(data):
        by_group[k["group"]].append(k)
    for group, ks in sorted(by_group.items()):
        device = all(k["source"] == "device" for k in ks)
        lat = "device latency (median)" if device else "modelled latency"
        # Kernels that declare their useful FLOPs (padding, masks, selection matmuls excluded) show both figures.
        declared = any(k["flops_issued"] and k["flops"] != k["flops_issued"] for k in ks)
        # Side-by-side benches record a peer kernel's latency over ours on the same case.
        peer = any(k["speedup_vs_peer"] for k in ks)
        tables.append({
            "title": f"{group} — {'measured on device' if device else 'MODELLED by nkisim (not measured)'}",
            "header": ["case", "target", lat, "roofline bound", "bound", "of roofline", "HBM bytes"]
            + (["GFLOP useful / issued"] if declared else []) + (["peer / ours"] if peer else []),
            "rows": [[k["case"], k["target"], _t(k["latency_s"]), _t(k["bound_s"]), k["bound"] or "—",
                      _pct(k["roofline_fraction"]), _b(k["hbm_bytes"])] + (_flops_pair(k) if declared else [])
                     + ([f"{k['speedup_vs_peer']:.2f}×" if k["speedup_vs_peer"] else "—"] if peer else [])
                     for k in sorted(ks, key=lambda k: (_natural(k["case"]), k["target"]))],
            "note": "" if device else "of roofline = modelled roofline time / modelled latency"
            + ("; MFU and intensity use the useful FLOPs" if declared else ""),
        })
    groups: dict[str, list[dict]] = defaultdict(list)
    for b in data.get("benchmarks", []):
        groups[_group(b)] += [r for r in model_rows(b) if r.get("kind") == "model"]
    groups = {g: rows for g, rows in groups.items() if rows}
    picked = []
    for group, rows in sorted(groups.items()):
        for r in _model_picks(rows):
            frac = r["t_roof_us"] / step_us(r) if step_us(r) else None
            cal = r.get("t_step_cal_us")
            picked.append([group.removeprefix("model:"), cfg_label(r), r["bucket"],
                               _t(cal * 1e-6) if cal is not None else "—", _t(r["t_step_us"] * 1e-6),
                               _t(r["t_roof_us"] * 1e-6), r["bound"], _pct(frac),
                               f"{tokens_per_s_per_chip(r):,.0f}", _b(r["hbm_bytes"]), f"{len(rows)}"])
    if picked:
        tables.append({
            "title": "whole-model sweep — MODELLED (analytical model, per rank)",
            "header": ["group", "config", "bucket", "calibrated step", "uncalibrated", "roofline", "bound",
                       "of roofline", "tok/s/chip", "HBM bytes", "configs"],
            "rows": picked,
            "note": f"per group: the fitting configuration with the most tokens/s/chip, then the lowest step latency, "
                    f"by the calibrated figures where present (decode; prefill and vision are uncalibrated); "
                    f"of roofline = roofline / step; all {sum(len(v) for v in groups.values())} in the HTML report",
        })
    waste = vision_bucket_table(split(data)["vision_buckets"])
    if waste:
        tables.append(waste)
    pub = published_comparison(split(data)["published"])
    if pub:
        tables.append({
            "title": "modelled vs published decode latency (calibrated: bench/model/calibration.py)",
            "header": ["run", "published", "uncalibrated", "calibrated", "residual", "out of sample", "validation"],
            "rows": [[p["label"], _t(p["published_ms"] * 1e-3), _t(p["modelled_ms"] * 1e-3),
                      _t(p["calibrated_ms"] * 1e-3) if p["calibrated_ms"] is not None else "—",
                      f"{p['residual']:+.0%}" if p["residual"] is not None else "—",
                      f"{p['residual_oos']:+.0%}" if p["residual_oos"] is not None else "—", p["validation"]]
                     for p in pub],
            "note": "residual = calibrated / published - 1; out of sample = leave-one-out (fitted rows) or the "
                    "declared subset's fit (held-out rows)",
        })
    return tables


def vision_bucket_table(rows: list[dict]) -> dict | None:
    """bench/test_vision_buckets.py rows: block-level vision DP vs replicas per bucket (modelled)."""
    if not rows:
        return None
    order = sorted(rows, key=lambda r: (r["instance"], r["world"], r["replicas"], r["tp"]))
    return {
        "title": "vision bucket waste (small 256 + large 4096-patch image) — MODELLED (analytical model)",
        "header": ["instance", "world", "mode", "layout", "buckets", "real patches", "small image", "large image",
                   "rank-seconds"],
        "rows": [[r["instance"], str(r["world"]), r["mode"], r["layout"], r["buckets"],
                  f"{r['patches_real']:,}/{r['patches_processed']:,} ({_pct(r['real_fraction'])})",
                  _t(r["modelled_small_image_latency_s"]), _t(r["modelled_large_image_latency_s"]),
                  _t(r["modelled_rank_seconds"])] for r in order],
        "note": "modelled latency of each image's encoder call; rank-seconds = ranks x busy time for the workload; "
                "attention charged for the 128x128 tiles the images cover (bench/model/vision_buckets.py)",
    }


def _numeric(c: str) -> bool:
    return c[:1].isdigit() or c[:1] in "+-" and c[1:2].isdigit() or c == "—"


def _r(v: float | None) -> float | None:
    """6 significant digits: enough for any comparison, and keeps the summary small."""
    return None if v is None else float(f"{v:.6g}")


def format_table(t: dict) -> str:
    cols = [t["header"], *t["rows"]]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(t["header"]))]

    def line(r):   # figures right-aligned, names left-aligned
        return "  ".join(str(c).rjust(w) if i and _numeric(str(c)) else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [t["title"], line(t["header"]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in t["rows"]]
    if t.get("note"):
        out.append(f"({t['note']})")
    return "\n".join(out)


def format_console(data: dict) -> str:
    return "\n\n".join(format_table(t) for t in console_tables(data))


def summary(data: dict, report: str = "", json_path: str = "") -> dict:
    """The small machine-readable summary written beside the report as ``latest-summary.json``."""
    parts = split(data)
    pub = published_comparison(parts["published"])
    models = parts["model"]
    return {
        "schema": SUMMARY_SCHEMA,
        "datetime": data.get("datetime", ""),
        "report": report,
        "benchmark_json": json_path,
        "note": "latency_s of source 'modelled' rows is nkisim's modelled kernel latency (not measured); "
                "source 'device' rows are medians timed on Trainium",
        "kernels": [{"name": r["name"], "target": r["target"], "source": r["source"], "latency_s": _r(r["latency_s"]),
                     "bound_s": _r(r["bound_s"]), "bound": r["bound"], "roofline_fraction": _r(r["roofline_fraction"]),
                     "hbm_bytes": r["hbm_bytes"]} for r in kernel_records(data)],
        "published_comparison": [{"name": p["label"], "key": p["key"], "published_s": _r(p["published_ms"] * 1e-3),
                                  "modelled_s": _r(p["modelled_ms"] * 1e-3),
                                  "calibrated_s": _r(p["calibrated_ms"] * 1e-3) if p["calibrated_ms"] else None,
                                  "residual_out_of_sample": _r(p["residual_oos"])} for p in pub],
        "model_sweep": {"configurations": len(models), "fit": sum(bool(r.get("fits")) for r in models),
                        "skipped": len(skipped(data))},
    }
