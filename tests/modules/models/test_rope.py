"""RoPE tables: plain, Llama-3.1's llama3 scaling and GPT-OSS's YaRN, against values derived by hand from the
published formulas, and against HF transformers' own rope functions when transformers is importable."""

from __future__ import annotations

import math

import pytest
import torch

from modules.model_specs import GPT_OSS_20B, GPT_OSS_ROPE, LLAMA3_ROPE, LLAMA_31_8B, RopeSpec
from modules.models.rope import apply_rope, rope_inv_freq, rope_tables


def test_models_carry_their_checkpoint_rope():
    assert GPT_OSS_20B.rope == GPT_OSS_ROPE and GPT_OSS_ROPE.theta == 150000.0 and not GPT_OSS_ROPE.truncate
    assert LLAMA_31_8B.rope == LLAMA3_ROPE and LLAMA3_ROPE.factor == 8.0


def test_plain_rope_is_theta_power():
    inv, af = rope_inv_freq(8, RopeSpec(theta=10000.0))
    assert af == 1.0
    torch.testing.assert_close(inv, torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)], dtype=torch.float64))


def test_llama3_bands():
    """head_dim 128, theta 5e5, original 8192: wavelengths < 2048 keep their frequency, > 8192 are divided by 8,
    the band between interpolates (smooth = 8192 / wavelength - 1) / 3."""
    plain, _ = rope_inv_freq(128, RopeSpec(theta=500000.0))
    inv, af = rope_inv_freq(128, LLAMA3_ROPE)
    assert af == 1.0
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 2048, wavelen > 8192
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(inv[high], plain[high])
    torch.testing.assert_close(inv[low], plain[low] / 8)
    mid = ~high & ~low
    smooth = (8192 / wavelen[mid] - 1) / 3
    torch.testing.assert_close(inv[mid], (1 - smooth) * plain[mid] / 8 + smooth * plain[mid])
    assert bool((inv[1:] < inv[:-1]).all())          # still strictly decreasing


def test_yarn_gpt_oss_ramp_by_hand():
    """GPT-OSS (head_dim 64, theta 1.5e5, factor 32, original 4096, beta 32 / 1, no truncation): the ramp runs over
    dimension index 64 ln(4096 / (2 pi beta)) / (2 ln 1.5e5) = 8.093 (beta 32) .. 17.398 (beta 1); cos and sin carry
    0.1 ln 32 + 1 = 1.3466."""
    plain, _ = rope_inv_freq(64, RopeSpec(theta=150000.0))
    inv, af = rope_inv_freq(64, GPT_OSS_ROPE)
    assert af == pytest.approx(1.346574, abs=1e-6)
    low = 64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(150000.0))
    high = 64 * math.log(4096 / (2 * math.pi)) / (2 * math.log(150000.0))
    assert low == pytest.approx(8.093, abs=1e-3) and high == pytest.approx(17.398, abs=1e-3)
    torch.testing.assert_close(inv[:9], plain[:9])                    # index <= 8 < low: extrapolated (kept)
    torch.testing.assert_close(inv[18:], plain[18:] / 32)             # index >= 18 > high: interpolated
    r = (12 - low) / (high - low)
    assert float(inv[12]) == pytest.approx(float(plain[12]) * ((1 - r) + r / 32), rel=1e-12)
    # HF's default (truncate=True) floors / ceils the range to 8 .. 18: index 12 moves
    inv_t, _ = rope_inv_freq(64, RopeSpec(**{**GPT_OSS_ROPE.__dict__, "truncate": True}))
    assert float(inv_t[12]) == pytest.approx(float(plain[12]) * ((1 - 0.4) + 0.4 / 32), rel=1e-12)


def test_tables_and_rotation_keep_the_attention_factor():
    cos, sin = rope_tables(torch.arange(50), 64, GPT_OSS_ROPE)
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, 1.346574 ** 2), atol=1e-5, rtol=1e-5)
    x = torch.randn(50, 2, 64)
    y = apply_rope(x, cos, sin)     # a rotation scaled by the factor: norms grow by exactly it
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1) * 1.346574, atol=1e-4, rtol=1e-4)


def test_bad_rope_specs_raise():
    with pytest.raises(ValueError, match="kind"):
        RopeSpec(kind="ntk")
    with pytest.raises(ValueError, match="factor"):
        RopeSpec(kind="yarn", factor=0.5, original_max_position=4096)
    with pytest.raises(ValueError, match="original_max_position"):
        RopeSpec(kind="llama3", factor=8.0)
    with pytest.raises(ValueError, match="head_dim=7"):
        rope_tables(torch.arange(3), 7)


@pytest.mark.parametrize("model", ["gpt_oss", "llama3"])
def test_matches_hf_transformers(model):
    """Cross-check with HF transformers' rope functions (optional: skipped when transformers is not installed)."""
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils", reason="transformers not installed")
    from transformers import GptOssConfig, LlamaConfig
    if model == "gpt_oss":
        spec, cfg = GPT_OSS_ROPE, GptOssConfig()           # HF's defaults are GPT-OSS's config.json values
        head_dim = GPT_OSS_20B.head_dim
    else:
        spec, head_dim = LLAMA3_ROPE, LLAMA_31_8B.head_dim
        cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    kind = cfg.rope_scaling["rope_type"]
    hf_inv, hf_af = rope_utils.ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    inv, af = rope_inv_freq(head_dim, spec)
    torch.testing.assert_close(inv.float(), hf_inv.float(), rtol=1e-5, atol=0)
    assert af == pytest.approx(hf_af, rel=1e-6)
