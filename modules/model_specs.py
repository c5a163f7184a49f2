"""Model shapes: the one table tests, the bench and the modules use (public HF config.json files, model-configs.md).

Only dimensions live here; no weights are ever read. Bytes are bf16 (2 bytes) throughout: the toolkit works in bf16
(MXFP4 expert weights are dequantised at load on Trn2, as in the published GPT-OSS-120B Trn2 recipe).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of a text model: HF config.json's ``rope_theta`` and ``rope_scaling``.

    kind "default": plain RoPE; "llama3": Llama-3.1's frequency-band rescaling (factor, low/high_freq_factor,
    original_max_position); "yarn": YaRN (factor, beta_fast/beta_slow, original_max_position, truncate; cos and sin
    carry the attention factor 0.1·ln(factor) + 1). The tables: `modules.models.rope`.
    """

    theta: float = 500000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0       # llama3
    high_freq_factor: float = 4.0      # llama3
    beta_fast: float = 32.0            # yarn
    beta_slow: float = 1.0             # yarn
    truncate: bool = True              # yarn: floor/ceil the correction range (GPT-OSS: false)

    def __post_init__(self) -> None:
        if self.kind not in ("default", "llama3", "yarn"):
            raise ValueError(f"RopeSpec: kind={self.kind!r} is not one of 'default', 'llama3', 'yarn'")
        if self.kind != "default" and (self.factor < 1.0 or self.original_max_position <= 0):
            raise ValueError(f"RopeSpec: {self.kind} scaling needs factor >= 1 (got {self.factor}) and "
                             f"original_max_position > 0 (got {self.original_max_position})")


# HF config.json rope settings of the measured models (model-configs.md)
GPT_OSS_ROPE = RopeSpec(theta=150000.0, kind="yarn", factor=32.0, original_max_position=4096, beta_fast=32.0,
                        beta_slow=1.0, truncate=False)
LLAMA3_ROPE = RopeSpec(theta=500000.0, kind="llama3", factor=8.0, original_max_position=8192, low_freq_factor=1.0,
                       high_freq_factor=4.0)


@dataclass(frozen=True)
class TextModelSpec:
    """A decoder-only text model (dense SwiGLU MLP or a top-k MoE)."""

    name: str
    layers: int
    hidden: int
    intermediate: int          # dense MLP intermediate, or per-expert intermediate for MoE
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0           # 0 = dense
    top_k: int = 0
    sliding_window: int = 0    # >0: every other layer is sliding-window attention (GPT-OSS)
    attention_bias: bool = False
    tied_embeddings: bool = False
    rope: RopeSpec = RopeSpec()

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- parameter counts (full model, unsharded) -------------------------------------------------------------
    def attention_params(self) -> int:
        h = self.hidden
        params = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        if self.attention_bias:
            params += self.q_width + 2 * self.kv_width + h
        if self.sliding_window:
            params += self.heads  # learned sinks
        return params

    def mlp_params(self) -> int:
        h, i = self.hidden, self.intermediate
        if self.is_moe:
            experts = self.experts * (h * 2 * i + i * h + 2 * i + h)  # gate_up + down (+ biases)
            return experts + h * self.experts + self.experts          # router with bias
        return 3 * h * i

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        per_layer = self.attention_params() + self.mlp_params() + 2 * self.hidden
        lm_head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * per_layer + self.embedding_params() + lm_head + self.hidden

    def active_params_per_token(self) -> int:
        if not self.is_moe:
            return self.total_params()
        h, i = self.hidden, self.intermediate
        active_mlp = self.top_k * 3 * h * i + h * self.experts
        per_layer = self.attention_params() + active_mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden

    def sliding_layers(self) -> int:
        return self.layers // 2 if self.sliding_window else 0


@dataclass(frozen=True)
class VisionModelSpec:
    """A ViT encoder with block-packed inputs (Qwen3-VL vision encoder)."""

    name: str
    layers: int
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    patch_dim: int
    spatial_merge: int
    out_hidden: int
    deepstack_mergers: int
    num_position_embeddings: int
    block_size: int = 1024     # patches per packed block (a 512x512 image at patch 16 = 32x32 = 1024 patches)
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    deepstack_indexes: tuple[int, ...] = ()   # layers whose output feeds one extra (deepstack) merger each
    layer_norm_eps: float = 1e-6

    def layer_params(self) -> int:
        h = self.hidden
        return 4 * h * h + 4 * h + 2 * h * self.intermediate + self.intermediate + h + 4 * h

    def merger_params(self) -> int:
        m = self.hidden * self.spatial_merge**2
        return 2 * m + m * m + m + m * self.out_hidden + self.out_hidden

    def total_params(self) -> int:
        mergers = (1 + self.deepstack_mergers) * self.merger_params()
        embed = self.patch_dim * self.hidden + self.hidden + self.num_position_embeddings * self.hidden
        return self.layers * self.layer_params() + mergers + embed


GPT_OSS_20B = TextModelSpec("GPT-OSS-20B", layers=24, hidden=2880, intermediate=2880, heads=64, kv_heads=8,
                            head_dim=64, vocab=201088, experts=32, top_k=4, sliding_window=128, attention_bias=True,
                            rope=GPT_OSS_ROPE)
GPT_OSS_120B = TextModelSpec("GPT-OSS-120B", layers=36, hidden=2880, intermediate=2880, heads=64, kv_heads=8,
                             head_dim=64, vocab=201088, experts=128, top_k=4, sliding_window=128, attention_bias=True,
                             rope=GPT_OSS_ROPE)
LLAMA_31_8B = TextModelSpec("Llama-3.1-8B", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                            head_dim=128, vocab=128256, rope=LLAMA3_ROPE)
LLAMA_33_70B = TextModelSpec("Llama-3.3-70B", layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                             head_dim=128, vocab=128256, rope=LLAMA3_ROPE)
QWEN3_VL_VIT = VisionModelSpec("Qwen3-VL-ViT", layers=27, hidden=1152, heads=16, head_dim=72, intermediate=4304,
                               patch_dim=1536, spatial_merge=2, out_hidden=4096, deepstack_mergers=3,
                               num_position_embeddings=2304, in_channels=3, patch_size=16, temporal_patch_size=2,
                               deepstack_indexes=(8, 16, 24), layer_norm_eps=1e-6)

TEXT_MODELS: dict[str, TextModelSpec] = {m.name: m for m in (GPT_OSS_20B, GPT_OSS_120B, LLAMA_31_8B, LLAMA_33_70B)}
VISION_MODELS: dict[str, VisionModelSpec] = {QWEN3_VL_VIT.name: QWEN3_VL_VIT}
ALL_MODELS: dict[str, TextModelSpec | VisionModelSpec] = {**TEXT_MODELS, **VISION_MODELS}
