"""Qwen3-VL vision-tower layers, head/feature-sharded over the vision TP group.

Parameter names and shapes follow the HF checkpoint (``model.visual.*``), so a module's ``named_parameters`` are the
checkpoint keys minus the prefix and every parameter's weight loader reads only this rank's slice:

- attention: ``attn.qkv`` fused [q | k | v] column-parallel by heads, ``attn.proj`` row-parallel; the block-packed
  attention kernel does QKV → 2D rotary → bounded attention → the O-projection partial of this rank's heads; the
  partials of all blocks are summed over the TP group in one all-reduce, then the O bias is added once.
- MLP: ``linear_fc1`` column-parallel → gelu (tanh) → ``linear_fc2`` row-parallel (+ all-reduce, bias after).
- patch merger: LayerNorm (before the 2x2 shuffle for the main merger, after it for deepstack mergers) →
  ``linear_fc1`` column-parallel → exact GELU → ``linear_fc2`` row-parallel.
Patch embedding, position embedding and norms are replicated (small, per token).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from modules.layers.attention import QKVParallelLinear
from modules.layers.linear import ColumnParallelLinear, RowParallelLinear
from modules.layers.norm import LayerNorm
from modules.loading.loaders import replicated_weight_loader, set_weight_loader
from modules.vision.config import VisionEncoderConfig
from nki_kernels.vision import vision_block_attention


def _replicated(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    set_weight_loader(p, replicated_weight_loader())
    return p


class PatchEmbed(nn.Module):
    """HF's Conv3d with kernel = stride = (temporal_patch, patch, patch) is a linear map of each flattened patch;
    the weight keeps the checkpoint's 5-D shape [hidden, C, T, P, P]."""

    def __init__(self, cfg: VisionEncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = _replicated((cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                        cfg.patch_size), dtype)
        self.proj.bias = _replicated((cfg.hidden_size,), dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, tp_group, backend: str, dtype: torch.dtype, lnc: int = 1) -> None:
        super().__init__()
        self.tp_group, self.backend, self.lnc = tp_group, backend, lnc
        self.num_heads = cfg.num_heads // tp_group.world_size     # this rank's heads
        self.head_dim = cfg.head_dim
        self.qkv = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, cfg.num_heads, cfg.head_dim, tp_group,
                                     bias=True, dtype=dtype)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp_group, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bound_min: torch.Tensor,
                bound_max: torch.Tensor) -> torch.Tensor:
        # The kernel's matmul inputs are bf16 (no-ops when the encoder runs in bf16).
        w_qkv = self.qkv.weight.t().to(torch.bfloat16).contiguous()   # kernel layout [H, 3 * heads * head_dim]
        w_o = self.proj.weight.t().to(torch.bfloat16).contiguous()    # [heads * head_dim, H]
        xb = x.to(torch.bfloat16)
        partial = torch.stack([
            _as_torch(vision_block_attention(
                xb[b], w_qkv, self.qkv.bias, cos[b], sin[b], bound_min[b], bound_max[b], w_o,
                num_heads=self.num_heads, head_dim=self.head_dim, backend=self.backend, lnc=self.lnc)).to(x.dtype)
            for b in range(x.shape[0])])
        # One all-reduce per layer for all of this rank's blocks; the O bias once, after the sum.
        return self.tp_group.all_reduce(partial) + self.proj.bias


def _as_torch(out) -> torch.Tensor:
    """The kernel's output as a torch tensor: the torch backend returns one, nkisim a NumPy array (bf16 stored as
    ml_dtypes.bfloat16, which torch cannot wrap directly)."""
    if isinstance(out, torch.Tensor):
        return out
    a = np.asarray(out)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32))
    return torch.from_numpy(a)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, tp_group, bias=True,
                                               dtype=dtype)
        self.linear_fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp_group, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, tp_group, backend: str, dtype: torch.dtype, lnc: int = 1) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.attn = VisionAttention(cfg, tp_group, backend, dtype, lnc)
        self.mlp = VisionMLP(cfg, tp_group, dtype)

    def forward(self, x, cos, sin, bound_min, bound_max):
        x = x + self.attn(self.norm1(x), cos, sin, bound_min, bound_max)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """[..., block_size, hidden] → [..., block_size / merge_unit, out_hidden]: each merge_unit consecutive rows
    (one spatial_merge x spatial_merge square) become one token."""

    def __init__(self, cfg: VisionEncoderConfig, tp_group, postshuffle_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged, self.postshuffle_norm = cfg.merged_hidden, postshuffle_norm
        self.norm = LayerNorm(cfg.merged_hidden if postshuffle_norm else cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.linear_fc1 = ColumnParallelLinear(cfg.merged_hidden, cfg.merged_hidden, tp_group, bias=True, dtype=dtype)
        self.linear_fc2 = RowParallelLinear(cfg.merged_hidden, cfg.out_hidden_size, tp_group, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-2]
        if self.postshuffle_norm:
            x = self.norm(x.reshape(*lead, -1, self.merged))
        else:
            x = self.norm(x).reshape(*lead, -1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
