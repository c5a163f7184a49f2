"""Decoder-only text models as a serving stack calls them: one prefill graph (plain TP, sequence parallel) and one
decode graph (component DP), each with its own per-rank weight slices loaded from one HF checkpoint
(disaggregated inference: the two graphs shard differently, so they load separately).

Prefill (the TP seed), one sequence per call, T tokens padded to the prefill bucket (T > tp and T % tp == 0):
  embedding → reduce-scatter into SP [T/tp, H] → layers (attention: AG … RS; MLP: AG … RS) → final norm →
  all-gather [T, H] → the last real token → LM head (vocab over TP) → greedy sample without gathering logits.
  Writes the sequence's KV cache slot.

Decode (the component-DP seed), one new token for each of this replica's B_local sequences:
  all-gather input_ids over the embedding DP column → embedding (embedding component TP all-reduce) →
  dp_transition(emb → mlp) once → layers (`decoder_layer_decode`: transition mlp→attn, attention partial +
  attention component TP all-reduce, transition attn→mlp, MLP partial + MLP component TP all-reduce) → norm →
  slice to the local batch → index_select(sampling_positions) → all-gather over the LM-head DP column → LM head
  (LM-head component TP group) → greedy sample → slice back to the local batch.
  ``flow="unoptimised"`` runs the pre-optimisation layer (data at the local batch between modules: AG + RS +
  TP-AR for attention, AG + super-AR + slice for the MLP) with the same weights, for comparison.

The KV cache of a rank holds its own replica's sequences and the KV heads of its TP position; prefill (TP rank t
of replica d) and decode (TP position t of replica d) agree on both, so a prefilled cache is decoded in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modules.layers.embedding import VocabDimShardedEmbedding
from modules.layers.norm import RMSNorm
from modules.loading.checkpoint import SafetensorsCheckpoint
from modules.model_specs import TextModelSpec
from modules.models import hf_layout as hf
from modules.models.attention_blocks import DecodeAttentionDP, PrefillAttention
from modules.models.lm_head import ShardedLMHead
from modules.parallel.heads import shard_heads
from modules.parallel.patterns import decoder_layer_decode
from modules.parallel.state import ParallelState
from modules.parallel.transition import dp_transition

FLOWS = ("optimised", "unoptimised")

# mlp_factory(spec, layer, tp_group, eps, dtype) -> module with .partial(x) (decode) and .forward_sp(x) (prefill)
MLPFactory = Callable[[TextModelSpec, int, object, float, torch.dtype], nn.Module]
# mlp_mappings(spec, layer) -> {param name inside the MLP module: checkpoint key or role → key}
MLPMappings = Callable[[TextModelSpec, int], dict]


@dataclass
class KVCache:
    """Per layer (k, v), each [batch, kv_heads of this TP position, S_max, head_dim] (the decode kernel's layout)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: TextModelSpec, tp_size: int, batch: int, s_max: int, dtype: torch.dtype) -> KVCache:
        kv = shard_heads(spec.heads, spec.kv_heads, spec.head_dim, tp_size).kv_heads_per_rank
        shape = (batch, kv, s_max, spec.head_dim)
        return cls([torch.zeros(shape, dtype=dtype) for _ in range(spec.layers)],
                   [torch.zeros(shape, dtype=dtype) for _ in range(spec.layers)])

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def s_max(self) -> int:
        return self.k[0].shape[2]

    def rows(self, n: int) -> KVCache:
        """The first n sequence slots (views: updates land in this cache)."""
        if n > self.batch:
            raise ValueError(f"KVCache: {n} sequences do not fit a cache of batch {self.batch}")
        return KVCache([k[:n] for k in self.k], [v[:n] for v in self.v])


def _attention_mappings(spec: TextModelSpec, i: int, prefix: str, prefill: bool) -> dict:
    a, n = hf.attention_keys(i), hf.norm_keys(i)
    m = {f"{prefix}.norm.weight": n["input"]}
    if prefill:
        m[f"{prefix}.qkv_proj.weight"] = {r: a[r] for r in ("q", "k", "v")}
        m[f"{prefix}.o_proj.weight"] = a["o"]
    else:
        m.update({f"{prefix}.{r}_weight": a[r] for r in ("q", "k", "v", "o")})
    if spec.attention_bias:
        b = hf.attention_bias_keys(i)
        if prefill:
            m[f"{prefix}.qkv_proj.bias"] = {r: b[r] for r in ("q", "k", "v")}
            m[f"{prefix}.o_proj.bias"] = b["o"]
        else:
            m.update({f"{prefix}.{r}_bias": b[r] for r in ("q", "k", "v", "o")})
    if spec.sliding_window:
        m[f"{prefix}.sinks"] = hf.sinks_key(i)
    return m


class _Model(nn.Module):
    """What prefill and decode share: embedding, layers, final norm, LM head, checkpoint mappings and loading."""

    prefill: bool

    def __init__(self, spec: TextModelSpec, embed_group, lm_group, mlp_mappings: MLPMappings, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.spec, self.dtype, self._mlp_mappings = spec, dtype, mlp_mappings
        self.embed = VocabDimShardedEmbedding(spec.vocab, spec.hidden, embed_group, dtype=dtype)
        self.norm = RMSNorm(spec.hidden, eps, dtype=dtype)
        self.lm_head = ShardedLMHead(spec.hidden, spec.vocab, lm_group, dtype=dtype)

    def checkpoint_mappings(self) -> dict:
        """Every parameter → its HF checkpoint key(s)."""
        m = {"embed.weight": hf.EMBED_KEY, "norm.weight": hf.FINAL_NORM_KEY,
             "lm_head.proj.weight": hf.EMBED_KEY if self.spec.tied_embeddings else hf.LM_HEAD_KEY}
        for i in range(self.spec.layers):
            m.update(_attention_mappings(self.spec, i, f"layers.{i}.attn", self.prefill))
            m.update({f"layers.{i}.mlp.{k}": v for k, v in self._mlp_mappings(self.spec, i).items()})
        return m

    def load(self, checkpoint: SafetensorsCheckpoint, pipelined: bool = True) -> dict[str, torch.Tensor]:
        """Load this graph's per-rank slices (every layer's loader knows its own group and rank)."""
        loader = checkpoint.load_sharded_pipelined if pipelined else checkpoint.load_sharded
        # rank/world_size are nominal: every parameter's loader overrides the rank with its own group's.
        out = loader(rank=0, world_size=1, model=self, mappings=self.checkpoint_mappings())
        for m in self.modules():
            if hasattr(m, "weights_loaded"):
                m.weights_loaded()
        return out


class PrefillLayer(nn.Module):
    def __init__(self, spec, i, tp_group, mlp_factory: MLPFactory, eps, dtype):
        super().__init__()
        self.attn = PrefillAttention(spec, i, tp_group, eps, dtype)
        self.mlp = mlp_factory(spec, i, tp_group, eps, dtype)


class PrefillModel(_Model):
    prefill = True

    def __init__(self, spec: TextModelSpec, state: ParallelState, mlp_factory: MLPFactory,
                 mlp_mappings: MLPMappings, eps: float = 1e-5,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(spec, state.tp, state.tp, mlp_mappings, eps, dtype)
        self.state, self.tp_group = state, state.tp
        self.layers = nn.ModuleList(PrefillLayer(spec, i, state.tp, mlp_factory, eps, dtype)
                                    for i in range(spec.layers))

    def forward(self, input_ids: torch.Tensor, cache: KVCache, slot: int, bucket: int | None = None,
                return_logits: bool = False):
        """input_ids [T] of one sequence → (greedy next token [1], logits [1, V] or None). Pads to ``bucket``
        (default: the smallest prefill bucket that fits) and writes cache slot ``slot`` for positions < T."""
        t = input_ids.shape[0]
        n = self.tp_group.world_size
        if bucket is None:
            bucket = self.state.config.select_prefill_bucket(t)
        if bucket < t:
            raise ValueError(f"prefill: bucket {bucket} < {t} tokens")
        if not (bucket > n and bucket % n == 0):
            # Sequence parallel splits the (padded) tokens evenly over the TP group.
            raise ValueError(f"prefill: padded length T={bucket} must satisfy T > tp world_size={n} and "
                             f"T % {n} == 0 (sequence parallel)")
        if bucket > cache.s_max:
            raise ValueError(f"prefill: bucket {bucket} exceeds the KV cache length S_max={cache.s_max}")
        ids = torch.cat([input_ids, input_ids.new_zeros(bucket - t)])  # pad id 0; causal masking hides it
        h = self.embed(ids, sequence_parallel=True)  # [T/n, H] (enter SP)
        for i, layer in enumerate(self.layers):
            h = h + layer.attn(h, cache.k[i], cache.v[i], slot, t)
            h = h + layer.mlp.forward_sp(h)
        h = self.tp_group.all_gather(self.norm(h), dim=0)  # [T, H] (exit SP)
        last = h[t - 1: t]
        logits = self.lm_head.gathered_logits(last) if return_logits else None
        return self.lm_head.sample(last), logits


class DecodeLayer(nn.Module):
    def __init__(self, spec, i, state: ParallelState, mlp_factory: MLPFactory, eps, dtype, backend):
        super().__init__()
        self.state = state
        self.attn = DecodeAttentionDP(spec, i, state.attention, eps, dtype, backend)
        self.mlp = mlp_factory(spec, i, state.mlp.tp, eps, dtype)

    def forward(self, h, k_cache, v_cache, positions, flow: str):
        s = self.state

        def attn_partial(x):
            return self.attn.partial(x, k_cache, v_cache, positions)

        if flow == "optimised":  # h gathered at mlp_dp in and out
            return decoder_layer_decode(h, s.attention, s.mlp, attn_partial, self.mlp.partial)
        # Unoptimised (before the component-DP work): h is the local batch between modules.
        p = s.attention.dp.reduce_scatter(attn_partial(s.attention.dp.all_gather(h)))  # AG, RS over the column
        h = h + s.tp.all_reduce(p)  # TP all-reduce
        full = s.mlp.tp.all_reduce(self.mlp.partial(s.mlp.dp.all_gather(h)))  # AG, super all-reduce
        return h + dp_transition(full, s.mlp.dp, s.local)  # slice back to the local batch


class DecodeModel(_Model):
    prefill = False

    def __init__(self, spec: TextModelSpec, state: ParallelState, mlp_factory: MLPFactory,
                 mlp_mappings: MLPMappings, eps: float = 1e-5,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "torch") -> None:
        super().__init__(spec, state.embedding.tp, state.lm_head.tp, mlp_mappings, eps, dtype)
        self.state = state
        self.layers = nn.ModuleList(DecodeLayer(spec, i, state, mlp_factory, eps, dtype, backend)
                                    for i in range(spec.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                sampling_positions: torch.Tensor | None = None, flow: str = "optimised",
                return_logits: bool = False, layer_hook: Callable[[int, str], None] | None = None):
        """input_ids, positions [B_local] (this replica's sequences, already padded to the decode bucket; the
        cache has exactly B_local slots) → (greedy tokens [B_selected], logits [B_selected, V] or None).

        sampling_positions: rows of the local batch to sample (same count on every rank; default all).
        layer_hook(i, "start" | "end") is called around each layer (to slice the collective log per layer).
        """
        if flow not in FLOWS:
            raise ValueError(f"decode: flow={flow!r} must be one of {FLOWS}")
        s = self.state
        b = input_ids.shape[0]
        if positions.shape != input_ids.shape or cache.batch != b:
            raise ValueError(f"decode: input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
                             f"cache batch {cache.batch} must all be [B_local]")
        if b and not (0 <= int(positions.min()) and int(positions.max()) < cache.s_max):
            raise ValueError(f"decode: positions must be in [0, S_max={cache.s_max}) of the KV cache, got "
                             f"[{int(positions.min())}, {int(positions.max())}]")
        home = s.mlp.dp if flow == "optimised" else s.local  # where h lives between layers
        ids = s.embedding.dp.all_gather(input_ids)  # [B_local · emb_dp]
        h = dp_transition(self.embed(ids), s.embedding.dp, home)  # once, before the layer loop
        for i, layer in enumerate(self.layers):
            if layer_hook:
                layer_hook(i, "start")
            h = layer(h, cache.k[i], cache.v[i], positions, flow)
            if layer_hook:
                layer_hook(i, "end")
        h = dp_transition(self.norm(h), home, s.local)  # slice to the local batch
        if sampling_positions is not None:
            h = h.index_select(0, sampling_positions)
        n_sel = h.shape[0]
        h = dp_transition(h, s.local, s.lm_head.dp)  # all-gather over the LM-head DP column
        tokens = dp_transition(self.lm_head.sample(h), s.lm_head.dp, s.local)  # slice back
        logits = None
        if return_logits:
            logits = self.lm_head.gathered_logits(h)
            logits = logits.narrow(0, s.lm_head.dp.rank_in_group * n_sel, n_sel)
        return tokens, logits
