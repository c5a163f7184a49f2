"""Build the model's Instance objects from ``nkisim.hardware`` (the single hardware table; no numbers here)."""

from __future__ import annotations

from bench.model.collectives import CollectiveParams
from bench.model.hardware import Instance

# Bench-only assumption (not an interpreter constant): the smallest time the analytical model charges one kernel.
KERNEL_MIN_LATENCY_S = 2e-6
KERNEL_MIN_LATENCY_SOURCE = ("ASSUMPTION from vllm-neuron docs/kernel_ledger.md roofline per LNC=2 core: max(FLOPs/79 "
                             "TF, bytes/716 GB/s, 2 us) (kernel-anchors.md §1)")


# The bench's collective table (issue 10 "one source per hardware fact"): every collective constant the bench uses,
# each with its status and source. The values are re-exported from nkisim.hardware, not copied: the interpreter's
# cost of nki.collectives instructions (nkisim.cost.collective) needs the same constants and nkisim must not import
# the bench, so the one place a value is written is nkisim/hardware.py; the bench reads collective constants only
# through this table. status: "documented" (an AWS page gives the figure), "documented example" (one published
# measurement used as a plateau) or "ASSUMPTION" (a modelled default; replace with an nccom-test sweep).
COLLECTIVE_ITEMS = (
    # (key, item, status)
    ("alpha_base_s", "collective base latency s", "ASSUMPTION"),
    ("alpha_hop_s", "collective per-hop latency s", "documented"),
    ("mesh_max_bytes", "Mesh max bytes", "documented"),
    ("rdh_max_bytes", "RDH max bytes", "documented"),
    ("busbw_mesh", "busbw Mesh B/s", "ASSUMPTION"),
    ("busbw_rdh", "busbw RDH B/s", "ASSUMPTION"),
    ("busbw_kangaring", "busbw KangaRing B/s", "documented example"),
)
TARGETS = ("trn2", "trn3")


def _collective_value(target: str, key: str):
    """(value, source) of one collective constant for `target`, read from nkisim.hardware."""
    from nkisim import hardware as table

    c = table.HARDWARE[target].collective
    attr = {"alpha_base_s": "base_latency_s", "alpha_hop_s": "hop_latency_s", "mesh_max_bytes": "mesh_max_bytes",
            "rdh_max_bytes": "rdh_max_bytes"}.get(key)
    if attr is not None:
        return getattr(c, attr), c.source(attr)
    alg = {"busbw_mesh": "Mesh", "busbw_rdh": "RDH", "busbw_kangaring": "KangaRing"}[key]
    src = table.COLLECTIVE_BUSBW_SOURCES[alg]
    if target != "trn2":
        src = f"ASSUMPTION: {table.COLLECTIVE_BUSBW_SOURCES[target]}"
    return table.COLLECTIVE_BUSBW[target][alg], src


def collective_table() -> list[dict]:
    """Rows (key, item, trn2, trn3, status, source): the bench's table of collective constants. The status is the
    trn2 one; the trn3 busbw values reuse the trn2 anchors, which their source says."""
    rows = []
    for key, item, status in COLLECTIVE_ITEMS:
        (v2, s2), (v3, s3) = (_collective_value(t, key) for t in TARGETS)
        rows.append({"key": key, "item": item, "trn2": v2, "trn3": v3, "status": status,
                     "source": s2 if s2 == s3 else f"{s2} (trn3: {s3})"})
    return rows


def _collectives(target: str) -> CollectiveParams:
    """The bench's CollectiveParams for `target`, from its collective table only."""
    return CollectiveParams(**{r["key"]: r[target] for r in collective_table()})


def build_instances() -> list[Instance]:
    from nkisim import hardware as table

    out = []
    for target, name in (("trn2", "trn2.48xlarge"), ("trn3", "trn3-server")):
        hw = table.HARDWARE[target]
        inst, chip = hw.instance, hw.chip
        out.append(Instance(
            name=name, target=target, chips=inst.chips, cores_per_chip=chip.cores, lnc=inst.default_lnc,
            chip_bf16_flops=chip.bf16_flops, chip_hbm_bytes=chip.hbm_bytes, chip_hbm_bw=chip.hbm_bytes_per_s,
            link_bw_per_chip=inst.link_bytes_per_s_per_chip, collectives=_collectives(target),
            kernel_min_s=KERNEL_MIN_LATENCY_S, source=f"nkisim.hardware HARDWARE[{target!r}] ({inst.name})"))
    return out


def hardware_rows() -> list[dict]:
    """Rows (item, trn2, trn3, source) for the report's constants table."""
    from nkisim import hardware as table

    rows = []
    t2, t3 = table.HARDWARE["trn2"], table.HARDWARE["trn3"]
    for label, obj, attr in (
        ("chip BF16 FLOP/s", "chip", "bf16_flops"), ("chip HBM bytes", "chip", "hbm_bytes"),
        ("chip HBM B/s", "chip", "hbm_bytes_per_s"),
        ("core BF16 FLOP/s (kernel roofline)", "core", "tensor_bf16_flops"),
        ("core HBM B/s share", "core", "hbm_bytes_per_s"), ("core DMA B/s", "core", "dma_bytes_per_s"),
        ("instance chips", "instance", "chips"), ("default LNC", "instance", "default_lnc"),
        ("intra-instance link B/s per chip", "instance", "link_bytes_per_s_per_chip"),
    ):
        a, b = getattr(t2, obj), getattr(t3, obj)
        rows.append({"item": label, "trn2": getattr(a, attr), "trn3": getattr(b, attr),
                     "source": a.source(attr) or b.source(attr)})
    for r in collective_table():
        rows.append({"item": r["item"], "trn2": r["trn2"], "trn3": r["trn3"],
                     "source": f"[{r['status']}] {r['source']}"})
    rows.append({"item": "kernel floor s", "trn2": KERNEL_MIN_LATENCY_S, "trn3": KERNEL_MIN_LATENCY_S,
                 "source": KERNEL_MIN_LATENCY_SOURCE})
    from bench.model.calibration import terms_rows  # the whole-model calibration terms, in the same one table

    return rows + terms_rows()
