"""Compile target (trn2 / trn3) and the per-target constants the interpreter enforces.

The target comes from `NEURON_PLATFORM_TARGET_OVERRIDE` as for the real compiler (`trn2|gen3`, `trn3|gen4`; `trn1|gen2`
accepted for reading old code). nkisim defaults to trn2, the fleet our kernels are tuned for (the official simulator
defaults to the detected chip, else trn3). Capacities are the usable per-partition numbers of the real `nki` wheel's
target_info (nki-api.md §3.6); hardware timing numbers live in the cost model's single hardware table, not here.
"""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str               # "trn1" | "trn2" | "trn3"
    nc_version: int         # 2 (NeuronCore-v2), 3 (v3), 4 (v4)
    sbuf_usable_bytes: int  # per partition, target_info
    sbuf_physical_bytes: int
    psum_bytes: int = 16384          # per partition
    psum_bank_bytes: int = 2048      # 8 banks x 2 KiB
    pmax: int = 128
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512      # per instruction on v2/v3 (one fp32 PSUM bank)

    @property
    def psum_num_banks(self) -> int:
        return self.psum_bytes // self.psum_bank_bytes

    @property
    def matmul_moving_fmax_fp32(self) -> int:
        # v4 may span all 8 PSUM banks with one instruction (nki-api.md §4.3).
        return 4096 if self.nc_version >= 4 else 512

    @property
    def matmul_moving_fmax_bf16(self) -> int:
        return 8192 if self.nc_version >= 4 else 512


TARGETS = {
    "trn1": Target("trn1", 2, sbuf_usable_bytes=180224, sbuf_physical_bytes=192 * 1024),
    "trn2": Target("trn2", 3, sbuf_usable_bytes=212984, sbuf_physical_bytes=224 * 1024),
    "trn3": Target("trn3", 4, sbuf_usable_bytes=245752, sbuf_physical_bytes=256 * 1024),
}
_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3", "trn1": "trn1", "trn2": "trn2", "trn3": "trn3"}


def resolve_target(name: str | None = None) -> Target:
    """Target by explicit name, else from NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    raw = name if name is not None else os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    key = _ALIASES.get(str(raw).strip().lower())
    if key is None:
        raise ValueError(
            f"NEURON_PLATFORM_TARGET_OVERRIDE / target={raw!r} is not a known platform; expected one of "
            f"{sorted(_ALIASES)}"
        )
    return TARGETS[key]
