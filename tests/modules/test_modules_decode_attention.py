"""DecodeAttention over a 2-rank gloo group: the all-reduced partial O-projections equal the unsharded reference."""

import pytest
import torch

from modules.testing import run_distributed

H, NQ, NKV, D, B, S, CTX = 256, 8, 2, 64, 3, 2, 200


def _full_inputs():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nki_kernels" / "attention"))
    from test_decode_attention import make_inputs
    return make_inputs(B, S, H, D, NKV, NQ, s_max=CTX, ctx=CTX, gamma=True, bias=True, sinks=True, seed=3)


def _rank(rank, world_size, backend, bias_o=None):
    from modules.attention import DecodeAttention
    from modules.parallel.coordinator import GroupCoordinator
    tp = GroupCoordinator([list(range(world_size))], "attention_tp")
    (X, W, Kc, Vc, pos, cos, sin, Wo), kw = _full_inputs()
    nq, nkv = NQ // world_size, NKV // world_size
    m = DecodeAttention(H, nq, nkv, D, tp, bias=True, sinks=True, backend=backend)
    q_cols = slice(rank * nq * D, (rank + 1) * nq * D)
    k_cols = slice(NQ * D + rank * nkv * D, NQ * D + (rank + 1) * nkv * D)
    v_cols = slice((NQ + NKV) * D + rank * nkv * D, (NQ + NKV) * D + (rank + 1) * nkv * D)
    m.w_qkv.data = torch.cat([W[:, q_cols], W[:, k_cols], W[:, v_cols]], dim=1)
    m.b_qkv.data = torch.cat([kw["bias_qkv"][:, q_cols], kw["bias_qkv"][:, k_cols], kw["bias_qkv"][:, v_cols]], 1)
    m.w_o.data = Wo[q_cols].contiguous()
    m.b_o.data = kw["bias_o"] if bias_o is None else bias_o
    m.gamma.data = kw["gamma"]
    m.sinks.data = kw["sinks"][rank * nq:(rank + 1) * nq].contiguous()
    kc = Kc[:, rank * nkv:(rank + 1) * nkv].contiguous()
    vc = Vc[:, rank * nkv:(rank + 1) * nkv].contiguous()
    out = m(X, kc, vc, pos, cos, sin, context_len=CTX)
    return out.float()


@pytest.mark.timeout(120)
def test_two_rank_decode_attention_matches_unsharded_reference():
    from nki_kernels.attention import decode_attention_torch
    outs = run_distributed(_rank, 2, "nkisim")
    args, kw = _full_inputs()
    ref = decode_attention_torch(*args, **kw).float().view(B, S, H)
    assert torch.equal(outs[0], outs[1])
    err = (outs[0] - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), err


def _bias_runs(rank, world_size, backend, bias):
    """The all-reduced output with the O bias `bias` and with a zero O bias (same inputs, fresh caches)."""
    return [_rank(rank, world_size, backend, bias_o=b) for b in (bias, torch.zeros_like(bias))]


@pytest.mark.timeout(180)
def test_o_bias_is_added_once_across_the_tp_group():
    """Every rank holds bias_o, the kernel adds it on the group's first rank only (add_bias_o): the all-reduced
    output carries it exactly once. The bias (4 .. 8, exact in bf16) dwarfs the attention output (|o| < 1), so a
    bias added on both ranks (a difference of 8 .. 16) cannot pass."""
    bias = (4.0 + torch.arange(H) % 5).to(torch.bfloat16).reshape(1, H)
    runs = run_distributed(_bias_runs, 2, "nkisim", bias)
    for with_b, without_b in runs:
        diff = with_b - without_b
        assert torch.allclose(diff, bias.float().expand_as(diff), atol=0.15), (diff - bias.float()).abs().max()
