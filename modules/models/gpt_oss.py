"""GPT-OSS: the decoder of `modules.models.decoder` (attention with q/k/v/o biases, learned sinks, sliding-window
attention on even layers and full attention on odd ones) with `modules.moe`'s TP-without-EP MoE layer in the MLP
slot, on the MLP (component) TP group. The post-attention RMSNorm is fused into the MoE (its ``gamma``).
RoPE: YaRN as in the checkpoint's config (`spec.rope`, `modules.models.rope`).
"""

from __future__ import annotations

import torch
from torch import nn

from modules.model_specs import TextModelSpec
from modules.moe import MoELayer, MoEShape, gpt_oss_moe_mappings


class GptOssMoEMLP(nn.Module):
    """The MLP slot of a GPT-OSS decoder layer: ``partial`` (decode) and ``forward_sp`` (prefill, SP)."""

    def __init__(self, spec: TextModelSpec, layer: int, tp_group, eps: float, dtype: torch.dtype,
                 backend: str = "torch") -> None:
        super().__init__()
        if not spec.is_moe:
            raise ValueError(f"GptOssMoEMLP: {spec.name} is dense (experts=0); GPT-OSS needs a MoE spec")
        shape = MoEShape.from_spec(spec, tp_group.world_size)
        self.moe = MoELayer(shape, tp_group, norm_eps=eps, dtype=dtype, backend=backend)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        # No collective: the decoder layer's one all-reduce over the MLP component group sums these partials
        # (`decoder_layer_decode`).
        return self.moe.decode_partial(x)

    def forward_sp(self, x_sp: torch.Tensor) -> torch.Tensor:
        return self.moe.prefill(x_sp)  # all-gather of hidden and affinities … reduce-scatter, inside the layer


def gpt_oss_mlp(spec: TextModelSpec, layer: int, tp_group, eps: float, dtype: torch.dtype,
                backend: str = "torch") -> GptOssMoEMLP:
    """The MLP factory of GPT-OSS; functools.partial(gpt_oss_mlp, backend="nkisim" | "nki" | "auto") runs the MoE
    through the nki_kernels.moe kernels instead of their torch references."""
    return GptOssMoEMLP(spec, layer, tp_group, eps, dtype, backend=backend)


def gpt_oss_mlp_mappings(spec: TextModelSpec, layer: int, mxfp4: bool = False) -> dict:
    """MoE parameters → GPT-OSS checkpoint keys (bf16 experts; functools.partial(..., mxfp4=True) for MXFP4
    blocks/scales), the post-attention norm included."""
    return gpt_oss_moe_mappings(layer, mxfp4, norm=True, prefix="moe.")
