"""Modelled latency of the MoE TKG kernel (fused RMSNorm + router + experts) vs the bound set by the bytes of the
experts it actually had to read, and side by side with nki-library's `moe_tkg` (nkisim cost model; NOT measured).

Shape: the GPT-OSS-20B TP=8 rank (H 2880 padded to 3072, E 32, k 4, I 360; modules/model_specs via
nki_kernels/moe/tkg_inputs.py), random routing, T = 1, 4, 8, 32, 128, trn2 and trn3; expert mode "auto" (the
cost rule of nki_kernels/moe/tkg_cost.py). Our bf16 rows pass w_gate_up in the tiled layout [E, 128, H/128, 2I] that
MoELayer holds (gate_up_layout.py; the kernel's modelled latency is the same as with [E, H, 2, I] or lower).
bound = (distinct experts in the routing) x (one expert's weight bytes) / (the cores' memory roof,
hw.core.memory_bytes_per_s x LNC): reading the touched experts once is the least any kernel must do.
Target (issue 13): modelled latency <= 1.3 x bound at every T; asserted where met: LNC=1 on both targets, GPT-OSS-120B
TP=16 (trn2 LNC=1; trn3 LNC=1 and LNC=2 on both targets except `NOT_MET_120B`), LNC=2 except the cells of
`LNC2_NOT_MET` (reported through `modelled_meets_target`): at T = 1 the routing prologue (two DMA start latencies and
the cross-core logits exchange) and the store do not shrink with the bound.
Side by side (needs NKILIB_SRC, else skipped with that reason): the library's `moe_tkg` at LNC=2 (as its tests run
it) on the same weights, the same normalised hidden states and the same routing (bench/peers/moe_tkg.py; its mode by
NxD's rule: all-expert iff T·k/E >= 1), against ours at LNC=2. The library's figure excludes the RMSNorm and router
that ours includes. `modelled_speedup_vs_peer` = library / ours; issue 13 asks > 1 at every T >= 4 (asserted).
"""

import functools

import pytest
import torch

import nkisim
from bench.peers import nkilib
from modules.model_specs import GPT_OSS_20B, GPT_OSS_120B
from nki_kernels.moe import rmsnorm_torch, router_torch
from nki_kernels.moe.gate_up_layout import tile_gate_up
from nki_kernels.moe.moe_tkg import moe_tkg_nki
from nki_kernels.moe.tkg_cost import choose_expert_mode, expert_bytes
from nki_kernels.moe.tkg_inputs import make_tkg_inputs, tkg_shard
from nkisim.hardware import hardware

pytestmark = pytest.mark.skipif(not nkisim.active(), reason="real nki present: the figures here are modelled")

SHAPE = tkg_shard(GPT_OSS_20B, 8)
SHAPE_120B = tkg_shard(GPT_OSS_120B, 16)
TOKENS = (1, 4, 8, 32, 128)
TARGET_RATIO = 1.3
# (T, target) of the LNC=2 rows not asserted against the target (modelled, GPT-OSS-20B TP8): none since T = 1 trn3
# went from 1.2988 (under 1.3 by 0.1 %, less than the 0.5 % margin an asserted cell keeps) to 1.2919 (the activation
# swaps as rows on one DMA engine, the two-block H-split tail, the swapped logits added in PSUM; DESIGN.md)
LNC2_NOT_MET = set()
_OURS = {}


def _inputs(T, shape=SHAPE):
    args, kw = make_tkg_inputs(T=T, **shape)
    return args, kw


def touched_bound_s(expert_index, target, lnc, shape=SHAPE):
    """Seconds to read the distinct experts of the routing once at the memory roof of `lnc` cores."""
    n = len(set(torch.as_tensor(expert_index).flatten().tolist()))
    return n, n * expert_bytes(shape["H"], shape["inter"]) / (hardware(target).core.memory_bytes_per_s * lnc)


def ours(T, target, lnc=1, shape=SHAPE):
    args, kw = _inputs(T, shape)
    # bf16 experts' gate/up in the tiled layout MoELayer holds (gate_up_layout.py; the kernel reads [E, H, 2, I] too)
    args = (args[0], args[1], tile_gate_up(args[2]), args[3])
    mode = choose_expert_mode(T, shape["E"], shape["top_k"], shape["H"], shape["inter"], target)
    kin = dict(kw, b_router=kw["b_router"].reshape(1, -1), gamma=kw["gamma"].reshape(1, -1),
               hidden_actual=kw["hidden_actual"] or 0, expert_mode=mode)
    out, rep = nkisim.profile(moe_tkg_nki if lnc == 1 else moe_tkg_nki[lnc], *args, target=target, **kin)
    rep.touched, rep.touched_bound_s = touched_bound_s(out[1], target, lnc, shape)
    rep.expert_mode = mode
    if shape is SHAPE:
        _OURS[T, target, lnc] = rep
    return rep


def _record(benchmark, rep, T, target, lnc, impl="ours", model="gpt-oss-20b-tp8"):
    info = rep.extra_info()
    ratio = rep.latency_s / rep.touched_bound_s
    info.update({"kernel": f"moe_tkg ({impl})", "model": model, "tokens": T, "lnc": lnc,
                 "impl": impl, "modelled_expert_mode": rep.expert_mode, "modelled_touched_experts": rep.touched,
                 "modelled_bound_s": rep.touched_bound_s, "modelled_latency_over_bound": ratio,
                 "modelled_target_ratio": TARGET_RATIO if impl == "ours" else None,
                 "modelled_meets_target": ratio <= TARGET_RATIO, "modelled_roofline_s": rep.roofline_s,
                 "modelled_critical_path_s": rep.critical_path_s})
    benchmark.extra_info.update(info)
    return ratio


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("T", TOKENS)
def test_moe_tkg_modelled(benchmark, T, target):
    rep = benchmark.pedantic(ours, args=(T, target), rounds=1, iterations=1)
    ratio = _record(benchmark, rep, T, target, 1)
    assert rep.latency_s >= rep.roofline_s * 0.999
    assert ratio <= TARGET_RATIO, f"T={T} {target}: {ratio:.3f} x the touched-expert bound"


@pytest.mark.parametrize("T", TOKENS)
def test_moe_tkg_gpt_oss_120b_modelled(benchmark, T):
    """GPT-OSS-120B TP=16 rank (E 128, I 180) on trn2, LNC=1: <= 1.3 x the touched-expert bound at every T (T = 1
    is the tightest, ~1.30: the 786 KB router weight load is on the routing's critical path)."""
    rep = benchmark.pedantic(ours, args=(T, "trn2"), kwargs=dict(shape=SHAPE_120B), rounds=1, iterations=1)
    ratio = _record(benchmark, rep, T, "trn2", 1, model="gpt-oss-120b-tp16")
    assert rep.latency_s >= rep.roofline_s * 0.999
    assert ratio <= TARGET_RATIO, f"120B T={T}: {ratio:.3f} x the touched-expert bound"


# GPT-OSS-120B TP=16 on trn3 (LNC 1) and at LNC 2 (trn2, trn3): reported, the 1.3x target asserted where met (trn3 LNC 1
# T = 1 since the down rows are spread over the 16 DMA engines: 1.295x). Not met (modelled, after the T = 1 LNC 2 H
# split of the down projection, the selective-mode pipelining and the T = 1 kt-block tail): LNC 2 T = 1, where the
# fixed chain (x load, 786 KB W_r, logits exchange, first weight DMA latency, store: ~7 us) meets a bound of 18.3 us
# (trn2: 1.49x) / 12.6 us (trn3: 1.63x); see DESIGN.md.
NOT_MET_120B = {(1, "trn2", 2), (1, "trn3", 2)}
CELLS_120B = [(T, target, lnc) for target, lnc in (("trn3", 1), ("trn2", 2), ("trn3", 2)) for T in TOKENS]


@pytest.mark.parametrize("T,target,lnc", CELLS_120B, ids=[f"{T}-{tg}-lnc{c}" for T, tg, c in CELLS_120B])
def test_moe_tkg_gpt_oss_120b_cells_modelled(benchmark, T, target, lnc):
    rep = benchmark.pedantic(ours, args=(T, target, lnc, SHAPE_120B), rounds=1, iterations=1)
    ratio = _record(benchmark, rep, T, target, lnc, model="gpt-oss-120b-tp16")
    assert rep.latency_s >= rep.roofline_s * 0.999
    if (T, target, lnc) not in NOT_MET_120B:
        assert ratio <= TARGET_RATIO, f"120B T={T} {target} LNC={lnc}: {ratio:.3f} x the touched-expert bound"


# ---- MXFP4 experts (trn3 nc_matmul_mx, LNC=1) -----------------------------------------------------------------
# Rows `ours-mxfp4`: the same inputs and routing with MXFP4 experts (random codes / scales, mx_weights.py's layout;
# tokens and activations quantised to MXFP8 on chip). Their touched-expert bound is computed on the MXFP4 bytes
# (expert_bytes(mx=True): 4-bit codes + one scale byte per 32 elements), not on the bf16 ones; the speed-up and the
# HBM bytes are against the bf16 row of the same cell (ours, trn3, same LNC). Not asserted against the 1.3x target
# (the MX stream is DMA-engine imbalanced, see DESIGN.md); asserted: faster than bf16 by > 1.5x and fewer HBM bytes.
MX_CELLS = [(SHAPE, "gpt-oss-20b-tp8", T, lnc) for lnc in (1, 2) for T in (1, 4, 8, 32)] + \
    [(SHAPE_120B, "gpt-oss-120b-tp16", 1, 1)]


@functools.lru_cache(maxsize=2)
def _mx_weights(E, H, inter):
    """Random MXFP4 experts of a shape, made once per bench run (~3 s at 20B TP8)."""
    from nki_kernels.moe.cte_inputs import make_cte_mx_weights
    return make_cte_mx_weights(E, H, inter)[2]


def ours_mx(T, shape=SHAPE, target="trn3", lnc=1):
    args, kw = _inputs(T, shape)
    mode = choose_expert_mode(T, shape["E"], shape["top_k"], shape["H"], shape["inter"], target, mx=True)
    mx = _mx_weights(shape["E"], shape["H"], shape["inter"])
    kin = dict(kw, b_router=kw["b_router"].reshape(1, -1), gamma=kw["gamma"].reshape(1, -1),
               hidden_actual=kw["hidden_actual"] or 0, expert_mode=mode, w_gate_up_scale=mx["w_gate_up_scale"],
               w_down_scale=mx["w_down_scale"])
    kernel = moe_tkg_nki if lnc == 1 else moe_tkg_nki[lnc]
    out, rep = nkisim.profile(kernel, args[0], args[1], mx["w_gate_up"], mx["w_down"], target=target, **kin)
    n = len(set(torch.as_tensor(out[1]).flatten().tolist()))
    rep.touched = n
    roof = hardware(target).core.memory_bytes_per_s * lnc
    rep.touched_bound_s = n * expert_bytes(shape["H"], shape["inter"], mx=True) / roof
    rep.expert_mode = mode
    return rep


@pytest.mark.parametrize("shape,model,T,lnc", MX_CELLS, ids=[f"{m}-T{T}-lnc{c}" for _, m, T, c in MX_CELLS])
def test_moe_tkg_mxfp4_modelled(benchmark, shape, model, T, lnc):
    rep = benchmark.pedantic(ours_mx, args=(T, shape, "trn3", lnc), rounds=1, iterations=1)
    _record(benchmark, rep, T, "trn3", lnc, impl="ours-mxfp4", model=model)
    bf16 = _OURS.get((T, "trn3", lnc)) if shape is SHAPE else None
    if bf16 is None:
        bf16 = ours(T, "trn3", lnc, shape)
    speedup = bf16.latency_s / rep.latency_s
    benchmark.extra_info.update({"modelled_target_ratio": None, "modelled_meets_target": None,
                                 "modelled_speedup_vs_bf16": speedup,
                                 "modelled_hbm_bytes_vs_bf16": rep.hbm_read_bytes / bf16.hbm_read_bytes,
                                 "modelled_bound_basis": "MXFP4 bytes of the touched experts"})
    assert rep.latency_s >= rep.roofline_s * 0.999
    assert speedup > 1.5 and rep.hbm_read_bytes < 0.4 * bf16.hbm_read_bytes, (speedup, rep.hbm_read_bytes)



# ---- MXFP4 decode above the MX TKG kernel's 64 tokens: the layer's route (modules/moe/layer.py decode_route) ------
# Rows `mxfp4-decode-route`: T tokens with MXFP4 experts (trn3) as MoELayer runs them when the cost rule
# (tkg_cost.choose_mx_decode_route) picks the CTE: host RMSNorm (not in the figure), the router kernel, ONE moe_cte
# call on its MX path (every routed expert read once). Their latency is router + CTE kernel bodies; `before` = the
# split route the layer took before (moe_tkg calls of <= 64 tokens on the same tokens and weights, each streaming its
# tokens' experts again), with the HBM bytes of both. Asserted: the rule picks the CTE here, and it is faster with
# fewer HBM bytes read. Launch overheads (two kernels either way at T <= 128) are not in these figures.
MX_ROUTE_CELLS = [(128, 1), (128, 2), (96, 1)]


def mx_decode_routes(T, lnc, shape=SHAPE, target="trn3"):
    """(after: {router, cte} reports, before: [TKG reports of the <= 64-token pieces])."""
    from nki_kernels.moe.moe_cte import kernel_inputs, moe_cte_nki
    from nki_kernels.moe.moe_tkg import OUTT_MAX_TOKENS
    from nki_kernels.moe.router import router_nki
    from nki_kernels.moe.tkg_cost import tkg_mx_pieces

    args, kw = _inputs(T, shape)
    x, w_r = args[0], args[1]
    mx = dict(_mx_weights(shape["E"], shape["H"], shape["inter"]))
    w_gu, w_d = mx.pop("w_gate_up"), mx.pop("w_down")
    before, t0 = [], 0
    for n in tkg_mx_pieces(T, OUTT_MAX_TOKENS):
        mode = choose_expert_mode(n, shape["E"], shape["top_k"], shape["H"], shape["inter"], target, mx=True)
        kin = dict(kw, b_router=kw["b_router"].reshape(1, -1), gamma=kw["gamma"].reshape(1, -1),
                   hidden_actual=kw["hidden_actual"] or 0, expert_mode=mode, **mx)
        kernel = moe_tkg_nki if lnc == 1 else moe_tkg_nki[lnc]
        before.append(nkisim.profile(kernel, x[t0:t0 + n], w_r, w_gu, w_d, target=target, **kin)[1])
        t0 += n
    h = rmsnorm_torch(x, kw["gamma"], 1e-5, kw["hidden_actual"]).to(x.dtype)     # the layer's host RMSNorm
    (_, idx, aff), rrep = nkisim.profile(router_nki, h, w_r, kw["b_router"].reshape(1, -1), target=target,
                                         top_k=shape["top_k"], mode="gpt_oss")
    idx, aff = torch.as_tensor(idx).long(), torch.as_tensor(aff).float()
    _, rows, sched = kernel_inputs(idx, aff, shape["E"], 256, lnc)
    kernel = moe_cte_nki if lnc == 1 else moe_cte_nki[lnc]
    crep = nkisim.profile(kernel, h, w_gu, w_d, *(torch.from_numpy(a) for a in (rows, sched)),
                          b_gate_up=kw["b_gate_up"], b_down=kw["b_down"], target=target, routed_rows=idx.numel(),
                          **mx).report
    return {"router": rrep, "cte": crep}, before


@pytest.mark.parametrize("T,lnc", MX_ROUTE_CELLS, ids=[f"T{T}-lnc{c}" for T, c in MX_ROUTE_CELLS])
def test_moe_mxfp4_decode_route_modelled(benchmark, T, lnc):
    from nki_kernels.moe.tkg_cost import choose_mx_decode_route, mx_decode_costs

    after, before = benchmark.pedantic(mx_decode_routes, args=(T, lnc), rounds=1, iterations=1)
    lat = after["router"].latency_s + after["cte"].latency_s
    lat_before = sum(r.latency_s for r in before)
    hbm = after["router"].hbm_read_bytes + after["cte"].hbm_read_bytes
    hbm_before = sum(r.hbm_read_bytes for r in before)
    rule = mx_decode_costs(T, SHAPE["E"], SHAPE["top_k"], SHAPE["H"], SHAPE["inter"], "trn3", lnc)
    benchmark.extra_info.update({
        "kernel": "moe mxfp4 decode route (router + moe_cte)", "model": "gpt-oss-20b-tp8", "tokens": T, "lnc": lnc,
        "impl": "mxfp4-decode-route", "target": "trn3", "modelled_latency_s": lat,
        "modelled_router_latency_s": after["router"].latency_s, "modelled_cte_latency_s": after["cte"].latency_s,
        "modelled_hbm_read_bytes": hbm, "modelled_before_latency_s": lat_before,
        "modelled_before_calls": len(before), "modelled_before_hbm_read_bytes": hbm_before,
        "modelled_speedup_vs_before": lat_before / lat, "modelled_hbm_read_vs_before": hbm / hbm_before,
        "modelled_rule_split_s": rule[0], "modelled_rule_cte_s": rule[1]})
    assert choose_mx_decode_route(T, SHAPE["E"], SHAPE["top_k"], SHAPE["H"], SHAPE["inter"], "trn3", lnc) == "cte"
    assert lat < lat_before and hbm < hbm_before, (lat, lat_before, hbm, hbm_before)

# ---- side by side with nki-library's moe_tkg (LNC=2) -----------------------------------------------------------

def library(T, target):
    from bench.peers import moe_tkg as peer
    args, kw = _inputs(T)
    x, wr, wgu, wd = args
    h = rmsnorm_torch(x, kw["gamma"], 1e-5, kw["hidden_actual"]).to(x.dtype)
    _, idx, aff = router_torch(h, wr, kw["b_router"], top_k=SHAPE["top_k"])
    mode = peer.nxd_mode(T, SHAPE["E"], SHAPE["top_k"])
    kin = peer.inputs(h, idx, aff, wgu, wd, kw["b_gate_up"], kw["b_down"], mode=mode)
    _, rep = nkisim.profile(peer.kernel()[2], target=target, **kin)
    rep.touched, rep.touched_bound_s = touched_bound_s(idx, target, 2)
    rep.expert_mode = mode
    return rep


@pytest.mark.skipif(nkilib.skip_reason() is not None, reason=str(nkilib.skip_reason()))
@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("impl", ["ours", "nkilib"])
def test_moe_tkg_vs_nkilib_modelled(benchmark, impl, T, target):
    fn = (lambda: ours(T, target, 2)) if impl == "ours" else (lambda: library(T, target))
    rep = benchmark.pedantic(fn, rounds=1, iterations=1)
    ratio = _record(benchmark, rep, T, target, 2, impl)
    if impl == "ours" and (T, target) not in LNC2_NOT_MET:
        assert ratio <= TARGET_RATIO, f"T={T} {target} LNC=2: {ratio:.3f} x the touched-expert bound"
    mine = _OURS.get((T, target, 2))
    if impl == "nkilib" and mine is not None:
        speedup = rep.latency_s / mine.latency_s
        benchmark.extra_info["modelled_speedup_vs_peer"] = speedup
        if T >= 4:
            assert speedup > 1.0, f"T={T} {target}: nki-library moe_tkg {rep.latency_s * 1e6:.1f} us vs ours " \
                                  f"{mine.latency_s * 1e6:.1f} us"
