"""Blockwise CTE MoE: the torch backend against the unblocked fp32 reference, argument errors before any work, and
the NKI kernel on nkisim against the torch reference.

Tolerances follow nki-library's moe_cte tests (test_moe_cte.py): bf16, |a − b| <= atol + rtol · max|ref| with
rtol 2e-2, atol 1e-5.
"""

import numpy as np
import pytest
import torch

from modules.model_specs import GPT_OSS_20B, GPT_OSS_120B
from nki_kernels.moe import moe_cte, moe_experts_torch
from nki_kernels.moe.cte_inputs import make_cte_inputs
from nki_kernels.moe.tkg_inputs import tkg_shard

RTOL, ATOL = 2e-2, 1e-5
GPT_OSS_20B_TP8 = tkg_shard(GPT_OSS_20B, 8)        # H 3072 (2880 padded), E 32, k 4, I 360
GPT_OSS_120B_TP16 = tkg_shard(GPT_OSS_120B, 16)    # H 3072, E 128, k 4, I 180


def make_inputs(T, H, E, inter, k, **kw):
    return make_cte_inputs(T, H, E, k, inter, **kw)


def assert_close(out, ref):
    a, b = out.float(), ref.float()
    assert not torch.isnan(a).any(), "NaN in output"
    err = (a - b).abs().max().item()
    assert err <= ATOL + RTOL * b.abs().max().item(), f"max err {err} vs range {b.abs().max().item()}"


@pytest.mark.parametrize("activation", ["clamped_swiglu", "swiglu"])
@pytest.mark.parametrize("skew", [None, "one", "half"])
def test_torch_backend_matches_unblocked_reference(activation, skew):
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(200, 256, 8, 96, 2, skew=skew)
    out = moe_cte(x, idx, aff, w_gu, w_d, b_gate_up=b_gu, b_down=b_d, activation=activation, block_size=128,
                  backend="torch")
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = moe_experts_torch(x, idx, aff, w_gu, w_d, b_gu, b_d, activation)
    assert_close(out, ref)
    # without the down bias (the TP ranks that must not add it)
    out = moe_cte(x, idx, aff, w_gu, w_d, b_gate_up=b_gu, b_down=b_d, activation=activation, add_down_bias=False,
                  backend="torch")
    assert_close(out, moe_experts_torch(x, idx, aff, w_gu, w_d, b_gu, b_d, activation, add_down_bias=False))


def test_torch_backend_rounds_each_block_to_bf16():
    """Two experts whose outputs cancel: the per-block bf16 rounding leaves what fp32 accumulation would not."""
    x, idx, aff, w_gu, w_d, _, _ = make_inputs(4, 128, 2, 32, 2, biases=False)
    w_gu[1], w_d[1] = w_gu[0], -w_d[0]
    aff = torch.full((4, 2), 0.3)
    out = moe_cte(x, idx, aff, w_gu, w_d, backend="torch")
    assert (out == 0).all()        # bf16(a) + bf16(-a) == 0 exactly
    y = moe_experts_torch(x, idx, aff, w_gu, w_d)
    assert y.abs().max() < 1e-5


def test_numpy_inputs_give_numpy_output():
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(16, 128, 4, 32, 2, biases=False)
    out = moe_cte(x.float().numpy(), idx.numpy(), aff.numpy(), w_gu.float().numpy(), w_d.float().numpy(),
                  backend="torch")
    assert isinstance(out, np.ndarray) and out.shape == (16, 128)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(4, 100)), "H=100 must be a multiple of 128"),
    (dict(expert_index=torch.zeros(4, 5, dtype=torch.long), affinities=torch.zeros(4, 5)),
     r"top_k=5 .* must be in \[1, E=4\]"),
    (dict(w_down=torch.zeros(4, 16, 128)), r"w_down must be \[E=4, I=32, H=128\]"),
    (dict(w_gate_up=torch.zeros(4, 128, 3, 32)), r"w_gate_up must be \[E, H=128, 2, I\]"),
    (dict(b_gate_up=torch.zeros(4, 2, 16)), r"b_gate_up must be \[E=4, 2, I=32\]"),
    (dict(b_down=torch.zeros(3, 128)), r"b_down must be \[E=4, H=128\]"),
    (dict(affinities=torch.zeros(4, 1)), r"affinities must be \[T=4, k=2\]"),
    (dict(expert_index=torch.tensor([[0, 0]] * 4)), "same expert twice"),
    (dict(expert_index=torch.tensor([[0, 4]] * 4)), r"values must be in \[0, E=4\)"),
    (dict(block_size=192), "block_size=192 must be a multiple of 128"),
    (dict(block_size=640), "block_size=640 must be a multiple of 128 in"),
    (dict(activation="gelu"), "activation='gelu'"),
    (dict(backend="cuda"), "backend='cuda'"),
])
def test_bad_arguments_raise_before_work(change, match):
    x, idx, aff, w_gu, w_d, _, _ = make_inputs(4, 128, 4, 32, 2, biases=False)
    kw = dict(x=x, expert_index=idx, affinities=aff, w_gate_up=w_gu, w_down=w_d, b_gate_up=None, b_down=None,
              activation="clamped_swiglu", block_size=None, backend="nkisim")
    kw.update(change)
    args = [kw.pop(n) for n in ("x", "expert_index", "affinities", "w_gate_up", "w_down")]
    with pytest.raises(ValueError, match=match):
        moe_cte(*args, **kw)


# ---- the NKI kernel on nkisim ------------------------------------------------------------------------------------

def run_and_check(T, H, E, inter, k, lnc=1, block_size=None, activation="clamped_swiglu", add_down_bias=True,
                  **kw):
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(T, H, E, inter, k, **kw)
    args = (x, idx, aff, w_gu, w_d)
    opts = dict(b_gate_up=b_gu, b_down=b_d, activation=activation, add_down_bias=add_down_bias,
                block_size=block_size)
    out = moe_cte(*args, **opts, backend="nkisim", lnc=lnc)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, moe_cte(*args, **opts, backend="torch"))
    return out


@pytest.mark.parametrize("activation,bias,block_size", [("clamped_swiglu", True, None), ("clamped_swiglu", False, 384),
                                                        ("swiglu", True, 128), ("swiglu", False, 256)])
def test_kernel_small(activation, bias, block_size):
    run_and_check(200, 256, 8, 96, 2, activation=activation, biases=bias, block_size=block_size)


@pytest.mark.parametrize("skew", ["one", "half"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_kernel_skewed_routing(skew, lnc):
    """All tokens on one expert (its rows span several blocks and tiles) / half the experts without a token."""
    run_and_check(300, 256, 8, 96, 3, lnc=lnc, skew=skew, block_size=128)


@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("counts", [(200,), (100, 30, 20)])
def test_kernel_lnc2_h_split_uneven_steps(counts, mx, monkeypatch):
    """LNC=2 (down projection split by H halves, the down operand swapped per tile-step: bf16 act^T, or with MXFP4
    weights on trn3 the MXFP8 act^T words and scales): one active expert (core 1 has no tile of its own: it zeroes
    its half of out first and only runs the peer's tiles), and three experts (the last step has no peer expert;
    experts with fewer tiles than their step partner; narrow last tiles, on both tile buffer sets)."""
    T, E, inter = sum(counts), 4, 96
    H = 512 if mx else 256      # MXFP4: H in whole 512-element contraction chunks
    x, _, _, w_gu, w_d, b_gu, b_d = make_inputs(T, H, E, inter, 1)
    idx = torch.cat([torch.full((c, 1), e + 1, dtype=torch.int64) for e, c in enumerate(counts)])
    idx = idx[torch.randperm(T, generator=torch.Generator().manual_seed(1))]
    aff = torch.rand(T, 1, generator=torch.Generator().manual_seed(2))
    opts = dict(b_gate_up=b_gu, b_down=b_d, activation="clamped_swiglu", add_down_bias=True, block_size=128)
    if mx:
        from nki_kernels.moe.cte_inputs import make_cte_mx_weights
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
        _, _, mxw = make_cte_mx_weights(E, H, inter)
        w_gu, w_d = mxw.pop("w_gate_up"), mxw.pop("w_down")
        opts.update(mxw)
    args = (x, idx, aff, w_gu, w_d)
    out = moe_cte(*args, **opts, backend="nkisim", lnc=2)
    assert_close(out, moe_cte(*args, **opts, backend="torch"))


@pytest.mark.parametrize("T,inter,lnc", [(1, 96, 1), (1, 96, 2), (130, 128, 1), (129, 600, 2)])
def test_kernel_edge_shapes(T, inter, lnc):
    """One token; I a multiple of 128 (the down-bias row opens a contraction tile of its own); I > 512 (gate/up in
    two PSUM chunks); T not a multiple of 128."""
    run_and_check(T, 256, 4, inter, 2, lnc=lnc, block_size=256)


def test_kernel_without_down_bias_rank():
    run_and_check(64, 128, 4, 96, 2, add_down_bias=False)


@pytest.mark.parametrize("T,lnc,block_size", [(128, 1, None), (512, 2, 256), (2048, 1, None)])
def test_kernel_gpt_oss_20b_tp8(T, lnc, block_size):
    run_and_check(T, lnc=lnc, block_size=block_size, **_rank(GPT_OSS_20B_TP8))


@pytest.mark.parametrize("T,lnc,skew", [(128, 1, None), (512, 2, "one")])
def test_kernel_gpt_oss_120b_tp16(T, lnc, skew):
    run_and_check(T, lnc=lnc, skew=skew, **_rank(GPT_OSS_120B_TP16))


def _rank(shard):
    return dict(H=shard["H"], E=shard["E"], inter=shard["inter"], k=shard["top_k"],
                hidden_actual=shard["hidden_actual"])


@pytest.mark.parametrize("T,lnc,skew,bias", [(200, 1, None, True), (300, 2, "one", False), (129, 1, "half", True)])
def test_kernel_trn3_dma_transposes(T, lnc, skew, bias, monkeypatch):
    """trn3 takes x^T from DMA gather-transposes (natural H tiles for x and the gate/up weights) when the weight runs
    (2I bf16) are >= 1 KiB: I = 256."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run_and_check(T, 256, 8, 256, 3, lnc=lnc, skew=skew, biases=bias, block_size=128)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_kernel_narrow_last_tiles(target, monkeypatch):
    """Experts whose last tile has <= 64 rows serve it as a narrow tile (weights stationary, tokens moving; gather
    and scatter of 64 rows), after full tiles or alone: TensorE transposes (trn2) and DMA transposes (trn3, I 256)."""
    from nki_kernels.moe.moe_cte import HALF_ROWS, SCHED_FIELDS, SCHED_HEADER, kernel_inputs
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    x, idx, aff, *_ = make_inputs(300, 256, 2, 256, 2)
    m, *_, sched = kernel_inputs(idx, aff, 2, 128)
    entries = sched[0, SCHED_HEADER:].reshape(-1, SCHED_FIELDS)[:m.num_active]
    rows = m.tokens_per_expert[entries[:, 0]]
    # both experts have all 300 rows: two full tiles + a narrow 44-row tile
    assert entries[:, 2:4].tolist() == [[1, 0], [1, 0]] and entries[:, 5].tolist() == [1, 1]
    rest = rows - 128 * (2 * entries[:, 2] + entries[:, 3])      # rows left after the full tiles
    assert (rest <= HALF_ROWS).all() and ((rest > 0) == (entries[:, 5] == 1)).all()
    run_and_check(300, 256, 2, 256, 2, block_size=128)
    run_and_check(390, 256, 3, 256, 2, activation="swiglu", biases=False, block_size=256, skew="one")


def test_kernel_trn3_tensor_transposes_for_short_weight_rows(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run_and_check(100, 256, 4, 96, 2)


def _spy_config(monkeypatch, attr):
    """The values of _Config.<attr> of every kernel config built from here on (the kernel's path choice)."""
    import nki_kernels.moe.moe_cte as mod  # the module: the package attribute moe_cte is the function
    seen = []
    init = mod._Config.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(getattr(self, attr))

    monkeypatch.setattr(mod._Config, "__init__", spy)
    return seen

@pytest.mark.parametrize("T,lnc,want_dma", [(400, 1, True), (400, 2, True), (380, 1, False)])
def test_kernel_trn3_short_weight_rows_dma_transposes_from_384_rows(T, lnc, want_dma, monkeypatch):
    """trn3 takes DMA transposes despite short weight runs (I = 180 as GPT-OSS-120B TP16: 720 B) from 384 rows per
    expert (here every token on both experts), TensorE transposes below."""
    seen = _spy_config(monkeypatch, "dma_transpose")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run_and_check(T, 256, 2, 180, 2, lnc=lnc)
    assert seen and all(d == want_dma for d in seen)


def test_kernel_trn3_gpt_oss_20b_tp8(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run_and_check(512, lnc=2, **_rank(GPT_OSS_20B_TP8))


def test_kernel_long_prefill_16k():
    """T = 16384 (nki-library's shard_on_i_hybrid fails past 2048 for GPT-OSS-20B, aws-neuron-sdk#1372): nothing in
    the kernel scales with T but its loop trip counts (small H / I keep the interpretation short)."""
    run_and_check(16384, 128, 4, 64, 2, lnc=2)


def test_kernel_trn2_dma_transposes_with_many_rows_per_expert():
    """trn2 switches to DMA gather-transposes from 384 rows per expert (here 400, I = 256: 1 KiB weight runs)."""
    run_and_check(400, 256, 2, 256, 2)


@pytest.mark.parametrize("lnc", [1, 2])
def test_kernel_reads_each_expert_weight_once(lnc):
    """HBM reads (cost model trace) = every expert's weights once + the token rows: with weights dominating, a
    weight read twice (per tile, or by both cores) would at least double them."""
    import nkisim
    from nki_kernels.moe.moe_cte import kernel_inputs, moe_cte_nki
    T, H, E, inter, k = 300, 256, 4, 512, 2
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(T, H, E, inter, k)
    _, *arrays = kernel_inputs(idx, aff, E, 128, lnc)
    kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
    rep = nkisim.profile(kernel, x, w_gu, w_d, *[torch.from_numpy(a) for a in arrays], b_gate_up=b_gu,
                         b_down=b_d).report
    weights = sum(t.numel() * 2 for t in (w_gu, w_d, b_gu, b_d))
    tiles = sum(-(-int((idx == e).sum()) // 128) for e in range(E))
    rows = 2 * tiles * 128 * H * 2     # gathers, scatter-add reads (LNC=2: each core reads its H half of a row)
    assert weights <= rep.hbm_read_bytes <= weights + rows + 64 * 1024, (rep.hbm_read_bytes, weights, rows)


# ---- MXFP4 weights (trn3 nc_matmul_mx) ------------------------------------------------------------------------------

def _run_mx(T, H, E, inter, k, lnc=1, **kw):
    """The functional entry with MXFP4 weights on nkisim and its torch backend (the MX reference)."""
    from nki_kernels.moe.cte_inputs import make_cte_mx_weights
    x, idx, aff, _, _, b_gu, b_d = make_inputs(T, H, E, inter, k, **kw)
    w_gu, w_d, mxw = make_cte_mx_weights(E, H, inter)
    args = (x, idx, aff, mxw["w_gate_up"], mxw["w_down"])
    opts = dict(b_gate_up=b_gu, b_down=b_d, w_gate_up_scale=mxw["w_gate_up_scale"],
                w_down_scale=mxw["w_down_scale"], block_size=128)
    ref = moe_cte(*args, **opts, backend="torch")
    out = moe_cte(*args, **opts, backend="nkisim", lnc=lnc)
    return out, ref, (x, idx, aff, w_gu, w_d, b_gu, b_d)


@pytest.mark.parametrize("T,H,E,inter,k,lnc,skew", [(200, 512, 4, 96, 2, 1, None), (300, 1024, 4, 360, 3, 2, "one"),
                                                     (40, 512, 8, 96, 4, 1, None), (40, 512, 8, 96, 4, 2, None),
                                                     (150, 512, 2, 600, 1, 2, None)])
def test_kernel_mxfp4_trn3_matches_mx_reference(T, H, E, inter, k, lnc, skew, monkeypatch):
    """MXFP4 weights on trn3: x and the activations quantised to MXFP8 on chip, every projection an nc_matmul_mx;
    against the reference that models the same quantisation (I = 360: the last 32-block zero-padded). The MX
    reference differs visibly from the bf16-weight one (the activation quantisation), so matching it is a check.
    Narrow (<= 64-row) last tiles: expert 0 of the skewed case (300 rows: 128 + 128 + 44), and every expert of the
    decode-sized cases (T 40, k 4, E 8: ~20 rows each, on both tile buffer sets, most slots' first use). LNC=2
    splits the down projection by H halves (the MXFP8 act^T swapped); I = 600: two 512-element down contraction
    chunks (each core's H half of the down words and scales read per chunk)."""
    from nki_kernels.moe.moe_cte_torch import moe_cte_torch
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    out, ref, (x, idx, aff, w_gu, w_d, b_gu, b_d) = _run_mx(T, H, E, inter, k, lnc, skew=skew)
    assert_close(out, ref)
    bf16_weights = moe_cte_torch(x, idx, aff, w_gu.to(torch.bfloat16), w_d.to(torch.bfloat16), b_gu, b_d,
                                 block_size=128)
    assert (ref.float() - bf16_weights.float()).abs().max() > 2 * (ATOL + RTOL * ref.float().abs().max())


def test_kernel_mxfp4_lnc2_reads_each_weight_once(monkeypatch):
    """MXFP4, LNC=2 (H split): each core reads its H half of the step experts' down words, scales and b_down, so
    the two cores together read what LNC=1 reads, plus only the peer tiles' scatter ids and affinities and the
    schedule rows; a down half read twice would add >= 64 KiB here (one expert's half: 64 KiB of words). Padding
    rows moved at both LNCs (MXFP4 LNC=2 does not skip them, LNC=1 would), so that only the weights differ."""
    import sys

    import nkisim
    from nki_kernels.moe.cte_inputs import make_cte_mx_weights
    from nki_kernels.moe.moe_cte import kernel_inputs, moe_cte_nki
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    monkeypatch.setattr(sys.modules["nki_kernels.moe.moe_cte"], "PAD_SKIP_MAX_ROWS", 0)
    T, H, E, inter, k = 300, 512, 4, 360, 2
    x, idx, aff, _, _, b_gu, b_d = make_inputs(T, H, E, inter, k)
    _, _, mxw = make_cte_mx_weights(E, H, inter)
    reads = {}
    for lnc in (1, 2):
        _, *arrays = kernel_inputs(idx, aff, E, 128, lnc)
        kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
        reads[lnc] = nkisim.profile(kernel, x, *[mxw[n] for n in ("w_gate_up", "w_down")],
                                    *[torch.from_numpy(a) for a in arrays], b_gate_up=b_gu, b_down=b_d,
                                    target="trn3", w_gate_up_scale=mxw["w_gate_up_scale"],
                                    w_down_scale=mxw["w_down_scale"]).report.hbm_read_bytes
    weights = sum(int(np.asarray(mxw[n]).nbytes) for n in ("w_gate_up_scale", "w_down_scale")) + sum(
        int(mxw[n].nbytes) for n in ("w_gate_up", "w_down")) + sum(t.numel() * 2 for t in (b_gu, b_d))
    assert weights <= reads[1] <= reads[2] <= reads[1] + 16 * 1024, (weights, reads)


def test_kernel_mxfp4_refused_on_trn2():
    with pytest.raises(AssertionError, match="nc_matmul_mx.*trn3"):
        _run_mx(64, 512, 2, 64, 1)


def test_mxfp4_bad_arguments_raise_before_work():
    from nki_kernels.moe.cte_inputs import make_cte_mx_weights
    x, idx, aff, _, _, b_gu, b_d = make_inputs(8, 512, 2, 64, 1)
    _, _, mxw = make_cte_mx_weights(2, 512, 64)
    args = (x, idx, aff, mxw["w_gate_up"], mxw["w_down"])
    with pytest.raises(ValueError, match="without w_down_scale"):
        moe_cte(*args, w_gate_up_scale=mxw["w_gate_up_scale"], backend="torch")
    with pytest.raises(ValueError, match="w_down_scale must be"):
        moe_cte(*args, w_gate_up_scale=mxw["w_gate_up_scale"], w_down_scale=mxw["w_down_scale"][:, :8],
                backend="torch")
    with pytest.raises(ValueError, match="multiple of 512"):
        moe_cte(x[:, :384], idx, aff, *args[3:], w_gate_up_scale=mxw["w_gate_up_scale"],
                w_down_scale=mxw["w_down_scale"], backend="torch")


@pytest.mark.parametrize("target,lnc", [("trn2", 1), ("trn2", 2), ("trn3", 1)])
def test_kernel_last_tiles_mostly_padding(target, lnc, monkeypatch):
    """An expert's last tile moves only the PAD_PIECE-row pieces holding real rows (a gated window per tile: start
    and piece-count one-hot gates, placed cyclically, wrapping): 1 and 17 rows (narrow, mostly padding), 65 rows
    (partial: 63 padding rows), 100, 129, 200 and 250 rows (complete tiles then partial / narrow last tiles);
    TensorE transposes (trn2, gather and scatter gated) and DMA transposes (trn3 at I 256, scatter gated)."""
    from nki_kernels.moe.moe_cte import PAD_PIECE, PAD_STARTS, _last_tiles, _pad_count_min, kernel_inputs, rows_table
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    counts = (65, 1, 17, 100, 129, 200, 250)
    T, E, inter = sum(counts), 8, 256 if target == "trn3" else 96
    x, _, _, w_gu, w_d, b_gu, b_d = make_inputs(T, 256, E, inter, 1)
    idx = torch.cat([torch.full((c, 1), e, dtype=torch.int64) for e, c in enumerate(counts)])
    idx = idx[torch.randperm(T, generator=torch.Generator().manual_seed(3))]
    aff = torch.rand(T, 1, generator=torch.Generator().manual_seed(4))
    m, rows, _ = kernel_inputs(idx, aff, E, 128, lnc)
    _, scatter, row_aff = (a[:, None] for a in rows_table(rows))
    firsts = m.expert_first_block[:m.num_active] * m.block_size
    wrapped = 0
    for j, (full, half, part, gates, slots) in enumerate(_last_tiles(m)):
        rows = counts[int(m.active_experts[j])]
        assert full == rows // 128 and (half or part) == bool(rows % 128)
        if not (half or part):
            continue
        n = 64 if half else 128
        assert gates[:PAD_STARTS].index(1) == slots[0] and sum(gates[:PAD_STARTS]) == 1
        assert gates[PAD_STARTS:].index(1) == len(slots) - _pad_count_min(n) and sum(gates[PAD_STARTS:]) == 1
        wrapped += slots[-1] < slots[0]
        t0 = int(firsts[j]) + 128 * full
        tile = scatter[t0:t0 + n, 0]
        real = np.zeros(n, bool)
        for s in slots:
            real[s * PAD_PIECE:(s + 1) * PAD_PIECE] = True
        assert (tile[~real] == -1).all() and (tile >= 0).sum() == rows % 128     # real rows only in the window
        assert (row_aff[t0:t0 + n, 0][tile < 0] == 0).all()
    assert wrapped, "no wrapped window exercised"
    opts = dict(b_gate_up=b_gu, b_down=b_d, activation="clamped_swiglu", add_down_bias=True, block_size=128)
    args = (x, idx, aff, w_gu, w_d)
    assert_close(moe_cte(*args, **opts, backend="nkisim", lnc=lnc), moe_cte(*args, **opts, backend="torch"))


@pytest.mark.parametrize("target,inter", [("trn2", 96), ("trn3", 256)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_kernel_tiled_gate_up_layout(target, inter, lnc, monkeypatch):
    """Gate/up weights in the tiled layout [E, 128, H/128, 2I] (tile_gate_up: natural H tiles, one DMA run per
    partition): TensorE transposes of natural column tiles (trn2, I 96) and DMA gather-transposes (trn3, I 256),
    full, partial and narrow last tiles; same result as the [E, H, 2, I] layout's reference."""
    from nki_kernels.moe.gate_up_layout import tile_gate_up
    from nki_kernels.moe.moe_cte import kernel_inputs, moe_cte_nki
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    T, H, E, k = 300, 256, 4, 2
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(T, H, E, inter, k)
    tiled = tile_gate_up(w_gu)
    assert tuple(tiled.shape) == (E, 128, H // 128, 2 * inter)
    assert torch.equal(tiled[1, 5, 1, inter + 3], w_gu[1, 128 + 5, 1, 3])
    _, *arrays = kernel_inputs(idx, aff, E, 128, lnc)
    kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
    out = kernel(x, tiled, w_d, *[torch.from_numpy(a) for a in arrays], b_gate_up=b_gu, b_down=b_d,
                 routed_rows=T * k)
    ref = moe_cte(x, idx, aff, w_gu, w_d, b_gate_up=b_gu, b_down=b_d, activation="clamped_swiglu",
                  add_down_bias=True, block_size=128, backend="torch")
    assert_close(torch.as_tensor(out), ref)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_kernel_last_down_tile_on_high_partitions(target, lnc, monkeypatch):
    """I = 180 (GPT-OSS-120B TP16: 180 + the bias row = 128 + 53 down contraction rows) below REM_HIGH_MAX_ROWS rows
    per expert: the second weight slot keeps the last contraction tile (weights, act^T, narrow gate/up, bias
    columns) on partitions 64.. (row-tiled matmuls)."""
    seen = _spy_config(monkeypatch, "rem_high")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    run_and_check(200, 256, 4, 180, 2, lnc=lnc, block_size=128)
    assert seen and all(seen)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_kernel_lnc2_last_down_tile_by_core(target, monkeypatch):
    """I = 180 at LNC 2 from REM_CORE_MIN_ROWS rows per expert (here ~300: two full tiles and a narrow or partial
    last tile per expert): the last down contraction tile sits on partitions 64 * core for the core's own expert
    and 64 * (1 - core) for the peer's (rem_core, not rem_high), so each core's own act^T rows (full tiles by
    transposes, narrow tiles from the weights-stationary gate/up) arrive where the other core's peer weights are."""
    rem_core = _spy_config(monkeypatch, "rem_core")
    rem_high = _spy_config(monkeypatch, "rem_high")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    run_and_check(600, 256, 4, 180, 2, lnc=2, block_size=128)
    assert rem_core and all(rem_core) and not any(rem_high)


def test_entry_takes_the_tiled_gate_up_layout():
    """The functional entry (what MoELayer calls) takes w_gate_up tiled [E, 128, H/128, 2I] (gate_up_layout.py): the
    torch reference untiles it (same bits as [E, H, 2, I]), the kernel runs it; a wrong shape names both layouts."""
    from nki_kernels.moe.gate_up_layout import gate_up_layout, tile_gate_up, untile_gate_up
    T, H, E, inter, k = 40, 256, 4, 96, 2
    x, idx, aff, w_gu, w_d, b_gu, b_d = make_inputs(T, H, E, inter, k)
    tiled = tile_gate_up(w_gu)
    assert gate_up_layout(tiled.shape, H) == (True, E, inter) and gate_up_layout(w_gu.shape, H) == (False, E, inter)
    assert torch.equal(untile_gate_up(tiled), w_gu)
    assert np.array_equal(untile_gate_up(tile_gate_up(w_gu.float().numpy())), w_gu.float().numpy())
    opts = dict(b_gate_up=b_gu, b_down=b_d, activation="clamped_swiglu", add_down_bias=True, block_size=128)
    ref = moe_cte(x, idx, aff, w_gu, w_d, **opts, backend="torch")
    assert torch.equal(moe_cte(x, idx, aff, tiled, w_d, **opts, backend="torch"), ref)
    assert_close(moe_cte(x, idx, aff, tiled, w_d, **opts, backend="nkisim"), ref)
    with pytest.raises(ValueError, match=r"moe_cte: w_gate_up must be \[E, H=256, 2, I\] or tiled "
                                         r"\[E, 128, H/128=2, 2I\]"):
        moe_cte(x, idx, aff, torch.zeros(E, 128, 3, 2 * inter), w_d, **opts, backend="torch")
