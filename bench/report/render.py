"""Render one self-contained HTML report (inline SVG, inline CSS, no scripts from the network) from benchmark JSON."""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections import Counter, defaultdict
from pathlib import Path

import jinja2

from bench.model import calibration
from bench.model.collectives import collective_time
from bench.model.hardware import instances
from bench.report import analysis, charts
from bench.report.console import vision_bucket_table
from bench.report.data import extras, split
from bench.report.data import skipped as skipped_rows

SECTIONS = (
    ("summary", "Summary"),
    ("best", "Best configuration under a memory limit"),
    ("published", "Modelled vs published"),
    ("calibration", "Cost-model calibration"),
    ("kernel-roofline", "Kernel roofline"),
    ("model-roofline", "Model roofline"),
    ("latency", "Latency breakdown"),
    ("memory", "Memory heat maps"),
    ("collectives", "Collectives per layer"),
    ("pareto", "Pareto frontier"),
    ("kernels", "Kernel results"),
    ("vision-buckets", "Vision bucket waste"),
    ("skipped", "Skipped configurations"),
    ("other", "Other benchmarks"),
    ("constants", "Hardware constants"),
)

BREAKDOWN_BUCKET = (1, 8192)      # decode (batch, ctx) used for the breakdown bars
HEATMAP_BUCKET = (64, 8192)       # decode (batch, ctx) used for the memory heat maps
COLLECTIVE_CASES = (("Llama-3.1-8B", 8, 4, 8), ("GPT-OSS-20B", 8, 4, 8), ("Llama-3.3-70B", 16, 4, 8),
                    ("GPT-OSS-120B", 16, 4, 1))


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.{digits}g}"
        return f"{v:,.{digits}g}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def _bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _kernel_roofs() -> dict[str, tuple[float, float]]:
    from nkisim.hardware import HARDWARE

    return {t: (HARDWARE[t].core.tensor_bf16_flops, HARDWARE[t].core.memory_bytes_per_s) for t in ("trn2", "trn3")}


def _model_roofs() -> dict[str, tuple[float, float]]:
    return {i.name: (i.rank_flops, i.rank_hbm_bw) for i in instances().values()}


def _band_curves() -> tuple[dict, float, float]:
    inst = instances()["trn2.48xlarge"]
    p = inst.collectives
    sizes = [2**k for k in range(3, 32)]
    curves = {}
    for op, n in (("all_reduce", 8), ("all_reduce", 16), ("all_reduce", 64), ("all_gather", 16)):
        curves[f"{op} n={n}"] = [(s, *collective_time(op, n, s, p, spans_chips=inst.spans_chips(n))) for s in sizes]
    return curves, p.mesh_max_bytes, p.rdh_max_bytes


CALIBRATION_RESULTS = Path(__file__).resolve().parents[1] / "calibration" / "results.json"


def load_calibration(path: Path = CALIBRATION_RESULTS) -> dict | None:
    """The last `python -m bench.calibration.run --json bench/calibration/results.json` output, or None."""
    import json

    if not Path(path).exists():
        return None
    with open(path) as f:
        return json.load(f)


def build_context(data: dict, mem_limit_gib: float | None = None, title: str = "") -> dict:
    # A zero, negative or NaN limit would silently empty the best-configuration table: reject it up front.
    if mem_limit_gib is not None and not (isinstance(mem_limit_gib, (int, float)) and mem_limit_gib > 0):
        raise ValueError(f"mem_limit_gib={mem_limit_gib!r} must be a positive number of GiB per rank (or None for "
                         "the HBM capacity of one rank)")
    parts = split(data)
    ext = extras(data)
    rows = parts["model"]
    decode = [r for r in rows if r["phase"] == "decode"]
    ctx: dict = {"title": title or "NKI performance report", "sections": SECTIONS, "fmt": _fmt, "bytes": _bytes,
                 "cfg_label": analysis.cfg_label}
    ctx["generated"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ctx["run_datetime"] = str(data.get("datetime", ""))[:19].replace("T", " ")
    mi = data.get("machine_info") or {}
    ctx["machine"] = f"{mi.get('node', '?')} · {mi.get('machine', '')} · Python {mi.get('python_version', '')}"
    ctx["pytest_benchmark_version"] = data.get("version", "")
    skipped = skipped_rows(data)
    ctx["counts"] = {
        "model": len(rows), "decode": len(decode), "prefill": sum(r["phase"] == "prefill" for r in rows),
        "vision": sum(r["phase"] == "vision" for r in rows), "published": len(parts["published"]),
        "kernel": len(parts["kernel"]), "other": len(parts["other"]), "skipped": len(skipped),
        "fits": sum(r["fits"] for r in rows), "models": len({r["model"] for r in rows}),
    }
    ctx["bounds"] = Counter(r["bound"] for r in rows)
    ctx["mem_limit_gib"] = mem_limit_gib

    # ---- best configuration under a memory limit ----
    best = analysis.best_under_memory(decode, mem_limit_gib)
    ctx["best"] = [{"model": m, "instance": i, **v} for (m, i), v in best.items()]

    # ---- published comparison ----
    pub = analysis.published_comparison(parts["published"])
    ctx["published"] = pub
    ctx["cal_params"] = calibration.params()
    ctx["cal_band"] = calibration.BAND
    ctx["cal_sensitivity"] = calibration.host_sensitivity()
    ctx["published_svg"] = charts.published_bars(pub) if pub else ""

    # ---- cost-model calibration (bench/calibration) ----
    ctx["calibration"] = ext.get("calibration") or load_calibration()

    # ---- rooflines ----
    ctx["kernel_roofline_svg"] = charts.kernel_roofline(parts["kernel"], _kernel_roofs())
    ctx["model_roofline_svg"] = charts.model_roofline(rows, _model_roofs()) if rows else ""

    # ---- latency breakdown per configuration ----
    breakdowns = []
    for model in sorted({r["model"] for r in decode}):
        sel = [r for r in decode if r["model"] == model and r["instance"] == "trn2.48xlarge"
               and (r["batch"], r["ctx"]) == BREAKDOWN_BUCKET]
        if sel:
            title_ = f"{model} · trn2.48xlarge · decode b{BREAKDOWN_BUCKET[0]} ctx{BREAKDOWN_BUCKET[1]}"
            breakdowns.append({"title": title_, "svg": charts.latency_breakdown(sel, title_, f"lat{len(breakdowns)}")})
    for model in sorted({r["model"] for r in rows if r["phase"] in ("prefill", "vision")}):
        sel = [r for r in rows if r["model"] == model and r["instance"] == "trn2.48xlarge" and r["phase"] != "decode"]
        if sel:
            biggest = max(r["prefill_len"] or r["vision_blocks"] for r in sel)
            sel = [r for r in sel if (r["prefill_len"] or r["vision_blocks"]) == biggest]
            title_ = f"{model} · trn2.48xlarge · {sel[0]['bucket']}"
            breakdowns.append({"title": title_, "svg": charts.latency_breakdown(sel, title_, f"lat{len(breakdowns)}")})
    ctx["breakdowns"] = breakdowns

    # ---- memory heat maps ----
    heatmaps = []
    for inst in sorted({r["instance"] for r in decode}):
        for model in sorted({r["model"] for r in decode}):
            grid = analysis.memory_grid(decode, model, inst, *HEATMAP_BUCKET)
            if not grid:
                continue
            tps = sorted({r["tp"] for r in decode if r["model"] == model} | {k[0] for k in grid})
            dps = sorted({r["dp"] for r in decode if r["model"] == model} | {k[1] for k in grid})
            cap = next(iter(grid.values()))["mem_capacity_gib"]
            heatmaps.append({"model": model, "instance": inst, "svg": charts.memory_heatmap(
                grid, tps, dps, f"{model} · {inst} · cap {cap:.0f} GiB", f"mem{len(heatmaps)}")})
    vision = [r for r in rows if r["phase"] == "vision"]
    for inst in sorted({r["instance"] for r in vision}):
        grid = {}
        blocks = max(r["vision_blocks"] for r in vision)
        for r in vision:
            if r["instance"] == inst and r["vision_blocks"] == blocks:
                grid[(r["tp"], r["dp"])] = r
        tps, dps = sorted({k[0] for k in grid}), sorted({k[1] for k in grid})
        heatmaps.append({"model": "Qwen3-VL-ViT", "instance": inst, "svg": charts.memory_heatmap(
            grid, tps, dps, f"Qwen3-VL-ViT · {inst} · {blocks} blocks", f"mem{len(heatmaps)}")})
    ctx["heatmaps"] = heatmaps

    # ---- collectives ----
    comps = [analysis.layer_collective_comparison(m, "trn2.48xlarge", tp, dp, b) for m, tp, dp, b in COLLECTIVE_CASES]
    ctx["coll_compare"] = comps
    ctx["coll_compare_svg"] = charts.collective_comparison(comps)
    curves, mesh_max, rdh_max = _band_curves()
    ctx["bands_svg"] = charts.collective_bands(curves, mesh_max, rdh_max)
    samples = []
    for want in (("Llama-3.3-70B", 16, 4, "all-dp"), ("GPT-OSS-120B", 16, 4, "attn-dp"), ("Llama-3.1-8B", 8, 2,
                                                                                           "mlp-dp")):
        for r in decode:
            if (r["model"], r["tp"], r["dp"], r["mix"], r["instance"], r["batch"], r["ctx"]) == (
                    *want, "trn2.48xlarge", 8, 8192):
                samples.append({**r, "collectives": analysis.step_collectives(r)})
                break
    ctx["coll_samples"] = samples

    # ---- Pareto ----
    paretos = []
    for model in sorted({r["model"] for r in decode}):
        for ctx_len in sorted({r["ctx"] for r in decode}):
            sel = [r for r in decode if r["model"] == model and r["fits"] and r["ctx"] == ctx_len]
            if not sel:
                continue
            front = [f for tgt in sorted({r["target"] for r in sel})
                     for f in analysis.pareto_frontier([r for r in sel if r["target"] == tgt])]
            paretos.append({"model": model, "ctx": ctx_len, "frontier": sorted(front, key=lambda r: (
                r["target"], analysis.step_us(r))), "svg": charts.pareto(sel, front, f"{model} · ctx {ctx_len}",
                                                                     f"par{len(paretos)}")})
    ctx["paretos"] = paretos

    # ---- kernels, skipped, other ----
    ctx["kernels"] = sorted(parts["kernel"], key=lambda k: (k["kernel"], k["target"], k["bucket"]))
    reasons = Counter(s.get("reason", "") for s in skipped)
    examples = defaultdict(list)
    for s in skipped:
        if len(examples[s.get("reason", "")]) < 3:
            examples[s.get("reason", "")].append(s.get("id", ""))
    ctx["skipped"] = [{"reason": r, "count": c, "examples": examples[r]} for r, c in reasons.most_common()]
    ctx["other"] = parts["other"]
    ctx["vision_buckets"] = vision_bucket_table(parts["vision_buckets"])
    ctx["hardware"] = ext.get("hardware") or _hardware_rows()
    return ctx


def _hardware_rows() -> list[dict]:
    from bench.model._hw_source import hardware_rows

    return hardware_rows()


_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent)), autoescape=True,
                          trim_blocks=True, lstrip_blocks=True)


def render_html(data: dict, mem_limit_gib: float | None = None, title: str = "") -> str:
    ctx = build_context(data, mem_limit_gib, title)
    tpl = _ENV.get_template("template.html.j2")
    return tpl.render(**ctx, markup=lambda s: jinja2.utils.markupsafe.Markup(s), esc=html.escape)


def write_report(data: dict, out: str | Path, mem_limit_gib: float | None = None, title: str = "") -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data, mem_limit_gib, title), encoding="utf-8")
    return out
