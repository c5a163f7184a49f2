"""Attention DP inside the fused decode kernel (decode/exchange.py): N ranks of one nkisim launch, each with its
query-head shard, the gathered batch and its own sequences' caches, swap heads <-> sequences with in-kernel
all_to_alls; the sum of their partial outputs equals the single-rank kernel and the torch reference on the whole
batch with every head, and each rank's cache holds exactly its own sequences' new rows."""

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
import nkisim
from nki_kernels.attention import decode_attention, decode_attention_torch
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import dp_rank_inputs, make_inputs, to_paged

RTOL, MIN_COS = 1.5e-2, 0.99
TINY = dict(H=256, d=64, nkv=1, gamma=True, bias=True, sinks=True)     # the column's shard: nq query heads


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("NKISIM_COLLECTIVE_TIMEOUT_S", "60")


def _check_close(got, want, what):
    a, b = got.float(), want.float()
    err = (a - b).abs().max().item()
    assert err <= 1e-5 + RTOL * b.abs().max().item(), f"{what}: max err {err} vs range {b.abs().max().item()}"
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert cos >= MIN_COS, f"{what}: cosine {cos}"


def run_dp(world, columns, B, nq, s_max=256, ctx=200, window=0, block_size=0, seed=0, S=1, nkv=1, fp8=False):
    a = len(columns[0])
    args, kw = make_inputs(B, S, s_max=s_max, ctx=ctx, nq=nq, seed=seed, **dict(TINY, nkv=nkv))
    if fp8:      # e4m3fn cache, per-head scales
        args = args[:2] + tuple(c.float().mul(4.0).to(torch.float8_e4m3fn) for c in args[2:4]) + args[4:]
        kw = dict(kw, k_scale=torch.full((nkv,), 0.25), v_scale=torch.linspace(0.2, 0.3, nkv))
    if block_size:
        args, kw = to_paged(args, kw, block_size, seed=seed)
    kw["sliding_window"] = window
    ref_args = [t.clone() if t is not None else None for t in args]
    ref = decode_attention_torch(*ref_args, **kw)
    single_args = [t.clone() if t is not None else None for t in args]
    single = decode_attention(*single_args, **kw, backend="nkisim")
    inputs = [dp_rank_inputs(args, kw, columns, r) for r in range(world)]
    outs = nkisim.run_ranks(decode_attention_nki, world, inputs).outputs
    bl = B // a
    for col in columns:
        total = sum(outs[r].float() for r in col)
        assert outs[col[0]].shape == (B * S, TINY["H"])
        _check_close(total, ref, f"column {col} vs torch reference")
        _check_close(total, single, f"column {col} vs single-rank kernel")
        for j, r in enumerate(col):
            (_, _, K_r, V_r, *_), rk = inputs[r]
            own = slice(j * bl, (j + 1) * bl)
            if block_size:       # own sequences' blocks written, the rest of the pool as before
                rows = rk["block_table"].long().unique()
                assert torch.equal(K_r[rows], single_args[2][rows]) or torch.allclose(
                    K_r[rows].float(), single_args[2][rows].float(), rtol=2e-2, atol=2e-2)
                continue
            for got, want in ((K_r, ref_args[2][own]), (V_r, ref_args[3][own])):
                assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), f"rank {r} cache"
            assert not torch.equal(K_r, args[2][own])


def test_dp2_matches_single_rank():
    run_dp(2, [[0, 1]], B=4, nq=4)


def test_dp4_matches_single_rank():
    run_dp(4, [[0, 1, 2, 3]], B=8, nq=4)


def test_two_strided_columns_of_two():
    """World 4 as tp 2 x attention DP 2: columns [0, 2] and [1, 3] (rank-list order != rank order), a sliding window
    and GQA (2 query heads per rank over one KV head)."""
    run_dp(4, [[0, 2], [1, 3]], B=4, nq=4, window=64, seed=1)


def test_dp4_fewer_query_heads_per_rank_than_kv_heads():
    """GQA 2 over 2 KV heads, 4 ranks: each rank projects 1 query head but attends 4 against 2 KV heads."""
    run_dp(4, [[0, 1, 2, 3]], B=4, nq=4, nkv=2, seed=4)


def test_dp2_fp8_cache():
    """fp8 cache: each rank quantises its own tokens' k / v after the swap (scales per KV head)."""
    run_dp(2, [[0, 1]], B=4, nq=4, nkv=2, fp8=True, seed=5)


def test_dp2_two_new_tokens():
    run_dp(2, [[0, 1]], B=4, nq=4, S=2, seed=3)


def test_dp2_paged_cache():
    run_dp(2, [[0, 1]], B=4, nq=4, block_size=32, seed=2)


def test_dp_limits_are_named():
    args, kw = make_inputs(3, 1, s_max=256, ctx=200, nq=4, **TINY)
    with pytest.raises(AssertionError, match="attn_dp=2 x B_local"):
        nkisim.run_ranks(decode_attention_nki, 2, [(args, dict(kw, attn_dp_groups=[[0, 1]], attn_dp_rank=r))
                                                  for r in range(2)])
    args, kw = make_inputs(4, 1, s_max=256, ctx=200, nq=4, **TINY)
    inputs = [dp_rank_inputs(args, kw, [[0, 1]], r) for r in range(2)]
    with pytest.raises(AssertionError, match="attention DP runs at LNC=1"):
        nkisim.run_ranks(decode_attention_nki[2], 2, inputs)
    with pytest.raises(ValueError, match="attn_dp_groups needs a kernel backend"):
        decode_attention(*inputs[0][0], **inputs[0][1], backend="torch")
