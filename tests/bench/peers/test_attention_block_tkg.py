"""The side-by-side adapter of nki-library's attention_block_tkg computes the same attention as our kernel: on the
same inputs its output matches our torch reference (so the bench compares equal work). Needs NKILIB_SRC."""

import numpy as np
import pytest

from bench.peers import nkilib

pytestmark = pytest.mark.skipif(nkilib.skip_reason() is not None, reason=str(nkilib.skip_reason()))


@pytest.mark.parametrize("B,S,ctx", [(3, 1, 512), (2, 2, 384)])
def test_library_block_matches_our_reference(B, S, ctx):
    nkilib.activate()
    import nki

    import nkisim
    from bench.peers.attention_block_tkg import inputs, launch
    from nki_kernels.attention import decode_attention
    from nki_kernels.attention.decode_inputs import make_inputs

    args, kw = make_inputs(B, S, H=1024, d=64, nkv=1, nq=4, s_max=ctx, ctx=ctx, gamma=True, bias=False,
                           sinks=False, seed=5)
    kin = inputs(*args, kw["gamma"])
    out = np.asarray(nkisim.simulate(nki.jit(launch))(**kin)).astype(np.float32)
    ref = decode_attention(*[a.clone() if a is not None else None for a in args], **kw, backend="torch")
    ref = ref.float().numpy()
    assert out.shape == ref.shape
    assert not np.isnan(out).any()
    assert np.abs(out - ref).max() <= 1e-5 + 0.015 * np.abs(ref).max()
