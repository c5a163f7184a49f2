"""moe_tkg with MXFP4 experts (trn3 nc_matmul_mx, nki_kernels/moe/tkg_mx.py) on nkisim vs the MX reference.

The reference is moe_torch(mx=True): the CTE's expert_mlp_mx_torch (tokens and bf16 activations quantised to MXFP8
in 32-element blocks, weights the dequantised MXFP4 values). Tolerances as test_moe_tkg.py; expert indices exact;
no NaN; and the MX reference must differ from the same weights in bf16 math by more than the tolerance, so a kernel
doing bf16 math could not pass.
"""

import functools

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from modules.model_specs import GPT_OSS_20B
from nki_kernels.moe import moe_tkg
from nki_kernels.moe.cte_inputs import make_cte_mx_weights
from nki_kernels.moe.tkg_inputs import make_tkg_inputs, tkg_shard

RTOL, ATOL = 2e-2, 1e-5
OSS20_TP8 = tkg_shard(GPT_OSS_20B, 8)
SMALL = dict(H=512, E=8, top_k=2, inter=200, hidden_actual=None)
MID = dict(H=1024, E=32, top_k=4, inter=360, hidden_actual=960)     # GPT-OSS-20B's experts, a narrower H


@functools.lru_cache(maxsize=4)
def _mx_weights(E, H, inter):
    return make_cte_mx_weights(E, H, inter)


def _inputs(T, shape, skew=None, **over):
    args, kw = make_tkg_inputs(T=T, skew=skew, **shape)
    kw.update(over)
    w_gu, w_d, mxw = _mx_weights(shape["E"], shape["H"], shape["inter"])
    mx_args = (args[0], args[1], mxw["w_gate_up"], mxw["w_down"])
    kw_mx = dict(kw, w_gate_up_scale=mxw["w_gate_up_scale"], w_down_scale=mxw["w_down_scale"])
    return mx_args, kw_mx, (args[0], args[1], w_gu.to(torch.bfloat16), w_d.to(torch.bfloat16)), kw


def run_and_check(T, shape, expert_mode="auto", skew=None, lnc=1, **over):
    mx_args, kw_mx, bf_args, kw = _inputs(T, shape, skew, **over)
    out, idx, aff = moe_tkg(*mx_args, **kw_mx, expert_mode=expert_mode, backend="nkisim", lnc=lnc)
    ref, ridx, raff = moe_tkg(*mx_args, **kw_mx, backend="torch")
    assert out.shape == (T, shape["H"]) and out.dtype == mx_args[0].dtype
    assert not torch.isnan(out).any() and not torch.isnan(aff).any()
    assert torch.equal(idx.long(), ridx.long()), "expert indices differ"
    assert torch.allclose(aff, raff, rtol=RTOL, atol=ATOL)
    tol = ATOL + RTOL * ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max err {err} vs tolerance {tol}"
    bf16, _, _ = moe_tkg(*bf_args, **kw, backend="torch")
    assert (bf16.float() - ref.float()).abs().max().item() > 2 * tol, "MX reference indistinguishable from bf16 math"
    return idx


@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")


@pytest.mark.parametrize("T,mode", [(1, "selective"), (4, "selective"), (32, "auto")])
def test_gpt_oss_20b_tp8(trn3, T, mode):
    """The GPT-OSS-20B TP=8 rank (H 3072, E 32, k 4, I 360: the last MX block of I zero-padded)."""
    run_and_check(T, OSS20_TP8, mode)


@pytest.mark.parametrize("T,mode,over", [
    (1, "selective", {}),
    (4, "selective", dict(activation="swiglu", router_mode="softmax_topk", renormalize=True)),
    (6, "all", {}),
    (6, "all", dict(gamma=None, b_gate_up=None, b_down=None, b_router=None)),
    (1, "selective", dict(add_down_bias=False, gamma=None)),
    (64, "all", {}),
])
def test_small_variants(trn3, T, mode, over):
    run_and_check(T, SMALL, mode, **over)


@pytest.mark.parametrize("T,mode,shape", [(4, "selective", OSS20_TP8), (1, "selective", SMALL), (6, "all", SMALL)])
def test_lnc2(trn3, T, mode, shape):
    """LNC 2: the cores take alternate slots / experts and exchange kt halves of their partial outputs."""
    run_and_check(T, shape, mode, lnc=2)


@pytest.mark.parametrize("skew,mode,lnc", [("one", "selective", 1), ("hot", "all", 1), ("hot", "selective", 2)])
def test_skewed_routing(trn3, skew, mode, lnc):
    """Every token on the same k experts (the other experts get none) / one hot expert."""
    idx = run_and_check(16, MID, mode, skew=skew, lnc=lnc)
    if skew == "one":
        assert idx.tolist() == [[0, 1, 2, 3]] * 16
    else:
        assert (idx[:, 0] == MID["E"] - 1).all()


def test_refused_on_trn2_with_the_reason():
    mx_args, kw_mx, _, _ = _inputs(1, SMALL)
    with pytest.raises(ValueError, match="nc_matmul_mx.*trn3.*dequantises"):
        moe_tkg(*mx_args, **kw_mx, backend="nkisim")


@pytest.mark.parametrize("change,match", [
    (dict(w_down_scale=None), "w_down_scale"),
    (dict(w_gate_up="cut"), r"w_gate_up \(MXFP4 words\) must be \[E, 128, H/512=1, 2I\]"),
    (dict(w_down_scale="cut"), r"w_down_scale must be \[E, 16, chunks, N\]"),
    (dict(T=65), "T=65 must be <= 64 with MXFP4"),
])
def test_bad_packed_arguments_raise_before_work(change, match):
    mx_args, kw_mx, _, _ = _inputs(change.pop("T", 2), SMALL)
    a = list(mx_args)
    if change.get("w_gate_up") == "cut":
        a[2] = a[2][:, :64]
        change.pop("w_gate_up")
    if change.get("w_down_scale") == "cut":
        change["w_down_scale"] = kw_mx["w_down_scale"][:, :8]
    kw_mx.update(change)
    with pytest.raises(ValueError, match=match):
        moe_tkg(*a, **kw_mx, backend="torch")


def test_one_expert_under_lnc2(trn3):
    """LNC 2 with an odd count (every token on ONE expert, k = 1): one core serves it, the other only exchanges."""
    idx = run_and_check(8, dict(MID, top_k=1), "selective", skew="one", lnc=2)
    assert idx.flatten().tolist() == [0] * 8


def test_expert_bytes_mxfp4():
    """4-bit codes + one scale byte per 32 contraction elements: the 20B TP8 expert is ~27% of its bf16 bytes."""
    from nki_kernels.moe.tkg_cost import expert_bytes
    H, inter = OSS20_TP8["H"], OSS20_TP8["inter"]
    mx = expert_bytes(H, inter, mx=True)
    assert mx == H * 2 * inter // 2 + (H // 32) * 2 * inter + inter * H // 2 + -(-inter // 32) * H + (2 * inter + H) * 2
    assert 0.26 < mx / expert_bytes(H, inter) < 0.28
