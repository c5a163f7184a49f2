"""MoE layer with tensor parallelism without EP (the tensor-parallelism seed's GPT-OSS case study).

Every rank holds all E experts and a 1/tp slice of each expert's intermediate dimension: gate/up are
column-parallel, down is row-parallel, so each rank's expert output is a partial sum over its I-shard. The router
and the optional fused RMSNorm are replicated. The layer takes its tp_group explicitly (Megatron style).

Prefill (sequence parallel), input [T/tp, H] on each rank — collectives, in order, as the seed lists them:
    router on the local [T/tp, H] tokens → affinities
    all_gather(dim 0) hidden [T/tp, Hp] → [T, Hp]
    all_gather(dim 0) affinities [T/tp, E] → [T, E]   (dense: routing needs the full sequence)
    CTE on all T tokens → partial [T, Hp]
    reduce_scatter(dim 0) → [T/tp, Hp]                 (sums the TP partials and returns to the SP layout)
Decode, input [T, H] on every rank: TKG (fused RMSNorm + router + experts) → partial [T, Hp]; all_reduce
(``decode_partial`` stops before the all-reduce, for callers that fuse it with their own).
Every rank must pass the same T/tp in prefill (the seed's SP constraint: the scheduler pads T to a bucket divisible by
tp); the layer cannot see the other ranks' counts without a collective, and a mismatched all-gather aborts the group.

The dense affinities carry UNSELECTED (−1) for experts a token does not use. Selected affinities are
probabilities (≥ 0, possibly 0 after underflow), so top-k of the gathered rows recovers exactly each token's
experts and affinities, in descending order, even when an affinity is 0 or logits tie. The down-projection bias is
added on TP rank 0 only (the partials are summed). Collectives run in the activations' dtype, as on the device.

Expert formats (``expert_format``): "bf16" (default) holds the experts in the parameter dtype (an MXFP4 checkpoint
is dequantised at load: the trn2 route, which has no MX matmul); "mxfp4" keeps this rank's experts packed as the
kernels' MX path takes them (w_gate_up / w_down int16 words of float4_e2m1fn_x4, w_gate_up_scale / w_down_scale
uint8 E8M0, ``nki_kernels/moe/mx_weights.py``'s layout; ~3.8x fewer weight bytes than bf16) and loads them from the
GPT-OSS MXFP4 blocks/scales without a bf16 round trip. Each rank's I-shard must lie on 32-element MX blocks: build
the shape with ``intermediate_padded=mx_aligned_intermediate(I, tp)`` (GPT-OSS-20B TP8: 2880 → 3072, 384 a rank);
hidden_padded must be a multiple of 512. Decode runs moe_tkg and prefill moe_cte with the scales (the kernels' trn3
MX path: tokens and activations quantised to MXFP8 on chip); backend "torch" runs their MX references
(moe_torch(mx=True), moe_cte_torch(mx=True)) so the layer runs on CPU. The target is the kernels' own choice (the
compile target, NEURON_PLATFORM_TARGET_OVERRIDE for nkisim as for neuronx-cc): on trn2 the kernels refuse MXFP4 with
the reason (no nc_matmul_mx / quantize_mx; use expert_format="bf16" there) — no silent dequantising fallback, which
would change the numerics and the weight footprint behind the caller's back. Decode batches above the MX TKG
kernel's 64 tokens (``decode_route``): where the cost rule (``tkg_cost.choose_mx_decode_route``) models it faster,
prefill's steps without the collectives — RMSNorm, the router kernel, ONE moe_cte call, whose MX path reads every
routed expert once (GPT-OSS-20B TP8 trn3 from T = 68 at LNC 1, 66 at LNC 2); below that, several moe_tkg calls of
<= 64 tokens (tokens are independent: exact, but each call streams its touched experts again), as bf16 decode does
above 128. The two routes differ in rounding only (the CTE adds each expert's contribution in x's dtype).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from modules.loading.checkpoint import SafetensorsCheckpoint
from modules.loading.loaders import set_weight_loader, with_rank_override
from modules.moe.loaders import (
    down_weight_loader,
    gate_up_bias_loader,
    gate_up_weight_loader,
    gpt_oss_checkpoint_is_mxfp4,
    gpt_oss_moe_mappings,
    hidden_vector_loader,
    mx_down_loader,
    mx_gate_up_loader,
    mx_packed_shapes,
    mx_shard_error,
)
from modules.moe.router import MoERouter
from modules.moe.shape import MoEShape
from nki_kernels.entry import BACKENDS, resolve_backend
from nki_kernels.entry import to_torch as as_torch
from nki_kernels.moe import ACTIVATIONS, moe_cte, moe_tkg, rmsnorm_torch
from nki_kernels.moe.gate_up_layout import P as P_TILE
from nki_kernels.moe.moe_tkg import MAX_TOKENS as TKG_MAX_TOKENS
from nki_kernels.moe.moe_tkg import OUTT_MAX_TOKENS as TKG_MX_MAX_TOKENS
from nki_kernels.moe.tkg_cost import choose_mx_decode_route

UNSELECTED = -1.0
EXPERT_FORMATS = ("bf16", "mxfp4")


class MoELayer(nn.Module):
    """GPT-OSS-style MoE block sharded on the intermediate dimension over ``tp_group``.

    Parameters (kernel layout, this rank's shard): router.weight [Hp, E], router.bias [E], w_gate_up
    [E, 128, Hp/128, 2·Is] (the tiled layout of ``nki_kernels/moe/gate_up_layout.py``: element [e, p, kt, g·Is + i] =
    gate (g 0) / up (g 1) weight of hidden row kt·128 + p; ``untile_gate_up`` gives [E, Hp, 2, Is]), b_gate_up
    [E, 2, Is], w_down [E, Is, Hp], b_down [E, Hp] (replicated, added on rank 0), and gamma [Hp] when ``norm_eps`` is
    given (the fused pre-MoE RMSNorm). Each parameter carries its GPT-OSS checkpoint loader. The gate/up weights are
    held ONCE, tiled, and passed as such to moe_cte (prefill: one DMA run per partition and expert for its x^T paths)
    and moe_tkg (decode: x^T in natural H tiles for the experts); a second [E, Hp, 2, Is] copy would double the
    expert bytes in HBM.
    expert_format "mxfp4" (module docstring): w_gate_up [E, 128, Hp/512, 2·Is] and w_down [E, 128, ceil(Is/512), Hp]
    int16 words, w_gate_up_scale / w_down_scale [E, 16, chunks, N] uint8, loaded from the MXFP4 checkpoint only.
    forward(x, sequence_parallel) returns the MoE output (no residual) with x's width (H or Hp) and dtype.
    backend / lnc / expert_mode / block_size go to the kernel entries ``nki_kernels.moe.router / moe_tkg / moe_cte``
    (backend "auto" | "nki" | "nkisim" | "torch"; "torch" runs their references).
    """

    def __init__(self, shape: MoEShape, tp_group, *, router_mode: str = "gpt_oss", renormalize: bool = False,
                 activation: str = "clamped_swiglu", bias: bool = True, norm_eps: float | None = None,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "auto", expert_mode: str = "auto",
                 block_size: int | None = None, lnc: int = 1, expert_format: str = "bf16") -> None:
        super().__init__()
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"MoELayer: expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
        if expert_format == "mxfp4" and (err := mx_shard_error(shape)):
            raise ValueError(err)
        if tp_group.world_size != shape.tp_size:
            raise ValueError(f"MoELayer: tp_group world_size={tp_group.world_size} != shape.tp_size={shape.tp_size}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoELayer: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.shape, self.tp_group, self.activation, self.backend = shape, tp_group, activation, backend
        self.norm_eps, self.expert_mode, self.block_size, self.lnc = norm_eps, expert_mode, block_size, lnc
        self.expert_format = expert_format
        rank = tp_group.rank_in_group
        self.add_down_bias = rank == 0
        E, Hp, Is = shape.experts, shape.hidden_padded, shape.i_per_rank

        def param(*size, loader, pdtype=dtype):
            p = nn.Parameter(torch.zeros(*size, dtype=pdtype), requires_grad=False)
            # The loader uses this group's rank, whatever rank the model loader passes.
            set_weight_loader(p, with_rank_override(loader, rank))
            return p

        self.router = MoERouter(shape, router_mode, renormalize, bias=bias, dtype=dtype, backend=backend)
        self.w_gate_up_scale = self.w_down_scale = None
        if expert_format == "mxfp4":
            mx = mx_packed_shapes(shape)
            self.w_gate_up = param(*mx["w_gate_up"], loader=mx_gate_up_loader(shape, "blocks"), pdtype=torch.int16)
            self.w_gate_up_scale = param(*mx["w_gate_up_scale"], loader=mx_gate_up_loader(shape, "scales"),
                                         pdtype=torch.uint8)
            self.w_down = param(*mx["w_down"], loader=mx_down_loader(shape, "blocks"), pdtype=torch.int16)
            self.w_down_scale = param(*mx["w_down_scale"], loader=mx_down_loader(shape, "scales"),
                                      pdtype=torch.uint8)
        else:
            # tiled [E, 128, Hp/128, 2·Is] (gate_up_layout.py): the one copy both kernels read (class docstring)
            self.w_gate_up = param(E, P_TILE, Hp // P_TILE, 2 * Is, loader=gate_up_weight_loader(shape, tiled=True))
            self.w_down = param(E, Is, Hp, loader=down_weight_loader(shape))
        self.b_gate_up = param(E, 2, Is, loader=gate_up_bias_loader(shape)) if bias else None
        self.b_down = param(E, Hp, loader=hidden_vector_loader(shape, "down_proj_bias [E, H]")) if bias else None
        self.gamma = None
        if norm_eps is not None:
            self.gamma = param(Hp, loader=hidden_vector_loader(shape, "norm weight [H]"))

    def load_gpt_oss(self, path: str | Path | SafetensorsCheckpoint, layer: int,
                     pipelined: bool = True) -> dict[str, torch.Tensor]:
        """Load this rank's shard of GPT-OSS decoder layer ``layer``'s MoE (bf16 or MXFP4 experts, detected; MXFP4
        only with expert_format "mxfp4", packed as is) and, with the fused norm, its post-attention RMSNorm weight,
        from an HF-layout safetensors file or directory.
        pipelined: through ``load_sharded_pipelined`` (the gate_up and down reads and dequantisations run in two
        reader threads) or the sequential ``load_sharded``; the result is the same."""
        ckpt = path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)
        mappings = gpt_oss_moe_mappings(layer, gpt_oss_checkpoint_is_mxfp4(ckpt, layer), norm=self.gamma is not None,
                                        packed=self.expert_format == "mxfp4")
        load = ckpt.load_sharded_pipelined if pipelined else ckpt.load_sharded
        return load(self.tp_group.rank_in_group, self.tp_group.world_size, self, mappings)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _experts(self, op: str) -> tuple[object, object, dict]:
        """(w_gate_up, w_down, scale kwargs) as the kernel entries take them. Packed MXFP4 words go to the nkisim
        kernels as float4_e2m1fn_x4 arrays (nkisim.mx.PackedArray over the same storage words)."""
        if self.expert_format != "mxfp4":
            return self.w_gate_up, self.w_down, {}
        scales = dict(w_gate_up_scale=self.w_gate_up_scale.detach(), w_down_scale=self.w_down_scale.detach())
        if self.backend == "torch" or self.backend not in BACKENDS:  # an unknown name: the entry refuses it
            return self.w_gate_up.detach(), self.w_down.detach(), scales
        backend = resolve_backend(f"MoELayer.{op}", self.backend)
        if backend == "nki":
            # torch/xla cannot pass x4 packed dtypes to a kernel (nki-library takes int16 words and reinterprets
            # them inside the kernel); our kernels check for float4_e2m1fn_x4 words, so this route is not wired.
            raise NotImplementedError(
                f"MoELayer.{op}: expert_format='mxfp4' with backend 'nki' (AWS's real nki) is not wired: the kernels "
                "take float4_e2m1fn_x4 words, which torch cannot pass; use backend 'nkisim' or 'torch', or "
                "expert_format='bf16'")
        from nkisim import dtypes as nk_dtypes
        from nkisim import mx as nk_mx

        fp4 = nk_dtypes.as_dtype("float4_e2m1fn_x4")
        words = [nk_mx.PackedArray(w.detach().numpy().view(fp4.storage), fp4) for w in (self.w_gate_up, self.w_down)]
        return words[0], words[1], scales

    def _padded(self, x: torch.Tensor, what: str) -> torch.Tensor:
        s = self.shape
        if x.dim() != 2 or x.shape[1] not in (s.hidden, s.hidden_padded):
            raise ValueError(f"MoELayer.{what}: x must be [T, {s.hidden}] or [T, {s.hidden_padded}] (padded), "
                             f"got {tuple(x.shape)}")
        if x.shape[0] == 0:
            raise ValueError(f"MoELayer.{what}: x has no tokens")
        if x.shape[1] == s.hidden_padded:
            return x
        return torch.cat([x, x.new_zeros(x.shape[0], s.hidden_padded - s.hidden)], dim=1)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Prefill's RMSNorm, on the local SP chunk (per token, so before the gather: tp× less work). The CTE kernel has
        # no fused norm; this is the torch reference's math, the same as the TKG kernel's fused norm.
        if self.gamma is None:
            return x
        return rmsnorm_torch(x, self.gamma, self.norm_eps, self.shape.hidden).to(x.dtype)

    # -- flows -----------------------------------------------------------------------------------------------
    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """x [T/tp, H] (this rank's SP chunk) → [T/tp, H]."""
        width = x.shape[-1] if x.dim() == 2 else None
        h = self._norm(self._padded(x, "prefill"))
        _, index, aff = self.router(h)
        dense = torch.full((h.shape[0], self.shape.experts), UNSELECTED, dtype=torch.float32)
        dense.scatter_(1, index.long(), aff.float())
        g = self.tp_group
        h_all = g.all_gather(h, dim=0)
        dense_all = g.all_gather(dense, dim=0)
        aff_all, index_all = torch.topk(dense_all, self.shape.top_k, dim=-1)
        w_gate_up, w_down, scales = self._experts("prefill")
        partial = as_torch(moe_cte(h_all, index_all, aff_all, w_gate_up, w_down, b_gate_up=self.b_gate_up,
                                   b_down=self.b_down, activation=self.activation, add_down_bias=self.add_down_bias,
                                   block_size=self.block_size, backend=self.backend, lnc=self.lnc, **scales))
        out = g.reduce_scatter(partial.to(x.dtype), dim=0)
        return out[:, :width]

    def _tkg_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's decode output for x [T, H or Hp], padded width [T, Hp], in x's dtype. A batch above the TKG
        kernel's token limit (128; 64 with MXFP4 experts) runs as several kernel calls (tokens are independent), or
        with MXFP4 experts as one CTE call where ``decode_route`` says so."""
        h = self._padded(x, "decode")
        r = self.router
        w_gate_up, w_down, scales = self._experts("decode")
        if scales and self.decode_route(h.shape[0]) == "cte":
            return self._cte_decode(h, w_gate_up, w_down, scales).to(x.dtype)
        partials = []
        for piece in h.split(TKG_MX_MAX_TOKENS if scales else TKG_MAX_TOKENS):
            out, _, _ = moe_tkg(
                piece, r.weight, w_gate_up, w_down, **scales, top_k=self.shape.top_k, b_router=r.bias,
                b_gate_up=self.b_gate_up, b_down=self.b_down, gamma=self.gamma, eps=self.norm_eps or 1e-5,
                hidden_actual=self.shape.hidden, router_mode=r.mode, renormalize=r.renormalize,
                activation=self.activation, add_down_bias=self.add_down_bias, expert_mode=self.expert_mode,
                backend=self.backend, lnc=self.lnc)
            partials.append(as_torch(out).to(x.dtype))
        return torch.cat(partials)

    def decode_route(self, T: int) -> str:
        """"tkg" (moe_tkg calls) or "cte" (router + one moe_cte call) for a T-token decode: "cte" only with MXFP4
        experts above the MX TKG kernel's 64 tokens, where one CTE call (every routed expert read once) is modelled
        faster than several TKG calls (each streaming its tokens' experts again): tkg_cost.choose_mx_decode_route on
        this rank's shape (trn3, the only MX target), at this layer's lnc."""
        if self.expert_format != "mxfp4" or T <= TKG_MX_MAX_TOKENS:
            return "tkg"
        s = self.shape
        return choose_mx_decode_route(T, s.experts, s.top_k, s.hidden_padded, s.i_per_rank, "trn3", self.lnc,
                                      TKG_MX_MAX_TOKENS)

    def _cte_decode(self, h: torch.Tensor, w_gate_up, w_down, scales: dict) -> torch.Tensor:
        """MXFP4 decode of h [T, Hp] through the CTE kernel: prefill's steps without its collectives (every rank
        holds all T tokens): RMSNorm (torch, as prefill), the router kernel, one moe_cte call with the scales."""
        hn = self._norm(h)
        _, index, aff = self.router(hn)
        return as_torch(moe_cte(hn, index, aff, w_gate_up, w_down, b_gate_up=self.b_gate_up, b_down=self.b_down,
                                activation=self.activation, add_down_bias=self.add_down_bias,
                                block_size=self.block_size, backend=self.backend, lnc=self.lnc, **scales))

    def decode_partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (all tokens on every rank) → this rank's partial [T, H] (x's width), no collective: the sum
        over ``tp_group`` of every rank's partial is ``decode(x)``. For callers that fuse this reduction with
        others over the same group (the decoder layer's one MLP all-reduce over the TP and DP weight shards)."""
        width = x.shape[-1] if x.dim() == 2 else None
        return self._tkg_partial(x)[:, :width]

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (all tokens on every rank) → [T, H]: the TKG partial and one all-reduce over ``tp_group``."""
        width = x.shape[-1] if x.dim() == 2 else None
        return self.tp_group.all_reduce(self._tkg_partial(x))[:, :width]

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        return self.prefill(x) if sequence_parallel else self.decode(x)
