"""Load a pytest-benchmark JSON and split its benchmarks into model, published, kernel and other rows."""

from __future__ import annotations

import json
from pathlib import Path

REPORT_KEY = "bench_report"   # our additions to the pytest-benchmark JSON (skipped cases, hardware table)


def load(path: str | Path) -> dict:
    with open(path) as fh:
        data = json.load(fh)
    if "benchmarks" not in data:
        raise ValueError(f"{path}: not a pytest-benchmark JSON (no 'benchmarks' key)")
    return data


def _median(b: dict) -> float | None:
    stats = b.get("stats") or {}
    return stats.get("median", b.get("median"))


def kernel_row(b: dict) -> dict | None:
    """Normalise a kernel benchmark: nkisim's CostReport.extra_info() keys (``modelled_*``) or device-timed rows."""
    x = b.get("extra_info") or {}
    modelled = "modelled_latency_s" in x
    device = x.get("measured") == "device" or x.get("kind") == "kernel-device"
    if not (modelled or device or x.get("kind") == "kernel"):
        return None
    if modelled:
        latency = x["modelled_latency_s"]
        flops = x.get("modelled_flops", x.get("flops", 0.0)) or 0.0
        nbytes = (x.get("modelled_hbm_read_bytes", 0) or 0) + (x.get("modelled_hbm_write_bytes", 0) or 0)
        target = x.get("modelled_target", x.get("target", "trn2"))
        bound = x.get("modelled_bound", "")
        source = "modelled (nkisim)"
    else:
        latency = x.get("device_latency_s", x.get("latency_s", _median(b)))
        flops = x.get("flops", 0.0) or 0.0
        nbytes = x.get("hbm_bytes", 0.0) or 0.0
        target = x.get("target", "trn2")
        bound = x.get("bound", "")
        source = "measured (device)"
    params = b.get("params") or {}
    stem = b.get("name", "").split("[")[0].removeprefix("test_").removesuffix("_modelled")
    name = x.get("kernel") or params.get("case") or stem
    if not x.get("kernel") and "case" not in params and isinstance(params.get("model"), str):
        name = f"{stem} · {params['model']}"
    bucket = x.get("bucket") or ", ".join(f"{k}={v}" for k, v in params.items()
                                           if k not in ("target", "case", "model")) or b.get("param") or ""
    ai = flops / nbytes if nbytes else None
    return {
        "kernel": str(name), "bucket": str(bucket), "target": str(target), "latency_s": latency, "flops": flops,
        "hbm_bytes": nbytes, "ai": ai, "achieved_flops": flops / latency if latency else 0.0, "bound": bound,
        "mfu": x.get("modelled_mfu", x.get("mfu")), "mbu": x.get("modelled_mbu", x.get("mbu")),
        "limiter": x.get("modelled_limiter", ""), "source": source, "name": b.get("name", ""),
        "busy": {k.removeprefix("modelled_busy_").removesuffix("_s"): v for k, v in x.items()
                 if k.startswith("modelled_busy_")},
    }


TABLE_KIND = "model-table"     # bench.model.sweep.run_table: one benchmark per group, rows stored as columns


def model_rows(b: dict) -> list[dict]:
    """The whole-model rows one benchmark carries: a columnar group table, one per-configuration row (older JSON
    and ``bench.cli sweep``), or none."""
    x = b.get("extra_info") or {}
    if x.get("kind") == TABLE_KIND:
        cols = x.get("columns") or []
        return [dict(zip(cols, vals, strict=True)) for vals in x.get("rows") or []]
    if x.get("kind") in ("model", "published"):
        return [_normalise(x)]
    return []


def _normalise(r: dict) -> dict:
    """Rows saved before the JSON was slimmed carry full component / collective lists: derive the totals the report
    reads (kernel time per component, exposed collective time per layer and elsewhere)."""
    if "kernel_us" in r or "components" not in r:
        return r
    colls = r.get("collectives") or []
    return {**r, "kernel_us": {c["name"]: c["t_kernel"] * 1e6 for c in r["components"]},
            "coll_layer_us": sum(c["time_s"] * r["layers"] for c in colls if c["per_layer"]) * 1e6,
            "coll_other_us": sum(c["time_s"] for c in colls if not c["per_layer"]) * 1e6}


def skipped(data: dict) -> list[dict]:
    """Invalid configurations with their reasons: from the group tables and from the session's skip records."""
    out = list(extras(data).get("skipped", []))
    for b in data.get("benchmarks", []):
        x = b.get("extra_info") or {}
        if x.get("kind") == TABLE_KIND:
            out += [{"id": i, "reason": r} for r, ids in (x.get("skipped") or {}).items() for i in ids]
    return out


def split(data: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"model": [], "published": [], "kernel": [], "vision_buckets": [], "other": []}
    for b in data.get("benchmarks", []):
        x = b.get("extra_info") or {}
        rows = model_rows(b)
        if rows:
            for r in rows:
                out["published" if r.get("kind") == "published" else "model"].append(r)
        elif x.get("kind") == "vision-buckets":
            out["vision_buckets"].append(x)
        else:
            k = kernel_row(b)
            if k is not None:
                out["kernel"].append(k)
            else:
                out["other"].append({"name": b.get("name", ""), "group": b.get("group") or "",
                                     "median_s": _median(b), "extra_info": x})
    return out


def extras(data: dict) -> dict:
    return data.get(REPORT_KEY) or {}
