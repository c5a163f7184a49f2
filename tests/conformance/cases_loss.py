"""experimental/loss cross_entropy_forward / cross_entropy_backward: configurations of
test/integration/nkilib/experimental/loss/test_cross_entropy_forward.py and test_cross_entropy_backward.py
(V, dtype, positions_per_batch PB, chunk_size CS and reduction as in their fast grids; LNC=2, the default
CompilerArgs), atol = rtol = 1e-2 bf16 / 1e-5 fp32. The tests' golden runs the library's torch references in the
kernel dtype and rounds to it; ours does the same. Only the minimal (1, 1) shape is the library's own: its other
fast shapes have 4k-16k positions x 32k-200k vocab (GBs of logits), so B*T is cut to 64-128 positions here with the
same V / PB / CS (single- and multi-chunk)."""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

_SRC = "test/integration/nkilib/experimental/loss/"
BF16 = ml_dtypes.bfloat16


def _torch_in(logits, dtype):
    import torch
    return logits.float().to(torch.bfloat16 if dtype == BF16 else torch.float32)


def _forward_ref(logits_hbm, targets_hbm, positions_per_batch, chunk_size, dtype):
    ref = nkilib.load("experimental.loss.cross_entropy_torch:cross_entropy_forward_torch_ref")
    np_dtype = BF16 if dtype == "bfloat16" else np.float32
    loss, lse = ref(_torch_in(logits_hbm, np_dtype), targets_hbm.long())
    return {"loss_hbm": loss.float().numpy().astype(np_dtype), "lse_state_hbm": lse.float().numpy().astype(np_dtype)}


def _backward_ref(logits_hbm, targets_hbm, lse_state_hbm, reduction, positions_per_batch, chunk_size, dtype):
    ref = nkilib.load("experimental.loss.cross_entropy_torch:cross_entropy_backward_torch_ref")
    np_dtype = BF16 if dtype == "bfloat16" else np.float32
    grad = ref(_torch_in(logits_hbm, np_dtype), targets_hbm.long(), reduction)
    return {"grad_logits_hbm": grad.float().numpy().astype(np_dtype)}


def _logits(n, V, dtype):
    rng = np.random.default_rng(n * 7 + V)
    return rng.standard_normal((n, V)).astype(np.float32).astype(dtype), rng.integers(0, V, n).astype(np.int32)


def _with_nki_dtype(kw):
    import nki.language as nl
    return {**kw, "dtype": nl.bfloat16 if kw["dtype"] == "bfloat16" else nl.float32}


def _forward(n, V, dtype, PB, CS, target="trn2"):
    def inputs():
        logits, targets = _logits(n, V, dtype)
        return _with_nki_dtype({"logits_hbm": logits, "targets_hbm": targets, "positions_per_batch": PB,
                                "chunk_size": CS, "dtype": np.dtype(dtype).name})

    tol = 1e-2 if dtype == BF16 else 1e-5
    return Case("experimental.loss:cross_entropy_forward", _forward_ref,
                f"n{n}_v{V}_{np.dtype(dtype).name}_pb{PB}_cs{CS}", inputs, atol=tol, rtol=tol,
                source=_SRC + "test_cross_entropy_forward.py (fast grid configs)", target=target, lnc=2,
                ref_inputs=lambda kw: {**kw, "dtype": str(kw["dtype"])})


def _backward(n, V, dtype, PB, CS, reduction, target="trn2"):
    def inputs():
        import torch
        logits, targets = _logits(n, V, dtype)
        fwd = nkilib.load("experimental.loss.cross_entropy_torch:cross_entropy_forward_torch_ref")
        _, lse = fwd(_torch_in(torch.from_numpy(logits.astype(np.float32)), dtype), torch.from_numpy(targets).long())
        return _with_nki_dtype({"logits_hbm": logits, "targets_hbm": targets,
                                "lse_state_hbm": lse.float().numpy().astype(dtype), "reduction": reduction,
                                "positions_per_batch": PB, "chunk_size": CS, "dtype": np.dtype(dtype).name})

    tol = 1e-2 if dtype == BF16 else 1e-5
    return Case("experimental.loss:cross_entropy_backward", _backward_ref,
                f"n{n}_v{V}_{np.dtype(dtype).name}_pb{PB}_cs{CS}_{reduction}", inputs, atol=tol, rtol=tol,
                source=_SRC + "test_cross_entropy_backward.py (fast grid configs)", target=target, lnc=2,
                ref_inputs=lambda kw: {**kw, "dtype": str(kw["dtype"])})


F32 = np.float32
CASES = [
    _forward(1, 32128, BF16, 1, 32128), _forward(128, 32128, BF16, 64, 32128),
    _forward(64, 129280, BF16, 64, 65535), _forward(64, 129280, F32, 64, 32768),
    _forward(128, 32128, BF16, 64, 32128, target="trn3"),
    _backward(1, 32128, BF16, 1, 16384, "mean"), _backward(128, 32128, BF16, 64, 16384, "mean"),
    _backward(128, 32128, F32, 64, 8192, "sum"), _backward(64, 129280, BF16, 64, 16384, "mean"),
    _backward(64, 129280, F32, 64, 8192, "mean"), _backward(128, 32128, BF16, 64, 16384, "mean", target="trn3"),
]
