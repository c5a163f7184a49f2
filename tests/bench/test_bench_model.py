"""Hand-checked cases for the analytical model: FLOPs, bytes, memory, collective counts, validation."""

import math

import pytest

from bench.model.analytical import (
    Bucket,
    InvalidConfig,
    ParallelConfig,
    evaluate,
    expected_experts_touched,
    legacy_decode_layer_collectives,
)
from bench.model.collectives import CollectiveParams, busbw_factor, choose_algorithm, collective_time
from bench.model.hardware import Instance, get_instance
from bench.model.kernel_table import KernelTable
from bench.model.sweep import cases, published_cases, run_case
from modules.model_specs import GPT_OSS_120B, LLAMA_31_8B, LLAMA_33_70B, QWEN3_VL_VIT, TextModelSpec

COLL = CollectiveParams(alpha_base_s=5e-6, alpha_hop_s=1.5e-6, mesh_max_bytes=1 << 20, rdh_max_bytes=56 << 20,
                        busbw_mesh=50e9, busbw_rdh=100e9, busbw_kangaring=100e9)
# A toy instance with round numbers: 2 chips x 8 cores, LNC=2 -> 4 ranks per chip, 8 ranks.
TOY_INST = Instance("toy", "trn2", chips=2, cores_per_chip=8, lnc=2, chip_bf16_flops=4e12, chip_hbm_bytes=4 * 2**30,
                    chip_hbm_bw=4e11, link_bw_per_chip=1e11, collectives=COLL, kernel_min_s=0.0)
TOY = TextModelSpec("toy", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, vocab=1000)


def decode(cfg, batch=2, ctx=10, model=TOY, inst=TOY_INST):
    return evaluate(model, inst, cfg, Bucket("decode", batch=batch, ctx=ctx))


# ---- parameter counts ------------------------------------------------------------------------------------------
def test_public_parameter_counts():
    assert LLAMA_31_8B.total_params() == 8_030_261_248          # the published 8.03B
    assert abs(LLAMA_33_70B.total_params() / 1e9 - 70.55) < 0.01
    assert abs(GPT_OSS_120B.total_params() / 1e9 - 116.8) < 0.1  # ~117B
    assert 0.5e9 < QWEN3_VL_VIT.total_params() < 0.7e9


# ---- memory ----------------------------------------------------------------------------------------------------
def test_toy_weights_and_kv_per_rank():
    r = decode(ParallelConfig(tp=2))
    # attention: Q/O 2*128*(2 heads*32) + K/V 2*128*(1*32) = 16384 + 8192; MLP 3*128*256/2 = 49152; norms 256
    per_layer = 16384 + 8192 + 49152 + 256
    params = 2 * per_layer + 2 * (1000 * 128 // 2) + 128
    assert r.mem_weights == 2 * params == 552_192
    # KV: K and V x 1 head x 32 x batch 2 x ctx 10 x 2 layers x 2 bytes
    assert r.mem_kv == 2 * 1 * 32 * 2 * 10 * 2 * 2 == 5120
    assert r.mem_capacity == 2**30                                # 4 GiB chip / 4 ranks
    assert r.fits


def test_component_dp_shards_weights_but_not_kv():
    base = decode(ParallelConfig(tp=2, dp=2))
    sharded = decode(ParallelConfig(tp=2, dp=2, attn_dp=2, emb_dp=2, mlp_dp=2, lm_dp=2))
    assert sharded.mem_kv == base.mem_kv                          # KV cache stays batch-sharded per DP rank
    # MLP and vocab weights halve; attention Q/O halve (K/V stay TP-sharded in Q-only mode: kv_heads <= tp)
    mlp, emb_lm, q_o = 49152, 2 * 64000, 16384
    assert base.mem_weights - sharded.mem_weights == 2 * (2 * (mlp // 2 + q_o // 2) + emb_lm // 2)


def test_gpt_oss_120b_tp8_does_not_fit_trn2_but_tp16_does():
    # published: "TP16 (TP8 does not fit)" for GPT-OSS-120B BF16 on trn2.48xlarge (parallel-and-perf-model.md §2.7)
    inst = get_instance("trn2.48xlarge")
    b = Bucket("decode", batch=1, ctx=768)
    assert not evaluate(GPT_OSS_120B, inst, ParallelConfig(8), b).fits
    assert evaluate(GPT_OSS_120B, inst, ParallelConfig(16), b).fits


# ---- FLOPs and bytes -----------------------------------------------------------------------------------------------
def test_toy_decode_flops():
    r = decode(ParallelConfig(tp=2))
    comp = {c.name: c for c in r.components}
    # per layer: Q/O 2*B*16384, K/V (own batch, Q-only mode) 2*B*8192, scores+PV 4*B*2 heads*32*ctx
    attn_layer = 2 * 2 * 16384 + 2 * 2 * 8192 + 4 * 2 * 2 * 32 * 10
    assert comp["attention"].flops == 2 * attn_layer
    assert comp["mlp"].flops == 2 * (2 * 2 * 49152)
    assert comp["lm_head"].flops == 2 * 2 * 64000
    assert comp["embedding"].flops == 0
    assert r.flops == 2 * attn_layer + 4 * 2 * 49152 + 4 * 64000 == 856_064


def test_toy_decode_bytes():
    r = decode(ParallelConfig(tp=2))
    comp = {c.name: c for c in r.components}
    attn_params = 16384 + 8192
    kv_read = 2 * 10 * 2 * 1 * 32 * 2        # B * ctx * (K,V) * kvh * hd * bf16
    kv_write = 2 * 2 * 1 * 32 * 2
    act = 2 * 2 * 2 * 128                    # in + out, B tokens, bf16
    assert comp["attention"].bytes == 2 * (2 * attn_params + kv_read + kv_write + act)
    assert comp["mlp"].bytes == 2 * (2 * 49152 + 2 * 2 * 2 * 128)
    assert r.hbm_bytes == sum(c.bytes for c in r.components)
    assert r.as_dict()["ai"] == pytest.approx(r.flops / r.hbm_bytes)


def test_moe_touches_only_routed_experts():
    assert expected_experts_touched(4, 1, 0) == 0
    assert expected_experts_touched(4, 1, 1) == pytest.approx(1.0)
    assert expected_experts_touched(128, 4, 1) == pytest.approx(4.0)
    assert expected_experts_touched(128, 4, 10_000) == pytest.approx(128.0)
    inst = get_instance("trn2.48xlarge")
    b1 = evaluate(GPT_OSS_120B, inst, ParallelConfig(16), Bucket("decode", batch=1, ctx=1024))
    b64 = evaluate(GPT_OSS_120B, inst, ParallelConfig(16), Bucket("decode", batch=64, ctx=1024))
    mlp1 = next(c for c in b1.components if c.name == "mlp")
    mlp64 = next(c for c in b64.components if c.name == "mlp")
    assert mlp64.bytes > 10 * mlp1.bytes          # batch 64 reads most of the 128 experts, batch 1 only 4


def test_three_roofs_and_bound():
    r = decode(ParallelConfig(tp=2))
    assert r.t_roof == max(r.t_compute, r.t_memory, r.t_collective)
    assert r.bound in ("compute", "memory", "collective")
    assert r.t_step >= r.t_roof * 0.999 or r.bound == "collective"
    assert r.tokens_per_s_per_chip == pytest.approx(2 * 1 / r.t_step / 0.5)   # 2 ranks = half a chip


# ---- collectives -----------------------------------------------------------------------------------------------
def test_collective_counts_tp_only():
    r = decode(ParallelConfig(tp=2))
    layer = r.layer_collectives()
    assert [(c.op, c.group, c.n) for c in layer] == [("all_reduce", "attn_tp", 2), ("all_reduce", "mlp_tp", 2)]
    assert all(c.bytes == 2 * 128 * 2 for c in layer)           # B * H * bf16
    # per step: 2 layers x 2 + embedding all-reduce + LM-head argmax all-gather (size-1 DP columns bypassed)
    assert r.as_dict()["n_collectives_per_step"] == 6


def test_collective_counts_all_dp_equal():
    r = decode(ParallelConfig(tp=2, dp=2, attn_dp=2, emb_dp=2, mlp_dp=2, lm_dp=2))
    ops = [(c.op, c.n) for c in r.layer_collectives()]
    # all dp sizes equal: no transitions; attention-DP head swap (2 all-to-all in the megakernel) + 2 all-reduces
    assert ops == [("all_to_all", 2), ("all_to_all", 2), ("all_reduce", 4), ("all_reduce", 4)]
    ar = [c for c in r.layer_collectives() if c.op == "all_reduce"]
    assert all(c.bytes == 2 * 2 * 128 * 2 for c in ar)          # gathered batch B*dp tokens


def test_collective_counts_mixed_dp_inserts_one_gather():
    r = decode(ParallelConfig(tp=2, dp=2, attn_dp=2, mlp_dp=1))
    ops = [(c.where, c.op) for c in r.layer_collectives()]
    assert ops[0] == ("layer.mlp->attn", "all_gather")            # going up: one all-gather
    assert ("layer.attn->mlp", "all_gather") not in ops           # going down: a free slice
    r2 = decode(ParallelConfig(tp=2, dp=2, attn_dp=1, mlp_dp=2))
    assert [c.where for c in r2.layer_collectives()].count("layer.attn->mlp") == 1


def test_seed_three_vs_seven():
    inst = get_instance("trn2.48xlarge")
    cfg = ParallelConfig(8, 4, 4, 4, 4, 4)
    old = legacy_decode_layer_collectives(LLAMA_31_8B, inst, cfg, batch=8)
    assert [c.op for c in old] == ["all_gather", "reduce_scatter", "all_reduce", "all_gather", "slice", "all_reduce"]
    new = evaluate(LLAMA_31_8B, inst, cfg, Bucket("decode", batch=8, ctx=1024)).layer_collectives()
    assert [c.op for c in new if c.op != "all_to_all"] == ["all_reduce", "all_reduce"]


def test_alpha_beta_and_bands():
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == 0.75
    assert busbw_factor("all_reduce", 1) == 0.0
    assert choose_algorithm(1000, COLL) == "Mesh"
    assert choose_algorithm(2 << 20, COLL) == "RDH"
    assert choose_algorithm(100 << 20, COLL) == "KangaRing"
    assert collective_time("all_reduce", 1, 1e6, COLL) == (0.0, "bypass")
    t, alg = collective_time("all_reduce", 4, 1000, COLL, spans_chips=False)
    assert alg == "Mesh" and t == pytest.approx(5e-6 + 2 * 1.5e-6 + 1.5 * 1000 / 50e9)
    t, alg = collective_time("all_reduce", 16, 4 << 20, COLL)          # RDH: 2*log2(16) steps
    assert alg == "RDH" and t == pytest.approx(5e-6 + 8 * 1.5e-6 + 1.875 * (4 << 20) / 100e9)
    t, alg = collective_time("all_gather", 16, 64 << 20, COLL)         # KangaRing: n/2 steps
    assert alg == "KangaRing" and t == pytest.approx(5e-6 + 8 * 1.5e-6 + 0.9375 * (64 << 20) / 100e9)


def test_dp_column_spans_chips():
    r = decode(ParallelConfig(tp=4, dp=2, mlp_dp=2), batch=1)
    gather = [c for c in r.layer_collectives() if c.op == "all_gather"][0]
    assert gather.group == "mlp_dp_col" and gather.spans_chips   # ranks 0 and 4: different chips (4 ranks/chip)
    r = decode(ParallelConfig(tp=2, dp=2, mlp_dp=2), batch=1)
    assert not [c for c in r.layer_collectives() if c.op == "all_gather"][0].spans_chips   # ranks 0 and 2


# ---- prefill and vision ------------------------------------------------------------------------------------------
def test_prefill_sequence_parallel_collectives():
    r = evaluate(TOY, TOY_INST, ParallelConfig(2), Bucket("prefill", prefill_len=8))
    layer = [c.op for c in r.layer_collectives()]
    assert layer == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    causal_pairs = 8 * 9 / 2
    attn = next(c for c in r.components if c.name == "attention")
    assert attn.flops == 2 * (2 * 8 * (16384 + 8192) + 4 * 2 * 32 * causal_pairs)


def test_vision_dp_replicates_weights_and_pads_blocks():
    inst = get_instance("trn2.48xlarge")
    full_dp = evaluate(QWEN3_VL_VIT, inst, ParallelConfig(1, 8), Bucket("vision", vision_blocks=5))
    one = evaluate(QWEN3_VL_VIT, inst, ParallelConfig(1, 1), Bucket("vision", vision_blocks=5))
    assert full_dp.mem_weights == one.mem_weights
    assert full_dp.mem_act < one.mem_act
    gather = [c for c in full_dp.collectives if c.op == "all_gather"][0]
    # 5 blocks padded to 8; 1024 patches / 4 merged, 4096 out, 4 mergers, bf16
    assert gather.bytes == 2 * 8 * 256 * 4096 * 4


# ---- validation --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, bucket, match", [
    (ParallelConfig(2, 2, attn_dp=3), Bucket("decode", batch=1, ctx=8), "attention_dp_size=3 must divide"),
    (ParallelConfig(4, 4), Bucket("decode", batch=1, ctx=8), "exceeds 8 ranks"),
    (ParallelConfig(3), Bucket("decode", batch=1, ctx=8), "does not divide num_attention_heads"),
    (ParallelConfig(4, 2, attn_dp=2), Bucket("decode", batch=1, ctx=8), "tp\\*attention_dp_size=8"),
    (ParallelConfig(2), Bucket("prefill", prefill_len=7), "divisible by tp=2"),
    (ParallelConfig(2, 2, mlp_dp=2), Bucket("prefill", prefill_len=8), "decode only"),
    (ParallelConfig(2), Bucket("vision", vision_blocks=1), "has no .vision. phase"),
])
def test_invalid_configs_raise_with_reason(cfg, bucket, match):
    with pytest.raises(InvalidConfig, match=match):
        evaluate(TOY, TOY_INST, cfg, bucket)


def test_invalid_vision_config():
    inst = get_instance("trn2.48xlarge")
    with pytest.raises(InvalidConfig, match="num_heads"):
        evaluate(QWEN3_VL_VIT, inst, ParallelConfig(32, 1), Bucket("vision", vision_blocks=4))


def test_sweep_cases_valid_or_reasoned():
    all_cases = cases() + published_cases()
    assert 500 <= len(all_cases) <= 5000
    assert len({c.id for c in all_cases}) == len(all_cases)
    sample = all_cases[:: max(1, len(all_cases) // 150)]
    for c in sample:
        try:
            row = run_case(c)
        except InvalidConfig as e:
            assert str(e)
            continue
        assert row["modelled"] is True and row["t_step_us"] > 0 and math.isfinite(row["tokens_per_s_per_chip"])


# ---- nkisim kernel latencies --------------------------------------------------------------------------------------
def test_kernel_table_interpolates_and_feeds_the_model():
    rows = [{"name": "test_decode_attention_modelled[x]", "params": {"target": "trn2"},
             "extra_info": {"modelled_latency_s": lat, "model": "llama-3.1-8b-tp8", "batch": b, "context": c,
                            "lnc": 1, "modelled_target": "trn2"}}
            for (b, c), lat in {(1, 1024): 10e-6, (1, 4096): 40e-6, (8, 1024): 20e-6, (8, 4096): 80e-6}.items()]
    table = KernelTable.from_benchmarks(rows)
    shape = dict(q_heads=4, kv_heads=1, head_dim=128, hidden=4096, target="trn2", lnc=1)
    assert table("attention", {**shape, "batch": 1, "ctx": 2048}) == pytest.approx(20e-6)
    assert table("attention", {**shape, "batch": 8, "ctx": 8192}) is None        # no extrapolation
    assert table("mlp", {**shape, "batch": 1, "ctx": 2048}) is None
    inst = get_instance("trn2.48xlarge")                                         # LNC=2: batch 2 -> 1 per core
    r = evaluate(LLAMA_31_8B, inst, ParallelConfig(8), Bucket("decode", batch=2, ctx=2048), table)
    attn = next(c for c in r.components if c.name == "attention")
    assert attn.source == "nkisim" and attn.t_kernel == pytest.approx(32 * 20e-6)
    assert r.as_dict()["kernel_sources"] == ["attention"]


def test_kernel_table_takes_only_the_contiguous_main_grid():
    """Variants at the same (batch, context) — ragged contexts, sliding window, paged KV, fp8 cache — and other
    benchmarks never replace the main grid's point (a ragged row's context is a label, not a number)."""
    x = {"modelled_latency_s": 1e-4, "model": "llama-3.1-8b-tp8", "batch": 8, "context": 4096, "lnc": 1,
         "modelled_target": "trn2"}
    table = KernelTable()
    assert table.add_benchmark("test_decode_attention_modelled[a]", {}, x)
    for name, extra in (("test_decode_attention_ragged_modelled[b]", {"context": "ragged 128-16K"}),
                        ("test_decode_attention_modelled[c]", {"context": "ragged 128-16K"}),
                        ("test_decode_attention_modelled[d]", {"modelled_sliding_window": 128}),
                        ("test_decode_attention_paged_modelled[e]", {"modelled_layout": "paged"}),
                        ("test_decode_attention_fp8_modelled[f]", {"modelled_kv_cache": "fp8 e4m3"}),
                        ("test_moe_tkg_modelled[g]", {})):
        assert not table.add_benchmark(name, {}, {**x, "modelled_latency_s": 9.0, **extra}), name
    assert len(table) == 1
    assert table("attention", {"q_heads": 4, "kv_heads": 1, "head_dim": 128, "hidden": 4096, "batch": 8,
                               "ctx": 4096, "target": "trn2", "lnc": 1}) == 1e-4
