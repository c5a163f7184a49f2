"""Sharded layers in one process: each rank's partial (collectives replaced by identity) sums or concatenates to
the unsharded layer; shape and id errors name the offending value."""

import pytest
import torch

from modules.layers import ColumnParallelLinear, ParallelAttention, RMSNorm, RowParallelLinear, VocabDimShardedEmbedding
from modules.loading import load_from_tensors
from modules.parallel.coordinator import StaticGroup


class PartialGroup(StaticGroup):
    """Rank r of n where every collective returns its input: forward() yields the rank's partial result."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=0):
        return x

    def reduce_scatter(self, x, dim=0):
        return x


def _build(cls, n, r, tensors, *args, **kwargs):
    m = cls(*args, PartialGroup(n, r) if n > 1 else StaticGroup(), **kwargs)
    load_from_tensors(m, tensors, rank=0)  # the rank comes from the layer's group (rank override)
    return m


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_embedding_partials_sum_to_full(n):
    v, h = 10, 4
    w = torch.randn(v, h)
    ids = torch.tensor([[0, 9, 3], [5, 5, 7]])
    ref = torch.nn.functional.embedding(ids, w)
    parts = [_build(VocabDimShardedEmbedding, n, r, {"weight": w}, v, h)(ids) for r in range(n)]
    torch.testing.assert_close(sum(parts), ref)
    # Each id is looked up by exactly one rank.
    assert sum((p.abs().sum(-1) > 0).int() for p in parts).max() <= 1


@pytest.mark.parametrize("bad", [10, -1, 12345])
def test_embedding_out_of_range_id_named(bad):
    emb = _build(VocabDimShardedEmbedding, 2, 0, {"weight": torch.randn(10, 4)}, 10, 4)
    with pytest.raises(ValueError, match=rf"token id {bad} is out of range for vocab_size=10"):
        emb(torch.tensor([1, bad, 2]))


@pytest.mark.parametrize("n,out,pad", [(2, 6, False), (4, 8, False), (3, 7, True)])
def test_column_parallel_concat(n, out, pad):
    w, b, x = torch.randn(out, 5), torch.randn(out), torch.randn(3, 5)
    parts = [_build(ColumnParallelLinear, n, r, {"weight": w, "bias": b}, 5, out, bias=True, pad=pad)(x)
             for r in range(n)]
    torch.testing.assert_close(torch.cat(parts, -1)[:, :out], torch.nn.functional.linear(x, w, b))


def test_column_parallel_indivisible_named():
    with pytest.raises(ValueError, match=r"out_features=7 is not divisible by tp world_size=2; pass pad=True"):
        ColumnParallelLinear(5, 7, StaticGroup(2, 0))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_row_parallel_partials_sum(n):
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    k = 8 // n
    ref = torch.nn.functional.linear(x, w, b)
    parts = [_build(RowParallelLinear, n, r, {"weight": w, "bias": b}, 8, 5, bias=False)(x[:, r * k:(r + 1) * k])
             for r in range(n)]
    torch.testing.assert_close(sum(parts) + b, ref)
    with pytest.raises(ValueError, match=r"in_features=8 is not divisible by tp world_size=3"):
        RowParallelLinear(8, 5, StaticGroup(3, 0))


@pytest.mark.parametrize("heads,kv,n", [(8, 2, 4), (8, 4, 2), (4, 4, 4), (8, 2, 8)])
def test_attention_head_sharding_partials_sum(heads, kv, n):
    hd, hidden, t = 3, 6, 5
    tensors = {"qkv_proj.weight": torch.randn((heads + 2 * kv) * hd, hidden),
               "o_proj.weight": torch.randn(hidden, heads * hd)}
    x = torch.randn(t, hidden)
    ref = _build(ParallelAttention, 1, 0, tensors, hidden, heads, kv, hd)(x)
    parts = [_build(ParallelAttention, n, r, tensors, hidden, heads, kv, hd)(x) for r in range(n)]
    torch.testing.assert_close(sum(parts), ref)


def test_rmsnorm_reference_and_padding():
    h, pad = 6, 8
    w = torch.randn(h)
    x = torch.randn(4, h)
    norm = RMSNorm(h, eps=1e-5, padded_size=pad)
    load_from_tensors(norm, {"weight": w}, rank=3)  # replicated: any rank gets the full weight
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), ref)
    padded = torch.cat([x, torch.zeros(4, pad - h)], -1)
    out = norm(padded)
    torch.testing.assert_close(out[:, :h], ref)
    assert not out[:, h:].any()
    with pytest.raises(ValueError, match=r"last dim 7 is neither hidden_size=6 nor padded_size=8"):
        norm(torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"padded_size=4 < hidden_size=6"):
        RMSNorm(6, padded_size=4)


def test_greedy_sample_single_rank_and_bad_valid_named():
    from modules.layers.sampling import sharded_greedy_sample

    logits = torch.tensor([[0.1, 0.9, 0.9, -1.0], [2.0, 0.0, 0.0, 5.0]])
    g = StaticGroup()
    assert sharded_greedy_sample(logits, g, vocab_start=0).tolist() == [1, 3]           # first max wins ties
    assert sharded_greedy_sample(logits, g, vocab_start=10, valid=3).tolist() == [11, 10]  # padding column ignored
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=rf"valid={bad} must be in \[0, 4\]"):
            sharded_greedy_sample(logits, g, vocab_start=0, valid=bad)
