"""Published end-to-end decode measurements to compare the model against (never modelled; sources named).

parallel-and-perf-model.md §2.7 (AWS Neuron docs and tutorials, trn2) and kernel-anchors.md §8 (community trn3
megakernel, nkipy). ``ctx`` is the mean decode context the run implies (input + half the output) unless stated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Published:
    key: str
    model: str
    instance: str
    lnc: int
    tp: int
    batch: int
    ctx: int
    tpot_ms: float
    what: str
    setup: str
    source: str
    runtime: str = "vllm-neuron"    # software stack: vllm-neuron | nxdi | nkipy | megakernel (calibration.stack_of)

    def as_dict(self) -> dict:
        return asdict(self)


_VN = "vllm-neuron/docs/tutorials/"
_KG = "KevGomes1403/nki-moe-megakernel megakernels/gpt_oss/README.md (kernel-anchors.md §8)"
PUBLISHED: tuple[Published, ...] = (
    Published("llama70b-tp64", "Llama-3.3-70B", "trn2.48xlarge", 2, 64, 1, 10750, 19.6, "TPOT P50",
              "NxDI+vLLM, TP64, BS1, 10,000 in / 1,500 out (LLMPerf)",
              "aws-neuron-sdk libraries/nxd-inference/tutorials/llama70b_perf_comparison.csv (§2.7)", "nxdi"),
    Published("llama8b-tp8", "Llama-3.1-8B", "trn2.48xlarge", 2, 8, 2, 576, 10.52, "TPOT median",
              "vLLM Neuron, TP8, max-num-seqs 2, 512 in / 128 out, concurrency 2",
              _VN + "tutorial-eagle3-speculative-decoding-llama-3-1.md (§2.7)"),
    Published("gptoss120b-tp16", "GPT-OSS-120B", "trn2.48xlarge", 2, 16, 1, 576, 7.00, "TPOT",
              "vLLM Neuron, BF16, TP16 (TP8 does not fit), max-num-seqs 1, max-model-len 768, sonnet 512 in / 128 "
              "out (ctx 512 + 64, as llama8b-tp8)",
              _VN + "tutorial-eagle3-speculative-decoding-gpt-oss.md (§2.7)"),
    Published("gptoss20b-trn2-tp4", "GPT-OSS-20B", "trn2.48xlarge", 1, 4, 1, 1024, 18.7, "1 / decode tok/s",
              "nkipy, TP4 at LNC=1 (nkipy compiles with --lnc 1: 4 physical cores), bs1, ~52-55 tok/s (53.5 used; "
              "context not stated, 1024 assumed)",
              "aws-neuron/nkipy PR #69 (kernel-anchors.md §8)", "nkipy"),
    Published("gptoss20b-trn3-ctx640", "GPT-OSS-20B", "trn3-server", 1, 8, 1, 640, 5.88, "TKG p50 per token",
              "decode megakernel, trn3, TP8, LNC1, bf16, bs1, seq 640", _KG, "megakernel"),
    Published("gptoss20b-trn3-ctx2048", "GPT-OSS-20B", "trn3-server", 1, 8, 1, 2048, 4.92, "TKG p50 per token",
              "decode megakernel, trn3, TP8, LNC1, bf16, bs1, seq 2048", _KG, "megakernel"),
    Published("gptoss20b-trn3-ctx4096", "GPT-OSS-20B", "trn3-server", 1, 8, 1, 4096, 4.85, "TKG p50 per token",
              "decode megakernel, trn3, TP8, LNC1, bf16, bs1, seq 4096", _KG, "megakernel"),
    Published("gptoss20b-trn3-ctx8192", "GPT-OSS-20B", "trn3-server", 1, 8, 1, 8192, 4.98, "TKG p50 per token",
              "decode megakernel, trn3, TP8, LNC1, bf16, bs1, seq 8192", _KG, "megakernel"),
    Published("gptoss20b-trn3-bs4", "GPT-OSS-20B", "trn3-server", 1, 8, 4, 640, 10.53, "TKG p50 per step",
              "decode megakernel, trn3, TP8, LNC1, bs4, seq 640", _KG, "megakernel"),
    Published("gptoss20b-trn3-bs8", "GPT-OSS-20B", "trn3-server", 1, 8, 8, 640, 17.65, "TKG p50 per step",
              "decode megakernel, trn3, TP8, LNC1, bs8, seq 640", _KG, "megakernel"),
)
