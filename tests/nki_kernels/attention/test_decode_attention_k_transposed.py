"""decode_attention(K_cache_transposed=True): K stored [B, nkv, d, S_max] (AWS nki-library's attention_block_tkg
layout), loaded with plain DMA copies into the SBUF K^T layout the row-major cache's DMA transposes produce. The
results must be the row-major cache's, bit for bit (same SBUF bytes, same instruction stream downstream), and the new
tokens' K written as columns."""

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from modules.model_specs import GPT_OSS_20B, LLAMA_31_8B
from nki_kernels.attention import decode_attention, decode_attention_torch
from nki_kernels.attention.decode import config as cfg_mod
from nki_kernels.attention.decode import flash
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import make_inputs, rank_shard, to_paged

RTOL, ATOL = 1.5e-2, 1e-5
GPT_OSS_20B_TP8 = rank_shard(GPT_OSS_20B, 8)
LLAMA31_8B_TP8 = rank_shard(LLAMA_31_8B, 8)


def _clone(args):
    return [a.clone() if a is not None else None for a in args]


def _fp8(args, kw):
    one = torch.ones(1)
    args = list(args[:2]) + [c.float().to(torch.float8_e4m3fn) for c in args[2:4]] + list(args[4:])
    return args, dict(kw, k_scale=one, v_scale=one)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _transposed(args):
    """The same inputs with K_cache stored [B, nkv, d, S_max]."""
    args = _clone(args)
    args[2] = args[2].transpose(2, 3).contiguous()
    return args


def _run_both(args, kw, lnc=1, probe=None):
    """The kernel on the row-major cache and on the transposed one (probe(cfg) recorded for every _Config of the
    transposed run). Returns (out_row_major, out_transposed, args_row_major, args_transposed) after the runs."""
    a_row, a_t = _clone(args), _transposed(args)
    out_row = decode_attention(*a_row, **kw, backend="nkisim", lnc=lnc)
    seen = []
    orig = cfg_mod._Config.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(probe(self) if probe else self.k_t)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cfg_mod._Config, "__init__", spy)
        out_t = decode_attention(*a_t, **kw, backend="nkisim", lnc=lnc, K_cache_transposed=True)
    assert seen and all(seen), "the transposed run did not take the case's path"
    return out_row, out_t, a_row, a_t


def _check_same(out_row, out_t, a_row, a_t):
    """Same output bits, same V cache, K cache = the row-major one transposed (the update written as columns)."""
    assert torch.equal(_bits(out_row), _bits(out_t)), (out_row.float() - out_t.float()).abs().max().item()
    assert torch.equal(_bits(a_row[3]), _bits(a_t[3]))
    assert torch.equal(_bits(a_row[2]), _bits(a_t[2].transpose(2, 3)))


def _check_reference(args, kw, out_t, a_t):
    """The torch reference takes the flag too: same output within tolerance, same cache update."""
    ref_args = _transposed(args)
    ref = decode_attention_torch(*ref_args, **kw, K_cache_transposed=True).float()
    a = out_t.float()
    assert torch.isfinite(a).all()
    assert (a - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    assert torch.allclose(a_t[2].float(), ref_args[2].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape,B,ctx,window,lnc,pos0", [
    (GPT_OSS_20B_TP8, 4, 1024, 0, 1, None),      # d = 64: two batches per K^T stack, ragged positions
    (GPT_OSS_20B_TP8, 8, 4096, 0, 1, None),      # multi-piece ragged slots: half pieces, rotations
    (LLAMA31_8B_TP8, 3, 1024, 0, 1, None),       # d = 128: one batch per stack
    (LLAMA31_8B_TP8, 2, 600, 0, 1, None),        # remainder slot (S_max not a multiple of 128)
    (GPT_OSS_20B_TP8, 8, 4096, 0, 2, None),      # LNC=2, batch split
    (GPT_OSS_20B_TP8, 1, 2048, 0, 2, 300),       # LNC=2, context split
    (GPT_OSS_20B_TP8, 1, 8192, 0, 1, 6500),      # one sequence: K^T on alternating lanes (kt_alt)
    (GPT_OSS_20B_TP8, 4, 2048, 128, 1, None),    # sliding window: register-addressed windowed loads
])
def test_transposed_cache_matches_row_major(shape, B, ctx, window, lnc, pos0):
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, seed=5, **shape)
    if pos0 is not None:
        args[4][0] = pos0
    kw["sliding_window"] = window
    out_row, out_t, a_row, a_t = _run_both(args, kw, lnc)
    _check_same(out_row, out_t, a_row, a_t)
    _check_reference(args, kw, out_t, a_t)


def test_transposed_pairs_of_whole_slots():
    """GPT-OSS B=32 2K ragged: the K^T of two sequences' whole slots in one load (flash._load_k_pair, _Config.k_plain)
    as one plain copy from the transposed cache; checked to fail with the pair's second sequence read at the first
    one's offset (the copy's batch step)."""
    calls = []
    orig = flash._load_k_pair

    def spy(cfg, *a, **k):
        calls.append(cfg.k_t)
        return orig(cfg, *a, **k)
    args, kw = make_inputs(32, 1, s_max=2048, ctx=2048, seed=0, **GPT_OSS_20B_TP8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_load_k_pair", spy)
        out_row, out_t, a_row, a_t = _run_both(args, kw)
    assert True in calls and False in calls
    _check_same(out_row, out_t, a_row, a_t)


def _poison(args, k_t):
    """NaN in every cache row at or past each sequence's first new position (K transposed: columns)."""
    for b in range(args[4].shape[0]):
        p0 = int(args[4][b, 0])
        args[3][b, :, p0:] = float("nan")
        if k_t:
            args[2][b, :, :, p0:] = float("nan")
        else:
            args[2][b, :, p0:] = float("nan")


@pytest.mark.parametrize("shape,B,ctx,lnc", [(GPT_OSS_20B_TP8, 4, 4096, 1), (LLAMA31_8B_TP8, 3, 1024, 1),
                                             (GPT_OSS_20B_TP8, 4, 1024, 2)])
def test_transposed_nan_tails_stay_isolated(shape, B, ctx, lnc):
    """Stale NaN columns of the transposed K cache (and rows of V) never reach a result: the output has the bits
    of the clean cache's (the scrubs see the same SBUF layout)."""
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, seed=7, **shape)
    clean = _transposed(args)
    poisoned = _transposed(args)
    _poison(poisoned, True)
    out = decode_attention(*poisoned, **kw, backend="nkisim", lnc=lnc, K_cache_transposed=True)
    out_clean = decode_attention(*clean, **kw, backend="nkisim", lnc=lnc, K_cache_transposed=True)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(_bits(out), _bits(out_clean))


def test_torch_backend_takes_the_flag():
    args, kw = make_inputs(2, 1, s_max=256, ctx=256, seed=3, **GPT_OSS_20B_TP8)
    a_row, a_t = _clone(args), _transposed(args)
    ref = decode_attention(*a_row, **kw, backend="torch")
    got = decode_attention(*a_t, **kw, backend="torch", K_cache_transposed=True)
    assert torch.equal(ref, got)
    assert torch.equal(a_row[2], a_t[2].transpose(2, 3))


def test_transposed_limits_are_named():
    """Paged + transposed, fp8 + transposed, attention DP + transposed and a K_cache not in the transposed layout
    raise before any work, naming K_cache_transposed / K_cache."""
    args, kw = make_inputs(2, 1, s_max=512, ctx=512, seed=1, **GPT_OSS_20B_TP8)
    f_args, f_kw = _fp8(_transposed(args), kw)
    k_before = f_args[2].clone()
    with pytest.raises(ValueError, match=r"^K_cache_transposed=True supports a bf16 cache only"):
        decode_attention(*f_args, **f_kw, backend="nkisim", K_cache_transposed=True)
    with pytest.raises(ValueError, match=r"^K_cache_transposed=True supports a bf16 cache only"):
        decode_attention(*f_args, **f_kw, backend="torch", K_cache_transposed=True)
    with pytest.raises(AssertionError, match=r"^K_cache_transposed=True supports a bf16 cache only"):
        decode_attention_nki(*f_args, **f_kw, K_cache_transposed=True)
    assert torch.equal(_bits(f_args[2]), _bits(k_before))
    p_args, p_kw = to_paged(args, kw, 32)
    k_before = p_args[2].clone()
    with pytest.raises(ValueError, match=r"^K_cache_transposed=True supports a contiguous cache only"):
        decode_attention(*p_args, **p_kw, backend="nkisim", K_cache_transposed=True)
    with pytest.raises(AssertionError, match=r"^K_cache_transposed=True supports a contiguous cache only"):
        decode_attention_nki(*p_args, **p_kw, K_cache_transposed=True)
    assert torch.equal(p_args[2], k_before)
    row = _clone(args)      # row-major K with the flag: blamed on K_cache
    with pytest.raises(ValueError, match=r"^K_cache: shape \(2, 1, 512, 64\) with K_cache_transposed=True must be"):
        decode_attention(*row, **kw, backend="nkisim", K_cache_transposed=True)
    with pytest.raises(AssertionError, match=r"^K_cache: shape .* with K_cache_transposed=True"):
        decode_attention_nki(*row, **kw, K_cache_transposed=True)
    with pytest.raises(ValueError, match=r"^K_cache_transposed=True is not supported with attn_dp_groups"):
        decode_attention(*_transposed(args), **kw, backend="nkisim", K_cache_transposed=True,
                         attn_dp_groups=((0, 1),), attn_dp_rank=0)
    assert torch.equal(row[2], args[2])
