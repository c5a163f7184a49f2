"""Derived views of the sweep rows: Pareto frontiers, best configuration under a memory limit, published comparison,
memory grids, per-layer collective tables. Pure functions over the flat ``extra_info`` records."""

from __future__ import annotations

from collections import defaultdict

from bench.model.analytical import ParallelConfig, legacy_decode_layer_collectives
from bench.model.hardware import get_instance
from modules.model_specs import TEXT_MODELS


def cfg_label(r: dict) -> str:
    s = f"tp{r['tp']}·dp{r['dp']}"
    if r.get("mix") and r["mix"] != "tp-only":
        s += f" {r['mix']}"
        if r["phase"] == "decode":
            s += f" (a{r['attn_dp']} e{r['emb_dp']} m{r['mlp_dp']} l{r['lm_dp']})"
    return s


def step_us(r: dict) -> float:
    """The step latency a ranking uses: calibrated where the row has it (decode), else the uncalibrated step."""
    v = r.get("t_step_cal_us")
    return r["t_step_us"] if v is None else v


def tokens_per_s_per_chip(r: dict) -> float:
    v = r.get("tokens_per_s_per_chip_cal")
    return r["tokens_per_s_per_chip"] if v is None else v


def pareto_frontier(rows: list[dict]) -> list[dict]:
    """Rows not dominated in (lower step latency, higher tokens/s per chip); calibrated figures where present."""
    best: list[dict] = []
    top = -1.0
    for r in sorted(rows, key=lambda r: (step_us(r), -tokens_per_s_per_chip(r))):
        if tokens_per_s_per_chip(r) > top:
            best.append(r)
            top = tokens_per_s_per_chip(r)
    return best


def best_under_memory(rows: list[dict], mem_limit_gib: float | None = None) -> dict[tuple[str, str], dict]:
    """Per (model, instance): the fitting decode configuration with the highest tokens/s per chip, and the one with
    the lowest step latency, both by the calibrated figures (bench.model.calibration) where the rows carry them. The
    limit defaults to each rank's HBM capacity."""
    out: dict[tuple[str, str], dict] = {}
    by = defaultdict(list)
    for r in rows:
        if r["phase"] != "decode":
            continue
        limit = r["mem_capacity_gib"] if mem_limit_gib is None else min(mem_limit_gib, r["mem_capacity_gib"])
        if r["mem_total_gib"] <= limit:
            by[(r["model"], r["instance"])].append(r)
    for key, sel in sorted(by.items()):
        out[key] = {"throughput": max(sel, key=tokens_per_s_per_chip), "latency": min(sel, key=step_us),
                    "n": len(sel)}
    return out


def published_comparison(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        p = r["published"]
        modelled = r["t_step_us"] / 1e3
        out.append({
            "label": (f"{p['model']} {p['instance'].split('.')[0]} LNC{p['lnc']} TP{p['tp']} b{p['batch']} "
                      f"ctx{p['ctx']}"),
            "key": p.get("key", ""), "model": p["model"], "instance": p["instance"], "lnc": p["lnc"], "tp": p["tp"],
            "batch": p["batch"],
            "ctx": p["ctx"], "what": p["what"], "setup": p["setup"], "source": p["source"],
            "published_ms": p["tpot_ms"], "modelled_ms": modelled, "roof_ms": r["t_roof_us"] / 1e3,
            "ratio": p["tpot_ms"] / modelled if modelled else float("nan"), "bound": r["bound"], "fits": r["fits"],
            "mem_gib": r["mem_total_gib"], "collective_ms": r["t_collective_us"] / 1e3,
            "memory_ms": r["t_memory_us"] / 1e3, "kernel_sources": r.get("kernel_sources", []),
            "efficiency": modelled / p["tpot_ms"] if p["tpot_ms"] else 0.0,
            **_calibrated(r, p),
        })
    return out


def _calibrated(r: dict, p: dict) -> dict:
    """Calibrated figure of a published row and how it was validated (bench.model.calibration)."""
    from bench.model import calibration

    if r.get("t_step_cal_us") is None:
        return {"calibrated_ms": None, "residual": None, "residual_oos": None, "out_of_sample_ms": None,
                "in_sample": None, "validation": ""}
    cal = r["t_step_cal_us"] / 1e3
    val = {v["key"]: v for v in calibration.validation()}.get(p.get("key", ""))
    return {"calibrated_ms": cal, "residual": cal / p["tpot_ms"] - 1.0 if p["tpot_ms"] else None,
            "residual_oos": val["residual_oos"] if val else None,
            "out_of_sample_ms": val["out_of_sample_s"] * 1e3 if val else None,
            "in_sample": val["in_sample"] if val else None, "validation": val["validation"] if val else "",
            "cal_terms_ms": {k: r.get(f"cal_{k}_us", 0.0) / 1e3 for k in
                             ("kernels", "collectives", "layer_fixed", "host")}, "stack": r.get("cal_stack", "")}


def step_collectives(r: dict) -> list[dict]:
    """Every collective of one decode sweep row, re-evaluated by the model (the JSON keeps only their totals)."""
    from bench.model.analytical import Bucket, evaluate

    cfg = ParallelConfig(r["tp"], r["dp"], r["attn_dp"], r["emb_dp"], r["mlp_dp"], r["lm_dp"])
    res = evaluate(TEXT_MODELS[r["model"]], get_instance(r["instance"], r["lnc"]), cfg,
                   Bucket("decode", batch=r["batch"], ctx=r["ctx"]))
    return [c.as_dict() for c in res.collectives if c.n > 1]


def memory_grid(rows: list[dict], model: str, instance: str, batch: int, ctx: int) -> dict[tuple[int, int], dict]:
    """(tp, dp) -> row for decode at one bucket, mix all-dp (tp-only at dp=1)."""
    grid = {}
    for r in rows:
        if (r["model"], r["instance"], r["phase"], r["batch"], r["ctx"]) != (model, instance, "decode", batch, ctx):
            continue
        if (r["dp"] == 1 and r["mix"] == "tp-only") or (r["dp"] > 1 and r["mix"] == "all-dp"):
            grid[(r["tp"], r["dp"])] = r
    return grid


def _summ(colls: list) -> dict:
    real = [c for c in colls if c["op"] != "slice" and c["n"] > 1]
    return {"count": len(real), "ops": len(colls), "bytes": sum(c["bytes"] for c in real),
            "time_us": sum(c["time_s"] for c in real) * 1e6}


def layer_collective_comparison(model: str, instance: str, tp: int, dp: int, batch: int) -> dict:
    """Seed's 3-vs-7: per-layer decode collectives with all component dp sizes = dp, new scheme vs before."""
    from bench.model.analytical import Bucket, evaluate

    inst = get_instance(instance)
    spec = TEXT_MODELS[model]
    cfg = ParallelConfig(tp, dp, dp, dp, dp, dp)
    res = evaluate(spec, inst, cfg, Bucket("decode", batch=batch, ctx=4096))
    new = [c.as_dict() for c in res.collectives if c.per_layer]
    old = [c.as_dict() for c in legacy_decode_layer_collectives(spec, inst, cfg, batch)]
    new_no_a2a = [c for c in new if c["op"] != "all_to_all"]
    short = model.replace("Llama-3.1-", "L3-").replace("Llama-3.3-", "L3-").replace("GPT-OSS-", "OSS-")
    return {"label": f"{short}\nTP{tp} DP{dp} b{batch}", "model": model, "tp": tp, "dp": dp, "batch": batch,
            "new": _summ(new_no_a2a), "new_with_a2a": _summ(new), "old": _summ(old), "new_rows": new,
            "old_rows": old}
