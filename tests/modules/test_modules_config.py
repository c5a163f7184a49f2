"""NeuronConfig / VisionNeuronConfig validation and resolution (seeds: component-DP, vision)."""

import pytest
import torch

from modules.config import NeuronConfig, VisionNeuronConfig, pad_blocks, pad_num_blocks, select_bucket


class TestNeuronConfig:
    def test_defaults(self):
        cfg = NeuronConfig()
        assert cfg.world_size == 1
        assert cfg.component_dp_sizes() == {"attention": 1, "embedding": 1, "mlp": 1, "lm_head": 1}

    def test_seed_example_all_four(self):
        cfg = NeuronConfig(tp_size=8, dp_size=4, attention_dp_size=4, embedding_dp_size=4, mlp_dp_size=4,
                           lm_head_dp_size=4)
        cfg.validate_world_size(32)
        assert cfg.world_size == 32

    def test_embedding_and_lm_head_independent(self):
        cfg = NeuronConfig(tp_size=2, dp_size=4, embedding_dp_size=4, lm_head_dp_size=2, attention_dp_size=1)
        assert cfg.component_dp_sizes()["embedding"] == 4 and cfg.component_dp_sizes()["lm_head"] == 2

    @pytest.mark.parametrize("name", ["attention_dp_size", "embedding_dp_size", "mlp_dp_size", "lm_head_dp_size"])
    def test_component_dp_must_divide_dp(self, name):
        with pytest.raises(ValueError, match=rf"{name}=3 must divide dp_size=4"):
            NeuronConfig(tp_size=2, dp_size=4, **{name: 3})

    @pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
    def test_component_dp_positive_int(self, bad):
        with pytest.raises(ValueError, match=r"mlp_dp_size must be a positive integer, got"):
            NeuronConfig(dp_size=4, mlp_dp_size=bad)

    def test_mlp_dp_with_ep_rejected(self):
        with pytest.raises(ValueError, match=r"mlp_dp_size=2 > 1 is incompatible with ep_degree=2"):
            NeuronConfig(tp_size=4, dp_size=2, mlp_dp_size=2, ep_degree=2)
        NeuronConfig(tp_size=4, dp_size=2, mlp_dp_size=1, ep_degree=2)  # EP alone is fine

    @pytest.mark.parametrize("tp,dp,world", [(8, 4, 16), (2, 2, 8), (4, 1, 2)])
    def test_world_size_mismatch(self, tp, dp, world):
        cfg = NeuronConfig(tp_size=tp, dp_size=dp)
        with pytest.raises(ValueError, match=rf"{tp} \* {dp} = {tp * dp} != world_size={world}"):
            cfg.validate_world_size(world)

    def test_buckets(self):
        cfg = NeuronConfig(tp_size=8, prefill_buckets=(128, 512, 2048), decode_buckets=(1, 4, 8))
        assert cfg.select_prefill_bucket(129) == 512
        assert cfg.select_decode_bucket(1) == 1
        with pytest.raises(ValueError, match=r"n=9"):
            cfg.select_decode_bucket(9)

    def test_prefill_bucket_must_divide_by_tp(self):
        with pytest.raises(ValueError, match=r"prefill_buckets entry 100 must be divisible by tp_size=8"):
            NeuronConfig(tp_size=8, prefill_buckets=(64, 100))

    @pytest.mark.parametrize("tp, bucket", [(8, 8), (2, 2), (1, 1)])
    def test_prefill_bucket_must_exceed_tp(self, tp, bucket):
        with pytest.raises(ValueError, match=rf"prefill_buckets entry {bucket} must be > tp_size={tp}"):
            NeuronConfig(tp_size=tp, prefill_buckets=(bucket, 4 * tp))
        assert NeuronConfig(tp_size=tp, prefill_buckets=(2 * tp,)).prefill_buckets == (2 * tp,)

    def test_buckets_sorted_unique(self):
        with pytest.raises(ValueError, match=r"decode_buckets must be strictly increasing"):
            NeuronConfig(decode_buckets=(4, 4))
        with pytest.raises(ValueError, match=r"decode_buckets entry must be a positive integer, got 0"):
            NeuronConfig(decode_buckets=(0, 4))

    def test_select_bucket_exact(self):
        assert select_bucket(4, (1, 4, 8)) == 4


class TestVisionNeuronConfig:
    # The vision seed's mode table, world_size=16.
    @pytest.mark.parametrize(
        "kwargs,expected",
        [({}, (1, 16)), ({"tp_size": 4}, (4, 4)), ({"tp_size": 16}, (16, 1)), ({"tp_size": 4, "dp_size": 4}, (4, 4))],
    )
    def test_mode_table_world16(self, kwargs, expected):
        cfg = VisionNeuronConfig(**kwargs)
        assert cfg.resolve_tp_dp(16) == expected
        # Written back so downstream callers (model runner, warmup) see the resolved values.
        assert (cfg.tp_size, cfg.dp_size) == expected
        assert cfg.resolve_tp_dp(16) == expected  # idempotent: worker init and runner init both call it

    def test_both_set_mismatch(self):
        with pytest.raises(ValueError, match=r"tp_size \* dp_size = 4 \* 2 = 8 != world_size=16"):
            VisionNeuronConfig(tp_size=4, dp_size=2).resolve_tp_dp(16)

    def test_seed_world8_tp1_dp4_is_rejected_by_the_constraint(self):
        # The seed's rank-list example (world 8, tp 1, dp 4) does not satisfy tp*dp == world; resolution rejects it.
        with pytest.raises(ValueError, match=r"1 \* 4 = 4 != world_size=8"):
            VisionNeuronConfig(tp_size=1, dp_size=4).resolve_tp_dp(8)

    def test_only_dp_set_uses_default_tp(self):
        with pytest.raises(ValueError, match=r"set tp_size explicitly"):
            VisionNeuronConfig(dp_size=4).resolve_tp_dp(16)
        assert VisionNeuronConfig(dp_size=16).resolve_tp_dp(16) == (1, 16)

    def test_tp_must_divide_world(self):
        with pytest.raises(ValueError, match=r"tp_size=3 must divide world_size=16"):
            VisionNeuronConfig(tp_size=3).resolve_tp_dp(16)

    @pytest.mark.parametrize("bad", [0, -1, 2.0])
    def test_positive(self, bad):
        with pytest.raises(ValueError, match=r"tp_size must be a positive integer"):
            VisionNeuronConfig(tp_size=bad)

    def test_block_padding(self):
        cfg = VisionNeuronConfig(tp_size=4)
        with pytest.raises(ValueError, match=r"resolve_tp_dp"):
            cfg.padded_num_blocks(5)
        cfg.resolve_tp_dp(16)
        assert [cfg.padded_num_blocks(n) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
        x = torch.arange(10.0).reshape(5, 2)
        padded = cfg.pad_blocks(x)
        assert padded.shape == (8, 2)
        assert torch.equal(padded[:5], x) and not padded[5:].any()
        assert pad_blocks(x, 5) is x

    def test_pad_num_blocks_errors(self):
        with pytest.raises(ValueError, match=r"num_blocks must be a non-negative integer, got -1"):
            pad_num_blocks(-1, 4)
        with pytest.raises(ValueError, match=r"dp_size must be a positive integer, got 0"):
            pad_num_blocks(3, 0)
