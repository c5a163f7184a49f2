"""Modelled latency of the blockwise CTE (prefill) MoE kernel, side by side with nki-library's `moe_cte` (nkisim cost
model; MODELLED, not measured).

Shapes: the GPT-OSS-20B TP=8 rank (H 3072 = 2880 padded, E 32, k 4, I 360) and the GPT-OSS-120B TP=16 rank (E 128,
I 180), random top-4 routing, biases, clamped SwiGLU; T (tokens of the prefill) 512 / 2048 / 4096 (120B: 2048 /
8192, and 16384 on trn3 only);
trn2 and trn3. Ours at LNC 1 and 2; the library's `moe_cte` (the shard_on_block implementation vllm-neuron runs for
GPT-OSS, LNC=2 only: it shards blocks over the two cores) at LNC 2 in PEER_CELLS, on the same routing, the same
blockwise mapping (block size 256, vllm-neuron's) and the same cost model (bench/peers/moe_cte.py); skipped with the
reason when NKILIB_SRC is unset. Our kernel reads routing data into registers (the schedule), so every profile
computes the numerics (no trace-only mode).

Figures per case (benchmark.extra_info, console): modelled latency, `modelled_mfu` = useful FLOPs (2·T·k·3·H·I) /
(latency × TensorE bf16 peak of the LNC's cores) — the "% of TensorE peak"; the roofline bound of what was issued;
`modelled_useful_memory_bound_s` = the bytes the work cannot avoid (every expert's weights once, each routed row's
x read and its output row written once) at the HBM rate, the floor no kernel beats; for the library rows
`modelled_speedup_vs_peer` = library latency / ours at LNC 2 (> 1: ours faster).
MXFP4 rows (`ours-mxfp4`, trn3 LNC 1/2 at 20B T 2048, LNC 1 at 120B T 2048): the same routing with MXFP4 experts
(nc_matmul_mx, activations quantised to MXFP8 on chip); `modelled_speedup_vs_bf16` and `modelled_hbm_bytes_vs_bf16`
against the bf16 row of the same cell. Their MFU is against the MX peak (4x bf16 on trn3).
Issue 13's targets, recorded per case (`modelled_meets_target`) and asserted where this kernel meets them (see
ASSERTED below; the others are reported, not asserted): >= 70% of TensorE peak at T >= 2048, and faster than moe_cte.
"""

import functools

import pytest

import nkisim
from bench.peers import nkilib
from modules.model_specs import GPT_OSS_20B, GPT_OSS_120B
from nki_kernels.moe import blockwise_mapping
from nki_kernels.moe.cte_inputs import make_cte_inputs, make_cte_mx_weights
from nki_kernels.moe.gate_up_layout import tile_gate_up
from nki_kernels.moe.moe_cte import kernel_inputs, moe_cte_nki
from nki_kernels.moe.tkg_inputs import tkg_shard

pytestmark = pytest.mark.skipif(not nkisim.active(), reason="real nki present: the CTE figures are modelled")

SHARDS = {"gpt-oss-20b-tp8": tkg_shard(GPT_OSS_20B, 8), "gpt-oss-120b-tp16": tkg_shard(GPT_OSS_120B, 16)}
TOKENS = {"gpt-oss-20b-tp8": (512, 2048, 4096), "gpt-oss-120b-tp16": (2048, 8192, 16384)}
# cells left out to keep the bench short (modelled figures in DESIGN.md): 120B T 4096 (between its T 2048 and 8192
# rows), T 16384 on trn2 (DMA bound, 49% / 46%; ~35 s each to model)
SKIPPED_CELLS = {("gpt-oss-120b-tp16", 16384, "trn2")}
# the library's rows (its interpretation is the slow part of this file): its own target trn2 at T 512 / 2048 and
# the 120B shape, trn3 at T 2048
PEER_CELLS = {("gpt-oss-20b-tp8", 512, "trn2"), ("gpt-oss-20b-tp8", 2048, "trn2"), ("gpt-oss-20b-tp8", 2048, "trn3"),
              ("gpt-oss-120b-tp16", 2048, "trn2")}
BLOCK = 256            # vllm-neuron's GPT-OSS prefill block size, for both kernels
MFU_TARGET = 0.70      # issue 13: CTE >= 70% of TensorE peak at T >= 2048
# (model, T, target, lnc) cells where our kernel meets the MFU target: asserted there, reported elsewhere (modelled:
# 20B T 2048 trn2 56% / 53% (LNC 1 / 2: DMA bound, see DESIGN.md), trn3 74% / 71%; T 4096 76-84%; 120B T 2048
# <= 24%, memory bound by its weights, T 4096 / 8192 / 16384 trn2 <= 26 / 38 / 49%, trn3 <= 38 / 55 / 72.3% (LNC 1,
# met, asserted) and 70.15% (LNC 2: met since the last down tile by core, asserted: 1961.8 us, the target needs
# <= 1966); the bound per T is in DESIGN.md). LNC 2 cells met since the down projection is split by H halves.
ASSERTED_MFU = {("gpt-oss-20b-tp8", 2048, "trn3", 1), ("gpt-oss-20b-tp8", 2048, "trn3", 2),
                ("gpt-oss-20b-tp8", 4096, "trn2", 1), ("gpt-oss-20b-tp8", 4096, "trn2", 2),
                ("gpt-oss-20b-tp8", 4096, "trn3", 1), ("gpt-oss-20b-tp8", 4096, "trn3", 2),
                ("gpt-oss-120b-tp16", 16384, "trn3", 1), ("gpt-oss-120b-tp16", 16384, "trn3", 2)}
_RESULTS = {}


@functools.lru_cache(maxsize=1)
def _inputs(model, T):
    s = SHARDS[model]
    return make_cte_inputs(T, s["H"], s["E"], s["top_k"], s["inter"], hidden_actual=s["hidden_actual"])


def _useful_flops(model, T):
    s = SHARDS[model]
    return 2 * T * s["top_k"] * 3 * s["H"] * s["inter"]


def _useful_memory_bound_s(model, T, target, lnc):
    """Bytes no implementation avoids (weights once, x rows read and output rows written once per routed row) at
    the HBM rate of the LNC's cores."""
    from nkisim.hardware import hardware
    s = SHARDS[model]
    weights = s["E"] * 3 * s["H"] * s["inter"] * 2
    rows = T * s["top_k"] * s["H"] * 2 * 2
    return (weights + rows) / (lnc * hardware(target).core.hbm_bytes_per_s)


def _run(model, T, target, lnc, impl):
    x, idx, aff, w_gu, w_d, b_gu, b_d = _inputs(model, T)
    flops = _useful_flops(model, T)
    if impl in ("ours", "ours-mxfp4"):
        import torch
        _, rows, sched = kernel_inputs(idx, aff, w_gu.shape[0], BLOCK, lnc)
        arrays = [torch.from_numpy(a) for a in (rows, sched)]
        kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
        mx = {}
        if impl == "ours-mxfp4":      # the same MoE with MXFP4 experts (random codes / scales, mx_weights.py)
            s = SHARDS[model]
            _, _, mx = make_cte_mx_weights(s["E"], s["H"], s["inter"])
            w_gu, w_d = mx.pop("w_gate_up"), mx.pop("w_down")
        if not mx:     # bf16 experts in the tiled gate/up layout MoELayer holds (gate_up_layout.py)
            w_gu = tile_gate_up(w_gu)
        rep = nkisim.profile(kernel, x, w_gu, w_d, *arrays, b_gate_up=b_gu, b_down=b_d, target=target,
                             useful_flops=flops, routed_rows=idx.numel(), **mx).report
    else:
        import nki
        nkilib.activate()
        from bench.peers.moe_cte import inputs, launch
        kw = inputs(x, idx, aff, w_gu, w_d, b_gu, b_d, blockwise_mapping(idx, w_gu.shape[0], BLOCK), n_cores=lnc)
        rep = nkisim.profile(nki.jit(launch)[lnc], target=target, useful_flops=flops, **kw).report
    _RESULTS[model, T, target, lnc, impl] = rep
    return rep


# MXFP4 experts (trn3 only: nc_matmul_mx), beside the bf16 rows of the same cells
MX_CELLS = [("gpt-oss-20b-tp8", 2048, "trn3", 1), ("gpt-oss-20b-tp8", 2048, "trn3", 2),
            ("gpt-oss-120b-tp16", 2048, "trn3", 1)]
CASES = [(m, T, tgt, lnc, impl) for m in sorted(SHARDS) for T in TOKENS[m] for tgt in ("trn2", "trn3")
         for lnc, impl in ((1, "ours"), (2, "ours"), (2, "nkilib"))
         if (m, T, tgt) not in SKIPPED_CELLS and (impl == "ours" or (m, T, tgt) in PEER_CELLS)] + \
    [cell + ("ours-mxfp4",) for cell in MX_CELLS]


@pytest.mark.parametrize("model,T,target,lnc,impl", CASES)
def test_moe_cte_modelled(benchmark, model, T, target, lnc, impl):
    if impl == "nkilib" and nkilib.skip_reason() is not None:
        pytest.skip(nkilib.skip_reason())
    rep = benchmark.pedantic(_run, args=(model, T, target, lnc, impl), rounds=1, iterations=1)
    info = rep.extra_info()
    info.update({"kernel": f"moe cte ({impl})", "bucket": f"{model}, T={T}, lnc={lnc}, {impl}", "model": model,
                 "tokens": T, "lnc": lnc, "impl": impl, "block_size": BLOCK, "modelled_bound_s": rep.roofline_s,
                 "modelled_useful_memory_bound_s": _useful_memory_bound_s(model, T, target, lnc)})
    if impl == "ours" and T >= 2048:
        info["modelled_meets_target"] = rep.mfu >= MFU_TARGET
    bf16 = _RESULTS.get((model, T, target, lnc, "ours"))
    if impl == "ours-mxfp4" and bf16 is not None:    # MXFP4 / bf16 weights: modelled latency and HBM bytes
        info["modelled_speedup_vs_bf16"] = bf16.latency_s / rep.latency_s
        info["modelled_hbm_bytes_vs_bf16"] = rep.hbm_bytes / bf16.hbm_bytes
    ours = _RESULTS.get((model, T, target, 2, "ours"))
    if impl == "nkilib" and ours is not None:
        info["modelled_speedup_vs_peer"] = rep.latency_s / ours.latency_s
        info["modelled_meets_target"] = ours.latency_s < rep.latency_s
    benchmark.extra_info.update(info)
    # (no latency >= roofline check: the model times a dma_compute read-modify-write as its write alone while its
    # roofline counts the HBM read too, so a scatter-add-heavy kernel can sit below that roofline)
    assert rep.flops <= rep.flops_issued               # the useful work is part of what TensorE executed
    if impl == "nkilib" and ours is not None:
        assert ours.latency_s < rep.latency_s, "ours must be faster than nki-library's moe_cte (issue 13)"
    if impl == "ours" and (model, T, target, lnc) in ASSERTED_MFU:
        assert rep.mfu >= MFU_TARGET
