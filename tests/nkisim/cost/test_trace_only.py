"""Trace-only profile (numerics=False): the same modelled report without TensorE products; refused, with the
reason, for kernels whose addresses or control flow read tensor data."""

import numpy as np
import pytest

import nkisim
from nkisim.errors import NkiValidationError

from . import kernels as K
from .test_dependencies import gather_scatter, register_offset


def test_trace_only_report_equals_the_full_run():
    a = np.random.default_rng(0).standard_normal((512, 128)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)
    full = nkisim.profile(K.matmul_pipelined, a, b)
    fast = nkisim.profile(K.matmul_pipelined, a, b, numerics=False)
    assert fast.outputs is None
    np.testing.assert_allclose(full.outputs, a.T @ b, rtol=1e-4, atol=1e-3)
    assert fast.report.latency_s == full.report.latency_s
    assert fast.report.flops_issued == full.report.flops_issued
    assert [e.op for e in fast.report.events] == [e.op for e in full.report.events]


def test_trace_only_refuses_register_loads():
    x = np.zeros((300, 1024), np.float32)
    with pytest.raises(NkiValidationError, match="trace-only run: register_load reads tensor data"):
        nkisim.profile(register_offset, x, np.array([[37]], np.int32), "ds", numerics=False)


def test_trace_only_refuses_indirect_addresses():
    table = np.zeros((256, 1024), np.float32)
    idx = np.arange(128, dtype=np.int32).reshape(128, 1)
    with pytest.raises(NkiValidationError, match="addressed by index/offset tensor data"):
        nkisim.profile(gather_scatter, table, idx, False, numerics=False)
