"""Rank-list goldens for every seed example, the trn2 mesh, and partition properties up to world 128."""

import pytest

from modules.parallel import rank_lists as rl


class TestSeedGoldens:
    def test_tp8_single_group(self):
        # tensor-parallelism seed: TP=8 → [0..7]
        assert rl.build_tp_group_ranks(8, 8) == [[0, 1, 2, 3, 4, 5, 6, 7]]

    def test_tp8_dp4_table(self):
        # component-DP seed: TP=8, DP=4, all dp_sizes=4
        assert rl.build_tp_group_ranks(32, 8) == [list(range(d * 8, d * 8 + 8)) for d in range(4)]
        assert rl.build_component_tp_group_ranks(32, 8, 4) == [list(range(32))]
        cols = rl.build_dp_column_group_ranks(32, 8, 4)
        assert cols[0] == [0, 8, 16, 24] and cols[1] == [1, 9, 17, 25] and cols[-1] == [7, 15, 23, 31]
        assert cols == [[t, t + 8, t + 16, t + 24] for t in range(8)]
        assert rl.build_dp_group_ranks(32, 8) == cols

    def test_dp_size_one_groups(self):
        # "Groups always created": dp=1 → component TP group is the TP group, column is a size-1 self-group.
        assert rl.build_component_tp_group_ranks(32, 8, 1) == rl.build_tp_group_ranks(32, 8)
        assert rl.build_dp_column_group_ranks(32, 8, 1) == [[r] for r in range(32)]

    def test_partial_component_dp_world64(self):
        # vllm-neuron docstring example: world 64, tp 8, component dp 4 → two supergroups.
        assert rl.build_component_tp_group_ranks(64, 8, 4) == [list(range(32)), list(range(32, 64))]
        cols = rl.build_dp_column_group_ranks(64, 8, 4)
        assert cols[:2] == [[0, 8, 16, 24], [1, 9, 17, 25]]
        assert cols[8:10] == [[32, 40, 48, 56], [33, 41, 49, 57]]

    def test_component_tp_dp_major_order(self):
        # tp 2, dp 4, component dp 2: DP-major then TP-minor inside each supergroup.
        assert rl.build_component_tp_group_ranks(8, 2, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert rl.build_dp_column_group_ranks(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]

    def test_vision_world16_tp4(self):
        assert rl.build_vision_tp_group_ranks(16, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                         [12, 13, 14, 15]]
        assert rl.build_vision_dp_group_ranks(16, 4, 4) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                                            [3, 7, 11, 15]]

    def test_vision_world8_tp1_dp4(self):
        assert rl.build_vision_tp_group_ranks(8, 1) == [[r] for r in range(8)]
        assert rl._build_dp_column_group_ranks(8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]

    @pytest.mark.parametrize("tp,expected_tp_groups,expected_dp_cols", [
        (1, [[r] for r in range(16)], [list(range(16))]),
        (4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
         [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]),
        (16, [list(range(16))], [[r] for r in range(16)]),
    ])
    def test_vision_mode_table_world16(self, tp, expected_tp_groups, expected_dp_cols):
        dp = 16 // tp
        assert rl.build_vision_tp_group_ranks(16, tp) == expected_tp_groups
        assert rl.build_vision_dp_group_ranks(16, tp, dp) == expected_dp_cols

    def test_ep_groups(self):
        rows, cols = rl.build_ep_group_ranks(8, 2)
        assert rows == [[0, 1, 2, 3], [4, 5, 6, 7]] and cols == [[0, 4], [1, 5], [2, 6], [3, 7]]


class TestTrn2Mesh:
    MESH = [
        [0, 1, 2, 3, 12, 13, 14, 15],
        [4, 5, 6, 7, 8, 9, 10, 11],
        [16, 17, 18, 19, 28, 29, 30, 31],
        [20, 21, 22, 23, 24, 25, 26, 27],
        [32, 33, 34, 35, 44, 45, 46, 47],
        [36, 37, 38, 39, 40, 41, 42, 43],
        [48, 49, 50, 51, 60, 61, 62, 63],
        [52, 53, 54, 55, 56, 57, 58, 59],
    ]

    def test_table_is_a_partition(self):
        assert [list(r) for r in rl.TRN2_MESH] == self.MESH
        rl.validate_partition([list(r) for r in rl.TRN2_MESH], 64)

    def test_rows_and_cols(self):
        rows, cols = rl.build_2d_mesh(list(range(64)), 8, 8, trn2=True)
        assert rows == self.MESH
        assert cols[0] == [0, 4, 16, 20, 32, 36, 48, 52]
        assert cols[4] == [12, 8, 28, 24, 44, 40, 60, 56]
        rl.validate_partition(cols, 64)

    def test_lookup_tables_match_structure(self):
        # Arithmetic form of the table (quad q of each 16-block: 0→row0 cols0-3, 1→row1 cols0-3,
        # 2→row1 cols4-7, 3→row0 cols4-7).
        for r in range(64):
            quad = (r % 16) // 4
            assert rl.rank_to_col(r, 8, 64, trn2=True) == r % 4 + 4 * (quad // 2)
            assert rl.rank_to_row(r, 8, 64, trn2=True) == 2 * (r // 16) + ((quad + 1) // 2) % 2
            assert self.MESH[rl.rank_to_row(r, 8, 64, trn2=True)][rl.rank_to_col(r, 8, 64, trn2=True)] == r

    def test_only_at_64_by_8(self):
        rows, _ = rl.build_2d_mesh(list(range(64)), 8, 8, trn2=False)
        assert rows[0] == list(range(8))
        rows, _ = rl.build_2d_mesh(list(range(64)), 16, 4, trn2=True)
        assert rows[0] == list(range(16))
        assert rl.rank_to_row(12, 8, 64) == 1 and rl.rank_to_col(12, 8, 64) == 4

    def test_ep8_on_trn2(self):
        rows, cols = rl.build_ep_group_ranks(64, 8, trn2=True)
        assert rows == self.MESH


WORLD_CASES = [(w, tp) for w in (1, 2, 4, 8, 16, 32, 64, 128) for tp in (1, 2, 4, 8, 16, 64) if w % tp == 0]


@pytest.mark.parametrize("world,tp", WORLD_CASES)
def test_partitions_up_to_128(world, tp):
    rl.validate_partition(rl.build_tp_group_ranks(world, tp), world)
    dp = world // tp
    for cdp in (d for d in range(1, dp + 1) if dp % d == 0):
        comp = rl.build_component_tp_group_ranks(world, tp, cdp)
        cols = rl.build_dp_column_group_ranks(world, tp, cdp)
        rl.validate_partition(comp, world)
        rl.validate_partition(cols, world)
        assert all(len(g) == tp * cdp for g in comp) and all(len(c) == cdp for c in cols)
        for col in cols:
            # A column lies inside one supergroup and holds one TP position.
            sg = rl.group_containing(comp, col[0])
            assert set(col) <= set(sg)
            assert len({r % tp for r in col}) == 1
            # Column order = DP order, so rank_in_column == position of the DP replica inside the supergroup.
            assert col == sorted(col)
        for sg in comp:
            # Every supergroup is TP groups stacked DP-major.
            assert sg == [r for d in range(cdp) for r in rl.build_tp_group_ranks(world, tp)[sg[0] // tp + d]]


class TestErrors:
    def test_tp_must_divide_world(self):
        with pytest.raises(ValueError, match=r"tp_size=3 must divide world_size=8"):
            rl.build_tp_group_ranks(8, 3)

    def test_component_must_divide_dp(self):
        with pytest.raises(ValueError, match=r"dp_component_size=3 must divide dp_size=4"):
            rl.build_component_tp_group_ranks(32, 8, 3)
        with pytest.raises(ValueError, match=r"dp_component_size=8 must divide dp_size=4"):
            rl.build_dp_column_group_ranks(32, 8, 8)

    def test_positive(self):
        with pytest.raises(ValueError, match=r"tp_size must be a positive integer, got 0"):
            rl.build_tp_group_ranks(8, 0)

    def test_group_containing(self):
        with pytest.raises(ValueError, match=r"rank 9 is in 0 groups"):
            rl.group_containing([[0, 1]], 9)

    def test_validate_partition(self):
        with pytest.raises(ValueError, match=r"do not partition"):
            rl.validate_partition([[0, 1], [1, 2]], 3)
        with pytest.raises(ValueError, match=r"mixed sizes"):
            rl.validate_partition([[0, 1], [2]], 3)

    def test_mesh_size(self):
        with pytest.raises(ValueError, match=r"len\(ranks\)=5"):
            rl.build_2d_mesh(list(range(5)), 2, 2)
