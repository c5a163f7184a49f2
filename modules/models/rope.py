"""Rotary position embedding tables in the half-split layout (HF Llama's rotate_half; the decode kernel's cos/sin)."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim / 2] in fp32 for integer positions (plain RoPE; no Llama-3.1 / YaRN
    frequency scaling, which only rescales inv_freq and is not modelled here)."""
    if head_dim % 2:
        raise ValueError(f"rope_tables: head_dim={head_dim} must be even")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, d] with cos/sin [..., d/2] (broadcast over heads); computed in fp32, returned in x.dtype."""
    d = x.shape[-1]
    xf = x.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
