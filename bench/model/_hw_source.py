"""Build the model's Instance objects from ``nkisim.hardware`` (the single hardware table; no numbers here)."""

from __future__ import annotations

from bench.model.collectives import CollectiveParams
from bench.model.hardware import Instance

# Bench-only assumption (not an interpreter constant): the smallest time the analytical model charges one kernel.
KERNEL_MIN_LATENCY_S = 2e-6
KERNEL_MIN_LATENCY_SOURCE = ("ASSUMPTION from vllm-neuron docs/kernel_ledger.md roofline per LNC=2 core: max(FLOPs/79 "
                             "TF, bytes/716 GB/s, 2 us) (kernel-anchors.md §1)")


def _collectives(hw, target: str) -> CollectiveParams:
    from nkisim import hardware as table

    bw = table.COLLECTIVE_BUSBW[target]
    c = hw.collective
    return CollectiveParams(alpha_base_s=c.base_latency_s, alpha_hop_s=c.hop_latency_s,
                            mesh_max_bytes=c.mesh_max_bytes, rdh_max_bytes=c.rdh_max_bytes,
                            busbw_mesh=bw["Mesh"], busbw_rdh=bw["RDH"], busbw_kangaring=bw["KangaRing"])


def build_instances() -> list[Instance]:
    from nkisim import hardware as table

    out = []
    for target, name in (("trn2", "trn2.48xlarge"), ("trn3", "trn3-server")):
        hw = table.HARDWARE[target]
        inst, chip = hw.instance, hw.chip
        out.append(Instance(
            name=name, target=target, chips=inst.chips, cores_per_chip=chip.cores, lnc=inst.default_lnc,
            chip_bf16_flops=chip.bf16_flops, chip_hbm_bytes=chip.hbm_bytes, chip_hbm_bw=chip.hbm_bytes_per_s,
            link_bw_per_chip=inst.link_bytes_per_s_per_chip, collectives=_collectives(hw, target),
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
        ("collective base latency s", "collective", "base_latency_s"),
        ("collective per-hop latency s", "collective", "hop_latency_s"),
        ("Mesh max bytes", "collective", "mesh_max_bytes"), ("RDH max bytes", "collective", "rdh_max_bytes"),
    ):
        a, b = getattr(t2, obj), getattr(t3, obj)
        rows.append({"item": label, "trn2": getattr(a, attr), "trn3": getattr(b, attr),
                     "source": a.source(attr) or b.source(attr)})
    for alg in ("Mesh", "RDH", "KangaRing"):
        rows.append({"item": f"busbw {alg} B/s", "trn2": table.COLLECTIVE_BUSBW["trn2"][alg],
                     "trn3": table.COLLECTIVE_BUSBW["trn3"][alg], "source": table.COLLECTIVE_BUSBW_SOURCES[alg]})
    rows.append({"item": "kernel floor s", "trn2": KERNEL_MIN_LATENCY_S, "trn3": KERNEL_MIN_LATENCY_S,
                 "source": KERNEL_MIN_LATENCY_SOURCE})
    return rows
