"""Compile target (trn2 / trn3) and the per-target constants the interpreter enforces.

The target comes from `NEURON_PLATFORM_TARGET_OVERRIDE` as for the real compiler (`trn2|gen3`, `trn3|gen4`; `trn1|gen2`
accepted for reading old code). nkisim defaults to trn2, the fleet our kernels are tuned for (the official simulator
defaults to the detected chip, else trn3). Capacities are the usable per-partition numbers of the real `nki` wheel's
target_info (nki-api.md §3.6); tile sizes, partition counts and physical capacities derive from the one hardware
table, nkisim.hardware.
"""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str               # "trn1" | "trn2" | "trn3"
    nc_version: int         # 2 (NeuronCore-v2), 3 (v3), 4 (v4)
    sbuf_usable_bytes: int  # per partition, target_info (what the allocator may hand out; not a hardware fact)
    sbuf_physical_bytes: int
    psum_bytes: int          # per partition
    psum_bank_bytes: int
    pmax: int
    gemm_stationary_fmax: int
    gemm_moving_fmax: int    # per instruction on v2/v3: one PSUM bank of fp32

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


# target_info's usable SBUF bytes per partition (nki-api.md §3.6); everything else derives from nkisim.hardware
_SBUF_USABLE = {"trn1": 180224, "trn2": 212984, "trn3": 245752}
# every accepted spelling of a platform -> its canonical name (the one alias map; nkisim.hardware uses it too)
ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3", "trn1": "trn1", "trn2": "trn2", "trn3": "trn3"}


def _target(name):
    from .hardware import HARDWARE
    c = HARDWARE[name].core
    bank = c.psum_partition_bytes // c.psum_banks
    return Target(name, c.nc_version, sbuf_usable_bytes=_SBUF_USABLE[name], sbuf_physical_bytes=c.sbuf_partition_bytes,
                  psum_bytes=c.psum_partition_bytes, psum_bank_bytes=bank, pmax=c.partitions,
                  gemm_stationary_fmax=c.tensor_cols, gemm_moving_fmax=bank // 4)


TARGETS = {n: _target(n) for n in ("trn1", "trn2", "trn3")}


def resolve_target(name: str | None = None) -> Target:
    """Target by explicit name, else from NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    raw = name if name is not None else os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    key = ALIASES.get(str(raw).strip().lower())
    if key is None:
        raise ValueError(
            f"NEURON_PLATFORM_TARGET_OVERRIDE / target={raw!r} is not a known platform; expected one of "
            f"{sorted(ALIASES)}"
        )
    return TARGETS[key]
