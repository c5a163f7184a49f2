"""The model sweep: tp × dp × component-DP mix × bucket × instance for every model, plus the published cases.

Kept to ~2,300 cases so ``pytest bench/ --benchmark-only`` stays far under 10 minutes. Invalid combinations stay in
the grid on purpose: the benchmark test skips them with the model's reason, so nothing disappears silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from bench.model.analytical import Bucket, InvalidConfig, KernelLatency, ParallelConfig, evaluate
from bench.model.hardware import get_instance
from bench.model.published import PUBLISHED, Published
from modules.model_specs import ALL_MODELS, TEXT_MODELS, VISION_MODELS

INSTANCES = ("trn2.48xlarge", "trn3-server")
TEXT_TP = (4, 8, 16, 32, 64)
TEXT_DP = (1, 2, 4)
DECODE_BATCHES = (1, 8, 64)                                         # num_seqs bucket per DP rank
DECODE_CONTEXTS = (2048, 8192)                                      # decode context-length buckets
DECODE_BUCKETS = tuple((b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES)
PREFILL_BUCKETS = (2048, 8192)
VISION_TP = (1, 2, 4, 8, 16)
VISION_DP = (1, 2, 4, 8)
VISION_BUCKETS = (4, 16)                                            # packed blocks per encoder call


def component_mixes(dp: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(name, (attn_dp, emb_dp, mlp_dp, lm_dp)) mixes swept at one dp."""
    if dp == 1:
        return [("tp-only", (1, 1, 1, 1))]
    return [("tp-only", (1, 1, 1, 1)), ("all-dp", (dp, dp, dp, dp)), ("attn-dp", (dp, 1, 1, 1)),
            ("mlp-dp", (1, 1, dp, 1))]


@dataclass(frozen=True)
class Case:
    model: str
    instance: str
    config: ParallelConfig
    bucket: Bucket
    mix_name: str = "tp-only"
    lnc: int | None = None
    published: Published | None = None

    @property
    def id(self) -> str:
        c, b = self.config, self.bucket
        if self.published is not None:
            return f"published-{self.published.key}"
        tail = {"decode": f"b{b.batch}-ctx{b.ctx}", "prefill": f"len{b.prefill_len}",
                "vision": f"blocks{b.vision_blocks}"}[b.phase]
        return f"{b.phase}-{self.model}-{self.instance}-tp{c.tp}-dp{c.dp}-{self.mix_name}-{tail}"

    @property
    def group(self) -> str:
        if self.published is not None:
            return "model:published-comparison"
        return f"model:{self.model}:{self.bucket.phase}:{self.instance}"

    def params(self) -> dict:
        c, b = self.config, self.bucket
        return {"model": self.model, "instance": self.instance, "phase": b.phase, "tp": c.tp, "dp": c.dp,
                "mix": self.mix_name, "bucket": b.label()}


def cases() -> list[Case]:
    out: list[Case] = []
    for inst in INSTANCES:
        for name in TEXT_MODELS:
            for tp in TEXT_TP:
                for dp in TEXT_DP:
                    for mix_name, (a, e, m, lm) in component_mixes(dp):
                        cfg = ParallelConfig(tp, dp, a, e, m, lm)
                        for batch, ctx in DECODE_BUCKETS:
                            out.append(Case(name, inst, cfg, Bucket("decode", batch=batch, ctx=ctx), mix_name))
            for tp in TEXT_TP:
                for length in PREFILL_BUCKETS:
                    out.append(Case(name, inst, ParallelConfig(tp), Bucket("prefill", prefill_len=length)))
        for name in VISION_MODELS:
            for tp in VISION_TP:
                for dp in VISION_DP:
                    for blocks in VISION_BUCKETS:
                        out.append(Case(name, inst, ParallelConfig(tp, dp), Bucket("vision", vision_blocks=blocks)))
    return out


def published_cases() -> list[Case]:
    return [Case(p.model, p.instance, ParallelConfig(p.tp), Bucket("decode", batch=p.batch, ctx=p.ctx),
                 lnc=p.lnc, published=p) for p in PUBLISHED]


def run_case(case: Case, kernel_latency: KernelLatency | None = None) -> dict:
    """Evaluate one case; the flat record for ``extra_info``. Raises InvalidConfig with the reason."""
    inst = get_instance(case.instance, case.lnc)
    res = evaluate(ALL_MODELS[case.model], inst, case.config, case.bucket, kernel_latency)
    row = res.as_dict()
    row["mix"] = case.mix_name if case.published is None else "tp-only"
    if case.published is not None:
        row["kind"] = "published"
        row["published"] = case.published.as_dict()
    return row


def iter_rows(all_cases: Iterable[Case], kernel_latency: KernelLatency | None = None) -> Iterator[tuple[Case, dict |
                                                                                                      str]]:
    """(case, row) for valid cases, (case, reason) for invalid ones."""
    for case in all_cases:
        try:
            yield case, run_case(case, kernel_latency)
        except InvalidConfig as e:
            yield case, str(e)
