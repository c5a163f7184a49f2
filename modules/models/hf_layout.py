"""HF-layout checkpoint names (Llama-3 and GPT-OSS `model.safetensors`) and a writer of random ones.

One source for the checkpoint keys: the models' load mappings and the tests' / bench's generated checkpoints both
use these functions. Weights are stored as HF stores them: [out, in] for projections, [H] for norms.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from modules.model_specs import TextModelSpec


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def attention_keys(i: int) -> dict[str, str]:
    p = f"{layer_prefix(i)}.self_attn"
    return {r: f"{p}.{r}_proj.weight" for r in ("q", "k", "v", "o")}


def attention_bias_keys(i: int) -> dict[str, str]:
    p = f"{layer_prefix(i)}.self_attn"
    return {r: f"{p}.{r}_proj.bias" for r in ("q", "k", "v", "o")}


def sinks_key(i: int) -> str:
    return f"{layer_prefix(i)}.self_attn.sinks"


def norm_keys(i: int) -> dict[str, str]:
    return {"input": f"{layer_prefix(i)}.input_layernorm.weight",
            "post_attention": f"{layer_prefix(i)}.post_attention_layernorm.weight"}


def dense_mlp_keys(i: int) -> dict[str, str]:
    p = f"{layer_prefix(i)}.mlp"
    return {r: f"{p}.{r}_proj.weight" for r in ("gate", "up", "down")}


EMBED_KEY = "model.embed_tokens.weight"
FINAL_NORM_KEY = "model.norm.weight"
LM_HEAD_KEY = "lm_head.weight"


def _random_attention_state(spec: TextModelSpec, g: torch.Generator, dtype: torch.dtype,
                            scale: float) -> dict[str, torch.Tensor]:
    """Embedding, final norm, LM head and every layer's attention (+ input norm) in HF layout; GPT-OSS attention
    extras (q/k/v/o biases, sinks) when spec.attention_bias / spec.sliding_window say so."""

    def rnd(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    h = spec.hidden
    out = {EMBED_KEY: rnd(spec.vocab, h, s=1.0), FINAL_NORM_KEY: 1 + rnd(h, s=0.1)}
    if not spec.tied_embeddings:
        out[LM_HEAD_KEY] = rnd(spec.vocab, h)
    for i in range(spec.layers):
        a = attention_keys(i)
        out[a["q"]], out[a["k"]], out[a["v"]] = rnd(spec.q_width, h), rnd(spec.kv_width, h), rnd(spec.kv_width, h)
        out[a["o"]] = rnd(h, spec.q_width)
        if spec.attention_bias:
            b = attention_bias_keys(i)
            out[b["q"]], out[b["k"]], out[b["v"]], out[b["o"]] = (rnd(spec.q_width), rnd(spec.kv_width),
                                                                   rnd(spec.kv_width), rnd(h))
        if spec.sliding_window:
            out[sinks_key(i)] = rnd(spec.heads, s=1.0).float()
        out[norm_keys(i)["input"]] = 1 + rnd(h, s=0.1)
    return out


def random_dense_state(spec: TextModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                       scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A random HF-layout state dict for a dense (Llama-style) spec (GPT-OSS attention extras if the spec has
    them). Norm weights are near 1, projections ~N(0, scale²)."""
    if spec.is_moe:
        raise ValueError(f"random_dense_state: {spec.name} is a MoE spec; use random_gpt_oss_state")
    g = torch.Generator().manual_seed(seed)
    out = _random_attention_state(spec, g, dtype, scale)
    for i in range(spec.layers):
        m = dense_mlp_keys(i)
        out[m["gate"]] = (torch.randn(spec.intermediate, spec.hidden, generator=g) * scale).to(dtype)
        out[m["up"]] = (torch.randn(spec.intermediate, spec.hidden, generator=g) * scale).to(dtype)
        out[m["down"]] = (torch.randn(spec.hidden, spec.intermediate, generator=g) * scale).to(dtype)
        out[norm_keys(i)["post_attention"]] = (1 + torch.randn(spec.hidden, generator=g) * 0.1).to(dtype)
    return out


def random_gpt_oss_state(spec: TextModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                         scale: float = 0.2, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """A random GPT-OSS HF-layout state dict: attention parts as random_dense_state, each layer's MoE (router,
    interleaved gate_up, down, biases, post-attention norm; bf16 or MXFP4 experts) from
    `modules.testing.gpt_oss_moe.make_gpt_oss_moe`."""
    from modules.testing.gpt_oss_moe import make_gpt_oss_moe

    if not spec.is_moe:
        raise ValueError(f"random_gpt_oss_state: {spec.name} is dense; use random_dense_state")
    out = _random_attention_state(spec, torch.Generator().manual_seed(seed), dtype, scale)
    for i in range(spec.layers):
        out.update(make_gpt_oss_moe(spec.experts, spec.hidden, spec.intermediate, layer=i, mxfp4=mxfp4,
                                    seed=seed * 1000 + i))
    return out


def write_checkpoint(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Save as one HF `model.safetensors` under directory path (created); returns the file path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    f = path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(f))
    return f
