"""Tiny GPT-OSS MoE checkpoints in the HF layout, and the unsharded reference weights, for loader and layer tests.

The reference side is written independently of ``modules.moe.loaders``: de-interleaving by strided views and MXFP4
decoding through ml_dtypes' E2M1 / E8M0 types, so a loader bug cannot cancel itself out in a test.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import torch

MLP = "model.layers.{layer}.mlp."
NORM = "model.layers.{layer}.post_attention_layernorm.weight"


def make_gpt_oss_moe(E: int, H: int, inter: int, layer: int = 0, mxfp4: bool = False, seed: int = 0,
                     scale_exp: tuple[int, int] = (120, 124)) -> dict[str, torch.Tensor]:
    """HF-layout tensors of one GPT-OSS MoE layer (bf16; MXFP4 experts as uint8 blocks/scales when mxfp4).

    scale_exp: E8M0 scale range [lo, hi) for the MXFP4 blocks (127 = 2^0)."""
    g = torch.Generator().manual_seed(seed)
    p = MLP.format(layer=layer)
    bf = lambda *s, k=1.0: (torch.randn(*s, generator=g) * k).to(torch.bfloat16)  # noqa: E731
    out = {p + "router.weight": bf(E, H, k=0.3), p + "router.bias": bf(E, k=0.3),
           p + "experts.gate_up_proj_bias": bf(E, 2 * inter, k=0.2), p + "experts.down_proj_bias": bf(E, H, k=0.2),
           NORM.format(layer=layer): (1 + bf(H, k=0.1).float()).to(torch.bfloat16)}
    if not mxfp4:
        out[p + "experts.gate_up_proj"] = bf(E, H, 2 * inter, k=H ** -0.5 * 2)
        out[p + "experts.down_proj"] = bf(E, inter, H, k=inter ** -0.5)
        return out
    for name, rows, cols in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
        out[f"{p}experts.{name}_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g,
                                                         dtype=torch.uint8)
        out[f"{p}experts.{name}_scales"] = torch.randint(*scale_exp, (E, rows, cols // 32), generator=g,
                                                         dtype=torch.uint8)
    return out


def save_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    return path


def mx_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 + [..., G] uint8 → [..., G·32] fp32 via ml_dtypes (low nibble = first element)."""
    b = blocks.numpy()
    nib = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 32).astype(np.uint8)
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return torch.from_numpy(vals * scale[..., None]).flatten(-2)


def full_kernel_weights(t: dict[str, torch.Tensor], layer: int = 0) -> dict[str, torch.Tensor]:
    """Unsharded, unpadded fp32 weights in the kernels' layout from HF tensors (either form)."""
    p = MLP.format(layer=layer)
    if p + "experts.gate_up_proj" in t:
        gu, down = t[p + "experts.gate_up_proj"].float(), t[p + "experts.down_proj"].float()
    else:
        # MXFP4 rows are the bf16 tensor's last axis (HF convert_moe_packed_tensors transposes them back).
        gu = mx_decode(t[p + "experts.gate_up_proj_blocks"], t[p + "experts.gate_up_proj_scales"]).transpose(1, 2)
        down = mx_decode(t[p + "experts.down_proj_blocks"], t[p + "experts.down_proj_scales"]).transpose(1, 2)
    gub = t[p + "experts.gate_up_proj_bias"].float()
    return {"w_router": t[p + "router.weight"].float().t().contiguous(), "b_router": t[p + "router.bias"].float(),
            "w_gate_up": torch.stack([gu[..., 0::2], gu[..., 1::2]], dim=2).contiguous(),
            "b_gate_up": torch.stack([gub[..., 0::2], gub[..., 1::2]], dim=1).contiguous(),
            "w_down": down.contiguous(), "b_down": t[p + "experts.down_proj_bias"].float(),
            "gamma": t[NORM.format(layer=layer)].float()}
