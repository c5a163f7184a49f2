"""core/router_topk: configurations of test/integration/nkilib/core/router_topk/test_router_topk.py (rtol 2e-2,
atol 1e-5, the library's max-mode comparison of logits, indices and affinities), run through a thin kernel of ours
that drives router_topk as the test's wrapper does: x from HBM or pre-loaded into SBUF with the library's
router_topk_input_x_load, the three outputs written in place (HBM, or SBUF then copied out).
Inputs: our seeded uniform(-0.1, 0.1) bf16 x / w / bias, the range the test uses (x.T @ w feeds a sigmoid)."""

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np

from .harness import Case

SOURCE = "test/integration/nkilib/core/router_topk/test_router_topk.py::test_router_topk"
_FLAGS = ("router_pre_norm", "norm_topk_prob", "use_column_tiling", "use_indirect_dma_scatter",
          "use_PE_broadcast_w_bias", "shard_on_tokens")


def router_topk_launch(x, w, w_bias, router_logits, expert_affinities, expert_index, act_fn, k, x_hbm_layout,
                       x_sb_layout, router_pre_norm=True, norm_topk_prob=False, use_column_tiling=False,
                       use_indirect_dma_scatter=False, use_PE_broadcast_w_bias=False, shard_on_tokens=False,
                       output_in_sbuf=False, x_input_in_sbuf=False):
    """Our launch kernel around the library's router_topk (its outputs are mutable arguments)."""
    from nkilib_src.nkilib.core.router_topk import router_topk as rt
    x_in = rt.router_topk_input_x_load(x, hbm_layout=rt.XHBMLayout_T_H__1, sb_layout=x_sb_layout) \
        if x_input_in_sbuf else x
    if output_in_sbuf:
        t, e = expert_affinities.shape
        idx_out = nl.ndarray((t, k), dtype=nl.uint32, buffer=nl.sbuf)
        aff_out = nl.ndarray((t, e), dtype=nl.float32, buffer=nl.sbuf)
    else:
        idx_out, aff_out = expert_index, expert_affinities
    rt.router_topk(x=x_in, w=w, w_bias=w_bias, router_logits=router_logits, expert_affinities=aff_out,
                   expert_index=idx_out, act_fn=act_fn, k=k, x_hbm_layout=x_hbm_layout, x_sb_layout=x_sb_layout,
                   router_pre_norm=router_pre_norm, norm_topk_prob=norm_topk_prob,
                   use_column_tiling=use_column_tiling, use_indirect_dma_scatter=use_indirect_dma_scatter,
                   use_PE_broadcast_w_bias=use_PE_broadcast_w_bias, shard_on_tokens=shard_on_tokens)
    if output_in_sbuf:
        nisa.dma_copy(dst=expert_index, src=idx_out)
        nisa.dma_copy(dst=expert_affinities, src=aff_out)
    return router_logits, expert_index, expert_affinities


def _drop_launch_only(kwargs):
    return {k: v for k, v in kwargs.items() if k != "output_in_sbuf"}


def _case(T, H, E, k, act, bias, flags=(), x_sb=False, x_hbm=0, x_sbl=0, outsb=False, target="trn2"):
    lnc = 2 if "shard_on_tokens" in flags else 1

    def inputs():
        from nkilib_src.nkilib.core.utils.common_types import RouterActFnType
        rng = np.random.default_rng(0)
        uni = lambda *s: rng.uniform(-0.1, 0.1, size=s).astype(np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
        th = x_sb or x_hbm == 1
        kw = {"x": uni(T, H) if th else uni(H, T), "w": uni(H, E), "w_bias": uni(1, E) if bias else None,
              "router_logits": np.zeros((T, E), ml_dtypes.bfloat16),
              "expert_affinities": np.zeros((T, E), np.float32 if outsb else ml_dtypes.bfloat16),
              "expert_index": np.zeros((T, k), np.uint32), "act_fn": getattr(RouterActFnType, act), "k": k,
              "x_hbm_layout": x_hbm, "x_sb_layout": x_sbl, "output_in_sbuf": outsb, "x_input_in_sbuf": x_sb}
        kw.update({f: f in flags for f in _FLAGS})
        return kw

    tag = "_".join([f"T{T}_H{H}_E{E}_k{k}_{act.lower()}", "bias" if bias else "nobias",
                    *(f.replace("use_", "").replace("router_", "") for f in flags),
                    *(["xsb" + str(x_sbl)] if x_sb else []), *(["xTH"] if x_hbm == 1 else []),
                    *(["outsb"] if outsb else [])])
    return Case(router_topk_launch, "core.router_topk.router_topk_torch:router_topk_torch_ref", tag, inputs,
                atol=1e-5, rtol=2e-2, source=SOURCE, target=target, lnc=lnc, ref_inputs=_drop_launch_only,
                out_args=("router_logits", "expert_index", "expert_affinities"))


CASES = [
    _case(4, 3072, 128, 4, "SOFTMAX", True),
    _case(4, 3072, 128, 4, "SOFTMAX", True, x_hbm=1, target="trn3"),
    _case(4, 3072, 128, 4, "SOFTMAX", True, ("use_PE_broadcast_w_bias",)),
    _case(16, 3072, 128, 4, "SOFTMAX", True, ("use_column_tiling",)),
    _case(4, 3072, 256, 4, "SOFTMAX", True, x_sb=True, x_sbl=1),
    _case(8, 8192, 128, 8, "SIGMOID", True, ("router_pre_norm", "use_indirect_dma_scatter"), target="trn3"),
    _case(8, 8192, 128, 8, "SOFTMAX", True, ("router_pre_norm", "norm_topk_prob", "use_indirect_dma_scatter")),
    _case(32, 3072, 128, 4, "SOFTMAX", True, ("router_pre_norm", "norm_topk_prob"), x_sb=True, x_sbl=2),
    _case(48, 3072, 128, 4, "SOFTMAX", True, ("shard_on_tokens",)),
    _case(8, 512, 128, 4, "SOFTMAX", False, ("shard_on_tokens",), outsb=True, target="trn3"),
    _case(2, 5120, 16, 1, "SOFTMAX", False),
]
