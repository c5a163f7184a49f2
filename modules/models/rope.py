"""Rotary position embedding tables in the half-split layout (HF Llama's rotate_half; the decode kernel's cos/sin).

The frequencies follow the model's `RopeSpec` (HF config.json's rope_theta / rope_scaling): plain RoPE, Llama-3.1's
"llama3" band rescaling, or YaRN (GPT-OSS) whose attention factor scales cos and sin. The formulas are the published
ones (HF transformers' modeling_rope_utils, the YaRN paper arXiv:2309.00071), computed here in float64.
"""

from __future__ import annotations

import math

import torch

from modules.model_specs import RopeSpec


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] (float64) and the attention factor that multiplies cos and sin (1 unless YaRN)."""
    if head_dim % 2:
        raise ValueError(f"rope_tables: head_dim={head_dim} must be even")
    inv_freq = rope.theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(inv_freq, head_dim, rope), 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Wavelengths shorter than original / high_freq_factor keep their frequency, longer than original /
    low_freq_factor are divided by the factor, and the band between interpolates linearly in original / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                                              - rope.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), smoothed, out)


def _yarn(inv_freq: torch.Tensor, head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """Dimensions that turn more than beta_fast times over the original context keep their frequency
    (extrapolation), those turning fewer than beta_slow times are divided by the factor (interpolation), with a
    linear ramp over the dimension index between them."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001      # (as the published formula: no zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / rope.factor * ramp + inv_freq * extrapolate


def rope_tables(positions: torch.Tensor, head_dim: int,
                rope: RopeSpec = RopeSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim / 2] in fp32 for integer positions (YaRN's attention factor included)."""
    inv_freq, attention_factor = rope_inv_freq(head_dim, rope)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, d] with cos/sin [..., d/2] (broadcast over heads); computed in fp32, returned in x.dtype."""
    d = x.shape[-1]
    xf = x.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
