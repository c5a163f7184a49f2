"""experimental/conv conv1d and depthwise_conv1d_implicit_gemm: shapes of
test/integration/nkilib/experimental/conv/test_conv1d.py (test_conv1d_basic; LNC=2, the default CompilerArgs on
trn2/trn3; atol = rtol = 1e-5 fp32, 5e-2 bf16) and test_depthwise_conv1d.py (fast and a few "all" shapes; LNC=2;
atol = rtol = 1e-2; the test's golden is a torch grouped conv2d, ours the same in NumPy terms via torch)."""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

_SRC = "test/integration/nkilib/experimental/conv/"
BF16 = ml_dtypes.bfloat16


def _conv1d(b, cin, cout, L, K, stride, pl, pr, dil, bias, act, lnc_shard, dtype, target="trn2"):
    def inputs():
        rng = np.random.default_rng(b + cin + cout + L + K)
        g = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
        acts = nkilib.load("core.utils.common_types:ActFnType")
        return {"x_in": g(b, cin, L), "filters": g(K, cin, cout), "bias": g(cout) if bias else None,
                "stride": stride, "padding": (pl, pr), "dilation": dil,
                "activation_fn": getattr(acts, act) if act else None, "lnc_shard": lnc_shard}

    tol = 5e-2 if dtype == BF16 else 1e-5
    return Case("experimental.conv.conv1d:conv1d", "experimental.conv.conv1d_torch:conv1d_torch_ref",
                f"b{b}_ic{cin}_oc{cout}_l{L}_k{K}_s{stride}_p{pl}-{pr}_d{dil}{'_bias' if bias else ''}_{act}"
                f"{'_lncshard' if lnc_shard else ''}_{np.dtype(dtype).name}", inputs, atol=tol, rtol=tol,
                source=_SRC + "test_conv1d.py::test_conv1d_basic", target=target, lnc=2)


def _depthwise_ref(img_ref, filter_ref, padding, stride, **_):
    import torch
    out = torch.nn.functional.conv2d(img_ref.float(), filter_ref.float(), stride=stride, padding=(0, padding[1][0]),
                                     groups=img_ref.shape[1])
    return {"output": out}


def _depthwise(b, c, width, k, stride, pad, dtype, test, target="trn2"):
    def inputs():
        rng = np.random.default_rng(b + c + width + k)
        g = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
        return {"img_ref": g(b, c, 1, width), "filter_ref": g(c, 1, 1, k), "padding": ((0, 0), (pad, pad)),
                "stride": (1, stride), "rhs_dilation": (1, 1), "lhs_dilation": (1, 1), "feature_group_count": c,
                "batch_group_count": 1}

    return Case("experimental.conv.depthwise_conv1d:depthwise_conv1d_implicit_gemm", _depthwise_ref,
                f"b{b}_c{c}_w{width}_k{k}_s{stride}_p{pad}_{np.dtype(dtype).name}", inputs, atol=1e-2, rtol=1e-2,
                source=_SRC + f"test_depthwise_conv1d.py::{test}", target=target, lnc=2)


F32 = np.float32
CASES = [
    _conv1d(1, 16, 32, 20, 3, 1, 0, 0, 1, False, None, False, F32),
    _conv1d(2, 64, 128, 40, 5, 2, 2, 2, 2, True, "GELU", False, F32),
    _conv1d(2, 96, 192, 80, 7, 2, 3, 3, 1, False, "SiLU", False, F32),
    _conv1d(1, 256, 256, 200, 3, 1, 1, 1, 1, False, None, False, F32),
    _conv1d(1, 48, 64, 128, 100, 1, 1, 1, 1, True, None, False, F32),
    _conv1d(1, 64, 128, 100, 5, 10, 2, 2, 1, True, "GELU", False, F32),
    _conv1d(1, 64, 128, 150, 5, 2, 4, 6, 2, False, "SiLU", False, F32),
    _conv1d(8, 32, 64, 50, 3, 1, 1, 1, 1, False, "SiLU", False, F32),
    _conv1d(1, 16, 32, 20, 3, 1, 0, 0, 1, False, None, True, F32),
    _conv1d(1, 128, 256, 200, 5, 2, 2, 2, 1, True, "GELU", True, F32),
    _conv1d(1, 16, 32, 20, 3, 1, 0, 0, 1, True, "SiLU", False, BF16),
    _conv1d(1, 64, 128, 100, 5, 1, 2, 2, 1, True, "GELU", False, BF16),
    _conv1d(2, 96, 192, 150, 7, 1, 3, 3, 1, False, "SiLU", True, F32, target="trn3"),
    _depthwise(1, 16, 512, 200, 2, 10, BF16, "test_depthwise_conv1d_fast"),
    _depthwise(1, 1024, 1024, 128, 2, 5, BF16, "test_depthwise_conv1d_fast"),
    _depthwise(1, 16, 512, 3, 1, 0, BF16, "test_depthwise_conv1d_all"),
    _depthwise(1, 256, 512, 64, 1, 10, BF16, "test_depthwise_conv1d_all"),
    _depthwise(1, 256, 512, 64, 2, 0, F32, "test_depthwise_conv1d_all"),
    _depthwise(1, 256, 129, 128, 1, 0, BF16, "test_depthwise_conv1d_all"),
    _depthwise(1, 16, 512, 200, 2, 10, BF16, "test_depthwise_conv1d_fast", target="trn3"),
]
