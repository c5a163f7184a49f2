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
