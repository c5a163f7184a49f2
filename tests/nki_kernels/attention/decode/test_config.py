"""The launch configuration of the decode kernel (nki_kernels/attention/decode/config.py) built directly: the fp8
cache's half-dim K^T stacks and the SBUF its K/V ring takes."""

import pytest

import nkisim

nkisim.install()

import nki.language as nl  # noqa: E402

from nki_kernels.attention.decode.config import (  # noqa: E402
    KV_SBUF_MAX,
    P_MAX,
    _Config,
    _ring_bytes,
)


def _cfg(B, H, d, nq, fp8=False, fp8_mm=False):
    return _Config(B, 1, H, d, 1, nq, 16384, 16384, d ** -0.5, H, 0, 2, fp8=fp8, fp8_mm=fp8_mm)


@pytest.mark.parametrize("B,H,d,nq", [(16, 3072, 64, 8), (16, 4096, 128, 4), (3, 4096, 128, 4)])
def test_fp8_stacks_hold_half_the_dims_of_twice_the_batches(B, H, d, nq):
    bf16, fp8 = _cfg(B, H, d, nq), _cfg(B, H, d, nq, fp8=True)
    assert (fp8.halves, fp8.kd) == (2, d // 2) and (bf16.halves, bf16.kd) == (1, d)
    assert fp8.kpp == 2 * bf16.kpp and fp8.kpp * fp8.kd == P_MAX
    assert fp8.nst == 2 * fp8.ngroups
    # as many score matmuls per step as bf16 (stacks of the pack), with the pack bf16 would use; one more when
    # a load group is half full (an odd count of bf16 stacks)
    assert fp8.pack == bf16.pack
    stacks = lambda c: (c.pack + c.kpp - 1) // c.kpp * c.halves   # noqa: E731
    assert stacks(fp8) == stacks(bf16) + stacks(bf16) % 2


@pytest.mark.parametrize("fp8_mm", [False, True])
def test_fp8_ring_fits_the_kv_budget(fp8_mm):
    c = _cfg(16, 3072, 64, 8, fp8=True, fp8_mm=fp8_mm)
    kt = 1 if fp8_mm else 2
    assert _ring_bytes(c.kv_bufs, c.pack, c.fa_tile, c.kpp, c.d, 2, kt) <= KV_SBUF_MAX
    # reading the pairs in the matmul needs no bf16 stacks: the same pack gets slots at least as long
    assert c.fa_tile >= _cfg(16, 3072, 64, 8, fp8=True).fa_tile


def test_kv_dtype_is_kept_for_the_matmul_views():
    c = _Config(4, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, fp8=True, fp8_mm=True,
                kv_dtype=nl.float8_e4m3)
    assert c.fp8_mm and c.kv_dtype == nl.float8_e4m3
    assert not _Config(4, 1, 3072, 64, 1, 8, 4096, 4096, 0.125, 3072, 0, 2, fp8_mm=True).fp8_mm   # bf16 cache
