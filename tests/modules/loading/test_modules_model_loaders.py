"""Loaders the models added: fused gate_up (separate or fused sources), a fixed head range, transposed and
reshaped wrappers; each reads only its rows and checks its source's shape."""

import pytest
import torch

from modules.loading import (
    gate_up_weight_loader,
    head_range_weight_loader,
    replicated_weight_loader,
    reshaped_weight_loader,
    sharding_weight_loader,
    transposed_weight_loader,
)

INTER, H, N = 6, 4, 3


def test_gate_up_rank_gets_its_gate_rows_then_its_up_rows():
    gate, up = torch.randn(INTER, H), torch.randn(INTER, H)
    load = gate_up_weight_loader(INTER, N)
    for r in range(N):
        want = torch.cat([gate[2 * r:2 * r + 2], up[2 * r:2 * r + 2]])
        assert torch.equal(load({"gate": gate, "up": up}, r), want)
        assert torch.equal(load(torch.cat([gate, up]), r), want)  # one fused [gate | up] tensor
        assert torch.equal(gate_up_weight_loader(INTER, N, dim=0)({"gate": gate[:, 0], "up": up[:, 0]}, r), want[:, 0])


def test_gate_up_errors_name_the_limit():
    with pytest.raises(ValueError, match="intermediate_size=6 is not divisible by num_shards=4"):
        gate_up_weight_loader(INTER, 4)
    with pytest.raises(ValueError, match="up dim 0 has 5 rows, expected intermediate_size=6"):
        gate_up_weight_loader(INTER, N)({"gate": torch.zeros(INTER, H), "up": torch.zeros(5, H)}, 0)
    with pytest.raises(ValueError, match="fused gate_up dim 0 has 6 rows, expected 2 × 6"):
        gate_up_weight_loader(INTER, N)(torch.zeros(INTER, H), 0)
    with pytest.raises(ValueError, match="needs roles gate,up or gate_up"):
        gate_up_weight_loader(INTER, N)({"gate": torch.zeros(INTER, H)}, 0)


def test_head_range_is_rank_independent_and_checked():
    w = torch.randn(4 * 2, H)  # 4 heads of dim 2
    load = head_range_weight_loader(1, 2, 2, 4)
    assert torch.equal(load(w, 0), w[2:6]) and torch.equal(load(w, 5), w[2:6])
    with pytest.raises(ValueError, match=r"head range \[3, 5\) is outside 0..4"):
        head_range_weight_loader(3, 2, 2, 4)
    with pytest.raises(ValueError, match="dim 0 has 6 rows, expected 4 heads × 2"):
        load(torch.zeros(6, H), 0)


def test_transposed_and_reshaped_wrappers():
    w = torch.randn(H, INTER)
    t = transposed_weight_loader(sharding_weight_loader(1, 2, N))
    assert torch.equal(t(w, 1), w[:, 2:4].t())
    assert torch.equal(reshaped_weight_loader(replicated_weight_loader(), (1, H))(torch.arange(H), 0),
                       torch.arange(H).view(1, H))
    with pytest.raises(ValueError, match="needs a 2-D shard"):
        transposed_weight_loader(replicated_weight_loader())(torch.zeros(3), 0)
