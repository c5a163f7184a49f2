"""The block vision-attention kernel on nkisim vs the torch reference.

Tolerance: nki-library's attention_cte tests (relative_accuracy 2e-2, absolute_accuracy 1e-5 under the library's
rule |kernel - golden| <= atol + rtol * max|golden|), plus cosine similarity >= 0.99. Padding rows must be exactly
zero and no output may be NaN. Shapes: small ones (several head dims, heads, image mixes) and one Qwen3-VL rank
shard (vision TP 4: 4 heads of 72 on hidden 1152, from modules/model_specs), at LNC 1 and 2.
"""

import numpy as np
import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from modules.model_specs import QWEN3_VL_VIT
from nki_kernels.vision import vision_block_attention, vision_block_attention_torch
from nki_kernels.vision.block_attention import vision_block_attention_nki
from nki_kernels.vision.inputs import make_inputs

RTOL, ATOL, MIN_COS = 2e-2, 1e-5, 0.99
VIT_TP = 4
QWEN_RANK = dict(H=QWEN3_VL_VIT.hidden, nh=QWEN3_VL_VIT.heads // VIT_TP, d=QWEN3_VL_VIT.head_dim)


def _check(out, ref, n_real):
    out = torch.as_tensor(np.asarray(out, dtype=np.float32)) if not isinstance(out, torch.Tensor) else out.float()
    ref = ref.float()
    assert not out.isnan().any(), "NaN in the kernel output"
    assert (out[n_real:] == 0).all(), "padding rows must be exactly zero"
    err = (out - ref).abs().max().item()
    tol = ATOL + RTOL * ref.abs().max().item()
    assert err <= tol, f"max |kernel - ref| = {err:.3g} > {tol:.3g}"
    if n_real:
        cos = torch.nn.functional.cosine_similarity(out[:n_real].flatten(), ref[:n_real].flatten(), dim=0).item()
        assert cos >= MIN_COS, f"cosine {cos:.4f} < {MIN_COS}"


CASES = {
    "1-image-fills-block": (256, 128, 2, 72, (256,)),
    "2-images": (256, 256, 2, 64, (100, 156)),
    "5-images-padding": (512, 128, 3, 72, (40, 60, 30, 90, 45)),
    "1-image-padding": (512, 128, 1, 16, (300,)),
    "all-padding": (256, 128, 2, 8, ()),
    "d128-2-images": (512, 256, 1, 128, (200, 312)),
    "images-cross-tiles": (768, 128, 2, 32, (129, 1, 255, 200, 100)),
}


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case, lnc):
    S, H, nh, d, sizes = CASES[case]
    args = make_inputs(S, H, nh, d, sizes)
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="nkisim", lnc=lnc)
    _check(out, vision_block_attention_torch(*args, num_heads=nh, head_dim=d), sum(sizes))


@pytest.mark.parametrize("sizes,lnc", [((1024,), 1), ((300, 200, 256, 100, 100), 2)])
def test_qwen3_vl_rank_shape(sizes, lnc):
    """Qwen3-VL vision attention at vision TP 4 (4 heads x 72 on hidden 1152), a 1024-patch block."""
    S = 1024
    args = make_inputs(S, QWEN_RANK["H"], QWEN_RANK["nh"], QWEN_RANK["d"], sizes)
    kw = dict(num_heads=QWEN_RANK["nh"], head_dim=QWEN_RANK["d"])
    out = vision_block_attention(*args, backend="nkisim", lnc=lnc, **kw)
    _check(out, vision_block_attention_torch(*args, **kw), sum(sizes))


def test_trn3(monkeypatch):
    """The same kernel on a trn3 target (the benchmarks profile it there)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    S, H, nh, d = 512, 256, 2, 72
    args = make_inputs(S, H, nh, d, (300, 100))
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="nkisim", lnc=2)
    _check(out, vision_block_attention_torch(*args, num_heads=nh, head_dim=d), 400)


def test_fp32_bias():
    """b_qkv may be fp32 (an encoder kept in fp32 passes its bias as is): added exactly, as the reference does."""
    S, H, nh, d = 256, 128, 2, 72
    args = list(make_inputs(S, H, nh, d, (100, 156)))
    args[2] = args[2].float() + 0.001          # not representable in bf16
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="nkisim")
    _check(out, vision_block_attention_torch(*args, num_heads=nh, head_dim=d), S)


def test_unsorted_bounds_and_holes():
    """Bounds are data: rows may see any range (not only their own image's), and padding rows may sit between
    images; the kernel follows them row by row."""
    S, H, nh, d = 256, 128, 1, 16
    args = list(make_inputs(S, H, nh, d, (256,)))
    g = torch.Generator().manual_seed(3)
    lo = torch.randint(0, S, (S,), generator=g, dtype=torch.int32)
    hi = (lo + torch.randint(-20, 100, (S,), generator=g, dtype=torch.int32)).clamp(0, S)
    args[5], args[6] = lo, hi
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="nkisim")
    ref = vision_block_attention_torch(*args, num_heads=nh, head_dim=d)
    out = out.float()
    assert not out.isnan().any() and (out[lo >= hi] == 0).all()
    assert (out - ref.float()).abs().max() <= ATOL + RTOL * ref.float().abs().max()


def test_cost_follows_image_sizes():
    """Key tiles outside every query row's range are skipped at run time: on a Qwen3-VL rank block of 2048, five
    images of 368 patches (5 x 368^2 key pairs) cost less attention work on every engine than one image of 2048
    (2048^2 pairs) -- the modelled latency drops with it, and so do the TensorE FLOPs issued."""
    import nkisim
    reps = {}
    for name, sizes in (("one", (2048,)), ("five", (368,) * 5)):
        args = make_inputs(2048, QWEN_RANK["H"], QWEN_RANK["nh"], QWEN_RANK["d"], sizes)
        reps[name] = nkisim.profile(vision_block_attention_nki, *args, target="trn2", num_heads=QWEN_RANK["nh"],
                                    head_dim=QWEN_RANK["d"]).report
    one, five = reps["one"], reps["five"]
    attn_one = 4.0 * QWEN_RANK["nh"] * QWEN_RANK["d"] * 2048 ** 2    # QK^T + PV over one image's pairs
    # issued FLOPs: the projections are the same; the attention falls from all 64 key tiles per query tile to the
    # steps the images touch
    assert five.flops_issued < one.flops_issued - 0.6 * attn_one
    assert five.latency_s < 0.75 * one.latency_s, (five.latency_s, one.latency_s)


def test_kernel_rejects_bad_shapes_at_trace_time():
    """The kernel itself (not only the host entry) refuses bad shapes before any instruction."""
    args = list(make_inputs(256, 128, 1, 8, (10,)))
    args[3] = args[3][:, :4].contiguous()
    with pytest.raises(ValueError, match=r"cos must be \[S=256, head_dim=8\]"):
        vision_block_attention_nki(*args, num_heads=1, head_dim=8)


def test_lnc2_needs_even_tile_count():
    args = make_inputs(384, 128, 1, 8, (10,))
    with pytest.raises(ValueError, match="block size S=384 must be a multiple of 256 at LNC=2"):
        vision_block_attention_nki[2](*args, num_heads=1, head_dim=8)


@pytest.mark.parametrize("tp,S,fits", [(4, 4096, True), (2, 2048, True), (1, 1024, True), (2, 4096, False),
                                       (1, 2048, False)])
def test_sbuf_budget_of_qwen3_vl_shards(tp, S, fits):
    """The resident SBUF budget (limits.resident_bytes, the two-pass softmax's fp32 score buffers included) admits
    the Qwen3-VL rank shards DESIGN.md promises (TP 4 up to 4096, TP 2 up to 2048, TP 1 up to 1024) and refuses the
    next block size, with the limit in the message."""
    from nki_kernels.vision.limits import RESIDENT_MAX, argument_error, resident_bytes
    nh, d, H = QWEN3_VL_VIT.heads // tp, QWEN3_VL_VIT.head_dim, QWEN3_VL_VIT.hidden
    assert (resident_bytes(S, H, nh, d) <= RESIDENT_MAX) == fits
    shaped = [torch.empty(S, H, dtype=torch.bfloat16), torch.empty(H, 3 * nh * d, dtype=torch.bfloat16),
              torch.empty(3 * nh * d, dtype=torch.bfloat16), torch.empty(S, d), torch.empty(S, d),
              torch.empty(S, dtype=torch.int32), torch.empty(S, dtype=torch.int32),
              torch.empty(nh * d, H, dtype=torch.bfloat16)]
    err = argument_error(*shaped, nh, d)
    assert (err is None) == fits, err
    if not fits:
        assert f"more than {RESIDENT_MAX}" in err


def test_long_ranges_use_every_key_step():
    """Ranges long enough for every key loop (2048-, 1024- and 512-key steps, kernel's STEPS) and a query tile that
    straddles two images: the two-pass softmax keeps one row max and one accumulator over all of a range's steps.
    (No other case reaches a 2048-key step.)"""
    S, H, nh, d, sizes = 4096, 128, 1, 16, (3000, 700, 300)
    args = make_inputs(S, H, nh, d, sizes)
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="nkisim")
    _check(out, vision_block_attention_torch(*args, num_heads=nh, head_dim=d), sum(sizes))
