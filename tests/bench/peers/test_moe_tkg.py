"""The side-by-side adapter of nki-library's moe_tkg computes the same experts as our kernel: given our RMSNorm output
and routing, its output matches the shared reference in both of its modes (so the bench compares equal expert work).
Needs NKILIB_SRC."""

import numpy as np
import pytest

from bench.peers import nkilib

pytestmark = pytest.mark.skipif(nkilib.skip_reason() is not None, reason=str(nkilib.skip_reason()))


@pytest.mark.parametrize("T,mode,activation", [(3, "selective", "clamped_swiglu"), (8, "all", "clamped_swiglu"),
                                               (4, "selective", "swiglu")])
def test_library_experts_match_our_reference(T, mode, activation):
    import nkisim
    from bench.peers import moe_tkg as peer
    from nki_kernels.moe import moe_torch, rmsnorm_torch, router_torch
    from nki_kernels.moe.tkg_inputs import make_tkg_inputs

    args, kw = make_tkg_inputs(T=T, H=512, E=8, top_k=2, inter=128, hidden_actual=480, seed=3)
    x, wr, wgu, wd = args
    h = rmsnorm_torch(x, kw["gamma"], 1e-5, kw["hidden_actual"]).to(x.dtype)
    _, idx, aff = router_torch(h, wr, kw["b_router"], top_k=2)
    kin = peer.inputs(h, idx, aff, wgu, wd, kw["b_gate_up"], kw["b_down"], mode=mode, activation=activation)
    out = np.asarray(nkisim.simulate(peer.kernel()[2])(**kin)).astype(np.float32)
    ref = moe_torch(*args, **kw, activation=activation)[0].numpy()
    assert out.shape == ref.shape and not np.isnan(out).any()
    assert np.abs(out - ref).max() <= 1e-5 + 2e-2 * np.abs(ref).max()
