"""moe_tkg: the functional entry's checks and backends; the NKI kernel on nkisim vs the torch reference.

Tolerances follow nki-library's moe_tkg tests: |a - b| <= atol + rtol * max|ref| with rtol 2e-2, atol 1e-5;
expert indices exact; no NaN.
"""

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from modules.model_specs import GPT_OSS_20B, GPT_OSS_120B
from nki_kernels.moe import moe_tkg, moe_torch
from nki_kernels.moe.gate_up_layout import tile_gate_up, untile_gate_up
from nki_kernels.moe.tkg_cost import choose_expert_mode
from nki_kernels.moe.tkg_inputs import make_tkg_inputs, tkg_shard

RTOL, ATOL = 2e-2, 1e-5
OSS20_TP8 = tkg_shard(GPT_OSS_20B, 8)
OSS120_TP16 = tkg_shard(GPT_OSS_120B, 16)


def test_rank_shards_come_from_the_model_table():
    assert OSS20_TP8 == dict(H=3072, E=32, top_k=4, inter=360, hidden_actual=2880)
    assert OSS120_TP16 == dict(H=3072, E=128, top_k=4, inter=180, hidden_actual=2880)


def test_torch_backend_is_the_reference_in_the_input_dtype():
    args, kw = make_tkg_inputs(T=4, H=256, E=8, top_k=2, inter=64, hidden_actual=200)
    out, idx, aff = moe_tkg(*args, **kw, backend="torch")
    ref, ridx, raff = moe_torch(*args, **{**kw, "b_router": kw["b_router"]})
    assert out.dtype == torch.bfloat16 and out.shape == (4, 256)
    assert torch.equal(out, ref.to(torch.bfloat16)) and torch.equal(idx, ridx) and torch.equal(aff, raff)
    out3, _, _ = moe_tkg(args[0].reshape(2, 2, 256), *args[1:], **kw, backend="torch")
    assert torch.equal(out3, out)


@pytest.mark.parametrize("change,match", [
    (dict(top_k=9), "top_k"),
    (dict(x=torch.zeros(129, 256)), "tokens T=129"),
    (dict(x=torch.zeros(4, 200), w_router=torch.zeros(200, 8)), "multiple of 128"),
    (dict(w_down=torch.zeros(8, 32, 256)), "w_down must be"),
    (dict(w_gate_up=torch.zeros(8, 256, 2, 32)), "w_down must be"),
    (dict(w_gate_up=torch.zeros(7, 256, 2, 64)), "w_gate_up must be"),
    (dict(b_gate_up=torch.zeros(8, 64)), "b_gate_up"),
    (dict(b_down=torch.zeros(8, 128)), "b_down"),
    (dict(gamma=torch.zeros(128)), "gamma"),
    (dict(hidden_actual=300), "hidden_actual"),
    (dict(activation="gelu"), "activation"),
    (dict(expert_mode="dense"), "expert_mode"),
    (dict(router_mode="sigmoid"), "router mode"),
    (dict(w_router=torch.zeros(256, 129)), "experts E=129"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_is_named_before_any_work(change, match):
    args, kw = make_tkg_inputs(T=4, H=256, E=8, top_k=2, inter=64)
    names = ("x", "w_router", "w_gate_up", "w_down")
    a = dict(zip(names, args))
    for k in list(change):
        if k in a:
            a[k] = change.pop(k)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        moe_tkg(*(a[n] for n in names), **kw)


# ---- the NKI kernel on nkisim --------------------------------------------------------------------------------

def run_and_check(T, shape, expert_mode="auto", lnc=1, skew=None, seed=0, **over):
    args, kw = make_tkg_inputs(T=T, seed=seed, skew=skew, **shape)
    kw.update(over)
    out, idx, aff = moe_tkg(*args, **kw, expert_mode=expert_mode, backend="nkisim", lnc=lnc)
    ref, ridx, raff = moe_torch(*args, **kw)
    assert out.shape == (T, shape["H"]) and out.dtype == args[0].dtype
    assert not torch.isnan(out).any() and not torch.isnan(aff).any()
    assert torch.equal(idx.long(), ridx), "expert indices differ"
    assert torch.allclose(aff, raff, rtol=RTOL, atol=ATOL)
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL + RTOL * ref.abs().max().item(), f"max err {err} vs range {ref.abs().max().item()}"
    return idx


@pytest.mark.parametrize("T,mode", [(1, "auto"), (8, "selective"), (32, "auto"), (128, "all")])
def test_gpt_oss_20b_tp8(T, mode):
    run_and_check(T, OSS20_TP8, mode)


@pytest.mark.parametrize("T,mode,lnc", [(1, "selective", 1), (1, "selective", 2), (4, "selective", 1),
                                        (32, "selective", 2), (128, "all", 1)])
def test_gpt_oss_120b_tp16(T, mode, lnc):
    run_and_check(T, OSS120_TP16, mode, lnc=lnc)


@pytest.mark.parametrize("T,mode,lnc", [(1, "selective", 2), (8, "all", 2), (16, "selective", 2)])
def test_gpt_oss_20b_tp8_lnc2(T, mode, lnc):
    run_and_check(T, OSS20_TP8, mode, lnc=lnc)


MID = dict(H=1024, E=32, top_k=4, inter=360, hidden_actual=960)      # GPT-OSS-20B's experts, a narrower H


@pytest.mark.parametrize("T,bias_dtype", [(4, torch.float32), (2, torch.bfloat16), (1, torch.float32)])
def test_router_weight_swap_lnc2(T, bias_dtype):
    """LNC=2, T <= 8, E < 128: the cores swap their W_r halves (sendrecv) instead of their partial logits and both
    add the two halves' logits in the same order: both must pick the reference's experts (bf16 / fp32 b_r). T = 1
    adds them in PSUM (an fp32 ones matmul onto the other half's group) and the top-k reads them there."""
    args, kw = make_tkg_inputs(T=T, seed=3, **MID)
    kw["b_router"] = kw["b_router"].to(bias_dtype)
    out, idx, aff = moe_tkg(*args, **kw, expert_mode="selective", backend="nkisim", lnc=2)
    ref, ridx, raff = moe_torch(*args, **kw)
    assert torch.equal(idx.long(), ridx), "expert indices differ"
    assert torch.allclose(aff, raff, rtol=RTOL, atol=ATOL)
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL + RTOL * ref.abs().max().item(), f"max err {err} vs range {ref.abs().max().item()}"


@pytest.mark.parametrize("skew,mode,lnc,shape", [("one", "selective", 1, OSS20_TP8), ("one", "all", 2, MID),
                                                 ("hot", "selective", 2, MID)])
def test_skewed_routing(skew, mode, lnc, shape):
    """Every token on the same k experts (the other experts get none; selective runs k slots) / one hot expert."""
    idx = run_and_check(16, shape, mode, lnc=lnc, skew=skew)
    if skew == "one":
        assert idx.tolist() == [[0, 1, 2, 3]] * 16
    else:
        assert (idx[:, 0] == shape["E"] - 1).all()


def test_one_expert_split_across_cores():
    """LNC=2, every token on ONE expert (k = 1): an odd count's last expert is served by both cores, each on half of
    its I columns (here the only expert: without the split one core would idle)."""
    idx = run_and_check(8, dict(MID, top_k=1), "selective", lnc=2, skew="one")
    assert idx.flatten().tolist() == [0] * 8


SMALL = dict(H=512, E=8, top_k=2, inter=200, hidden_actual=None)


@pytest.mark.parametrize("over", [
    dict(activation="swiglu", router_mode="softmax_topk", renormalize=True),
    dict(router_mode="softmax_topk", add_down_bias=False),
    dict(gamma=None, b_gate_up=None, b_down=None, b_router=None),
])
@pytest.mark.parametrize("mode", ["selective", "all"])
def test_variants(over, mode):
    run_and_check(6, SMALL, mode, **over)


@pytest.mark.parametrize("over,lnc", [
    (dict(activation="swiglu", router_mode="softmax_topk", renormalize=True), 2),
    (dict(add_down_bias=False, hidden_actual=501), 1),
    (dict(gamma=None, b_gate_up=None, b_down=None, b_router=None), 2),
])
def test_one_token_variants(over, lnc):
    """T = 1 takes its own selective path (slots straight from the top-k, per-slot down-bias rows, x loaded
    transposed, fused RMSNorm steps): the options it must honour."""
    run_and_check(1, SMALL, "selective", lnc=lnc, **over)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32, None])
def test_one_token_transposed_logits_exchange_lnc2(bias_dtype):
    """T = 1, LNC=2 without the W_r swap (KT odd here; E = 128 at GPT-OSS-120B): each core's partial logits are
    computed transposed ([E, 1], W_r stationary), exchanged, and turned into the logits row by two fp32 identity
    matmuls accumulating own + other in PSUM (the bias, bf16 / fp32 / none, in core 0's part): both cores must pick
    the reference's experts and the output must match."""
    shape = dict(H=384, E=16, top_k=2, inter=200, hidden_actual=None)
    args, kw = make_tkg_inputs(T=1, seed=5, **shape)
    kw["b_router"] = None if bias_dtype is None else kw["b_router"].to(bias_dtype)
    out, idx, aff = moe_tkg(*args, **kw, expert_mode="selective", backend="nkisim", lnc=2)
    ref, ridx, raff = moe_torch(*args, **kw)
    assert torch.equal(idx.long(), ridx), "expert indices differ"
    assert torch.allclose(aff, raff, rtol=RTOL, atol=ATOL)
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL + RTOL * ref.abs().max().item(), f"max err {err} vs range {ref.abs().max().item()}"


@pytest.mark.parametrize("inter,over", [(100, {}), (300, dict(activation="swiglu", b_down=None))])
def test_one_token_hsplit_activation_rows_lnc2(inter, over):
    """T = 1, LNC=2, k even (the H split): each activation act^T [128, MT] crosses to the other core as MT rows on
    partitions 120.. (_ActSwap: TensorE transposes there and back, exact); MT = 1 and 3 (a 44-row partial tile),
    the H half in the two kt blocks of _hsplit_blocks (down biases as a block) or one (no down bias)."""
    run_and_check(1, dict(SMALL, top_k=4, inter=inter), "selective", lnc=2, **over)


@pytest.mark.parametrize("shape,over", [
    (dict(SMALL, top_k=3), {}),                                                    # one pair-mode expert
    (dict(SMALL, top_k=6, inter=180), dict(activation="swiglu")),                  # four, I = 128 + 52
    (dict(SMALL, top_k=5, inter=170), dict(gamma=None, b_gate_up=None, b_down=None, b_router=None)),
    (dict(SMALL, top_k=4, inter=259), {}),                                         # I odd, 3 tiles: no pairs
])
def test_one_token_spread_rows(shape, over):
    """T = 1, LNC 1 (_Spread): the partial I tile's down rows (and, before the last two experts, every expert's
    rows in pairs per partition) spread over the DMA engines, act^T permuted onto them by 0/1 matmuls."""
    run_and_check(1, shape, "selective", lnc=1, **over)


@pytest.mark.parametrize("mode,lnc,over", [("all", 1, {}), ("selective", 2, dict(activation="swiglu"))])
def test_large_T_token_layout(mode, lnc, over):
    """Large T with 2I <= 512: gate/up with the tokens stationary, activation with the tokens on the partitions,
    act^T by TensorE transposes (cfg.flip)."""
    run_and_check(100, SMALL, mode, lnc=lnc, **over)


def test_expert_mode_rule():
    """Selective while the expected touched experts (plus the routing on its critical path) cost less than E."""
    from nki_kernels.moe.tkg_cost import choose_expert_mode, expected_touched
    s20 = dict(E=32, k=4, H=3072, inter=360)
    assert [choose_expert_mode(T, **s20) for T in (1, 4, 8, 32, 128)] == ["selective"] * 3 + ["all"] * 2
    assert choose_expert_mode(32, E=128, k=4, H=3072, inter=180) == "selective"
    assert choose_expert_mode(128, E=128, k=4, H=3072, inter=180) == "all"
    assert expected_touched(1, 32, 4) == pytest.approx(32 * (1 - (31 / 32) ** 4))
    assert expected_touched(128, 32, 4) <= 32


# ---- gate/up weights in the tiled layout [E, 128, H/128, 2I] (gate_up_layout.py: what MoELayer holds) -------------

def _run_both(T, shape, mode, lnc, seed=0, exact=False, skew=None, **over):
    """(tiled out, [E, H, 2, I] out, reference, idx of each): the same inputs, the gate/up weights in both layouts.
    exact: small-integer multiples of 2^-3 (x) and 2^-6 (weights), no RMSNorm, so every fp32 sum of the gate/up
    contraction is exact whatever its order and the two layouts must give the same bits."""
    args, kw = make_tkg_inputs(T=T, seed=seed, skew=skew, **shape)
    kw.update(over)
    if exact:
        g = torch.Generator().manual_seed(seed + 1)
        x, w_r, w_gu, w_d = args

        def q(t, scale):
            return (torch.randint(-2, 3, t.shape, generator=g).float() * scale).to(t.dtype)

        x = q(x, 2.0 ** -3)
        if shape.get("hidden_actual"):
            x[:, shape["hidden_actual"]:] = 0
        args = (x, w_r, q(w_gu, 2.0 ** -6), w_d)
        kw["gamma"] = None
    tiled = (args[0], args[1], tile_gate_up(args[2]), args[3])
    out_t, idx_t, aff_t = moe_tkg(*tiled, **kw, expert_mode=mode, backend="nkisim", lnc=lnc)
    out_h, idx_h, aff_h = moe_tkg(*args, **kw, expert_mode=mode, backend="nkisim", lnc=lnc)
    ref, ridx, _ = moe_torch(*args, **kw)
    assert torch.equal(idx_t, idx_h) and torch.equal(aff_t, aff_h), "routing differs between the layouts"
    assert torch.equal(idx_t.long(), ridx), "expert indices differ from the reference"
    err = (out_t.float() - ref).abs().max().item()
    assert not torch.isnan(out_t).any()
    assert err <= ATOL + RTOL * ref.abs().max().item(), f"tiled: max err {err} vs range {ref.abs().max().item()}"
    return out_t, out_h, ref


@pytest.mark.parametrize("T,mode,lnc,over", [
    (1, "selective", 1, {}),                                     # T = 1 slots, the last expert in kt pieces
    (1, "selective", 1, dict(top_k=3, inter=180)),               # _Spread (a partial I tile), odd k
    (1, "selective", 2, dict(top_k=4, inter=300)),               # the H split (k even), MT 3
    (1, "selective", 2, dict(top_k=3)),                          # LNC 2 odd k: partial outputs exchanged
    (4, "selective", 2, {}),                                     # the W_r swap
    (8, "all", 1, dict(hidden_actual=500)),
    (8, "selective", 1, dict(gamma=None)),
    (16, "selective", 2, dict(top_k=1, skew="one")),             # one expert split by I columns between cores
    (32, "selective", 2, {}),                                    # rows + natural-tile transposes (T > 8)
    (100, "all", 1, dict(gamma=None)),                           # tokens stationary (cfg.flip)
    (128, "all", 2, {}),
])
def test_tiled_gate_up_layout(T, mode, lnc, over):
    """moe_tkg takes w_gate_up tiled [E, 128, H/128, 2I] (partition p, kt block = H row kt * 128 + p): the experts'
    x^T then in natural H tiles (_Natural), the weight DMAs' access patterns unchanged. Every path (T = 1 pieces,
    _Spread, the LNC 2 H split, the W_r swap, the split expert, T > 8 rows, cfg.flip, all-expert mode) matches the
    reference and the [E, H, 2, I] run to within the fp32 order of the contraction's partial sums."""
    over = dict(over)
    skew = over.pop("skew", None)
    shape = {k: over.pop(k) if k in over else v for k, v in SMALL.items()}
    out_t, out_h, ref = _run_both(T, shape, mode, lnc, skew=skew, **over)
    d = (out_t.float() - out_h.float()).abs().max().item()
    assert d <= 2 ** -6 * ref.abs().max().item(), f"tiled vs [E, H, 2, I]: {d}"


@pytest.mark.parametrize("shape", [OSS20_TP8, OSS120_TP16], ids=["20b-tp8", "120b-tp16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 8])
def test_tiled_gate_up_layout_rank_shapes_bit_identical(shape, lnc, T):
    """GPT-OSS-20B TP8 (H 2880 -> 3072, E 32, k 4, I 360) and GPT-OSS-120B TP16 (E 128, I 180) ranks, LNC 1 and 2,
    T 1 and 8, the auto mode: with exact data (every partial sum exact) the tiled layout's output is bit-identical to
    the [E, H, 2, I] run's -- a kt block of the tiled layout read from or contracted against the wrong H rows
    changes it."""
    mode = choose_expert_mode(T, shape["E"], shape["top_k"], shape["H"], shape["inter"])
    out_t, out_h, _ = _run_both(T, shape, mode, lnc, seed=7, exact=True)
    assert torch.equal(out_t, out_h), f"{(out_t.float() - out_h.float()).abs().max().item()}"


@pytest.mark.parametrize("T,lnc", [(1, 2), (8, 1)])
def test_tiled_gate_up_layout_rank_shape_with_rmsnorm(T, lnc):
    """The 20B TP8 rank with the fused RMSNorm and random weights: the tiled layout against the reference and the
    [E, H, 2, I] run (equal up to the fp32 order of the contraction's partial sums: the two layouts group the H rows
    differently into the 128-row matmuls)."""
    out_t, out_h, ref = _run_both(T, OSS20_TP8, "selective", lnc, seed=2)
    d = (out_t.float() - out_h.float()).abs().max().item()
    assert d <= 2 ** -7 * ref.abs().max().item(), f"tiled vs [E, H, 2, I]: {d}"


def test_tiled_gate_up_layout_checks_and_torch_backend():
    """The entry's shape check names w_gate_up and both accepted layouts; the torch backend (the reference) takes the
    tiled layout too (untiled for moe_torch)."""
    args, kw = make_tkg_inputs(T=4, H=256, E=8, top_k=2, inter=64)
    tiled = (args[0], args[1], tile_gate_up(args[2]), args[3])
    assert tuple(tiled[2].shape) == (8, 128, 2, 128)
    assert torch.equal(tiled[2][3, 5, 1, 64 + 7], args[2][3, 128 + 5, 1, 7])
    assert torch.equal(untile_gate_up(tiled[2]), args[2])
    out_t, idx_t, _ = moe_tkg(*tiled, **kw, backend="torch")
    out_h, idx_h, _ = moe_tkg(*args, **kw, backend="torch")
    assert torch.equal(out_t, out_h) and torch.equal(idx_t, idx_h)
    for bad in (torch.zeros(8, 128, 3, 128), torch.zeros(8, 128, 2, 127), torch.zeros(7, 128, 2, 128)):
        with pytest.raises(ValueError, match=r"moe_tkg: w_gate_up must be \[E=8, H=256, 2, I\] or tiled "
                                             r"\[E=8, 128, H/128=2, 2I\]"):
            moe_tkg(args[0], args[1], bad, args[3], **kw)
    with pytest.raises(ValueError, match="w_down must be"):      # I from the tiled shape: 2I = 128 -> I = 64
        moe_tkg(args[0], args[1], torch.zeros(8, 128, 2, 64), args[3], **kw)
