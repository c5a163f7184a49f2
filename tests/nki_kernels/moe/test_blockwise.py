"""Blockwise token → block → expert mapping: counts, the static block bound, −1 padding, every routed row once."""

import numpy as np
import pytest

from nki_kernels.moe.blockwise import blockwise_mapping, max_blocks


def _routing(rng, T, E, k):
    return np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)


def _check(idx, E, B):
    T, k = idx.shape
    m = blockwise_mapping(idx, E, B)
    N = -(-(T * k - (E - 1)) // B) + (E - 1)
    assert m.max_blocks == max(1, min(N, T * k))
    assert m.token_position_to_id.shape == (m.max_blocks * B,)
    np.testing.assert_array_equal(m.tokens_per_expert, np.bincount(idx.reshape(-1), minlength=E))
    assert m.num_blocks == int((-(-m.tokens_per_expert // B)).sum()) <= m.max_blocks
    # every (token, slot) pair appears exactly once, in a block of its expert, in token order inside the expert
    slots = m.token_position_to_slot
    real = slots >= 0
    assert sorted(slots[real].tolist()) == list(range(T * k))
    np.testing.assert_array_equal(m.token_position_to_id[real], slots[real] // k)
    assert (m.token_position_to_id[~real] == -1).all()
    block_of_row = np.arange(slots.size) // B
    np.testing.assert_array_equal(m.block_to_expert[block_of_row[real]], idx.reshape(-1)[slots[real]])
    assert (m.block_to_expert[m.num_blocks:] == -1).all() and (m.block_to_expert[:m.num_blocks] >= 0).all()
    assert (np.diff(m.block_to_expert[:m.num_blocks]) >= 0).all()     # grouped by expert, increasing
    for e in range(E):
        rows = slots[(m.block_to_expert[block_of_row] == e) & real]
        assert (np.diff(rows) > 0).all()
        # an expert's rows fill its blocks from the start: padding only at the end of its last block
        blocks = np.nonzero(m.block_to_expert == e)[0]
        if blocks.size:
            seg = slots[blocks[0] * B:(blocks[-1] + 1) * B]
            n = m.tokens_per_expert[e]
            assert (seg[:n] >= 0).all() and (seg[n:] == -1).all()
    # active-expert schedule
    act = m.active_experts[:m.num_active]
    np.testing.assert_array_equal(act, np.nonzero(m.tokens_per_expert)[0])
    assert (m.active_experts[m.num_active:] == -1).all()
    for j, e in enumerate(act):
        f, nb = m.expert_first_block[j], m.expert_num_blocks[j]
        assert (m.block_to_expert[f:f + nb] == e).all() and nb == -(-m.tokens_per_expert[e] // B)
    return m


@pytest.mark.parametrize("T,E,k,B", [(128, 32, 4, 128), (2048, 32, 4, 512), (513, 128, 4, 256), (1, 8, 2, 128),
                                     (300, 4, 4, 384)])
def test_mapping_random(T, E, k, B):
    _check(_routing(np.random.default_rng(T + E), T, E, k), E, B)


def test_mapping_all_tokens_to_one_expert():
    T, E, B = 1000, 16, 256
    idx = np.full((T, 1), 5)
    m = _check(idx, E, B)
    assert m.num_active == 1 and m.num_blocks == 4 and m.tokens_per_expert[5] == T
    assert (m.token_position_to_id[T:] == -1).all()


def test_mapping_skewed_worst_case_reaches_bound():
    """One row for each of E−1 experts, the rest on one expert: every expert's last block is partly empty — the
    case the static bound is sized for."""
    E, B = 8, 128
    T = (E - 1) + 3 * B + 1
    idx = np.concatenate([np.arange(1, E), np.zeros(T - (E - 1), np.int64)])[:, None]
    m = _check(idx, E, B)
    assert m.num_blocks == m.max_blocks == max_blocks(T, E, B)


def test_mapping_empty_experts_and_duplicates_of_torch_types():
    import torch
    idx = torch.tensor([[0, 3], [3, 0], [0, 3]])
    m = _check(idx.numpy(), 6, 128)
    assert m.tokens_per_expert.tolist() == [3, 0, 0, 3, 0, 0] and m.num_active == 2
    assert blockwise_mapping(idx, 6, 128).num_blocks == 2


@pytest.mark.parametrize("B", [64, 100, 640, 0, 200])
def test_mapping_bad_block_size(B):
    with pytest.raises(ValueError, match="block_size"):
        blockwise_mapping(np.zeros((4, 1), np.int64), 4, B)


def test_mapping_bad_routing():
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        blockwise_mapping(np.zeros((2, 5), np.int64), 4, 128)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, num_experts=4\)"):
        blockwise_mapping(np.array([[4]]), 4, 128)
