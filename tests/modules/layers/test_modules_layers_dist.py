"""Sharded layers on real gloo groups equal the unsharded layer: decode (all-reduce) and prefill SP
(reduce-scatter) paths, KV replication, sharded greedy sampling, a real safetensors load on every rank, and
the component-DP decode flow with mixed dp sizes."""

import pytest
import torch
import torch.nn.functional as F

from modules.config import NeuronConfig
from modules.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    RMSNorm,
    RowParallelLinear,
    VocabDimShardedEmbedding,
    sharded_greedy_sample,
)
from modules.loading import SafetensorsCheckpoint, load_from_tensors
from modules.parallel.coordinator import CollectiveLog, GroupCoordinator, StaticGroup
from modules.parallel.patterns import decoder_layer_decode
from modules.parallel.state import initialize_parallel_state
from modules.parallel.transition import dp_transition
from modules.testing import assert_close_global, run_distributed

V, H, HEADS, KV, HD, INTER = 37, 16, 8, 2, 4, 24


def _tensors():
    g = torch.Generator().manual_seed(7)
    return {"embed": torch.randn(V, H, generator=g), "norm": torch.randn(H, generator=g),
            "qkv": torch.randn((HEADS + 2 * KV) * HD, H, generator=g), "o": torch.randn(H, HEADS * HD, generator=g),
            "up": torch.randn(INTER, H, generator=g), "up_b": torch.randn(INTER, generator=g),
            "down": torch.randn(H, INTER, generator=g), "down_b": torch.randn(H, generator=g),
            "lm_head": torch.randn(V, H, generator=g)}


def _layers(group, t):
    mods = {
        "embed": VocabDimShardedEmbedding(V, H, group), "norm": RMSNorm(H),
        "attn": ParallelAttention(H, HEADS, KV, HD, group), "up": ColumnParallelLinear(H, INTER, group, bias=True),
        "down": RowParallelLinear(INTER, H, group, bias=True),
        "lm_head": ColumnParallelLinear(H, V, group, pad=True, gather_output=False),
        "lm_head_gather": ColumnParallelLinear(H, V, group, pad=True, gather_output=True),
    }
    maps = {"embed": {"weight": "embed"}, "norm": {"weight": "norm"},
            "attn": {"qkv_proj.weight": "qkv", "o_proj.weight": "o"}, "up": {"weight": "up", "bias": "up_b"},
            "down": {"weight": "down", "bias": "down_b"}, "lm_head": {"weight": "lm_head"},
            "lm_head_gather": {"weight": "lm_head"}}
    for name, m in mods.items():
        load_from_tensors(m, t, rank=0, mappings=maps[name])  # rank from each layer's own group
    return mods


def _forward(m, ids, sp):
    """Embedding → norm → attention → MLP → norm, in decode (all-reduce) or prefill SP layout."""
    h = m["embed"](ids, sequence_parallel=sp)
    h = h + m["attn"](m["norm"](h), sequence_parallel=sp)
    return h + m["down"](F.silu(m["up"](m["norm"](h), sequence_parallel=sp)), sequence_parallel=sp)


def _check_layers(rank, world_size):
    n = world_size
    t = _tensors()
    log = CollectiveLog()
    group = GroupCoordinator([list(range(n))], "tp", log=log)
    ref, shard = _layers(StaticGroup(), t), _layers(group, t)
    tokens = 2 * n
    ids = torch.tensor([0, V - 1, 5, 17, 36, 1, 9, 30, 12, 3, 25, 33, 8, 20, 6, 2][:tokens])

    # Decode: every rank holds all tokens; each layer ends with an all-reduce.
    with torch.no_grad():
        expect = _forward(ref, ids, False)
        assert_close_global(_forward(shard, ids, False), expect)
        # Prefill SP: embedding reduce-scatters into [T/n, H]; attention/MLP all-gather in and reduce-scatter out.
        with log.capture() as cap:
            local = _forward(shard, ids, True)
        chunk = tokens // n
        assert_close_global(local, expect[rank * chunk:(rank + 1) * chunk])
        if n > 1:
            assert cap.ops() == [("reduce_scatter", "tp"), ("all_gather", "tp"), ("reduce_scatter", "tp"),
                                 ("all_gather", "tp"), ("reduce_scatter", "tp")]
        # Exit SP and compute logits both ways: gathered logits and sharded greedy sampling.
        full_h = group.all_gather(local, dim=0)
        ref_logits = ref["lm_head"](full_h)
        assert_close_global(shard["lm_head_gather"](full_h), ref_logits)
        head = shard["lm_head"]
        valid = max(0, min(head.out_per_rank, V - head.output_start))
        tokens_out = sharded_greedy_sample(head(full_h), group, head.output_start, valid=valid)
        assert torch.equal(tokens_out, ref_logits.argmax(-1))
        # Ties resolve to the lowest id, like torch.argmax over the full vocab.
        tied = torch.zeros(3, head.out_per_rank)
        assert sharded_greedy_sample(tied, group, head.output_start, valid=valid).tolist() == [0, 0, 0]

    # A bad id fails on every rank before any collective (no hang).
    try:
        shard["embed"](torch.tensor([3, V + 4]))
    except ValueError as e:
        assert f"token id {V + 4} is out of range for vocab_size={V}" in str(e)
    else:
        raise AssertionError("expected ValueError")
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_layers_equal_unsharded(world_size):
    assert all(run_distributed(_check_layers, world_size, timeout=100))


def _load_checkpoint(rank, world_size, path):
    group = GroupCoordinator([list(range(world_size))], "tp")
    m = torch.nn.ModuleDict(_layers(group, {k: torch.zeros_like(v) for k, v in _tensors().items()}))
    maps = {"embed.weight": "embed", "norm.weight": "norm", "attn.qkv_proj.weight": "qkv", "attn.o_proj.weight": "o",
            "up.weight": "up", "up.bias": "up_b", "down.weight": "down", "down.bias": "down_b",
            "lm_head.weight": "lm_head", "lm_head_gather.weight": "lm_head"}
    ckpt = SafetensorsCheckpoint(path)
    state = ckpt.load_sharded_pipelined(rank=group.rank_in_group, world_size=group.world_size, model=m,
                                        mappings=maps)
    return state, dict(ckpt.bytes_read)


@pytest.mark.timeout(120)
def test_real_safetensors_every_rank(tmp_path):
    from safetensors.torch import save_file

    full = _tensors()
    save_file(full, tmp_path / "model.safetensors")
    n = 4
    out = run_distributed(_load_checkpoint, n, str(tmp_path))
    states = [s for s, _ in out]
    assert torch.equal(torch.cat([s["embed.weight"] for s in states])[:V], full["embed"])
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in states])[:V], full["lm_head"])
    assert torch.equal(torch.cat([s["up.weight"] for s in states]), full["up"])
    assert torch.equal(torch.cat([s["down.weight"] for s in states], dim=1), full["down"])
    assert torch.equal(torch.cat([s["attn.o_proj.weight"] for s in states], dim=1), full["o"])
    q = HEADS * HD // n
    assert torch.equal(torch.cat([s["attn.qkv_proj.weight"][:q] for s in states]), full["qkv"][:HEADS * HD])
    for s in states:
        assert torch.equal(s["norm.weight"], full["norm"]) and torch.equal(s["down.bias"], full["down_b"])
    # Each rank read a quarter of every sharded tensor, not the whole file.
    for _, read in out:
        assert read["up"] == full["up"].numel() * 4 // n and read["down"] == full["down"].numel() * 4 // n


# --- component-DP decode flow with mixed dp sizes (tp 2 × dp 4) ------------------------------------------
TP, DP, B = 2, 4, 2


def _replica_ids(d):
    return torch.tensor([(7 * d + 3 * j) % V for j in range(B)])


def _component_flow(rank, world_size, dp_sizes):
    cfg = NeuronConfig(tp_size=TP, dp_size=DP, **dp_sizes)
    st = initialize_parallel_state(cfg)
    t = _tensors()
    d = rank // TP
    emb = VocabDimShardedEmbedding(V, H, st.embedding.tp)
    lm_head = ColumnParallelLinear(H, V, st.lm_head.tp, pad=True, gather_output=True)
    attn_o = RowParallelLinear(H, H, st.attention.tp)  # toy attention: a row-parallel map over the component
    mlp_down = RowParallelLinear(H, H, st.mlp.tp)
    load_from_tensors(emb, {"weight": t["embed"]}, rank=0)
    load_from_tensors(lm_head, {"weight": t["lm_head"]}, rank=0)
    w_attn, w_mlp = t["o"][:, :H] * 0.1, t["down"][:, :H] * 0.1
    load_from_tensors(attn_o, {"weight": w_attn}, rank=0)
    load_from_tensors(mlp_down, {"weight": w_mlp}, rank=0)

    def partial(layer):
        k = layer.in_per_rank
        return lambda h: F.linear(h.narrow(-1, layer.tp_group.rank_in_group * k, k), layer.weight)

    st.log.clear()
    with torch.no_grad():
        ids = st.embedding.dp.all_gather(_replica_ids(d))  # gather ids across the embedding DP column
        h = emb(ids)  # component-TP all-reduce sums vocab shards over TP × emb_dp ranks
        h = dp_transition(h, st.embedding.dp, st.mlp.dp)  # once, before the layer loop
        for _ in range(2):
            h = decoder_layer_decode(h, st.attention, st.mlp, partial(attn_o), partial(mlp_down))
        h = dp_transition(h, st.mlp.dp, st.local)  # slice to the local batch
        h = st.lm_head.dp.all_gather(h)  # gather across the LM-head DP column
        logits = dp_transition(lm_head(h), st.lm_head.dp, st.local)  # back to the local batch

    ref = F.embedding(_replica_ids(d), t["embed"])
    for _ in range(2):
        ref = ref + ref @ w_attn.t()
        ref = ref + ref @ w_mlp.t()
    assert_close_global(logits, ref @ t["lm_head"].t())
    return st.log.ops()


@pytest.mark.timeout(120)
def test_component_dp_flow_mixed_sizes():
    cases = [dict(embedding_dp_size=2, attention_dp_size=4, mlp_dp_size=1, lm_head_dp_size=4),
             dict(embedding_dp_size=4, attention_dp_size=4, mlp_dp_size=4, lm_head_dp_size=4)]
    results = run_distributed(_run_flow_cases, TP * DP, cases)
    mixed, equal = results[0]
    # All equal: ids gather, embedding AR, 2 ARs per layer, lm-head gather (ids already gathered), lm-head
    # all-gather of logits (gather_output). No transition collectives.
    assert [op for op, _ in equal] == ["all_gather", "all_reduce"] + ["all_reduce"] * 4 + ["all_gather", "all_gather"]
    # Mixed: emb 2 → mlp 1 is a slice; each layer adds one all-gather (mlp 1 → attn 4 goes up).
    per_layer = ["all_gather", "all_reduce", "all_reduce"]
    assert [op for op, _ in mixed] == ["all_gather", "all_reduce"] + per_layer * 2 + ["all_gather", "all_gather"]


def _run_flow_cases(rank, world_size, cases):
    return [_component_flow(rank, world_size, c) for c in cases]
