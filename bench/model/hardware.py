"""Instance view of the hardware table for the analytical model.

Every number comes from ``nkisim.hardware`` (the single hardware table, with sources). This module only assembles
the per-instance view the model needs: ranks, per-rank peaks and HBM, collective alpha-beta parameters.

Instance-level rooflines use the *chip* numbers divided over the ranks on a chip (parallel-and-perf-model.md §2.6:
"use the chip number for instance-level rooflines and the core number for kernel-level ones").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bench.model.collectives import CollectiveParams


@dataclass(frozen=True)
class Instance:
    name: str
    target: str                 # "trn2" | "trn3"
    chips: int
    cores_per_chip: int         # physical NeuronCores per chip
    lnc: int                    # logical core = lnc physical cores
    chip_bf16_flops: float      # FLOP/s, dense
    chip_hbm_bytes: float
    chip_hbm_bw: float          # bytes/s
    link_bw_per_chip: float     # bytes/s, intra-instance NeuronLink
    collectives: CollectiveParams
    kernel_min_s: float         # per-kernel floor (launch / semaphore overhead)
    source: str = ""

    @property
    def ranks_per_chip(self) -> int:
        return self.cores_per_chip // self.lnc

    @property
    def ranks(self) -> int:
        return self.chips * self.ranks_per_chip

    @property
    def rank_flops(self) -> float:
        return self.chip_bf16_flops / self.ranks_per_chip

    @property
    def rank_hbm_bw(self) -> float:
        return self.chip_hbm_bw / self.ranks_per_chip

    @property
    def rank_hbm_bytes(self) -> float:
        return self.chip_hbm_bytes / self.ranks_per_chip

    def chips_for(self, world: int) -> float:
        """Chips occupied by ``world`` ranks (fractional below one chip: per-chip throughput counts the share)."""
        return world / self.ranks_per_chip

    def spans_chips(self, group_size: int) -> bool:
        return group_size > self.ranks_per_chip

    def with_lnc(self, lnc: int) -> Instance:
        if lnc not in (1, 2):
            raise ValueError(f"lnc must be 1 or 2, got {lnc}")
        return Instance(**{**self.__dict__, "lnc": lnc})

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["collectives"] = dict(self.collectives.__dict__)
        d.update(ranks=self.ranks, ranks_per_chip=self.ranks_per_chip, rank_flops=self.rank_flops,
                 rank_hbm_bw=self.rank_hbm_bw, rank_hbm_bytes=self.rank_hbm_bytes)
        return d


@lru_cache(maxsize=1)
def instances() -> dict[str, Instance]:
    from bench.model import _hw_source as hw

    return {inst.name: inst for inst in hw.build_instances()}


def get_instance(name: str, lnc: int | None = None) -> Instance:
    table = instances()
    if name not in table:
        raise ValueError(f"unknown instance {name!r}; expected one of {sorted(table)}")
    inst = table[name]
    return inst if lnc is None or lnc == inst.lnc else inst.with_lnc(lnc)
