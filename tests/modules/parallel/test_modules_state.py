"""initialize_parallel_state on real gloo worlds: rank lists, aliasing, working groups, vision reuse."""

import pytest
import torch

from modules.config import NeuronConfig, VisionNeuronConfig
from modules.parallel import rank_lists as rl
from modules.parallel.state import initialize_parallel_state
from modules.parallel.transition import dp_gather_blocks, dp_scatter_blocks
from modules.testing import run_distributed


def _check_state(rank, world_size, cfg_kwargs, vision_kwargs):
    cfg = NeuronConfig(**cfg_kwargs)
    vision = VisionNeuronConfig(**vision_kwargs) if vision_kwargs is not None else None
    st = initialize_parallel_state(cfg, vision)
    tp = cfg.tp_size
    assert st.tp.ranks == rl.group_containing(rl.build_tp_group_ranks(world_size, tp), rank)
    assert st.dp.ranks == rl.group_containing(rl.build_dp_group_ranks(world_size, tp), rank)
    assert st.world.ranks == list(range(world_size))
    sizes = cfg.component_dp_sizes()
    for name, size in sizes.items():
        comp = st.component(name)
        assert comp.tp.ranks == rl.group_containing(rl.build_component_tp_group_ranks(world_size, tp, size), rank)
        assert comp.dp.ranks == rl.group_containing(rl.build_dp_column_group_ranks(world_size, tp, size), rank)
        assert (comp.tp.world_size, comp.dp.world_size) == (tp * size, size)
        # Groups are real: an all-reduce of the global rank sums the group's ranks.
        assert comp.tp.all_reduce(torch.tensor([float(rank)])).item() == sum(comp.tp.ranks)
        assert comp.dp.all_gather(torch.tensor([float(rank)])).tolist() == [float(r) for r in comp.dp.ranks]
        # Aliasing: equal dp sizes share one coordinator object; dp 1 is the TP group itself.
        for other, osize in sizes.items():
            assert (st.component(other).tp is comp.tp) == (osize == size)
            assert (st.component(other).dp is comp.dp) == (osize == size)
        if size == 1:
            assert comp.tp is st.tp and comp.dp.world_size == 1
    info = {"distinct": len(st.cache), "rank_in_tp": st.tp.rank_in_group}
    if vision is not None:
        vtp, vdp = vision.tp_size, vision.dp_size
        assert st.vision_tp.ranks == rl.group_containing(rl.build_vision_tp_group_ranks(world_size, vtp), rank)
        assert (st.vision_tp is st.tp) == (vtp == tp)
        if vdp == 1:
            assert st.vision_dp is None          # the seed creates vision DP groups only when dp > 1
            return info
        assert st.vision_dp.ranks == rl.group_containing(rl.build_vision_dp_group_ranks(world_size, vtp, vdp), rank)
        info["vision_dp"] = st.vision_dp.ranks
        # Vision block DP: pad num_blocks to a multiple of dp, scatter, compute, gather back on every rank.
        blocks = vision.pad_blocks(torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3))
        out = dp_gather_blocks(dp_scatter_blocks(blocks, st.vision_dp) * 2, st.vision_dp)
        assert torch.equal(out, blocks * 2) and out.shape[0] == vision.padded_num_blocks(5)
        info["vision_tp"] = st.vision_tp.ranks
    return info


@pytest.mark.timeout(90)
def test_world8_mixed_component_groups():
    cfg = dict(tp_size=2, dp_size=4, attention_dp_size=4, embedding_dp_size=1, mlp_dp_size=2, lm_head_dp_size=4)
    out = run_distributed(_check_state, 8, cfg, {"tp_size": 4})
    # Distinct layouts: world (= component-TP at dp 4), tp (= component-TP at dp 1), dp column (= column at
    # dp 4), component-TP at dp 2 (= vision TP 4: same contiguous blocks of 4), column at dp 2, column at dp 1
    # (self groups), vision DP columns.
    assert out[0]["distinct"] == 7
    assert [o["vision_tp"] for o in out[:5:4]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [o["vision_dp"] for o in out[:4]] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.timeout(120)
def test_world16_vision_reuses_text_tp():
    cfg = dict(tp_size=4, dp_size=4, attention_dp_size=4, embedding_dp_size=2, mlp_dp_size=2, lm_head_dp_size=1)
    out = run_distributed(_check_state, 16, cfg, {"tp_size": 4}, timeout=100)
    # Vision seed golden: world 16, vision tp 4 → DP columns [0,4,8,12], [1,5,9,13], ...
    assert [o["vision_dp"] for o in out[:4]] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert [o["rank_in_tp"] for o in out] == [r % 4 for r in range(16)]


def test_world_size_mismatch_is_rejected():
    cfg = NeuronConfig(tp_size=8, dp_size=4)
    with pytest.raises(ValueError, match=r"8 \* 4 = 32 != world_size=8"):
        cfg.validate_world_size(8)


@pytest.mark.timeout(60)
def test_state_rejects_world_mismatch_in_process():
    with pytest.raises(Exception, match=r"2 \* 2 = 4 != world_size=2"):
        run_distributed(_check_state, 2, dict(tp_size=2, dp_size=2), None)
