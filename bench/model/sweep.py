"""The model sweep: tp × dp × component-DP mix × bucket × instance for every model, plus the published cases.

Kept to a few thousand cases so ``pytest bench/ --benchmark-only`` stays within its 4-minute budget. Invalid
combinations stay in the grid on purpose: the benchmark test skips them with the model's reason, so nothing
disappears silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from bench.model import calibration
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
VISION_BUCKETS = (4, 16)                                            # packed blocks per encoder call


def vision_worlds(instance: str) -> tuple[int, ...]:
    """World sizes the vision encoder is swept at on ``instance``: one chip, a quarter of the instance, the whole
    instance (vision-encoder seed: tp_size * dp_size == world_size, every rank of the deployment takes part)."""
    inst = get_instance(instance)
    return tuple(sorted({inst.ranks_per_chip, max(inst.ranks_per_chip, inst.ranks // 4), inst.ranks}))


def component_mixes(dp: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(name, (attn_dp, emb_dp, mlp_dp, lm_dp)) mixes swept at one dp.

    The component-DP seed lets each *_dp_size be any divisor of dp_size, independently (embedding and LM head too):
    beside TP-only and all-equal, the sweep takes each component alone at dp (embedding-only, LM-head-only, attention,
    MLP), the two vocabulary components together, attention + MLP, and for dp >= 4 two mixed-size mixes (so a
    _dp_transition between unequal sizes is exercised at every boundary)."""
    if dp == 1:
        return [("tp-only", (1, 1, 1, 1))]
    mixes = [("tp-only", (1, 1, 1, 1)), ("all-dp", (dp, dp, dp, dp)), ("attn-dp", (dp, 1, 1, 1)),
             ("mlp-dp", (1, 1, dp, 1)), ("emb-dp", (1, dp, 1, 1)), ("lm-dp", (1, 1, 1, dp)),
             ("vocab-dp", (1, dp, 1, dp)), ("attn-mlp-dp", (dp, 1, dp, 1))]
    if dp >= 4:
        half = dp // 2
        for sizes in ((dp, 1, half, dp), (half, dp, dp, half)):
            mixes.append((ParallelConfig(1, dp, *sizes).mix, sizes))
    return mixes


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
            for world in vision_worlds(inst):
                for tp in VISION_TP:
                    if world % tp:
                        continue
                    for blocks in VISION_BUCKETS:
                        out.append(Case(name, inst, ParallelConfig(tp, world // tp),
                                        Bucket("vision", vision_blocks=blocks)))
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
    if case.bucket.phase == "decode":
        stack = calibration.stack_of(case.published) if case.published is not None else calibration.DEFAULT_STACK
        row.update(calibration.decode_fields(res, stack))
    if case.published is not None:
        row["kind"] = "published"
        row["published"] = case.published.as_dict()
    return compact(row)


def compact(v):
    """Floats to 6 significant digits (recursively): enough for any figure here, and a much smaller JSON."""
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, dict):
        return {k: compact(x) for k, x in v.items()}
    if isinstance(v, list):
        return [compact(x) for x in v]
    return v


TABLE_KIND = "model-table"


def case_groups(all_cases: Iterable[Case]) -> dict[str, list[Case]]:
    """Cases by report group (model × phase × instance, and the published comparison), in sweep order."""
    out: dict[str, list[Case]] = {}
    for c in all_cases:
        out.setdefault(c.group, []).append(c)
    return out


def run_table(group_cases: list[Case], kernel_latency: KernelLatency | None = None) -> dict:
    """Evaluate every case of one group: one columnar table (``extra_info`` of one benchmark) plus the invalid cases
    with their reasons. One benchmark per group, not per configuration: the configurations' figures are all
    modelled, the CPU time of evaluating the formula says nothing about any of them, and per-configuration records
    of pytest-benchmark (stats, options, names) made most of a multi-MB JSON."""
    rows, skipped = [], {}
    for case, row in iter_rows(group_cases, kernel_latency):
        if isinstance(row, dict):
            rows.append({**row, "case_id": case.id})
        else:
            skipped.setdefault(row, []).append(case.id)      # {reason: [case ids]}: reasons repeat a lot
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    return {"kind": TABLE_KIND, "modelled": True, "configurations": len(rows),
            "invalid": sum(len(v) for v in skipped.values()), "columns": columns,
            "rows": [[r.get(k) for k in columns] for r in rows], "skipped": skipped}


def iter_rows(all_cases: Iterable[Case], kernel_latency: KernelLatency | None = None) -> Iterator[tuple[Case, dict |
                                                                                                      str]]:
    """(case, row) for valid cases, (case, reason) for invalid ones."""
    for case in all_cases:
        try:
            yield case, run_case(case, kernel_latency)
        except InvalidConfig as e:
            yield case, str(e)
