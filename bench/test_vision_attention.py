"""Block vision attention (Qwen3-VL vision encoder, one rank at vision TP 4): our fused kernel vs nki-library, MODELLED
by the nkisim cost model (not measured).

Shapes: QWEN3_VL_VIT from modules/model_specs (hidden 1152, 16 heads of 72) at vision TP 4 (4 heads on the rank),
block sizes 1024 / 2048 / 4096, image mixes: one image filling the block, two images (3/4 + 1/4 of it), and five equal
images filling 90% of it (the rest padding rows). trn2 at LNC 1 for all, trn3 for the one-image blocks; one LNC 2
row. (That the cost follows the image sizes is asserted in tests/nki_kernels/vision/test_block_attention.py.)

Ours (`vision_block_attention_nki`): the whole block -- QKV projection with bias, RoPE, bounded attention, partial
O-projection -- from HBM to HBM. Its key loops depend on the bounds (runtime registers), so it is profiled with
numerics (a trace-only run cannot know the trip counts).
"% of TensorE peak" = the useful FLOPs (nki_kernels/vision/work.py: projections + attention over each image's own key
pairs) / (modelled latency x bf16 peak) = the report's MFU. Issue 14's target (>= 55% for one image filling a block
of >= 2048) is recorded per row (`modelled_meets_55pct_target`) and asserted on every such row (trn2 and trn3, 2048
and 4096; nki_kernels/vision/DESIGN.md, "Performance").

nki-library (NKILIB_SRC; skipped with the reason otherwise; bench/peers/nkilib_vision.py): `attention_cte` with
sequence packing on the same bounds (attention only: Q, K, V in, O out), and the library pipeline for the same block
= qkv (CTE path, with bias) + attention_cte + output_projection_cte, three kernels profiled separately and summed
(no RoPE: the library has no kernel for it here, which favours the library). Rows record
`modelled_speedup_vs_peer` = library pipeline / ours (> 1: ours faster) and `modelled_speedup_vs_attention_cte` =
attention_cte ALONE / ours (our whole fused block against the library's attention without its projections).
"""

import pytest

import nkisim
from bench.peers import nkilib
from modules.model_specs import QWEN3_VL_VIT
from nki_kernels.vision.block_attention import vision_block_attention_nki
from nki_kernels.vision.inputs import make_inputs
from nki_kernels.vision.work import attention_flops, useful_flops

pytestmark = pytest.mark.skipif(not nkisim.active(), reason="real nki present: these figures are modelled")

VISION_TP = 4
H, NH, D = QWEN3_VL_VIT.hidden, QWEN3_VL_VIT.heads // VISION_TP, QWEN3_VL_VIT.head_dim
BLOCKS = (1024, 2048, 4096)
MIXES = ("1-image", "2-images", "5-images-padded")
# trn2: every block size and mix; trn3: the one-image blocks (the bench must stay short)
CASES = [(S, mix, "trn2") for S in BLOCKS for mix in MIXES] + [(S, "1-image", "trn3") for S in BLOCKS]
TARGET_MFU = 0.55    # issue 14: one image filling a block of >= 2048, trn2 and trn3
_OURS = {}


def sizes(mix, S):
    """Patches per image of a mix (packed from row 0; the rest of the block is padding)."""
    if mix == "1-image":
        return (S,)
    if mix == "2-images":
        return (3 * S // 4, S // 4)
    return (S * 9 // 50,) * 5


def ours(S, mix, target, lnc=1):
    key = (S, mix, target, lnc)
    if key not in _OURS:
        sz = sizes(mix, S)
        args = make_inputs(S, H, NH, D, sz)
        kernel = vision_block_attention_nki if lnc == 1 else vision_block_attention_nki[lnc]
        _, rep = nkisim.profile(kernel, *args, target=target, useful_flops=useful_flops(S, H, NH, D, sz),
                                num_heads=NH, head_dim=D)
        _OURS[key] = rep
    return _OURS[key]


def _record(benchmark, rep, S, mix, lnc, impl="ours", **extra):
    info = rep.extra_info()
    info.update({"kernel": f"vision block attention ({impl})", "bucket": f"S={S} {mix} lnc={lnc}",
                 "block_size": S, "mix": mix, "images": len(sizes(mix, S)), "lnc": lnc, "impl": impl,
                 "heads_on_rank": NH, "head_dim": D, "hidden": H, "modelled_bound_s": rep.roofline_s,
                 "modelled_tensor_peak_fraction": rep.mfu, **extra})
    benchmark.extra_info.update(info)


@pytest.mark.benchmark(group="vision block attention (ours)")
@pytest.mark.parametrize("S,mix,target", CASES)
def test_vision_attention_modelled(benchmark, S, mix, target):
    rep = benchmark.pedantic(ours, args=(S, mix, target), rounds=1, iterations=1)
    meets = rep.mfu >= TARGET_MFU if (mix == "1-image" and S >= 2048) else None
    _record(benchmark, rep, S, mix, 1, modelled_meets_55pct_target=meets)
    if meets is not None:
        assert meets, f"{100 * rep.mfu:.1f}% of TensorE peak < {100 * TARGET_MFU:.0f}%"
    assert rep.latency_s >= rep.roofline_s * 0.999     # a modelled latency never beats its own roofline
    assert rep.flops_issued >= rep.flops * 0.999        # the declared useful work is work the kernel issued


@pytest.mark.benchmark(group="vision block attention (ours)")
def test_vision_attention_lnc2_modelled(benchmark):
    """LNC 2 (query tiles split between the two cores) on the largest block: near half the LNC 1 latency."""
    rep = benchmark.pedantic(ours, args=(4096, "1-image", "trn2", 2), rounds=1, iterations=1)
    one = ours(4096, "1-image", "trn2")
    _record(benchmark, rep, 4096, "1-image", 2, modelled_speedup_vs_lnc1=one.latency_s / rep.latency_s)
    assert rep.latency_s < 0.65 * one.latency_s


@pytest.mark.benchmark(group="vision block attention vs nki-library")
@pytest.mark.skipif(nkilib.skip_reason() is not None, reason=str(nkilib.skip_reason()))
@pytest.mark.parametrize("S,mix,target", CASES)
def test_vision_attention_vs_nkilib_modelled(benchmark, S, mix, target):
    """The library on the same packed block; the row is the library pipeline (qkv + attention_cte + O-projection)."""
    from bench.peers import nkilib_vision as lib
    from nki_kernels.vision.inputs import packed_bounds

    sz = sizes(mix, S)
    lo, hi = packed_bounds(sz, S)

    def run():
        attn = lib.attention_cte_packed(S, NH, D, lo.numpy(), hi.numpy(), target=target,
                                        useful_flops=attention_flops(NH, D, sz))
        return attn, lib.qkv_cte(S, H, NH, D, target=target), lib.output_projection_cte(S, H, NH, D, target=target)

    attn, qkv, oproj = benchmark.pedantic(run, rounds=1, iterations=1)
    mine = ours(S, mix, target)
    pipeline_s = qkv.latency_s + attn.latency_s + oproj.latency_s
    parts = (qkv, attn, oproj)
    _record(benchmark, attn, S, mix, 1, impl="nki-library qkv + attention_cte + output_projection_cte",
            modelled_latency_s=pipeline_s, modelled_bound_s=sum(r.roofline_s for r in parts),
            modelled_flops=sum(r.flops for r in parts), modelled_flops_issued=sum(r.flops_issued for r in parts),
            modelled_hbm_read_bytes=sum(r.hbm_read_bytes for r in parts),
            modelled_hbm_write_bytes=sum(r.hbm_write_bytes for r in parts),
            modelled_tensor_peak_fraction=sum(r.flops for r in parts) / (pipeline_s * attn.peak_flops),
            modelled_mfu=sum(r.flops for r in parts) / (pipeline_s * attn.peak_flops),
            modelled_latency_with_launch_s=pipeline_s + 3 * attn.launch_s,      # three kernel launches
            modelled_roofline_fraction=sum(r.roofline_s for r in parts) / pipeline_s,
            modelled_attention_cte_latency_s=attn.latency_s,
            modelled_qkv_cte_latency_s=qkv.latency_s, modelled_output_projection_cte_latency_s=oproj.latency_s,
            modelled_ours_latency_s=mine.latency_s, modelled_speedup_vs_peer=pipeline_s / mine.latency_s,
            modelled_speedup_vs_attention_cte=attn.latency_s / mine.latency_s,
            modelled_ours_faster=mine.latency_s < pipeline_s)
    assert attn.latency_s >= attn.roofline_s * 0.999
    assert mine.latency_s < pipeline_s, "issue 14: ours must be faster than the library pipeline at every block size"
