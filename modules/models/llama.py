"""Llama-3: the decoder of `modules.models.decoder` with a dense SwiGLU MLP on the MLP (component) TP group."""

from __future__ import annotations

import torch

from modules.model_specs import TextModelSpec
from modules.models import hf_layout as hf
from modules.models.mlp import DenseMLP


def llama_mlp(spec: TextModelSpec, layer: int, tp_group, eps: float, dtype: torch.dtype) -> DenseMLP:
    if spec.is_moe:
        raise ValueError(f"llama_mlp: {spec.name} is a MoE spec (experts={spec.experts}); Llama-3 is dense")
    return DenseMLP(spec.hidden, spec.intermediate, tp_group, eps, dtype)


def llama_mlp_mappings(spec: TextModelSpec, layer: int) -> dict:
    k, n = hf.dense_mlp_keys(layer), hf.norm_keys(layer)
    return {"norm.weight": n["post_attention"], "gate_up": {"gate": k["gate"], "up": k["up"]},
            "down.weight": k["down"]}
