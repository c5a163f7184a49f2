"""Blockwise CTE MoE: the torch backend against the unblocked fp32 reference, argument errors before any work, and
the NKI kernel on nkisim against the torch reference.

Tolerances follow nki-library's moe_cte tests (test_moe_cte.py): bf16, |a − b| <= atol + rtol · max|ref| with
rtol 2e-2, atol 1e-5.
"""

import numpy as np
import pytest
import torch

from nki_kernels.moe import moe_cte, moe_experts_torch

RTOL, ATOL = 2e-2, 1e-5


def make_inputs(T, H, E, inter, k, seed=0, bias=True, skew=None):
    """bf16 inputs in moe_torch's layout; routing uniform over distinct experts, or `skew`: "one" (every token to
    expert 0 first), "half" (only the first E/2 experts used)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w_gu = (torch.randn(E, H, 2, inter, generator=g) / H ** 0.5).to(torch.bfloat16)
    w_d = (torch.randn(E, inter, H, generator=g) / inter ** 0.5).to(torch.bfloat16)
    b_gu = (0.5 * torch.randn(E, 2, inter, generator=g)).to(torch.bfloat16) if bias else None
    b_d = (0.5 * torch.randn(E, H, generator=g)).to(torch.bfloat16) if bias else None
    used = E // 2 if skew == "half" else E
    idx = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(T)])
    if skew == "one":
        idx = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 1, generator=g)[:k - 1]])
                           for _ in range(T)])
    aff = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return x, idx, aff, w_gu, w_d, b_gu, b_d


def assert_close(out, ref):
    a, b = out.float(), ref.float()
    assert not torch.isnan(a).any(), "NaN in output"
    err = (a - b).abs().max().item()
    assert err <= ATOL + RTOL * b.abs().max().item(), f"max err {err} vs range {b.abs().max().item()}"


@pytest.mark.parametrize("activation", ["clamped_swiglu", "swiglu"])
@pytest.mark.parametrize("skew", [None, "one", "half"])
def test_torch_backend_matches_unblocked_reference(activation, skew):
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(200, 256, 8, 96, 2, skew=skew)
    out = moe_cte(x, idx, aff, w_gu, w_d, b_gate_up=b_gu, b_down=b_d, activation=activation, block_size=128,
                  backend="torch")
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = moe_experts_torch(x, idx, aff, w_gu, w_d, b_gu, b_d, activation)
    assert_close(out, ref)
    # without the down bias (the TP ranks that must not add it)
    out = moe_cte(x, idx, aff, w_gu, w_d, b_gate_up=b_gu, b_down=b_d, activation=activation, add_down_bias=False,
                  backend="torch")
    assert_close(out, moe_experts_torch(x, idx, aff, w_gu, w_d, b_gu, b_d, activation, add_down_bias=False))


def test_torch_backend_rounds_each_block_to_bf16():
    """Two experts whose outputs cancel: the per-block bf16 rounding leaves what fp32 accumulation would not."""
    x, idx, aff, w_gu, w_d, _, _ = make_inputs(4, 128, 2, 32, 2, bias=False)
    w_gu[1], w_d[1] = w_gu[0], -w_d[0]
    aff = torch.full((4, 2), 0.3)
    out = moe_cte(x, idx, aff, w_gu, w_d, backend="torch")
    assert (out == 0).all()        # bf16(a) + bf16(-a) == 0 exactly
    y = moe_experts_torch(x, idx, aff, w_gu, w_d)
    assert y.abs().max() < 1e-5


def test_numpy_inputs_give_numpy_output():
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(16, 128, 4, 32, 2, bias=False)
    out = moe_cte(x.float().numpy(), idx.numpy(), aff.numpy(), w_gu.float().numpy(), w_d.float().numpy(),
                  backend="torch")
    assert isinstance(out, np.ndarray) and out.shape == (16, 128)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(4, 100)), "H=100 must be a multiple of 128"),
    (dict(expert_index=torch.zeros(4, 5, dtype=torch.long), affinities=torch.zeros(4, 5)),
     r"top_k=5 .* must be in \[1, E=4\]"),
    (dict(w_down=torch.zeros(4, 16, 128)), r"w_down must be \[E=4, I=32, H=128\]"),
    (dict(w_gate_up=torch.zeros(4, 128, 3, 32)), r"w_gate_up must be \[E, H=128, 2, I\]"),
    (dict(b_gate_up=torch.zeros(4, 2, 16)), r"b_gate_up must be \[E=4, 2, I=32\]"),
    (dict(b_down=torch.zeros(3, 128)), r"b_down must be \[E=4, H=128\]"),
    (dict(affinities=torch.zeros(4, 1)), r"affinities must be \[T=4, k=2\]"),
    (dict(expert_index=torch.tensor([[0, 0]] * 4)), "same expert twice"),
    (dict(expert_index=torch.tensor([[0, 4]] * 4)), r"values must be in \[0, E=4\)"),
    (dict(block_size=192), "block_size=192 must be a multiple of 128"),
    (dict(block_size=640), "block_size=640 must be a multiple of 128 in"),
    (dict(activation="gelu"), "activation='gelu'"),
    (dict(backend="cuda"), "backend='cuda'"),
])
def test_bad_arguments_raise_before_work(change, match):
    x, idx, aff, w_gu, w_d, _, _ = make_inputs(4, 128, 4, 32, 2, bias=False)
    kw = dict(x=x, expert_index=idx, affinities=aff, w_gate_up=w_gu, w_down=w_d, b_gate_up=None, b_down=None,
              activation="clamped_swiglu", block_size=None, backend="nkisim")
    kw.update(change)
    args = [kw.pop(n) for n in ("x", "expert_index", "affinities", "w_gate_up", "w_down")]
    with pytest.raises(ValueError, match=match):
        moe_cte(*args, **kw)
