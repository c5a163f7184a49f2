"""Analytical per-rank model of one inference step: memory, FLOPs, HBM bytes, collectives, three-roof time.

Scope and conventions (all results are *modelled*):

* A rank is a logical NeuronCore (LNC=2 on trn2 by default). ``world = tp * dp`` ranks; every rank is symmetric, so
  per-rank figures describe the whole deployment.
* Decode follows the component-level DP seed: each component (attention, embedding, MLP/MoE, LM head) shards its
  weights over ``tp * component_dp`` ranks and sees the batch gathered over ``component_dp`` DP replicas;
  ``_dp_transition`` inserts one all-gather when going up and a free slice when going down. ``batch`` is the decode
  batch per DP rank (the ``num_seqs`` bucket), ``ctx`` the context-length bucket.
* Prefill uses standard TP with sequence parallelism (tensor-parallelism seed), one sequence of ``prefill_len`` tokens
  per DP replica; component DP does not apply (decode only).
* Vision follows the vision-encoder seed: ``VisionNeuronConfig(tp, dp)`` with ``tp * dp = world``; packed blocks of
  ``block_size`` patches are scattered over DP and all-gathered after the mergers.
* FLOPs = 2·MAC. HBM bytes = unique bytes: local weight shard (MoE: only experts the step touches), KV-cache read and
  write, activations in/out. bf16 everywhere.
* Times: per component ``max(FLOPs / peak, bytes / HBM BW, kernel floor)``; collectives by the alpha-beta model with
  Neuron's algorithm bands. ``t_roof = max(compute, memory, collective)`` is the three-roof lower bound (GenZ) and
  names the bound; ``t_step`` = components in series + collectives exposed (decode has no overlap between a layer's
  all-reduce and the next kernel) is the modelled step latency (TPOT for decode).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.model.collectives import Collective, collective_time
from bench.model.hardware import Instance
from modules.model_specs import BF16, TextModelSpec, VisionModelSpec

GiB = 2**30
COMPONENTS = ("embedding", "attention", "mlp", "lm_head")

KernelLatency = Callable[[str, dict], "float | None"]


class InvalidConfig(ValueError):
    """The combination cannot be deployed; the message says why (the sweep skips it with this reason)."""


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    dp: int = 1
    attn_dp: int = 1
    emb_dp: int = 1
    mlp_dp: int = 1
    lm_dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def mix(self) -> str:
        sizes = (self.attn_dp, self.emb_dp, self.mlp_dp, self.lm_dp)
        if all(s == 1 for s in sizes):
            return "tp-only"
        return f"a{self.attn_dp}-e{self.emb_dp}-m{self.mlp_dp}-l{self.lm_dp}"


@dataclass(frozen=True)
class Bucket:
    phase: str                  # "decode" | "prefill" | "vision"
    batch: int = 1              # decode: sequences per DP rank
    ctx: int = 0                # decode: context length bucket
    prefill_len: int = 0        # prefill: tokens per sequence
    vision_blocks: int = 0      # vision: packed blocks per encoder call
    # vision: (query, key) pairs the attention computes per head on the busiest rank; 0 = every block in full
    # (block_size² per block, a dense mask). A bounds-skipping kernel computes only the tiles its images cover.
    vision_attn_pairs: int = 0

    def label(self) -> str:
        if self.phase == "decode":
            return f"decode b{self.batch} ctx{self.ctx}"
        if self.phase == "prefill":
            return f"prefill {self.prefill_len}"
        return f"vision {self.vision_blocks} blocks"


@dataclass
class ComponentCost:
    name: str
    flops: float = 0.0
    bytes: float = 0.0
    count: int = 1              # kernel launches per step (layers for per-layer components)
    t_compute: float = 0.0
    t_memory: float = 0.0
    t_kernel: float = 0.0       # the time used in the step (max of roofs and floor, or nkisim's modelled latency)
    source: str = "roofline"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class StepResult:
    model: str
    instance: str
    target: str
    lnc: int
    config: ParallelConfig
    bucket: Bucket
    world: int
    chips: float
    layers: int
    mem_weights: float
    mem_kv: float
    mem_act: float
    mem_capacity: float
    components: list[ComponentCost] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    tokens_per_step: float = 0.0    # tokens produced (decode) or consumed (prefill, vision patches) per step, all ranks

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def mem_total(self) -> float:
        return self.mem_weights + self.mem_kv + self.mem_act

    @property
    def fits(self) -> bool:
        return self.mem_total <= self.mem_capacity

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.components)

    @property
    def hbm_bytes(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def t_compute(self) -> float:
        return sum(c.t_compute for c in self.components)

    @property
    def t_memory(self) -> float:
        return sum(c.t_memory for c in self.components)

    def collective_multiplier(self, c: Collective) -> int:
        return self.layers if c.per_layer else 1

    @property
    def t_collective(self) -> float:
        return sum(c.time_s * self.collective_multiplier(c) for c in self.collectives)

    @property
    def t_roof(self) -> float:
        return max(self.t_compute, self.t_memory, self.t_collective)

    @property
    def bound(self) -> str:
        roofs = {"compute": self.t_compute, "memory": self.t_memory, "collective": self.t_collective}
        return max(roofs, key=roofs.get)

    @property
    def t_step(self) -> float:
        return sum(c.t_kernel for c in self.components) + self.t_collective

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens_per_step / self.t_step / self.chips if self.t_step > 0 else 0.0

    def layer_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.per_layer and c.n > 1]

    def as_dict(self) -> dict:
        """Flat, JSON-serialisable record (pytest-benchmark ``extra_info``). Every figure is modelled."""
        cfg, b = self.config, self.bucket
        layer_coll = self.layer_collectives()
        return {
            "kind": "model", "modelled": True, "phase": b.phase, "model": self.model, "instance": self.instance,
            "target": self.target, "lnc": self.lnc, "tp": cfg.tp, "dp": cfg.dp, "attn_dp": cfg.attn_dp,
            "emb_dp": cfg.emb_dp, "mlp_dp": cfg.mlp_dp, "lm_dp": cfg.lm_dp, "mix": cfg.mix,
            "batch": b.batch, "ctx": b.ctx, "prefill_len": b.prefill_len, "vision_blocks": b.vision_blocks,
            "bucket": b.label(), "world": self.world, "chips": self.chips, "layers": self.layers,
            "mem_weights_gib": self.mem_weights / GiB, "mem_kv_gib": self.mem_kv / GiB,
            "mem_act_gib": self.mem_act / GiB, "mem_total_gib": self.mem_total / GiB,
            "mem_capacity_gib": self.mem_capacity / GiB, "fits": self.fits,
            "flops": self.flops, "hbm_bytes": self.hbm_bytes,
            "ai": self.flops / self.hbm_bytes if self.hbm_bytes else 0.0,
            "t_compute_us": self.t_compute * 1e6, "t_memory_us": self.t_memory * 1e6,
            "t_collective_us": self.t_collective * 1e6, "t_roof_us": self.t_roof * 1e6,
            "t_step_us": self.t_step * 1e6, "bound": self.bound,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
            "n_collectives_per_layer": len(layer_coll),
            "collective_bytes_per_layer": sum(c.bytes for c in layer_coll),
            "n_collectives_per_step": sum(self.collective_multiplier(c) for c in self.collectives if c.n > 1),
            "kernel_sources": sorted({c.name for c in self.components if c.source != "roofline"}),
            # per-component kernel time and the exposed collective time split; the full lists (every collective
            # with its algorithm) stay on the StepResult: one row per configuration keeps the JSON small
            "kernel_us": {c.name: c.t_kernel * 1e6 for c in self.components},
            "coll_layer_us": sum(c.time_s * self.layers for c in self.collectives if c.per_layer) * 1e6,
            "coll_other_us": sum(c.time_s for c in self.collectives if not c.per_layer) * 1e6,
        }


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------
def _neuron_config_check(cfg: ParallelConfig) -> None:
    """Validate with modules.config.NeuronConfig (the seeds' rules) when it is importable, else the same rules here."""
    try:
        from modules.config import NeuronConfig
    except ImportError:  # modules layer unavailable (e.g. torch missing): same rules, inline
        NeuronConfig = None
    if NeuronConfig is not None:
        try:
            NeuronConfig(tp_size=cfg.tp, dp_size=cfg.dp, attention_dp_size=cfg.attn_dp,
                         embedding_dp_size=cfg.emb_dp, mlp_dp_size=cfg.mlp_dp, lm_head_dp_size=cfg.lm_dp)
        except ValueError as e:
            raise InvalidConfig(str(e)) from None
        return
    for name, v in (("tp_size", cfg.tp), ("dp_size", cfg.dp)):
        if v < 1:
            raise InvalidConfig(f"{name} must be a positive integer, got {v}")
    for name, v in (("attention_dp_size", cfg.attn_dp), ("embedding_dp_size", cfg.emb_dp),
                    ("mlp_dp_size", cfg.mlp_dp), ("lm_head_dp_size", cfg.lm_dp)):
        if v < 1 or cfg.dp % v:
            raise InvalidConfig(f"{name}={v} must divide dp_size={cfg.dp}")


def validate_text(model: TextModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket) -> None:
    _neuron_config_check(cfg)
    if cfg.world > inst.ranks:
        raise InvalidConfig(f"tp*dp={cfg.world} exceeds {inst.ranks} ranks of {inst.name} (LNC={inst.lnc})")
    if model.heads % cfg.tp:
        raise InvalidConfig(f"tp={cfg.tp} does not divide num_attention_heads={model.heads}")
    if model.kv_heads >= cfg.tp and model.kv_heads % cfg.tp:
        raise InvalidConfig(f"tp={cfg.tp} does not divide num_key_value_heads={model.kv_heads}")
    if model.kv_heads < cfg.tp and cfg.tp % model.kv_heads:
        raise InvalidConfig(f"KV replication needs tp={cfg.tp} to be a multiple of num_key_value_heads="
                            f"{model.kv_heads}")
    if bucket.phase == "decode":
        if cfg.tp * cfg.attn_dp > model.heads or model.heads % (cfg.tp * cfg.attn_dp):
            raise InvalidConfig(f"tp*attention_dp_size={cfg.tp * cfg.attn_dp} must divide num_attention_heads="
                                f"{model.heads} (attention DP shards Q heads over TP x attn_dp)")
        if bucket.batch < 1 or bucket.ctx < 1:
            raise InvalidConfig(f"decode bucket needs batch >= 1 and ctx >= 1, got {bucket}")
    elif bucket.phase == "prefill":
        if cfg.mix != "tp-only":
            raise InvalidConfig("component DP sizes apply to decode only (prefill uses standard TP)")
        if bucket.prefill_len < 1 or bucket.prefill_len % cfg.tp:
            raise InvalidConfig(f"prefill_len={bucket.prefill_len} must be divisible by tp={cfg.tp} "
                                "(sequence parallel)")
    else:
        raise InvalidConfig(f"phase {bucket.phase!r} is not a text-model phase")


def validate_vision(model: VisionModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket) -> None:
    if bucket.phase != "vision":
        raise InvalidConfig(f"{model.name} only runs the vision phase, got {bucket.phase!r}")
    if cfg.mix != "tp-only":
        raise InvalidConfig("component DP sizes do not apply to the vision encoder")
    try:
        from modules.config import VisionNeuronConfig
    except ImportError:  # modules layer unavailable (e.g. torch missing): the checks below still apply
        VisionNeuronConfig = None
    if VisionNeuronConfig is not None:
        try:
            VisionNeuronConfig(tp_size=cfg.tp, dp_size=cfg.dp).resolve_tp_dp(cfg.world)
        except ValueError as e:
            raise InvalidConfig(str(e)) from None
    if cfg.world > inst.ranks:
        raise InvalidConfig(f"tp*dp={cfg.world} exceeds {inst.ranks} ranks of {inst.name} (LNC={inst.lnc})")
    if model.heads % cfg.tp:
        raise InvalidConfig(f"vision tp={cfg.tp} does not divide num_heads={model.heads}")
    if bucket.vision_blocks < 1:
        raise InvalidConfig(f"vision_blocks must be >= 1, got {bucket.vision_blocks}")


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def kv_heads_per_rank(model: TextModelSpec, tp: int) -> int:
    """KV heads a rank holds under TP: kv/tp, or 1 when tp > kv (each KV head replicated tp/kv times)."""
    return max(1, model.kv_heads // tp)


def expected_experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """E·(1 − (1 − k/E)^T): distinct experts a step reads when T tokens route uniformly at random."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


class _Builder:
    def __init__(self, inst: Instance, kernel_latency: KernelLatency | None):
        self.inst = inst
        self.kernel_latency = kernel_latency
        self.components: dict[str, ComponentCost] = {}
        self.collectives: list[Collective] = []

    def add(self, name: str, flops: float, nbytes: float, count: int = 1, shape: dict | None = None) -> None:
        """Add ``count`` launches of one kernel of this component (``flops``/``nbytes`` are totals over them)."""
        inst = self.inst
        tc, tm = flops / inst.rank_flops, nbytes / inst.rank_hbm_bw
        t, source = max(tc, tm, count * inst.kernel_min_s), "roofline"
        if self.kernel_latency is not None and shape is not None:
            modelled = self.kernel_latency(name, {**shape, "target": inst.target, "lnc": inst.lnc})
            if modelled is not None:
                t, source = modelled * count, "nkisim"
        c = self.components.get(name)
        if c is None:
            self.components[name] = ComponentCost(name, flops, nbytes, count, tc, tm, t, source)
        else:
            c.flops += flops
            c.bytes += nbytes
            c.t_compute += tc
            c.t_memory += tm
            c.t_kernel += t
            c.count += count
            if source != "roofline":
                c.source = source

    def coll(self, where: str, op: str, group: str, n: int, nbytes: float, per_layer: bool, stride: int = 1) -> None:
        """Record one collective over ``n`` ranks spaced ``stride`` apart (DP columns: stride = tp)."""
        spans = self.inst.spans_chips((n - 1) * stride + 1)
        t, alg = collective_time(op, n, nbytes, self.inst.collectives, spans_chips=spans)
        self.collectives.append(Collective(where, op, group, n, float(nbytes), per_layer, alg, t, spans))


# ---------------------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------------------
def _attention_weights_local(model: TextModelSpec, tp: int, a: int) -> tuple[float, int, int]:
    """(params per rank, q heads per rank, kv heads of the K/V weight shard) under attention DP ``a``."""
    h, hd = model.hidden, model.head_dim
    nq = model.heads // (tp * a)
    if model.kv_heads <= tp:                       # Q-only mode: K/V sharded over TP only
        kvw = kv_heads_per_rank(model, tp)
    elif model.kv_heads % (tp * a) == 0:           # Q+K+V mode
        kvw = model.kv_heads // (tp * a)
    else:
        kvw = model.kv_heads // tp
    params = 2 * h * nq * hd + 2 * h * kvw * hd
    if model.attention_bias:
        params += nq * hd + 2 * kvw * hd + h
    if model.sliding_window:
        params += nq
    return params, nq, kvw


def _mlp_local_params(model: TextModelSpec, shards: int) -> tuple[float, float]:
    """(params per expert-or-dense-MLP per rank, replicated router params)."""
    h, i = model.hidden, model.intermediate
    if model.is_moe:
        per_expert = 3 * h * i / shards + 2 * i / shards + h
        return per_expert, h * model.experts + model.experts
    return 3 * h * i / shards, 0.0


def _ctx_per_layer(model: TextModelSpec, ctx: int) -> list[tuple[int, int]]:
    """[(layers, effective context)]: GPT-OSS sliding layers attend to at most ``sliding_window`` tokens."""
    if model.sliding_window:
        slide = model.sliding_layers()
        return [(model.layers - slide, ctx), (slide, min(ctx, model.sliding_window))]
    return [(model.layers, ctx)]


def evaluate_decode(model: TextModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket,
                    kernel_latency: KernelLatency | None = None) -> StepResult:
    validate_text(model, inst, cfg, bucket)
    tp, a, e, m, lm = cfg.tp, cfg.attn_dp, cfg.emb_dp, cfg.mlp_dp, cfg.lm_dp
    B, ctx, h, hd, V, L = bucket.batch, bucket.ctx, model.hidden, model.head_dim, model.vocab, model.layers
    Ta, Te, Tm, Tl = B * a, B * e, B * m, B * lm
    kvh = kv_heads_per_rank(model, tp)
    bld = _Builder(inst, kernel_latency)

    # ---- weights per rank ----
    attn_params, nq, kvw = _attention_weights_local(model, tp, a)
    per_expert, router = _mlp_local_params(model, tp * m)
    mlp_params = (model.experts * per_expert + router) if model.is_moe else per_expert
    norms = 2 * h
    emb_params = V * h / (tp * e)
    lm_params = V * h / (tp * lm)
    mem_weights = BF16 * (L * (attn_params + mlp_params + norms) + emb_params + lm_params + h)

    # ---- KV cache per rank: own batch, KV heads sharded over TP (replicated when tp > kv) ----
    kv_tokens = sum(n * c for n, c in _ctx_per_layer(model, ctx))  # sliding layers keep a rolling window
    mem_kv = BF16 * 2 * kvh * hd * B * kv_tokens

    # ---- activations (peak working set of one component) ----
    i_local = model.intermediate / (tp * m)
    kfac = model.top_k if model.is_moe else 1
    act = max(Ta * (4 * h + 2 * nq * hd + 2 * kvw * hd), Tm * (4 * h + 3 * i_local * kfac),
              Tl * (2 * h + 2 * V / (tp * lm)))
    mem_act = BF16 * act

    # ---- embedding ----
    bld.coll("embedding", "all_gather", "emb_dp_col", e, B * e * 4, per_layer=False, stride=tp)
    bld.add("embedding", 0.0, BF16 * 2 * Te * h, shape=dict(tokens=Te, hidden=h))
    bld.coll("embedding", "all_reduce", "emb_tp", tp * e, BF16 * Te * h, per_layer=False)
    if m > e:
        bld.coll("embedding", "all_gather", "mlp_dp_col", m, BF16 * B * m * h, per_layer=False, stride=tp)

    # ---- decoder layers ----
    if a > m:
        bld.coll("layer.mlp->attn", "all_gather", "attn_dp_col", a, BF16 * B * a * h, per_layer=True, stride=tp)
    q_o_params = 2 * h * nq * hd
    kv_proj_tokens = B if model.kv_heads <= tp else Ta
    for n_layers, ctx_eff in _ctx_per_layer(model, ctx):
        if n_layers == 0:
            continue
        flops = (2 * Ta * q_o_params + 2 * kv_proj_tokens * 2 * h * kvw * hd
                 + 4 * B * (model.heads // tp) * hd * ctx_eff)
        nbytes = (BF16 * attn_params + BF16 * B * ctx_eff * 2 * kvh * hd + BF16 * B * 2 * kvh * hd
                  + BF16 * 2 * Ta * h)
        # the fused decode-attention kernel's shape (a nkisim latency can replace the roofline; not under attn DP)
        shape = dict(batch=B, ctx=ctx_eff, q_heads=model.heads // tp, kv_heads=kvh, head_dim=hd, hidden=h)
        bld.add("attention", flops * n_layers, nbytes * n_layers, count=n_layers, shape=shape if a == 1 else None)
    if a > 1:
        a2a = BF16 * Ta * nq * hd
        bld.coll("layer.attention", "all_to_all", "attn_dp_col", a, a2a, per_layer=True, stride=tp)
        bld.coll("layer.attention", "all_to_all", "attn_dp_col", a, a2a, per_layer=True, stride=tp)
    bld.coll("layer.attention", "all_reduce", "attn_tp", tp * a, BF16 * Ta * h, per_layer=True)
    if m > a:
        bld.coll("layer.attn->mlp", "all_gather", "mlp_dp_col", m, BF16 * B * m * h, per_layer=True, stride=tp)
    if model.is_moe:
        touched = expected_experts_touched(model.experts, model.top_k, Tm)
        flops = 2 * Tm * model.top_k * 3 * h * model.intermediate / (tp * m) + 2 * Tm * h * model.experts
        nbytes = BF16 * (touched * per_expert + router) + BF16 * 2 * Tm * h
    else:
        flops = 2 * Tm * mlp_params
        nbytes = BF16 * mlp_params + BF16 * 2 * Tm * h
    bld.add("mlp", flops * L, nbytes * L, count=L,
            shape=dict(tokens=Tm, hidden=h, intermediate=i_local, experts=model.experts, top_k=model.top_k))
    bld.coll("layer.mlp", "all_reduce", "mlp_tp", tp * m, BF16 * Tm * h, per_layer=True)

    # ---- LM head with on-device greedy sampling (distributed argmax over the vocab shards) ----
    bld.coll("lm_head", "all_gather", "lm_dp_col", lm, BF16 * Tl * h, per_layer=False, stride=tp)
    bld.add("lm_head", 2 * Tl * lm_params, BF16 * (lm_params + Tl * h + 2 * Tl * V / (tp * lm)),
            shape=dict(tokens=Tl, hidden=h, vocab_local=V / (tp * lm)))
    bld.coll("lm_head", "all_gather", "lm_tp", tp * lm, 8 * Tl * tp * lm, per_layer=False)

    return StepResult(model.name, inst.name, inst.target, inst.lnc, cfg, bucket, cfg.world,
                      inst.chips_for(cfg.world), L, mem_weights, mem_kv, mem_act, inst.rank_hbm_bytes,
                      list(bld.components.values()), bld.collectives, tokens_per_step=B * cfg.dp)


def legacy_decode_layer_collectives(model: TextModelSpec, inst: Instance, cfg: ParallelConfig,
                                    batch: int) -> list[Collective]:
    """Per-layer decode collectives *before* component-level DP, as the seed lists them (7 ops per layer):

    attention: AG over the DP column + RS + TP all-reduce; MLP: AG over the DP column + slice + TP-super all-reduce.
    The slice moves no data (op "slice", zero time) but is one of the seed's seven.
    """
    bld = _Builder(inst, None)
    a, m, tp, h, B = cfg.attn_dp, cfg.mlp_dp, cfg.tp, model.hidden, batch
    bld.coll("layer.attention", "all_gather", "attn_dp_col", a, BF16 * B * a * h, True, stride=tp)
    bld.coll("layer.attention", "reduce_scatter", "attn_dp_col", a, BF16 * B * a * h, True, stride=tp)
    bld.coll("layer.attention", "all_reduce", "tp", tp, BF16 * B * h, True)
    bld.coll("layer.mlp", "all_gather", "mlp_dp_col", m, BF16 * B * m * h, True, stride=tp)
    out = list(bld.collectives)
    out.append(Collective("layer.mlp", "slice", "local", 1, 0.0, True, "none", 0.0, False))
    bld.collectives = []
    bld.coll("layer.mlp", "all_reduce", "mlp_tp_super", tp * m, BF16 * B * m * h, True)
    return out + bld.collectives


# ---------------------------------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------------------------------
def evaluate_prefill(model: TextModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket,
                     kernel_latency: KernelLatency | None = None) -> StepResult:
    validate_text(model, inst, cfg, bucket)
    tp, T, h, hd, V, L = cfg.tp, bucket.prefill_len, model.hidden, model.head_dim, model.vocab, model.layers
    kvh = kv_heads_per_rank(model, tp)
    bld = _Builder(inst, kernel_latency)
    attn_params, nq, kvw = _attention_weights_local(model, tp, 1)
    per_expert, router = _mlp_local_params(model, tp)
    mlp_params = (model.experts * per_expert + router) if model.is_moe else per_expert
    emb_params = lm_params = V * h / tp
    mem_weights = BF16 * (L * (attn_params + mlp_params + 2 * h) + emb_params + lm_params + h)
    kv_tokens = sum(n * c for n, c in _ctx_per_layer(model, T))
    mem_kv = BF16 * 2 * kvh * hd * kv_tokens
    i_local = model.intermediate / tp
    kfac = model.top_k if model.is_moe else 1
    mem_act = BF16 * T * max(4 * h + 2 * nq * hd + 2 * kvw * hd, 4 * h + 3 * i_local * kfac)

    bld.add("embedding", 0.0, BF16 * 2 * T * h, shape=dict(tokens=T, hidden=h))
    bld.coll("embedding", "reduce_scatter", "tp", tp, BF16 * T * h, per_layer=False)
    for n_layers, window in _ctx_per_layer(model, T):
        if n_layers == 0:
            continue
        # causal attention pairs: T(T+1)/2 for full layers, ≈ T·w for a sliding window w < T
        pairs = T * (T + 1) / 2 if window >= T else T * window - window * (window - 1) / 2
        flops = 2 * T * attn_params + 4 * (model.heads // tp) * hd * pairs
        nbytes = BF16 * attn_params + BF16 * T * 2 * kvh * hd + BF16 * T * (2 * h + 2 * nq * hd + 2 * kvw * hd)
        bld.add("attention", flops * n_layers, nbytes * n_layers, count=n_layers,
                shape=dict(seq=T, q_heads=nq, kv_heads=kvh, head_dim=hd, hidden=h, window=window, phase="prefill"))
    bld.coll("prefill.layer.attention", "all_gather", "tp", tp, BF16 * T * h, per_layer=True)
    bld.coll("prefill.layer.attention", "reduce_scatter", "tp", tp, BF16 * T * h, per_layer=True)
    bld.coll("prefill.layer.mlp", "all_gather", "tp", tp, BF16 * T * h, per_layer=True)
    if model.is_moe:
        bld.coll("prefill.layer.mlp", "all_gather", "tp", tp, 4 * T * model.experts, per_layer=True)
        touched = expected_experts_touched(model.experts, model.top_k, T)
        flops = 2 * T * model.top_k * 3 * h * i_local + 2 * (T / tp) * h * model.experts
        nbytes = BF16 * (touched * per_expert + router) + BF16 * T * (2 * h + 3 * i_local * model.top_k)
    else:
        flops = 2 * T * mlp_params
        nbytes = BF16 * mlp_params + BF16 * T * (2 * h + 3 * i_local)
    bld.add("mlp", flops * L, nbytes * L, count=L, shape=dict(tokens=T, hidden=h, intermediate=i_local,
                                                               experts=model.experts, phase="prefill"))
    bld.coll("prefill.layer.mlp", "reduce_scatter", "tp", tp, BF16 * T * h, per_layer=True)
    bld.coll("prefill.final", "all_gather", "tp", tp, BF16 * T * h, per_layer=False)
    bld.add("lm_head", 2 * lm_params, BF16 * (lm_params + h + V / tp), shape=dict(tokens=1, hidden=h))
    bld.coll("lm_head", "all_gather", "tp", tp, 8 * tp, per_layer=False)
    return StepResult(model.name, inst.name, inst.target, inst.lnc, cfg, bucket, cfg.world,
                      inst.chips_for(cfg.world), L, mem_weights, mem_kv, mem_act, inst.rank_hbm_bytes,
                      list(bld.components.values()), bld.collectives, tokens_per_step=T * cfg.dp)


# ---------------------------------------------------------------------------------------------------------------------
# vision encoder
# ---------------------------------------------------------------------------------------------------------------------
def evaluate_vision(model: VisionModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket,
                    kernel_latency: KernelLatency | None = None) -> StepResult:
    validate_vision(model, inst, cfg, bucket)
    tp, dp, h, L = cfg.tp, cfg.dp, model.hidden, model.layers
    blocks = math.ceil(bucket.vision_blocks / dp) * dp          # padded to a multiple of dp (seed: block padding)
    T = blocks // dp * model.block_size                         # patches per rank
    merged = T // model.spatial_merge**2
    n_mergers = 1 + model.deepstack_mergers
    bld = _Builder(inst, kernel_latency)
    layer_params = model.layer_params() / tp
    merger_params = model.merger_params() / tp
    embed_params = model.patch_dim * h + h + model.num_position_embeddings * h
    mem_weights = BF16 * (L * layer_params + n_mergers * merger_params + embed_params)
    mem_act = BF16 * T * (4 * h + 3 * h / tp + model.intermediate / tp)

    bld.add("embedding", 2 * T * model.patch_dim * h, BF16 * (embed_params + T * (model.patch_dim + 2 * h)),
            shape=dict(tokens=T, hidden=h))
    heads = model.heads // tp
    pairs = bucket.vision_attn_pairs or T * model.block_size                  # block-diagonal attention
    flops = 2 * T * layer_params + 4 * heads * model.head_dim * pairs
    nbytes = BF16 * layer_params + BF16 * T * (6 * h + 2 * model.intermediate / tp)
    bld.add("attention", flops * L, nbytes * L, count=L,
            shape=dict(tokens=T, heads=heads, head_dim=model.head_dim, block=model.block_size, phase="vision"))
    bld.coll("vision.layer.attention", "all_reduce", "vision_tp", tp, BF16 * T * h, per_layer=True)
    bld.coll("vision.layer.mlp", "all_reduce", "vision_tp", tp, BF16 * T * h, per_layer=True)
    bld.add("lm_head", 2 * merged * model.merger_params() / tp * n_mergers,
            BF16 * n_mergers * (merger_params + merged * (h * model.spatial_merge**2 + model.out_hidden)),
            count=n_mergers, shape=dict(tokens=merged, phase="vision-merger"))
    for _ in range(n_mergers):
        bld.coll("vision.merger", "all_reduce", "vision_tp", tp, BF16 * merged * model.out_hidden, per_layer=False)
    bld.coll("vision.gather", "all_gather", "vision_dp", dp,
             BF16 * blocks * (model.block_size // model.spatial_merge**2) * model.out_hidden * n_mergers,
             per_layer=False, stride=tp)
    res = StepResult(model.name, inst.name, inst.target, inst.lnc, cfg, bucket, cfg.world,
                     inst.chips_for(cfg.world), L, mem_weights, 0.0, mem_act, inst.rank_hbm_bytes,
                     list(bld.components.values()), bld.collectives,
                     tokens_per_step=bucket.vision_blocks * model.block_size)
    # rename for the report: the vision "lm_head" slot holds the patch mergers
    for c in res.components:
        if c.name == "lm_head":
            c.name = "merger"
        elif c.name == "embedding":
            c.name = "patch_embed"
    return res


def evaluate(model: TextModelSpec | VisionModelSpec, inst: Instance, cfg: ParallelConfig, bucket: Bucket,
             kernel_latency: KernelLatency | None = None) -> StepResult:
    """Dispatch on the bucket's phase. Raises InvalidConfig (with the reason) for invalid combinations."""
    if isinstance(model, VisionModelSpec):
        return evaluate_vision(model, inst, cfg, bucket, kernel_latency)
    if bucket.phase == "decode":
        return evaluate_decode(model, inst, cfg, bucket, kernel_latency)
    if bucket.phase == "prefill":
        return evaluate_prefill(model, inst, cfg, bucket, kernel_latency)
    raise InvalidConfig(f"{model.name} has no {bucket.phase!r} phase")
