"""The shared MoE references against independent computations: per-token loops, hand values, ml_dtypes' MX types."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_kernels.moe import (
    activation_torch,
    dense_affinities,
    dequant_mxfp4,
    moe_experts_torch,
    moe_torch,
    router_torch,
)


def _weights(E=4, H=16, inter=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, 2, inter, generator=g) / 4, torch.randn(E, inter, H, generator=g) / 4,
            torch.randn(E, 2, inter, generator=g) / 4, torch.randn(E, H, generator=g) / 4)


def test_clamped_swiglu_hand_values():
    gate = torch.tensor([1.0, 9.0, -3.0])
    up = torch.tensor([0.5, -8.0, 9.0])
    sig = lambda v: 1 / (1 + math.exp(-1.702 * v))  # noqa: E731
    want = [(0.5 + 1) * 1.0 * sig(1.0), (-7 + 1) * 7.0 * sig(7.0), (7 + 1) * -3.0 * sig(-3.0)]
    assert activation_torch(gate, up).tolist() == pytest.approx(want, rel=1e-6)
    assert activation_torch(gate, up, "swiglu").tolist() == pytest.approx(
        [g / (1 + math.exp(-g)) * u for g, u in zip(gate.tolist(), up.tolist())], rel=1e-6)
    with pytest.raises(ValueError, match="activation"):
        activation_torch(gate, up, "gelu")


def test_router_modes_match_a_per_token_computation():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, generator=g)
    logits, idx, aff = router_torch(x, w, b, top_k=3)
    for t in range(5):
        order = sorted(range(8), key=lambda e: -float(logits[t, e]))[:3]
        assert idx[t].tolist() == order
        top = np.array([float(logits[t, e]) for e in order])
        assert aff[t].numpy() == pytest.approx(np.exp(top - top.max()) / np.exp(top - top.max()).sum(), rel=1e-5)
    _, idx2, aff2 = router_torch(x, w, b, top_k=3, mode="softmax_topk", renormalize=True)
    assert torch.equal(idx2, idx)                      # softmax is monotone: same experts
    assert torch.allclose(aff2, aff, rtol=1e-5)        # renormalised top-k softmax == softmax over the top-k
    _, _, raw = router_torch(x, w, b, top_k=3, mode="softmax_topk")
    assert (raw.sum(-1) < 1).all()


def test_router_ties_lowest_index_first_and_bad_k_is_named():
    x = torch.ones(2, 4)
    w = torch.zeros(4, 6)                              # every logit equal
    _, idx, aff = router_torch(x, w, top_k=2)
    assert idx.tolist() == [[0, 1], [0, 1]]            # torch.topk's CPU order here is [3, 5]: implementation-defined
    assert torch.allclose(aff, torch.full((2, 2), 0.5))
    b = torch.tensor([0.0, 2.0, 2.0, 1.0, 2.0, 0.5])   # a three-way tie above the rest
    _, idx, _ = router_torch(torch.zeros(1, 4), w, b, top_k=4, mode="softmax_topk")
    assert idx.tolist() == [[1, 2, 4, 3]]
    with pytest.raises(ValueError, match="top_k"):
        router_torch(x, w, top_k=7)
    with pytest.raises(ValueError, match="router mode"):
        router_torch(x, w, top_k=2, mode="sigmoid")


def test_moe_experts_equals_a_per_token_loop_and_bias_rank():
    wgu, wd, bgu, bd = _weights()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 16, generator=g)
    idx = torch.tensor([[0, 1], [1, 0], [3, 3], [2, 0], [0, 1], [1, 2]])
    aff = torch.rand(6, 2, generator=g)
    got = moe_experts_torch(x, idx, aff, wgu, wd, bgu, bd)
    for t in range(6):
        want = torch.zeros(16)
        for j in range(2):
            e = int(idx[t, j])
            gate, up = x[t] @ wgu[e, :, 0] + bgu[e, 0], x[t] @ wgu[e, :, 1] + bgu[e, 1]
            want += aff[t, j] * (activation_torch(gate, up) @ wd[e] + bd[e])
        assert torch.allclose(got[t], want, atol=1e-5)
    no_bias = moe_experts_torch(x, idx, aff, wgu, wd, bgu, bd, add_down_bias=False)
    assert torch.allclose(got - no_bias, dense_affinities(idx, aff, 4) @ bd, atol=1e-5)


def test_moe_torch_tp_partials_sum_to_the_unsharded_layer():
    wgu, wd, bgu, bd = _weights(inter=8)
    g = torch.Generator().manual_seed(3)
    x, wr = torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g)
    full, idx, aff = moe_torch(x, wr, wgu, wd, top_k=2, b_gate_up=bgu, b_down=bd)
    parts = [moe_torch(x, wr, wgu[..., s], wd[:, s], top_k=2, b_gate_up=bgu[..., s], b_down=bd,
                       add_down_bias=(r == 0))[0] for r, s in enumerate((slice(0, 4), slice(4, 8)))]
    assert torch.allclose(parts[0] + parts[1], full, atol=1e-5)


def test_dequant_mxfp4_every_byte_and_scale_code_matches_ml_dtypes():
    """Every byte (both nibbles) under every E8M0 code, the NaN code 0xFF and the subnormal 2^-127 included."""
    byte = np.arange(256, dtype=np.uint8)
    blocks = np.broadcast_to(np.resize(byte, 256)[None, :].reshape(1, 16, 16), (256, 16, 16)).copy()  # [s, G, 16]
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)                          # [s, G]
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(256, 16, 32)
    fp4 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore"):  # 6 × 2^127 overflows to inf, in both
        want = (fp4 * scale[..., None]).reshape(256, 512)
    assert np.isnan(want[255]).all() and not np.isnan(want[:255]).any()
    got = dequant_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(got.numpy(), want)


def test_dequant_mxfp4_matches_ml_dtypes():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(3, 2, 32), dtype=np.uint8)            # [rows, G, 32] nibbles
    scales = rng.integers(120, 135, size=(3, 2), dtype=np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                      # low nibble = even element
    fp4 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    want = (fp4 * scale[..., None]).reshape(3, 64)
    got = dequant_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(got.numpy(), want)
