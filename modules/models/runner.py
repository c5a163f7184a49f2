"""ModelRunner: what a serving worker holds for one model — the prefill graph and the decode graph (each with its
own weight slices from one checkpoint), the KV cache, bucket padding and warmup.

Warmup enumerates every (phase, bucket) graph once — on Neuron that is where each shape is compiled; here each
graph is traced eagerly on a scratch cache — so the number of graphs is len(prefill_buckets) + len(decode_buckets).
"""

from __future__ import annotations

import torch

from modules.loading.checkpoint import SafetensorsCheckpoint
from modules.model_specs import TextModelSpec
from modules.models.decoder import DecodeModel, KVCache, MLPFactory, MLPMappings, PrefillModel
from modules.parallel.state import ParallelState


class ModelRunner:
    """Args:
        spec: the model's shapes (`modules.model_specs`); state: this rank's process groups.
        mlp_factory / mlp_mappings: the MLP family (dense Llama MLP, or MoE).
        s_max: KV cache length. The cache has max(decode_buckets) sequence slots (this replica's sequences).
        backend: decode attention backend ("torch" | "auto" | "nki" | "nkisim"); prefill attention is torch.
    """

    def __init__(self, spec: TextModelSpec, state: ParallelState, mlp_factory: MLPFactory, mlp_mappings: MLPMappings,
                 s_max: int, dtype: torch.dtype = torch.bfloat16, backend: str = "torch", eps: float = 1e-5) -> None:
        cfg = state.config
        if not cfg.prefill_buckets or not cfg.decode_buckets:
            raise ValueError("ModelRunner: NeuronConfig needs prefill_buckets and decode_buckets")
        if max(cfg.prefill_buckets) > s_max:
            raise ValueError(f"ModelRunner: prefill bucket {max(cfg.prefill_buckets)} exceeds s_max={s_max}")
        self.spec, self.state, self.dtype = spec, state, dtype
        kw = dict(eps=eps, dtype=dtype)
        self.prefill_model = PrefillModel(spec, state, mlp_factory, mlp_mappings, **kw)
        self.decode_model = DecodeModel(spec, state, mlp_factory, mlp_mappings, backend=backend, **kw)
        self.cache = KVCache.allocate(spec, cfg.tp_size, max(cfg.decode_buckets), s_max, dtype)
        self.graphs: list[tuple[str, int]] = []

    def load(self, checkpoint: SafetensorsCheckpoint, pipelined: bool = True) -> None:
        """Prefill (plain TP) and decode (component DP) each load their own slices of the same checkpoint."""
        self.prefill_model.load(checkpoint, pipelined=pipelined)
        self.decode_model.load(checkpoint, pipelined=pipelined)

    @torch.no_grad()
    def warmup(self) -> list[tuple[str, int]]:
        """Run every (phase, bucket) graph once on a scratch cache (the real cache is untouched)."""
        cfg = self.state.config
        scratch = KVCache.allocate(self.spec, cfg.tp_size, max(cfg.decode_buckets), self.cache.s_max, self.dtype)
        self.graphs = []
        for b in cfg.prefill_buckets:
            self.prefill_model(torch.zeros(b, dtype=torch.long), scratch, slot=0, bucket=b)
            self.graphs.append(("prefill", b))
        for b in cfg.decode_buckets:
            zeros = torch.zeros(b, dtype=torch.long)
            self.decode_model(zeros, zeros, scratch.rows(b))
            self.graphs.append(("decode", b))
        return list(self.graphs)

    @torch.no_grad()
    def prefill(self, slot: int, input_ids: torch.Tensor, return_logits: bool = False):
        """Prefill one of this replica's sequences into cache slot ``slot``: (next token [1], logits or None)."""
        if not 0 <= slot < self.cache.batch:
            raise ValueError(f"prefill: slot={slot} outside the cache's {self.cache.batch} sequence slots")
        return self.prefill_model(input_ids, self.cache, slot, return_logits=return_logits)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, flow: str = "optimised",
               return_logits: bool = False, layer_hook=None):
        """One decode step for this replica's n sequences (slots 0..n-1), padded to the decode bucket:
        (tokens [n], logits [n, V] or None)."""
        n = input_ids.shape[0]
        b = self.state.config.select_decode_bucket(n)
        pad = torch.zeros(b - n, dtype=torch.long)
        tokens, logits = self.decode_model(torch.cat([input_ids, pad]), torch.cat([positions, pad]),
                                           self.cache.rows(b), flow=flow, return_logits=return_logits,
                                           layer_hook=layer_hook)
        return tokens[:n], None if logits is None else logits[:n]
