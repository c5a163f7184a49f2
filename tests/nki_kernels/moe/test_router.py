"""router: the functional entry's checks and backends; the NKI kernel on nkisim vs router_torch (indices exact)."""

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from nki_kernels.moe import router, router_torch


def _inputs(T=8, H=256, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return ((torch.randn(T, H, generator=g)).to(bf), (torch.randn(H, E, generator=g) * H ** -0.5).to(bf),
            (torch.randn(E, generator=g) * 0.1).to(bf))


@pytest.mark.parametrize("mode,renorm", [("gpt_oss", False), ("softmax_topk", False), ("softmax_topk", True)])
def test_torch_backend_is_the_reference(mode, renorm):
    x, w, b = _inputs()
    got = router(x, w, b, top_k=4, mode=mode, renormalize=renorm, backend="torch")
    want = router_torch(x, w, b, top_k=4, mode=mode, renormalize=renorm)
    for a, c in zip(got, want):
        assert torch.equal(a, c)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9), "top_k"), (dict(top_k=0), "top_k"), (dict(mode="sigmoid"), "router mode"),
    (dict(b=torch.zeros(15)), "b_router"), (dict(x=torch.zeros(4, 255)), "x hidden size"),
    (dict(x=torch.zeros(4, 200), w=torch.zeros(200, 16)), "multiple of 128"),
    (dict(w=torch.zeros(256, 200)), "experts E=200"), (dict(backend="gpu"), "backend"),
])
def test_bad_input_is_named(kw, match):
    x, w, b = _inputs()
    x, w, b = kw.pop("x", x), kw.pop("w", w), kw.pop("b", b)
    with pytest.raises(ValueError, match=match):
        router(x, w, b, **{"top_k": 4, **kw})


# ---- the NKI kernel on nkisim --------------------------------------------------------------------------------

def _check(got, want):
    logits, idx, aff = got
    assert idx.dtype == torch.int32 and logits.dtype == torch.float32 and aff.dtype == torch.float32
    assert not torch.isnan(logits).any() and not torch.isnan(aff).any()
    assert torch.equal(idx.long(), want[1])                       # indices exact
    assert torch.allclose(logits, want[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(aff, want[2], rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("T,H,E,k,mode,renorm", [
    (1, 3072, 32, 4, "gpt_oss", False),            # GPT-OSS-20B rank shape
    (128, 3072, 128, 4, "gpt_oss", False),         # GPT-OSS-120B, a full token tile
    (130, 256, 16, 8, "softmax_topk", True),       # two token tiles, k = 8
    (5, 256, 6, "3", "softmax_topk", False),       # E < 8: max8 input padded
])
def test_kernel_matches_the_reference(T, H, E, k, mode, renorm):
    k = int(k)
    x, w, b = _inputs(T, H, E, seed=T + E)
    _check(router(x, w, b, top_k=k, mode=mode, renormalize=renorm, backend="nkisim"),
           router_torch(x, w, b, top_k=k, mode=mode, renormalize=renorm))


@pytest.mark.parametrize("mode", ["gpt_oss", "softmax_topk"])
def test_kernel_ties_lowest_index_first_and_no_bias(mode):
    x, w, _ = _inputs(4, 256, 16)
    b = torch.zeros(16, dtype=torch.bfloat16)
    b[[3, 7, 11]] = 2.0                                           # three experts tie above the rest
    w0 = torch.zeros_like(w)
    got = router(x, w0, b, top_k=4, mode=mode, backend="nkisim")
    _check(got, router_torch(x, w0, b, top_k=4, mode=mode))
    assert got[1][:, :3].tolist() == [[3, 7, 11]] * 4 and got[1][:, 3].tolist() == [0] * 4
    _check(router(x, w, None, top_k=2, mode=mode, backend="nkisim"), router_torch(x, w, None, top_k=2, mode=mode))
