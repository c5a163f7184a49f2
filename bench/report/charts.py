"""Matplotlib charts rendered to inline SVG strings (no network, no files). Every plotted figure is modelled unless
the kernel row says it was measured on a device."""

from __future__ import annotations

import io
import math
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402


def _plain_log_axes(ax) -> None:
    """Log axes labelled 1, 2, 5, 10, ... in plain numbers (no overlapping 2×10^0 minor labels)."""
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22"]
TARGET_COLORS = {"trn2": "#1f4e9c", "trn3": "#c0392b"}
PART_COLORS = {"embedding": "#9ecae1", "attention": "#3182bd", "mlp": "#31a354", "lm_head": "#fdae6b",
               "patch_embed": "#9ecae1", "merger": "#fdae6b", "collectives (layers)": "#de2d26",
               "collectives (other)": "#fc9272"}

plt.rcParams.update({
    "font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold",
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.25,
    "grid.linestyle": "-", "legend.frameon": False, "legend.fontsize": 8, "svg.fonttype": "none",
})


def to_svg(fig, salt: str) -> str:
    """Inline SVG; a per-figure hash salt keeps element ids unique when several SVGs share one page."""
    with plt.rc_context({"svg.hashsalt": salt}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def _roof(ax, peak: float, bw: float, color: str, label: str, style: str = "-", xlim=(1e-2, 1e4),
          index: int = 0) -> None:
    xs = [xlim[0] * (xlim[1] / xlim[0]) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw) for x in xs], style, color=color, lw=1.6, label=label)
    ridge = peak / bw
    ax.plot([ridge], [peak], "o", ms=3.5, color=color)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak), textcoords="offset points",
                xytext=(6, -12 - 11 * index), fontsize=7, color=color)


def kernel_roofline(rows: list[dict], roofs: dict[str, tuple[float, float]]) -> str:
    """AI vs achieved FLOP/s, one point per kernel x bucket, with trn2/trn3 per-core roofs."""
    fig, ax = plt.subplots(figsize=(7.6, 4.6))
    for i, (tgt, (peak, bw)) in enumerate(sorted(roofs.items())):
        _roof(ax, peak, bw, TARGET_COLORS.get(tgt, PALETTE[i]), f"{tgt} roof (per core: {peak / 1e12:.0f} TF, "
              f"{bw / 1e9:.0f} GB/s)", "-" if i == 0 else "--", index=i)
    pts = [r for r in rows if r.get("ai") and r.get("achieved_flops")]
    if not pts:
        ax.text(0.97, 0.06, "no kernel benchmarks with FLOPs and bytes in this run", ha="right",
                transform=ax.transAxes, color="#666", bbox=dict(facecolor="white", edgecolor="#ccc"))
    markers = "osD^v<>pP*hX"
    kernels = sorted({r["kernel"] for r in pts})
    for k_i, k in enumerate(kernels):
        for tgt in sorted({r["target"] for r in pts}):
            sel = [r for r in pts if r["kernel"] == k and r["target"] == tgt]
            if sel:
                ax.scatter([r["ai"] for r in sel], [r["achieved_flops"] for r in sel], s=34,
                           marker=markers[k_i % len(markers)], color=TARGET_COLORS.get(tgt, "#444"),
                           edgecolor="white", linewidth=0.6, zorder=3, label=f"{k} ({tgt})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("achieved FLOP/s (modelled)")
    ax.set_title("Kernel roofline — nkisim-modelled latency, one point per kernel × bucket")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return to_svg(fig, "kroof")


def model_roofline(rows: list[dict], roofs: dict[str, tuple[float, float]]) -> str:
    """Per-rank roofline of whole decode/prefill steps (chip peaks / ranks per chip)."""
    fig, ax = plt.subplots(figsize=(7.6, 4.4))
    for i, (inst, (peak, bw)) in enumerate(sorted(roofs.items())):
        _roof(ax, peak, bw, list(TARGET_COLORS.values())[i % 2], f"{inst} per-rank roof", "-" if i == 0 else "--",
              xlim=(0.1, 1e5), index=i)
    models = sorted({r["model"] for r in rows})
    for m_i, m in enumerate(models):
        for phase, marker in (("decode", "o"), ("prefill", "^"), ("vision", "s")):
            sel = [r for r in rows if r["model"] == m and r["phase"] == phase and r["ai"] > 0 and r["t_step_us"] > 0]
            if sel:
                ax.scatter([r["ai"] for r in sel], [r["flops"] / (r["t_step_us"] * 1e-6) for r in sel], s=10,
                           marker=marker, color=PALETTE[m_i % len(PALETTE)], alpha=0.55, linewidth=0,
                           label=f"{m} {phase}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity of the step (FLOP / HBM byte, per rank)")
    ax.set_ylabel("attained FLOP/s per rank (modelled)")
    ax.set_title("Model-step roofline — every swept configuration (modelled)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, markerscale=1.6)
    return to_svg(fig, "mroof")


def latency_breakdown(rows: list[dict], title: str, salt: str, max_rows: int = 16) -> str:
    """Horizontal stacked bars: kernel time per component + exposed collective time, per configuration."""
    rows = sorted(rows, key=lambda r: r["t_step_us"])[:max_rows]
    fig, ax = plt.subplots(figsize=(7.6, 0.32 * max(len(rows), 3) + 1.1))
    if not rows:
        _note(ax, "no valid configuration")
        return to_svg(fig, salt)
    labels, parts = [], defaultdict(list)
    names = list(rows[0]["kernel_us"])
    for r in rows:
        labels.append(f"tp{r['tp']} dp{r['dp']} {r['mix']}" + ("" if r["fits"] else "  ✗mem"))
        for n in names:
            parts[n].append(r["kernel_us"].get(n, 0.0) * 1e-3)
        parts["collectives (layers)"].append(r["coll_layer_us"] * 1e-3)
        parts["collectives (other)"].append(r["coll_other_us"] * 1e-3)
    left = [0.0] * len(rows)
    ys = list(range(len(rows)))
    for n, vals in parts.items():
        ax.barh(ys, vals, left=left, color=PART_COLORS.get(n, "#999"), label=n, height=0.72)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, r in zip(ys, rows, strict=True):
        src = " · attn nkisim" if "attention" in r.get("kernel_sources", []) else ""
        cal = f" · calibrated {r['t_step_cal_us'] / 1e3:.2f} ms" if r.get("t_step_cal_us") else ""
        ax.text(left[y], y, f"  {r['t_step_us'] / 1e3:.2f} ms · {r['bound']}{src}{cal}", va="center", fontsize=7,
                color="#333")
    ax.set_yticks(ys, labels, fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlabel("modelled step latency, uncalibrated terms (ms)")
    ax.set_xlim(0, max(left) * (1.55 if any(r.get("t_step_cal_us") for r in rows) else 1.28))
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    ax.legend(ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.5 / max(len(rows), 3) - 0.12), fontsize=7)
    return to_svg(fig, salt)


def memory_heatmap(grid: dict[tuple[int, int], dict], tps: list[int], dps: list[int], title: str, salt: str) -> str:
    """tp × dp heat map of modelled memory per rank (GiB); a cross marks configurations that do not fit."""
    fig, ax = plt.subplots(figsize=(3.7, 2.9))
    if not grid:
        _note(ax, "no valid configuration")
        return to_svg(fig, salt)
    vals = [[grid.get((tp, dp), {}).get("mem_total_gib", math.nan) for tp in tps] for dp in dps]
    finite = [v for row in vals for v in row if not math.isnan(v)]
    vmin, vmax = max(min(finite), 1e-3), max(finite)
    vmax = max(vmax, vmin * 1.01)
    im = ax.imshow(vals, cmap="viridis_r", aspect="auto", norm=LogNorm(vmin=vmin, vmax=vmax))
    for yi, dp in enumerate(dps):
        for xi, tp in enumerate(tps):
            cell = grid.get((tp, dp))
            if cell is None:
                ax.text(xi, yi, "invalid", ha="center", va="center", fontsize=6.5, color="#888")
                continue
            fits = cell["fits"]
            v = min(max(cell["mem_total_gib"], vmin), vmax)
            r_, g_, b_, _ = im.cmap(math.log(v / vmin) / math.log(vmax / vmin))
            light = 0.299 * r_ + 0.587 * g_ + 0.114 * b_ > 0.55
            ax.text(xi, yi, f"{cell['mem_total_gib']:.1f}" + ("" if fits else "\n✗ fit"), ha="center", va="center",
                    fontsize=7, color=("#1d2733" if light else "white") if fits else "#ff8a80", fontweight="bold")
    ax.set_xticks(range(len(tps)), [str(t) for t in tps])
    ax.set_yticks(range(len(dps)), [str(d) for d in dps])
    ax.set_xlabel("tp")
    ax.set_ylabel("dp")
    ax.grid(False)
    ax.set_title(title, fontsize=8.5)
    cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03)
    cb.set_label("GiB / rank (modelled)", fontsize=7)
    cb.ax.tick_params(labelsize=6.5)
    return to_svg(fig, salt)


def collective_comparison(items: list[dict]) -> str:
    """Per-layer collective count and bytes: component-DP scheme vs the seed's pre-optimisation scheme."""
    fig, axes = plt.subplots(1, 3, figsize=(11.5, 3.3))
    labels = [i["label"] for i in items]
    xs = range(len(items))
    w = 0.38
    for ax, key, ylabel in ((axes[0], "count", "collectives per layer"), (axes[1], "bytes", "KiB per layer"),
                            (axes[2], "time_us", "µs per layer (modelled)")):
        new = [i["new"][key] / (1024 if key == "bytes" else 1) for i in items]
        old = [i["old"][key] / (1024 if key == "bytes" else 1) for i in items]
        ax.bar([x - w / 2 for x in xs], old, w, color="#bdbdbd", label="before component DP (seed: \"7\")")
        ax.bar([x + w / 2 for x in xs], new, w, color="#3182bd", label="component DP (seed: \"3\")")
        for x, v in zip(xs, old, strict=True):
            ax.text(x - w / 2, v, f"{v:.0f}" if key != "time_us" else f"{v:.0f}", ha="center", va="bottom",
                    fontsize=6.5)
        for x, v in zip(xs, new, strict=True):
            ax.text(x + w / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6.5)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(axis="x", visible=False)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Decode collectives per layer, all component dp sizes equal (modelled)", fontsize=10,
                 fontweight="bold")
    fig.tight_layout()
    return to_svg(fig, "collcmp")


def collective_bands(curves: dict[str, list[tuple[float, float, str]]], mesh_max: float, rdh_max: float) -> str:
    """Alpha-beta time vs message size with Neuron's algorithm bands shaded."""
    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    ax.axvspan(1, mesh_max, color="#e5f5e0", alpha=0.7, lw=0)
    ax.axvspan(mesh_max, rdh_max, color="#deebf7", alpha=0.7, lw=0)
    ax.axvspan(rdh_max, 2**31, color="#fee6ce", alpha=0.7, lw=0)
    for x, txt in ((30, "Mesh < 1 MB"), (mesh_max * 1.4, "RDH 1–56 MB"), (rdh_max * 1.4, "KangaRing > 56 MB")):
        ax.text(x, 0.97, txt, transform=ax.get_xaxis_transform(), fontsize=7.5, va="top", color="#555")
    for i, (label, pts) in enumerate(curves.items()):
        ax.plot([p[0] for p in pts], [p[1] * 1e6 for p in pts], color=PALETTE[i % len(PALETTE)], lw=1.5, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(8, 2**31)
    ax.set_xlabel("message size S (bytes, nccl-tests convention)")
    ax.set_ylabel("modelled time (µs)")
    ax.set_title("Collective alpha-beta model with Neuron algorithm bands (trn2.48xlarge, modelled)")
    ax.legend(fontsize=7, loc="lower right")
    return to_svg(fig, "bands")


def pareto(rows: list[dict], frontier: list[dict], title: str, salt: str) -> str:
    """Latency (TPOT) vs tokens/s per chip for every fitting decode configuration, frontier highlighted; calibrated
    figures where the rows carry them (bench.model.calibration)."""
    from bench.report.analysis import step_us
    from bench.report.analysis import tokens_per_s_per_chip as tps

    fig, ax = plt.subplots(figsize=(4.6, 3.3))
    if not rows:
        _note(ax, "no fitting decode configuration")
        return to_svg(fig, salt)
    for tgt in sorted({r["target"] for r in rows}):
        sel = [r for r in rows if r["target"] == tgt]
        ax.scatter([step_us(r) / 1e3 for r in sel], [tps(r) for r in sel], s=9, alpha=0.45,
                   color=TARGET_COLORS.get(tgt, "#555"), linewidth=0, label=f"{tgt} configs")
    for tgt in sorted({r["target"] for r in frontier}):
        f = sorted([r for r in frontier if r["target"] == tgt], key=step_us)
        ax.plot([step_us(r) / 1e3 for r in f], [tps(r) for r in f], "-o", ms=3.5, lw=1.3,
                color=TARGET_COLORS.get(tgt, "#555"), markeredgecolor="black", markeredgewidth=0.4,
                label=f"{tgt} Pareto frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axes(ax)
    ax.set_xlabel("modelled step latency / TPOT (ms, calibrated)")
    ax.set_ylabel("tokens/s per chip (modelled, calibrated)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6.5, loc="lower right")
    return to_svg(fig, salt)


def published_bars(rows: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(7.6, 0.42 * max(len(rows), 2) + 1.0))
    ys = list(range(len(rows)))
    cal = [r.get("calibrated_ms") or 0.0 for r in rows]
    ax.barh([y - 0.27 for y in ys], [r["published_ms"] for r in rows], 0.26, color="#636363",
            label="published (measured)")
    ax.barh(ys, cal, 0.26, color="#31a354", label="modelled, calibrated")
    ax.barh([y + 0.27 for y in ys], [r["modelled_ms"] for r in rows], 0.26, color="#3182bd",
            label="modelled, uncalibrated step")
    for y, r in zip(ys, rows, strict=True):
        note = f"  {r['residual_oos']:+.0%} out of sample" if r.get("residual_oos") is not None else \
            f"  ×{r['ratio']:.1f}"
        ax.text(max(r["published_ms"], r.get("calibrated_ms") or 0.0, r["modelled_ms"]), y, note, va="center",
                fontsize=7)
    ax.set_yticks(ys, [r["label"] for r in rows], fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlabel("decode latency per step (ms)")
    ax.set_xlim(0, max(max(r["published_ms"], r.get("calibrated_ms") or 0.0) for r in rows) * 1.35)
    ax.set_title("Published decode latency vs the model, calibrated and not (residual: calibrated out of sample)")
    ax.grid(axis="y", visible=False)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6 / max(len(rows), 2) - 0.1), ncol=3)
    return to_svg(fig, "pub")
