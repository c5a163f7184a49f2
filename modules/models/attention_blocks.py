"""The two attention blocks of a decoder layer: prefill (plain TP, sequence parallel) and decode (component DP).

Prefill (the TP seed): input in SP layout [T/n, H] → RMSNorm → all-gather → this rank's Q/K/V heads → RoPE →
causal attention (sinks, sliding window) → KV cache of the sequence's slot → O-projection shard → reduce-scatter
back to [T/n, H].

Decode (the component-DP seed, attention DP for real): the block runs over the attention component TP group
(tp × attn_dp ranks, DP-major then TP-minor, so member m = d·tp + t) on the batch gathered over its DP column
(attn_dp replicas' local batches, replica j at rows j·B_local..). Q and O are sharded over the whole group by the
*interleaved effective rank* e = t·attn_dp + d, so the attn_dp ranks of column t together hold exactly the Q heads
that TP rank t holds without attention DP, each a contiguous 1/attn_dp of them. K/V are sharded by TP position
only (KV heads of position t on every rank of column t, replicated when tp > KV heads), and each rank keeps the KV
cache of its own replica's B_local sequences. Per step:

  1. RMSNorm; Q = x_gathered @ Wq_e (every gathered sequence, this rank's heads); K/V of the own sequences only.
  2. all-to-all over the DP column: heads ↔ sequences. Rank (t, d) now holds, for its own B_local sequences, all
     Q heads of position t (the column's head slices, concatenated in head order).
  3. RoPE (own positions), cache update, attention against its own cache.
  4. all-to-all back: sequences ↔ heads (every gathered sequence, this rank's head slice).
  5. O-projection shard → partial [B_gathered, H]; the caller's one all-reduce over the attention component TP
     group sums the TP and DP partials (the O bias is added by member 0 only).

Backends: "torch" runs steps 1-5 above in torch, the two all-to-alls through torch.distributed on the DP column
(the collective log shows them). "nki" / "nkisim" / "auto" run steps 1-5 in the fused decode megakernel
(`nki_kernels.attention.decode_attention`), with attn_dp > 1 the two swaps as in-kernel all-to-alls
(nki.collectives over the DP columns' world ranks; nki_kernels/attention/decode/exchange.py): no host collective
but the caller's all-reduce. nkisim runs them across the gloo processes through nkisim.process_world.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.layers.attention import QKVParallelLinear
from modules.layers.linear import RowParallelLinear
from modules.layers.norm import RMSNorm
from modules.loading.loaders import (
    head_range_weight_loader,
    replicated_weight_loader,
    set_weight_loader,
    sharding_weight_loader,
    with_rank_override,
)
from modules.model_specs import TextModelSpec
from modules.models.attention_math import cached_attention, causal_attention
from modules.models.rope import apply_rope, rope_tables
from modules.parallel.heads import shard_heads

KERNEL_BACKENDS = ("auto", "nki", "nkisim")
BACKENDS = ("torch", *KERNEL_BACKENDS)


def layer_window(spec: TextModelSpec, layer: int) -> int:
    """GPT-OSS alternates sliding-window (even layers) and full attention; dense Llama has no window."""
    return spec.sliding_window if spec.sliding_window and layer % 2 == 0 else 0


def _param(*shape, dtype):
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class PrefillAttention(nn.Module):
    """Head-sharded attention over a plain TP group, sequence parallel (the TP seed's prefill flow)."""

    def __init__(self, spec: TextModelSpec, layer: int, tp_group, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_group, self.window, self.rope = tp_group, layer_window(spec, layer), spec.rope
        self.norm = RMSNorm(spec.hidden, eps, dtype=dtype)
        self.qkv_proj = QKVParallelLinear(spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, tp_group,
                                          bias=spec.attention_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(spec.q_width, spec.hidden, tp_group, bias=spec.attention_bias, dtype=dtype)
        self.sharding = self.qkv_proj.sharding
        self.sinks = None
        if spec.sliding_window:  # GPT-OSS: learned per-head sinks
            n = self.sharding.q_heads_per_rank
            self.sinks = _param(n, dtype=torch.float32)
            set_weight_loader(self.sinks, with_rank_override(
                sharding_weight_loader(0, n, tp_group.world_size), tp_group.rank_in_group))

    def forward(self, x_sp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
                length: int) -> torch.Tensor:
        """x_sp [T/n, H] → [T/n, H] (reduce-scattered partial sums); writes cache[slot, :, :length]."""
        s = self.sharding
        x = self.tp_group.all_gather(self.norm(x_sp), dim=0)
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(t, s.q_heads_per_rank, s.head_dim)
        k = k.view(t, s.kv_heads_per_rank, s.head_dim)
        v = v.view(t, s.kv_heads_per_rank, s.head_dim)
        cos, sin = rope_tables(torch.arange(t), s.head_dim, self.rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[slot, :, :length] = k[:length].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot, :, :length] = v[:length].transpose(0, 1).to(v_cache.dtype)
        o = causal_attention(q, k, v, self.sinks, self.window)
        return self.o_proj(o.reshape(t, s.q_size), sequence_parallel=True)


class DecodeAttentionDP(nn.Module):
    """One rank's decode attention over the attention component groups (see the module docstring).

    Args:
        groups: the attention ``ComponentGroups`` (``tp``: tp × attn_dp ranks; ``dp``: the DP column).
        backend: "torch", or a kernel backend ("auto" | "nki" | "nkisim"; attention DP swaps in the kernel).
    """

    def __init__(self, spec: TextModelSpec, layer: int, groups, eps: float, dtype: torch.dtype,
                 backend: str = "torch") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"DecodeAttentionDP: backend={backend!r} must be one of {BACKENDS}")
        self.groups, self.backend, self.eps, self.rope = groups, backend, eps, spec.rope
        self.window = layer_window(spec, layer)
        comp, col = groups.tp, groups.dp
        self.attn_dp = col.world_size
        if comp.world_size % self.attn_dp:
            raise ValueError(f"attention component group size {comp.world_size} is not a multiple of its DP column "
                             f"size {self.attn_dp}")
        self.tp_size = comp.world_size // self.attn_dp
        self.tp_pos, self.dp_pos = comp.rank_in_group % self.tp_size, comp.rank_in_group // self.tp_size
        if self.dp_pos != col.rank_in_group:
            raise ValueError(f"attention groups disagree: member {comp.rank_in_group} of the component group is DP "
                             f"index {self.dp_pos}, but the DP column says {col.rank_in_group}")
        self.effective_rank = self.tp_pos * self.attn_dp + self.dp_pos
        d, h = spec.head_dim, spec.hidden
        self.head_dim = d
        tp_heads = shard_heads(spec.heads, spec.kv_heads, d, self.tp_size)      # K/V and the column's Q heads
        comp_heads = shard_heads(spec.heads, spec.heads, d, comp.world_size)    # Q/O over the whole group
        self.q_heads, self.kv_heads = comp_heads.q_heads_per_rank, tp_heads.kv_heads_per_rank
        self.column_q_heads = tp_heads.q_heads_per_rank
        qn = self.q_heads * d
        n, e = comp.world_size, self.effective_rank
        q_loader = with_rank_override(sharding_weight_loader(0, qn, n), e)
        kv_loader = head_range_weight_loader(tp_heads.kv_head_start(self.tp_pos), self.kv_heads, d, spec.kv_heads)
        self.norm = RMSNorm(h, eps, dtype=dtype)
        self.q_weight, self.o_weight = _param(qn, h, dtype=dtype), _param(h, qn, dtype=dtype)
        self.k_weight, self.v_weight = _param(self.kv_heads * d, h, dtype=dtype), _param(self.kv_heads * d, h,
                                                                                           dtype=dtype)
        set_weight_loader(self.q_weight, q_loader)
        set_weight_loader(self.o_weight, with_rank_override(sharding_weight_loader(1, qn, n), e))
        set_weight_loader(self.k_weight, kv_loader)
        set_weight_loader(self.v_weight, kv_loader)
        self.q_bias = self.k_bias = self.v_bias = self.o_bias = None
        if spec.attention_bias:
            self.q_bias, self.o_bias = _param(qn, dtype=dtype), _param(h, dtype=dtype)
            self.k_bias, self.v_bias = _param(self.kv_heads * d, dtype=dtype), _param(self.kv_heads * d, dtype=dtype)
            set_weight_loader(self.q_bias, q_loader)
            set_weight_loader(self.k_bias, kv_loader)
            set_weight_loader(self.v_bias, kv_loader)
            set_weight_loader(self.o_bias, replicated_weight_loader())
        self.sinks = None
        if spec.sliding_window:  # after the swap a rank attends all Q heads of its TP position
            self.sinks = _param(self.column_q_heads, dtype=torch.float32)
            set_weight_loader(self.sinks, with_rank_override(
                sharding_weight_loader(0, self.column_q_heads, self.tp_size), self.tp_pos))
        self._kernel_args: dict | None = None

    def weights_loaded(self) -> None:
        """Drop derived kernel-layout weights (rebuilt from the parameters at the next kernel call)."""
        self._kernel_args = None

    # ---- torch flow (any attn_dp) ------------------------------------------------------------------------------
    def _swap_heads_for_sequences(self, q: torch.Tensor, b_local: int) -> torch.Tensor:
        """[a·B_local, q_heads·d] (every sequence, my heads) → [B_local, a·q_heads, d] (my sequences, the column's
        heads in head order: piece j holds effective rank t·a + j's heads)."""
        a, d = self.attn_dp, self.head_dim
        recv = self.groups.dp.all_to_all(q, dim=0)  # piece j: my sequences × rank j's heads
        return recv.view(a, b_local, self.q_heads, d).permute(1, 0, 2, 3).reshape(b_local, a * self.q_heads, d)

    def _swap_sequences_for_heads(self, o: torch.Tensor) -> torch.Tensor:
        """Inverse of _swap_heads_for_sequences: [B_local, a·q_heads, d] → [a·B_local, q_heads·d]."""
        a, d, b_local = self.attn_dp, self.head_dim, o.shape[0]
        send = o.reshape(b_local, a, self.q_heads * d).transpose(0, 1).reshape(a * b_local, self.q_heads * d)
        return self.groups.dp.all_to_all(send, dim=0)  # piece j: replica j's sequences × my heads

    def _torch_partial(self, x, k_cache, v_cache, positions):
        b_local, d = positions.shape[0], self.head_dim
        xn = self.norm(x)
        q = F.linear(xn, self.q_weight, self.q_bias)
        own = xn.narrow(0, self.dp_pos * b_local, b_local)
        k = F.linear(own, self.k_weight, self.k_bias).view(b_local, self.kv_heads, d)
        v = F.linear(own, self.v_weight, self.v_bias).view(b_local, self.kv_heads, d)
        q = self._swap_heads_for_sequences(q, b_local)
        cos, sin = rope_tables(positions, d, self.rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.arange(b_local)
        k_cache[rows, :, positions] = k.to(k_cache.dtype)
        v_cache[rows, :, positions] = v.to(v_cache.dtype)
        o = cached_attention(q, k_cache, v_cache, positions, self.sinks, self.window)
        partial = F.linear(self._swap_sequences_for_heads(o), self.o_weight)
        if self.o_bias is not None and self.groups.tp.rank_in_group == 0:
            partial = partial + self.o_bias  # summed once by the group's all-reduce
        return partial

    # ---- fused kernel (any attn_dp) ---------------------------------------------------------------------------
    def _kernel_weights(self) -> dict:
        if self._kernel_args is None:
            w_qkv = torch.cat([self.q_weight, self.k_weight, self.v_weight]).t().contiguous()
            args = {"W_qkv": w_qkv, "W_o": self.o_weight.t().contiguous(),
                    "gamma": self.norm.weight.detach().view(1, -1).contiguous()}
            if self.q_bias is not None:
                args["bias_qkv"] = torch.cat([self.q_bias, self.k_bias, self.v_bias]).view(1, -1)
                args["bias_o"] = self.o_bias.detach().view(1, -1)
            self._kernel_args = args
        return self._kernel_args

    def _kernel_partial(self, x, k_cache, v_cache, positions):
        from nki_kernels.attention import decode_attention
        w = self._kernel_weights()
        b, bl = x.shape[0], positions.shape[0]          # gathered batch, own sequences (equal without DP)
        cos, sin = rope_tables(positions.view(bl, 1), self.head_dim, self.rope)
        out = decode_attention(x.view(b, 1, -1), w["W_qkv"], k_cache, v_cache, positions.view(bl, 1), cos.to(x.dtype),
                               sin.to(x.dtype), w["W_o"], gamma=w["gamma"], bias_qkv=w.get("bias_qkv"),
                               sinks=None if self.sinks is None else self.sinks.detach(), bias_o=w.get("bias_o"),
                               eps=self.eps, sliding_window=self.window, backend=self.backend,
                               add_bias_o=self.groups.tp.rank_in_group == 0, **self._dp_kernel_args())
        return out.view(b, -1)

    def _dp_kernel_args(self) -> dict:
        """Attention DP in the kernel: the DP columns (world ranks, DP order) and this rank's DP index."""
        if self.attn_dp == 1:
            return {}
        return {"attn_dp_groups": self.groups.dp.group_ranks, "attn_dp_rank": self.groups.dp.rank_in_group}

    def partial(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """x [attn_dp·B_local, H] gathered at attn_dp; positions [B_local] of this rank's own sequences; caches
        [B_local, kv_heads, S_max, d] (own sequences, heads of this TP position), updated in place.
        Returns this rank's partial [attn_dp·B_local, H]; the caller all-reduces it over groups.tp."""
        if x.shape[0] != self.attn_dp * positions.shape[0]:
            raise ValueError(f"DecodeAttentionDP: x has {x.shape[0]} rows, expected attn_dp={self.attn_dp} × "
                             f"B_local={positions.shape[0]} (input gathered over the attention DP column)")
        if k_cache.shape[0] != positions.shape[0]:
            raise ValueError(f"DecodeAttentionDP: cache batch {k_cache.shape[0]} != B_local={positions.shape[0]}")
        if self.backend == "torch":
            return self._torch_partial(x, k_cache, v_cache, positions)
        return self._kernel_partial(x, k_cache, v_cache, positions)
