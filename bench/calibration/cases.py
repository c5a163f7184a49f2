"""The calibration table: AWS's published, hardware-measured timings of its NKI tutorial kernels, each with its
source, and how to run our NKI 0.7 version of the kernel on the same shapes.

Nothing in the cost model is fitted to these figures (hardware constants come from AWS's documentation, see
nkisim.cost's design note). `held_out` marks the cross-check cases: they were not looked at while choosing between
documented interpretations of a constant (the DMA transfer overhead, rule 6 of the design note), which used only the
trn2 tutorial's v2/v3 figures as a sanity check. The later review of DMA efficiency vs chunk size read the trn1
DMA-bound figures (per-transfer arithmetic in the cost design note's calibration section) but changed no constant,
so they stay held out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_KO = ("aws-neuron-sdk nki/guides/tutorials/kernel-optimization.rst ('Introduction to NKI kernel optimization', "
       "trn2), profile screenshots {}")
_MM = ("aws-neuron-sdk SDK 2.23 docs, general/nki/tutorials/matrix_multiplication (trn1), performance table "
       "(figure as quoted in issue 10)")
_MAMBA = ("aws-neuron-sdk nki/guides/tutorials/fused_mamba.rst (trn1, SDK 2.23), mamba_v1 device latency {} "
          "(figure as quoted in issue 10)")

MATMUL_SHAPE = (4096, 8192, 8192)      # M, K, N: lhsT [K, M] @ rhs [K, N]


@dataclass(frozen=True)
class Case:
    key: str
    target: str
    kernel: str                  # "matmul_v2".."matmul_v5" (bench.calibration.matmul_tutorial) or "mamba_v1"
    dtype: str
    shape: tuple                 # matmul: (M, K, N); mamba: (batch, channels, seq, state)
    published_s: float
    source: str
    held_out: bool = False
    kwargs: dict = field(default_factory=dict)
    note: str = ""

    @property
    def what(self):
        if self.kernel == "mamba_v1":
            b, c, s, st = self.shape
            return f"mamba_v1 {self.dtype} batch {b} channels {c} seq {s} state {st}"
        m, k, n = self.shape
        return f"{self.kernel} {self.dtype} {m}x{k} @ {k}x{n}"


_V5_TRN2 = ("K block of 4 tiles instead of the tutorial's 8: with fp32 accumulators the tutorial's live set (224 KiB/"
            "partition) exceeds the 208 KiB usable; same load shapes, twice the SBUF accumulations")
_V4 = "rhs tiles of one n-tile of the 2x2 block live at a time (the tutorial's 256 KiB live set cannot fit)"
_BCAST = "B/C rows loaded broadcast by DMA (NKI 0.7 has no partition broadcast)"

CASES: tuple[Case, ...] = (
    Case("trn2-ko-v2", "trn2", "matmul_v2", "float32", MATMUL_SHAPE, 39.89e-3, _KO.format("v2")),
    Case("trn2-ko-v3", "trn2", "matmul_v3", "float32", MATMUL_SHAPE, 28.20e-3, _KO.format("v3")),
    Case("trn2-ko-v4", "trn2", "matmul_v4", "float32", MATMUL_SHAPE, 28.41e-3, _KO.format("v4"), True, note=_V4),
    Case("trn2-ko-v5", "trn2", "matmul_v5", "float32", MATMUL_SHAPE, 28.30e-3, _KO.format("v5"), True,
         dict(tiles_m=16, tiles_n=2, tiles_k=4), _V5_TRN2),
    Case("trn1-mm-orig", "trn1", "matmul_v2", "bfloat16", MATMUL_SHAPE, 51.80e-3, _MM, True),
    Case("trn1-mm-opt1", "trn1", "matmul_v3", "bfloat16", MATMUL_SHAPE, 42.96e-3, _MM, True),
    Case("trn1-mm-opt2", "trn1", "matmul_v4", "bfloat16", MATMUL_SHAPE, 22.07e-3, _MM, True, note=_V4),
    Case("trn1-mm-opt3", "trn1", "matmul_v5", "bfloat16", MATMUL_SHAPE, 6.97e-3, _MM, True,
         dict(tiles_m=16, tiles_n=2, tiles_k=8)),
    Case("trn1-mamba-256", "trn1", "mamba_v1", "float32", (1, 256, 512, 16), 172.93e-6, _MAMBA.format("172.93 us"),
         True, note=_BCAST),
    Case("trn1-mamba-4096", "trn1", "mamba_v1", "float32", (1, 4096, 512, 16), 2.34e-3, _MAMBA.format("2.34 ms"),
         True, note=_BCAST),
)

TARGET_BAND = 0.15      # every case within +-15% of its published figure
