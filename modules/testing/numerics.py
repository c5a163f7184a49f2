"""Global-range tolerance used across the toolkit's tests: |a - b| <= atol + rtol * max|ref|."""

from __future__ import annotations

import torch


def assert_close_global(actual: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6,
                        msg: str = "") -> None:
    """Sharded matmuls reorder sums; compare against the tensor's range, not elementwise magnitudes."""
    if actual.shape != ref.shape:
        raise AssertionError(f"{msg} shape {tuple(actual.shape)} != reference {tuple(ref.shape)}")
    if ref.numel() == 0:
        return
    a, r = actual.double(), ref.double()
    err = (a - r).abs().max().item()
    bound = atol + rtol * r.abs().max().item()
    if not err <= bound:
        raise AssertionError(f"{msg} max |actual - ref| = {err:.3e} > atol + rtol * max|ref| = {bound:.3e}")
