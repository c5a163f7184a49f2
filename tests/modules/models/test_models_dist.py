"""Llama-3 and GPT-OSS end to end on gloo ranks: prefill (TP + SP) and greedy decode (component DP, attention DP)
give the single-rank model's logits and tokens for tp-only, equal and mixed component-DP layouts, and a world-16
layout with KV replication; each decode layer issues the component-DP seed's minimal collective sequence, and the
unoptimised flow (same weights, same results) shows what that saves."""

import pytest
import torch
from models_case import (
    DECODE_BUCKETS,
    PREFILL_BUCKETS,
    TINY_GPT_OSS,
    TINY_LLAMA,
    by_replica,
    serve,
)

from modules.models.hf_layout import random_dense_state, random_gpt_oss_state, write_checkpoint
from modules.testing import assert_close_global, run_distributed

STEPS = 3
AR, AG, A2A, RS = "all_reduce", "all_gather", "all_to_all", "reduce_scatter"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny checkpoint and the single-rank model's run (the reference every layout must reproduce)."""
    path = write_checkpoint(random_dense_state(TINY_LLAMA, seed=0), tmp_path_factory.mktemp("llama"))
    ref = run_distributed(serve, 1, TINY_LLAMA, {}, str(path), steps=STEPS, warmup=True, log_layer_step=0)
    return path, ref[0]


# name: (world, config, layer-0 collectives of a decode step as (op, role)); roles resolve to the run's groups.
LAYOUTS = {
    "tp2": (2, dict(tp_size=2), [(AR, "attention"), (AR, "mlp")]),
    "tp4": (4, dict(tp_size=4), [(AR, "attention"), (AR, "mlp")]),
    "tp8": (8, dict(tp_size=8), [(AR, "attention"), (AR, "mlp")]),
    # all component dp sizes equal: every transition is a no-op; the head<->sequence swaps of attention DP remain
    "tp2_dp4_all4": (8, dict(tp_size=2, dp_size=4, attention_dp_size=4, embedding_dp_size=4, mlp_dp_size=4,
                             lm_head_dp_size=4),
                     [(A2A, "attention_dp"), (A2A, "attention_dp"), (AR, "attention"), (AR, "mlp")]),
    # mlp 2 -> attention 4 goes up (one all-gather); attention 4 -> mlp 2 goes down (a slice, no collective)
    "tp2_dp4_a4_m2_e1_l4": (8, dict(tp_size=2, dp_size=4, attention_dp_size=4, mlp_dp_size=2, embedding_dp_size=1,
                                    lm_head_dp_size=4),
                            [(AG, "attention_dp"), (A2A, "attention_dp"), (A2A, "attention_dp"), (AR, "attention"),
                             (AR, "mlp")]),
    # pure DP (tp 1): mlp 4 -> attention 2 is a slice; attention 2 -> mlp 4 one all-gather
    "tp1_dp4_a2_m4_e2_l1": (4, dict(tp_size=1, dp_size=4, attention_dp_size=2, mlp_dp_size=4, embedding_dp_size=2,
                                    lm_head_dp_size=1),
                            [(A2A, "attention_dp"), (A2A, "attention_dp"), (AR, "attention"), (AG, "mlp_dp"),
                             (AR, "mlp")]),
}


MIXED = LAYOUTS["tp2_dp4_a4_m2_e1_l4"]
# The whole decode step of the mixed layout: the seed's brackets around the layers.
MIXED_STEP = ([(AR, "embedding"),       # input_ids all-gather over the size-1 embedding column: bypassed
               (AG, "mlp_dp")]          # dp_transition(emb 1 -> mlp 2), once before the layers
              + MIXED[2] * TINY_LLAMA.layers
              + [(AG, "lm_head_dp"),    # slice to local + index_select, then all-gather over the LM-head column
                 (AG, "lm_head"),       # on-device greedy sampling: (max, id) pairs over the vocab shards
                 (AG, "lm_head")])      # the test's own logits gather (checking only)


def _named(log, groups):
    return [(op, groups[role]) for op, role in log]


def _check_against_reference(results, ref, tp_size):
    tokens, logits = by_replica(results, tp_size)
    assert torch.equal(tokens, ref["tokens"]), (tokens, ref["tokens"])
    assert_close_global(logits, ref["logits"], rtol=1e-5, atol=1e-5, msg="logits vs single rank")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank_and_decode_layer_is_minimal(llama, layout):
    path, ref = llama
    world, cfg, expected_layer = LAYOUTS[layout]
    results = run_distributed(serve, world, TINY_LLAMA, cfg, str(path), steps=STEPS, log_layer_step=1, timeout=100)
    _check_against_reference(results, ref, cfg["tp_size"])
    for r in results:
        assert r["layer_log"] == _named(expected_layer, r["groups"]), r["layer_log"]
        if layout == "tp2_dp4_a4_m2_e1_l4":
            assert r["step_log"] == _named(MIXED_STEP, r["groups"]), r["step_log"]


@pytest.mark.timeout(150)
def test_world16_with_kv_replication(llama):
    """tp 8 > 2 KV heads: each KV head on 4 TP positions; attention DP 2 splits each position's 2 Q heads."""
    path, ref = llama
    cfg = dict(tp_size=8, dp_size=2, attention_dp_size=2, mlp_dp_size=1, embedding_dp_size=2, lm_head_dp_size=2)
    results = run_distributed(serve, 16, TINY_LLAMA, cfg, str(path), steps=STEPS, log_layer_step=0, timeout=140)
    _check_against_reference(results, ref, 8)
    expected = [(AG, "attention_dp"), (A2A, "attention_dp"), (A2A, "attention_dp"), (AR, "attention"), (AR, "mlp")]
    assert results[0]["layer_log"] == _named(expected, results[0]["groups"])


@pytest.mark.timeout(120)
def test_unoptimised_flow_same_results_more_collectives(llama):
    """The pre-optimisation layer flow (local batch between modules) with the same weights gives the same tokens and
    logits with 7 collectives per layer instead of the optimised flow's 5 (mixed layout)."""
    path, ref = llama
    world, cfg, layer = MIXED
    unopt = run_distributed(serve, world, TINY_LLAMA, cfg, str(path), steps=STEPS, log_layer_step=0,
                            flow="unoptimised", timeout=100)
    _check_against_reference(unopt, ref, cfg["tp_size"])
    unopt_layer = [(AG, "attention_dp"), (A2A, "attention_dp"), (A2A, "attention_dp"), (RS, "attention_dp"),
                   (AR, "tp"), (AG, "mlp_dp"), (AR, "mlp")]
    for r in unopt:
        assert r["layer_log"] == _named(unopt_layer, r["groups"])
    assert len(unopt_layer) - len(layer) == 2


def test_warmup_enumerates_every_bucket_graph(llama):
    _, ref = llama
    graphs = ref["graphs"]
    assert graphs == [("prefill", b) for b in PREFILL_BUCKETS] + [("decode", b) for b in DECODE_BUCKETS]
    assert len(graphs) == len(PREFILL_BUCKETS) + len(DECODE_BUCKETS)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = write_checkpoint(random_gpt_oss_state(TINY_GPT_OSS, seed=2), tmp_path_factory.mktemp("gpt_oss"))
    return path, run_distributed(serve, 1, TINY_GPT_OSS, {}, str(path), steps=STEPS)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, cfg", [
    (4, dict(tp_size=4)),
    # MoE on an MLP component group of 4 (tp 2 x mlp_dp 2), attention DP 2, embedding local, LM head gathered
    (4, dict(tp_size=2, dp_size=2, attention_dp_size=2, mlp_dp_size=2, embedding_dp_size=1, lm_head_dp_size=2)),
], ids=["tp4", "tp2_dp2_a2_m2_e1_l2"])
def test_gpt_oss_matches_single_rank(gpt_oss, world, cfg):
    """GPT-OSS end to end: sinks, biases, alternating sliding window (4 tokens) and the TP-without-EP MoE (its
    prefill all-gathers/reduce-scatter inside the layer; its decode partial summed by the layer's one MLP
    all-reduce), prefill + decode, against the single-rank model."""
    path, ref = gpt_oss
    results = run_distributed(serve, world, TINY_GPT_OSS, cfg, str(path), steps=STEPS, log_layer_step=0,
                              timeout=100)
    _check_against_reference(results, ref, cfg["tp_size"])
    layer = [(AR, "attention"), (AR, "mlp")] if world == cfg["tp_size"] else [
        (A2A, "attention_dp"), (A2A, "attention_dp"), (AR, "attention"), (AR, "mlp")]
    assert results[0]["layer_log"] == _named(layer, results[0]["groups"])
