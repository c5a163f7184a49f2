"""Pure loaders: every rank's shard built in one process reassembles the full tensor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modules.loading import (
    ShardSpec,
    fused_qkv_weight_loader,
    get_weight_loader,
    replicated_weight_loader,
    set_weight_loader,
    sharding_weight_loader,
    with_rank_override,
)
from modules.parallel.heads import shard_heads


@pytest.mark.parametrize("dim,n", [(0, 4), (1, 2), (-1, 3)])
def test_sharding_loader_reassembles(dim, n):
    full = torch.randn(12, 6)
    size = full.shape[dim] // n
    loader = sharding_weight_loader(dim, size, n)
    assert torch.equal(torch.cat([loader(full, r) for r in range(n)], dim=dim), full)


def test_rank_modulo_num_shards():
    full = torch.arange(8.0)
    loader = sharding_weight_loader(0, 4, 2)
    assert torch.equal(loader(full, 3), full[4:])  # rank 3 of a 4-rank world with 2 shards → shard 1


def test_pad_last_shard():
    full = torch.arange(10.0).reshape(5, 2)
    loader = sharding_weight_loader(0, 2, 3, pad=True)
    shards = [loader(full, r) for r in range(3)]
    assert all(s.shape == (2, 2) for s in shards)
    assert torch.equal(torch.cat(shards)[:5], full) and not shards[2][1].any()
    with pytest.raises(ValueError, match=r"dim 0 has 5 rows but size 2 × num_shards 3 = 6; pass pad=True"):
        sharding_weight_loader(0, 2, 3)(full, 0)
    with pytest.raises(ValueError, match=r"dim 0 has 5 rows, more than size 1 × num_shards 3"):
        sharding_weight_loader(0, 1, 3, pad=True)(full, 0)


def test_transposed_storage():
    param_full = torch.randn(6, 4)  # [out, in]
    stored = param_full.t().contiguous()  # checkpoint stores [in, out]
    loader = sharding_weight_loader(0, 3, 2, transposed=True)
    assert torch.equal(torch.cat([loader(stored, r) for r in range(2)]), param_full)


def test_shard_spec_validation():
    with pytest.raises(ValueError, match=r"ShardSpec.size must be a positive integer, got 0"):
        ShardSpec(0, 0, 2)


def test_with_rank_override_ignores_passed_rank():
    full = torch.arange(8.0)
    loader = with_rank_override(sharding_weight_loader(0, 2, 4), rank=3)
    assert torch.equal(loader(full, 0), full[6:]) and loader.rank_override == 3


def test_replicated_with_padding():
    w = torch.ones(5)
    assert torch.equal(replicated_weight_loader(pad_to=8)(w, 3), torch.tensor([1.0] * 5 + [0.0] * 3))
    with pytest.raises(ValueError, match=r"pad_to=4"):
        replicated_weight_loader(pad_to=4)(w, 0)


def test_get_set_weight_loader():
    p = torch.nn.Parameter(torch.zeros(2))
    assert torch.equal(get_weight_loader(p)(torch.ones(2), 5), torch.ones(2))  # default: replicated
    loader = sharding_weight_loader(0, 1, 2)
    set_weight_loader(p, loader)
    assert get_weight_loader(p) is loader


class TestHeads:
    def test_gpt_oss_tp8_and_tp16(self):
        hs = shard_heads(64, 8, 64, 8)
        assert (hs.q_heads_per_rank, hs.kv_heads_per_rank, hs.num_kv_replicas) == (8, 1, 1)
        hs = shard_heads(64, 8, 64, 16)
        assert (hs.q_heads_per_rank, hs.kv_heads_per_rank, hs.num_kv_replicas) == (4, 1, 2)
        assert [hs.kv_head_start(r) for r in range(16)] == [r // 2 for r in range(16)]
        # Seed's TP=8 shard shape with head_dim 45: q_size 360, kv_size 45, fused 450.
        hs = shard_heads(64, 8, 45, 8)
        assert (hs.q_size, hs.kv_size, hs.q_size + 2 * hs.kv_size) == (360, 45, 450)

    def test_kv_split_when_tp_small(self):
        hs = shard_heads(32, 8, 128, 4)
        assert (hs.q_heads_per_rank, hs.kv_heads_per_rank, hs.num_kv_replicas) == (8, 2, 1)

    @pytest.mark.parametrize("args,msg", [
        ((64, 8, 64, 24), r"num_heads=64 must be divisible by tp_size=24"),
        ((48, 8, 64, 12), r"tp_size=12 must be a multiple of num_kv_heads=8"),
        ((12, 6, 8, 4), r"num_kv_heads=6 must be divisible by tp_size=4"),
        ((10, 4, 8, 2), r"num_heads=10 must be a multiple of num_kv_heads=4"),
        ((8, 2, 0, 2), r"head_dim must be a positive integer, got 0"),
    ])
    def test_errors(self, args, msg):
        with pytest.raises(ValueError, match=msg):
            shard_heads(*args)


@pytest.mark.parametrize("heads,kv,tp", [(64, 8, 16), (64, 8, 8), (8, 4, 2), (8, 2, 4)])
@pytest.mark.parametrize("fused", [False, True])
def test_fused_qkv_loader_with_kv_replication(heads, kv, tp, fused):
    hd, hidden = 2, 3
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    loader = fused_qkv_weight_loader(heads, kv, hd, tp)
    hs = loader.head_sharding
    sources = {"qkv": torch.cat([q, k, v])} if fused else {"q": q, "k": k, "v": v}
    for r in range(tp):
        out = loader(sources, r)
        assert out.shape == (hs.q_size + 2 * hs.kv_size, hidden)
        qs, ks, vs = out.split([hs.q_size, hs.kv_size, hs.kv_size])
        assert torch.equal(qs, q[r * hs.q_size:(r + 1) * hs.q_size])
        kv_head = hs.kv_head_start(r)
        assert torch.equal(ks, k[kv_head * hd:(kv_head + hs.kv_heads_per_rank) * hd])
        assert torch.equal(vs, v[kv_head * hd:(kv_head + hs.kv_heads_per_rank) * hd])
    # Q shards reassemble; every KV head is held by exactly num_kv_replicas ranks.
    assert torch.equal(torch.cat([loader(sources, r)[:hs.q_size] for r in range(tp)]), q)
    holders = [hs.kv_head_start(r) for r in range(tp)]
    assert all(holders.count(h) == hs.num_kv_replicas for h in range(0, kv, hs.kv_heads_per_rank))


def test_fused_qkv_errors():
    loader = fused_qkv_weight_loader(8, 2, 2, 4)
    with pytest.raises(ValueError, match=r"k dim 0 has 6 rows, expected 4"):
        loader({"q": torch.zeros(16, 3), "k": torch.zeros(6, 3), "v": torch.zeros(4, 3)}, 0)
    with pytest.raises(ValueError, match=r"fused qkv dim 0 has 20 rows, expected 24"):
        loader(torch.zeros(20, 3), 0)
    with pytest.raises(ValueError, match=r"rank=4 out of range for tp_size=4"):
        loader(torch.zeros(24, 3), 4)
    with pytest.raises(ValueError, match=r"needs roles q,k,v or qkv"):
        loader({"q": torch.zeros(16, 3)}, 0)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 17), cols=st.integers(1, 5), n=st.integers(1, 6), dim=st.sampled_from([0, 1]))
def test_padded_shards_reassemble_property(rows, cols, n, dim):
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    size = max(1, -(-full.shape[dim] // n))
    loader = sharding_weight_loader(dim, size, n, pad=True)
    shards = [loader(full, r) for r in range(n)]
    assert all(s.shape[dim] == size for s in shards)
    joined = torch.cat(shards, dim=dim)
    assert torch.equal(joined.narrow(dim, 0, full.shape[dim]), full)
    assert not joined.narrow(dim, full.shape[dim], joined.shape[dim] - full.shape[dim]).any()
