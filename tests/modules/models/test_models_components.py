"""Model components on gloo ranks: the LM head's padded-vocab mask, the prefill SP length rule, and the decode
kernel path (attention DP's swaps inside the kernel) against the torch path within bf16."""

import pytest
import torch
from models_case import TINY_LLAMA, by_replica, serve

from modules.model_specs import TextModelSpec
from modules.models.hf_layout import random_dense_state, random_gpt_oss_state, write_checkpoint
from modules.testing import RankFailedError, assert_close_global, run_distributed

V, H = 13, 8  # 13 over 4 ranks: 4 rows each, the last shard holds 1 real row and 3 zero padding rows


def _lm_head_rank(rank, world_size, x, w):
    from modules.loading import load_from_tensors
    from modules.models.lm_head import ShardedLMHead
    from modules.parallel.coordinator import GroupCoordinator
    head = ShardedLMHead(H, V, GroupCoordinator([list(range(world_size))], "lm_head_tp"), dtype=torch.float32)
    load_from_tensors(head, {"w": w}, rank, mappings={"proj.weight": "w"})
    return head.sample(x), head.sample(x, mask_padding=False), head.gathered_logits(x)


def test_padded_vocab_is_masked_where_padding_would_win():
    """Every real logit is negative (positive hidden states, negative weights), so a padded column's 0 is the
    largest value: unmasked sampling picks a padding id >= V, the masked one the true argmax."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, H, generator=g) + 0.1
    w = -(torch.rand(V, H, generator=g) + 0.1)
    ref = x @ w.t()
    assert (ref < 0).all()
    for masked, unmasked, logits in run_distributed(_lm_head_rank, 4, x, w):
        assert torch.equal(masked, ref.argmax(-1))
        assert (unmasked >= V).all(), unmasked  # what the mask prevents
        torch.testing.assert_close(logits, ref)


def test_prefill_rejects_padded_length_not_above_tp():
    """Sequence parallel needs T > tp world_size: the config refuses such a bucket at construction
    (tests/modules/test_modules_config.py); an explicit bucket equal to tp is refused by the prefill model."""
    spec = TextModelSpec("tiny", layers=1, hidden=16, intermediate=16, heads=2, kv_heads=2, head_dim=8, vocab=11)
    with pytest.raises(RankFailedError, match=r"T=2 must satisfy T > tp world_size=2"):
        run_distributed(_prefill_bucket_rank, 2, spec)


def _prefill_bucket_rank(rank, world_size, spec):
    from modules.config import NeuronConfig
    from modules.models import ModelRunner, llama_mlp, llama_mlp_mappings
    from modules.parallel.state import initialize_parallel_state
    state = initialize_parallel_state(NeuronConfig(tp_size=2, prefill_buckets=(4,), decode_buckets=(1,)))
    runner = ModelRunner(spec, state, llama_mlp, llama_mlp_mappings, s_max=8, dtype=torch.float32)
    runner.prefill_model(torch.tensor([1, 2]), runner.cache, 0, bucket=2)


KERNEL_SPEC = TextModelSpec("tiny-kernel", layers=1, hidden=128, intermediate=128, heads=4, kv_heads=2, head_dim=32,
                            vocab=64)
# GPT-OSS for the kernels: H a multiple of 128 (decode kernel), a sliding-window and a full layer, biases, sinks, MoE.
GPT_OSS_KERNEL_SPEC = TextModelSpec("tiny-gpt-oss-kernel", layers=2, hidden=128, intermediate=64, heads=4, kv_heads=2,
                                    head_dim=32, vocab=64, experts=4, top_k=2, sliding_window=4, attention_bias=True)


# Layouts of the kernel-vs-torch comparison: plain tp 2, and attention DP (in-kernel all-to-alls) with 2 TP
# positions of 2-rank DP columns (world 4: columns [0, 2] and [1, 3]) and as pure DP (tp 1, world 2 and 4).
KERNEL_LAYOUTS = {
    "tp2": (2, dict(tp_size=2)),
    "tp2_attn_dp2": (4, dict(tp_size=2, dp_size=2, attention_dp_size=2, mlp_dp_size=2, embedding_dp_size=2,
                             lm_head_dp_size=2)),
    "tp1_attn_dp2": (2, dict(tp_size=1, dp_size=2, attention_dp_size=2, mlp_dp_size=1, embedding_dp_size=1,
                             lm_head_dp_size=1)),
    # one query head per rank, two KV heads: every rank of the column attends 4 heads after the swap
    "tp1_attn_dp4": (4, dict(tp_size=1, dp_size=4, attention_dp_size=4, mlp_dp_size=2, embedding_dp_size=1,
                             lm_head_dp_size=4)),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spec, layout", [(KERNEL_SPEC, "tp2"), (GPT_OSS_KERNEL_SPEC, "tp2"),
                                          (KERNEL_SPEC, "tp2_attn_dp2"), (GPT_OSS_KERNEL_SPEC, "tp1_attn_dp2"),
                                          (KERNEL_SPEC, "tp1_attn_dp4")],
                         ids=["llama-tp2", "gpt_oss-tp2", "llama-tp2_attn_dp2", "gpt_oss-tp1_attn_dp2",
                              "llama-tp1_attn_dp4"])
def test_decode_kernel_path_matches_torch_path(tmp_path, spec, layout):
    """backend="nkisim" runs the fused decode-attention kernel on the interpreter (bf16; for GPT-OSS also the
    MoE's router / CTE / TKG kernels through modules.moe) against the torch path; with attention DP the kernel swaps
    heads <-> sequences with its in-kernel all-to-alls across the gloo processes (no host all-to-all in its decode
    layer), the torch path with torch.distributed.

    Per sequence, step by step while both paths have emitted the same tokens: logits agree within bf16
    (|diff| <= 2e-2 max|logit|), and a token may differ only where the torch path's top-2 margin is within that
    tolerance (a bf16 near-tie; the sequence is compared no further, its inputs now differ)."""
    world, cfg = KERNEL_LAYOUTS[layout]
    state = (random_gpt_oss_state if spec.is_moe else random_dense_state)(spec, seed=3, dtype=torch.bfloat16)
    path = str(write_checkpoint(state, tmp_path))
    raw = {be: run_distributed(serve, world, spec, cfg, path, steps=3, attn_backend=be, mlp_backend=be,
                               dtype=torch.bfloat16, log_layer_step=0, timeout=180) for be in ("torch", "nkisim")}
    # host collectives of a decode layer: the torch path swaps heads <-> sequences on the attention DP column; the
    # kernel path does it inside the megakernel, so its log is the torch path's without the two all-to-alls
    for t, k in zip(raw["torch"], raw["nkisim"]):
        swaps = [(op, grp) for op, grp in t["layer_log"] if op == "all_to_all"]
        assert swaps == ([("all_to_all", t["groups"]["attention_dp"])] * 2 if cfg.get("attention_dp_size", 1) > 1
                         else []), t["layer_log"]
        assert k["layer_log"] == [c for c in t["layer_log"] if c[0] != "all_to_all"], k["layer_log"]
    runs = {be: by_replica(res, cfg["tp_size"]) for be, res in raw.items()}
    (t_tokens, t_logits), (k_tokens, k_logits) = runs["torch"], runs["nkisim"]
    tol = 2e-2 * t_logits.abs().max()
    top2 = t_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    compared = 0
    for b in range(t_tokens.shape[1]):
        for step in range(t_tokens.shape[0]):
            assert (t_logits[step, b] - k_logits[step, b]).abs().max() <= tol, (step, b)
            compared += 1
            if t_tokens[step, b] != k_tokens[step, b]:
                assert margin[step, b] <= 2 * tol, (step, b, margin[step, b])
                break
    assert compared >= t_tokens.shape[1] * 2  # prefill and at least one decode step per sequence on average


@pytest.mark.timeout(120)
def test_decode_pads_the_local_batch_to_the_bucket(tmp_path):
    """3 sequences decode in the 4-bucket (one padding slot): their tokens and logits are the 4-sequence run's."""
    path = str(write_checkpoint(random_dense_state(TINY_LLAMA, seed=0), tmp_path))
    full = run_distributed(serve, 1, TINY_LLAMA, {}, path, steps=2)[0]
    padded = run_distributed(serve, 2, TINY_LLAMA, dict(tp_size=2), path, steps=2, sequences=3)[0]
    assert torch.equal(padded["tokens"], full["tokens"][:, :3])
    assert_close_global(padded["logits"], full["logits"][:, :3], rtol=1e-5, atol=1e-5)


def _sampling_and_loads_rank(rank, world_size, path):
    """tp 1 x dp 2, attention / LM-head DP 2: index_select(sampling_positions) before the LM-head gather, and the
    bytes each graph reads of one attention weight (prefill: plain TP; decode: half of Q over the DP pair)."""
    from modules.config import NeuronConfig
    from modules.loading import SafetensorsCheckpoint
    from modules.models import KVCache, ModelRunner, llama_mlp, llama_mlp_mappings
    from modules.models.hf_layout import attention_keys
    from modules.parallel.state import initialize_parallel_state
    cfg = NeuronConfig(dp_size=2, attention_dp_size=2, lm_head_dp_size=2, embedding_dp_size=2,
                       prefill_buckets=(16,), decode_buckets=(4,))
    state = initialize_parallel_state(cfg)
    runner = ModelRunner(TINY_LLAMA, state, llama_mlp, llama_mlp_mappings, s_max=16, dtype=torch.float32)
    reads = {}
    for graph in ("prefill_model", "decode_model"):
        ckpt = SafetensorsCheckpoint(path)
        getattr(runner, graph).load(ckpt)
        reads[graph] = ckpt.bytes_read[attention_keys(0)["q"]]
    ids = torch.tensor([3, 14, 15, 92]) + rank
    positions = torch.zeros(4, dtype=torch.long)
    everyone, _ = runner.decode_model(ids, positions, KVCache.allocate(TINY_LLAMA, 1, 4, 16, torch.float32))
    picked, _ = runner.decode_model(ids, positions, KVCache.allocate(TINY_LLAMA, 1, 4, 16, torch.float32),
                                    sampling_positions=torch.tensor([3, 1]))
    error = None
    try:
        runner.decode_model(ids, positions + 16, KVCache.allocate(TINY_LLAMA, 1, 4, 16, torch.float32))
    except ValueError as e:
        error = str(e)
    return everyone, picked, reads, error


def test_sampling_positions_and_disaggregated_loads(tmp_path):
    path = str(write_checkpoint(random_dense_state(TINY_LLAMA, seed=0), tmp_path))
    q_bytes = TINY_LLAMA.q_width * TINY_LLAMA.hidden * 4
    for everyone, picked, reads, error in run_distributed(_sampling_and_loads_rank, 2, path):
        assert torch.equal(picked, everyone[[3, 1]])
        assert error == "decode: positions must be in [0, S_max=16) of the KV cache, got [16, 16]"
        assert reads == {"prefill_model": q_bytes, "decode_model": q_bytes // 2}
