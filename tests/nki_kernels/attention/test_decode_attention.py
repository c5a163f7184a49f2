"""Fused decode attention kernel on nkisim vs the torch reference, at the rank-shard shapes of the target models.

Tolerances follow nki-library's attention_block_tkg tests: global-range |a - b| <= atol + rtol * max|ref| with
bf16 rtol 1.5e-2, plus cosine similarity >= 0.99. Caches must match the reference at the written rows (bf16 ulp
differences from accumulation order allowed) and be bit-identical everywhere else.
"""

import numpy as np
import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer

# by tests/modules too)
from modules.model_specs import GPT_OSS_20B, LLAMA_31_8B, LLAMA_33_70B
from nki_kernels.attention import check_positions, decode_attention, decode_attention_torch
from nki_kernels.attention.decode import config as cfg_mod
from nki_kernels.attention.decode import qkv as qkv_mod
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import make_inputs, rank_shard, to_paged  # noqa: F401 (make_inputs: used

RTOL, ATOL, MIN_COS = 1.5e-2, 1e-5, 0.99

# Rank-shard shapes (docs/model-configs.md): H padded, head dim, kv heads, q heads per rank, extras.
GPT_OSS_20B_TP8 = rank_shard(GPT_OSS_20B, 8)
LLAMA31_8B_TP8 = rank_shard(LLAMA_31_8B, 8)
LLAMA33_70B_TP16 = rank_shard(LLAMA_33_70B, 16)     # KV replicated x2
MULTI_KV = dict(H=1024, d=128, nkv=2, nq=8, gamma=True, bias=True, sinks=True)           # 2 KV heads, GQA 4
SMALL_D = dict(H=256, d=32, nkv=3, nq=6, gamma=False, bias=False, sinks=False)           # any even d, no norm
PARTIAL_QKV_CHUNK = dict(H=256, d=64, nkv=1, nq=1, gamma=True, bias=True, sinks=True)   # C % 128 = 64


def _written_rows(args, kw, B):
    """[rows of the cache's dim 0, rows of dim 2] mask of the cache rows the new tokens write."""
    K, pos, table = args[2], args[4], kw.get("block_table")
    written = torch.zeros(K.shape[0], K.shape[2], dtype=torch.bool)
    for bi in range(B):
        for p in pos[bi].long():
            if table is None:
                written[bi, p] = True
            else:
                bs = K.shape[2]
                written[table[bi, p // bs].long(), p % bs] = True
    return written


def run_and_check(B, S, s_max, ctx, window=0, lnc=1, shape=GPT_OSS_20B_TP8, seed=0, rope=True, block_size=0):
    shape = dict(shape)
    args, kw = make_inputs(B, S, s_max=s_max, ctx=ctx, seed=seed, rope=rope, **shape)
    if block_size:
        args, kw = to_paged(args, kw, block_size, seed=seed)
    kw["sliding_window"] = window
    ref_args = [a.clone() if a is not None else None for a in args]
    ref = decode_attention_torch(*ref_args, **kw)
    k_before = args[2].clone()
    out = decode_attention(*args, **kw, backend="nkisim", lnc=lnc)
    assert out.shape == (B * S, shape["H"]) and out.dtype == torch.bfloat16
    a, b = out.float(), ref.float()
    assert not torch.isnan(a).any(), "NaN in output (uninitialised read?)"
    err = (a - b).abs().max().item()
    assert err <= ATOL + RTOL * b.abs().max().item(), f"max err {err} vs range {b.abs().max().item()}"
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert cos >= MIN_COS, cos
    # Caches: written rows match the reference within one bf16 step of the value range; all other rows untouched.
    written = _written_rows(args, kw, B)
    for got, want in ((args[2], ref_args[2]), (args[3], ref_args[3])):
        sel = written[:, None, :, None].expand_as(got)
        assert torch.equal(got[~sel], want[~sel])
        assert torch.allclose(got[sel].float(), want[sel].float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(args[2], k_before)
    return out


def test_lnc2_reads_each_weight_once():
    """LNC=2 with a batch split loads half of W_qkv and half of W_o per core: the HBM traffic equals LNC=1's within
    the small inputs both cores read (X, cos/sin, positions) and the modelled latency drops."""
    import nkisim
    args, kw = make_inputs(8, 1, s_max=1024, ctx=1024, seed=4, **LLAMA31_8B_TP8)
    reps = {lnc: nkisim.profile(decode_attention_nki if lnc == 1 else decode_attention_nki[2], *args, target="trn2",
                                **kw).report for lnc in (1, 2)}
    H, C = args[0].shape[2], args[1].shape[1]
    weights = (H * C + args[7].shape[0] * H) * 2
    extra = reps[2].hbm_read_bytes - reps[1].hbm_read_bytes
    assert 0 <= extra <= 2 * args[0].numel() * 2 + 64 * 1024, extra        # the small inputs, not a weight
    assert extra < 0.05 * weights
    assert reps[2].latency_s < 0.8 * reps[1].latency_s


# ---- model rank shards ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,ctx,window", [
    (1, 1, 128, 0), (4, 4, 512, 128), (16, 1, 1024, 128), (16, 4, 2048, 0), (64, 1, 256, 128), (64, 4, 128, 0),
    (1, 1, 16384, 0), (1, 4, 16384, 128),
])
def test_gpt_oss_20b_tp8(B, S, ctx, window):
    run_and_check(B, S, s_max=ctx, ctx=ctx, window=window, shape=GPT_OSS_20B_TP8)


# (64, 1) / (40, 1): token tiles of 33..64 rows, stored by column ranges from 128 partitions (oproj._store_halves)
@pytest.mark.parametrize("B,S,ctx", [(1, 1, 4096), (4, 4, 1024), (16, 1, 512), (64, 4, 256), (64, 1, 256),
                                     (40, 1, 384)])
def test_llama31_8b_tp8(B, S, ctx):
    run_and_check(B, S, s_max=ctx + 64, ctx=ctx, shape=LLAMA31_8B_TP8)


@pytest.mark.parametrize("B,S,ctx", [(1, 1, 2048), (16, 4, 512)])
def test_llama33_70b_tp16(B, S, ctx):
    run_and_check(B, S, s_max=ctx, ctx=ctx, shape=LLAMA33_70B_TP16)


@pytest.mark.parametrize("B,S,ctx,window", [(4, 1, 1000, 0), (3, 4, 640, 64), (16, 2, 300, 0)])
def test_several_kv_heads_per_rank(B, S, ctx, window):
    run_and_check(B, S, s_max=ctx + 24, ctx=ctx, window=window, shape=MULTI_KV)


@pytest.mark.parametrize("lnc", [1, 2])
def test_output_chunks_not_a_multiple_of_the_packed_group(lnc):
    """H = 42 * 128 (nki-library's q2 / H5376 shape) with 8 tokens: the packed O-projection store has groups of 16
    chunks and a partial last group of 10 (LNC=2: 21 chunks per core, 16 + 5), with bias_o added by the evictions.
    d = 128: each eviction's groups are stored right after it (oproj._output_projection), the last with the partial
    group (LNC=2: core 1's groups from its first chunk, 21)."""
    run_and_check(8, 1, s_max=256, ctx=256, shape=dict(H=5376, d=128, nkv=1, nq=2, gamma=True, bias=True,
                                                        sinks=False), lnc=lnc)


@pytest.mark.parametrize("lnc", [1, 2])
def test_wo_last_piece_with_a_partial_group(lnc):
    """16 tokens, H = 42 * 128, d = 128: one packed group of 8 chunks per eviction and W_o in two column pieces,
    the last one chunks 38..41 (half of the last eviction's columns, oproj._wo_pieces), which ends in the partial
    group of 2 chunks; LNC=2: 21 chunks per core (core 1's from chunk 21, its last piece 17..20 of its own)."""
    run_and_check(16, 1, s_max=256, ctx=256, shape=dict(H=5376, d=128, nkv=1, nq=2, gamma=True, bias=True,
                                                         sinks=False), lnc=lnc)


@pytest.mark.parametrize("B,lnc", [(8, 1), (16, 1), (16, 2)])
def test_gptoss_wo_last_piece_eviction_by_eviction(B, lnc):
    """d = 64 (GPT-OSS-20B TP8, biases, sinks): the packed token tile stored eviction by eviction (groups of 12 / 8
    chunks, oproj._early_store) with W_o's last piece half of the last eviction (oproj._wo_pieces); LNC=2: split
    weights, core 1's chunks from 12."""
    run_and_check(B, 1, s_max=256, ctx=256, shape=GPT_OSS_20B_TP8, lnc=lnc)


@pytest.mark.parametrize("B,shape", [(8, GPT_OSS_20B_TP8), (16, LLAMA31_8B_TP8), (16, GPT_OSS_20B_TP8)])
def test_packed_groups_stored_in_one_dma(B, shape):
    """A packed token tile's whole groups go out in one store per eviction (oproj._store_packed: every token's rows
    in one DMA, not one per token): GPT-OSS B=8 two evictions of 12 chunks, Llama-8B B=16 four of 8, GPT-OSS B=16
    three of 8; same output as the reference."""
    import nkisim

    args, kw = make_inputs(B, 1, s_max=256, ctx=256, **shape)
    rep = nkisim.profile(decode_attention_nki, *args, target="trn2", **kw).report
    # the output stores: DMAs writing >= 1 KiB to HBM (the cache update writes one d-row per sequence and DMA)
    stores = [e for e in rep.events if e.engine == "dma" and e.cost.hbm_write >= 1024]
    assert 0 < len(stores) <= shape["H"] // 128 // 8, len(stores)
    run_and_check(B, 1, s_max=256, ctx=256, shape=shape)


def test_odd_shapes_no_norm_no_rope():
    run_and_check(5, 3, s_max=200, ctx=130, shape=SMALL_D, rope=False)
    run_and_check(2, 8, s_max=129, ctx=129, shape=SMALL_D)


# ---- weights larger than SBUF: streamed in contraction chunks (config._weight_plan) -----------------------------

Q16_H7168 = dict(H=7168, d=128, nkv=1, nq=16, gamma=True, bias=False, sinks=False)    # nki-library's q16 family
Q16_SMALL = dict(H=1024, d=128, nkv=1, nq=16, gamma=True, bias=True, sinks=True)


@pytest.mark.parametrize("lnc", [1, 2])
def test_weights_larger_than_sbuf(lnc):
    """nki-library's q16 d128 H7168 B8 shape (W_qkv 252 KiB, W_o 224 KiB per partition; 208 KiB usable on trn2),
    shorter context: LNC=1 streams both weights, LNC=2 holds each core's halves resident."""
    from nki_kernels.attention.decode import config

    cfg = config._Config(8, 1, 7168, 128, 1, 16, 1024, 1024, 1.0, 7168, 0, 2, n_prog=lnc, core=lnc - 1)
    assert (bool(cfg.wq_chunk), bool(cfg.wo_chunk)) == ((True, True) if lnc == 1 else (False, False))
    run_and_check(8, 1, s_max=1024, ctx=1024, shape=Q16_H7168, lnc=lnc)


@pytest.mark.parametrize("B,S,ctx,shape,lnc,room", [
    (20, 8, 300, MULTI_KV, 1, 12 * 1024),     # biases + sinks, 2 KV heads, two token tiles share each W_o chunk
    (8, 1, 600, Q16_SMALL, 2, 14000),         # LNC=2 split weights: each core streams its W_qkv rows / W_o columns
    (20, 7, 300, dict(Q16_SMALL, H=512), 1, 14000),   # 10 QKV accumulators > 8 PSUM banks: two column groups
    (8, 1, 1000, GPT_OSS_20B_TP8, 1, 20 * 1024),      # d = 64 (stacked o^T), hidden_actual 2880, W_qkv 24 = 5 * 4 + 4
    (40, 1, 300, MULTI_KV, 1, 12 * 1024),     # a 40-row token tile: unpacked, stored a column range at a time
])
def test_streamed_weights(B, S, ctx, shape, lnc, room, monkeypatch):
    """Weights forced to stream (WEIGHT_ROOM lowered) on small shapes, each through more chunks than ring buffers:
    same output as the reference; every weight byte read once (HBM traffic equal to the resident launch's)."""
    import nkisim
    from nki_kernels.attention.decode import config

    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, **shape)
    prof = decode_attention_nki if lnc == 1 else decode_attention_nki[2]
    resident = nkisim.profile(prof, *args, target="trn2", **kw).report
    monkeypatch.setattr(config, "WEIGHT_ROOM", room)
    for core in range(lnc):
        cfg = config._Config(B, S, shape["H"], shape["d"], shape["nkv"], shape["nq"], ctx, ctx, 1.0, shape["H"], 0, 2,
                             n_prog=lnc, core=core)
        n_kt = cfg.KT - cfg.KT // 2 if cfg.wsplit else cfg.KT
        n_k = -(-shape["nq"] * shape["d"] // 128)
        assert cfg.wq_chunk and -(-n_kt // cfg.wq_chunk) > cfg.wq_bufs >= 2
        assert cfg.wo_chunk and -(-n_k // cfg.wo_chunk) > cfg.wo_bufs >= 2
    streamed = nkisim.profile(prof, *args, target="trn2", **kw).report
    assert streamed.hbm_read_bytes == resident.hbm_read_bytes
    run_and_check(B, S, s_max=ctx, ctx=ctx, shape=shape, lnc=lnc)


# ---- trn3 (sizes from nl.tile_size: a larger usable SBUF gives longer K/V slots) --------------------------------

@pytest.mark.parametrize("B,S,ctx,shape,lnc,bs", [
    (3, 1, 4096, LLAMA31_8B_TP8, 1, 0),     # 3072-position slots on trn3 (2048 on trn2)
    (16, 1, 2048, GPT_OSS_20B_TP8, 1, 0),
    (8, 1, 2048, LLAMA31_8B_TP8, 1, 0),     # two packs of 4, each ending in the full form (v4: flash.full_all)
    (5, 4, 512, LLAMA31_8B_TP8, 2, 0),
    (2, 2, 700, GPT_OSS_20B_TP8, 1, 256),   # paged, sub-block gathers (16 index rows per transpose, C22)
])
def test_trn3(B, S, ctx, shape, lnc, bs, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run_and_check(B, S, s_max=ctx if not bs else 1024, ctx=ctx, shape=shape, lnc=lnc, block_size=bs)


def test_trn3_gptoss_out_groups_capped(monkeypatch):
    """trn3, d = 64 (_Config.out_group_max): GPT-OSS B=8's packed out^T groups hold OUT_GROUP_V4 = 8 chunks (trn2:
    12), so the O-projection evicts and stores three groups of 8 instead of two of 12; same output as the
    reference, stale NaN rows still excluded."""
    import nkisim

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    args, kw = make_inputs(8, 1, s_max=256, ctx=256, **GPT_OSS_20B_TP8)
    rep = nkisim.profile(decode_attention_nki, *args, target="trn3", **kw).report
    # the output stores: DMAs writing >= 1 KiB to HBM (the cache update writes one d-row per sequence and DMA)
    stores = [e for e in rep.events if e.engine == "dma" and e.cost.hbm_write >= 1024]
    assert len(stores) == GPT_OSS_20B_TP8["H"] // 128 // 8, len(stores)
    run_and_check(8, 1, s_max=256, ctx=256, shape=GPT_OSS_20B_TP8)
    test_nan_in_stale_cache_rows_stays_isolated(GPT_OSS_20B_TP8, 8, 1, 256, 0, 0, 1, None)


def test_trn3_one_pack_row_max_split(monkeypatch):
    """trn3, scans of one-piece slots (<= 4K; _Config.rmax_split): the row max per score chunk and the tail's
    normalisation half on ScalarE, as on trn2, with one pack or several (GPT-OSS B=16, Llama-8B B=8); two-piece
    slots (16K) keep one reduce. Output and NaN isolation on such a scan."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    g, ll = GPT_OSS_20B_TP8, LLAMA31_8B_TP8
    for shape, B, s_max, split in ((g, 8, 4096, True), (g, 8, 2048, True), (g, 8, 16384, False), (g, 16, 4096, True),
                                   (ll, 8, 4096, True), (ll, 16, 16384, False)):
        cfg = cfg_mod._Config(B, 1, shape["H"], shape["d"], shape["nkv"], shape["nq"], s_max, s_max, 1.0,
                              shape.get("hidden_actual", shape["H"]), 0, 2)
        assert cfg.rmax_split == split, (B, s_max)
    run_and_check(8, 1, s_max=2048, ctx=2048, shape=g)
    test_nan_in_stale_cache_rows_stays_isolated(g, 8, 1, 2048, 0, 0, 1, None)
    test_nan_in_stale_cache_rows_stays_isolated(ll, 8, 1, 2048, 0, 0, 1, None)    # two packs


@pytest.mark.parametrize("B,shape", [(8, GPT_OSS_20B_TP8), (8, LLAMA31_8B_TP8)])
def test_trn3_qkv_transposed(B, shape, monkeypatch):
    """trn3, <= 4K caches (_Config.qkv_t): the QKV projection in the transposed form (W_qkv stationary, x^T moving:
    no matmul with the tokens' x^T as stationary and W_qkv columns moving), then back to the token layout; same
    output as the reference, stale NaN rows still excluded."""
    import nkisim

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    args, kw = make_inputs(B, 1, s_max=256, ctx=256, **shape)
    rep = nkisim.profile(decode_attention_nki, *args, target="trn3", **kw).report
    row_form = [e for e in rep.events if e.op == "nc_matmul" and e.meta.get("k") == 128 and e.meta.get("m") == B
                and e.meta.get("n", 0) >= 128]
    assert not row_form, len(row_form)
    run_and_check(B, 1, s_max=256, ctx=256, shape=shape)
    test_nan_in_stale_cache_rows_stays_isolated(shape, B, 1, 256, 0, 0, 1, None)


def test_trn3_pv_v_stationary(monkeypatch):
    """trn3, d = 64 (_Config.pv_t): PV with each batch pair's V stationary and the pair's P^T columns moving (2R = 16
    columns: the 64-cycle floor), the accumulator o^T-like in PSUM, rescaled by alpha along the free axis, o^T
    assembled from it; no PV with P^T stationary and V moving. Not d = 128 (Llama-8B) nor trn2. Output as the
    reference with one pack, two packs and an odd batch (the row-form PV), stale NaN rows still excluded."""
    import nkisim

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    g, ll = GPT_OSS_20B_TP8, LLAMA31_8B_TP8
    for shape, B, s_max, want, chain in ((g, 8, 4096, True, True), (g, 16, 16384, True, False),
                                         (g, 16, 4096, True, False), (ll, 8, 4096, False, False)):
        cfg = cfg_mod._Config(B, 1, shape["H"], shape["d"], shape["nkv"], shape["nq"], s_max, s_max, 1.0,
                              shape.get("hidden_actual", shape["H"]), 0, 2)
        assert cfg.pv_t == want, (B, s_max)
        assert cfg.rmax_chain == chain, (B, s_max)     # one pack: the chained row max too
    args, kw = make_inputs(8, 1, s_max=2048, ctx=2048, **g)
    rep = nkisim.profile(decode_attention_nki, *args, target="trn3", **kw).report
    mm = [(int(e.meta.get("k", 0)), int(e.meta.get("m", 0)), int(e.meta.get("n", 0))) for e in rep.events
          if e.op == "nc_matmul"]
    R = g["nq"] // g["nkv"]
    assert (128, 2 * g["d"], 2 * R) in mm                   # V of a pair stationary, its P^T columns moving
    assert (128, 8 * R, 2 * g["d"]) not in mm               # P^T stationary, a pair's V moving
    run_and_check(8, 1, s_max=2048, ctx=2048, shape=g)
    run_and_check(5, 1, s_max=1024, ctx=1024, shape=g)
    test_nan_in_stale_cache_rows_stays_isolated(g, 8, 1, 2048, 0, 0, 1, None)
    test_nan_in_stale_cache_rows_stays_isolated(g, 16, 1, 2048, 0, 0, 1, None)    # two packs


def test_trn3_queries_copied_per_stack_half(monkeypatch):
    """trn3 (_Config.q_par, one stack per load group): a pack's queries and new keys are copied into their stacks
    with one GpSimd copy per stack half (batch parity) instead of one per batch; not on trn2. Output as the reference
    with two-batch stacks (GPT-OSS: an odd batch, S_tkg 4, two packs) and one-batch stacks (Llama-8B)."""
    from nki_kernels.attention.decode import flash

    g = GPT_OSS_20B_TP8
    for target, want in (("trn3", True), ("trn2", False)):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        cfg = cfg_mod._Config(8, 1, g["H"], g["d"], g["nkv"], g["nq"], 4096, 4096, 1.0, g.get("hidden_actual", g["H"]),
                              0, 2)
        assert cfg.q_par == want, target
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    calls = []
    monkeypatch.setattr(flash, "_stack_queries", _logged(flash._stack_queries, calls, lambda *a: a[-1]))
    run_and_check(5, 4, s_max=512, ctx=512, shape=g)
    run_and_check(16, 1, s_max=1024, ctx=1024, shape=g)
    run_and_check(3, 2, s_max=512, ctx=512, shape=LLAMA31_8B_TP8)
    assert calls == [3, 2, 8, 8, 3], calls    # the packs' batch counts (B=5, S_tkg 4: 96 + 64 rows)


def test_trn3_last_half(monkeypatch):
    """trn3, PV with V stationary and one pack of one-piece slots (_Config.last_half: GPT-OSS B=8 4K): the scan's last
    LAST_HALF_V4 positions are a slot of their own, so half a step follows the last K/V byte. Not several packs,
    two-piece slots (16K), d = 128 nor trn2. Output and stale NaN rows with sequences ending in either half of the
    last 1024 positions, at the halves' boundary and before the last slot. The last step's score matmuls are issued
    before the first step's PV (inside it, after its exp: 2K, three steps) and the last two steps' alpha broadcasts
    and the normalisation's copied on VectorE."""
    from nki_kernels.attention.decode import flash
    from nki_kernels.attention.decode.planning import _slot_bounds

    g, ll = GPT_OSS_20B_TP8, LLAMA31_8B_TP8
    for target, shape, B, s_max, want in (("trn3", g, 8, 4096, True), ("trn3", g, 16, 4096, False),
                                          ("trn3", g, 8, 16384, False), ("trn3", ll, 8, 4096, False),
                                          ("trn2", g, 8, 4096, False)):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        cfg = cfg_mod._Config(B, 1, shape["H"], shape["d"], shape["nkv"], shape["nq"], s_max, s_max, 1.0,
                              shape.get("hidden_actual", shape["H"]), 0, 2)
        assert cfg.last_half == want, (target, shape["d"], B, s_max)
        if want:
            assert _slot_bounds(cfg, 0, s_max)[-3:] == [s_max - 1024, s_max - cfg_mod.LAST_HALF_V4, s_max]
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    args, kw = make_inputs(8, 1, s_max=2048, ctx=2048, seed=5, **g)
    lens = (2047, 1500, 1800, 1030, 1600, 700, 2000, 1536)
    args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, False)
    log = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_step_scores", _logged(flash._step_scores, log, "scores"))
        mp.setattr(flash, "_pv", _logged(flash._pv, log, "pv"))
        mp.setattr(flash, "_bcast_rows", _logged(flash._bcast_rows, log, lambda *a, **k: ("bcast",) + a[3:]))
        _check_nan_tails_where(args, clean, kw, lambda c: c.last_half, "the 2K scan must take last_half")
    # per run (poisoned, clean): the last step's scores before the first step's PV; the last two steps' alpha
    # broadcasts and the normalisation's copied on VectorE, the first step's on ScalarE
    run = log[:len(log) // 2]
    assert run == log[len(log) // 2:]
    assert [e for e in run if e in ("scores", "pv")] == ["scores"] * 3 + ["pv"] * 3, run
    assert [e for e in run if e not in ("scores", "pv")] == [("bcast", False)] + [("bcast", True)] * 3, run


# ---- LNC=2 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,ctx,window,shape", [
    (8, 1, 1024, 128, GPT_OSS_20B_TP8),   # split weights (B even, one token tile): QKV partials and o^T exchanged
    (5, 4, 512, 0, LLAMA31_8B_TP8),       # odd B: whole weights per core
    (1, 1, 512, 0, GPT_OSS_20B_TP8),      # context split
    (4, 2, 256, 0, MULTI_KV),             # split weights, 2 KV heads
    (6, 4, 512, 0, LLAMA31_8B_TP8),       # split weights, S_tkg 4
    (4, 1, 256, 0, PARTIAL_QKV_CHUNK),    # split weights, QKV columns C = 192: the transposed partials' last chunk
])                                        # holds 64 of 128 rows
def test_lnc2(B, S, ctx, window, shape, monkeypatch):
    # Same bits as LNC=1 holds on TensorE (an output element's accumulation depends only on its own row and column)
    # but not with NumPy's fp32 BLAS, whose summation order changes with the tile shape (a core's pack of 3 batches
    # vs LNC=1's pack of 5): the interpreter's shape-independent fp64-accumulation mode checks the property.
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp64")
    out1 = run_and_check(B, S, s_max=ctx, ctx=ctx, window=window, shape=shape, lnc=2)
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, **shape)
    out2 = decode_attention(*args, **kw, sliding_window=window, backend="nkisim", lnc=1)
    if B >= 2:
        assert torch.equal(out1, out2), "LNC=2 must give the same bits as LNC=1 (whole sequences per core)"
    else:   # B = 1: the context is split between the cores (merged softmax states: fp32 order differs)
        _assert_close_to_lnc1(out1, out2)


@pytest.mark.parametrize("B,S,ctx,shape", [
    (8, 1, 1024, GPT_OSS_20B_TP8),      # d = 64 (kpp = 2): heads on both partition halves by the swap matmul
    (6, 4, 512, LLAMA31_8B_TP8),        # d = 128 (kpp = 1), S_tkg 4
    (4, 2, 256, MULTI_KV),              # 2 KV heads
    (4, 1, 256, PARTIAL_QKV_CHUNK),     # the v rows share the last chunk with zero rows
])
def test_lnc2_rope_on_transposed_sums(B, S, ctx, shape, monkeypatch):
    """LNC=2 with split weights (_Config.rope_t): RoPE runs on the exchanged QKV sums in their transposed layout and
    q^T / k^T come from there (qkv._rope_transposed, once per core), not from the token rows (qkv._rope and
    _transpose_qk not called); the output and the updated caches are the bits of the same launch with the flag off
    (RoPE on the token rows), and match the reference."""
    import importlib
    da_mod = importlib.import_module("nki_kernels.attention.decode_attention")   # the package exports a function
    log = []
    monkeypatch.setattr(qkv_mod, "_rope_transposed", _logged(qkv_mod._rope_transposed, log, "transposed"))
    monkeypatch.setattr(da_mod, "_rope", _logged(da_mod._rope, log, "rows"))
    monkeypatch.setattr(da_mod, "_transpose_qk", _logged(da_mod._transpose_qk, log, "qk^T"))
    args_on, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=3, **shape)
    args_off = [a.clone() if a is not None else None for a in args_on]
    out_on = decode_attention(*args_on, **kw, backend="nkisim", lnc=2)
    assert log == ["transposed"] * 2
    log.clear()
    orig = cfg_mod._Config.__init__

    def off(self, *a, **k):
        orig(self, *a, **k)
        object.__setattr__(self, "rope_t", False)      # past the frozen configuration's guard: the flag off
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cfg_mod._Config, "__init__", off)
        out_off = decode_attention(*args_off, **kw, backend="nkisim", lnc=2)
    assert sorted(log) == ["qk^T", "qk^T", "rows", "rows"]     # the two cores trace concurrently: any order
    assert torch.equal(out_on, out_off)
    assert torch.equal(args_on[2], args_off[2]) and torch.equal(args_on[3], args_off[3])    # K (roped) / V rows
    run_and_check(B, S, s_max=ctx, ctx=ctx, shape=shape, lnc=2)


@pytest.mark.parametrize("lens", [
    (4095, 3129, 971, 2463, 3490, 3457, 3688, 1108),    # the bench's 4K lengths: core 1's last slot, 3 of 4 ending
    (1000, 4095, 2049, 3071, 17, 2048, 4000, 1025),     # piece / slot edges on both cores
])
def test_lnc2_batch_split_tail_cuts_with_nan_tails(lens):
    """LNC=2 batch split with one pack per core (GPT-OSS B=8 4K): each core's pack takes the last pack's tail cuts
    (_Config.tail_cuts for wsplit without the stride split, helper-98: the K^T ANDs of its last slot in column
    pieces, l on GpSimd, the sink before the steps; with one pack of <= 64 rows also tail_halves). NaN past every
    length and a large V at each last valid key: finite, equal to the reference and bit-identical to a clean cache.
    Checked to fail with the tail_cuts change reverted (the probe). The row max unchained there (_Config.rmax_chain
    off, helper-98): checked to fail with rmax_chain on (the probe)."""
    ctx = 4096
    args, kw = make_inputs(len(lens), 1, s_max=ctx, ctx=ctx, seed=98, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
    for b, n in enumerate(lens):
        args[3][b, :, n - 1, :] = 64.0
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, False)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg.tail_cuts and cfg.wsplit and not cfg.split and not cfg.rmax_chain,
                           "the LNC=2 batch split at 4K must take tail_cuts, not rmax_chain", lnc=2)


def _assert_close_to_lnc1(out2, out1):
    a, b = out2.float(), out1.float()
    assert not torch.isnan(a).any()
    assert (a - b).abs().max().item() <= 1e-2 * b.abs().max().item()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert cos >= 0.9999, cos


@pytest.mark.parametrize("S,ctx,pos0,window,shape,bs", [
    (1, 4096, None, 0, GPT_OSS_20B_TP8, 0),      # both halves see keys
    (4, 2048, 5, 0, LLAMA31_8B_TP8, 0),          # the second core's half is entirely masked
    (2, 2048, 1030, 0, MULTI_KV, 32),            # paged; the new tokens just after the split point
    (1, 4096, 3000, 1000, GPT_OSS_20B_TP8, 0),   # windowed scan split between the cores
])
def test_lnc2_single_sequence_splits_context(S, ctx, pos0, window, shape, bs):
    """LNC=2 with B=1: each core scans half of the cache, the partial (max, sum, acc) are merged through sendrecv
    and each core computes half of the O-projection columns. Checked against the reference and LNC=1."""
    args, kw = make_inputs(1, S, s_max=ctx, ctx=ctx, seed=11, **shape)
    if pos0 is not None:
        args[4][0] = torch.arange(pos0, pos0 + S, dtype=torch.int32)
    if bs:
        args, kw = to_paged(args, kw, bs)
    kw["sliding_window"] = window
    outs = []
    for lnc in (2, 1):
        a = [x.clone() if x is not None else None for x in args]
        ref_args = [x.clone() if x is not None else None for x in args]
        ref = decode_attention_torch(*ref_args, **kw).float()
        out = decode_attention(*a, **kw, backend="nkisim", lnc=lnc)
        err = (out.float() - ref).abs().max().item()
        assert err <= ATOL + RTOL * ref.abs().max().item(), (lnc, err)
        for got, want in ((a[2], ref_args[2]), (a[3], ref_args[3])):   # the cache is written once, correctly
            sel = _written_rows(a, kw, 1)[:, None, :, None].expand_as(got)
            assert torch.equal(got[~sel], want[~sel])
            assert torch.allclose(got[sel].float(), want[sel].float(), rtol=2e-2, atol=2e-2)
        outs.append(out)
    _assert_close_to_lnc1(outs[0], outs[1])


# ---- determinism and sentinels ------------------------------------------------------------------------------------

def test_ten_runs_identical_bits():
    outs = []
    for _ in range(10):
        args, kw = make_inputs(4, 2, s_max=640, ctx=600, **GPT_OSS_20B_TP8)
        outs.append(decode_attention(*args, **kw, sliding_window=128, backend="nkisim").view(torch.int16))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_numpy_inputs_and_torch_backend_agree():
    args, kw = make_inputs(2, 2, s_max=256, ctx=256, **MULTI_KV)

    def as_np(t):
        if t is None:
            return None
        return t.view(torch.int16).numpy().view(np.dtype("bfloat16")) if t.dtype == torch.bfloat16 else t.numpy()
    import ml_dtypes  # noqa: F401 - registers the numpy bfloat16 dtype
    np_args = [as_np(a.clone()) for a in args]
    np_kw = {k: (as_np(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out_sim = decode_attention(*np_args, **np_kw, backend="nkisim")
    np_args2 = [as_np(a.clone()) for a in args]
    out_ref = decode_attention(*np_args2, **np_kw, backend="torch")
    assert isinstance(out_sim, np.ndarray) and out_sim.shape == out_ref.shape
    a, b = out_sim.astype(np.float32), out_ref.astype(np.float32)
    assert np.abs(a - b).max() <= RTOL * np.abs(b).max()
    np.testing.assert_allclose(np_args[2].astype(np.float32), np_args2[2].astype(np.float32), atol=2e-2, rtol=2e-2)


# ---- bad input: clear errors before any work -----------------------------------------------------------------------

def _bad(**over):
    base = dict(B=2, S=1, H=256, d=64, nkv=1, nq=4, s_max=256, ctx=256, gamma=True, bias=False, sinks=False)
    base.update(over)
    return make_inputs(**base)




def test_h_not_multiple_of_128():
    args, kw = _bad(H=200)
    with pytest.raises(AssertionError, match="multiple of 128"):
        decode_attention_nki(*args, **kw)


def test_head_dim_too_large():
    args, kw = _bad(d=192, H=256)
    with pytest.raises(AssertionError, match="head dim d=192"):
        decode_attention_nki(*args, **kw)


def test_too_many_new_tokens():
    args, kw = _bad(S=9)
    with pytest.raises(AssertionError, match="S_tkg 9"):
        decode_attention_nki(*args, **kw)


def test_cache_too_short():
    args, kw = _bad()
    kw["context_len"] = 512
    with pytest.raises(AssertionError, match="cache too short"):
        decode_attention_nki(*args, **kw)
    args, kw = _bad()
    args[4][1, 0] = 300
    with pytest.raises(ValueError, match="too short"):
        decode_attention(*args, **kw, backend="nkisim")


def test_non_consecutive_positions():
    args, kw = _bad(S=2)
    args[4][0, 0], args[4][0, 1] = 0, 2
    with pytest.raises(ValueError, match="consecutive"):
        decode_attention(*args, **kw)


def test_mismatched_dtypes():
    args, kw = _bad()
    args = (args[0], args[1].float()) + args[2:]
    with pytest.raises(AssertionError, match="W_qkv dtype"):
        decode_attention_nki(*args, **kw)


def test_errors_before_any_work():
    args, kw = _bad()
    k_before = args[2].clone()
    kw["context_len"] = 512
    with pytest.raises(AssertionError):
        decode_attention_nki(*args, **kw)
    assert torch.equal(args[2], k_before)
    check_positions(args[4], 256)


# ---- K/V ring, packs, slots -------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,ctx,shape", [(13, 2, 2500, LLAMA31_8B_TP8), (20, 1, 5000, GPT_OSS_20B_TP8)])
def test_ring_wrap_balanced_packs_partial_slots(B, S, ctx, shape):
    """Several packs (balanced), K/V ring slots reused across packs, a context that is not a multiple of 128."""
    run_and_check(B, S, s_max=ctx + 40, ctx=ctx, shape=shape)


# ---- paged KV cache (block table) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,s_max,ctx,bs,shape", [
    (2, 1, 512, 300, 16, GPT_OSS_20B_TP8),        # small blocks: two blocks per V partition
    (3, 4, 1024, 1000, 32, LLAMA31_8B_TP8),       # d = 128, S_tkg = 4 crossing block boundaries
    (16, 1, 2048, 2048, 64, GPT_OSS_20B_TP8),     # one pack of 16, 128 blocks per gather
    (2, 2, 1024, 700, 256, GPT_OSS_20B_TP8),      # blocks larger than a V partition's run (K > 1), gathered
                                                  # as 16 sub-blocks per slot (indirect transpose rows, C22)
    (2, 3, 2048, 2048, 512, MULTI_KV),            # 2 KV heads per rank, largest block
    (1, 1, 8192, 8192, 16, GPT_OSS_20B_TP8),      # > 128 blocks per slot: several gathers per slot
])
def test_paged_cache(B, S, s_max, ctx, bs, shape):
    run_and_check(B, S, s_max=s_max, ctx=ctx, shape=shape, block_size=bs)


def test_paged_matches_contiguous():
    """Same logical cache, contiguous vs paged: the same result up to fp32 reduction order (the block split permutes
    the positions inside a slot)."""
    args, kw = make_inputs(4, 2, s_max=1024, ctx=1000, **GPT_OSS_20B_TP8)
    pargs, pkw = to_paged([a.clone() if a is not None else None for a in args], kw, 32)
    out_c = decode_attention(*args, **kw, backend="nkisim")
    out_p = decode_attention(*pargs, **pkw, backend="nkisim")
    err = (out_c.float() - out_p.float()).abs().max().item()
    assert err <= 2e-3 * out_c.float().abs().max().item(), err   # same math; reduction order may differ


def test_paged_bad_inputs():
    args, kw = _bad(s_max=512, ctx=512)
    pargs, pkw = to_paged(args, kw, 32)
    bad_bs = to_paged(args, kw, 8)
    with pytest.raises(AssertionError, match="block_size=8 must be a power of two in 16..512"):
        decode_attention_nki(*bad_bs[0], **bad_bs[1])
    with pytest.raises(AssertionError, match=r"block_table must be \[B=2"):
        decode_attention_nki(*pargs, **dict(pkw, block_table=pkw["block_table"][:1]))
    with pytest.raises(AssertionError, match="block_table must be int32"):
        decode_attention_nki(*pargs, **dict(pkw, block_table=pkw["block_table"].to(torch.int16)))
    with pytest.raises(AssertionError, match="cache too short"):
        decode_attention_nki(*pargs, **dict(pkw, block_table=pkw["block_table"][:, :8], context_len=512))
    table = pkw["block_table"].clone()
    table[1, 0] = 10_000
    with pytest.raises(ValueError, match="num_blocks"):
        decode_attention(*pargs, **dict(pkw, block_table=table), backend="nkisim")


# ---- sliding window: only the window is scanned ----------------------------------------------------------------------

@pytest.mark.parametrize("B,S,ctx,window,shape,bs", [
    (8, 1, 4096, 128, GPT_OSS_20B_TP8, 0),      # GPT-OSS SWA layers, long context, clamped starts at both ends
    (3, 4, 2048, 300, MULTI_KV, 0),             # W not a multiple of 128, S_tkg = 4, 2 KV heads
    (4, 3, 640, 2, SMALL_D, 0),                 # W < S_tkg: no cache key visible
    (4, 2, 4096, 128, GPT_OSS_20B_TP8, 16),     # paged + window: block-aligned dynamic start
    (2, 1, 2048, 200, LLAMA31_8B_TP8, 256),     # paged, large blocks (K > 1), windowed
])
def test_sliding_window_scan(B, S, ctx, window, shape, bs):
    run_and_check(B, S, s_max=ctx, ctx=ctx, window=window, shape=shape, block_size=bs)


@pytest.mark.parametrize("B,S,window,shape", [
    (8, 1, 0, LLAMA31_8B_TP8),       # row-major steps over a full 33K scan: thresholds up to ~33K
    (4, 1, 128, GPT_OSS_20B_TP8),    # windowed scan starting past 2^15 (thresholds relative to the window)
])
def test_positions_past_int16_range(B, S, window, shape):
    """S_max > 2^15: the per-step int16 mask thresholds (position - step start) exceed int16 for late positions and
    rely on the fp32 -> int16 write saturating (a wrapping cast would mask every key of those sequences)."""
    ctx = (1 << 15) + 256
    run_and_check(B, S, s_max=ctx, ctx=ctx, window=window, shape=shape)


def test_sliding_window_reads_only_the_window():
    """Cache rows outside the scanned window hold NaN: the output must still match the reference (computed on the
    clean cache), i.e. the kernel never reads them."""
    B, S, ctx, W = 6, 2, 2048, 128
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=5, **GPT_OSS_20B_TP8)
    kw["sliding_window"] = W
    ref = decode_attention_torch(*[a.clone() if a is not None else None for a in args], **kw)
    scan = (W - 1 + 127) // 128 * 128
    for b in range(B):
        start = min(max(int(args[4][b, 0]) - W + 1, 0), ctx - scan)
        for c in (args[2], args[3]):
            c[b, :, :start] = float("nan")
            c[b, :, start + scan:] = float("nan")
    out = decode_attention(*args, **kw, backend="nkisim")
    a, r = out.float(), ref.float()
    assert not torch.isnan(a).any()
    assert (a - r).abs().max().item() <= ATOL + RTOL * r.abs().max().item()


# ---- isolation: stale cache rows (NaN) never reach another row ---------------------------------------------------

def _assert_nan_tails_clean(args, clean, kw, **launch):
    """The kernel on the poisoned args: finite like the reference, equal to it within tolerance, and bit-identical
    to its output on the clean cache. Returns that output."""
    ref = decode_attention_torch(*[a.clone() if a is not None else None for a in args], **kw).float()
    out = decode_attention(*args, **kw, backend="nkisim", **launch)
    assert torch.isfinite(ref).all() and torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    assert _same_bits(out, decode_attention(*clean, **kw, backend="nkisim", **launch))
    return out


def _kv_bytes_beyond_empty(first, ctx, seed, shape):
    """Modelled HBM bytes (trn2) a batch whose sequences start at `first` reads beyond the same batch of empty caches
    (first position 0): the K/V rows it loads."""
    import nkisim

    reads = []
    for f in (first, (0,) * len(first)):
        args, kw = make_inputs(len(first), 1, s_max=ctx, ctx=ctx, seed=seed, **shape)
        args[4][:, 0] = torch.tensor(f, dtype=torch.int32)
        _, rep = nkisim.profile(decode_attention_nki, *args, target="trn2", **kw)
        reads.append(rep.hbm_read_bytes)
    return reads[0] - reads[1]


def _check_nan_tails_where(args, clean, kw, probe, why, **launch):
    """Run the kernel on the poisoned args (launch: e.g. lnc), recording probe(cfg) for every _Config it builds
    (each must hold, else the case does not test what it says: `why`), then the NaN-tail checks: finite, equal to
    the reference and bit-identical to the clean cache's output."""
    seen = []
    orig = cfg_mod._Config.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(probe(self))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cfg_mod._Config, "__init__", spy)
        _assert_nan_tails_clean(args, clean, kw, **launch)
    assert seen and all(seen), why


def _fp8_cache(args, kw):
    """The same inputs with K/V caches cast to fp8 e4m3 and unit per-tensor scales."""
    one = torch.ones(1)
    args = args[:2] + tuple(c.float().to(torch.float8_e4m3fn) for c in args[2:4]) + args[4:]
    return args, dict(kw, k_scale=one, v_scale=one)


def _poison_past(args, lens, fp8):
    """Stale cache rows from each sequence's length on: NaN (fp8: 0x7F bytes)."""
    for b, p0 in enumerate(lens):
        for c in args[2:4]:
            if fp8:
                c.view(torch.uint8)[b, :, p0:] = 0x7F
            else:
                c[b, :, p0:] = float("nan")


def _nan_tail_inputs(lens, ctx, seed, shape, S=1):
    """make_inputs for sequences of these lengths (cache of ctx positions; each sequence's S new tokens at positions
    lens[b]..), a clean copy, and the inputs with NaN past every length: (args, clean, kw)."""
    args, kw = make_inputs(len(lens), S, s_max=ctx, ctx=ctx, seed=seed, **shape)
    args[4][:] = torch.tensor(lens, dtype=torch.int32)[:, None] + torch.arange(S, dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, False)
    return args, clean, kw


def _poison_stale_rows(args, window):
    """NaN in every cache row no query of its sequence may use: positions >= the first new position (the new tokens'
    rows before the update, and the stale tail of a reused block) and, with a sliding window, positions before the
    first new token's window."""
    pos = args[4]
    for b in range(pos.shape[0]):
        p0 = int(pos[b, 0])
        for c in (args[2], args[3]):
            c[b, :, p0:] = float("nan")
            if window:
                c[b, :, :max(0, p0 - window + 1)] = float("nan")


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _logged(fn, log, entry):
    """fn as a spy: appends entry(*args, **kwargs) (entry itself when it is not callable) to log, then calls fn."""
    def spy(*a, **k):
        log.append(entry(*a, **k) if callable(entry) else entry)
        return fn(*a, **k)
    return spy


@pytest.mark.parametrize("shape,B,S,ctx,window,bs,lnc,pos0", [
    (GPT_OSS_20B_TP8, 4, 1, 1024, 0, 0, 1, None),       # full attention: batch packing, stacked K^T (d = 64)
    (GPT_OSS_20B_TP8, 4, 1, 4096, 0, 0, 1, None),       # several slots: fully valid ones skip the scrub (gates)
    (LLAMA31_8B_TP8, 3, 1, 4096, 0, 16, 1, None),       # same, paged with small blocks
    (GPT_OSS_20B_TP8, 4, 1, 2048, 128, 0, 1, None),     # SWA-128: windowed scan from a dynamic start
    (GPT_OSS_20B_TP8, 4, 1, 1024, 0, 32, 1, None),      # paged (a reused block's stale tail)
    (GPT_OSS_20B_TP8, 4, 2, 1024, 128, 16, 1, None),    # paged + SWA
    (LLAMA31_8B_TP8, 4, 2, 600, 0, 0, 1, None),         # d = 128, remainder slot (s_max not a multiple of 128)
    (LLAMA31_8B_TP8, 3, 1, 1024, 0, 64, 1, None),       # Llama paged
    (GPT_OSS_20B_TP8, 4, 1, 1024, 0, 0, 2, None),       # LNC=2, sequences split between the cores
    (GPT_OSS_20B_TP8, 1, 1, 2048, 0, 0, 2, 300),        # LNC=2 context split: core 1's half is all stale
    (GPT_OSS_20B_TP8, 1, 1, 2048, 0, 0, 1, None),       # position-major steps (8 query rows), stacked K^T
    # one sequence, d = 64: ring buffers 1 and 2 hold K^T on partitions 64..127 (_Config.kt_alt, flash._kt_lanes);
    # slots 2048 x3 / 1024 x2 over 4 buffers: the stale rows start in buffer 1's slot (upper half), buffer 3's
    # (lower half) and the wrapped buffer 0's (lower half)
    (GPT_OSS_20B_TP8, 1, 1, 8192, 0, 0, 1, 3000),
    (GPT_OSS_20B_TP8, 1, 1, 8192, 0, 0, 1, 6500),
    (GPT_OSS_20B_TP8, 1, 1, 8192, 0, 0, 1, 7500),
    # the same with a paged cache (row-major steps, i-major K^T): slots 2048 / 1024 / 1024, buffers 1 and 2 upper
    (GPT_OSS_20B_TP8, 1, 1, 4096, 0, 32, 1, 1000),
    (GPT_OSS_20B_TP8, 1, 1, 4096, 0, 32, 1, 2500),
    (GPT_OSS_20B_TP8, 1, 1, 4096, 0, 128, 1, 3500),
    (LLAMA31_8B_TP8, 2, 1, 4096, 0, 0, 1, None),        # position-major steps, two sequences in one pack
])
def test_nan_in_stale_cache_rows_stays_isolated(shape, B, S, ctx, window, bs, lnc, pos0):
    """Rows a sequence never uses hold NaN: every output row stays finite, matches the reference (which excludes
    them by selection) and has the same bits as with a clean cache; the cache rows are untouched."""
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=21, **shape)
    if pos0 is not None:
        args[4][0] = torch.arange(pos0, pos0 + S, dtype=torch.int32)
    kw["sliding_window"] = window
    clean = [a.clone() if a is not None else None for a in args]
    _poison_stale_rows(args, window)
    if bs:
        args, kw_p = to_paged(args, kw, bs, seed=21)
        clean, _ = to_paged(clean, kw, bs, seed=21)
        kw = kw_p
    ref_args = [a.clone() if a is not None else None for a in args]
    ref = decode_attention_torch(*ref_args, **kw)
    assert torch.isfinite(ref.float()).all()
    out = decode_attention(*args, **kw, backend="nkisim", lnc=lnc)
    a, r = out.float(), ref.float()
    assert torch.isfinite(a).all(), f"{(~torch.isfinite(a)).any(-1).sum().item()} of {a.shape[0]} rows not finite"
    err = (a - r).abs().max().item()
    assert err <= ATOL + RTOL * r.abs().max().item(), err
    out_clean = decode_attention(*clean, **kw, backend="nkisim", lnc=lnc)
    assert _same_bits(out, out_clean), "stale rows changed a result"
    written = _written_rows(args, kw, B)
    for got, want in ((args[2], ref_args[2]), (args[3], ref_args[3])):
        sel = written[:, None, :, None].expand_as(got)
        assert _same_bits(got[~sel], want[~sel])
        assert torch.allclose(got[sel].float(), want[sel].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape,B,ctx", [(GPT_OSS_20B_TP8, 4, 1024), (LLAMA31_8B_TP8, 3, 4096),
                                         (LLAMA31_8B_TP8, 8, 2048)])   # two packs: alternation, then _tail_rule
def test_nan_in_stale_cache_rows_stays_isolated_on_trn3(shape, B, ctx, monkeypatch):
    """trn3 (NeuronCore-v4): the V scrub's ANDs are split by batch (VectorE as int32 pairs where the batch's K^T
    stack ANDs on GpSimd, GpSimd as int16 elsewhere; GPT-OSS B=4: two stacks of 2, Llama-8B B=3: one batch per
    stack): stale NaN rows stay excluded on both engines' batches."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    test_nan_in_stale_cache_rows_stays_isolated(shape, B, 1, ctx, 0, 0, 1, None)


# ---- errors name the argument at fault ---------------------------------------------------------------------------

def test_int64_position_ids_and_block_table_are_accepted():
    """torch's default integer dtype: checked on the host, passed to the kernel as int32; same result."""
    args, kw = _bad(S=2, s_max=512, ctx=512)
    pargs, pkw = to_paged(args, kw, 32)
    want = decode_attention(*[a.clone() for a in pargs], **pkw, backend="nkisim")
    a64 = [a.clone() for a in pargs]
    a64[4] = a64[4].long()
    got = decode_attention(*a64, **dict(pkw, block_table=pkw["block_table"].long()), backend="nkisim")
    assert _same_bits(got, want)
    bad = [a.clone() for a in args]
    bad[4] = bad[4].to(torch.int16)
    with pytest.raises(ValueError, match="position_ids must be int32 or int64, got int16"):
        decode_attention(*bad, **kw, backend="nkisim")


@pytest.mark.parametrize("missing", [5, 6])
def test_cos_and_sin_come_together(missing):
    args, kw = _bad()
    args = list(args)
    given = "sin" if missing == 5 else "cos"
    args[missing] = None
    k_before = args[2].clone()
    for call in (lambda: decode_attention(*args, **kw, backend="nkisim"),
                 lambda: decode_attention(*args, **kw, backend="torch")):
        with pytest.raises(ValueError, match=f"^{given} is given but .* is None"):
            call()
    with pytest.raises(AssertionError, match=f"^{given} is given but"):
        decode_attention_nki(*args, **kw)
    assert torch.equal(args[2], k_before)


@pytest.mark.parametrize("paged", [False, True])
def test_cache_in_wrong_layout_names_the_cache(paged):
    """A [B, S_max, kv_heads, d] cache (the Hugging Face layout) is blamed on K_cache, not on W_qkv or the
    positions, before any work."""
    args, kw = _bad(s_max=512, ctx=512)
    if paged:
        args, kw = to_paged(args, kw, 32)
    args = list(args)
    args[2], args[3] = args[2].transpose(1, 2).contiguous(), args[3].transpose(1, 2).contiguous()
    k_before = args[2].clone()
    with pytest.raises(ValueError, match=r"^K_cache: shape .* is the cache in another layout"):
        decode_attention(*args, **kw, backend="nkisim")
    with pytest.raises(AssertionError, match=r"^K_cache: shape"):
        decode_attention_nki(*args, **kw)
    bad_v = list(args)
    bad_v[2] = k_before.transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match=r"^V_cache shape .* must equal K_cache shape"):
        decode_attention(*bad_v, **kw, backend="nkisim")
    assert torch.equal(args[2], k_before)


def test_add_bias_o_selects_the_rank_that_adds_the_bias():
    """Under TP the output is a partial sum: add_bias_o=False leaves bias_o out (another rank adds it)."""
    args, kw = make_inputs(2, 1, s_max=256, ctx=256, seed=2, **MULTI_KV)
    with_b = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim").float()
    without_b = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim", add_bias_o=False).float()
    no_bias = decode_attention(*[a.clone() for a in args], **dict(kw, bias_o=None), backend="nkisim").float()
    assert torch.equal(without_b, no_bias)
    ref = decode_attention_torch(*[a.clone() for a in args], **kw, add_bias_o=False).float()
    assert (without_b - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    assert not torch.equal(with_b, without_b)
    with pytest.raises(ValueError, match="add_bias_o=1 must be a bool"):
        decode_attention(*args, **kw, backend="nkisim", add_bias_o=1)



@pytest.mark.parametrize("H,B,lnc", [(3072, 40, 1), (2944, 48, 2)])
def test_bias_o_added_in_psum(H, B, lnc):
    """trn2 with W_o resident (_Config.bias_psum): bias_o is added in PSUM by a K = 1 matmul opening each out^T
    chunk's accumulation group (chunk c's row on partition BIAS_ROWS[c % 2], column block c // 2), the evictions
    are plain copies, and an unpacked token tile's last eviction group is split in two (_OutLayout.groups). 33..64
    tokens per tile (unpacked); H = 23 * 128: an odd chunk count (the two rows hold 12 and 11 chunks), LNC=2 splits
    the chunks between the cores. The kernel's own bias effect (output with bias_o minus output without) must be
    bias_o on every token (a unit-scale bias, so a chunk read from the wrong row or column block shows far beyond
    the outputs' bf16 rounding), and the output must match the reference."""
    shape = dict(GPT_OSS_20B_TP8, H=H)
    args, kw = make_inputs(B, 1, s_max=256, ctx=256, seed=5, **shape)
    kw["bias_o"] = torch.randn(1, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    seen = []
    orig = cfg_mod._Config.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self.bias_psum and not self.wo_chunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cfg_mod._Config, "__init__", spy)
        with_b = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim", lnc=lnc).float()
    assert seen and all(seen), "bias_psum is off: the case tests no bias added in PSUM"
    without_b = decode_attention(*[a.clone() for a in args], **dict(kw, bias_o=None), backend="nkisim",
                                 lnc=lnc).float()
    effect = with_b - without_b
    want = kw["bias_o"].float().expand_as(effect)
    tol = 0.02 + 2.0 ** -7 * with_b.abs().max().item()
    assert (effect - want).abs().max().item() <= tol, (effect - want).abs().max().item()
    ref = decode_attention_torch(*[a.clone() for a in args], **kw).float()
    assert (with_b - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()


def _assert_equals_one_reduce_row_max(args, kw, out):
    """out (the kernel's row max per score chunk, chained or not) must be bit-identical to the same kernel with one
    reduce per step (a max is exact: a chunk left out moves the exponent's reference point of its rows) and match
    the reference."""
    from nki_kernels.attention.decode import flash
    orig = flash._row_max
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_row_max", lambda m_t, sc, rows, cols, split=None, chain=False: orig(m_t, sc, rows, cols))
        one = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim")
    assert torch.equal(out, one)
    ref = decode_attention_torch(*[a.clone() for a in args], **kw).float()
    assert (out.float() - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()


def test_last_pack_row_max_per_chunk():
    """trn2 (_Config.rmax_split): the kernel's last pack takes each step's row max as one reduce per score chunk
    and a max of the partial maxima (flash._row_max). A max is exact, so the output must be bit-identical to the
    one-reduce row max's (a chunk left out moves the exponent's reference point of its rows, hence the rounding of
    their bf16 probabilities) and match the reference. GPT-OSS B=8: one pack, the last; two score chunks per
    1024-position step."""
    from nki_kernels.attention.decode import flash
    args, kw = make_inputs(8, 1, s_max=4096, ctx=4096, seed=11, **GPT_OSS_20B_TP8)
    orig = flash._row_max
    seen = []

    def spy(m_t, sc, rows, cols, split=None, chain=False):
        seen.append(split is not None and len(split) > 1)
        orig(m_t, sc, rows, cols, split, chain)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_row_max", spy)
        out = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim")
    assert any(seen), "no step took its row max per chunk"
    _assert_equals_one_reduce_row_max(args, kw, out)


def test_one_pack_row_max_chained_and_m_on_gpsimd():
    """trn2, a kernel of one pack scanning two-piece slots (_Config.rmax_chain): the second score chunk's row-max
    reduce continues the first chunk's max (tensor_scalar_reduce, load_reduce) instead of a third reduce of the
    partial maxima, and the last pack's in-place steps update m on GpSimd (flash._online_step_inplace). Both are
    exact: the output must be bit-identical to the one-reduce row max's and match the reference; the instruction
    counts show both paths taken (fails with either reverted: no tensor_scalar_reduce / no [rows, 1] GpSimd max; a
    chained reduce started without the first chunk's max moves the bits). GPT-OSS B=8 at 8K, random positions:
    one pack, gated steps, 2048-position slots; the in-place steps in two partition halves (_Config.tail_halves,
    flash._p128_steps, which replace both there) off."""
    import nkisim
    from nki_kernels.attention.decode import flash
    args, kw = make_inputs(8, 1, s_max=8192, ctx=8192, seed=12, **GPT_OSS_20B_TP8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_p128_steps", lambda cfg, st, steps, rows: None)
        rep = nkisim.profile(decode_attention_nki, *[a.clone() for a in args], target="trn2", **kw)[1]
        chained = sum(1 for e in rep.events if e.op == "tensor_scalar_reduce")
        m_gpsimd = sum(1 for e in rep.events if e.op == "tensor_tensor" and e.engine == "gpsimd"
                       and e.meta.get("n") == 1 and e.meta.get("op") == "maximum")
        assert chained >= 3, f"{chained} chained row-max reduces"
        assert m_gpsimd >= 2, f"{m_gpsimd} m updates on GpSimd"
        out = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim")
        _assert_equals_one_reduce_row_max(args, kw, out)


def test_one_pack_k_masks_in_pieces_with_nan_tails():
    """trn2, a kernel of one pack scanning two-piece slots (_Config.k_mask_pieces, with rmax_chain): each K^T scrub
    mask (ScalarE sign over the slot's columns) is issued in K_MASK_PIECES column pieces, so a QKV eviction that
    becomes ready meanwhile waits for a piece only. Every piece must be written before the AND reads the mask: with
    NaN past every sequence's length the output is bit-identical to a clean cache's and matches the reference.
    Fails with the masks whole (no sign activation narrower than a slot) or with a piece left out (a wrong
    output vs the reference). GPT-OSS B=8 at 8K, ragged lengths: one pack, 2048-position slots."""
    import nkisim
    from nki_kernels.attention.decode.config import K_MASK_PIECES
    args, kw = make_inputs(8, 1, s_max=8192, ctx=8192, seed=14, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor([100, 700, 1500, 2100, 3000, 4097, 6000, 8000], dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_stale_rows(args, 0)
    rep = nkisim.profile(decode_attention_nki, *[a.clone() for a in args], target="trn2", **kw)[1]
    signs = [e.meta.get("n") for e in rep.events if e.op == "activation" and e.meta.get("op") == "sign"]
    assert signs and max(signs) <= 2048 // K_MASK_PIECES, f"K^T mask widths {sorted(set(signs))}"
    _assert_nan_tails_clean(args, clean, kw)


def test_one_pack_8k_tail_halves_with_nan_tails():
    """trn2, a kernel of one full pack of 64 rows scanning 8K (_Config.tail_cuts from TAIL_CUTS_ONE_PACK_MIN_SCAN, so
    _Config.tail_halves, which replaced helper-93's row halves there): the in-place steps' scores as [128, 512] (the
    P^T blocks il < 4 on partitions 0..63, the others on 64..127, thresholds -4 there; flash._online_step_p128),
    one softmax state with m on both halves. Sequences ending in every slot, one at the last position; NaN past
    every length: finite, equal to the reference and bit-identical to a clean cache. Fails with the one-pack scope
    reverted (the probe; no [128, 512] row max)."""
    import nkisim
    from nki_kernels.attention.decode import flash
    from nki_kernels.attention.decode.config import P_MAX
    ctx, lengths = 8192, (100, 700, 1500, 2100, 3000, 4097, 6000, 8191)
    args, kw = make_inputs(8, 1, s_max=ctx, ctx=ctx, seed=15, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor(lengths, dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_stale_rows(args, 0)
    rep = nkisim.profile(decode_attention_nki, *[a.clone() for a in args], target="trn2", **kw)[1]
    halves = [e for e in rep.events if e.op == "tensor_reduce" and e.engine == "vector"
              and e.meta.get("p") == P_MAX and e.meta.get("n") == 512 and e.meta.get("op") == "maximum"]
    assert len(halves) >= 4, f"{len(halves)} row maxima over [128, 512]"
    steps = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_online_step_p128", _logged(flash._online_step_p128, steps, 1))
        _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.tail_halves and cfg.mask_dve and cfg.scan == ctx,
                               "tail_halves is off: the case tests none of the one-pack halves at 8K")
    assert steps, "no step of the pack in the two-halves layout"


def test_ragged_final_normalisation_split_vector_scalar():
    """trn2 (flash._normalise_full, ragged per-group PV): the final o = acc / l is computed half on VectorE, half on
    ScalarE (activation copy with the per-row 1/l as scale), both halves fp32 products rounded to bf16: the output
    equals the all-VectorE normalisation's and the reference; fails when the ScalarE half is not issued or reads
    the other half's columns."""
    from nki_kernels.attention.decode import flash
    args, kw = make_inputs(8, 1, s_max=8192, ctx=8192, seed=13, **GPT_OSS_20B_TP8)
    orig = flash.nisa.activation
    calls = []

    def spy(*a, **k):
        if not isinstance(k.get("scale", 1.0), float) and k.get("op") is flash.nl.copy:
            calls.append(k["dst"].shape)
        return orig(*a, **k)

    def vector_only(*a, **k):
        if not isinstance(k.get("scale", 1.0), float) and k.get("op") is flash.nl.copy:
            return flash.nisa.tensor_scalar(dst=k["dst"], data=k["data"], op0=flash.nl.multiply, operand0=k["scale"])
        return orig(*a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash.nisa, "activation", spy)
        out = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim")
    assert calls, "no ScalarE half of the normalisation"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash.nisa, "activation", vector_only)
        one = decode_attention(*[a.clone() for a in args], **kw, backend="nkisim")
    assert torch.equal(out, one)
    ref = decode_attention_torch(*[a.clone() for a in args], **kw).float()
    assert (out.float() - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()


# ---- ragged contexts: each sequence is scanned to its own length ---------------------------------------------------

RAGGED_FIRST = (1, 130, 1000, 4095, 2500)        # first new position of each sequence (its cache length)


def _ragged_inputs(S, ctx, bs, seed=31):
    args, kw = make_inputs(len(RAGGED_FIRST), S, s_max=ctx, ctx=ctx, seed=seed, **GPT_OSS_20B_TP8)
    args[4][:] = torch.tensor(RAGGED_FIRST, dtype=torch.int32)[:, None] + torch.arange(S, dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_stale_rows(args, 0)          # NaN past every sequence's length (stale tails of reused rows)
    if bs:
        args, kw_p = to_paged(args, kw, bs, seed=seed)
        clean, _ = to_paged(clean, kw, bs, seed=seed)
        kw = kw_p
    return args, clean, kw


@pytest.mark.parametrize("bs,lnc", [(0, 1), (64, 1), (0, 2)])
def test_ragged_contexts_with_nan_tails(bs, lnc):
    """Sequences of very different lengths in one batch, NaN past each one's length: finite, equal to the reference
    and bit-identical to a clean cache (the skipped slots' leftovers are excluded like any stale row)."""
    args, clean, kw = _ragged_inputs(1, 4096 + 128, bs)
    _assert_nan_tails_clean(args, clean, kw, lnc=lnc)


def test_ragged_contexts_read_only_real_rows():
    """The modelled HBM traffic follows each sequence's length: the K/V bytes beyond a batch of empty caches (first
    position 0) are the real rows (2 * d * 2 B each), rounded up per sequence to at most one load piece (FA_SUB)."""
    from nki_kernels.attention.decode_attention import FA_SUB

    d, ctx = GPT_OSS_20B_TP8["d"], 4096 + 128
    kv = _kv_bytes_beyond_empty(RAGGED_FIRST, ctx, 31, GPT_OSS_20B_TP8)
    real = sum(RAGGED_FIRST) * 2 * d * 2
    assert real <= kv <= real + len(RAGGED_FIRST) * FA_SUB * 2 * d * 2, (kv, real)
    assert kv < 0.5 * (len(RAGGED_FIRST) * (ctx - 1) * 2 * d * 2)      # far below a scan to the longest


@pytest.mark.parametrize("fp8", [False, True])
def test_ragged_load_groups_skip_their_matmuls(fp8):
    """Geometric lengths 128 ... 6K in one pack (GPT-OSS B=8: 4 K^T load groups of 2 batches, 2 of 4 with fp8
    pairs): a load group none of whose sequences reaches a step skips its score and PV matmuls (and a fresh ring
    buffer scrubs only the groups reaching its slot). NaN past every length: finite, equal to the reference and
    bit-identical to a clean cache; TensorE issues far less than for the same batch at full length."""
    import nkisim

    ctx = 6144
    lens = [int(x) for x in np.geomspace(128, ctx - 1, 8).round()]
    args, kw = make_inputs(8, 1, s_max=ctx, ctx=ctx, seed=61, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
    if fp8:
        args, kw = _fp8_cache(args, kw)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, fp8)
    _assert_nan_tails_clean(args, clean, kw)
    _, rep = nkisim.profile(decode_attention_nki, *clean, target="trn2", **kw)
    full = [a.clone() if a is not None else None for a in clean]
    full[4][:, 0] = ctx - 1
    _, rep_full = nkisim.profile(decode_attention_nki, *full, target="trn2", **kw)
    # modelled: 0.49 (bf16) / 0.56 (fp8) of the full-length batch's issued FLOPs (real keys: 0.29); ungated 1.0
    assert rep.flops_issued < (0.7 if fp8 else 0.6) * rep_full.flops_issued


@pytest.mark.parametrize("shape,S,ctx,lens,fp8", [
    (GPT_OSS_20B_TP8, 1, 8192, (1, 900, 2047, 2049, 3000, 5000, 7000), False),   # odd pack: one-batch last stack
    (LLAMA31_8B_TP8, 2, 8192 + 200, (700, 1500, 2100, 4000, 8190), False),       # kpp 1, S_tkg 2, remainder slot
    (LLAMA31_8B_TP8, 1, 8192, (300, 3100, 5000), True),                          # fp8 pairs (kd 64, 2 per stack)
])
def test_ragged_rotated_slots_with_nan_tails(shape, S, ctx, lens, fp8):
    """Ragged packs on trn2 hold their odd batches' multi-piece slots rotated by half (_Config.v_rot: V partition q
    and K^T column block q hold the plain layout's (q + 64) % 128; masks and scrubs follow). NaN past every
    length, sequences ending in either half of a rotated slot: finite, equal to the reference and bit-identical to
    a clean cache."""
    from nki_kernels.attention.decode.planning import _plan, _v_rotated

    args, kw = make_inputs(len(lens), S, s_max=ctx, ctx=ctx, seed=71, **shape)
    args[4][:] = torch.tensor(lens, dtype=torch.int32)[:, None] + torch.arange(S, dtype=torch.int32)
    if fp8:
        args, kw = _fp8_cache(args, kw)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, fp8)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg.v_rot and any(_v_rotated(cfg, sl.j0, sl.w) for sl in _plan(cfg)[0]),
                           "no rotated slot: the case does not test the rotation")


def test_ragged_k_pairs_with_nan_tails():
    """Llama-8B (one batch per K^T stack) ragged packs on trn2 load every batch's K^T plain (_Config.k_plain; the
    rotated batches' score matmuls read it rotated) and the whole-slot K^T of batches 2i, 2i + 1 in one transpose
    when both sequences need it (flash._load_k_pair, gated in ragged._load_gates). Pairs with both partners long,
    one ending in a slot's first piece (its partner's whole slot loaded alone), both ending inside a slot, an odd
    pack's unpaired last batch; NaN past every length: finite, equal to the reference and bit-identical to a clean
    cache. Modelled: some transposes move a pair's two whole slots."""
    import nkisim

    ctx = 8192
    lens = (6500, 7100, 900, 5000, 3000, 2100, 8190, 4500, 1500)     # packs of 4 / 5 (an unpaired last batch)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 79, LLAMA31_8B_TP8)
    _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.k_plain, "k_plain is off: the case tests no K^T pair")
    _, rep = nkisim.profile(decode_attention_nki, *clean, target="trn2", **kw)
    w = 2048
    pair = [e for e in rep.events if e.op == "dma_transpose" and e.cost.dma_bytes == 2 * w * 128 * 2]
    assert pair, "no K^T pair transpose"


@pytest.mark.parametrize("lens,lnc", [
    ((4095, 3000, 300, 3100, 2047, 2049, 900, 3500, 1024), 1),     # packs of 5 / 4: an unpaired last batch
    # LNC=2 weight split: packs of 4 / 3 (7 tokens: 8 keep the first slot whole, _Config.first_whole)
    ((4095, 1100, 3072, 3073, 2500, 200, 3900), 2),
])
def test_one_step_slots_k_pairs_with_nan_tails(lens, lnc):
    """Llama-8B at 4K on trn2 with fewer than KW_PACKS packs: the scan [0, 4096) of 2048-position slots has its first
    and last slot split, so every slot is one step (1024 positions); the K^T ring buffers then hold stacks of 1024
    columns (planning._kt_width) and batches 2i, 2i + 1 both reaching a one-piece slot load its K^T in one transpose
    (planning._pair_k, flash._load_k_pair: 4 KiB SBUF runs), each alone when its partner ends before the slot; the
    first slot's longest prefix alternative likewise (300 / 200: a partner loading a shorter prefix). Sequences
    ending in every slot, at and beside slot bounds, pairs split by a short partner; NaN past every
    length: finite, equal to the reference and bit-identical to a clean cache. Modelled: some transposes move a
    pair's two one-step slots."""
    import nkisim
    from nki_kernels.attention.decode.planning import _kt_width, _pair_k, _plan

    ctx = 4096
    args, clean, kw = _nan_tail_inputs(lens, ctx, 89, LLAMA31_8B_TP8)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: _kt_width(cfg, _plan(cfg)[0]) == 1024
                           and any(_pair_k(cfg, _plan(cfg)[0], sl.j0, sl.w) for sl in _plan(cfg)[0]),
                           "no one-step slot loads K^T pairs (planning._pair_k)", lnc=lnc)
    kernel = decode_attention_nki if lnc == 1 else decode_attention_nki[lnc]
    _, rep = nkisim.profile(kernel, *clean, target="trn2", **kw)
    pair = [e for e in rep.events if e.op == "dma_transpose" and e.cost.dma_bytes == 2 * 1024 * 128 * 2]
    assert pair and all(e.cost.efficiency > 0.84 for e in pair), "no K^T pair transpose of one-step slots"


@pytest.mark.parametrize("lens,lnc", [
    ((4095, 3000, 300, 3100, 2047, 2049, 900, 1024), 1),           # two packs of 4
    ((4095, 1100, 2048, 3073, 2500, 200, 1500, 3071), 2),          # LNC=2 weight split: each core one pack of 4
])
def test_first_slot_whole_b8_4k_with_nan_tails(lens, lnc):
    """Llama-8B B=8 at 4K on trn2 (_Config.first_whole, LNC=1 and the LNC=2 weight split): the scan keeps its first
    2048-position slot whole (its K^T as the whole slot / pairs or the first piece's prefix alternatives, V in two
    pieces) and splits only the last one, plan (0, 2048), (2048, 1024), (3072, 1024). Sequences ending in the first
    prefix, in both pieces of the first slot and at its bounds, in the one-step slots; NaN past every length: finite,
    equal to the reference and bit-identical to a clean cache."""
    from nki_kernels.attention.decode.planning import _plan

    ctx = 4096
    args, clean, kw = _nan_tail_inputs(lens, ctx, 91, LLAMA31_8B_TP8)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg.first_whole and [(sl.j0, sl.w) for sl in _plan(cfg)[0]] == [
                               (0, 2048), (2048, 1024), (3072, 1024)],
                           "not the whole-first-slot plan (_Config.first_whole)", lnc=lnc)


def test_ragged_gptoss_k_plain_pairs_with_nan_tails():
    """GPT-OSS (two batches per K^T stack, d = 64) ragged scans of >= KW_PACKS packs on trn2: the rotation is by
    stack (batches 2, 3 of every 4: _Config.rot_unit), every batch's K^T is loaded plain (the rotated stacks' score
    matmuls read it rotated: _Config.k_plain) and batches j, j + 2 (the same partitions of adjacent stacks) both
    needing a slot's whole K^T load it in one transpose (flash._load_k_pair). Packs of 7 (an unpaired batch, a
    one-batch last stack on the swapped lane), sequences ending in both pieces of rotated and unrotated slots while
    their partner goes on; NaN past every length: finite, equal to the reference and bit-identical to a clean cache.
    Modelled: some transposes move a pair's two whole slots."""
    import nkisim

    ctx = 8192
    lens = (6500, 7100, 900, 5000, 3000, 2100, 8190, 4500, 1500, 3500, 2000, 7800, 1100, 6100, 4096, 2600, 5500,
            300, 8000, 3900, 1700, 7300, 5100, 2300, 6900, 4700, 1200, 7700)     # 4 packs of 7
    args, clean, kw = _nan_tail_inputs(lens, ctx, 83, GPT_OSS_20B_TP8)
    _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.k_plain and cfg.kpp == 2 and cfg.rot_unit == 2,
                           "k_plain is off: the case tests no d = 64 plain K^T")
    _, rep = nkisim.profile(decode_attention_nki, *clean, target="trn2", **kw)
    w, d = 2048, GPT_OSS_20B_TP8["d"]
    pair = [e for e in rep.events if e.op == "dma_transpose" and e.cost.dma_bytes == 2 * w * d * 2]
    assert pair, "no K^T pair transpose"


def test_ragged_gptoss_half_piece_pairs_with_nan_tails():
    """GPT-OSS (d = 64) at 4K on trn2 with >= KW_PACKS packs: one-piece slots load as half pieces
    (_Config.half_pieces) and the ring buffers are as wide as the slots (fa_tile = FA_SUB), so batches j, j + 2 both
    needing a slot's whole K^T load it in one transpose (flash._load_k_pair). 49 sequences: 7 packs of 7 (an
    unpaired batch each), random lengths ending in both halves of their last slot while their partner goes on; NaN
    past every length: finite, equal to the reference and bit-identical to a clean cache. Modelled: some transposes
    move a pair's two whole slots (none with the ring buffers FA_TILE_MAX / 2 wide)."""
    import nkisim
    from nki_kernels.attention.decode.config import FA_SUB

    ctx = 4096
    lens = tuple(torch.randint(1, ctx, (49,), generator=torch.Generator().manual_seed(86)).tolist())
    args, clean, kw = _nan_tail_inputs(lens, ctx, 86, GPT_OSS_20B_TP8)
    _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.half_pieces and cfg.fa_tile == FA_SUB and cfg.pack == 8,
                           "the case must load half pieces into FA_SUB-wide ring buffers, packs of <= 8")
    _, rep = nkisim.profile(decode_attention_nki, *clean, target="trn2", **kw)
    d = GPT_OSS_20B_TP8["d"]
    pair = [e for e in rep.events if e.op == "dma_transpose" and e.cost.dma_bytes == 2 * FA_SUB * d * 2]
    assert pair, "no K^T pair transpose"


def test_pack_tables_without_per_pack_loads(monkeypatch):
    """GPT-OSS ragged on trn2 with two-batch K^T stacks and >= KW_PACKS packs (_Config.pack_tables): every batch's
    position on every partition comes from one load for all packs (flash._PackTables; each pack's table copied on
    chip), each attention row's first position is selected on chip out of it (flash._own_position) and the sink rows
    are loaded once for all packs (flash._sink_rows). 29 sequences: packs of 8, 8, 8, 5 (nonzero column offsets; the
    last pack reads a prefix of the shared sink rows); NaN past every length: finite, equal to the reference and
    bit-identical to a clean cache. Modelled: none of the per-pack 4-byte-run loads of p_first / sinks is left."""
    import nkisim

    # 4K: one-piece slots, which load as half pieces (_Config.half_pieces) without the shared pack tables; this case
    # keeps whole pieces so that the tables apply
    monkeypatch.setattr(cfg_mod, "_one_piece_plan", lambda cfg: False)
    ctx = 4096
    lens = (3000, 4095, 900, 2047, 2049, 1500, 3900, 100, 2600, 1024, 3500, 1800, 4000, 700, 2200, 3300, 1200, 2900,
            500, 3700, 1600, 2400, 3100, 1300, 2800, 600, 3600, 2000, 1025)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 85, GPT_OSS_20B_TP8)
    _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.pack_tables and cfg.pack == 8,
                           "pack_tables is off: the case tests no shared pack tables")
    _, rep = nkisim.profile(decode_attention_nki, *clean, target="trn2", **kw)
    rows = GPT_OSS_20B_TP8["nq"] // GPT_OSS_20B_TP8["nkv"]
    per_pack = [e for e in rep.events if e.op == "dma_copy" and e.cost.hbm_read in (8 * rows * 4, 5 * rows * 4)]
    assert len(per_pack) == 1, f"{len(per_pack)} row-table loads: expected the sink rows' one"


def test_last_pack_tail_cuts_with_nan_tails():
    """GPT-OSS ragged on trn2 with the pack tables (_Config.tail_cuts): the kernel's last pack ANDs each K^T stack's
    scrub in LAST_K_AND_PIECES column pieces, updates l on GpSimd (multiply, then add), and o^T's PSUM copy is split
    (the other packs' token columns before the last pack, its own after), the sink term joins l before its steps
    and its pending PV groups' flush is folded into the normalisation. 32 sequences (packs of 8); the last pack's
    end in different quarters of the four 1024-position slots; NaN past every length: finite, equal to the reference
    and bit-identical to a clean cache. Checked to fail with the last piece's AND dropped, the split copy's columns
    off by one token, the folded groups' acc scaled by 1/l instead of alpha/l, and each cut reverted (its spy)."""
    import nki.isa as nisa_mod
    import nki.language as nl_mod

    from nki_kernels.attention.decode import flash, isolation

    ctx = 4096
    lens = (3000, 4095, 900, 2047, 2049, 1500, 3900, 100, 2600, 1024, 3500, 1800, 4000, 700, 2200, 3300, 1200, 2900,
            500, 3700, 1600, 2400, 3100, 1300, 300, 700, 1100, 1900, 2047, 2500, 3800, 4095)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 88, GPT_OSS_20B_TP8)
    widths, copies, l_adds, order = [], [], [], []
    and_bits, copy_oT, tensor_tensor = isolation._and_bits, flash._copy_oT, nisa_mod.tensor_tensor
    copy_pairs = flash._copy_oT_pairs
    add_sink, prior_steps, flush_acc = flash._add_sink, flash._prior_steps, flash._flush_acc

    def spy_steps(*a, **k):
        order.append("steps")
        prior_steps(*a, **k)
        order.append("end")

    def spy_tt(dst, data1, data2, op, engine=nisa_mod.engine.unknown, **k):
        if engine == nisa_mod.engine.gpsimd and op == nl_mod.add and dst.shape[-1] == 1:
            l_adds.append(1)
        return tensor_tensor(dst=dst, data1=data1, data2=data2, op=op, engine=engine, **k)

    with pytest.MonkeyPatch.context() as mp:
        # 4K: whole pieces, so that the pack tables (and tail_cuts) apply (see test_pack_tables_without_per_pack_loads)
        mp.setattr(cfg_mod, "_one_piece_plan", lambda cfg: False)
        mp.setattr(isolation, "_and_bits", _logged(and_bits, widths, lambda data, *a, **k: data.shape[-1]))
        mp.setattr(flash, "_copy_oT", _logged(copy_oT, copies, lambda oT, ps, K, n_k, c0, c1: (c0, c1)))
        # _Config.tail_halves: the last pack's columns from _sel_pairs
        mp.setattr(flash, "_copy_oT_pairs", _logged(copy_pairs, copies, lambda cfg, oT, y, c0, nb: (c0, c0 + nb)))
        mp.setattr(nisa_mod, "tensor_tensor", spy_tt)
        mp.setattr(flash, "_add_sink", _logged(add_sink, order, "sink"))
        mp.setattr(flash, "_prior_steps", spy_steps)
        mp.setattr(flash, "_flush_acc", _logged(flush_acc, order, "flush"))
        _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.tail_cuts and cfg.pack == 8,
                               "tail_cuts is off: the case tests none of the last pack's cuts")
    assert 1024 // cfg_mod.LAST_K_AND_PIECES in widths, f"K^T ANDs not in column pieces: {sorted(set(widths))}"
    assert (0, 24) in copies and (24, 32) in copies, f"o^T copies {sorted(set(copies))}: not split at the last pack"
    assert l_adds, "the last pack's l updates are not on GpSimd"
    # the last pack (of each run): the sink term before its steps, no flush after them (folded into _normalise_full)
    i = len(order) - 1 - order[::-1].index("steps")
    assert order[i - 1] == "sink" and order[-1] == "end", f"the last pack's sink / steps / flush: {order[i - 1:]}"


@pytest.mark.parametrize("lens", [
    (16383, 5000, 9300, 700, 12289, 2047, 14600, 8191),
    (128, 256, 512, 1024, 2047, 4095, 8191, 16383),     # the bench's ragged row: short sequences, 1024-position slots
])
def test_tail_cuts_16k_few_packs_with_nan_tails(lens):
    """GPT-OSS ragged on trn2 scanning 16K in one pack of 8 (no pack tables: fewer than KW_PACKS packs) takes the
    last pack's tail cuts too (_Config.tail_cuts from TAIL_CUTS_MIN_SCAN, helper-92): the K^T ANDs of its
    2048-position slots in LAST_K_AND_PIECES column pieces, l updated on GpSimd, the sink term before its steps; and
    the steps' masks on VectorE (_Config.mask_dve: fp16 key offsets 0 .. 2047, exact, against fp32 thresholds), no
    GpSimd mask compare. One pack: its in-place steps in the two partition halves too (_Config.tail_halves,
    flash._online_step_p128, helper-97), whose masks follow mask_dve (fp16 key offsets, fp32 thresholds shifted by
    -ni / 2 on the upper half). Sequences ending in different pieces of the slots (one at the last position, stack
    partners in different slots); NaN past every length: finite, equal to the reference and bit-identical to a clean
    cache. Checked to fail with the tail_cuts change reverted (the probe), with mask_dve off (the spies), with the
    fp16 key offsets one too high (reference mismatch), with tail_halves at pack_tables only (the probe, no p128
    step) and with the two-halves masks on GpSimd (int16, as before helper-97: the spies)."""
    import nki.isa as nisa_mod
    import nki.language as nl_mod

    from nki_kernels.attention.decode import flash, isolation

    ctx = 16384
    args, kw = make_inputs(len(lens), 1, s_max=ctx, ctx=ctx, seed=92, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
    for b, n in enumerate(lens):     # a large V at each last valid key: a mask one position off changes the output
        args[3][b, :, n - 1, :] = 64.0
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, False)
    widths, l_adds, order, gp_masks, dve_masks, p128 = [], [], [], [], [], []
    and_bits, tensor_tensor, tensor_scalar = isolation._and_bits, nisa_mod.tensor_tensor, nisa_mod.tensor_scalar
    add_sink, prior_steps, step_p128 = flash._add_sink, flash._prior_steps, flash._online_step_p128

    def spy_ts(dst, data, op0, operand0, *a, **k):
        if data.dtype == nl_mod.float16 and op0 in (nl_mod.greater, nl_mod.less_equal):
            dve_masks.append(1)
        return tensor_scalar(dst, data, op0, operand0, *a, **k)

    def spy_tt(dst, data1, data2, op, engine=nisa_mod.engine.unknown, **k):
        if engine == nisa_mod.engine.gpsimd and op == nl_mod.add and dst.shape[-1] == 1:
            l_adds.append(1)
        if engine == nisa_mod.engine.gpsimd and op == nl_mod.greater and dst.shape[-1] >= 128:   # a cache step's
            gp_masks.append(1)
        return tensor_tensor(dst=dst, data1=data1, data2=data2, op=op, engine=engine, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolation, "_and_bits", _logged(and_bits, widths, lambda data, *a, **k: data.shape[-1]))
        mp.setattr(nisa_mod, "tensor_tensor", spy_tt)
        mp.setattr(nisa_mod, "tensor_scalar", spy_ts)
        mp.setattr(flash, "_add_sink", _logged(add_sink, order, "sink"))
        mp.setattr(flash, "_prior_steps", _logged(prior_steps, order, "steps"))
        mp.setattr(flash, "_online_step_p128", _logged(step_p128, p128, 1))
        _check_nan_tails_where(args, clean, kw,
                               lambda cfg: cfg.tail_cuts and not cfg.pack_tables and cfg.pack == 8 and cfg.scan == ctx
                               and cfg.mask_dve and cfg.tail_halves,
                               "tail_cuts / tail_halves off (or pack_tables on): the case tests none of the 16K cuts")
    assert p128, "no step of the last pack in the two-halves layout"
    assert 2048 // cfg_mod.LAST_K_AND_PIECES in widths and 2048 not in widths, \
        f"K^T ANDs not in column pieces: {sorted(set(widths))}"
    assert l_adds, "the last pack's l updates are not on GpSimd"
    assert dve_masks and not gp_masks, f"step masks: {len(dve_masks)} on VectorE, {len(gp_masks)} on GpSimd"
    # one pack per run (the poisoned and the clean cache): its sink term before its steps
    assert order and order == ["sink", "steps"] * (len(order) // 2), f"the pack's sink / steps: {order}"


def test_tail_cuts_16k_one_pack_of_128_rows_with_nan_tails():
    """GPT-OSS ragged on trn2, S_tkg 2, 16K: one pack of 8 sequences = 128 rows takes the tail cuts but not the
    last pack's halves (_Config.tail_halves keeps m on both partition halves: packs of <= 64 rows). NaN past every
    length: finite, equal to the reference and bit-identical to a clean cache. Fails with tail_halves on every
    one-pack tail_cuts scan (as at 0a97081: an IndexError in flash._alpha_bufs)."""
    ctx, S = 16384, 2
    lens = (1100, 6000, 4200, 1900, 5300, 3000, 16000, 4900)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 97, GPT_OSS_20B_TP8, S=S)
    _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.tail_cuts and cfg.pack * cfg.R > 64,
                           "no one-pack tail_cuts scan of more than 64 rows: the case tests nothing")


def test_last_pack_tail_halves_with_nan_tails():
    """GPT-OSS ragged on trn2 with the pack tables (_Config.tail_halves): the kernel's last pack (64 rows) keeps
    alpha and m in two buffers alternating by step (flash._alpha_bufs), its in-place steps put the two halves of
    the P^T blocks on the two partition halves (flash._p128_steps: scores [128, 512], thresholds shifted by -ni / 2
    on the upper half), its o^T selection is one matmul per batch (oproj._sel_pairs) and W_o's last column piece
    is the last eviction group's (oproj._wo_pieces). 32 sequences (packs of 8; 1024-position slots, the first one
    step 0), the last pack's ending in the lower and upper halves of its in-place steps; NaN past every length:
    finite, equal to the reference and bit-identical to a clean cache, with random inputs and with inputs where
    every cache key scores ~-32 and the new key 0 (a key past the end wrongly kept, score ~0 once scrubbed, then
    weighs as much as the new one). Checked to fail (reference mismatch) with the upper half's threshold shift left
    out (second inputs), with the pair copy taking the other parity's half, with the flush reading this step's
    alpha buffer, and with the P^T blocks of the upper half read from the lower columns (first inputs)."""
    from nki_kernels.attention.decode import flash, oproj

    ctx = 4096
    lens = (3000, 4095, 900, 2047, 2049, 1500, 3900, 100, 2600, 1024, 3500, 1800, 4000, 700, 2200, 3300, 1200, 2900,
            500, 3700, 1600, 2400, 3100, 1300, 1028, 3333, 2051, 2047, 1500, 3077, 1030, 3585)
    steps, pairs, pieces = [], [], []
    step_p128, copy_pairs, wo_pieces = flash._online_step_p128, flash._copy_oT_pairs, oproj._wo_pieces

    def spy_pieces(cfg, W_o, tiles=None):
        out = wo_pieces(cfg, W_o, tiles)
        pieces.append(out)
        return out

    for dominant in (False, True):
        args, kw = make_inputs(len(lens), 1, s_max=ctx, ctx=ctx, seed=90, rope=not dominant, **GPT_OSS_20B_TP8)
        args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
        if dominant:    # q = 4 (bias only), new k = 0, cached keys -1: cache scores -32 * d * scale, new key 0
            nq_d, d = GPT_OSS_20B_TP8["nq"] * GPT_OSS_20B_TP8["d"], GPT_OSS_20B_TP8["d"]
            bias = kw["bias_qkv"].clone()
            bias[:, :nq_d] = 4.0
            bias[:, nq_d:nq_d + d] = 0.0
            args = (args[0], args[1] * 0, torch.full_like(args[2], -1.0)) + tuple(args[3:])
            kw["bias_qkv"] = bias
        clean = [a.clone() if a is not None else None for a in args]
        _poison_past(args, lens, False)
        with pytest.MonkeyPatch.context() as mp:
            # 4K: whole pieces, so that the pack tables and tail_halves apply (see test_pack_tables_without_...)
            mp.setattr(cfg_mod, "_one_piece_plan", lambda cfg: False)
            mp.setattr(flash, "_online_step_p128", _logged(step_p128, steps, 1))
            mp.setattr(flash, "_copy_oT_pairs", _logged(copy_pairs, pairs, lambda cfg, oT, y, c0, nb: (c0, nb)))
            mp.setattr(oproj, "_wo_pieces", spy_pieces)
            _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.tail_halves and cfg.pack == 8,
                                   "tail_halves is off: the case tests none of the last pack's halves")
    assert steps, "no step of the last pack in the two-halves layout"
    assert (24, 8) in pairs, f"o^T's last columns not from the paired selection: {pairs}"
    assert any(len(p) == 3 and p[-1] == (20, 24) for p in pieces), f"W_o's pieces: {pieces}"


def test_ragged_whole_end_slots_with_nan_tails():
    """Llama-8B ragged on trn2 scanning >= KW_PACKS packs (_Config.k_packs): the scan's first and last slots are not
    split to one step (planning._slot_bounds), so at 4K both slots are two-piece (2048 positions): the first one's
    prefix alternatives, the whole-slot K^T and K^T pairs, and the rotated batches' halves in both. Sequences ending
    in every piece of both slots (one in the first prefix, one at the last position), stack partners ending in
    different pieces, an odd pack's unpaired batch; NaN past every length: finite, equal to the reference and
    bit-identical to a clean cache."""
    from nki_kernels.attention.decode.planning import _plan

    ctx = 4096
    lens = (90, 4095, 1500, 2600, 3700, 1030, 2047, 2049, 3071, 3073, 200, 4000, 1024, 3500, 600, 2500, 3900)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 83, LLAMA31_8B_TP8)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg.k_packs and [(sl.j0, sl.w) for sl in _plan(cfg)[0]] == [(0, 2048),
                                                                                                   (2048, 2048)],
                           "not the whole-end-slot plan (k_packs, two 2048-position slots)")


def test_ragged_k_first_with_nan_tails():
    """Llama-8B ragged on trn2 (d = 128, _Config.k_first): each batch's K^T loads of a slot (the first piece alone,
    the whole slot, the pair with its stack partner) are issued before its V pieces, so the kernel's last K^T is
    not the last byte in the DMA rings. Sequences ending in every piece of both 2048-position slots, pairs split by
    a short partner; NaN past every length: finite, equal to the reference and bit-identical to a clean cache; per
    (sequence, slot) the first load carrying K^T precedes every V-only load. With it _Config.last_and_split: the
    last pack's scrub ANDs by half (K^T: LAST_AND_SPLIT column pieces of the 2048-position slot; V: each step's 8
    blocks), the other packs' whole."""
    from nki_kernels.attention.decode import flash, isolation

    ctx = 4096
    lens = (90, 4095, 1500, 2600, 3700, 1030, 2047, 2049, 3071, 3073, 200, 4000, 1024, 3500, 600, 2500, 3900)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 97, LLAMA31_8B_TP8)
    loads = []

    def piece(cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, a, size, lane=0, rot=False, parts="kv"):
        return [(b, j0, parts)]

    def pair(cfg, K_cache, kT, b, g, j, j0, w, lane=0):
        return [(b, j0, "k"), (b + cfg.kpp, j0, "k")]
    ands = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_load_piece", _logged(flash._load_piece, loads, piece))
        mp.setattr(flash, "_load_k_pair", _logged(flash._load_k_pair, loads, pair))
        mp.setattr(isolation, "_and_bits", _logged(isolation._and_bits, ands, lambda data, mask, vector=False:
                                                   tuple(data.shape)))
        _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.k_first and cfg.k_packs and cfg.last_and_split,
                               "k_first / last_and_split off: the case does not test the K^T-first order")
    assert (128, 2048) in ands and (128, 1024) in ands, f"K^T ANDs not whole then by half in the last pack: {ands}"
    assert (128, 16, 128) in ands and (128, 8, 128) in ands, f"V ANDs not whole then per step in the last pack: {ands}"
    order = [x for call in loads for x in call]
    v_only = {(b, j0) for b, j0, parts in order if parts == "v"}
    assert v_only, "no V-only load (whole-slot K^T): the case does not test the order"
    for key in v_only:
        first_k = min(i for i, (b, j0, parts) in enumerate(order) if (b, j0) == key and "k" in parts)
        first_v = min(i for i, (b, j0, parts) in enumerate(order) if (b, j0) == key and parts == "v")
        assert first_k < first_v, f"sequence {key[0]}'s V of slot {key[1]} loaded before its K^T"


def test_ragged_k1_prefixes_with_nan_tails():
    """Llama-8B ragged on trn2 (d = 128, _Config.k1_prefixes): a sequence ending inside the first 1024-position piece
    of a 2048-position slot (the first-piece-alone K^T load, planning._whole_k) loads K^T of [j0, j0 + m K1_PREFIX)
    only, the shortest prefix holding its rows (not the whole piece); the scan's first slot from 512 positions (the
    shorter prefix pieces below). Sequences ending at every alternative's edges of both slots, in both halves of a
    stack pair. NaN past every length: finite, equal to the reference, bit-identical to a
    clean cache; every such sequence's K^T load of its last slot (in both runs) is the expected prefix."""
    from nki_kernels.attention.decode import flash

    ctx, p = 4096, cfg_mod.K1_PREFIX
    lens = (513, 1024, 700, 4095, 2049, 2048 + p, 2048 + p + 1, 3071, 3072, 2600, 900, 2300, 3000, 1500, 2048 + 3 * p,
            3500)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 101, LLAMA31_8B_TP8)
    loads = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "_load_piece", _logged(
            flash._load_piece, loads, lambda cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, a, size, lane=0,
            rot=False, parts="kv": (b, j0, a, size, parts)))
        _check_nan_tails_where(args, clean, kw, lambda cfg: cfg.k1_prefixes and cfg.k_whole,
                               "k1_prefixes off: the case does not test the K^T prefix alternatives")
    checked = 0
    for b, n in enumerate(lens):
        j0 = (n - 1) // 2048 * 2048
        if not (n - j0 <= 1024 and (j0 > 0 or n > 512)):
            continue
        want = -(-(n - j0) // p) * p
        got = [size for bb, jj, a, size, parts in loads if (bb, jj, a) == (b, j0, j0) and parts == "k"]
        assert got and set(got) == {want}, f"sequence {b} (length {n}): K^T of its last slot {got}, expected {want}"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("B,S,lnc,ctx", [(9, 1, 1, 1024), (11, 1, 1, 1024), (3, 4, 1, 1024), (16, 1, 2, 1024)])
def test_x_rows_in_groups_with_nan_tails(B, S, lnc, ctx):
    """Llama-8B on trn2 with 9..16 tokens and a bf16 cache of <= X_ROW_S_MAX positions (_Config.x_row_parts): X's
    rows load in groups on partitions 96 / 32 / 0 / 64 (config.X_ROW_PARTS; 9 tokens: 6 + 3, 11: 6 + 5, 12 and 16:
    every group, the last partial) and are transposed per group into one x^T (tiles.transpose_token_groups); LNC=2
    feeds the split-contraction QKV. NaN past every length: finite, equal to the reference, bit-identical to a clean
    cache."""
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=31 + B, **LLAMA31_8B_TP8)
    lens = [90 + 61 * b for b in range(B)]
    args[4][:, :] = torch.tensor(lens, dtype=torch.int32)[:, None] + torch.arange(S, dtype=torch.int32)[None, :]
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, lens, False)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg_mod.x_row_groups(cfg, B * S) == cfg_mod.X_ROW_PARTS,
                           "X's rows not loaded in groups (_Config.x_row_parts, config.x_row_groups)", lnc=lnc)


@pytest.mark.parametrize("B,S,lnc,ctx", [(8, 1, 1, 2048), (4, 2, 1, 2048), (8, 1, 2, 2048), (8, 1, 1, 4096)])
def test_x_rows_spread_d128_with_nan_tails(B, S, lnc, ctx):
    """Llama-8B (d = 128) on trn2 with 8 tokens, a bf16 cache of <= X_ROW_S_MAX positions and a scan of >=
    X_SPREAD_D128_SCAN positions (_Config.x_spread): X's 8 rows load on partitions 64 + 8 * t (one DMA engine each)
    of a zeroed 64-partition block, transposed whole per kt (tiles.transpose_spread_rows), not in row groups; LNC=2
    B=8 is the weight-split batch split (each core loads the whole tile for its half of the QKV contraction). NaN
    past every length: finite, equal to the reference, bit-identical to a clean cache."""
    lens = [90 + (ctx - 200) // B * b for b in range(B)]
    args, clean, kw = _nan_tail_inputs(lens, ctx, 31 + B, LLAMA31_8B_TP8, S=S)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: (cfg.x_spread == cfg_mod.X_SPREAD_STRIDE and not cfg_mod.x_row_groups(cfg, B * S)
                                        and (lnc == 1 or cfg.wsplit)),
                           "X's 8 rows not spread over the DMA engines (_Config.x_spread, d = 128)", lnc=lnc)


@pytest.mark.parametrize("B,S,lnc,ctx", [(8, 1, 1, 1024), (5, 1, 1, 1024), (3, 2, 1, 1024), (2, 1, 1, 1024),
                                         (5, 1, 2, 1024), (8, 1, 1, 4224), (2, 1, 1, 4224)])
def test_x_rows_spread_with_nan_tails(B, S, lnc, ctx):
    """GPT-OSS (d = 64) on trn2 with 2..8 tokens (_Config.x_spread): X's rows load on partitions 8 * t (one DMA
    engine each) of a zeroed 32 / 64-partition block, transposed whole per kt, the eviction picking every 8th column
    (tiles.transpose_spread_rows); 8 tokens fill 57 partitions, 5 / 6 a 64-block, 2 a 32-block, at the top of the
    partitions (64.. / 96..) for caches of <= X_ROW_S_MAX positions, at 0.. for longer ones (4224); LNC=2 with an odd
    batch (no weight split): each core its own 3 / 2 rows. The RoPE tables on partitions SMALL_P0.. (_Config.small_p0,
    d = 64 too). NaN past every length: finite, equal to the reference, bit-identical to a clean cache."""
    lens = [100 + (ctx - 200) // B * b for b in range(B)]
    args, clean, kw = _nan_tail_inputs(lens, ctx, 41 + B, GPT_OSS_20B_TP8, S=S)
    _check_nan_tails_where(args, clean, kw,
                           lambda cfg: cfg.x_spread == cfg_mod.X_SPREAD_STRIDE and cfg.small_p0 == cfg_mod.SMALL_P0,
                           "X's rows not spread over the DMA engines (_Config.x_spread) or RoPE tables at 0", lnc=lnc)


@pytest.mark.parametrize("S,ctx,lens", [
    # odd pack: the last stack's one batch (4700) on partitions 64..127 in the swapped buffers; 1100 / 1500 end in
    # the swapped 1024-position slot, 4500 / 5800 in either piece of the swapped 2048-position one, their stack
    # partners beyond
    (1, 8192, (1100, 7000, 4500, 1500, 5800, 2100, 4700)),
    (2, 8192 + 200, (1100, 6000, 4200, 1900, 5300, 3000, 8000, 4900)),    # S_tkg 2, even pack, remainder slot
    (1, 8192, (1100, 7000, 4500, 1500, 5800, 2100, 4700, 300, 8100) * 2),  # two packs of 9 (the second's queries)
])
def test_ragged_swapped_kt_lanes_with_nan_tails(S, ctx, lens):
    """GPT-OSS ragged packs on trn2 swap each K^T stack's halves on the odd ring buffers (_Config.kt_swap: batch j
    on partitions ((j + 1) % 2) * 64.., the score matmuls against the swapped queries, the scrub against the
    swapped valid-range table), on top of the odd batches' rotated multi-piece slots (v_rot). NaN past every
    length, sequences ending in swapped slots while their stack partner goes on (a scrub by the partner's length
    would keep their NaN rows): finite, equal to the reference and bit-identical to a clean cache."""
    from nki_kernels.attention.decode.flash import _kt_lanes
    from nki_kernels.attention.decode.planning import _plan

    args, clean, kw = _nan_tail_inputs(lens, ctx, 73, GPT_OSS_20B_TP8, S=S)
    def swapped_ends(cfg):
        lanes, slots = _kt_lanes(cfg), _plan(cfg)[0]
        # the swapped slots holding a sequence's first stale row (its NaN tail starts there)
        ends = [k for k, sl in enumerate(slots) for n in lens if sl.j0 <= n < sl.j0 + sl.w and lanes[k % cfg.kv_bufs]]
        return cfg.kt_swap and cfg.v_rot and len(ends) >= 3

    _check_nan_tails_where(args, clean, kw, swapped_ends,
                           "no sequence ends in a swapped slot: the case does not test the swap")


def test_ragged_v_balances_the_dma_rings():
    """GPT-OSS B=8, 8K (slots 1024 / 1024 / 2048 / ...): every sequence ends inside the first piece of the 2048-
    position slot, so each loads only that piece's V (64 partitions, 8 DMA rings). Those loads used to land on
    partitions 0..63 (rings 0..7) only; with the odd batches rotated both halves of the rings carry the same V
    bytes (modelled, trn2; main: 1050112 / 1024 bytes)."""
    import nkisim

    lens = (2100, 2200, 2300, 2400, 2500, 2600, 2700, 2800)
    args, kw = make_inputs(len(lens), 1, s_max=8192, ctx=8192, seed=72, **GPT_OSS_20B_TP8)
    args[4][:, 0] = torch.tensor(lens, dtype=torch.int32)
    _, rep = nkisim.profile(decode_attention_nki, *args, target="trn2", **kw)
    halves = [0, 0]
    for e in rep.events:      # DMA copies over 64 partitions: the V pieces
        if e.engine == "dma" and e.op == "dma_copy" and not e.cost.note and len(e.pieces) == 8:
            for q, _s, _e in e.pieces:
                halves[q // 8] += e.cost.dma_bytes / len(e.pieces)
    assert 0.9 < halves[0] / halves[1] < 1.1, halves


def test_ragged_short_sequences_load_a_prefix_of_the_first_piece():
    """Llama-8B (d = 128) on trn2, two packs of sequences ending in the scan's first piece: each loads the shortest
    prefix of that piece holding its rows (planning._first_prefixes), not the whole piece; with NaN past every
    length (the second pack's prefixes leave the first pack's rows in the reused ring buffers) the output is finite,
    equal to the reference and bit-identical to a clean cache. Modelled K/V bytes: real rows <= read <= 0.7x the
    whole first piece per sequence (each reads 1024 positions without the prefixes)."""
    from nki_kernels.attention.decode.config import FA_SUB

    ctx, d = 4096, LLAMA31_8B_TP8["d"]
    lens = (90, 3000, 300, 600, 150, 2000, 400, 700)      # packs of 4: the first piece's prefixes in both
    args, clean, kw = _nan_tail_inputs(lens, ctx, 73, LLAMA31_8B_TP8)
    _assert_nan_tails_clean(args, clean, kw)
    short = [n for n in lens if n < FA_SUB]
    kv, row = _kv_bytes_beyond_empty(short, ctx, 73, LLAMA31_8B_TP8), 2 * d * 2
    assert sum(short) * row <= kv <= 0.7 * len(short) * FA_SUB * row, (kv, sum(short) * row)


def test_ragged_one_piece_slots_load_in_half_pieces():
    """GPT-OSS (d = 64) B=8 at 4K on trn2: every slot is one FA_SUB-position piece, loaded as two half pieces
    (_Config.half_pieces): V as two blocks of 64 partitions, K^T as the first half alone or the whole slot
    (_whole_k), the second and fourth batch pair rotated by half (rotation by stack, k_plain). Lengths end in the
    first half of their last slot (100, 1500, 2560: exactly at the half, 3073: one row past a slot start) and in the
    second (700, 2047, 3600, 4095), in rotated and unrotated stacks; NaN past every length: the unloaded halves keep
    the ring buffer's earlier rows (NaN in a fresh buffer), which the scrubs must clear. Finite, equal to the
    reference, bit-identical to a clean cache; the modelled K/V bytes read are exactly the half pieces up to each
    length (each sequence's last slot read whole without them)."""
    from nki_kernels.attention.decode.config import FA_SUB

    ctx, d = 4096, GPT_OSS_20B_TP8["d"]
    lens = (100, 4095, 1500, 2560, 3073, 700, 2047, 3600)
    args, clean, kw = _nan_tail_inputs(lens, ctx, 74, GPT_OSS_20B_TP8)
    _check_nan_tails_where(args, clean, kw, lambda c: c.half_pieces and c.k_plain and c.rot_unit == 2,
                           "the launch must load half pieces, rotated by stack (_Config.half_pieces, k_plain)")
    half = FA_SUB // 2
    rows = sum((n + half - 1) // half * half for n in lens)     # K and V alike
    assert _kv_bytes_beyond_empty(lens, ctx, 74, GPT_OSS_20B_TP8) == 2 * rows * d * 2


# ---- LNC=2 batch split balanced at run time: both cores on every sequence, alternating slots, states merged -------

@pytest.mark.parametrize("shape,S,ctx,first,bs,fp8,min_scan", [
    (GPT_OSS_20B_TP8, 1, 8192 + 128, (8190, 130, 1000, 4095, 2500, 6000), 0, False, None),  # the real threshold
    # 16K, one pack: _Config.tail_cuts, not tail_halves (its m in alternating buffers; the merge reads one m)
    (GPT_OSS_20B_TP8, 1, 16384, (16383, 130, 5000, 4095, 2500, 9000, 12000, 700), 0, False, None),
    (GPT_OSS_20B_TP8, 1, 4096 + 128, (1, 130, 1000, 4095, 2500, 3000), 64, False, 2048),   # paged
    (MULTI_KV, 2, 4096 + 128, (4000, 17, 1500, 2900), 0, True, 2048),       # fp8 pairs, 2 KV heads, S_tkg 2
    (LLAMA31_8B_TP8, 1, 4096 + 128, (5, 900, 1000, 300, 17, 640), 0, False, 2048),   # core 1: all masked
])
def test_lnc2_stride_split(shape, S, ctx, first, bs, fp8, min_scan, monkeypatch):
    """LNC=2 batch split at scans >= STRIDE_MIN_SCAN (lowered here for the shorter cases): each core scans
    alternating slots of every sequence and the partial (m, l, own acc block) are merged. Ragged lengths, NaN past
    every length (fp8: NaN bytes): finite, equal to the reference and to LNC=1 (merged states: fp32 order differs),
    bit-identical to a clean cache; the cache is written once, correctly."""
    from nki_kernels.attention.decode import config

    if min_scan is not None:
        monkeypatch.setattr(config, "STRIDE_MIN_SCAN", min_scan)
    B = len(first)
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=71, **shape)
    args[4][:] = torch.tensor(first, dtype=torch.int32)[:, None] + torch.arange(S, dtype=torch.int32)
    cfg = config._Config(B, S, shape["H"], shape["d"], shape["nkv"], shape["nq"], ctx, ctx, 1.0, shape["H"], 0, 2,
                         bs, ctx // bs if bs else 0, fp8, n_prog=2, core=1)
    assert cfg.stride, "the launch must take the runtime-balanced split"
    if fp8:
        nkv, f8 = shape["nkv"], torch.float8_e4m3fn
        ks, vs = torch.tensor([1 / 64, 1 / 48][:nkv]), torch.tensor([1 / 80, 1 / 40][:nkv])
        args = args[:2] + tuple((c.float() / sc[None, :, None, None]).to(f8) for c, sc in zip(args[2:4], (ks, vs))) \
            + args[4:]
        kw = dict(kw, k_scale=ks, v_scale=vs)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_past(args, first, fp8)
    if bs:
        args, kw_p = to_paged(args, kw, bs, seed=71)
        clean, _ = to_paged(clean, kw, bs, seed=71)
        kw = kw_p
    ref_args = [a.clone() if a is not None else None for a in args]
    ref = decode_attention_torch(*ref_args, **kw).float()
    assert torch.isfinite(ref).all()
    out = decode_attention(*args, **kw, backend="nkisim", lnc=2)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    written = _written_rows(args, kw, B)
    for got, want in ((args[2], ref_args[2]), (args[3], ref_args[3])):     # written once (core 0), rest untouched
        sel = written[:, None, :, None].expand_as(got)
        bits = torch.uint8 if got.element_size() == 1 else torch.int16
        assert torch.equal(got.view(bits)[~sel], want.view(bits)[~sel])
        assert torch.allclose(got[sel].float(), want[sel].float(), rtol=7e-2, atol=2e-2)
    assert _same_bits(out, decode_attention(*[a.clone() if a is not None else None for a in clean], **kw,
                                            backend="nkisim", lnc=2))
    _assert_close_to_lnc1(out, decode_attention(*clean, **kw, backend="nkisim", lnc=1))


# ---- fp8 (e4m3) KV cache: per-tensor or per-head scales, dequantised on load ------------------------------------

@pytest.mark.parametrize("shape,B,S,ctx,per_head,lnc,ragged", [
    (GPT_OSS_20B_TP8, 4, 1, 1024, False, 1, False),     # per-tensor scales, stacked K^T (d = 64)
    (LLAMA31_8B_TP8, 3, 2, 512, True, 1, False),        # per-head scales, d = 128, S_tkg 2
    (MULTI_KV, 2, 1, 2048, True, 2, True),              # 2 KV heads with their own scales, LNC=2, NaN tails
    (LLAMA31_8B_TP8, 1, 1, 1000, True, 1, True),        # position-major steps, S_max not a multiple of 128
])
def test_fp8_kv_cache(shape, B, S, ctx, per_head, lnc, ragged):
    args, kw = make_inputs(B, S, s_max=ctx, ctx=ctx, seed=41, **shape)
    nkv = shape["nkv"]
    ks = torch.tensor([1 / 64, 1 / 48][:nkv] if per_head else [1 / 64], dtype=torch.float32)
    vs = torch.tensor([1 / 80, 1 / 40][:nkv] if per_head else [1 / 80], dtype=torch.float32)
    f8 = torch.float8_e4m3fn
    K8 = (args[2].float() / ks.expand(nkv)[None, :, None, None]).to(f8)
    V8 = (args[3].float() / vs.expand(nkv)[None, :, None, None]).to(f8)
    if ragged:    # stale rows past each sequence's length: NaN bytes (0x7F in e4m3fn)
        for b in range(B):
            p0 = int(args[4][b, 0])
            for c in (K8, V8):
                c.view(torch.uint8)[b, :, p0:] = 0x7F
    args = args[:2] + (K8, V8) + args[4:]
    kw = dict(kw, k_scale=ks, v_scale=vs)
    ref_args = [a.clone() if a is not None else None for a in args]
    ref = decode_attention_torch(*ref_args, **kw).float()
    assert torch.isfinite(ref).all()
    out = decode_attention(*args, **kw, backend="nkisim", lnc=lnc).float()
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err <= ATOL + RTOL * ref.abs().max().item(), err
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item() >= MIN_COS
    written = _written_rows(args, kw, B)
    for got, want in ((args[2], ref_args[2]), (args[3], ref_args[3])):      # quantised new rows, rest untouched
        sel = written[:, None, :, None].expand_as(got)
        assert torch.equal(got.view(torch.uint8)[~sel], want.view(torch.uint8)[~sel])
        diff = (got[sel].float() - want[sel].float()).abs()
        assert (diff <= 0.07 * want[sel].float().abs() + 1e-3).float().mean() >= 0.99   # one fp8 step at most


@pytest.mark.parametrize("shape,B,ctx,block_size,window", [
    (GPT_OSS_20B_TP8, 3, 2048, 32, 0),     # gathered rows of whole blocks
    (LLAMA31_8B_TP8, 2, 1024, 256, 0),     # blocks larger than 16 gathered rows: sub-blocks
    (GPT_OSS_20B_TP8, 2, 1024, 32, 128),   # sliding window: windowed gathers
    (GPT_OSS_20B_TP8, 2, 1024, 0, 128),    # contiguous, sliding window: register-addressed pair transposes
])
def test_fp8_paged_kv_cache(shape, B, ctx, block_size, window):
    """Paged fp8 cache: K gathered as 2-byte pairs (the indirect transpose takes 2-byte data only), V cast by its
    gathers; NaN bytes past each sequence stay out of every output row. Also the windowed scans' fp8 loads."""
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, seed=43, **shape)
    kw = dict(kw, sliding_window=window)
    ks, vs = torch.tensor([1 / 64]), torch.tensor([1 / 80])
    f8 = torch.float8_e4m3fn
    K8, V8 = (args[2].float() / ks).to(f8), (args[3].float() / vs).to(f8)
    for b in range(B):
        for c in (K8, V8):
            c.view(torch.uint8)[b, :, int(args[4][b, 0]):] = 0x7F
    args, kw = args[:2] + (K8, V8) + args[4:], dict(kw, k_scale=ks, v_scale=vs)
    if block_size:
        args, kw = to_paged(args, kw, block_size, seed=5)
    ref = decode_attention_torch(*[a.clone() if a is not None else None for a in args], **kw).float()
    out = decode_attention(*args, **kw, backend="nkisim").float()
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item() >= MIN_COS


@pytest.mark.parametrize("block_size", [0, 32])
def test_fp8_cache_in_the_matmul_on_trn3(block_size):
    """trn3's TensorE takes float8_e4m3fn: the score matmuls read the K pairs' fp8 bytes directly (no cast, no bf16
    K^T stacks); same results as the reference, NaN bytes past each sequence excluded."""
    import nkisim
    args, kw = make_inputs(3, 1, s_max=1024, ctx=1024, seed=44, **GPT_OSS_20B_TP8)
    ks, vs = torch.tensor([1 / 64]), torch.tensor([1 / 80])
    f8 = torch.float8_e4m3fn
    K8, V8 = (args[2].float() / ks).to(f8), (args[3].float() / vs).to(f8)
    for b in range(3):
        for c in (K8, V8):
            c.view(torch.uint8)[b, :, int(args[4][b, 0]):] = 0x7F
    args, kw = args[:2] + (K8, V8) + args[4:], dict(kw, k_scale=ks, v_scale=vs)
    if block_size:
        args, kw = to_paged(args, kw, block_size, seed=6)
    ref = decode_attention_torch(*[a.clone() if a is not None else None for a in args], **kw).float()
    out, rep = nkisim.profile(decode_attention_nki, *args, target="trn3", **kw)
    out = torch.as_tensor(out).float()
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= ATOL + RTOL * ref.abs().max().item()
    fp8_mm = [e for e in rep.events if e.engine == "tensor" and "float8" in str(e.meta.get("dtype", "")) +
              str(e.meta.get("stationary_dtype", ""))]
    assert fp8_mm, "no matmul read the fp8 cache bytes"


def test_fp8_cache_halves_the_kv_bytes():
    """The modelled HBM traffic of the cache scan halves with an fp8 cache (1 byte per element instead of 2)."""
    import nkisim
    args, kw = make_inputs(4, 1, s_max=4096, ctx=4096, seed=42, **GPT_OSS_20B_TP8)
    args[4][:, 0] = 4095
    reads = {}
    _, rep = nkisim.profile(decode_attention_nki, *args, target="trn2", **kw)
    reads["bf16"] = rep.hbm_read_bytes
    a8, kw8 = _fp8_cache(args, kw)
    _, rep8 = nkisim.profile(decode_attention_nki, *a8, target="trn2", **kw8)
    kv_bf16 = 4 * 4095 * 2 * 64 * 2
    assert reads["bf16"] - rep8.hbm_read_bytes == pytest.approx(kv_bf16 / 2, rel=0.02)


@pytest.mark.parametrize("shape,B,ctx", [(MULTI_KV, 6, 4096), (GPT_OSS_20B_TP8, 20, 8192)])
def test_ragged_skipped_loads_reuse_the_ring(shape, B, ctx):
    """More slots than ring buffers (2 KV heads, or several packs and slots): a lane whose load is skipped reads
    what an earlier slot left in the ring; with NaN past every sequence it stays finite and bit-identical to a clean
    cache."""
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, seed=51, **shape)
    args[4][:, 0] = torch.tensor([(ctx - 1) if b % 3 == 0 else (37 * b + 5) % (ctx // 3) for b in range(B)],
                                 dtype=torch.int32)
    clean = [a.clone() if a is not None else None for a in args]
    _poison_stale_rows(args, 0)
    _assert_nan_tails_clean(args, clean, kw)
