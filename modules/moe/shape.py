"""MoE shapes under tensor parallelism without EP: every rank holds all experts and a 1/tp slice of the intermediate.

One source for the per-rank facts the layer, its loaders and the tests share: padded hidden (H rounded up with zeros
to what the kernels tile by, the real width kept as ``hidden`` for the RMSNorm mean), the padded
intermediate (optional zero columns so tp divides it; a zero intermediate column contributes nothing because both
activations map (0, 0) to 0) and which real checkpoint columns rank r holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from modules.model_specs import TextModelSpec
from nki_kernels.moe.moe_torch import MX_BLOCK

HIDDEN_PARTITION = 128  # H is tiled over the 128 SBUF partitions: a padded H must be a multiple of it
# Default padding: nki-library's TKG MLP requires H % 512 == 0 (core/mlp/mlp_tkg/mlp_tkg_utils.py, "Expect H to be a
# multiple of 512"); GPT-OSS's 2880 becomes the seed's and the issue's 3072.
HIDDEN_ALIGN = 512


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def mx_aligned_intermediate(intermediate: int, tp_size: int) -> int:
    """Smallest padded intermediate whose every rank shard starts and ends on an MXFP4 block boundary (the seed's
    GPT-OSS-20B TP=8 figure: 2880 → 3072, 384 per rank)."""
    return round_up(intermediate, MX_BLOCK * tp_size)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MoEShape: {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class MoEShape:
    """Real checkpoint dimensions, TP degree and the padded sizes the kernels see.

    hidden / intermediate: the checkpoint's H and per-expert I. hidden_padded: default H rounded up to 512; an
    explicit value must be a multiple of 128.
    intermediate_padded: I plus zero columns so tp_size divides it (default I itself: tp must divide I).
    """

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tp_size: int
    hidden_padded: int = 0        # 0 = round_up(hidden, HIDDEN_ALIGN)
    intermediate_padded: int = 0  # 0 = intermediate

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k", "tp_size"):
            _positive(name, getattr(self, name))
        if not self.top_k <= self.experts:
            raise ValueError(f"MoEShape: top_k={self.top_k} exceeds experts={self.experts}")
        if self.hidden_padded == 0:
            object.__setattr__(self, "hidden_padded", round_up(self.hidden, HIDDEN_ALIGN))
        if self.intermediate_padded == 0:
            object.__setattr__(self, "intermediate_padded", self.intermediate)
        hp, ip = self.hidden_padded, self.intermediate_padded
        if hp < self.hidden or hp % HIDDEN_PARTITION:
            raise ValueError(f"MoEShape: hidden_padded={hp} must be a multiple of {HIDDEN_PARTITION} and >= "
                             f"hidden={self.hidden}")
        if ip < self.intermediate:
            raise ValueError(f"MoEShape: intermediate_padded={ip} < intermediate={self.intermediate}")
        if ip % self.tp_size:
            hint = ("" if ip != self.intermediate else
                    f"; pass intermediate_padded (e.g. mx_aligned_intermediate({self.intermediate}, {self.tp_size})"
                    f" = {mx_aligned_intermediate(self.intermediate, self.tp_size)})")
            raise ValueError(f"MoEShape: tp_size={self.tp_size} does not divide intermediate "
                             f"{'padded ' if ip != self.intermediate else ''}size {ip}{hint}")

    @classmethod
    def from_spec(cls, spec: TextModelSpec, tp_size: int, intermediate_padded: int = 0) -> MoEShape:
        if not spec.is_moe:
            raise ValueError(f"MoEShape.from_spec: {spec.name} is not an MoE model")
        return cls(spec.hidden, spec.intermediate, spec.experts, spec.top_k, tp_size,
                   intermediate_padded=intermediate_padded)

    @property
    def i_per_rank(self) -> int:
        return self.intermediate_padded // self.tp_size

    def i_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the real checkpoint intermediate columns rank holds; its remaining i_per_rank − (stop −
        start) columns are zero padding (stop == start for a rank lying wholly in the padding)."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"MoEShape: rank={rank} out of range for tp_size={self.tp_size}")
        start = min(rank * self.i_per_rank, self.intermediate)
        return start, min(start + self.i_per_rank, self.intermediate)
